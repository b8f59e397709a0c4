"""`gencli forecast` options that are wrong, and outputs that could clash: one ``error:`` line, exit 2,
before anything is printed or written; the plot goes through the output layer (a FIFO in place,
``-`` to stdout). In process, on the embedded default model and a one-series table; FIFOs in a
temporary folder, never real /dev nodes."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat
import threading
from pathlib import Path

import pandas as pd
import pytest
from conftest import one_error_line
from PIL import Image
from typer.testing import CliRunner

from gencli.cli import app
from gencli.errors import UserError

MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff", "pdf": b"%PDF"}


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One torch thread: the model is small and the machine is shared."""
    monkeypatch.setenv("GENCLI_THREADS", "1")


def run(*args):
    return CliRunner().invoke(app, ["forecast", *map(str, args)])


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    """A daily series of 40 days in ``tmp_path``, the current folder of the test."""
    monkeypatch.chdir(tmp_path)
    days = pd.date_range("2024-01-01", periods=40, freq="D")
    path = tmp_path / "d.csv"
    path.write_text("date,y\n" + "".join(f"{d:%Y-%m-%d},{10 + i % 7}\n" for i, d in enumerate(days)))
    return path


def refused(result, *needles: str) -> str:
    """One error line naming ``needles``, exit 2, and nothing on stdout (checked before any work)."""
    line = one_error_line(result, *needles)
    assert result.stdout == "", result.stdout
    return line


# -- option values ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["%Q", "%", "%Y-%m-%d%e", "%Y-%W"])
def test_a_time_format_pandas_cannot_use_names_the_option_and_value(data, fmt):
    refused(run(data, "--time-format", fmt), f"--time-format '{fmt}' is not a date format")


def test_an_empty_time_format_is_refused_not_ignored(data):
    refused(run(data, "--time-format", ""), "--time-format is empty")


def test_a_time_format_is_checked_where_the_layout_is_inferred_too():
    from gencli.pipelines.forecast.layout import infer_layout

    frame = pd.DataFrame({"date": ["2024-01-01", "2024-01-02"], "y": [1.0, 2.0]})
    with pytest.raises(UserError, match=r"--time-format '%Q' is not a date format: 'Q' is a bad directive"):
        infer_layout(frame, time_format="%Q")


def test_utc_offsets_first_seen_beyond_the_rows_read_first_are_one_line(data):
    hours = pd.date_range("2024-01-01", periods=2100, freq="h")  # the layout reads the first 2000 distinct values
    data.write_text("time,y\n" + "".join(f"{t:%Y-%m-%d %H:%M:%S}{'+01:00' if i >= 2050 else ''},{i % 24}\n" for i, t in enumerate(hours)))
    refused(run(data, "-H", "2"), "time column 'time' mixes timestamps with and without a UTC offset")


@pytest.mark.parametrize("value", ["0", "-1"])
def test_plot_max_below_one_is_refused_before_the_forecast(data, value):
    refused(run(data, "--plot", "fan.png", "--plot-max", value), "--plot-max", value)
    assert not (data.parent / "fan.png").exists()


def test_plot_max_is_a_number_in_help():
    r = run("--help")
    assert r.exit_code == 0
    line = next(x for x in r.stdout.splitlines() if "--plot-max" in x)
    assert "INT" in line and "PATH" not in line, line


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf", "0"])
def test_fit_lr_must_be_finite_and_above_zero(data, value):
    refused(run(data, "--fit-steps", "2", "--fit-lr", value), "--fit-lr", f"(got {value})")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_min_length_below_one_is_refused_not_taken_as_one(data, value):
    refused(run(data, "--min-length", value), f"--min-length must be at least 1 observed value (got {value})")


def test_the_request_checks_hold_without_the_command_line():
    """The Ray driver and library callers go through check_request, not the option callbacks."""
    from gencli.pipelines.forecast.request import ForecastRequest, check_request

    for req, needle in (
        (ForecastRequest(data="d.csv", plot="fan.png", plot_max=0), "--plot-max"),
        (ForecastRequest(data="d.csv", fit_steps=2, fit_lr=float("nan")), "--fit-lr"),
        (ForecastRequest(data="d.csv", time_format="%Q"), "--time-format '%Q'"),
    ):
        with pytest.raises(UserError, match=needle):
            check_request(req)


# -- --save-model ---------------------------------------------------------------------------------------
@pytest.fixture
def always_kept(monkeypatch):
    """Fine-tuning that takes no time and is always kept, so --save-model writes its folder."""
    import gencli.pipelines.forecast.finetune as finetune

    def fine_tune(fc, records, binding, horizon, steps, **kwargs):
        return finetune.FineTuneReport(steps, 1, len(records), 1.0, 0.5, True, len(records))

    monkeypatch.setattr(finetune, "fine_tune", fine_tune)


def test_save_model_onto_a_file_is_refused_with_or_without_force(data):
    taken = data.parent / "m"
    taken.write_text("mine")
    for force in ([], ["-f"]):
        refused(run(data, "--fit-steps", "2", "--save-model", "m", *force), "--save-model", "'m'", "not a folder")
    assert taken.read_text() == "mine"


def test_save_model_force_replaces_the_folder_it_saved_whole(data, always_kept, monkeypatch):
    folder = data.parent / "tuned"
    r = run(data, "--fit-steps", "2", "--seed", "1", "--save-model", folder, "-q")
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    refused(run(data, "--fit-steps", "2", "--save-model", folder), "--save-model", "already exists", "--force")
    r = run(data, "--fit-steps", "2", "--seed", "2", "--save-model", folder, "-f", "-q")
    assert r.exit_code == 0, r.stderr
    assert "(seed 2)" in json.loads((folder / "config.json").read_text())["extra"]["fine_tuned"]
    assert sorted(p.name for p in data.parent.iterdir()) == ["d.csv", "tuned"]  # no temporary folder left
    # a write that fails half-way leaves the saved folder as it was
    import gencli.pipelines.forecast.finetune as finetune

    def disk_full(model, path, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    monkeypatch.setattr(finetune, "save_model", disk_full)
    one_error_line(run(data, "--fit-steps", "2", "--seed", "3", "--save-model", folder, "-f", "-q"), "cannot write", "No space left")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in data.parent.iterdir()) == ["d.csv", "tuned"]
    (folder / "notes.txt").write_text("mine")
    refused(run(data, "--fit-steps", "2", "--save-model", folder, "-f"), "--save-model", "files gencli did not write", "notes.txt")


# -- outputs that clash -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,needles",
    [
        (["-o", "x.csv", "--explain-out", "x.csv"], ["-o/--out and --explain-out would both be written to 'x.csv'"]),
        (["-o", "x.csv", "--explain-out", "./x.csv"], ["-o/--out and --explain-out would both be written to './x.csv'"]),
        (["-o", "fan.png", "--plot", "fan.png"], ["-o/--out and --plot would both be written to 'fan.png'"]),
        (["--explain-out", "fan.png", "--plot", "fan.png"], ["--explain-out and --plot would both be written to 'fan.png'"]),
        (["-o", "link.csv", "--explain-out", "x.csv"], ["would both be written"]),
        (["-o", "tuned", "--fit-steps", "2", "--save-model", "tuned"], ["-o/--out is the --save-model folder 'tuned'"]),
        (["--plot", "-"], ["--plot and the results would share stdout", "-o FILE"]),
        (["--explain-out", "-"], ["--explain-out and the results would share stdout"]),
        (["-o", "x.csv", "--plot", "-", "--explain-out", "/dev/stdout"], ["--explain-out and --plot would share stdout"]),
        (["-o", "-", "--plot", "/dev/stdout"], ["--plot and the results would share stdout"]),
        (["--plot", "fan"], ["--plot: 'fan' should end in .png"]),
    ],
)
@pytest.mark.parametrize("force", [[], ["-f"]])
def test_two_outputs_in_one_place_are_refused_up_front(data, args, needles, force):
    (data.parent / "link.csv").symlink_to("x.csv")
    refused(run(data, *args, *force), *needles)
    assert sorted(p.name for p in data.parent.iterdir()) == ["d.csv", "link.csv"]


@pytest.mark.parametrize("args", [["--plot", "fan.png"], ["--explain-out", "ex.csv"], ["--fit-steps", "2", "--save-model", "tuned"]])
def test_backtest_refuses_the_outputs_only_a_forecast_writes(data, args):
    refused(run(data, "-H", "3", "--backtest", "2", *args), "--backtest writes a score table", args[-2], "would write nothing")


def test_plot_dash_to_a_terminal_is_refused_before_the_forecast(data, monkeypatch):
    import sys

    from gencli.pipelines.forecast.request import ForecastRequest, check_request

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    with pytest.raises(UserError, match="stdout is a terminal"):
        check_request(ForecastRequest(data=str(data), out="o.csv", plot="-"))


# -- the plot through the output layer ------------------------------------------------------------------
def read_fifo(fifo: Path, got: list) -> threading.Thread:
    """A reader that drains ``fifo`` into ``got`` (started; join it after the run)."""

    def read() -> None:
        with open(fifo, "rb") as fh:
            got.append(fh.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


@pytest.mark.parametrize("name,fmt", [("pipe.png", "png"), ("pipe.jpg", "jpeg"), ("pipe.pdf", "pdf"), ("pipe", "png")])
def test_plot_into_a_fifo_is_written_in_place(data, name, fmt):
    fifo = data.parent / name
    os.mkfifo(fifo)
    got: list = []
    reader = read_fifo(fifo, got)
    r = run(data, "-H", "3", "--plot", fifo, "-o", "fc.csv", "-q")
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))  # a reader no writer came to is released
    reader.join(30)
    assert r.exit_code == 0, r.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced by a regular file"
    assert got and got[0].startswith(MAGIC[fmt]), got[:1]
    if fmt != "pdf":
        assert Image.open(io.BytesIO(got[0])).format == fmt.upper()
    assert (data.parent / "fc.csv").read_text().startswith("id,time,q0.1,q0.5,q0.9\n")


def test_plot_dash_writes_a_png_to_stdout(data):
    r = run(data, "-H", "3", "--plot", "-", "-o", "fc.csv", "-q")
    assert r.exit_code == 0, r.stderr
    image = Image.open(io.BytesIO(r.stdout_bytes))
    assert image.format == "PNG" and image.size[0] > 100
    assert len(pd.read_csv(data.parent / "fc.csv")) == 3
