"""One denoising step with classifier-free guidance: gencli's UNet2DConditionModel vs diffusers' on the
same random-weight checkpoint folder and the same inputs.

    python scripts/bench.py unet --dtype float32 --rounds 3
    python scripts/bench.py unet --dtype bfloat16 --rounds 3
    python scripts/bench.py unet --channels 160,320,640,640 --context 768   # a narrower UNet

The default is an SD-1.5-shaped UNet (block_out_channels 320/640/1280/1280, 8 heads, 768-wide
context, about 860M parameters) at a 32x32 latent (256x256 pixels) with a batch of 2 (the
conditional and unconditional halves of CFG) and a 77-token context. Each side loads the diffusers
``unet/`` folder itself (``load_s``), runs one warm-up step (gencli packs its convolution weights
there), then ``--repeat`` steps at different timesteps: ``s_per_step`` is the best wall-clock step,
``cpu_s_per_step`` the best step in process CPU time (steadier than wall-clock on a shared machine).
The reference side saves its output; the gencli side reports its distance to it.
"""

from __future__ import annotations

import time

import torch

from bench_cases._util import device_and_dtype, peak_gpu_mb, sync

DESCRIPTION = "UNet step with CFG (batch 2), SD-1.5-shaped random UNet at a 32x32 latent (gencli vs diffusers)"
METRICS = {"s_per_step": "lower", "cpu_s_per_step": "lower", "load_s": "lower", "max_abs_diff_vs_reference": "lower"}


def add_arguments(p):
    p.add_argument("--latent", type=int, default=32, help="latent height and width (pixels / 8)")
    p.add_argument("--batch", type=int, default=2, help="UNet batch (2 = one image with CFG)")
    p.add_argument("--channels", default="320,640,1280,1280", help="block_out_channels")
    p.add_argument("--context", type=int, default=768, help="cross_attention_dim (768 SD 1.x, 1024 SD 2.x)")
    p.add_argument("--tokens", type=int, default=77)


def setup(args, workdir):
    from diffusers import UNet2DConditionModel

    channels = tuple(int(c) for c in args.channels.split(","))
    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=channels, cross_attention_dim=args.context, sample_size=args.latent)
    unet.save_pretrained(workdir / "unet", safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    inputs = {
        "sample": torch.randn(args.batch, 4, args.latent, args.latent, generator=g),
        "context": torch.randn(args.batch, args.tokens, args.context, generator=g),
    }
    torch.save(inputs, workdir / "inputs.pt")


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    inputs = torch.load(workdir / "inputs.pt", weights_only=True)
    start = time.perf_counter()
    if side == "gencli":
        from gencli.backend.device import Placement
        from gencli.pipelines.diffusion.unet_loading import load_unet

        model = load_unet(workdir / "unet", Placement(device, dtype))
        step = lambda x, t, c: model(x, t, c)  # noqa: E731
    else:
        from diffusers import UNet2DConditionModel

        model = UNet2DConditionModel.from_pretrained(workdir / "unet", torch_dtype=dtype).to(device).eval()
        step = lambda x, t, c: model(x, t, c).sample  # noqa: E731
    sync(device)
    load_s = time.perf_counter() - start

    sample = inputs["sample"].to(device, dtype)
    context = inputs["context"].to(device, dtype)
    timesteps = [torch.tensor(t, device=device) for t in (999, 759, 519, 279, 39)]
    wall, cpu = [], []
    with torch.inference_mode():
        out = step(sample, timesteps[0], context)  # warm-up (gencli packs its conv weights here)
        sync(device)
        for i in range(max(1, args.repeat)):
            t = timesteps[(i + 1) % len(timesteps)]
            w0, c0 = time.perf_counter(), time.process_time()
            step(sample, t, context)
            sync(device)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
        out = step(sample, timesteps[0], context).float().cpu()
    result = {
        "s_per_step": round(min(wall), 4),
        "cpu_s_per_step": round(min(cpu), 4),
        "load_s": round(load_s, 3),
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "peak_gpu_mb": peak_gpu_mb(device),
    }
    ref_path = workdir / f"reference_out_{result['dtype']}.pt"
    if side == "reference":
        torch.save(out, ref_path)
    elif ref_path.exists():
        ref = torch.load(ref_path, weights_only=True)
        result["max_abs_diff_vs_reference"] = float(f"{(out - ref).abs().max().item():.3g}")
        result["max_abs_reference"] = float(f"{ref.abs().max().item():.3g}")
    return result
