"""bf16 decoding of GPT-2 / Llama on a CPU (gencli generate --dtype bfloat16): with native bf16 the
linear layers and the LM head are held packed for oneDNN (gencli.backend.packed_linear) and give the
tokens of the unpacked bf16 model; greedy steps may screen the packed head exactly; without native
bf16 the model runs unpacked, correct, after one notice."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from _text_fixtures import gpt2_checkpoint, llama_checkpoint

from gencli.backend import device as devmod
from gencli.backend.layers import dense_of
from gencli.backend.packed_linear import PackedLinear, pack_linears, packing_available
from gencli.errors import Notice

pytest.importorskip("transformers")
needs_packing = pytest.mark.skipif(not packing_available(), reason="no oneDNN bf16 matmul on this CPU")

PROMPTS = [("", [5, 9, 13]), ("", [8, 3, 11, 17, 2, 6, 30]), ("", [12])]  # a left-padded batch


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-bf16")
    gpt2_checkpoint(root / "gpt2")
    llama_checkpoint(root / "llama", kv_heads=2)
    return root


@pytest.fixture
def native_bf16(monkeypatch):
    """Set whether this CPU counts as multiplying bf16 natively (``GENCLI_CPU_BF16``) for one test."""

    def set_flag(on: bool) -> None:
        devmod.cpu_has_native_bf16.cache_clear()
        monkeypatch.setenv("GENCLI_CPU_BF16", "1" if on else "0")

    yield set_flag
    devmod.cpu_has_native_bf16.cache_clear()


def _load(folder, dtype="bfloat16"):
    from gencli.pipelines.text.loading import load_text_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tm = load_text_model(folder, device="cpu", dtype=dtype)
    return tm, [w for w in caught if issubclass(w.category, Notice)]


def _tokens(tm, *, max_new_tokens=16, static=False):
    from gencli.pipelines.text.generate import GenerationSettings, generate
    from gencli.pipelines.text.sampling import SamplingParams

    settings = GenerationSettings(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=0.0), ignore_eos=True, static_cache=static)
    return [c.token_ids for c in generate(tm, PROMPTS, settings)]


def _linears(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if name and dense_of(m) is not None]


@needs_packing
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_packed_bf16_decoding_gives_the_tokens_of_unpacked_bf16(models, name, native_bf16):
    native_bf16(True)
    packed, notices = _load(models / name)
    assert not notices
    assert _linears(packed.model) == []  # every projection (GPT-2's Conv1D too) and the head packed
    assert isinstance(packed.model.lm_head, PackedLinear)
    assert packed.model.get_input_embeddings().weight.dtype == torch.bfloat16  # a tied embedding stays dense
    plain, _ = _load(models / name, dtype="float32")
    plain.model.to(torch.bfloat16)  # the same bf16 model computed by F.linear
    want = _tokens(plain)
    assert _tokens(packed) == want
    assert _tokens(packed, static=True) == want
    assert len({tuple(ids) for ids in want}) > 1  # the rows differ: a sane fixture


@needs_packing
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_screens_the_packed_head_exactly(models, name, native_bf16, monkeypatch):
    """The screened argmax of the packed head's fp32 image (forced on for a tiny head) gives the
    tokens of the plain argmax of the bf16 logits."""
    from gencli.backend.screened_argmax import ScreenedArgmax
    from gencli.pipelines.text import generate as g

    native_bf16(True)
    tm, _ = _load(models / name)
    if not ScreenedArgmax.supported(tm.model.lm_head.weight.float()):
        pytest.skip("no screened argmax on this CPU")
    want = _tokens(tm)
    assert tm.screen is None  # a tiny head and a short run: not screened by default
    monkeypatch.setattr(g, "SCREEN_MIN_HEAD_BYTES", 0)
    monkeypatch.setattr(g, "SCREEN_MIN_STEPS", 1)
    got = _tokens(tm)
    assert isinstance(tm.screen, ScreenedArgmax) and tm.screen.weight.dtype == torch.float32
    assert torch.equal(tm.screen.weight, tm.model.lm_head.weight.float())
    assert got == want


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_without_native_bf16_decoding_is_unpacked_and_correct_after_one_notice(models, name, native_bf16):
    native_bf16(False)
    tm, notices = _load(models / name)
    assert len(notices) == 1 and "no native bf16" in str(notices[0].message)
    assert not any(isinstance(m, PackedLinear) for m in tm.model.modules())
    assert tm.model.lm_head.weight.dtype == torch.bfloat16
    plain, _ = _load(models / name, dtype="float32")
    plain.model.to(torch.bfloat16)
    assert _tokens(tm) == _tokens(plain)  # the same computation: the same tokens


def test_float32_models_are_never_packed(models, native_bf16):
    native_bf16(True)
    tm, notices = _load(models / "gpt2", dtype="float32")
    assert not notices and not any(isinstance(m, PackedLinear) for m in tm.model.modules())


@needs_packing
def test_pack_linears_packs_gpt2_conv1d_layers():
    """GPT-2's Conv1D (weight stored (in, out)) packs as the nn.Linear of its transposed weight."""
    from gencli.models.gpt2 import Conv1D

    torch.manual_seed(0)
    layer = Conv1D(24, 40)
    nn.init.normal_(layer.weight)  # (Conv1D starts from an empty weight: GPT-2 checkpoints fill it)
    nn.init.normal_(layer.bias)
    layer.to(torch.bfloat16)
    holder = nn.Sequential(layer)
    x = torch.randn(3, 24).to(torch.bfloat16)
    with torch.inference_mode():
        want = layer(x)
        assert pack_linears(holder) == 1
        got = holder[0](x)
    assert isinstance(holder[0], PackedLinear) and torch.equal(holder[0].weight, layer.weight.t())
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_cli_shows_the_notice_once(models):
    from conftest import run_cli

    result = run_cli("generate", "hello", "--model", str(models / "gpt2"), "--dtype", "bfloat16", "--max-new-tokens", "3", env={"GENCLI_CPU_BF16": "0"})
    assert result.returncode == 0, result.stderr
    warnings_shown = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings_shown) == 1 and "no native bf16" in warnings_shown[0], result.stderr
