"""bf16 linear layers with oneDNN-packed weights (gencli.backend.packed_linear), and their use by the
seq2seq loader for bf16 decoding on a CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.layers import Linear, get_activation
from gencli.backend.packed_linear import PackedLinear, pack_linears, packing_available

needs_packing = pytest.mark.skipif(not packing_available(), reason="no oneDNN bf16 matmul on this CPU")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16 products of the same bf16 operands, up to summation order and one rounding of the output."""
    assert a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@needs_packing
@pytest.mark.parametrize("rows", [1, 4, 37])
@pytest.mark.parametrize("activation", [None, "relu", "gelu_new", "quick_gelu"])
def test_packed_linear_matches_f_linear_in_bf16(rows, activation):
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=True).to(torch.bfloat16)
    packed = PackedLinear(layer.weight, layer.bias)
    x = torch.randn(2, rows, 48).to(torch.bfloat16)
    with torch.inference_mode():
        want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        want = get_activation(activation)(want) if activation else want
        got = packed(x, activation=activation)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, 80)
    _close(got, want)
    assert torch.equal(packed.weight, layer.weight.detach())


@needs_packing
def test_packed_linear_falls_back_with_autograd_or_another_dtype():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    packed = PackedLinear(layer.weight, None)
    x = torch.randn(3, 16)
    out = packed(x)  # fp32 input: F.linear on the weight unpacked
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, layer.weight.float()))
    x16 = x.to(torch.bfloat16).requires_grad_()
    with torch.enable_grad():
        assert packed(x16).requires_grad


@needs_packing
def test_pack_linears_swaps_every_bf16_linear_and_keeps_a_tied_embedding():
    from gencli.models.t5 import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    model = T5ForConditionalGeneration(cfg).eval().to(torch.bfloat16)
    ids, dec = torch.randint(3, 64, (2, 7)), torch.randint(3, 64, (2, 4))
    with torch.inference_mode():
        want = model(ids, dec)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert pack_linears(model) == linears > 0
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear) and model.shared.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        got = model(ids, dec)
    torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)
    assert pack_linears(model) == 0  # nothing left to pack


@needs_packing
def test_seq2seq_bf16_decodes_with_packed_weights(tmp_path):
    """--dtype bfloat16 on a CPU: every linear layer packed, and greedy decoding runs through them to
    the tokens an unpacked bf16 model gives (tiny random T5: decisive logits)."""
    from gencli.pipelines.seq2seq.generate import encode_input, generate, resolve_settings
    from gencli.pipelines.seq2seq.loading import load_seq2seq_model
    from tests._seq2seq_fixtures import t5_checkpoint

    folder = t5_checkpoint(tmp_path / "t5", "v1.0", seed=0)
    sm = load_seq2seq_model(folder, device="cpu", dtype="bfloat16")
    assert isinstance(sm.model.lm_head, PackedLinear)
    text = "the quick brown fox"
    settings = resolve_settings(sm.generation_config, max_new_tokens=6, temperature=0.0, eos_ids=sm.eos_ids)
    got = generate(sm, [(text, encode_input(sm, text))], settings)[0].token_ids
    plain = load_seq2seq_model(folder, device="cpu", dtype="float32")
    plain.model.to(torch.bfloat16)
    want = generate(plain, [(text, encode_input(plain, text))], settings)[0].token_ids
    assert got == want and len(got) >= 1


@needs_packing
def test_bf16_greedy_screens_the_packed_head(tmp_path, monkeypatch):
    """Greedy steps of a bf16 model with a packed head choose by the screened argmax of the head's
    fp32 image (here forced on for a tiny head): the tokens of the plain argmax of the logits."""
    from gencli.backend.screened_argmax import ScreenedArgmax
    from gencli.pipelines.seq2seq import generate as g
    from gencli.pipelines.seq2seq.loading import load_seq2seq_model
    from tests._seq2seq_fixtures import INPUTS, t5_checkpoint

    folder = t5_checkpoint(tmp_path / "t5", "v1.0", seed=3)
    sm = load_seq2seq_model(folder, device="cpu", dtype="bfloat16")
    if not ScreenedArgmax.supported(sm.model.lm_head.weight.float()):
        pytest.skip("no screened argmax on this CPU")
    inputs = [(t, g.encode_input(sm, t)) for t in INPUTS[:3]]
    settings = g.resolve_settings(sm.generation_config, max_new_tokens=8, temperature=0.0, eos_ids=sm.eos_ids)
    want = [o.token_ids for o in g.generate(sm, inputs, settings)]
    assert sm.screen is None  # a tiny head: not screened by default
    monkeypatch.setattr(g, "SCREEN_MIN_HEAD_BYTES", 0)
    monkeypatch.setattr(g, "SCREEN_MIN_STEPS", 1)
    got = [o.token_ids for o in g.generate(sm, inputs, settings)]
    assert isinstance(sm.screen, ScreenedArgmax) and sm.screen.weight.dtype == torch.float32
    assert got == want


def test_auto_dtype_of_an_encoder_decoder(monkeypatch):
    """--dtype auto: bf16 (packed) only for a model of 20M parameters or more on a CPU with native
    bf16 and oneDNN's packed matmul; an explicit dtype always wins."""
    from gencli.pipelines.seq2seq import loading

    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(loading, "packing_available", lambda: True)
    big, small = loading.PACKED_BF16_MIN_PARAMS, loading.PACKED_BF16_MIN_PARAMS - 1
    assert loading._auto_dtype("cpu", "auto", big) == "bfloat16"
    assert loading._auto_dtype("cpu", "auto", small) == "auto"
    assert loading._auto_dtype("cpu", "float32", big) == "float32"
    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: False)
    assert loading._auto_dtype("cpu", "auto", big) == "auto"
