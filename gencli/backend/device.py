"""Device, dtype and thread choice.

Auto rules (what is fastest without measurable quality loss):
- CUDA: bfloat16 where the GPU supports it, else float16 — for every family that runs in reduced
  precision (``family_kind="transformer"``); float32 for the small numerically touchy families
  (``"float"``: TFT, VAE/GAN) on every device.
- CPU: bfloat16 for transformer/UNet families when the CPU multiplies bf16 natively (AMX or
  AVX512-BF16 on x86, the BF16 extension on Arm); float32 otherwise. fp16 is never chosen on CPU:
  without native fp16 matmul it is slower than fp32.
- Autoregressive decoders (``"decoder"``: text generation) on CPU: the placement is float32 (fp32
  activations). Decoding one token at a time is a chain of matrix-vector products bound by the bytes
  of weights it reads, which the CPU's bf16 matrix units do not speed up; the text loader then keeps a
  bf16 checkpoint's linear weights in bf16 for gencli's kernels
  (:mod:`gencli.pipelines.text.loading`). bfloat16 when fp32 weights would take more than half of the
  machine's memory (on any CPU: gencli's kernels multiply bf16 weights without native bf16, and
  torch does so correctly, if slowly). On CUDA/MPS decoders follow the transformer rule.
- MPS: float16 for transformer families, float32 otherwise.

Threads (CPU), unless ``--threads``/``$GENCLI_THREADS`` says otherwise, and never more than the usable
cores (:func:`gencli.backend.cores.usable_cores`):
- 1 thread for work too small to share: batch-1 decoding of a model under
  ``DECODER_THREADS_MIN_PARAMS`` parameters (one matrix-vector product per weight and token: the
  threads spend more time meeting than multiplying, and on a busy machine each waits for the slowest;
  measured here on a shared 2-core CPU, the tiny GPT-2 decoded 14x faster with 1 thread than with 2),
  and batched work with a model under ``BATCHED_THREADS_MIN_PARAMS`` parameters, which includes the
  small numeric families (TFT, VAE, GAN) whose size is not told.
- ``min(usable cores, MAX_DEFAULT_THREADS)`` for larger models, and for transformer/UNet work whose
  size is not told (a diffusion pipeline): big matrix products and convolutions spread over cores.

torch's thread count belongs to the whole process, so the default rule only sets it where nobody
else has: while it is still torch's own starting count, or the count this rule set for an earlier
model. A count the application set itself (``torch.set_num_threads``, a training script's
``--threads``, an earlier explicit ``--threads``) is kept, and a second, smaller model loaded after a
bigger one (a judge beside a model being trained, a small encoder after a UNet) never lowers it.
"""

from __future__ import annotations

import functools
import os
import platform
import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from gencli.backend.cores import requested_threads, usable_cores
from gencli.backend.names import DEVICE_PATTERN
from gencli.errors import Notice, UserError

FamilyKind = Literal["transformer", "decoder", "float"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bf16 in hardware (so bf16 matmuls beat fp32 by a wide margin)."""
    override = os.environ.get("GENCLI_CPU_BF16")
    if override in ("0", "1"):
        return override == "1"
    machine = platform.machine().lower()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            text = fh.read(200_000)
    except OSError:
        text = ""
    if text:
        flags = set()
        for line in text.splitlines():
            if line.startswith(("flags", "Features")):
                flags.update(line.split(":", 1)[1].split())
                break
        if machine in ("x86_64", "amd64"):
            return bool({"amx_bf16", "avx512_bf16"} & flags)
        if machine in ("aarch64", "arm64"):
            return "bf16" in flags
    if platform.system() == "Darwin" and machine == "arm64":
        # Apple M2 and later implement the Arm BF16 extension.
        try:
            import subprocess

            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True, timeout=2)
            return out.stdout.strip() == "1"
        except Exception:  # noqa: BLE001
            return False
    return False


def resolve_device(spec: str = "auto") -> torch.device:
    """Turn ``auto|cpu|cuda|cuda:N|mps`` into a torch.device that exists, or raise UserError."""
    spec = (spec or "auto").strip().lower()
    m = DEVICE_PATTERN.match(spec)
    if not m:
        raise UserError(f"unknown device '{spec}': use auto, cpu, cuda, cuda:N or mps")
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if getattr(torch.backends, "mps", None) is None or not torch.backends.mps.is_available():
            raise UserError("device 'mps' requested but MPS is not available on this machine")
        return torch.device("mps")
    if not torch.cuda.is_available():
        raise UserError(f"device '{spec}' requested but CUDA is not available on this machine")
    index = int(m.group(3)) if m.group(3) is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise UserError(f"device '{spec}' does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def resolve_dtype(spec: str, device: torch.device, family_kind: FamilyKind = "transformer", n_params: Optional[int] = None) -> torch.dtype:
    """Turn ``auto|float32|bfloat16|float16`` into a torch dtype for ``device`` (see module doc).
    ``n_params`` (the checkpoint's parameter count, when known) lets a CPU decoder fall back to bf16
    when fp32 weights would not fit comfortably in memory."""
    spec = (spec or "auto").strip().lower()
    if spec != "auto":
        if spec not in DTYPES:
            raise UserError(f"unknown dtype '{spec}': use auto, float32, bfloat16 or float16")
        dtype = DTYPES[spec]
        if device.type == "mps" and dtype == torch.bfloat16 and not _mps_supports_bf16():
            raise UserError("bfloat16 is not supported on this MPS device: use float16 or float32")
        return dtype
    if family_kind == "float":
        return torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    if family_kind == "decoder":
        return torch.float32 if n_params is None or 4 * n_params <= physical_memory_bytes() // 2 else torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def physical_memory_bytes() -> int:
    """This machine's memory in bytes (8 GiB where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _mps_supports_bf16() -> bool:
    try:
        torch.zeros(1, dtype=torch.bfloat16, device="mps")
        return True
    except Exception:  # noqa: BLE001
        return False


DECODER_THREADS_MIN_PARAMS = 100_000_000  # batch-1 decoding: fewer parameters run on 1 thread
BATCHED_THREADS_MIN_PARAMS = 5_000_000  # batched work (images, series): fewer parameters run on 1 thread
MAX_DEFAULT_THREADS = 16  # the default never takes more (an explicit --threads may)


def default_threads(family_kind: FamilyKind, n_params: Optional[int], cores: int) -> int:
    """The thread count for ``family_kind`` work with an ``n_params`` model on ``cores`` usable cores
    when the user chose none (see the module doc)."""
    if family_kind == "decoder":
        small = n_params is None or n_params < DECODER_THREADS_MIN_PARAMS
    elif family_kind == "float":
        small = n_params is None or n_params < BATCHED_THREADS_MIN_PARAMS
    else:
        small = n_params is not None and n_params < BATCHED_THREADS_MIN_PARAMS
    return 1 if small else max(1, min(cores, MAX_DEFAULT_THREADS))


_TORCH_STARTING_THREADS = torch.get_num_threads()  # torch's own count when gencli was imported
_last_set: Optional[tuple[str, int]] = None  # ("explicit" | "rule", count): what this function last set


def set_threads(threads: Optional[int], family_kind: FamilyKind = "transformer", n_params: Optional[int] = None) -> int:
    """Set torch's CPU thread count: ``threads`` (``--threads``, else ``$GENCLI_THREADS``) capped at the
    usable cores (with a :class:`~gencli.errors.Notice` when it asked for more), else
    :func:`default_threads` where the process's count is still torch's own or the rule's (see the
    module doc; an application count equal to torch's starting one cannot be told from it). Returns
    the count the model runs with."""
    global _last_set
    cores = usable_cores()
    threads, notice = requested_threads(threads, cores)
    if notice is not None:
        warnings.warn(notice, Notice, stacklevel=2)
    current = torch.get_num_threads()
    if threads:
        n, who = min(int(threads), cores), "explicit"
    elif _last_set is not None and current == _last_set[1]:
        if _last_set[0] == "explicit":
            return current  # an earlier explicit count is still in force
        n, who = max(current, default_threads(family_kind, n_params, cores)), "rule"  # an earlier model chose more
    elif current == _TORCH_STARTING_THREADS:
        n, who = default_threads(family_kind, n_params, cores), "rule"
    else:
        return current  # the application's own count
    _last_set = (who, n)
    if current != n:
        torch.set_num_threads(n)
    return n


@dataclass(frozen=True)
class Placement:
    """Where and in which precision a model runs."""

    device: torch.device
    dtype: torch.dtype
    threads: Optional[int] = field(default=None, compare=False)  # torch's CPU threads, as set by choose_placement

    def describe(self) -> str:
        text = f"device {self.device}, dtype {DTYPE_NAMES.get(self.dtype, str(self.dtype))}"
        return text + (f", {self.threads} CPU thread(s)" if self.threads and self.device.type == "cpu" else "")


def choose_placement(
    device: str = "auto", dtype: str = "auto", family_kind: FamilyKind = "transformer", threads: Optional[int] = None, n_params: Optional[int] = None
) -> Placement:
    """Resolve the user's ``--device/--dtype/--threads`` for one model family; ``n_params`` (the
    checkpoint's parameter count, when known) informs the dtype and the default thread count."""
    dev = resolve_device(device)
    n_threads = set_threads(threads, family_kind, n_params)
    return Placement(dev, resolve_dtype(dtype, dev, family_kind, n_params), n_threads)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if platform.system() != "Linux":
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Give the memory the C allocator holds free back to the system (glibc's ``malloc_trim``).

    glibc keeps freed blocks of up to 32 MB in its heap for reuse; after a one-off reshuffle of
    weights (repacking a model's convolutions, say) that can leave gigabytes counted against the
    process. A no-op where there is no glibc.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class MemoryTrimmer:
    """Gives the C allocator's free memory back to the system (:func:`release_free_memory`) each time
    another ``every`` bytes of weights have been converted (quantized, transposed) and dropped. glibc keeps freed blocks
    of up to 32 MB in its heap, and the new tensors allocated between them pin the heap: without this the
    peak of converting a model layer by layer is near that of its old weights. Not after every layer: each trim
    costs milliseconds, and the pages it returns are faulted in again by the next layer."""

    def __init__(self, every: int = 64 << 20):
        self.every, self.pending = every, 0

    def freed(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.every:
            release_free_memory()
            self.pending = 0


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
