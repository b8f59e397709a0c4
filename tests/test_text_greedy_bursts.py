"""Plain greedy decoding several steps a native call (DecoderStack.greedy_steps, generate's _Burst):
the same tokens, text, finish reasons and streamed pieces as one step a call, for bursts of any length,
with EOS, stop strings found inside a burst, and a left-padded batch whose rows end at different steps
(their budgets, the model's context)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _text_fixtures import three_text_models

from gencli.models.causal_lm import CausalLM
from gencli.pipelines.text import generate as generate_module
from gencli.pipelines.text.generate import GenerationSettings, encode_prompt, generate
from gencli.pipelines.text.loading import load_text_model
from gencli.pipelines.text.sampling import SamplingParams

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("quant_kernels_built")

TEXTS = ["import os", "class Point:\n    def", "x"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return three_text_models(tmp_path_factory.mktemp("bursts"))


@pytest.fixture(scope="module", params=[("gpt2", "int8"), ("llama", "int8"), ("gpt2", "int4")])
def tm(request, models):
    name, mode = request.param
    return load_text_model(models / name, device="cpu", dtype="float32", quantize=mode)


def _run(tm, settings, texts=TEXTS, *, bursts=True):
    """The completions and each row's streamed pieces, with bursts on (as long as allowed) or off."""
    prompts = [(t, encode_prompt(tm, t)) for t in texts]
    pieces = [[] for _ in prompts]
    saved = CausalLM.fused_greedy_steps
    if not bursts:
        CausalLM.fused_greedy_steps = lambda self, *a, **k: None
    try:
        out = generate(tm, prompts, settings, on_text=lambda i, p: pieces[i].append(p))
    finally:
        CausalLM.fused_greedy_steps = saved
    return [(c.token_ids, c.text, c.finish_reason, c.hit_context) for c in out], ["".join(p) for p in pieces]


def _same(tm, settings, monkeypatch, texts=TEXTS):
    want = _run(tm, settings, texts, bursts=False)
    monkeypatch.setattr(generate_module, "BURST_SECONDS", 1e9)  # every burst as long as BURST_TOKENS allows
    for most in (1, 3, 16):
        monkeypatch.setattr(generate_module, "BURST_TOKENS", most)
        assert _run(tm, settings, texts) == want, most
    return want


GREEDY = GenerationSettings(max_new_tokens=24, sampling=SamplingParams(temperature=0.0), ignore_eos=True)


def test_bursts_give_the_tokens_and_text_of_one_step_a_call(tm, monkeypatch):
    calls = []
    real = CausalLM.fused_greedy_steps
    monkeypatch.setattr(CausalLM, "fused_greedy_steps", lambda self, *a, **k: calls.append(k["steps"]) or real(self, *a, **k))
    completions, streamed = _same(tm, GREEDY, monkeypatch)
    assert calls  # the bursts ran
    assert all(len(ids) == 24 and reason == "length" for ids, _, reason, _ in completions)
    assert len({tuple(ids) for ids, *_ in completions}) == 3  # the rows differ: a sane fixture
    assert streamed == [text for _, text, _, _ in completions]


def test_a_row_that_meets_eos_inside_a_burst_ends_there_and_the_others_go_on(tm, monkeypatch):
    ids = _run(tm, GREEDY)[0][0][0]
    eos = ids[5]  # the first row's sixth token
    monkeypatch.setattr(tm, "eos_ids", [eos])
    completions, _ = _same(tm, dataclasses.replace(GREEDY, ignore_eos=False), monkeypatch)
    first = completions[0]
    assert first[0] == ids[: ids.index(eos) + 1] and first[2] == "stop"
    assert any(reason == "length" or len(row) > len(first[0]) for row, _, reason, _ in completions[1:])


def test_a_stop_string_inside_a_burst_cuts_the_text_where_one_step_a_call_does(tm, monkeypatch):
    text = _run(tm, GREEDY)[0][1][1]
    stop = text.strip()[4:7]
    assert stop.strip()
    completions, streamed = _same(tm, dataclasses.replace(GREEDY, stop=[stop]), monkeypatch)
    assert completions[1][2] == "stop" and stop not in completions[1][1]
    assert streamed == [t for _, t, _, _ in completions]


def test_rows_of_a_padded_batch_end_at_their_own_budget_at_the_models_context(tm, monkeypatch):
    long_prompt = "def add(a, b):\n    return a + b\n"
    n = len(encode_prompt(tm, long_prompt))
    monkeypatch.setattr(tm, "context_length", n + 9)  # the long prompt has room for 9 new tokens, the others more
    settings = dataclasses.replace(GREEDY, max_new_tokens=20)
    completions, _ = _same(tm, settings, monkeypatch, texts=["x", long_prompt, "import os"])
    assert [len(ids) for ids, *_ in completions] == [20, 9, 20]
    assert completions[1][3] and not completions[0][3]  # the long one hit the context


def test_native_bursts_match_token_steps_fed_back_from_python(tm):
    """DecoderStack.greedy_steps against fused_logits(greedy) called a step at a time: the same choices,
    the same keys and values in the cache, ended where every row's budget or a stop id ends it, the
    positions held at the last one."""
    model = tm.model
    prompts = [encode_prompt(tm, t) for t in TEXTS]
    b, longest = len(prompts), max(map(len, prompts))
    ids = torch.zeros((b, longest), dtype=torch.long)
    mask = torch.zeros((b, longest + 12), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = True
    pos = (mask[:, :longest].long().cumsum(-1) - 1).clamp(min=0)
    last = int(pos[:, -1].max()) + 3  # positions stop growing three steps in

    def prefill():
        cache = model.new_cache(b, longest + 12)
        with torch.inference_mode():
            first = model(ids, kv_cache=cache, position_ids=pos, attention_mask=mask, logits_to_keep=1)[:, -1].argmax(-1)
        return cache, first.view(b, 1), pos[:, -1:] + 1

    cache, tokens, p = prefill()
    want = []
    with torch.inference_mode():
        for _ in range(10):
            _, tokens = model.fused_logits(tokens, position_ids=p.clamp(max=last), attention_mask=mask[:, : cache.length + 1], kv_cache=cache, greedy=True)
            tokens = tokens.view(b, 1)
            want.append(tokens)
            p = p + 1
    want = torch.cat(want, 1)
    assert len(set(want.flatten().tolist())) > 3

    def steps_run(left, stop):  # the first step after which every row has finished
        left = list(left)
        for s in range(10):
            left = [0 if n == 0 or want[i, s].item() in stop else n - 1 for i, n in enumerate(left)]
            if not any(left):
                return s + 1
        return 10

    cases = [([10] * 3, []), ([2, 7, 4], []), ([0, 0, 1], []), ([10] * 3, want[:, 3].tolist()), ([10, 0, 10], want[:, 1].tolist())]
    assert len({steps_run(*c) for c in cases}) >= 3  # bursts ended at different steps
    for left, stop in cases:
        k = steps_run(left, stop)
        got_cache, first, p0 = prefill()
        with torch.inference_mode():
            got = model.fused_greedy_steps(
                first, kv_cache=got_cache, steps=10, left=left, stop_ids=stop, position_ids=p0, attention_mask=mask, last_position=last
            )
        assert torch.equal(got, want[:, :k]), (left, stop)
        assert got_cache.length == longest + k
        n = longest + k
        assert torch.equal(got_cache.keys[..., :n, :], cache.keys[..., :n, :]) and torch.equal(got_cache.values[..., :n, :], cache.values[..., :n, :])
    with torch.inference_mode(), pytest.raises(RuntimeError, match="key_mask must be bool"):
        model.fused_greedy_steps(first, kv_cache=got_cache, steps=30, left=[30] * 3, position_ids=p0, attention_mask=mask, last_position=last)
