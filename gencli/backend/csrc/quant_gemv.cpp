// Weight-only quantized matrix-vector products on a CPU, for decoding (a few activation rows).
//
// out[m, n] = sum_k x[m, k] * w[n, k] with w stored as gencli.backend.quantize stores it:
//   int8: w = q * scale[n]                      (q int8 (N, K), scale bf16 (N,))
//   int4: w = (q - 8) * scale[n, g] + zero[n, g] (q packed two per byte (N, K/2), the even column in
//         the low nibble; scale, zero bf16 (N, K/G))
// Two kinds of kernels, both reading the stored codes in place (nothing is repacked):
// - integer (int8_activations): x is quantized per call to int8 in blocks of 32 columns with one fp32
//   scale each (llama.cpp's Q8_0 activations) and multiplied by the codes with integer dot products
//   (AVX-512 VNNI vpdpbusd, 64 bytes at a time, or AVX2 maddubs + madd), converted to fp32 once per
//   vector of int32 sums and scaled by the block's and the weight's scales; the int4 zero points
//   multiply the exact fp32 group sums of x;
// - float: the codes are converted to fp32 in registers and multiplied with the fp32 activations
//   (FMA), exact to fp32 rounding; the scales are applied per output row (int8) or per group (int4:
//   s * sum q x + (z - 8 s) * sum x).
// The int4 kernels multiply the low nibbles by the even columns of x and the high ones by the odd
// columns (x is de-interleaved once per call). The instruction set is chosen at run time from the
// CPU's flags; rows of the weight are spread over torch's intra-op threads (at::parallel_for, inline
// OpenMP: the extension is built with -fopenmp).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GENCLI_X86 1
#endif
#include "simd_ops.h"
#include "kernels.h"

namespace {

constexpr int kMaxRows = 4;     // activation rows handled together (each weight row is read once per tile)
constexpr int kInt4RowsAtOnce = 2;  // integer int4: weight rows multiplied together (2 measured best of 1, 2, 4)
constexpr int kRowsAtOnce = 4;  // int8: weight rows multiplied together (each load of x serves them all)

// bytes ahead in each stream of weights that are prefetched (a one-thread matrix-vector product over
// weights in memory: 0.6-0.9x the time without, measured at 256-4096 bytes on layers of 3072x768, 768x3072)
constexpr int64_t kPrefetchBytes = 4096;

constexpr int64_t kActBlock = 32;  // int8 activations: columns per scale (llama.cpp's Q8_0 block)

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
  void int4_tile(const float* xd, const float* xs, int64_t gs, int64_t K, const uint8_t* w, const uint16_t* scale, \
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
          for (int m = 0; m < MT; ++m) zacc[m] = fma(z8, load(xs + m * gs + g0), zacc[m]);             \
        } else {                                                                                           \
          for (int64_t j = 0; j < gn; ++j) {                                                               \
            float s = bf16_to_float(sr[g0 + j]), z8 = bf16_to_float(zr[g0 + j]) - 8.0f * s;                \
            sg[j] = s;                                                                                     \
            for (int m = 0; m < MT; ++m) ztail[m] += z8 * xs[m * gs + g0 + j];                         \
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
  void int4_tile_g(int64_t G, const float* xd, const float* xs, int64_t gs, int64_t K, const uint8_t* w,   \
                   const uint16_t* scale, const uint16_t* zero_, float* out, int64_t N, int64_t n0,        \
                   int64_t n1) {                                                                           \
    switch (G / (2 * W)) {                                                                                 \
      case 1: int4_tile<MT, 1>(xd, xs, gs, K, w, scale, zero_, out, N, n0, n1); break;                         \
      case 2: int4_tile<MT, 2>(xd, xs, gs, K, w, scale, zero_, out, N, n0, n1); break;                         \
      case 4: int4_tile<MT, 4>(xd, xs, gs, K, w, scale, zero_, out, N, n0, n1); break;                         \
      case 8: int4_tile<MT, 8>(xd, xs, gs, K, w, scale, zero_, out, N, n0, n1); break;                         \
      default: int4_tile<MT, 16>(xd, xs, gs, K, w, scale, zero_, out, N, n0, n1); break;                       \
    }                                                                                                      \
  }


// The same products with the activations quantized to int8 as well (dynamically, per call, in blocks
// of 32 columns with one fp32 scale each: llama.cpp's Q8_0 activations) and multiplied by the codes with
// integer dot products (AVX-512 VNNI vpdpbusd, or AVX2's maddubs + madd), converted to fp32 once per
// vector of int32 sums. Written once against: byte vector B (BW bytes) with loadb, abs8, sign_as (x
// negated where w < 0), lo4/hi4 (the nibbles of each byte), dot (acc += 4-byte dot products of
// unsigned u by signed s per int32 lane, L = BW / 4 lanes), cvt (int32 -> fp32) and lane_scales<G>.
#define GENCLI_Q8_KERNELS                                                                                                               \
  /* n < BW bytes, the rest zero (a row's last, partial vector) */                                                                      \
  inline B loadb_n(const void* p, int64_t n) {                                                                                          \
    alignas(64) uint8_t t[BW] = {};                                                                                                     \
    std::memcpy(t, p, n);                                                                                                               \
    return loadb(t);                                                                                                                    \
  }                                                                                                                                     \
  /* int8 codes. xq: MT rows of int8 x, stride KP (K rounded up to whole vectors, zeros past K); xl: */                                 \
  /* MT rows of KP/4 fp32, the scale of the block each int32 lane's 4 columns are in; R weight rows at */                               \
  /* a time (each load of x serves them all) */                                                                                         \
  template <int MT, int R>                                                                                                              \
  int64_t q8_int8_rows(const int8_t* xq, const float* xl, int64_t KP, int64_t K, const int8_t* w,                                       \
                       const uint16_t* scale, float* out, int64_t N, int64_t n, int64_t n1) {                                           \
    const int64_t KV = K / BW * BW;                                                                                                     \
    for (; n + R <= n1; n += R) {                                                                                                       \
      const int8_t* wr = w + n * K;                                                                                                     \
      V acc[MT][R];                                                                                                                     \
      for (int m = 0; m < MT; ++m)                                                                                                      \
        for (int r = 0; r < R; ++r) acc[m][r] = zero();                                                                                 \
      auto step = [&](int64_t k, const B* wv) {                                                                                         \
        B wa[R];                                                                                                                        \
        for (int r = 0; r < R; ++r) wa[r] = abs8(wv[r]);                                                                                \
        for (int m = 0; m < MT; ++m) {                                                                                                  \
          const B xv = loadb(xq + m * KP + k);                                                                                          \
          const V sl = load(xl + m * (KP / 4) + k / 4);                                                                                 \
          for (int r = 0; r < R; ++r) acc[m][r] = fma(cvt(dot(zeroi(), wa[r], sign_as(xv, wv[r]))), sl, acc[m][r]);                     \
        }                                                                                                                               \
      };                                                                                                                                \
      for (int64_t k = 0; k < KV; k += BW) {                                                                                            \
        B wv[R];                                                                                                                        \
        if ((k & 63) == 0)                                                                                                              \
          for (int r = 0; r < R; ++r) prefetch(wr + r * K + k + kPrefetchBytes);                                                        \
        for (int r = 0; r < R; ++r) wv[r] = loadb(wr + r * K + k);                                                                      \
        step(k, wv);                                                                                                                    \
      }                                                                                                                                 \
      if (KV < K) {                                                                                                                     \
        B wv[R];                                                                                                                        \
        for (int r = 0; r < R; ++r) wv[r] = loadb_n(wr + r * K + KV, K - KV);                                                           \
        step(KV, wv);                                                                                                                   \
      }                                                                                                                                 \
      for (int r = 0; r < R; ++r) {                                                                                                     \
        const float s = bf16_to_float(scale[n + r]);                                                                                    \
        for (int m = 0; m < MT; ++m) out[m * N + n + r] = hsum(acc[m][r]) * s;                                                          \
      }                                                                                                                                 \
    }                                                                                                                                   \
    return n;                                                                                                                           \
  }                                                                                                                                     \
  template <int MT>                                                                                                                     \
  void q8_int8_tile(const int8_t* xq, const float* xl, int64_t KP, int64_t K, const int8_t* w,                                          \
                    const uint16_t* scale, float* out, int64_t N, int64_t n0, int64_t n1) {                                             \
    int64_t n = q8_int8_rows<MT, kRowsAtOnce>(xq, xl, KP, K, w, scale, out, N, n0, n1);                                                 \
    q8_int8_rows<MT, 1>(xq, xl, KP, K, w, scale, out, N, n, n1);                                                                        \
  }                                                                                                                                     \
  /* int4 codes, in chunks of BW packed bytes (2 BW columns). xd: MT rows of int8 x, stride KP (K */                                    \
  /* rounded up to whole chunks, zeros past K), de-interleaved per chunk as the nibbles are stored: the */                              \
  /* chunk's even columns, then its odd ones (a row's last, partial chunk of T columns: T/2 even ones */                                \
  /* from the chunk's start, T/2 odd ones from BW on); xl: MT rows of KP/8 fp32, the block scale of each */                             \
  /* int32 lane's 8 columns; xs: exact group sums of x (MT rows of stride gs, zeros past K/G) for the */                                \
  /* zero-point term; R weight rows at a time */                                                                                        \
  template <int MT, int R, int64_t G>                                                                                                   \
  int64_t q8_int4_rows(const int8_t* xd, const float* xl, int64_t KP, const float* xs, int64_t gs, int64_t K,                           \
                       const uint8_t* w, const uint16_t* scale, const uint16_t* zero_, float* out, int64_t N,                           \
                       int64_t n, int64_t n1) {                                                                                         \
    constexpr int64_t CC = 2 * BW;                                                                                                      \
    const int64_t groups = K / G, full = K / CC, chunks = (K + CC - 1) / CC;                                                            \
    for (; n + R <= n1; n += R) {                                                                                                       \
      const uint8_t* wr = w + n * (K / 2);                                                                                              \
      V acc[MT][R];                                                                                                                     \
      for (int m = 0; m < MT; ++m)                                                                                                      \
        for (int r = 0; r < R; ++r) acc[m][r] = zero();                                                                                 \
      for (int r = 0; r < R; ++r) { /* the zero-point term: sum over groups of (z - 8 s) * (sum of x) */                                \
        const uint16_t* sr = scale + (n + r) * groups;                                                                                  \
        const uint16_t* zr = zero_ + (n + r) * groups;                                                                                  \
        for (int64_t g = 0; g < groups; g += W) {                                                                                       \
          const int64_t c = groups - g < W ? groups - g : W;                                                                            \
          const V z8 = fma(bf16n(sr + g, c), set1(-8.0f), bf16n(zr + g, c));                                                            \
          for (int m = 0; m < MT; ++m) acc[m][r] = fma(z8, load(xs + m * gs + g), acc[m][r]);                                           \
        }                                                                                                                               \
      }                                                                                                                                 \
      auto step = [&](int64_t c, const B* b, const V* sw) {                                                                             \
        for (int m = 0; m < MT; ++m) {                                                                                                  \
          const int8_t* xc = xd + m * KP + c * CC;                                                                                      \
          const B xe = loadb(xc), xo = loadb(xc + BW);                                                                                  \
          const V sl = load(xl + m * (KP / 8) + c * L);                                                                                 \
          for (int r = 0; r < R; ++r) acc[m][r] = fma(cvt(dot(dot(zeroi(), lo4(b[r]), xe), hi4(b[r]), xo)), mul(sw[r], sl), acc[m][r]); \
        }                                                                                                                               \
      };                                                                                                                                \
      for (int64_t c = 0; c < full; ++c) {                                                                                              \
        B b[R];                                                                                                                         \
        V sw[R];                                                                                                                        \
        for (int r = 0; r < R; ++r) {                                                                                                   \
          const uint8_t* q = wr + r * (K / 2) + c * BW;                                                                                 \
          if (BW >= 64 || (c & 1) == 0) prefetch(q + kPrefetchBytes);                                                                   \
          b[r] = loadb(q);                                                                                                              \
          sw[r] = lane_scales<G>(scale + (n + r) * groups + c * CC / G, CC / G);                                                        \
        }                                                                                                                               \
        step(c, b, sw);                                                                                                                 \
      }                                                                                                                                 \
      if (full < chunks) { /* the last, partial chunk: only its bytes and its groups' scales are read */                                \
        B b[R];                                                                                                                         \
        V sw[R];                                                                                                                        \
        for (int r = 0; r < R; ++r) {                                                                                                   \
          b[r] = loadb_n(wr + r * (K / 2) + full * BW, (K - full * CC) / 2);                                                            \
          sw[r] = lane_scales<G>(scale + (n + r) * groups + full * CC / G, groups - full * CC / G);                                     \
        }                                                                                                                               \
        step(full, b, sw);                                                                                                              \
      }                                                                                                                                 \
      for (int m = 0; m < MT; ++m)                                                                                                      \
        for (int r = 0; r < R; ++r) out[m * N + n + r] = hsum(acc[m][r]);                                                               \
    }                                                                                                                                   \
    return n;                                                                                                                           \
  }                                                                                                                                     \
  template <int MT, int64_t G>                                                                                                          \
  void q8_int4_tile(const int8_t* xd, const float* xl, int64_t KP, const float* xs, int64_t gs, int64_t K,                              \
                    const uint8_t* w, const uint16_t* scale, const uint16_t* zero_, float* out, int64_t N,                              \
                    int64_t n0, int64_t n1) {                                                                                           \
    int64_t n = q8_int4_rows<MT, kInt4RowsAtOnce, G>(xd, xl, KP, xs, gs, K, w, scale, zero_, out, N, n0, n1);                           \
    q8_int4_rows<MT, 1, G>(xd, xl, KP, xs, gs, K, w, scale, zero_, out, N, n, n1);                                                      \
  }                                                                                                                                     \
  template <int MT>                                                                                                                     \
  void q8_int4_tile_g(int64_t G, const int8_t* xd, const float* xl, int64_t KP, const float* xs, int64_t gs,                            \
                      int64_t K, const uint8_t* w, const uint16_t* scale, const uint16_t* zero_, float* out,                            \
                      int64_t N, int64_t n0, int64_t n1) {                                                                              \
    switch (G) {                                                                                                                        \
      case 32: q8_int4_tile<MT, 32>(xd, xl, KP, xs, gs, K, w, scale, zero_, out, N, n0, n1); break;                                     \
      case 64: q8_int4_tile<MT, 64>(xd, xl, KP, xs, gs, K, w, scale, zero_, out, N, n0, n1); break;                                     \
      case 128: q8_int4_tile<MT, 128>(xd, xl, KP, xs, gs, K, w, scale, zero_, out, N, n0, n1); break;                                   \
      default: q8_int4_tile<MT, 256>(xd, xl, KP, xs, gs, K, w, scale, zero_, out, N, n0, n1); break;                                    \
    }                                                                                                                                   \
  }

#ifdef GENCLI_X86
// AVX-512's vector helpers (the float kernels' interface), shared by the two AVX-512 namespaces
#define GENCLI_AVX512_BASE                                                                                 \
  using V = __m512;                                                                                        \
  constexpr int W = 16;                                                                                    \
  GENCLI_FLOAT_OPS(_mm512)                                                                                 \
  inline float hsum(V v) { return _mm512_reduce_add_ps(v); }                                               \
  inline V bf16(const uint16_t* p) {                                                                       \
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));            \
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                                                  \
  }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")
namespace avx512 {
GENCLI_AVX512_BASE
inline V i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void nibbles(const uint8_t* p, V& lo, V& hi) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
GENCLI_KERNELS
}  // namespace avx512
#pragma GCC pop_options

// the integer kernels on AVX-512 with VNNI (Cascade Lake and later): vpdpbusd, 64 bytes at a time
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")
namespace avx512vnni {
GENCLI_AVX512_BASE
using B = __m512i;
constexpr int BW = 64, L = 16;
inline B zeroi() { return _mm512_setzero_si512(); }
inline B loadb(const void* p) { return _mm512_loadu_si512(p); }
inline B abs8(B w) { return _mm512_abs_epi8(w); }
inline B sign_as(B x, B w) { return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x); }
inline B lo4(B b) { return _mm512_and_si512(b, _mm512_set1_epi8(15)); }
inline B hi4(B b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(15)); }
inline B dot(B acc, B u, B s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline V cvt(B v) { return _mm512_cvtepi32_ps(v); }
// n <= W bf16 values, the rest zero
inline V bf16n(const uint16_t* p, int64_t n) {
  const __mmask16 k = n >= W ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
// each lane's weight scale in a chunk (128 columns, 8 a lane) from its groups' scales s[0..n) (n < the
// chunk's groups only in a row's last, partial chunk, whose other lanes multiply zeros)
template <int64_t G>
inline V lane_scales(const uint16_t* s, int64_t n) {
  if constexpr (G >= 2 * BW) {
    return set1(bf16_to_float(s[0]));
  } else {  // G 32: 4 groups a chunk, 4 lanes each; G 64: 2 groups, 8 lanes each
    const __m512i idx = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), G == 32 ? 2 : 3);
    return _mm512_permutexvar_ps(idx, bf16n(s, n));
  }
}
GENCLI_Q8_KERNELS
}  // namespace avx512vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
using V = __m256;
constexpr int W = 8;
GENCLI_FLOAT_OPS(_mm256)
GENCLI_AVX2_HSUM
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
// the integer kernels without VNNI: maddubs (u8 x s8 pairs summed to int16: at most 2 * 127 * 127 for
// int8 codes, 2 * 15 * 127 for int4, never saturating) then madd by ones (int16 pairs to int32)
using B = __m256i;
constexpr int BW = 32, L = 8;
inline B zeroi() { return _mm256_setzero_si256(); }
inline B loadb(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline B abs8(B w) { return _mm256_abs_epi8(w); }
inline B sign_as(B x, B w) { return _mm256_sign_epi8(x, w); }
inline B lo4(B b) { return _mm256_and_si256(b, _mm256_set1_epi8(15)); }
inline B hi4(B b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(15)); }
inline B dot(B acc, B u, B s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))); }
inline V cvt(B v) { return _mm256_cvtepi32_ps(v); }
// n <= W bf16 values, the rest zero
inline V bf16n(const uint16_t* p, int64_t n) {
  if (n >= W) return bf16(p);
  alignas(32) uint16_t t[W] = {};
  for (int64_t i = 0; i < n; ++i) t[i] = p[i];
  return bf16(t);
}
template <int64_t G>
inline V lane_scales(const uint16_t* s, int64_t n) {
  if constexpr (G >= 2 * BW) {
    return set1(bf16_to_float(s[0]));
  } else {  // G 32: two groups a chunk of 64 columns, 4 lanes each
    const float s1 = n > 1 ? bf16_to_float(s[1]) : 0.f;
    return _mm256_setr_m128(_mm_set1_ps(bf16_to_float(s[0])), _mm_set1_ps(s1));
  }
}
GENCLI_Q8_KERNELS
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace {

enum class Isa { none, avx2, avx512 };

bool supported(Isa want) {
#ifdef GENCLI_X86
  __builtin_cpu_init();
  if (want == Isa::avx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl");
  if (want == Isa::avx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return false;
}

Isa g_isa = supported(Isa::avx512) ? Isa::avx512 : supported(Isa::avx2) ? Isa::avx2 : Isa::none;

Isa isa() { return g_isa; }

bool has_vnni() {
#ifdef GENCLI_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// the integer (int8-activation) kernels: AVX-512 VNNI where the CPU has it and AVX-512 is in use
bool use_vnni() { return isa() == Isa::avx512 && has_vnni(); }

int int_bytes() { return use_vnni() ? 64 : 32; }  // bytes per integer vector (BW)

int lanes() { return isa() == Isa::avx512 ? 16 : 8; }

// rows per task: enough work (~64k weights) that a thread's share outweighs the scheduling
int64_t grain(int64_t K) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K, 1)); }

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

// fn(c) for c in [0, count), the chunks taken in turn by torch's threads from a shared counter rather
// than split in equal shares (at::parallel_for): on a shared machine one thread is often held up, and
// with equal shares every product then waits for it.
template <typename F>
void parallel_chunks(int64_t count, F&& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < count; ++c) fn(c);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(threads))
  for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < count; c = next.fetch_add(1, std::memory_order_relaxed)) fn(c);
}

// tile(i, MT, m0, n0, n1) for every weight i of Ns (rows Ns[i]), tile of activation rows [m0, m0 + MT)
// and range of weight rows [n0, n1): each weight's rows cut into chunks of about 64 kB of codes (a
// multiple of 4 rows), all the weights' chunks in one parallel pass, each chunk read once per tile of up
// to kMaxRows activation rows
template <typename F>
void for_tiles(int64_t M, const std::vector<int64_t>& Ns, int64_t row_bytes, F&& tile) {
  const int64_t rows = (grain(row_bytes) + 3) / 4 * 4;
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (weight, first row)
  for (int64_t i = 0; i < static_cast<int64_t>(Ns.size()); ++i)
    for (int64_t n0 = 0; n0 < Ns[i]; n0 += rows) chunks.emplace_back(i, n0);
  parallel_chunks(static_cast<int64_t>(chunks.size()), [&](int64_t c) {
    const int64_t i = chunks[c].first, n0 = chunks[c].second, n1 = std::min(Ns[i], n0 + rows);
    by_row_tiles(M, [&](auto mt, int64_t m0) { tile(i, mt, m0, n0, n1); });
  });
}

template <typename F>
void for_tiles(int64_t M, int64_t N, int64_t row_bytes, F&& tile) {
  for_tiles(M, std::vector<int64_t>{N}, row_bytes, [&](int64_t, auto mt, int64_t m0, int64_t n0, int64_t n1) { tile(mt, m0, n0, n1); });
}

// x's rows quantized to int8 in blocks of kActBlock columns: codes q (M, K) and one scale per block
// sx (M, K / kActBlock), x ~ q * sx (symmetric, q in [-127, 127]: Q8_0's activations)
void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* q, float* sx) {
  const int64_t blocks = K / kActBlock;
  for (int64_t i = 0; i < M * blocks; ++i) {
    const float* xb = x + i * kActBlock;
    float amax = 0.f;
    for (int64_t j = 0; j < kActBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;
    sx[i] = amax / 127.0f;
    // round half to even by the 1.5 * 2^23 trick (exact for |y| <= 127, and vectorised: no libm call)
    for (int64_t j = 0; j < kActBlock; ++j) {
      const float y = std::max(-127.f, std::min(127.f, xb[j] * inv));
      q[i * kActBlock + j] = static_cast<int8_t>((y + 12582912.0f) - 12582912.0f);
    }
  }
}

}  // namespace

// The products on raw pointers (decoder_step.cpp calls them too): x (M, K) float32 contiguous, each
// weight's result written to outs[i] (M, N_i). The f32 kernels: one weight a pass.
namespace {

void int8_product_f32(const float* xp, int64_t M, int64_t K, const gencli::QuantWeight& w, float* op) {
  const int64_t N = w.N;
  const int8_t* wp = static_cast<const int8_t*>(w.codes);
  const uint16_t* sp = w.scale;
  for_tiles(M, N, K, [&](auto mt, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int MT = decltype(mt)::value;
#ifdef GENCLI_X86
    if (isa() == Isa::avx512)
      avx512::int8_tile<MT>(xp + m0 * K, K, wp, sp, op + m0 * N, N, n0, n1);
    else
      avx2::int8_tile<MT>(xp + m0 * K, K, wp, sp, op + m0 * N, N, n0, n1);
#endif
  });
}

// Scratch memory of the calling thread, reused from call to call (decoding makes dozens of these calls
// a token: no allocation each time). The kernels only read it, within the call that filled it.
template <typename T>
T* scratch(std::vector<T>& buffer, int64_t n, bool zeroed) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  if (zeroed) std::fill(buffer.begin(), buffer.begin() + n, T{});
  return buffer.data();
}

// w = (q - 8) * scale + zero with q packed (N, K/2), groups of G; xsp the group sums of x (M, gs)
void int4_product_f32(const float* xp, int64_t M, int64_t K, const gencli::QuantWeight& w, const float* xsp, int64_t gs, float* op) {
  const int64_t N = w.N, G = w.G, W = lanes();
  // x de-interleaved per block of 2W columns (the even columns, then the odd ones)
  thread_local std::vector<float> xd_buf;
  float* xdp = scratch(xd_buf, M * K, false);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K; c += 2 * W)
      for (int64_t j = 0; j < W; ++j) {
        xdp[m * K + c + j] = xp[m * K + c + 2 * j];
        xdp[m * K + c + W + j] = xp[m * K + c + 2 * j + 1];
      }
  const uint8_t* wp = static_cast<const uint8_t*>(w.codes);
  const uint16_t* sp = w.scale;
  const uint16_t* zp = w.zero;
  for_tiles(M, N, K, [&](auto mt, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int MT = decltype(mt)::value;
#ifdef GENCLI_X86
    if (isa() == Isa::avx512)
      avx512::int4_tile_g<MT>(G, xdp + m0 * K, xsp + m0 * gs, gs, K, wp, sp, zp, op + m0 * N, N, n0, n1);
    else
      avx2::int4_tile_g<MT>(G, xdp + m0 * K, xsp + m0 * gs, gs, K, wp, sp, zp, op + m0 * N, N, n0, n1);
#endif
  });
}

// x quantized for the integer kernels: the codes in rows of KP (zeros past K), de-interleaved per chunk
// of 2 * chunk_bytes columns when chunk_bytes > 0 (int4: as the nibbles are stored, the chunk's even
// columns then its odd ones), and each int32 lane's block scale (per_lane columns a lane: 4 for int8
// codes, 8 for packed int4 codes)
struct IntActivations {
  const int8_t* codes;        // (M, KP)
  const float* lane_scales;   // (M, KP / per_lane)
};

IntActivations int_activations(const float* x, int64_t M, int64_t K, int64_t KP, int64_t per_lane, int64_t chunk_bytes) {
  thread_local std::vector<int8_t> q_buf, codes_buf;
  thread_local std::vector<float> sx_buf, lanes_buf;
  const int64_t blocks = K / kActBlock;
  int8_t* qp = scratch(q_buf, M * K, false);
  float* sxp = scratch(sx_buf, M * blocks, false);
  int8_t* cp = scratch(codes_buf, M * KP, true);
  float* lp = scratch(lanes_buf, M * (KP / per_lane), true);
  quantize_activations(x, M, K, qp, sxp);
  const int64_t BW = chunk_bytes, CC = 2 * chunk_bytes;
  for (int64_t m = 0; m < M; ++m) {
    if (BW == 0) {
      std::memcpy(cp + m * KP, qp + m * K, K);
    } else {
      for (int64_t c = 0; c < K; c += CC)
        for (int64_t j = 0; j < BW && c + 2 * j < K; ++j) {
          cp[m * KP + c + j] = qp[m * K + c + 2 * j];
          cp[m * KP + c + BW + j] = qp[m * K + c + 2 * j + 1];
        }
    }
    for (int64_t i = 0; i < K / per_lane; ++i) lp[m * (KP / per_lane) + i] = sxp[m * blocks + i / (kActBlock / per_lane)];
  }
  return {cp, lp};
}

// the same with x quantized to int8 (blocks of kActBlock) and integer dot products, for several weights
// multiplying the same x (a layer's query/key/value or gate/up projections): x quantized once, every
// weight's rows in one parallel pass
void int8_products_q8(const float* x, int64_t M, int64_t K, const gencli::QuantWeight* ws, int64_t count, float* const* outs) {
  const int64_t BW = int_bytes(), KP = (K + BW - 1) / BW * BW;
  const IntActivations a = int_activations(x, M, K, KP, 4, 0);
  const int8_t* xpp = a.codes;
  const float* xlp = a.lane_scales;
  std::vector<int64_t> Ns;
  for (int64_t i = 0; i < count; ++i) Ns.push_back(ws[i].N);
  for_tiles(M, Ns, K, [&](int64_t i, auto mt, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int MT = decltype(mt)::value;
    const int8_t* wp = static_cast<const int8_t*>(ws[i].codes);
    const uint16_t* sp = ws[i].scale;
    float* op = outs[i] + m0 * Ns[i];
#ifdef GENCLI_X86
    if (use_vnni())
      avx512vnni::q8_int8_tile<MT>(xpp + m0 * KP, xlp + m0 * (KP / 4), KP, K, wp, sp, op, Ns[i], n0, n1);
    else
      avx2::q8_int8_tile<MT>(xpp + m0 * KP, xlp + m0 * (KP / 4), KP, K, wp, sp, op, Ns[i], n0, n1);
#endif
  });
}

void int4_products_q8(const float* x, int64_t M, int64_t K, const gencli::QuantWeight* ws, int64_t count, const float* xsp, int64_t gs,
                      float* const* outs) {
  const int64_t BW = int_bytes(), CC = 2 * BW, G = ws[0].G;
  const int64_t KP = (K + CC - 1) / CC * CC;
  const IntActivations a = int_activations(x, M, K, KP, 8, BW);
  const int8_t* xdp = a.codes;
  const float* xlp = a.lane_scales;
  std::vector<int64_t> Ns;
  for (int64_t i = 0; i < count; ++i) Ns.push_back(ws[i].N);
  for_tiles(M, Ns, K / 2, [&](int64_t i, auto mt, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int MT = decltype(mt)::value;
    const uint8_t* wp = static_cast<const uint8_t*>(ws[i].codes);
    const uint16_t* sp = ws[i].scale;
    const uint16_t* zp = ws[i].zero;
    float* op = outs[i] + m0 * Ns[i];
#ifdef GENCLI_X86
    if (use_vnni())
      avx512vnni::q8_int4_tile_g<MT>(G, xdp + m0 * KP, xlp + m0 * (KP / 8), KP, xsp + m0 * gs, gs, K, wp, sp, zp, op, Ns[i], n0, n1);
    else
      avx2::q8_int4_tile_g<MT>(G, xdp + m0 * KP, xlp + m0 * (KP / 8), KP, xsp + m0 * gs, gs, K, wp, sp, zp, op, Ns[i], n0, n1);
#endif
  });
}

// x's group sums (M, gs), gs the groups rounded up to 16 (padded with zeros): the zero points multiply them
const float* group_sums(const float* xp, int64_t M, int64_t K, int64_t G, int64_t gs) {
  thread_local std::vector<float> xs_buf;
  float* xsp = scratch(xs_buf, M * gs, true);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / G; ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < G; ++j) s += xp[m * K + g * G + j];
      xsp[m * gs + g] = s;
    }
  return xsp;
}

}  // namespace

namespace gencli {

bool quantized_kernels_available() { return isa() != Isa::none; }

int vector_lanes() { return isa() == Isa::none ? 0 : lanes(); }

void quantized_products(const float* x, int64_t M, int64_t K, const QuantWeight* ws, float* const* outs, int64_t count, bool int8_act) {
  if (count <= 0) return;
  const bool int4 = ws[0].int4;
  bool same = true;
  for (int64_t i = 1; i < count; ++i) same = same && ws[i].int4 == int4 && (!int4 || ws[i].G == ws[0].G);
  if (!same) {  // (not made by gencli's layers: one mode, one group size a model)
    for (int64_t i = 0; i < count; ++i) quantized_products(x, M, K, ws + i, outs + i, 1, int8_act);
    return;
  }
  if (!int4) {
    if (int8_act && K % kActBlock == 0) {
      int8_products_q8(x, M, K, ws, count, outs);
    } else {
      for (int64_t i = 0; i < count; ++i) int8_product_f32(x, M, K, ws[i], outs[i]);
    }
  } else {
    const int64_t G = ws[0].G, gs = (K / G + 15) / 16 * 16;
    const float* xsp = group_sums(x, M, K, G, gs);
    if (int8_act && G >= kActBlock && G <= 256) {
      int4_products_q8(x, M, K, ws, count, xsp, gs, outs);
    } else {
      for (int64_t i = 0; i < count; ++i) int4_product_f32(x, M, K, ws[i], xsp, gs, outs[i]);
    }
  }
  for (int64_t i = 0; i < count; ++i) {  // the layer's bias, without a call of its own
    const float* b = ws[i].bias;
    if (!b) continue;
    float* o = outs[i];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < ws[i].N; ++n) o[m * ws[i].N + n] += b[n];
  }
}

std::string check_quant_weight(const QuantWeight& w) {
  if (w.N <= 0 || w.K <= 0) return "empty weight";
  if (!w.int4) return "";
  const int64_t W = lanes(), G = w.G;
  if (!(G > 0 && G % (2 * W) == 0 && G <= 32 * W && (G & (G - 1)) == 0 && w.K % G == 0))
    return "the group size must be a power of two, a multiple of " + std::to_string(2 * W) + " dividing K";
  return "";
}

}  // namespace gencli

// The entry points: x (..., K) float32, any layout (a decoding step's (B, n, K) activations as they come);
// the result (..., N). int8 activations (the integer kernels) where asked and the shape allows, else fp32.
// The scales and the bias are taken in any floating dtype (converted here, a no-op when they are bf16 /
// fp32 already): the Python side passes the layer's tensors as they are, one call a layer.
namespace {
at::Tensor as_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "quant_gemv: x must be float32 (..., K)");
  return x.reshape({-1, x.size(-1)}).contiguous();
}
at::Tensor shaped_like(const at::Tensor& out, const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out.size(1);
  return out.view(shape);
}
}  // namespace

using Biases = std::vector<c10::optional<at::Tensor>>;

namespace gencli {

// A layer's tensors as the kernels read them: codes (N, K) int8 or (N, K/2) uint8; scale (and zero) in any
// floating dtype, bias (or undefined) in any floating dtype; the converted copies (none when they are bf16 /
// fp32 and contiguous already) kept in `keep`.
QuantWeight quant_weight(bool int4, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero, int64_t G,
                         const at::Tensor& bias, std::vector<at::Tensor>& keep) {
  TORCH_CHECK(isa() != Isa::none, "quant_gemv: this CPU has neither AVX-512 nor AVX2");
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 2 && codes.is_contiguous(), "quant_gemv: the codes must be contiguous CPU (N, K or K/2)");
  TORCH_CHECK(codes.scalar_type() == (int4 ? at::kByte : at::kChar), int4 ? "quant_gemv: packed uint8 int4 codes expected" : "quant_gemv: int8 codes expected");
  QuantWeight w{};
  w.int4 = int4;
  w.N = codes.size(0);
  w.K = int4 ? 2 * codes.size(1) : codes.size(1);
  w.G = int4 ? G : -1;
  w.codes = codes.data_ptr();
  const std::string problem = check_quant_weight(w);
  TORCH_CHECK(problem.empty(), "quant_gemv: ", problem);
  const int64_t per_row = int4 ? (G > 0 ? w.K / G : 0) : 1;
  keep.push_back(scale.to(at::kBFloat16).contiguous());
  TORCH_CHECK(keep.back().numel() == w.N * per_row && (!int4 || (keep.back().dim() == 2 && keep.back().size(0) == w.N)),
              "quant_gemv: shapes do not match");
  w.scale = reinterpret_cast<const uint16_t*>(keep.back().data_ptr<at::BFloat16>());
  if (int4) {
    keep.push_back(zero.to(at::kBFloat16).contiguous());
    TORCH_CHECK(keep.back().sizes() == keep[keep.size() - 2].sizes(), "quant_gemv: shapes do not match");
    w.zero = reinterpret_cast<const uint16_t*>(keep.back().data_ptr<at::BFloat16>());
  }
  if (bias.defined()) {
    keep.push_back(bias.to(at::kFloat).contiguous());
    TORCH_CHECK(keep.back().numel() == w.N, "quant_gemv: the bias must have N values");
    w.bias = keep.back().data_ptr<float>();
  }
  return w;
}

}  // namespace gencli

namespace {

// x (..., K) times each weight: the list of (..., N_i) results
std::vector<at::Tensor> products(const at::Tensor& x_in, std::vector<gencli::QuantWeight>& ws, bool int8_act) {
  const at::Tensor x = as_rows(x_in);
  TORCH_CHECK(x.device().is_cpu(), "quant_gemv: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> outs;
  std::vector<float*> ptrs;
  for (const auto& w : ws) {
    TORCH_CHECK(w.K == K, "quant_gemv: shapes do not match");
    outs.push_back(at::empty({M, w.N}, x.options()));
    ptrs.push_back(outs.back().data_ptr<float>());
  }
  gencli::quantized_products(x.data_ptr<float>(), M, K, ws.data(), ptrs.data(), static_cast<int64_t>(ws.size()), int8_act);
  for (auto& out : outs) out = shaped_like(out, x_in);
  return outs;
}

at::Tensor or_undefined(const c10::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

}  // namespace

// x (..., K) times each of the int8 weights ws (N_i, K): the list of (..., N_i) results
std::vector<at::Tensor> int8_gemv_many(const at::Tensor& x, const std::vector<at::Tensor>& ws, const std::vector<at::Tensor>& scales,
                                       bool int8_activations, const Biases& biases) {
  const size_t count = ws.size();
  TORCH_CHECK(count > 0 && scales.size() == count && biases.size() == count, "quant_gemv: one scale and one bias (or None) a weight");
  std::vector<at::Tensor> keep;
  std::vector<gencli::QuantWeight> qw;
  for (size_t i = 0; i < count; ++i) qw.push_back(gencli::quant_weight(false, ws[i], scales[i], at::Tensor(), -1, or_undefined(biases[i]), keep));
  return products(x, qw, int8_activations);
}

// x (..., K) times each of the int4 weights ws (N_i, K/2 packed), all with groups of G
std::vector<at::Tensor> int4_gemv_many(const at::Tensor& x, const std::vector<at::Tensor>& ws, const std::vector<at::Tensor>& scales,
                                       const std::vector<at::Tensor>& zeros, int64_t G, bool int8_activations, const Biases& biases) {
  const size_t count = ws.size();
  TORCH_CHECK(count > 0 && scales.size() == count && zeros.size() == count && biases.size() == count,
              "quant_gemv: one scale, one zero point and one bias (or None) a weight");
  std::vector<at::Tensor> keep;
  std::vector<gencli::QuantWeight> qw;
  for (size_t i = 0; i < count; ++i) qw.push_back(gencli::quant_weight(true, ws[i], scales[i], zeros[i], G, or_undefined(biases[i]), keep));
  return products(x, qw, int8_activations);
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, bool int8_activations,
                     const c10::optional<at::Tensor>& bias) {
  return int8_gemv_many(x, {w}, {scale}, int8_activations, {bias})[0];
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& zero, int64_t G, bool int8_activations,
                     const c10::optional<at::Tensor>& bias) {
  return int4_gemv_many(x, {w}, {scale}, {zero}, G, int8_activations, {bias})[0];
}

std::string isa_name() {
  switch (isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "";
  }
}

// decode_attention.cpp, built into the same extension
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const c10::optional<at::Tensor>& key_mask);
bool use_attention_isa(const std::string& name);
// decoder_step.cpp
void register_decoder_step(py::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decoder_step(m);
  m.def("int8_gemv", &int8_gemv, "x (..., K) f32 @ (q int8 (N, K) * scale bf16 (N,)).T (+ bias f32 (N,))", py::arg("x"), py::arg("q"), py::arg("scale"),
        py::arg("int8_activations") = false, py::arg("bias") = py::none());
  m.def("int4_gemv", &int4_gemv, "x (..., K) f32 @ ((q - 8) * scale + zero).T (+ bias), q packed (N, K/2), groups of G", py::arg("x"),
        py::arg("packed"), py::arg("scale"), py::arg("zero"), py::arg("group_size"), py::arg("int8_activations") = false,
        py::arg("bias") = py::none());
  m.def("int8_gemv_many", &int8_gemv_many, "[x @ (q_i * scale_i).T (+ bias_i)] for several int8 weights and one x (quantized once)",
        py::arg("x"), py::arg("qs"), py::arg("scales"), py::arg("int8_activations"), py::arg("biases"));
  m.def("int4_gemv_many", &int4_gemv_many, "[x @ ((q_i - 8) * scale_i + zero_i).T (+ bias_i)] for several int4 weights and one x",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("zeros"), py::arg("group_size"), py::arg("int8_activations"),
        py::arg("biases"));
  m.def(
      "quantize_activations",
      [](const at::Tensor& x) {
        TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % kActBlock == 0,
                    "quant_gemv: x must be contiguous float32 (M, K), K a multiple of ", kActBlock);
        at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar)), sx = at::empty({x.size(0), x.size(1) / kActBlock}, x.options());
        quantize_activations(x.data_ptr<float>(), x.size(0), x.size(1), q.data_ptr<int8_t>(), sx.data_ptr<float>());
        return std::make_tuple(q, sx);
      },
      "x (M, K) f32 -> (codes int8 (M, K), scales f32 (M, K/32)): the int8 activations the integer kernels use");
  m.def("int_isa", []() -> std::string { return isa() == Isa::none ? "" : use_vnni() ? "avx512vnni" : "avx2"; },
        "the instruction set of the int8-activation kernels ('' when none)");
  m.def(
      "use_isa",
      [](const std::string& name) {
        const Isa want = name == "avx512" ? Isa::avx512 : name == "avx2" ? Isa::avx2 : Isa::none;
        if (!supported(want)) return false;
        g_isa = want;
        return true;
      },
      "use 'avx512' or 'avx2' from now on (False, and no change, when the CPU lacks it)");
  m.def("decode_attention", &decode_attention,
        "softmax(q k^T * scale) v for one query position: q (B, H, 1, D), k, v (B, Hkv, L, D) float32, key_mask (B, L) bool",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("key_mask") = py::none());
  m.def("use_attention_isa", &use_attention_isa, "decode_attention: use 'avx512', 'avx2' or 'scalar' from now on (False beyond the CPU)");
  m.def("isa", &isa_name, "the vector instruction set the kernels use ('' when none)");
}
