#!/usr/bin/env python
"""Reconstruction quality and latent statistics of an AutoencoderKL on held-out shapes-world scenes
(default: the embedded autoencoder-shapes).

Scenes come from the ``test`` seed split (never seen in training; one- and two-object scenes as the
world draws them, fixed seeds), drawn at 64x64, encoded to the posterior mean and decoded, through
gencli's loader in the chosen dtype. Reported:

- PSNR and SSIM (gencli.pipelines.generative.metrics) per image, averaged; also for one- and two-object
  scenes separately, and the 5th percentile;
- the latents (posterior means) per channel: mean, standard deviation and share of the variance,
  before and after ``scaling_factor`` (a diffusion model wants about unit variance, spread over the
  channels), and the posterior's own standard deviation;
- smoothness: PSNR (against the original scene) of decoding latents perturbed by Gaussian noise of
  standard deviation 0.1 and 0.2 in scaled units (what a diffusion sampler's small errors do).

    python scripts/eval_autoencoder.py                          # 1000 scenes, fp32
    python scripts/eval_autoencoder.py --model runs/autoencoder/model --n 256 --json
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

DEFAULT_MODEL = "autoencoder-shapes"


@torch.inference_mode()
def evaluate(model, n: int, offset: int = 0, size: int = 64, batch_size: int = 100, noise=(0.1, 0.2)) -> dict:
    from gencli.pipelines.diffusion.vae import images_to_tensor, latent_statistics, reconstruct, tensor_to_images
    from gencli.pipelines.generative.metrics import psnr, ssim

    images, scenes = shapes.render_batch(shapes.split_seeds("test", n, offset=offset), size)
    recon, latents = reconstruct(model, images, batch_size=batch_size)
    p, s = psnr(recon, images), ssim(recon, images)
    two = torch.tensor([len(sc.objects) == 2 for sc in scenes])
    scale = model.config.scaling_factor
    weight = model.decoder.conv_out.weight
    posterior_std = []
    for start in range(0, n, batch_size):
        x = images_to_tensor(images[start : start + batch_size]).to(weight.device, weight.dtype)
        posterior_std.append(model.encode(x).std.float().mean(dim=(0, 2, 3)).cpu())
    robustness = {}
    g = torch.Generator().manual_seed(0)
    for sigma in noise:
        scores = []
        for start in range(0, n, batch_size):
            z = latents[start : start + batch_size]
            z = z + torch.randn(z.shape, generator=g) * (sigma / scale)
            out = tensor_to_images(model.decode(z.to(weight.device, weight.dtype)))
            scores.append(psnr(out, images[start : start + batch_size]))
        robustness[f"psnr_noise_{sigma}"] = round(float(torch.cat(scores).mean()), 2)
    return {
        "n": n,
        "size": size,
        "psnr": round(float(p.mean()), 3),
        "ssim": round(float(s.mean()), 4),
        "psnr_p5": round(float(p.quantile(0.05)), 2),
        "psnr_one_object": round(float(p[~two].mean()), 3),
        "psnr_two_objects": round(float(p[two].mean()), 3),
        "ssim_one_object": round(float(s[~two].mean()), 4),
        "ssim_two_objects": round(float(s[two].mean()), 4),
        "scaling_factor": scale,
        "latents": latent_statistics(latents),
        "scaled_latents": latent_statistics(latents, scale),
        "posterior_std": [round(v, 5) for v in torch.stack(posterior_std).mean(0).tolist()],
        **robustness,
    }


def markdown(r: dict) -> str:
    lat, sc = r["latents"], r["scaled_latents"]
    rows = [
        "| scenes | PSNR (dB) | SSIM |",
        "|---|---|---|",
        f"| all {r['n']} (5th percentile PSNR {r['psnr_p5']}) | {r['psnr']:.2f} | {r['ssim']:.4f} |",
        f"| one object | {r['psnr_one_object']:.2f} | {r['ssim_one_object']:.4f} |",
        f"| two objects | {r['psnr_two_objects']:.2f} | {r['ssim_two_objects']:.4f} |",
        "",
        "| latent channel | " + " | ".join(str(i) for i in range(len(lat["std"]))) + " |",
        "|---|" + "---|" * len(lat["std"]),
        "| mean (unscaled) | " + " | ".join(f"{v:.3f}" for v in lat["mean"]) + " |",
        "| std (unscaled) | " + " | ".join(f"{v:.3f}" for v in lat["std"]) + " |",
        f"| std x scaling_factor {r['scaling_factor']} | " + " | ".join(f"{v:.3f}" for v in sc["std"]) + " |",
        "| share of the variance | " + " | ".join(f"{v:.1%}" for v in sc["variance_share"]) + " |",
        "| posterior std (unscaled) | " + " | ".join(f"{v:.4f}" for v in r["posterior_std"]) + " |",
    ]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="an AutoencoderKL folder or file (default: the embedded autoencoder-shapes)")
    p.add_argument("--n", type=int, default=1000, help="held-out scenes")
    p.add_argument("--offset", type=int, default=0, help="first test seed used (offset into the test split)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the README tables")
    args = p.parse_args()

    from gencli.backend.device import choose_placement
    from gencli.pipelines.diffusion.vae import load_autoencoder
    from gencli.weights import resolve_model

    placement = choose_placement(args.device, args.dtype, "float", args.threads)
    loaded = load_autoencoder(resolve_model(args.model, DEFAULT_MODEL), placement, prepack=True)  # as `gencli reconstruct` runs it
    start = time.perf_counter()
    r = evaluate(loaded.model, args.n, args.offset)
    r.update(
        model=str(loaded.path),
        dtype=str(loaded.placement.dtype).replace("torch.", ""),
        split="test",
        offset=args.offset,
        seconds=round(time.perf_counter() - start, 1),
    )
    if args.json:
        print(json.dumps(r))
    elif args.markdown:
        print(markdown(r))
    else:
        print(
            f"{r['model']} ({r['dtype']}): PSNR {r['psnr']:.2f} dB, SSIM {r['ssim']:.4f} on {r['n']} held-out scenes "
            f"(one object {r['psnr_one_object']:.2f} dB, two {r['psnr_two_objects']:.2f} dB; 5th percentile {r['psnr_p5']:.2f} dB)"
        )
        print(
            f"latent std per channel x scaling_factor {r['scaling_factor']}: {r['scaled_latents']['std']} (overall {r['scaled_latents']['overall_std']}); "
            f"mean {r['scaled_latents']['mean']}; posterior std {r['posterior_std']}"
        )
        print("decoded with latent noise: " + ", ".join(f"{k} {v} dB" for k, v in r.items() if k.startswith("psnr_noise")))


if __name__ == "__main__":
    main()
