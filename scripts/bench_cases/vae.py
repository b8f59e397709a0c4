"""AutoencoderKL: gencli vs diffusers, encode + decode of the same images with the same random
SD-1.x-shaped VAE (widths 128/256/512/512, two ResNets per block, mid-block attention), same dtype.

    python scripts/bench.py vae                               # 256x256 and 512x512, fp32
    python scripts/bench.py vae --dtype bfloat16 --rounds 3
    python scripts/bench.py vae --sizes 256 --tile 128

For each size: seconds for one encode (posterior mean) + decode of one image (wall clock, best of
``--repeat``; and ``cpu_s_*``, the process's CPU seconds for one such pass, all threads together,
steadier than wall clock on a shared machine), and the peak memory
that pass adds on top of the loaded model (on a CPU: the process's peak resident set, reset before
each pass through ``/proc/self/clear_refs``; on CUDA: ``max_memory_allocated``). The largest size
is run again tiled (gencli: ``Tiling(tile_size=--tile)``; diffusers: ``enable_tiling()`` with
``tile_sample_min_size`` set to the same tile). ``max_abs_diff`` compares gencli's untiled output
with diffusers' for the largest size.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench_cases._util import best_time, device_and_dtype, sync

DESCRIPTION = "AutoencoderKL SD-1.x shape (random weights): encode+decode s and peak memory at 256/512 px, untiled and tiled"
METRICS = {
    "s_256": "lower",
    "s_512": "lower",
    "s_512_tiled": "lower",
    "peak_mb_256": "lower",
    "peak_mb_512": "lower",
    "peak_mb_512_tiled": "lower",
    "s_256_tiled": "lower",  # with --sizes 256
    "peak_mb_256_tiled": "lower",
    "cpu_s_256": "lower",
    "cpu_s_512": "lower",
    "cpu_s_256_tiled": "lower",
    "cpu_s_512_tiled": "lower",
    "load_s": "lower",
}


def add_arguments(p):
    p.add_argument("--sizes", default="256,512", help="image sides, comma-separated (the last one is also run tiled)")
    p.add_argument("--tile", type=int, default=256, help="tile side in pixels for the tiled pass")


def setup(args, workdir: Path):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=512,
    )
    vae.save_pretrained(workdir / "vae")
    g = torch.Generator().manual_seed(1)
    for size in (int(s) for s in args.sizes.split(",")):
        torch.save(torch.rand(1, 3, size, size, generator=g) * 2 - 1, workdir / f"image_{size}.pt")


def _reset_peak(device: torch.device) -> float:
    """Reset the peak-memory counter; return the current usage in MB."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status_mb("VmRSS")


def _peak(device: torch.device) -> float:
    if device.type == "cuda":
        sync(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _status_mb("VmHWM")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    start = time.perf_counter()
    if side == "gencli":
        from gencli.backend.device import Placement
        from gencli.models.autoencoder_kl.tiling import Tiling
        from gencli.pipelines.diffusion.vae import load_autoencoder

        # the same dtype as the reference side: diffusers' model class does not apply the config's
        # force_upcast (its pipelines do), so neither does this side; packed for inference as `gencli
        # reconstruct/encode/decode` load it (in float32 on a CPU: the 3x3 layers by Winograd's F(2x2, 3x3))
        model = load_autoencoder(workdir / "vae", Placement(device, dtype), config_overrides={"force_upcast": False}, prepack=True).model

        def roundtrip(x, tiled=False):
            model.tiling = Tiling(tile_size=args.tile, overlap=0.25, auto_above=None)
            return model.decode(model.encode(x, tile=tiled).mode(), tile=tiled)
    else:
        from diffusers import AutoencoderKL

        model = AutoencoderKL.from_pretrained(workdir / "vae", torch_dtype=dtype).to(device).eval()

        def roundtrip(x, tiled=False):
            if tiled:
                model.enable_tiling()
                model.tile_sample_min_size = args.tile
                model.tile_latent_min_size = args.tile // 8
            else:
                model.disable_tiling()
            return model.decode(model.encode(x).latent_dist.mode()).sample

    load_s = time.perf_counter() - start
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {"load_s": round(load_s, 3), "dtype": str(dtype).replace("torch.", "")}
    out = None
    with torch.inference_mode():
        for i, size in enumerate(sizes):
            x = torch.load(workdir / f"image_{size}.pt", weights_only=True).to(device, dtype)
            passes = [(f"{size}", False)] + ([(f"{size}_tiled", True)] if i == len(sizes) - 1 else [])
            for name, tiled in passes:
                roundtrip(x, tiled)  # warm-up (and oneDNN primitive creation) outside the measurement
                base = _reset_peak(device)
                cpu = time.process_time()
                y = roundtrip(x, tiled)
                sync(device)
                result[f"cpu_s_{name}"] = round(time.process_time() - cpu, 3)
                result[f"peak_mb_{name}"] = round(_peak(device) - base, 1)
                result[f"s_{name}"] = round(best_time(lambda x=x, tiled=tiled: roundtrip(x, tiled), device, args.repeat, warmup=0), 3)
                if name == f"{sizes[-1]}":
                    out = y.float().cpu()
    path = workdir / "reference_out.pt"
    if side == "reference":
        torch.save(out, path)
    elif path.exists():
        result["max_abs_diff"] = round((out - torch.load(path, weights_only=True)).abs().max().item(), 6)
    return result
