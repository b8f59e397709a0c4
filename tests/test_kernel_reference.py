"""The vector kernels of the CPU extension against its plain scalar reference kernels (``csrc/reference.cpp``),
product by product (int8 and int4 weights, fp32 and int8 activations) on every instruction set this CPU
offers: equal to the bit where every sum is an exact integer, within fp32 rounding elsewhere; and the
references themselves against the dequantized product in float64."""

from __future__ import annotations

import pytest
import torch

from gencli.backend import quant_kernels
from gencli.backend.quantize import dequantize, quantize_int4, quantize_int8, unpack_int4

kernels = quant_kernels.cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the quantized CPU kernels cannot be built here")

ROWS = (1, 2, 3, 4, 5, 9)  # activation tiles of 1 to 4 rows, and more than one tile
INT8_SHAPES = [(50, 64), (37, 768), (9, 864), (13, 320), (6, 96), (8, 40), (5, 16), (11, 100), (4, 7)]  # (N, K): K tails; K % 32 != 0 keeps fp32
INT4_SHAPES = [(21, 640, 32), (16, 768, 32), (9, 1088, 64), (5, 384, 128), (7, 512, 256), (13, 320, 32), (6, 864, 32), (11, 96, 32), (3, 544, 32)]


def _integer_activations(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Integers in [-127, 127] with 127 in every block of 32: int8 activations quantize them to themselves (scale 1)."""
    x = torch.randint(-127, 128, (rows, k), generator=gen).float()
    x[:, ::32] = 127.0
    return x


def _powers_of_two(shape, low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    return (2.0 ** torch.randint(low, high + 1, shape, generator=gen).float()).to(torch.bfloat16)


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize(("out_f", "in_f"), INT8_SHAPES)
def test_int8_kernels_equal_the_reference_on_exact_integers(isa, out_f, in_f, int8_activations):
    """Small integer codes and activations, power-of-two scales: every sum is exact in fp32, whatever its
    order, so the vector kernels and the reference agree to the bit."""
    gen = torch.Generator().manual_seed(out_f * in_f)
    q = torch.randint(-31, 32, (out_f, in_f), generator=gen, dtype=torch.int8)
    q[0, :] = -31  # the most negative codes the layer stores, in full rows
    scale = _powers_of_two((out_f,), -6, 0, gen)
    for rows in ROWS:
        x = _integer_activations(rows, in_f, gen)
        got = kernels.int8_gemv(x, q, scale, int8_activations)
        want = kernels.int8_gemv_reference(x, q, scale, int8_activations)
        assert torch.equal(got, want), (rows, (got - want).abs().max())


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize(("out_f", "in_f", "group"), INT4_SHAPES)
def test_int4_kernels_equal_the_reference_on_exact_integers(isa, out_f, in_f, group, int8_activations):
    gen = torch.Generator().manual_seed(out_f * in_f + group)
    packed = torch.randint(0, 256, (out_f, in_f // 2), generator=gen, dtype=torch.uint8)
    packed[0, :] = 0xF0  # codes 0 and 15 side by side
    scale = _powers_of_two((out_f, in_f // group), -2, 0, gen)
    zero = (torch.randint(-16, 17, (out_f, in_f // group), generator=gen) / 4).to(torch.bfloat16)
    for rows in ROWS:
        x = _integer_activations(rows, in_f, gen)
        got = kernels.int4_gemv(x, packed, scale, zero, group, int8_activations)
        want = kernels.int4_gemv_reference(x, packed, scale, zero, group, int8_activations)
        assert torch.equal(got, want), (rows, (got - want).abs().max())


def _close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """Within a few units of fp32 precision of the sum of the magnitudes of the terms."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    error = (got.double() - want.double()).abs()
    bound = 1e-6 * magnitude + 1e-30
    assert (error <= bound).all(), (error / bound).max()


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize(("out_f", "in_f"), INT8_SHAPES)
def test_int8_kernels_are_the_reference_within_fp32_rounding(isa, out_f, in_f, int8_activations):
    torch.manual_seed(out_f + in_f)
    q, scale = quantize_int8(torch.randn(out_f, in_f))
    bias = torch.randn(out_f)
    weight = dequantize("int8", q, scale).double().abs()
    for rows in ROWS:
        x = torch.randn(rows, in_f) * torch.logspace(-2, 1, in_f)  # blocks of different magnitudes
        got = kernels.int8_gemv(x, q, scale, int8_activations, bias)
        want = kernels.int8_gemv_reference(x, q, scale, int8_activations, bias)
        _close(got, want, 1.01 * x.double().abs() @ weight.T + bias.double().abs())


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize(("out_f", "in_f", "group"), INT4_SHAPES)
def test_int4_kernels_are_the_reference_within_fp32_rounding(isa, out_f, in_f, group, int8_activations):
    """The terms: the codes times the scales, and the offsets (zero - 8 scale) times x, as the kernels sum them."""
    torch.manual_seed(out_f + in_f + group)
    packed, scale, zero = quantize_int4(torch.randn(out_f, in_f) + torch.linspace(-1, 3, in_f), group)
    bias = torch.randn(out_f)
    s, z = scale.double().repeat_interleave(group, 1), zero.double().repeat_interleave(group, 1)
    terms = (unpack_int4(packed).double() * s).abs() + (z - 8 * s).abs()
    for rows in ROWS:
        x = torch.randn(rows, in_f)
        got = kernels.int4_gemv(x, packed, scale, zero, group, int8_activations, bias)
        want = kernels.int4_gemv_reference(x, packed, scale, zero, group, int8_activations, bias)
        _close(got, want, 1.01 * x.double().abs() @ terms.T + bias.double().abs())


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """The int8 activations the integer products multiply, dequantized (float64)."""
    q, sx = kernels.quantize_activations(x)
    return (q.double().reshape(x.shape[0], -1, 32) * sx.double()[..., None]).reshape(x.shape)


def test_the_references_are_the_dequantized_products():
    """fp32 activations: x @ w.T; int8 activations: the quantized x times the int8 weights, and for int4
    the quantized x times the codes plus the exact x times the offsets (zero - 8 scale)."""
    torch.manual_seed(0)
    x = torch.randn(3, 256)
    q, scale = quantize_int8(torch.randn(24, 256))
    w = dequantize("int8", q, scale).double()
    _close(kernels.int8_gemv_reference(x, q, scale), (x.double() @ w.T).float(), x.double().abs() @ w.abs().T)
    _close(kernels.int8_gemv_reference(x, q, scale, True), (_quantized(x) @ w.T).float(), x.double().abs() @ w.abs().T)
    packed, scale, zero = quantize_int4(torch.randn(24, 256) + 1, 64)
    w = dequantize("int4", packed, scale, zero).double()
    _close(kernels.int4_gemv_reference(x, packed, scale, zero, 64), (x.double() @ w.T).float(), x.double().abs() @ w.abs().T)
    s, z = scale.double().repeat_interleave(64, 1), zero.double().repeat_interleave(64, 1)
    codes, offsets = unpack_int4(packed).double() * s, z - 8 * s
    want = _quantized(x) @ codes.T + x.double() @ offsets.T
    magnitude = x.double().abs() @ (codes.abs() + offsets.abs()).T
    _close(kernels.int4_gemv_reference(x, packed, scale, zero, 64, True), want.float(), magnitude)
