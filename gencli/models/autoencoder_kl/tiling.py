"""Tiled encoding and decoding for :class:`~gencli.models.autoencoder_kl.model.AutoencoderKL`.

The encoder and decoder (:class:`Tiling`) process an image in overlapping tiles. Every tile has
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.interrupt import check_interrupt
from gencli.backend.layers import GroupNorm
from gencli.models.resnet2d import ResnetBlock2D


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


def _checked(piece: torch.Tensor) -> torch.Tensor:
    """A tile about to run, after checking for a pending termination (a long decode stops between tiles)."""
    check_interrupt()
    return piece


def blend_tiles(run, x: torch.Tensor, in_tile: int, in_stride: int, scale: float, out_channels: int, halo: float = 0.25) -> torch.Tensor:
    """Apply ``run`` to the overlapping tiles of ``x`` (:func:`tile_grid`) and merge the outputs
    (``scale`` times the input's size) with their weights (:func:`merge_tiles`); only one tile's
    activations are alive at a time."""
    b, _, h, w = x.shape
    outputs = ((run(_checked(piece)), offset, wt) for piece, offset, wt in tile_grid(x, in_tile, in_stride, scale, halo))
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
            check_interrupt()
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
