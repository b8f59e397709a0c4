"""The bf16-screened argmax of an fp32 LM head is exactly the fp32 argmax, near-ties included."""

import pytest
import torch
import torch.nn.functional as F

from gencli.backend.screened_argmax import ScreenedArgmax

pytestmark = pytest.mark.skipif(
    not ScreenedArgmax.supported(torch.zeros(2, 2)), reason="no native bf16 matmul (oneDNN) on this CPU"
)


def head(vocab=3000, dim=96, seed=0, column_major=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, dim, generator=g) * 0.05
    return w.t().contiguous().t() if column_major else w


@pytest.mark.parametrize("column_major", [False, True])
def test_matches_the_fp32_argmax_on_many_rows(column_major):
    w = head(column_major=column_major)
    screen = ScreenedArgmax(w)
    h = torch.randn(400, 96, generator=torch.Generator().manual_seed(1)) * 3
    ours = torch.cat([screen(h[i : i + 8]) for i in range(0, 400, 8)])
    assert torch.equal(ours, F.linear(h, w).argmax(-1))
    assert 0 < screen.last_candidates <= screen.max_candidates  # the screen did the work


def test_bound_holds_for_every_logit():
    w = head(seed=2)
    screen = ScreenedArgmax(w)
    h = torch.randn(16, 96, generator=torch.Generator().manual_seed(3)) * 10
    approx, top, bound = screen.approximate(h)
    assert torch.equal(top, approx.amax(-1))
    exact = (h.double() @ w.double().t()).float()
    assert ((exact - approx).abs() <= bound[:, None]).all()
    assert (bound > 0).all()


def test_near_tie_below_bf16_resolution_goes_to_the_true_maximum():
    w = head(seed=4)
    h = torch.randn(96, generator=torch.Generator().manual_seed(5))
    best = int(F.linear(h, w).argmax())
    # row 11 becomes the maximum by a margin bf16 cannot see: both rows round to the same bf16 row
    w[best] = w[best].bfloat16().float()
    w[11] = w[best] + 1e-6 * h / h.norm()
    assert torch.equal(w[11].bfloat16(), w[best].bfloat16())
    expected = int(F.linear(h, w).argmax())
    assert expected == 11
    assert int(ScreenedArgmax(w)(h[None])[0]) == 11


def test_exact_ties_go_to_the_lowest_id_like_argmax():
    w = head(seed=6)
    h = torch.randn(96, generator=torch.Generator().manual_seed(7))
    best = int(F.linear(h, w).argmax())
    w[2] = w[best]
    assert int(ScreenedArgmax(w)(h[None])[0]) == int(F.linear(h, w).argmax()) == min(2, best)


def test_falls_back_to_the_fp32_product_when_the_screen_cannot_decide():
    w = head(seed=8)
    h = torch.randn(3, 96, generator=torch.Generator().manual_seed(9))
    tight = ScreenedArgmax(w, max_candidates=0)  # every row over the limit
    assert torch.equal(tight(h), F.linear(h, w).argmax(-1))
    bad = h.clone()
    bad[1, 0] = float("nan")  # NaN logits: the same answer as the fp32 head gives
    assert torch.equal(ScreenedArgmax(w)(bad), F.linear(bad, w).argmax(-1))


def test_rejects_what_it_cannot_screen():
    with pytest.raises(ValueError):
        ScreenedArgmax(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not ScreenedArgmax.supported(torch.zeros(4, 4, dtype=torch.bfloat16))
