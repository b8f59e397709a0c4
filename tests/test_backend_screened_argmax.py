"""The screened argmax of an fp32 LM head (int8 and bf16 copies) is exactly the fp32 argmax, near-ties
included."""

import pytest
import torch
import torch.nn.functional as F

from gencli.backend.screened_argmax import ScreenedArgmax

KINDS = [
    pytest.param(kind, marks=pytest.mark.skipif(not ScreenedArgmax.supported(torch.zeros(2, 2), kind), reason=f"no exact {kind} kernel (oneDNN) on this CPU"))
    for kind in ["int8", "bf16"]
]


def head(vocab=3000, dim=96, seed=0, column_major=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, dim, generator=g) * 0.05
    return w.t().contiguous().t() if column_major else w


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("column_major", [False, True])
def test_matches_the_fp32_argmax_on_many_rows(column_major, kind):
    w = head(column_major=column_major)
    screen = ScreenedArgmax(w, kind=kind)
    assert screen.kind == kind
    h = torch.randn(400, 96, generator=torch.Generator().manual_seed(1)) * 3
    ours = torch.cat([screen(h[i : i + 8]) for i in range(0, 400, 8)])
    assert torch.equal(ours, F.linear(h, w).argmax(-1))
    assert 0 < screen.last_candidates <= screen.max_candidates  # the screen did the work


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shift", [0.0, 25.0, -25.0], ids=["mixed", "positive", "negative"])
def test_bound_holds_for_every_logit(kind, shift):
    # all-positive and all-negative hidden states put the int8 zero point at 0 and at 255
    w = head(seed=2)
    w[5] *= 40  # rows of very different sizes
    w[7] = 0.0
    screen = ScreenedArgmax(w, kind=kind)
    h = torch.randn(16, 96, generator=torch.Generator().manual_seed(3)) * 10 + shift
    approx, top, bound = screen.approximate(h)
    assert torch.equal(top, approx.amax(-1))
    exact = h.double() @ w.double().t()
    err = (exact - approx.double()).abs()
    assert (err <= bound[:, None]).all()
    assert (bound > 0).all()
    assert (err.amax(-1) > bound / 1000).all()  # a bound, not a blanket: the screen must do work


@pytest.mark.parametrize("kind", KINDS)
def test_near_tie_below_the_copy_resolution_goes_to_the_true_maximum(kind):
    w = head(seed=4)
    h = torch.randn(96, generator=torch.Generator().manual_seed(5))
    best = int(F.linear(h, w).argmax())
    # row 11 becomes the maximum by a margin neither copy can see: both rows round to the same bf16 row
    w[best] = w[best].bfloat16().float()
    w[11] = w[best] + 1e-6 * h / h.norm()
    assert torch.equal(w[11].bfloat16(), w[best].bfloat16())
    expected = int(F.linear(h, w).argmax())
    assert expected == 11
    assert int(ScreenedArgmax(w, kind=kind)(h[None])[0]) == 11


@pytest.mark.parametrize("kind", KINDS)
def test_exact_ties_go_to_the_lowest_id_like_argmax(kind):
    w = head(seed=6)
    h = torch.randn(96, generator=torch.Generator().manual_seed(7))
    best = int(F.linear(h, w).argmax())
    w[2] = w[best]
    assert int(ScreenedArgmax(w, kind=kind)(h[None])[0]) == int(F.linear(h, w).argmax()) == min(2, best)


@pytest.mark.parametrize("kind", KINDS)
def test_falls_back_to_the_fp32_product_when_the_screen_cannot_decide(kind):
    w = head(seed=8)
    h = torch.randn(3, 96, generator=torch.Generator().manual_seed(9))
    tight = ScreenedArgmax(w, max_candidates=0, kind=kind)  # every row over the limit
    assert torch.equal(tight(h), F.linear(h, w).argmax(-1))
    screen = ScreenedArgmax(w, kind=kind)
    for value in [float("nan"), float("inf")]:  # the same answer as the fp32 head gives
        bad = h.clone()
        bad[1, 0] = value
        assert torch.equal(screen(bad), F.linear(bad, w).argmax(-1))
    zero = torch.zeros(2, 96)  # every logit 0: all tie, the lowest id wins
    assert screen(zero).tolist() == [0, 0]


def test_rejects_what_it_cannot_screen():
    with pytest.raises(ValueError):
        ScreenedArgmax(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not ScreenedArgmax.supported(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unknown screen"):
        ScreenedArgmax(torch.zeros(4, 4), kind="fp8")
    assert not ScreenedArgmax.supported(torch.zeros(4, 4), kind="fp8")


@pytest.mark.skipif(not ScreenedArgmax.supported(torch.zeros(2, 2)), reason="no exact low-precision kernel on this CPU")
def test_prefers_the_int8_copy_where_it_is_exact(monkeypatch):
    from gencli.backend import screened_argmax

    w = head(seed=10)
    expected = "int8" if screened_argmax.Int8Screen.available() else "bf16"
    assert ScreenedArgmax(w).kind == expected
    if screened_argmax.Bf16Screen.available():
        # an int8 kernel that fails its exactness check at build time is not used
        def broken(self, qx, scale, zero):
            return torch.zeros(qx.shape[0], self.scales.shape[0]) + 1.0

        monkeypatch.setattr(screened_argmax.Int8Screen, "available", staticmethod(lambda: True))
        monkeypatch.setattr(screened_argmax.Int8Screen, "_product", broken)
        assert ScreenedArgmax(w).kind == "bf16"
        with pytest.raises(ValueError, match="no int8 screen"):
            ScreenedArgmax(w, kind="int8")
