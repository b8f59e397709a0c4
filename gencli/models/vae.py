"""A convolutional variational autoencoder (Kingma & Welling 2014) with a vector latent.

- :class:`VAEEncoder`: ``conv_in``, then one stage per entry of ``block_out_channels`` (optional
  ResNet blocks, a stride-2 :class:`~gencli.models.resnet2d.Downsample2D` conv to the stage's width,
  GroupNorm + activation), flattened and projected by ``to_moments`` to the mean and log-variance of
  a ``latent_dim`` Gaussian;
- :class:`VAEDecoder`: the mirror image: ``from_latent`` projects the latent to the smallest feature
  map, then per stage GroupNorm + activation and a x2 :class:`~gencli.models.resnet2d.Upsample2D`
  conv (optional ResNet blocks), and ``conv_out`` to the image in ``[-1, 1]`` (not clamped);
- :class:`ConvVAE`: ``encode(x)`` -> :class:`~gencli.models.autoencoder_kl.model.DiagonalGaussianDistribution`
  over ``(B, latent_dim)``, ``decode(z)``, ``forward(x)`` with the reparameterisation trick.

The architecture scales with the config: ``image_size`` must be divisible by
``2 ** len(block_out_channels)``, the smallest feature map is ``image_size / 2**len(...)`` pixels
square. The prior is the standard normal, so sampling is ``decode(temperature * randn(latent_dim))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from gencli.backend.layers import Conv2d, GroupNorm, Linear, get_activation
from gencli.checkpoints.config import JsonConfig
from gencli.models.autoencoder_kl.model import DiagonalGaussianDistribution
from gencli.models.resnet2d import Downsample2D, ResnetBlock2D, Upsample2D

ARCHITECTURE = "ConvVAE"


@dataclass
class ConvVAEConfig(JsonConfig):
    """``config.json`` of a :class:`ConvVAE` (``"architecture": "ConvVAE"``)."""

    architecture: str = ARCHITECTURE
    image_size: int = 64
    in_channels: int = 3
    latent_dim: int = 64
    block_out_channels: tuple[int, ...] = (32, 64, 128, 256)
    layers_per_block: int = 0
    norm_num_groups: int = 8
    act_fn: str = "silu"

    def __post_init__(self) -> None:
        self.block_out_channels = tuple(int(c) for c in self.block_out_channels)
        if self.architecture != ARCHITECTURE:
            raise ValueError(f"architecture '{self.architecture}' is not {ARCHITECTURE}")
        check_pyramid(self.image_size, self.block_out_channels, self.norm_num_groups)
        if self.latent_dim < 1 or self.layers_per_block < 0:
            raise ValueError("latent_dim must be at least 1 and layers_per_block at least 0")
        get_activation(self.act_fn)

    @property
    def bottom_size(self) -> int:
        return self.image_size >> len(self.block_out_channels)



def check_pyramid(image_size: int, widths: tuple[int, ...], groups: Optional[int]) -> None:
    """An image pyramid of ``len(widths)`` x2 stages must divide ``image_size`` and fit the norms' groups."""
    if not widths:
        raise ValueError("block_out_channels is empty")
    if image_size < 2 ** len(widths) or image_size % (2 ** len(widths)):
        raise ValueError(f"image_size {image_size} is not divisible by 2**{len(widths)} (one x2 stage per width)")
    if groups is not None:
        odd = [c for c in widths if c % groups]
        if odd:
            raise ValueError(f"width {odd[0]} is not divisible by norm_num_groups={groups}")


class VAEStage(nn.Module):
    """``layers`` ResNet blocks at ``in_channels``, a x2 resampling conv to ``out_channels``, GroupNorm."""

    def __init__(self, in_channels: int, out_channels: int, layers: int, groups: int, act: str, down: bool):
        super().__init__()
        self.act = act
        self.resnets = nn.ModuleList(
            ResnetBlock2D(in_channels, in_channels, temb_channels=None, groups=groups, non_linearity=act) for _ in range(layers)
        )
        if down:
            self.resampler: nn.Module = Downsample2D(in_channels, out_channels=out_channels, padding=1)
        else:
            self.resampler = Upsample2D(in_channels, out_channels=out_channels)
        self.norm = GroupNorm(groups, out_channels, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.norm(self.resampler(x), self.act)


class VAEEncoder(nn.Module):
    def __init__(self, c: ConvVAEConfig):
        super().__init__()
        widths = c.block_out_channels
        self.conv_in = Conv2d(c.in_channels, widths[0], kernel_size=3, padding=1)
        self.down_blocks = nn.ModuleList(
            VAEStage(widths[max(i - 1, 0)], w, c.layers_per_block, c.norm_num_groups, c.act_fn, down=True) for i, w in enumerate(widths)
        )
        self.to_moments = Linear(widths[-1] * c.bottom_size**2, 2 * c.latent_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for block in self.down_blocks:
            h = block(h)
        return self.to_moments(h.flatten(1))


class VAEDecoder(nn.Module):
    def __init__(self, c: ConvVAEConfig):
        super().__init__()
        widths = tuple(reversed(c.block_out_channels))
        self.bottom = (widths[0], c.bottom_size, c.bottom_size)
        self.act = c.act_fn
        self.from_latent = Linear(c.latent_dim, widths[0] * c.bottom_size**2)
        self.norm_in = GroupNorm(c.norm_num_groups, widths[0], eps=1e-6)
        self.up_blocks = nn.ModuleList(
            VAEStage(w, widths[min(i + 1, len(widths) - 1)], c.layers_per_block, c.norm_num_groups, c.act_fn, down=False)
            for i, w in enumerate(widths)
        )
        self.conv_out = Conv2d(widths[-1], c.in_channels, kernel_size=3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.norm_in(self.from_latent(z).view(-1, *self.bottom), self.act)
        for block in self.up_blocks:
            h = block(h)
        return self.conv_out(h)


class ConvVAE(nn.Module):
    """Images ``(B, C, S, S)`` in ``[-1, 1]`` <-> latents ``(B, latent_dim)`` under a standard-normal prior."""

    def __init__(self, config: ConvVAEConfig):
        super().__init__()
        self.config = config
        self.encoder = VAEEncoder(config)
        self.decoder = VAEDecoder(config)

    def encode(self, x: torch.Tensor) -> DiagonalGaussianDistribution:
        return DiagonalGaussianDistribution(self.encoder(x))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)

    def forward(self, x: torch.Tensor, sample_posterior: bool = True, generator: Optional[torch.Generator] = None):
        """``(reconstruction, posterior)``: decoded from a posterior sample (or its mean)."""
        posterior = self.encode(x)
        z = posterior.sample(generator) if sample_posterior else posterior.mode()
        return self.decode(z), posterior


__all__ = ["ARCHITECTURE", "ConvVAEConfig", "ConvVAE", "VAEEncoder", "VAEDecoder", "VAEStage", "check_pyramid"]
