// Attention of one query position per sequence over a KV cache, on a CPU (batch-1 decoding).
//
// torch's CPU flash-attention kernel takes about 30 us for one query over 64 cached positions of 12
// heads (GPT-2's shape, one or two threads), most of it fixed cost (blocking, buffers); the work itself
// is a few microseconds. Decoding calls it once per layer and token. This kernel does the same
// softmax(q k^T * scale) v for each (sequence, head) in one pass over the cached keys and values:
// fp32 throughout, grouped-query attention (query head h reads key/value head h / (H / Hkv)), an
// optional boolean key mask (True = may attend; a row with no allowed key attends every key, as
// gencli.backend.attention.build_mask makes it), the heads
// spread over torch's threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GENCLI_X86 1
#endif
#include "simd_ops.h"
#include "kernels.h"

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

}  // namespace

// The vector version, written once against a small interface (V, W, zero, set1, load, store, fma, add,
// sub, mul, hsum, vexp: e^x for x <= 0, exactly 0 below -87) and compiled for AVX-512 and AVX2:
// scores four positions at a time, the exponentials W at a time, the output's D values kept in
// registers (up to 8 vectors at a time) while the values stream past.
#define GENCLI_ATTENTION_BODY                                                                               \
  template <int NV>                                                                                         \
  void weighted_sum(const float* s, const float* v, int64_t vs, int64_t L, float inv, float* o) {           \
    V acc[NV];                                                                                              \
    for (int i = 0; i < NV; ++i) acc[i] = zero();                                                           \
    for (int64_t j = 0; j < L; ++j) {                                                                       \
      if (s[j] == 0.f) continue;                                                                            \
      const V p = set1(s[j]);                                                                               \
      for (int i = 0; i < NV; ++i) acc[i] = fma(p, load(v + j * vs + i * W), acc[i]);                       \
    }                                                                                                       \
    for (int i = 0; i < NV; ++i) store(o + i * W, mul(acc[i], set1(inv)));                                  \
  }                                                                                                         \
  void head(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, const bool* m, int64_t L, \
            int64_t D, float sc, float* s, float* o) {                                                      \
    int64_t j = 0;                                                                                          \
    for (; j + 4 <= L; j += 4) {                                                                            \
      V a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();                                                 \
      const float* kj = k + j * ks;                                                                         \
      for (int64_t d = 0; d < D; d += W) {                                                                  \
        const V qv = load(q + d);                                                                           \
        a0 = fma(qv, load(kj + d), a0);                                                                     \
        a1 = fma(qv, load(kj + ks + d), a1);                                                                \
        a2 = fma(qv, load(kj + 2 * ks + d), a2);                                                            \
        a3 = fma(qv, load(kj + 3 * ks + d), a3);                                                            \
      }                                                                                                     \
      s[j] = hsum(a0) * sc, s[j + 1] = hsum(a1) * sc, s[j + 2] = hsum(a2) * sc, s[j + 3] = hsum(a3) * sc;   \
    }                                                                                                       \
    for (; j < L; ++j) {                                                                                    \
      V a = zero();                                                                                         \
      for (int64_t d = 0; d < D; d += W) a = fma(load(q + d), load(k + j * ks + d), a);                     \
      s[j] = hsum(a) * sc;                                                                                  \
    }                                                                                                       \
    float best = kNegInf;                                                                                   \
    for (j = 0; j < L; ++j) {                                                                               \
      if (m && !m[j]) s[j] = kNegInf;                                                                       \
      best = std::max(best, s[j]);                                                                          \
    }                                                                                                       \
    const V bv = set1(best);                                                                                \
    V tv = zero();                                                                                          \
    for (j = 0; j + W <= L; j += W) {                                                                       \
      const V e = vexp(sub(load(s + j), bv));                                                               \
      store(s + j, e);                                                                                      \
      tv = add(tv, e);                                                                                      \
    }                                                                                                       \
    float total = hsum(tv);                                                                                 \
    for (; j < L; ++j) total += (s[j] = std::exp(s[j] - best));                                             \
    const float inv = 1.f / total;                                                                          \
    for (int64_t d0 = 0; d0 < D; d0 += 8 * W) {                                                             \
      switch (std::min<int64_t>(8, (D - d0) / W)) {                                                         \
        case 8: weighted_sum<8>(s, v + d0, vs, L, inv, o + d0); break;                                      \
        case 7: weighted_sum<7>(s, v + d0, vs, L, inv, o + d0); break;                                      \
        case 6: weighted_sum<6>(s, v + d0, vs, L, inv, o + d0); break;                                      \
        case 5: weighted_sum<5>(s, v + d0, vs, L, inv, o + d0); break;                                      \
        case 4: weighted_sum<4>(s, v + d0, vs, L, inv, o + d0); break;                                      \
        case 3: weighted_sum<3>(s, v + d0, vs, L, inv, o + d0); break;                                      \
        case 2: weighted_sum<2>(s, v + d0, vs, L, inv, o + d0); break;                                      \
        default: weighted_sum<1>(s, v + d0, vs, L, inv, o + d0); break;                                     \
      }                                                                                                     \
    }                                                                                                       \
  }

#ifdef GENCLI_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")
namespace attn_avx512 {
using V = __m512;
constexpr int W = 16;
GENCLI_FLOAT_OPS(_mm512)
inline float hsum(V x) { return _mm512_reduce_add_ps(x); }
GENCLI_AVX512_EXP
GENCLI_ATTENTION_BODY
}  // namespace attn_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace attn_avx2 {
using V = __m256;
constexpr int W = 8;
GENCLI_FLOAT_OPS(_mm256)
GENCLI_AVX2_HSUM
GENCLI_AVX2_EXP
GENCLI_ATTENTION_BODY
}  // namespace attn_avx2
#pragma GCC pop_options
#endif

namespace {

enum class AttnIsa { scalar, avx2, avx512 };

AttnIsa best_attn_isa() {
#ifdef GENCLI_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return AttnIsa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AttnIsa::avx2;
#endif
  return AttnIsa::scalar;
}

AttnIsa g_attn_isa = best_attn_isa();

}  // namespace

namespace gencli {

const bool* key_mask_flags(const c10::optional<at::Tensor>& key_mask, int64_t B, int64_t L, at::Tensor& keep, const char* who) {
  if (!key_mask.has_value() || !key_mask->defined()) return nullptr;
  keep = key_mask->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.dim() == 2 && keep.size(0) == B && keep.size(1) == L, who,
              ": key_mask must be bool (B, ", L, " keys)");
  return keep.data_ptr<bool>();
}

void attend_one_query(const KVView& q, const KVView& k, const KVView& v, const bool* mp, int64_t B, int64_t H, int64_t Hkv, int64_t L,
                      int64_t D, float sc, float* op) {
  const int64_t rep = H / Hkv;
  const AttnIsa use = g_attn_isa;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    if (static_cast<int64_t>(scores.size()) < L) scores.resize(L);
    float* s = scores.data();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H, g = h / rep;
      const float* qh = q.data + b * q.s_b + h * q.s_h;
      const float* kh = k.data + b * k.s_b + g * k.s_h;
      const float* vh = v.data + b * v.s_b + g * v.s_h;
      const bool* mb = mp ? mp + b * L : nullptr;
      // a row that may attend no key attends them all (as gencli's masks do: finite, and never used)
      if (mb && std::none_of(mb, mb + L, [](bool x) { return x; })) mb = nullptr;
      float* oh = op + (b * H + h) * D;
#ifdef GENCLI_X86
      if (use == AttnIsa::avx512 && D % 16 == 0) {
        attn_avx512::head(qh, kh, k.s_l, vh, v.s_l, mb, L, D, sc, s, oh);
        continue;
      }
      if (use != AttnIsa::scalar && D % 8 == 0) {
        attn_avx2::head(qh, kh, k.s_l, vh, v.s_l, mb, L, D, sc, s, oh);
        continue;
      }
#endif
      head_scalar(qh, kh, k.s_l, vh, v.s_l, mb, L, D, sc, s, oh);
    }
  });
}

}  // namespace gencli

// q (B, H, 1, D), k and v (B, Hkv, L, D), float32, the last dimension contiguous (any other strides:
// cache views); key_mask (B, L) bool or undefined. Returns (B, H, 1, D) contiguous.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const c10::optional<at::Tensor>& key_mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1, "decode_attention: q (B, H, 1, D), k, v (B, Hkv, L, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "decode_attention: float32 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention: CPU tensors only");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == L && k.size(3) == D && v.size(3) == D,
              "decode_attention: shapes do not match");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "decode_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: the head dimension must be contiguous");
  at::Tensor mask;
  const bool* mp = gencli::key_mask_flags(key_mask, B, L, mask, "decode_attention");
  at::Tensor out = at::empty({B, H, 1, D}, q.options());
  gencli::attend_one_query({q.data_ptr<float>(), q.stride(0), q.stride(1), 0}, {k.data_ptr<float>(), k.stride(0), k.stride(1), k.stride(2)},
                           {v.data_ptr<float>(), v.stride(0), v.stride(1), v.stride(2)}, mp, B, H, Hkv, L, D, static_cast<float>(scale),
                           out.data_ptr<float>());
  return out;
}

// for the tests: "avx512", "avx2" or "scalar" from now on (false, and no change, beyond what the CPU has)
bool use_attention_isa(const std::string& name) {
  const AttnIsa want = name == "avx512" ? AttnIsa::avx512 : name == "avx2" ? AttnIsa::avx2 : AttnIsa::scalar;
  if (static_cast<int>(want) > static_cast<int>(best_attn_isa())) return false;
  g_attn_isa = want;
  return true;
}
