"""Dense decoding products (gencli.backend.streamed_linear, csrc/quant_gemv.cpp): fp32 and bf16 weights
times fp32 activations against the float64 product of the same values, on every instruction set this
CPU has, by the vector kernels and the plain reference; the layer (kernel for a few rows, torch's GEMM
beyond), and stream_linears swapping GPT-2's Conv1D, nn.Linear and a tied head."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gencli.backend import quant_kernels
from gencli.backend.streamed_linear import DENSE_MAX_ROWS, StreamedLinear, stream_linears

kernels = quant_kernels.cpu_kernels()
needs_kernels = pytest.mark.usefixtures("quant_kernels_built")  # a skip saying why, a failure on CI


def _within_fp32_rounding(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias=None) -> None:
    ref = x.double() @ dense.double().T + (0 if bias is None else bias.double())
    bound = 1e-6 * (x.double().abs() @ dense.double().abs().T) + 1e-30
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert ((got.double() - ref).abs() <= bound).all(), ((got.double() - ref).abs() / bound).max()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(50, 40), (37, 768), (8, 16), (5, 7), (130, 1000)])  # K tails, rows not a multiple of 4
def test_the_dense_kernel_is_the_product_of_the_stored_values(isa, dtype, rows, shape):
    torch.manual_seed(rows)
    w = torch.randn(shape).to(dtype)
    x, b = torch.randn(rows, shape[1]), torch.randn(shape[0])
    _within_fp32_rounding(kernels.dense_gemv(x, w), x, w.float())
    _within_fp32_rounding(kernels.dense_gemv(x, w, b), x, w.float(), b)
    _within_fp32_rounding(kernels.dense_gemv_reference(x, w, b), x, w.float(), b)


@needs_kernels
def test_several_dense_weights_in_one_call_equal_one_call_each():
    torch.manual_seed(0)
    x = torch.randn(3, 96)
    ws = [torch.randn(n, 96).bfloat16() for n in (40, 96, 7)]
    bs = [torch.randn(40), None, torch.randn(7)]
    together = kernels.dense_gemv_many(x, ws, bs)
    for got, w, b in zip(together, ws, bs):
        assert torch.equal(got, kernels.dense_gemv(x, w, b))
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.dense_gemv_many(x, [ws[0], ws[1].float()], [None, None])
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.dense_gemv(x, torch.randn(96, 40).t())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.dense_gemv(x, torch.randn(40, 96).half())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_uses_the_kernel_for_few_rows_and_torch_beyond(dtype, monkeypatch):
    torch.manual_seed(1)
    w, b = torch.randn(24, 64), torch.randn(24)
    layer = StreamedLinear(w.to(dtype), b)
    calls = []
    real = kernels.dense_gemv
    monkeypatch.setattr(kernels, "dense_gemv", lambda *a: calls.append(1) or real(*a), raising=False)
    few, many = torch.randn(2, 1, 64), torch.randn(DENSE_MAX_ROWS[dtype], 64)
    for x, kernel in ((few, True), (many, False)):
        calls.clear()
        with torch.inference_mode():
            got = layer(x, activation="relu")
        assert bool(calls) == kernel
        ref = torch.relu(x.double() @ w.to(dtype).double().T + b.double())
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        StreamedLinear(w.half(), None)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_linears_swaps_conv1d_linear_and_a_tied_head(dtype):
    from gencli.models.gpt2 import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    ids = torch.randint(0, 96, (2, 9))
    with torch.inference_mode():
        want = model(ids)
        conv = model.transformer.h[0].attn.c_attn.linear_weight().clone()
        assert stream_linears(model, dtype) == 4 * 2 + 1  # four projections a block and the head
        got = model(ids)
    layer = model.transformer.h[0].attn.c_attn
    assert isinstance(layer, StreamedLinear) and layer.weight.is_contiguous() and torch.equal(layer.weight.float(), conv.to(dtype).float())
    head = model.lm_head
    assert isinstance(head, StreamedLinear) and head.weight.dtype == dtype
    assert (head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()) == (dtype == torch.float32)  # fp32: the tied weight, no copy
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert stream_linears(model, dtype) == 0  # nothing left to swap


def test_without_the_kernels_nothing_is_swapped(monkeypatch):
    monkeypatch.setenv(quant_kernels.ENV_SWITCH, "0")
    model = nn.Sequential(nn.Linear(8, 4))
    assert stream_linears(model, torch.bfloat16) == 0 and isinstance(model[0], nn.Linear)
