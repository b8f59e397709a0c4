"""Train the embedded default segmenter ``weights/unet-shapes``: a small U-Net
(:class:`gencli.models.unet_segmenter.UNetSegmenter`) that labels every pixel of a shapes-world scene
with its shape (9 classes: background + the eight shapes), from the scenes' exact masks
(:func:`gencli.data.shapes.render_mask`).

Data: train-split scenes rendered on the fly, one or two objects (``--two-objects``: the share of
two-object scenes), each step at one size drawn from ``--sizes`` with about the same number of pixels
per step (``--batch`` scenes at 64x64, fewer at larger sizes). Each step's scenes depend on the step
alone, so a resumed run sees what an uninterrupted one would. Loss: per-pixel cross-entropy plus a
soft Dice term over the classes (the small shapes count as much as the background). AdamW, warmup
and cosine decay; ``--time-budget`` re-plans the steps so the run ends in time.

Resumable: the state goes to ``--out``/state.pt every ``--ckpt-every`` steps (atomically); run the
same command again to continue. ``--export DIR`` writes the model folder (config.json,
model.safetensors in fp16, preprocessor_config.json: images larger than 96 px on the shorter side resized down to it, [-1, 1]).

    python scripts/train_segmenter.py --data-workers 1 --time-budget 4000 --export weights/unet-shapes
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gencli.checkpoints.loader import save_model  # noqa: E402
from gencli.data import shapes  # noqa: E402
from gencli.models.unet_segmenter import UNetSegmenter, UNetSegmenterConfig  # noqa: E402
from gencli.training import StepBudget, parse_training_args, prefetched, resume, save_checkpoint, set_lr, training_parser, warmup_cosine_lr  # noqa: E402

PREPROCESSOR = {
    "image_processor_type": "ViTImageProcessor",
    # images whose shorter side exceeds 96 px, the largest size seen in training, are resized down to
    # it (the class map is resized back to the image): larger objects outgrow what the U-Net learnt;
    # smaller images run at their own size ("only_shrink", read by gencli's segmentation pipeline)
    "do_resize": True,
    "size": {"shortest_edge": 96},
    "only_shrink": True,
    "resample": 2,
    "do_center_crop": False,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}


def make_batch(step: int, batch: int, sizes: list[int], two_objects: float, seed_offset: int = 0):
    """The scenes of one step: ``(images (B, 3, S, S) float in [-1, 1], masks (B, S, S) int64)``."""
    rng = np.random.default_rng(10_000_019 * step + 7)
    size = int(sizes[rng.integers(len(sizes))])
    n = max(2, round(batch * (64 / size) ** 2))
    first = shapes.SPLITS["train"].start + seed_offset + step * 64
    images = np.empty((n, size, size, 3), np.uint8)
    masks = np.empty((n, size, size), np.uint8)
    for i in range(n):
        k = 2 if rng.random() < two_objects else 1
        images[i], masks[i], _ = shapes.render_with_mask(first + i, size, n_objects=k)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)
    return x, torch.from_numpy(masks).long()


def dice_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 - the soft Dice coefficient, averaged over the classes present in the batch."""
    probs = logits.softmax(1)
    onehot = F.one_hot(target, logits.shape[1]).permute(0, 3, 1, 2).to(probs.dtype)
    inter = (probs * onehot).sum((0, 2, 3))
    total = probs.sum((0, 2, 3)) + onehot.sum((0, 2, 3))
    present = onehot.sum((0, 2, 3)) > 0
    dice = (2 * inter + 1.0) / (total + 1.0)
    return 1.0 - dice[present].mean()


def export(model: UNetSegmenter, folder: Path, meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    save_model(model, folder / "model.safetensors", dtype=torch.float16, metadata={k: str(v) for k, v in meta.items()})
    print(f"exported {folder}", flush=True)


def main() -> None:
    p = training_parser(__doc__.splitlines()[0], out="runs/segmenter", steps=6000, batch=16, lr=3e-3)
    p.add_argument("--channels", default="8,16,32,64", help="widths of the levels")
    p.add_argument("--norm-groups", type=int, default=4)
    p.add_argument("--sizes", default="64,64,64,80,96", help="image sizes drawn per step")
    p.add_argument("--two-objects", type=float, default=0.5)
    p.add_argument("--dice", type=float, default=0.5, help="weight of the soft Dice loss")
    p.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this step without exporting")
    args = parse_training_args(p)
    args.out.mkdir(parents=True, exist_ok=True)
    state_path = args.out / "state.pt"
    config = UNetSegmenterConfig(
        channels=tuple(int(c) for c in args.channels.split(",")), norm_groups=args.norm_groups, id2label=dict(enumerate(shapes.MASK_CLASSES))
    )
    model = UNetSegmenter(config)
    model.init_weights(torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    step, command, state = resume(state_path, model=model, optimizer=opt)
    total = int(state["total"]) if state and "total" in state else args.steps
    sizes = [int(s) for s in args.sizes.split(",")]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.3f}M parameters; step {step} of {total}", flush=True)
    device = torch.device(args.device)
    model.to(device).train()
    budget = StepBudget(args.time_budget, every=50)
    budget.begin(step)
    t0 = time.time()
    ema = None

    def checkpoint() -> None:
        save_checkpoint(state_path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "total": total, "command": command})

    batches = prefetched(lambda s: make_batch(s, args.batch, sizes, args.two_objects), step, 10**9, args.data_workers)
    while step < total:
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        set_lr(opt, warmup_cosine_lr(step, total, args.lr, warmup=200, floor=0.02))
        logits = model(x)
        loss = F.cross_entropy(logits, y) + args.dice * dice_loss(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        planned = budget.steps(step)
        if planned is not None:
            total = max(step + 1, planned)
        if step % 50 == 0:
            print(f"step {step}/{total} loss {ema:.4f} {time.time() - t0:.0f}s", flush=True)
        if step % args.ckpt_every == 0 or step == total:
            checkpoint()
        if args.stop_after is not None and step >= args.stop_after:
            checkpoint()
            return
    checkpoint()
    if args.export is not None:
        model.eval().cpu()
        export(model, args.export, {"format": "pt", "trained_steps": step, "world_version": shapes.WORLD_VERSION})


if __name__ == "__main__":
    main()
