#!/usr/bin/env python
"""Train the embedded default CLIP (``weights/clip-shapes``) on shapes-world image/caption pairs.

    nohup python scripts/train_clip.py --out runs/clip > runs/clip.log 2>&1 &
    python scripts/train_clip.py --out runs/clip --export weights/clip-shapes   # export the last checkpoint

What it does:
1. learns a CLIP-format byte-level BPE (vocab.json + merges.txt) on the training captions;
2. trains a small CLIPModel (transformers layout) from scratch with CLIP's symmetric contrastive loss,
   batches of layout groups (each scene with its main object's shape and/or colour changed: hard
   negatives that make shape and colour binding necessary), AdamW, warmup + cosine schedule, bf16 autocast on CPU; images 64x64 normalised exactly
   as the exported ``preprocessor_config.json`` does, captions from :mod:`gencli.data.shapes_clip`
   (held-out colour+shape pairs never seen, the short caption style never used);
3. checkpoints every ``--ckpt-every`` steps (resumes from ``OUT/ckpt.pt``), evaluates zero-shot on
   validation scenes every ``--eval-every`` steps;
4. exports the HF folder (config.json, model.safetensors in fp16, tokenizer files,
   preprocessor_config.json) to ``OUT/model``.

Quality is measured afterwards by ``scripts/eval_clip.py`` on the test split.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gencli.data import shapes, shapes_clip  # noqa: E402
from gencli.models.clip import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig, contrastive_loss, init_clip_weights, l2_normalize  # noqa: E402
from gencli.pipelines.images import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageProcessor  # noqa: E402
from gencli.tokenizers.clip_bpe import CLIPTokenizer, train_bpe  # noqa: E402

IMAGE_SIZE = 64


def build_config(args, tok: CLIPTokenizer) -> CLIPConfig:
    text = CLIPTextConfig(
        vocab_size=tok.vocab_size,
        hidden_size=args.text_width,
        intermediate_size=4 * args.text_width,
        projection_dim=args.embed_dim,
        num_hidden_layers=args.text_layers,
        num_attention_heads=args.text_width // 64,
        max_position_embeddings=77,
        hidden_act="gelu",
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = CLIPVisionConfig(
        hidden_size=args.vision_width,
        intermediate_size=4 * args.vision_width,
        projection_dim=args.embed_dim,
        num_hidden_layers=args.vision_layers,
        num_attention_heads=args.vision_width // 64,
        image_size=IMAGE_SIZE,
        patch_size=args.patch,
        hidden_act="gelu",
    )
    return CLIPConfig(text, vision, args.embed_dim, math.log(1 / 0.07))


def processor() -> ImageProcessor:
    return ImageProcessor.from_dict(
        {
            "image_processor_type": "CLIPImageProcessor",
            "size": {"shortest_edge": IMAGE_SIZE},
            "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "do_center_crop": True,
            "resample": 3,
            "image_mean": list(OPENAI_CLIP_MEAN),
            "image_std": list(OPENAI_CLIP_STD),
        }
    )


MEAN = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)


def to_pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 64, 64, 3) -> normalised (N, 3, 64, 64): what the processor gives for a 64x64 input."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    return (x - MEAN) / STD


class Batches:
    """The training stream: deterministic from a seed cursor (saved in checkpoints)."""

    def __init__(self, tok: CLIPTokenizer, batch: int, cursor: int = 0, resize_fraction: float = 0.15):
        self.tok, self.batch, self.cursor = tok, batch, cursor
        self.resize_fraction = resize_fraction
        self.proc = processor()

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One batch: groups of scenes sharing a layout (hard negatives, see shapes_clip.contrastive_group)."""
        images, captions = [], []
        for seed, base, _ in shapes_clip.training_pairs(self.cursor):
            for k, (scene, caption) in enumerate(shapes_clip.contrastive_group(seed, base)):
                rng = np.random.default_rng(np.random.SeedSequence([seed, k, 0x51CE]))
                if rng.random() < self.resize_fraction:
                    # some scenes drawn at another resolution and brought to 64x64 by the real preprocessing
                    big = shapes.render_scene(scene, int(rng.integers(80, 200)))
                    images.append(self.proc([Image.fromarray(big)])[0])
                else:
                    images.append(to_pixels(shapes.render_scene(scene, IMAGE_SIZE)[None])[0])
                captions.append(caption)
            if len(captions) >= self.batch:
                self.cursor = seed + 1
                break
        ids, mask = self.tok(captions).tensors()
        return torch.stack(images), ids, mask


def param_groups(model: CLIPModel, wd: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embedding" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


@torch.no_grad()
def quick_eval(model: CLIPModel, tok: CLIPTokenizer, n: int = 400) -> dict[str, float]:
    model.eval()

    def enc_img(images):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return l2_normalize(model.get_image_features(to_pixels(images)))

    def enc_txt(texts):
        ids, mask = tok(list(texts)).tensors()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return l2_normalize(model.get_text_features(ids, mask))

    sets = shapes_clip.label_sets()
    res = shapes_clip.evaluate(enc_img, enc_txt, shapes_clip.eval_scenes("validation", n), sets)
    held = shapes_clip.evaluate(enc_img, enc_txt, shapes_clip.eval_scenes("validation", n // 2, held_out=True, offset=500_000), sets)
    res.update({f"held-out {k}": v for k, v in held.items()})
    model.train()
    return res


def export(model: CLIPModel, tok: CLIPTokenizer, folder: Path, meta: dict) -> None:
    from gencli.checkpoints.loader import save_model

    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = "float16"
    cfg["text_config"].update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_model(model, folder / "model.safetensors", dtype=torch.float16, metadata={"architecture": "CLIPModel", **{k: str(v) for k, v in meta.items()}})
    tok.save(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(processor().to_dict(), indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/clip"))
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--vision-width", type=int, default=128)
    p.add_argument("--vision-layers", type=int, default=6)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--text-width", type=int, default=128)
    p.add_argument("--text-layers", type=int, default=3)
    p.add_argument("--embed-dim", type=int, default=128)
    p.add_argument("--merges", type=int, default=600)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--export", type=Path, default=None, help="only export the last checkpoint to this folder and exit")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)

    tok_dir = args.out / "tokenizer"
    if (tok_dir / "vocab.json").is_file():
        tok = CLIPTokenizer.from_folder(tok_dir)
    else:
        t0 = time.time()
        tok = train_bpe(shapes_clip.caption_corpus(), args.merges)
        tok.save(tok_dir)
        print(f"BPE: {tok.vocab_size} tokens in {time.time() - t0:.0f}s", flush=True)

    config = build_config(args, tok)
    model = CLIPModel(config)
    init_clip_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    step, cursor, history = 0, 0, []
    ckpt = args.out / "ckpt.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, cursor, history = state["step"], state["cursor"], state.get("history", [])
        print(f"resumed at step {step}", flush=True)

    meta = {"steps": step, "batch": args.batch, "world_version": shapes.WORLD_VERSION, "held_out_pairs": json.dumps(shapes_clip.HELD_OUT_PAIRS)}
    if args.export:
        export(model, tok, args.export, meta)
        print(f"exported step {step} to {args.export}")
        return

    print(f"model: {n_params / 1e6:.2f}M parameters; vocab {tok.vocab_size}; training {args.steps} steps of {args.batch}", flush=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    data = Batches(tok, args.batch, cursor)
    model.train()
    t_last, seen = time.time(), 0
    while step < args.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        pixels, ids, mask = data.next()
        # the math kernel: CPU flash attention's backward is several times slower at these sizes
        with sdpa_kernel(SDPBackend.MATH), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, pixels, mask)
            loss = contrastive_loss(out.logits_per_image)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        step += 1
        seen += len(ids)
        if step % 10 == 0:
            dt = time.time() - t_last
            print(f"step {step} loss {loss.item():.4f} T {model.logit_scale.exp().item():.1f} lr {lr_at(step, args):.2e} {seen / dt:.0f} pairs/s", flush=True)
            t_last, seen = time.time(), 0
        if step % args.eval_every == 0 or step == args.steps:
            res = quick_eval(model, tok)
            history.append({"step": step, **res})
            print("eval " + json.dumps({"step": step, **{k: round(v, 4) for k, v in res.items()}}), flush=True)
        if step % args.ckpt_every == 0 or step == args.steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "cursor": data.cursor, "history": history, "args": vars(args)}, tmp)
            os.replace(tmp, ckpt)
    meta["steps"] = step
    export(model, tok, args.out / "model", meta)
    print(f"exported to {args.out / 'model'}", flush=True)


if __name__ == "__main__":
    main()
