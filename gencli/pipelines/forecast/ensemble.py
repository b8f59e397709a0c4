"""The default forecast: the network combined per series with fast statistical forecasters.

For each series the network and the five statistical members of
:mod:`~gencli.pipelines.forecast.statistical` (damped-trend ETS, Theta, damped Holt-Winters with
seasonal states on the log scale, ARIMA(p, d, 0) on the adjusted series, seasonal ARIMA(p, d, 0)(P, 1, 0)
on the raw one) first forecast the last
``horizon`` steps of the history from what came before them (the held-out last window, as
statsforecast's and AutoGluon's ensembles validate). Each member's mean quantile loss there gives its
weight, ``w_k ~ (loss_min / loss_k)^POWER`` normalised, so the member that did best on this series
counts most and members much worse count little; the forecast is the weighted average of the
members' quantiles at every level of the network's grid (quantile averaging keeps them ordered).
Series too short to hold a window out keep the network's forecast alone. ``WINDOWS > 1`` sums the
losses of that many held-out windows where the history is long enough (measured: no better than one
on the tuning groups, and each window costs another network and statistical pass).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from gencli.data.timeseries import SeriesRecord
from gencli.pipelines.forecast.metrics import pinball
from gencli.pipelines.forecast.statistical import MEMBERS, statistical_forecasts

POWER = 4.0
WINDOWS = 1  # held-out windows per series, where its history is long enough
MIN_FIT = 16  # history values the statistical members need before the held-out window


def member_weights(losses: np.ndarray, power: Optional[float] = None) -> np.ndarray:
    """``(N, K)`` held-out losses -> ``(N, K)`` weights summing to 1 (non-finite losses weigh 0)."""
    power = POWER if power is None else power
    ok = np.isfinite(losses)
    best = np.min(np.where(ok, losses, np.inf), axis=1, keepdims=True)
    ratio = np.where(ok, np.maximum(best, 1e-12) / np.maximum(losses, 1e-12), 0.0)
    w = np.where(ok, ratio**power, 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total > 0, w / np.where(total > 0, total, 1.0), 0.0)
    w[total[:, 0] <= 0, 0] = 1.0  # nothing scored: the network alone
    return w


def combine(
    records: Sequence[SeriesRecord],
    ends: Sequence[int],
    network: np.ndarray,
    network_heldout: Callable[[list[int], list[int]], np.ndarray],
    horizon: int,
    grid: Sequence[float],
    context: int,
    nonnegative: Optional[np.ndarray] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The ensemble's quantiles ``(N, H, G)`` at the ``grid`` levels and the weights ``(N, 1 + K)``
    (network first, then :data:`MEMBERS`).

    ``network`` holds the network's quantiles ``(N, H, G)`` for the windows after ``ends``;
    ``network_heldout(indices, origins)`` runs it for those series at earlier origins."""
    n = len(records)
    seasons = [max(1, r.freq.season_length()) for r in records]
    spans = [max(context, 3 * m + 2 * horizon) for m in seasons]

    def enough(i: int, origin: int) -> bool:
        return origin >= max(MIN_FIT, 2 * seasons[i] if origin >= 3 * seasons[i] else MIN_FIT)

    # the held-out windows: the last ``horizon`` steps of the history, then the ones before them
    held_out = [(w, i) for w in range(1, WINDOWS + 1) for i in range(n) if enough(i, ends[i] - w * horizon)]
    cut = [ends[i] for i in range(n)] + [ends[i] - w * horizon for w, i in held_out]
    who = list(range(n)) + [i for _, i in held_out]
    hist = [records[i].target[max(0, c - spans[i]) : c] for i, c in zip(who, cut)]
    # in units of a power of two near each history's peak (exact): the members' squared errors
    # neither overflow near 1e300 nor vanish near 1e-160, and their forecasts scale with the series
    units = np.array([_power_of_two_unit(h) for h in hist])
    stats = statistical_forecasts([h / u for h, u in zip(hist, units)], [seasons[i] for i in who], horizon, grid)
    stats = {k: v * units[:, None, None] for k, v in stats.items()}
    if nonnegative is not None:
        clip = nonnegative[who]
        stats = {k: np.where(clip[:, None, None], np.maximum(v, 0.0), v) for k, v in stats.items()}
    members = np.stack([network] + [stats[k][:n] for k in MEMBERS], axis=1)  # (N, 1 + K, H, G)
    weights = np.zeros((n, 1 + len(MEMBERS)))
    weights[:, 0] = 1.0
    if held_out:
        rows = np.arange(n, len(who))
        idx = [i for _, i in held_out]
        held = network_heldout(idx, [cut[r] for r in rows])
        if nonnegative is not None:
            held = np.where(nonnegative[idx][:, None, None], np.maximum(held, 0.0), held)
        cand = np.stack([held] + [stats[k][rows] for k in MEMBERS], axis=1)  # (V, 1 + K, H, G)
        truth = np.stack([records[i].target[c : c + horizon] for i, c in zip(idx, [cut[r] for r in rows])])  # (V, H)
        mask = np.stack([records[i].observed_mask[c : c + horizon] for i, c in zip(idx, [cut[r] for r in rows])])
        # losses in units of the latest history (the same for all of a series' windows), so that the
        # windows add up as in the series' own scale and member_weights' floor is relative
        u = units[:n][idx][:, None]
        loss = pinball((truth / u)[:, None, :], cand / u[:, :, None, None], grid).mean(axis=-1)  # (V, 1 + K, H)
        loss = (loss * mask[:, None, :]).sum(axis=-1) / np.maximum(mask.sum(axis=-1), 1)[:, None]
        total = np.zeros((n, 1 + len(MEMBERS)))
        np.add.at(total, idx, loss)
        scored = np.unique(idx)
        weights[scored] = member_weights(total[scored])
    out = np.einsum("nk,nkhg->nhg", weights, members)
    return out, weights


def _power_of_two_unit(values: np.ndarray) -> float:
    finite = np.abs(values[np.isfinite(values)])
    peak = float(finite.max()) if finite.size else 0.0
    return float(np.ldexp(1.0, int(np.frexp(peak)[1]))) if peak > 0 else 1.0


__all__ = ["MEMBERS", "combine", "member_weights"]
