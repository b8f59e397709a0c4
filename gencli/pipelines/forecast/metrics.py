"""Forecast metrics and baselines (numpy only).

- :func:`pinball` — the quantile (pinball) loss ``q max(y - f, 0) + (1 - q) max(f - y, 0)``;
- :func:`weighted_quantile_loss` — ``mean_q [2 sum |pinball_q| / sum |y|]`` (GluonTS' mean wQL, the
  scale the zero-shot forecasting papers report);
- :func:`mase` — mean absolute error of the median over the in-sample mean absolute error of the
  seasonal-naive forecast on the history (Hyndman & Koehler 2006);
- :func:`seasonal_naive` — the last season repeated, as a point forecast used at every quantile
  level (the denominator of the relative scores) and optionally with the usual Gaussian band
  ``sigma sqrt(k + 1)``, ``k`` the number of completed seasons in the lead time;
- :func:`interpolate_quantiles` — any quantile level from a fixed grid, by monotone piecewise-linear
  interpolation in the standard-normal z-scale (linear extrapolation of the outermost segments
  beyond the grid), so requested levels between grid points follow a Gaussian-like shape and the
  result is ordered whenever the grid values are;
- :func:`geometric_mean`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Optional, Sequence

import numpy as np

_NORMAL = NormalDist()


def z_scores(levels: Sequence[float]) -> np.ndarray:
    return np.array([_NORMAL.inv_cdf(float(q)) for q in levels])


def level_label(q: float) -> str:
    """A quantile level as the output names it: short (``0.1``, ``1e-05``), but never the same label
    for two different levels (``0.10000000001`` is not ``0.1``: a short form that rounds is written in full)."""
    q = float(q)
    short = f"{q:g}"
    return short if float(short) == q else repr(q)


def interpolate_quantiles(values: np.ndarray, grid: Sequence[float], requested: Sequence[float]) -> np.ndarray:
    """``values (..., G)`` at ``grid`` levels -> ``(..., R)`` at ``requested`` levels (see module doc)."""
    grid = [float(g) for g in grid]
    zg = z_scores(grid)
    out = []
    for q in requested:
        q = float(q)
        if q in grid:
            out.append(values[..., grid.index(q)])
            continue
        z = _NORMAL.inv_cdf(q)
        k = int(np.searchsorted(zg, z))
        lo, hi = (0, 1) if k == 0 else ((len(grid) - 2, len(grid) - 1) if k >= len(grid) else (k - 1, k))
        w = (z - zg[lo]) / (zg[hi] - zg[lo])
        out.append(values[..., lo] + w * (values[..., hi] - values[..., lo]))
    return np.stack(out, axis=-1)


def pinball(y: np.ndarray, forecast: np.ndarray, levels: Sequence[float]) -> np.ndarray:
    """Pinball loss per level: ``y (...)``, ``forecast (..., Q)`` -> ``(..., Q)``."""
    q = np.asarray(levels, dtype=np.float64)
    diff = y[..., None] - forecast
    return np.maximum(q * diff, (q - 1.0) * diff)


def quantile_loss_sum(y: np.ndarray, forecast: np.ndarray, levels: Sequence[float], mask: Optional[np.ndarray] = None) -> tuple[np.ndarray, float]:
    """``(sum over points of 2 * pinball per level (Q,), sum |y|)`` — the parts of the wQL, to aggregate."""
    pl = 2.0 * pinball(y, forecast, levels)
    if mask is None:
        mask = np.isfinite(y)
    pl = np.where(mask[..., None], pl, 0.0)
    return pl.reshape(-1, len(levels)).sum(axis=0), float(np.abs(np.where(mask, y, 0.0)).sum())


def weighted_quantile_loss(y: np.ndarray, forecast: np.ndarray, levels: Sequence[float], mask: Optional[np.ndarray] = None) -> float:
    """``mean_q 2 sum pinball_q / sum |y|`` over all points."""
    num, den = quantile_loss_sum(y, forecast, levels, mask)
    return float(np.mean(num) / den) if den > 0 else float("nan")


def naive_scale(history: np.ndarray, season: int) -> float:
    """In-sample mean absolute error of the seasonal-naive forecast (the MASE denominator)."""
    h = np.asarray(history, dtype=np.float64)
    m = season if len(h) > season else 1
    if len(h) <= m:
        return float("nan")
    d = np.abs(h[m:] - h[:-m])
    return float(d.mean())


def mase(y: np.ndarray, median: np.ndarray, history: np.ndarray, season: int) -> float:
    scale = naive_scale(history, season)
    err = np.abs(y - median)
    err = err[np.isfinite(err)]
    if not err.size or not np.isfinite(scale):
        return float("nan")
    return float(err.mean() / scale) if scale > 0 else (0.0 if err.mean() == 0 else float("inf"))


def seasonal_naive(history: np.ndarray, season: int, horizon: int, levels: Optional[Sequence[float]] = None) -> np.ndarray:
    """Seasonal-naive forecast ``(horizon,)``, or ``(horizon, Q)`` quantiles with the Gaussian band
    ``point + z_q sigma sqrt(k + 1)`` (sigma = std of the in-sample seasonal differences)."""
    h = np.asarray(history, dtype=np.float64)
    m = season if len(h) >= season else 1
    idx = len(h) - m + (np.arange(horizon) % m)
    point = h[idx]
    if levels is None:
        return point
    diffs = h[m:] - h[:-m] if len(h) > m else np.zeros(1)
    sigma = float(np.sqrt(np.mean(diffs**2))) if diffs.size else 0.0
    k = np.arange(horizon) // m
    z = z_scores(levels)
    return point[:, None] + z[None, :] * sigma * np.sqrt(k + 1.0)[:, None]


def geometric_mean(values: Sequence[float], floor: float = 1e-6) -> float:
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=np.float64)
    if not v.size:
        return float("nan")
    return float(np.exp(np.mean(np.log(np.maximum(v, floor)))))


def rounded(x: Optional[float], nd: int = 4) -> Optional[float]:
    """A figure for the reports: rounded, None when undefined."""
    return None if x is None or not np.isfinite(x) else round(float(x), nd)


@dataclass
class Score:
    """One forecaster's errors on one series, accumulated over windows: the weighted quantile loss
    pools the windows (sums of pinball losses and of |y|), MASE averages the per-window values."""

    n_levels: int
    ql: np.ndarray = None
    abs_sum: float = 0.0
    mase_values: list = field(default_factory=list)

    def add(self, ql: np.ndarray, abs_sum: float, mase_value: float) -> None:
        self.ql = np.asarray(ql, dtype=np.float64) if self.ql is None else self.ql + ql
        self.abs_sum += abs_sum
        self.mase_values.append(mase_value)

    @property
    def windows(self) -> int:
        return len(self.mase_values)

    @property
    def wql(self) -> float:
        return float(np.mean(self.ql) / self.abs_sum) if self.ql is not None and self.abs_sum > 0 else float("nan")

    @property
    def mase(self) -> float:
        v = [x for x in self.mase_values if np.isfinite(x)]
        return float(np.mean(v)) if v else float("nan")
