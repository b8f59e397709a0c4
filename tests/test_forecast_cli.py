"""`gencli forecast` end to end, with a small randomly initialised TFT in the default model's input layout
(the behaviour of the command does not depend on the weights; quality is tested separately)."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import one_error_line
from typer.testing import CliRunner

from gencli.cli import app

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The model's matrices are small: one thread is as fast, and immune to a busy machine (torch's
    OpenMP threads spin-wait badly when the cores are oversubscribed). Restored afterwards."""
    import os

    import torch

    before, env = torch.get_num_threads(), os.environ.get("GENCLI_THREADS")
    os.environ["GENCLI_THREADS"] = "1"
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("GENCLI_THREADS", None)
    else:
        os.environ["GENCLI_THREADS"] = env


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    import torch
    from train_forecast import default_config, export

    from gencli.models.tft import TemporalFusionTransformer

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tft") / "tiny"
    export(TemporalFusionTransformer(default_config(hidden=16, variable_size=8, heads=2, dropout=0.0)).eval(), out, {"note": "random test model"})
    return str(out)


def run(*args, input=None):
    return CliRunner().invoke(app, ["forecast", *map(str, args)], input=input)


def store_table(n_hist=60, horizon=3, stores=("north", "south", "east"), seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    dates = pd.date_range("2023-01-02", periods=n_hist + horizon, freq="D")
    for k, s in enumerate(stores):
        promo = (rng.random(n_hist + horizon) < 0.2).astype(int)
        for i, d in enumerate(dates):
            sales = 100 + 10 * k + 15 * np.sin(2 * np.pi * i / 7) + 20 * promo[i] + rng.normal(0, 3)
            rows.append(
                {
                    "store": s,
                    "date": d.strftime("%Y-%m-%d"),
                    "sales": round(sales, 2) if i < n_hist else None,
                    "promo": promo[i],
                    "visits": round(sales * 3 + rng.normal(0, 5), 1) if i < n_hist else None,
                    "size": 300 + 20 * k,
                    "area": "urban" if k % 2 == 0 else "rural",
                }
            )
    return pd.DataFrame(rows)


def test_long_table_with_covariates_inferred(tmp_path, model_dir):
    path = tmp_path / "stores.csv"
    store_table().to_csv(path, index=False)
    r = run(path, "-m", model_dir, "--verbose")
    assert r.exit_code == 0, r.stderr
    out = pd.read_csv(pd.io.common.StringIO(r.stdout))
    assert list(out.columns) == ["id", "time", "q0.1", "q0.5", "q0.9"]
    assert list(out["id"].unique()) == ["north", "south", "east"] and len(out) == 9
    assert list(out["time"][:3]) == ["2023-03-03", "2023-03-04", "2023-03-05"]
    assert (out["q0.1"] <= out["q0.5"]).all() and (out["q0.5"] <= out["q0.9"]).all()
    for note in (
        "series id column 'store'",
        "'promo' used as a known",
        "'visits' used as a past-only",
        "'size' used as a static",
        "'area' used as a static",
        "horizon 3",
    ):
        assert note in r.stderr, r.stderr


def test_wide_table_from_stdin_and_quantile_interpolation(model_dir):
    t = pd.date_range("2020-01-01", periods=40, freq="MS")
    df = pd.DataFrame({"month": t.strftime("%Y-%m"), "a": np.arange(40.0), "b": np.sin(np.arange(40)) + 5})
    r = run("-", "-m", model_dir, "--horizon", "4", "--quantiles", "0.05,0.5,0.95,0.3", "--json", input=df.to_csv(index=False))
    assert r.exit_code == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["id"] for x in lines[:2]] == ["a", "b"] and "summary" in lines[2]
    rec = lines[0]
    assert rec["frequency"] == "M" and rec["time"][0] == "2023-05-01" and len(rec["time"]) == 4
    assert list(rec["quantiles"]) == ["0.05", "0.3", "0.5", "0.95"]
    q = np.array([rec["quantiles"][k] for k in rec["quantiles"]])
    assert (np.diff(q, axis=0) >= 0).all()
    assert rec["quantiles"]["0.5"] == rec["median"]


def test_single_column_without_time_and_output_file(tmp_path, model_dir):
    path = tmp_path / "y.csv"
    pd.DataFrame({"demand": np.abs(np.sin(np.arange(30))) * 10}).to_csv(path, index=False)
    out = tmp_path / "fc.csv"
    r = run(path, "-m", model_dir, "-H", "5", "--out", out)
    assert r.exit_code == 0, r.stderr
    df = pd.read_csv(out)
    assert list(df["time"]) == [30, 31, 32, 33, 34] and (df["id"] == "demand").all()
    assert (df["q0.1"] >= 0).all()  # never-negative history: forecasts clipped at 0
    one_error_line(run(path, "-m", model_dir, "-H", "5", "--out", out), "already exists", "--force")
    assert run(path, "-m", model_dir, "-H", "5", "--out", out, "--force").exit_code == 0


def _write(tmp_path, text, name="d.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def _series(n=20, start="2021-01-01", freq="D"):
    return "\n".join(f"{d.date()},{i % 5 + 1}" for i, d in enumerate(pd.date_range(start, periods=n, freq=freq)))


@pytest.mark.parametrize(
    "content,args,needles",
    [
        ("", [], ["is empty"]),
        ("date,name\n2021-01-01,a\n2021-01-02,b\n", [], ["no numeric column"]),
        ("date,y\n" + _series(), ["--target-col", "sales"], ["unknown column 'sales'", "date, y"]),
        ("date,y\n" + _series(), ["--horizon", "0"], ["--horizon"]),
        ("date,y\n" + _series(), ["--quantiles", "0.1,1.5"], ["--quantiles", "1.5"]),
        ("date,y\n" + _series(), ["--quantiles", "0,0.5"], ["--quantiles"]),
        ("date,y\n2021-01-01,1\n2021-01-03,2\n2021-01-02,3\n" + _series(10, "2021-01-04"), [], ["not in increasing order"]),
        ("date,y\n2021-01-01,1\n2021-01-01,2\n" + _series(10, "2021-01-02"), [], ["duplicate timestamp 2021-01-01"]),
        ("date,y\n2021-01-01,1\n2021-01-02,2\n2021-01-03 12:00,3\n2021-01-05,4\n" + _series(10, "2021-01-06"), [], ["irregular"]),
        ("date,y\n" + _series(5), [], ["too short"]),
        (
            "date,y,promo\n"
            + "\n".join(f"{d.date()},{'' if i >= 20 else i},{'' if i == 22 else 1}" for i, d in enumerate(pd.date_range("2021-01-01", periods=23))),
            ["--known-cols", "promo", "-H", "3"],
            ["known covariate 'promo' is missing at 2021-01-23"],
        ),
        ("date,y,promo\n" + _series(), ["--known-cols", "promo", "-H", "3"], ["need the future"]),
        (
            "store,date,a,b\n" + "\n".join(f"s{i % 2},{d.date()},{i},{i * 2}" for i, d in enumerate(pd.date_range("2021-01-01", periods=20))),
            [],
            ["target", "a, b", "--target-col"],
        ),
        ("date,time,y\n2021-01-01,2021-01-01,1\n", [], ["--time-col"]),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, model_dir, content, args, needles):
    one_error_line(run(_write(tmp_path, content), "-m", model_dir, *args), *needles)


def test_dates_are_read_in_one_format_for_the_whole_column(tmp_path, model_dir):
    days = pd.date_range("2024-01-01", periods=40, freq="D")
    dmy = _write(tmp_path, "date,y\n" + "\n".join(f"{d:%d/%m/%Y},{i % 5 + 1}" for i, d in enumerate(days)))
    r = run(dmy, "-m", model_dir, "-H", "2")
    assert r.exit_code == 0, r.stderr
    assert [line.split(",")[1] for line in r.stdout.splitlines()[1:]] == ["2024-02-10", "2024-02-11"]
    # the first of each month: 01/02/2024 reads as 1 February or 2 January
    monthly = tmp_path / "monthly.csv"
    monthly.write_text("date,y\n" + "\n".join(f"01/{m:02d}/2023,{m}" for m in range(1, 13)) + "\n")
    one_error_line(run(monthly, "-m", model_dir, "-H", "2"), "read two ways", "--time-format '%m/%d/%Y' or '%d/%m/%Y'", "--dayfirst")
    r = run(monthly, "-m", model_dir, "-H", "2", "--dayfirst")
    assert r.exit_code == 0 and [line.split(",")[1] for line in r.stdout.splitlines()[1:]] == ["2024-01-01", "2024-02-01"], r.stderr
    r = run(monthly, "-m", model_dir, "-H", "1", "--time-format", "%d/%m/%Y")
    assert r.exit_code == 0 and r.stdout.splitlines()[1].split(",")[1] == "2024-01-01", r.stderr
    mixed = tmp_path / "mixed.csv"
    mixed.write_text("date,y\n" + "\n".join(f"{d:%d/%m/%Y},1" for d in days[12:30]) + "\n02/14/2024,1\n")
    one_error_line(run(mixed, "-m", model_dir), "mixes date formats", "--time-format")
    one_error_line(run(monthly, "-m", model_dir, "--time-format", "%Y-%m-%d"), "--time-format '%Y-%m-%d' does not read the time column 'date'")


def test_time_zone_offsets_are_kept(tmp_path, model_dir):
    hours = pd.date_range("2024-03-01", periods=40, freq="h")
    p = _write(tmp_path, "time,y\n" + "\n".join(f"{d} +01:00,{i % 4}".replace(" +", "+") for i, d in enumerate(hours)))
    r = run(p, "-m", model_dir, "-H", "2")
    assert r.exit_code == 0, r.stderr
    assert [line.split(",")[1] for line in r.stdout.splitlines()[1:]] == ["2024-03-02 16:00:00+01:00", "2024-03-02 17:00:00+01:00"]


def test_values_near_1e300_or_1e_12_forecast_in_their_scale(tmp_path, model_dir):
    def forecast(factor):
        p = _write(tmp_path, "step,y\n" + "".join(f"{i},{(10 + i % 7) * factor!r}\n" for i in range(48)))
        r = run(p, "-m", model_dir, "-H", "3")
        assert r.exit_code == 0 and "Warning" not in r.stderr, r.stderr
        return np.array([[float(v) for v in line.split(",")[2:]] for line in r.stdout.splitlines()[1:]])

    unit = forecast(1.0)
    assert np.isfinite(unit).all()
    for factor in (1e300, 1e-12):
        assert np.allclose(forecast(factor) / factor, unit, rtol=1e-5), factor
    p = _write(tmp_path, "step,y\n" + "".join(f"{i},{(10 + i % 7) * 1e305!r}\n" for i in range(48)))
    one_error_line(run(p, "-m", model_dir), "too close to the largest 64-bit float", "divide the column")


def test_missing_file_and_model_errors(tmp_path, model_dir):
    one_error_line(run(tmp_path / "nope.csv", "-m", model_dir), "does not exist")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (other / "model.safetensors").write_bytes((Path(model_dir) / "model.safetensors").read_bytes())
    data = _write(tmp_path, "date,y\n" + _series(30))
    one_error_line(run(data, "-m", other), "holds a LlamaForCausalLM (a text-generation model), not a forecasting model: run it with gencli generate")
    pq = _write(tmp_path, "x", "d.parquet")
    if importlib.util.find_spec("pyarrow") is None:
        one_error_line(run(pq, "-m", model_dir), "Parquet", "pyarrow")


def test_a_bad_series_never_sinks_the_good_ones(tmp_path, model_dir):
    df = store_table(stores=("a", "b", "c"))
    bad = df.index[(df["store"] == "b")][5]
    df.loc[bad, "date"] = df.loc[bad - 1, "date"]  # duplicate timestamp in series b
    path = tmp_path / "s.csv"
    df.to_csv(path, index=False)
    r = run(path, "-m", model_dir)
    assert r.exit_code == 0, r.stderr
    assert list(pd.read_csv(pd.io.common.StringIO(r.stdout))["id"].unique()) == ["a", "c"]
    assert "skipped series 'b': duplicate timestamp" in r.stderr
    rj = run(path, "-m", model_dir, "--json")
    recs = [json.loads(x) for x in rj.stdout.splitlines()]
    assert {"id": "b", "error": "series 'b': duplicate timestamp 2023-01-06"} in recs
    assert recs[-1]["summary"]["failed"] == 1
    one_error_line(run(path, "-m", model_dir, "--strict", "-q"), "--strict")


def test_missing_values_are_imputed_and_counted(tmp_path, model_dir):
    dates = pd.date_range("2022-01-01", periods=40, freq="W-SUN")
    y = np.arange(40.0) + 10
    df = pd.DataFrame({"week": dates.strftime("%Y-%m-%d"), "y": y})
    df.loc[[5, 6], "y"] = np.nan
    df = df.drop(index=[20])  # a missing week: a gap in the grid
    path = tmp_path / "w.csv"
    df.to_csv(path, index=False)
    r = run(path, "-m", model_dir, "--json", "-H", "2")
    assert r.exit_code == 0, r.stderr
    rec = json.loads(r.stdout.splitlines()[0])
    assert rec["imputed"] == 3 and rec["history_length"] == 40 and rec["frequency"] == "W"
    assert "note: 3 missing history values imputed (3 in series 'y')" in r.stderr
    assert "missing" not in run(path, "-m", model_dir, "-H", "2", "-q").stderr


def test_explain_outputs(tmp_path, model_dir):
    path = tmp_path / "stores.csv"
    store_table().to_csv(path, index=False)
    ex_csv, ex_json = tmp_path / "ex.csv", tmp_path / "ex.jsonl"
    r = run(path, "-m", model_dir, "--explain", "--explain-out", ex_csv, "-q")
    assert r.exit_code == 0 and r.stderr == ""  # --quiet silences the printed explanation
    r = run(path, "-m", model_dir, "--explain", "--explain-out", ex_json)
    assert r.exit_code == 0
    assert "series 'north':" in r.stderr and "history inputs:" in r.stderr and "attention:" in r.stderr
    ex = pd.read_csv(ex_csv)
    assert set(ex["kind"]) == {"static", "past", "future", "attention", "ensemble"}
    north = ex[ex["id"] == "north"]
    assert set(north[north["kind"] == "ensemble"]["name"]) == {"network", "damped trend", "theta", "holt-winters", "arima", "seasonal arima"}
    assert "ensemble weights:" in r.stderr
    for kind in ("static", "past", "future", "attention", "ensemble"):
        assert np.isclose(north[north["kind"] == kind]["weight"].sum(), 1.0, atol=1e-3), kind
    assert {"promo", "target history", "visits", "day of week"} <= set(north[north["kind"] == "past"]["name"])
    assert {"size", "area", "frequency"} <= set(north[north["kind"] == "static"]["name"])
    js = [json.loads(x) for x in ex_json.read_text().splitlines()]
    assert [j["id"] for j in js] == ["north", "south", "east"] and len(js[0]["attention_by_lag"]) == 60
    r = run(path, "-m", model_dir, "--model-only", "--explain-out", ex_csv, "-f", "-q")
    assert r.exit_code == 0 and "ensemble" not in set(pd.read_csv(ex_csv)["kind"])


def test_model_only_is_the_network_alone(tmp_path, model_dir):
    """The default combines the network with the statistical members; --model-only is the network's
    own forecast, as the Forecaster without the ensemble gives it."""
    from gencli.pipelines.forecast.features import Binding
    from gencli.pipelines.forecast.forecaster import Forecaster
    from gencli.pipelines.forecast.layout import Layout
    from gencli.pipelines.forecast.records import RecordOptions, build_record

    path = tmp_path / "stores.csv"
    store_table(stores=("north",)).to_csv(path, index=False)
    default = pd.read_csv(io.StringIO(run(path, "-m", model_dir, "-q", "--known-cols", "promo").stdout))
    alone = pd.read_csv(io.StringIO(run(path, "-m", model_dir, "-q", "--known-cols", "promo", "--model-only").stdout))
    assert default.shape == alone.shape and not np.allclose(default["q0.5"], alone["q0.5"])
    # a clean weekly pattern: the statistical members follow it and the (random) network does not
    t = np.arange(70)
    y = 100 + 15 * np.sin(2 * np.pi * t / 7)
    frame = pd.DataFrame({"time": pd.date_range("2024-01-01", periods=63, freq="D"), "value": y[:63]})
    rec = build_record("s", frame, Layout("time", "datetime", None, "value"), RecordOptions(horizon=0, min_length=1))
    errors = {}
    for ens in (True, False):
        fc = Forecaster(Path(model_dir), device="cpu", ensemble=ens)
        res = fc.forecast([rec], Binding(), 7, [0.1, 0.5, 0.9])[0]
        errors[ens] = np.abs(res.quantiles[:, 1] - y[63:]).mean()
    assert errors[True] < 1.0 < errors[False], errors


def test_plot(tmp_path, model_dir):
    path = tmp_path / "stores.csv"
    store_table().to_csv(path, index=False)
    png = tmp_path / "fan.png"
    r = run(path, "-m", model_dir, "--plot", png, "--plot-max", "2", "-o", tmp_path / "o.csv")
    assert r.exit_code == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one_error_line(run(path, "-m", model_dir, "--plot", tmp_path / "fan.txt"), "--plot")


def test_backtest(tmp_path, model_dir):
    path = tmp_path / "stores.csv"
    store_table().to_csv(path, index=False)
    r = run(path, "-m", model_dir, "--backtest", "3", "-H", "7")
    assert r.exit_code == 0, r.stderr
    assert "backtest: last 3 window(s) of 7 steps, 3 series, 9 windows" in r.stdout
    assert "seasonal naive" in r.stdout and "north" in r.stdout
    rj = run(path, "-m", model_dir, "--backtest", "3", "-H", "7", "--json")
    recs = [json.loads(x) for x in rj.stdout.splitlines()]
    s = recs[-1]["summary"]
    assert s["windows"] == 9 and s["relative_wql"] > 0 and s["mase"] > 0
    assert np.isclose(s["relative_wql"], s["wql"] / s["seasonal_naive_wql"], atol=1e-3)


def test_fit_steps_reports_gain_and_saves(tmp_path, model_dir):
    path = tmp_path / "stores.csv"
    store_table(n_hist=80).to_csv(path, index=False)
    saved = tmp_path / "tuned"
    r = run(path, "-m", model_dir, "--fit-steps", "40", "--fit-lr", "3e-3", "--save-model", saved, "--seed", "1", "-o", tmp_path / "o.csv")
    assert r.exit_code == 0, r.stderr
    assert "fine-tuned 40 steps" in r.stderr and "held-out weighted quantile loss" in r.stderr
    assert "using the fine-tuned model" in r.stderr  # a random model gains from 40 steps on this data
    cfg = json.loads((saved / "config.json").read_text())
    assert cfg["architecture"] == "TemporalFusionTransformer" and "fine_tuned" in cfg["extra"]
    assert run(path, "-m", saved, "-q").exit_code == 0
    rb = run(path, "-m", model_dir, "--fit-steps", "10", "--backtest", "2", "-H", "5", "--json")
    s = json.loads(rb.stdout.splitlines()[-1])["summary"]
    assert "zero_shot" in s and "fine_tune" in s


def test_streaming_large_files_gives_the_same_output(tmp_path, model_dir, monkeypatch):
    import gencli.pipelines.forecast.table as table

    df = store_table(stores=[f"s{i}" for i in range(7)])
    path = tmp_path / "big.csv"
    df.to_csv(path, index=False)
    whole = run(path, "-m", model_dir, "--batch-size", "3")
    monkeypatch.setattr(table, "STREAM_BYTES", 0)
    seen = []
    real = table._stream_groups
    monkeypatch.setattr(table, "_stream_groups", lambda t, layout: (seen.append(1), (yield from real(t, layout))))
    old = table.Table.chunks
    monkeypatch.setattr(table.Table, "chunks", lambda self, usecols=None, chunksize=0: old(self, usecols, 50))
    streamed = run(path, "-m", model_dir, "--batch-size", "3")
    assert streamed.exit_code == 0 and seen and streamed.stdout == whole.stdout
    shuffled = tmp_path / "interleaved.csv"
    df.sort_values(["date", "store"]).to_csv(shuffled, index=False)
    inter = run(shuffled, "-m", model_dir, "--batch-size", "3")
    assert inter.exit_code == 0 and "not contiguous" in inter.stderr
    assert sorted(inter.stdout.splitlines()) == sorted(whole.stdout.splitlines())
