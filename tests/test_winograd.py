"""3x3 convolutions by Winograd's F(2x2, 3x3) (gencli.backend.winograd, csrc/winograd_conv.cpp): the
weight's transform, the kernel against F.conv2d in float64 on every instruction set, and the packed
Conv2d that takes this path when a model asks for it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import built_quant_kernels

CL = torch.channels_last


@pytest.fixture(autouse=True)
def winograd_switched_on(monkeypatch):
    # the path runs when asked on any CPU (unset, it is off by default on AMD CPUs: the last tests)
    monkeypatch.setenv("GENCLI_WINOGRAD", "1")


def _case(n, c, k, h, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g).contiguous(memory_format=CL)
    weight = torch.randn(k, c, 3, 3, generator=g) / (9 * c) ** 0.5
    bias = torch.randn(k, generator=g)
    residual = torch.randn(n, k, h, w, generator=g).contiguous(memory_format=CL)
    return x, weight, bias, residual


def test_the_weight_transform_is_g_g_gt():
    from gencli.backend.winograd import winograd_weight

    w = torch.randn(5, 3, 3, 3, dtype=torch.float64)
    u = winograd_weight(w)
    assert u.shape == (16, 3, 5) and u.dtype == torch.float32 and u.is_contiguous()
    G = torch.tensor([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=torch.float64)
    for k, c in [(0, 0), (4, 2), (2, 1)]:
        want = G @ w[k, c] @ G.T
        assert torch.allclose(u[:, c, k].double().reshape(4, 4), want, atol=1e-6)
    # the corners are the weight's corners, exactly
    assert torch.equal(u[0].T, w[:, :, 0, 0].float()) and torch.equal(u[15].T, w[:, :, 2, 2].float())
    with pytest.raises(ValueError, match="3, 3"):
        winograd_weight(torch.zeros(2, 2, 1, 1))


@pytest.mark.parametrize("isa_name", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize(
    "shape",
    [(2, 64, 64, 8, 8), (1, 16, 32, 7, 9), (3, 20, 24, 5, 4), (1, 128, 64, 1, 1), (2, 96, 80, 3, 16), (1, 64, 64, 33, 2)],
    ids=["even", "odd-sides", "channel-tails", "one-pixel", "rectangle", "tall"],
)
def test_the_kernel_matches_the_convolution_in_float64(isa_name, shape):
    kernels = built_quant_kernels()
    from gencli.backend.winograd import winograd_weight

    best, reference = kernels.isa(), isa_name == "scalar"
    if not reference and not kernels.use_isa(isa_name):
        pytest.skip(f"this CPU has no {isa_name}")
    try:
        x, weight, bias, residual = _case(*shape)
        u = winograd_weight(weight)
        exact = F.conv2d(x.double(), weight.double(), bias.double(), padding=1)
        direct = F.conv2d(x, weight, bias, padding=1)
        for chunk in (0, 1, 5):  # the default chunking, and chunks that cut the tiles unevenly
            got = kernels.winograd_conv3x3(x, u, bias, None, chunk, reference)
            assert got.shape == exact.shape and got.is_contiguous(memory_format=CL)
            err, direct_err = (got.double() - exact).abs().max().item(), (direct.double() - exact).abs().max().item()
            assert err < max(4 * direct_err, 1e-6), (err, direct_err)
        with_res = kernels.winograd_conv3x3(x, u, None, residual, 0, reference)
        want = F.conv2d(x.double(), weight.double(), None, padding=1) + residual.double()
        assert (with_res.double() - want).abs().max().item() < 1e-5
        # the output is not a copy of a neighbour's: moving one input pixel moves only its 3x3 neighbourhood
        x2 = x.clone()
        x2[0, :, 0, 0] += 1.0
        moved = (kernels.winograd_conv3x3(x2, u, bias, None, 0, reference) - kernels.winograd_conv3x3(x, u, bias, None, 0, reference)).abs()
        moved = moved.amax(dim=(0, 1))
        assert moved[:2, :2].min() > 0 and moved[2:].sum() == 0 and moved[:, 2:].sum() == 0
    finally:
        kernels.use_isa(best)


def test_the_kernel_refuses_what_it_does_not_compute():
    kernels = built_quant_kernels()
    from gencli.backend.winograd import winograd_weight

    x, weight, bias, residual = _case(1, 16, 16, 4, 4)
    u = winograd_weight(weight)
    with pytest.raises(RuntimeError, match="channels-last"):
        kernels.winograd_conv3x3(torch.randn(1, 16, 4, 5), u)  # planar (a 4x5 map is not both layouts)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.winograd_conv3x3(x.bfloat16(), u)
    with pytest.raises(RuntimeError, match=r"\(16, C, K\)"):
        kernels.winograd_conv3x3(x, u[:, :8])
    with pytest.raises(RuntimeError, match="residual"):
        kernels.winograd_conv3x3(x, u, None, residual[:, :, :2])


def _conv(c, k, **kwargs):
    from gencli.backend.layers import Conv2d

    torch.manual_seed(0)
    conv = Conv2d(c, k, kwargs.pop("kernel_size", 3), padding=kwargs.pop("padding", 1), **kwargs).eval()
    return conv


def test_conv2d_runs_by_winograd_when_asked_and_gives_the_direct_values():
    built_quant_kernels()
    conv, plain = _conv(64, 96), _conv(64, 96)
    dense = conv.weight.detach().clone()
    conv.prepack(True, winograd=True)
    plain.prepack(True)
    x, _, _, _ = _case(2, 64, 96, 6, 10)
    residual = torch.randn(2, 96, 6, 10).contiguous(memory_format=CL)
    with torch.no_grad():
        want = plain(x)
        got = conv(x)
        assert conv.winograd and not plain.winograd
        assert (got - want).abs().max() < 1e-4
        assert (conv(x, residual=residual) - (want + residual)).abs().max() < 1e-4
        assert (conv(x, residual=residual[:1]) - (want + residual[:1])).abs().max() < 1e-4  # broadcast: added after
        assert (conv(x, activation="silu") - F.silu(want)).abs().max() < 1e-4
        assert (conv(x.contiguous()) - want).abs().max() < 1e-4  # a planar input is made channels-last
    assert torch.equal(conv.state_dict()["weight"], dense)
    conv.prepack(True, winograd=True)  # asked again: kept as it is
    assert conv.winograd
    conv.prepack(True)  # without: back to oneDNN's direct convolution on the next call
    with torch.no_grad():
        assert (conv(x) - want).abs().max() < 1e-4
    assert conv.packed and not conv.winograd
    conv.prepack(True, winograd=True)
    with torch.no_grad():
        conv(x)
    assert conv.winograd
    conv.unpack()
    assert not conv.winograd and torch.equal(conv.weight, dense)
    # with autograd on it is an ordinary convolution again
    y = conv(x.requires_grad_())
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize(
    "kwargs",
    [dict(stride=2), dict(kernel_size=1, padding=0), dict(groups=2), dict(dilation=2, padding=2), dict(padding=0), dict(c=32)],
    ids=["stride-2", "1x1", "groups", "dilated", "no-padding", "narrow"],
)
def test_other_convolutions_stay_direct(kwargs):
    built_quant_kernels()
    c = kwargs.pop("c", 64)
    conv = _conv(c, 64, **kwargs).prepack(True, winograd=True)
    x = torch.randn(1, c, 8, 8).contiguous(memory_format=CL)
    with torch.no_grad():
        conv(x)
    assert conv.packed and not conv.winograd


def test_bf16_and_the_switch_keep_the_direct_convolution(monkeypatch):
    built_quant_kernels()
    conv = _conv(64, 64).to(torch.bfloat16).prepack(True, winograd=True)
    with torch.no_grad():
        conv(torch.randn(1, 64, 8, 8, dtype=torch.bfloat16).contiguous(memory_format=CL))
    assert not conv.winograd
    monkeypatch.setenv("GENCLI_WINOGRAD", "0")
    conv = _conv(64, 64).prepack(True, winograd=True)
    with torch.no_grad():
        conv(torch.randn(1, 64, 8, 8).contiguous(memory_format=CL))
    assert conv.packed and not conv.winograd


def test_a_model_whose_transforms_would_not_fit_in_memory_stays_direct(monkeypatch):
    built_quant_kernels()
    from gencli.backend import winograd
    from gencli.backend.layers import prepack_convolutions

    model = torch.nn.Sequential(_conv(64, 64), _conv(64, 128)).eval()
    assert winograd.transform_bytes(list(model)) == 16 * 4 * (64 * 64 + 64 * 128)
    x = torch.randn(1, 64, 8, 8).contiguous(memory_format=CL)
    monkeypatch.setattr(winograd, "MEMORY_SHARE", 1e-9)  # an eighth of the memory becomes a few bytes
    prepack_convolutions(model, True, winograd=True)
    with torch.no_grad():
        model(x)
    assert all(c.packed and not c.winograd for c in model)
    monkeypatch.setattr(winograd, "MEMORY_SHARE", 1 / 8)
    prepack_convolutions(model, True, winograd=True)
    with torch.no_grad():
        model(x)
    assert all(c.winograd for c in model)
    assert winograd.transform_bytes(list(model)) == 16 * 4 * (64 * 64 + 64 * 128)  # read off the kept dense weights


@pytest.mark.parametrize(
    ("value", "want"),
    [(None, None), ("", None), ("1", True), ("on", True), ("yes", True), ("0", False), ("off", False), ("False", False), (" no ", False)],
)
def test_the_switch_reads_on_off_and_unset(monkeypatch, value, want):
    from gencli.backend import winograd

    if value is None:
        monkeypatch.delenv("GENCLI_WINOGRAD", raising=False)
    else:
        monkeypatch.setenv("GENCLI_WINOGRAD", value)
    assert winograd.choice() is want
    assert winograd.enabled() is (want is not False)


@pytest.mark.parametrize("amd", [True, False], ids=["amd", "other-x86"])
def test_unset_the_cpu_chooses_and_the_switch_overrides_it(monkeypatch, amd):
    from gencli.backend import winograd

    own = built_quant_kernels()
    monkeypatch.setattr(own, "cpu_vendor_amd", lambda: amd)
    assert winograd.default_for(amd) is (not amd)

    def runs_by_winograd() -> bool:
        conv = _conv(64, 64).prepack(True, winograd=True)
        with torch.no_grad():
            conv(torch.randn(1, 64, 8, 8).contiguous(memory_format=CL))
        assert conv.winograd or conv.packed  # by Winograd, or oneDNN's packed direct convolution
        return conv.winograd

    monkeypatch.delenv("GENCLI_WINOGRAD")
    assert runs_by_winograd() is (not amd)  # AMD: oneDNN's direct convolution is the faster there
    monkeypatch.setenv("GENCLI_WINOGRAD", "1")
    assert runs_by_winograd()
    monkeypatch.setenv("GENCLI_WINOGRAD", "0")
    assert not runs_by_winograd()
