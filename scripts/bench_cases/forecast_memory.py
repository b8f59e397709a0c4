"""Bounded memory when forecasting many series: the same `gencli forecast` command on 10,000 series
(reference side) and on 100,000 series (gencli side), streamed from an id-sorted CSV to a CSV file.

Peak RSS should stay about the same (ratio ~1): input is read in chunks, series are forecast in
batches and written as they are done. Both sides run the CLI as a subprocess; the table shows its
peak RSS and throughput.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DESCRIPTION = "peak memory of `gencli forecast` streamed: 10,000 series (reference side) vs 100,000 series (gencli side)"
METRICS = {"cli_peak_rss_mb": "lower", "series_per_s": "higher"}


def add_arguments(p):
    p.add_argument("--series", type=int, default=100_000, help="series on the gencli side (the reference side runs a tenth)")
    p.add_argument("--length", type=int, default=60)
    p.add_argument("--horizon", type=int, default=12)
    p.add_argument("--model", default=None)


def _write_csv(path: Path, n: int, length: int) -> None:
    rng = np.random.default_rng(0)
    t = np.arange(length)
    dates = np.datetime_as_string(np.datetime64("2015-01-01") + t * np.timedelta64(1, "D"), unit="D")
    with open(path, "w") as fh:
        fh.write("id,date,value\n")
        for start in range(0, n, 1000):
            k = min(1000, n - start)
            level = rng.uniform(10, 1000, (k, 1))
            y = level * (1 + 0.2 * np.sin(2 * np.pi * t / 7)[None, :] + 0.05 * rng.normal(size=(k, length)))
            lines = []
            for i in range(k):
                sid = f"s{start + i}"
                lines.extend(f"{sid},{d},{v:.3f}\n" for d, v in zip(dates, y[i]))
            fh.write("".join(lines))


def setup(args, workdir):
    _write_csv(workdir / "big.csv", args.series, args.length)
    _write_csv(workdir / "small.csv", max(1, args.series // 10), args.length)


def run(side, args, workdir):
    data = workdir / ("small.csv" if side == "reference" else "big.csv")
    n = max(1, args.series // 10) if side == "reference" else args.series
    out = workdir / f"out-{side}.csv"
    cmd = [sys.executable, "-m", "gencli", "forecast", str(data), "--horizon", str(args.horizon), "--out", str(out), "--force", "--quiet"]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    root = Path(__file__).resolve().parents[2]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    seconds = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    rows = sum(1 for _ in open(out)) - 1
    return {
        "series": n,
        "input_mb": round(data.stat().st_size / 2**20, 1),
        "cli_peak_rss_mb": round(peak_kb / 1024, 1),
        "series_per_s": round(n / seconds, 1),
        "rows_written": rows,
    }
