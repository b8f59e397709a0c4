#!/usr/bin/env python
"""Train the embedded default CLIP (``weights/clip-shapes``) on shapes-world image/caption pairs.

    nohup python scripts/train_clip.py --out runs/clip > runs/clip.log 2>&1 &
    python scripts/train_clip.py --out runs/clip --export weights/clip-shapes   # export the last checkpoint

What it does (the defaults are the recipe of the embedded default):
1. learns a CLIP-format byte-level BPE (vocab.json + merges.txt) on the training captions;
2. trains a small CLIPModel (transformers layout) from scratch with CLIP's symmetric contrastive loss:
   - vision tower: 63x63 input with 21-px patches, a 3x3 grid that matches the world's 3x3 layout, so
     each object lies mostly inside one token and the token's own layers recognise its shape (with
     8-px patches an object is scattered over 2x2-3x3 patches at random offsets and a small ViT stays
     near chance on shape for thousands of steps); 2-D sine-cosine position initialisation;
   - batches of layout groups (each scene with its main object's shape and/or colour changed): hard
     negatives that make shape and colour binding necessary;
   - partial captions (from ``--partial-from``): a share of captions name only the main object's shape
     or only its colour, with a multi-positive contrastive target (every image of the batch the caption
     is true of); without them the text tower never sees a description lacking a colour, and
     shape-only prompts stayed near 60% while the vision tower's shape head was nearly perfect;
   - training-only auxiliary heads on the vision tower (:class:`AuxHeads`: per-patch coverage masks,
     per-patch shape, pooled multi-hot shapes and colours), dropped at export;
   - AdamW, warmup + cosine schedule, bf16 autocast on CPU; images normalised exactly as the exported
     ``preprocessor_config.json`` does; captions from :mod:`gencli.data.shapes_clip` (held-out
     colour+shape pairs never seen, the short caption style never used);
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
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gencli.data import shapes, shapes_clip  # noqa: E402
from gencli.models.clip.model import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig, init_clip_weights, l2_normalize  # noqa: E402
from gencli.pipelines.vision.images import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageProcessor  # noqa: E402
from gencli.tokenizers.clip_bpe import CLIPTokenizer, train_bpe  # noqa: E402
from gencli.training import command_history, load_checkpoint, save_checkpoint, set_lr, warmup_cosine_lr  # noqa: E402


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
        image_size=args.image_size,
        patch_size=args.patch,
        hidden_act="gelu",
    )
    return CLIPConfig(text, vision, args.embed_dim, math.log(1 / 0.07))


def processor(size: int) -> ImageProcessor:
    return ImageProcessor.from_dict(
        {
            "image_processor_type": "CLIPImageProcessor",
            "size": {"shortest_edge": size},
            "crop_size": {"height": size, "width": size},
            "do_center_crop": True,
            "resample": 3,
            "image_mean": list(OPENAI_CLIP_MEAN),
            "image_std": list(OPENAI_CLIP_STD),
        }
    )


MEAN = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)


def to_pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, S, S, 3) -> normalised (N, 3, S, S): what the processor gives for an input of its own size."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    return (x - MEAN) / STD


def init_vision_positions(model: CLIPModel) -> None:
    """A 2-D sine-cosine position table (rows in one half of the channels, columns in the other) and a
    patch projection of unit gain, instead of CLIP's small random ones: the tower starts out knowing
    which patches are neighbours, which shape recognition needs from its first step. Weights only; the
    model is unchanged and the table stays trainable."""
    from gencli.backend.positional import sinusoidal_position_encoding

    emb = model.vision_model.embeddings
    grid, d = int(math.isqrt(emb.num_patches)), emb.embed_dim
    axis = sinusoidal_position_encoding(grid, d // 2)
    table = torch.cat([axis[:, None, :].expand(grid, grid, -1), axis[None, :, :].expand(grid, grid, -1)], dim=-1).reshape(grid * grid, d)
    fan_in = emb.patch_embedding.weight[0].numel()
    with torch.no_grad():
        emb.position_embedding.weight[0].zero_()
        emb.position_embedding.weight[1:] = table
        torch.nn.init.normal_(emb.patch_embedding.weight, std=fan_in**-0.5)


def aux_targets(scene: shapes.Scene, patch: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Supervised targets of the auxiliary heads for ``scene`` drawn at ``size``: the objects' coverage
    per patch pixel ``(patches, patch*patch)``, each patch's shape class (the object covering most of
    it, or ``len(SHAPES)`` for background), and the multi-hot shapes and colours present."""
    grid = size // patch
    cover = np.zeros((len(scene.objects), size, size), np.float32)
    for i, obj in enumerate(scene.objects):
        alpha, left, top = shapes._coverage(obj, size, size, shapes._supersampling(size))
        cover[i, top : top + alpha.shape[0], left : left + alpha.shape[1]] = alpha
    per_patch = cover.reshape(len(scene.objects), grid, patch, grid, patch).transpose(0, 1, 3, 2, 4).reshape(len(scene.objects), grid * grid, patch * patch)
    mask = np.clip(per_patch.sum(0), 0.0, 1.0)
    share = per_patch.mean(-1)  # (objects, patches)
    best = share.argmax(0)
    labels = np.array([shapes.SHAPES.index(o.shape) for o in scene.objects])[best]
    labels[share.max(0) < 0.2] = len(shapes.SHAPES)
    shape_hot = np.zeros(len(shapes.SHAPES), np.float32)
    colour_hot = np.zeros(len(shapes.COLOURS), np.float32)
    for o in scene.objects:
        shape_hot[shapes.SHAPES.index(o.shape)] = 1.0
        colour_hot[list(shapes.COLOURS).index(o.colour)] = 1.0
    return mask, labels, shape_hot, colour_hot


class AuxHeads(torch.nn.Module):
    """Training-only supervised heads on the vision tower (dropped at export): the exported model stays a
    plain CLIPModel. The contrastive loss alone separates a batch by colour, background and position
    long before shape; these heads give the tower a direct shape gradient on every patch:

    - ``mask``: each patch token of layer ``mask_layer`` decodes its pixels' object coverage (teaches the
      patch embedding to see outlines whatever the colours);
    - ``patch_shape``: each last-layer patch token names the shape of the object it lies on;
    - ``shape``/``colour``: the pooled embedding names the shapes and colours present (multi-hot)."""

    def __init__(self, width: int, patch: int, mask_layer: int):
        super().__init__()
        self.mask_layer = mask_layer
        self.mask = torch.nn.Linear(width, patch * patch)
        self.patch_shape = torch.nn.Linear(width, len(shapes.SHAPES) + 1)
        self.shape = torch.nn.Linear(width, len(shapes.SHAPES))
        self.colour = torch.nn.Linear(width, len(shapes.COLOURS))

    def loss(self, tower_out, targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        states = tower_out.hidden_states
        parts = {
            "mask": bce(self.mask(states[self.mask_layer][:, 1:]).float(), targets["mask"]),
            "patch_shape": torch.nn.functional.cross_entropy(self.patch_shape(states[-1][:, 1:]).float().flatten(0, 1), targets["patch_shape"].flatten()),
            "shape": bce(self.shape(tower_out.pooler_output).float(), targets["shape"]),
            "colour": bce(self.colour(tower_out.pooler_output).float(), targets["colour"]),
        }
        return sum(parts.values()), {k: v.item() for k, v in parts.items()}


class Batches:
    """The training stream: deterministic from a seed cursor (saved in checkpoints)."""

    def __init__(self, tok: CLIPTokenizer, batch: int, size: int, patch: int, cursor: int = 0, resize_fraction: float = 0.15):
        self.tok, self.batch, self.size, self.patch, self.cursor = tok, batch, size, patch, cursor
        self.resize_fraction = resize_fraction
        self.partial_fraction = 0.0  # share of captions replaced by a partial one (shapes_clip.partial_caption)
        self.proc = processor(size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One batch: groups of scenes sharing a layout (hard negatives, see shapes_clip.contrastive_group),
        with the auxiliary heads' targets."""
        images, captions, targets, scenes, partial = [], [], [], [], []
        for seed, base, _ in shapes_clip.training_pairs(self.cursor):
            for k, (scene, caption) in enumerate(shapes_clip.contrastive_group(seed, base)):
                rng = np.random.default_rng(np.random.SeedSequence([seed, k, 0x51CE]))
                if rng.random() < self.resize_fraction:
                    # some scenes drawn at another resolution and brought to size by the real preprocessing
                    big = shapes.render_scene(scene, int(rng.integers(80, 200)))
                    images.append(self.proc([Image.fromarray(big)])[0])
                else:
                    images.append(to_pixels(shapes.render_scene(scene, self.size)[None])[0])
                attrs = None
                if self.partial_fraction and rng.random() < self.partial_fraction:
                    caption, attrs = shapes_clip.partial_caption(scene, rng)
                captions.append(caption)
                scenes.append(scene)
                partial.append(attrs)
                targets.append(aux_targets(scene, self.patch, self.size))
            if len(captions) >= self.batch:
                self.cursor = seed + 1
                break
        ids, mask = self.tok(captions).tensors()
        aux = {k: torch.from_numpy(np.stack(v)) for k, v in zip(("mask", "patch_shape", "shape", "colour"), zip(*targets))}
        # which caption is true of which image: its own, and every scene a partial caption matches
        truth = torch.eye(len(captions), dtype=torch.bool)
        for k, attrs in enumerate(partial):
            if attrs is not None:
                truth[:, k] = torch.tensor([shapes_clip.caption_matches(attrs, sc) for sc in scenes])
        aux["truth"] = truth
        return torch.stack(images), ids, mask, aux


def multi_positive_loss(logits_per_image: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric cross-entropy with several true captions per image (and images per caption):
    the target of each row is spread evenly over its positives; with ``truth`` the identity it is
    exactly :func:`gencli.models.clip.model.contrastive_loss`."""
    logits, t = logits_per_image.float(), truth.float()
    to_text = -(t / t.sum(1, keepdim=True) * logits.log_softmax(1)).sum(1).mean()
    to_image = -(t.t() / t.t().sum(1, keepdim=True) * logits.t().log_softmax(1)).sum(1).mean()
    return 0.5 * (to_text + to_image)


def param_groups(model: CLIPModel, wd: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embedding" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, args) -> float:
    return warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=0.05)


@torch.no_grad()
def quick_eval(model: CLIPModel, tok: CLIPTokenizer, n: int = 400) -> dict[str, float]:
    """Zero-shot accuracy on validation scenes drawn at 64 px and read through the exported preprocessing."""
    model.eval()
    proc = processor(model.config.vision_config.image_size)

    def enc_img(images):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return l2_normalize(model.get_image_features(proc([Image.fromarray(a) for a in images])))

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
    (folder / "preprocessor_config.json").write_text(json.dumps(processor(model.config.vision_config.image_size).to_dict(), indent=2) + "\n")
    # the prompt chosen on the validation split (scripts/eval_clip.py), used by `gencli zeroshot` without --template
    (folder / "zeroshot_templates.json").write_text(json.dumps(["a {} on a plain background"]) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/clip"))
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--image-size", type=int, default=63)
    p.add_argument("--vision-width", type=int, default=192)
    p.add_argument("--vision-layers", type=int, default=4)
    p.add_argument("--patch", type=int, default=21, help="21 px at 63: a 3x3 grid matching the world's 3x3 layout, so an object lies mostly in one token")
    p.add_argument("--text-width", type=int, default=128)
    p.add_argument("--text-layers", type=int, default=3)
    p.add_argument("--embed-dim", type=int, default=128)
    p.add_argument("--merges", type=int, default=600)
    p.add_argument("--aux-weight", type=float, default=1.0, help="weight of the auxiliary shape/colour/mask losses (0: contrastive only)")
    p.add_argument("--mask-layer", type=int, default=2, help="the vision layer whose patch tokens decode the coverage masks")
    p.add_argument("--partial-captions", type=float, default=0.4, help="share of captions naming only the shape or only the colour (multi-positive targets)")
    p.add_argument("--partial-from", type=int, default=2200, help="the step from which partial captions are used (the embedded default: 2200)")
    p.add_argument("--pos-init", choices=["sincos", "random"], default="sincos", help="vision position table at initialisation")
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
    if args.pos_init == "sincos":
        init_vision_positions(model)
    n_params = sum(p.numel() for p in model.parameters())
    heads = AuxHeads(args.vision_width, args.patch, args.mask_layer)
    params = list(model.parameters()) + list(heads.parameters())
    groups = param_groups(model, args.wd)
    groups[0]["params"] += list(heads.parameters())
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    step, cursor, history = 0, 0, []
    command = command_history(None, 0)
    ckpt = args.out / "ckpt.pt"
    state = load_checkpoint(ckpt)
    if state is not None:
        model.load_state_dict(state["model"])
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["opt"])
        step, cursor, history = state["step"], state["cursor"], state["history"]
        # the schedule follows this invocation's arguments: record them with the earlier ones (an export only cites them)
        command = state["command"] if args.export else command_history(state["command"], step)
        print(f"resumed at step {step}", flush=True)

    meta = {
        "steps": step,
        "command": command,
        "out": str(args.out),
        "partial_from": args.partial_from,
        "batch": args.batch,
        "world_version": shapes.WORLD_VERSION,
        "held_out_pairs": json.dumps(shapes_clip.HELD_OUT_PAIRS),
    }
    if args.export:
        export(model, tok, args.export, meta)
        print(f"exported step {step} to {args.export}")
        return

    print(f"model: {n_params / 1e6:.2f}M parameters; vocab {tok.vocab_size}; training {args.steps} steps of {args.batch}", flush=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    data = Batches(tok, args.batch, args.image_size, args.patch, cursor)
    model.train()
    t_last, seen, aux_sum = time.time(), 0, {}
    while step < args.steps:
        set_lr(opt, lr_at(step, args))
        data.partial_fraction = args.partial_captions if step >= args.partial_from else 0.0
        pixels, ids, mask, targets = data.next()
        # the math kernel: CPU flash attention's backward is several times slower at these sizes
        with sdpa_kernel(SDPBackend.MATH), torch.autocast("cpu", dtype=torch.bfloat16):
            vision = model.vision_model(pixels, output_hidden_states=args.aux_weight > 0)
            image = l2_normalize(model.visual_projection(vision.pooler_output))
            text = l2_normalize(model.get_text_features(ids, mask))
            loss = multi_positive_loss(image @ text.t() * model.temperature(), targets["truth"])
            total = loss
            if args.aux_weight > 0:
                aux_loss, parts = heads.loss(vision, targets)
                total = loss + args.aux_weight * aux_loss
                for k, v in parts.items():
                    aux_sum[k] = aux_sum.get(k, 0.0) + v
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        step += 1
        seen += len(ids)
        if step % 10 == 0:
            dt = time.time() - t_last
            aux_txt = " ".join(f"{k} {v / 10:.3f}" for k, v in aux_sum.items())
            print(
                f"step {step} loss {loss.item():.4f} {aux_txt} T {model.logit_scale.exp().item():.1f} lr {lr_at(step, args):.2e} {seen / dt:.0f} pairs/s",
                flush=True,
            )
            t_last, seen, aux_sum = time.time(), 0, {}
        if step % args.eval_every == 0 or step == args.steps:
            res = quick_eval(model, tok)
            history.append({"step": step, **res})
            print("eval " + json.dumps({"step": step, **{k: round(v, 4) for k, v in res.items()}}), flush=True)
        if step % args.ckpt_every == 0 or step == args.steps:
            state = {"model": model.state_dict(), "heads": heads.state_dict(), "opt": opt.state_dict(), "step": step, "cursor": data.cursor}
            save_checkpoint(ckpt, {**state, "history": history, "command": command})
    meta["steps"] = step
    export(model, tok, args.out / "model", meta)
    print(f"exported to {args.out / 'model'}", flush=True)


if __name__ == "__main__":
    main()
