"""gencli as a shell citizen, tested the way a shell uses it: real subprocesses, pipes, signals, file
modes, /dev/full. See the README's "Command contract"."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_cli


def _env(**extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1", **extra}
    env.pop("COLUMNS", None)  # no terminal width: what a pipe gets
    return env


def sh(script: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a bash pipeline with ``G`` bound to this checkout's gencli; ``PIPESTATUS`` is at hand."""
    env = _env(G=f"{sys.executable} -m gencli")
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def series_csv(path: Path, n_series: int = 2, length: int = 48) -> Path:
    rows = ["id,step,sales"] + [f"s{s},{i},{10 + (i % 7) + s}" for s in range(n_series) for i in range(length)]
    path.write_text("\n".join(rows) + "\n")
    return path


# -- output files ---------------------------------------------------------------------------------
def test_new_files_get_the_umask_mode_replaced_files_keep_theirs_symlinks_are_written_through(tmp_path):
    data = series_csv(tmp_path / "sales.csv")
    r = sh("umask 022 && $G forecast sales.csv -H 2 -q -o new.csv && umask 077 && $G forecast sales.csv -H 2 -q -o private.csv", tmp_path)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(tmp_path / "new.csv").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "private.csv").st_mode) == 0o600
    (tmp_path / "shared.csv").write_text("old\n")
    os.chmod(tmp_path / "shared.csv", 0o664)
    os.symlink("shared.csv", tmp_path / "link.csv")
    r = sh("umask 077 && $G forecast sales.csv -H 2 -q -o link.csv --force", tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "link.csv").is_symlink(), "the link stays a link"
    assert (tmp_path / "shared.csv").read_text().startswith("id,time,"), "its target got the output"
    assert stat.S_IMODE(os.stat(tmp_path / "shared.csv").st_mode) == 0o664, "a replaced file keeps its mode"
    assert data.exists()


def test_sigterm_removes_the_partial_output_and_exits_143(tmp_path):
    """The signal comes at a point the test controls: ``--explain-out`` names a FIFO this test never
    opens, so the run, its ``-o`` file begun (opened first), waits on opening the FIFO until the
    signal arrives: it cannot finish first, however fast the machine."""
    series_csv(tmp_path / "sales.csv", n_series=3)
    os.mkfifo(tmp_path / "explain.csv")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gencli", "forecast", "sales.csv", "-H", "2", "-o", "x.csv", "--explain-out", "explain.csv", "-q"],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".x.csv.*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(".x.csv.*")) and proc.poll() is None, "the run ended before writing its output: " + proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["explain.csv", "sales.csv"], "no partial output, no temporary file"


def test_a_closed_stdout_does_not_drop_a_requested_file(tmp_path):
    """`| head` closes stdout early: the run still finishes the --explain-out file it was asked for."""
    series_csv(tmp_path / "sales.csv", n_series=40)
    r = sh("$G forecast sales.csv -H 3 -q --batch-size 2 --explain-out ex.csv | head -c 10; echo \"rc=${PIPESTATUS[0]}\"", tmp_path)
    assert "rc=0" in r.stdout, r.stderr
    ids = {line.split(",")[0] for line in (tmp_path / "ex.csv").read_text().splitlines()[1:]}
    assert ids == {f"s{i}" for i in range(40)}, "every series' explanation is in the file"


def test_full_disk_is_a_clear_exit_2(tmp_path):
    series_csv(tmp_path / "sales.csv")
    r = sh("$G forecast sales.csv -H 2 -q --out /dev/full", tmp_path)
    assert r.returncode == 2 and "error: cannot write '/dev/full': No space left on device" in r.stderr, r.stderr
    r = sh("$G models > /dev/full", tmp_path)
    assert r.returncode == 2 and "error: cannot write stdout: No space left on device" in r.stderr, r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr


def test_out_dash_is_stdout_and_json_goes_where_out_says(tmp_path):
    series_csv(tmp_path / "sales.csv")
    r = run_cli("forecast", "sales.csv", "-H", "2", "-q", "--out", "-", cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.startswith("id,time,"), r.stderr
    assert not (tmp_path / "-").exists()
    r = run_cli("forecast", "sales.csv", "-H", "2", "-q", "--json", "--out", "j.jsonl", cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout == "", "results go to one place: the file"
    records = [json.loads(line) for line in (tmp_path / "j.jsonl").read_text().splitlines()]
    assert [rec.get("id") for rec in records[:-1]] == ["s0", "s1"] and "summary" in records[-1]
    r = run_cli("forecast", "sales.csv", "-H", "2", "-q", "--backtest", "2", "--csv", "--out", "bt.csv", cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert (tmp_path / "bt.csv").read_text().startswith("id,windows,wql")
    r = run_cli("models", "--json", "-o", "m.jsonl", cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout == ""
    assert all(json.loads(line)["commands"] for line in (tmp_path / "m.jsonl").read_text().splitlines())
    r = run_cli("models", "-o", "m.jsonl", cwd=str(tmp_path))
    assert r.returncode == 2 and "already exists (use --force" in r.stderr


def test_forecast_json_keeps_input_order_for_errors(tmp_path):
    rows = ["id,t,y"] + [f"ok1,{i},{i % 5}" for i in range(40)] + ["short,0,1", "short,1,2"] + [f"ok2,{i},{i % 3}" for i in range(40)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    r = run_cli("forecast", "d.csv", "-H", "2", "-q", "--json", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x.get("id") for x in recs[:3]] == ["ok1", "short", "ok2"] and "error" in recs[1]
    assert recs[3]["summary"]["failed"] == 1


# -- tables and text in pipes ---------------------------------------------------------------------------
def test_tables_in_pipes_are_never_wrapped_or_cut(tmp_path):
    r = sh("$G info llama-pystdlib --all | cat", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout
    names = [line.split()[0] for line in r.stdout.splitlines() if line.startswith("model.")]
    assert "model.layers.0.self_attn.q_proj.weight" in names and len(names) > 40
    r = sh("$G models | cat", tmp_path)
    assert all(line == line.rstrip() for line in r.stdout.splitlines()), "no padding at line ends"
    assert sum(1 for line in r.stdout.splitlines() if line.strip()) == 1 + len(list((ROOT / "weights").iterdir())), "one line per model"


def test_classify_rows_in_a_pipe_name_the_image_on_every_row(tmp_path):
    from conftest import write_scene_folder

    deep = tmp_path / ("a-rather-long-directory-name-" * 3) / "deeper"
    deep.mkdir(parents=True)
    write_scene_folder(deep, [40])
    r = sh(f"$G classify '{tmp_path}' -r -k 2 | cat", tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    assert len(rows) == 4 and all(row[0].startswith(str(tmp_path)) for row in rows), r.stdout
    r = sh(f"$G classify '{tmp_path}' -r -k 1 --csv", tmp_path)
    assert r.stdout.splitlines()[0] == "image,rank,label,id,score"


@pytest.mark.parametrize("cmd", ["info llama-pystdlib --all", "models", "forecast sales.csv -H 30"])
def test_head_closing_stdout_is_exit_0(tmp_path, cmd):
    series_csv(tmp_path / "sales.csv")
    r = sh(f'$G {cmd} -q | head -1; echo "rc=${{PIPESTATUS[0]}}"', tmp_path)
    assert r.stdout.strip().endswith("rc=0"), r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr


# -- one option vocabulary, one error style -------------------------------------------------------------------
def test_short_options_mean_one_thing_in_every_command():
    import typer.main

    from gencli.cli import app
    from gencli.cli.common import SHORT_OPTIONS

    group = typer.main.get_command(app)
    seen = 0
    for name, cmd in group.commands.items():
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            longs = [o for o in p.opts + p.secondary_opts if o.startswith("--")]
            shorts = [o for o in p.opts + p.secondary_opts if not o.startswith("--")]
            for s in shorts:
                assert longs and SHORT_OPTIONS.get(longs[0]) == s, f"{name}: {s} for {longs}"
            if longs and longs[0] in SHORT_OPTIONS:
                assert SHORT_OPTIONS[longs[0]] in shorts, f"{name}: {longs[0]} lacks {SHORT_OPTIONS[longs[0]]}"
                seen += 1
        if name in ("generate", "classify", "zeroshot", "similarity", "forecast", "info", "models"):
            opts = {o for p in cmd.params for o in p.opts}
            assert {"--out", "--force", "--json"} <= opts, name
    assert seen > 20


@pytest.mark.parametrize(
    "args, needle",
    [
        (["classify", "-b", "0", "x.png"], "error: Invalid value for '--batch-size' / '-b': must be at least 1 (got 0)"),
        (["generate", "--batch-size", "0", "x"], "error: Invalid value for '--batch-size' / '-b': must be at least 1 (got 0)"),
        (["classify", "--no-such-option", "x.png"], "error: No such option: --no-such-option"),
        (["classify", "-q", "-v", "x.png"], "error: --quiet and --verbose contradict each other"),
        (["forecast", "x.csv", "--json", "--csv"], "error: --csv and --json are exclusive"),
    ],
)
def test_usage_errors_are_one_error_line(tmp_path, args, needle):
    r = run_cli(*args, cwd=str(tmp_path))
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(needle), r.stderr


def test_usage_errors_do_not_import_torch(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gencli", "generate", "--batch-size", "0", "x"], capture_output=True, text=True, cwd=ROOT, env=_env()
    )
    assert proc.returncode == 2
    assert "| torch\n" not in proc.stderr and " torch\n" not in proc.stderr.replace("|", " ")


def test_help_has_no_python_types_and_honest_seed_help():
    for cmd in ("classify", "zeroshot", "similarity", "generate", "forecast"):
        r = run_cli(cmd, "--help", env={"COLUMNS": "200"})
        assert r.returncode == 0
        option_lines = [line for line in r.stdout.splitlines() if line.lstrip("│ ").startswith("--")]
        for bad in ("list[str]", "int range", "<int>", "<str>", "<float>", "x>=1"):
            assert not any(bad in line for line in option_lines), (cmd, bad)
        seed = next(line for line in option_lines if line.lstrip("│ ").startswith("--seed"))  # the option, not an example
        assert ("sampling" in seed) == (cmd == "generate"), (cmd, seed)


def _one_image(folder) -> str:
    from PIL import Image

    Image.new("RGB", (16, 16), (200, 30, 30)).save(folder / "x.png")
    return "x.png"


def test_threads_env_must_be_an_integer(tmp_path):
    r = run_cli("classify", _one_image(tmp_path), env={"GENCLI_THREADS": "two"}, cwd=str(tmp_path))
    assert r.returncode == 2 and "GENCLI_THREADS must be a positive integer (got 'two')" in r.stderr


def test_threads_beyond_the_usable_cores_are_capped_with_a_notice(tmp_path):
    cores = len(os.sched_getaffinity(0))
    r = run_cli("classify", _one_image(tmp_path), "--threads", "999", cwd=str(tmp_path))
    notice = f"warning: --threads 999 is more than the {cores} usable CPU core(s): using {cores}"
    assert r.returncode == 0 and r.stderr.count(notice) == 1, r.stderr  # chosen where the model is placed, shown once
    r = run_cli("classify", "x.png", env={"GENCLI_THREADS": "999"}, cwd=str(tmp_path))
    assert r.returncode == 0 and "warning: GENCLI_THREADS 999 is more than" in r.stderr, r.stderr


def test_forecast_refuses_a_horizon_far_beyond_training(tmp_path):
    series_csv(tmp_path / "sales.csv")
    r = run_cli("forecast", "sales.csv", "-H", "100000", cwd=str(tmp_path))
    assert r.returncode == 2 and "--horizon 100000 is more than 4x the 64 steps this model was trained for (at most 256)" in r.stderr, r.stderr


def test_backtest_says_how_many_windows_were_used(tmp_path):
    series_csv(tmp_path / "sales.csv", n_series=1, length=48)
    r = run_cli("forecast", "sales.csv", "-H", "4", "--backtest", "1000", "-q", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "of the 1000 asked, 10 fit the history" in r.stdout.splitlines()[0], r.stdout
