"""Train a ControlNet for the embedded text-to-image default (``weights/txt2img-shapes``): the objects'
outlines (a white line on black, what an edge detector gives) steer where and how large the prompt's
shapes are drawn; write it as a diffusers ``ControlNetModel`` folder that ``gencli txt2img --controlnet``
(and diffusers' ``ControlNetModel.from_pretrained``) reads.

The recipe (Zhang et al. 2023, as diffusers' ``train_controlnet.py``):

- the base UNet is frozen; the ControlNet starts as a copy of its down path and middle block, its
  conditioning convolutions (widths 16, 32, 64: two stride-2 steps, the VAE's factor 4) fresh, every
  output ("zero") convolution at zero, so training starts from the base model exactly;
- data: ``--scenes`` scenes of the base model's own training distribution
  (:func:`gencli.data.shapes_txt2img.training_scenes`), encoded once into a latent cache
  (``OUT/latents.pt``) by the pipeline's autoencoder, each with its outline map (:func:`outline`);
- captions drawn afresh at every step as the base model's training draws them (colour and shape
  always; size, position and background each in about half; one in ten empty), and ``--drop-caption``
  more of them emptied, so that the outline alone must say where and how large;
- the base model's objective (v-prediction on the zero-terminal-SNR ``scaled_linear`` schedule,
  min-SNR-5 weighting), AdamW on the ControlNet only, linear warmup then cosine decay, bf16 autocast,
  gradient clipping at 1;
- every ``--eval-every`` steps the loss at fixed timesteps and noise on validation scenes, with and
  without their outlines (how much the outline tells the model);
- checkpoints every ``--ckpt-every`` steps into ``OUT/ckpt.pt`` (atomic); the same command resumes;
  ``--time-budget SECONDS`` re-plans the step count so the decay ends in time.

    python scripts/train_controlnet.py --out runs/controlnet-shapes --threads 2 --time-budget 2400
    python scripts/train_controlnet.py --out runs/controlnet-shapes --export weights/controlnet-shapes
    python scripts/train_controlnet.py --out runs/controlnet-shapes --evaluate 200
    python scripts/train_controlnet.py --grid docs/txt2img-controlnet-grid.png

``--evaluate N`` draws N held-out single-object prompts (test split; colour, shape and background named,
never size or position) with and without the ControlNet and measures how well the drawn object covers
the outline's shape (intersection over union of the object's pixels and the scene's mask; the distance
of their centres), and whether the prompt's colour and background are still drawn.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gencli.backend.device import Placement  # noqa: E402
from gencli.data import shapes  # noqa: E402
from gencli.data.shapes_txt2img import judge_image, object_mask, outline, train_caption, training_scenes  # noqa: E402
from gencli.io import atomic_path  # noqa: E402
from gencli.models.unet.controlnet import ControlNetModel  # noqa: E402
from gencli.pipelines.diffusion.prompt_encoding import load_prompt_encoder  # noqa: E402
from gencli.pipelines.diffusion.vae import load_autoencoder  # noqa: E402
from gencli.schedulers import get_scheduler  # noqa: E402
from gencli.training import StepBudget, command_history, load_checkpoint, save_checkpoint, set_lr, warmup_cosine_lr  # noqa: E402
from gencli.weights import weights_dir  # noqa: E402
from scripts.train_lora import encode_scenes, load_unet  # noqa: E402
from scripts.train_txt2img import CaptionCache, min_snr_weights  # noqa: E402

CONDITIONING_WIDTHS = [16, 32, 64]  # two stride-2 steps: the latents are 1/4 of the image


def control_tensor(maps: torch.Tensor) -> torch.Tensor:
    """uint8 outline maps ``(N, side, side)`` -> the ControlNet's image ``(N, 3, side, side)`` in [0, 1]."""
    return (maps.float() / 255.0)[:, None].expand(-1, 3, -1, -1)


def new_controlnet(unet) -> ControlNetModel:
    """A ControlNet for ``unet``: its down path and middle block copied, the output convolutions at zero."""
    config = {**unet.config.to_dict(), "conditioning_embedding_out_channels": CONDITIONING_WIDTHS}
    cn = ControlNetModel(config)
    missing, _ = cn.load_state_dict(unet.state_dict(), strict=False)
    assert all(k.startswith(("controlnet_", "add_embedding")) for k in missing), missing
    with torch.no_grad():
        for module in [*cn.controlnet_down_blocks, cn.controlnet_mid_block, cn.controlnet_cond_embedding.conv_out]:
            module.weight.zero_()
            module.bias.zero_()
    return cn


def fixed_loss(unet, cn, captions, scheduler, latents, maps, scenes, *, gamma: float, control: bool, seed: int = 1234) -> float:
    """The v-prediction loss at fixed timesteps, noise and captions (colour and shape only), with or
    without the outlines."""
    n = len(scenes)
    g = torch.Generator().manual_seed(seed)
    x0 = latents.float()
    noise = torch.randn(x0.shape, generator=g)
    t = torch.linspace(0, 999, n).long()
    ctx = captions([f"a {s.objects[0].colour} {s.objects[0].shape}" for s in scenes])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        noisy = scheduler.add_noise(x0, noise, t)
        extra = {}
        if control:
            down, mid = cn(noisy, t, ctx, control_tensor(maps))
            extra = {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
        pred = unet(noisy, t, ctx, **extra).float()
    err = (pred - scheduler.get_velocity(x0, noise, t)).pow(2).mean(dim=(1, 2, 3))
    return float((err * min_snr_weights(scheduler, t, gamma)).mean())


def export(state: dict, folder: Path) -> None:
    from safetensors.torch import save_file

    cn = new_controlnet(load_unet(Path(state["base"])))
    cn.load_state_dict(state["controlnet"])
    base = json.loads((Path(state["base"]) / "unet" / "config.json").read_text())  # the UNet's own fields, as diffusers writes them
    config = {**base, "_class_name": "ControlNetModel", "_diffusers_version": "0.30.0"}
    for key in ("up_block_types", "out_channels", "center_input_sample", "sample_size"):
        config.pop(key, None)
    config.update(conditioning_channels=3, conditioning_embedding_out_channels=CONDITIONING_WIDTHS, controlnet_conditioning_channel_order="rgb",
                  global_pool_conditions=False)  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in cn.state_dict().items()}
    with atomic_path(folder / "diffusion_pytorch_model.safetensors", force=True) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt", "gencli_base_model": "txt2img-shapes", "gencli_training_steps": str(state["step"])})
    with atomic_path(folder / "config.json", force=True) as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
    n = sum(t.numel() for t in tensors.values())
    print(f"exported step {state['step']}: {n} parameters, {(folder / 'diffusion_pytorch_model.safetensors').stat().st_size} bytes -> {folder}")


def evaluate_drawings(folder: Path, base: Path, n: int, threads: int) -> dict:
    """IoU of the drawn object with the outline's shape, N held-out prompts, with and without the ControlNet."""
    import tempfile

    from PIL import Image

    from gencli.pipelines.diffusion.controlnet import ControlNetSpec, load_controlnet
    from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, resolve_settings

    torch.set_num_threads(threads)
    scenes = [shapes.make_scene(s, n_objects=1) for s in shapes.split_seeds("test", n, offset=50_000)]
    result: dict = {"prompts": n}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("without", "with"):
            ious, centre, colour, background = [], [], [], []
            plain = load_pipeline(base, device="cpu", dtype="float32")
            for i, scene in enumerate(scenes):
                obj = scene.objects[0]
                prompt = f"a {obj.colour} {obj.shape} on a {scene.background} background"
                pipe = plain
                if name == "with":
                    path = Path(tmp) / f"{i}.png"
                    Image.fromarray(outline(scene)).convert("RGB").save(path)
                    pipe.controlnet = load_controlnet(ControlNetSpec(str(folder), str(path)), pipe.unet, pipe.placement, 4)
                settings = resolve_settings(pipe)
                image = generate(pipe, [prompt], [i], settings)[0].pixels
                drawn, _ = object_mask(image)
                truth = shapes.render_mask(scene, 64) > 0
                ious.append(float((drawn & truth).sum() / max(1, (drawn | truth).sum())))
                judged = judge_image(image, obj.shape)
                colour.append(judged["colour"] == obj.colour)
                background.append(judged["background"] == scene.background)
                ys, xs = np.nonzero(drawn)
                ty, tx = np.nonzero(truth)
                centre.append(float(np.hypot(ys.mean() - ty.mean(), xs.mean() - tx.mean())) if len(ys) else 64.0)
                pipe.controlnet = None
            result[name] = {"mean_iou": round(float(np.mean(ious)), 4), "iou_above_0.5": round(float(np.mean(np.array(ious) > 0.5)), 4),
                            "median_centre_error_px": round(float(np.median(centre)), 2), "colour": round(float(np.mean(colour)), 4),
                            "background": round(float(np.mean(background)), 4)}  # fmt: skip
            print(name, json.dumps(result[name]), flush=True)
    return result


def write_grid(folder: Path, base: Path, path: Path, n: int = 4, scale: int = 3) -> None:
    """A picture for the docs: for ``n`` held-out prompts, the outline, the image without the ControlNet
    and with it (rows), side by side (columns), each ``scale`` times its size."""
    import tempfile

    from PIL import Image

    from gencli.pipelines.diffusion.controlnet import ControlNetSpec, load_controlnet
    from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, resolve_settings

    pipe = load_pipeline(base, device="cpu", dtype="float32")
    scenes = [shapes.make_scene(s, n_objects=1) for s in shapes.split_seeds("test", n, offset=60_000)]
    rows: list[list[np.ndarray]] = [[], [], []]
    with tempfile.TemporaryDirectory() as tmp:
        for i, scene in enumerate(scenes):
            obj = scene.objects[0]
            prompt = f"a {obj.colour} {obj.shape} on a {scene.background} background"
            edges = np.repeat(outline(scene)[..., None], 3, axis=2)
            Image.fromarray(edges).save(Path(tmp) / "c.png")
            pipe.controlnet = None
            rows[0].append(edges)
            rows[1].append(generate(pipe, [prompt], [i], resolve_settings(pipe))[0].pixels)
            pipe.controlnet = load_controlnet(ControlNetSpec(str(folder), str(Path(tmp) / "c.png")), pipe.unet, pipe.placement, 4)
            rows[2].append(generate(pipe, [prompt], [i], resolve_settings(pipe))[0].pixels)
            print(f"column {i + 1}: {prompt!r}, seed {i}")
    gap = np.full((64, 2, 3), 255, np.uint8)
    grid = np.concatenate([np.concatenate([x for img in row for x in (img, gap)][:-1], axis=1) for row in rows], axis=0)
    Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST).save(path, optimize=True)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/controlnet-shapes"))
    p.add_argument("--base", type=Path, default=weights_dir() / "txt2img-shapes", help="the diffusers pipeline folder the ControlNet is for")
    p.add_argument("--scenes", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--min-snr", type=float, default=5.0)
    p.add_argument("--drop-caption", type=float, default=0.3, help="share of captions reduced to colour and shape only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--time-budget", type=float, default=None, help="seconds: re-plan --steps every 100 steps so the run ends in time")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this step")
    p.add_argument("--export", type=Path, default=None, help="only write the last checkpoint as a diffusers ControlNet folder")
    p.add_argument("--evaluate", type=int, default=None, help="only measure an exported folder (--export's) on N held-out prompts")
    p.add_argument("--grid", type=Path, default=None, help="only draw the docs' picture of an exported folder (--export's) to this PNG")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "ckpt.pt"
    if args.grid is not None:
        write_grid(args.export or weights_dir() / "controlnet-shapes", args.base, args.grid)
        return
    if args.evaluate is not None:
        folder = args.export or weights_dir() / "controlnet-shapes"
        print(json.dumps(evaluate_drawings(folder, args.base, args.evaluate, args.threads)))
        return
    state = load_checkpoint(ckpt_path)
    if args.export is not None:
        if state is None:
            raise SystemExit(f"no checkpoint in {args.out}")
        export(state, args.export)
        return
    if state is not None:
        args.base = Path(state["base"])

    placement = Placement(torch.device("cpu"), torch.float32)
    captions = CaptionCache(load_prompt_encoder(args.base, placement))
    scheduler = get_scheduler("ddpm", json.loads((args.base / "scheduler" / "scheduler_config.json").read_text()))
    scenes = training_scenes(args.scenes)
    val = [shapes.make_scene(s, n_objects=1) for s in shapes.split_seeds("validation", 64, offset=20_000)]
    cache = args.out / "latents.pt"
    key = [len(scenes), len(val), str(args.base)]
    cached = torch.load(cache, weights_only=True) if cache.exists() else None
    if cached is None or cached["key"] != key:
        vae = load_autoencoder(args.base / "vae", placement).model
        t0 = time.time()
        cached = {"key": key, "train": encode_scenes(vae, scenes), "val": encode_scenes(vae, val),
                  "train_maps": torch.from_numpy(np.stack([outline(s) for s in scenes])),
                  "val_maps": torch.from_numpy(np.stack([outline(s) for s in val]))}  # fmt: skip
        with atomic_path(cache, force=True) as tmp:
            torch.save(cached, tmp)
        print(f"encoded {len(scenes) + len(val)} scenes ({time.time() - t0:.0f}s)", flush=True)
        del vae

    unet = load_unet(args.base)
    torch.manual_seed(args.seed)
    cn = new_controlnet(unet).train()
    params = [q for q in cn.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    step, history = 0, []
    if state is not None:
        cn.load_state_dict(state["controlnet"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        args.steps = max(args.steps, state.get("planned_steps", args.steps)) if args.time_budget is None else args.steps
        print(f"resumed at step {step}", flush=True)
    command = command_history(state.get("command") if state else None, step)
    print(f"ControlNet: {sum(q.numel() for q in params)} parameters; {len(scenes)} scenes; {vars(args)}", flush=True)

    def evaluate() -> dict:
        rec = {"step": step}
        cn.eval()
        for name, control in (("val_with_outline", True), ("val_without", False)):
            rec[name] = round(fixed_loss(unet, cn, captions, scheduler, cached["val"], cached["val_maps"], val, gamma=args.min_snr, control=control), 5)
        cn.train()
        return rec

    if step == 0:
        history.append(evaluate())
        print("eval " + json.dumps(history[-1]), flush=True)
    rng = np.random.default_rng([args.seed, step])
    gen = torch.Generator().manual_seed(args.seed * 100003 + step)
    budget = StepBudget(args.time_budget, every=100)
    budget.begin(step)
    t_last = time.time()
    while step < args.steps:
        planned = budget.steps(step)
        if planned is not None:
            args.steps = planned
            print(f"{budget.seconds_per_step:.2f} s/step: the run ends at step {args.steps}", flush=True)
        idx = torch.from_numpy(rng.integers(0, len(scenes), args.batch))
        x0 = cached["train"][idx].float()
        texts = []
        for i in idx.tolist():
            s = scenes[i]
            texts.append(f"a {s.objects[0].colour} {s.objects[0].shape}" if rng.random() < args.drop_caption else train_caption(s, rng))
        ctx = captions(texts)
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, 1000, (args.batch,), generator=gen)
        lr = warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=0.1)
        set_lr(opt, lr)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            noisy = scheduler.add_noise(x0, noise, t)
            down, mid = cn(noisy, t, ctx, control_tensor(cached["train_maps"][idx]))
            pred = unet(noisy, t, ctx, down_block_additional_residuals=down, mid_block_additional_residual=mid)
        err = (pred.float() - scheduler.get_velocity(x0, noise, t)).pow(2).mean(dim=(1, 2, 3))
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
            save_checkpoint(ckpt_path, {"controlnet": cn.state_dict(), "optimizer": opt.state_dict(), "step": step, "planned_steps": args.steps,
                                        "history": history, "command": command, "base": str(args.base),
                                        "args": {k: str(v) for k, v in vars(args).items()}})  # fmt: skip
        if args.stop_after is not None and step >= args.stop_after:
            print(f"stopped at step {step} (resume with the same command)")
            return
    print("done; export with --export weights/controlnet-shapes, then --evaluate 200")


if __name__ == "__main__":
    main()
