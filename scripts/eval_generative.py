#!/usr/bin/env python
"""Sample quality of a VAE or GAN folder (default: the embedded vae-shapes / gan-shapes), judged by the
default classifier (vit-shapes), and for a VAE its reconstruction quality on held-out scenes.

Samples are seeds 0..n-1 through ``gencli sample``'s own path (the per-seed latents of
``gencli.pipelines.generative``); the real images are held-out scenes of the shapes world's test
split (one or two objects, as in training), n of them for the reference and n more, disjoint, for
the floor of the Frechet distance (two real sets). Reported (``gencli.pipelines.generative.quality``):

- recognised: the share of images whose top class scores above 0.5;
- the class distribution of the recognised images: classes present, the smallest share, entropy
  relative to the uniform distribution's;
- the Frechet distance to the real reference set in the classifier's feature space;
- VAE only: PSNR/SSIM of the posterior-mean reconstructions of the held-out scenes;
- GAN only: the same sample figures at each ``--truncation`` value (realism against diversity);
- the geometric judge (:class:`GeometricJudge`): the share of images whose every object (one or two:
  connected pixels far from the background colour) matches one of the eight shape templates fitted
  at its centroid, size and rotation with IoU >= 0.8 (soft masks), the share with no object at all,
  and the shapes of the matched objects. Real scenes score 100% at 64x64 (92% at 32x32, where the
  small crescents and stars are five pixels wide); blurred, warped and empty images score low;
- DDPM (a pipeline folder with --model): the same figures at each ``--steps`` count of ``--sampler``.

    python scripts/eval_generative.py vae                 # 2000 samples and scenes
    python scripts/eval_generative.py gan --truncation 1,0.8,0.6 --markdown
    python scripts/eval_generative.py vae --model runs/vae/model --n 500 --json
    python scripts/eval_generative.py ddpm --model runs/ddpm/pipeline --sampler ddim --steps 50,20,10
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gencli.data import shapes  # noqa: E402

DEFAULTS = {"vae": "vae-shapes", "gan": "gan-shapes", "ddpm": "ddpm-shapes"}


# -- the geometric judge --------------------------------------------------------------------------------
# The classifier's "recognised" share counts blobs as circles and hearts. This judge asks whether a
# sample holds shapes of the world at all: each object (a connected set of pixels far from the
# background colour) must match one of the eight shape templates, fitted at its centroid, size and
# rotation, with an IoU of at least IOU_MATCH. Masks are soft: the object's coverage of each pixel
# is estimated from its colour between the background's and the object's (the templates are
# anti-aliased the same way), so real scenes score near 1 at any size.
IOU_MATCH = 0.8
FOREGROUND = 30.0  # RGB distance from the background colour that starts an object
MAX_OBJECTS = 2  # the world's scenes hold one or two objects
GRID = 40  # canonical grid for the fast screening of (shape, rotation) candidates
GRID_EXTENT = 1.6  # in units of the square root of the object's area
ROTATIONS = np.arange(0.0, 360.0, 5.0)


class GeometricJudge:
    """Judges uint8 images ``(N, H, W, 3)`` (see :meth:`judge`): per image, whether every object matches a shape."""

    def __init__(self, shape_names: Sequence[str] = shapes.SHAPES) -> None:
        """``shape_names``: the templates it fits (``shapes.ALL_SHAPES`` to recognise the hexagon too)."""
        from scipy import ndimage

        self.ndimage = ndimage
        size, diameter = 192, 0.5
        r_px = diameter * size / 2
        u = np.linspace(-GRID_EXTENT, GRID_EXTENT, GRID)
        self.templates, self.keys = [], []
        self.unit_area: dict[str, float] = {}
        self.centroid_offset: dict[tuple[str, float], np.ndarray] = {}
        self.shape_names = tuple(shape_names)
        for shape in self.shape_names:
            for rot in ROTATIONS if shape != "circle" else [0.0]:
                cov = shapes.shape_coverage(shape, 0.5, 0.5, diameter, float(rot), size)
                area = float(cov.sum())
                ys, xs = np.mgrid[0:size, 0:size]
                cy, cx = float((cov * ys).sum() / area), float((cov * xs).sum() / area)
                # (template centroid - drawn centre) in radii, image axes (x right, y down)
                centre = size * 0.5 - 0.5
                self.centroid_offset[(shape, float(rot))] = np.array([(cx - centre) / r_px, (cy - centre) / r_px])
                self.unit_area[shape] = area / r_px**2
                scale = math.sqrt(area)
                gy, gx = np.meshgrid(cy + u * scale, cx + u * scale, indexing="ij")
                self.templates.append(ndimage.map_coordinates(cov, [gy, gx], order=1, mode="constant").ravel())
                self.keys.append((shape, float(rot)))
        self.templates = np.stack(self.templates).astype(np.float32)
        self.u = u

    # -- one object ----------------------------------------------------------------------------------
    def _objects(self, image: np.ndarray) -> list[np.ndarray]:
        """Soft coverage maps ``(H, W)`` of the objects of one image, largest first (tiny specks dropped)."""
        img = image.astype(np.float32)
        border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
        bg = np.median(border, axis=0)
        dist = np.linalg.norm(img - bg, axis=-1)
        labels, n = self.ndimage.label(dist > FOREGROUND, structure=np.ones((3, 3)))
        min_area = max(4, int(6 * image.shape[0] * image.shape[1] / 64**2))
        out = []
        for k in range(1, n + 1):
            comp = labels == k
            if comp.sum() < min_area:
                continue
            d = dist[comp]
            colour = np.median(img[comp][d >= 0.9 * d.max()], axis=0)
            axis = colour - bg
            alpha = np.clip(((img - bg) @ axis) / max(float(axis @ axis), 1e-6), 0.0, 1.0)
            region = self.ndimage.binary_dilation(comp, structure=np.ones((3, 3)))
            out.append(np.where(region, alpha, 0.0).astype(np.float32))
        return sorted(out, key=lambda a: -float(a.sum()))

    def fit(self, alpha: np.ndarray, candidates: int = 3) -> tuple[str, float]:
        """The best shape for one object's coverage map and its IoU."""
        h, w = alpha.shape
        area = float(alpha.sum())
        ys, xs = np.mgrid[0:h, 0:w]
        cy, cx = float((alpha * ys).sum() / area), float((alpha * xs).sum() / area)
        scale = math.sqrt(area)
        gy, gx = np.meshgrid(cy + self.u * scale, cx + self.u * scale, indexing="ij")
        seen = self.ndimage.map_coordinates(alpha, [gy, gx], order=1, mode="constant").ravel()
        inter = np.minimum(self.templates, seen).sum(1)
        union = np.maximum(self.templates, seen).sum(1)
        screen = inter / np.maximum(union, 1e-6)
        best_shape, best_iou = "", 0.0
        tried: set[str] = set()
        for idx in np.argsort(-screen):
            shape, rot = self.keys[idx]
            if shape in tried:
                continue
            tried.add(shape)
            r = math.sqrt(area / self.unit_area[shape])
            off = self.centroid_offset[(shape, rot)] * r
            short = min(h, w)
            x, y = (cx - off[0] + 0.5) / w, (cy - off[1] + 0.5) / h
            for dr in (0.0, -2.5, 2.5):
                tpl = shapes.shape_coverage(shape, x, y, 2 * r / short, rot + dr, (w, h))
                iou = float(np.minimum(tpl, alpha).sum() / max(np.maximum(tpl, alpha).sum(), 1e-6))
                if iou > best_iou:
                    best_shape, best_iou = shape, iou
            if len(tried) == candidates:
                break
        return best_shape, best_iou

    def judge_image(self, image: np.ndarray) -> dict:
        """``{"objects": n, "shapes": [...], "ious": [...], "match": bool}`` for one uint8 image."""
        objects = self._objects(image)
        fits = [self.fit(a) for a in objects[: MAX_OBJECTS + 1]]
        match = 1 <= len(objects) <= MAX_OBJECTS and all(iou >= IOU_MATCH for _, iou in fits)
        return {"objects": len(objects), "shapes": [s for s, _ in fits], "ious": [round(i, 4) for _, i in fits], "match": match}

    def judge(self, images: np.ndarray) -> dict:
        """The share of images whose every object (one or two) matches a shape with IoU >= IOU_MATCH,
        the shares of the matched objects' shapes, and the share of images with no object at all."""
        results = [self.judge_image(im) for im in images]
        n = max(1, len(results))
        matched = [s for r in results if r["match"] for s in r["shapes"]]
        return {
            "matching": round(sum(r["match"] for r in results) / n, 4),
            "empty": round(sum(r["objects"] == 0 for r in results) / n, 4),
            "mean_iou_main": round(float(np.mean([r["ious"][0] if r["ious"] else 0.0 for r in results])) if results else 0.0, 4),
            "shapes": {s: round(matched.count(s) / max(1, len(matched)), 4) for s in self.shape_names},
        }


def _ddpm_sampler(model: str | None, sampler: str, threads: int | None, dtype: str = "float32"):
    """A pipeline folder for :func:`evaluate`: ``(loaded, image size, images(n, steps))`` (seeds 0..n-1)."""
    from gencli.pipelines.ddpm import loading, sampling
    from gencli.weights import resolve_model

    loaded = loading.open_ddpm(loading.inspect_pipeline(resolve_model(model, DEFAULTS["ddpm"])), device="auto", dtype=dtype, threads=threads)

    def images(n: int, k: int) -> np.ndarray:
        return sampling.generate(loaded, list(range(n)), sampler=sampler, steps=k, batch_size=64)

    return loaded, loaded.checkpoint.unet_config.image_size[0], images


def evaluate(family: str, model: str | None, n: int, scales: list[float], threads: int | None = None, sampler: str = "ddpm", dtype: str = "float32") -> dict:
    from gencli.pipelines.generative.metrics import psnr, ssim
    from gencli.pipelines.generative.quality import class_distribution, frechet_distance, judge_images, sample_report
    from gencli.pipelines.vision.classify import ImageClassifier
    from gencli.weights import resolve_model

    if family == "ddpm":
        loaded, size, ddpm_images = _ddpm_sampler(model, sampler, threads, dtype)
    else:
        from gencli.pipelines.generative import loading, sampling

        loaded = loading.open_generative(resolve_model(model, DEFAULTS[family]), family, device="cpu", dtype="float32", threads=threads)
        size = loaded.image_size
    clf = ImageClassifier.load(resolve_model(None, "vit-shapes"), device="cpu", dtype="float32", threads=threads)
    geometric = GeometricJudge()
    classes = [clf.labels[i] for i in sorted(clf.labels)]
    real_a, _ = shapes.render_batch(shapes.split_seeds("test", n), size)
    real_b, _ = shapes.render_batch(shapes.split_seeds("test", n, offset=n), size)
    ref, other = judge_images(clf, real_a), judge_images(clf, real_b)
    report: dict = {
        "model": str(loaded.path),
        "family": family,
        "n": n,
        **({"sampler": sampler, "dtype": str(loaded.placement.dtype).removeprefix("torch.")} if family == "ddpm" else {}),
        "real": {
            "recognised": round(float((ref.scores > 0.5).mean()), 4),
            "classes": class_distribution([lab for lab, s in zip(ref.labels, ref.scores) if s > 0.5], classes),
            "frechet_distance_real_vs_real": round(frechet_distance(other.features, ref.features), 4),
            "geometric": geometric.judge(real_a),
        },
    }
    key = {"vae": "temperature", "gan": "truncation", "ddpm": "steps"}[family]
    if family != "ddpm":
        latents = sampling.seed_latents(range(n), loaded.latent_dim)
    report["samples"] = []
    for scale in scales:
        if family == "ddpm":
            scale = int(scale)
            images = ddpm_images(n, scale)
        else:
            images = sampling.generate(loaded, latents, **{key: scale})
        report["samples"].append({key: scale, **sample_report(judge_images(clf, images), ref, classes), "geometric": geometric.judge(images)})
    if family == "vae":
        recon = sampling.reconstruct_vae(loaded, real_a)
        report["reconstruction"] = {"psnr": round(float(psnr(recon, real_a).mean()), 3), "ssim": round(float(ssim(recon, real_a).mean()), 4)}
    return report


def markdown(r: dict) -> str:
    key = {"vae": "temperature", "gan": "truncation", "ddpm": "steps"}[r["family"]]
    lines = [
        f"| images ({r['n']} each) | recognised (score > 0.5) | classes present | smallest class share | entropy / uniform | Frechet distance to real "
        f"| matching a shape (IoU >= {IOU_MATCH}) | no object |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in r["samples"]:
        c, g = s["classes"], s["geometric"]
        lines.append(f"| samples, {key} {s[key]} | {s['recognised']:.1%} | {c['classes_present']} | {c['min_share']:.1%} | "
                     f"{c['entropy_ratio']:.3f} | {s['frechet_distance']:.3f} | {g['matching']:.1%} | {g['empty']:.1%} |")  # fmt: skip
    c, g = r["real"]["classes"], r["real"]["geometric"]
    lines.append(f"| held-out real scenes | {r['real']['recognised']:.1%} | {c['classes_present']} | {c['min_share']:.1%} | "
                 f"{c['entropy_ratio']:.3f} | {r['real']['frechet_distance_real_vs_real']:.3f} (a second real set: the floor) "
                 f"| {g['matching']:.1%} | {g['empty']:.1%} |")  # fmt: skip
    lines += ["", "| class | " + " | ".join(r["samples"][0]["classes"]["shares"]) + " |", "|---|" + "---|" * len(r["samples"][0]["classes"]["shares"])]
    for s in r["samples"]:
        lines.append(f"| samples, {key} {s[key]} | " + " | ".join(f"{v:.1%}" for v in s["classes"]["shares"].values()) + " |")
    lines.append("| held-out real scenes | " + " | ".join(f"{v:.1%}" for v in r["real"]["classes"]["shares"].values()) + " |")
    if "reconstruction" in r:
        rec = r["reconstruction"]
        lines += ["", f"Reconstruction (posterior mean) of the {r['n']} held-out scenes: PSNR {rec['psnr']:.2f} dB, SSIM {rec['ssim']:.4f}."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("family", choices=("vae", "gan", "ddpm"))
    p.add_argument("--model", default=None, help="a VAE/GAN/DDPM folder (default: the embedded vae-shapes / gan-shapes / ddpm-shapes)")
    p.add_argument("--n", type=int, default=2000, help="samples, and held-out scenes per real set")
    p.add_argument("--truncation", default="1", help="GAN: comma-separated truncation values to evaluate")
    p.add_argument("--temperature", default="1", help="VAE: comma-separated prior temperatures to evaluate")
    p.add_argument("--steps", default="1000", help="DDPM: comma-separated step counts to evaluate")
    p.add_argument("--sampler", default="ddpm", help="DDPM: the sampler (ddpm, ddim, ...)")
    p.add_argument("--dtype", default="float32", help="DDPM: the UNet's dtype (float32, or auto: sample ddpm's default, bf16 where the CPU multiplies it)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the README tables")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spec = {"vae": args.temperature, "gan": args.truncation, "ddpm": args.steps}[args.family]
    scales = [float(v) for v in spec.split(",")]
    start = time.perf_counter()
    r = evaluate(args.family, args.model, args.n, scales, args.threads, sampler=args.sampler, dtype=args.dtype)
    r["seconds"] = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps(r))
    else:
        print(markdown(r))
        print(f"\n({r['model']}, {r['seconds']} s)")


if __name__ == "__main__":
    main()
