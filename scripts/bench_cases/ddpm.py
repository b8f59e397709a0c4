"""Pixel-space DDPM sampling: gencli's ``sample ddpm`` path vs diffusers' ``DDPMPipeline`` on the same
random-weight pipeline folder in the google/ddpm-cifar10-32 shape, one CPU generator per image.

    python scripts/bench.py ddpm --batch 1 --rounds 3
    python scripts/bench.py ddpm --batch 16 --dtype auto --device cuda

The UNet is google/ddpm-cifar10-32's (block_out_channels 128/256/256/256, attention at 16x16,
flip_sin_to_cos False, freq_shift 1, about 36M parameters) at 32x32, with its DDPMScheduler (1000
training steps, linear betas, fixed_small variance, clipped x0). Each side loads the folder itself
(``load_s``), runs one warm-up call of one step, then ``--repeat`` runs of ``--steps`` DDPM steps
for ``--batch`` images (seeds 0..batch-1): ``s_per_step`` is the best run's wall-clock time per
step, ``cpu_s_per_step`` the same in process CPU time. The reference side saves its images; the
gencli side reports the largest pixel difference to them (0-255; float32 parity allows 2).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench_cases._util import device_and_dtype, peak_gpu_mb, sync

DESCRIPTION = "DDPM sampling steps, google/ddpm-cifar10-32-shaped random UNet at 32x32 (gencli vs diffusers DDPMPipeline)"
METRICS = {"s_per_step": "lower", "cpu_s_per_step": "lower", "load_s": "lower", "max_pixel_diff_vs_reference": "lower"}

CIFAR10_UNET = dict(
    sample_size=32, in_channels=3, out_channels=3, block_out_channels=(128, 256, 256, 256), layers_per_block=2,
    down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=None, flip_sin_to_cos=False, freq_shift=1, norm_eps=1e-6, downsample_padding=0, dropout=0.1, norm_num_groups=32,
)  # fmt: skip


def add_arguments(p):
    p.add_argument("--batch", type=int, default=1, help="images sampled together")
    p.add_argument("--steps", type=int, default=10, help="DDPM steps per timed run (of the 1000-step schedule)")


def setup(args, workdir):
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    torch.manual_seed(0)
    unet = UNet2DModel(**CIFAR10_UNET)
    DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=1000)).save_pretrained(workdir / "pipeline")


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    folder = workdir / "pipeline"
    seeds = list(range(args.batch))
    start = time.perf_counter()
    if side == "gencli":
        from gencli.pipelines.ddpm import loading, sampling

        checkpoint = loading.inspect_pipeline(folder)
        # --dtype auto: the command's own choice (what `gencli sample ddpm --dtype auto` runs)
        wanted = "auto" if args.dtype == "auto" else str(dtype).replace("torch.", "")
        loaded = loading.open_ddpm(checkpoint, device=str(device), dtype=wanted, threads=torch.get_num_threads())
        dtype = loaded.placement.dtype

        def sample(steps: int) -> np.ndarray:
            return sampling.generate(loaded, seeds, sampler="ddpm", steps=steps, batch_size=len(seeds))
    else:
        from diffusers import DDPMPipeline

        pipe = DDPMPipeline.from_pretrained(folder, torch_dtype=dtype).to(device)
        pipe.set_progress_bar_config(disable=True)

        def sample(steps: int) -> np.ndarray:
            gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
            images = pipe(batch_size=len(seeds), generator=gens, num_inference_steps=steps, output_type="np").images
            return (images * 255).round().astype(np.uint8)

    sync(device)
    load_s = time.perf_counter() - start
    sample(1)  # warm-up
    wall, cpu = [], []
    out = None
    for _ in range(max(1, args.repeat)):
        w0, c0 = time.perf_counter(), time.process_time()
        out = sample(args.steps)
        sync(device)
        wall.append((time.perf_counter() - w0) / args.steps)
        cpu.append((time.process_time() - c0) / args.steps)
    result = {
        "s_per_step": round(min(wall), 4),
        "cpu_s_per_step": round(min(cpu), 4),
        "load_s": round(load_s, 3),
        "batch": args.batch,
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "peak_gpu_mb": peak_gpu_mb(device),
    }
    ref_path = workdir / f"reference_images_{args.batch}_{args.steps}.npy"
    if side == "reference" and result["dtype"] == "float32":
        np.save(ref_path, out)
    elif side == "gencli" and ref_path.exists():
        result["max_pixel_diff_vs_reference"] = int(np.abs(out.astype(int) - np.load(ref_path).astype(int)).max())
    return result
