"""Evaluate a segmenter on held-out shapes-world scenes: per-class IoU, mean IoU and pixel accuracy.

The scenes come from the test split (never seen in training) and go through the same path as
``gencli segment``: an RGB image -> the model folder's preprocessing -> the model -> logits resized to
the image -> argmax. Ground truth: :func:`gencli.data.shapes.render_mask` (background + the eight
shapes). Rows: one-object and two-object scenes at 64x64, and mixed scenes (half with two objects)
at 96x96 and 128x128. IoU of a class = TP / (TP + FP + FN) over all pixels of a row; the mean IoU
averages the nine classes.

    python scripts/eval_segmenter.py --model weights/unet-shapes            # 400 scenes per row
    python scripts/eval_segmenter.py --model runs/unet-shapes-export --n 100 --overlay docs/segment-overlay.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gencli.data import shapes  # noqa: E402
from gencli.pipelines.segmentation.loading import Segmenter  # noqa: E402

ROWS = (("64x64, one object", 64, 0.0), ("64x64, two objects", 64, 1.0), ("96x96, mixed", 96, 0.5), ("128x128, mixed", 128, 0.5))


# the floor tests/test_segment_quality.py holds the embedded default to (mean IoU on 40 scenes)
MIOU_FLOOR = 0.9


def scenes(n: int, size: int, two: float, offset: int, split: str = "test"):
    rng = np.random.default_rng(offset + size)
    seeds = shapes.split_seeds(split, n, offset=offset)
    for seed in seeds:
        k = 2 if rng.random() < two else 1
        image, mask, scene = shapes.render_with_mask(seed, size, n_objects=k)
        yield image, mask, scene


def evaluate(seg: Segmenter, n: int, size: int, two: float, offset: int, batch: int = 32, split: str = "test") -> dict:
    k = len(shapes.MASK_CLASSES)
    confusion = np.zeros((k, k), dtype=np.int64)
    images, masks = [], []

    def flush():
        preds = seg.segment([Image.fromarray(im, "RGB") for im in images])
        for p, m in zip(preds, masks):
            confusion[:] += np.bincount(m.ravel().astype(np.int64) * k + p.ravel().astype(np.int64), minlength=k * k).reshape(k, k)
        images.clear()
        masks.clear()

    for image, mask, _ in scenes(n, size, two, offset, split):
        images.append(image)
        masks.append(mask)
        if len(images) == batch:
            flush()
    if images:
        flush()
    tp = np.diag(confusion).astype(np.float64)
    union = confusion.sum(0) + confusion.sum(1) - tp
    iou = np.where(union > 0, tp / np.maximum(union, 1), np.nan)
    return {
        "pixel_accuracy": float(tp.sum() / confusion.sum()),
        "mean_iou": float(np.nanmean(iou)),
        "iou": {name: (None if np.isnan(v) else round(float(v), 4)) for name, v in zip(shapes.MASK_CLASSES, iou)},
        "scenes": n,
    }


def overlay_picture(seg: Segmenter, path: Path, offset: int) -> None:
    """Four held-out scenes (one and two objects, 96 and 128 px) side by side with their overlays."""
    from gencli.pipelines.segmentation.masks import overlay_image, write_image

    tiles = []
    for i, (size, k) in enumerate(((96, 1), (96, 2), (128, 2), (128, 1))):
        image, _, _ = shapes.render_with_mask(shapes.split_seeds("test", 1, offset=offset + 50_000 + i)[0], size, n_objects=k)
        pil = Image.fromarray(image, "RGB")
        tiles.append(overlay_image(pil, seg.segment([pil])[0], seg.labels, 0.55))
    width = sum(t.width for t in tiles) + 8 * (len(tiles) - 1)
    canvas = Image.new("RGB", (width, max(t.height for t in tiles)), (255, 255, 255))
    x = 0
    for t in tiles:
        canvas.paste(t, (x, 0))
        x += t.width + 8
    write_image(path, canvas, force=True)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="weights/unet-shapes")
    p.add_argument("--n", type=int, default=400, help="scenes per row")
    p.add_argument("--offset", type=int, default=0, help="first test-split seed used")
    p.add_argument("--split", default="test", choices=("test", "validation"), help="validation: for choices made before the final figures")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--overlay", type=Path, default=None, help="write an overlay picture of four held-out scenes here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    seg = Segmenter.load(args.model, device="cpu", dtype=args.dtype, threads=args.threads)
    results = {}
    names = list(shapes.MASK_CLASSES)
    print("| scenes | pixel accuracy | mean IoU | " + " | ".join(names) + " |")
    print("|---" * (3 + len(names)) + "|")
    for title, size, two in ROWS:
        t = time.time()
        r = evaluate(seg, args.n, size, two, args.offset, split=args.split)
        results[title] = r
        cells = " | ".join("-" if r["iou"][c] is None else f"{r['iou'][c]:.3f}" for c in names)
        print(f"| {title} | {r['pixel_accuracy']:.4f} | {r['mean_iou']:.3f} | {cells} |", flush=True)
        print(f"  ({args.n} scenes in {time.time() - t:.0f}s)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "dtype": args.dtype, "rows": results}, indent=2) + "\n")
    if args.overlay:
        overlay_picture(seg, args.overlay, args.offset)


if __name__ == "__main__":
    main()
