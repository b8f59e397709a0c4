"""Helpers shared by benchmark cases."""

from __future__ import annotations

import time
from typing import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_and_dtype(args, side: str) -> tuple[torch.device, torch.dtype]:
    """The device, and the dtype a side runs in (``auto`` means gencli's choice; the reference then uses fp32)."""
    from gencli.backend.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    if args.dtype == "auto":
        return device, (resolve_dtype("auto", device) if side == "gencli" else torch.float32)
    return device, DTYPES[args.dtype]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, repeat: int = 3, warmup: int = 1) -> float:
    """Best wall-clock seconds of ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    best = float("inf")
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def peak_gpu_mb(device: torch.device) -> float | None:
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return None
