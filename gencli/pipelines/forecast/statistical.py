"""Fast statistical forecasters for the default ensemble, vectorised over a batch of series (numpy).

Both members work on the seasonally adjusted series, as the M4 competition's statistical benchmarks
do: when the autocorrelation at the season lag is significant (90%, Bartlett's bound; at least three
seasons of history) the series is divided by classical multiplicative seasonal indices (or, when a value
is not positive, has additive ones subtracted), the forecast is made on what is left and the indices
are put back.

- :func:`damped_trend` — ETS(A,Ad,N), Holt's linear trend damped by ``phi`` in innovations form
  ``l_t = l_{t-1} + phi b_{t-1} + alpha e_t``, ``b_t = phi b_{t-1} + beta e_t``; ``(alpha, beta, phi)``
  chosen per series from a grid by the one-step in-sample squared error.
- :func:`theta` — the Theta method (Assimakopoulos & Nikolopoulos 2000) in Hyndman & Billah's form:
  simple exponential smoothing (``alpha`` from a grid) plus half the least-squares slope as drift,
  ``l_n + b/2 (j + (1 - (1 - alpha)^n) / alpha)`` for lead ``j + 1``.

Quantiles are Gaussian around the point forecast with the model's own horizon scaling of the in-sample
one-step residual variance ``sigma^2 (1 + sum_{j<h} c_j^2)``: ``c_j = alpha + beta phi (1 - phi^j) /
(1 - phi)`` for the damped trend, ``c_j = alpha`` for Theta (the SES form), then multiplied by the
seasonal index. The members run on the last ``history`` values of each series (at least three seasons
and two horizons where the series has them).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gencli.pipelines.forecast.metrics import z_scores

ALPHAS = np.array([0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 0.95])
TREND_ALPHAS = np.array([0.05, 0.15, 0.3, 0.5, 0.8])
BETA_RATIOS = np.array([0.02, 0.1, 0.3])  # beta = ratio * alpha
PHIS = np.array([0.85, 0.93, 0.98])
MEMBERS = ("damped_trend", "theta")


def _seasonal_indices(y: np.ndarray, m: int) -> tuple[np.ndarray, bool]:
    """Classical decomposition indices ``(m,)`` aligned so that ``index[k]`` belongs to ``y[k]`` (and
    every ``m`` steps on), and whether they are multiplicative; ``(ones, True)`` when the series shows
    no significant seasonality."""
    n = len(y)
    none = (np.ones(m), True)
    if m < 2 or n < 3 * m:
        return none
    d = y - y.mean()
    denom = float(d @ d)
    if denom <= 0:
        return none
    acf = np.array([d[k:] @ d[: n - k] for k in range(1, m + 1)]) / denom
    limit = 1.645 * np.sqrt((1.0 + 2.0 * np.sum(acf[: m - 1] ** 2)) / n)
    if abs(acf[m - 1]) <= limit:
        return none
    # centred moving average of order m (2 x m when m is even)
    if m % 2 == 0:
        w = np.r_[0.5, np.ones(m - 1), 0.5] / m
    else:
        w = np.ones(m) / m
    trend = np.convolve(y, w, mode="valid")
    off = (len(w) - 1) // 2
    mult = bool(np.all(y > 0))
    part = y[off : off + len(trend)]
    ratio = part / trend if mult else part - trend
    pos = (np.arange(len(trend)) + off) % m
    idx = np.bincount(pos, weights=ratio, minlength=m) / np.maximum(np.bincount(pos, minlength=m), 1)
    if mult:
        idx = idx / idx.mean()
        if not np.all(np.isfinite(idx)) or np.any(idx <= 0):
            return none
    else:
        idx = idx - idx.mean()
    return idx, mult


def _adjust(histories: Sequence[np.ndarray], seasons: Sequence[int], horizon: int):
    """Seasonally adjusted histories, left-padded with NaN into ``(N, L)``, and each series' future
    seasonal factors ``(N, H)`` (multiplicative) and offsets ``(N, H)`` (additive)."""
    n_series = len(histories)
    length = max(len(h) for h in histories)
    adj = np.full((n_series, length), np.nan)
    fac = np.ones((n_series, horizon))
    add = np.zeros((n_series, horizon))
    for i, (y, m) in enumerate(zip(histories, seasons)):
        idx, mult = _seasonal_indices(y, int(m))
        k = len(idx)
        past = idx[np.arange(len(y)) % k]
        fut = idx[(len(y) + np.arange(horizon)) % k]
        if mult:
            adj[i, length - len(y) :] = y / past
            fac[i] = fut
        else:
            adj[i, length - len(y) :] = y - past
            add[i] = fut
    return adj, fac, add


def _smooth(adj: np.ndarray, alpha: np.ndarray, beta: np.ndarray, phi: np.ndarray, trend: bool):
    """Run the damped-trend recursion for every series and grid point: the final ``(level, trend)``
    ``(N, G)`` each, the one-step mean squared error ``(N, G)``."""
    n, length = adj.shape
    start = np.argmax(np.isfinite(adj), axis=1)
    n_obs = length - start
    k = np.clip(n_obs // 4, 1, 8)
    rows = np.arange(n)
    a0 = adj[rows, start]
    if trend:
        first = np.array([adj[i, start[i] : start[i] + k[i]].mean() for i in range(n)])
        second = np.array([adj[i, start[i] + k[i] : start[i] + 2 * k[i]].mean() for i in range(n)])
        b0 = np.where(np.isfinite(second), (second - first) / k, 0.0)
    else:
        b0 = np.zeros(n)
    g = len(alpha)
    level = np.repeat((a0 - b0)[:, None], g, axis=1)
    slope = np.repeat(b0[:, None], g, axis=1)
    sse = np.zeros((n, g))
    count = np.zeros(n)
    burn = start + 1 + (k if trend else 0)
    all_active, all_scored = int(start.max()), int(burn.max())
    for t in range(int(start.min()), length):
        f = level + phi * slope
        if t >= all_active:  # every series has begun: no masking
            e = adj[:, t, None] - f
            level = f + alpha * e
            slope = phi * slope + beta * e
        else:
            active = (t >= start)[:, None]
            e = np.where(active, adj[:, t, None] - f, 0.0)
            level = np.where(active, f + alpha * e, level)
            slope = np.where(active, phi * slope + beta * e, slope)
        if t >= all_scored:
            sse += e * e
            count += 1
        else:
            scored = t >= burn
            sse += np.where(scored[:, None], e * e, 0.0)
            count += scored
    mse = sse / np.maximum(count, 1)[:, None]
    return level, slope, mse


def _quantiles(point: np.ndarray, sigma: np.ndarray, c: np.ndarray, fac: np.ndarray, add: np.ndarray, levels: Sequence[float]) -> np.ndarray:
    """``(N, H, Q)`` Gaussian quantiles with the variance ``sigma^2 (1 + cumsum c_j^2)`` put back on
    the seasonal scale."""
    h = point.shape[1]
    var = np.ones((point.shape[0], h))
    if h > 1:
        var[:, 1:] += np.cumsum(c[:, : h - 1] ** 2, axis=1)
    spread = sigma[:, None] * np.sqrt(var)
    q = point[:, :, None] + spread[:, :, None] * z_scores(levels)[None, None, :]
    return q * fac[:, :, None] + add[:, :, None]


def damped_trend(adj: np.ndarray, fac: np.ndarray, add: np.ndarray, horizon: int, levels: Sequence[float]) -> np.ndarray:
    """ETS(A,Ad,N) on the adjusted series ``(N, L)`` -> quantiles ``(N, H, Q)`` (see the module doc)."""
    a, r, p = np.meshgrid(TREND_ALPHAS, BETA_RATIOS, PHIS, indexing="ij")
    alpha, beta, phi = a.ravel(), (a * r).ravel(), p.ravel()
    level, slope, mse = _smooth(adj, alpha, beta, phi, trend=True)
    best = np.argmin(np.where(np.isfinite(mse), mse, np.inf), axis=1)
    rows = np.arange(adj.shape[0])
    lvl, b, s = level[rows, best], slope[rows, best], np.sqrt(mse[rows, best])
    al, be, ph = alpha[best][:, None], beta[best][:, None], phi[best][:, None]
    j = np.arange(1, horizon + 1)[None, :]
    damp = ph * (1.0 - ph**j) / (1.0 - ph)  # phi + ... + phi^j
    point = lvl[:, None] + damp * b[:, None]
    c = al + be * damp
    return _quantiles(point, s, c, fac, add, levels)


def theta(adj: np.ndarray, fac: np.ndarray, add: np.ndarray, horizon: int, levels: Sequence[float]) -> np.ndarray:
    """The Theta method on the adjusted series ``(N, L)`` -> quantiles ``(N, H, Q)`` (see the module doc)."""
    zeros = np.zeros_like(ALPHAS)
    level, _, mse = _smooth(adj, ALPHAS, zeros, np.ones_like(ALPHAS), trend=False)
    best = np.argmin(np.where(np.isfinite(mse), mse, np.inf), axis=1)
    rows = np.arange(adj.shape[0])
    lvl, s, al = level[rows, best], np.sqrt(mse[rows, best]), ALPHAS[best][:, None]
    obs = np.isfinite(adj)
    n_obs = obs.sum(axis=1)
    t = np.where(obs, np.cumsum(obs, axis=1) - 1.0, 0.0)
    y = np.where(obs, adj, 0.0)
    tm = t.sum(axis=1) / n_obs
    ym = y.sum(axis=1) / n_obs
    cov = (np.where(obs, (t - tm[:, None]) * (y - ym[:, None]), 0.0)).sum(axis=1)
    var = (np.where(obs, (t - tm[:, None]) ** 2, 0.0)).sum(axis=1)
    slope = np.where(var > 0, cov / np.maximum(var, 1e-12), 0.0)
    j = np.arange(horizon)[None, :]
    drift = slope[:, None] / 2.0 * (j + (1.0 - (1.0 - al) ** n_obs[:, None]) / al)
    point = lvl[:, None] + drift
    c = np.repeat(al, horizon, axis=1)
    return _quantiles(point, s, c, fac, add, levels)


def statistical_forecasts(histories: Sequence[np.ndarray], seasons: Sequence[int], horizon: int, levels: Sequence[float]) -> dict[str, np.ndarray]:
    """Both members' quantile forecasts ``(N, H, Q)`` for a batch of histories (1-D arrays of any
    lengths, no NaNs) with their season lengths."""
    adj, fac, add = _adjust([np.asarray(h, dtype=np.float64) for h in histories], seasons, horizon)
    return {"damped_trend": damped_trend(adj, fac, add, horizon, levels), "theta": theta(adj, fac, add, horizon, levels)}


__all__ = ["MEMBERS", "damped_trend", "statistical_forecasts", "theta"]
