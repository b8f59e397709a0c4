"""Rolling-origin evaluation of a forecaster on real series, side by side with baselines.

For every series and every origin of the last ``windows`` non-overlapping windows of ``horizon``
steps, three forecasters predict the window from the history before it:

- the TFT (through the same record building and batching as ``gencli forecast``);
- seasonal naive (the last season repeated; the denominator of the relative scores, used as a point
  forecast at every quantile level, as in the zero-shot forecasting papers);
- statsmodels' damped Holt-Winters (``ETSModel``, additive error, additive damped trend, additive
  season when the series is long enough), with its analytic Gaussian prediction intervals;
- with ``with_auto=True``, statsforecast's AutoETS, AutoARIMA and AutoTheta (their own model
  selection and prediction intervals; AutoETS and AutoARIMA non-seasonal for seasons over 24) and the
  mean of their quantiles (an evaluation dependency only).

Baseline forecasts do not depend on the forecaster under test: ``cache`` (a dict, e.g. loaded from and
saved to a JSON file by the caller) keeps them between runs.

Per series: weighted quantile loss (levels 0.1..0.9) and MASE (median vs. the in-sample
seasonal-naive error), pooled over the windows; relative scores are divided by seasonal naive's and
summarised by the geometric mean over series.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import numpy as np

from gencli.pipelines.forecast.metrics import Score, geometric_mean, mase, quantile_loss_sum, seasonal_naive, z_scores

LEVELS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


def ets_quantiles(history: np.ndarray, season: int, horizon: int, levels: Sequence[float], max_history: int = 600) -> np.ndarray:
    """Damped Holt-Winters (additive ETS) quantile forecasts ``(horizon, Q)``; falls back to a
    non-seasonal model, then to the seasonal-naive band, when fitting fails."""
    import pandas as pd
    from statsmodels.tsa.exponential_smoothing.ets import ETSModel

    y = pd.Series(np.asarray(history[-max_history:], dtype=np.float64))
    z = z_scores(levels)
    specs = []
    if season > 1 and len(y) >= 2 * season + 10:
        specs.append({"seasonal": "add", "seasonal_periods": season})
    specs.append({})
    for spec in specs:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = ETSModel(y, error="add", trend="add", damped_trend=True, **spec).fit(disp=False, maxiter=200)
                pred = res.get_prediction(start=len(y), end=len(y) + horizon - 1)
                mean = np.asarray(pred.predicted_mean, dtype=np.float64)
                var = np.asarray(pred.var_pred_mean, dtype=np.float64)
            if np.all(np.isfinite(mean)) and np.all(np.isfinite(var)):
                return mean[:, None] + z[None, :] * np.sqrt(np.maximum(var, 0.0))[:, None]
        except Exception:  # noqa: BLE001 - statsmodels raises many kinds of fit failures
            continue
    return seasonal_naive(np.asarray(history), season, horizon, levels)


AUTO_MODELS = ("autoets", "autoarima", "autotheta")


def auto_quantiles(history: np.ndarray, season: int, horizon: int, levels: Sequence[float], max_history: int = 600) -> dict[str, np.ndarray]:
    """statsforecast's AutoETS, AutoARIMA, AutoTheta quantile forecasts ``(horizon, Q)`` and their mean
    (``stats_mean``); a model that fails to fit falls back to its non-seasonal form, then to the
    seasonal-naive band. Levels symmetric about 0.5 map to statsforecast's central intervals."""
    from statsforecast.models import AutoARIMA, AutoETS, AutoTheta

    y = np.asarray(history[-max_history:], dtype=np.float64)
    def width(q: float):  # statsforecast names its columns after the level as given: lo-80, lo-80.0
        w = round(abs(2 * q - 1) * 100, 6)
        return int(w) if w == int(w) else w

    widths = sorted({width(q) for q in levels if q != 0.5})
    makers = {"autoets": AutoETS, "autoarima": AutoARIMA, "autotheta": AutoTheta}
    out = {}
    for key, make in makers.items():
        q = None
        # AutoARIMA and AutoETS stay non-seasonal for seasons over 24 (weekly data), as R's ets does:
        # a seasonal ARIMA with period 52 takes many minutes per fit
        first = season if season > 1 and (season <= 24 or key == "autotheta") else 1
        for m in ([first, 1] if first > 1 else [1]):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    f = make(season_length=m).forecast(y=y, h=horizon, level=widths)
                cols = []
                for lv in levels:
                    cols.append(f["mean"] if lv == 0.5 else f[f"{'lo' if lv < 0.5 else 'hi'}-{width(lv)}"])
                q = np.stack([np.asarray(c, dtype=np.float64) for c in cols], axis=1)
                if np.all(np.isfinite(q)):
                    break
                q = None
            except Exception:  # noqa: BLE001 - fit failures of any kind fall back
                q = None
        out[key] = q if q is not None else seasonal_naive(np.asarray(history), season, horizon, levels)
    out["stats_mean"] = np.mean([out[k] for k in AUTO_MODELS], axis=0)
    return out


def horizon_for(freq) -> int:
    return freq.default_horizon()


def evaluate(
    fc,
    series: Sequence[tuple[str, str, object]],
    *,
    windows: int = 5,
    levels: Sequence[float] = LEVELS,
    with_ets: bool = True,
    with_auto: bool = False,
    context: Optional[int] = None,
    cache: Optional[dict] = None,
    log=None,
) -> dict:
    """Evaluate ``fc`` (a :class:`~gencli.pipelines.forecast.forecaster.Forecaster`) on ``series``."""
    from gencli.pipelines.forecast.features import Binding
    from gencli.pipelines.forecast.layout import Layout
    from gencli.pipelines.forecast.records import RecordOptions, build_record

    layout = Layout("time", "datetime", None, "value")
    rows = []
    for dataset, name, frame in series:
        rec = build_record(f"{dataset}/{name}", frame, layout, RecordOptions(horizon=0, min_length=1))
        h = horizon_for(rec.freq)
        m = rec.freq.season_length()
        min_hist = max(3 * m if m > 1 else 0, 20)
        n_win = min(windows, (rec.length - min_hist) // h)
        if n_win < 1:
            continue
        origins = [rec.length - (n_win - k) * h for k in range(n_win)]
        res = fc.forecast([rec] * n_win, Binding(), h, levels, context, origins=origins)
        baselines = (["ets"] if with_ets else []) + ([*AUTO_MODELS, "stats_mean"] if with_auto else [])
        scores = {k: Score(len(levels)) for k in ("tft", "naive", "naive_band", *baselines)}
        for o, r in zip(origins, res):
            y = rec.target[o : o + h]
            mask = rec.observed_mask[o : o + h]
            y_obs = np.where(mask, y, np.nan)
            hist = rec.target[:o]
            mm = m if len(hist) >= 2 * m else 1
            point = seasonal_naive(hist, mm, h)
            preds = {
                "tft": r.quantiles,
                "naive": np.repeat(point[:, None], len(levels), axis=1),
                "naive_band": seasonal_naive(hist, mm, h, levels),
            }
            key = f"{dataset}/{name}@{o}+{h}/{mm}"
            cached = (cache or {}).get(key, {})
            if with_ets and "ets" not in cached:
                cached["ets"] = ets_quantiles(hist, mm, h, levels).tolist()
            if with_auto and "stats_mean" not in cached:
                cached.update({k: v.tolist() for k, v in auto_quantiles(hist, mm, h, levels).items()})
            if cache is not None:
                cache[key] = cached
            preds.update({k: np.asarray(cached[k]) for k in baselines})
            for key, q in preds.items():
                num, den = quantile_loss_sum(y, q, levels, mask)
                median = q[:, list(levels).index(0.5)]
                scores[key].add(num, den, mase(y_obs, median, hist, mm))
        row = {"dataset": dataset, "series": name, "frequency": rec.freq.label, "length": rec.length, "horizon": h, "windows": n_win}
        for key, s in scores.items():
            row[f"{key}_wql"] = s.wql
            row[f"{key}_mase"] = s.mase
        rows.append(row)
        if log:
            log(
                f"{dataset}/{name}: rel wQL {row['tft_wql'] / row['naive_wql']:.3f}"
                + (f" (ETS {row['ets_wql'] / row['naive_wql']:.3f})" if with_ets else "")
                + f", rel MASE {row['tft_mase'] / row['naive_mase']:.3f}"
                + (f" (ETS {row['ets_mase'] / row['naive_mase']:.3f})" if with_ets else "")
            )
    return {"levels": list(levels), "series": rows, "summary": summarise(rows)}


def summarise(rows: list[dict]) -> dict:
    """Geometric means over ``rows`` of every forecaster's scores relative to seasonal naive (and the
    TFT's relative to ETS when ETS was run)."""
    out = {"series": len(rows)}
    if not rows:
        return out
    keys = [k[: -len("_wql")] for k in rows[0] if k.endswith("_wql") and k != "naive_wql"]
    with_ets = "ets" in keys
    for key in keys:
        out[f"{key}_relative_wql"] = geometric_mean([r[f"{key}_wql"] / r["naive_wql"] for r in rows if r["naive_wql"] > 0])
        out[f"{key}_relative_mase"] = geometric_mean([r[f"{key}_mase"] / r["naive_mase"] for r in rows if r["naive_mase"] > 0])
    if with_ets:
        out["tft_vs_ets_wql"] = geometric_mean([r["tft_wql"] / r["ets_wql"] for r in rows if r["ets_wql"] > 0])
        out["tft_vs_ets_mase"] = geometric_mean([r["tft_mase"] / r["ets_mase"] for r in rows if r["ets_mase"] > 0])
    return out
