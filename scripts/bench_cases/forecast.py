"""TFT forecasting throughput: 1,000 series of length 500, horizon 24, end to end (CSV in, CSV out).

There is no TFT reference implementation installed (pytorch-forecasting is not available offline), so
the reference side is what a user would otherwise run on the same series: statsmodels' damped
Holt-Winters ETS (fitted per series; timed on the first --ets-series series) and seasonal naive.
The gencli side times the whole command (read, validate, batch, forecast, write) and the model alone.
"""

from __future__ import annotations

import time

import numpy as np

DESCRIPTION = "forecast 1,000 series x 500 steps, horizon 24 (gencli TFT vs statsmodels ETS / seasonal naive; no TFT reference installed)"
METRICS = {"series_per_s": "higher"}


def add_arguments(p):
    p.add_argument("--series", type=int, default=1000)
    p.add_argument("--length", type=int, default=500)
    p.add_argument("--horizon", type=int, default=24)
    p.add_argument("--ets-series", type=int, default=30, help="series the ETS baseline is timed on")
    p.add_argument("--model", default=None, help="TFT model folder (default: the embedded default)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--model-only", action="store_true", help="time `gencli forecast --model-only` (the network without the ensemble)")


def setup(args, workdir):
    import pandas as pd

    from gencli.data.series import generate

    frames = []
    for i in range(args.series):
        rec = generate([424242, i], args.length, frequency="hourly", covariates=False, missing=False)
        frames.append(pd.DataFrame({"id": f"s{i}", "time": rec.timestamps, "value": np.round(rec.target, 4)}))
    pd.concat(frames).to_csv(workdir / "series.csv", index=False)


def run(side, args, workdir):
    import pandas as pd

    path = workdir / "series.csv"
    if side == "reference":
        from gencli.pipelines.forecast.evaluate import LEVELS, ets_quantiles
        from gencli.pipelines.forecast.metrics import seasonal_naive

        df = pd.read_csv(path)
        groups = [g["value"].to_numpy() for _, g in df.groupby("id", sort=False)]
        t0 = time.perf_counter()
        for y in groups:
            seasonal_naive(y, 24, args.horizon, LEVELS)
        naive_rate = len(groups) / (time.perf_counter() - t0)
        n = min(args.ets_series, len(groups))
        t0 = time.perf_counter()
        for y in groups[:n]:
            ets_quantiles(y, 24, args.horizon, LEVELS)
        ets_rate = n / (time.perf_counter() - t0)
        return {"series_per_s": round(ets_rate, 2), "seasonal_naive_series_per_s": round(naive_rate, 1), "timed_series": n}

    from gencli.console import Reporter
    from gencli.pipelines.forecast.features import Binding
    from gencli.pipelines.forecast.forecaster import DEFAULT_MODEL, Forecaster
    from gencli.pipelines.forecast.layout import Layout
    from gencli.pipelines.forecast.pipeline import run as run_forecast
    from gencli.pipelines.forecast.records import RecordOptions, build_record
    from gencli.pipelines.forecast.request import ForecastRequest
    from gencli.weights import resolve_model

    model = resolve_model(args.model, DEFAULT_MODEL)
    t0 = time.perf_counter()
    fc = Forecaster(model, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    best = float("inf")
    for k in range(max(1, args.repeat)):
        out = workdir / f"out-{k}.csv"
        t0 = time.perf_counter()
        req = ForecastRequest(
            data=str(path), horizon=args.horizon, out=str(out), batch_size=args.batch_size, force=True, model=str(model), device=args.device, dtype=args.dtype,
            model_only=args.model_only,
        )  # fmt: skip
        run_forecast(req, Reporter(quiet=True))
        best = min(best, time.perf_counter() - t0)
    rows = sum(1 for _ in open(workdir / "out-0.csv")) - 1
    assert rows == args.series * args.horizon, rows
    # the network alone (records already built)
    df = pd.read_csv(path)
    layout = Layout("time", "datetime", "id", "value")
    records = [build_record(str(k), g, layout, RecordOptions(horizon=args.horizon)) for k, g in df.groupby("id", sort=False)]
    t0 = time.perf_counter()
    for s in range(0, len(records), args.batch_size):
        fc.forecast(records[s : s + args.batch_size], Binding(), args.horizon, [0.1, 0.5, 0.9])
    model_s = time.perf_counter() - t0
    return {
        "series_per_s": round(args.series / best, 1),
        "model_series_per_s": round(args.series / model_s, 1),
        "end_to_end_s": round(best, 2),
        "load_s": round(load_s, 3),
        "context": fc.context_length,
    }
