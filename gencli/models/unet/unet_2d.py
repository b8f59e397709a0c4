"""The pixel-space denoising UNet of DDPM / DDIM in diffusers' ``UNet2DModel`` layout (the google/ddpm-*
checkpoints and their kind), unconditional or class-conditional, built from its ``config.json``.

``noise_pred = unet(sample, timestep, class_labels=None)``:

- the timestep(s) become a sinusoidal embedding (``flip_sin_to_cos``, ``freq_shift``: google/ddpm-cifar10-32
  uses ``False`` and 1) and go through ``time_embedding`` (``linear_1`` -> SiLU -> ``linear_2``); a
  class-conditional model adds ``class_embedding`` of its labels (an ``nn.Embedding`` of
  ``num_class_embeds`` rows, or with ``class_embed_type`` "timestep"/"identity" a time-style
  embedding of the label or the label vector itself);
- ``conv_in``, the down blocks (``DownBlock2D``: ResNet blocks; ``AttnDownBlock2D``: each ResNet
  block followed by a self-attention over the pixels, GroupNorm first and the input added back; a
  stride-2 conv after every level but the last), the mid block (``UNetMidBlock2D``: ResNet,
  attention unless ``add_attention`` is false, ResNet), the up blocks (``UpBlock2D`` /
  ``AttnUpBlock2D``: each layer reads the matching skip connection; nearest x2 + conv after every
  level but the last), and ``conv_norm_out`` -> SiLU -> ``conv_out``.

The blocks are the shared ones: :class:`~gencli.models.resnet2d.ResnetBlock2D`,
:class:`~gencli.models.attention.Attention`, the down/up sampling convs, and the plain
``DownBlock2D``/``UpBlock2D``/``TimestepEmbedding`` of
:mod:`gencli.models.unet.unet_2d_condition`; the attention levels here are those plain blocks with
a pixel attention after each ResNet block. ``attention_head_dim`` is the size of a head (None: one
head of the full width), not the head count as in ``UNet2DConditionModel``. Attribute names are
diffusers', so a diffusers ``unet/`` folder loads by identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from gencli.backend.layers import Conv2d, GroupNorm, get_activation, prepack_convolutions
from gencli.backend.positional import timestep_embedding
from gencli.checkpoints.config import read_config
from gencli.models.attention import Attention
from gencli.models.unet.unet_2d_condition import DownBlock2D, TimestepEmbedding, UpBlock2D, _resnet

DOWN_BLOCK_TYPES = ("DownBlock2D", "AttnDownBlock2D")
UP_BLOCK_TYPES = ("UpBlock2D", "AttnUpBlock2D")
CLASS_NAME = "UNet2DModel"

# config fields whose other values select layers not built here, with the values that mean "not used"
_ONLY: dict[str, tuple[Any, ...]] = {
    "time_embedding_type": ("positional",),
    "downsample_type": ("conv",),
    "upsample_type": ("conv",),
    "class_embed_type": (None, "timestep", "identity"),
    "resnet_time_scale_shift": ("default", "scale_shift"),
    "mid_block_type": ("UNetMidBlock2D", None),
}


@dataclass
class UNet2DConfig:
    """The fields of a diffusers ``UNet2DModel`` ``config.json`` (absent keys take diffusers' defaults).

    Build it with :meth:`from_dict`; fields it does not know are ignored, values it cannot build
    raise ``ValueError``. :meth:`to_dict` writes a config diffusers reads. The names the shared
    blocks read (``layers_per_block`` per level, ``time_embed_dim``, ``num_levels``, the norm and
    activation fields) are those of :class:`~gencli.models.unet.unet_2d_condition.UNet2DConditionConfig`.
    """

    sample_size: Optional[int | tuple[int, int]] = None
    in_channels: int = 3
    out_channels: int = 3
    center_input_sample: bool = False
    time_embedding_type: str = "positional"
    time_embedding_dim: Optional[int] = None
    freq_shift: float = 0
    flip_sin_to_cos: bool = True
    down_block_types: tuple[str, ...] = ("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D")
    mid_block_type: Optional[str] = "UNetMidBlock2D"
    up_block_types: tuple[str, ...] = ("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D")
    block_out_channels: tuple[int, ...] = (224, 448, 672, 896)
    layers_per_block: tuple[int, ...] = (2, 2, 2, 2)  # one value per level (diffusers: one int)
    mid_block_scale_factor: float = 1.0
    downsample_padding: int = 1
    downsample_type: str = "conv"
    upsample_type: str = "conv"
    dropout: float = 0.0
    act_fn: str = "silu"
    attention_head_dim: Optional[int] = 8
    norm_num_groups: int = 32
    attn_norm_num_groups: Optional[int] = None
    norm_eps: float = 1e-5
    resnet_time_scale_shift: str = "default"
    add_attention: bool = True
    class_embed_type: Optional[str] = None
    num_class_embeds: Optional[int] = None
    num_train_timesteps: Optional[int] = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_levels(self) -> int:
        return len(self.block_out_channels)

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding_dim or 4 * self.block_out_channels[0]

    @property
    def class_conditional(self) -> bool:
        """Whether the model takes class labels (``num_class_embeds`` or a ``class_embed_type``)."""
        return self.class_embed_type is not None or self.num_class_embeds is not None

    def head_dim(self, channels: int) -> int:
        """The size of one attention head at a level of ``channels`` (None in the config: one head)."""
        return self.attention_head_dim if self.attention_head_dim is not None else channels

    @property
    def image_size(self) -> tuple[int, int]:
        """``(height, width)`` of the samples (``sample_size``); ``ValueError`` when the config has none."""
        if self.sample_size is None:
            raise ValueError("the UNet config has no sample_size")
        if isinstance(self.sample_size, int):
            return (self.sample_size, self.sample_size)
        return (int(self.sample_size[0]), int(self.sample_size[1]))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "UNet2DConfig":
        """Read a diffusers ``UNet2DModel`` config dict (null where diffusers means None is kept as None)."""
        cls_name = d.get("_class_name")
        if cls_name not in (None, CLASS_NAME):
            raise ValueError(f"_class_name {cls_name!r} is not {CLASS_NAME}")
        values: dict[str, Any] = {}
        for key, allowed in _ONLY.items():
            value = d.get(key, getattr(cls, key))
            if value not in allowed:
                raise ValueError(f"{key}={value!r} is not supported ({', '.join(map(repr, allowed))})")
            values[key] = value
        down = tuple(str(t) for t in d.get("down_block_types", cls.down_block_types))
        up = tuple(str(t) for t in d.get("up_block_types", cls.up_block_types))
        for t in down:
            if t not in DOWN_BLOCK_TYPES:
                raise ValueError(f"down block type '{t}' is not supported ({', '.join(DOWN_BLOCK_TYPES)})")
        for t in up:
            if t not in UP_BLOCK_TYPES:
                raise ValueError(f"up block type '{t}' is not supported ({', '.join(UP_BLOCK_TYPES)})")
        channels = tuple(int(c) for c in d.get("block_out_channels", cls.block_out_channels))
        n = len(down)
        if n < 1 or len(up) != n or len(channels) != n:
            raise ValueError(f"{n} down blocks, {len(up)} up blocks and {len(channels)} block_out_channels do not match")
        layers = d.get("layers_per_block", 2)
        if isinstance(layers, (list, tuple)):
            raise ValueError("layers_per_block must be one number for a UNet2DModel")
        groups = d.get("norm_num_groups", 32)
        if groups is None:
            raise ValueError("norm_num_groups=None is not supported")
        head = d["attention_head_dim"] if "attention_head_dim" in d else cls.attention_head_dim
        if head is not None and int(head) < 1:
            raise ValueError(f"attention_head_dim must be positive, got {head}")
        get_activation(str(d.get("act_fn", "silu")))
        if values["class_embed_type"] is None and d.get("num_class_embeds") is not None and int(d["num_class_embeds"]) < 1:
            raise ValueError("num_class_embeds must be positive")
        sample_size = d.get("sample_size")
        if isinstance(sample_size, list):
            sample_size = tuple(int(s) for s in sample_size)
        return read_config(
            cls, d, sample_size=sample_size, down_block_types=down, up_block_types=up, block_out_channels=channels,
            layers_per_block=(int(layers),) * n, norm_num_groups=int(groups), attention_head_dim=None if head is None else int(head),
            attn_norm_num_groups=d.get("attn_norm_num_groups"), raw=dict(d), **values,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """A diffusers ``UNet2DModel`` config.json for this architecture."""
        out: dict[str, Any] = {"_class_name": CLASS_NAME}
        for name in self.__dataclass_fields__:
            if name == "raw":
                continue
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        out["layers_per_block"] = self.layers_per_block[0]
        return out


# -- blocks (diffusers' unet_2d_blocks.py names) -------------------------------------------------------
def _attention(cfg: UNet2DConfig, channels: int, *, groups: Optional[int], scale: float = 1.0) -> Attention:
    """diffusers' pixel self-attention of the UNet2DModel blocks: heads of ``attention_head_dim``,
    biased projections, a GroupNorm first (``groups``; None: no norm), the input added back."""
    head = cfg.head_dim(channels)
    return Attention(
        channels, heads=channels // head, dim_head=head, bias=True, norm_num_groups=groups, eps=cfg.norm_eps, residual_connection=True,
        rescale_output_factor=scale,
    )  # fmt: skip


class AttnDownBlock2D(DownBlock2D):
    """:class:`DownBlock2D` with a pixel self-attention (``attentions.i``) after each ResNet block."""

    def __init__(self, cfg: UNet2DConfig, level: int, cin: int, cout: int, *, add_downsample: bool):
        super().__init__(cfg, level, cin, cout, add_downsample=add_downsample)  # type: ignore[arg-type]
        self.attentions = nn.ModuleList([_attention(cfg, cout, groups=cfg.norm_num_groups) for _ in self.resnets])

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        skips = []
        for resnet, attn in zip(self.resnets, self.attentions):
            x = attn(resnet(x, temb))
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class AttnUpBlock2D(UpBlock2D):
    """:class:`UpBlock2D` with a pixel self-attention (``attentions.i``) after each ResNet block."""

    def __init__(self, cfg: UNet2DConfig, index: int, cin: int, prev_out: int, cout: int, *, add_upsample: bool):
        super().__init__(cfg, index, cin, prev_out, cout, add_upsample=add_upsample)  # type: ignore[arg-type]
        self.attentions = nn.ModuleList([_attention(cfg, cout, groups=cfg.norm_num_groups) for _ in self.resnets])

    def forward(
        self,
        x: torch.Tensor,
        skips: Sequence[torch.Tensor],
        temb: torch.Tensor,
        context: Optional[torch.Tensor] = None,
        upsample_size: Optional[tuple[int, int]] = None,
    ) -> torch.Tensor:
        for i, (resnet, attn) in enumerate(zip(self.resnets, self.attentions)):
            x = attn(resnet(torch.cat([x, skips[len(skips) - 1 - i]], dim=1), temb))
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, upsample_size)
        return x


class UNetMidBlock2D(nn.Module):
    """ResNet block, pixel self-attention (unless ``add_attention`` is false), ResNet block, at the
    lowest resolution. The attention's GroupNorm has ``attn_norm_num_groups`` groups, else the
    ResNets' with ``resnet_time_scale_shift="default"`` and none with ``"scale_shift"`` (as diffusers builds it)."""

    def __init__(self, cfg: UNet2DConfig):
        super().__init__()
        c = cfg.block_out_channels[-1]
        scale = cfg.mid_block_scale_factor
        self.resnets = nn.ModuleList([_resnet(cfg, c, c, scale=scale), _resnet(cfg, c, c, scale=scale)])  # type: ignore[arg-type]
        groups = cfg.attn_norm_num_groups
        if groups is None and cfg.resnet_time_scale_shift == "default":
            groups = cfg.norm_num_groups
        self.attentions = nn.ModuleList([_attention(cfg, c, groups=groups, scale=scale)] if cfg.add_attention else [])

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x, temb)
        if len(self.attentions):
            x = self.attentions[0](x)
        return self.resnets[1](x, temb)


# -- the model ---------------------------------------------------------------------------------------------
class UNet2DModel(nn.Module):
    """diffusers' ``UNet2DModel`` (see the module docstring).

    ``UNet2DModel(UNet2DConfig.from_dict(config_json))`` (or the dict). Call it as
    ``unet(sample, timestep, class_labels=None)``: ``sample`` ``(B, in_channels, H, W)`` with ``H``,
    ``W`` multiples of ``2 ** (levels - 1)``; ``timestep`` a number, a 0-d tensor or one per sample;
    ``class_labels`` ``(B,)`` integer labels for a class-conditional model (required there, refused
    otherwise). Returns ``(B, out_channels, H, W)`` in ``sample``'s dtype.
    """

    def __init__(self, config: UNet2DConfig | Mapping[str, Any]):
        super().__init__()
        cfg = config if isinstance(config, UNet2DConfig) else UNet2DConfig.from_dict(config)
        self.config = cfg
        ch = cfg.block_out_channels
        self.conv_in = Conv2d(cfg.in_channels, ch[0], kernel_size=3, padding=1)
        self.time_embedding = TimestepEmbedding(ch[0], cfg.time_embed_dim)
        self.class_embedding: Optional[nn.Module]
        if cfg.class_embed_type is None and cfg.num_class_embeds is not None:
            self.class_embedding = nn.Embedding(cfg.num_class_embeds, cfg.time_embed_dim)
        elif cfg.class_embed_type == "timestep":
            self.class_embedding = TimestepEmbedding(ch[0], cfg.time_embed_dim)
        elif cfg.class_embed_type == "identity":
            self.class_embedding = nn.Identity()
        else:
            self.class_embedding = None

        self.down_blocks = nn.ModuleList()
        out = ch[0]
        for i, kind in enumerate(cfg.down_block_types):
            cin, out = out, ch[i]
            block = AttnDownBlock2D if kind == "AttnDownBlock2D" else DownBlock2D
            self.down_blocks.append(block(cfg, i, cin, out, add_downsample=i < cfg.num_levels - 1))  # type: ignore[arg-type]
        self.mid_block = UNetMidBlock2D(cfg) if cfg.mid_block_type is not None else None
        self.up_blocks = nn.ModuleList()
        rev = list(reversed(ch))
        out = rev[0]
        for i, kind in enumerate(cfg.up_block_types):
            prev, out = out, rev[i]
            cin = rev[min(i + 1, cfg.num_levels - 1)]
            block = AttnUpBlock2D if kind == "AttnUpBlock2D" else UpBlock2D
            self.up_blocks.append(block(cfg, i, cin, prev, out, add_upsample=i < cfg.num_levels - 1))  # type: ignore[arg-type]
        self.conv_norm_out = GroupNorm(cfg.norm_num_groups, ch[0], eps=cfg.norm_eps)
        self.conv_out = Conv2d(ch[0], cfg.out_channels, kernel_size=3, padding=1)
        self.channels_last = False

    def use_channels_last(self, enabled: bool = True, *, weights: bool = True) -> "UNet2DModel":
        """Run the feature maps in channels-last memory (what oneDNN's CPU convolutions work in; the
        pixel attention's token layout is then a free view), the conv weights converted to match
        unless ``weights=False`` (packed convolutions do not read them again)."""
        self.channels_last = enabled
        if weights:
            self.to(memory_format=torch.channels_last if enabled else torch.contiguous_format)
        return self

    def prepack_convolutions(self, enabled: bool = True) -> "UNet2DModel":
        """Keep every convolution's weight in oneDNN's layout after the first CPU inference call
        (:class:`gencli.backend.layers.Conv2d`): inference only, reversed by ``enabled=False``."""
        prepack_convolutions(self, enabled)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.time_embedding.linear_1.weight.dtype  # not a conv: packed convolutions drop their weight

    @property
    def device(self) -> torch.device:
        return self.time_embedding.linear_1.weight.device

    def _timesteps(self, timestep: torch.Tensor | float | int, batch: int) -> torch.Tensor:
        if not torch.is_tensor(timestep):
            timestep = torch.tensor([timestep], dtype=torch.float64 if isinstance(timestep, float) else torch.int64)
        elif timestep.ndim == 0:
            timestep = timestep[None]
        timestep = timestep.to(self.device).reshape(-1)
        if timestep.shape[0] not in (1, batch):
            raise ValueError(f"{timestep.shape[0]} timesteps for a batch of {batch}")
        return timestep.expand(batch)

    def _sinusoid(self, values: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        emb = timestep_embedding(values, cfg.block_out_channels[0], flip_sin_to_cos=cfg.flip_sin_to_cos, downscale_freq_shift=cfg.freq_shift)
        return emb.to(self.dtype)

    def time_embed(self, timestep: torch.Tensor | float | int, batch: int, class_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The embedding every ResNet block receives: ``(batch, time_embed_dim)`` in the model's dtype."""
        emb = self.time_embedding(self._sinusoid(self._timesteps(timestep, batch)))
        if self.class_embedding is None:
            if class_labels is not None:
                raise ValueError("this UNet is not class-conditional: it takes no class labels")
            return emb
        if class_labels is None:
            raise ValueError("this UNet is class-conditional: give class_labels")
        labels = class_labels.to(self.device)
        if self.config.class_embed_type == "timestep":
            labels = self._sinusoid(labels.reshape(-1))
        return emb + self.class_embedding(labels).to(self.dtype)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor | float | int, class_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        in_dtype = sample.dtype
        x = sample.to(self.device, self.dtype, memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)
        if self.config.center_input_sample:
            x = 2 * x - 1.0
        emb = self.time_embed(timestep, x.shape[0], class_labels)
        x = self.conv_in(x)
        skips: list[torch.Tensor] = [x]
        for block in self.down_blocks:
            x, res = block(x, emb)
            skips.extend(res)
        if self.mid_block is not None:
            x = self.mid_block(x, emb)
        for block in self.up_blocks:
            n = len(block.resnets)
            res, skips = skips[-n:], skips[:-n]
            x = block(x, res, emb)
        x = self.conv_out(self.conv_norm_out(x, "silu"))
        return x.to(in_dtype, memory_format=torch.contiguous_format)


__all__ = ["UNet2DConfig", "UNet2DModel", "AttnDownBlock2D", "AttnUpBlock2D", "UNetMidBlock2D", "DOWN_BLOCK_TYPES", "UP_BLOCK_TYPES"]
