"""Frequencies, calendar features, the synthetic corpus, features and metrics of the forecasting family."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gencli.data.calendar import (
    CALENDAR_FEATURES,
    Frequency,
    IrregularError,
    calendar_features,
    future_timestamps,
    infer_frequency,
)
from gencli.data.series import generate
from gencli.data.timeseries import impute_linear
from gencli.models.tft import TFTConfig
from gencli.pipelines.forecast.features import bind_columns, hash_bucket, make_batch, series_scale
from gencli.pipelines.forecast.metrics import (
    geometric_mean,
    interpolate_quantiles,
    mase,
    seasonal_naive,
    weighted_quantile_loss,
)


@pytest.mark.parametrize(
    "pandas_freq,family,multiple,season",
    [("h", "hourly", 1, 24), ("15min", "subhourly", 1, 96), ("D", "daily", 1, 7), ("B", "business", 1, 5), ("W-SUN", "weekly", 1, 52),
     ("MS", "monthly", 1, 12), ("ME", "monthly", 1, 12), ("QS", "quarterly", 1, 4), ("QE-DEC", "quarterly", 1, 4), ("YS", "yearly", 1, 1),
     ("2h", "hourly", 2, 12), ("6MS", "quarterly", 2, 2)],
)
def test_frequency_inference_and_future_grid(pandas_freq, family, multiple, season):
    idx = pd.date_range("2021-03-01", periods=30, freq=pandas_freq)
    freq, pos = infer_frequency(idx.values)
    assert (freq.family, freq.multiple, freq.season_length()) == (family, multiple, season)
    assert list(pos) == list(range(30))
    nxt = pd.date_range(idx[-1], periods=4, freq=pandas_freq)[1:]
    assert list(pd.DatetimeIndex(future_timestamps(idx[-1], freq, 3))) == list(nxt)


def test_gaps_become_positions_and_irregular_steps_are_rejected():
    idx = pd.date_range("2021-01-01", periods=20, freq="D").delete([3, 4, 10])
    freq, pos = infer_frequency(idx.values)
    assert freq.family == "daily" and list(pos[:5]) == [0, 1, 2, 5, 6]
    bad = pd.to_datetime(["2021-01-01 00:00", "2021-01-02 00:00", "2021-01-03 12:00", "2021-01-05 00:00"]).values
    with pytest.raises(IrregularError, match="irregular"):
        infer_frequency(bad)
    with pytest.raises(IrregularError, match="monthly grid"):
        infer_frequency(pd.to_datetime(["2021-01-01", "2021-02-15", "2021-03-01", "2021-04-20"]).values)


def test_calendar_features_are_cyclic_and_zero_without_time():
    ts = pd.date_range("2024-01-01", periods=8, freq="D").values  # a Monday
    f = calendar_features(ts, 8)
    assert f.shape == (8, len(CALENDAR_FEATURES))
    assert np.allclose(f[0, 2:4], [0.0, 1.0], atol=1e-6)  # Monday: weekday 0
    assert np.allclose(f[7, 2:4], f[0, 2:4], atol=1e-6)  # a week later, same weekday
    assert np.allclose(f[:, 0:2], [0.0, 1.0])  # midnight
    assert not calendar_features(None, 5).any()


def test_generator_is_deterministic_and_varied():
    a, b = generate(123, 300), generate(123, 300)
    assert np.array_equal(a.target, b.target) and a.freq == b.freq
    recs = [generate(i, 200) for i in range(200)]
    assert len({r.freq.family for r in recs}) >= 8
    assert any(r.known for r in recs) and any(r.observed for r in recs) and any(r.imputed for r in recs)
    assert any((r.target == 0).mean() > 0.3 for r in recs)  # intermittent series
    assert all(np.isfinite(r.target).all() and len(r.target) == 200 for r in recs)
    stds = [np.std(r.target) for r in recs]
    assert max(stds) / max(min(stds), 1e-12) > 1e4  # very different scales


def test_make_batch_scaling_layout_and_bindings():
    cfg = TFTConfig(
        hidden_size=8, variable_size=4, num_attention_heads=2, quantiles=[0.1, 0.5, 0.9],
        static_reals=["target_loc", "static_real_1"], static_categoricals={"frequency": 8, "static_cat_1": 16},
        observed_reals=["target", "target_observed", "observed_1"], known_reals=["relative_time", *CALENDAR_FEATURES, "known_1", "price"],
    )
    binding = bind_columns(cfg, known=["promo", "price"], observed=["visits"], static_real=["size"], static_cat=["area"])
    assert binding.known == {"price": "price", "known_1": "promo"}
    r1, r2 = generate(1, 40, frequency="daily", covariates=False), generate(2, 25, frequency="monthly", covariates=False)
    for r in (r1, r2):
        r.known = {"promo": np.arange(r.length + 5, dtype=float), "price": np.ones(r.length + 5)}
        r.observed = {"visits": np.arange(r.length, dtype=float)}
        r.static_reals, r.static_cats = {"size": 340.0}, {"area": "urban"}
    batch = make_batch([r1, r2], cfg, binding, context=30, horizon=5)
    assert batch.observed_reals.shape == (2, 30, 3) and batch.known_reals.shape == (2, 35, 9)
    assert list(batch.encoder_lengths) == [30, 25]
    loc, scale = series_scale(r1.target[-30:])
    assert np.allclose(batch.observed_reals[0, :, 0], (r1.target[-30:] - loc) / scale, atol=1e-5)
    assert np.allclose(batch.known_reals[1, :25, 0], np.arange(-25, 0) / 100.0)
    assert np.allclose(batch.known_reals[1, 30:, 0], np.arange(5) / 100.0)  # horizon rows after the padding
    assert batch.static_categoricals[0, 0] == 3 and batch.static_categoricals[1, 0] == 5  # daily, monthly
    assert batch.static_categoricals[0, 1] == hash_bucket("urban", 16) != 0
    assert np.isclose(batch.static_reals[0, 1], np.log1p(340.0))
    from gencli.errors import UserError

    with pytest.raises(UserError, match="at most 2 known"):
        bind_columns(cfg, known=["a", "b", "c"])


def test_impute_linear():
    v, m = impute_linear(np.array([np.nan, 1.0, np.nan, 3.0, np.nan]))
    assert np.allclose(v, [1, 1, 2, 3, 3]) and list(m) == [False, True, False, True, False]


def test_interpolate_quantiles_exact_on_grid_and_monotone():
    grid = [0.1, 0.5, 0.9]
    vals = np.array([[1.0, 2.0, 4.0]])
    out = interpolate_quantiles(vals, grid, [0.05, 0.1, 0.3, 0.5, 0.75, 0.9, 0.99])
    assert np.allclose(out[0, [1, 3, 5]], [1.0, 2.0, 4.0])
    assert (np.diff(out[0]) > 0).all()
    assert out[0, 0] < 1.0 and out[0, -1] > 4.0  # extrapolated beyond the grid


def test_metrics():
    y = np.array([230.0, 260.0, 210.0])
    pred = np.tile([220.0, 240.0, 250.0], (3, 1))
    # sums of the worked example: 8 + 23 + 28 = 59 pinball; wQL = mean_q 2 sum_q / sum|y|
    assert np.isclose(weighted_quantile_loss(y, pred, [0.1, 0.5, 0.9]), 2 * 59 / 3 / 700)
    hist = np.array([1.0, 2, 3, 1, 2, 3, 1, 2, 3])
    assert np.allclose(seasonal_naive(hist, 3, 5), [1, 2, 3, 1, 2])
    band = seasonal_naive(hist + np.arange(9) * 0.1, 3, 4, [0.1, 0.5, 0.9])
    assert (band[:, 0] < band[:, 1]).all() and (band[3, 2] - band[3, 0]) > (band[0, 2] - band[0, 0])
    assert mase(np.array([1.0, 2.0]), np.array([1.0, 2.0]), hist, 3) == 0.0
    assert np.isclose(mase(np.array([2.0]), np.array([1.0]), np.array([0.0, 1, 2, 3]), 1), 1.0)
    assert np.isclose(geometric_mean([0.5, 2.0]), 1.0)
    f = Frequency("monthly", anchor="start")
    assert f.default_horizon() == 18 and f.label == "M"


def test_seasonal_lag_is_seasonal_naive_over_the_horizon():
    from gencli.pipelines.forecast.features import seasonal_lag_index

    idx = seasonal_lag_index(0, 10, 5, 4)
    assert list(idx[:10]) == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]  # one season back (itself before the first season)
    assert list(idx[10:]) == [6, 7, 8, 9, 6]  # the last observed value of the same phase
    assert list(seasonal_lag_index(5, 10, 3, 1)[-3:]) == [9, 9, 9]  # no season: the last value
    assert list(seasonal_lag_index(0, 3, 2, 12)[-2:]) == [2, 2]  # less than a season of history
    hist = np.arange(10.0)
    assert np.allclose(hist[idx[10:]], seasonal_naive(hist, 4, 5))


def test_last_value_anchor_scaling_and_differences():
    cfg = TFTConfig(
        hidden_size=8, variable_size=4, num_attention_heads=2, quantiles=[0.1, 0.5, 0.9],
        observed_reals=["target", "target_diff"], known_reals=["relative_time"], extra={"scaling": "last"},
    )
    rec = generate(5, 50, frequency="monthly", covariates=False, missing=False)
    batch = make_batch([rec], cfg, bind_columns(cfg), context=40, horizon=3)
    _, scale = series_scale(rec.target[-40:])
    assert np.isclose(batch.loc[0], rec.target[-1]) and np.isclose(batch.scale[0], scale)
    assert batch.observed_reals[0, -1, 0] == 0.0  # "no change" is exactly 0
    d = np.diff(rec.target[-40:], prepend=rec.target[-40])
    assert np.allclose(batch.observed_reals[0, :, 1], np.clip(d / d.std(), -10, 10), atol=1e-4)
