// Attention of one query position per sequence over a KV cache, on a CPU (batch-1 decoding).
//
// torch's CPU flash-attention kernel takes about 30 us for one query over 64 cached positions of 12
// heads (GPT-2's shape, one or two threads), most of it fixed cost (blocking, buffers); the work itself
// is a few microseconds. Decoding calls it once per layer and token. This kernel does the same
// softmax(q k^T * scale) v for each (sequence, head) in one pass over the cached keys and values:
// fp32 throughout, grouped-query attention (query head h reads key/value head h / (H / Hkv)), an
// optional boolean key mask (True = may attend; a row with no allowed key attends every key, as
// gencli.backend.attention.build_mask makes it), the heads spread over torch's threads. The vector
// version is attention.inc, compiled for AVX-512 and AVX2; head_scalar is the portable one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <immintrin.h>

#include "cpu_features.h"
#include "kernels.h"
#include "ops.h"

namespace gencli {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One (sequence, head): s (L) is scratch; o (D) receives softmax(q k^T * sc) v. m: may-attend flags or
// null. The portable version; the vector ones below do the same with D a multiple of their width.
void head_scalar(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, const bool* m, int64_t L, int64_t D, float sc,
                 float* s, float* o) {
  float best = kNegInf;
  for (int64_t j = 0; j < L; ++j) {
    float d = 0.f;
    for (int64_t i = 0; i < D; ++i) d += q[i] * k[j * ks + i];
    s[j] = (m && !m[j]) ? kNegInf : d * sc;
    best = std::max(best, s[j]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < L; ++j) total += (s[j] = std::exp(s[j] - best));
  std::fill(o, o + D, 0.f);
  for (int64_t j = 0; j < L; ++j)
    if (s[j] != 0.f)
      for (int64_t i = 0; i < D; ++i) o[i] += s[j] * v[j * vs + i];
  for (int64_t i = 0; i < D; ++i) o[i] /= total;
}

// the code path in use: the best the CPU has unless the tests chose another (Isa::none: head_scalar)
Isa& attention_isa() {
  static Isa isa = best_isa();
  return isa;
}

}  // namespace

GENCLI_TARGET_AVX512
namespace attn_avx512 {
#include "simd_avx512.inc"
#include "attention.inc"
}  // namespace attn_avx512
GENCLI_TARGET_END

GENCLI_TARGET_AVX2
namespace attn_avx2 {
#include "simd_avx2.inc"
#include "attention.inc"
}  // namespace attn_avx2
GENCLI_TARGET_END

const bool* key_mask_flags(const OptionalTensor& key_mask, int64_t B, int64_t L, at::Tensor& keep, const char* who) {
  if (!key_mask.has_value() || !key_mask->defined()) return nullptr;
  keep = key_mask->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.dim() == 2 && keep.size(0) == B && keep.size(1) == L, who,
              ": key_mask must be bool (B, ", L, " keys)");
  return keep.data_ptr<bool>();
}

void attend_heads(const KVView& q, const KVView& k, const KVView& v, const bool* mp, int64_t B, int64_t H, int64_t Hkv, int64_t L,
                  int64_t D, float sc, float* op, int64_t begin, int64_t end) {
  const int64_t rep = H / Hkv;
  const Isa use = attention_isa();
  thread_local AlignedVector<float> scores;
  float* s = scratch(scores, L);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / H, h = task % H, g = h / rep;
    const float* qh = q.data + b * q.s_b + h * q.s_h;
    const float* kh = k.data + b * k.s_b + g * k.s_h;
    const float* vh = v.data + b * v.s_b + g * v.s_h;
    const bool* mb = mp ? mp + b * L : nullptr;
    // a row that may attend no key attends them all (as gencli's masks do: finite, and never used)
    if (mb && std::none_of(mb, mb + L, [](bool x) { return x; })) mb = nullptr;
    float* oh = op + (b * H + h) * D;
    if (use == Isa::avx512 && D % 16 == 0) {
      attn_avx512::head(qh, kh, k.s_l, vh, v.s_l, mb, L, D, sc, s, oh);
      continue;
    }
    if (use != Isa::none && D % 8 == 0) {
      attn_avx2::head(qh, kh, k.s_l, vh, v.s_l, mb, L, D, sc, s, oh);
      continue;
    }
    head_scalar(qh, kh, k.s_l, vh, v.s_l, mb, L, D, sc, s, oh);
  }
}

void attend_one_query(const KVView& q, const KVView& k, const KVView& v, const bool* mp, int64_t B, int64_t H, int64_t Hkv, int64_t L,
                      int64_t D, float sc, float* op) {
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) { attend_heads(q, k, v, mp, B, H, Hkv, L, D, sc, op, begin, end); });
}

// q (B, H, 1, D), k and v (B, Hkv, L, D), float32, the last dimension contiguous (any other strides:
// cache views); key_mask (B, L) bool or undefined. Returns (B, H, 1, D) contiguous.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, const OptionalTensor& key_mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1, "decode_attention: q (B, H, 1, D), k, v (B, Hkv, L, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "decode_attention: float32 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention: CPU tensors only");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == L && k.size(3) == D && v.size(3) == D,
              "decode_attention: shapes do not match");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "decode_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: the head dimension must be contiguous");
  at::Tensor mask;
  const bool* mp = key_mask_flags(key_mask, B, L, mask, "decode_attention");
  at::Tensor out = at::empty({B, H, 1, D}, q.options());
  attend_one_query({q.data_ptr<float>(), q.stride(0), q.stride(1), 0}, {k.data_ptr<float>(), k.stride(0), k.stride(1), k.stride(2)},
                   {v.data_ptr<float>(), v.stride(0), v.stride(1), v.stride(2)}, mp, B, H, Hkv, L, D, static_cast<float>(scale),
                   out.data_ptr<float>());
  return out;
}

bool use_attention_isa(const std::string& name) {
  const Isa want = name == "scalar" ? Isa::none : isa_named(name);
  if ((want == Isa::none && name != "scalar") || !isa_supported(want)) return false;
  attention_isa() = want;
  return true;
}

}  // namespace gencli
