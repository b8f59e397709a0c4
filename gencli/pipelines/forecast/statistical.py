"""Fast statistical forecasters for the default ensemble, vectorised over a batch of series (numpy).

The damped-trend, Theta and AR members work on the seasonally adjusted series, as the M4 competition's statistical benchmarks
do: when the autocorrelation at the season lag is significant (90%, Bartlett's bound; at least three
seasons of history) the series is divided by classical multiplicative seasonal indices (or, when a value
is not positive, has additive ones subtracted), the forecast is made on what is left and the indices
are put back.

- :func:`damped_trend` — ETS(A,Ad,N), Holt's linear trend damped by ``phi`` in innovations form
  ``l_t = l_{t-1} + phi b_{t-1} + alpha e_t``, ``b_t = phi b_{t-1} + beta e_t``; ``(alpha, beta, phi)``
  chosen per series from a grid by the one-step in-sample squared error.
- :func:`holt_winters` — ETS(A,Ad,A), damped Holt-Winters with seasonal states (the season adapts
  over time, unlike the fixed indices above), on the log of a positive series so that trend and
  season act multiplicatively; ``(alpha, beta, gamma, phi)`` from a grid by the one-step in-sample
  squared error, on the raw history (not the adjusted one), grouped by season length.
- :func:`autoregressive` — ARIMA(p, d, 0) with an intercept: ``d`` from the KPSS test as auto.arima
  decides it, ``p <= 12`` by AICc among the non-explosive least-squares fits; it carries the cycles
  (lynx, sunspots) the smoothing members cannot.
- :func:`seasonal_arima` — ARIMA(p, d, 0)(P, 1, 0)_m on the raw (unadjusted) seasonal series, as
  AutoARIMA models them: seasonal differences, then KPSS for ``d``, then ``p, P <= 1`` by AICc (the
  airline-like series, AirPassengers, the adjusted AR member misses); the AR member's forecast for
  the non-seasonal series.
- :func:`theta` — the Theta method (Assimakopoulos & Nikolopoulos 2000) in Hyndman & Billah's form:
  simple exponential smoothing (``alpha`` from a grid) plus half the least-squares slope as drift,
  ``l_n + b/2 (j + (1 - (1 - alpha)^n) / alpha)`` for lead ``j + 1``.

Quantiles are Gaussian around the point forecast with the model's own horizon scaling of the in-sample
one-step residual variance ``sigma^2 (1 + sum_{j<h} c_j^2)``: ``c_j = alpha + beta phi (1 - phi^j) /
(1 - phi)`` for the damped trend, ``c_j = alpha`` for Theta (the SES form), the MA(infinity) weights for the AR member, then multiplied
by the seasonal index (Holt-Winters: ``c_j`` gains ``gamma`` at whole seasons, on the log scale,
exponentiated back). The members run on the last ``history`` values of each series (at least three seasons
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
HW_ALPHAS = np.array([0.05, 0.15, 0.3, 0.5, 0.8])
HW_BETA_RATIOS = np.array([0.02, 0.1, 0.3])
HW_GAMMA_RATIOS = np.array([0.05, 0.2, 0.5])  # gamma = ratio * (1 - alpha)
HW_PHIS = np.array([0.9, 0.98])
AR_MAX_ORDER = 12
SARIMA_P, SARIMA_SEASONAL_P = 1, 1
MEMBERS = ("damped_trend", "theta", "holt_winters", "autoregressive", "seasonal_arima")  # the order of the weights after the network's
LABELS = {"damped_trend": "damped trend", "theta": "theta", "holt_winters": "holt-winters", "autoregressive": "arima", "seasonal_arima": "seasonal arima"}


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
    acf = np.correlate(d, d, mode="full")[n : n + m] / denom  # lags 1..m
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
    """Seasonally adjusted histories, left-padded with NaN into ``(N, L)``, each series' future
    seasonal factors ``(N, H)`` (multiplicative) and offsets ``(N, H)`` (additive), and whether its
    seasonality was significant ``(N,)``."""
    n_series = len(histories)
    length = max(len(h) for h in histories)
    adj = np.full((n_series, length), np.nan)
    fac = np.ones((n_series, horizon))
    add = np.zeros((n_series, horizon))
    seasonal = np.zeros(n_series, dtype=bool)
    for i, (y, m) in enumerate(zip(histories, seasons)):
        idx, mult = _seasonal_indices(y, int(m))
        k = len(idx)
        seasonal[i] = not (mult and np.all(idx == 1.0))
        past = idx[np.arange(len(y)) % k]
        fut = idx[(len(y) + np.arange(horizon)) % k]
        if mult:
            adj[i, length - len(y) :] = y / past
            fac[i] = fut
        else:
            adj[i, length - len(y) :] = y - past
            add[i] = fut
    return adj, fac, add, seasonal


def _damped_step(level, slope, x, season, alpha, beta, phi, active, buf):
    """One step of the damped-trend recursion ``(N, G)`` for every grid point, the observation ``x
    (N, 1)`` minus the seasonal state ``season (N, G)`` (or none): the new level and slope and the
    one-step error (zero where ``active (N, 1)`` is false: those keep their state; ``active`` None:
    every series has begun, and the update runs in place in ``level``/``slope`` and ``buf (3, N, G)``)."""
    ps, e, tmp = buf
    np.multiply(phi, slope, out=ps)  # phi b
    if active is None:
        np.add(level, ps, out=level)  # the one-step forecast without the season
        np.subtract(x, level, out=e)
        if season is not None:
            e -= season
        np.multiply(alpha, e, out=tmp)
        level += tmp
        np.multiply(beta, e, out=tmp)
        np.add(ps, tmp, out=slope)
        return level, slope, e
    f = level + ps
    np.copyto(e, np.where(active, x - f - (0.0 if season is None else season), 0.0))
    return np.where(active, f + alpha * e, level), np.where(active, ps + beta * e, slope), e


def _accumulate(sse, count, e, scored, tmp):
    """Add the squared errors ``e (N, G)`` to ``sse`` and one to ``count (N,)`` where ``scored (N,)``
    (None: every series)."""
    np.multiply(e, e, out=tmp)
    if scored is None:
        sse += tmp
        count += 1
    else:
        sse += np.where(scored[:, None], tmp, 0.0)
        count += scored


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
    buf = np.empty((3, n, g))
    for t in range(int(start.min()), length):
        level, slope, e = _damped_step(level, slope, adj[:, t, None], None, alpha, beta, phi, None if t >= all_active else (t >= start)[:, None], buf)
        _accumulate(sse, count, e, None if t >= all_scored else t >= burn, buf[2])
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


def _hw_smooth(y: np.ndarray, m: int, alpha, beta, gamma, phi):
    """Additive damped Holt-Winters recursion (seasonal states) on right-aligned ``y (N, L)`` (NaN
    before each series' start) for every grid point: final level, slope ``(N, G)``, seasonal states
    ``(N, G, m)`` indexed by time modulo ``m``, one-step mean squared error ``(N, G)``."""
    n, length = y.shape
    g = len(alpha)
    start = np.argmax(np.isfinite(y), axis=1)
    n_obs = length - start
    rows = np.arange(n)
    first = np.array([y[i, start[i] : start[i] + m].mean() for i in range(n)])
    has2 = n_obs >= 2 * m + 1
    second = np.array([y[i, start[i] + m : start[i] + 2 * m].mean() if has2[i] else np.nan for i in range(n)])
    b0 = np.where(has2, (second - first) / m, 0.0) if m > 1 else np.zeros(n)
    if m == 1:  # a non-seasonal start: the first value, the slope of the first few
        k = np.clip(n_obs // 4, 1, 8)
        first = y[rows, start]
        a = np.array([y[i, start[i] : start[i] + k[i]].mean() for i in range(n)])
        b = np.array([y[i, start[i] + k[i] : start[i] + 2 * k[i]].mean() for i in range(n)])
        b0 = np.where(np.isfinite(b), (b - a) / k, 0.0)
    # seasonal states time-major (m, N, G), so that the state of each step is one contiguous block
    season = np.zeros((m, n, g))
    if m > 1:
        for i in range(n):
            t = start[i] + np.arange(m)
            season[t % m, i, :] = (y[i, t] - first[i])[:, None]
    # the state at the last initialisation step: the level at mid-season moved to its end
    level = np.repeat((first + b0 * (m - 1) / 2.0)[:, None], g, axis=1)
    slope = np.repeat(b0[:, None], g, axis=1)
    sse = np.zeros((n, g))
    count = np.zeros(n)
    begin = start + m
    burn = begin + max(m, 1)
    all_active, all_scored = int(begin.max()), int(burn.max())
    buf = np.empty((3, n, g))
    for t in range(int(begin.min()), length):
        s_old = season[t % m]
        level, slope, e = _damped_step(level, slope, y[:, t, None], s_old, alpha, beta, phi, None if t >= all_active else (t >= begin)[:, None], buf)
        np.multiply(gamma, e, out=buf[2])
        s_old += buf[2]
        _accumulate(sse, count, e, None if t >= all_scored else t >= burn, buf[2])
    season = season.transpose(1, 2, 0)
    mse = sse / np.maximum(count, 1)[:, None]
    mse[count == 0] = np.nan
    return level, slope, season, mse


def holt_winters(histories: Sequence[np.ndarray], seasons: Sequence[int], horizon: int, levels: Sequence[float]) -> np.ndarray:
    """Damped Holt-Winters with seasonal states, ETS(A,Ad,A), fitted on the log of a positive series
    (so trend and season act multiplicatively) and on the values otherwise -> quantiles ``(N, H, Q)``;
    series are grouped by season length."""
    a, r, gr, p = np.meshgrid(HW_ALPHAS, HW_BETA_RATIOS, HW_GAMMA_RATIOS, HW_PHIS, indexing="ij")
    alpha, beta, gamma, phi = a.ravel(), (a * r).ravel(), (gr * (1.0 - a)).ravel(), p.ravel()
    out = np.zeros((len(histories), horizon, len(levels)))
    logs = np.array([bool(np.all(h > 0)) for h in histories])
    seasons = np.array([m if len(h) >= 3 * m + 2 else 1 for h, m in zip(histories, seasons)])
    z = z_scores(levels)
    j = np.arange(1, horizon + 1)
    for m in np.unique(seasons):
        sel = np.flatnonzero(seasons == m)
        length = max(len(histories[i]) for i in sel)
        y = np.full((len(sel), length), np.nan)
        for row, i in enumerate(sel):
            h = np.log(histories[i]) if logs[i] else histories[i]
            y[row, length - len(h) :] = h
        gm = gamma if m > 1 else np.zeros_like(gamma)
        level, slope, season, mse = _hw_smooth(y, int(m), alpha, beta, gm, phi)
        best = np.argmin(np.where(np.isfinite(mse), mse, np.inf), axis=1)
        rows = np.arange(len(sel))
        ph, al, be, ga = phi[best][:, None], alpha[best][:, None], beta[best][:, None], gm[best][:, None]
        damp = ph * (1.0 - ph ** j[None, :]) / (1.0 - ph)
        fut = season[rows, best][:, (length - 1 + j) % m]  # (n, H)
        point = level[rows, best][:, None] + damp * slope[rows, best][:, None] + fut
        c = al + be * damp + ga * ((j % m) == 0)[None, :]
        var = np.ones_like(point)
        var[:, 1:] += np.cumsum(c[:, :-1] ** 2, axis=1)
        s = np.sqrt(np.where(np.isfinite(mse[rows, best]), mse[rows, best], 0.0))
        q = point[:, :, None] + (s[:, None] * np.sqrt(var))[:, :, None] * z[None, None, :]
        lg = logs[sel][:, None, None]
        out[sel] = np.where(lg, np.exp(np.minimum(np.where(lg, q, 0.0), 700.0)), q)
    return out


def _stationary(a: np.ndarray) -> np.ndarray:
    """``(R,)`` whether the AR models ``y_t = sum_k a_k y_{t-k}`` (``a (R, p)``) are stationary (every
    root of ``z^p - a_1 z^(p-1) - ... - a_p`` inside the unit circle), by the Schur-Cohn step-down
    recursion: the reflection coefficients ``k_j = a_j`` of the order-``j`` model, each order reduced by
    ``a_i <- (a_i + k_j a_(j-i)) / (1 - k_j^2)``, all ``|k_j| < 1`` (the same verdict as the companion
    matrix's eigenvalues in O(p^2))."""
    ok = np.ones(len(a), dtype=bool)
    for j in range(a.shape[1], 0, -1):
        k = a[:, j - 1]
        ok &= np.abs(k) < 1.0
        if j > 1:
            k = np.where(ok, k, 0.0)[:, None]
            a = (a[:, : j - 1] + k * a[:, j - 2 :: -1]) / (1.0 - k * k)
    return ok


def _ar_fit(z: np.ndarray, candidates: Sequence[tuple[int, ...]], const: np.ndarray):
    """Least-squares AR fits with the lag sets ``candidates`` (plus an intercept where ``const``
    ``(N,)``) on ``z (N, L)`` (NaN before each series' start), the candidate chosen per series by
    AICc among the non-explosive fits with at most a fifth of the history as coefficients, all scored
    on the same rows (those whose every lag up to the largest is observed): coefficients ``(N, 1 +
    top)`` (intercept, then lags ``1..top``) and the residual variance ``(N,)``."""
    n, length = z.shape
    obs = np.isfinite(z)
    n_obs = obs.sum(axis=1)
    top = int(min(max((max(c) for c in candidates if c), default=0), max(0, length - 2)))
    candidates = [c for c in candidates if not c or max(c) <= top]
    x = np.where(obs, z, 0.0)
    start = length - n_obs
    used = (np.arange(length)[None, :] >= (start + top)[:, None]) & obs
    design = np.zeros((n, 1 + top, length))  # (N, 1 + top, L): the intercept, then lags 1..top
    design[:, 0] = np.where(const, 1.0, 0.0)[:, None]
    for k in range(1, top + 1):
        design[:, k, k:] = x[:, :-k]  # the rows before ``top`` are not used
    design *= used[:, None, :]
    target = x * used
    count = used.sum(axis=1)
    m = np.maximum(count, 1)
    xtx = design @ design.transpose(0, 2, 1)
    xty = (design @ target[:, :, None])[:, :, 0]
    yty = np.einsum("nt,nt->n", target, target)
    coef = np.zeros((n, 1 + top))
    coef[:, 0] = np.where(const, xty[:, 0] / m, 0.0)
    sigma2 = np.maximum(yty / m - coef[:, 0] ** 2, 0.0)
    # every candidate's fit and AICc first; then per series the lowest AICc among the admissible
    # ones (the earliest candidate on a tie) whose fit is not explosive, checked only for the winner
    # and, where it is explosive, for the next best
    fits = np.zeros((len(candidates), n, 1 + top))
    aics = np.full((len(candidates), n), np.inf)
    sig = np.zeros((len(candidates), n))
    for c, lagset in enumerate(candidates):
        cols = np.r_[0, np.asarray(lagset, dtype=int)]
        k = len(cols)
        sub = xtx[:, cols[:, None], cols[None, :]]
        a = sub + 1e-9 * np.eye(k) * np.maximum(np.trace(sub, axis1=1, axis2=2), 1.0)[:, None, None]
        b = np.linalg.solve(a, xty[:, cols, None])[:, :, 0]
        sse = np.maximum(yty - 2 * np.einsum("ni,ni->n", b, xty[:, cols]) + np.einsum("ni,nij,nj->n", b, sub, b), 1e-300)
        params = len(lagset) + const
        aic = m * np.log(sse / m) + 2 * params + 2 * params * (params + 1) / np.maximum(m - params - 1, 1e-9)
        ok = (len(lagset) <= n_obs // 5) & (count - params - 1 > 0) & np.isfinite(aic)
        aics[c] = np.where(ok, aic, np.inf)
        fits[c][:, cols] = b
        sig[c] = sse / np.maximum(count - params, 1)
    pending = np.ones(n, dtype=bool)
    while pending.any():
        rows = np.flatnonzero(pending)
        choice = np.argmin(aics[:, rows], axis=0)
        found = np.isfinite(aics[choice, rows])
        rows, choice = rows[found], choice[found]
        pending[:] = False
        for c in np.unique(choice):
            lagset = candidates[c]
            r = rows[choice == c]
            if lagset:
                stable = _stationary(fits[c][r, 1 : max(lagset) + 1])
                aics[c, r[~stable]] = np.inf
                pending[r[~stable]] = True
                r = r[stable]
            coef[r] = fits[c][r]
            sigma2[r] = sig[c][r]
    return coef, sigma2


def _integrate(coef: np.ndarray, d: np.ndarray, seasonal_d: np.ndarray, m: int) -> np.ndarray:
    """The AR coefficients ``(N, 1 + p)`` of the differenced series as coefficients ``(N, 1 + p + 1 + m)``
    of the series itself: ``phi(B) (1 - B)^d (1 - B^m)^D``, ``d`` and ``D`` in {0, 1} per series."""
    n, width = coef.shape
    poly = np.concatenate([np.ones((n, 1)), -coef[:, 1:]], axis=1)  # phi(B) = 1 - sum phi_k B^k
    out = np.zeros((n, width + 1 + m))
    for dd in (0, 1):
        for sd in (0, 1):
            sel = (d == dd) & (seasonal_d == sd)
            if not sel.any():
                continue
            diff = np.array([1.0])
            if dd:
                diff = np.convolve(diff, [1.0, -1.0])
            if sd:
                diff = np.convolve(diff, np.r_[1.0, np.zeros(m - 1), -1.0])
            for k, c in enumerate(diff):
                if c:
                    out[sel, k : k + width] += c * poly[sel]
    full = np.concatenate([coef[:, :1], -out[:, 1:]], axis=1)
    return full


def _ar_predict(y: np.ndarray, coef: np.ndarray, horizon: int):
    """Point forecasts ``(N, H)`` and MA(infinity) weights ``psi_1..psi_H`` ``(N, H)`` of the AR
    model ``y_t = c + sum_k a_k y_{t-k}`` (``coef (N, 1 + p)``: ``c`` then ``a_1..a_p``) after the
    right-aligned history ``y (N, L)``."""
    n = y.shape[0]
    top = coef.shape[1] - 1
    phi = coef[:, 1:]
    x = np.where(np.isfinite(y), y, 0.0)
    recent = np.zeros((n, top))
    have = min(top, x.shape[1])
    recent[:, :have] = x[:, ::-1][:, :have]  # lag 1 first
    point = np.zeros((n, horizon))
    psi = np.zeros((n, horizon))
    psi_hist = np.zeros((n, top))  # psi_j, psi_{j-1}, ... (psi_0 = 1)
    if top:
        psi_hist[:, 0] = 1.0
    for j in range(horizon):
        f = coef[:, 0] + np.einsum("nk,nk->n", phi, recent)
        point[:, j] = f
        if top:
            recent = np.concatenate([f[:, None], recent[:, :-1]], axis=1)
            psi[:, j] = np.einsum("nk,nk->n", phi, psi_hist)
            psi_hist = np.concatenate([psi[:, j : j + 1], psi_hist[:, :-1]], axis=1)
    return point, psi


def kpss_nonstationary(adj: np.ndarray, critical: float = 0.463) -> np.ndarray:
    """``(N,)`` whether the KPSS level-stationarity statistic (Bartlett long-run variance with
    ``floor(4 (n / 100)^(1/4))`` lags) of each series exceeds its 5% critical value."""
    obs = np.isfinite(adj)
    n_obs = np.maximum(obs.sum(axis=1), 1)
    mean = np.where(obs, adj, 0.0).sum(axis=1) / n_obs
    e = np.where(obs, adj - mean[:, None], 0.0)
    partial = np.cumsum(e, axis=1)
    lrv = (e * e).sum(axis=1) / n_obs
    lags = np.floor(4.0 * (n_obs / 100.0) ** 0.25).astype(int)
    for k in range(1, int(lags.max()) + 1):
        gamma = (e[:, k:] * e[:, :-k]).sum(axis=1) / n_obs
        lrv += np.where(k <= lags, 2.0 * (1.0 - k / (lags + 1.0)) * gamma, 0.0)
    stat = (partial**2).sum(axis=1) / (n_obs**2 * np.maximum(lrv, 1e-300))
    return stat > critical


def _difference(y: np.ndarray, lag: int, where: np.ndarray) -> np.ndarray:
    out = y.copy()
    out[where, lag:] = y[where, lag:] - y[where, :-lag]
    out[where, :lag] = np.nan
    return out


def autoregressive(adj: np.ndarray, fac: np.ndarray, add: np.ndarray, horizon: int, levels: Sequence[float]) -> np.ndarray:
    """ARIMA(p, d, 0) on the adjusted series ``(N, L)`` -> quantiles ``(N, H, Q)``: ``d = 1`` (first
    differences, the intercept a drift) where the KPSS test rejects level stationarity (as
    auto.arima decides), ``p <= AR_MAX_ORDER`` by AICc (see :func:`_ar_fit`)."""
    diff = kpss_nonstationary(adj)
    z = _difference(adj, 1, diff)
    coef, sigma2 = _ar_fit(z, [tuple(range(1, p + 1)) for p in range(AR_MAX_ORDER + 1)], np.ones(len(adj), dtype=bool))
    full = _integrate(coef, diff.astype(int), np.zeros(len(adj), dtype=int), 1)
    point, psi = _ar_predict(adj, full, horizon)
    return _quantiles(point, np.sqrt(sigma2), psi, fac, add, levels)


def seasonal_arima(histories: Sequence[np.ndarray], seasons: Sequence[int], horizon: int, levels: Sequence[float], otherwise: np.ndarray) -> np.ndarray:
    """Seasonal ARIMA(p, d, 0)(P, 1, 0)_m on the raw series whose ``seasons[i] > 1`` (and at least
    three seasons and two values of history) -> quantiles ``(N, H, Q)``, ``otherwise`` (the same
    shape) for the rest: seasonal differences, ``d = 1`` where the KPSS test then rejects level
    stationarity, ``p <= SARIMA_P`` and ``P <= SARIMA_SEASONAL_P`` (lags ``m..Pm``) by AICc, an
    intercept only when ``d + D <= 1`` (as auto.arima allows a drift)."""
    out = otherwise.copy()
    seasons = np.array([m if len(h) >= 3 * m + 2 else 1 for h, m in zip(histories, seasons)])
    for m in np.unique(seasons[seasons > 1]):
        m = int(m)
        sel = np.flatnonzero(seasons == m)
        length = max(len(histories[i]) for i in sel)
        y = np.full((len(sel), length), np.nan)
        for row, i in enumerate(sel):
            y[row, length - len(histories[i]) :] = histories[i]
        seasonal_d = np.ones(len(sel), dtype=int)
        d = kpss_nonstationary(_difference(y, m, seasonal_d == 1))
        z = _difference(_difference(y, m, seasonal_d == 1), 1, d)
        lags = [tuple(range(1, p + 1)) + tuple(m * k for k in range(1, sp + 1)) for p in range(SARIMA_P + 1) for sp in range(SARIMA_SEASONAL_P + 1)]
        coef, sigma2 = _ar_fit(z, lags, d.astype(int) + seasonal_d <= 1)
        point, psi = _ar_predict(y, _integrate(coef, d.astype(int), seasonal_d, m), horizon)
        one = np.ones_like(point)
        # a floor on the spread: an exactly periodic series is fitted without residuals
        sigma = np.maximum(np.sqrt(sigma2), 1e-3 * np.nanstd(y, axis=1))
        out[sel] = _quantiles(point, sigma, psi, one, 0.0 * one, levels)
    return out


def statistical_forecasts(histories: Sequence[np.ndarray], seasons: Sequence[int], horizon: int, levels: Sequence[float]) -> dict[str, np.ndarray]:
    """Every member's quantile forecasts ``(N, H, Q)`` for a batch of histories (1-D arrays of any
    lengths, no NaNs) with their season lengths."""
    histories = [np.asarray(h, dtype=np.float64) for h in histories]
    adj, fac, add, seasonal = _adjust(histories, seasons, horizon)
    out = {"damped_trend": damped_trend(adj, fac, add, horizon, levels), "theta": theta(adj, fac, add, horizon, levels)}
    seasonal_m = [int(m) if s else 1 for m, s in zip(seasons, seasonal)]
    out["holt_winters"] = holt_winters(histories, seasonal_m, horizon, levels)
    out["autoregressive"] = autoregressive(adj, fac, add, horizon, levels)
    out["seasonal_arima"] = seasonal_arima(histories, seasonal_m, horizon, levels, out["autoregressive"])
    return out


__all__ = ["MEMBERS", "autoregressive", "damped_trend", "holt_winters", "seasonal_arima", "statistical_forecasts", "theta"]
