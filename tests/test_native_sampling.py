"""The native sampler (csrc/sampling.cpp) against the Python one it replaces on a CPU
(gencli.pipelines.text.sampling's candidates() + draw()): the same token for the same uniform number on
every instruction set, for each processor alone and combined, for peaked and flat rows, small and large
vocabularies; and sampled decoding several steps a native call (generate's bursts) against one step a
call: the same tokens, text and generator state."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _text_fixtures import three_text_models

from gencli.models.causal_lm import CausalLM
from gencli.pipelines.text import generate as generate_module
from gencli.pipelines.text.generate import GenerationSettings, encode_prompt, generate
from gencli.pipelines.text.loading import load_text_model
from gencli.pipelines.text.sampling import SamplingParams, candidates, draw, native_settings, next_tokens, process_logits

pytestmark = pytest.mark.usefixtures("quant_kernels_built")

SETTINGS = [
    SamplingParams(temperature=0.8, top_k=50),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=0.6, top_k=5, min_p=0.2),
    SamplingParams(temperature=1.0, top_p=0.999),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.2),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=2.0, top_p=0.5),
    SamplingParams(temperature=0.5, top_k=2000, top_p=0.9, min_p=0.01, repetition_penalty=0.8),
]


def _within_rounding(x, params, seen, u, token) -> bool:
    """Whether ``token`` is the Python sampler's choice for a uniform number within float rounding of
    ``u`` (where probabilities of 1e-6 and less meet a boundary computed in float32 on both sides): the
    Python candidates' cumulative probability at ``token`` brackets ``u`` x the total within 1e-5."""
    probs, ids = candidates(x, params, seen)
    cdf = probs.double().cumsum(-1)[0]
    at = (ids[0] == token).nonzero() if ids is not None else torch.tensor([[token]])
    if at.numel() == 0:
        return False
    j = int(at[0, 0])
    target = u * float(cdf[-1])
    low = float(cdf[j - 1]) if j > 0 else 0.0
    return low - 1e-5 <= target <= float(cdf[j]) + 1e-5


@pytest.mark.parametrize("isa_name", ["avx512", "avx2"])
def test_the_native_sampler_chooses_the_tokens_the_python_one_does(isa_name):
    """The same token for the same uniform number: every draw of peaked rows; of flat rows whose nucleus
    holds tens of thousands of tokens (each a millionth of the mass) a draw may differ from Python's by
    float rounding (the two log-sum-exps' last bit moves the cut by a token), then only to a token whose
    cumulative probability brackets the same number within 1e-5."""
    from gencli.backend.quant_kernels import cpu_kernels

    kernels = cpu_kernels()
    best = kernels.isa()
    if not kernels.use_isa(isa_name):
        pytest.skip(f"this CPU has no {isa_name}")
    try:
        compared, differ = 0, []
        for i, (scale, v) in enumerate([(1.0, 1000), (3.0, 50257), (8.0, 32003), (0.3, 50257)]):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(12, v, generator=g) * scale
            x[:, :5] += 6  # a few likely tokens
            x[0, 7] = float("-inf")  # a masked vocabulary entry
            before = x.clone()
            seen = torch.randint(0, v, (12, 30), generator=g)
            for params in SETTINGS:
                gen = torch.Generator().manual_seed(100 + i)
                u = torch.rand((12, 1), generator=gen, dtype=torch.float64)
                gen.manual_seed(100 + i)
                want = process_logits(x, params, seen).argmax(-1) if params.greedy else draw(*candidates(x, params, seen), gen)
                uniforms = torch.empty(0, dtype=torch.float64) if params.greedy else u.view(-1)
                got = kernels.sample_tokens(x, *native_settings(params), uniforms, seen)
                compared += 12
                for r in (got != want).nonzero().view(-1).tolist():
                    assert not params.greedy and _within_rounding(x[r : r + 1], params, seen[r : r + 1], float(u[r]), int(got[r])), (params, r)
                    differ.append((scale, params))
                assert torch.equal(x, before)  # (the logits are not changed)
        assert compared == 4 * len(SETTINGS) * 12
        assert len(differ) <= 2 and all(scale == 3.0 and p.top_p > 0.99 for scale, p in differ)
    finally:
        kernels.use_isa(best)


def test_the_native_draws_follow_the_distribution_and_never_choose_a_dropped_token():
    from gencli.backend.quant_kernels import cpu_kernels

    kernels = cpu_kernels()
    x = torch.tensor([[2.0, 1.0, 0.5, float("nan"), float("-inf"), 0.0, -3.0, 1.5]])
    params = SamplingParams(temperature=1.0, top_k=4)
    keep = torch.tensor([0, 1, 7, 2])  # the four largest numbers; a NaN logit is never chosen
    p = torch.softmax(x[0, keep], -1)
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    picks = torch.cat([kernels.sample_tokens(x, *native_settings(params), u[i : i + 1], None) for i in range(n)])
    counts = torch.stack([(picks == k).sum() for k in keep]).double() / n
    assert set(picks.unique().tolist()) <= set(keep.tolist())
    assert torch.allclose(counts, p.double(), atol=0.015)
    # every logit -inf but one: that one, whatever the draw
    y = torch.full((1, 300), float("-inf"))
    y[0, 123] = 0.0
    for params in SETTINGS:
        if not params.greedy:
            for v in (0.0, 0.5, 0.999999):
                assert kernels.sample_tokens(y, *native_settings(params), torch.tensor([v], dtype=torch.float64), None).item() == 123


def test_next_tokens_draws_as_the_python_sampler_on_a_cpu():
    """next_tokens on CPU logits goes through the native sampler: one uniform a row from the generator,
    the Python sampler's tokens."""
    x = torch.randn(6, 5000, generator=torch.Generator().manual_seed(4)) * 4
    for params in SETTINGS:
        a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        seen = torch.randint(0, 5000, (6, 10), generator=torch.Generator().manual_seed(5))
        for _ in range(5):
            want = process_logits(x, params, seen).argmax(-1) if params.greedy else draw(*candidates(x, params, seen), a)
            assert torch.equal(next_tokens(x, params, b, seen), want)
        assert torch.equal(a.get_state(), b.get_state())


# -- sampled decoding several steps a native call -------------------------------------------------------

TEXTS = ["import os", "class Point:\n    def", "x"]
SAMPLED = GenerationSettings(max_new_tokens=20, sampling=SamplingParams(temperature=0.9, top_k=40, top_p=0.95), ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return three_text_models(tmp_path_factory.mktemp("sampled"))


@pytest.fixture(scope="module", params=[("gpt2", "int8"), ("llama", "int8"), ("gpt2", "int4")])
def tm(request, models):
    name, mode = request.param
    return load_text_model(models / name, device="cpu", dtype="float32", quantize=mode)


def _run(tm, settings, texts=TEXTS, *, bursts=True, seed=5):
    """Completions, streamed pieces and the generator's next number, with bursts on or off."""
    prompts = [(t, encode_prompt(tm, t)) for t in texts]
    pieces = [[] for _ in prompts]
    gen = torch.Generator().manual_seed(seed)
    saved = CausalLM.fused_sample_steps
    if not bursts:
        CausalLM.fused_sample_steps = lambda self, *a, **k: None
    try:
        out = generate(tm, prompts, settings, on_text=lambda i, p: pieces[i].append(p), generator=gen)
    finally:
        CausalLM.fused_sample_steps = saved
    after = torch.rand(1, generator=gen).item()
    return [(c.token_ids, c.text, c.finish_reason) for c in out], ["".join(p) for p in pieces], after


def _same(tm, settings, monkeypatch, texts=TEXTS):
    want = _run(tm, settings, texts, bursts=False)
    monkeypatch.setattr(generate_module, "BURST_SECONDS", 1e9)
    calls = []
    real = CausalLM.fused_sample_steps
    monkeypatch.setattr(CausalLM, "fused_sample_steps", lambda self, *a, **k: calls.append(k["steps"]) or real(self, *a, **k))
    for most in (1, 3, 16):
        monkeypatch.setattr(generate_module, "BURST_TOKENS", most)
        assert _run(tm, settings, texts) == want, most
    assert calls and max(calls) == 16  # the bursts ran, as long as allowed
    return want


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.95),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
    ],
)
def test_sampled_bursts_give_the_tokens_text_and_generator_state_of_one_step_a_call(tm, params, monkeypatch):
    completions, streamed, _ = _same(tm, dataclasses.replace(SAMPLED, sampling=params), monkeypatch)
    assert all(len(ids) == 20 for ids, *_ in completions)
    assert streamed == [text for _, text, _ in completions]
    if not params.greedy:
        assert _run(tm, dataclasses.replace(SAMPLED, sampling=params), seed=6)[0] != completions  # the seed matters: a sane fixture
    if params.repetition_penalty != 1.0:  # the penalty matters (the bursts' record of the tokens seen is tested)
        plain = dataclasses.replace(params, repetition_penalty=1.0)
        assert _run(tm, dataclasses.replace(SAMPLED, sampling=plain))[0] != completions


def test_a_sampled_row_that_meets_eos_inside_a_burst_ends_there_and_the_generator_is_left_where_the_steps_leave_it(tm, monkeypatch):
    ids = _run(tm, SAMPLED)[0][0][0]
    eos = ids[4]
    monkeypatch.setattr(tm, "eos_ids", [eos])
    completions, _, _ = _same(tm, dataclasses.replace(SAMPLED, ignore_eos=False), monkeypatch)
    assert completions[0][0] == ids[: ids.index(eos) + 1] and completions[0][2] == "stop"


def test_top_p_zero_keeps_the_top_token_alone_on_both_samplers():
    """A generation config may hold top_p 0 (transformers keeps the most likely token): both samplers
    then choose it whatever the draw."""
    from gencli.backend.quant_kernels import cpu_kernels

    kernels = cpu_kernels()
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(2)) * 2
    for params in (SamplingParams(temperature=1.0, top_p=0.0), SamplingParams(temperature=0.7, top_k=40, top_p=0.0)):
        for u in (0.0, 0.5, 0.999999):
            uniforms = torch.full((4,), u, dtype=torch.float64)
            assert torch.equal(kernels.sample_tokens(x, *native_settings(params), uniforms, None), x.argmax(-1))
            probs, ids = candidates(x, params)
            assert torch.equal(ids.gather(-1, probs.argmax(-1, keepdim=True)).view(-1), x.argmax(-1)) and bool((probs.sum(-1) > 0.99).all())
