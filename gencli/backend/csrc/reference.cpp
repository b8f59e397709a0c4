// Plain scalar versions of the quantized and dense products (kernels.h): one output at a time, on one thread,
// written to be read rather than to be fast; the tests compare the vector kernels (quant_gemv.cpp) with
// them. Sums of fp32 terms are taken in double and rounded once at the end; the int8-activation products
// sum each block of 32 columns in int32, exactly, as the integer kernels do, before scaling it.
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace gencli {

namespace {

// The code of column k in row n: int8 as stored; int4 the nibble, 0..15 (the even column in the low one)
int int8_code(const QuantWeight& w, int64_t n, int64_t k) { return static_cast<const int8_t*>(w.codes)[n * w.K + k]; }

int int4_code(const QuantWeight& w, int64_t n, int64_t k) {
  const uint8_t byte = static_cast<const uint8_t*>(w.codes)[n * (w.K / 2) + k / 2];
  return k % 2 == 0 ? byte & 15 : byte >> 4;
}

// The scale of row n (int8) or of the group of column k in row n (int4), and the int4 zero point
double scale_at(const QuantWeight& w, int64_t n, int64_t k) {
  return w.int4() ? bf16_to_float(w.scale[n * (w.K / w.G) + k / w.G]) : bf16_to_float(w.scale[n]);
}

double zero_at(const QuantWeight& w, int64_t n, int64_t k) { return bf16_to_float(w.zero[n * (w.K / w.G) + k / w.G]); }

// int8 weights, fp32 activations: scale[n] * sum_k q[n, k] x[k]
float int8_f32(const float* x, const QuantWeight& w, int64_t n) {
  double sum = 0.0;
  for (int64_t k = 0; k < w.K; ++k) sum += int8_code(w, n, k) * static_cast<double>(x[k]);
  return static_cast<float>(sum * scale_at(w, n, 0));
}

// dense weights (fp32, or bf16 values), fp32 activations: sum_k w[n, k] x[k]
float dense_f32(const float* x, const QuantWeight& w, int64_t n) {
  double sum = 0.0;
  for (int64_t k = 0; k < w.K; ++k) {
    const double weight = w.kind == WeightKind::f32 ? static_cast<const float*>(w.codes)[n * w.K + k]
                                                    : bf16_to_float(static_cast<const uint16_t*>(w.codes)[n * w.K + k]);
    sum += weight * x[k];
  }
  return static_cast<float>(sum);
}

// int4 weights, fp32 activations: sum_k ((q[n, k] - 8) * scale[n, g] + zero[n, g]) x[k], g the group of k
float int4_f32(const float* x, const QuantWeight& w, int64_t n) {
  double sum = 0.0;
  for (int64_t k = 0; k < w.K; ++k) {
    const double weight = (int4_code(w, n, k) - 8) * scale_at(w, n, k) + zero_at(w, n, k);
    sum += weight * x[k];
  }
  return static_cast<float>(sum);
}

// int8 weights, Q8_0 activations (codes xq, one scale xs per block of kActBlock columns):
// scale[n] * sum_b xs[b] * (sum_{k in b} q[n, k] xq[k])
float int8_q8(const int8_t* xq, const float* xs, const QuantWeight& w, int64_t n) {
  double sum = 0.0;
  for (int64_t b = 0; b < w.K / kActBlock; ++b) {
    int32_t dot = 0;
    for (int64_t k = b * kActBlock; k < (b + 1) * kActBlock; ++k) dot += int8_code(w, n, k) * xq[k];
    sum += static_cast<double>(xs[b]) * dot;
  }
  return static_cast<float>(sum * scale_at(w, n, 0));
}

// int4 weights, Q8_0 activations: the codes times the quantized activations, the offsets (zero - 8 scale)
// times the exact sums of x over each group (a block lies in one group: G is a multiple of kActBlock):
// sum_b xs[b] scale[n, g(b)] (sum_{k in b} q[n, k] xq[k]) + sum_g (zero[n, g] - 8 scale[n, g]) (sum_{k in g} x[k])
float int4_q8(const float* x, const int8_t* xq, const float* xs, const QuantWeight& w, int64_t n) {
  double sum = 0.0;
  for (int64_t b = 0; b < w.K / kActBlock; ++b) {
    int32_t dot = 0;
    for (int64_t k = b * kActBlock; k < (b + 1) * kActBlock; ++k) dot += int4_code(w, n, k) * xq[k];
    sum += static_cast<double>(xs[b]) * scale_at(w, n, b * kActBlock) * dot;
  }
  for (int64_t g = 0; g < w.K / w.G; ++g) {
    double group_sum = 0.0;
    for (int64_t k = g * w.G; k < (g + 1) * w.G; ++k) group_sum += x[k];
    sum += (zero_at(w, n, g * w.G) - 8.0 * scale_at(w, n, g * w.G)) * group_sum;
  }
  return static_cast<float>(sum);
}

}  // namespace

void quantized_products_reference(const float* x, int64_t M, int64_t K, const QuantWeight* ws, float* const* outs, int64_t count,
                                  bool int8_activations) {
  std::vector<int8_t> xq;
  std::vector<float> xs;
  for (int64_t i = 0; i < count; ++i) {
    const QuantWeight& w = ws[i];
    const bool q8 = int8_activations_apply(w, int8_activations);
    if (q8 && xq.empty()) {
      xq.resize(M * K);
      xs.resize(M * K / kActBlock);
      quantize_activations_reference(x, M, K, xq.data(), xs.data());
    }
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      const int8_t* xqm = q8 ? xq.data() + m * K : nullptr;
      const float* xsm = q8 ? xs.data() + m * (K / kActBlock) : nullptr;
      for (int64_t n = 0; n < w.N; ++n) {
        float out;
        if (w.dense())
          out = dense_f32(xm, w, n);
        else if (w.int4())
          out = q8 ? int4_q8(xm, xqm, xsm, w, n) : int4_f32(xm, w, n);
        else
          out = q8 ? int8_q8(xqm, xsm, w, n) : int8_f32(xm, w, n);
        if (w.bias) out += w.bias[n];
        outs[i][m * w.N + n] = out;
      }
    }
  }
}

}  // namespace gencli
