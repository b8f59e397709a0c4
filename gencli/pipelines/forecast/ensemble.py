"""The default forecast: the network combined per series with fast statistical forecasters.

For each series the network and the two statistical members of
:mod:`~gencli.pipelines.forecast.statistical` (damped-trend ETS, Theta) first forecast the last
``horizon`` steps of the history from what came before them (the held-out last window, as
statsforecast's and AutoGluon's ensembles validate). Each member's mean quantile loss there gives its
weight, ``w_k ~ (loss_min / loss_k)^POWER`` normalised, so the member that did best on this series
counts most and members much worse count little; the forecast is the weighted average of the
members' quantiles at every level of the network's grid (quantile averaging keeps them ordered).
Series too short to hold a window out keep the network's forecast alone.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from gencli.data.timeseries import SeriesRecord
from gencli.pipelines.forecast.metrics import pinball
from gencli.pipelines.forecast.statistical import MEMBERS, statistical_forecasts

POWER = 4.0
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
    val = [i for i in range(n) if ends[i] - horizon >= max(MIN_FIT, 2 * seasons[i] if ends[i] - horizon >= 3 * seasons[i] else MIN_FIT)]
    hist = [records[i].target[max(0, ends[i] - spans[i]) : ends[i]] for i in range(n)]
    hist += [records[i].target[max(0, ends[i] - horizon - spans[i]) : ends[i] - horizon] for i in val]
    # in units of a power of two near each history's peak (exact): the members' squared errors
    # neither overflow near 1e300 nor vanish near 1e-160, and their forecasts scale with the series
    units = np.array([_power_of_two_unit(h) for h in hist])
    stats = statistical_forecasts([h / u for h, u in zip(hist, units)], seasons + [seasons[i] for i in val], horizon, grid)
    stats = {k: v * units[:, None, None] for k, v in stats.items()}
    if nonnegative is not None:
        clip = np.r_[nonnegative, nonnegative[val]] if len(val) else nonnegative
        stats = {k: np.where(clip[:, None, None], np.maximum(v, 0.0), v) for k, v in stats.items()}
    members = np.stack([network] + [stats[k][:n] for k in MEMBERS], axis=1)  # (N, 1 + K, H, G)
    weights = np.zeros((n, 1 + len(MEMBERS)))
    weights[:, 0] = 1.0
    if val:
        held = network_heldout(val, [ends[i] - horizon for i in val])
        if nonnegative is not None:
            held = np.where(nonnegative[val][:, None, None], np.maximum(held, 0.0), held)
        cand = np.stack([held] + [stats[k][n:] for k in MEMBERS], axis=1)  # (V, 1 + K, H, G)
        truth = np.stack([records[i].target[ends[i] - horizon : ends[i]] for i in val])  # (V, H)
        mask = np.stack([records[i].observed_mask[ends[i] - horizon : ends[i]] for i in val])
        u = units[val][:, None]  # losses in the series' own units: member_weights' floor is then relative
        loss = pinball((truth / u)[:, None, :], cand / u[:, :, None, None], grid).mean(axis=-1)  # (V, 1 + K, H)
        loss = (loss * mask[:, None, :]).sum(axis=-1) / np.maximum(mask.sum(axis=-1), 1)[:, None]
        weights[val] = member_weights(loss)
    out = np.einsum("nk,nkhg->nhg", weights, members)
    return out, weights


def _power_of_two_unit(values: np.ndarray) -> float:
    finite = np.abs(values[np.isfinite(values)])
    peak = float(finite.max()) if finite.size else 0.0
    return float(np.ldexp(1.0, int(np.frexp(peak)[1]))) if peak > 0 else 1.0


__all__ = ["MEMBERS", "combine", "member_weights"]
