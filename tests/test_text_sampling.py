"""Logit processors against transformers' own, settings resolution, and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from gencli.errors import UserError
from gencli.pipelines.text.generate import resolve_settings
from gencli.pipelines.text.sampling import SamplingParams, next_tokens, process_logits


def _logits(seed=0, b=3, v=200):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.5, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    ],
)
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
