#!/usr/bin/env python
"""Train the embedded default DCGAN (``weights/gan-shapes``) on the shapes world.

    nohup nice -n 10 python scripts/train_gan.py --out runs/gan --threads 1 > runs/gan.log 2>&1 &
    python scripts/train_gan.py --out runs/gan --export weights/gan-shapes    # export the last checkpoint

Recipe: a fresh batch of train-split scenes every step (64x64, in [-1, 1]); the hinge loss
(Lim & Ye 2017) with spectral normalisation on every discriminator layer (Miyato et al. 2018), Adam
with betas (0, 0.9) and the two-timescale rule (the discriminator's learning rate twice the
generator's); an exponential moving average of the generator's weights (``--ema``) is what gets
exported (the usual GAN practice: the average generator is smoother than the last iterate). The
spectral normalisation is folded into the exported discriminator weights, which then need nothing
else at inference. Atomic checkpoints in ``OUT/ckpt.pt`` that a rerun with the same ``--out`` resumes.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gencli.models.gan import DCGAN, DCGANConfig  # noqa: E402
from gencli.pipelines.generative import save_generative  # noqa: E402
from gencli.training import parse_training_args, resume, save_checkpoint, training_parser  # noqa: E402
from scripts.train_vae import SIZE, batch  # noqa: E402  (the same stream of training scenes)


def add_spectral_norm(module: nn.Module) -> None:
    for m in list(module.modules()):
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            spectral_norm(m)


def fold_spectral_norm(module: nn.Module) -> None:
    for m in list(module.modules()):
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)


def main() -> None:
    p = training_parser(__doc__.split("\n\n")[0], out="runs/gan", steps=400, batch=32, lr=2e-4)
    p.add_argument("--g-widths", default="256,128,64,32")
    p.add_argument("--d-widths", default="32,64,128,256")
    p.add_argument("--latent-dim", type=int, default=64)
    p.add_argument("--ema", type=float, default=0.999)
    args = parse_training_args(p)
    config = DCGANConfig(
        image_size=SIZE, latent_dim=args.latent_dim,
        generator_channels=tuple(int(w) for w in args.g_widths.split(",")),
        discriminator_channels=tuple(int(w) for w in args.d_widths.split(",")),
    )  # fmt: skip
    model = DCGAN(config)
    add_spectral_norm(model.discriminator)
    ema = copy.deepcopy(model.generator).requires_grad_(False)
    opt_g = torch.optim.Adam(model.generator.parameters(), lr=args.lr, betas=(0.0, 0.9))
    opt_d = torch.optim.Adam(model.discriminator.parameters(), lr=2 * args.lr, betas=(0.0, 0.9))
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "ckpt.pt"
    step, command, _ = resume(ckpt_path, model=model, ema=ema, opt_g=opt_g, opt_d=opt_d)
    gen = torch.Generator().manual_seed(1234 + step)
    G, D = model.generator, model.discriminator
    t0 = time.time()
    while step < args.steps and args.export is None:
        real = batch(step, args.batch)
        z = torch.randn(args.batch, config.latent_dim, generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fake = G(z)
            d_loss = torch.relu(1 - D(real)).mean() + torch.relu(1 + D(fake.detach())).mean()
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        opt_d.step()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            g_loss = -D(fake).float().mean()
        opt_g.zero_grad(set_to_none=True)
        g_loss.backward()
        opt_g.step()
        with torch.no_grad():
            decay = min(args.ema, (1 + step) / (10 + step))
            for pe, pg in zip(ema.parameters(), G.parameters()):
                pe.lerp_(pg, 1 - decay)
            for be, bg in zip(ema.buffers(), G.buffers()):
                be.copy_(bg)
        step += 1
        if step % 50 == 0:
            print(f"step {step} d {float(d_loss):.3f} g {float(g_loss):.3f} ({time.time() - t0:.0f}s)", flush=True)
        if step % args.ckpt_every == 0 or step == args.steps:
            save_checkpoint(ckpt_path, {"model": model.state_dict(), "ema": ema.state_dict(), "opt_g": opt_g.state_dict(),
                                        "opt_d": opt_d.state_dict(), "step": step, "command": command})  # fmt: skip
    fold_spectral_norm(model.discriminator)
    model.generator.load_state_dict(ema.state_dict())
    folder = args.export or args.out / "model"
    save_generative(model.float().eval(), folder, dtype=torch.float16, metadata={"steps": str(step), "command": command})
    print(f"exported to {folder}", flush=True)


if __name__ == "__main__":
    main()
