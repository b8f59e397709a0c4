// Vector helpers shared by the CPU kernels (quant_gemv.cpp, decode_attention.cpp): expanded inside a
// namespace compiled for one instruction set (#pragma GCC target), where V is that set's float vector.
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
  inline V mul(V a, V b) { return P##_mul_ps(a, b); }

// the sum of an AVX2 vector's 8 lanes
#define GENCLI_AVX2_HSUM                                             \
  inline float hsum(__m256 v) {                                      \
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); \
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                          \
    s = _mm_add_ss(s, _mm_movehdup_ps(s));                           \
    return _mm_cvtss_f32(s);                                         \
  }
