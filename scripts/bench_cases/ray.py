"""``forecast --ray``: N series forecast in one process (reference) vs on a local Ray runtime with
``--replicas`` model replicas (gencli side), the same command line otherwise, CSV in, CSV out.

Both sides run the real command (``python -m gencli forecast ...``) in a subprocess with one torch
thread per process, at each of ``--sizes`` (the first N series of one generated table, written once
as CSV), plus once on a single series: the start-up overhead (for ``--ray``: starting Ray and the
replicas, loading the model in each; for one process: imports and the model load). While the
largest run goes, the resident memory of the command and of each Ray model replica is sampled
(peak per replica). The gencli side checks that its output is the same bytes as the reference's at
every size (``identical``).

``series_per_s`` counts the whole command at the largest size, start-up included;
``steady_series_per_s`` is the slope of a fit ``wall = startup + n / throughput`` over the sizes.
The summary solves the two fits for the number of series at which ``--ray`` starts to pay (None
when its fitted throughput is not above the single process's: it never does on this machine).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

DESCRIPTION = "forecast N series: one process vs --ray local --replicas R (throughput, start-up, peak memory per replica, break-even size, identical output)"
METRICS = {"series_per_s": "higher", "steady_series_per_s": "higher", "startup_s": "lower", "wall_s": "lower"}
ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p):
    p.add_argument("--sizes", default="2000,20000", help="comma-separated numbers of series (the last is the headline size)")
    p.add_argument("--length", type=int, default=120)
    p.add_argument("--horizon", type=int, default=24)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--model", default=None, help="TFT model folder (default: the embedded default)")


def sizes(args) -> list[int]:
    return sorted({int(s) for s in str(args.sizes).split(",") if s.strip()})


def setup(args, workdir):
    import pandas as pd

    from gencli.data.series import generate

    largest = sizes(args)[-1]
    frames = []
    for i in range(largest):
        rec = generate([424242, i], args.length, frequency="hourly", covariates=False, missing=False)
        frames.append(pd.DataFrame({"id": f"s{i}", "time": rec.timestamps, "value": np.round(rec.target, 4)}))
    table = pd.concat(frames, ignore_index=True)
    for n in sizes(args):
        table.iloc[: n * args.length].to_csv(workdir / f"series-{n}.csv", index=False)
    table.iloc[: args.length].to_csv(workdir / "one.csv", index=False)


# -- sampling the resident memory of a command and its Ray workers ---------------------------------------------
def _descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", encoding="ascii", errors="replace") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in parents.get(pid, []):
            out.append(child)
            todo.append(child)
    return out


def _rss_mb(pid: int) -> tuple[str, float]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return cmd, int(line.split()[1]) / 1024
    except OSError:
        pass
    return "", 0.0


def gencli_command(command: str, data: Path, out: str, args, ray: bool, *options: str) -> list[str]:
    """``python -m gencli COMMAND DATA OPTIONS...`` writing ``out``, one torch thread, quiet, with
    ``--batch-size`` and ``--model`` from ``args``, and on the Ray side ``--ray local --replicas R``."""
    cmd = [sys.executable, "-m", "gencli", command, str(data), *options, "--batch-size", str(args.batch_size)]
    cmd += ["--out", out, "--force", "--threads", "1", "--quiet"]
    if args.model:
        cmd += ["--model", args.model]
    if ray:
        cmd += ["--ray", "local", "--replicas", str(args.replicas)]
    return cmd


def _command(args, data: Path, out: str, ray: bool) -> list[str]:
    return gencli_command("forecast", data, out, args, ray, "--horizon", str(args.horizon))


def _timed(cmd: list[str], replica: str = "ForecastReplica") -> dict:
    """Wall seconds of ``cmd``, the peak resident memory of the command's own process and of its
    largest Ray model replica (a process whose title names the ``replica`` class; MB, sampled every
    0.25 s), and how many replicas were seen."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GENCLI_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = {"command": 0.0, "replica": 0.0}
    replicas: set[int] = set()

    def sample():
        while proc.poll() is None:
            peak["command"] = max(peak["command"], _rss_mb(proc.pid)[1])
            for pid in _descendants(proc.pid):
                cmdline, rss = _rss_mb(pid)
                if replica in cmdline:
                    replicas.add(pid)
                    peak["replica"] = max(peak["replica"], rss)
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    sampler.join(timeout=5)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}): {err.strip()[-2000:]}")
    return {"wall": wall, "command_mb": round(peak["command"], 1), "replica_mb": round(peak["replica"], 1), "replicas_seen": len(replicas)}


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``wall = startup + n / throughput`` over ``(n, wall)`` points:
    ``(startup_s, series_per_s)``."""
    n = np.array([p[0] for p in points], dtype=float)
    w = np.array([p[1] for p in points], dtype=float)
    slope, intercept = np.polyfit(n, w, 1)
    return float(intercept), float(1.0 / slope) if slope > 0 else float("inf")


def break_even(single: tuple[float, float], ray: tuple[float, float]) -> Optional[float]:
    """The number of series above which the Ray fit's wall time is below the single-process fit's
    (None when Ray's throughput is not higher: it never pays)."""
    (a1, b1), (a2, b2) = single, ray
    gain = 1.0 / b1 - 1.0 / b2  # seconds saved per series
    if gain <= 0:
        return None
    return max(0.0, (a2 - a1) / gain)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(side, args, workdir):
    ray = side == "gencli"
    startup = _timed(_command(args, workdir / "one.csv", os.devnull, ray))
    points = [(1, startup["wall"])]
    result: dict = {"startup_s": round(startup["wall"], 2)}
    identical = True
    for n in sizes(args):
        out = workdir / f"out-{side}-{n}.csv"
        t = _timed(_command(args, workdir / f"series-{n}.csv", str(out), ray))
        points.append((n, t["wall"]))
        result[f"wall_s_{n}"] = round(t["wall"], 2)
        result[f"series_per_s_{n}"] = round(n / t["wall"], 1)
        ref = workdir / f"out-reference-{n}.csv"
        if ray and ref.exists():
            identical = identical and _digest(ref) == _digest(out)
        largest = t
    n = sizes(args)[-1]
    fit_startup, fit_rate = fit_line(points)
    result.update(
        {
            "series": n,
            "wall_s": round(largest["wall"], 2),
            "series_per_s": round(n / largest["wall"], 1),
            "steady_series_per_s": round(fit_rate, 1),
            "fit_startup_s": round(fit_startup, 2),
            "peak_rss_mb": largest["command_mb"],
        }
    )
    if ray:
        result.update(
            {
                "replicas": args.replicas,
                "replicas_seen": largest["replicas_seen"],
                "replica_peak_rss_mb": largest["replica_mb"],
                "per_replica_series_per_s": round(fit_rate / args.replicas, 1),
                "identical": identical if (workdir / f"out-reference-{n}.csv").exists() else None,
            }
        )
    return result


def summarize(results: dict) -> dict:
    """Where ``--ray`` starts to pay, from both sides' fits."""
    ref, ours = results.get("reference"), results.get("gencli")
    if not ref or not ours:
        return {}
    n = break_even((ref["fit_startup_s"], ref["steady_series_per_s"]), (ours["fit_startup_s"], ours["steady_series_per_s"]))
    return {
        "startup_overhead_s": round(ours["startup_s"] - ref["startup_s"], 2),
        "throughput_ratio": round(ours["series_per_s"] / ref["series_per_s"], 3),
        "steady_throughput_ratio": round(ours["steady_series_per_s"] / ref["steady_series_per_s"], 3),
        "break_even_series": None if n is None else int(round(n)),
        "identical": ours.get("identical"),
    }
