#!/usr/bin/env python
"""Train the embedded default image classifier (weights/vit-shapes) on the shapes world.

A small ViT in transformers' ViTForImageClassification layout learns the shape of the object in
single-object scenes (``gencli.data.shapes``, train split seeds), at 64x64 pixels. A third of the
training scenes are rendered at another resolution (40-160 px) and resized by the model's own
preprocessing (PIL bilinear), so the classifier also serves images that were not drawn at 64x64.

    python scripts/train_classifier.py --out weights/vit-shapes            # ~4000 steps, resumable
    python scripts/eval_classifier.py                                     # held-out accuracy

Training state is checkpointed under runs/classifier/ (resumed automatically); the final model is
written in fp16 as config.json + model.safetensors + preprocessor_config.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gencli.checkpoints.loader import save_model  # noqa: E402
from gencli.data import shapes  # noqa: E402
from gencli.models.vit import ViTConfig, ViTForImageClassification  # noqa: E402
from gencli.pipelines.images import ImageProcessor  # noqa: E402

IMAGE_SIZE = 64


def model_config(args) -> ViTConfig:
    return ViTConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        intermediate_size=4 * args.hidden,
        image_size=(IMAGE_SIZE, IMAGE_SIZE),
        patch_size=(args.patch, args.patch),
        id2label=dict(enumerate(shapes.SHAPES)),
    )


def processor() -> ImageProcessor:
    return ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, resample=2, do_convert_rgb=True)


def batch(seeds, rng: np.random.Generator, proc: ImageProcessor, other_res: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel values and shape labels of single-object scenes; some drawn at another resolution."""
    from PIL import Image

    pixels, labels = [], []
    for seed in seeds:
        res = IMAGE_SIZE if rng.random() >= other_res else int(rng.integers(40, 161))
        sample = shapes.render(int(seed), res, n_objects=1)
        pixels.append(proc.preprocess(Image.fromarray(sample.image)))
        labels.append(shapes.SHAPES.index(sample.scene.main.shape))
    return torch.from_numpy(np.stack(pixels)), torch.tensor(labels)


@torch.no_grad()
def evaluate(model, seeds, proc, batch_size=256) -> float:
    model.eval()
    correct = 0
    rng = np.random.default_rng(0)
    for i in range(0, len(seeds), batch_size):
        x, y = batch(seeds[i : i + batch_size], rng, proc, other_res=0.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            correct += (model(x).argmax(-1) == y).sum().item()
    model.train()
    return correct / len(seeds)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "weights" / "vit-shapes"))
    p.add_argument("--run-dir", default=str(ROOT / "runs" / "classifier"))
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--other-res", type=float, default=0.33, help="fraction of scenes drawn at another resolution")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args)
    proc = processor()
    model = ViTForImageClassification(cfg)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    decay = [p_ for n, p_ in model.named_parameters() if p_.ndim >= 2 and "position_embeddings" not in n and "cls_token" not in n]
    no_decay = [p_ for n, p_ in model.named_parameters() if not (p_.ndim >= 2 and "position_embeddings" not in n and "cls_token" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.999)
    )
    state_path = run / "state.pt"
    step = 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
        print(f"resumed at step {step}", flush=True)
    n_params = sum(p_.numel() for p_ in model.parameters())
    print(f"ViT {cfg.num_hidden_layers}x{cfg.hidden_size}, patch {cfg.patch_size[0]}, {n_params / 1e6:.2f}M parameters", flush=True)

    val_seeds = list(shapes.split_seeds("validation", 1024))
    train_seeds = shapes.SPLITS["train"]
    model.train()
    t0, seen_loss, seen = time.time(), 0.0, 0
    while step < args.steps:
        seeds = train_seeds[step * args.batch_size : (step + 1) * args.batch_size]
        rng = np.random.default_rng([args.seed, step])
        x, y = batch(seeds, rng, proc, args.other_res)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=0.05)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen_loss += loss.item()
        seen += 1
        if step % 50 == 0:
            print(f"step {step} loss {seen_loss / seen:.4f} lr {lr_at(step, args):.2e} {(time.time() - t0) / seen:.2f}s/step", flush=True)
            t0, seen_loss, seen = time.time(), 0.0, 0
        if step % 250 == 0 or step == args.steps:
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
            tmp.replace(state_path)
        if step % args.eval_every == 0 or step == args.steps:
            print(f"step {step} validation accuracy {evaluate(model, val_seeds, proc):.4f}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    save_model(model, out / "model.safetensors", dtype=torch.float16, metadata={"format": "pt", "shapes_world_version": str(shapes.WORLD_VERSION)})
    config = cfg.to_dict()
    config["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(proc.to_dict(), indent=2) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
