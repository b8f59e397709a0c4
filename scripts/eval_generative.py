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
- GAN only: the same sample figures at each ``--truncation`` value (realism against diversity).

    python scripts/eval_generative.py vae                 # 2000 samples and scenes
    python scripts/eval_generative.py gan --truncation 1,0.8,0.6 --markdown
    python scripts/eval_generative.py vae --model runs/vae/model --n 500 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gencli.data import shapes  # noqa: E402

DEFAULTS = {"vae": "vae-shapes", "gan": "gan-shapes"}


def evaluate(family: str, model: str | None, n: int, scales: list[float], threads: int | None = None) -> dict:
    from gencli.pipelines.generative import loading, sampling
    from gencli.pipelines.generative.metrics import psnr, ssim
    from gencli.pipelines.generative.quality import class_distribution, frechet_distance, judge_images, sample_report
    from gencli.pipelines.vision.classify import ImageClassifier
    from gencli.weights import resolve_model

    loaded = loading.open_generative(resolve_model(model, DEFAULTS[family]), family, device="cpu", dtype="float32", threads=threads)
    clf = ImageClassifier.load(resolve_model(None, "vit-shapes"), device="cpu", dtype="float32", threads=threads)
    classes = [clf.labels[i] for i in sorted(clf.labels)]
    size = loaded.image_size
    real_a, _ = shapes.render_batch(shapes.split_seeds("test", n), size)
    real_b, _ = shapes.render_batch(shapes.split_seeds("test", n, offset=n), size)
    ref, other = judge_images(clf, real_a), judge_images(clf, real_b)
    report: dict = {
        "model": str(loaded.path),
        "family": family,
        "n": n,
        "real": {
            "recognised": round(float((ref.scores > 0.5).mean()), 4),
            "classes": class_distribution([lab for lab, s in zip(ref.labels, ref.scores) if s > 0.5], classes),
            "frechet_distance_real_vs_real": round(frechet_distance(other.features, ref.features), 4),
        },
    }
    latents = sampling.seed_latents(range(n), loaded.latent_dim)
    key = "temperature" if family == "vae" else "truncation"
    report["samples"] = []
    for scale in scales:
        images = sampling.generate(loaded, latents, **{key: scale})
        report["samples"].append({key: scale, **sample_report(judge_images(clf, images), ref, classes)})
    if family == "vae":
        recon = sampling.reconstruct_vae(loaded, real_a)
        report["reconstruction"] = {"psnr": round(float(psnr(recon, real_a).mean()), 3), "ssim": round(float(ssim(recon, real_a).mean()), 4)}
    return report


def markdown(r: dict) -> str:
    key = "temperature" if r["family"] == "vae" else "truncation"
    lines = [
        f"| images ({r['n']} each) | recognised (score > 0.5) | classes present | smallest class share | entropy / uniform | Frechet distance to real |",
        "|---|---|---|---|---|---|",
    ]
    for s in r["samples"]:
        c = s["classes"]
        lines.append(f"| samples, {key} {s[key]} | {s['recognised']:.1%} | {c['classes_present']} | {c['min_share']:.1%} | "
                     f"{c['entropy_ratio']:.3f} | {s['frechet_distance']:.3f} |")  # fmt: skip
    c = r["real"]["classes"]
    lines.append(f"| held-out real scenes | {r['real']['recognised']:.1%} | {c['classes_present']} | {c['min_share']:.1%} | "
                 f"{c['entropy_ratio']:.3f} | {r['real']['frechet_distance_real_vs_real']:.3f} (a second real set: the floor) |")  # fmt: skip
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
    p.add_argument("family", choices=("vae", "gan"))
    p.add_argument("--model", default=None, help="a VAE/GAN folder (default: the embedded vae-shapes / gan-shapes)")
    p.add_argument("--n", type=int, default=2000, help="samples, and held-out scenes per real set")
    p.add_argument("--truncation", default="1", help="GAN: comma-separated truncation values to evaluate")
    p.add_argument("--temperature", default="1", help="VAE: comma-separated prior temperatures to evaluate")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the README tables")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    scales = [float(v) for v in (args.temperature if args.family == "vae" else args.truncation).split(",")]
    start = time.perf_counter()
    r = evaluate(args.family, args.model, args.n, scales, args.threads)
    r["seconds"] = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps(r))
    else:
        print(markdown(r))
        print(f"\n({r['model']}, {r['seconds']} s)")


if __name__ == "__main__":
    main()
