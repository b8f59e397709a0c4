"""The U-Net (Ronneberger, Fischer and Brox 2015) for semantic segmentation, in gencli's own layout.

A contracting path of ``len(channels)`` levels, each two 3x3 convolutions (each followed by an
optional GroupNorm and a ReLU), with a 2x2 max-pool between levels; an expanding path that, level by
level, doubles the resolution with a 2x2 up-convolution (a transposed convolution with stride 2
that halves the channels), *concatenates* the contracting path's map of that level (the skip
connection) and runs two 3x3 convolutions again; and a 1x1 convolution that classifies every pixel.

The convolutions are padded (``padding=1``), so every level keeps its size and the class map has
the size of the input image; the 2015 paper used unpadded ("valid") convolutions, so its output was
smaller than its input (a 572x572 tile gave a 388x388 map, the skip connections were cropped to
fit, and large images were segmented in overlapping tiles). For sizes that the max-pools do not
divide, the up-convolution's output is one row or column short of the skip connection's map and is
zero-padded at the bottom and right to meet it: any input size gives an output of that size.

The optional GroupNorm (``norm_groups`` > 0; the paper has none) normalises the same way in training
and inference, so a model trained on batches behaves identically on one image.

Layout of a checkpoint (``config.json`` with ``"architecture": "UNetSegmenter"`` + ``model.safetensors``)::

    down.L.conv1.weight/bias, down.L.norm1.weight/bias, down.L.conv2..., down.L.norm2...   L = 0..levels-1
    up.K.up.weight/bias (ConvTranspose2d), up.K.block.conv1/norm1/conv2/norm2 ...           K = 0..levels-2 (deepest first)
    classifier.weight/bias (1x1)

The config (:class:`UNetSegmenterConfig`): ``in_channels``, ``channels`` (per level, e.g.
``[16, 32, 64, 128]``), ``norm_groups`` (0 = no normalisation) and ``id2label``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.checkpoints.config import config_to_dict, read_config

ARCHITECTURE = "UNetSegmenter"


@dataclass
class UNetSegmenterConfig:
    """The ``config.json`` of a :class:`UNetSegmenter`."""

    in_channels: int = 3
    channels: tuple[int, ...] = (16, 32, 64, 128)
    norm_groups: int = 0
    id2label: dict[int, str] = field(default_factory=lambda: {0: "background", 1: "object"})
    architecture: str = ARCHITECTURE

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @property
    def levels(self) -> int:
        return len(self.channels)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "UNetSegmenterConfig":
        raw = d.get("id2label")
        if not isinstance(raw, dict) or not raw:
            raise ValueError("'id2label' must name the classes 0..N-1")
        id2label = {int(k): str(v) for k, v in raw.items()}
        if sorted(id2label) != list(range(len(id2label))):
            raise ValueError("id2label must number the labels 0..N-1")
        cfg = read_config(cls, d, id2label=id2label, required=("channels",), what="a UNetSegmenter")
        if cfg.architecture != ARCHITECTURE:
            raise ValueError(f"architecture is '{cfg.architecture}', not {ARCHITECTURE}")
        if not cfg.channels or any(c < 1 for c in cfg.channels):
            raise ValueError("'channels' must list a positive width per level")
        if cfg.norm_groups and any(c % cfg.norm_groups for c in cfg.channels):
            raise ValueError(f"every level's width must be a multiple of norm_groups {cfg.norm_groups}")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        out = config_to_dict(self)
        out["id2label"] = {str(k): v for k, v in sorted(self.id2label.items())}
        return {"architecture": out.pop("architecture"), **out}


class DoubleConv(nn.Module):
    """Two padded 3x3 convolutions, each followed by an optional GroupNorm and a ReLU."""

    def __init__(self, cin: int, cout: int, norm_groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        if norm_groups:
            self.norm1 = nn.GroupNorm(norm_groups, cout)
            self.norm2 = nn.GroupNorm(norm_groups, cout)
        self.normed = bool(norm_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = F.relu(self.norm1(x) if self.normed else x)
        x = self.conv2(x)
        return F.relu(self.norm2(x) if self.normed else x)


class UpBlock(nn.Module):
    """2x2 up-convolution (channels halved), concatenation with the skip connection, DoubleConv."""

    def __init__(self, cin: int, cout: int, norm_groups: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, kernel_size=2, stride=2)
        self.block = DoubleConv(2 * cout, cout, norm_groups)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        dh, dw = skip.shape[2] - x.shape[2], skip.shape[3] - x.shape[3]
        if dh or dw:  # an odd size at this level: meet the skip connection's map
            x = F.pad(x, (0, dw, 0, dh))
        return self.block(torch.cat((skip, x), dim=1))


class UNetSegmenter(nn.Module):
    """Pixel values ``(B, C, H, W)`` -> per-pixel class logits ``(B, labels, H, W)``."""

    def __init__(self, config: UNetSegmenterConfig):
        super().__init__()
        self.config = config
        ch = config.channels
        g = config.norm_groups
        self.down = nn.ModuleList(DoubleConv(config.in_channels if i == 0 else ch[i - 1], ch[i], g) for i in range(len(ch)))
        self.up = nn.ModuleList(UpBlock(ch[i], ch[i - 1], g) for i in range(len(ch) - 1, 0, -1))
        self.classifier = nn.Conv2d(ch[0], config.num_labels, kernel_size=1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.to(self.classifier.weight.dtype)
        skips = []
        for i, block in enumerate(self.down):
            if i:
                x = F.max_pool2d(x, 2)
            x = block(x)
            skips.append(x)
        skips.pop()  # the deepest level's output is the bottleneck, not a skip connection
        for block in self.up:
            x = block(x, skips.pop())
        return self.classifier(x)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """He initialisation of the convolutions (the paper's), zero biases."""
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu", generator=generator)
                nn.init.zeros_(m.bias)


__all__ = ["ARCHITECTURE", "UNetSegmenterConfig", "UNetSegmenter"]
