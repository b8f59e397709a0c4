"""gencli's own CPU kernels for decoding (a few activation rows): weight-only quantized layers, and the
dense fp32 / bf16 layers of :mod:`gencli.backend.streamed_linear`.

torch's ``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu`` take bf16 activations and, at one
row, stay well below the memory bandwidth a matrix-vector product is bound by (torchao's CPU
weight-only configs call the same kernels, or dequantize and multiply in floating point). The C++
extension in ``csrc/quant_gemv.cpp`` reads the layouts :mod:`gencli.backend.quantize` stores (no
second copy of the weights), with the rows of the weight spread over torch's threads, in one of two
ways:

- int8 activations (the default): each activation row is quantized to int8 in blocks of 32 columns
  with one fp32 scale each, as llama.cpp does for its Q8_0 / Q4_0 products, and multiplied by the
  codes with integer dot products (AVX-512 VNNI ``vpdpbusd``, or AVX2's ``maddubs``); the int4 zero
  points are applied to the exact fp32 group sums of the activations;
- fp32 activations (``GENCLI_QUANT_ACTIVATIONS=fp32``): the codes are converted to fp32 in registers
  and multiplied with FMAs (AVX-512 or AVX2), exact to fp32 rounding; slower for int4, whose decoding
  is then bound by the conversions rather than by memory. Dense bf16 and fp32 weights always run this
  way (bf16 values widened to fp32 in registers).

The same extension holds the decode attention, the fused decoding step (``csrc/decoder_step.cpp``) and
the Winograd 3x3 convolution of :mod:`gencli.backend.winograd` (``csrc/winograd_conv.cpp``).

The extension is compiled the first time it is asked for (``torch.utils.cpp_extension.load``: about
a minute, cached in torch's extensions folder for the next runs). Without a compiler, on another
architecture, or when the build fails, :func:`cpu_kernels` returns None (one debug line;
:func:`unavailable_reason` says why) and the quantized layers keep torch's kernels, the unquantized
ones torch's layers. A build the compiler rejects leaves a note in the build folder
(``build-failed-*.txt``) so that the processes of the next day do not each spend another minute
failing the same way (they say so in one notice); a new source, compiler, torch or Python headers,
deleting the note, or a day later, tries again. A build cut short (a signal, the compiler killed for
memory) leaves none.
``GENCLI_QUANT_KERNELS=0`` turns the extension off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from gencli.errors import Notice

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "quant_gemv.cpp"
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))  # one extension
HEADERS = tuple(sorted([*CSRC.glob("*.h"), *CSRC.glob("*.inc")]))  # included by the sources: part of the build's identity
ENV_SWITCH = "GENCLI_QUANT_KERNELS"
ENV_ACTIVATIONS = "GENCLI_QUANT_ACTIVATIONS"
ACTIVATIONS = ("int8", "fp32")

_log = logging.getLogger(__name__)
_BUILD_FLAGS_TAG = b"-O3 -fopenmp"  # part of the extension's name: new flags are a new build


def enabled() -> bool:
    """False when ``GENCLI_QUANT_KERNELS`` is set to 0 / false / off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


_why_not: Optional[str] = None  # why the last build gave no extension (one line)


def _unavailable(reason: str) -> None:
    global _why_not
    _why_not = reason
    _log.debug("quantized CPU kernels unavailable (%s), using torch's", reason)


@functools.lru_cache(maxsize=None)
def _build() -> Optional[Any]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _unavailable(f"not built on {platform.machine()}: x86-64 only")
        return None
    try:
        from torch.utils.cpp_extension import is_ninja_available, load

        compiler = os.environ.get("CXX") or "c++"  # what torch's build calls
        if not is_ninja_available():
            _unavailable("ninja, which torch builds extensions with, is not installed (pip install ninja)")
            return None
        if shutil.which(compiler) is None:
            _unavailable(f"no C++ compiler: '{compiler}' is not on PATH")
            return None

        # the name carries the source's hash: an edited source is a new extension, never a stale one
        digest = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS) + _BUILD_FLAGS_TAG).hexdigest()[:12]
        name = f"gencli_quant_gemv_{digest}"
        marker = None if _built_already(name) else _failure_note(name, compiler)
        if marker is not None and _recent(marker):
            reason = marker.read_text(encoding="utf-8", errors="replace").strip()
            _unavailable(f"{reason} (an earlier build; delete {marker} to try again)")
            warnings.warn(
                f"gencli's CPU kernels failed to build earlier ({reason}): decoding and DDPM's float32 convolutions use torch's slower ones "
                f"for a day, unless {marker} is deleted to try again",
                Notice,
                stacklevel=2,
            )
            return None
        _announce_first_build(name)
        # -fopenmp: at::parallel_for is inline OpenMP in the headers; without it the rows run on one
        # thread. The library it links is libgomp.so.1, already loaded by torch: one thread pool.
        try:
            module = load(name=name, sources=[str(f) for f in SOURCES], extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:
            if marker is not None:
                _remember_failure(marker, exc)
            raise
        if not module.isa():
            _unavailable("this CPU has neither AVX-512 nor AVX2")
            return None
        return module
    except Exception as exc:  # no Python headers, a failed build: torch's kernels serve
        _unavailable(_one_line(exc))
        return None


def _one_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


FAILURE_NOTE_SECONDS = 24 * 3600  # how long a failed build is believed before the next process tries again


def _failure_note(name: str, compiler: str) -> Optional[Path]:
    """Where a failed build of ``name`` by ``compiler`` is remembered: in the extension's build folder,
    named after the compiler (its path and modification time), torch's version and Python's include
    folder (a new compiler, torch or Python headers try again); None when torch's build folder cannot be had."""
    try:
        import sysconfig

        import torch
        from torch.utils.cpp_extension import _get_build_directory

        exe = shutil.which(compiler) or compiler
        headers = sysconfig.get_paths()["include"]
        ident = f"{os.path.realpath(exe)}:{os.stat(exe).st_mtime_ns}:{torch.__version__}:{headers}:{os.path.isfile(os.path.join(headers, 'Python.h'))}"
        return Path(_get_build_directory(name, verbose=False)) / f"build-failed-{hashlib.sha256(ident.encode()).hexdigest()[:8]}.txt"
    except Exception:  # torch's private helper moved, or the folder cannot be made: no memory, only retries
        return None


def _recent(note: Path) -> bool:
    try:
        return time.time() - note.stat().st_mtime < FAILURE_NOTE_SECONDS
    except OSError:
        return False


def _remember_failure(note: Path, exc: Exception) -> None:
    """Write ``note`` when ``exc`` is the compiler's verdict on the sources: the build ran and exited
    with an error. Not for a build cut short (a signal, the compiler killed for memory), a failure to
    load what another process built, or when a recent note already says why (the first one stays)."""
    import subprocess

    cause = exc.__cause__
    text = str(exc)
    if not isinstance(cause, subprocess.CalledProcessError) or cause.returncode <= 0:
        return
    if any(word in text for word in ("Killed", "signal", "No space left", "Interrupt")) or _recent(note):
        return
    from gencli.io import atomic_write_bytes

    with contextlib.suppress(OSError):
        atomic_write_bytes(note, (_one_line(exc) + "\n").encode(), force=True)


def _built_already(name: str) -> bool:
    """Whether torch's build folder holds a built ``name`` (loading it needs no compiler)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return any(Path(_get_build_directory(name, verbose=False)).glob(f"{name}*.so"))
    except Exception:
        return False


def _announce_first_build(name: str) -> None:
    """One line on stderr before a build that is not cached yet (it takes about a minute, once), so
    the first quantized decoding on a CPU does not look hung."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(name, verbose=False))
    except Exception:  # the build folder is torch's business: without it, just say nothing
        return
    if _built_already(name):
        return
    sys.stderr.write(f"gencli: compiling the CPU kernels (decoding, convolutions; once, about a minute; cached in {folder})\n")
    sys.stderr.flush()


def int8_activations() -> bool:
    """Whether the kernels quantize the activations to int8 (``GENCLI_QUANT_ACTIVATIONS``: ``int8``,
    the default, or ``fp32``)."""
    value = os.environ.get(ENV_ACTIVATIONS, "int8").strip().lower()
    if value not in ACTIVATIONS:
        raise ValueError(f"{ENV_ACTIVATIONS} must be one of {', '.join(ACTIVATIONS)} (got '{value}')")
    return value == "int8"


def cpu_kernels() -> Optional[Any]:
    """The compiled extension (functions ``int8_gemv(x, q, scale, int8_activations=False, bias=None)``,
    ``int4_gemv(x, packed, scale, zero, group_size, int8_activations=False, bias=None)`` with ``x``
    float32 ``(..., K)``, their plain scalar references ``int8_gemv_reference`` / ``int4_gemv_reference``
    (``csrc/reference.cpp``), ``quantize_activations(x)``, ``decode_attention(q, k, v, scale, key_mask=None)``
    (``csrc/decode_attention.cpp``), the dense products ``dense_gemv(x, weight, bias=None)`` /
    ``dense_gemv_many`` / ``dense_gemv_reference`` (fp32 or bf16 weights), the fused step's
    ``DecoderStack``, ``winograd_conv3x3(x, u, bias=None, residual=None, chunk=0, reference=False)``
    (``csrc/winograd_conv.cpp``), ``isa()`` and ``int_isa()``), or None where it cannot be had: built once per
    process."""
    return _build() if enabled() else None


def unavailable_reason() -> Optional[str]:
    """Why :func:`cpu_kernels` gives None here, on one line (None when it gives the extension)."""
    if not enabled():
        return f"{ENV_SWITCH}={os.environ.get(ENV_SWITCH)} turns them off"
    return None if _build() is not None else _why_not


def loaded_kernels() -> Optional[Any]:
    """The extension if this process has built or loaded it already (a quantized or streamed layer asked
    for it), else None: never a build. The decode attention (:func:`gencli.backend.attention.scaled_dot_product_attention`)
    uses it then; a model that decodes through torch's layers (a small fp32 one), where attention is a
    small part of a token's time, does not pay for a compilation."""
    if not enabled() or _build.cache_info().currsize == 0:
        return None
    return _build()


__all__ = ["SOURCE", "SOURCES", "loaded_kernels", "ENV_SWITCH", "ENV_ACTIVATIONS", "enabled", "int8_activations", "cpu_kernels", "unavailable_reason"]
