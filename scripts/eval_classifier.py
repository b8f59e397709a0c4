#!/usr/bin/env python
"""Held-out accuracy of an image classifier on the shapes world (default: the embedded vit-shapes).

Scenes come from the ``test`` seed split (never seen in training): single-object scenes whose label is
the object's shape. Images go through the same path as ``gencli classify`` (PNG-equivalent RGB
image -> the checkpoint's preprocessor -> model in the chosen dtype, auto = bf16 on CPUs with bf16
matrix units). Besides the 64x64 figure, the same scenes are drawn at other resolutions and resized
by the preprocessor.

    python scripts/eval_classifier.py                       # 4000 scenes, auto dtype
    python scripts/eval_classifier.py --n 1000 --dtype float32 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gencli.data import shapes  # noqa: E402


def evaluate(clf, seeds, resolution: int, batch_size: int = 128) -> dict:
    """Accuracy (and per-shape accuracy, confusions) of ``clf`` on single-object scenes of ``seeds``."""
    correct, per_shape, totals, confusions = 0, Counter(), Counter(), Counter()
    for i in range(0, len(seeds), batch_size):
        samples = [shapes.render(int(s), resolution, n_objects=1) for s in seeds[i : i + batch_size]]
        preds = clf.predict([s.pil() for s in samples], top_k=1)
        for s, p in zip(samples, preds):
            truth, guess = s.scene.main.shape, p[0]["label"]
            totals[truth] += 1
            if truth == guess:
                correct += 1
                per_shape[truth] += 1
            else:
                confusions[f"{truth}->{guess}"] += 1
    return {
        "resolution": resolution,
        "n": len(seeds),
        "accuracy": correct / len(seeds),
        "per_shape": {k: round(per_shape[k] / totals[k], 4) for k in shapes.SHAPES if totals[k]},
        "confusions": dict(confusions.most_common(8)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded vit-shapes)")
    p.add_argument("--n", type=int, default=4000, help="held-out scenes")
    p.add_argument("--offset", type=int, default=0, help="first test seed used (offset into the test split)")
    p.add_argument("--resolutions", default="64,48,128,200", help="first one is the headline figure")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from gencli.pipelines.vision.classify import DEFAULT_MODEL, ImageClassifier
    from gencli.weights import resolve_model

    clf = ImageClassifier.load(resolve_model(args.model, DEFAULT_MODEL), device=args.device, dtype=args.dtype, threads=args.threads)
    placement = clf.placement
    seeds = shapes.split_seeds("test", args.n, offset=args.offset)
    results = []
    for res in (int(r) for r in args.resolutions.split(",")):
        start = time.perf_counter()
        r = evaluate(clf, seeds, res)
        r["seconds"] = round(time.perf_counter() - start, 1)
        results.append(r)
        if not args.json:
            print(f"{res}x{res}: accuracy {r['accuracy']:.4f} on {r['n']} held-out scenes ({placement.describe()}); "
                  f"per shape {r['per_shape']}; confusions {r['confusions']}", flush=True)
    if args.json:
        print(
            json.dumps(
                {"model": str(clf.path), "dtype": str(placement.dtype).replace("torch.", ""), "split": "test", "offset": args.offset, "results": results}
            )
        )


if __name__ == "__main__":
    main()
