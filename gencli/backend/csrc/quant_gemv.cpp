// Weight-only quantized matrix-vector products on a CPU, for decoding (a few activation rows).
//
// out[m, n] = sum_k x[m, k] * w[n, k] with w stored as gencli.backend.quantize stores it:
//   int8: w = q * scale[n]                      (q int8 (N, K), scale bf16 (N,))
//   int4: w = (q - 8) * scale[n, g] + zero[n, g] (q packed two per byte (N, K/2), the even column in
//         the low nibble; scale, zero bf16 (N, K/G))
// The codes are converted to fp32 in registers and multiplied with the fp32 activations (FMA); the
// scales are applied per output row (int8) or per group (int4: s * sum q x + (z - 8 s) * sum x, the
// group sums of x computed once per call). Nothing is repacked: the int4 kernel reads the stored
// bytes and multiplies the low nibbles by the even columns of x, the high ones by the odd columns
// (x is de-interleaved once per call). AVX-512 or AVX2+FMA, chosen at run time from the CPU's flags;
// rows of the weight are spread over torch's intra-op threads (at::parallel_for).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GENCLI_X86 1
#endif

namespace {

constexpr int kMaxRows = 4;     // activation rows handled together (each weight row is read once per tile)
constexpr int kRowsAtOnce = 4;  // int8: weight rows multiplied together (each load of x serves them all)

// bytes ahead in each stream of weights that are prefetched (a one-thread matrix-vector product over
// weights in memory: 0.6-0.9x the time without, measured at 256-4096 bytes on layers of 3072x768, 768x3072)
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 3);
#endif
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

// The kernel bodies, written once against a small vector interface (namespace Isa: type V, lanes W,
// zero, set1, load, fma, mul, add, hsum, i8 (W int8 -> fp32), nibbles (W bytes -> low/high nibble
// fp32), bf16 (W bf16 -> fp32), store), instantiated below for AVX-512 and AVX2.
#define GENCLI_KERNELS                                                                                     \
  /* int8: a tile of MT activation rows against output rows [n0, n1), R output rows at a time (R */      \
  /* streams of weights in flight; each load of x serves R rows) */                                        \
  template <int MT, int R>                                                                                 \
  int64_t int8_rows(const float* x, int64_t K, const int8_t* w, const uint16_t* scale, float* out,         \
                    int64_t N, int64_t n, int64_t n1) {                                                    \
    for (; n + R <= n1; n += R) {                                                                          \
      const int8_t* wr = w + n * K;                                                                        \
      V acc[MT][R];                                                                                        \
      for (int m = 0; m < MT; ++m)                                                                         \
        for (int r = 0; r < R; ++r) acc[m][r] = zero();                                                    \
      int64_t k = 0;                                                                                       \
      for (; k + W <= K; k += W) {                                                                         \
        V wv[R];                                                                                           \
        if ((k & 63) == 0)                                                                                 \
          for (int r = 0; r < R; ++r) prefetch(wr + r * K + k + kPrefetchBytes);                              \
        for (int r = 0; r < R; ++r) wv[r] = i8(wr + r * K + k);                                            \
        for (int m = 0; m < MT; ++m) {                                                                     \
          V xv = load(x + m * K + k);                                                                      \
          for (int r = 0; r < R; ++r) acc[m][r] = fma(wv[r], xv, acc[m][r]);                               \
        }                                                                                                  \
      }                                                                                                    \
      for (int r = 0; r < R; ++r) {                                                                        \
        const float s = bf16_to_float(scale[n + r]);                                                       \
        for (int m = 0; m < MT; ++m) {                                                                     \
          float sum = hsum(acc[m][r]);                                                                     \
          for (int64_t j = k; j < K; ++j) sum += static_cast<float>(wr[r * K + j]) * x[m * K + j];         \
          out[m * N + n + r] = sum * s;                                                                    \
        }                                                                                                  \
      }                                                                                                    \
    }                                                                                                      \
    return n;                                                                                              \
  }                                                                                                        \
  template <int MT>                                                                                        \
  void int8_tile(const float* x, int64_t K, const int8_t* w, const uint16_t* scale, float* out, int64_t N, \
                 int64_t n0, int64_t n1) {                                                                 \
    int64_t n = int8_rows<MT, kRowsAtOnce>(x, K, w, scale, out, N, n0, n1);                                \
    int8_rows<MT, 1>(x, K, w, scale, out, N, n, n1);                                                       \
  }                                                                                                        \
  /* int4: xd is x de-interleaved per block of 2W columns (W even columns, then W odd ones), xs the */     \
  /* group sums of x (MT, K/G); groups of G = B * 2W columns */                                             \
  template <int MT, int B>                                                                                 \
  void int4_tile(const float* xd, const float* xs, int64_t K, const uint8_t* w, const uint16_t* scale,     \
                 const uint16_t* zero_, float* out, int64_t N, int64_t n0, int64_t n1) {                   \
    constexpr int64_t G = B * 2 * W;                                                                       \
    const int64_t groups = K / G;                                                                          \
    alignas(64) float sg[W];                                                                               \
    for (int64_t n = n0; n < n1; ++n) {                                                                    \
      const uint8_t* wr = w + n * (K / 2);                                                                 \
      const uint16_t* sr = scale + n * groups;                                                             \
      const uint16_t* zr = zero_ + n * groups;                                                             \
      V acc[MT][2], zacc[MT];                                                                              \
      for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = zacc[m] = zero();                               \
      float ztail[MT] = {};                                                                                \
      for (int64_t g0 = 0; g0 < groups; g0 += W) {                                                         \
        const int64_t gn = groups - g0 < W ? groups - g0 : W;                                              \
        if (gn == W) { /* the zero-point term of W groups at once: sum (z - 8 s) * xs */                   \
          V s = bf16(sr + g0), z = bf16(zr + g0);                                                          \
          V z8 = fma(s, set1(-8.0f), z);                                                                   \
          store(sg, s);                                                                                    \
          for (int m = 0; m < MT; ++m) zacc[m] = fma(z8, load(xs + m * groups + g0), zacc[m]);             \
        } else {                                                                                           \
          for (int64_t j = 0; j < gn; ++j) {                                                               \
            float s = bf16_to_float(sr[g0 + j]), z8 = bf16_to_float(zr[g0 + j]) - 8.0f * s;                \
            sg[j] = s;                                                                                     \
            for (int m = 0; m < MT; ++m) ztail[m] += z8 * xs[m * groups + g0 + j];                         \
          }                                                                                                \
        }                                                                                                  \
        /* one group: acc[m][a] += s_g * sum q x (a alternates: two independent chains) */                 \
        auto group = [&](int64_t j, int a) {                                                               \
          const uint8_t* q = wr + (g0 + j) * (G / 2);                                                      \
          const float* xg = xd + (g0 + j) * G;                                                             \
          if (G >= 128 || ((g0 + j) & (64 / (G / 2) - 1)) == 0) prefetch(q + kPrefetchBytes);                 \
          V part[MT];                                                                                      \
          for (int m = 0; m < MT; ++m) part[m] = zero();                                                   \
          for (int b = 0; b < B; ++b) {                                                                    \
            V lo, hi;                                                                                      \
            nibbles(q + b * W, lo, hi);                                                                    \
            for (int m = 0; m < MT; ++m) {                                                                 \
              part[m] = fma(lo, load(xg + m * K + b * 2 * W), part[m]);                                    \
              part[m] = fma(hi, load(xg + m * K + b * 2 * W + W), part[m]);                                \
            }                                                                                              \
          }                                                                                                \
          V sv = set1(sg[j]);                                                                              \
          for (int m = 0; m < MT; ++m) acc[m][a] = fma(part[m], sv, acc[m][a]);                            \
        };                                                                                                 \
        int64_t j = 0;                                                                                     \
        for (; j + 2 <= gn; j += 2) {                                                                      \
          group(j, 0);                                                                                     \
          group(j + 1, 1);                                                                                 \
        }                                                                                                  \
        if (j < gn) group(j, 0);                                                                           \
      }                                                                                                    \
      for (int m = 0; m < MT; ++m)                                                                         \
        out[m * N + n] = hsum(add(acc[m][0], acc[m][1])) + hsum(zacc[m]) + ztail[m];                       \
    }                                                                                                      \
  }                                                                                                        \
  /* int4 with the group size chosen at run time: B = G / 2W blocks per group */                            \
  template <int MT>                                                                                        \
  void int4_tile_g(int64_t G, const float* xd, const float* xs, int64_t K, const uint8_t* w,               \
                   const uint16_t* scale, const uint16_t* zero_, float* out, int64_t N, int64_t n0,        \
                   int64_t n1) {                                                                           \
    switch (G / (2 * W)) {                                                                                 \
      case 1: int4_tile<MT, 1>(xd, xs, K, w, scale, zero_, out, N, n0, n1); break;                         \
      case 2: int4_tile<MT, 2>(xd, xs, K, w, scale, zero_, out, N, n0, n1); break;                         \
      case 4: int4_tile<MT, 4>(xd, xs, K, w, scale, zero_, out, N, n0, n1); break;                         \
      case 8: int4_tile<MT, 8>(xd, xs, K, w, scale, zero_, out, N, n0, n1); break;                         \
      default: int4_tile<MT, 16>(xd, xs, K, w, scale, zero_, out, N, n0, n1); break;                       \
    }                                                                                                      \
  }

#ifdef GENCLI_X86
// the float operations both instruction sets spell alike (P: the intrinsics' prefix)
#define GENCLI_FLOAT_OPS(P)                                          \
  inline V zero() { return P##_setzero_ps(); }                       \
  inline V set1(float v) { return P##_set1_ps(v); }                  \
  inline V load(const float* p) { return P##_loadu_ps(p); }          \
  inline void store(float* p, V v) { P##_storeu_ps(p, v); }          \
  inline V fma(V a, V b, V c) { return P##_fmadd_ps(a, b, c); }      \
  inline V add(V a, V b) { return P##_add_ps(a, b); }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,fma")
namespace avx512 {
using V = __m512;
constexpr int W = 16;
GENCLI_FLOAT_OPS(_mm512)
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
inline V i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void nibbles(const uint8_t* p, V& lo, V& hi) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline V bf16(const uint16_t* p) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
GENCLI_KERNELS
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
using V = __m256;
constexpr int W = 8;
GENCLI_FLOAT_OPS(_mm256)
inline float hsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void nibbles(const uint8_t* p, V& lo, V& hi) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline V bf16(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
GENCLI_KERNELS
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace {

enum class Isa { none, avx2, avx512 };

bool supported(Isa want) {
#ifdef GENCLI_X86
  __builtin_cpu_init();
  if (want == Isa::avx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  if (want == Isa::avx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return false;
}

Isa g_isa = supported(Isa::avx512) ? Isa::avx512 : supported(Isa::avx2) ? Isa::avx2 : Isa::none;

Isa isa() { return g_isa; }

int lanes() { return isa() == Isa::avx512 ? 16 : 8; }

// rows per task: enough work (~64k weights) that a thread's share outweighs the scheduling
int64_t grain(int64_t K) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K, 1)); }

void check_common(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(isa() != Isa::none, "quant_gemv: this CPU has neither AVX-512 nor AVX2");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "quant_gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "quant_gemv: x must be contiguous float32 (M, K)");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "quant_gemv: the codes must be contiguous (N, K or K/2)");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.is_contiguous(), "quant_gemv: scales must be contiguous bfloat16");
}

// Runs tile<MT>(row pointer offset m0, ...) over the activation rows in tiles of at most kMaxRows.
template <typename F>
void by_row_tiles(int64_t M, F&& tile) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, M - m0)) {
      case 1: tile(std::integral_constant<int, 1>{}, m0); break;
      case 2: tile(std::integral_constant<int, 2>{}, m0); break;
      case 3: tile(std::integral_constant<int, 3>{}, m0); break;
      default: tile(std::integral_constant<int, 4>{}, m0); break;
    }
  }
}

}  // namespace

// x (M, K) float32 @ (q int8 (N, K) * scale bf16 (N,)).T -> (M, N) float32
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  check_common(x, w, scale);
  TORCH_CHECK(w.scalar_type() == at::kChar, "quant_gemv: int8 codes expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && scale.numel() == N, "quant_gemv: shapes do not match");
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(K), [&](int64_t n0, int64_t n1) {
    by_row_tiles(M, [&](auto mt, int64_t m0) {
      constexpr int MT = decltype(mt)::value;
#ifdef GENCLI_X86
      if (isa() == Isa::avx512)
        avx512::int8_tile<MT>(xp + m0 * K, K, wp, sp, op + m0 * N, N, n0, n1);
      else
        avx2::int8_tile<MT>(xp + m0 * K, K, wp, sp, op + m0 * N, N, n0, n1);
#endif
    });
  });
  return out;
}

// x (M, K) float32 @ ((q - 8) * scale + zero).T with q packed (N, K/2) uint8, scale/zero bf16 (N, K/G)
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& zero, int64_t G) {
  check_common(x, w, scale);
  TORCH_CHECK(w.scalar_type() == at::kByte, "quant_gemv: packed uint8 int4 codes expected");
  TORCH_CHECK(zero.scalar_type() == at::kBFloat16 && zero.is_contiguous(), "quant_gemv: zero points must be contiguous bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), W = lanes();
  TORCH_CHECK(G > 0 && G % (2 * W) == 0 && G <= 32 * W && (G & (G - 1)) == 0 && K % G == 0, "quant_gemv: the group size must be a multiple of ", 2 * W, " dividing K");
  TORCH_CHECK(w.size(1) * 2 == K && scale.size(0) == N && scale.numel() == N * (K / G) && zero.sizes() == scale.sizes(),
              "quant_gemv: shapes do not match");
  const int64_t groups = K / G;
  // x de-interleaved per block of 2W columns (the even columns, then the odd ones) and its group sums
  at::Tensor xd = at::empty({M, K}, x.options()), xs = at::empty({M, groups}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xdp = xd.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    float* dr = xdp + m * K;
    for (int64_t c = 0; c < K; c += 2 * W)
      for (int64_t j = 0; j < W; ++j) {
        dr[c + j] = xr[c + 2 * j];
        dr[c + W + j] = xr[c + 2 * j + 1];
      }
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < G; ++j) s += xr[g * G + j];
      xsp[m * groups + g] = s;
    }
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zero.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(K), [&](int64_t n0, int64_t n1) {
    by_row_tiles(M, [&](auto mt, int64_t m0) {
      constexpr int MT = decltype(mt)::value;
#ifdef GENCLI_X86
      if (isa() == Isa::avx512)
        avx512::int4_tile_g<MT>(G, xdp + m0 * K, xsp + m0 * groups, K, wp, sp, zp, op + m0 * N, N, n0, n1);
      else
        avx2::int4_tile_g<MT>(G, xdp + m0 * K, xsp + m0 * groups, K, wp, sp, zp, op + m0 * N, N, n0, n1);
#endif
    });
  });
  return out;
}

std::string isa_name() {
  switch (isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "";
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv", &int8_gemv, "x (M, K) f32 @ (q int8 (N, K) * scale bf16 (N,)).T");
  m.def("int4_gemv", &int4_gemv, "x (M, K) f32 @ ((q - 8) * scale + zero).T, q packed (N, K/2), groups of G");
  m.def(
      "use_isa",
      [](const std::string& name) {
        const Isa want = name == "avx512" ? Isa::avx512 : name == "avx2" ? Isa::avx2 : Isa::none;
        if (!supported(want)) return false;
        g_isa = want;
        return true;
      },
      "use 'avx512' or 'avx2' from now on (False, and no change, when the CPU lacks it)");
  m.def("isa", &isa_name, "the vector instruction set the kernels use ('' when none)");
}
