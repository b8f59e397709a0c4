"""The decoding step of fixed shapes: a :class:`~gencli.backend.attention.StaticKVCache` written by
position, and the one-token step compiled with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs
on a GPU) so that it is captured once and replayed for every token.

On CUDA the compiled step is the default (``compile=None``) for generations of at least
``COMPILE_MIN_STEPS`` tokens, which repay the first compile; ``compile=True`` asks for it on any
device, ``False`` turns it off. The static cache's length is rounded up to ``CAPACITY_MULTIPLE`` so
that runs of other prompt lengths replay the same shapes (and torch's compile cache serves them).
Where torch cannot compile (no compiler, an unsupported device) the step runs eagerly after one
warning. The static cache alone (``static_cache=True``) runs the same
fixed-shape step without compiling it: the token ids equal those of the growing cache.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable, Optional

import torch

from gencli.models.causal_lm import CausalLM

Step = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor]

COMPILE_MIN_STEPS = 128
CAPACITY_MULTIPLE = 256


def wants_static(device: torch.device, compile: Optional[bool], static_cache: Optional[bool], steps: int = COMPILE_MIN_STEPS) -> tuple[bool, bool]:
    """``(static cache, compiled step)`` for a generation of ``steps`` tokens on ``device``: compiling
    is on by default on CUDA for long enough generations; a compiled step always uses the static cache."""
    compiled = (device.type == "cuda" and steps >= COMPILE_MIN_STEPS) if compile is None else bool(compile)
    return compiled or bool(static_cache), compiled


def static_capacity(length: int) -> int:
    """The static cache's length for ``length`` positions: rounded up to a multiple of ``CAPACITY_MULTIPLE``."""
    return -(-length // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


def decode_step(model: CausalLM, cache, attention_mask: Optional[torch.Tensor]) -> Step:
    """``step(ids (B, 1), position_ids (B, 1) or None, cache_position (1,)) -> logits (B, V)`` over
    ``cache`` (a static cache), every shape fixed from one token to the next."""

    def step(ids: torch.Tensor, pos: Optional[torch.Tensor], cache_position: torch.Tensor) -> torch.Tensor:
        hidden = model.hidden_states(ids, position_ids=pos, attention_mask=attention_mask, kv_cache=cache, cache_position=cache_position, logits_to_keep=1)
        return model.lm_head(hidden[:, -1])

    return step


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def compiled(step: Step, on_info: Optional[Callable[[str], None]] = None, on_warning: Callable[[str], None] = _warn) -> Step:
    """``step`` compiled for replay (``mode="reduce-overhead"``: CUDA graphs on a GPU). The first call
    compiles (its cost goes to ``on_info``; torch's compile cache keeps what it can between runs); if
    compiling fails, one warning and the eager step from then on."""
    try:
        fast = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    except Exception as exc:  # torch without a compiler backend for this platform
        on_warning(f"--compile: torch cannot compile here ({type(exc).__name__}: {exc}); decoding eagerly")
        return step
    state = {"fn": fast, "first": True}

    def run(ids: torch.Tensor, pos: Optional[torch.Tensor], cache_position: torch.Tensor) -> torch.Tensor:
        if not state["first"]:
            return state["fn"](ids, pos, cache_position)
        state["first"] = False
        t = time.perf_counter()
        try:
            with warnings.catch_warnings():  # (torch's notes while it traces: the outcome is said below)
                warnings.simplefilter("ignore")
                out = fast(ids, pos, cache_position)
        except Exception as exc:  # no C++ compiler, an unsupported device or op: the step runs as it is
            state["fn"] = step
            on_warning(f"--compile: compiling the decoding step failed ({type(exc).__name__}); decoding eagerly")
            return step(ids, pos, cache_position)
        took = time.perf_counter() - t
        if on_info is not None and took > 0.5:  # (a graph compiled before in this process is reused)
            on_info(f"compiled the decoding step in {took:.1f} s (once per batch shape)")
        return out

    return run
