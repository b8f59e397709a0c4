"""`gencli forecast` on tables and flags a demanding user gives it: timestamps across a
daylight-saving change, series ids that only look like numbers, rows without an id, dates written as
numbers (20240131), quantile levels that print alike or lie far beyond the model's grid, a learning
rate past float32, and ``-o`` names that say another format. Bad input is one error line and exit
code 2 with nothing written; a result is right, never silently wrong."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from conftest import one_error_line
from typer.testing import CliRunner

from gencli.cli import app

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def invoke(*args: object, input: str | None = None):
    return CliRunner().invoke(app, ["forecast", *map(str, args), "--threads", "1"], input=input)


def ok(result):
    assert result.exit_code == 0, (result.exit_code, result.stderr)
    return result


def rows(result) -> pd.DataFrame:
    from io import StringIO

    return pd.read_csv(StringIO(ok(result).stdout), dtype={"id": str, "time": str})


def js(result) -> list[dict]:
    return [json.loads(line) for line in ok(result).stdout.splitlines() if line.strip()]


def daily(n: int = 40, start: str = "2024-01-01", seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    y = 50 + 10 * np.sin(np.arange(n) * 2 * np.pi / 7) + rng.normal(0, 2, n)
    return pd.DataFrame({"date": pd.date_range(start, periods=n, freq="D").strftime("%Y-%m-%d"), "y": y.round(2)})


@pytest.fixture
def single(tmp_path):
    path = tmp_path / "single.csv"
    daily().to_csv(path, index=False)
    return path


# -- timestamps and ids read as written ------------------------------------------------------------------
def test_a_daylight_saving_change_among_the_first_rows_is_read_in_utc(tmp_path):
    # was an internal error (pandas: "Mixed timezones detected") while looking for the time column
    t = pd.date_range("2024-03-29", periods=72, freq="h", tz="Europe/Berlin")
    path = tmp_path / "dst.csv"
    pd.DataFrame({"time": t.astype(str), "y": np.arange(72) % 24 + 10.0}).to_csv(path, index=False)
    out = rows(invoke(path, "-H", 3))
    last_utc = t[-1].tz_convert("UTC")
    expected = [str(last_utc + pd.Timedelta(hours=h)) for h in (1, 2, 3)]
    assert list(out["time"]) == expected


def test_series_ids_that_look_like_numbers_stay_as_written(tmp_path):
    # '007' and '7' were read as the number 7 (one series of duplicate timestamps), '08' came out as '8'
    path = tmp_path / "ids.csv"
    frames = [daily(30, seed=i).assign(id=sid) for i, sid in enumerate(["007", "7", "08"])]
    pd.concat(frames)[["id", "date", "y"]].to_csv(path, index=False)
    for result in (invoke(path, "-H", 2), invoke("-", "-H", 2, input=path.read_text())):
        out = rows(result)
        assert list(dict.fromkeys(out["id"])) == ["007", "7", "08"], result.stderr
        assert "skipped" not in result.stderr


def test_rows_without_a_series_id_are_skipped_with_a_warning(tmp_path):
    # was an internal error: ValueError: cannot convert float NaN to integer
    path = tmp_path / "noid.csv"
    a = daily(30).assign(id="a")
    b = daily(30, seed=1).assign(id=np.nan)
    pd.concat([a, b])[["id", "date", "y"]].to_csv(path, index=False)
    result = invoke(path, "-H", 2)
    out = rows(result)
    assert set(out["id"]) == {"a"}
    assert "30 rows with no series id in column 'id'" in result.stderr


def test_dates_written_as_numbers_forecast_real_dates(tmp_path):
    # 20240101 ... 20240130 were a numeric step index: the forecast continued at 20240131, 20240132
    path = tmp_path / "ymd.csv"
    dates = pd.date_range("2024-01-01", periods=30, freq="D")
    pd.DataFrame({"date": dates.strftime("%Y%m%d").astype(int), "y": np.arange(30.0) + 1}).to_csv(path, index=False)
    assert list(rows(invoke(path, "-H", 2))["time"]) == ["2024-01-31", "2024-02-01"]
    # and --time-format says so where the column's name does not (was: "--time-format reads dates, but ... holds none")
    other = tmp_path / "stamp.csv"
    pd.read_csv(path).rename(columns={"date": "stamp"}).to_csv(other, index=False)
    assert list(rows(invoke(other, "-H", 2, "--time-col", "stamp", "--time-format", "%Y%m%d"))["time"]) == ["2024-01-31", "2024-02-01"]


def test_a_step_index_that_is_not_a_date_stays_numeric(tmp_path):
    path = tmp_path / "steps.csv"
    pd.DataFrame({"date": 20240101 + np.arange(40), "y": np.arange(40.0)}).to_csv(path, index=False)
    assert list(rows(invoke(path, "-H", 2))["time"]) == ["20240141", "20240142"]


# -- quantile levels ---------------------------------------------------------------------------------------------
def test_two_close_quantile_levels_keep_their_own_columns_and_keys(single):
    # both were labelled 0.1: CSV had two q0.1 columns, JSON kept one of the two levels
    levels = "0.1,0.10000000001,0.1234567"
    header = ok(invoke(single, "-H", 2, "--quantiles", levels)).stdout.splitlines()[0]
    assert header.split(",") == ["id", "time", "q0.1", "q0.10000000001", "q0.1234567"]
    first = js(invoke(single, "-H", 2, "--quantiles", levels, "--json"))[0]
    assert list(first["quantiles"]) == ["0.1", "0.10000000001", "0.1234567"]


def test_levels_far_below_the_grid_stay_at_or_above_zero_for_a_nonnegative_series(tmp_path):
    # the clip at 0 for never-negative series came before the extrapolation beyond the grid's 0.01
    path = tmp_path / "counts.csv"
    rng = np.random.default_rng(1)
    pd.DataFrame({"date": pd.date_range("2024-01-01", periods=60), "y": rng.poisson(2, 60)}).to_csv(path, index=False)
    clipped = rows(invoke(path, "-H", 3, "--quantiles", "1e-6,0.5"))
    free = rows(invoke(path, "-H", 3, "--quantiles", "1e-6,0.5", "--allow-negative"))
    assert (free["q1e-06"] < 0).any()  # the extrapolation does go below zero
    assert (clipped["q1e-06"] >= 0).all() and (clipped["q1e-06"] <= clipped["q0.5"]).all()


# -- options checked before anything is read or written ------------------------------------------------------------
def test_a_learning_rate_past_float32_is_one_error_line(single):
    # was an internal error: RuntimeError: value cannot be converted to type float without overflow
    one_error_line(invoke(single, "-H", 2, "--fit-steps", 2, "--fit-lr", "1e38"), "--fit-lr", "1e+38")


@pytest.mark.parametrize(
    ("name", "extra", "needle"),
    [
        ("fc.parquet", [], "Parquet"),
        ("fc.json", [], "--json"),
        ("fc.csv", ["--json"], "--json"),
        ("fc.tsv", [], "TSV"),
        ("bt.csv", ["--backtest", "1"], "--csv"),
    ],
)
def test_an_out_name_that_says_another_format_is_refused(single, tmp_path, name, extra, needle):
    # CSV rows were written into fc.parquet / fc.json, JSON lines into fc.csv, a text table into bt.csv
    out = tmp_path / name
    one_error_line(invoke(single, "-H", 2, "-o", out, *extra), "-o/--out", needle)
    assert not out.exists()


@pytest.mark.parametrize(("name", "extra"), [("fc.jsonl", ["--json"]), ("bt.csv", ["--backtest", "1", "--csv"]), ("fc.txt", [])])
def test_an_out_name_that_fits_is_written(single, tmp_path, name, extra):
    out = tmp_path / name
    ok(invoke(single, "-H", 2, "-o", out, *extra))
    assert out.stat().st_size > 0


def test_a_target_named_column_with_a_word_in_it_names_the_word(tmp_path):
    # was "no numeric column to forecast (columns: date, y)", though 'y' is plainly the target
    path = tmp_path / "typo.csv"
    d = daily(30)
    d["y"] = d["y"].astype(str)
    d.loc[3, "y"] = "n/a?"
    d.to_csv(path, index=False)
    one_error_line(invoke(path, "-H", 2), "target column 'y'", "'n/a?'")
