"""``forecast --ray``: N series forecast in one process (reference) vs on a local Ray runtime with
``--replicas`` model replicas (gencli side), the same command line otherwise, CSV in, CSV out.

Both sides run the real command (``python -m gencli forecast ...``) in a subprocess with one torch
thread per process. The gencli side also times ``--ray`` on a single series (the start-up overhead:
starting Ray and the replicas, loading the model in each) and samples the resident memory of the
Ray worker processes while it runs (peak per worker). ``series_per_s`` counts the whole command,
start-up included; ``steady_series_per_s`` takes the start-up overhead out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

DESCRIPTION = "forecast N series: one process vs --ray local --replicas R (throughput, start-up overhead, peak memory per Ray worker)"
METRICS = {"series_per_s": "higher", "steady_series_per_s": "higher", "wall_s": "lower"}
ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p):
    p.add_argument("--series", type=int, default=2000)
    p.add_argument("--length", type=int, default=120)
    p.add_argument("--horizon", type=int, default=24)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--model", default=None, help="TFT model folder (default: the embedded default)")


def setup(args, workdir):
    import pandas as pd

    from gencli.data.series import generate

    frames = []
    for i in range(args.series):
        rec = generate([424242, i], args.length, frequency="hourly", covariates=False, missing=False)
        frames.append(pd.DataFrame({"id": f"s{i}", "time": rec.timestamps, "value": np.round(rec.target, 4)}))
    table = pd.concat(frames)
    table.to_csv(workdir / "series.csv", index=False)
    table[table["id"] == "s0"].to_csv(workdir / "one.csv", index=False)


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


def _command(args, data: Path, ray: bool) -> list[str]:
    cmd = [sys.executable, "-m", "gencli", "forecast", str(data), "--horizon", str(args.horizon), "--batch-size", str(args.batch_size)]
    cmd += ["--out", os.devnull, "--threads", "1", "--quiet"]
    if args.model:
        cmd += ["--model", args.model]
    if ray:
        cmd += ["--ray", "local", "--replicas", str(args.replicas)]
    return cmd


def _timed(cmd: list[str], sample_workers: bool = False) -> tuple[float, float]:
    """Wall seconds of ``cmd``, and the peak resident memory of one of its Ray model replicas (MB)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GENCLI_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0.0]

    def sample():
        while proc.poll() is None:
            for pid in _descendants(proc.pid):
                cmdline, rss = _rss_mb(pid)
                if "ForecastReplica" in cmdline:
                    peak[0] = max(peak[0], rss)
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    if sample_workers:
        sampler.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}): {err.strip()[-2000:]}")
    return wall, round(peak[0], 1)


def run(side, args, workdir):
    data = workdir / "series.csv"
    if side == "reference":
        wall, _ = _timed(_command(args, data, ray=False))
        return {"wall_s": round(wall, 2), "series_per_s": round(args.series / wall, 1), "steady_series_per_s": round(args.series / wall, 1)}
    startup, _ = _timed(_command(args, workdir / "one.csv", ray=True))
    wall, worker_peak = _timed(_command(args, data, ray=True), sample_workers=True)
    # without the start-up (None when the start-up, timed separately on a busy machine, took as long)
    steady = round(args.series / (wall - startup), 1) if wall > startup else None
    return {
        "wall_s": round(wall, 2),
        "series_per_s": round(args.series / wall, 1),
        "steady_series_per_s": steady,
        "startup_s": round(startup, 2),
        "replicas": args.replicas,
        "worker_peak_rss_mb": worker_peak,
    }
