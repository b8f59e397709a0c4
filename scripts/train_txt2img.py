"""Train the embedded text-to-image default (``weights/txt2img-shapes``): a small latent-diffusion
UNet on shapes-world scenes and their captions, in the latent space of ``weights/autoencoder-shapes``,
conditioned on the (frozen) text tower of the default CLIP ``weights/clip-shapes``.

The result is a diffusers pipeline folder (``model_index.json``, ``unet/``, ``vae/``,
``text_encoder/``, ``tokenizer/``, ``scheduler/``, and ``generation_config.json`` with the default
sampler, steps, guidance and size), loadable by diffusers' ``StableDiffusionPipeline`` as well as by
gencli. The recipe:

- data: 64x64 scenes of the train seed split (``gencli.data.shapes``), three in four with a single
  object, scenes with a colour+shape pair held out of the CLIP default's training
  (``shapes_clip.HELD_OUT_PAIRS``) left out here too, so the evaluation can measure composition;
  the scenes are encoded once into a latent cache (``OUT/latents.pt``: posterior means times
  ``scaling_factor``, 16x16x4 each);
- captions drawn afresh at every step: the objects' colour and shape always, their size, position
  and the background each in about half of the captions (the quick start's "a red star on a blue
  background" names neither size nor position), in one of the generic framings of the CLIP
  default's training ("a photo of ...") or background first; one caption in ten is empty, which
  trains the unconditional prediction that classifier-free guidance needs;
- the text tower of ``clip-shapes`` encodes them as Stable Diffusion 1.x does (77 tokens padded with
  the end token, the last layer after the final LayerNorm) through gencli's own prompt encoder, read
  from the exported ``text_encoder/`` folder: training and inference condition on the same states;
- noise schedule: Stable Diffusion's ``scaled_linear`` betas (0.00085 to 0.012 over 1000 steps)
  rescaled to zero terminal SNR (Lin et al. 2023) with v-prediction: plain backgrounds are most of
  every image, and with the usual schedule the model would read the background colour off the
  signal left at the last timestep, which pure noise at sampling time does not have; sampling uses
  DDIM with "trailing" timesteps as that paper recommends;
- loss: the v-prediction error weighted by min-SNR-5 (Hang et al. 2023), AdamW, linear warmup then
  cosine decay (``gencli.training``), bf16 autocast (``--device cpu`` or ``cuda``), gradient clipping at 1, an
  exponential moving average of the weights (decay ramping up to ``--ema``) which is what is exported;
- every ``--eval-every`` steps: the validation loss at fixed timesteps and noise, for both the raw and
  the averaged weights;
- checkpoints every ``--ckpt-every`` steps into ``OUT/ckpt.pt`` (atomic); the same command resumes.

``python scripts/train_txt2img.py --out runs/txt2img`` then ``--export weights/txt2img-shapes``.
The quality is measured by ``scripts/eval_txt2img.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gencli.backend.device import Placement  # noqa: E402
from gencli.checkpoints.loader import save_model  # noqa: E402
from gencli.data import shapes  # noqa: E402
from gencli.data.shapes_txt2img import train_caption, training_scenes  # noqa: E402
from gencli.io import atomic_write_bytes  # noqa: E402
from gencli.models.unet.unet_2d_condition import UNet2DConditionModel  # noqa: E402
from gencli.pipelines.diffusion.prompt_encoding import load_prompt_encoder  # noqa: E402
from gencli.pipelines.diffusion.vae import images_to_tensor, load_autoencoder  # noqa: E402
from gencli.schedulers import get_scheduler  # noqa: E402
from gencli.training import StepBudget, command_history, load_checkpoint, save_checkpoint, set_lr, warmup_cosine_lr  # noqa: E402
from gencli.weights import weights_dir  # noqa: E402

SCHEDULER_CONFIG = {
    "_class_name": "DDIMScheduler",
    "_diffusers_version": "0.30.0",
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "trained_betas": None,
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "prediction_type": "v_prediction",
    "thresholding": False,
    "timestep_spacing": "trailing",
    "rescale_betas_zero_snr": True,
}

UNET_CONFIG = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.30.0",
    "sample_size": 16,
    "in_channels": 4,
    "out_channels": 4,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "only_cross_attention": False,
    "block_out_channels": [64, 128, 128],
    "layers_per_block": 1,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "act_fn": "silu",
    "norm_num_groups": 16,
    "norm_eps": 1e-05,
    "cross_attention_dim": 128,
    "transformer_layers_per_block": 1,
    "attention_head_dim": 4,
    "use_linear_projection": True,
    "upcast_attention": False,
    "resnet_time_scale_shift": "default",
}

MODEL_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "_diffusers_version": "0.30.0",
    "feature_extractor": [None, None],
    "image_encoder": [None, None],
    "requires_safety_checker": False,
    "safety_checker": [None, None],
    "scheduler": ["diffusers", "DDIMScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode(), force=True)


def export_conditioning(folder: Path, *, generation: dict) -> None:
    """Everything of the pipeline folder but the UNet: model_index.json, scheduler/, vae/ (the
    embedded autoencoder), text_encoder/ and tokenizer/ (the text tower of the embedded CLIP, in
    transformers' ``CLIPTextModel`` layout) and generation_config.json."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    root = weights_dir()
    write_json(folder / "model_index.json", MODEL_INDEX)
    write_json(folder / "scheduler" / "scheduler_config.json", SCHEDULER_CONFIG)
    write_json(folder / "generation_config.json", generation)
    (folder / "vae").mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        shutil.copyfile(root / "autoencoder-shapes" / name, folder / "vae" / name)
    clip = root / "clip-shapes"
    cfg = json.loads((clip / "config.json").read_text())
    text_cfg = {**cfg["text_config"], "architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "torch_dtype": "float16"}
    text_cfg.pop("projection_dim", None)
    write_json(folder / "text_encoder" / "config.json", text_cfg)
    with safe_open(str(clip / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k).to(torch.float16).contiguous() for k in f.keys() if k.startswith("text_model.")}
    save_file(tensors, str(folder / "text_encoder" / "model.safetensors"), metadata={"format": "pt"})
    (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(clip / name, folder / "tokenizer" / name)


def latent_cache(path: Path, n: int, batch: int = 256, device: torch.device | None = None) -> tuple[torch.Tensor, list[shapes.Scene]]:
    """The scenes and their scaled latents, encoded once by the embedded autoencoder."""
    scenes = training_scenes(n)
    if path.exists():
        latents = torch.load(path, weights_only=True)
        if latents.shape[0] == n:
            return latents, scenes
    device = device or torch.device("cpu")
    vae = load_autoencoder(weights_dir() / "autoencoder-shapes", Placement(device, torch.float32)).model
    out = []
    t0 = time.time()
    with torch.inference_mode():
        for i in range(0, n, batch):
            images = np.stack([shapes.render_scene(s, 64) for s in scenes[i : i + batch]])
            out.append((vae.encode(images_to_tensor(images).to(device)).mode() * vae.config.scaling_factor).cpu())
            if i // batch % 20 == 0:
                print(f"encoded {i + len(images)}/{n} scenes ({time.time() - t0:.0f}s)", flush=True)
    latents = torch.cat(out).to(torch.float16).contiguous()
    torch.save(latents, path)
    return latents, scenes


def min_snr_weights(scheduler, timesteps: torch.Tensor, gamma: float) -> torch.Tensor:
    """min(SNR, gamma) / (SNR + 1): min-SNR weighting for the v-prediction loss."""
    abar = scheduler.alphas_cumprod.to(timesteps.device)[timesteps]
    snr = abar / (1 - abar)
    return torch.minimum(snr, torch.full_like(snr, gamma)) / (snr + 1)


class CaptionCache:
    """Prompt conditioning memoised per caption: the captions repeat (a few attributes in a few
    framings), and on an accelerator tokenising and encoding every step would dominate a step."""

    def __init__(self, encoder, limit: int = 300_000) -> None:
        self.encoder, self.limit, self.rows = encoder, limit, {}

    def __call__(self, captions: list[str]) -> torch.Tensor:
        missing = [c for c in dict.fromkeys(captions) if c not in self.rows]
        if len(self.rows) + len(missing) > self.limit:
            self.rows.clear()
            missing = list(dict.fromkeys(captions))
        if missing:
            with torch.no_grad():
                states = self.encoder.encode_prompts(missing).hidden_states
            self.rows.update(zip(missing, states.to(torch.float16)))
        return torch.stack([self.rows[c] for c in captions]).float()


def validation_loss(unet, encoder, scheduler, latents, scenes, *, n: int = 256, gamma: float = 5.0) -> float:
    """The weighted v-prediction loss on fixed validation items, timesteps and noise."""
    device = latents.device
    g = torch.Generator().manual_seed(1234)
    idx = torch.arange(n)
    x0 = latents[idx.to(device)].float()
    noise = torch.randn(x0.shape, generator=g).to(device)
    t = torch.linspace(0, 999, n).long().to(device)
    rng = np.random.default_rng(99)
    ctx = encoder.encode_prompts([train_caption(scenes[i], rng) or "" for i in idx.tolist()]).hidden_states
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16):
        pred = unet(scheduler.add_noise(x0, noise, t), t, ctx).float()
    err = (pred - scheduler.get_velocity(x0, noise, t)).pow(2).mean(dim=(1, 2, 3))
    return float((err * min_snr_weights(scheduler, t, gamma)).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/txt2img"))
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--ema", type=float, default=0.999, help="final decay of the weights' moving average (exported)")
    p.add_argument("--min-snr", type=float, default=5.0)
    p.add_argument("--scenes", type=int, default=60000, help="training scenes in the latent cache")
    p.add_argument("--widths", default="64,128,128", help="UNet block_out_channels")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast on either)")
    p.add_argument("--init", type=Path, default=None, help="start a fresh run from this pipeline folder's UNet (its exported average)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: every 200 steps, --steps is reset from the recent rate so the run and its cosine decay end in time",
    )
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this step")
    p.add_argument("--export", type=Path, default=None, help="only export the last checkpoint's averaged UNet into this pipeline folder")
    p.add_argument("--steps-default", type=int, default=25, help="generation_config.json: num_inference_steps")
    p.add_argument("--guidance-default", type=float, default=5.0, help="generation_config.json: guidance_scale")
    p.add_argument("--sampler-default", default="ddim", help="generation_config.json: sampler")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, help="print where N steps (after 20) spend their time, then go on")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "ckpt.pt"
    generation = {
        "num_inference_steps": args.steps_default,
        "guidance_scale": args.guidance_default,
        "guidance_rescale": 0.0,
        "sampler": args.sampler_default,
        "width": 64,
        "height": 64,
    }

    unet_cfg = {**UNET_CONFIG, "block_out_channels": [int(w) for w in args.widths.split(",")]}
    state = load_checkpoint(ckpt_path)
    if args.export is not None:
        if state is None:
            raise SystemExit(f"no checkpoint in {args.out}")
        export_conditioning(args.export, generation=generation)
        unet = UNet2DConditionModel(state["config"])
        unet.load_state_dict(state["ema"])
        write_json(args.export / "unet" / "config.json", state["config"])
        save_model(unet, args.export / "unet" / "diffusion_pytorch_model.safetensors", dtype=torch.float16)
        print(f"exported step {state['step']} to {args.export}")
        return

    pipeline = args.out / "pipeline"
    export_conditioning(pipeline, generation=generation)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    encoder = load_prompt_encoder(pipeline, Placement(device, torch.float32))
    captions = CaptionCache(encoder)
    scheduler = get_scheduler("ddpm", SCHEDULER_CONFIG)
    latents, scenes = latent_cache(args.out / "latents.pt", args.scenes, device=device)
    latents = latents.to(device)
    n_val = 256
    val_latents, val_scenes = latents[-n_val:], scenes[-n_val:]
    latents, scenes = latents[:-n_val], scenes[:-n_val]

    torch.manual_seed(args.seed)
    unet = UNet2DConditionModel(state["config"] if state else unet_cfg)
    n_params = sum(t.numel() for t in unet.parameters())
    ema = copy.deepcopy(unet).requires_grad_(False)
    step, history = 0, []
    if state is None and args.init is not None:
        from safetensors.torch import load_file

        init = {k: v.float() for k, v in load_file(str(args.init / "unet" / "diffusion_pytorch_model.safetensors")).items()}
        unet.load_state_dict(init)
        ema.load_state_dict(init)
        print(f"initialised from {args.init}", flush=True)
    unet.to(device)
    ema.to(device)
    opt = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    if state is not None:
        unet.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        print(f"resumed at step {step}", flush=True)
    command = command_history(state.get("command") if state else None, step)
    print(f"UNet {unet_cfg['block_out_channels']}, {n_params / 1e6:.2f}M parameters, {len(scenes)} training scenes; {vars(args)}", flush=True)
    unet.train()
    rng = np.random.default_rng([args.seed, step])
    gen = torch.Generator(device).manual_seed(args.seed * 100003 + step)
    t_last = time.time()
    first_step = step
    budget = StepBudget(args.time_budget)
    budget.begin(step)
    while step < args.steps:
        planned = budget.steps(step)  # the recent rate: the first steps fill the caption cache and run slower
        if planned is not None:
            args.steps = planned
            print(f"{budget.seconds_per_step * 1000:.1f} ms/step: the run ends at step {args.steps}", flush=True)
        if args.profile and step == first_step + 20:
            profiler = torch.profiler.profile()
            profiler.start()
        if args.profile and step == first_step + 20 + args.profile:
            profiler.stop()
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        idx = rng.integers(0, len(scenes), args.batch)
        x0 = latents[torch.from_numpy(idx).to(device)].float()
        ctx = captions([train_caption(scenes[i], rng) for i in idx])
        noise = torch.randn(x0.shape, generator=gen, device=device)
        t = torch.randint(0, 1000, (args.batch,), generator=gen, device=device)
        noisy = scheduler.add_noise(x0, noise, t)
        target = scheduler.get_velocity(x0, noise, t)
        lr = warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=0.1)
        set_lr(opt, lr)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = unet(noisy, t, ctx)
        err = (pred.float() - target).pow(2).mean(dim=(1, 2, 3))
        loss = (err * min_snr_weights(scheduler, t, args.min_snr)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        opt.step()
        step += 1
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(unet.parameters()), 1 - decay)
        if step % 25 == 0:
            now = time.time()
            print(f"step {step} loss {loss.item():.4f} lr {lr:.2e} {(now - t_last) / 25:.2f}s/step", flush=True)
            t_last = now
        if step % args.eval_every == 0 or step == args.steps:
            unet.eval()
            rec = {"step": step, "val_loss": validation_loss(unet, encoder, scheduler, val_latents, val_scenes, n=n_val, gamma=args.min_snr)}
            rec["val_loss_ema"] = validation_loss(ema, encoder, scheduler, val_latents, val_scenes, n=n_val, gamma=args.min_snr)
            unet.train()
            history.append(rec)
            print("eval " + json.dumps(rec), flush=True)
        if step % args.ckpt_every == 0 or step == args.steps or step == args.stop_after:
            save_checkpoint(
                ckpt_path,
                {
                    "model": unet.state_dict(),
                    "ema": ema.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step,
                    "history": history,
                    "command": command,
                    "config": state["config"] if state else unet_cfg,
                    "args": {k: str(v) for k, v in vars(args).items()},
                },
            )
        if args.stop_after is not None and step >= args.stop_after:
            print(f"stopped at step {step} (resume with the same command)")
            return
    print("done; export with --export weights/txt2img-shapes")


if __name__ == "__main__":
    main()
