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

Large inputs are encoded and decoded in overlapping tiles (:mod:`gencli.models.autoencoder_kl.tiling`).
Attribute names are diffusers', so a diffusers ``vae/`` folder loads by identity; the original
Stable Diffusion (LDM) naming is mapped in :mod:`gencli.models.autoencoder_kl.keymaps`.
Every norm is the backend's :class:`~gencli.backend.layers.GroupNorm` (``norm(x, "silu")``), every
attention goes through :class:`gencli.models.attention.Attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from gencli.backend.interrupt import check_interrupt
from gencli.backend.layers import GroupNorm, get_activation
from gencli.checkpoints.config import config_to_dict, read_config
from gencli.models.attention import Attention
from gencli.models.autoencoder_kl.tiling import NormStep, TiledStep, Tiling, blend_tiles, blend_tiles_with_shared_statistics, block_steps, module_step
from gencli.models.resnet2d import Downsample2D, ResnetBlock2D, Upsample2D

DOWN_BLOCK = "DownEncoderBlock2D"
UP_BLOCK = "UpDecoderBlock2D"



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
        size = d.get("sample_size")
        return read_config(cls, {**d, "sample_size": size[0]} if isinstance(size, (list, tuple)) and size else d)

    def to_dict(self) -> dict[str, Any]:
        """A diffusers ``config.json`` (with ``_class_name``), loadable by ``AutoencoderKL.from_pretrained``."""
        return {"_class_name": "AutoencoderKL", "_diffusers_version": "0.30.0", **config_to_dict(self)}


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
            check_interrupt()
            x = block(x)
        return self.conv_out(self.conv_norm_out(x, "silu"))

    def pixel_steps(self) -> list["TiledStep"]:
        """:meth:`pixels` as a queue of steps split at every GroupNorm (see :meth:`Encoder.feature_steps`)."""
        steps = [step for block in self.up_blocks for step in block_steps(block)]
        return steps + [NormStep(self.conv_norm_out, "silu"), module_step(self.conv_out)]

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.pixels(self.stem(z))


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
]
