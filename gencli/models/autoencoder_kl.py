"""The KL-regularised autoencoder of latent diffusion (Rombach et al. 2022), in diffusers'
``AutoencoderKL`` layout: the Stable Diffusion VAE and anything configured like it.

- :class:`Encoder`: ``conv_in``, down blocks (:class:`DownEncoderBlock2D`: ``layers_per_block``
  ResNet blocks, then a stride-2 conv padded on the right and bottom, except after the last block),
  a mid-block (ResNet, single-head self-attention over the pixels, ResNet), then
  GroupNorm + SiLU and ``conv_out`` to ``2 * latent_channels`` moments (mean and log-variance);
  (that last activation is SiLU whatever ``act_fn`` says, as in diffusers);
- :class:`Decoder`: the mirror image, up blocks of ``layers_per_block + 1`` ResNet blocks and a
  nearest-neighbour x2 upsampling conv (except after the last block);
- :class:`AutoencoderKL`: the two, with the optional 1x1 ``quant_conv`` / ``post_quant_conv``;
  ``encode(x)`` gives a :class:`DiagonalGaussianDistribution`, ``decode(z)`` the image in
  ``[-1, 1]``; :meth:`AutoencoderKL.scale_latents` / :meth:`AutoencoderKL.unscale_latents` apply the
  config's ``scaling_factor`` (and ``shift_factor`` or ``latents_mean``/``latents_std``) the way
  diffusers' pipelines do.

Tiled encoding and decoding (:class:`Tiling`) process an image in overlapping tiles. Every tile has
the same full size (the last row and column are aligned to the image's edge instead of being cut
short). Tiles are merged
by a weighted average (:func:`tile_weights`): in each overlap a tile's weight is zero over the
quarter nearest its border (outputs there saw the tile's zero padding), then ramps linearly to one
across the middle half while its neighbour's falls, so the weights sum to one and the hand-over is
spread over half the overlap (diffusers' ``blend_v``/``blend_h`` ramp from the tile's very border
and then crop). Only the local part of each network is tiled: the encoder's ``conv_in`` and down
blocks, the decoder's up blocks and output. The mid-block, whose self-attention is global, runs
once on the whole latent-resolution feature map (the latent is ``f*f`` times smaller than the image,
so this costs little memory), as the untiled pass does. GroupNorm statistics are the whole image's
in every tile: the tiles advance together through the network split at its GroupNorms
(:meth:`Encoder.feature_steps`, :meth:`Decoder.pixel_steps`), and each norm's statistics are
gathered over all tiles before any tile goes on (:func:`blend_tiles_with_shared_statistics`). The
pass costs the untiled one's compute times the tiles' coverage (their summed area over the image's:
2.25 for 3x3 tiles of half the image's side, 1.56 for 5x5 tiles of a quarter); at its widest it
keeps two activations of every tile (a norm's input and a ResNet block's residual), where the
untiled pass keeps about three of the whole image. What is left between a tiled and an untiled
pass is the zero padding at tile borders seen through the receptive field,
kept out of the output by the blending halo: on the trained shapes autoencoder, 0.1/255 away from
the blending bands and 1.6/255 at most inside them.

Attribute names are diffusers', so a diffusers ``vae/`` folder loads by identity; the original
Stable Diffusion (LDM) naming is mapped in :mod:`gencli.models.autoencoder_kl_keymaps`.
Every norm is the backend's :class:`~gencli.backend.layers.GroupNorm` (``norm(x, "silu")``), every
attention goes through :class:`gencli.models.attention.Attention`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.layers import GroupNorm, get_activation
from gencli.models.attention import Attention
from gencli.models.resnet2d import Downsample2D, ResnetBlock2D, Upsample2D

DOWN_BLOCK = "DownEncoderBlock2D"
UP_BLOCK = "UpDecoderBlock2D"

# diffusers bookkeeping fields of a config.json, not architecture
_META_FIELDS = ("_class_name", "_diffusers_version", "_name_or_path", "_use_default_values")


@dataclass
class AutoencoderKLConfig:
    """The fields of a diffusers ``AutoencoderKL`` ``config.json`` (diffusers' defaults)."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = (DOWN_BLOCK,)
    up_block_types: tuple[str, ...] = (UP_BLOCK,)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int = 32
    scaling_factor: float = 0.18215
    shift_factor: Optional[float] = None
    latents_mean: Optional[tuple[float, ...]] = None
    latents_std: Optional[tuple[float, ...]] = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self) -> None:
        self.down_block_types = tuple(self.down_block_types)
        self.up_block_types = tuple(self.up_block_types)
        self.block_out_channels = tuple(int(c) for c in self.block_out_channels)
        if isinstance(self.sample_size, (list, tuple)):
            self.sample_size = int(self.sample_size[0])
        for name in ("latents_mean", "latents_std"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, tuple(float(v) for v in value))
        n = len(self.block_out_channels)
        if n == 0:
            raise ValueError("block_out_channels is empty")
        if len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise ValueError(
                f"{len(self.down_block_types)} down and {len(self.up_block_types)} up block types for {n} block_out_channels"
            )
        bad = [t for t in self.down_block_types if t != DOWN_BLOCK] + [t for t in self.up_block_types if t != UP_BLOCK]
        if bad:
            raise ValueError(f"unsupported block type '{bad[0]}' (AutoencoderKL uses {DOWN_BLOCK} and {UP_BLOCK})")
        odd = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if odd:
            raise ValueError(f"block width {odd[0]} is not divisible by norm_num_groups={self.norm_num_groups}")
        if self.layers_per_block < 1 or self.latent_channels < 1:
            raise ValueError("layers_per_block and latent_channels must be at least 1")
        get_activation(self.act_fn)
        for name in ("latents_mean", "latents_std"):
            value = getattr(self, name)
            if value is not None and len(value) != self.latent_channels:
                raise ValueError(f"{name} has {len(value)} values for {self.latent_channels} latent channels")

    @property
    def downsampling(self) -> int:
        """How many pixels one latent pixel covers along each side (8 for Stable Diffusion)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AutoencoderKLConfig":
        """From a diffusers ``config.json`` (unknown fields are ignored, as diffusers does)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known and k not in _META_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        """A diffusers ``config.json`` (with ``_class_name``), loadable by ``AutoencoderKL.from_pretrained``."""
        out: dict[str, Any] = {"_class_name": "AutoencoderKL", "_diffusers_version": "0.30.0"}
        for k, v in asdict(self).items():
            out[k] = list(v) if isinstance(v, tuple) else v
        return out


class DiagonalGaussianDistribution:
    """The encoder's posterior: a Gaussian per latent element, from ``moments = cat(mean, logvar)``
    along the channels (log-variance clamped to [-30, 20], as diffusers does)."""

    def __init__(self, moments: torch.Tensor):
        self.moments = moments
        self.mean, logvar = torch.chunk(moments, 2, dim=1)
        self.logvar = torch.clamp(logvar, -30.0, 20.0)

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    @property
    def var(self) -> torch.Tensor:
        return torch.exp(self.logvar)

    def sample(self, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``mean + std * eps``; ``eps`` drawn on the generator's device (so a CPU generator gives
        the same latents whatever device the model runs on)."""
        where = generator.device if generator is not None else self.mean.device
        eps = torch.randn(self.mean.shape, generator=generator, device=where, dtype=self.mean.dtype).to(self.mean.device)
        return self.mean + self.std * eps

    def mode(self) -> torch.Tensor:
        return self.mean

    def kl(self) -> torch.Tensor:
        """KL divergence to the standard normal, summed over each sample's latent elements: ``(B,)``."""
        return 0.5 * torch.sum(self.mean.pow(2) + self.var - 1.0 - self.logvar, dim=list(range(1, self.mean.ndim)))


def vae_resnets(in_channels: int, out_channels: int, num_layers: int, groups: int, act: str) -> nn.ModuleList:
    """``num_layers`` ResNet blocks without timestep input (the first one changes the width)."""
    return nn.ModuleList(
        ResnetBlock2D(in_channels if i == 0 else out_channels, out_channels, temb_channels=None, groups=groups, eps=1e-6, non_linearity=act)
        for i in range(num_layers)
    )


def _resnets_then(resnets: nn.ModuleList, resample: Optional[nn.ModuleList], x: torch.Tensor) -> torch.Tensor:
    for resnet in resnets:
        x = resnet(x)
    return resample[0](x) if resample is not None else x


class DownEncoderBlock2D(nn.Module):
    """``num_layers`` ResNet blocks without timestep input, then (optionally) a stride-2 conv."""

    def __init__(self, in_channels: int, out_channels: int, num_layers: int, groups: int, act: str, add_downsample: bool):
        super().__init__()
        self.resnets = vae_resnets(in_channels, out_channels, num_layers, groups, act)
        self.downsamplers = nn.ModuleList([Downsample2D(out_channels, out_channels=out_channels, padding=0)]) if add_downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _resnets_then(self.resnets, self.downsamplers, x)


class UpDecoderBlock2D(nn.Module):
    """``num_layers`` ResNet blocks without timestep input, then (optionally) a x2 upsampling conv."""

    def __init__(self, in_channels: int, out_channels: int, num_layers: int, groups: int, act: str, add_upsample: bool):
        super().__init__()
        self.resnets = vae_resnets(in_channels, out_channels, num_layers, groups, act)
        self.upsamplers = nn.ModuleList([Upsample2D(out_channels, out_channels=out_channels)]) if add_upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _resnets_then(self.resnets, self.upsamplers, x)


class UNetMidBlock2D(nn.Module):
    """diffusers' ``UNetMidBlock2D`` as the VAE uses it: ResNet, single-head self-attention over the
    pixels (GroupNorm first, residual added), ResNet; the attention is left out with
    ``add_attention=False``."""

    def __init__(self, channels: int, groups: int, act: str, add_attention: bool = True):
        super().__init__()
        self.add_attention = add_attention
        self.resnets = vae_resnets(channels, channels, 2, groups, act)
        if add_attention:
            attn = Attention(channels, heads=1, dim_head=channels, bias=True, norm_num_groups=groups, eps=1e-6, residual_connection=True)
            self.attentions = nn.ModuleList([attn])
        else:
            self.attentions = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Encoder(nn.Module):
    """Image ``(B, in_channels, H, W)`` -> moments ``(B, 2*latent_channels, H/f, W/f)`` (``double_z``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        block_out_channels: Sequence[int],
        layers_per_block: int,
        norm_num_groups: int,
        act_fn: str = "silu",
        double_z: bool = True,
        mid_block_add_attention: bool = True,
    ):
        super().__init__()
        widths = list(block_out_channels)
        self.conv_in = nn.Conv2d(in_channels, widths[0], kernel_size=3, padding=1)
        self.down_blocks = nn.ModuleList(
            DownEncoderBlock2D(widths[max(i - 1, 0)], w, layers_per_block, norm_num_groups, act_fn, add_downsample=i < len(widths) - 1)
            for i, w in enumerate(widths)
        )
        self.mid_block = UNetMidBlock2D(widths[-1], norm_num_groups, act_fn, mid_block_add_attention)
        self.conv_norm_out = GroupNorm(norm_num_groups, widths[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(widths[-1], 2 * out_channels if double_z else out_channels, kernel_size=3, padding=1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The local part: ``conv_in`` and the down blocks (image -> features at latent resolution)."""
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return x

    def feature_steps(self) -> list["TiledStep"]:
        """:meth:`features` as a queue of steps split at every GroupNorm (for a tiled pass that
        advances all tiles together, :func:`blend_tiles_with_shared_statistics`)."""
        return [module_step(self.conv_in)] + [step for block in self.down_blocks for step in block_steps(block)]

    def moments(self, h: torch.Tensor) -> torch.Tensor:
        """The global part, at latent resolution: mid-block (attention over every latent pixel) and output."""
        h = self.mid_block(h)
        return self.conv_out(self.conv_norm_out(h, "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moments(self.features(x))


class Decoder(nn.Module):
    """Latent ``(B, in_channels, h, w)`` -> image ``(B, out_channels, h*f, w*f)``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        block_out_channels: Sequence[int],
        layers_per_block: int,
        norm_num_groups: int,
        act_fn: str = "silu",
        mid_block_add_attention: bool = True,
    ):
        super().__init__()
        widths = list(reversed(block_out_channels))
        self.conv_in = nn.Conv2d(in_channels, widths[0], kernel_size=3, padding=1)
        self.mid_block = UNetMidBlock2D(widths[0], norm_num_groups, act_fn, mid_block_add_attention)
        self.up_blocks = nn.ModuleList(
            UpDecoderBlock2D(widths[max(i - 1, 0)], w, layers_per_block + 1, norm_num_groups, act_fn, add_upsample=i < len(widths) - 1)
            for i, w in enumerate(widths)
        )
        self.conv_norm_out = GroupNorm(norm_num_groups, widths[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(widths[-1], out_channels, kernel_size=3, padding=1)

    def stem(self, z: torch.Tensor) -> torch.Tensor:
        """The global part, at latent resolution: ``conv_in`` and the mid-block (attention over every latent pixel)."""
        return self.mid_block(self.conv_in(z))

    def pixels(self, x: torch.Tensor) -> torch.Tensor:
        """The local part: up blocks and output (features at latent resolution -> image)."""
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(self.conv_norm_out(x, "silu"))

    def pixel_steps(self) -> list["TiledStep"]:
        """:meth:`pixels` as a queue of steps split at every GroupNorm (see :meth:`Encoder.feature_steps`)."""
        steps = [step for block in self.up_blocks for step in block_steps(block)]
        return steps + [NormStep(self.conv_norm_out, "silu"), module_step(self.conv_out)]

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.pixels(self.stem(z))


@dataclass
class Tiling:
    """How :class:`AutoencoderKL` cuts large inputs into tiles.

    ``tile_size``: a tile's side in image pixels (a multiple of the downsampling factor; the latent
    tile is ``tile_size / f``); ``overlap``: the share of a tile shared with its neighbour
    (0 < overlap < 1; the weights ramp over all of it); ``auto_above``: with ``tile=None`` an image
    (or the image a latent decodes to) is tiled when a side exceeds this many pixels (None: never);
    ``shared_norm_statistics``: every tile normalises with the whole image's GroupNorm statistics
    (:func:`blend_tiles_with_shared_statistics`: all tiles advance together from one GroupNorm to
    the next, one pass in all, every tile's activations alive at once); False: every tile
    normalises with its own statistics, as diffusers' tiling does (one tile's activations alive at
    a time; visibly different tiles on images whose regions differ).
    """

    tile_size: int = 512
    overlap: float = 0.25
    auto_above: Optional[int] = 1024
    shared_norm_statistics: bool = True

    def __post_init__(self) -> None:
        if self.tile_size < 8:
            raise ValueError(f"tile size {self.tile_size} is too small (at least 8 pixels)")
        if not 0.0 < self.overlap < 1.0:
            raise ValueError(f"tile overlap {self.overlap} must lie strictly between 0 and 1")


def tile_starts(length: int, tile: int, stride: int) -> list[int]:
    """Start offsets of full-size tiles covering ``[0, length)``: every ``stride``, the last one
    moved back so that it ends exactly at ``length`` (one tile when ``length <= tile``)."""
    if length <= tile:
        return [0]
    starts = list(range(0, length - tile, stride))
    starts.append(length - tile)
    return starts


def tile_weights(starts: list[int], size: int, scale: float, device, halo: float = 0.25) -> list[torch.Tensor]:
    """Blending weights along one axis for tiles starting at ``starts`` (input units), each ``size``
    output pixels long, ``scale`` output pixels per input unit.

    Where a tile overlaps a neighbour by ``o`` output pixels, its weight is 0 over the ``halo * o``
    pixels nearest its border (the outputs there saw the tile's zero padding), then rises linearly
    to 1 over the middle of the overlap, where the neighbour's weight falls by the same amount: the
    weights of the tiles covering a pixel add up to 1. Towards the image's own edges a tile keeps
    weight 1 (it sees the same border as the untiled pass)."""
    out = []
    pos = torch.arange(size, device=device, dtype=torch.float32) + 0.5
    for i, s in enumerate(starts):
        w = torch.ones(size, device=device, dtype=torch.float32)
        if i > 0:
            o = (starts[i - 1] - s) * scale + size
            h = math.floor(halo * o)
            w = torch.minimum(w, ((pos - h) / max(o - 2 * h, 1)).clamp(0.0, 1.0))
        if i + 1 < len(starts):
            o = (s - starts[i + 1]) * scale + size
            h = math.floor(halo * o)
            w = torch.minimum(w, ((size - pos - h) / max(o - 2 * h, 1)).clamp(0.0, 1.0))
        out.append(w)
    return out


def tile_grid(x: torch.Tensor, in_tile: int, in_stride: int, scale: float, halo: float = 0.25):
    """The tiles of ``x`` (stride ``in_stride``; the last row and column aligned to the edge), each as
    ``(input slice, output offset (oy, ox), output weights (h, w))`` with the weights of
    :func:`tile_weights` (they sum to one over the tiles covering an output pixel)."""
    h, w = x.shape[-2:]
    ys, xs = tile_starts(h, in_tile, in_stride), tile_starts(w, in_tile, in_stride)
    th, tw = round(min(in_tile, h) * scale), round(min(in_tile, w) * scale)
    wys = tile_weights(ys, th, scale, x.device, halo)
    wxs = tile_weights(xs, tw, scale, x.device, halo)
    for y0, wy in zip(ys, wys):
        for x0, wx in zip(xs, wxs):
            yield x[:, :, y0 : y0 + in_tile, x0 : x0 + in_tile], (round(y0 * scale), round(x0 * scale)), wy[:, None] * wx[None, :]


def merge_tiles(tiles, batch: int, out_channels: int, out_h: int, out_w: int, like: torch.Tensor) -> torch.Tensor:
    """The weighted average of tile outputs: ``tiles`` yields ``(output, (oy, ox), weights (h, w))``
    (as :func:`tile_grid` places them). Accumulated in fp32 (on ``like``'s device, returned in its
    dtype); each output may be freed as soon as the next one is asked for."""
    acc = torch.zeros(batch, out_channels, out_h, out_w, device=like.device, dtype=torch.float32)
    total = torch.zeros(1, 1, out_h, out_w, device=like.device, dtype=torch.float32)
    for tile, (oy, ox), wt in tiles:
        th, tw = wt.shape
        acc[:, :, oy : oy + th, ox : ox + tw].addcmul_(tile.float(), wt)
        total[:, :, oy : oy + th, ox : ox + tw].add_(wt)
        del tile
    return acc.div_(total).to(like.dtype)


def blend_tiles(run, x: torch.Tensor, in_tile: int, in_stride: int, scale: float, out_channels: int, halo: float = 0.25) -> torch.Tensor:
    """Apply ``run`` to the overlapping tiles of ``x`` (:func:`tile_grid`) and merge the outputs
    (``scale`` times the input's size) with their weights (:func:`merge_tiles`); only one tile's
    activations are alive at a time."""
    b, _, h, w = x.shape
    outputs = ((run(piece), offset, wt) for piece, offset, wt in tile_grid(x, in_tile, in_stride, scale, halo))
    return merge_tiles(outputs, b, out_channels, round(h * scale), round(w * scale), x)


class SharedGroupNormStatistics:
    """One GroupNorm's statistics over a whole image, gathered from its overlapping tiles.

    GroupNorm normalises with the mean and variance of each group over the *whole* image, so a tile
    normalised with its own statistics comes out unlike the same region of the untiled pass
    (everywhere in the tile, not only near its border: a tile of plain background has other
    statistics than the image with its objects). :meth:`add` takes each tile's input to the norm
    and adds its per-group sums of ``x`` and ``x**2`` weighted by the tile's blending weights,
    resampled to the layer's resolution, so that each pixel counts once and the padding-affected
    halo not at all (per channel in fp32, as matrix-vector products; over channels and tiles in
    fp64); :meth:`close` turns the sums into a mean and variance per sample and group. Installed as
    a GroupNorm's ``statistics`` hook, it then normalises every tile with them (:meth:`normalize`).
    """

    def __init__(self) -> None:
        self.sums: Optional[list[torch.Tensor]] = None  # [weight, sum x, sum x^2]: scalar, (B, groups), (B, groups)
        self.mean: Optional[torch.Tensor] = None  # (B, groups) fp64
        self.var: Optional[torch.Tensor] = None

    @staticmethod
    def weights_at(weights: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """A tile's blending weights (given at the output's resolution) at a layer's ``h x w``."""
        wt = weights[None, None]
        mode = "area" if h <= wt.shape[-2] else "nearest"
        return F.interpolate(wt, size=(h, w), mode=mode)[0, 0]

    def add(self, x: torch.Tensor, num_groups: int, weights: torch.Tensor) -> None:
        """Add a tile's input ``x`` ``(B, C, h, w)`` to the norm, with its output ``weights``."""
        b, c, h, w = x.shape
        per = c // num_groups
        if x.dtype != torch.float64:
            x = x.float()  # (a no-op in fp32) per-channel sums as matrix-vector products, fp32 accumulation
        wt = self.weights_at(weights, h, w).to(x.dtype)
        s1 = torch.einsum("bchw,hw->bc", x, wt).double().view(b, -1, per).sum(-1)
        s2 = torch.einsum("bchw,hw->bc", x * x, wt).double().view(b, -1, per).sum(-1)
        s0 = wt.double().sum() * per
        self.sums = [s0, s1, s2] if self.sums is None else [a + d for a, d in zip(self.sums, (s0, s1, s2))]

    def close(self) -> None:
        """The mean and (biased) variance of every group from the added tiles."""
        if self.sums is None:
            raise RuntimeError("no tile was added")
        s0, s1, s2 = self.sums
        self.mean = s1 / s0
        self.var = (s2 / s0 - self.mean * self.mean).clamp_min(0.0)

    def normalize(self, norm: GroupNorm, x: torch.Tensor) -> torch.Tensor:
        """``norm`` applied to a tile ``x`` with the whole image's statistics (the ``statistics`` hook
        of :class:`~gencli.backend.layers.GroupNorm`)."""
        if self.mean is None or self.var is None:
            raise RuntimeError("statistics used before close()")
        per = x.shape[1] // norm.num_groups
        rstd = torch.rsqrt(self.var + norm.eps).repeat_interleave(per, dim=1)  # (B, C)
        scale = rstd * norm.weight.double() if norm.weight is not None else rstd
        shift = (norm.bias.double() if norm.bias is not None else 0.0) - self.mean.repeat_interleave(per, dim=1) * scale
        return torch.addcmul(shift.to(x.dtype)[:, :, None, None], x, scale.to(x.dtype)[:, :, None, None])


# -- the tiled pass with shared statistics: a queue of steps that all tiles advance through together --
@dataclass
class TileState:
    """Where one tile stands in a layer-by-layer pass: its current activation ``x`` and, inside a
    ResNet block, the block's ``residual``."""

    x: Optional[torch.Tensor]
    residual: Optional[torch.Tensor] = None


@dataclass
class NormStep:
    """A GroupNorm (then ``activation``) that every tile reaches before any goes on: its statistics
    are the whole image's. ``keep_input``: the input becomes the tile's ``residual`` (a ResNet
    block's first norm)."""

    norm: GroupNorm
    activation: Optional[str] = None
    keep_input: bool = False


TiledStep = Any  # a NormStep or a callable that advances one TileState in place


def module_step(module: nn.Module):
    """A step that applies ``module`` to a tile's activation (a conv, a resampler)."""

    def step(state: TileState) -> None:
        state.x = module(state.x)

    return step


def resnet_steps(block: ResnetBlock2D) -> list[TiledStep]:
    """A ResNet block without timestep input as steps: norm1 (input kept as the residual), conv1
    (and the shortcut, so the wider input is freed early), norm2, conv2 plus the residual."""
    if block.time_emb_proj is not None:
        raise ValueError("a ResNet block with a timestep input is not tiled")

    def conv1(state: TileState) -> None:
        state.x = block.conv1(state.x)
        state.residual = block.shortcut(state.residual)

    def conv2(state: TileState) -> None:
        state.x, state.residual = block.output(state.x, state.residual), None

    return [NormStep(block.norm1, block.act, keep_input=True), conv1, NormStep(block.norm2, block.act), conv2]


def block_steps(block: nn.Module) -> list[TiledStep]:
    """A down or up block (:class:`DownEncoderBlock2D`, :class:`UpDecoderBlock2D`) as steps."""
    steps = [step for resnet in block.resnets for step in resnet_steps(resnet)]
    for resample in (getattr(block, "downsamplers", None), getattr(block, "upsamplers", None)):
        if resample is not None:
            steps.append(module_step(resample[0]))
    return steps


def _segments(steps: Sequence[TiledStep]) -> list[tuple[Optional[NormStep], list]]:
    """``steps`` cut before every GroupNorm: ``(norm or None for the first, the steps up to the next norm)``."""
    segments: list[tuple[Optional[NormStep], list]] = [(None, [])]
    for step in steps:
        if isinstance(step, NormStep):
            segments.append((step, []))
        else:
            segments[-1][1].append(step)
    return segments


def _advance(tiles, norm: Optional[NormStep], shared: Optional[SharedGroupNormStatistics], run: list):
    """Take each tile ``(state, weights)`` through one segment: the norm with the ``shared``
    statistics, then the steps up to the next norm; yields each tile as it gets there."""
    if norm is not None:
        norm.norm.statistics = shared
    try:
        for state, wt in tiles:
            if norm is not None:
                out = norm.norm(state.x, norm.activation)
                if norm.keep_input:
                    state.residual = state.x
                state.x = out  # the input (unless kept) is freed here
            for step in run:
                step(state)
            yield state, wt
    finally:
        if norm is not None:
            norm.norm.statistics = None


def blend_tiles_with_shared_statistics(
    steps: Sequence[TiledStep], x: torch.Tensor, in_tile: int, in_stride: int, scale: float, out_channels: int, halo: float = 0.25
) -> torch.Tensor:
    """:func:`blend_tiles` of the network that ``steps`` describe, with every GroupNorm normalising
    each tile with the whole input's statistics.

    The tiles advance together through the queue of steps (as the Tiled VAE extensions for Stable
    Diffusion do): each tile in turn is normalised with the current GroupNorm's statistics and run
    up to the next GroupNorm, whose per-group sums it then adds (:class:`SharedGroupNormStatistics`);
    once every tile is there, the next norm's statistics are complete and the tiles go on. One pass
    in all, at the cost of keeping every tile's activation at the current norm's input (and a ResNet
    block's residual) alive at once, on the input's device and in its dtype, instead of one
    tile's; the rest (a norm's output, the tensors inside a segment) lives one tile at a time, and
    the last segment's outputs go straight into the blended result."""
    grid = list(tile_grid(x, in_tile, in_stride, scale, halo))
    tiles = [(TileState(piece), wt) for piece, _, wt in grid]
    segments = _segments(steps)
    shared = None
    for (norm, run), (following, _) in zip(segments, segments[1:]):
        gathering = SharedGroupNormStatistics()
        for state, wt in _advance(tiles, norm, shared, run):
            gathering.add(state.x, following.norm.num_groups, wt)
        gathering.close()
        shared = gathering

    def outputs():
        norm, run = segments[-1]
        for (state, wt), (_, offset, _) in zip(_advance(tiles, norm, shared, run), grid):
            tile, state.x = state.x, None
            yield tile, offset, wt

    b, _, h, w = x.shape
    return merge_tiles(outputs(), b, out_channels, round(h * scale), round(w * scale), x)


class AutoencoderKL(nn.Module):
    """diffusers' ``AutoencoderKL``: ``encode(x)`` -> posterior, ``decode(z)`` -> image.

    Images are ``(B, in_channels, H, W)`` in ``[-1, 1]`` with H and W multiples of the
    downsampling factor (``config.downsampling``); latents are ``(B, latent_channels, H/f, W/f)``
    before scaling (see :meth:`scale_latents`).
    """

    def __init__(self, config: AutoencoderKLConfig, tiling: Optional[Tiling] = None):
        super().__init__()
        self.config = config
        self.tiling = tiling or Tiling()
        c = config
        self.encoder = Encoder(
            c.in_channels, c.latent_channels, c.block_out_channels, c.layers_per_block, c.norm_num_groups, c.act_fn,
            double_z=True, mid_block_add_attention=c.mid_block_add_attention,
        )  # fmt: skip
        self.decoder = Decoder(
            c.latent_channels, c.out_channels, c.block_out_channels, c.layers_per_block, c.norm_num_groups, c.act_fn,
            mid_block_add_attention=c.mid_block_add_attention,
        )  # fmt: skip
        z2 = 2 * c.latent_channels
        self.quant_conv = nn.Conv2d(z2, z2, kernel_size=1) if c.use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(c.latent_channels, c.latent_channels, kernel_size=1) if c.use_post_quant_conv else None

    # -- plain passes -----------------------------------------------------------------------------
    def _memory_format(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs follow the weights' memory format (channels-last weights: channels-last activations)."""
        if self.encoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last) and not self.encoder.conv_in.weight.is_contiguous():
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def _moments(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return self.quant_conv(h) if self.quant_conv is not None else h

    def _image(self, z: torch.Tensor) -> torch.Tensor:
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def _tiled(self, tile: Optional[bool], pixels_h: int, pixels_w: int) -> bool:
        if tile is not None:
            return bool(tile) and max(pixels_h, pixels_w) > self.tiling.tile_size
        limit = self.tiling.auto_above
        return limit is not None and max(pixels_h, pixels_w) > limit

    def _tile_geometry(self) -> tuple[int, int]:
        """(latent tile side, latent stride) from the tiling settings."""
        f = self.config.downsampling
        lt = max(1, self.tiling.tile_size // f)
        stride = max(1, round(lt * (1.0 - self.tiling.overlap)))
        return lt, stride

    def encode(self, x: torch.Tensor, *, tile: Optional[bool] = None) -> DiagonalGaussianDistribution:
        """The posterior over latents for images ``x`` in ``[-1, 1]``.

        ``tile``: True tiles when the image is larger than a tile, False never, None (default)
        when a side exceeds ``self.tiling.auto_above``.
        """
        f = self.config.downsampling
        if x.shape[-1] % f or x.shape[-2] % f:
            raise ValueError(f"image size {x.shape[-1]}x{x.shape[-2]} is not a multiple of {f}")
        x = self._memory_format(x)
        if not self._tiled(tile, x.shape[-2], x.shape[-1]):
            return DiagonalGaussianDistribution(self._moments(x))
        lt, stride = self._tile_geometry()
        enc = self.encoder
        h = self._run_tiled(enc.feature_steps, enc.features, x, lt * f, stride * f, 1.0 / f, self.config.block_out_channels[-1])
        moments = enc.moments(h)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return DiagonalGaussianDistribution(moments)

    def decode(self, z: torch.Tensor, *, tile: Optional[bool] = None) -> torch.Tensor:
        """Images in (about) ``[-1, 1]`` for unscaled latents ``z`` (``tile`` as in :meth:`encode`)."""
        f = self.config.downsampling
        z = self._memory_format(z)
        if not self._tiled(tile, z.shape[-2] * f, z.shape[-1] * f):
            return self._image(z)
        lt, stride = self._tile_geometry()
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        dec = self.decoder
        h = dec.stem(z)
        return self._run_tiled(dec.pixel_steps, dec.pixels, h, lt, stride, float(f), self.config.out_channels)

    def _run_tiled(self, steps, run, x: torch.Tensor, tile: int, stride: int, scale: float, channels: int) -> torch.Tensor:
        """With ``shared_norm_statistics``, the queue ``steps()`` run over all tiles together
        (:func:`blend_tiles_with_shared_statistics`); otherwise ``run`` tile by tile (:func:`blend_tiles`)."""
        if not self.tiling.shared_norm_statistics:
            return blend_tiles(run, x, tile, stride, scale, channels)
        return blend_tiles_with_shared_statistics(steps(), x, tile, stride, scale, channels)

    def forward(self, x: torch.Tensor, sample_posterior: bool = False, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        posterior = self.encode(x)
        z = posterior.sample(generator) if sample_posterior else posterior.mode()
        return self.decode(z)

    # -- latent scaling (what diffusion models see) ----------------------------------------------------
    def scale_latents(self, z: torch.Tensor) -> torch.Tensor:
        """Latents as a diffusion model sees them: ``(z - shift) * scaling_factor`` (Stable Diffusion:
        ``z * 0.18215``); with ``latents_mean``/``latents_std`` per channel ``(z - mean) * scaling / std``."""
        c = self.config
        if c.latents_mean is not None and c.latents_std is not None:
            mean = torch.tensor(c.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1)
            std = torch.tensor(c.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1)
            return (z - mean) * c.scaling_factor / std
        return (z - (c.shift_factor or 0.0)) * c.scaling_factor

    def unscale_latents(self, z: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`scale_latents` (what :meth:`decode` takes)."""
        c = self.config
        if c.latents_mean is not None and c.latents_std is not None:
            mean = torch.tensor(c.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1)
            std = torch.tensor(c.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1)
            return z * std / c.scaling_factor + mean
        return z / c.scaling_factor + (c.shift_factor or 0.0)


__all__ = [
    "AutoencoderKLConfig",
    "AutoencoderKL",
    "DiagonalGaussianDistribution",
    "Encoder",
    "Decoder",
    "DownEncoderBlock2D",
    "UpDecoderBlock2D",
    "UNetMidBlock2D",
    "Tiling",
    "SharedGroupNormStatistics",
    "tile_starts",
    "tile_weights",
    "blend_tiles",
    "blend_tiles_with_shared_statistics",
    "merge_tiles",
    "tile_grid",
    "TileState",
    "NormStep",
    "module_step",
    "resnet_steps",
    "block_steps",
]
