#!/usr/bin/env python
"""Train the embedded default latent autoencoder (``weights/autoencoder-shapes``) on the shapes world.

    nohup python scripts/train_autoencoder.py --out runs/autoencoder --threads 1 > runs/autoencoder.log 2>&1 &
    python scripts/train_autoencoder.py --out runs/autoencoder --export weights/autoencoder-shapes   # export the last checkpoint
    python scripts/eval_autoencoder.py                                                              # held-out PSNR/SSIM

The model is a diffusers ``AutoencoderKL`` (the Stable Diffusion VAE's layout, small widths): 3 image
channels, 4 latent channels, three blocks (two downsamplings, so a 64x64 scene becomes a 16x16x4
latent), ``layers_per_block`` ResNet blocks per encoder block (one more per decoder block), the
mid-block self-attention, ``quant_conv``/``post_quant_conv``. The text-to-image default is trained in
its latent space, so the recipe aims at crisp reconstructions *and* a well-behaved latent space:

- data: a fresh batch of shapes-world scenes every step (``gencli.data.shapes``, train split seeds
  only, consecutive seeds, one- and two-object scenes as the world draws them) at 64x64, in [-1, 1];
- the posterior starts narrow (``--logvar-init``: log-variance -6, i.e. standard deviation 0.05,
  instead of about 1 with the default initialisation, which drowns the latents in noise for the
  first thousand steps);
- posterior sampling during training (``z = mean + std * eps``) with the KL term of latent diffusion
  (``--kl-weight``, 1e-6 as in Stable Diffusion's VAE, with the reconstruction and KL terms both
  summed over each image); the decoder thereby learns to tolerate latent noise;
- reconstruction loss: the pixels' squared error, a little absolute error (``--l1-weight``), and
  ``--grad-weight`` times the squared error of the images' horizontal and vertical finite
  differences (an edge term: it weights the shapes' outlines, which carry most of the error once the
  flat colours are right). Squared errors, not L1 alone: with L1 every pixel pulls with the same
  force, the background's 95% of the pixels drown the objects' gradient (under Adam's
  normalisation) and after 450 steps the reconstructions were backgrounds with faint blobs
  (17 dB at step 250);
- the trained weights themselves are exported: an exponential moving average of them (decay 0.999,
  tried from step 600 of the embedded default's run) evaluated 3.3 dB worse at step 1500 (25.6 dB
  against 28.9 dB on the validation scenes): it averages the weights of a model still improving
  fast, and the cosine decay already settles them at the end;
- AdamW, linear warmup then cosine decay (``gencli.training.warmup_cosine_lr``), gradient clipping at 1,
  bf16 autocast on the CPU (AMX) with fp32 master weights, channels-last activations, the plain
  ("math") attention kernel (the CPU flash kernel's backward is slower at these sizes);
- checkpoints every ``--ckpt-every`` steps into ``OUT/ckpt.pt`` (atomic, ``gencli.training``); the run
  resumes from it when started again with the same ``--out``; the command lines of a run are kept in
  the checkpoint and written into the export;
- every ``--eval-every`` steps: PSNR of the posterior mean's reconstruction on validation scenes and the
  latents' per-channel mean and standard deviation.

Export (``--export DIR``, or at the end into ``OUT/model``) writes a diffusers ``vae/`` folder:
``config.json`` (``_class_name: AutoencoderKL``) + ``diffusion_pytorch_model.safetensors``, with
``scaling_factor`` set to 1 / (the standard deviation of posterior samples of ``--scale-n`` training
scenes), as Stable Diffusion's 0.18215 was, so that scaled latents have unit variance for the
diffusion model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gencli.data import shapes  # noqa: E402
from gencli.models.autoencoder_kl.model import AutoencoderKL, AutoencoderKLConfig  # noqa: E402
from gencli.pipelines.diffusion.vae import images_to_tensor, save_autoencoder, tensor_to_images  # noqa: E402
from gencli.pipelines.generative.metrics import psnr  # noqa: E402
from gencli.training import command_history, load_checkpoint, save_checkpoint, set_lr, warmup_cosine_lr  # noqa: E402

SIZE = 64


def model_config(args) -> AutoencoderKLConfig:
    widths = tuple(int(w) for w in args.widths.split(","))
    return AutoencoderKLConfig(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(widths),
        up_block_types=("UpDecoderBlock2D",) * len(widths),
        block_out_channels=widths,
        layers_per_block=args.layers_per_block,
        latent_channels=args.latent_channels,
        norm_num_groups=args.groups,
        sample_size=SIZE,
        force_upcast=False,
    )


def init_log_variance(model: AutoencoderKL, value: float) -> None:
    """Start the posterior narrow: the log-variance half of the moments is the constant ``value``
    (zero weights in the last 1x1 ``quant_conv``, or in the encoder's ``conv_out`` without one).

    With the default initialisation the posterior's standard deviation starts near 1, as large as
    the latents themselves, and the decoder spends its first thousand steps learning through the
    noise while Adam walks the log-variance down a few thousandths per step (measured: 16 dB after
    250 steps, posterior std still 0.5-0.8). Starting at exp(-6 / 2) = 0.05 the KL term can still
    widen it where reconstruction allows."""
    layer = model.quant_conv if model.quant_conv is not None else model.encoder.conv_out
    c = model.config.latent_channels
    with torch.no_grad():
        layer.weight[c:].zero_()
        layer.bias[c:].fill_(value)


def batch(step: int, size: int) -> torch.Tensor:
    """The scenes of training step ``step``: consecutive train-split seeds, never reused."""
    images, _ = shapes.render_batch(shapes.split_seeds("train", size, offset=step * size), SIZE)
    return images_to_tensor(images)


def gradient_mse(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Mean squared difference between the images' horizontal and vertical finite differences."""
    dx = (y[..., :, 1:] - y[..., :, :-1]) - (x[..., :, 1:] - x[..., :, :-1])
    dy = (y[..., 1:, :] - y[..., :-1, :]) - (x[..., 1:, :] - x[..., :-1, :])
    return dx.pow(2).mean() + dy.pow(2).mean()


@torch.no_grad()
def evaluate(model: AutoencoderKL, images: torch.Tensor, batch_size: int = 64) -> dict:
    """PSNR (mean of the posterior, uint8 round trip) and latent statistics on ``images``."""
    model.eval()
    scores, latents = [], []
    for i in range(0, len(images), batch_size):
        x = images[i : i + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            post = model.encode(x)
            y = model.decode(post.mean)
        latents.append(post.mean.float())
        scores.append(psnr(tensor_to_images(y.float()), tensor_to_images(x)))
    model.train()
    z = torch.cat(latents)
    return {
        "psnr": round(float(torch.cat(scores).mean()), 3),
        "latent_mean": [round(v, 3) for v in z.mean(dim=(0, 2, 3)).tolist()],
        "latent_std": [round(v, 3) for v in z.std(dim=(0, 2, 3)).tolist()],
    }


@torch.no_grad()
def measure_scaling(model: AutoencoderKL, n: int, batch_size: int = 64) -> dict:
    """Statistics of posterior samples on ``n`` training scenes (fixed seeds); ``scaling_factor`` = 1/std."""
    model.eval()
    g = torch.Generator().manual_seed(0)
    zs = []
    for start in range(0, n, batch_size):
        size = min(batch_size, n - start)
        images, _ = shapes.render_batch(shapes.split_seeds("train", size, offset=start), SIZE)
        zs.append(model.encode(images_to_tensor(images)).sample(g))
    z = torch.cat(zs)
    return {"std": float(z.std()), "mean": float(z.mean()), "channel_std": z.std(dim=(0, 2, 3)).tolist(), "channel_mean": z.mean(dim=(0, 2, 3)).tolist()}


def export(model: AutoencoderKL, folder: Path, args, meta: dict) -> None:
    model = model.float().eval().to(memory_format=torch.contiguous_format)
    stats = measure_scaling(model, args.scale_n)
    model.config.scaling_factor = round(1.0 / stats["std"], 5)
    dtype = {"float16": torch.float16, "float32": torch.float32}[args.export_dtype]
    meta = {**meta, "latent_std": f"{stats['std']:.5f}", "latent_mean": f"{stats['mean']:.5f}", "scale_n": str(args.scale_n)}
    save_autoencoder(model, folder, dtype=dtype, metadata=meta)
    print(f"exported to {folder}: scaling_factor {model.config.scaling_factor} (latent std {stats['std']:.4f}, mean {stats['mean']:.4f}; "
          f"per channel std {[round(v, 3) for v in stats['channel_std']]})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/autoencoder"))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--widths", default="32,64,128", help="block_out_channels (one downsampling between consecutive blocks)")
    p.add_argument("--layers-per-block", type=int, default=1)
    p.add_argument("--groups", type=int, default=16, help="norm_num_groups")
    p.add_argument("--latent-channels", type=int, default=4)
    p.add_argument("--kl-weight", type=float, default=1e-6, help="KL weight, both terms summed over each image (latent diffusion: 1e-6)")
    p.add_argument("--logvar-init", type=float, default=-6.0, help="initial posterior log-variance (see init_log_variance)")
    p.add_argument("--mse-weight", type=float, default=1.0, help="weight of the pixels' mean squared error")
    p.add_argument("--l1-weight", type=float, default=0.1, help="weight of the pixels' mean absolute error")
    p.add_argument("--grad-weight", type=float, default=1.0, help="weight of the finite-difference (edge) squared-error term")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-n", type=int, default=256, help="validation scenes of the periodic evaluation")
    p.add_argument("--scale-n", type=int, default=1024, help="training scenes whose latents set scaling_factor at export")
    p.add_argument("--export-dtype", choices=["float16", "float32"], default="float16")
    p.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this step without exporting")
    p.add_argument("--export", type=Path, default=None, help="only export the last checkpoint to this folder and exit")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    config = model_config(args)
    model = AutoencoderKL(config)
    init_log_variance(model, args.logvar_init)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=args.wd)
    ckpt_path = args.out / "ckpt.pt"
    state = load_checkpoint(ckpt_path)
    step, history, command = 0, [], None
    if state is not None:
        saved = AutoencoderKLConfig.from_dict(state["config"])
        if saved != config:
            raise SystemExit(f"{ckpt_path} holds a model configured as {saved}, not {config}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history, command = int(state["step"]), list(state["history"]), state["command"]
        print(f"resumed at step {step}", flush=True)
    if args.export is None:
        command = command_history(command, step)
    meta = {"steps": str(step), "command": command or "", "world_version": str(shapes.WORLD_VERSION), "batch": str(args.batch)}
    if args.export is not None:
        export(model, args.export, args, meta)
        return

    n_params = sum(t.numel() for t in model.parameters())
    print(f"AutoencoderKL {config.block_out_channels} x{config.layers_per_block}, {n_params / 1e6:.2f}M parameters; {vars(args)}", flush=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = model.to(memory_format=torch.channels_last).train()
    val = images_to_tensor(shapes.render_batch(shapes.split_seeds("validation", args.eval_n), SIZE)[0])
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    stop = min(args.steps, args.stop_after or args.steps)
    t0, sums, seen = time.time(), np.zeros(5), 0
    pixels = SIZE * SIZE * config.in_channels
    while step < stop:
        x = batch(step, args.batch).contiguous(memory_format=torch.channels_last)
        set_lr(opt, warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=0.02))
        with sdpa_kernel(SDPBackend.MATH), torch.autocast("cpu", dtype=torch.bfloat16):
            post = model.encode(x)
            y = model.decode(post.sample(gen)).float()
        mse = (y - x).pow(2).mean()
        l1 = (y - x).abs().mean()
        edge = gradient_mse(y, x)
        kl = post.kl().float().mean() / pixels  # per image sum, in the per-pixel units of the means
        loss = args.mse_weight * mse + args.l1_weight * l1 + args.grad_weight * edge + args.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        sums += (loss.item(), mse.item(), l1.item(), edge.item(), kl.item() * pixels)
        seen += 1
        if step % 25 == 0:
            s = sums / seen
            print(f"step {step} loss {s[0]:.4f} mse {s[1]:.5f} l1 {s[2]:.4f} edge {s[3]:.5f} kl {s[4]:.0f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{(time.time() - t0) / seen:.2f}s/step", flush=True)
            t0, sums, seen = time.time(), np.zeros(5), 0
        if step % args.eval_every == 0 or step == stop:
            res = evaluate(model, val.contiguous(memory_format=torch.channels_last))
            history.append({"step": step, **res})
            print("eval " + json.dumps({"step": step, **res}), flush=True)
            t0 = time.time()
        if step % args.ckpt_every == 0 or step == stop:
            save_checkpoint(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "history": history,
                                        "command": command, "config": config.to_dict(), "args": {k: str(v) for k, v in vars(args).items()}})
    if step < args.steps:
        return
    meta["steps"] = str(step)
    export(model, args.out / "model", args, meta)


if __name__ == "__main__":
    main()
