"""How many CPU cores this process may use (no torch: the command line checks ``--threads`` against
it before torch is imported; :func:`gencli.backend.device.choose_placement` picks the default from it)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

from gencli.errors import UserError


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, cpusets), further limited by
    a cgroup v2 CPU quota (``docker run --cpus``, Kubernetes limits) where there is one; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def threads_from_env() -> Optional[int]:
    """``$GENCLI_THREADS`` (unset or empty: None); anything but a positive integer is a UserError."""
    raw = os.environ.get("GENCLI_THREADS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise UserError(f"GENCLI_THREADS must be a positive integer (got '{raw}')")
    return int(raw)


def requested_threads(threads: Optional[int], cores: Optional[int] = None) -> tuple[Optional[int], Optional[str]]:
    """``(threads, notice)``: ``--threads`` (else ``$GENCLI_THREADS``, else None: the work chooses)
    capped at the usable cores (``cores``, default :func:`usable_cores`), and the notice saying so
    when it asked for more."""
    source = "--threads"
    if threads is None:
        threads, source = threads_from_env(), "GENCLI_THREADS"
    cores = usable_cores() if cores is None else cores
    if threads is not None and threads > cores:
        return cores, f"{source} {threads} is more than the {cores} usable CPU core(s): using {cores}"
    return threads, None


def _cgroup_cpu_quota() -> int | None:
    """``cpu.max`` of this process's cgroup (v2) as whole cores, rounded up; None when unlimited or absent."""
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except OSError:
        return None
    if len(text) != 2 or text[0] == "max":
        return None
    try:
        quota, period = int(text[0]), int(text[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


__all__ = ["usable_cores"]
