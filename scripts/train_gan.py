#!/usr/bin/env python
"""Train the embedded default DCGAN (``weights/gan-shapes``) on the shapes world.

    nohup nice -n 10 python scripts/train_gan.py --out runs/gan --threads 1 > runs/gan.log 2>&1 &
    python scripts/train_gan.py --out runs/gan --export weights/gan-shapes    # export the best checkpoint

Recipe: a fresh batch of train-split scenes every step (64x64, in [-1, 1]); the hinge loss
(Lim & Ye 2017) with spectral normalisation on every discriminator layer (Miyato et al. 2018), Adam
with betas (0, 0.9) and the two-timescale rule (the discriminator's learning rate twice the
generator's), held for the first half of the run and then decayed along a cosine (``--decay-start``);
differentiable augmentation (DiffAugment, Zhao et al. 2020: a random translation, and optionally a
cutout, applied to every image the discriminator sees, real and generated alike, ``--diffaug``); a
lazy R1 penalty on real images (``--r1``, Mescheder et al. 2018), without which the same run fell
back to three or four shapes within 500 steps; an
exponential moving average of the generator's weights (``--ema``) is what gets exported (the usual GAN
practice: the average generator is smoother than the last iterate).

Model selection as GAN practice does it with FID: every ``--eval-every`` steps the averaged generator
is judged on ``--eval-n`` samples by the default classifier (vit-shapes) against scenes of the
*validation* split (the final figures of ``scripts/eval_generative.py`` use the test split and other
seeds), and the checkpoint with the lowest Frechet distance is kept in ``OUT/best.pt`` and exported.
The spectral normalisation is folded into the exported discriminator weights, which then need nothing
else at inference. Atomic checkpoints in ``OUT/ckpt.pt`` that a rerun with the same ``--out`` resumes.
"""

from __future__ import annotations

import copy
import functools
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gencli.data import shapes  # noqa: E402
from gencli.models.gan import DCGAN, DCGANConfig  # noqa: E402
from gencli.pipelines.generative.loading import save_generative  # noqa: E402
from gencli.training import StepBudget, load_checkpoint, parse_training_args, prefetched, resume, save_checkpoint, set_lr, training_parser, warmup_cosine_lr  # noqa: E402
from scripts.train_vae import SIZE, batch  # noqa: E402  (the same stream of training scenes)


def add_spectral_norm(module: nn.Module) -> None:
    for m in list(module.modules()):
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            spectral_norm(m)


def fold_spectral_norm(module: nn.Module) -> None:
    for m in list(module.modules()):
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)


def diff_augment(x: torch.Tensor, policy: tuple[str, ...], gen: torch.Generator) -> torch.Tensor:
    """DiffAugment's colour-free policies, differentiable in ``x`` ``(B, C, S, S)``: ``translation``
    shifts each image by up to 1/8 of its side (the uncovered border is 0, mid-grey), ``cutout``
    blanks one square of half the side at a random place."""
    b, _, s, _ = x.shape
    dev = x.device  # the draws come from the CPU generator (the same stream on every device)
    if "translation" in policy:
        pad = s // 8
        shift = torch.randint(-pad, pad + 1, (2, b), generator=gen).to(dev)
        padded = F.pad(x, (pad, pad, pad, pad))
        rows = (torch.arange(s, device=dev)[None, :] + pad - shift[0][:, None]).clamp(0, s + 2 * pad - 1)  # (B, S)
        cols = (torch.arange(s, device=dev)[None, :] + pad - shift[1][:, None]).clamp(0, s + 2 * pad - 1)
        idx = torch.arange(b, device=dev)[:, None, None]
        x = padded.permute(0, 2, 3, 1)[idx, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    if "cutout" in policy:
        half = s // 2
        corner = torch.randint(0, s - half + 1, (2, b), generator=gen).to(dev)
        r = torch.arange(s, device=dev)[None, :]
        inside_r = (r >= corner[0][:, None]) & (r < corner[0][:, None] + half)
        inside_c = (r >= corner[1][:, None]) & (r < corner[1][:, None] + half)
        keep = ~(inside_r[:, :, None] & inside_c[:, None, :])
        x = x * keep[:, None].to(x.dtype)
    return x


class Judge:
    """The selection metric: vit-shapes' Frechet distance (and recognised share, class coverage)
    of the averaged generator's samples against validation-split scenes."""

    def __init__(self, n: int, latent_dim: int, device: str = "cpu"):
        from gencli.pipelines.generative.quality import judge_images
        from gencli.pipelines.vision.classify import ImageClassifier
        from gencli.weights import resolve_model

        # (the training's threads: left to itself, loading picks one thread for this small model, for the whole process)
        self.clf = ImageClassifier.load(resolve_model(None, "vit-shapes"), device=device, dtype="float32", threads=torch.get_num_threads())
        self.classes = [self.clf.labels[i] for i in sorted(self.clf.labels)]
        real, _ = shapes.render_batch(shapes.split_seeds("validation", n), SIZE)
        self.reference = judge_images(self.clf, real)
        self.latents = torch.randn(n, latent_dim, generator=torch.Generator().manual_seed(987_654)).to(device)

    @torch.inference_mode()
    def __call__(self, generator: nn.Module) -> dict:
        from gencli.pipelines.diffusion.vae import tensor_to_images
        from gencli.pipelines.generative.quality import judge_images, sample_report

        images = np.concatenate([tensor_to_images(generator(z).float()) for z in self.latents.split(100)])
        return sample_report(judge_images(self.clf, images), self.reference, self.classes)


def main() -> None:
    p = training_parser(__doc__.split("\n\n")[0], out="runs/gan", steps=2400, batch=32, lr=2e-4)
    p.add_argument("--g-widths", default="256,128,64,32")
    p.add_argument("--d-widths", default="32,64,128,256")
    p.add_argument("--latent-dim", type=int, default=64)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--decay-start", type=float, default=0.5, help="fraction of --steps after which the learning rates decay (cosine to 0)")
    p.add_argument("--diffaug", default="translation", help="DiffAugment policies ('' for none)")
    p.add_argument("--r1", type=float, default=0.1, help="R1 penalty weight on real images (0: off), applied every 16 steps")
    p.add_argument("--eval-every", type=int, default=250, help="judge the averaged generator every N steps and keep the best (0: off)")
    p.add_argument("--eval-n", type=int, default=500)
    args = parse_training_args(p)
    config = DCGANConfig(
        image_size=SIZE, latent_dim=args.latent_dim,
        generator_channels=tuple(int(w) for w in args.g_widths.split(",")),
        discriminator_channels=tuple(int(w) for w in args.d_widths.split(",")),
    )  # fmt: skip
    device = torch.device(args.device)
    model = DCGAN(config).to(device)
    add_spectral_norm(model.discriminator)
    ema = copy.deepcopy(model.generator).requires_grad_(False)
    opt_g = torch.optim.Adam(model.generator.parameters(), lr=args.lr, betas=(0.0, 0.9))
    opt_d = torch.optim.Adam(model.discriminator.parameters(), lr=2 * args.lr, betas=(0.0, 0.9))
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "ckpt.pt"
    best_path = args.out / "best.pt"
    step, command, state = resume(ckpt_path, model=model, ema=ema, opt_g=opt_g, opt_d=opt_d)
    best = (state or {}).get("best", {"frechet_distance": float("inf")})
    if state and "steps" in state and args.time_budget:  # a resumed --time-budget run goes on from the length it planned
        args.steps = state["steps"]
    gen = torch.Generator().manual_seed(1234 + step)
    policy = tuple(p for p in args.diffaug.split(",") if p)
    judge = Judge(args.eval_n, config.latent_dim, args.device) if args.eval_every and args.export is None else None
    G, D = model.generator, model.discriminator

    def aug(x: torch.Tensor) -> torch.Tensor:
        return diff_augment(x, policy, gen) if policy else x

    t0 = time.time()
    budget = StepBudget(args.time_budget)
    budget.begin(step)
    data = prefetched(functools.partial(batch, size=args.batch), step, 10**9, args.data_workers if args.export is None else 0)
    while step < args.steps and args.export is None:
        lr = warmup_cosine_lr(step, args.steps, args.lr, decay_start=int(args.decay_start * args.steps))
        set_lr(opt_g, lr)
        set_lr(opt_d, 2 * lr)
        real = next(data).to(device, non_blocking=True)
        z = torch.randn(args.batch, config.latent_dim, generator=gen).to(device)
        r1 = args.r1 > 0 and step % 16 == 0
        with torch.autocast(device.type, dtype=torch.bfloat16):
            fake = G(z)
            real_in = aug(real).requires_grad_(r1)
            real_logits = D(real_in)
            d_loss = torch.relu(1 - real_logits).mean() + torch.relu(1 + D(aug(fake.detach()))).mean()
        if r1:  # lazy R1 (Mescheder et al. 2018), scaled by the interval as StyleGAN2 does
            (grad,) = torch.autograd.grad(real_logits.float().sum(), real_in, create_graph=True)
            d_loss = d_loss + args.r1 * 16 / 2 * grad.float().pow(2).flatten(1).sum(1).mean()
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        opt_d.step()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            g_loss = -D(aug(fake)).float().mean()
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
        planned = budget.steps(step)
        if planned is not None:
            args.steps = planned
            print(f"{budget.seconds_per_step * 1000:.1f} ms/step: the run ends at step {planned}", flush=True)
        if step % 50 == 0:
            print(f"step {step} lr {lr:.2e} d {d_loss.item():.3f} g {g_loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
        judged = judge is not None and (step % args.eval_every == 0 or step == args.steps)
        if judged:
            report = judge(ema)
            better = report["frechet_distance"] < best["frechet_distance"]
            cls = report["classes"]
            print(f"eval step {step}: fd {report['frechet_distance']:.1f} recognised {report['recognised']:.3f} "
                  f"classes {cls['classes_present']} min share {cls['min_share']:.3f}{'  (best)' if better else ''}", flush=True)  # fmt: skip
            if better:
                best = {**report, "step": step}
                save_checkpoint(best_path, {"model": model.state_dict(), "ema": ema.state_dict(), "step": step, "best": best})
        if judged or step % args.ckpt_every == 0 or step == args.steps:
            save_checkpoint(ckpt_path, {"model": model.state_dict(), "ema": ema.state_dict(), "opt_g": opt_g.state_dict(),
                                        "opt_d": opt_d.state_dict(), "step": step, "steps": args.steps, "command": command, "best": best})  # fmt: skip
    chosen = load_checkpoint(best_path)
    if chosen is not None:  # the selected checkpoint (the last one when selection is off)
        model.load_state_dict(chosen["model"])
        ema.load_state_dict(chosen["ema"])
        print(f"exporting the best checkpoint: step {chosen['step']}, {chosen['best']}", flush=True)
        step = chosen["step"]
    model.cpu()
    ema.cpu()
    fold_spectral_norm(model.discriminator)
    model.generator.load_state_dict(ema.state_dict())
    folder = args.export or args.out / "model"
    save_generative(model.float().eval(), folder, dtype=torch.float16, metadata={"steps": str(step), "command": command})
    print(f"exported to {folder}", flush=True)


if __name__ == "__main__":
    main()
