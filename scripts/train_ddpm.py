#!/usr/bin/env python
"""Train a pixel-space DDPM (diffusers' ``UNet2DModel`` + ``DDPMScheduler``) on the shapes world.

    nohup nice -n 10 python scripts/train_ddpm.py --out runs/ddpm --device cuda --data-workers 4 > runs/ddpm.log 2>&1 &
    python scripts/train_ddpm.py --out runs/ddpm --export runs/ddpm/pipeline     # export the best checkpoint
    gencli sample ddpm --model runs/ddpm/pipeline --sampler ddim --steps 50 -n 16 -o grid.png

Recipe (Ho et al. 2020, algorithm 1): a fresh batch of train-split scenes every step (one or two
objects, ``--size`` pixels, in [-1, 1]); a timestep t uniform over the ``--timesteps`` training
steps, x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps (the schedule of ``--beta-schedule``), and the
mean squared error between the UNet's prediction and its target: by default the velocity
v = sqrt(abar_t) eps - sqrt(1 - abar_t) x_0 on the schedule rescaled to zero terminal SNR (Lin et al.
2023, as ``scripts/train_txt2img.py`` does), sampled with "trailing" timesteps. A plain coloured
background is most of every scene, and with the usual schedule (``--prediction-type epsilon
--no-zero-snr``, Ho et al.'s) the model reads the background's colour off the signal the last
timestep leaves, which pure noise at sampling time does not have: a run of 3,000 steps that way drew
every background mid-gray. AdamW with a linear warmup and a
cosine decay, gradient clipping at 1, bf16 autocast on channels-last feature maps, and an exponential moving average of the
weights (``--ema``): the averaged model is what gets judged and exported, as DDPM practice does.

64x64 by default: the size of the GAN and VAE defaults (the classifier's figures compare like with
like), and the size at which the geometric judge of ``scripts/eval_generative.py`` scores real scenes
100% (at 32x32 the small crescents and stars are five pixels wide and even real scenes match 92%).

On a GPU (``--device cuda --data-workers 8``): an H100 ran a step of the 9.3 M-parameter UNet
(``--widths 64,128,128,128 --layers 2 --attention-from 2``, bf16 autocast) in 91 ms at batch 64 and
93 ms at batch 128 alike (2026-11): the host's kernel launches bound the step, not the
GPU, so give a GPU run a large ``--batch`` (512 or more, with a higher ``--lr``) and ``--compile
reduce-overhead``; 3,000 steps at batch 128 (384,000 scenes, 400 s) matched 4% of the judged samples,
no better than the CPU default's run. To go on from the default's 22,000 CPU steps instead of from
scratch (its 70 MB checkpoint need not travel): ``--init-from weights/ddpm-shapes --widths 32,64,128,128
--layers 1 --attention-from 3 --groups 16`` (the default's UNet) with the GPU's batch and rate.

Model selection: every ``--eval-every`` steps the averaged model draws ``--eval-n`` samples with DDIM
(``--eval-steps``, seeds 0..n-1) that the geometric judge and the default classifier (Frechet
distance against *validation* scenes) score; the checkpoint with the highest share of samples
matching a shape (ties: the lower Frechet distance) is kept in ``OUT/best.pt`` and exported. Atomic
checkpoints in ``OUT/ckpt.pt`` every ``--ckpt-every`` steps that a rerun with the same ``--out`` resumes.

The export is a diffusers pipeline folder (``model_index.json``, ``unet/config.json`` +
``diffusion_pytorch_model.safetensors``, ``scheduler/scheduler_config.json``): a ``DDIMPipeline`` by
default (``--pipeline ddpm``: a ``DDPMPipeline``); ``gencli sample ddpm --model`` and
``DDPMPipeline.from_pretrained`` both load it.
"""

from __future__ import annotations

import copy
import functools
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

from gencli.data import shapes  # noqa: E402
from gencli.models.unet.unet_2d import UNet2DConfig, UNet2DModel  # noqa: E402
from gencli.pipelines.diffusion.vae import images_to_tensor  # noqa: E402
from gencli.schedulers.ddpm import DDPMScheduler  # noqa: E402
from gencli.training import StepBudget, load_checkpoint, parse_training_args, prefetched, resume, save_checkpoint, set_lr, training_parser, warmup_cosine_lr  # noqa: E402

DIFFUSERS_VERSION = "0.30.0"  # the format version written into the configs (any diffusers since reads them)


def batch(step: int, n: int, size: int) -> torch.Tensor:
    """The training scenes of ``step``: ``n`` train-split scenes (the same for every run), in [-1, 1]."""
    images, _ = shapes.render_batch(shapes.split_seeds("train", n, offset=step * n), size)
    return images_to_tensor(images)


def unet_config(size: int, widths: tuple[int, ...], layers: int, attention_from: int, head_dim: int, groups: int) -> UNet2DConfig:
    """The UNet: ``widths`` per level, pixel attention at the levels from ``attention_from`` down (0: every level)."""
    n = len(widths)
    down = tuple("AttnDownBlock2D" if i >= attention_from else "DownBlock2D" for i in range(n))
    up = tuple("AttnUpBlock2D" if n - 1 - i >= attention_from else "UpBlock2D" for i in range(n))
    return UNet2DConfig.from_dict(
        dict(sample_size=size, in_channels=3, out_channels=3, block_out_channels=list(widths), layers_per_block=layers, down_block_types=list(down),
             up_block_types=list(up), attention_head_dim=head_dim, norm_num_groups=groups, flip_sin_to_cos=True, freq_shift=0, dropout=0.0)
    )  # fmt: skip


def scheduler_config(timesteps: int, beta_schedule: str, prediction_type: str = "v_prediction", zero_snr: bool = True) -> dict:
    """A diffusers ``DDPMScheduler`` config (fixed_small variance, clipped x0; zero terminal SNR with
    "trailing" timesteps, or Ho et al.'s "leading" ones)."""
    return {
        "_class_name": "DDPMScheduler", "_diffusers_version": DIFFUSERS_VERSION, "num_train_timesteps": timesteps, "beta_start": 0.0001,
        "beta_end": 0.02, "beta_schedule": beta_schedule, "trained_betas": None, "variance_type": "fixed_small", "clip_sample": True,
        "clip_sample_range": 1.0, "prediction_type": prediction_type, "thresholding": False,
        "timestep_spacing": "trailing" if zero_snr else "leading", "steps_offset": 0, "rescale_betas_zero_snr": zero_snr,
    }  # fmt: skip


def export_pipeline(model: UNet2DModel, sched: dict, folder: Path, *, dtype: torch.dtype = torch.float32, metadata: dict | None = None,
                    pipeline: str = "ddpm", generation: dict | None = None) -> None:  # fmt: skip
    """Write a diffusers pipeline folder for ``model`` and the ``DDPMScheduler`` config ``sched``:
    ``pipeline="ddpm"`` a ``DDPMPipeline`` (ancestral sampling, all the training timesteps by default),
    ``"ddim"`` a ``DDIMPipeline`` whose ``DDIMScheduler`` has the same noise schedule (50 deterministic
    steps by default). ``DDPMPipeline.from_pretrained`` and ``gencli sample ddpm`` load either.
    ``generation``: written as ``generation_config.json`` (``sampler``, ``num_inference_steps``: the
    defaults of ``gencli sample ddpm``; diffusers ignores the file)."""
    from gencli.checkpoints.loader import save_model
    from gencli.io import atomic_write_bytes

    def write_json(path: Path, data: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode(), force=True)

    cfg = {**model.config.to_dict(), "_diffusers_version": DIFFUSERS_VERSION}
    write_json(folder / "unet" / "config.json", cfg)
    save_model(model, folder / "unet" / "diffusion_pytorch_model.safetensors", dtype=dtype, metadata=metadata)
    if pipeline == "ddim":  # DDIMScheduler's fields: no variance type; the final step lands on x_0 (alpha_cumprod 1)
        sched = {k: v for k, v in sched.items() if k != "variance_type"} | {"_class_name": "DDIMScheduler", "set_alpha_to_one": True}
    elif pipeline != "ddpm":
        raise ValueError(f"pipeline must be ddpm or ddim, got {pipeline!r}")
    write_json(folder / "scheduler" / "scheduler_config.json", sched)
    index = {"_class_name": f"{pipeline.upper()}Pipeline", "_diffusers_version": DIFFUSERS_VERSION, "scheduler": ["diffusers", sched["_class_name"]],
             "unet": ["diffusers", "UNet2DModel"]}  # fmt: skip
    write_json(folder / "model_index.json", index)
    if generation:
        write_json(folder / "generation_config.json", generation)


class Judge:
    """Scores the averaged model: DDIM samples of seeds 0..n-1 by the geometric judge and the classifier."""

    def __init__(self, n: int, size: int, steps: int):
        from gencli.pipelines.generative.quality import judge_images
        from gencli.pipelines.vision.classify import ImageClassifier
        from gencli.weights import resolve_model
        from scripts.eval_generative import GeometricJudge

        self.n, self.steps = n, steps
        # (the training's threads: left to itself, loading picks one thread for this small model, for the whole process)
        self.clf = ImageClassifier.load(resolve_model(None, "vit-shapes"), device="cpu", dtype="float32", threads=torch.get_num_threads())
        self.geometric = GeometricJudge()
        real, _ = shapes.render_batch(shapes.split_seeds("validation", n), size)
        self.reference = judge_images(self.clf, real)

    @torch.no_grad()
    def __call__(self, model: UNet2DModel, sched: dict) -> dict:
        from gencli.pipelines.ddpm.sampling import to_pixels
        from gencli.pipelines.generative.quality import judge_images, sample_report
        from gencli.schedulers import get_scheduler

        device = next(model.parameters()).device
        model.eval()
        images = []
        for start in range(0, self.n, 100):
            seeds = range(start, min(self.n, start + 100))
            gens = [torch.Generator().manual_seed(s) for s in seeds]
            cfg = model.config
            x = torch.cat([torch.randn((1, 3, *cfg.image_size), generator=g) for g in gens]).to(device)
            scheduler = get_scheduler("ddim", sched)
            scheduler.set_timesteps(self.steps)
            for t in scheduler.timesteps:
                x = scheduler.step(model(x, t), t, x).prev_sample
            images.append(to_pixels(x))
        pixels = np.concatenate(images)
        classes = [self.clf.labels[i] for i in sorted(self.clf.labels)]
        report = sample_report(judge_images(self.clf, pixels), self.reference, classes)
        geo = self.geometric.judge(pixels)
        model.train()
        return {"matching": geo["matching"], "frechet_distance": report["frechet_distance"], "recognised": report["recognised"],
                "classes_present": report["classes"]["classes_present"], "min_share": report["classes"]["min_share"]}  # fmt: skip


def timestep_sampler(abar: torch.Tensor, mean: float, std: float, uniform_share: float):
    """Draws training timesteps: a share ``uniform_share`` uniform over the schedule (Ho et al.), the
    rest at the timestep whose log signal-to-noise ratio log(abar / (1 - abar)) is nearest a draw from
    N(``mean``, ``std``). Uniform timesteps on a linear schedule rescaled to zero terminal SNR spend
    ~40% of the batch at log-SNR below -4, where the target is little more than the mean scene; the
    log-normal share moves them to the noise levels where an object's outline and colour are decided
    (the emphasis of EDM's log-normal noise levels and SD3's logit-normal timesteps)."""
    log_snr = torch.log(abar.double().clamp_min(1e-12)) - torch.log1p(-abar.double().clamp(max=1 - 1e-12))
    ascending = log_snr.flip(0)  # log-SNR falls with t: searched on its reverse

    def draw(n: int, gen: torch.Generator) -> torch.Tensor:
        t = torch.randint(0, len(abar), (n,), generator=gen)
        if uniform_share >= 1.0:
            return t
        target = mean + std * torch.randn(n, generator=gen, dtype=torch.float64)
        i = torch.searchsorted(ascending, target).clamp(1, len(abar) - 1)
        nearer = torch.where((target - ascending[i - 1]).abs() < (ascending[i] - target).abs(), i - 1, i)
        pick = torch.rand(n, generator=gen) >= uniform_share
        return torch.where(pick, len(abar) - 1 - nearer, t)

    return draw


def init_from(folder: Path, model: UNet2DModel, ema: UNet2DModel, sched: dict) -> str:
    """Load an exported pipeline folder's UNet weights into ``model`` and ``ema`` (float32); the folder's
    UNet config and noise schedule must be the run's. Returns what it loaded, for the run's command."""
    from safetensors import safe_open

    for part in ("unet/config.json", "unet/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"):
        if not (folder / part).is_file():
            raise SystemExit(f"--init-from {folder}: no {part} (an exported pipeline folder, e.g. weights/ddpm-shapes)")
    theirs = UNet2DConfig.from_dict(json.loads((folder / "unet" / "config.json").read_text())).to_dict()
    ours = model.config.to_dict()
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key) != ours.get(key):
            raise SystemExit(f"--init-from {folder}: its UNet has {key} {theirs.get(key)!r}, this run's {ours.get(key)!r} (--widths, --layers ...)")
    their_sched = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    for key in ("num_train_timesteps", "beta_schedule", "prediction_type", "rescale_betas_zero_snr"):
        if their_sched.get(key) != sched.get(key):
            raise SystemExit(f"--init-from {folder}: its scheduler has {key} {their_sched.get(key)!r}, this run's {sched.get(key)!r}")
    with safe_open(str(folder / "unet" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        weights = {k: f.get_tensor(k).float() for k in f.keys()}
        steps = (f.metadata() or {}).get("steps", "?")
    for m in (model, ema):
        m.load_state_dict(weights, strict=True)
    print(f"started from {folder} (trained {steps} steps)", flush=True)
    return f"{folder} (trained {steps} steps)"


def better(a: dict, b: dict) -> bool:
    """``a`` beats ``b``: more samples matching a shape, then a lower Frechet distance."""
    return (a["matching"], -a["frechet_distance"]) > (b["matching"], -b["frechet_distance"])


def main() -> None:
    p = training_parser(__doc__.split("\n\n")[0], out="runs/ddpm", steps=60000, batch=64, lr=2e-4)
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.add_argument("--widths", default="64,128,128,256", help="channels per UNet level")
    p.add_argument("--layers", type=int, default=2, help="ResNet blocks per down level")
    p.add_argument("--attention-from", type=int, default=2, help="first level (0 = full resolution) with pixel attention")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--groups", type=int, default=32, help="GroupNorm groups")
    p.add_argument("--timesteps", type=int, default=1000)
    p.add_argument("--beta-schedule", default="linear", choices=("linear", "scaled_linear", "squaredcos_cap_v2"))
    p.add_argument("--prediction-type", default="v_prediction", choices=("v_prediction", "epsilon"), help="what the UNet predicts")
    p.add_argument("--no-zero-snr", dest="zero_snr", action="store_false", help="keep the schedule's non-zero terminal SNR (Ho et al.)")
    p.add_argument("--uniform-share", type=float, default=1.0, help="share of each batch's timesteps drawn uniformly; the rest by --log-snr")
    p.add_argument("--log-snr", default="-1,2.5", help="MEAN,STD of the normal log-SNR the other timesteps are drawn at")
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--eval-every", type=int, default=2000, help="judge the averaged model every N steps and keep the best (0: off)")
    p.add_argument("--eval-n", type=int, default=300)
    p.add_argument("--eval-steps", type=int, default=50, help="DDIM steps of the judged samples")
    p.add_argument("--fp16", action="store_true", help="export the weights in float16 (half the size)")
    p.add_argument("--default-sampler", help="the exported folder's generation_config.json: gencli sample ddpm's default sampler")
    p.add_argument("--default-steps", type=int, help="... and its default number of steps")
    p.add_argument("--compile", default="off", choices=("off", "default", "reduce-overhead"),
                   help="torch.compile the training forward (the same steps, fused: ~17%% faster on a 2-core CPU; "
                        "reduce-overhead adds CUDA graphs)")  # fmt: skip
    p.add_argument("--init-from", type=Path,
                   help="an exported pipeline folder (e.g. weights/ddpm-shapes) whose UNet weights start a fresh run (model and average): "
                        "a GPU run goes on from the CPU-trained default without its 70 MB checkpoint")  # fmt: skip
    p.add_argument("--pipeline", default="ddim", choices=("ddim", "ddpm"),
                   help="the exported folder: a DDIMPipeline (50 DDIM steps by default, as judged) or a DDPMPipeline (1000 ancestral steps)")  # fmt: skip
    args = parse_training_args(p)
    widths = tuple(int(w) for w in args.widths.split(","))
    config = unet_config(args.size, widths, args.layers, args.attention_from, args.head_dim, args.groups)
    if args.zero_snr and args.prediction_type == "epsilon":
        raise SystemExit("--prediction-type epsilon cannot be learnt at zero terminal SNR (x_T is the noise itself): add --no-zero-snr")
    sched = scheduler_config(args.timesteps, args.beta_schedule, args.prediction_type, args.zero_snr)
    device = torch.device(args.device)
    if device.type == "cuda":  # fixed shapes every step: let cuDNN pick its fastest convolutions once
        torch.backends.cudnn.benchmark = True
    # channels-last feature maps: oneDNN's convolutions and their gradients run ~20% faster on a CPU (bf16 autocast)
    model = UNet2DModel(config).to(device, memory_format=torch.channels_last).train()
    ema = copy.deepcopy(model).requires_grad_(False)
    # the compiled module shares model's parameters; checkpoints keep model's own (unprefixed) keys
    forward = model if args.compile == "off" else torch.compile(model, mode=args.compile)
    # fused: one kernel for every parameter (4-5x faster than the per-tensor loop on a CPU, a few launches on a GPU)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path, best_path = args.out / "ckpt.pt", args.out / "best.pt"
    step, command, state = resume(ckpt_path, model=model, ema=ema, opt=opt)
    if args.init_from is not None and state is None:
        command += f"  # started from the weights of {init_from(args.init_from, model, ema, sched)}"
    best = (state or {}).get("best", {"matching": -1.0, "frechet_distance": math.inf})
    if state and "steps" in state and args.time_budget:
        args.steps = state["steps"]
    print(f"UNet2DModel: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {args.size}x{args.size}, from step {step}", flush=True)
    noise_schedule = DDPMScheduler(sched)
    abar = noise_schedule.alphas_cumprod.to(device)
    gen = torch.Generator().manual_seed(4321 + step)
    log_snr_mean, log_snr_std = (float(v) for v in args.log_snr.split(","))
    draw_timesteps = timestep_sampler(noise_schedule.alphas_cumprod, log_snr_mean, log_snr_std, args.uniform_share)
    judge = Judge(args.eval_n, args.size, args.eval_steps) if args.eval_every and args.export is None else None
    budget = StepBudget(args.time_budget)
    budget.begin(step)
    data = prefetched(functools.partial(batch, n=args.batch, size=args.size), step, 10**9, args.data_workers if args.export is None else 0)
    t0 = time.time()
    while step < args.steps and args.export is None:
        lr = warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=0.05)
        set_lr(opt, lr)
        x0 = next(data).to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        t = draw_timesteps(x0.shape[0], gen).to(device)
        eps = torch.randn(x0.shape, generator=gen).to(device)
        a = abar[t].view(-1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * eps
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = forward(xt, t)
        target = eps if args.prediction_type == "epsilon" else a.sqrt() * eps - (1 - a).sqrt() * x0
        loss = F.mse_loss(pred.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(args.ema, (1 + step) / (10 + step))
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)
        step += 1
        planned = budget.steps(step)
        if planned is not None:
            args.steps = planned
            print(f"{budget.seconds_per_step * 1000:.1f} ms/step: the run ends at step {planned}", flush=True)
        if step % 50 == 0:
            print(f"step {step} lr {lr:.2e} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
        judged = judge is not None and (step % args.eval_every == 0 or step == args.steps)
        if judged:
            report = judge(ema, sched)
            improved = better(report, best)
            print(f"eval step {step}: matching {report['matching']:.3f} fd {report['frechet_distance']:.1f} recognised {report['recognised']:.3f} "
                  f"classes {report['classes_present']} min share {report['min_share']:.3f}{'  (best)' if improved else ''}", flush=True)  # fmt: skip
            if improved:
                best = {**report, "step": step}
                save_checkpoint(best_path, {"ema": ema.state_dict(), "step": step, "best": best})
        if judged or step % args.ckpt_every == 0 or step == args.steps:
            save_checkpoint(ckpt_path, {"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step,
                                        "steps": args.steps, "command": command, "best": best})  # fmt: skip
    chosen = load_checkpoint(best_path)
    if chosen is not None:
        ema.load_state_dict(chosen["ema"])
        step = chosen["step"]
        print(f"exporting the best checkpoint: step {step}, {chosen['best']}", flush=True)
    folder = args.export or args.out / "pipeline"
    generation = {k: v for k, v in (("sampler", args.default_sampler), ("num_inference_steps", args.default_steps)) if v is not None}
    export_pipeline(ema.cpu().float().eval(), sched, folder, dtype=torch.float16 if args.fp16 else torch.float32,
                    metadata={"steps": str(step), "command": command}, pipeline=args.pipeline, generation=generation)  # fmt: skip
    print(f"exported to {folder}", flush=True)


if __name__ == "__main__":
    main()
