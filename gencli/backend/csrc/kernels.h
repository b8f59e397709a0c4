// What the kernel files offer each other on raw pointers (one extension: quant_gemv.cpp,
// reference.cpp, decode_attention.cpp, decoder_step.cpp): the decoder step calls the products and the
// attention without going through tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

namespace gencli {

// Allocations on cache-line boundaries: the kernels' scratch vectors (activations, their int8 codes,
// de-interleaved copies) are read a vector register at a time, and a 64-byte load from a 16-byte aligned
// malloc block spans two lines (on the 2-core AMD EPYC, a bf16 product over weights in memory read them
// at 18-23 GB/s instead of 28-38 when its activations' copy landed off a line boundary).
template <typename T>
struct CacheAligned {
  using value_type = T;
  static constexpr std::size_t kAlign = 64;
  CacheAligned() = default;
  template <typename U>
  CacheAligned(const CacheAligned<U>&) {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    if (void* p = std::aligned_alloc(kAlign, bytes ? bytes : kAlign)) return static_cast<T*>(p);
    throw std::bad_alloc();
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <typename U>
  bool operator==(const CacheAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheAligned<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheAligned<T>>;

// Scratch memory of the calling thread, reused from call to call (decoding makes dozens of these calls
// a token: no allocation each time): at least n values of a thread_local buffer, zeroed or as left. The
// kernels only read it within the call that filled it.
template <typename T>
T* scratch(AlignedVector<T>& buffer, int64_t n, bool zeroed = false) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  if (zeroed) std::fill(buffer.begin(), buffer.begin() + n, T{});
  return buffer.data();
}

// A linear layer's weight as the kernels read it: weight-only quantized (gencli.backend.quantize's
// layout) or dense (gencli.backend.streamed_linear's), always (N, K) rows:
//   int8: w = q * scale[n]                       codes int8 (N, K), scale bf16 (N,)
//   int4: w = (q - 8) * scale[n, g] + zero[n, g] codes packed two per byte (N, K/2), the even column in
//         the low nibble; scale/zero bf16 (N, K/G)
//   f32:  w as stored                            codes float32 (N, K), no scale
//   bf16: w as stored                            codes bf16 (N, K), no scale (fp32 products of its values)
enum class WeightKind { int8, int4, f32, bf16 };

struct QuantWeight {
  WeightKind kind = WeightKind::int8;
  const void* codes = nullptr;
  const uint16_t* scale = nullptr;  // int8 and int4 only
  const uint16_t* zero = nullptr;   // int4 only
  const float* bias = nullptr;     // (N,) or none
  int64_t N = 0, K = 0, G = -1;

  bool int4() const { return kind == WeightKind::int4; }
  bool dense() const { return kind == WeightKind::f32 || kind == WeightKind::bf16; }
};

constexpr int64_t kActBlock = 32;  // int8 activations: columns per scale (llama.cpp's Q8_0 block)

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Whether the products of x with weights like w run on int8 activations when they are asked for: K a
// multiple of kActBlock (int8 codes), groups of 32 to 256 columns (int4); else (dense weights always)
// on fp32 activations.
bool int8_activations_apply(const QuantWeight& w, bool asked);

// outs[i] (M, ws[i].N) = x (M, K) @ W_i^T (+ bias_i), for weights sharing x: with int8_activations x is
// quantized once (blocks of 32) and every weight's rows run in one parallel pass of integer kernels.
void quantized_products(const float* x, int64_t M, int64_t K, const QuantWeight* ws, float* const* outs, int64_t count,
                        bool int8_activations);

// Rows `rows` (n of them) of a dense weight (f32 or bf16) times one activation row x (K): out[j] = x . w[rows[j]]
// (+ bias), by the same per-row arithmetic as quantized_products's dense kernels, on the calling thread alone
// (no team, no parallel region): the decoding step's exact recomputation of a screen's candidates.
void dense_rows(const float* x, int64_t K, const QuantWeight& w, const int64_t* rows, int64_t n, float* out);

// x's rows quantized to int8 in blocks of kActBlock columns: codes q (M, K) and one scale per block
// sx (M, K / kActBlock), x ~ q * sx (symmetric, q in [-127, 127]: Q8_0's activations); by the active
// instruction set's vectors (act_quant.inc), or plainly (the reference: the same bits)
void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* q, float* sx);
void quantize_activations_reference(const float* x, int64_t M, int64_t K, int8_t* q, float* sx);

// The same products computed plainly, one output at a time, on one thread (reference.cpp): what the
// vector kernels are tested against.
void quantized_products_reference(const float* x, int64_t M, int64_t K, const QuantWeight* ws, float* const* outs, int64_t count,
                                  bool int8_activations);

// softmax(q k^T * scale) v for one query per (sequence b, head h): q at base + b * s_b + h * s_h, k and v
// at base + b * s_b + g * s_h + position * s_l (the head dimension contiguous in all three), mask (B, L)
// may-attend flags or null; out (B, H, D) contiguous. Heads spread over torch's threads.
struct KVView {
  const float* data;
  int64_t s_b, s_h, s_l;
};
void attend_one_query(const KVView& q, const KVView& k, const KVView& v, const bool* mask, int64_t B, int64_t H, int64_t Hkv,
                      int64_t L, int64_t D, float scale, float* out);
// the same for the (sequence, head) pairs b * H + h in [begin, end) only, on the calling thread
void attend_heads(const KVView& q, const KVView& k, const KVView& v, const bool* mask, int64_t B, int64_t H, int64_t Hkv, int64_t L,
                  int64_t D, float scale, float* out, int64_t begin, int64_t end);

// the index of the first largest of p[begin, end) (torch.argmax's choice: a NaN before any number, the
// first of equal ones), or -1 for an empty range (decoder_step.cpp)
int64_t first_largest(const float* p, int64_t begin, int64_t end);

// How the next token is chosen from a row of logits (gencli.pipelines.text.sampling's SamplingParams):
// temperature 0 greedy (after the repetition penalty), top_k 0 / top_p 1 / min_p 0 / penalty 1 off.
struct SamplingSettings {
  float temperature = 0.f;
  int64_t top_k = 0;
  float top_p = 1.f;
  float min_p = 0.f;
  float repetition_penalty = 1.f;
};

// The token sampling chooses from the logits x (V) (overwritten: the processed logits) with the uniform
// number u in [0, 1), the tokens seen so far (n, repeats allowed) penalized (sampling.cpp): the choice of
// sampling.py's candidates() + draw() up to float rounding.
int64_t sample_token(float* x, int64_t V, const SamplingSettings& s, const int64_t* seen, int64_t n_seen, double u);

}  // namespace gencli
