"""What a benchmark ran on: the CPU's model, instruction sets and cache sizes, and the memory read
bandwidth measured on the spot (a streaming read at the run's thread count), so every figure names
its machine and a decode speed can be given as a fraction of what the memory allows."""

from __future__ import annotations

import time
from pathlib import Path

# the instruction sets that decide which kernels run (as /proc/cpuinfo spells them)
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_info() -> dict:
    """``{"cpu": model name, "isa": [...], "caches": {"L1d": ..., "L2": ..., "L3": ...}}`` (Linux; empty elsewhere)."""
    info: dict = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    info["cpu"] = fields.get("model name", "unknown")
    if "cpu family" in fields:  # the generation: a VM may name an AMD EPYC of any (family 25: Zen 3 / 4, 26: Zen 5)
        info["cpu"] += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    flags = set(fields.get("flags", "").split())
    info["isa"] = [f for f in FLAGS if f in flags]
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / n).read_text().strip() for n in ("level", "type", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            caches[f"L{level}" + ("d" if kind == "Data" else "")] = size
    info["caches"] = caches
    return info


def kernel_tuning() -> str:
    """The decoding products' per-CPU choices of gencli's CPU extension (csrc/cpu_features.cpp) as
    ``key=value`` pairs, or "" where the extension cannot be built (loading it may build it once)."""
    from gencli.backend.quant_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        return ""
    return " ".join(f"{k}={v}" for k, v in sorted(kernels.tuning().items()))


def read_bandwidth_gbs(threads: int | None = None, megabytes: int = 1024, rounds: int = 5, device: str = "cpu") -> float:
    """GB/s of a streaming read of a ``megabytes`` fp32 buffer (a sum over it), best of ``rounds``,
    at ``threads`` torch threads (or on a GPU ``device``): the memory's speed as a memory-bound kernel
    sees it. The buffer is larger than the caches of the CPUs this runs on, so it is read from memory."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    try:
        x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
        x.sum()  # pages touched before timing
        sync()
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            x.sum()
            sync()
            best = min(best, time.perf_counter() - t)
        return round(x.numel() * 4 / best / 1e9, 2)
    finally:
        torch.set_num_threads(before)


def bandwidth_fraction(bytes_per_token: float, tokens_per_s: float, bandwidth_gbs: float) -> float:
    """The share of the measured read bandwidth a decode speed uses: bytes read a token x tokens/s / bandwidth."""
    return round(bytes_per_token * tokens_per_s / (bandwidth_gbs * 1e9), 3)
