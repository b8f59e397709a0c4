#!/usr/bin/env python
"""Train the embedded default convolutional VAE (``weights/vae-shapes``) on the shapes world.

    nohup nice -n 10 python scripts/train_vae.py --out runs/vae --threads 1 > runs/vae.log 2>&1 &
    python scripts/train_vae.py --out runs/vae --export weights/vae-shapes    # export the last checkpoint

Recipe: a fresh batch of train-split scenes every step (64x64, one or two objects, in [-1, 1]);
loss per image = summed squared error / (2 * sigma^2) + KL to the standard normal (the Gaussian
likelihood with a fixed ``--sigma``: a smaller sigma weights reconstruction over the prior, a
beta-VAE with beta = 2 sigma^2); AdamW with warmup + cosine decay (``gencli.training``); atomic
checkpoints in ``OUT/ckpt.pt`` that a rerun with the same ``--out`` resumes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gencli.data import shapes  # noqa: E402
from gencli.models.vae import ConvVAE, ConvVAEConfig  # noqa: E402
from gencli.pipelines.diffusion.vae import images_to_tensor  # noqa: E402
from gencli.pipelines.generative.loading import save_generative  # noqa: E402
from gencli.training import parse_training_args, resume, save_checkpoint, set_lr, training_parser, warmup_cosine_lr  # noqa: E402

SIZE = 64


def batch(step: int, size: int) -> torch.Tensor:
    images, _ = shapes.render_batch(shapes.split_seeds("train", size, offset=step * size), SIZE)
    return images_to_tensor(images)


def main() -> None:
    p = training_parser(__doc__.split("\n\n")[0], out="runs/vae", steps=450, batch=32, lr=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--widths", default="32,64,128,128")
    p.add_argument("--latent-dim", type=int, default=64)
    p.add_argument("--sigma", type=float, default=0.1, help="the decoder's fixed Gaussian standard deviation (images in [-1, 1])")
    args = parse_training_args(p)
    config = ConvVAEConfig(image_size=SIZE, latent_dim=args.latent_dim, block_out_channels=tuple(int(w) for w in args.widths.split(",")))
    model = ConvVAE(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "ckpt.pt"
    step, command, _ = resume(ckpt_path, model=model, optimizer=opt)
    if args.export is None or step < args.steps:
        model.train()
        t0 = time.time()
        while step < args.steps:
            set_lr(opt, warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=0.02 * args.lr))
            x = batch(step, args.batch).contiguous(memory_format=torch.channels_last)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                recon, posterior = model(x)
            rec = (recon.float() - x).pow(2).sum(dim=(1, 2, 3)) / (2 * args.sigma**2)
            kl = posterior.kl()
            loss = (rec + kl).mean() / x[0].numel()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 50 == 0:
                mse = float((recon.float() - x).pow(2).mean())
                print(f"step {step} loss {float(loss):.4f} mse {mse:.5f} kl {float(kl.mean()):.1f} ({time.time() - t0:.0f}s)", flush=True)
            if step % args.ckpt_every == 0 or step == args.steps:
                save_checkpoint(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "command": command})
    folder = args.export or args.out / "model"
    save_generative(model.float().eval(), folder, dtype=torch.float16, metadata={"steps": str(step), "command": command})
    print(f"exported to {folder}", flush=True)


if __name__ == "__main__":
    main()
