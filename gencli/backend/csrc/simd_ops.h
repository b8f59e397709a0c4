// Vector helpers shared by the CPU kernels (quant_gemv.cpp, decode_attention.cpp, decoder_step.cpp):
// expanded inside a namespace compiled for one instruction set (#pragma GCC target), where V is that
// set's float vector.
#pragma once

// the float operations AVX-512 and AVX2 spell alike (P: the intrinsics' prefix, _mm512 or _mm256)
#define GENCLI_FLOAT_OPS(P)                                          \
  inline V zero() { return P##_setzero_ps(); }                       \
  inline V set1(float v) { return P##_set1_ps(v); }                  \
  inline V load(const float* p) { return P##_loadu_ps(p); }          \
  inline void store(float* p, V v) { P##_storeu_ps(p, v); }          \
  inline V fma(V a, V b, V c) { return P##_fmadd_ps(a, b, c); }      \
  inline V add(V a, V b) { return P##_add_ps(a, b); }                \
  inline V sub(V a, V b) { return P##_sub_ps(a, b); }                \
  inline V mul(V a, V b) { return P##_mul_ps(a, b); }                \
  inline V vdiv(V a, V b) { return P##_div_ps(a, b); }               \
  inline V vmin(V a, V b) { return P##_min_ps(a, b); }               \
  inline V vmax(V a, V b) { return P##_max_ps(a, b); }

// the sum of an AVX2 vector's 8 lanes
#define GENCLI_AVX2_HSUM                                             \
  inline float hsum(__m256 v) {                                      \
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); \
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                          \
    s = _mm_add_ss(s, _mm_movehdup_ps(s));                           \
    return _mm_cvtss_f32(s);                                         \
  }

// e^x = 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), p Cephes' expf polynomial
// (within 2 ulp); x clamped at -87 (2^n stays normal) and the result set to 0 below it
#define GENCLI_EXP_CONSTANTS                                                                                \
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;           \
  constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f, \
                  kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f, kLow = -87.0f;                            \
  inline V poly(V r) {                                                                                      \
    V p = fma(set1(kP0), r, set1(kP1));                                                                     \
    p = fma(p, r, set1(kP2));                                                                               \
    p = fma(p, r, set1(kP3));                                                                               \
    p = fma(p, r, set1(kP4));                                                                               \
    p = fma(p, r, set1(kP5));                                                                               \
    return fma(mul(p, r), r, add(r, set1(1.f)));                                                            \
  }

// e^x on a vector (after GENCLI_FLOAT_OPS): exact 0 below -87; x must stay below 88 (2^n normal)
#define GENCLI_AVX512_EXP                                                                                    \
GENCLI_EXP_CONSTANTS                                                                                         \
inline V vexp(V x) {                                                                                         \
  const __mmask16 low = _mm512_cmp_ps_mask(x, set1(kLow), _CMP_LT_OQ);                                       \
  x = _mm512_max_ps(x, set1(kLow));                                                                          \
  const V n = _mm512_roundscale_ps(mul(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);     \
  const V r = fma(n, set1(-kLn2Lo), fma(n, set1(-kLn2Hi), x));                                               \
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);  \
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~low), mul(poly(r), _mm512_castsi512_ps(e)));            \
}

#define GENCLI_AVX2_EXP                                                                                      \
GENCLI_EXP_CONSTANTS                                                                                         \
inline V vexp(V x) {                                                                                         \
  const V keep = _mm256_cmp_ps(x, set1(kLow), _CMP_GE_OQ);                                                   \
  x = _mm256_max_ps(x, set1(kLow));                                                                          \
  const V n = _mm256_round_ps(mul(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);          \
  const V r = fma(n, set1(-kLn2Lo), fma(n, set1(-kLn2Hi), x));                                               \
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  \
  return _mm256_and_ps(keep, mul(poly(r), _mm256_castsi256_ps(e)));                                          \
}
