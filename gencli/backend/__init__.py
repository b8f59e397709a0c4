"""The shared device/kernel backend: device and dtype choice, the attention entry point, norms,
activations, position encodings, seeding and timing. Every model family builds on this package.

Importing the package imports no torch (``gencli.backend.names`` serves the command line before
torch is loaded); the names below are loaded from their modules on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "attention": ("KVCache", "LayerKVCache", "build_mask", "reference_attention", "scaled_dot_product_attention"),
    "device": ("Placement", "choose_placement", "cpu_has_native_bf16", "resolve_device", "resolve_dtype", "set_threads"),
    "layers": (
        "Activation", "FeedForward", "GatedMLP", "GroupNorm", "LayerNorm", "Linear", "RMSNorm",
        "get_activation", "gelu_tanh", "init_normal_", "quick_gelu", "swiglu",
    ),
    "positional": (
        "RotaryEmbedding", "apply_rotary", "interpolate_position_table", "rope_inverse_frequencies",
        "rotate_half", "sinusoidal_position_encoding", "timestep_embedding",
    ),
    "random": ("make_generator", "multinomial", "rand", "randn", "randn_tensor", "seed_everything"),
    "timing": ("Stopwatch", "peak_memory_bytes", "reset_peak_memory"),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'gencli.backend' has no attribute '{name}'")
    return getattr(importlib.import_module(f"gencli.backend.{module}"), name)
