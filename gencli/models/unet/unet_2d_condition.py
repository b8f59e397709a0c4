"""The conditional UNet of latent diffusion (Stable Diffusion 1.x, 2.x and SDXL) in diffusers'
``UNet2DConditionModel`` layout, built from the fields of its ``config.json``.

``noise_pred = unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=None)``:

- the timestep(s) become a sinusoidal embedding (``flip_sin_to_cos``, ``freq_shift``) and go through
  ``time_embedding`` (``linear_1`` -> act -> ``linear_2``); SDXL (``addition_embed_type="text_time"``)
  adds ``add_embedding`` of [pooled text embedding, sinusoidal embeddings of the size/crop time ids];
- ``conv_in``, then the down blocks (``CrossAttnDownBlock2D``: ResNet block + spatial transformer per
  layer, ``DownBlock2D``: ResNet blocks only; a stride-2 conv after every level but the last), the mid
  block (``UNetMidBlock2DCrossAttn``: ResNet, transformer, ResNet), the up blocks
  (``CrossAttnUpBlock2D``/``UpBlock2D``: each layer concatenates the matching skip connection of the
  down path, nearest x2 upsampling + conv after every level but the last), and
  ``conv_norm_out`` -> SiLU -> ``conv_out``;
- the spatial transformers (``Transformer2DModel``: GroupNorm, ``proj_in`` (1x1 conv, or linear with
  ``use_linear_projection``), ``BasicTransformerBlock``s, ``proj_out``, residual) run self attention
  (``attn1``), cross attention on the text encoder's hidden states (``attn2``) and a GEGLU
  feed-forward (``ff.net.0.proj``, ``ff.net.2``), each pre-normed by a LayerNorm.

Head counts follow diffusers' reading of the config: ``attention_head_dim`` (an int or one value
per level) is, despite its name, the number of heads, unless ``num_attention_heads`` is given; each
head has ``channels // heads`` dimensions. Attribute names are diffusers', so a diffusers ``unet/``
folder loads by identity; :mod:`gencli.models.unet.single_file` maps original-layout single files.

Speed: attention runs through the backend's one entry point (SDPA kernels); the 1x1 ``proj_in/out``
convolutions run as matmuls on the token layout; GEGLU multiplies by the two halves of its projection
separately (the gate's GELU fused into the bf16 matmul on CPUs with native bf16) and gates in place;
GroupNorm + SiLU write one tensor; residual additions are in place (the ResNet blocks' inside the
conv kernel). On a CPU, :meth:`UNet2DConditionModel.use_channels_last` keeps the feature maps in
NHWC (what oneDNN's convolutions work in, and the transformers' token layout becomes a free view)
and :meth:`UNet2DConditionModel.prepack_convolutions` keeps the conv weights in oneDNN's own layout
after the first call (the weight reorder otherwise costs more than the convolution at the low
resolutions); the loaders in :mod:`gencli.pipelines.diffusion.unet_loading` turn both on for CPU placements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from gencli.backend.interrupt import check_interrupt
from gencli.backend.layers import Conv2d, GroupNorm, LayerNorm, Linear, get_activation, linear, prepack_convolutions
from gencli.backend.positional import timestep_embedding
from gencli.checkpoints.config import read_config
from gencli.models.attention import Attention
from gencli.models.resnet2d import Downsample2D, ResnetBlock2D, Upsample2D

DOWN_BLOCK_TYPES = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCK_TYPES = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCK_TYPES = ("UNetMidBlock2DCrossAttn", None)

# config fields of diffusers' UNet2DConditionModel this implementation does not build, with the
# value(s) that mean "not used"
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "class_embed_type": (None,),
    "num_class_embeds": (None,),
    "encoder_hid_dim": (None,),
    "encoder_hid_dim_type": (None,),
    "time_embedding_type": ("positional",),
    "time_cond_proj_dim": (None,),
    "dual_cross_attention": (False,),
    "attention_type": ("default",),
    "resnet_skip_time_act": (False,),
    "resnet_out_scale_factor": (1.0, 1),
    "class_embeddings_concat": (False,),
    "cross_attention_norm": (None,),
}


def _per_block(value: Any, n: int, name: str) -> list:
    """An int/bool/None (the same for every level) or a list of ``n`` values."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} blocks")
        return list(value)
    return [value] * n


@dataclass
class UNet2DConditionConfig:
    """The fields of a diffusers ``UNet2DConditionModel`` ``config.json``, resolved per level.

    Build it with :meth:`from_dict` (the config.json dict; fields it does not know are ignored,
    features it does not implement raise ``ValueError``); :meth:`to_dict` writes a config diffusers reads.
    """

    sample_size: Optional[int | tuple[int, int]] = None
    in_channels: int = 4
    out_channels: int = 4
    center_input_sample: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: float = 0
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
    mid_block_type: Optional[str] = "UNetMidBlock2DCrossAttn"
    up_block_types: tuple[str, ...] = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: tuple[int, ...] = (2, 2, 2, 2)
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    dropout: float = 0.0
    act_fn: str = "silu"
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    cross_attention_dim: tuple[int, ...] = (1280, 1280, 1280, 1280)
    # transformer blocks per layer of each down level (and of the up levels, top to bottom as built)
    transformer_layers_per_block: tuple[tuple[int, ...], ...] = ((1, 1), (1, 1), (1, 1), (1, 1))
    reverse_transformer_layers_per_block: tuple[tuple[int, ...], ...] = ((1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1))
    num_heads: tuple[int, ...] = (8, 8, 8, 8)  # heads per level (diffusers: attention_head_dim or num_attention_heads)
    only_cross_attention: tuple[bool, ...] = (False, False, False, False)
    use_linear_projection: bool = False
    upcast_attention: bool = False
    resnet_time_scale_shift: str = "default"
    time_embedding_dim: Optional[int] = None
    time_embedding_act_fn: Optional[str] = None
    timestep_post_act: Optional[str] = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    addition_embed_type: Optional[str] = None  # None or "text_time" (SDXL)
    addition_time_embed_dim: Optional[int] = None
    projection_class_embeddings_input_dim: Optional[int] = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # -- derived ------------------------------------------------------------------------------
    @property
    def num_levels(self) -> int:
        return len(self.block_out_channels)

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding_dim or 4 * self.block_out_channels[0]

    @property
    def context_dim(self) -> int:
        """The width of the encoder hidden states the cross attentions read."""
        return self.cross_attention_dim[-1]

    def has_attention(self, level: int) -> bool:
        """Whether down level ``level`` (0 = full resolution) has spatial transformers."""
        return self.down_block_types[level] == "CrossAttnDownBlock2D"

    # -- dict round trip ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "UNet2DConditionConfig":
        """Read a diffusers ``UNet2DConditionModel`` config dict."""
        for key, allowed in _UNSUPPORTED_DEFAULTS.items():
            if key in d and d[key] not in allowed:
                raise ValueError(f"{key}={d[key]!r} is not supported")
        down = tuple(str(t) for t in d.get("down_block_types", cls.down_block_types))
        up = tuple(str(t) for t in d.get("up_block_types", cls.up_block_types))
        n = len(down)
        for t in down:
            if t not in DOWN_BLOCK_TYPES:
                raise ValueError(f"down block type '{t}' is not supported ({', '.join(DOWN_BLOCK_TYPES)})")
        for t in up:
            if t not in UP_BLOCK_TYPES:
                raise ValueError(f"up block type '{t}' is not supported ({', '.join(UP_BLOCK_TYPES)})")
        mid = d.get("mid_block_type", "UNetMidBlock2DCrossAttn")
        if mid not in MID_BLOCK_TYPES:
            raise ValueError(f"mid block type '{mid}' is not supported (UNetMidBlock2DCrossAttn or none)")
        channels = tuple(int(c) for c in d.get("block_out_channels", cls.block_out_channels))
        if len(up) != n or len(channels) != n:
            raise ValueError(f"{n} down blocks, {len(up)} up blocks and {len(channels)} block_out_channels do not match")
        if n < 1:
            raise ValueError("a UNet needs at least one block")
        layers = tuple(int(x) for x in _per_block(d.get("layers_per_block", 2), n, "layers_per_block"))
        cross = tuple(int(x) for x in _per_block(d.get("cross_attention_dim", 1280), n, "cross_attention_dim"))
        heads_src = d.get("num_attention_heads") or d.get("attention_head_dim", 8)
        heads = tuple(int(x) if x is not None else channels[i] for i, x in enumerate(_per_block(heads_src, n, "attention_head_dim")))
        only_cross_src = d.get("only_cross_attention", False)
        only_cross = tuple(bool(x) for x in _per_block(only_cross_src, n, "only_cross_attention"))

        tlpb = d.get("transformer_layers_per_block", 1)
        rev = d.get("reverse_transformer_layers_per_block")
        per_level = _per_block(tlpb, n, "transformer_layers_per_block")
        if any(isinstance(x, (list, tuple)) for x in per_level):
            if rev is None:
                raise ValueError("a transformer_layers_per_block of lists needs reverse_transformer_layers_per_block")
            down_depths = tuple(tuple(int(v) for v in _per_block(x, layers[i], f"transformer_layers_per_block[{i}]")) for i, x in enumerate(per_level))
        else:
            down_depths = tuple((int(x),) * layers[i] for i, x in enumerate(per_level))
        if rev is not None:
            rev_levels = _per_block(rev, n, "reverse_transformer_layers_per_block")
            rev_layers = list(reversed(layers))
            up_depths = tuple(
                tuple(int(v) for v in _per_block(x, rev_layers[i] + 1, f"reverse_transformer_layers_per_block[{i}]")) for i, x in enumerate(rev_levels)
            )
        else:
            up_depths = tuple((d_[0] if d_ else 1,) * (layers[n - 1 - i] + 1) for i, d_ in enumerate(reversed(down_depths)))

        for i, c in enumerate(channels):
            if down[i] == "CrossAttnDownBlock2D" and c % heads[i]:
                raise ValueError(f"block_out_channels[{i}]={c} is not a multiple of {heads[i]} attention heads")
        add = d.get("addition_embed_type")
        if add not in (None, "text_time"):
            raise ValueError(f"addition_embed_type={add!r} is not supported (none, or 'text_time' as SDXL uses)")
        if add == "text_time" and (not d.get("addition_time_embed_dim") or not d.get("projection_class_embeddings_input_dim")):
            raise ValueError("addition_embed_type 'text_time' needs addition_time_embed_dim and projection_class_embeddings_input_dim")
        shift = str(d.get("resnet_time_scale_shift", "default"))
        if shift not in ("default", "scale_shift"):
            raise ValueError(f"resnet_time_scale_shift={shift!r} is not supported (default, scale_shift)")
        groups = d.get("norm_num_groups", 32)
        if groups is None:
            raise ValueError("norm_num_groups=None (no output norm) is not supported")
        act = str(d.get("act_fn", "silu"))
        for a in (act, d.get("time_embedding_act_fn"), d.get("timestep_post_act")):
            if a is not None:
                get_activation(a)
        sample_size = d.get("sample_size")
        if isinstance(sample_size, list):
            sample_size = tuple(sample_size)
        return read_config(
            cls, d, sample_size=sample_size, down_block_types=down, mid_block_type=mid, up_block_types=up, block_out_channels=channels,
            layers_per_block=layers, act_fn=act, norm_num_groups=int(groups), cross_attention_dim=cross, transformer_layers_per_block=down_depths,
            reverse_transformer_layers_per_block=up_depths, num_heads=heads, only_cross_attention=only_cross, resnet_time_scale_shift=shift,
            addition_embed_type=add, raw=dict(d),
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """A diffusers ``UNet2DConditionModel`` config.json for this architecture."""
        out = {k: v for k, v in asdict(self).items() if k not in ("raw", "num_heads", "transformer_layers_per_block", "reverse_transformer_layers_per_block")}
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
        out["_class_name"] = "UNet2DConditionModel"
        out["attention_head_dim"] = list(self.num_heads)
        depths = [list(x) for x in self.transformer_layers_per_block]
        uniform = all(len(set(x)) <= 1 for x in depths) and all(
            list(u) == [d_[0] if d_ else 1] * len(u) for u, d_ in zip(self.reverse_transformer_layers_per_block, reversed(depths))
        )
        if uniform:
            out["transformer_layers_per_block"] = [x[0] if x else 1 for x in depths]
        else:
            out["transformer_layers_per_block"] = depths
            out["reverse_transformer_layers_per_block"] = [list(x) for x in self.reverse_transformer_layers_per_block]
        return out


# -- transformer blocks (diffusers' attention.py / transformer_2d.py names) ---------------------
class GEGLU(nn.Module):
    """``value * gelu(gate)`` over the two halves of one projection ``proj`` (``dim_in -> 2 * dim_out``).

    The halves are multiplied separately (row slices of the weight are contiguous): no strided
    chunks, the GELU fused into the gate's bf16 matmul where the backend can, and the gating done in
    place. The same function as diffusers' ``GEGLU``.
    """

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True):
        super().__init__()
        self.dim_out = dim_out
        self.proj = Linear(dim_in, 2 * dim_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, w, b = self.dim_out, self.proj.weight, self.proj.bias
        value = linear(x, w[:n], b[:n] if b is not None else None)
        gate = linear(x, w[n:], b[n:] if b is not None else None, activation="gelu")
        return gate.mul_(value) if not torch.is_grad_enabled() else gate * value


class FeedForward(nn.Module):
    """diffusers' ``FeedForward`` with GEGLU: ``net.0`` (GEGLU), ``net.1`` (dropout), ``net.2`` (linear)."""

    def __init__(self, dim: int, mult: int = 4, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        inner = int(dim * mult)
        self.net = nn.ModuleList([GEGLU(dim, inner, bias=bias), nn.Dropout(dropout), Linear(inner, dim, bias=bias)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.net:
            x = module(x)
        return x


class BasicTransformerBlock(nn.Module):
    """Pre-norm self attention (``attn1``), cross attention on the context (``attn2``) and GEGLU
    feed-forward (``ff``), each with a residual; LayerNorms ``norm1..3``.

    ``only_cross_attention``: ``attn1`` attends to the context as well (then both are cross attention).
    """

    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        *,
        cross_attention_dim: Optional[int] = None,
        dropout: float = 0.0,
        attention_bias: bool = False,
        only_cross_attention: bool = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.only_cross_attention = only_cross_attention
        heads = dict(heads=num_attention_heads, dim_head=attention_head_dim, bias=attention_bias)
        self.norm1 = LayerNorm(dim, eps=norm_eps)
        self.attn1 = Attention(dim, cross_attention_dim=cross_attention_dim if only_cross_attention else None, **heads)
        if cross_attention_dim is not None:
            self.norm2: Optional[LayerNorm] = LayerNorm(dim, eps=norm_eps)
            self.attn2: Optional[Attention] = Attention(dim, cross_attention_dim=cross_attention_dim, **heads)
        else:
            self.norm2 = self.attn2 = None
        self.norm3 = LayerNorm(dim, eps=norm_eps)
        self.ff = FeedForward(dim, dropout=dropout)

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.attn1(self.norm1(x), context if self.only_cross_attention else None).add_(x)
        if self.attn2 is not None:
            x = self.attn2(self.norm2(x), context).add_(x)
        return self.ff(self.norm3(x)).add_(x)


class Transformer2DModel(nn.Module):
    """The spatial transformer over a feature map: GroupNorm (``norm``), ``proj_in`` (a 1x1 conv, or a
    linear with ``use_linear_projection``), ``transformer_blocks`` on the ``H*W`` tokens, ``proj_out``
    and the residual. Both kinds of projection run as a matmul on the token layout (the 1x1 conv's
    weight viewed as a matrix), which is what the conv computes."""

    def __init__(
        self,
        num_attention_heads: int,
        attention_head_dim: int,
        in_channels: int,
        *,
        num_layers: int = 1,
        dropout: float = 0.0,
        norm_num_groups: int = 32,
        cross_attention_dim: Optional[int] = None,
        use_linear_projection: bool = False,
        only_cross_attention: bool = False,
        upcast_attention: bool = False,
    ):
        super().__init__()
        inner = num_attention_heads * attention_head_dim
        self.use_linear_projection = use_linear_projection
        self.upcast_attention = upcast_attention  # softmax runs in fp32 in every attention kernel gencli uses
        self.norm = GroupNorm(norm_num_groups, in_channels, eps=1e-6, affine=True)
        if use_linear_projection:
            self.proj_in: nn.Module = Linear(in_channels, inner)
            self.proj_out: nn.Module = Linear(inner, in_channels)
        else:
            self.proj_in = nn.Conv2d(in_channels, inner, kernel_size=1)
            self.proj_out = nn.Conv2d(inner, in_channels, kernel_size=1)
        self.transformer_blocks = nn.ModuleList(
            [
                BasicTransformerBlock(
                    inner,
                    num_attention_heads,
                    attention_head_dim,
                    cross_attention_dim=cross_attention_dim,
                    dropout=dropout,
                    only_cross_attention=only_cross_attention,
                )
                for _ in range(num_layers)
            ]
        )

    @staticmethod
    def _project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        return linear(x, weight.flatten(1) if weight.ndim == 4 else weight, module.bias)

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = self.norm(x).permute(0, 2, 3, 1).reshape(b, h * w, c)  # a view when x is channels-last
        tokens = self._project(self.proj_in, tokens)
        for block in self.transformer_blocks:
            tokens = block(tokens, context)
        # (B, H*W, C) is the memory of a channels-last (B, C, H, W) map: no copy back in that layout
        out = self._project(self.proj_out, tokens).view(b, h, w, c).permute(0, 3, 1, 2)
        return out.add_(x) if x.is_contiguous(memory_format=torch.channels_last) else x + out  # x + out: NCHW like x


# -- UNet blocks (diffusers' unet_2d_blocks.py names) --------------------------------------------
def _resnet(cfg: UNet2DConditionConfig, cin: int, cout: int, *, scale: float = 1.0) -> ResnetBlock2D:
    return ResnetBlock2D(
        cin,
        cout,
        temb_channels=cfg.time_embed_dim,
        groups=cfg.norm_num_groups,
        eps=cfg.norm_eps,
        dropout=cfg.dropout,
        non_linearity=cfg.act_fn,
        time_embedding_norm=cfg.resnet_time_scale_shift,
        output_scale_factor=scale,
    )


def _transformer(cfg: UNet2DConditionConfig, channels: int, heads: int, depth: int, cross_dim: int, only_cross: bool) -> Transformer2DModel:
    return Transformer2DModel(
        heads,
        channels // heads,
        channels,
        num_layers=depth,
        dropout=cfg.dropout,
        norm_num_groups=cfg.norm_num_groups,
        cross_attention_dim=cross_dim,
        use_linear_projection=cfg.use_linear_projection,
        only_cross_attention=only_cross,
        upcast_attention=cfg.upcast_attention,
    )


class DownBlock2D(nn.Module):
    """ResNet blocks, then a stride-2 conv (``downsamplers.0``) unless it is the last level.

    ``CrossAttnDownBlock2D`` adds a spatial transformer (``attentions.i``) after each ResNet block.
    ``forward`` returns the output and the skip connections it leaves for the up path."""

    has_cross_attention = False

    def __init__(self, cfg: UNet2DConditionConfig, level: int, cin: int, cout: int, *, add_downsample: bool):
        super().__init__()
        n = cfg.layers_per_block[level]
        self.resnets = nn.ModuleList([_resnet(cfg, cin if i == 0 else cout, cout) for i in range(n)])
        if self.has_cross_attention:
            heads, cross, only = cfg.num_heads[level], cfg.cross_attention_dim[level], cfg.only_cross_attention[level]
            depths = cfg.transformer_layers_per_block[level]
            self.attentions = nn.ModuleList([_transformer(cfg, cout, heads, depths[i], cross, only) for i in range(n)])
        self.downsamplers = nn.ModuleList([Downsample2D(cout, use_conv=True, out_channels=cout, padding=cfg.downsample_padding)]) if add_downsample else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        skips = []
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.has_cross_attention:
                x = self.attentions[i](x, context)
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class CrossAttnDownBlock2D(DownBlock2D):
    __doc__ = DownBlock2D.__doc__
    has_cross_attention = True


class UpBlock2D(nn.Module):
    """ResNet blocks on [input, skip connection] concatenated along channels, then nearest x2 +
    conv (``upsamplers.0``) unless it is the last level. ``CrossAttnUpBlock2D`` adds a spatial
    transformer after each ResNet block."""

    has_cross_attention = False

    def __init__(self, cfg: UNet2DConditionConfig, index: int, cin: int, prev_out: int, cout: int, *, add_upsample: bool):
        super().__init__()
        level = cfg.num_levels - 1 - index
        n = cfg.layers_per_block[level] + 1
        self.resnets = nn.ModuleList([_resnet(cfg, (prev_out if i == 0 else cout) + (cin if i == n - 1 else cout), cout) for i in range(n)])
        if self.has_cross_attention:
            heads, cross, only = cfg.num_heads[level], cfg.cross_attention_dim[level], cfg.only_cross_attention[level]
            depths = cfg.reverse_transformer_layers_per_block[index]
            self.attentions = nn.ModuleList([_transformer(cfg, cout, heads, depths[i], cross, only) for i in range(n)])
        self.upsamplers = nn.ModuleList([Upsample2D(cout, use_conv=True, out_channels=cout)]) if add_upsample else None

    def forward(
        self,
        x: torch.Tensor,
        skips: Sequence[torch.Tensor],
        temb: torch.Tensor,
        context: Optional[torch.Tensor] = None,
        upsample_size: Optional[tuple[int, int]] = None,
    ) -> torch.Tensor:
        for i, resnet in enumerate(self.resnets):
            skip = skips[len(skips) - 1 - i]
            x = resnet(torch.cat([x, skip], dim=1), temb)  # keeps channels-last when both are
            if self.has_cross_attention:
                x = self.attentions[i](x, context)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, upsample_size)
        return x


class CrossAttnUpBlock2D(UpBlock2D):
    __doc__ = UpBlock2D.__doc__
    has_cross_attention = True


class UNetMidBlock2DCrossAttn(nn.Module):
    """ResNet block, then (spatial transformer, ResNet block) pairs at the lowest resolution."""

    def __init__(self, cfg: UNet2DConditionConfig):
        super().__init__()
        c = cfg.block_out_channels[-1]
        depths = cfg.transformer_layers_per_block[-1]
        depth = depths[0] if depths else 1
        scale = cfg.mid_block_scale_factor
        self.attentions = nn.ModuleList(
            [_transformer(cfg, c, cfg.num_heads[-1], depth, cfg.cross_attention_dim[-1], False)]  # diffusers' mid block has no only-cross mode
        )
        self.resnets = nn.ModuleList([_resnet(cfg, c, c, scale=scale), _resnet(cfg, c, c, scale=scale)])

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.resnets[0](x, temb)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            x = resnet(attn(x, context), temb)
        return x


class TimestepEmbedding(nn.Module):
    """``linear_2(act(linear_1(x)))`` (and an optional activation after), diffusers' names."""

    def __init__(self, in_channels: int, time_embed_dim: int, act_fn: str = "silu", post_act_fn: Optional[str] = None):
        super().__init__()
        self.linear_1 = Linear(in_channels, time_embed_dim)
        self.act = act_fn
        self.linear_2 = Linear(time_embed_dim, time_embed_dim)
        self.post_act = post_act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_2(self.linear_1(x, activation=self.act))
        return get_activation(self.post_act)(x) if self.post_act else x


# -- the model -----------------------------------------------------------------------------------
def build_down_path(module: nn.Module, cfg: UNet2DConditionConfig) -> None:
    """The input convolution, the time (and SDXL's added) embeddings, the down blocks and the middle block of
    ``cfg``, as ``module``'s attributes under diffusers' names: the UNet's, and a ControlNet's copy of them."""
    ch = cfg.block_out_channels
    module.conv_in = Conv2d(cfg.in_channels, ch[0], kernel_size=cfg.conv_in_kernel, padding=(cfg.conv_in_kernel - 1) // 2)
    module.time_embedding = TimestepEmbedding(ch[0], cfg.time_embed_dim, cfg.act_fn, cfg.timestep_post_act)
    text_time = cfg.addition_embed_type == "text_time"
    module.add_embedding = TimestepEmbedding(int(cfg.projection_class_embeddings_input_dim), cfg.time_embed_dim) if text_time else None
    module.down_blocks = nn.ModuleList()
    out = ch[0]
    for i, kind in enumerate(cfg.down_block_types):
        cin, out = out, ch[i]
        block = CrossAttnDownBlock2D if kind == "CrossAttnDownBlock2D" else DownBlock2D
        module.down_blocks.append(block(cfg, i, cin, out, add_downsample=i < cfg.num_levels - 1))
    module.mid_block = UNetMidBlock2DCrossAttn(cfg) if cfg.mid_block_type == "UNetMidBlock2DCrossAttn" else None


class UNet2DConditionModel(nn.Module):
    """diffusers' ``UNet2DConditionModel`` for SD 1.x / 2.x / SDXL (see the module docstring).

    Build it from a config: ``UNet2DConditionModel(UNet2DConditionConfig.from_dict(config_json))``
    (or pass the dict). Call it as ``unet(sample, timestep, encoder_hidden_states,
    added_cond_kwargs=None)``:

    - ``sample``: noisy latents ``(B, in_channels, H, W)``; ``H``/``W`` need not be multiples of
      ``2 ** (levels - 1)`` (the up path then upsamples to the skip connections' sizes);
    - ``timestep``: a number, a 0-d tensor, or one timestep per sample ``(B,)``;
    - ``encoder_hidden_states``: the text encoder's states ``(B, L, cross_attention_dim)``;
    - ``added_cond_kwargs`` (SDXL, ``addition_embed_type="text_time"``): ``{"text_embeds": (B,
      pooled width), "time_ids": (B, n)}`` (SDXL base: n = 6, original size, crop top-left, target size);
    - ``down_block_additional_residuals`` / ``mid_block_additional_residual``: a ControlNet's outputs,
      added to the skip connections and to the middle block's output.

    ``sample`` and the conditioning are cast to the model's dtype; the noise prediction ``(B,
    out_channels, H, W)`` comes back in ``sample``'s dtype, in contiguous (NCHW) memory.
    """

    def __init__(self, config: UNet2DConditionConfig | Mapping[str, Any]):
        super().__init__()
        cfg = config if isinstance(config, UNet2DConditionConfig) else UNet2DConditionConfig.from_dict(config)
        self.config = cfg
        ch = cfg.block_out_channels
        build_down_path(self, cfg)

        self.up_blocks = nn.ModuleList()
        rev = list(reversed(ch))
        out = rev[0]
        for i, kind in enumerate(cfg.up_block_types):
            prev, out = out, rev[i]
            cin = rev[min(i + 1, cfg.num_levels - 1)]
            block = CrossAttnUpBlock2D if kind == "CrossAttnUpBlock2D" else UpBlock2D
            self.up_blocks.append(block(cfg, i, cin, prev, out, add_upsample=i < cfg.num_levels - 1))
        self.num_upsamplers = cfg.num_levels - 1
        self.channels_last = False

        self.conv_norm_out = GroupNorm(cfg.norm_num_groups, ch[0], eps=cfg.norm_eps)
        self.conv_act = cfg.act_fn
        self.conv_out = Conv2d(ch[0], cfg.out_channels, kernel_size=cfg.conv_out_kernel, padding=(cfg.conv_out_kernel - 1) // 2)

    @property
    def dtype(self) -> torch.dtype:
        return self.time_embedding.linear_1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.time_embedding.linear_1.weight.device

    def use_channels_last(self, enabled: bool = True, *, weights: bool = True) -> "UNet2DConditionModel":
        """Run the feature maps in channels-last memory (or NCHW), with the conv weights converted
        to match (``weights=False`` leaves them: packed convolutions do not read them again).

        Channels-last is what oneDNN's CPU convolutions work in (NCHW inputs are reordered on every
        call), and the transformers' token layout is then a free view of the feature map.
        """
        self.channels_last = enabled
        if weights:
            self.to(memory_format=torch.channels_last if enabled else torch.contiguous_format)
        return self

    def prepack_convolutions(self, enabled: bool = True) -> "UNet2DConditionModel":
        """Keep every convolution's weight in oneDNN's layout after the first CPU inference call
        (see :class:`gencli.backend.layers.Conv2d`): inference only, reversed by ``enabled=False``."""
        prepack_convolutions(self, enabled)
        return self

    # -- embeddings -----------------------------------------------------------------------------
    def _timesteps(self, timestep: torch.Tensor | float | int, batch: int) -> torch.Tensor:
        if not torch.is_tensor(timestep):
            dtype = torch.float64 if isinstance(timestep, float) else torch.int64
            timestep = torch.tensor([timestep], dtype=dtype)
        elif timestep.ndim == 0:
            timestep = timestep[None]
        timestep = timestep.to(self.device).reshape(-1)
        if timestep.shape[0] not in (1, batch):
            raise ValueError(f"{timestep.shape[0]} timesteps for a batch of {batch}")
        return timestep.expand(batch)

    def time_embed(
        self,
        timestep: torch.Tensor | float | int,
        batch: int,
        added_cond_kwargs: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """The embedding every ResNet block receives: ``(batch, time_embed_dim)`` in the model's dtype."""
        cfg = self.config
        t = timestep_embedding(
            self._timesteps(timestep, batch), cfg.block_out_channels[0], flip_sin_to_cos=cfg.flip_sin_to_cos, downscale_freq_shift=cfg.freq_shift
        )
        emb = self.time_embedding(t.to(self.dtype))
        if self.add_embedding is not None:
            if not added_cond_kwargs or "text_embeds" not in added_cond_kwargs or "time_ids" not in added_cond_kwargs:
                raise ValueError("this UNet (addition_embed_type='text_time', SDXL) needs added_cond_kwargs with 'text_embeds' and 'time_ids'")
            text_embeds = added_cond_kwargs["text_embeds"]
            time_ids = added_cond_kwargs["time_ids"].to(self.device)
            ids = timestep_embedding(
                time_ids.flatten(), int(cfg.addition_time_embed_dim), flip_sin_to_cos=cfg.flip_sin_to_cos, downscale_freq_shift=cfg.freq_shift
            )
            ids = ids.reshape(text_embeds.shape[0], -1)
            emb = emb + self.add_embedding(torch.cat([text_embeds.to(self.device, torch.float32), ids], dim=-1).to(self.dtype))
        if cfg.time_embedding_act_fn:
            emb = get_activation(cfg.time_embedding_act_fn)(emb)
        return emb

    # -- forward --------------------------------------------------------------------------------
    def down_path(self, x: torch.Tensor, emb: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The down blocks and the middle block from ``conv_in``'s output ``x``: the middle block's output
        and the skip connections (``x`` first), as the up path (or a ControlNet's zero convolutions) takes them."""
        skips: list[torch.Tensor] = [x]
        for block in self.down_blocks:
            check_interrupt()
            x, res = block(x, emb, context)
            skips.extend(res)
        if self.mid_block is not None:
            check_interrupt()
            x = self.mid_block(x, emb, context)
        return x, skips

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        encoder_hidden_states: torch.Tensor,
        added_cond_kwargs: Optional[Mapping[str, torch.Tensor]] = None,
        down_block_additional_residuals: Optional[Sequence[torch.Tensor]] = None,
        mid_block_additional_residual: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        in_dtype = sample.dtype
        x = sample.to(self.device, self.dtype, memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)
        context = encoder_hidden_states.to(self.device, self.dtype)
        if self.config.center_input_sample:
            x = 2 * x - 1.0
        emb = self.time_embed(timestep, x.shape[0], added_cond_kwargs)

        factor = 2**self.num_upsamplers
        odd_size = any(s % factor for s in x.shape[-2:])

        x, skips = self.down_path(self.conv_in(x), emb, context)
        if down_block_additional_residuals is not None:  # a ControlNet's (gencli.models.unet.controlnet)
            if len(down_block_additional_residuals) != len(skips):
                raise ValueError(f"{len(down_block_additional_residuals)} residuals for {len(skips)} skip connections")
            skips = [s + r.to(s.dtype) for s, r in zip(skips, down_block_additional_residuals)]
        if mid_block_additional_residual is not None:
            x = x + mid_block_additional_residual.to(x.dtype)
        for i, block in enumerate(self.up_blocks):
            check_interrupt()
            n = len(block.resnets)
            res, skips = skips[-n:], skips[:-n]
            size = tuple(skips[-1].shape[2:]) if odd_size and i < len(self.up_blocks) - 1 else None
            x = block(x, res, emb, context, size)
        x = self.conv_out(self.conv_norm_out(x, self.conv_act))
        return x.to(in_dtype, memory_format=torch.contiguous_format)


__all__ = [
    "UNet2DConditionConfig",
    "UNet2DConditionModel",
    "build_down_path",
    "Transformer2DModel",
    "BasicTransformerBlock",
    "FeedForward",
    "GEGLU",
    "TimestepEmbedding",
    "DownBlock2D",
    "CrossAttnDownBlock2D",
    "UpBlock2D",
    "CrossAttnUpBlock2D",
    "UNetMidBlock2DCrossAttn",
]
