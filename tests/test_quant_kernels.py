"""gencli's quantized CPU kernels (gencli.backend.quant_kernels): the int8 / int4 products against the
dequantized weight in float64, with fp32 activations and with the activations quantized to int8 (the
integer kernels), on every instruction set this CPU offers; the layer using them (one copy of the
weights), and the fallback to torch's kernels when the extension cannot be had."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gencli.backend import quant_kernels
from gencli.backend.quantize import QuantizationSpec, QuantizedLinear, dequantize, quantize_int4, quantize_int8, unpack_int4

kernels = quant_kernels.cpu_kernels()
needs_kernels = pytest.mark.usefixtures("quant_kernels_built")  # a skip saying why, a failure on CI


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


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """The activations the integer kernels multiply: ``x`` quantized by the extension, dequantized."""
    q, sx = kernels.quantize_activations(x)
    return (q.double().reshape(x.shape[0], -1, 32) * sx.double()[..., None]).reshape(x.shape)


@needs_kernels
def test_activations_are_quantized_in_blocks_of_32_as_q8_0():
    torch.manual_seed(0)
    x = torch.randn(5, 320) * torch.logspace(-3, 2, 320)  # blocks of very different magnitudes
    x[1, :32] = 0  # an all-zero block
    q, sx = kernels.quantize_activations(x)
    blocks = x.reshape(5, 10, 32)
    assert q.dtype == torch.int8 and q.shape == x.shape and sx.shape == (5, 10)
    assert torch.equal(sx, blocks.abs().amax(-1) / 127)
    assert int(q.abs().max()) == 127 and not q[1, :32].any()
    ideal = blocks / sx.clamp(min=1e-30)[..., None]  # each code is the nearest to x / scale
    assert ((q.reshape(5, 10, 32) - ideal).abs() <= 0.5 + 1e-4).all()


def test_vector_activation_quantization_is_the_scalar_rule_bit_for_bit(isa):
    """The vector quantization (act_quant.inc) gives the codes and scales of the plain reference exactly,
    halves rounded to even, the clamp and an all-zero block included."""
    torch.manual_seed(1)
    x = torch.randn(3, 2816) * torch.logspace(-4, 3, 2816)
    x[0, :32] = 0
    x[1, :32] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -1.5, 126.5, -126.5] + [0.25] * 22)  # amax 127: x * 127 / amax = x
    got, want = kernels.quantize_activations(x), kernels.quantize_activations(x, reference=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0][1, 1:10].tolist() == [2, 4, -2, 0, 0, 2, -2, 126, -126]


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("shape", [(50, 64), (37, 768), (9, 864), (13, 320), (6, 96)])  # K short of a vector: 864, 320, 96
def test_int8_kernel_with_int8_activations_is_the_product_of_the_quantized_activations(isa, rows, shape):
    torch.manual_seed(rows)
    q, scale = quantize_int8(torch.randn(shape))
    x = torch.randn(rows, shape[1])
    _within_fp32_rounding(kernels.int8_gemv(x, q, scale, True), _int8_activations(x), dequantize("int8", q, scale))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize(
    ("out_f", "in_f", "group"), [(21, 640, 32), (16, 768, 32), (9, 1088, 64), (5, 384, 128), (7, 512, 256), (13, 320, 32), (6, 864, 32), (11, 96, 32)]
)
def test_int4_kernel_with_int8_activations_is_the_product_of_the_quantized_activations(isa, rows, out_f, in_f, group):
    """The codes times the quantized activations, and the zero points times the exact group sums."""
    torch.manual_seed(out_f)
    weight = torch.randn(out_f, in_f) + torch.linspace(-1, 3, in_f)
    packed, scale, zero = quantize_int4(weight, group)
    x = torch.randn(rows, in_f)
    got = kernels.int4_gemv(x, packed, scale, zero, group, True).double()
    s, z = scale.double().repeat_interleave(group, 1), zero.double().repeat_interleave(group, 1)
    codes, offsets = unpack_int4(packed).double() * s, z - 8 * s  # w = codes + offsets
    xq = _int8_activations(x)
    ref = xq @ codes.T + x.double() @ offsets.T
    bound = 1e-6 * (xq.abs() @ codes.abs().T + x.double().abs() @ offsets.abs().T)
    assert ((got - ref).abs() <= bound).all(), ((got - ref).abs() / bound).max()


@needs_kernels
def test_int8_activations_stay_close_to_the_exact_product():
    """Q8_0 activations cost about 0.3% of the product's magnitude; a width that is not a multiple of
    32 keeps fp32 activations (exact)."""
    torch.manual_seed(3)
    w, x = torch.randn(64, 768) * 0.02, torch.randn(1, 768)
    q, scale = quantize_int8(w)
    exact = x @ dequantize("int8", q, scale).T
    rel = ((kernels.int8_gemv(x, q, scale, True) - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.01, rel
    q, scale = quantize_int8(torch.randn(8, 40))
    x = torch.randn(2, 40)
    _within_fp32_rounding(kernels.int8_gemv(x, q, scale, True), x, dequantize("int8", q, scale))


@needs_kernels
@pytest.mark.parametrize("int8_activations", [False, True])
def test_the_bias_is_added_in_the_call(int8_activations):
    torch.manual_seed(4)
    x, bias = torch.randn(3, 128), torch.randn(40)
    q, scale = quantize_int8(torch.randn(40, 128))
    plain = kernels.int8_gemv(x, q, scale, int8_activations)
    assert torch.equal(kernels.int8_gemv(x, q, scale, int8_activations, bias), plain + bias)
    packed, scale, zero = quantize_int4(torch.randn(40, 128), 32)
    plain = kernels.int4_gemv(x, packed, scale, zero, 32, int8_activations)
    assert torch.equal(kernels.int4_gemv(x, packed, scale, zero, 32, int8_activations, bias), plain + bias)
    # the layer's tensors are passed as they are: another dtype is converted, a wrong length refused
    assert torch.equal(kernels.int8_gemv(x, q, scale_8 := quantize_int8(torch.randn(40, 128))[1], int8_activations, bias.double()),
                       kernels.int8_gemv(x, q, scale_8, int8_activations, bias))
    with pytest.raises(RuntimeError, match="bias"):
        kernels.int8_gemv(x, q, scale_8, int8_activations, bias[:30])


@needs_kernels
@pytest.mark.parametrize("int8_activations", [False, True])
def test_the_kernels_take_activations_of_any_shape_and_layout(int8_activations):
    """x (..., K) as a decoding step has it, strided or not; the result (..., N); float32 scales are
    converted to the bf16 the kernels read."""
    torch.manual_seed(5)
    x = torch.randn(2, 3, 256)[..., ::2]  # (2, 3, 128), not contiguous
    q, scale = quantize_int8(torch.randn(40, 128))
    flat = kernels.int8_gemv(x.reshape(6, 128).contiguous(), q, scale, int8_activations)
    got = kernels.int8_gemv(x, q, scale.float(), int8_activations)
    assert got.shape == (2, 3, 40) and torch.equal(got.reshape(6, 40), flat)
    packed, scale, zero = quantize_int4(torch.randn(40, 128), 32)
    flat = kernels.int4_gemv(x.reshape(6, 128).contiguous(), packed, scale, zero, 32, int8_activations)
    got = kernels.int4_gemv(x, packed, scale.float(), zero.float(), 32, int8_activations)
    assert got.shape == (2, 3, 40) and torch.equal(got.reshape(6, 40), flat)


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
@pytest.mark.parametrize("activations", ["int8", "fp32", None])
def test_the_layer_decodes_with_the_kernels_from_one_copy_of_the_weights(mode, activations, monkeypatch):
    if activations is None:
        monkeypatch.delenv(quant_kernels.ENV_ACTIVATIONS, raising=False)  # the default: int8
    else:
        monkeypatch.setenv(quant_kernels.ENV_ACTIVATIONS, activations)
    torch.manual_seed(1)
    layer = QuantizedLinear.from_weight(torch.randn(48, 128) * 0.05, torch.randn(48), QuantizationSpec.for_mode(mode))
    x = torch.randn(1, 1, 128)
    with torch.inference_mode():
        out = layer(x, activation="gelu")
    dense = layer.dequantized().double()
    exact = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), dense, layer.bias.double()))
    if activations == "fp32":  # far closer than torch's kernels, which multiply in bf16 (about 1e-2 relative)
        assert (out.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    else:
        assert 1e-5 * exact.abs().max() < (out.double() - exact).abs().max() <= 0.02 * exact.abs().max()
    assert layer._kernel is None  # torch's int4 layout (a second copy of the codes) never built


def test_a_bad_activation_setting_is_refused(monkeypatch):
    monkeypatch.setenv(quant_kernels.ENV_ACTIVATIONS, "bf16")
    with pytest.raises(ValueError, match="GENCLI_QUANT_ACTIVATIONS must be one of int8, fp32"):
        quant_kernels.int8_activations()
    monkeypatch.setenv(quant_kernels.ENV_ACTIVATIONS, " FP32 ")
    assert quant_kernels.int8_activations() is False


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


def test_a_failed_build_is_a_quiet_fallback_remembered_by_the_next_processes(tmp_path, monkeypatch, caplog):
    import os
    import subprocess
    import time

    import torch.utils.cpp_extension as cpp_extension

    from gencli.errors import Notice

    calls, errors = [], []

    def failing_build(*args, **kwargs):
        calls.append(kwargs["name"])
        code, output = errors[0]
        try:
            raise subprocess.CalledProcessError(code, ["ninja"], output)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"Error building extension '{kwargs['name']}': {output}") from e

    monkeypatch.setattr(cpp_extension, "load", failing_build)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose=False: str(tmp_path))
    monkeypatch.setattr(quant_kernels, "_why_not", None)
    # cut short (the compiler killed for memory, a signal): no note, the next process tries again
    for cut in [(1, "c++: fatal error: Killed signal terminated program cc1plus"), (-9, "")]:
        errors[:] = [cut]
        assert quant_kernels._build.__wrapped__() is None
    assert not list(tmp_path.glob("build-failed-*.txt")) and len(calls) == 2
    # the compiler's verdict on the sources is remembered
    errors[:] = [(1, "quant_gemv.cpp:12: error: 'foo' was not declared in this scope")]
    with caplog.at_level("DEBUG", logger=quant_kernels.__name__):
        assert quant_kernels._build.__wrapped__() is None
    assert [r.levelname for r in caplog.records] == ["DEBUG"] and "not declared" in caplog.records[0].getMessage()
    (note,) = tmp_path.glob("build-failed-*.txt")
    assert "not declared" in note.read_text() and len(calls) == 3
    with pytest.warns(Notice, match="failed to build earlier .*not declared.*torch's slower ones"):
        assert quant_kernels._build.__wrapped__() is None
    assert len(calls) == 3  # the next process does not build again, and says why
    assert "not declared" in quant_kernels._why_not and str(note) in quant_kernels._why_not
    day_ago = time.time() - quant_kernels.FAILURE_NOTE_SECONDS - 60
    os.utime(note, (day_ago, day_ago))  # a day later: it tries again
    assert quant_kernels._build.__wrapped__() is None and len(calls) == 4
    note.unlink()  # deleting the note tries again
    assert quant_kernels._build.__wrapped__() is None and len(calls) == 5
    # a built extension is loaded whatever a note says (built with another compiler, say)
    (tmp_path / f"{calls[-1]}.so").write_bytes(b"")
    assert quant_kernels._build.__wrapped__() is None and len(calls) == 6


def test_first_build_is_announced_once_on_stderr(tmp_path, monkeypatch, capsys):
    import torch.utils.cpp_extension as ext

    from gencli.backend import quant_kernels

    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose=False: str(tmp_path))
    quant_kernels._announce_first_build("gencli_quant_gemv_x")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compiling the CPU kernels" in err and str(tmp_path) in err
    (tmp_path / "gencli_quant_gemv_x.so").write_bytes(b"")  # cached: nothing to say
    quant_kernels._announce_first_build("gencli_quant_gemv_x")
    assert capsys.readouterr().err == ""


@needs_kernels
@pytest.mark.parametrize("int8_activations", [False, True])
def test_several_weights_in_one_call_equal_one_call_each(int8_activations):
    """``int*_gemv_many``: x's activations quantized once, every weight's rows in one pass; the same
    results as a call per weight, biases (or None) per weight."""
    torch.manual_seed(6)
    x = torch.randn(1, 2, 256)
    shapes, biases = (40, 24, 24), [torch.randn(40), None, torch.randn(24)]
    eights = [quantize_int8(torch.randn(n, 256)) for n in shapes]
    got = kernels.int8_gemv_many(x, [q for q, _ in eights], [s for _, s in eights], int8_activations, biases)
    for out, (q, s), b in zip(got, eights, biases):
        assert torch.equal(out, kernels.int8_gemv(x, q, s, int8_activations, b))
    fours = [quantize_int4(torch.randn(n, 256), 64) for n in shapes]
    got = kernels.int4_gemv_many(x, [f[0] for f in fours], [f[1] for f in fours], [f[2] for f in fours], 64, int8_activations, biases)
    for out, (q, s, z), b in zip(got, fours, biases):
        assert torch.equal(out, kernels.int4_gemv(x, q, s, z, 64, int8_activations, b))
    with pytest.raises(RuntimeError, match="one scale"):
        kernels.int8_gemv_many(x, [eights[0][0]], [], int8_activations, [None])


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_projections_of_one_input_are_one_kernel_call(mode, monkeypatch):
    """``project``: a quantized layer's q/k/v (or gate/up) decode in one call, with the same outputs as
    the layers called one by one (the activation applied where asked); dense layers are called as usual."""
    from gencli.backend.layers import Linear, project

    torch.manual_seed(7)
    spec = QuantizationSpec.for_mode(mode)
    layers = tuple(QuantizedLinear.from_weight(torch.randn(n, 128) * 0.05, torch.randn(n) if n == 64 else None, spec) for n in (64, 32, 32))
    x = torch.randn(1, 1, 128)
    calls = []
    real = getattr(kernels, f"{mode}_gemv_many")

    class Spy:
        def __getattr__(self, name):
            return getattr(kernels, name)

    spy = Spy()
    setattr(spy, f"{mode}_gemv_many", lambda *args: calls.append(len(args[1])) or real(*args))
    from gencli.backend import quantize

    monkeypatch.setattr(quantize, "cpu_kernels", lambda: spy)
    got = project(x, layers, ("silu", None, None))
    assert calls == [3]
    want = (torch.nn.functional.silu(layers[0](x)), layers[1](x), layers[2](x))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    dense = tuple(Linear(128, n) for n in (8, 4))
    got = project(x, dense, ("gelu", None))
    assert calls == [3] and torch.equal(got[0], dense[0](x, activation="gelu")) and torch.equal(got[1], dense[1](x))
    project(torch.randn(1, 200, 128), layers)  # a prompt: each layer's own (dequantizing) path
    assert calls == [3]


def test_a_missing_ninja_or_compiler_is_named(monkeypatch):
    import torch.utils.cpp_extension as ext

    monkeypatch.setattr(quant_kernels, "_why_not", None)
    monkeypatch.setattr(ext, "is_ninja_available", lambda: False)
    assert quant_kernels._build.__wrapped__() is None
    assert "ninja" in quant_kernels._why_not and "pip install ninja" in quant_kernels._why_not
    monkeypatch.setattr(ext, "is_ninja_available", lambda: True)
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert quant_kernels._build.__wrapped__() is None
    assert quant_kernels._why_not == "no C++ compiler: 'no-such-compiler-here' is not on PATH"
    monkeypatch.setenv(quant_kernels.ENV_SWITCH, "0")
    assert quant_kernels.unavailable_reason() == "GENCLI_QUANT_KERNELS=0 turns them off"


@pytest.mark.parametrize("ci", ["true", None])
def test_without_ninja_the_kernel_tests_fail_on_ci_and_elsewhere_skip_saying_why(ci, tmp_path):
    """The kernels' tests never skip silently: on CI (``CI`` set) a machine that cannot build the
    extension fails them; elsewhere they skip with the reason on one line. Here in a pytest of its
    own whose PATH has a compiler but no ninja."""
    import os
    import shutil
    import subprocess
    import sys

    from conftest import ROOT

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    compiler = shutil.which("c++")
    if compiler:
        os.symlink(compiler, bin_dir / "c++")
    env = {k: v for k, v in os.environ.items() if k != "CI" and not k.startswith(("PYTEST_", "GENCLI_QUANT"))}
    env.update(PATH=str(bin_dir), PYTHONPATH=str(ROOT), **({"CI": ci} if ci else {}))
    test = f"{Path(__file__).name}::test_kernels_refuse_what_they_cannot_multiply"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-q", "-rsE", "-p", "no:cacheprovider", test],
        cwd=ROOT / "tests", env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    reason = "the quantized CPU kernels cannot be built here: ninja, which torch builds extensions with, is not installed (pip install ninja)"
    lines = [line for line in r.stdout.splitlines() if reason in line]
    if ci:
        assert r.returncode == 1 and "1 error" in r.stdout, r.stdout + r.stderr  # (an error in the test's setup)
        assert any("CI must be able to run this test" in line for line in lines), r.stdout
    else:
        assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout + r.stderr
        assert len(lines) == 1 and lines[0].startswith("SKIPPED"), r.stdout
