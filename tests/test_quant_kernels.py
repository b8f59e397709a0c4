"""gencli's quantized CPU kernels (gencli.backend.quant_kernels): the int8 / int4 products against the
dequantized weight in float64, on every instruction set this CPU offers, the layer using them (one copy
of the weights), and the fallback to torch's kernels when the extension cannot be had."""

from __future__ import annotations

import pytest
import torch

from gencli.backend import quant_kernels
from gencli.backend.quantize import QuantizationSpec, QuantizedLinear, dequantize, quantize_int4, quantize_int8

kernels = quant_kernels.cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="the quantized CPU kernels cannot be built here")


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    """Each instruction set the CPU has, forced in turn (the best one restored afterwards)."""
    best = kernels.isa()
    if not kernels.use_isa(request.param):
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    kernels.use_isa(best)


def _within_fp32_rounding(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """``got`` is ``x @ dense.T`` up to fp32 rounding: the error against a float64 product is at most
    a few units of fp32 precision times the sum of the magnitudes of the terms."""
    ref = x.double() @ dense.double().T
    bound = 1e-6 * (x.double().abs() @ dense.double().abs().T) + 1e-30
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert ((got.double() - ref).abs() <= bound).all(), ((got.double() - ref).abs() / bound).max()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(50, 40), (37, 768), (8, 16)])  # K tails shorter than a vector, rows not a multiple of 4
def test_int8_kernel_is_the_dequantized_product(isa, rows, shape):
    torch.manual_seed(rows)
    q, scale = quantize_int8(torch.randn(shape))
    x = torch.randn(rows, shape[1])
    _within_fp32_rounding(kernels.int8_gemv(x, q, scale), x, dequantize("int8", q, scale))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize(("out_f", "in_f", "group"), [(21, 640, 32), (16, 768, 32), (9, 1088, 64), (5, 384, 128), (7, 512, 256), (3, 32 * 17, 32)])
def test_int4_kernel_is_the_dequantized_product(isa, rows, out_f, in_f, group):
    torch.manual_seed(out_f)
    weight = torch.randn(out_f, in_f) + torch.linspace(-1, 3, in_f)  # groups with a nonzero mean: the zero points count
    packed, scale, zero = quantize_int4(weight, group)
    x = torch.randn(rows, in_f)
    _within_fp32_rounding(kernels.int4_gemv(x, packed, scale, zero, group), x, dequantize("int4", packed, scale, zero))


@needs_kernels
def test_kernels_refuse_what_they_cannot_multiply():
    q, scale = quantize_int8(torch.randn(4, 32))
    with pytest.raises(RuntimeError, match="shapes"):
        kernels.int8_gemv(torch.randn(1, 16), q, scale)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.int8_gemv(torch.randn(1, 32, dtype=torch.float64), q, scale)
    packed, scale, zero = quantize_int4(torch.randn(4, 96), 32)
    with pytest.raises(RuntimeError, match="group size"):
        kernels.int4_gemv(torch.randn(1, 96), packed, scale, zero, 48)


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_layer_decodes_with_the_kernels_in_fp32_from_one_copy_of_the_weights(mode):
    torch.manual_seed(1)
    layer = QuantizedLinear.from_weight(torch.randn(48, 128) * 0.05, torch.randn(48), QuantizationSpec.for_mode(mode))
    x = torch.randn(1, 1, 128)
    with torch.inference_mode():
        out = layer(x, activation="gelu")
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), layer.dequantized().double(), layer.bias.double()))
    # fp32 activations: far closer than torch's kernels, which multiply in bf16 (about 1e-2 relative)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert layer._kernel is None  # torch's int4 layout (a second copy of the codes) never built


def test_without_the_kernels_the_layer_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv(quant_kernels.ENV_SWITCH, "0")
    assert quant_kernels.cpu_kernels() is None
    torch.manual_seed(2)
    layer = QuantizedLinear.from_weight(torch.randn(32, 64), None, QuantizationSpec.for_mode("int4"))
    x = torch.randn(1, 64)
    with torch.inference_mode():
        out = layer(x)
    ref = x @ layer.dequantized().T
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()  # bf16 activations in torch's kernel


def test_a_failed_build_is_a_quiet_fallback(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level("DEBUG", logger=quant_kernels.__name__):
        assert quant_kernels._build.__wrapped__() is None
    assert [r.levelname for r in caplog.records] == ["DEBUG"] and "c++: not found" in caplog.records[0].getMessage()


def test_first_build_is_announced_once_on_stderr(tmp_path, monkeypatch, capsys):
    import torch.utils.cpp_extension as ext

    from gencli.backend import quant_kernels

    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose=False: str(tmp_path))
    quant_kernels._announce_first_build("gencli_quant_gemv_x")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compiling the quantized CPU kernels" in err and str(tmp_path) in err
    (tmp_path / "gencli_quant_gemv_x.so").write_bytes(b"")  # cached: nothing to say
    quant_kernels._announce_first_build("gencli_quant_gemv_x")
    assert capsys.readouterr().err == ""
