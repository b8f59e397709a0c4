// 3x3 convolutions (stride 1, padding 1, one group) of channels-last float32 feature maps by Winograd's
// minimal filtering F(2x2, 3x3) (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks",
// 2016): each 2x2 block of outputs comes from a 4x4 window of the input as A^T [(G g G^T) . (B^T d B)] A,
// 16 products per input and output channel where the direct convolution makes 36, so the multiplies of a
// UNet's wide 3x3 layers drop 2.25x (the direct one already runs at the cores' fp32 FMA peak). The
// weight's transform U = G g G^T (16, C, K) is made once, in Python (gencli.backend.winograd); here the
// tiles are cut into chunks that stay in a core's L2 cache and spread over torch's threads, and for each
// chunk: the input transform (winograd.inc), the 16 products V_k (tiles, C) @ U_k (C, K) (one batched
// matrix product, torch's), the output transform with the bias and the residual added on the way out.
// The rounding differs from the direct sum's by a few units of the last place (the transforms add
// and subtract neighbouring inputs and outputs; the weights' transform has halves and quarters, exact in
// binary).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <immintrin.h>

#include "cpu_features.h"
#include "kernels.h"
#include "ops.h"

namespace gencli {

GENCLI_TARGET_AVX512
namespace wino_avx512 {
#include "simd_avx512.inc"
#include "winograd.inc"
}  // namespace wino_avx512
GENCLI_TARGET_END

GENCLI_TARGET_AVX2
namespace wino_avx2 {
#include "simd_avx2.inc"
#include "winograd.inc"
}  // namespace wino_avx2
GENCLI_TARGET_END

namespace wino_scalar {
using V = float;
constexpr int W = 1;
inline V zero() { return 0.f; }
inline V load(const float* p) { return *p; }
inline void store(float* p, V v) { *p = v; }
inline V add(V a, V b) { return a + b; }
#include "winograd.inc"
}  // namespace wino_scalar

namespace {

// tiles per chunk: 128 (the fastest of 32-256 for 64-384 channels at batch 16 on a 2-core AVX-512 Xeon
// with 2 MB of L2 per core; larger chunks make the products more efficient and leave the cache), fewer
// where that would leave a thread without a chunk, but not under 32 (a smaller product costs more to
// call than a second thread saves: 1.4x slower at batch 1, 8x8)
int64_t default_chunk(int64_t T) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(32, std::min<int64_t>(128, (T + threads - 1) / threads));
}

}  // namespace

at::Tensor winograd_conv3x3(const at::Tensor& x, const at::Tensor& u, const OptionalTensor& bias, const OptionalTensor& residual,
                            int64_t chunk, bool reference) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 4 && x.device().is_cpu(), "winograd_conv3x3: x must be float32 (N, C, H, W) on the CPU");
  TORCH_CHECK(x.is_contiguous(at::MemoryFormat::ChannelsLast), "winograd_conv3x3: x must be channels-last");
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), Wd = x.size(3);
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.dim() == 3 && u.size(0) == 16 && u.size(1) == C && u.is_contiguous(),
              "winograd_conv3x3: the transformed weight must be float32 (16, C, K) contiguous");
  const int64_t K = u.size(2);
  at::Tensor b, res;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == K, "winograd_conv3x3: the bias must have K values");
  }
  if (residual.has_value() && residual->defined()) {
    res = residual->to(at::kFloat).contiguous(at::MemoryFormat::ChannelsLast);
    TORCH_CHECK(res.dim() == 4 && res.size(0) == N && res.size(1) == K && res.size(2) == H && res.size(3) == Wd,
                "winograd_conv3x3: the residual must have the output's shape");
  }
  at::Tensor y = at::empty({N, K, H, Wd}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  const int64_t tiles_w = (Wd + 1) / 2, tiles_hw = ((H + 1) / 2) * tiles_w, T = N * tiles_hw;
  if (T == 0 || K == 0) return y.zero_();
  const int64_t tc = std::min(T, chunk > 0 ? chunk : default_chunk(T));
  const int64_t chunks = (T + tc - 1) / tc;
  const float* xp = x.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const Isa isa = reference ? Isa::none : active_isa();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    thread_local AlignedVector<float> buf;
    float* v = scratch(buf, 16 * tc * (C + K));
    float* m = v + 16 * tc * C;
    for (int64_t ch = begin; ch < end; ++ch) {
      const int64_t t0 = ch * tc, t1 = std::min(T, t0 + tc), nt = t1 - t0;
      if (isa == Isa::avx512)
        wino_avx512::transform_input(xp, H, Wd, C, tiles_w, tiles_hw, t0, t1, v);
      else if (isa == Isa::avx2)
        wino_avx2::transform_input(xp, H, Wd, C, tiles_w, tiles_hw, t0, t1, v);
      else
        wino_scalar::transform_input(xp, H, Wd, C, tiles_w, tiles_hw, t0, t1, v);
      at::Tensor vt = at::from_blob(v, {16, nt, C}, x.options());
      at::Tensor mt = at::from_blob(m, {16, nt, K}, x.options());
      at::bmm_out(mt, vt, u);
      if (isa == Isa::avx512)
        wino_avx512::transform_output(m, bp, rp, H, Wd, K, tiles_w, tiles_hw, t0, t1, yp);
      else if (isa == Isa::avx2)
        wino_avx2::transform_output(m, bp, rp, H, Wd, K, tiles_w, tiles_hw, t0, t1, yp);
      else
        wino_scalar::transform_output(m, bp, rp, H, Wd, K, tiles_w, tiles_hw, t0, t1, yp);
    }
  });
  return y;
}

}  // namespace gencli
