"""A DCGAN-style generator and discriminator (Radford et al. 2016), sized by their config.

- :class:`Generator`: ``z (B, latent_dim)`` -> ``proj`` to a ``generator_channels[0]`` feature map of
  ``image_size / 2**len(generator_channels)`` pixels, GroupNorm + ReLU, then per stage a x2
  :class:`~gencli.models.resnet2d.Upsample2D` conv (nearest neighbour + 3x3 conv, which avoids the
  checkerboard of transposed convolutions) to the next width with GroupNorm + ReLU, and ``conv_out`` +
  tanh to the image in ``[-1, 1]``. (DCGAN's BatchNorm is GroupNorm here: one norm for every family,
  and a sample does not depend on the others in its batch.)
- :class:`Discriminator`: ``conv_in``, then per stage a stride-2 :class:`~gencli.models.resnet2d.Downsample2D`
  conv with LeakyReLU(0.2), flattened to one realism logit by ``head``. Training wraps its weights in
  spectral normalisation; the saved weights are the normalised ones, so inference needs nothing else.

The truncation trick for a generator without a mapping network: the latent is pulled towards the
prior's mean (zero) by ``psi`` (``z * psi``), trading diversity for typical, more realistic samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from gencli.backend.layers import Conv2d, GroupNorm, Linear, get_activation
from gencli.checkpoints.config import JsonConfig
from gencli.models.resnet2d import Downsample2D, Upsample2D
from gencli.models.vae import check_pyramid

ARCHITECTURE = "DCGAN"


@dataclass
class DCGANConfig(JsonConfig):
    """``config.json`` of a generator + discriminator pair (``"architecture": "DCGAN"``)."""

    architecture: str = ARCHITECTURE
    image_size: int = 64
    out_channels: int = 3
    latent_dim: int = 64
    generator_channels: tuple[int, ...] = (256, 128, 64, 32)
    discriminator_channels: tuple[int, ...] = (32, 64, 128, 256)
    norm_num_groups: int = 8

    def __post_init__(self) -> None:
        self.generator_channels = tuple(int(c) for c in self.generator_channels)
        self.discriminator_channels = tuple(int(c) for c in self.discriminator_channels)
        if self.architecture != ARCHITECTURE:
            raise ValueError(f"architecture '{self.architecture}' is not {ARCHITECTURE}")
        check_pyramid(self.image_size, self.generator_channels, self.norm_num_groups)
        check_pyramid(self.image_size, self.discriminator_channels, None)
        if self.latent_dim < 1:
            raise ValueError("latent_dim must be at least 1")



class GeneratorStage(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int):
        super().__init__()
        self.upsampler = Upsample2D(in_channels, out_channels=out_channels)
        self.norm = GroupNorm(groups, out_channels, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.upsampler(x), "relu")


class Generator(nn.Module):
    def __init__(self, c: DCGANConfig):
        super().__init__()
        widths = c.generator_channels
        side = c.image_size >> len(widths)
        self.bottom = (widths[0], side, side)
        self.proj = Linear(c.latent_dim, widths[0] * side * side)
        self.norm_in = GroupNorm(c.norm_num_groups, widths[0], eps=1e-5)
        self.up_blocks = nn.ModuleList(
            GeneratorStage(w, widths[min(i + 1, len(widths) - 1)], c.norm_num_groups) for i, w in enumerate(widths)
        )
        self.conv_out = Conv2d(widths[-1], c.out_channels, kernel_size=3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.norm_in(self.proj(z).view(-1, *self.bottom), "relu")
        for block in self.up_blocks:
            h = block(h)
        return torch.tanh(self.conv_out(h))


class Discriminator(nn.Module):
    def __init__(self, c: DCGANConfig):
        super().__init__()
        widths = c.discriminator_channels
        side = c.image_size >> len(widths)
        self.act = get_activation("leaky_relu")
        self.conv_in = Conv2d(c.out_channels, widths[0], kernel_size=3, padding=1)
        self.down_blocks = nn.ModuleList(Downsample2D(widths[max(i - 1, 0)], out_channels=w, padding=1) for i, w in enumerate(widths))
        self.head = Linear(widths[-1] * side * side, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Realism logits ``(B,)`` for images ``(B, C, S, S)`` in ``[-1, 1]``."""
        h = self.act(self.conv_in(x))
        for block in self.down_blocks:
            h = self.act(block(h))
        return self.head(h.flatten(1)).squeeze(1)


class DCGAN(nn.Module):
    """The pair, as one checkpoint: ``generator.*`` and ``discriminator.*`` tensors."""

    def __init__(self, config: DCGANConfig):
        super().__init__()
        self.config = config
        self.generator = Generator(config)
        self.discriminator = Discriminator(config)

    def forward(self, z: torch.Tensor, truncation: float = 1.0) -> torch.Tensor:
        return self.generator(z * truncation if truncation != 1.0 else z)


__all__ = ["ARCHITECTURE", "DCGANConfig", "DCGAN", "Generator", "Discriminator", "GeneratorStage"]
