"""Timing and memory helpers: load time, throughput, peak memory."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from gencli.backend.device import synchronize


@dataclass
class Stopwatch:
    """Accumulates named wall-clock durations (seconds); synchronises the device around each."""

    device: Optional[torch.device] = None
    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        if self.device is not None:
            synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device is not None:
                synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def rate(self, name: str, count: float) -> Optional[float]:
        """``count`` per second of the phase ``name`` (None if it took no measurable time)."""
        s = self.seconds.get(name, 0.0)
        return count / s if s > 0 else None


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory allocated by torch on CUDA; peak process RSS on CPU/MPS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()

