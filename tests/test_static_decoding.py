"""The decoding step of fixed shapes (a static KV cache written by position, the step a GPU captures
and replays) gives the token ids of the growing cache, on the CPU: GPT-2, Llama with GQA, a
sliding-window Mistral, a left-padded batch, and sampling with a seed."""

from __future__ import annotations

import json

import pytest
import torch
from _text_fixtures import gpt2_checkpoint, llama_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("static-decoding")
    gpt2_checkpoint(root / "gpt2")
    llama_checkpoint(root / "llama", kv_heads=2)  # GQA: 4 query heads, 2 key/value heads
    llama_checkpoint(root / "mistral", seed=3, kv_heads=1, rope={"rope_type": "default"})
    cfg = json.loads((root / "mistral" / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=24, rope_scaling=None)
    (root / "mistral" / "config.json").write_text(json.dumps(cfg))
    return root


def _generate(folder, prompts, *, static, temperature=0.0, seed=None, max_new_tokens=20):
    from gencli.backend.random import make_generator
    from gencli.pipelines.text.generate import GenerationSettings, generate
    from gencli.pipelines.text.loading import load_text_model
    from gencli.pipelines.text.sampling import SamplingParams

    tm = load_text_model(folder, device="cpu", dtype="float32")
    settings = GenerationSettings(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=temperature), ignore_eos=True, static_cache=static)
    generator = make_generator(seed)[0] if seed is not None else None
    return [c.token_ids for c in generate(tm, prompts, settings, generator=generator)]


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral"])
def test_static_cache_gives_the_ids_of_the_growing_cache(models, name):
    prompts = [("", [5, 9, 13, 4, 22, 7])]
    assert _generate(models / name, prompts, static=True) == _generate(models / name, prompts, static=False)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_left_padded_batch_and_sampling(models, name):
    prompts = [("", [5, 9, 13]), ("", [8, 3, 11, 17, 2, 6, 30]), ("", [12])]
    assert _generate(models / name, prompts, static=True) == _generate(models / name, prompts, static=False)
    sampled = _generate(models / name, prompts, static=True, temperature=0.9, seed=4)
    assert sampled == _generate(models / name, prompts, static=False, temperature=0.9, seed=4)
    assert len({tuple(ids) for ids in sampled}) > 1  # the rows differ: a sane fixture


def test_the_static_cache_attends_by_slot():
    """Slots after a query's position are hidden whatever they hold; the written ones are the new keys."""
    from gencli.backend.attention import StaticKVCache, scaled_dot_product_attention

    cache = StaticKVCache(1, 1, 2, 4, 8)
    cache.keys.fill_(1e4)  # garbage in the unwritten slots must not leak into the output
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    cache.bind(torch.arange(3))
    out = scaled_dot_product_attention(q, k, v, causal=True, kv_cache=cache[0])
    want = scaled_dot_product_attention(q, k, v, causal=True)
    assert torch.allclose(out, want, atol=1e-6)
    assert torch.equal(cache.keys[0, :, :, :3], k)
    with pytest.raises(ValueError, match="cache_position"):
        from gencli.models.causal_lm import CausalLM

        CausalLM.hidden_states(None, torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)


def test_compiling_falls_back_with_one_warning(monkeypatch):
    """Where torch cannot compile, the step runs as it is after one warning."""
    from gencli.pipelines.text import decode_step

    def broken(*args, **kwargs):
        raise RuntimeError("no backend")

    monkeypatch.setattr(torch, "compile", broken)
    seen = []
    step = decode_step.compiled(lambda ids, pos, slot: ids * 2, on_warning=seen.append)
    assert step(torch.tensor([3]), None, torch.tensor([0])).item() == 6
    assert len(seen) == 1 and "decoding eagerly" in seen[0]
    assert decode_step.wants_static(torch.device("cuda"), None, None, 256) == (True, True)
    assert decode_step.wants_static(torch.device("cuda"), None, None, 20) == (False, False)  # too short to repay compiling
    assert decode_step.static_capacity(300) == 512 and decode_step.static_capacity(256) == 256
    assert decode_step.wants_static(torch.device("cpu"), None, None) == (False, False)
    assert decode_step.wants_static(torch.device("cpu"), False, True) == (True, False)


def test_torchs_own_warnings_while_compiling_are_not_shown(monkeypatch):
    """torch's notes while it traces the first call (Dynamo's warnings) are dropped: gencli says the
    outcome in one line of its own."""
    import warnings

    from gencli.pipelines.text import decode_step

    def tracing(fn, **kwargs):
        def run(*args):
            warnings.warn("Dynamo detected a call to a lru_cache-wrapped function", UserWarning, stacklevel=2)
            raise RuntimeError("cannot compile this")

        return run

    monkeypatch.setattr(torch, "compile", tracing)
    seen = []
    step = decode_step.compiled(lambda ids, pos, slot: ids * 2, on_warning=seen.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert step(torch.tensor([3]), None, torch.tensor([0])).item() == 6
    assert not caught and len(seen) == 1 and "decoding eagerly" in seen[0]
