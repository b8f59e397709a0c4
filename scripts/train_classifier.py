#!/usr/bin/env python
"""Train the embedded default image classifier (weights/vit-shapes) on the shapes world.

A small ViT in transformers' ViTForImageClassification layout learns the shape of the object in
single-object scenes (``gencli.data.shapes``, train split seeds). Scenes are drawn at 64x64 (15% at
another resolution, 40-160 px) and resized to the model's 63x63 input exactly as its preprocessing
does (PIL bilinear), so the classifier serves images of any size.

What makes a plain ViT learn this task quickly on a CPU (scripts/train_classifier.md has the measurements):
- 21-pixel patches on a 63x63 input: a 3x3 patch grid whose patch centres sit near the world's nine
  object positions, so an object mostly lies inside one patch; ten tokens make a step cheap;
- token labelling: every patch token of the last layer also predicts the shape of the object it
  covers, or "background", and the patch tokens after the second block predict their pixels' object
  mask (linear heads used only in training, not exported). The mask comes from the rendered image
  itself (pixels that differ from the scene's background colour). These dense targets teach the
  patch embedding colour-invariant shape features far faster than the class-token loss alone;
- colour-invariance augmentation: random channel permutation, inversion and horizontal flip (shape
  labels depend on neither colour nor left/right);
- 2D sine-cosine initial position embeddings; AdamW (lr 1e-3, 200 warmup steps, cosine), batch 128,
  label smoothing 0.1; bf16 autocast and the explicit ("math") attention kernel.

    python scripts/train_classifier.py                 # resumable (state in runs/classifier/)
    python scripts/eval_classifier.py                  # held-out accuracy of weights/vit-shapes

The final model is written in fp16 as config.json + model.safetensors + preprocessor_config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gencli.checkpoints.loader import save_model  # noqa: E402
from gencli.data import shapes  # noqa: E402
from gencli.models.vit import ViTConfig, ViTForImageClassification  # noqa: E402
from gencli.pipelines.vision.images import ImageProcessor  # noqa: E402
from gencli.training import load_checkpoint, save_checkpoint, set_lr, warmup_cosine_lr  # noqa: E402

IMAGE_SIZE = 63  # the model's input: 3x3 patches of 21 px
RENDER_SIZE = 64  # the scenes are drawn at 64x64 (and other sizes), then resized as the preprocessor does
BACKGROUND = len(shapes.SHAPES)  # the token-label class of patches without an object


def model_config(args) -> ViTConfig:
    return ViTConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        image_size=(IMAGE_SIZE, IMAGE_SIZE),
        patch_size=(args.patch, args.patch),
        id2label=dict(enumerate(shapes.SHAPES)),
    )


def processor() -> ImageProcessor:
    # rescale 1/255 and normalise with mean = std = 0.5: pixel values = x / 127.5 - 1
    return ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, resample=2, do_convert_rgb=True)


def scenes_batch(seeds, rng: np.random.Generator, other_res: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Model-size uint8 images, shape labels and per-pixel object coverage (0..1) of single-object
    scenes, drawn at 64x64 (a fraction ``other_res`` at another resolution) and resized as the
    preprocessor does (PIL bilinear on the uint8 image).
    """
    from PIL import Image

    images = np.empty((len(seeds), IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    labels = np.empty(len(seeds), np.int64)
    coverage = np.empty((len(seeds), IMAGE_SIZE, IMAGE_SIZE), np.float32)
    for i, seed in enumerate(seeds):
        res = RENDER_SIZE if rng.random() >= other_res else int(rng.integers(40, 161))
        sample = shapes.render(int(seed), res, n_objects=1)
        img = sample.image
        if res != IMAGE_SIZE:
            img = np.asarray(Image.fromarray(img).resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR))
        scene = sample.scene
        bg = np.asarray(scene.background_rgb, np.float32)
        full = np.abs(np.asarray(scene.main.rgb, np.float32) - bg).max()
        coverage[i] = np.clip(np.abs(img.astype(np.float32) - bg).max(-1) / max(full, 1.0), 0.0, 1.0)
        images[i] = img
        labels[i] = shapes.SHAPES.index(scene.main.shape)
    return images, labels, coverage


def augment(images: torch.Tensor, coverage: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Label-preserving colour and mirror augmentation of uint8 (B, H, W, 3) images."""
    b = images.shape[0]
    perm = torch.argsort(torch.rand(b, 3, generator=gen), dim=1)
    images = torch.gather(images, 3, perm[:, None, None, :].expand_as(images))
    invert = torch.rand(b, generator=gen) < 0.5
    images = torch.where(invert[:, None, None, None], 255 - images, images)
    flip = torch.rand(b, generator=gen) < 0.5
    images = torch.where(flip[:, None, None, None], images.flip(2), images)
    coverage = torch.where(flip[:, None, None], coverage.flip(2), coverage)
    return images, coverage


def to_pixels(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, H, W, 3) -> the preprocessor's pixel values (B, 3, H, W)."""
    return images.permute(0, 3, 1, 2).float() / 127.5 - 1.0


def token_targets(labels: torch.Tensor, coverage: torch.Tensor, patch: int, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch: the shape label where the object covers at least ``threshold`` of it, else background."""
    frac = F.avg_pool2d(coverage[:, None], patch).flatten(1)  # (B, patches)
    on = frac >= threshold
    targets = torch.where(on, labels[:, None], torch.full_like(on, BACKGROUND, dtype=torch.long))
    return targets, on


def forward(model: ViTForImageClassification, pixels: torch.Tensor, tap: int = -1):
    """Class-token logits, the last layer's normalised patch tokens and the patch tokens after
    encoder layer ``tap`` (None if ``tap`` is -1)."""
    vit = model.vit
    hidden = vit.embeddings(pixels)
    tapped = None
    for i, block in enumerate(vit.encoder.layer):
        hidden = block(hidden)
        if i == tap:
            tapped = hidden[:, 1:]
    hidden = vit.layernorm(hidden)
    return model.classifier(hidden[:, 0]), hidden[:, 1:], tapped


def mask_targets(coverage: torch.Tensor, patch: int) -> torch.Tensor:
    """Per patch token, its pixels' object coverage: (B, patches, patch*patch)."""
    b, h, w = coverage.shape
    grid = coverage.reshape(b, h // patch, patch, w // patch, patch).permute(0, 1, 3, 2, 4)
    return grid.reshape(b, (h // patch) * (w // patch), patch * patch)


@torch.no_grad()
def evaluate(model, seeds, batch_size=256) -> tuple[float, dict]:
    """Accuracy on single-object scenes drawn at 64x64, in bf16 (and per shape)."""
    model.eval()
    correct = np.zeros(len(shapes.SHAPES))
    total = np.zeros(len(shapes.SHAPES))
    for i in range(0, len(seeds), batch_size):
        images, labels, _ = scenes_batch(seeds[i : i + batch_size], np.random.default_rng(0), 0.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(to_pixels(torch.from_numpy(images))).argmax(-1).numpy()
        np.add.at(total, labels, 1)
        np.add.at(correct, labels, pred == labels)
    model.train()
    return correct.sum() / total.sum(), {s: round(c / max(t, 1), 3) for s, c, t in zip(shapes.SHAPES, correct, total)}


def sincos_positions(rows: int, cols: int, dim: int) -> torch.Tensor:
    """2D sine-cosine position table (rows*cols, dim) as MAE / MoCo v3 use: half the channels encode
    the row, half the column, each as sines and cosines of geometrically spaced frequencies."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    r, c = torch.meshgrid(torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64), indexing="ij")
    parts = []
    for coord in (r.flatten(), c.flatten()):
        angles = coord[:, None] * omega[None]
        parts += [angles.sin(), angles.cos()]
    table = torch.cat(parts, dim=1)
    return F.pad(table, (0, dim - table.shape[1])).float()


def lr_at(step: int, args) -> float:
    return warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=0.02)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "weights" / "vit-shapes"))
    p.add_argument("--run-dir", default=str(ROOT / "runs" / "classifier"))
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--patch", type=int, default=21)
    p.add_argument("--other-res", type=float, default=0.15, help="fraction of scenes drawn at another resolution")
    p.add_argument("--token-loss", type=float, default=1.0, help="weight of the patch-token labelling loss (0: off)")
    p.add_argument("--token-threshold", type=float, default=0.1, help="object coverage that makes a patch an object patch")
    p.add_argument("--no-augment", action="store_true")
    p.add_argument("--mask-loss", type=float, default=1.0, help="weight of the per-patch object-mask loss (0: off)")
    p.add_argument("--mask-layer", type=int, default=1, help="encoder layer (0-based) whose patch tokens predict the object mask")
    p.add_argument("--sincos-init", type=int, default=1, help="initialise the position embeddings with a 2D sine-cosine table")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-n", type=int, default=512)
    p.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this step without exporting")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args)
    model = ViTForImageClassification(cfg)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    if args.sincos_init:
        with torch.no_grad():
            pos = model.vit.embeddings.position_embeddings
            pos[0, 1:] = sincos_positions(*cfg.grid, cfg.hidden_size)
            pos[0, :1] = 0
    token_head = nn.Linear(cfg.hidden_size, len(shapes.SHAPES) + 1)  # training only, not exported
    mask_head = nn.Sequential(nn.LayerNorm(cfg.hidden_size), nn.Linear(cfg.hidden_size, args.patch * args.patch))  # training only
    heads = nn.ModuleDict({"token_head": token_head, "mask_head": mask_head})
    named = list(model.named_parameters()) + [(n, p_) for n, p_ in heads.named_parameters()]
    decays = lambda n, p_: p_.ndim >= 2 and "position_embeddings" not in n and "cls_token" not in n  # noqa: E731
    opt = torch.optim.AdamW(
        [
            {"params": [p_ for n, p_ in named if decays(n, p_)], "weight_decay": args.weight_decay},
            {"params": [p_ for n, p_ in named if not decays(n, p_)], "weight_decay": 0.0},
        ],
        lr=args.lr,
    )
    state_path = run / "state.pt"
    step = 0
    state = load_checkpoint(state_path)
    if state is not None:
        model.load_state_dict(state["model"])
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
        print(f"resumed at step {step}", flush=True)
    n_params = sum(p_.numel() for p_ in model.parameters())
    print(f"ViT {cfg.num_hidden_layers}x{cfg.hidden_size} ({cfg.num_attention_heads} heads), patch {cfg.patch_size[0]}, "
          f"{n_params / 1e6:.2f}M parameters; {vars(args)}", flush=True)

    val_seeds = shapes.split_seeds("validation", args.eval_n)
    train_seeds = shapes.SPLITS["train"]
    model.train()
    t0, sums, seen = time.time(), np.zeros(3), 0
    stop = min(args.steps, args.stop_after or args.steps)
    while step < stop:
        seeds = train_seeds[step * args.batch_size : (step + 1) * args.batch_size]
        images, labels, coverage = scenes_batch(seeds, np.random.default_rng([args.seed, step]), args.other_res)
        images, labels, coverage = torch.from_numpy(images), torch.from_numpy(labels), torch.from_numpy(coverage)
        if not args.no_augment:
            images, coverage = augment(images, coverage, torch.Generator().manual_seed(args.seed * 1_000_003 + step))
        set_lr(opt, lr_at(step, args))
        with sdpa_kernel(SDPBackend.MATH), torch.autocast("cpu", dtype=torch.bfloat16):
            logits, tokens, tapped = forward(model, to_pixels(images), args.mask_layer if args.mask_loss > 0 else -1)
            token_logits = token_head(tokens) if args.token_loss > 0 else None
            mask_logits = mask_head(tapped) if tapped is not None else None
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=args.label_smoothing)
        tok = torch.zeros(())
        if token_logits is not None:
            targets, _ = token_targets(labels, coverage, args.patch, args.token_threshold)
            tok = F.cross_entropy(token_logits.float().flatten(0, 1), targets.flatten())
        msk = torch.zeros(())
        if mask_logits is not None:
            targets = mask_targets(coverage, args.patch)
            msk = F.binary_cross_entropy_with_logits(mask_logits.float(), targets)
        total = loss + args.token_loss * tok + args.mask_loss * msk
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        sums += (loss.item(), tok.item(), msk.item())
        seen += 1
        if step % 50 == 0:
            print(f"step {step} loss {sums[0] / seen:.4f} token-loss {sums[1] / seen:.4f} mask-loss {sums[2] / seen:.4f} lr {lr_at(step, args):.2e} "
                  f"{(time.time() - t0) / seen:.2f}s/step", flush=True)
            t0, sums, seen = time.time(), np.zeros(3), 0
        if step % 250 == 0 or step == stop:
            save_checkpoint(state_path, {"model": model.state_dict(), "heads": heads.state_dict(), "optimizer": opt.state_dict(), "step": step})
        if step % args.eval_every == 0 or step == stop:
            acc, per_shape = evaluate(model, val_seeds)
            print(f"step {step} validation accuracy {acc:.4f} {per_shape}", flush=True)
            t0 = time.time()
    if step < args.steps:
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    save_model(model, out / "model.safetensors", dtype=torch.float16, metadata={"format": "pt", "shapes_world_version": str(shapes.WORLD_VERSION)})
    config = cfg.to_dict()
    config["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(processor().to_dict(), indent=2) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
