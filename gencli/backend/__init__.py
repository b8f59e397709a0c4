"""The shared device/kernel backend: device and dtype choice, the attention entry point, norms,
activations, position encodings, seeding and timing. Every model family builds on this package."""

from gencli.backend.attention import KVCache, LayerKVCache, build_mask, reference_attention, scaled_dot_product_attention
from gencli.backend.device import Placement, choose_placement, cpu_has_native_bf16, resolve_device, resolve_dtype, set_threads
from gencli.backend.layers import (
    Activation,
    FeedForward,
    GatedMLP,
    GroupNorm,
    LayerNorm,
    RMSNorm,
    get_activation,
    gelu_tanh,
    init_normal_,
    quick_gelu,
    swiglu,
)
from gencli.backend.positional import RotaryEmbedding, apply_rotary, rope_inverse_frequencies, rotate_half, sinusoidal_position_encoding, timestep_embedding
from gencli.backend.random import make_generator, multinomial, rand, randn, randn_tensor, seed_everything
from gencli.backend.timing import Stopwatch, format_bytes, peak_memory_bytes, reset_peak_memory

__all__ = [name for name in dir() if not name.startswith("_")]
