// The extension's Python bindings (pybind11): the products and their plain references, the activation
// quantization, the decode attention, the fused decoding step and the choice of instruction set. The
// work is done in the other files (ops.h); here the arguments are converted and documented.
#include <torch/extension.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <utility>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "kernels.h"
#include "ops.h"

namespace {

using gencli::LinearSpec;
using gencli::NormSpec;

// (weight, bias or None, eps, rms)
NormSpec norm_spec(const py::tuple& t) {
  TORCH_CHECK(t.size() == 4, "decoder_step: a norm is (weight, bias or None, eps, rms)");
  NormSpec n;
  n.weight = t[0].cast<at::Tensor>();
  if (!t[1].is_none()) n.bias = t[1].cast<at::Tensor>();
  n.eps = static_cast<float>(t[2].cast<double>());
  n.rms = t[3].cast<bool>();
  return n;
}

// (codes, scale, zero or None, group size, bias or None); a dense layer: (weight, None, None, -1, bias or None)
LinearSpec linear_spec(const py::tuple& t) {
  TORCH_CHECK(t.size() == 5, "decoder_step: a linear layer is (codes, scale, zero or None, group size, bias or None)");
  LinearSpec l;
  l.codes = t[0].cast<at::Tensor>();
  if (!t[1].is_none()) l.scale = t[1].cast<at::Tensor>();
  if (!t[2].is_none()) l.zero = t[2].cast<at::Tensor>();
  l.group_size = t[3].cast<int64_t>();
  if (!t[4].is_none()) l.bias = t[4].cast<at::Tensor>();
  return l;
}

gencli::SamplingSettings sampling_settings(double temperature, int64_t top_k, double top_p, double min_p, double repetition_penalty) {
  TORCH_CHECK(temperature >= 0 && top_k >= 0 && top_p >= 0 && top_p <= 1 && min_p >= 0 && min_p <= 1 && repetition_penalty > 0,
              "sampling: temperature >= 0, top_k >= 0, top_p in [0, 1], min_p in [0, 1], repetition_penalty > 0");
  gencli::SamplingSettings s;
  s.temperature = static_cast<float>(temperature);
  s.top_k = top_k;
  s.top_p = static_cast<float>(top_p);
  s.min_p = static_cast<float>(min_p);
  s.repetition_penalty = static_cast<float>(repetition_penalty);
  return s;
}

std::vector<LinearSpec> linear_specs(const std::vector<py::tuple>& ts) {
  std::vector<LinearSpec> specs;
  for (const auto& t : ts) specs.push_back(linear_spec(t));
  return specs;
}

void add_layer(gencli::DecoderStack& stack, const py::tuple& norm1, const std::vector<py::tuple>& attn_in, const py::tuple& o_proj,
               const py::tuple& norm2, const std::vector<py::tuple>& mlp_in, const py::tuple& mlp_out, double attn_scale) {
  stack.add_layer(norm_spec(norm1), linear_specs(attn_in), linear_spec(o_proj), norm_spec(norm2), linear_specs(mlp_in), linear_spec(mlp_out),
                  attn_scale);
}

}  // namespace

namespace {

// ProductTuning's fields by name (the Python side's dict keys)
constexpr std::pair<const char*, int64_t gencli::ProductTuning::*> kTuningFields[] = {
    {"int8_ahead", &gencli::ProductTuning::int8_ahead},   {"int4_ahead", &gencli::ProductTuning::int4_ahead},
    {"dense_ahead", &gencli::ProductTuning::dense_ahead},
    {"bf16_ahead", &gencli::ProductTuning::bf16_ahead},   {"task_bytes", &gencli::ProductTuning::task_bytes},
    {"tasks_per_thread", &gencli::ProductTuning::tasks_per_thread}, {"dense_rows", &gencli::ProductTuning::dense_rows},
    {"scale_prefetch", &gencli::ProductTuning::scale_prefetch}, {"int8_rows", &gencli::ProductTuning::int8_rows},
    {"int4_rows", &gencli::ProductTuning::int4_rows}, {"bf16_level", &gencli::ProductTuning::bf16_level},
    {"step_team", &gencli::ProductTuning::step_team}};

std::map<std::string, int64_t> tuning_dict(const gencli::ProductTuning& t) {
  std::map<std::string, int64_t> out;
  for (const auto& [name, field] : kTuningFields) out[name] = t.*field;
  return out;
}

// t with values set by name: unknown names, negative values, dense_rows or int8_rows other than 1 or 4,
// int4_rows other than 1 or 2, bf16_level other than 1 or 2 and scale_prefetch other than 0 or 1
// refused (t unchanged)
gencli::ProductTuning tuned(gencli::ProductTuning t, const std::map<std::string, int64_t>& values) {
  for (const auto& [key, value] : values) {
    auto it = std::find_if(std::begin(kTuningFields), std::end(kTuningFields), [&](const auto& f) { return key == f.first; });
    TORCH_CHECK(it != std::end(kTuningFields), "set_tuning: unknown key '", key, "'");
    TORCH_CHECK(value >= 0, "set_tuning: ", key, " must be >= 0");
    TORCH_CHECK(key != "dense_rows" || value == 1 || value == 4, "set_tuning: dense_rows must be 1 or 4");
    TORCH_CHECK(key != "int8_rows" || value == 1 || value == 4, "set_tuning: int8_rows must be 1 or 4");
    TORCH_CHECK(key != "int4_rows" || value == 1 || value == 2, "set_tuning: int4_rows must be 1 or 2");
    TORCH_CHECK(key != "bf16_level" || value == 1 || value == 2, "set_tuning: bf16_level must be 1 or 2");
    TORCH_CHECK(key != "scale_prefetch" || value <= 1, "set_tuning: scale_prefetch must be 0 or 1");
    TORCH_CHECK(key != "step_team" || value <= 1, "set_tuning: step_team must be 0 or 1");
    t.*(it->second) = value;
  }
  t.task_bytes = std::max<int64_t>(t.task_bytes, 1);
  return t;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using gencli::OptionalTensor;

  m.def(
      "int8_gemv",
      [](const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, bool int8_activations, const OptionalTensor& bias) {
        return gencli::int8_gemv(x, q, scale, int8_activations, bias);
      },
      "x (..., K) f32 @ (q int8 (N, K) * scale bf16 (N,)).T (+ bias f32 (N,))", py::arg("x"), py::arg("q"), py::arg("scale"),
      py::arg("int8_activations") = false, py::arg("bias") = py::none());
  m.def(
      "int4_gemv",
      [](const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero, int64_t G, bool int8_activations,
         const OptionalTensor& bias) { return gencli::int4_gemv(x, packed, scale, zero, G, int8_activations, bias); },
      "x (..., K) f32 @ ((q - 8) * scale + zero).T (+ bias), q packed (N, K/2), groups of G", py::arg("x"), py::arg("packed"),
      py::arg("scale"), py::arg("zero"), py::arg("group_size"), py::arg("int8_activations") = false, py::arg("bias") = py::none());
  m.def(
      "int8_gemv_many",
      [](const at::Tensor& x, const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& scales, bool int8_activations,
         const std::vector<OptionalTensor>& biases) { return gencli::int8_gemv_many(x, qs, scales, int8_activations, biases); },
      "[x @ (q_i * scale_i).T (+ bias_i)] for several int8 weights and one x (quantized once)", py::arg("x"), py::arg("qs"),
      py::arg("scales"), py::arg("int8_activations"), py::arg("biases"));
  m.def(
      "int4_gemv_many",
      [](const at::Tensor& x, const std::vector<at::Tensor>& packed, const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& zeros,
         int64_t G, bool int8_activations, const std::vector<OptionalTensor>& biases) {
        return gencli::int4_gemv_many(x, packed, scales, zeros, G, int8_activations, biases);
      },
      "[x @ ((q_i - 8) * scale_i + zero_i).T (+ bias_i)] for several int4 weights and one x", py::arg("x"), py::arg("packed"),
      py::arg("scales"), py::arg("zeros"), py::arg("group_size"), py::arg("int8_activations"), py::arg("biases"));
  m.def(
      "int8_gemv_reference",
      [](const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, bool int8_activations, const OptionalTensor& bias) {
        return gencli::int8_gemv(x, q, scale, int8_activations, bias, /*reference=*/true);
      },
      "int8_gemv by the plain scalar kernels (csrc/reference.cpp), for the tests", py::arg("x"), py::arg("q"), py::arg("scale"),
      py::arg("int8_activations") = false, py::arg("bias") = py::none());
  m.def(
      "int4_gemv_reference",
      [](const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero, int64_t G, bool int8_activations,
         const OptionalTensor& bias) { return gencli::int4_gemv(x, packed, scale, zero, G, int8_activations, bias, /*reference=*/true); },
      "int4_gemv by the plain scalar kernels (csrc/reference.cpp), for the tests", py::arg("x"), py::arg("packed"), py::arg("scale"),
      py::arg("zero"), py::arg("group_size"), py::arg("int8_activations") = false, py::arg("bias") = py::none());
  m.def(
      "dense_gemv_many",
      [](const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<OptionalTensor>& biases) {
        return gencli::dense_gemv_many(x, weights, biases);
      },
      "[x @ W_i.T (+ bias_i)] for dense weights W_i (N_i, K) all float32 or all bfloat16 (fp32 products of their values)",
      py::arg("x"), py::arg("weights"), py::arg("biases"));
  m.def(
      "dense_gemv",
      [](const at::Tensor& x, const at::Tensor& w, const OptionalTensor& bias) { return gencli::dense_gemv_many(x, {w}, {bias})[0]; },
      "x (..., K) f32 @ W.T (+ bias), W (N, K) float32 or bfloat16 (fp32 products of its values)", py::arg("x"), py::arg("weight"),
      py::arg("bias") = py::none());
  m.def(
      "dense_gemv_reference",
      [](const at::Tensor& x, const at::Tensor& w, const OptionalTensor& bias) { return gencli::dense_gemv_many(x, {w}, {bias}, true)[0]; },
      "dense_gemv by the plain scalar kernels (csrc/reference.cpp), for the tests", py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def(
      "quantize_activations", [](const at::Tensor& x, bool reference) { return gencli::quantize_activations(x, reference); },
      "x (M, K) f32 -> (codes int8 (M, K), scales f32 (M, K/32)): the int8 activations the integer kernels use (reference: by the "
      "plain scalar code)",
      py::arg("x"), py::arg("reference") = false);

  m.def("winograd_conv3x3", &gencli::winograd_conv3x3,
        "3x3 convolution (stride 1, padding 1) of x (N, C, H, W) float32 channels-last by Winograd F(2x2, 3x3): u the weight's "
        "transform (16, C, K); + bias (K), + residual (N, K, H, W); chunk: tiles per chunk (0: default); reference: the scalar transforms",
        py::arg("x"), py::arg("u"), py::arg("bias") = py::none(), py::arg("residual") = py::none(), py::arg("chunk") = 0,
        py::arg("reference") = false);
  m.def("decode_attention", &gencli::decode_attention,
        "softmax(q k^T * scale) v for one query position: q (B, H, 1, D), k, v (B, Hkv, L, D) float32, key_mask (B, L) bool", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("key_mask") = py::none());

  py::class_<gencli::DecoderStack>(m, "DecoderStack",
                                   "Pre-norm decoder layers with quantized or dense projections, one decoding step in one call (csrc/decoder_step.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, const std::string&, bool>(), py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("activation"), py::arg("rotary"))
      .def("add_layer", &add_layer, "linear: (codes, scale, zero or None, group size, bias or None), dense: (weight, None, None, -1, bias or None); norm: (weight, bias or None, eps, rms)",
           py::arg("norm1"), py::arg("attn_in"), py::arg("o_proj"), py::arg("norm2"), py::arg("mlp_in"), py::arg("mlp_out"), py::arg("attn_scale"))
      .def("step", &gencli::DecoderStack::step, py::arg("x"), py::arg("keys"), py::arg("values"), py::arg("length"), py::arg("key_mask") = py::none(),
           py::arg("cos") = py::none(), py::arg("sin") = py::none(), py::arg("int8_activations") = true, py::arg("positions") = py::none())
      .def("token_step", &gencli::DecoderStack::token_step,
           "ids (B) int64 at positions (B) (None: length) through the embeddings, every layer, the final norm and the head: logits (B, V) "
           "float32 written, next (B) int64 the greedy choices where given",
           py::arg("ids"), py::arg("positions"), py::arg("keys"), py::arg("values"), py::arg("length"), py::arg("key_mask") = py::none(),
           py::arg("int8_activations") = true, py::arg("logits"), py::arg("next") = py::none())
      .def("greedy_steps", &gencli::DecoderStack::greedy_steps,
           "up to tokens.size(1) greedy token steps in one call, each step's choices fed back as the next ids: tokens (B, steps) "
           "written; a row finishes when its budget in left (B) runs out or it chooses one of stop_ids; returns the steps run",
           py::arg("ids"), py::arg("positions"), py::arg("keys"), py::arg("values"), py::arg("length"), py::arg("key_mask"),
           py::arg("int8_activations"), py::arg("tokens"), py::arg("stop_ids"), py::arg("left"), py::arg("last_position"),
           py::arg("screen") = false)
      .def("set_head_screen", &gencli::DecoderStack::set_head_screen,
           "the head's int8 copy for screened greedy steps: codes (V, hidden) int8, scale (V) (bf16), bound (V) float32 per unit of |h|",
           py::arg("codes"), py::arg("scale"), py::arg("bound"))
      .def_property_readonly("has_head_screen", &gencli::DecoderStack::has_head_screen)
      .def_property_readonly("screened_steps", &gencli::DecoderStack::screened_steps)
      .def_property_readonly("screen_fallbacks", &gencli::DecoderStack::screen_fallbacks)
      .def(
          "sample_steps",
          [](gencli::DecoderStack& stack, const at::Tensor& ids, const OptionalTensor& positions, const at::Tensor& keys, const at::Tensor& values,
             int64_t length, const OptionalTensor& key_mask, bool int8_activations, at::Tensor tokens, const at::Tensor& stop_ids,
             const at::Tensor& left, int64_t last_position, double temperature, int64_t top_k, double top_p, double min_p,
             double repetition_penalty, const at::Tensor& uniforms, const OptionalTensor& seen) {
            return stack.sample_steps(ids, positions, keys, values, length, key_mask, int8_activations, tokens, stop_ids, left, last_position,
                                      sampling_settings(temperature, top_k, top_p, min_p, repetition_penalty), uniforms, seen);
          },
          "greedy_steps with each step's tokens sampled as sample_tokens does: uniforms (steps, B) float64 (row b of step s draws "
          "uniforms[s, b]; empty when temperature is 0), seen (B, n) the tokens the repetition penalty counts before the first step",
          py::arg("ids"), py::arg("positions"), py::arg("keys"), py::arg("values"), py::arg("length"), py::arg("key_mask"),
          py::arg("int8_activations"), py::arg("tokens"), py::arg("stop_ids"), py::arg("left"), py::arg("last_position"), py::arg("temperature"),
          py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("repetition_penalty"), py::arg("uniforms"), py::arg("seen") = py::none())
      .def(
          "set_embeddings",
          [](gencli::DecoderStack& stack, const at::Tensor& tokens, const OptionalTensor& positions) {
            stack.set_embeddings(tokens, positions.has_value() ? *positions : at::Tensor());
          },
          "the input embeddings: token rows (V, hidden) float32, position rows (P, hidden) added or None", py::arg("tokens"),
          py::arg("positions") = py::none())
      .def_property_readonly("has_embeddings", &gencli::DecoderStack::has_embeddings)
      .def(
          "set_head", [](gencli::DecoderStack& stack, const py::tuple& head) { stack.set_head(linear_spec(head)); },
          "the LM head after the final norm, as add_layer's linear layers: token_step() then computes logits", py::arg("head"))
      .def_property_readonly("has_head", &gencli::DecoderStack::has_head)
      .def_property_readonly("vocab_size", &gencli::DecoderStack::vocab_size)
      .def("set_rotary", &gencli::DecoderStack::set_rotary,
           "RoPE's inverse frequencies (head_dim / 2) and attention factor: step() then takes positions instead of cos and sin",
           py::arg("inv_freq"), py::arg("attention_factor"))
      .def_property_readonly("has_rotary_tables", &gencli::DecoderStack::has_rotary_tables)
      .def(
          "set_final_norm", [](gencli::DecoderStack& stack, const py::tuple& norm) { stack.set_final_norm(norm_spec(norm)); },
          "the model's norm after the last layer (weight, bias or None, eps, rms): step() then returns normalized states", py::arg("norm"))
      .def_property_readonly("has_final_norm", &gencli::DecoderStack::has_final_norm)
      .def_property_readonly("num_layers", &gencli::DecoderStack::num_layers);
  m.def("greedy_choices", &gencli::greedy_choices,
        "each row's greedy choice as the token step makes it with `parts` threads (torch.argmax's), for the tests", py::arg("logits"),
        py::arg("parts"));
  m.def(
      "sample_tokens",
      [](const at::Tensor& logits, double temperature, int64_t top_k, double top_p, double min_p, double repetition_penalty,
         const at::Tensor& uniforms, const OptionalTensor& seen) {
        return gencli::sample_tokens(logits, sampling_settings(temperature, top_k, top_p, min_p, repetition_penalty), uniforms, seen);
      },
      "each row of logits (B, V)'s next token as gencli.pipelines.text.sampling chooses it (repetition penalty, temperature, top-k, "
      "top-p, min-p; temperature 0 greedy), row b drawing with uniforms[b] (float64 in [0, 1)); seen (B, n) the tokens so far",
      py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("repetition_penalty"),
      py::arg("uniforms"), py::arg("seen") = py::none());
  m.def("head_screen", &gencli::head_screen,
        "a dense head's int8 copy and bounds for DecoderStack.set_head_screen: (codes (V, D) int8, scale (V) bf16, bound (V) float32 "
        "per unit of |h|)",
        py::arg("weight"));
  m.def("activation", &gencli::activation, "act(x) (* up): the decoder step's activations ('gelu_tanh', 'silu', 'relu'), for the tests",
        py::arg("name"), py::arg("x"), py::arg("up") = py::none());

  m.def("isa", []() { return gencli::isa_name(gencli::active_isa()); }, "the vector instruction set the kernels use ('' when none)");
  m.def(
      "int_isa", []() -> std::string { return gencli::active_isa() == gencli::Isa::none ? "" : gencli::use_vnni() ? "avx512vnni" : "avx2"; },
      "the instruction set of the int8-activation kernels ('' when none)");
  m.def(
      "use_isa", [](const std::string& name) { return gencli::set_active_isa(gencli::isa_named(name)); },
      "use 'avx512' or 'avx2' from now on (False, and no change, when the CPU lacks it)");
  m.def(
      "tuning", []() { return tuning_dict(gencli::product_tuning()); },
      "the decoding products' per-CPU choices in use (prefetch distances, rows at once, bytes a task)");
  m.def(
      "set_tuning", [](const std::map<std::string, int64_t>& values) { gencli::product_tuning() = tuned(gencli::product_tuning(), values); },
      "change the decoding products' choices (keys of tuning()); the benches and the tests", py::arg("values"));
  m.def(
      "default_tuning", [](bool amd) { return tuning_dict(gencli::product_tuning_for(amd)); },
      "the choices made for an AMD CPU (True) or another x86 one (False)", py::arg("amd"));
  m.def("cpu_vendor_amd", &gencli::cpu_is_amd, "whether this CPU is AMD's");
  m.def(
      "scratch_misalignment",
      [](const std::vector<int64_t>& sizes) {
        // the scratch vectors' allocator, grown through the given sizes as the kernels grow theirs
        std::vector<int64_t> out;
        gencli::AlignedVector<float> f;
        gencli::AlignedVector<int8_t> b;
        for (int64_t n : sizes) {
          f.resize(n);
          b.resize(n);
          out.push_back(reinterpret_cast<uintptr_t>(f.data()) % 64);
          out.push_back(reinterpret_cast<uintptr_t>(b.data()) % 64);
        }
        return out;
      },
      "bytes past a cache line's start of the kernels' scratch vectors (float and int8) at each size: all 0", py::arg("sizes"));
  m.def("use_attention_isa", &gencli::use_attention_isa, "decode_attention: use 'avx512', 'avx2' or 'scalar' from now on (False beyond the CPU)");
}
