// What the kernel files offer each other (one extension: quant_gemv.cpp, decode_attention.cpp,
// decoder_step.cpp), on raw pointers: the decoder step calls the products and the attention without
// going through tensors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace gencli {

// A weight-only quantized linear layer as the kernels read it (gencli.backend.quantize's layout):
//   int8: w = q * scale[n]                       codes int8 (N, K), scale bf16 (N,)
//   int4: w = (q - 8) * scale[n, g] + zero[n, g] codes packed two per byte (N, K/2), scale/zero bf16 (N, K/G)
struct QuantWeight {
  bool int4 = false;
  const void* codes = nullptr;
  const uint16_t* scale = nullptr;
  const uint16_t* zero = nullptr;  // int4 only
  const float* bias = nullptr;     // (N,) or none
  int64_t N = 0, K = 0, G = -1;
};

bool quantized_kernels_available();
// the float lanes of the instruction set the kernels use (16: AVX-512, 8: AVX2, 0: neither)
int vector_lanes();

// The weight of a layer's tensors, checked: scale/zero/bias converted to bf16 / fp32 where they are not
// (the converted copies appended to keep, which must outlive the weight).
QuantWeight quant_weight(bool int4, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero, int64_t G,
                         const at::Tensor& bias, std::vector<at::Tensor>& keep);

// outs[i] (M, ws[i].N) = x (M, K) @ W_i^T (+ bias_i), for weights sharing x: with int8_activations x is
// quantized once (blocks of 32) and every weight's rows run in one parallel pass of integer kernels.
void quantized_products(const float* x, int64_t M, int64_t K, const QuantWeight* ws, float* const* outs, int64_t count,
                        bool int8_activations);

// softmax(q k^T * scale) v for one query per (sequence b, head h): q at base + b * s_b + h * s_h, k and v
// at base + b * s_b + g * s_h + position * s_l (the head dimension contiguous in all three), mask (B, L)
// may-attend flags or null; out (B, H, D) contiguous. Heads spread over torch's threads.
struct KVView {
  const float* data;
  int64_t s_b, s_h, s_l;
};
// key_mask (B, L) bool, or none: its flags (the contiguous tensor kept in keep), or null; who names the caller
const bool* key_mask_flags(const c10::optional<at::Tensor>& key_mask, int64_t B, int64_t L, at::Tensor& keep, const char* who);
void attend_one_query(const KVView& q, const KVView& k, const KVView& v, const bool* mask, int64_t B, int64_t H, int64_t Hkv,
                      int64_t L, int64_t D, float scale, float* out);

}  // namespace gencli
