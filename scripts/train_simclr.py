"""Train the embedded default image encoder ``weights/simclr-shapes`` with SimCLR (Chen et al. 2020)
on shapes-world scenes, without their labels.

Each step draws ``--batch`` train-split scenes (one or two objects, rendered at ``--size``) and makes
two views of each by the paper's augmentations, done on the whole batch at once: a random resized
crop (area ``--crop-scale``, aspect ratio 3/4..4/3, back to the full size, bilinear), a horizontal
flip with probability 1/2, colour jitter with probability 0.8 (brightness, contrast, saturation
by up to 0.8 x ``--jitter``, hue by up to 0.2 x ``--jitter`` of a turn; the paper's strength ``s``)
and grayscale with probability 0.2. The encoder (:class:`gencli.models.simclr.SimCLREncoder`) maps
each view to its representation ``h``, the projection head ``g`` to ``z``; the NT-Xent loss
(normalised temperature-scaled cross-entropy, ``--temperature``) makes each view pick its partner
among the other ``2 * batch - 1`` views by cosine similarity. The head is dropped at export.

Each step's scenes and augmentations depend on the step alone, so a resumed run sees what an
uninterrupted one would. AdamW, warmup and cosine decay; ``--time-budget`` re-plans the steps so the
run ends in time. Resumable: the state goes to ``--out``/state.pt every ``--ckpt-every`` steps;
run the same command again to continue. ``--export DIR`` writes the encoder's folder (config.json,
model.safetensors in fp16, preprocessor_config.json: resize to ``--size``, [-1, 1]).

    python scripts/train_simclr.py --time-budget 3600 --export weights/simclr-shapes
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gencli.checkpoints.loader import save_model  # noqa: E402
from gencli.data import shapes  # noqa: E402
from gencli.models.simclr import SimCLRConfig, SimCLREncoder, SimCLRProjectionHead  # noqa: E402
from gencli.training import StepBudget, parse_training_args, prefetched, resume, save_checkpoint, set_lr, training_parser, warmup_cosine_lr  # noqa: E402


def preprocessor(size: int) -> dict:
    return {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": size, "width": size},
        "resample": 2,
        "do_center_crop": False,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
    }


def render_scenes(step: int, batch: int, size: int) -> torch.Tensor:
    """The step's scenes ``(B, 3, S, S)`` in [0, 1] (train split; each step its own seeds)."""
    first = shapes.SPLITS["train"].start + step * batch
    images, _ = shapes.render_batch(range(first, first + batch), size)
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)


def random_resized_crop(x: torch.Tensor, g: torch.Generator, scale: tuple[float, float], flip: float = 0.5) -> torch.Tensor:
    """A crop of random area fraction in ``scale`` and aspect ratio in [3/4, 4/3] of each image,
    resized back to the image's size (bilinear), mirrored left-right with probability ``flip``."""
    b = x.shape[0]
    area = torch.empty(b).uniform_(scale[0], scale[1], generator=g)
    log_ratio = torch.empty(b).uniform_(math.log(3 / 4), math.log(4 / 3), generator=g)
    ratio = log_ratio.exp()
    w = (area * ratio).sqrt().clamp(max=1.0)  # fractions of the side
    h = (area / ratio).sqrt().clamp(max=1.0)
    cx = (torch.rand(b, generator=g) * 2 - 1) * (1 - w)  # centres in [-1, 1] keeping the crop inside
    cy = (torch.rand(b, generator=g) * 2 - 1) * (1 - h)
    sign = torch.where(torch.rand(b, generator=g) < flip, -1.0, 1.0)
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = w * sign, cx
    theta[:, 1, 1], theta[:, 1, 2] = h, cy
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


_YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])


def colour_jitter(x: torch.Tensor, g: torch.Generator, strength: float, p: float = 0.8, p_gray: float = 0.2) -> torch.Tensor:
    """SimCLR's colour distortion on images in [0, 1]: with probability ``p`` brightness, contrast
    and saturation factors in [1 - 0.8 s, 1 + 0.8 s] and a hue rotation by up to 0.2 s of a turn
    (in YIQ space); then grayscale with probability ``p_gray``."""
    b = x.shape[0]

    def factor(spread: float) -> torch.Tensor:
        return torch.empty(b, 1, 1, 1).uniform_(max(0.0, 1 - spread), 1 + spread, generator=g)

    apply = (torch.rand(b, 1, 1, 1, generator=g) < p).float()
    gray = lambda t: (t * _YIQ[0].view(1, 3, 1, 1)).sum(1, keepdim=True)  # noqa: E731
    y = x * factor(0.8 * strength)
    mean = gray(y).mean((2, 3), keepdim=True)
    y = ((y - mean) * factor(0.8 * strength) + mean).clamp(0, 1)
    y = ((y - gray(y)) * factor(0.8 * strength) + gray(y)).clamp(0, 1)
    angle = torch.empty(b).uniform_(-0.2 * strength, 0.2 * strength, generator=g) * 2 * math.pi
    yiq = torch.einsum("ij,bjhw->bihw", _YIQ, y)
    c, s = angle.cos().view(b, 1, 1), angle.sin().view(b, 1, 1)
    i, q = yiq[:, 1], yiq[:, 2]
    yiq = torch.stack((yiq[:, 0], c * i - s * q, s * i + c * q), 1)
    y = torch.einsum("ij,bjhw->bihw", torch.linalg.inv(_YIQ), yiq).clamp(0, 1)
    x = apply * y + (1 - apply) * x
    to_gray = (torch.rand(b, 1, 1, 1, generator=g) < p_gray).float()
    return to_gray * gray(x).expand_as(x) + (1 - to_gray) * x


def make_views(step: int, batch: int, size: int, scale: tuple[float, float], strength: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Two augmented views ``(B, 3, S, S)`` of the step's scenes, in [-1, 1]."""
    x = render_scenes(step, batch, size)
    g = torch.Generator().manual_seed(1_000_003 * step + 11)
    views = []
    for _ in range(2):
        v = colour_jitter(random_resized_crop(x, g, scale), g, strength)
        views.append(v.mul_(2.0).sub_(1.0))
    return views[0], views[1]


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """The NT-Xent loss: each of the 2B views classifies its partner among the other 2B - 1 by
    cosine similarity / temperature (cross-entropy, averaged over the 2B views)."""
    z = F.normalize(torch.cat((z1, z2)), dim=1)
    b = z1.shape[0]
    sim = z @ z.t() / temperature
    sim.fill_diagonal_(float("-inf"))
    target = torch.cat((torch.arange(b, 2 * b), torch.arange(0, b))).to(z.device)
    return F.cross_entropy(sim, target)


def export(encoder: SimCLREncoder, folder: Path, meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(encoder.config.to_dict(), indent=2) + "\n")
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor(encoder.config.image_size), indent=2) + "\n")
    save_model(encoder, folder / "model.safetensors", dtype=torch.float16, metadata={k: str(v) for k, v in meta.items()})
    print(f"exported {folder}", flush=True)


def main() -> None:
    p = training_parser(__doc__.splitlines()[0], out="runs/simclr", steps=3000, batch=96, lr=2e-3)
    p.add_argument("--size", type=int, default=64, help="scene and view size")
    p.add_argument("--channels", default="32,64,128", help="widths of the stages")
    p.add_argument("--stem", type=int, default=32)
    p.add_argument("--layers-per-block", type=int, default=1)
    p.add_argument("--projection-dim", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--jitter", type=float, default=0.5, help="colour-jitter strength s")
    p.add_argument("--crop-scale", default="0.5,1.0", help="area fraction range of the random crops")
    p.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this step without exporting")
    args = parse_training_args(p)
    args.out.mkdir(parents=True, exist_ok=True)
    state_path = args.out / "state.pt"
    config = SimCLRConfig(
        image_size=args.size,
        stem_channels=args.stem,
        block_out_channels=tuple(int(c) for c in args.channels.split(",")),
        layers_per_block=args.layers_per_block,
        projection_dim=args.projection_dim,
    )
    encoder = SimCLREncoder(config)
    encoder.init_weights(torch.Generator().manual_seed(0))
    head = SimCLRProjectionHead(config.hidden_size, config.projection_dim)
    params = list(encoder.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)
    step, command, state = resume(state_path, model=encoder, head=head, optimizer=opt)
    total = int(state["total"]) if state and "total" in state else args.steps
    scale = tuple(float(s) for s in args.crop_scale.split(","))
    print(f"{sum(p.numel() for p in encoder.parameters()) / 1e6:.3f}M encoder parameters; step {step} of {total}", flush=True)
    device = torch.device(args.device)
    encoder.to(device).train()
    head.to(device).train()
    budget = StepBudget(args.time_budget, every=25)
    budget.begin(step)
    t0 = time.time()
    ema = acc_ema = None

    def checkpoint() -> None:
        save_checkpoint(
            state_path,
            {"model": encoder.state_dict(), "head": head.state_dict(), "optimizer": opt.state_dict(), "step": step, "total": total, "command": command},
        )

    batches = prefetched(lambda s: make_views(s, args.batch, args.size, scale, args.jitter), step, 10**9, args.data_workers)
    while step < total:
        v1, v2 = next(batches)
        v1, v2 = v1.to(device), v2.to(device)
        set_lr(opt, warmup_cosine_lr(step, total, args.lr, warmup=100, floor=0.02))
        z = head(encoder(torch.cat((v1, v2))))
        z1, z2 = z.chunk(2)
        loss = nt_xent(z1, z2, args.temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        with torch.no_grad():  # how often a view's nearest other view is its partner
            zn = F.normalize(z.detach(), dim=1)
            sim = zn @ zn.t()
            sim.fill_diagonal_(-2.0)
            b = v1.shape[0]
            acc = (sim.argmax(1).cpu() == torch.cat((torch.arange(b, 2 * b), torch.arange(b)))).float().mean().item()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        acc_ema = acc if acc_ema is None else 0.95 * acc_ema + 0.05 * acc
        planned = budget.steps(step)
        if planned is not None:
            total = max(step + 1, planned)
        if step % 25 == 0:
            print(f"step {step}/{total} loss {ema:.4f} partner-acc {acc_ema:.3f} {time.time() - t0:.0f}s", flush=True)
        if step % args.ckpt_every == 0 or step == total:
            checkpoint()
        if args.stop_after is not None and step >= args.stop_after:
            checkpoint()
            return
    checkpoint()
    if args.export is not None:
        encoder.eval().cpu()
        export(
            encoder,
            args.export,
            {"format": "pt", "trained_steps": step, "world_version": shapes.WORLD_VERSION, "batch": args.batch, "temperature": args.temperature},
        )


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
