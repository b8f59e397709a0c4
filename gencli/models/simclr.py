"""A small ResNet-style image encoder trained with SimCLR (Chen et al. 2020), in gencli's own layout.

The encoder ``f`` (what a SimCLR checkpoint keeps): a stride-2 3x3 stem convolution, then one stage
per entry of ``block_out_channels``, each ``layers_per_block`` pre-norm residual blocks (the shared
:class:`gencli.models.resnet2d.ResnetBlock2D`: GroupNorm -> activation -> 3x3 conv, twice, plus a
1x1 shortcut where the width changes) and, between stages, a stride-2 3x3 convolution
(:class:`gencli.models.resnet2d.Downsample2D`); a last GroupNorm + activation, then global average
pooling over the spatial positions. The pooled vector (width ``block_out_channels[-1]``) is the
image's representation ``h``: what ``gencli embed --images`` returns and what the probes measure.

The projection head ``g`` (:class:`SimCLRProjectionHead`: Linear -> ReLU -> Linear, the paper's
two-layer MLP) maps ``h`` to the space where the NT-Xent loss compares views. It is used in
training only and, as in the paper, dropped afterwards: an exported checkpoint holds the encoder.

Layout of a checkpoint (``config.json`` with ``"model_type": "simclr"``,
``"architecture": "SimCLREncoder"`` + ``model.safetensors``)::

    conv_in.weight/bias                                    stem, stride 2
    down_blocks.S.resnets.R.{norm1,conv1,norm2,conv2}.*   S = stage, R = block (diffusers' names)
    down_blocks.S.resnets.R.conv_shortcut.*                where the width changes
    down_blocks.S.downsamplers.0.conv.*                    every stage but the last
    norm_out.weight/bias

The config (:class:`SimCLRConfig`): ``num_channels``, ``image_size`` (the side images are resized
to), ``stem_channels``, ``block_out_channels``, ``layers_per_block``, ``norm_num_groups``,
``hidden_act``, and the training head's ``projection_dim`` (recorded; the head is not stored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gencli.backend.layers import Conv2d, GroupNorm, Linear
from gencli.checkpoints.config import config_to_dict, read_config
from gencli.models.resnet2d import Downsample2D, ResnetBlock2D

ARCHITECTURE = "SimCLREncoder"
MODEL_TYPE = "simclr"


@dataclass
class SimCLRConfig:
    """The ``config.json`` of a :class:`SimCLREncoder`."""

    num_channels: int = 3
    image_size: int = 64
    stem_channels: int = 32
    block_out_channels: tuple[int, ...] = (32, 64, 128)
    layers_per_block: int = 1
    norm_num_groups: int = 8
    hidden_act: str = "silu"
    projection_dim: int = 64
    model_type: str = MODEL_TYPE
    architecture: str = ARCHITECTURE

    @property
    def hidden_size(self) -> int:
        """The width of the representation (the pooled last stage)."""
        return self.block_out_channels[-1]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SimCLRConfig":
        cfg = read_config(cls, d, required=("block_out_channels",), what="a SimCLR encoder")
        if cfg.model_type != MODEL_TYPE:
            raise ValueError(f"model_type is '{cfg.model_type}', not {MODEL_TYPE}")
        if not cfg.block_out_channels or any(c < 1 for c in cfg.block_out_channels) or cfg.layers_per_block < 1:
            raise ValueError("'block_out_channels' must list a positive width per stage and 'layers_per_block' be at least 1")
        widths = (cfg.stem_channels, *cfg.block_out_channels)
        if any(c % cfg.norm_num_groups for c in widths):
            raise ValueError(f"every width must be a multiple of norm_num_groups {cfg.norm_num_groups}")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        out = config_to_dict(self)
        return {"model_type": out.pop("model_type"), "architecture": out.pop("architecture"), **out}


class DownBlock(nn.Module):
    """One stage: residual blocks, then (except the last stage) a stride-2 convolution."""

    def __init__(self, cin: int, cout: int, config: SimCLRConfig, downsample: bool):
        super().__init__()
        g, act = config.norm_num_groups, config.hidden_act
        self.resnets = nn.ModuleList(
            ResnetBlock2D(cin if i == 0 else cout, cout, temb_channels=None, groups=g, eps=1e-5, non_linearity=act) for i in range(config.layers_per_block)
        )
        self.downsamplers = nn.ModuleList([Downsample2D(cout, use_conv=True, padding=1)]) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.resnets:
            x = block(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        return x


class SimCLREncoder(nn.Module):
    """Pixel values ``(B, C, H, W)`` -> the representation ``(B, hidden_size)`` (globally average-pooled)."""

    def __init__(self, config: SimCLRConfig):
        super().__init__()
        self.config = config
        ch = config.block_out_channels
        self.conv_in = Conv2d(config.num_channels, config.stem_channels, kernel_size=3, stride=2, padding=1)
        widths = (config.stem_channels, *ch)
        self.down_blocks = nn.ModuleList(DownBlock(widths[i], widths[i + 1], config, downsample=i < len(ch) - 1) for i in range(len(ch)))
        self.norm_out = GroupNorm(config.norm_num_groups, ch[-1], eps=1e-5)

    def feature_map(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The last stage's normalised, activated map ``(B, hidden_size, H', W')`` before pooling."""
        x = self.conv_in(pixel_values.to(self.conv_in.weight.dtype))
        for block in self.down_blocks:
            x = block(x)
        return self.norm_out(x, self.config.hidden_act)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.feature_map(pixel_values).mean(dim=(2, 3))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """He-normal convolutions, zero biases, unit GroupNorm scales (torch's defaults otherwise)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu", generator=generator)
                nn.init.zeros_(m.bias)


class SimCLRProjectionHead(nn.Module):
    """SimCLR's projection head ``g``: Linear -> ReLU -> Linear (training only; not exported)."""

    def __init__(self, hidden_size: int, projection_dim: int):
        super().__init__()
        self.fc1 = Linear(hidden_size, hidden_size)
        self.fc2 = Linear(hidden_size, projection_dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(h, activation="relu"))


__all__ = ["ARCHITECTURE", "MODEL_TYPE", "SimCLRConfig", "SimCLREncoder", "SimCLRProjectionHead"]
