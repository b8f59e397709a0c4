"""Position and timestep encodings, written once for every family.

- ``sinusoidal_position_encoding``: Vaswani et al. 2017, PE(pos, 2i) = sin(pos / 10000^(2i/d)),
  PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (interleaved; one source text uses the exponent k/d instead
  of 2i/d, we follow the paper);
- ``timestep_embedding``: the diffusion-model form (sin and cos halves, diffusers'
  ``get_timestep_embedding`` conventions: ``flip_sin_to_cos``, ``downscale_freq_shift``);
- ``RotaryEmbedding`` / ``apply_rotary``: RoPE (Su et al. 2021) in the half-split layout used by
  transformers' Llama, with the ``linear`` and ``llama3`` frequency scalings;
- ``interpolate_position_table``: a learned patch-position table (ViT, CLIP's vision tower) resized
  bicubically to another patch grid, as transformers' ``interpolate_pos_encoding`` does.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn


def sinusoidal_position_encoding(positions: torch.Tensor | int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """The paper's sinusoidal encoding for ``positions`` (an int n means 0..n-1): shape ``(*positions, dim)``."""
    if isinstance(positions, int):
        positions = torch.arange(positions)
    pos = positions.to(torch.float64).unsqueeze(-1)
    idx = torch.arange(dim, dtype=torch.float64)
    two_i = idx - (idx % 2)  # 2i for both members of the (sin, cos) pair
    angle = pos / torch.pow(torch.tensor(base, dtype=torch.float64), two_i / dim)
    pe = torch.where(idx % 2 == 0, torch.sin(angle), torch.cos(angle))
    return pe.to(torch.float32)


def timestep_embedding(
    timesteps: torch.Tensor,
    dim: int,
    *,
    flip_sin_to_cos: bool = False,
    downscale_freq_shift: float = 1.0,
    scale: float = 1.0,
    max_period: float = 10000.0,
) -> torch.Tensor:
    """Sinusoidal embedding of diffusion timesteps ``(N,)`` -> ``(N, dim)`` in fp32.

    freq_j = exp(-ln(max_period) * j / (half - downscale_freq_shift)); output [sin | cos]
    ([cos | sin] with ``flip_sin_to_cos``), zero-padded when ``dim`` is odd.
    """
    if timesteps.ndim == 0:
        timesteps = timesteps[None]
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    exponent = exponent / (half - downscale_freq_shift)
    args = timesteps.float()[:, None] * torch.exp(exponent)[None, :] * scale
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    if dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1))
    return emb


def rope_inverse_frequencies(head_dim: int, base: float = 10000.0, scaling: Optional[Mapping[str, Any]] = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and the attention scaling factor for a rope-scaling config.

    ``scaling`` is the checkpoint's ``rope_scaling`` dict (``{"rope_type": "llama3", "factor": 8, ...}``);
    None or ``"default"`` means plain RoPE. Returns ``(inv_freq (head_dim/2,), attention_factor)``.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths (low frequencies) are scaled down by `factor`, short ones kept,
        # and the band between them is interpolated smoothly.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope scaling type '{kind}' (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary position embeddings, computed in fp32 for given position ids."""

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: Optional[Mapping[str, Any]] = None):
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self.scaling = dict(scaling) if scaling else None
        inv_freq, self.attention_factor = rope_inverse_frequencies(head_dim, base, self.scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_buffers(self, device: torch.device) -> None:
        """Recompute the non-persistent table (called by the checkpoint loader after a meta-device build)."""
        inv_freq, _ = rope_inverse_frequencies(self.head_dim, self.base, self.scaling)
        self.inv_freq = inv_freq.to(device)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids (B, L)`` -> ``cos, sin`` of shape ``(B, L, head_dim)`` in ``dtype``."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos() * self.attention_factor
        sin = emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (B, H, L, D)`` by the tables ``cos, sin (B, L, D)`` (half-split layout), or by
    tables already shaped ``(B, 1, L, D)`` (a model rotating every layer's queries and keys by the
    same tables unsqueezes them once)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def interpolate_position_table(
    table: torch.Tensor,
    grid: tuple[int, int],
    new_grid: tuple[int, int],
    *,
    num_prefix: int = 1,
    cache: Optional[dict] = None,
) -> torch.Tensor:
    """A learned position table ``(1, prefix + rows * cols, D)`` for another patch grid.

    The patch part is resized bicubically (``align_corners=False``, computed in fp32, cast back) from
    ``grid`` to ``new_grid`` (rows, columns); the ``num_prefix`` leading entries (class and
    distillation tokens) are kept. The table itself is returned when the grid is unchanged. With a
    ``cache`` dict, inference calls reuse the last resized table of this table's version (the dict
    holds one entry; a changed weight is a new version).
    """
    if tuple(new_grid) == tuple(grid):
        return table
    key = (tuple(new_grid), table.dtype, table.device, table._version)
    cached = cache.get(key) if cache is not None else None
    if cached is not None and not torch.is_grad_enabled():
        return cached
    prefix, patches = table[:, :num_prefix], table[:, num_prefix:]
    dim = table.shape[-1]
    resized = patches.float().reshape(1, grid[0], grid[1], dim).permute(0, 3, 1, 2)
    resized = torch.nn.functional.interpolate(resized, size=tuple(new_grid), mode="bicubic", align_corners=False)
    patches = resized.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(table.dtype)
    out = torch.cat((prefix, patches), dim=1)
    if cache is not None and not torch.is_grad_enabled():
        cache.clear()
        cache[key] = out
    return out
