"""The statistical members of the default forecast ensemble (damped-trend ETS, Theta, Holt-Winters,
ARIMA) and the per-series weights of the ensemble."""

from __future__ import annotations

import numpy as np
import pytest

from gencli.pipelines.forecast.ensemble import member_weights
from gencli.pipelines.forecast.statistical import _seasonal_indices, _stationary, kpss_nonstationary, statistical_forecasts

LEVELS = [0.05, 0.1, 0.5, 0.9, 0.95]


def test_a_straight_line_is_extrapolated():
    y = 10.0 + 2.0 * np.arange(60)
    out = statistical_forecasts([y], [1], 6, LEVELS)
    truth = 10.0 + 2.0 * np.arange(60, 66)
    # the damped trend starts on the line and bends only slightly; Theta's drift is half the slope
    # plus SES catching up, so it lags a little more
    assert np.allclose(out["damped_trend"][0, :, 2], truth, rtol=0.02)
    assert np.abs(out["theta"][0, :, 2] - truth).max() < 0.1 * (truth[-1] - truth[0]) + 6.0


def test_seasonal_series_and_honest_bands():
    rng = np.random.default_rng(0)
    t = np.arange(180)
    season = 1.0 + 0.3 * np.sin(2 * np.pi * t / 12)
    y = (200 + 0.5 * t) * season * (1 + rng.normal(0, 0.02, t.size))
    idx, mult = _seasonal_indices(y, 12)
    assert mult and np.allclose(idx, season[:12], atol=0.03)
    h = 24
    out = statistical_forecasts([y[:-h]], [12], h, LEVELS)
    for name, q in out.items():
        assert np.all(np.diff(q[0], axis=-1) >= 0), name  # ordered quantiles
        width = (q[0, :, 3] - q[0, :, 1]) / q[0, :, 2]
        assert width[-1] > width[0], name  # the band widens with the lead time
        median_err = np.abs(q[0, :, 2] - y[-h:]).mean() / y[-h:].mean()
        assert median_err < 0.05, (name, median_err)
        inside = np.mean((y[-h:] >= q[0, :, 0]) & (y[-h:] <= q[0, :, 4]))
        assert inside >= 0.6, (name, inside)  # a 90% band holds most of the truth


def test_no_seasonality_is_found_in_noise_and_batches_mix_lengths():
    rng = np.random.default_rng(1)
    noise = 50 + rng.normal(0, 1, 120)
    idx, _ = _seasonal_indices(noise, 12)
    assert np.allclose(idx, 1.0)
    short = 20 + np.arange(25, dtype=float)
    both = statistical_forecasts([noise, short], [12, 12], 6, LEVELS)
    alone = statistical_forecasts([short], [12], 6, LEVELS)
    for name in both:  # left padding of the shorter series changes nothing
        assert np.allclose(both[name][1], alone[name][0]), name
    assert np.all(np.isfinite(both["theta"])) and np.abs(both["theta"][0, :, 2] - 50).max() < 1.5


def test_member_weights():
    w = member_weights(np.array([[1.0, 2.0, 4.0], [3.0, 3.0, 3.0], [np.nan, 1.0, 1.0], [np.nan, np.nan, np.nan]]), power=1.0)
    assert np.allclose(w.sum(axis=1), 1.0)
    assert np.allclose(w[0], np.array([1.0, 0.5, 0.25]) / 1.75)
    assert np.allclose(w[1], 1 / 3) and np.allclose(w[2], [0.0, 0.5, 0.5])
    assert np.allclose(w[3], [1.0, 0.0, 0.0])  # nothing scored: the network alone
    sharp = member_weights(np.array([[1.0, 2.0, 4.0]]), power=8.0)
    assert sharp[0, 0] > 0.99


@pytest.mark.parametrize("m", [1, 4, 7])
def test_constant_series(m):
    y = np.full(40, 5.0)
    out = statistical_forecasts([y], [m], 5, LEVELS)
    for q in out.values():
        assert np.allclose(q, 5.0)


def test_arima_member_carries_a_cycle_and_kpss_decides_differencing():
    rng = np.random.default_rng(2)
    # AR(2) with complex roots: a cycle of about 10 steps that smoothing members flatten out
    y = np.zeros(300)
    for t in range(2, 300):
        y[t] = 1.6 * y[t - 1] - 0.9 * y[t - 2] + rng.normal()
    y += 100.0
    h = 6
    out = statistical_forecasts([y[:-h]], [1], h, LEVELS)
    # the exact conditional mean of the process: the member's median should be near it
    cond = list(y[: -h])
    for _ in range(h):
        cond.append(100 + 1.6 * (cond[-1] - 100) - 0.9 * (cond[-2] - 100))
    ar_err = np.abs(out["autoregressive"][0, :, 2] - cond[-h:]).mean()
    flat_err = np.abs(out["theta"][0, :, 2] - cond[-h:]).mean()
    assert ar_err < 0.5 * flat_err and ar_err < 1.0, (ar_err, flat_err)
    assert np.all(np.diff(out["autoregressive"][0], axis=-1) >= 0)
    walk = np.cumsum(rng.normal(size=(1, 200)), axis=1) + 50
    noise = rng.normal(size=(1, 200))
    assert kpss_nonstationary(np.r_[walk, noise]).tolist() == [True, False]
    # a random walk with drift: differenced, the drift continues
    drift = 10 + 0.5 * np.arange(150) + np.cumsum(rng.normal(0, 0.2, 150))
    q = statistical_forecasts([drift], [1], 6, LEVELS)["autoregressive"][0]
    assert np.allclose(q[:, 2], drift[-1] + 0.5 * np.arange(1, 7), atol=1.5)
    assert np.all(np.diff(q[:, 4] - q[:, 0]) > 0)  # an integrated process: the band widens


def test_holt_winters_member_follows_multiplicative_growth_and_season():
    t = np.arange(144)
    y = 100 * np.exp(0.01 * t) * (1 + 0.25 * np.sin(2 * np.pi * t / 12))
    h = 18
    q = statistical_forecasts([y[:-h]], [12], h, LEVELS)["holt_winters"][0]
    err = np.abs(q[:, 2] - y[-h:]) / y[-h:]
    assert err.max() < 0.05, err
    assert np.all(np.diff(q, axis=-1) >= 0)
    # a series with values <= 0 is modelled additively on its own scale (the damped trend bends a little)
    z = 0.5 * t - 30 + 20 * np.sin(2 * np.pi * t / 12)
    qz = statistical_forecasts([z[:-h]], [12], h, LEVELS)["holt_winters"][0]
    assert np.all(np.isfinite(qz)) and np.abs(qz[:, 2] - z[-h:]).max() < 3.0, qz[:, 2] - z[-h:]


def test_seasonal_arima_member_follows_seasonal_differences_with_an_ar_term():
    rng = np.random.default_rng(3)
    m, n, h = 12, 240, 12
    pattern = 50 + 20 * np.sin(2 * np.pi * np.arange(m) / m)
    w = np.zeros(n)
    for t in range(1, n):
        w[t] = 0.7 * w[t - 1] + rng.normal(0, 1.0)
    y = np.zeros(n)
    y[:m] = pattern
    for t in range(m, n):
        y[t] = y[t - m] + w[t]
    cond = y[-m:] + 0.7 ** np.arange(1, h + 1) * w[-1]  # E[y_{n+j} | history]
    out = statistical_forecasts([y], [m], h, LEVELS)
    q = out["seasonal_arima"][0]
    assert np.abs(q[:, 2] - cond).max() < 1.5, q[:, 2] - cond
    # better than the AR member on the seasonally adjusted series, which cannot see the seasonal random walk
    assert np.abs(q[:, 2] - cond).mean() < np.abs(out["autoregressive"][0, :, 2] - cond).mean()
    assert np.all(np.diff(q, axis=-1) >= 0) and np.all(np.diff(q[:, 4] - q[:, 0]) >= 0)
    # a series without seasonality: the AR member's forecast
    noise = rng.normal(0, 1, 120)
    both = statistical_forecasts([noise], [12], 6, LEVELS)
    assert np.array_equal(both["seasonal_arima"], both["autoregressive"])


def test_stationarity_recursion_agrees_with_companion_eigenvalues():
    rng = np.random.default_rng(3)
    for p in (1, 2, 5, 13):
        a = rng.normal(size=(2000, p)) / np.sqrt(p)
        comp = np.zeros((len(a), p, p))
        comp[:, 0] = a
        comp[:, np.arange(1, p), np.arange(p - 1)] = 1.0
        expected = np.abs(np.linalg.eigvals(comp)).max(axis=1) < 1.0
        assert 0.05 < expected.mean() < 0.999  # both verdicts occur
        np.testing.assert_array_equal(_stationary(a), expected)
