// Choosing the next token from a row of logits, natively: the repetition penalty, temperature, top-k,
// top-p and min-p of gencli.pipelines.text.sampling (transformers' processors and order), then one
// uniform number's draw, the same choice as that module's candidates() + draw() make in Python (up to
// float rounding: a draw differs only where the uniform number falls within rounding of a boundary).
//
// The Python path sorts candidates with torch.topk and draws through torch's cumsum: for vocabularies of
// 50-130 k entries a few hundred microseconds a token, as long as a small model's whole decoding step.
// Here the vocabulary is read a few times by vectors (the temperature, the largest logit, the softmax's
// sum), the candidates are found by a threshold below the largest logit (lowered until it holds enough
// of them) and only they are sorted.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <immintrin.h>

#include "cpu_features.h"
#include "kernels.h"
#include "ops.h"

namespace gencli {

GENCLI_TARGET_AVX512
namespace sample_avx512 {
#include "simd_avx512.inc"
inline V nan_to_neg_inf(V v) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v, set1(-INFINITY)); }
inline uint32_t at_least(V v, V t) { return _mm512_cmp_ps_mask(v, t, _CMP_GE_OQ); }
#include "sampling_passes.inc"
}  // namespace sample_avx512
GENCLI_TARGET_END

GENCLI_TARGET_AVX2
namespace sample_avx2 {
#include "simd_avx2.inc"
inline V nan_to_neg_inf(V v) { return _mm256_blendv_ps(v, set1(-INFINITY), _mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
inline uint32_t at_least(V v, V t) { return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GE_OQ))); }
#include "sampling_passes.inc"
}  // namespace sample_avx2
GENCLI_TARGET_END

namespace {

// the passes without vectors (a CPU without AVX2)
namespace sample_plain {
float scale_and_max(float* x, int64_t n, float t, bool divide) {
  float best = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    float v = divide ? x[i] / t : x[i];
    if (v != v) v = -INFINITY;
    x[i] = v;
    best = std::max(best, v);
  }
  return best;
}
float sum_exp(const float* x, int64_t n, float m, float* out) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float e = x[i] - m < -87.f ? 0.f : std::exp(x[i] - m);
    if (out) out[i] = e;
    total += e;
  }
  return total;
}
void divide_by(float* p, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) p[i] /= s;
}
int64_t collect_at_least(const float* x, int64_t n, float t, int32_t* out) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i)
    if (x[i] >= t) out[count++] = static_cast<int32_t>(i);
  return count;
}
}  // namespace sample_plain

struct Passes {
  float (*scale_and_max)(float*, int64_t, float, bool);
  float (*sum_exp)(const float*, int64_t, float, float*);
  void (*divide_by)(float*, int64_t, float);
  int64_t (*collect_at_least)(const float*, int64_t, float, int32_t*);
};

Passes passes() {
  switch (active_isa()) {
    case Isa::avx512:
      return {sample_avx512::scale_and_max, sample_avx512::sum_exp, sample_avx512::divide_by, sample_avx512::collect_at_least};
    case Isa::avx2:
      return {sample_avx2::scale_and_max, sample_avx2::sum_exp, sample_avx2::divide_by, sample_avx2::collect_at_least};
    default:
      return {sample_plain::scale_and_max, sample_plain::sum_exp, sample_plain::divide_by, sample_plain::collect_at_least};
  }
}

struct Candidate {
  float v;
  int32_t i;
};

// torch.topk's order for distinct values: the larger first (equal values: the lower id first)
bool earlier(const Candidate& a, const Candidate& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

struct Workspace {
  std::vector<uint8_t> flags;
  AlignedVector<float> probs;
  std::vector<int32_t> ids;
  std::vector<float> values;
  std::vector<Candidate> candidates;
};

Workspace& workspace(int64_t V) {
  thread_local Workspace ws;
  if (static_cast<int64_t>(ws.flags.size()) < V) {
    ws.flags.assign(V, 0);
    ws.probs.resize(V);
    ws.ids.resize(V);
  }
  return ws;
}

// transformers' repetition penalty: each token of seen once (a repeated id counts once), its logit
// divided by the penalty where positive, multiplied where negative (float32, as torch computes it)
void penalize(float* x, int64_t V, const int64_t* seen, int64_t n, float penalty, std::vector<uint8_t>& flags) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = seen[j];
    if (t < 0 || t >= V || flags[t]) continue;
    flags[t] = 1;
    x[t] = x[t] < 0.f ? x[t] * penalty : x[t] / penalty;
  }
  for (int64_t j = 0; j < n; ++j)
    if (seen[j] >= 0 && seen[j] < V) flags[seen[j]] = 0;
}

// the candidates at ids[0, n) sorted (torch.topk's order)
void sorted_candidates(const float* x, const int32_t* ids, int64_t n, std::vector<Candidate>& out) {
  out.resize(n);
  for (int64_t j = 0; j < n; ++j) out[j] = {x[ids[j]], ids[j]};
  std::sort(out.begin(), out.end(), earlier);
}

// log(sum(e^v)) of the candidates' values (their first is the largest)
float log_sum_exp(const std::vector<Candidate>& c) {
  const float m = c[0].v;
  if (!(m > -INFINITY)) return m;
  float s = 0.f;
  for (const Candidate& k : c) s += k.v - m < -87.f ? 0.f : std::exp(k.v - m);
  return m + std::log(s);
}

// the index of the first of p[0, n) whose cumulative probability (in double, as torch's cumsum of float
// probabilities) passes u x the total, never one of probability 0
int64_t draw_index(const float* p, int64_t n, double u) {
  double total = 0.0;
  int64_t last = 0;
  for (int64_t j = 0; j < n; ++j) {
    total += p[j];
    if (p[j] > 0.f) last = j;
  }
  const double target = u * total;
  double cum = 0.0;
  for (int64_t j = 0; j <= last; ++j) {
    cum += p[j];
    if (cum > target) return j;
  }
  return last;
}

// draw(softmax(values)) over the sorted candidates, a dropped one's value -inf
int64_t draw_candidates(const std::vector<Candidate>& c, double u) {
  const int64_t K = static_cast<int64_t>(c.size());
  const float m = c[0].v;  // (the largest: the first candidate is never dropped)
  if (!(m > -INFINITY)) return c[0].i;
  thread_local std::vector<float> e;
  e.resize(K);
  float s = 0.f;
  for (int64_t j = 0; j < K; ++j) s += (e[j] = c[j].v - m < -87.f ? 0.f : std::exp(c[j].v - m));
  for (int64_t j = 0; j < K; ++j) e[j] /= s;
  return c[draw_index(e.data(), K, u)].i;
}

// the ids of at least k of the largest values of x (every value above the k-th among them), few more: above
// a threshold estimated from a sample of the row (the value of rank about 2k V / S of S values spread over
// it), lowered where it holds fewer than k
int64_t collect_top(const float* x, int64_t V, int64_t k, const Passes& p, int32_t* ids, std::vector<float>& sample) {
  constexpr int64_t S = 2048;
  if (k * 16 < V && V > S) {
    sample.resize(S);
    for (int64_t j = 0; j < S; ++j) sample[j] = x[j * V / S];
    for (int64_t rank = (k * S + V - 1) / V * 2 + 16; rank < S; rank *= 8) {
      std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(), [](float a, float b) { return a > b; });
      const int64_t n = p.collect_at_least(x, V, sample[rank - 1], ids);
      if (n >= k) return n;
    }
  }
  return p.collect_at_least(x, V, -INFINITY, ids);
}

}  // namespace

int64_t sample_token(float* x, int64_t V, const SamplingSettings& s, const int64_t* seen, int64_t n_seen, double u) {
  Workspace& ws = workspace(V);
  if (s.repetition_penalty != 1.f && n_seen > 0) penalize(x, V, seen, n_seen, s.repetition_penalty, ws.flags);
  if (s.temperature == 0.f) return first_largest(x, 0, V);  // greedy: torch.argmax's choice
  const Passes p = passes();
  const float m = p.scale_and_max(x, V, s.temperature, s.temperature != 1.f);
  if (!(m > -INFINITY)) return 0;  // no logit is a number above -inf
  const bool nucleus = s.top_p < 1.f, min_p = s.min_p > 0.f;
  int32_t* ids = ws.ids.data();
  std::vector<Candidate>& c = ws.candidates;
  float total;  // the log of the softmax's denominator the nucleus's probabilities take
  if (s.top_k > 0 && s.top_k < V) {
    // the k largest (and every value equal to the k-th) are among those above a threshold that holds k
    const int64_t n = collect_top(x, V, s.top_k, p, ids, ws.values);
    ws.values.resize(n);
    for (int64_t j = 0; j < n; ++j) ws.values[j] = x[ids[j]];
    const int64_t k = std::min<int64_t>(s.top_k, n);
    std::nth_element(ws.values.begin(), ws.values.begin() + (k - 1), ws.values.end(), [](float a, float b) { return a > b; });
    const float kth = ws.values[k - 1];
    int64_t kept = 0;
    for (int64_t j = 0; j < n; ++j)
      if (x[ids[j]] >= kth) ids[kept++] = ids[j];
    sorted_candidates(x, ids, kept, c);
    total = log_sum_exp(c);
  } else if (nucleus || min_p) {
    total = m + std::log(p.sum_exp(x, V, m, nullptr));
    int64_t n = 0;
    if (min_p) {  // min-p's tokens: (x - max) >= log(min_p), in float32 as torch compares them
      const float lm = static_cast<float>(std::log(static_cast<double>(s.min_p)));
      n = p.collect_at_least(x, V, m + lm - 1.f, ids);
      int64_t kept = 0;
      for (int64_t j = 0; j < n; ++j)
        if (!(x[ids[j]] - m < lm)) ids[kept++] = ids[j];
      n = kept;
    } else {  // the nucleus: a threshold lowered until the tokens above it hold clearly more than top_p
      for (float d = 4.f;; d *= 2.f) {
        const float t = d > 200.f ? -INFINITY : m - d;
        n = p.collect_at_least(x, V, t, ids);
        if (t == -INFINITY) break;
        double mass = 0.0;
        for (int64_t j = 0; j < n; ++j) mass += std::exp(static_cast<double>(x[ids[j]]) - total);
        if (mass - std::exp(static_cast<double>(t) - total) - 1e-5 >= s.top_p) break;  // every token below t dropped
      }
    }
    sorted_candidates(x, ids, n, c);
  } else {  // plain temperature sampling: the softmax over the vocabulary in order
    float* probs = ws.probs.data();
    p.divide_by(probs, V, p.sum_exp(x, V, m, probs));
    return draw_index(probs, V, u);
  }
  if (nucleus) {  // keep a token while the ones before it hold less than top_p (float32 as torch: cumsum - p)
    double cum = 0.0;
    for (size_t j = 0; j < c.size(); ++j) {
      const float pk = c[j].v - total < -87.f ? 0.f : std::exp(c[j].v - total);
      cum += pk;
      if (j > 0 && static_cast<float>(cum) - pk >= s.top_p) c[j].v = -INFINITY;  // (the first always: top_p 0 keeps it alone)
    }
  }
  if (min_p) {
    const float lm = static_cast<float>(std::log(static_cast<double>(s.min_p))), first = c[0].v;
    for (Candidate& k : c)
      if (k.v - first < lm) k.v = -INFINITY;
  }
  return draw_candidates(c, u);
}

at::Tensor sample_tokens(const at::Tensor& logits, const SamplingSettings& s, const at::Tensor& uniforms, const OptionalTensor& seen) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.size(1) > 0, "sample_tokens: logits must be (B, V) on the CPU");
  const int64_t B = logits.size(0), V = logits.size(1);
  const at::Tensor u = uniforms.to(at::kDouble).contiguous();
  TORCH_CHECK(u.numel() == B || (s.temperature == 0.f && u.numel() == 0), "sample_tokens: one uniform number a row");
  at::Tensor work = logits.to(at::kFloat, false, true).contiguous();  // (one copy: the caller's logits are not changed)
  at::Tensor st;
  if (seen.has_value() && seen->defined()) {
    st = seen->to(at::kLong).contiguous();
    TORCH_CHECK(st.dim() == 2 && st.size(0) == B, "sample_tokens: seen must be (B, n)");
  }
  at::Tensor out = at::empty({B}, at::kLong);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = st.defined() ? st.size(1) : 0;
    out[b] = sample_token(work.data_ptr<float>() + b * V, V, s, n ? st.data_ptr<int64_t>() + b * n : nullptr, n,
                          u.numel() ? u.data_ptr<double>()[b] : 0.0);
  }
  return out;
}

}  // namespace gencli
