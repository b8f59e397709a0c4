"""The statistical members of the default forecast ensemble (damped-trend ETS, Theta, Holt-Winters,
ARIMA, seasonal ARIMA with and without MA terms) and the per-series weights of the ensemble."""

from __future__ import annotations

import numpy as np
import pytest

from gencli.pipelines.forecast.ensemble import member_weights
from gencli.pipelines.forecast.statistical import (
    BOUND,
    _ar_predict,
    _difference,
    _integrate,
    _sarma_css,
    _seasonal_indices,
    _stationary,
    kpss_nonstationary,
    seasonal_arima,
    statistical_forecasts,
)

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
        assert np.allclose(both[name][1], alone[name][0], equal_nan=True), name
    assert np.all(np.isnan(both["seasonal_arima_ma"]))  # no season found: the member does not apply
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
    for name, q in out.items():
        assert np.allclose(q, 5.0) or (name == "seasonal_arima_ma" and np.all(np.isnan(q))), name


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


def _airline_like(phi, theta, seasonal_theta, n, m, seed):
    """``(1 - phi B)(1 - B)(1 - B^m) y_t = (1 + theta B)(1 + Theta B^m) e_t``, unit innovations, on a
    seasonal level of 100."""
    rng = np.random.default_rng(seed)
    e = rng.normal(size=n + m + 1)
    w = e[m + 1 :] + theta * e[m:-1] + seasonal_theta * e[1:-m] + theta * seasonal_theta * e[: -m - 1]
    u = np.zeros(n)
    for t in range(1, n):
        u[t] = phi * u[t - 1] + w[t]
    y = np.zeros(n)
    y[: m + 1] = 100 + 10 * np.sin(2 * np.pi * np.arange(m + 1) / m)
    for t in range(m + 1, n):
        y[t] = y[t - 1] + y[t - m] - y[t - m - 1] + u[t]
    return y


@pytest.mark.parametrize("phi,theta,seasonal_theta,order", [(0.0, -0.4, -0.6, (0, 1, 0, 1)), (0.5, 0.0, -0.7, (1, 0, 0, 1)), (0.3, 0.4, -0.5, (1, 1, 0, 1))])
def test_css_seasonal_arma_agrees_with_statsmodels_sarimax(phi, theta, seasonal_theta, order):
    import warnings

    from statsmodels.tsa.statespace.sarimax import SARIMAX

    m, n, h = 12, 240, 18
    y = _airline_like(phi, theta, seasonal_theta, n, m, seed=int(10 * (theta - seasonal_theta + phi) + 50))
    every = np.array([True])
    z = _difference(_difference(y[None], m, every), 1, every)
    beta, sse, count, last = _sarma_css(z, m, np.array([order]), np.array([False]), skip=m + 1)
    ours = beta[0, 0, [1, 3, 2, 4]][[k for k in range(4) if order[k]]]  # phi, theta, (Phi), Theta as fitted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = SARIMAX(y, order=(order[0], 1, order[1]), seasonal_order=(order[2], 1, order[3], m)).fit(disp=False)
    ref = res.params[:-1]  # (ar.L1), (ma.L1), ma.S.L12, then sigma2
    assert np.allclose(ours, ref, atol=0.06), (ours, ref)
    sigma2 = sse[0, 0] / (count[0] - sum(order))
    assert abs(sigma2 / res.params[-1] - 1) < 0.1, (sigma2, res.params[-1])
    # forecasts and their standard errors from the psi-weights against the state-space model's
    b = beta[0, 0]
    ar = np.zeros((1, m + 2))
    ar[0, [1, m, m + 1]] = b[1], b[2], -b[1] * b[2]
    ma = np.zeros((1, m + 1))
    ma[0, [0, m - 1, m]] = b[3], b[4], b[3] * b[4]
    point, psi = _ar_predict(y[None], _integrate(ar, np.array([1]), np.array([1]), m), h, ma, last[0])
    fc = res.get_forecast(h)
    se = np.sqrt(sigma2 * (1 + np.r_[0.0, np.cumsum(psi[0, : h - 1] ** 2)]))
    assert np.abs(point[0] - fc.predicted_mean).max() < 0.35 * np.sqrt(res.params[-1]), point[0] - fc.predicted_mean
    assert np.allclose(se, fc.se_mean, rtol=0.12), (se, fc.se_mean)


def test_seasonal_arima_ma_member_finds_the_airline_model_on_the_log_scale():
    m, n, h = 12, 144, 18
    # a multiplicative series: the airline model holds for its log
    y = np.exp(5.0 + 0.02 * _airline_like(0.0, -0.4, -0.6, n, m, seed=7))
    hist = y[: n - h]
    out = statistical_forecasts([hist], [m], h, LEVELS)
    ma, ar = out["seasonal_arima_ma"][0], out["seasonal_arima"][0]
    assert np.all(np.isfinite(ma)) and np.all(np.diff(ma, axis=-1) >= 0)
    assert np.all(np.diff(np.log(ma[:, 4] / ma[:, 0])) >= 0)  # the band widens on the log scale it was fitted on
    # the median: the airline model fitted to the log by statsmodels, exponentiated
    import warnings

    from statsmodels.tsa.statespace.sarimax import SARIMAX

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = np.exp(SARIMAX(np.log(hist), order=(0, 1, 1), seasonal_order=(0, 1, 1, m)).fit(disp=False).get_forecast(h).predicted_mean)
    assert np.abs(ma[:, 2] / ref - 1).max() < 0.02, ma[:, 2] / ref - 1
    assert np.abs(ma[:, 2] / ref - 1).mean() < np.abs(ar[:, 2] / ref - 1).mean()
    # a batch of different lengths (left-padded) gives each series the forecast it gets alone
    short = y[40 : n - h]
    both = seasonal_arima([hist, short], [m, m], h, LEVELS, np.zeros((2, h, len(LEVELS))), moving_average=True)
    alone = seasonal_arima([short], [m], h, LEVELS, np.zeros((1, h, len(LEVELS))), moving_average=True)
    assert np.allclose(both[1], alone[0])
    assert np.allclose(both[0], ma)


def test_css_keeps_the_moving_averages_invertible():
    # seasonal differences of white noise: the seasonal MA coefficient of the CSS fit runs to -1
    rng = np.random.default_rng(5)
    m = 4
    y = 10 + rng.normal(size=(3, 120))
    z = _difference(y, m, np.ones(3, dtype=bool))
    beta, sse, _, _ = _sarma_css(z, m, np.array([(0, 1, 0, 1), (1, 1, 1, 1)]), np.ones(3, dtype=bool), skip=m + 1)
    assert np.all(np.abs(beta[..., 1:]) <= BOUND) and np.all(np.isfinite(sse))
    assert np.all(beta[:, 0, 4] < -0.7), beta[:, 0, 4]
