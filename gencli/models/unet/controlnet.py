"""diffusers' ``ControlNetModel`` (Zhang et al. 2023, "Adding Conditional Control to Text-to-Image
Diffusion Models") for SD 1.x / 2.x / SDXL.

A trainable copy of the UNet's down path and middle block that reads the noisy latents plus a
conditioning image (edges, depth, pose... in ``[0, 1]``, at the image's pixel size): a small stack of
convolutions (:class:`ControlNetConditioningEmbedding`, strides 2 down to the latents' size) adds the
image's features to the first convolution's output; each skip connection of the down path and the
middle block's output then go through a 1x1 "zero" convolution and are returned, scaled by
``conditioning_scale``, for the UNet to add to its own (``down_block_additional_residuals``,
``mid_block_additional_residual`` of :class:`~gencli.models.unet.unet_2d_condition.UNet2DConditionModel`).

The blocks are the UNet's own classes built from the same config fields, so the parameter names are
diffusers' (``controlnet_cond_embedding.*``, ``controlnet_down_blocks.N``, ``controlnet_mid_block``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.layers import Conv2d
from gencli.models.unet.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel, build_down_path


@dataclass
class ControlNetConfig:
    """The fields diffusers' ControlNet config adds to the UNet's."""

    unet: UNet2DConditionConfig
    conditioning_channels: int = 3
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)
    channel_order: str = "rgb"  # "bgr": the image's channels are flipped first
    global_pool_conditions: bool = False  # (shuffle models) the residuals averaged over the image

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ControlNetConfig":
        order = d.get("controlnet_conditioning_channel_order", "rgb")
        if order not in ("rgb", "bgr"):
            raise ValueError(f"controlnet_conditioning_channel_order must be rgb or bgr (got {order!r})")
        if d.get("class_embed_type") or d.get("num_class_embeds"):
            raise ValueError("class embeddings are not supported")
        if "up_block_types" not in d:  # a ControlNet has no up path: the UNet's mirror of its down path, unused
            d = {**d, "up_block_types": [t.replace("Down", "Up") for t in reversed(d.get("down_block_types", UNet2DConditionConfig.down_block_types))]}
        return cls(
            unet=UNet2DConditionConfig.from_dict(d),
            conditioning_channels=int(d.get("conditioning_channels", 3)),
            conditioning_embedding_out_channels=tuple(int(c) for c in (d.get("conditioning_embedding_out_channels") or (16, 32, 96, 256))),
            channel_order=order,
            global_pool_conditions=bool(d.get("global_pool_conditions", False)),
        )


class ControlNetConditioningEmbedding(nn.Module):
    """The conditioning image ``(B, C, H, W)`` -> features at the latents' size ``(B, channels, H/f, W/f)``:
    a 3x3 convolution, then pairs of 3x3 convolutions (the second of each with stride 2), SiLU after
    each, and a 3x3 output convolution (zero-initialised when trained)."""

    def __init__(self, embedding_channels: int, conditioning_channels: int = 3, block_out_channels: tuple[int, ...] = (16, 32, 96, 256)):
        super().__init__()
        self.conv_in = Conv2d(conditioning_channels, block_out_channels[0], kernel_size=3, padding=1)
        self.blocks = nn.ModuleList()
        for cin, cout in zip(block_out_channels[:-1], block_out_channels[1:]):
            self.blocks.append(Conv2d(cin, cin, kernel_size=3, padding=1))
            self.blocks.append(Conv2d(cin, cout, kernel_size=3, padding=1, stride=2))
        self.conv_out = Conv2d(block_out_channels[-1], embedding_channels, kernel_size=3, padding=1)

    def forward(self, cond: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.conv_in(cond))
        for block in self.blocks:
            x = F.silu(block(x))
        return self.conv_out(x)


class ControlNetModel(nn.Module):
    """``controlnet(sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale=1.0,
    added_cond_kwargs=None)`` -> ``(down_block_res_samples, mid_block_res_sample)``: the residuals the
    UNet adds to its skip connections and to its middle block's output (arguments as the UNet's, plus
    ``controlnet_cond (B, C, H * f, W * f)`` in ``[0, 1]``)."""

    def __init__(self, config: ControlNetConfig | Mapping[str, Any]):
        super().__init__()
        cfg = config if isinstance(config, ControlNetConfig) else ControlNetConfig.from_dict(config)
        self.control_config = cfg
        self.config = u = cfg.unet
        ch = u.block_out_channels
        build_down_path(self, u)  # the UNet's own modules and names
        self.controlnet_cond_embedding = ControlNetConditioningEmbedding(ch[0], cfg.conditioning_channels, cfg.conditioning_embedding_out_channels)
        # a 1x1 zero convolution for each skip connection: conv_in's, each layer's, each downsampler's
        widths = [ch[0]] + [c for i, c in enumerate(ch) for _ in range(u.layers_per_block[i] + (1 if i < u.num_levels - 1 else 0))]
        self.controlnet_down_blocks = nn.ModuleList([Conv2d(c, c, kernel_size=1) for c in widths])
        self.controlnet_mid_block = Conv2d(ch[-1], ch[-1], kernel_size=1)
        self.channels_last = False

    # the embeddings are computed as the UNet computes them
    dtype = UNet2DConditionModel.dtype
    device = UNet2DConditionModel.device
    _timesteps = UNet2DConditionModel._timesteps
    time_embed = UNet2DConditionModel.time_embed
    down_path = UNet2DConditionModel.down_path

    def use_channels_last(self, enabled: bool = True, *, weights: bool = True) -> "ControlNetModel":
        """As :meth:`UNet2DConditionModel.use_channels_last`."""
        self.channels_last = enabled
        if weights:
            self.to(memory_format=torch.channels_last if enabled else torch.contiguous_format)
        return self

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        encoder_hidden_states: torch.Tensor,
        controlnet_cond: torch.Tensor,
        conditioning_scale: float = 1.0,
        added_cond_kwargs: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        memory = torch.channels_last if self.channels_last else torch.contiguous_format
        x = sample.to(self.device, self.dtype, memory_format=memory)
        cond = controlnet_cond.to(self.device, self.dtype, memory_format=memory)
        if self.control_config.channel_order == "bgr":
            cond = torch.flip(cond, dims=[1])
        context = encoder_hidden_states.to(self.device, self.dtype)
        if self.config.center_input_sample:
            x = 2 * x - 1.0
        emb = self.time_embed(timestep, x.shape[0], added_cond_kwargs)
        x, skips = self.down_path(self.conv_in(x) + self.controlnet_cond_embedding(cond), emb, context)
        down = [conv(s) * conditioning_scale for s, conv in zip(skips, self.controlnet_down_blocks)]
        mid = self.controlnet_mid_block(x) * conditioning_scale
        if self.control_config.global_pool_conditions:
            down = [d.mean(dim=(2, 3), keepdim=True) for d in down]
            mid = mid.mean(dim=(2, 3), keepdim=True)
        return down, mid


__all__ = ["ControlNetConditioningEmbedding", "ControlNetConfig", "ControlNetModel"]
