#!/usr/bin/env python
"""Evaluate a forecasting model zero-shot on real series that ship with statsmodels.

    python scripts/eval_forecast.py                       # the embedded default, headline datasets
    python scripts/eval_forecast.py --model runs/x/export --datasets macrodata,sunspots --no-ets
    python scripts/eval_forecast.py --json runs/eval.json --include-fertility

Rolling origin: the last 5 non-overlapping windows of each series (fewer when it is short), horizon by
frequency (yearly 6, quarterly 8, monthly 18, weekly 13). Scores: weighted quantile loss over the
levels 0.1..0.9 and MASE, each relative to seasonal naive per series, geometric mean over series;
side by side with statsmodels' damped Holt-Winters ETS on the same windows (see
gencli/pipelines/forecast/evaluate.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def table(result: dict) -> str:
    s = result["summary"]
    lines = [
        f"{s['series']} series; relative to seasonal naive (geometric mean over series; lower is better)",
        f"{'model':<28} {'rel wQL':>8} {'rel MASE':>9}",
        f"{'TFT (gencli, zero-shot)':<28} {s['tft_relative_wql']:>8.3f} {s['tft_relative_mase']:>9.3f}",
    ]
    if "ets_relative_wql" in s:
        lines.append(f"{'damped Holt-Winters ETS':<28} {s['ets_relative_wql']:>8.3f} {s['ets_relative_mase']:>9.3f}")
    lines.append(f"{'seasonal naive + band':<28} {s['naive_band_relative_wql']:>8.3f} {s['naive_band_relative_mase']:>9.3f}")
    lines.append(f"{'seasonal naive (point)':<28} {1.0:>8.3f} {1.0:>9.3f}")
    if "tft_vs_ets_wql" in s:
        lines.append(f"TFT / ETS: wQL {s['tft_vs_ets_wql']:.3f}, MASE {s['tft_vs_ets_mase']:.3f}")
    return "\n".join(lines)


def per_dataset(result: dict) -> str:
    from gencli.pipelines.forecast.evaluate import summarise

    by: dict[str, list] = {}
    for r in result["series"]:
        by.setdefault(r["dataset"], []).append(r)
    ets = "ets_wql" in result["series"][0]
    lines = [f"{'dataset':<20} {'n':>3} {'TFT wQL':>8} {'TFT MASE':>9}" + (f" {'ETS wQL':>8} {'ETS MASE':>9}" if ets else "")]
    for name, rows in by.items():
        s = summarise(rows, ets)
        line = f"{name:<20} {len(rows):>3} {s['tft_relative_wql']:>8.3f} {s['tft_relative_mase']:>9.3f}"
        if ets:
            line += f" {s['ets_relative_wql']:>8.3f} {s['ets_relative_mase']:>9.3f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded default)")
    p.add_argument("--datasets", default=None, help="comma-separated statsmodels datasets (default: the headline set)")
    p.add_argument("--include-fertility", action="store_true", help="also the 219 annual fertility series (reported separately)")
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--no-ets", action="store_true", help="skip the ETS baseline (faster)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the full result here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    import torch

    from gencli.data.real_series import HEADLINE, iter_series
    from gencli.pipelines.forecast.evaluate import evaluate
    from gencli.pipelines.forecast.forecaster import DEFAULT_MODEL, Forecaster
    from gencli.weights import resolve_model

    torch.set_num_threads(args.threads)
    fc = Forecaster(resolve_model(args.model, DEFAULT_MODEL), device="cpu")
    datasets = tuple(args.datasets.split(",")) if args.datasets else HEADLINE
    t0 = time.time()
    result = evaluate(fc, list(iter_series(datasets)), windows=args.windows, with_ets=not args.no_ets, log=None if args.quiet else print)
    result["seconds"] = round(time.time() - t0, 1)
    result["model"] = str(fc.path)
    print()
    print(table(result))
    print()
    print(per_dataset(result))
    if args.include_fertility:
        fert = evaluate(fc, list(iter_series(("fertility",))), windows=args.windows, with_ets=not args.no_ets)
        result["fertility"] = fert
        print("\nfertility (annual, not in the headline):")
        print(table(fert))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
