// One decoding step of a stack of pre-norm decoder layers (GPT-2, Llama, Mistral, Qwen2) with
// weight-only quantized projections (int8, int4) or dense ones (fp32, or bf16 values multiplied in fp32),
// in one native call a token.
//
// Decoding one token through a GPT-2-sized model from Python costs ~20 tensor operations a layer
// besides the products: norms, views, rotary, the cache write, residual adds, the activation, each a
// few microseconds of dispatch, and each running on caches the weight streams have just evicted. Here
// a layer is: norm (LayerNorm or RMSNorm) -> the q/k/v products (one fused weight or three, int8,
// int4, bf16 or fp32: quantized_products) -> rotary (half-split, per-row tables) -> keys/values written into the
// cache -> attention of the new position over the cache (attend_heads) -> output product ->
// residual -> norm -> MLP (act(fc) or act(gate) * up) -> down product -> residual, with scratch
// buffers reused from step to step. At more than one of torch's threads the whole step is one parallel
// region (team.h): every thread runs the rest (a few thousand floats a layer) on copies of its own, the
// products' tasks and the attention's heads are shared out, and the threads meet at a barrier where the
// next part needs the others' results (step_team 0: a parallel region for each product and attention).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "cpu_features.h"
#include "kernels.h"
#include "ops.h"
#include "team.h"

namespace gencli {

GENCLI_TARGET_AVX512
namespace step_avx512 {
#include "simd_avx512.inc"
#include "activations.inc"

// the index of the first largest of p[0, n) (n > 0) by whole vectors: the maximum, then its first place;
// a NaN anywhere: -1 (the caller finds the first one)
inline int64_t first_largest(const float* p, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(p + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  float best = _mm512_reduce_max_ps(m);
  for (int64_t j = i; j < n; ++j) {
    if (p[j] != p[j]) return -1;
    best = std::max(best, p[j]);
  }
  if (unordered) return -1;
  const __m512 b = _mm512_set1_ps(best);
  for (i = 0; i + 16 <= n; i += 16)
    if (const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i), b, _CMP_EQ_OQ)) return i + __builtin_ctz(hit);
  for (; i < n; ++i)
    if (p[i] == best) return i;
  return 0;  // (unreachable: best is one of them)
}
}  // namespace step_avx512
GENCLI_TARGET_END

GENCLI_TARGET_AVX2
namespace step_avx2 {
#include "simd_avx2.inc"
#include "activations.inc"
}  // namespace step_avx2
GENCLI_TARGET_END

namespace {

Activation parse_act(const std::string& name) {
  if (name == "gelu_tanh") return Activation::gelu_tanh;
  if (name == "silu") return Activation::silu;
  if (name == "relu") return Activation::relu;
  TORCH_CHECK(false, "decoder_step: unknown activation '", name, "' (gelu_tanh, silu, relu)");
}

// x (n) <- act(x) (* up, gated MLPs), in place: whole vectors by activations.inc, the rest here
void activate(Activation act, float* x, const float* up, int64_t n) {
  int64_t i = 0;
  const Isa isa = active_isa();
  if (act == Activation::gelu_tanh) {
    i = isa == Isa::avx512 ? step_avx512::gelu_tanh(x, n) : isa == Isa::avx2 ? step_avx2::gelu_tanh(x, n) : 0;
    for (; i < n; ++i) x[i] = 0.5f * x[i] * (1.f + std::tanh(0.7978845608028654f * (x[i] + 0.044715f * x[i] * x[i] * x[i])));
  } else if (act == Activation::silu) {
    if (up) {
      i = isa == Isa::avx512 ? step_avx512::silu_mul(x, up, n) : isa == Isa::avx2 ? step_avx2::silu_mul(x, up, n) : 0;
      for (; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i])) * up[i];
      return;
    }
    for (; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i]));
  } else {
    for (; i < n; ++i) x[i] = std::max(x[i], 0.f);
  }
  if (up && act != Activation::silu)
    for (i = 0; i < n; ++i) x[i] *= up[i];
}

// out (n) = norm(x (n)), statistics in double (n is a few thousand: no cost worth saving)
void normalize(const NormSpec& nm, const float* x, float* out, int64_t n) {
  const float* w = nm.weight.data_ptr<float>();
  if (nm.rms) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / n + nm.eps));
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
    return;
  }
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const double mean = sum / n;
  double var = 0.0;
  for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  const float r = static_cast<float>(1.0 / std::sqrt(var / n + nm.eps)), m = static_cast<float>(mean);
  const float* b = nm.bias.defined() ? nm.bias.data_ptr<float>() : nullptr;
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] - m) * r * w[i] + (b ? b[i] : 0.f);
}

// x (n heads of D, contiguous) rotated by the half-split tables cos, sin (D): transformers' rotate_half
// convention, x * cos + (-x2, x1) * sin
void rotate(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t h2 = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * D;
    for (int64_t i = 0; i < h2; ++i) {
      const float a = xh[i], b = xh[i + h2];
      xh[i] = a * cos[i] - b * sin[i];
      xh[i + h2] = b * cos[i + h2] + a * sin[i + h2];
    }
  }
}

// the first largest of a row of logits from the first largest of each of its T slices (in order; -1 for
// an empty slice): a later slice's wins where it is larger, or a NaN after a number
int64_t greedy_choice(const float* row, const int64_t* picks, int64_t T) {
  int64_t pick = -1;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t c = picks[t];
    if (c >= 0 && (pick < 0 || (row[pick] == row[pick] && (row[c] > row[pick] || row[c] != row[c])))) pick = c;
  }
  return pick;
}

}  // namespace

int64_t first_largest(const float* p, int64_t begin, int64_t end) {
  if (begin >= end) return -1;
  if (active_isa() == Isa::avx512) {
    const int64_t pick = step_avx512::first_largest(p + begin, end - begin);
    if (pick >= 0) return begin + pick;
  }
  int64_t pick = begin;
  for (int64_t i = begin + 1; i < end && p[pick] == p[pick]; ++i)
    if (p[i] > p[pick] || p[i] != p[i]) pick = i;
  return pick;
}

at::Tensor greedy_choices(const at::Tensor& logits, int64_t parts) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.device().is_cpu() && parts > 0,
              "greedy_choices: float32 (B, V) logits, parts > 0");
  const at::Tensor l = logits.contiguous();
  const int64_t B = l.size(0), V = l.size(1);
  at::Tensor out = at::empty({B}, at::kLong);
  std::vector<int64_t> picks(parts);
  for (int64_t b = 0; b < B; ++b) {
    const float* row = l.data_ptr<float>() + b * V;
    for (int64_t t = 0; t < parts; ++t) picks[t] = first_largest(row, V * t / parts, V * (t + 1) / parts);
    out[b] = greedy_choice(row, picks.data(), parts);
  }
  return out;
}

at::Tensor activation(const std::string& name, const at::Tensor& x, const OptionalTensor& up) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "activation: float32 CPU tensors");
  at::Tensor y = x.contiguous().clone(), u;
  if (up.has_value() && up->defined()) {
    u = up->to(at::kFloat).contiguous();
    TORCH_CHECK(u.numel() == y.numel(), "activation: up must have x's size");
  }
  activate(parse_act(name), y.data_ptr<float>(), u.defined() ? u.data_ptr<float>() : nullptr, y.numel());
  return y;
}

DecoderStack::DecoderStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, const std::string& activation, bool rotary)
    : hidden_(hidden), H_(heads), Hkv_(kv_heads), D_(head_dim), act_(parse_act(activation)), rotary_(rotary) {
  TORCH_CHECK(active_isa() != Isa::none, "decoder_step: this CPU has neither AVX-512 nor AVX2");
  TORCH_CHECK(hidden > 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && heads % kv_heads == 0 && (!rotary || head_dim % 2 == 0),
              "decoder_step: bad head counts");
}

void DecoderStack::add_layer(const NormSpec& norm1, const std::vector<LinearSpec>& attn_in, const LinearSpec& o_proj, const NormSpec& norm2,
                             const std::vector<LinearSpec>& mlp_in, const LinearSpec& mlp_out, double attn_scale) {
  Layer l;
  l.norm1 = norm(norm1);
  l.norm2 = norm(norm2);
  for (const auto& t : attn_in) l.attn_in.push_back(linear(t));
  l.o_proj = linear(o_proj);
  for (const auto& t : mlp_in) l.mlp_in.push_back(linear(t));
  l.mlp_out = linear(mlp_out);
  l.scale = static_cast<float>(attn_scale);
  const int64_t q = H_ * D_, kv = Hkv_ * D_;
  if (l.attn_in.size() == 1) {
    TORCH_CHECK(l.attn_in[0].N == q + 2 * kv, "decoder_step: a fused q/k/v projection must have ", q + 2 * kv, " outputs");
  } else {
    TORCH_CHECK(l.attn_in.size() == 3 && l.attn_in[0].N == q && l.attn_in[1].N == kv && l.attn_in[2].N == kv,
                "decoder_step: the q, k, v projections do not match the heads");
  }
  for (const auto& w : l.attn_in) TORCH_CHECK(w.K == hidden_, "decoder_step: the q/k/v projections must take the hidden size");
  TORCH_CHECK(l.o_proj.K == q && l.o_proj.N == hidden_, "decoder_step: the output projection does not match");
  TORCH_CHECK((l.mlp_in.size() == 1 || (l.mlp_in.size() == 2 && l.mlp_in[1].N == l.mlp_in[0].N)) && l.mlp_in[0].K == hidden_,
              "decoder_step: the MLP takes one input projection or two of one size (gate, up)");
  TORCH_CHECK(l.mlp_out.K == l.mlp_in[0].N && l.mlp_out.N == hidden_, "decoder_step: the MLP's output projection does not match");
  layers_.push_back(std::move(l));
}

void DecoderStack::step(at::Tensor x, const at::Tensor& keys, const at::Tensor& values, int64_t length, const OptionalTensor& key_mask,
                        const OptionalTensor& cos, const OptionalTensor& sin, bool int8_activations, const OptionalTensor& positions) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_ && x.is_contiguous() && x.device().is_cpu(),
              "decoder_step: x must be contiguous float32 (B, hidden)");
  Shared sh{};
  sh.x = x.data_ptr<float>();
  sh.B = x.size(0);
  sh.length = length;
  sh.int8_activations = int8_activations;
  at::Tensor pt;
  const int64_t* pp = nullptr;
  if (rotary_ && !cos.has_value() && positions.has_value() && has_rotary_tables()) {  // the tables' rows, computed from these
    pt = positions->to(at::kLong).contiguous();
    TORCH_CHECK(pt.numel() == sh.B, "decoder_step: one position a sequence");
    pp = pt.data_ptr<int64_t>();
  }
  launch(sh, keys, values, key_mask, cos, sin, pp);
}

void DecoderStack::check_token_step() const {
  TORCH_CHECK(has_embeddings() && has_final_norm() && has_head() && (!rotary_ || has_rotary_tables()),
              "decoder_step: a token step needs the embeddings, the final norm, the head (and RoPE's frequencies)");
}

void DecoderStack::token_step(const at::Tensor& ids, const OptionalTensor& positions, const at::Tensor& keys, const at::Tensor& values,
                              int64_t length, const OptionalTensor& key_mask, bool int8_activations, at::Tensor logits, const OptionalTensor& next) {
  check_token_step();
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.device().is_cpu(), "decoder_step: ids must be int64 (B)");
  const int64_t B = ids.size(0), V = head_.N;
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(0) == B && logits.size(1) == V && logits.is_contiguous() &&
                  logits.device().is_cpu(),
              "decoder_step: logits must be contiguous float32 (B, vocab)");
  const at::Tensor it = ids.contiguous();
  at::Tensor pt;
  thread_local std::vector<int64_t> at_length;
  const int64_t* pp;
  if (positions.has_value()) {
    pt = positions->to(at::kLong).contiguous();
    TORCH_CHECK(pt.numel() == B && pt.device().is_cpu(), "decoder_step: one position a sequence");
    pp = pt.data_ptr<int64_t>();
  } else {
    at_length.assign(B, length);
    pp = at_length.data();
  }
  at::Tensor nt;
  if (next.has_value()) {
    nt = *next;
    TORCH_CHECK(nt.scalar_type() == at::kLong && nt.numel() == B && nt.is_contiguous() && nt.device().is_cpu(),
                "decoder_step: next must be contiguous int64 (B)");
  }
  run_token(it.data_ptr<int64_t>(), pp, B, keys, values, length, key_mask, int8_activations, logits.data_ptr<float>(),
            nt.defined() ? nt.data_ptr<int64_t>() : nullptr);
}

int64_t DecoderStack::greedy_steps(const at::Tensor& ids, const OptionalTensor& positions, const at::Tensor& keys, const at::Tensor& values,
                                   int64_t length, const OptionalTensor& key_mask, bool int8_activations, at::Tensor tokens,
                                   const at::Tensor& stop_ids, const at::Tensor& left, int64_t last_position, bool screen) {
  return run_steps(ids, positions, keys, values, length, key_mask, int8_activations, tokens, stop_ids, left, last_position, nullptr, at::Tensor(),
                   {}, screen);
}

int64_t DecoderStack::sample_steps(const at::Tensor& ids, const OptionalTensor& positions, const at::Tensor& keys, const at::Tensor& values,
                                   int64_t length, const OptionalTensor& key_mask, bool int8_activations, at::Tensor tokens,
                                   const at::Tensor& stop_ids, const at::Tensor& left, int64_t last_position, const SamplingSettings& s,
                                   const at::Tensor& uniforms, const OptionalTensor& seen) {
  return run_steps(ids, positions, keys, values, length, key_mask, int8_activations, tokens, stop_ids, left, last_position, &s, uniforms, seen);
}

int64_t DecoderStack::run_steps(const at::Tensor& ids, const OptionalTensor& positions, const at::Tensor& keys, const at::Tensor& values,
                                int64_t length, const OptionalTensor& key_mask, bool int8_activations, at::Tensor tokens,
                                const at::Tensor& stop_ids, const at::Tensor& left, int64_t last_position, const SamplingSettings* sampling,
                                const at::Tensor& uniforms, const OptionalTensor& seen, bool screen) {
  check_token_step();
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.device().is_cpu(), "decoder_step: ids must be int64 (B)");
  const int64_t B = ids.size(0), V = head_.N;
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 2 && tokens.size(0) == B && tokens.size(1) > 0 && tokens.is_contiguous() &&
                  tokens.device().is_cpu(),
              "decoder_step: tokens must be contiguous int64 (B, steps > 0)");
  const int64_t S = tokens.size(1);
  const at::Tensor st = stop_ids.to(at::kLong).contiguous(), lt = left.to(at::kLong).contiguous();
  TORCH_CHECK(st.dim() == 1 && st.device().is_cpu(), "decoder_step: stop_ids must be int64 (n)");
  TORCH_CHECK(lt.numel() == B && lt.device().is_cpu(), "decoder_step: one budget a sequence");
  TORCH_CHECK(last_position >= 0, "decoder_step: last_position must be >= 0");
  const at::Tensor it = ids.contiguous();
  std::vector<int64_t> cur(it.data_ptr<int64_t>(), it.data_ptr<int64_t>() + B), pos(B, length), next(B);
  std::vector<int64_t> budget(lt.data_ptr<int64_t>(), lt.data_ptr<int64_t>() + B);
  if (positions.has_value()) {
    const at::Tensor pt = positions->to(at::kLong).contiguous();
    TORCH_CHECK(pt.numel() == B && pt.device().is_cpu(), "decoder_step: one position a sequence");
    std::copy(pt.data_ptr<int64_t>(), pt.data_ptr<int64_t>() + B, pos.begin());
  }
  at::Tensor mask;
  if (key_mask.has_value() && key_mask->defined()) {
    mask = *key_mask;
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == B && mask.size(1) >= length + S,
                "decoder_step: key_mask must be bool (B, >= ", length + S, " keys)");
  }
  // sampling: each step's uniform numbers, and each row's tokens so far where the repetition penalty counts them
  at::Tensor un;
  std::vector<std::vector<int64_t>> history;
  if (sampling) {
    if (sampling->temperature != 0.f) {
      un = uniforms.to(at::kDouble).contiguous();
      TORCH_CHECK(un.numel() == S * B && un.device().is_cpu(), "decoder_step: uniforms must be (steps, B)");
    }
    if (sampling->repetition_penalty != 1.f) {
      history.resize(B);
      if (seen.has_value() && seen->defined()) {
        const at::Tensor sn = seen->to(at::kLong).contiguous();
        TORCH_CHECK(sn.dim() == 2 && sn.size(0) == B && sn.device().is_cpu(), "decoder_step: seen must be int64 (B, n)");
        for (int64_t b = 0; b < B; ++b) history[b].assign(sn.data_ptr<int64_t>() + b * sn.size(1), sn.data_ptr<int64_t>() + (b + 1) * sn.size(1));
      }
    }
  }
  const int64_t* stop = st.data_ptr<int64_t>();
  const int64_t n_stop = st.numel();
  thread_local AlignedVector<float> logit_buf;
  float* logits = scratch(logit_buf, B * V);
  int64_t* out = tokens.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    const OptionalTensor km = mask.defined() ? OptionalTensor(mask.narrow(1, 0, length + s + 1)) : OptionalTensor();
    run_token(cur.data(), pos.data(), B, keys, values, length + s, km, int8_activations, logits, sampling ? nullptr : next.data(),
              screen && !sampling);
    if (sampling)
      for (int64_t b = 0; b < B; ++b) {
        const std::vector<int64_t>* h = history.empty() ? nullptr : &history[b];
        next[b] = sample_token(logits + b * V, V, *sampling, h ? h->data() : nullptr, h ? static_cast<int64_t>(h->size()) : 0,
                               un.defined() ? un.data_ptr<double>()[s * B + b] : 0.0);
        if (h) history[b].push_back(next[b]);
      }
    bool finished = true;
    for (int64_t b = 0; b < B; ++b) {
      out[b * S + s] = cur[b] = next[b];
      if (budget[b] > 0) budget[b] = std::find(stop, stop + n_stop, next[b]) != stop + n_stop ? 0 : budget[b] - 1;
      finished = finished && budget[b] == 0;
      pos[b] = positions.has_value() ? std::min(pos[b] + 1, last_position) : length + s + 1;
    }
    if (finished) return s + 1;
  }
  return S;
}

void DecoderStack::run_token(const int64_t* ip, const int64_t* pp, int64_t B, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                             const OptionalTensor& key_mask, bool int8_activations, float* logits, int64_t* next, bool screen) {
  // the embeddings: token rows (+ position rows)
  thread_local AlignedVector<float> x_buf;
  float* x = scratch(x_buf, B * hidden_);
  const float* tok = embed_tokens_.data_ptr<float>();
  const float* pos = embed_positions_.defined() ? embed_positions_.data_ptr<float>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ip[b] >= 0 && ip[b] < embed_tokens_.size(0), "decoder_step: token id ", ip[b], " outside the vocabulary of ", embed_tokens_.size(0));
    const float* row = tok + ip[b] * hidden_;
    float* xb = x + b * hidden_;
    if (pos) {
      TORCH_CHECK(pp[b] >= 0 && pp[b] < embed_positions_.size(0), "decoder_step: position ", pp[b], " outside the table of ", embed_positions_.size(0));
      const float* prow = pos + pp[b] * hidden_;
      for (int64_t i = 0; i < hidden_; ++i) xb[i] = row[i] + prow[i];
    } else {
      std::copy(row, row + hidden_, xb);
    }
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  thread_local std::vector<int64_t> best_at;
  best_at.assign(B * threads, -1);
  Shared sh{};
  sh.x = x;
  sh.B = B;
  sh.length = length;
  sh.int8_activations = int8_activations;
  sh.logits = logits;
  sh.next = next;
  sh.best_at = best_at.data();
  thread_local std::vector<float> screen_low;
  int screen_fallback = 0;
  if (screen && next && has_head_screen()) {
    screen_low.assign(B * threads, 0.f);
    sh.screen = true;
    sh.screen_low = screen_low.data();
    sh.screen_fallback = &screen_fallback;
  }
  launch(sh, keys, values, key_mask, {}, {}, pp);
}

void DecoderStack::launch(Shared sh, const at::Tensor& keys, const at::Tensor& values, const OptionalTensor& key_mask, const OptionalTensor& cos,
                          const OptionalTensor& sin, const int64_t* pp) {
  const int64_t B = sh.B, length = sh.length, L = length + 1, nl = num_layers();
  for (const at::Tensor* c : {&keys, &values})
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->dim() == 5 && c->size(0) == nl && c->size(1) == B && c->size(2) == Hkv_ &&
                    c->size(4) == D_ && c->stride(4) == 1 && c->device().is_cpu(),
                "decoder_step: the cache must be float32 (layers, B, kv heads, capacity, head dim)");
  TORCH_CHECK(length >= 0 && L <= keys.size(3) && L <= values.size(3), "decoder_step: KV cache overflow: ", L, " positions needed, capacity ",
              keys.size(3));
  at::Tensor mask;
  sh.mask = key_mask_flags(key_mask, B, L, mask, "decoder_step");
  at::Tensor ct, st;
  thread_local AlignedVector<float> rot_buf;
  if (rotary_ && pp) {  // the tables' rows, computed here
    const float* inv = inv_freq_.data_ptr<float>();
    float* rows = scratch(rot_buf, 2 * B * D_);
    const int64_t half = D_ / 2;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(pp[b]) * inv[i];
        const float c = std::cos(angle) * rotary_factor_, sn = std::sin(angle) * rotary_factor_;
        rows[b * D_ + i] = rows[b * D_ + half + i] = c;
        rows[(B + b) * D_ + i] = rows[(B + b) * D_ + half + i] = sn;
      }
    sh.cos = rows;
    sh.sin = rows + B * D_;
  } else if (rotary_) {
    TORCH_CHECK(cos.has_value() && sin.has_value(), "decoder_step: this stack rotates queries and keys: cos and sin (or positions) needed");
    ct = cos->to(at::kFloat).contiguous();
    st = sin->to(at::kFloat).contiguous();
    TORCH_CHECK(ct.numel() == B * D_ && st.numel() == B * D_, "decoder_step: cos and sin must be (B, head dim)");
    sh.cos = ct.data_ptr<float>();
    sh.sin = st.data_ptr<float>();
  }
  // the buffers the team shares (each product's results, written by the threads that computed them)
  const int64_t q_n = H_ * D_, kv_n = Hkv_ * D_;
  int64_t mid_n = 0;
  for (const Layer& l : layers_) mid_n = std::max<int64_t>(mid_n, l.mlp_in[0].N * static_cast<int64_t>(l.mlp_in.size()));
  thread_local AlignedVector<float> qkv_buf, att_buf, proj_buf, mid_buf;
  sh.keys = keys.data_ptr<float>();
  sh.values = values.data_ptr<float>();
  sh.qkv = scratch(qkv_buf, B * (q_n + 2 * kv_n));
  sh.att = scratch(att_buf, B * q_n);
  sh.proj = scratch(proj_buf, B * hidden_);
  sh.mid = scratch(mid_buf, B * mid_n);
  for (int64_t i = 0; i < 4; ++i) {
    sh.ks[i] = keys.stride(i);
    sh.vs[i] = values.stride(i);
  }
  const int64_t threads = at::in_parallel_region() ? 1 : std::max<int64_t>(1, at::get_num_threads());
  if (threads == 1 || !product_tuning().step_team) {  // one thread, or a parallel region for each product and attention
    StepTeam team(1);
    run_layers(sh, team, 0, threads == 1);
    return;
  }
  std::optional<StepTeam> team;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
#pragma omp single
    team.emplace(omp_get_num_threads());
    run_layers(sh, *team, omp_get_thread_num(), true);
  }
}

// One thread's part of the step (every thread of the team runs this): the residual stream and the norms
// on a copy of its own (the same values on every thread), each product's tasks through the team, the
// attention of its own key/value heads (rotary, cache write and attention of their query heads), and its
// share of the MLP's activation. Unseated (a team of one thread among torch's), the products and the
// attention open parallel regions of their own instead.
void DecoderStack::run_layers(const Shared& sh, StepTeam& team, int64_t me, bool seated) const {
  TeamSeat& seat = team_seat();
  if (seated) seat = {&team, me, 0};
  const int64_t B = sh.B, L = sh.length + 1, T = team.size(), q_n = H_ * D_, kv_n = Hkv_ * D_, rep = H_ / Hkv_;
  thread_local AlignedVector<float> x_buf, h_buf;
  float* xs = scratch(x_buf, B * hidden_);
  float* h = scratch(h_buf, B * hidden_);
  std::copy(sh.x, sh.x + B * hidden_, xs);
  const bool q8 = sh.int8_activations;
  for (int64_t li = 0; li < num_layers(); ++li) {
    const Layer& l = layers_[li];
    for (int64_t b = 0; b < B; ++b) normalize(l.norm1, xs + b * hidden_, h + b * hidden_, hidden_);
    // q, k, v: rows of q_n + 2 kv_n (one fused weight) or three blocks of B rows each
    float *q, *k, *v;
    int64_t q_s, k_s, v_s;  // row strides
    if (l.attn_in.size() == 1) {
      float* outs[1] = {sh.qkv};
      quantized_products(h, B, hidden_, l.attn_in.data(), outs, 1, q8);
      q = sh.qkv, k = sh.qkv + q_n, v = sh.qkv + q_n + kv_n;
      q_s = k_s = v_s = q_n + 2 * kv_n;
    } else {
      q = sh.qkv, k = sh.qkv + B * q_n, v = k + B * kv_n;
      float* outs[3] = {q, k, v};
      quantized_products(h, B, hidden_, l.attn_in.data(), outs, 3, q8);
      q_s = q_n, k_s = v_s = kv_n;
    }
    float* kc = sh.keys + li * sh.ks[0];
    float* vc = sh.values + li * sh.vs[0];
    const int64_t heads = B * Hkv_;
    // key/value heads (b, g) [begin, end): rotated, written into the cache, and (with_queries) the
    // attention of their query heads
    auto attend = [&](int64_t begin, int64_t end, bool with_queries) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / Hkv_, g = item % Hkv_;
        float* kh = k + b * k_s + g * D_;
        const float* vh = v + b * v_s + g * D_;
        if (rotary_) {
          rotate(q + b * q_s + g * rep * D_, rep, D_, sh.cos + b * D_, sh.sin + b * D_);
          rotate(kh, 1, D_, sh.cos + b * D_, sh.sin + b * D_);
        }
        std::copy(kh, kh + D_, kc + b * sh.ks[1] + g * sh.ks[2] + sh.length * sh.ks[3]);
        std::copy(vh, vh + D_, vc + b * sh.vs[1] + g * sh.vs[2] + sh.length * sh.vs[3]);
        if (with_queries)
          attend_heads({q, q_s, D_, 0}, {kc, sh.ks[1], sh.ks[2], sh.ks[3]}, {vc, sh.vs[1], sh.vs[2], sh.vs[3]}, sh.mask, B, H_, Hkv_, L,
                       D_, l.scale, sh.att, b * H_ + g * rep, b * H_ + (g + 1) * rep);
      }
    };
    if (!seated) {
      at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) { attend(begin, end, true); });
    } else if (heads >= T) {  // each thread its own key/value heads and their queries: no barrier between
      attend(heads * me / T, heads * (me + 1) / T, true);
    } else {  // fewer key/value heads than threads (one sequence, grouped queries): the cache written, then the query heads shared out
      attend(heads * me / T, heads * (me + 1) / T, false);
      team.barrier();
      attend_heads({q, q_s, D_, 0}, {kc, sh.ks[1], sh.ks[2], sh.ks[3]}, {vc, sh.vs[1], sh.vs[2], sh.vs[3]}, sh.mask, B, H_, Hkv_, L, D_,
                   l.scale, sh.att, B * H_ * me / T, B * H_ * (me + 1) / T);
    }
    team.barrier();
    {
      float* outs[1] = {sh.proj};
      quantized_products(sh.att, B, q_n, &l.o_proj, outs, 1, q8);
    }
    for (int64_t i = 0; i < B * hidden_; ++i) xs[i] += sh.proj[i];
    for (int64_t b = 0; b < B; ++b) normalize(l.norm2, xs + b * hidden_, h + b * hidden_, hidden_);
    const int64_t n_mid = l.mlp_in[0].N, n_act = B * n_mid;
    const bool gated = l.mlp_in.size() == 2;
    {
      float* outs[2] = {sh.mid, sh.mid + n_act};
      quantized_products(h, B, hidden_, l.mlp_in.data(), outs, static_cast<int64_t>(l.mlp_in.size()), q8);
    }
    {  // this thread's share of the activation (whole cache lines)
      const int64_t lines = (n_act + 15) / 16, a0 = std::min(n_act, lines * me / T * 16), a1 = std::min(n_act, lines * (me + 1) / T * 16);
      activate(act_, sh.mid + a0, gated ? sh.mid + n_act + a0 : nullptr, a1 - a0);
    }
    team.barrier();
    {
      float* outs[1] = {sh.proj};
      quantized_products(sh.mid, B, n_mid, &l.mlp_out, outs, 1, q8);
    }
    for (int64_t i = 0; i < B * hidden_; ++i) xs[i] += sh.proj[i];
  }
  team.barrier();  // (every thread has read x: with no layers, the copies above)
  if (sh.logits) {  // a token step: the final norm on every thread's copy, the head's tasks shared out
    for (int64_t b = 0; b < B; ++b) normalize(final_norm_, xs + b * hidden_, h + b * hidden_, hidden_);
    if (sh.screen && screened_choices(sh, team, me, h)) {
      if (seated) seat = {};
      return;
    }
    float* outs[1] = {sh.logits};
    quantized_products(h, B, hidden_, &head_, outs, 1, q8);
    if (sh.next) {  // the greedy choices: each thread the first largest of its share of each row, then thread 0 of theirs
      const int64_t V = head_.N;
      for (int64_t b = 0; b < B; ++b) sh.best_at[b * T + me] = first_largest(sh.logits + b * V, V * me / T, V * (me + 1) / T);
      team.barrier();
      if (me == 0)
        for (int64_t b = 0; b < B; ++b) sh.next[b] = greedy_choice(sh.logits + b * V, sh.best_at + b * T, T);
    }
  } else if (me == 0) {  // the result, from thread 0's copy
    if (has_final_norm())
      for (int64_t b = 0; b < B; ++b) normalize(final_norm_, xs + b * hidden_, sh.x + b * hidden_, hidden_);
    else
      std::copy(xs, xs + B * hidden_, sh.x);
  }
  if (seated) seat = {};
}

void DecoderStack::set_final_norm(const NormSpec& spec) { final_norm_ = norm(spec); }

void DecoderStack::set_embeddings(const at::Tensor& tokens, const at::Tensor& positions) {
  for (const at::Tensor* t : {&tokens, &positions})
    TORCH_CHECK(!t->defined() || (t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(1) == hidden_ && t->is_contiguous() &&
                                  t->device().is_cpu() && t->size(0) > 0),
                "decoder_step: embeddings must be contiguous float32 (rows, hidden)");
  TORCH_CHECK(tokens.defined(), "decoder_step: the token embeddings are needed");
  embed_tokens_ = tokens;
  embed_positions_ = positions;
}

void DecoderStack::set_head(const LinearSpec& spec) {
  QuantWeight w = linear(spec);
  TORCH_CHECK(w.K == hidden_ && w.N > 0, "decoder_step: the head must take the hidden size");
  head_ = w;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> head_screen(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "head_screen: a float32 or bfloat16 (V, D) weight on the CPU");
  const at::Tensor w = weight.contiguous();
  const int64_t V = w.size(0), D = w.size(1);
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  at::Tensor codes = at::empty({V, D}, at::kChar), scale = at::empty({V}, at::kBFloat16), bound = at::empty({V}, at::kFloat);
  int8_t* qp = codes.data_ptr<int8_t>();
  uint16_t* sp = reinterpret_cast<uint16_t*>(scale.data_ptr<at::BFloat16>());
  float* bp = bound.data_ptr<float>();
  const double gamma = 2.0 * static_cast<double>(D + 2) * std::ldexp(1.0, -24);
  at::parallel_for(0, V, 256, [&](int64_t v0, int64_t v1) {
    std::vector<float> row(D);
    for (int64_t v = v0; v < v1; ++v) {
      if (bf16) {
        const uint16_t* r = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + v * D;
        for (int64_t i = 0; i < D; ++i) row[i] = bf16_to_float(r[i]);
      } else {
        std::copy(w.data_ptr<float>() + v * D, w.data_ptr<float>() + (v + 1) * D, row.begin());
      }
      float amax = 0.f;
      for (float x : row) amax = std::max(amax, std::fabs(x));
      // the scale rounded to bf16 (to nearest, ties to even), the codes the rounded quotients by it
      const float s32 = amax / 127.f;
      uint32_t bits;
      std::memcpy(&bits, &s32, sizeof bits);
      const uint16_t sb = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
      const float s = bf16_to_float(sb), div = s > 0.f ? s : 1.f;
      double err = 0.0, nw = 0.0, na = 0.0;
      for (int64_t i = 0; i < D; ++i) {
        const float q = std::min(127.f, std::max(-127.f, std::nearbyint(row[i] / div)));
        qp[v * D + i] = static_cast<int8_t>(q);
        const double a = static_cast<double>(q) * s, x = row[i];
        err += (x - a) * (x - a);
        nw += x * x;
        na += a * a;
      }
      sp[v] = sb;
      // |h . w - h . w~| <= |h| |w - w~|, and each fp32 product within (D + 2) 2^-24 of sum |h_i w_i| <= |h| |w|
      // (doubled); rounded up to float
      bp[v] = static_cast<float>((std::sqrt(err) + gamma * (std::sqrt(nw) + std::sqrt(na))) * (1.0 + 1e-6));
    }
  });
  return {codes, scale, bound};
}

void DecoderStack::set_head_screen(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bound) {
  TORCH_CHECK(has_head() && head_.dense(), "decoder_step: a screen needs a dense (f32 or bf16) head");
  const int64_t V = head_.N;
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.size(0) == V && codes.size(1) == hidden_ && codes.is_contiguous() &&
                  codes.device().is_cpu(),
              "decoder_step: the screen's codes must be contiguous int8 (V, hidden)");
  TORCH_CHECK(scale.numel() == V && bound.numel() == V, "decoder_step: one scale and one bound a row");
  at::Tensor sc = scale.to(at::kBFloat16).contiguous(), bd = bound.to(at::kFloat).contiguous();
  keep_.push_back(codes);
  keep_.push_back(sc);
  QuantWeight w;
  w.kind = WeightKind::int8;
  w.codes = codes.data_ptr();
  w.scale = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  w.N = V;
  w.K = hidden_;
  screen_ = w;
  screen_bound_ = bd;
}

// The greedy choice through the head's int8 copy: every thread multiplies its share of the copy's rows
// (fp32 activations: the copy's logits y~ differ from the head's y by at most |h| bound[v]), then the
// largest lower bound max(y~ - |h| bound) rules out every row whose upper bound is below it; thread 0
// recomputes the rows left from the head itself (the same per-row arithmetic as the head's product) and
// takes the first largest. Too many rows left, or a non-finite value: the whole head decides.
bool DecoderStack::screened_choices(const Shared& sh, StepTeam& team, int64_t me, const float* h) const {
  constexpr int64_t kMaxCandidates = 64;
  const int64_t B = sh.B, V = head_.N, T = team.size();
  {
    float* outs[1] = {sh.logits};
    quantized_products(h, B, hidden_, &screen_, outs, 1, false);  // (a team pass: every thread's rows are in afterwards)
  }
  const float* bound = screen_bound_.data_ptr<float>();
  auto norm_of = [&](int64_t b) {
    double s = 0.0;
    for (int64_t i = 0; i < hidden_; ++i) s += static_cast<double>(h[b * hidden_ + i]) * h[b * hidden_ + i];
    return static_cast<float>(std::sqrt(s) * 1.0001);
  };
  // a margin for the fp32 arithmetic of the bounds themselves
  auto margin = [&](float hn, int64_t v, float y) { return hn * bound[v] + 1e-6f * std::fabs(y); };
  const int64_t r0 = V * me / T, r1 = V * (me + 1) / T;
  for (int64_t b = 0; b < B; ++b) {
    const float hn = norm_of(b);
    const float* y = sh.logits + b * V;
    float low = -INFINITY;
    bool finite = std::isfinite(hn);
    for (int64_t v = r0; v < r1 && finite; ++v) {
      finite = std::isfinite(y[v]);
      low = std::max(low, y[v] - margin(hn, v, y[v]));
    }
    sh.screen_low[b * T + me] = finite ? low : NAN;
  }
  team.barrier();
  if (me == 0) {
    int fallback = 0;
    thread_local std::vector<int64_t> cand;
    thread_local std::vector<float> exact;
    for (int64_t b = 0; b < B && !fallback; ++b) {
      float L = -INFINITY;
      for (int64_t t = 0; t < T; ++t) {
        const float l = sh.screen_low[b * T + t];
        if (l != l) fallback = 1;
        L = std::max(L, l);
      }
      if (fallback) break;
      const float hn = norm_of(b);
      const float* y = sh.logits + b * V;
      cand.clear();
      for (int64_t v = 0; v < V; ++v)
        if (y[v] + margin(hn, v, y[v]) >= L) {
          cand.push_back(v);
          if (static_cast<int64_t>(cand.size()) > kMaxCandidates) break;
        }
      if (cand.empty() || static_cast<int64_t>(cand.size()) > kMaxCandidates) {
        fallback = 1;
        break;
      }
      exact.resize(cand.size());
      dense_rows(h + b * hidden_, hidden_, head_, cand.data(), static_cast<int64_t>(cand.size()), exact.data());
      sh.next[b] = cand[first_largest(exact.data(), 0, static_cast<int64_t>(exact.size()))];
    }
    *sh.screen_fallback = fallback;
    ++(fallback ? screen_fallbacks_ : screened_);
  }
  team.barrier();
  return *sh.screen_fallback == 0;
}

void DecoderStack::set_rotary(const at::Tensor& inv_freq, double attention_factor) {
  TORCH_CHECK(rotary_, "decoder_step: this stack does not rotate queries and keys");
  inv_freq_ = inv_freq.to(at::kFloat).contiguous();
  TORCH_CHECK(inv_freq_.device().is_cpu() && inv_freq_.numel() == D_ / 2, "decoder_step: RoPE needs head_dim / 2 inverse frequencies");
  rotary_factor_ = static_cast<float>(attention_factor);
}

NormSpec DecoderStack::norm(const NormSpec& spec) {
  NormSpec n;
  n.weight = spec.weight.to(at::kFloat).contiguous();
  TORCH_CHECK(n.weight.numel() == hidden_ && n.weight.device().is_cpu(), "decoder_step: a norm's weight must have the hidden size");
  if (spec.bias.defined()) {
    n.bias = spec.bias.to(at::kFloat).contiguous();
    TORCH_CHECK(n.bias.numel() == hidden_, "decoder_step: a norm's bias must have the hidden size");
  }
  n.eps = spec.eps;
  n.rms = spec.rms;
  keep_.push_back(n.weight);
  return n;
}

QuantWeight DecoderStack::linear(const LinearSpec& spec) {
  const auto type = spec.codes.scalar_type();
  if (type == at::kFloat || type == at::kBFloat16) {  // a dense weight, read in place
    TORCH_CHECK(!spec.scale.defined() && !spec.zero.defined() && spec.group_size == -1,
                "decoder_step: a dense (float32 / bfloat16) weight takes no scale, zero point or group size");
    keep_.push_back(spec.codes);
    return dense_weight(spec.codes, spec.bias, keep_);
  }
  TORCH_CHECK(spec.scale.defined(), "decoder_step: quantized codes need their scales");
  const bool int4 = type == at::kByte;
  TORCH_CHECK(!int4 || spec.zero.defined(), "decoder_step: int4 codes need zero points");
  keep_.push_back(spec.codes);
  return quant_weight(int4, spec.codes, spec.scale, spec.zero, spec.group_size, spec.bias, keep_);
}

}  // namespace gencli
