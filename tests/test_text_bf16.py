"""bf16 decoding of GPT-2 / Llama on a CPU (gencli generate --dtype bfloat16).

Where gencli's kernels build, the linear layers and the LM head hold bf16 weights multiplied in fp32
(gencli.backend.streamed_linear; activations, norms, the KV cache fp32) and give the tokens of the
fp32 model whose linear weights are rounded to bf16; the decoding steps run fused; greedy steps may
screen the bf16 head exactly (by its int8 copy). Without the kernels, with native bf16, the whole model is bf16 with the
linear layers packed for oneDNN (gencli.backend.packed_linear), giving the tokens of the unpacked bf16
model; without either it runs unpacked, correct, after one notice."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from _text_fixtures import gpt2_checkpoint, llama_checkpoint

from gencli.backend import device as devmod
from gencli.backend import quant_kernels
from gencli.backend.decoder_step import FusedDecoder
from gencli.backend.layers import dense_of
from gencli.backend.packed_linear import PackedLinear, pack_linears, packing_available
from gencli.backend.streamed_linear import StreamedLinear
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
def no_kernels(monkeypatch):
    """gencli's kernels switched off for one test (the oneDNN / torch paths)."""
    monkeypatch.setenv(quant_kernels.ENV_SWITCH, "0")


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


def _rounded_fp32(folder):
    """The fp32 model with its linear weights (the head included) rounded to bf16, computed by torch."""
    plain, _ = _load(folder, dtype="float32")
    with torch.no_grad():
        for _, m in plain.model.named_modules():
            dense = dense_of(m)
            if dense is not None:
                dense[0].copy_(dense[0].to(torch.bfloat16).float())
    return plain


@pytest.mark.usefixtures("quant_kernels_built")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bf16_decoding_streams_bf16_weights_in_fp32_products(models, name, native_bf16, monkeypatch):
    native_bf16(False)  # (the kernels widen bf16 in registers: no native bf16 needed, no notice)
    tm, notices = _load(models / name)
    assert not notices
    assert _linears(tm.model) == [n for n, m in tm.model.named_modules() if isinstance(m, StreamedLinear)]  # every one, the head too
    assert all(m.weight.dtype == torch.bfloat16 for m in tm.model.modules() if isinstance(m, StreamedLinear))
    assert tm.model.get_input_embeddings().weight.dtype == torch.float32  # fp32 activations all along
    assert all(p.dtype == torch.float32 for p in tm.model.parameters())
    from gencli.pipelines.text.loading import describe

    assert "bfloat16 linear weights, float32 activations" in describe(tm)
    calls = []
    _count_fused_steps(monkeypatch, calls)
    got = _tokens(tm)
    assert len(calls) == 15  # every decoding step after the prompt's, fused
    want = _tokens(_rounded_fp32(models / name))
    assert got == want
    assert _tokens(tm, static=True) == want
    assert len({tuple(ids) for ids in want}) > 1  # the rows differ: a sane fixture


@pytest.mark.usefixtures("quant_kernels_built")
def test_a_streamed_bf16_head_is_screened_by_its_int8_copy_with_the_same_tokens(models, monkeypatch):
    """Greedy steps read an int8 copy of the bf16 head (a quarter of fp32's bytes, half of bf16's) and
    recompute the candidates from the bf16 rows themselves: inside the fused step's native greedy steps
    where it runs, else from Python (no fp32 image is held there); the tokens are those of the
    unscreened bf16 head. An fp32 streamed head is screened in place, as torch's is."""
    from gencli.backend import decoder_step
    from gencli.backend.screened_argmax import ScreenedArgmax
    from gencli.pipelines.text import generate as g
    from gencli.pipelines.text import loading

    tm, _ = _load(models / "gpt2")
    want = _tokens(tm)
    assert tm.screen is None  # a tiny head and a short run: not screened by default
    monkeypatch.setattr(g, "SCREEN_MIN_HEAD_BYTES", 0)
    monkeypatch.setattr(g, "SCREEN_MIN_STEPS", 1)
    head = tm.model.lm_head
    assert isinstance(head, StreamedLinear) and head.weight.dtype == torch.bfloat16
    assert _tokens(tm) == want
    fused = tm.model._built_fused_decoder()
    assert tm.screen is None and fused.native.has_head_screen and fused.native.screened_steps > 0  # natively
    monkeypatch.setattr(loading, "COLUMN_MAJOR_MIN_BYTES", 0)
    fp32, _ = _load(models / "gpt2", dtype="float32")
    assert isinstance(fp32.model.lm_head, StreamedLinear)
    want32 = _tokens(_load(models / "gpt2", dtype="float32")[0])
    assert _tokens(fp32) == want32 and fp32.model._built_fused_decoder().native.screened_steps > 0
    # the fused step off: the screen from Python
    monkeypatch.setenv(decoder_step.ENV_SWITCH, "0")
    tm, _ = _load(models / "gpt2")
    head = tm.model.lm_head
    if not ScreenedArgmax.supported(head.weight):
        pytest.skip("no exact int8 screen (oneDNN, VNNI) on this CPU")
    assert _tokens(tm) == want
    if tm.screen_failed:
        pytest.skip("oneDNN's int8 product failed its exactness check on this CPU")
    assert isinstance(tm.screen, ScreenedArgmax) and tm.screen.kind == "int8" and tm.screen.product is head
    assert tm.screen.weight.data_ptr() == head.weight.data_ptr()  # the head's own bf16 rows
    fp32, _ = _load(models / "gpt2", dtype="float32")
    assert _tokens(fp32) == want32
    assert isinstance(fp32.screen, ScreenedArgmax) and fp32.screen.weight.data_ptr() == fp32.model.lm_head.weight.data_ptr()


@needs_packing
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_packed_bf16_decoding_gives_the_tokens_of_unpacked_bf16(models, name, native_bf16, no_kernels):
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
def test_greedy_screens_the_packed_head_exactly(models, name, native_bf16, no_kernels, monkeypatch):
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
def test_without_kernels_or_native_bf16_decoding_is_unpacked_and_correct_after_one_notice(models, name, native_bf16, no_kernels):
    native_bf16(False)
    tm, notices = _load(models / name)
    assert len(notices) == 1 and "no native bf16" in str(notices[0].message)
    assert not any(isinstance(m, PackedLinear) for m in tm.model.modules())
    assert tm.model.lm_head.weight.dtype == torch.bfloat16
    plain, _ = _load(models / name, dtype="float32")
    plain.model.to(torch.bfloat16)
    assert _tokens(tm) == _tokens(plain)  # the same computation: the same tokens


def test_float32_models_are_never_packed_and_small_ones_run_as_torch_runs_them(models, native_bf16):
    native_bf16(True)
    tm, notices = _load(models / "gpt2", dtype="float32")
    assert not notices and not any(isinstance(m, (PackedLinear, StreamedLinear)) for m in tm.model.modules())


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

    env = {"GENCLI_CPU_BF16": "0", quant_kernels.ENV_SWITCH: "0"}
    result = run_cli("generate", "hello", "--model", str(models / "gpt2"), "--dtype", "bfloat16", "--max-new-tokens", "3", env=env)
    assert result.returncode == 0, result.stderr
    warnings_shown = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings_shown) == 1 and "no native bf16" in warnings_shown[0], result.stderr


@pytest.mark.usefixtures("quant_kernels_built")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_large_float32_models_stream_their_weights_and_decode_fused(models, name, monkeypatch):
    """From COLUMN_MAJOR_MIN_BYTES on (lowered to 0 here) an fp32 model's linear layers are streamed
    fp32 rows, the decoding steps fused, and the tokens those of torch's fp32 model."""
    from gencli.pipelines.text import loading

    want = _tokens(_load(models / name, dtype="float32")[0])
    monkeypatch.setattr(loading, "COLUMN_MAJOR_MIN_BYTES", 0)
    tm, notices = _load(models / name, dtype="float32")
    assert not notices and _linears(tm.model) == [n for n, m in tm.model.named_modules() if isinstance(m, StreamedLinear)]
    assert all(m.weight.dtype == torch.float32 and m.weight.is_contiguous() for m in tm.model.modules() if isinstance(m, StreamedLinear))
    calls = []
    _count_fused_steps(monkeypatch, calls)
    assert _tokens(tm) == want
    assert len(calls) == 15


@pytest.mark.usefixtures("quant_kernels_built")
def test_auto_streams_the_weights_of_a_bf16_checkpoint_as_they_are(models, tmp_path):
    """--dtype auto on a CPU: a bf16 checkpoint's linear weights are streamed as stored (bf16, the
    values fp32 would widen), an fp32 checkpoint decodes in fp32; both give the fp32 model's tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "llama-bf16"
    shutil.copytree(models / "llama", folder)
    for f in folder.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    auto, notices = _load(folder, dtype="auto")
    assert not notices
    heads = [m for m in auto.model.modules() if isinstance(m, StreamedLinear)]
    assert heads and all(m.weight.dtype == torch.bfloat16 for m in heads)
    assert all(p.dtype == torch.float32 for p in auto.model.parameters())
    plain, _ = _load(folder, dtype="float32")
    assert not any(isinstance(m, StreamedLinear) for m in plain.model.modules())  # (a small model: torch's fp32)
    assert _tokens(auto) == _tokens(plain)
    fp32_auto, _ = _load(models / "llama", dtype="auto")
    assert not any(isinstance(m, StreamedLinear) for m in fp32_auto.model.modules())


def _count_fused_steps(monkeypatch, calls: list) -> None:
    """Append to calls for every fused decoding step (the layers alone, from the ids to the logits, or
    each of the steps a greedy burst ran)."""
    for name in ("__call__", "logits"):
        real = getattr(FusedDecoder, name)
        monkeypatch.setattr(FusedDecoder, name, lambda self, *a, _real=real, **k: calls.append(1) or _real(self, *a, **k))
    for name in ("greedy_steps", "sample_steps"):
        real_burst = getattr(FusedDecoder, name)

        def burst(self, *a, _real=real_burst, **k):
            block = _real(self, *a, **k)
            calls.extend([1] * block.shape[1])
            return block

        monkeypatch.setattr(FusedDecoder, name, burst)


@pytest.mark.usefixtures("quant_kernels_built")
# (the Llama fixture's MLP width is no multiple of int4's groups: its down projection would stay in torch)
@pytest.mark.parametrize(("name", "quantize"), [("gpt2", "int4"), ("llama", "int8"), ("gpt2", None), ("llama", None)])
def test_generation_decodes_from_token_ids_to_choices_in_one_call_with_the_same_tokens(models, name, quantize, monkeypatch):
    """On a CPU with gencli's kernels each decoding step goes from the ids to the logits in one native
    call, several steps a call (the choices fed back natively: the step's argmax, or the native sampler);
    the completions are those of the layers and the head from Python, greedy, sampled with a seed, and
    with a repetition penalty."""
    import dataclasses

    from gencli.models.causal_lm import CausalLM
    from gencli.pipelines.text import generate as generate_module
    from gencli.pipelines.text.generate import GenerationSettings, generate
    from gencli.pipelines.text.loading import load_text_model
    from gencli.pipelines.text.sampling import SamplingParams

    tm = load_text_model(models / name, device="cpu", dtype="float32" if quantize else "bfloat16", quantize=quantize)
    greedy = GenerationSettings(max_new_tokens=12, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    runs = [
        greedy,
        dataclasses.replace(greedy, sampling=SamplingParams(temperature=0.9, top_k=20), seed=3),
        dataclasses.replace(greedy, sampling=SamplingParams(temperature=0.0, repetition_penalty=1.3)),
    ]

    def completions():
        out = []
        for s in runs:
            gen = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
            out.append([c.token_ids for c in generate(tm, PROMPTS, s, generator=gen)])
        return out

    calls, bursts, sampled = [], [], []
    real, real_burst, real_sampled = CausalLM.fused_logits, CausalLM.fused_greedy_steps, CausalLM.fused_sample_steps

    def logits(self, *a, **k):
        done = real(self, *a, **k)
        calls.append((k["greedy"], done is not None))
        return done

    def burst(self, *a, **k):
        block = real_burst(self, *a, **k)
        bursts.append(block.shape[1])
        return block

    def sampled_burst(self, *a, **k):
        block = real_sampled(self, *a, **k)
        sampled.append(block.shape[1])
        return block

    monkeypatch.setattr(CausalLM, "fused_logits", logits)
    monkeypatch.setattr(CausalLM, "fused_greedy_steps", burst)
    monkeypatch.setattr(CausalLM, "fused_sample_steps", sampled_burst)
    monkeypatch.setattr(generate_module, "BURST_SECONDS", 1e9)  # (every burst after the first: as long as allowed)
    got = completions()
    # every decoding step in a native call of several steps: plain greedy ones choose by the step's argmax,
    # sampled ones (and greedy ones with a repetition penalty) by the native sampler
    assert calls == [] and bursts == [1, 10] and sampled == [1, 10, 1, 10]
    for name in ("fused_logits", "fused_greedy_steps", "fused_sample_steps"):
        monkeypatch.setattr(CausalLM, name, lambda self, *a, **k: None)
    want = completions()
    assert got == want
    assert got[0] != got[1]  # sampling matters: a sane fixture
