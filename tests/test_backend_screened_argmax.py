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
    column_major_bf16 = torch.zeros(4, 4, dtype=torch.bfloat16).t()
    with pytest.raises(ValueError):
        ScreenedArgmax(column_major_bf16)
    assert not ScreenedArgmax.supported(column_major_bf16)
    assert not ScreenedArgmax.supported(torch.zeros(4, 4, dtype=torch.float16))
    assert not ScreenedArgmax.supported(torch.zeros(4, 4, dtype=torch.bfloat16), kind="bf16")  # its bf16 copy would be itself
    with pytest.raises(ValueError, match="no bf16 screen"):
        ScreenedArgmax(torch.zeros(4, 4, dtype=torch.bfloat16), kind="bf16")
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


def outlier_case(seed=12):
    """A head whose fifth input feature is nearly unused and hidden states where that feature is
    huge: the ``|x~| Q`` term of the int8 bound (the rows' rounding) then dwarfs the logits' spread."""
    w = head(seed=seed)
    w[:, 5] *= 0.01
    h = torch.randn(4, 96, generator=torch.Generator().manual_seed(seed + 1))
    h[:, 5] = 100.0
    return w, h


@pytest.mark.skipif(
    not (ScreenedArgmax.supported(torch.zeros(2, 2), "int8") and ScreenedArgmax.supported(torch.zeros(2, 2), "bf16")),
    reason="needs both the int8 and the bf16 kernels",
)
def test_rows_the_int8_copy_cannot_decide_go_to_the_bf16_copy_then_it_leads():
    w, h = outlier_case()
    expected = F.linear(h, w).argmax(-1)
    only_int8 = ScreenedArgmax(w, kind="int8", max_candidates=256)
    assert torch.equal(only_int8(h), expected)  # the fp32 product decided
    assert only_int8.last_candidates > 256
    cascade = ScreenedArgmax(w, max_candidates=256)
    assert cascade.kind == "int8"
    for _ in range(ScreenedArgmax.DEMOTE_AFTER):
        assert torch.equal(cascade(h), expected)
        assert cascade.last_candidates > 256  # int8 kept too many, bf16 then decided
    assert cascade.kind == "bf16"  # failing on most calls, the int8 copy was dropped
    assert torch.equal(cascade(h), expected)
    assert cascade.last_candidates <= 256
    # ordinary hidden states never reach the bf16 copy
    plain = ScreenedArgmax(w, max_candidates=256)
    g = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    for i in range(0, 64, 4):
        assert torch.equal(plain(g[i : i + 4]), F.linear(g[i : i + 4], w).argmax(-1))
    assert plain.kind == "int8"


@pytest.mark.skipif(not ScreenedArgmax.supported(torch.zeros(2, 2), "int8"), reason="no exact int8 kernel (oneDNN) on this CPU")
def test_int8_screen_resolves_the_hidden_state_to_about_16_bits():
    w = head(seed=14)
    screen = ScreenedArgmax(w, kind="int8")
    h = torch.randn(3, 96, generator=torch.Generator().manual_seed(15))
    h[:, 7] = 40.0  # one huge feature sets the scale
    approx, dx_norm, x_norm, rounding = screen.screen(h)
    step = h.abs().max().item() / 127 / 256  # the second row's step
    assert (dx_norm <= 96**0.5 * step / 2 * 1.001).all()
    assert torch.allclose(x_norm, h.double().norm(dim=-1), rtol=1e-4)
    exact = h.double() @ w.double().t()
    # the product of the two rows is that of the 16-bit hidden state with the int8 rows
    assert ((exact - approx.double()).abs().amax(-1) < 0.05 * exact.abs().amax(-1)).all()


needs_int8 = pytest.mark.skipif(not ScreenedArgmax.supported(torch.zeros(2, 2), "int8"), reason="no exact int8 kernel (oneDNN) on this CPU")


@needs_int8
def test_a_bf16_head_is_screened_by_its_int8_copy_and_gives_the_argmax_of_its_fp32_products(monkeypatch):
    """The bf16 head gencli's kernels decode with: the answer is the argmax of the exact (fp32) products
    of the hidden state and the bf16 values, near-ties and the fallback included."""
    from gencli.backend import screened_argmax

    monkeypatch.setattr(screened_argmax, "_CHUNK_ROWS", 512)  # the head is read in several chunks
    w = head(seed=14).bfloat16()
    assert ScreenedArgmax.supported(w)
    screen = ScreenedArgmax(w)
    assert screen.kind == "int8" and screen.weight.dtype == torch.bfloat16  # no fp32 image kept
    torch.testing.assert_close(screen.r / screen.margin, float(torch.linalg.vector_norm(w.float(), dim=1).max()))
    h = torch.randn(400, 96, generator=torch.Generator().manual_seed(15)) * 3
    ours = torch.cat([screen(h[i : i + 8]) for i in range(0, 400, 8)])
    assert torch.equal(ours, F.linear(h, w.float()).argmax(-1))
    assert 0 < screen.last_candidates <= 32  # the screen did the work
    approx, _, bound = screen.approximate(h[:16])
    assert ((h[:16].double() @ w.double().t() - approx.double()).abs() <= bound[:, None]).all()
    # a near-tie: the row after the best one wins by about one bf16
    # step in one column (a tie would go to the lower id, the old best)
    one = h[0]
    best = int(F.linear(one, w.float()).argmax())
    assert best + 1 < w.shape[0]
    w2 = w.clone()
    w2[best + 1] = w2[best]
    col = int(one.abs().argmax())
    up = w2[best, col].float() * (1 + 2.0**-7 * float(one[col].sign() * w2[best, col].sign()))
    w2[best + 1, col] = up.bfloat16()
    assert w2[best + 1, col] != w2[best, col]
    assert int(F.linear(one, w2.float()).argmax()) == best + 1
    assert int(ScreenedArgmax(w2)(one[None])[0]) == best + 1
    tight = ScreenedArgmax(w, max_candidates=0)  # every row over the limit: the chunked fp32 product decides
    assert torch.equal(tight(h[:5]), F.linear(h[:5], w.float()).argmax(-1))


@needs_int8
def test_rows_no_copy_decides_go_to_the_heads_own_product_and_a_failing_last_copy_stops_screening():
    w = head(seed=16).bfloat16()
    calls = []

    def product(x):
        calls.append(x.shape[0])
        return F.linear(x, w.float())

    h = torch.randn(1, 96, generator=torch.Generator().manual_seed(17))
    screen = ScreenedArgmax(w, max_candidates=0, product=product)
    for _ in range(ScreenedArgmax.DEMOTE_AFTER):
        assert not screen.gave_up
        assert torch.equal(screen(h), F.linear(h, w.float()).argmax(-1))
    assert screen.gave_up and len(calls) == ScreenedArgmax.DEMOTE_AFTER  # the int8 copy missed every time: no more screening
    approximate = screen.approximate
    screen.approximate = lambda *a, **k: pytest.fail("screened after giving up")
    assert torch.equal(screen(h), F.linear(h, w.float()).argmax(-1)) and len(calls) == ScreenedArgmax.DEMOTE_AFTER + 1
    screen.approximate = approximate
    decided = ScreenedArgmax(w, product=product)
    decided(h)
    assert len(calls) == ScreenedArgmax.DEMOTE_AFTER + 1 and not decided.gave_up  # decided by the copy: no full product
