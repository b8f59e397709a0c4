"""Train a LoRA that teaches the embedded text-to-image default (``weights/txt2img-shapes``) a shape
it has never seen (``--shape``: one of ``gencli.data.shapes.EXTRA_SHAPES``, the hexagon or the
arrow), and write it as a kohya / A1111 LoRA file that ``gencli txt2img --lora FILE:WEIGHT`` (and
diffusers' ``load_lora_weights``) reads.

The recipe:

- the base UNet is frozen; every linear projection of its attention layers (``attn1`` self and
  ``attn2`` cross attention: ``to_q``, ``to_k``, ``to_v``, ``to_out.0``, 56 layers) gets a low-rank
  update ``W + (alpha / rank) * up @ down`` (``down`` Kaiming-uniform, ``up`` zero at the start, so
  training starts from the base model exactly), added by a forward hook: the UNet's own modules and
  state-dict keys stay as they are;
- data: ``--examples`` rendered scenes of the new shape from the train seed split (eight dozen: three
  in four single, the rest with a second object of the eight known shapes beside it; every colour,
  size, position and background the world draws) and a regularisation set of ``--regular`` ordinary
  scenes of the base model's own training distribution, which make up ``--regular-share`` of every
  batch so that the update leaves the eight known shapes alone; all of them encoded once into a
  latent cache (``OUT/latents.pt``) by the pipeline's autoencoder;
- captions drawn afresh at every step exactly as the base model's training draws them
  (:func:`gencli.data.shapes_txt2img.train_caption`: colour and shape always, size, position and
  background each in about half, the CLIP framings, one in ten empty), encoded by the pipeline's
  frozen text encoder;
- the base model's objective: the ``scaled_linear`` schedule rescaled to zero terminal SNR,
  v-prediction, min-SNR-5 weighting (``scripts/train_txt2img.py``), AdamW on the LoRA weights only,
  linear warmup then cosine decay, bf16 autocast, gradient clipping at 1; each latent pixel's error
  weighted by ``1 + --object-weight x`` the objects' coverage of it (the scene's mask, averaged
  over the 4x4 pixels of a latent pixel), the weights of a sample normalised to mean 1: what tells a
  hexagon from a circle is a few pixels of its outline, which the plain loss, spread over the whole
  background, hardly sees (kohya's scripts call this a masked loss);
- every ``--eval-every`` steps the loss at fixed timesteps and noise on new-shape scenes of the
  validation split and on ordinary validation scenes (how much it learnt, how much it disturbs);
- checkpoints every ``--ckpt-every`` steps into ``OUT/ckpt.pt`` (atomic); the same command resumes;
  ``--time-budget SECONDS`` re-plans the step count from the measured speed so the decay ends in time.

    python scripts/train_lora.py --shape arrow --out runs/lora-arrow --threads 1 --time-budget 2100
    python scripts/train_lora.py --out runs/lora-arrow --export weights/lora-arrow/lora-arrow.safetensors

The export is kohya's layout (``lora_unet_<module path with underscores>.lora_down.weight`` /
``.lora_up.weight`` / ``.alpha``) in fp16. ``scripts/eval_txt2img.py --lora FILE:W --shape arrow``
measures it.
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
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gencli.backend.device import Placement  # noqa: E402
from gencli.data import shapes  # noqa: E402
from gencli.data.shapes_txt2img import SINGLE_OBJECT_SHARE, train_caption, training_scenes  # noqa: E402
from gencli.io import atomic_path  # noqa: E402
from gencli.models.unet.unet_2d_condition import UNet2DConditionModel  # noqa: E402
from gencli.pipelines.diffusion.prompt_encoding import load_prompt_encoder  # noqa: E402
from gencli.pipelines.diffusion.vae import images_to_tensor, load_autoencoder  # noqa: E402
from gencli.schedulers import get_scheduler  # noqa: E402
from gencli.training import StepBudget, command_history, load_checkpoint, save_checkpoint, set_lr, warmup_cosine_lr  # noqa: E402
from gencli.weights import weights_dir  # noqa: E402
from scripts.train_txt2img import CaptionCache, min_snr_weights  # noqa: E402

TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
CONCEPT_SEEDS = 900_000_000  # offset into the train split of the new shape's scenes (far from every other use)
REGULAR_SEEDS_NOTE = "the first scenes of gencli.data.shapes_txt2img.training_scenes (the base model's own)"


class LoraAdapter(nn.Module):
    """The low-rank update of one linear layer, added to its output by a forward hook."""

    def __init__(self, layer: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.rank, self.alpha = rank, alpha
        self.down = nn.Parameter(torch.empty(rank, layer.in_features))
        self.up = nn.Parameter(torch.zeros(layer.out_features, rank))
        nn.init.kaiming_uniform_(self.down, a=math.sqrt(5))  # as nn.Linear's (and kohya's) initialisation
        self.handle = layer.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        x = inputs[0]
        return output + (self.alpha / self.rank) * F.linear(F.linear(x, self.down.to(x.dtype)), self.up.to(x.dtype))


def attach_lora(unet: nn.Module, rank: int, alpha: float) -> nn.ModuleDict:
    """A LoRA adapter on every attention projection of ``unet``, keyed by the layer's module path
    (dots as ``/``: a ModuleDict key cannot hold dots)."""
    adapters = {}
    for name, module in unet.named_modules():
        if isinstance(module, nn.Linear) and name.endswith(TARGETS):
            adapters[name.replace(".", "/")] = LoraAdapter(module, rank, alpha)
    if not adapters:
        raise SystemExit("no attention projections found in the UNet")
    return nn.ModuleDict(adapters)


def kohya_state(adapters: nn.ModuleDict) -> dict[str, torch.Tensor]:
    """The adapters in kohya's layout, fp16."""
    out = {}
    for key, a in adapters.items():
        name = "lora_unet_" + key.replace("/", "_")
        out[f"{name}.lora_down.weight"] = a.down.detach().to(torch.float16).contiguous()
        out[f"{name}.lora_up.weight"] = a.up.detach().to(torch.float16).contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(a.alpha), dtype=torch.float16)
    return out


def concept_scenes(n: int, shape: str = "hexagon", offset: int = CONCEPT_SEEDS, split: str = "train") -> list[shapes.Scene]:
    """``n`` scenes whose main object is ``shape`` (one of the EXTRA_SHAPES): three in four alone, the
    others beside a second object of the eight known shapes."""
    scenes = []
    for seed in shapes.split_seeds(split, n, offset=offset):
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x4E7A]))
        single = rng.random() < SINGLE_OBJECT_SHARE
        scenes.append(shapes.make_scene(seed, n_objects=1 if single else 2, shape=shape))
    return scenes


def encode_scenes(vae, scenes: list[shapes.Scene], batch: int = 128) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for i in range(0, len(scenes), batch):
            images = np.stack([shapes.render_scene(s, 64) for s in scenes[i : i + batch]])
            out.append(vae.encode(images_to_tensor(images)).mode() * vae.config.scaling_factor)
    return torch.cat(out).to(torch.float16)


def object_weights(scenes: list[shapes.Scene], strength: float, side: int = 64, factor: int = 4) -> torch.Tensor:
    """``(N, 1, side/factor, side/factor)`` loss weights: 1 + ``strength`` x the objects' coverage of
    each latent pixel, normalised to mean 1 per scene."""
    out = []
    for scene in scenes:
        cover = (shapes.render_mask(scene, side) > 0).astype(np.float32)
        cover = cover.reshape(side // factor, factor, side // factor, factor).mean(axis=(1, 3))
        w = 1.0 + strength * cover
        out.append(w / w.mean())
    return torch.from_numpy(np.stack(out))[:, None]


def fixed_loss(unet, captions, scheduler, latents, scenes, *, gamma: float, seed: int = 1234) -> float:
    """The weighted v-prediction loss at fixed timesteps, noise and captions (a validation figure)."""
    n = len(scenes)
    g = torch.Generator().manual_seed(seed)
    x0 = latents.float()
    noise = torch.randn(x0.shape, generator=g)
    t = torch.linspace(0, 999, n).long()
    rng = np.random.default_rng(seed)
    ctx = captions([train_caption(s, rng, allow_empty=False) for s in scenes])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        pred = unet(scheduler.add_noise(x0, noise, t), t, ctx).float()
    err = (pred - scheduler.get_velocity(x0, noise, t)).pow(2).mean(dim=(1, 2, 3))
    return float((err * min_snr_weights(scheduler, t, gamma)).mean())


def export(state: dict, path: Path) -> None:
    from safetensors.torch import save_file

    adapters = attach_lora(load_unet(Path(state["base"])), state["rank"], state["alpha"])
    adapters.load_state_dict(state["lora"])
    tensors = kohya_state(adapters)
    metadata = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(state["rank"]),
        "ss_network_alpha": str(state["alpha"]),
        "ss_base_model": "txt2img-shapes",
        "ss_training_steps": str(state["step"]),
        "ss_output_name": path.stem,
        "gencli_trigger_word": state.get("shape", "hexagon"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, force=True) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    print(f"exported step {state['step']}: {len(adapters)} layers, {sum(t.numel() for t in tensors.values())} values, {path.stat().st_size} bytes -> {path}")


def load_unet(base: Path) -> UNet2DConditionModel:
    from safetensors.torch import load_file

    unet = UNet2DConditionModel(json.loads((base / "unet" / "config.json").read_text()))
    unet.load_state_dict({k: v.float() for k, v in load_file(str(base / "unet" / "diffusion_pytorch_model.safetensors")).items()})
    return unet.requires_grad_(False).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/lora-arrow"))
    p.add_argument("--shape", choices=shapes.EXTRA_SHAPES, default="arrow", help="the new shape the LoRA teaches")
    p.add_argument("--base", type=Path, default=weights_dir() / "txt2img-shapes", help="the diffusers pipeline folder the LoRA is for")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=None, help="default: the rank (scale 1)")
    p.add_argument("--examples", "--hexagons", type=int, default=96, help="rendered scenes of the new shape to learn from")
    p.add_argument("--regular", type=int, default=2048, help="ordinary scenes of the base model's training (regularisation)")
    p.add_argument("--regular-share", type=float, default=0.5, help="share of every batch from the regularisation scenes")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--min-snr", type=float, default=5.0)
    p.add_argument("--object-weight", type=float, default=4.0, help="extra loss weight on the objects' pixels (0: the plain loss)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--time-budget", type=float, default=None, help="seconds: re-plan --steps every 100 steps so the run ends in time")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this step")
    p.add_argument("--export", type=Path, default=None, help="only write the last checkpoint's LoRA to this .safetensors file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "ckpt.pt"
    state = load_checkpoint(ckpt_path)
    if args.export is not None:
        if state is None:
            raise SystemExit(f"no checkpoint in {args.out}")
        export(state, args.export)
        return
    if state is not None:  # a resumed run keeps the shape of the run it resumes
        args.rank, args.alpha, args.base = state["rank"], state["alpha"], Path(state["base"])
        args.shape = state.get("shape", "hexagon")
    alpha = float(args.alpha if args.alpha is not None else args.rank)

    placement = Placement(torch.device("cpu"), torch.float32)
    encoder = load_prompt_encoder(args.base, placement)
    captions = CaptionCache(encoder)
    scheduler = get_scheduler("ddpm", json.loads((args.base / "scheduler" / "scheduler_config.json").read_text()))
    examples, regular = concept_scenes(args.examples, args.shape), training_scenes(args.regular)
    val_new = concept_scenes(64, args.shape, offset=0, split="validation")
    val_regular = [shapes.make_scene(s, n_objects=1) for s in shapes.split_seeds("validation", 64, offset=10_000)]
    cache = args.out / "latents.pt"
    key = [args.shape, len(examples), len(regular), len(val_new), len(val_regular), str(args.base)]
    cached = torch.load(cache, weights_only=True) if cache.exists() else None
    if cached is None or cached["key"] != key:
        vae = load_autoencoder(args.base / "vae", placement).model
        t0 = time.time()
        sets = {"new": examples, "regular": regular, "val_new": val_new, "val_regular": val_regular}
        cached = {"key": key, **{name: encode_scenes(vae, s) for name, s in sets.items()}}
        with atomic_path(cache, force=True) as tmp:
            torch.save(cached, tmp)
        print(f"encoded {sum(len(v) for v in cached.values() if isinstance(v, torch.Tensor))} scenes ({time.time() - t0:.0f}s)", flush=True)
        del vae

    weights = {"new": object_weights(examples, args.object_weight), "regular": object_weights(regular, args.object_weight)}
    unet = load_unet(args.base)
    torch.manual_seed(args.seed)
    adapters = attach_lora(unet, args.rank, alpha)
    params = list(adapters.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    step, history = 0, []
    if state is not None:
        adapters.load_state_dict(state["lora"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        args.steps = max(args.steps, state.get("planned_steps", args.steps)) if args.time_budget is None else args.steps
        print(f"resumed at step {step}", flush=True)
    command = command_history(state.get("command") if state else None, step)
    n_lora = sum(t.numel() for t in params)
    print(f"LoRA rank {args.rank} alpha {alpha:g} on {len(adapters)} layers: {n_lora} parameters; ", end="")
    print(f"{len(examples)} {args.shape} + {len(regular)} regular scenes; {vars(args)}", flush=True)

    def evaluate() -> dict:
        rec = {"step": step}
        for name, lat, sc in ((f"val_{args.shape}", cached["val_new"], val_new), ("val_regular", cached["val_regular"], val_regular)):
            rec[name] = round(fixed_loss(unet, captions, scheduler, lat, sc, gamma=args.min_snr), 5)
        return rec

    if step == 0:
        history.append(evaluate())
        print("eval " + json.dumps(history[-1]), flush=True)
    rng = np.random.default_rng([args.seed, step])
    gen = torch.Generator().manual_seed(args.seed * 100003 + step)
    n_regular = int(round(args.batch * args.regular_share))
    budget = StepBudget(args.time_budget, every=100)
    budget.begin(step)
    t_last = time.time()
    while step < args.steps:
        planned = budget.steps(step)
        if planned is not None:
            args.steps = planned
            print(f"{budget.seconds_per_step:.2f} s/step: the run ends at step {args.steps}", flush=True)
        hi = rng.integers(0, len(examples), args.batch - n_regular)
        ri = rng.integers(0, len(regular), n_regular)
        x0 = torch.cat([cached["new"][torch.from_numpy(hi)], cached["regular"][torch.from_numpy(ri)]]).float()
        pixel_weight = torch.cat([weights["new"][torch.from_numpy(hi)], weights["regular"][torch.from_numpy(ri)]])
        ctx = captions([train_caption(examples[i], rng) for i in hi] + [train_caption(regular[i], rng) for i in ri])
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, 1000, (args.batch,), generator=gen)
        lr = warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=0.1)
        set_lr(opt, lr)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = unet(scheduler.add_noise(x0, noise, t), t, ctx)
        err = ((pred.float() - scheduler.get_velocity(x0, noise, t)).pow(2) * pixel_weight).mean(dim=(1, 2, 3))
        loss = (err * min_snr_weights(scheduler, t, args.min_snr)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            now = time.time()
            print(f"step {step} loss {loss.item():.4f} lr {lr:.2e} {(now - t_last) / 25:.2f}s/step", flush=True)
            t_last = now
        if step % args.eval_every == 0 or step == args.steps:
            history.append(evaluate())
            print("eval " + json.dumps(history[-1]), flush=True)
        if step % args.ckpt_every == 0 or step == args.steps or step == args.stop_after:
            save_checkpoint(
                ckpt_path,
                {
                    "lora": adapters.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step,
                    "planned_steps": args.steps,
                    "history": history,
                    "command": command,
                    "rank": args.rank,
                    "alpha": alpha,
                    "base": str(args.base),
                    "shape": args.shape,
                    "args": {k: str(v) for k, v in vars(args).items()},
                },
            )
        if args.stop_after is not None and step >= args.stop_after:
            print(f"stopped at step {step} (resume with the same command)")
            return
    print(f"done; export with --export {args.out}/lora-{args.shape}.safetensors (regular scenes: {REGULAR_SEEDS_NOTE})")


if __name__ == "__main__":
    main()
