"""Convolutional blocks shared by the VAE (``AutoencoderKL``) and the diffusion UNet, in diffusers'
layout (attribute names are diffusers', so its checkpoints load by identity):

- :class:`ResnetBlock2D`: GroupNorm -> SiLU -> 3x3 conv, plus a projected timestep embedding
  (UNet; added, or as scale and shift with ``time_embedding_norm="scale_shift"``), GroupNorm ->
  SiLU -> dropout -> 3x3 conv, and a residual (a 1x1 ``conv_shortcut`` where the width changes),
  divided by ``output_scale_factor``;
- :class:`Downsample2D`: a stride-2 3x3 conv (``padding=0`` pads right and bottom by one first,
  as the VAE encoder does) or 2x2 average pooling;
- :class:`Upsample2D`: nearest-neighbour x2 (or to an explicit size), then a 3x3 conv.

Norms and activations come from :mod:`gencli.backend.layers` (one GroupNorm for every family).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.layers import Conv2d, GroupNorm, Linear, get_activation


class ResnetBlock2D(nn.Module):
    """diffusers' ``ResnetBlock2D`` (pre-norm, no up/down sampling inside the block)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: Optional[int] = None,
        *,
        temb_channels: Optional[int] = 512,
        groups: int = 32,
        groups_out: Optional[int] = None,
        eps: float = 1e-6,
        dropout: float = 0.0,
        non_linearity: str = "silu",
        time_embedding_norm: str = "default",
        output_scale_factor: float = 1.0,
        use_in_shortcut: Optional[bool] = None,
        conv_shortcut_bias: bool = True,
    ):
        super().__init__()
        out_channels = in_channels if out_channels is None else out_channels
        if time_embedding_norm not in ("default", "scale_shift"):
            raise ValueError(f"unsupported time_embedding_norm '{time_embedding_norm}' (default, scale_shift)")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.act = "silu" if non_linearity == "swish" else non_linearity
        get_activation(self.act)  # fail early on an unknown name
        self.time_embedding_norm = time_embedding_norm
        self.output_scale_factor = output_scale_factor
        self.norm1 = GroupNorm(groups, in_channels, eps=eps, affine=True)
        self.conv1 = Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        if temb_channels is not None:
            width = 2 * out_channels if time_embedding_norm == "scale_shift" else out_channels
            self.time_emb_proj: Optional[Linear] = Linear(temb_channels, width)
        else:
            self.time_emb_proj = None
        self.norm2 = GroupNorm(groups_out or groups, out_channels, eps=eps, affine=True)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
        shortcut = in_channels != out_channels if use_in_shortcut is None else use_in_shortcut
        self.conv_shortcut = Conv2d(in_channels, out_channels, kernel_size=1, bias=conv_shortcut_bias) if shortcut else None

    def forward(self, x: torch.Tensor, temb: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.conv1(self.norm1(x, self.act))
        scale_shift = None
        if self.time_emb_proj is not None and temb is not None:
            t = self.time_emb_proj(get_activation(self.act)(temb))[:, :, None, None]
            if self.time_embedding_norm == "default":
                h = h.add_(t)
            else:
                scale_shift = t.chunk(2, dim=1)
        if scale_shift is None:
            h = self.norm2(h, self.act)
        else:
            h = get_activation(self.act)(self.norm2(h) * (1 + scale_shift[0]) + scale_shift[1])
        return self.output(h, self.shortcut(x))

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """The residual branch: ``x``, or ``conv_shortcut(x)`` where the width changes."""
        return self.conv_shortcut(x) if self.conv_shortcut is not None else x

    def output(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The block's end: ``conv2(dropout(h)) + residual`` (``h``: the second norm's activated
        output, ``residual``: :meth:`shortcut` of the input), divided by ``output_scale_factor``."""
        out = self.conv2(self.dropout(h), residual=residual)  # the residual added inside the conv kernel where it can be
        if self.output_scale_factor != 1.0:
            out = out.div_(self.output_scale_factor)
        return out


class Downsample2D(nn.Module):
    """Halve the resolution: a stride-2 conv (key ``conv``) or 2x2 average pooling (``use_conv=False``).

    ``padding=0`` pads one column on the right and one row at the bottom before a conv without
    padding (diffusers' VAE encoder); ``padding=1`` is the UNet's symmetric conv.
    """

    def __init__(self, channels: int, *, use_conv: bool = True, out_channels: Optional[int] = None, padding: int = 1):
        super().__init__()
        out_channels = out_channels or channels
        self.padding = padding
        self.use_conv = use_conv
        if use_conv:
            self.conv = Conv2d(channels, out_channels, kernel_size=3, stride=2, padding=padding)
        elif channels != out_channels:
            raise ValueError("average-pool downsampling keeps the channel count")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_conv:
            return F.avg_pool2d(x, kernel_size=2, stride=2)
        if self.padding == 0:
            x = F.pad(x, (0, 1, 0, 1), mode="constant", value=0.0)
        return self.conv(x)


class Upsample2D(nn.Module):
    """Double the resolution (nearest neighbour; or to ``output_size``, as the UNet does for odd
    sizes), then a 3x3 conv (key ``conv``) when ``use_conv``."""

    def __init__(self, channels: int, *, use_conv: bool = True, out_channels: Optional[int] = None):
        super().__init__()
        self.use_conv = use_conv
        self.conv = Conv2d(channels, out_channels or channels, kernel_size=3, padding=1) if use_conv else None

    def forward(self, x: torch.Tensor, output_size: Optional[tuple[int, int]] = None) -> torch.Tensor:
        if output_size is None:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        else:
            x = F.interpolate(x, size=output_size, mode="nearest")
        return self.conv(x) if self.conv is not None else x


__all__ = ["ResnetBlock2D", "Downsample2D", "Upsample2D"]
