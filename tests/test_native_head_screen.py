"""The fused step's screen of a dense LM head (decoder_step.head_screen, DecoderStack.screened_choices):
the bound holds for the kernels' own products, and greedy steps through the screen choose the tokens of
the whole head (fp32 and bf16 heads, GPT-2 and Llama shapes, ties, and the fallback to the whole head
when the bounds leave too many rows)."""

from __future__ import annotations

import pytest
import torch
from _text_fixtures import three_text_models

from gencli.backend.decoder_step import head_screen
from gencli.pipelines.text import generate as g
from gencli.pipelines.text import loading
from gencli.pipelines.text.generate import GenerationSettings, encode_prompt, generate
from gencli.pipelines.text.loading import load_text_model
from gencli.pipelines.text.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("quant_kernels_built")

TEXTS = ["import os", "class Point:\n    def", "x"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bound_covers_the_difference_of_the_kernels_products(dtype):
    """|head . h - copy . h| <= |h| bound for every row, as the kernels compute both products (the head's
    dense fp32 / bf16 kernel, the copy's int8 kernel on fp32 activations), at several scales of h; and
    the bound is not vacuous (a fraction of the logits' spread)."""
    from gencli.backend.quant_kernels import cpu_kernels

    kernels = cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(3000, 256, generator=gen) * 0.05).to(dtype)
    weight[7] = 0  # a zero row
    weight[8, :5] = 40.0  # a row with outliers
    codes, scale, bound = head_screen(weight)
    assert codes.dtype == torch.int8 and scale.dtype == torch.bfloat16 and bound.dtype == torch.float32
    for s in (1e-3, 1.0, 30.0, 1e4):
        h = torch.randn(1, 256, generator=gen) * s
        exact = kernels.dense_gemv(h, weight)
        approx = kernels.int8_gemv(h, codes, scale, False)
        gap = (exact - approx).abs()[0]
        limit = h.norm() * bound
        assert bool((gap <= limit).all()), float((gap - limit).max())
        assert float(limit[:7].max()) < 0.25 * float(exact.std())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return three_text_models(tmp_path_factory.mktemp("screen"))


def _load(folder, dtype, monkeypatch):
    monkeypatch.setattr(loading, "COLUMN_MAJOR_MIN_BYTES", 0)  # an fp32 head streamed by the kernels, as a large one is
    return load_text_model(folder, device="cpu", dtype=dtype)


def _tokens(tm, monkeypatch, *, screened: bool, n: int = 24):
    settings = GenerationSettings(max_new_tokens=n, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    with monkeypatch.context() as m:
        m.setattr(g, "screen_for", lambda *a, **k: None)  # (never the screen from Python)
        if screened:
            m.setattr(g, "SCREEN_MIN_HEAD_BYTES", 0)
            m.setattr(g, "SCREEN_MIN_STEPS", 1)
        else:
            m.setattr(g, "screens_natively", lambda *a, **k: False)
        prompts = [(t, encode_prompt(tm, t)) for t in TEXTS]
        return [c.token_ids for c in generate(tm, prompts, settings)]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_screened_greedy_steps_choose_the_tokens_of_the_whole_head(models, name, dtype, monkeypatch):
    tm = _load(models / name, dtype, monkeypatch)
    want = _tokens(tm, monkeypatch, screened=False)
    native = tm.model._built_fused_decoder().native
    assert not native.has_head_screen  # not by default for a tiny head
    got = _tokens(tm, monkeypatch, screened=True)
    assert native.has_head_screen and native.screened_steps >= 23 and native.screen_fallbacks == 0
    assert got == want
    assert len({tuple(t) for t in want}) > 1  # the rows differ: a sane fixture


def test_a_tie_goes_to_the_first_row_and_too_many_candidates_to_the_whole_head(models, monkeypatch):
    tm = _load(models / "gpt2", "float32", monkeypatch)
    first = _tokens(tm, monkeypatch, screened=False, n=1)[0][0]
    # a tie: the first choice's row copied to a row before it; the whole head and the screen take the copy
    tm = _load(models / "gpt2", "float32", monkeypatch)
    head = tm.model.lm_head.weight
    with torch.no_grad():
        head[3] = head[first]
    want = _tokens(tm, monkeypatch, screened=False)
    got = _tokens(tm, monkeypatch, screened=True)
    native = tm.model._built_fused_decoder().native
    assert got == want and want[0][0] == 3 and native.screened_steps > 0
    # every row alike: every row is a candidate, the whole head decides (its first largest: row 0)
    tm = _load(models / "gpt2", "float32", monkeypatch)
    with torch.no_grad():
        tm.model.lm_head.weight[:] = tm.model.lm_head.weight[5]
    want = _tokens(tm, monkeypatch, screened=False, n=6)
    got = _tokens(tm, monkeypatch, screened=True, n=6)
    native = tm.model._built_fused_decoder().native
    assert got == want and native.screen_fallbacks > 0 and native.screened_steps == 0
