"""The embedded default forecaster: zero-shot quality on real series it never saw (a modest sample of
the evaluation in scripts/eval_forecast.py), and that it is served like any other model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from gencli.cli import app
from gencli.weights import weights_dir

MODEL = weights_dir() / "tft-forecast"

# Floors set from the measurement on this sample: the default (the network combined per series with
# damped-trend ETS, Theta, Holt-Winters, ARIMA and seasonal ARIMA) scores 0.431 (wQL) and 0.518 (MASE) here, the network alone
# (--model-only) 0.689 and 0.853, seasonal naive with a Gaussian band 0.787 and 1.0 (see
# weights/tft-forecast/README.md for the full evaluation); the margin only absorbs numerical
# differences between machines.
MAX_RELATIVE_WQL = 0.445
MAX_RELATIVE_MASE = 0.535
MODEL_ONLY_MAX_RELATIVE_WQL = 0.72
MODEL_ONLY_MAX_RELATIVE_MASE = 0.88


@pytest.fixture(scope="module")
def forecaster():
    import torch

    from gencli.pipelines.forecast.forecaster import Forecaster

    before = torch.get_num_threads()
    yield Forecaster(MODEL, device="cpu", threads=1, ensemble=True)
    torch.set_num_threads(before)


def test_default_model_files():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["architecture"] == "TemporalFusionTransformer"
    assert (MODEL / "model.safetensors").stat().st_size < 5 * 2**20
    readme = (MODEL / "README.md").read_text()
    assert "task: forecast" in readme and "relative" in readme


@pytest.mark.slow
def test_zero_shot_beats_seasonal_naive_on_real_series(forecaster):
    from gencli.data.real_series import iter_series
    from gencli.pipelines.forecast.evaluate import evaluate

    series = list(iter_series(("macrodata", "sunspots", "nile", "danish_data")))
    result = evaluate(forecaster, series, windows=2, with_ets=False)
    s = result["summary"]
    assert s["series"] == 19
    assert s["tft_relative_wql"] <= MAX_RELATIVE_WQL, s
    assert s["tft_relative_mase"] <= MAX_RELATIVE_MASE, s
    # the probabilistic forecast is better than seasonal naive's own Gaussian band
    assert s["tft_relative_wql"] < s["naive_band_relative_wql"], s
    forecaster.ensemble = False  # the network alone (--model-only)
    try:
        alone = evaluate(forecaster, series, windows=2, with_ets=False)["summary"]
    finally:
        forecaster.ensemble = True
    assert alone["tft_relative_wql"] <= MODEL_ONLY_MAX_RELATIVE_WQL, alone
    assert alone["tft_relative_mase"] <= MODEL_ONLY_MAX_RELATIVE_MASE, alone
    assert s["tft_relative_wql"] < alone["tft_relative_wql"] and s["tft_relative_mase"] < alone["tft_relative_mase"]


def test_forecast_with_the_default_model(tmp_path):
    t = np.arange(120)
    y = 50 + 0.3 * t + 10 * np.sin(2 * np.pi * t / 12)
    path = tmp_path / "m.csv"
    path.write_text("month,y\n" + "\n".join(f"{1990 + i // 12}-{i % 12 + 1:02d}-01,{v:.3f}" for i, v in enumerate(y)))
    r = CliRunner().invoke(app, ["forecast", str(path), "--horizon", "12", "--json", "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    rec = json.loads(r.stdout.splitlines()[0])
    median = np.array(rec["median"])
    truth = 50 + 0.3 * np.arange(120, 132) + 10 * np.sin(2 * np.pi * np.arange(120, 132) / 12)
    # a clean trend + season: the zero-shot median follows it closely
    assert np.abs(median - truth).mean() < 3.0, median
    lo, hi = np.array(rec["quantiles"]["0.1"]), np.array(rec["quantiles"]["0.9"])
    assert (lo < median).all() and (median < hi).all()
    listed = CliRunner().invoke(app, ["models", "--json"])
    assert any(json.loads(x)["name"] == "tft-forecast" and "forecast" in json.loads(x)["commands"] for x in listed.stdout.splitlines())
