// The tensor-level operations bindings.cpp exposes to Python: the products (quant_gemv.cpp), the decode
// attention (decode_attention.cpp) and the fused decoding step (decoder_step.cpp), their inputs checked.
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "kernels.h"

namespace gencli {

class StepTeam;
using OptionalTensor = c10::optional<at::Tensor>;

// The weight of a layer's tensors, checked: codes (N, K) int8 or (N, K/2) packed uint8; scale (and zero)
// and bias (or undefined) in any floating dtype, converted to bf16 / fp32 where they are not (the converted
// copies appended to keep, which must outlive the weight).
QuantWeight quant_weight(bool int4, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero, int64_t G,
                         const at::Tensor& bias, std::vector<at::Tensor>& keep);

// A dense weight (float32 or bfloat16 values (N, K), contiguous, referenced in place) and its bias (or
// undefined, converted to fp32 into keep where it is not).
QuantWeight dense_weight(const at::Tensor& values, const at::Tensor& bias, std::vector<at::Tensor>& keep);

// x (..., K) float32, any layout, times each dense weight (all float32 or all bfloat16): the list of
// (..., N_i) results, fp32 products of the weights' values; reference: the plain kernels of reference.cpp.
std::vector<at::Tensor> dense_gemv_many(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<OptionalTensor>& biases,
                                        bool reference = false);

// x (..., K) float32, any layout, times each weight: the list of (..., N_i) results. int8 activations where
// asked and the shape allows (int8_activations_apply), else fp32; reference: the plain kernels of
// reference.cpp instead of the vector ones.
std::vector<at::Tensor> int8_gemv_many(const at::Tensor& x, const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& scales,
                                       bool int8_activations, const std::vector<OptionalTensor>& biases, bool reference = false);
std::vector<at::Tensor> int4_gemv_many(const at::Tensor& x, const std::vector<at::Tensor>& packed, const std::vector<at::Tensor>& scales,
                                       const std::vector<at::Tensor>& zeros, int64_t G, bool int8_activations,
                                       const std::vector<OptionalTensor>& biases, bool reference = false);
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, bool int8_activations, const OptionalTensor& bias,
                     bool reference = false);
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero, int64_t G,
                     bool int8_activations, const OptionalTensor& bias, bool reference = false);
// x (M, K) float32 contiguous, K a multiple of kActBlock: (codes int8 (M, K), scales float32 (M, K / kActBlock))
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x, bool reference = false);

// key_mask (B, L) bool, or none: its flags (the contiguous tensor kept in keep), or null; who names the caller
const bool* key_mask_flags(const OptionalTensor& key_mask, int64_t B, int64_t L, at::Tensor& keep, const char* who);
// q (B, H, 1, D), k and v (B, Hkv, L, D) float32, the last dimension contiguous: (B, H, 1, D)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, const OptionalTensor& key_mask);
// the decode attention's code path from now on: "avx512", "avx2" or "scalar" (false, and no change, beyond the CPU)
bool use_attention_isa(const std::string& name);

// A 3x3 convolution, stride 1, padding 1, one group, by Winograd's F(2x2, 3x3) (winograd_conv.cpp): x (N, C, H, W)
// float32 channels-last, u the weight's transform (16, C, K), bias (K) and residual (N, K, H, W) optional;
// chunk: tiles per chunk (0: the default); reference: the transforms by the plain scalar code (for the
// tests; also what a CPU without AVX2 runs). Returns (N, K, H, W) channels-last.
at::Tensor winograd_conv3x3(const at::Tensor& x, const at::Tensor& u, const OptionalTensor& bias, const OptionalTensor& residual,
                            int64_t chunk = 0, bool reference = false);

// the greedy choice of each row of logits (B, V) as the token step makes it with `parts` threads (each the
// first largest of its slice of the row, then the first largest of theirs): torch.argmax's, for the tests
at::Tensor greedy_choices(const at::Tensor& logits, int64_t parts);

// each row of logits (B, V)'s token as sample_token chooses it (the logits are not changed): uniforms (B)
// float64 (empty when greedy), seen (B, n) int64 the tokens the repetition penalty counts, or none
at::Tensor sample_tokens(const at::Tensor& logits, const SamplingSettings& s, const at::Tensor& uniforms, const OptionalTensor& seen);

// A dense head's screen for DecoderStack::set_head_screen: (codes (V, D) int8, scale (V) bf16, bound (V)
// float32), weight float32 or bfloat16 (V, D); see decoder_step.head_screen in Python for the bound.
std::tuple<at::Tensor, at::Tensor, at::Tensor> head_screen(const at::Tensor& weight);

// the MLP activations of the decoder step
enum class Activation { gelu_tanh, silu, relu };

// act(x) (* up): the decoder step's activations ("gelu_tanh", "silu", "relu") on a copy of x
at::Tensor activation(const std::string& name, const at::Tensor& x, const OptionalTensor& up);

// A layer's parts as the decoder step takes them: a norm (LayerNorm, or RMSNorm where rms; bias
// undefined where none) and a linear layer: quantized (int8 or packed int4 codes; zero undefined for int8,
// bias undefined where none) or dense (float32 or bfloat16 values (N, K) as codes, scale undefined).
struct NormSpec {
  at::Tensor weight, bias;
  float eps = 1e-5f;
  bool rms = false;
};
struct LinearSpec {
  at::Tensor codes, scale, zero;
  int64_t group_size = -1;
  at::Tensor bias;
};

// Pre-norm decoder layers (GPT-2, Llama, Mistral, Qwen2) with quantized or dense projections: one decoding step of
// all of them in one call. The layers' tensors are referenced, not copied (except scales and biases in
// another dtype).
class DecoderStack {
 public:
  DecoderStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, const std::string& activation, bool rotary);

  // attn_in: one fused q/k/v projection or three; mlp_in: one input projection or two (gate, up)
  void add_layer(const NormSpec& norm1, const std::vector<LinearSpec>& attn_in, const LinearSpec& o_proj, const NormSpec& norm2,
                 const std::vector<LinearSpec>& mlp_in, const LinearSpec& mlp_out, double attn_scale);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // the norm after the last layer (the model's final norm): step() then leaves x normalized
  void set_final_norm(const NormSpec& norm);
  bool has_final_norm() const { return final_norm_.weight.defined(); }

  // RoPE's inverse frequencies (head_dim / 2) and attention factor: step() then computes the cos and sin
  // rows of the positions it is given (cos(p * inv_freq) * factor, halves repeated: RotaryEmbedding's tables)
  void set_rotary(const at::Tensor& inv_freq, double attention_factor);
  bool has_rotary_tables() const { return inv_freq_.defined(); }

  // the input embeddings: token rows (V, hidden) float32, and position rows (P, hidden) added where the
  // model has them (GPT-2), or undefined: token_step() then takes token ids
  void set_embeddings(const at::Tensor& tokens, const at::Tensor& positions);
  bool has_embeddings() const { return embed_tokens_.defined(); }

  // the LM head after the final norm (a linear layer of any kind the layers take): token_step() then
  // computes the logits
  void set_head(const LinearSpec& head);
  bool has_head() const { return head_.codes != nullptr; }

  // A screen of a dense head (f32 or bf16) for greedy steps: its int8 copy, codes (V, hidden) int8 and one
  // bf16 scale a row, and bound (V) float32, each row's bound of |fp32 head logit - copy's logit| per unit
  // of the hidden state's norm (the copy's error and both products' rounding). greedy_steps(screen) then
  // reads the copy, keeps the rows whose logits the bounds cannot rule out and recomputes them from the
  // head: the head's choice, for a quarter (f32) or half (bf16) of its bytes.
  void set_head_screen(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bound);
  bool has_head_screen() const { return screen_.codes != nullptr; }
  // greedy steps the screen decided, and those it left to the whole head (too many candidates, non-finite values)
  int64_t screened_steps() const { return screened_; }
  int64_t screen_fallbacks() const { return screen_fallbacks_; }
  int64_t vocab_size() const { return head_.N; }

  // x (B, hidden) float32 contiguous, updated in place (the residual stream, or its final norm where the
  // stack has one); keys, values (layers, B, Hkv, capacity, D) float32,
  // the new position written at `length`; key_mask (B, length + 1) bool or None; cos, sin (B, D) or None, or
  // positions (B) where the stack has set_rotary's frequencies
  void step(at::Tensor x, const at::Tensor& keys, const at::Tensor& values, int64_t length, const OptionalTensor& key_mask,
            const OptionalTensor& cos, const OptionalTensor& sin, bool int8_activations, const OptionalTensor& positions = {});

  // A whole decoding step from token ids to logits (set_embeddings, set_final_norm and set_head given):
  // ids (B) int64 at positions (B) int64 (none: `length` for every row), the caches and mask as step()'s;
  // logits (B, V) float32 contiguous written; next (B) int64, where given, the greedy choices
  // (torch.argmax's: the first largest logit, the first NaN before any number)
  void token_step(const at::Tensor& ids, const OptionalTensor& positions, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                  const OptionalTensor& key_mask, bool int8_activations, at::Tensor logits, const OptionalTensor& next);

  // Up to tokens.size(1) greedy decoding steps in one call, each step's choices the next step's ids (as token_step
  // with next): ids (B) the first step's tokens, positions (B) (none: `length` on, every row), each step's
  // positions one further (at most last_position); key_mask (B, >= length + steps) bool or none, each step
  // reading its first length + 1 + step columns; tokens (B, steps) int64, column s written with step s's
  // choices; left (B) each row's budget of new tokens (0: finished), ended early by a choice in stop_ids.
  // Returns the number of steps run: fewer than asked where every row finished.
  int64_t greedy_steps(const at::Tensor& ids, const OptionalTensor& positions, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                       const OptionalTensor& key_mask, bool int8_activations, at::Tensor tokens, const at::Tensor& stop_ids,
                       const at::Tensor& left, int64_t last_position, bool screen = false);

  // The same steps with each step's tokens sampled (sample_token) instead of chosen greedily: uniforms
  // (steps, B) float64, row b of step s drawing with uniforms[s, b] (empty when s.temperature is 0); seen
  // (B, n) int64 the tokens each row has seen before the first step (the repetition penalty; each step's
  // choice is added for the next), or none.
  int64_t sample_steps(const at::Tensor& ids, const OptionalTensor& positions, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                       const OptionalTensor& key_mask, bool int8_activations, at::Tensor tokens, const at::Tensor& stop_ids,
                       const at::Tensor& left, int64_t last_position, const SamplingSettings& s, const at::Tensor& uniforms,
                       const OptionalTensor& seen);

 private:
  struct Layer {
    NormSpec norm1, norm2;  // weight and bias float32 contiguous
    std::vector<QuantWeight> attn_in, mlp_in;
    QuantWeight o_proj, mlp_out;
    float scale = 1.f;
  };

  // what one step's threads share: x (the residual stream, written once at the end), the caches, the
  // products' results, the RoPE rows, the mask, the caches' strides (layer, sequence, head, position);
  // a token step's logits, greedy choices and the index of each thread's first largest logit a row (or null)
  struct Shared {
    float *x, *keys, *values, *qkv, *att, *proj, *mid;
    const float *cos, *sin;
    const bool* mask;
    int64_t ks[4], vs[4];
    int64_t B, length;
    bool int8_activations;
    float* logits = nullptr;
    int64_t* next = nullptr;
    int64_t* best_at = nullptr;  // (B, threads)
    bool screen = false;          // the greedy choices through the head's screen
    float* screen_low = nullptr;  // (B, threads) each thread's largest lower bound of a logit
    int* screen_fallback = nullptr;  // set by thread 0: the whole head decides this step
  };
  // the greedy choices through the screen (every thread calls it): false where the whole head must decide
  bool screened_choices(const Shared& sh, StepTeam& team, int64_t me, const float* h) const;
  // the caches checked and the step run: the RoPE rows from cos/sin or from the positions pp (B)
  void launch(Shared sh, const at::Tensor& keys, const at::Tensor& values, const OptionalTensor& key_mask, const OptionalTensor& cos,
              const OptionalTensor& sin, const int64_t* pp);
  void run_layers(const Shared& shared, StepTeam& team, int64_t me, bool seated) const;
  // the embeddings of ids (B) at positions pp (B), the layers, the final norm and the head: logits (B, V), and
  // the greedy choices into next (B) where not null
  void run_token(const int64_t* ip, const int64_t* pp, int64_t B, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                 const OptionalTensor& key_mask, bool int8_activations, float* logits, int64_t* next, bool screen = false);
  void check_token_step() const;
  // greedy_steps and sample_steps: the choices by the token step's argmax (sampling null) or by sample_token
  int64_t run_steps(const at::Tensor& ids, const OptionalTensor& positions, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                    const OptionalTensor& key_mask, bool int8_activations, at::Tensor tokens, const at::Tensor& stop_ids,
                    const at::Tensor& left, int64_t last_position, const SamplingSettings* sampling, const at::Tensor& uniforms,
                    const OptionalTensor& seen, bool screen = false);

  NormSpec norm(const NormSpec& spec);
  QuantWeight linear(const LinearSpec& spec);

  int64_t hidden_, H_, Hkv_, D_;
  Activation act_;
  bool rotary_;
  std::vector<Layer> layers_;
  NormSpec final_norm_;  // weight undefined: none
  at::Tensor inv_freq_;  // float32 (D / 2), or undefined
  float rotary_factor_ = 1.f;
  at::Tensor embed_tokens_, embed_positions_;  // float32 (V, hidden) and (P, hidden), or undefined
  QuantWeight head_;                           // codes null: none
  QuantWeight screen_;                         // the head's int8 copy (codes null: none)
  at::Tensor screen_bound_;                    // float32 (V): each row's bound per unit of |h|
  mutable int64_t screened_ = 0, screen_fallbacks_ = 0;
  std::vector<at::Tensor> keep_;  // every tensor the layers point into
};

}  // namespace gencli
