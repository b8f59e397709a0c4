"""``--ray``: batch inference on Ray Data gives the single-process output, byte for byte.

The identity tests start a real local Ray runtime (``--ray local --replicas 2``; tens of seconds on a
busy machine, hence ``slow``) and skip where Ray is not installed. The bad-input tests start nothing.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT, one_error_line, run_cli, write_scene_folder

ONE_THREAD = {"GENCLI_THREADS": "1", "OMP_NUM_THREADS": "1"}

# one test process runs them all, one after the other: two local Ray runtimes starting side by side
# (pytest -n 2) were measured to wait on each other for minutes
pytestmark = pytest.mark.xdist_group("ray")


def _series_csv(path: Path, n: int = 9) -> Path:
    """``n`` daily series (rows of each id contiguous, ids in no sorted order) and a too-short one in the middle."""
    rng = np.random.default_rng(0)
    frames = []
    for i in range(n):
        t = np.arange(60)
        y = 10 + i + 3 * np.sin(2 * np.pi * t / 7) + rng.normal(0, 0.5, 60)
        frames.append(pd.DataFrame({"id": f"s{(7 * i) % n}", "time": pd.date_range("2024-01-01", periods=60, freq="D"), "value": y.round(3)}))
        if i == n // 2:
            frames.append(pd.DataFrame({"id": "short", "time": pd.date_range("2024-01-01", periods=3, freq="D"), "value": [1.0, 2.0, 3.0]}))
    pd.concat(frames).to_csv(path, index=False)
    return path


def test_without_ray_nothing_imports_ray(tmp_path):
    data = _series_csv(tmp_path / "s.csv")
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from gencli.cli import app\n"
        "r = CliRunner().invoke(app, ['forecast', '--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(app, ['forecast', {str(data)!r}, '--horizon', '3'])\n"
        "assert r.exit_code == 0, r.output\n"
        "assert r.stdout.startswith('id,time,'), r.stdout[:200]\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), **ONE_THREAD}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- bad input: one line, exit 2, nothing started -------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--ray", "--replicas", "0"], ["--replicas must be at least 1"]),
        (["--ray", "--gpus-per-replica", "-1"], ["--gpus-per-replica must be a finite number, 0 or more (got -1)"]),
        (["--ray", "--gpus-per-replica", "nan"], ["--gpus-per-replica must be a finite number, 0 or more (got nan)"]),
        (["--ray", "--gpus-per-replica", "inf"], ["--gpus-per-replica must be a finite number, 0 or more (got inf)"]),
        (["--ray", "--backtest", "2"], ["--ray cannot honour --backtest"]),
        (["--ray", "--fit-steps", "3"], ["--ray cannot honour --fit-steps"]),
        (["--replicas", "2"], ["--replicas needs --ray"]),
        (["--ray", "not an address"], ["is not an address"]),
        (["--ray", "--out-dir", "EXISTING"], ["already exists", "--force"]),
        (["--ray", "--out-dir", "NEW", "--plot", "x.png"], ["--ray cannot honour --plot"]),
    ],
)
def test_bad_ray_options_are_one_line(tmp_path, extra, needles):
    data = _series_csv(tmp_path / "s.csv")
    (tmp_path / "EXISTING").mkdir()
    (tmp_path / "EXISTING" / "part-000000000.csv").write_text("x\n")
    extra = [str(tmp_path / e) if e in ("EXISTING", "NEW", "x.png") else e for e in extra]
    one_error_line(run_cli("forecast", str(data), "--horizon", "3", *extra, env=ONE_THREAD), *needles)


def test_unreachable_address_fails_in_bounded_time(tmp_path):
    pytest.importorskip("ray")
    data = _series_csv(tmp_path / "s.csv")
    # port 1 on this machine: nothing listens there, so the connection is refused at once
    one_error_line(run_cli("forecast", str(data), "--horizon", "3", "--ray", "127.0.0.1:1", env=ONE_THREAD), "cannot reach the Ray cluster", "127.0.0.1:1")


def test_ray_not_installed_is_one_line(tmp_path):
    data = _series_csv(tmp_path / "s.csv")
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None\n")  # `import ray` raises ImportError
    env = {**ONE_THREAD, "PYTHONPATH": f"{shim}:{ROOT}"}
    one_error_line(run_cli("forecast", str(data), "--horizon", "3", "--ray", env=env), "needs Ray Data", "gencli[ray]")


# -- identical to the single-process run, on a real local Ray runtime ------------------------------------------------
@pytest.mark.slow
def test_forecast_with_ray_is_the_single_process_output(tmp_path):
    pytest.importorskip("ray")
    data = _series_csv(tmp_path / "s.csv")
    args = ["forecast", str(data), "--horizon", "5", "--batch-size", "3", "--json"]
    single = run_cli(*args, env=ONE_THREAD)
    assert single.returncode == 0, single.stderr
    distributed = run_cli(*args, "--ray", "--replicas", "2", env=ONE_THREAD)
    assert distributed.returncode == 0, distributed.stderr
    assert distributed.stdout == single.stdout  # same rows, same values, same order; stdout carries nothing else
    assert '{"id": "short", "error"' in distributed.stdout and "skipped series 'short'" in distributed.stderr


@pytest.mark.slow
def test_forecast_with_ray_writes_shards_from_a_directory(tmp_path):
    """A directory of files (one series split across two of them), sharded output: the shards, read in
    name order, are the single-process CSV of the concatenated files."""
    pytest.importorskip("ray")
    whole = pd.read_csv(_series_csv(tmp_path / "s.csv"))
    (tmp_path / "in").mkdir()
    split = len(whole) // 2 + 17  # inside a series
    whole.iloc[:split].to_csv(tmp_path / "in" / "a.csv", index=False)
    whole.iloc[split:].to_csv(tmp_path / "in" / "b.csv", index=False)
    single = run_cli("forecast", str(tmp_path / "s.csv"), "--horizon", "4", "--batch-size", "4", env=ONE_THREAD)
    assert single.returncode == 0, single.stderr
    out = tmp_path / "out"
    args = ["--horizon", "4", "--batch-size", "4", "--ray", "local", "--replicas", "2", "--out-dir", str(out)]
    r = run_cli("forecast", str(tmp_path / "in"), *args, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    shards = sorted(out.glob("part-*.csv"))
    assert len(shards) >= 2
    rows = pd.concat([pd.read_csv(s, dtype=str) for s in shards], ignore_index=True)
    expected = pd.read_csv(io.StringIO(single.stdout), dtype=str)
    assert rows.to_csv(index=False) == expected.to_csv(index=False)


@pytest.mark.slow
def test_classify_with_ray_is_the_single_process_output(tmp_path):
    pytest.importorskip("ray")
    folder = write_scene_folder(tmp_path, [32, 40, 48, 32, 56, 40, 32])
    (folder / "img3.png").write_bytes(b"not an image")  # reported, and the others go on
    args = ["classify", str(folder), "--json", "--batch-size", "3"]
    single = run_cli(*args, env=ONE_THREAD)
    distributed = run_cli(*args, "--ray", "--replicas", "2", env=ONE_THREAD)
    assert single.returncode == distributed.returncode == 2
    assert distributed.stdout == single.stdout
    assert len(distributed.stdout.splitlines()) == 7 and '"error"' in distributed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("command, sharded", [("zeroshot", False), ("similarity", True)])
def test_clip_commands_with_ray_are_the_single_process_output(tmp_path, command, sharded):
    """zeroshot and similarity on Ray: the same JSON lines in the same order (an unreadable image
    reported in its place), on stdout or, with --out-dir, in the shards read in name order."""
    pytest.importorskip("ray")
    folder = write_scene_folder(tmp_path, [32, 40, 48, 32, 56])
    (folder / "img2.png").write_bytes(b"not an image")
    what = ["--labels", "circle,square,triangle"] if command == "zeroshot" else ["--texts", "a red circle", "--texts", "a blue square"]
    args = [command, str(folder), *what, "--json", "--batch-size", "2"]
    single = run_cli(*args, env=ONE_THREAD)
    assert single.returncode == 2 and len(single.stdout.splitlines()) == 5 and '"error"' in single.stdout
    out = tmp_path / "shards"
    distributed = run_cli(*args, "--ray", "--replicas", "2", *(["--out-dir", str(out)] if sharded else []), env=ONE_THREAD)
    assert distributed.returncode == 2 and "img2.png" in distributed.stderr
    if sharded:
        assert distributed.stdout == ""
        assert "".join(s.read_text() for s in sorted(out.glob("part-*.jsonl"))) == single.stdout
    else:
        assert distributed.stdout == single.stdout


@pytest.mark.slow
def test_generate_prompts_file_with_ray_is_the_single_process_output(tmp_path):
    """Sampled with a seed, in batches of two: each batch draws from its own generator of (seed,
    batch), so the replicas give the single-process texts, in prompt order."""
    pytest.importorskip("ray")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n\ndef add(a, b):\nclass Point:\nfor i in range(3):\nx = [\n", encoding="utf-8")
    args = ["generate", "--prompts-file", str(prompts), "-n", "6", "--temperature", "0.9", "--seed", "7", "--batch-size", "2"]
    single = run_cli(*args, env=ONE_THREAD)
    assert single.returncode == 0, single.stderr
    distributed = run_cli(*args, "--ray", "--replicas", "2", env=ONE_THREAD)
    assert distributed.returncode == 0, distributed.stderr
    assert distributed.stdout == single.stdout
    records = [json.loads(line) for line in run_cli(*args, "--json", env=ONE_THREAD).stdout.splitlines()]
    assert len(records) == 5 and "".join(r["text"] + "\n\n" for r in records) == single.stdout


@pytest.mark.slow
def test_txt2img_prompts_file_with_ray_writes_the_single_process_files(tmp_path):
    """The replicas write the PNGs to the names the single-process run uses, byte for byte, and the
    JSON records come back in prompt order."""
    pytest.importorskip("ray")
    import json

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red star\na blue square\na green circle\n", encoding="utf-8")
    args = ["txt2img", "--prompts-file", str(prompts), "--seed", "3", "--steps", "2", "--width", "32", "--height", "32", "--batch-size", "2", "--json"]
    runs = {}
    for name, extra in (("single", []), ("ray", ["--ray", "--replicas", "2"])):
        (tmp_path / name).mkdir()
        r = run_cli(*args, "-o", str(tmp_path / name / "{i:02d}-{seed}.png"), *extra, env=ONE_THREAD)
        assert r.returncode == 0, r.stderr
        runs[name] = [{k: v for k, v in json.loads(line).items() if k != "file"} for line in r.stdout.splitlines()]
    assert runs["ray"] == runs["single"] and [row["seed"] for row in runs["single"]] == [3, 3, 3]  # each prompt from --seed
    names = sorted(p.name for p in (tmp_path / "single").iterdir())
    assert names == ["00-3.png", "01-3.png", "02-3.png"] == sorted(p.name for p in (tmp_path / "ray").iterdir())
    for n in names:
        assert (tmp_path / "ray" / n).read_bytes() == (tmp_path / "single" / n).read_bytes()


@pytest.mark.parametrize(
    "args, needles",
    [
        (["zeroshot", "IMG", "--labels", "a,b", "--replicas", "2"], ["--replicas needs --ray"]),
        (["similarity", "IMG", "--texts", "a", "--ray", "--out", "x.jsonl", "--out-dir", "NEW"], ["--out and --out-dir are exclusive"]),
        (["generate", "import os", "--ray"], ["--ray needs --prompts-file"]),
        (["txt2img", "a red star", "--ray"], ["--ray needs --prompts-file"]),
        (["txt2img", "--prompts-file", "PROMPTS", "--ray", "--replicas", "0"], ["--replicas must be at least 1"]),
        (["txt2img", "--prompts-file", "PROMPTS", "--ray", "--out-dir", "EXISTING"], ["already exists", "--force"]),
    ],
)
def test_bad_ray_options_of_the_other_commands(tmp_path, args, needles):
    (tmp_path / "imgs").mkdir()
    write_scene_folder(tmp_path / "imgs", [32])
    (tmp_path / "prompts.txt").write_text("a red star\n")
    (tmp_path / "EXISTING").mkdir()
    (tmp_path / "EXISTING" / "old.png").write_bytes(b"x")
    named = {"IMG": tmp_path / "imgs" / "img0.png", "PROMPTS": tmp_path / "prompts.txt"}
    named.update({n: tmp_path / n for n in ("NEW", "EXISTING", "x.jsonl")})
    one_error_line(run_cli(*[str(named.get(a, a)) for a in args], env=ONE_THREAD), *needles)


# -- warnings raised in the workers reach the driver's stderr once each ------------------------------------------------
def test_replica_warnings_are_kept_once_and_forwarded_once(capsys):
    import json
    import warnings

    from gencli.console import Reporter
    from gencli.pipelines.distributed.replica_warnings import ForwardedWarnings, ReplicaReporter

    replicas = [ReplicaReporter(), ReplicaReporter()]
    for rep in replicas:
        rep.warn("no preprocessor_config.json")
        rep.warn("no preprocessor_config.json")
        with rep.collecting():
            warnings.warn("a Python warning", UserWarning, stacklevel=1)
        rep.say("nothing printed in a worker")
    assert json.loads(replicas[0].take()) == ["no preprocessor_config.json", "UserWarning: a Python warning"]
    assert replicas[0].take() == "[]"  # taken once
    assert capsys.readouterr().err == ""
    forward = ForwardedWarnings(Reporter())
    forward(replicas[1].take())
    forward(json.dumps(["no preprocessor_config.json", "another one"]))
    forward(None)
    err = capsys.readouterr().err
    assert err.count("warning: no preprocessor_config.json") == 1 and err.count("warning: UserWarning: a Python warning") == 1
    assert err.count("warning: another one") == 1
    ForwardedWarnings(Reporter(quiet=True))(json.dumps(["hidden"]))
    assert capsys.readouterr().err == ""


def test_forecast_reader_task_sends_its_warning_back_with_the_first_row(tmp_path, monkeypatch):
    """The reader's warning (rows of one id not contiguous in a large CSV), raised in a Ray task,
    travels on the file's first row for the driver to show (read_series run here, without Ray)."""
    import json

    from gencli.pipelines.forecast import table as tables
    from gencli.pipelines.forecast.layout import infer_layout
    from gencli.pipelines.forecast.ray import read_series
    from gencli.pipelines.forecast.records import RecordOptions

    data = _series_csv(tmp_path / "s.csv")
    table = pd.read_csv(data)
    tail = table.index[table["id"] == table["id"].iloc[0]][-5:]
    pd.concat([table.drop(tail), table.loc[tail]]).to_csv(data, index=False)  # the rows of one id not contiguous
    monkeypatch.setattr(tables, "STREAM_BYTES", 1)  # "large": streamed when the ids are contiguous
    layout = infer_layout(tables.open_table(str(data)).sample())
    rows = read_series({"file": str(data), "file_index": 0}, layout=layout, rec_opts=RecordOptions(horizon=3), merge=False)
    assert len(rows) == 10
    first = json.loads(rows[0]["warnings"])
    assert len(first) == 1 and "not contiguous" in first[0]
    assert all(r["warnings"] == "[]" for r in rows[1:])


@pytest.mark.slow
def test_generate_with_ray_shards_in_the_single_process_format_and_forwards_warnings(tmp_path):
    """Without --json the shards hold the texts (``.txt``), read in name order they are the
    single-process stdout; the warning each replica raises while loading (--top-k with --temperature 0)
    is shown once, as in the single process."""
    pytest.importorskip("ray")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\ndef add(a, b):\nclass Point:\nx = [\n", encoding="utf-8")
    args = ["generate", "--prompts-file", str(prompts), "-n", "4", "--temperature", "0", "--top-k", "5", "--batch-size", "1", "--echo"]
    single = run_cli(*args, env=ONE_THREAD)
    assert single.returncode == 0, single.stderr
    notice = "warning: --top-k/--top-p/--min-p have no effect with --temperature 0"
    assert single.stderr.count(notice) == 1
    out = tmp_path / "shards"
    distributed = run_cli(*args, "--ray", "--replicas", "2", "--out-dir", str(out), env=ONE_THREAD)
    assert distributed.returncode == 0, distributed.stderr
    assert distributed.stdout == ""
    shards = sorted(out.glob("part-*"))
    assert len(shards) == 4 and {s.suffix for s in shards} == {".txt"}
    assert "".join(s.read_text(encoding="utf-8") for s in shards) == single.stdout
    assert distributed.stderr.count(notice) == 1, distributed.stderr
