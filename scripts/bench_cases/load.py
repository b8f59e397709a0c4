"""Checkpoint loading: gencli's meta-device loader vs the usual init + load_state_dict."""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from bench_cases._util import device_and_dtype, peak_gpu_mb

DESCRIPTION = "load a 24-layer MLP stack (~400M parameters, fp32 safetensors): time and peak memory"
METRICS = {"load_s": "lower"}


def add_arguments(p):
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)


def make(width: int, layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(layers)])


def setup(args, workdir):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    with torch.device("meta"):
        model = make(args.width, args.layers)
    state = {k: torch.randn(v.shape) * 0.02 for k, v in model.state_dict().items()}
    save_file(state, str(workdir / "model.safetensors"))


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    path = workdir / "model.safetensors"
    start = time.perf_counter()
    if side == "gencli":
        from gencli.checkpoints.loader import load_model
        from gencli.checkpoints.reader import open_reader

        model = load_model(lambda: make(args.width, args.layers), open_reader(path), device=device, dtype=dtype)
    else:
        from safetensors.torch import load_file

        model = make(args.width, args.layers)  # random init, then overwritten
        model.load_state_dict(load_file(str(path)))
        model = model.to(device=device, dtype=dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    n = sum(p.numel() for p in model.parameters())
    return {"load_s": round(seconds, 3), "parameters_m": round(n / 1e6, 1), "peak_gpu_mb": peak_gpu_mb(device)}
