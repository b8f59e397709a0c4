"""Logit processors against transformers' own, settings resolution, and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from gencli.errors import UserError
from gencli.pipelines.text import sampling
from gencli.pipelines.text.generate import resolve_settings
from gencli.pipelines.text.sampling import SamplingParams, candidates, draw, next_tokens, process_logits


def _logits(seed=0, b=3, v=200):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


SETTINGS = [
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
]


@pytest.mark.parametrize("params", SETTINGS)
def test_processors_match_transformers(params):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = _logits()
    seen = torch.randint(0, 200, (3, 30), generator=torch.Generator().manual_seed(1))
    chain = []
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    chain.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        chain.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        chain.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        chain.append(MinPLogitsWarper(params.min_p))
    expected = LogitsProcessorList(chain)(seen, logits.clone())
    ours = process_logits(logits, params, seen)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    assert torch.allclose(ours[finite], expected[finite], atol=1e-5)
    assert (~torch.isinf(ours)).sum(-1).min() >= 1


def _dense(probs, ids, v):
    """The candidates' probabilities over the whole vocabulary (B, V)."""
    return probs if ids is None else torch.zeros(probs.shape[0], v, dtype=probs.dtype).scatter(-1, ids, probs)


@pytest.mark.parametrize(
    "params",
    [
        *SETTINGS,
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=3.0, top_p=0.95),  # flat: the nucleus passes the first candidates searched
        SamplingParams(temperature=4.0, min_p=0.2),  # flat: min-p keeps more than them
        SamplingParams(temperature=1.0, top_k=7, top_p=0.5),
    ],
)
@pytest.mark.parametrize("v", [200, 5000])
def test_the_candidates_carry_the_processed_distribution(params, v, monkeypatch):
    """Sampling draws from the candidates only (top-k's survivors, a nucleus found among the most likely
    tokens first): their probabilities are the softmax of the processed logits, every other token's 0."""
    monkeypatch.setattr(sampling, "NUCLEUS_SEARCH", 64)
    logits = _logits(b=3, v=v)
    logits[0, :40] = logits[0, 40]  # ties at top-k's boundary
    seen = torch.randint(0, v, (3, 30), generator=torch.Generator().manual_seed(1))
    want = process_logits(logits, params, seen).softmax(-1)
    probs, ids = candidates(logits, params, seen)
    got = _dense(probs, ids, v)
    assert torch.equal(got > 0, want > 0), (got > 0).sum(-1)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
    assert probs.shape[-1] < v or params.top_k == 0


def test_draws_follow_the_candidates_probabilities_and_never_choose_a_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0], [0.1, 0.0, 0.0, 0.0, 0.0, 0.9]])
    ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    g = torch.Generator().manual_seed(0)
    picks = torch.stack([draw(probs, ids, g) for _ in range(20000)])
    for row, want in enumerate(probs):
        freq = torch.stack([(picks[:, row] == i).double().mean() for i in ids[row]])
        assert (freq - want.double()).abs().max() < 0.015, freq
        assert (freq[want == 0] == 0).all()
    ones = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert all(draw(ones, None, g).item() == 2 for _ in range(200))


def test_greedy_and_seeded_sampling():
    logits = _logits(b=2)
    assert torch.equal(next_tokens(logits, SamplingParams(temperature=0.0), None), logits.argmax(-1))
    p = SamplingParams(temperature=1.0, top_k=100)
    draws = lambda seed: torch.stack([next_tokens(logits, p, g) for g in [torch.Generator().manual_seed(seed)] for _ in range(20)])  # noqa: E731
    assert torch.equal(draws(7), draws(7))
    assert not torch.equal(draws(7), draws(8))
    # top_k=1 is greedy whatever the draw
    assert torch.equal(next_tokens(logits, SamplingParams(temperature=1.0, top_k=1), torch.Generator().manual_seed(3)), logits.argmax(-1))


def test_settings_follow_flags_then_generation_config_then_transformers_defaults():
    s = resolve_settings({})
    assert s.sampling.greedy and s.max_new_tokens == 256
    s = resolve_settings({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 40})
    assert (s.sampling.temperature, s.sampling.top_p, s.sampling.top_k, s.max_new_tokens) == (0.6, 0.9, 50, 40)
    s = resolve_settings({"do_sample": True, "temperature": 0.6}, temperature=0.0, max_new_tokens=5)
    assert s.sampling.greedy and s.max_new_tokens == 5
    s = resolve_settings({}, top_p=0.5)  # a sampling knob alone turns sampling on
    assert s.sampling.temperature == 1.0 and s.sampling.top_p == 0.5
    s = resolve_settings({"repetition_penalty": 1.2}, top_k=0)
    assert s.sampling.repetition_penalty == 1.2 and s.sampling.top_k == 0
    warnings = []
    resolve_settings({}, temperature=0.0, top_p=0.5, warn=warnings.append)
    assert warnings and "no effect" in warnings[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "--temperature"),
        ({"top_p": 0.0}, "--top-p"),
        ({"top_p": 1.5}, "--top-p"),
        ({"max_new_tokens": 0}, "--max-new-tokens"),
        ({"top_k": -1}, "--top-k"),
        ({"min_p": 2.0}, "--min-p"),
        ({"repetition_penalty": 0.0}, "--repetition-penalty"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(UserError, match=message):
        resolve_settings({}, **kwargs)
