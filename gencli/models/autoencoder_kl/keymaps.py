"""Key mappings from ``AutoencoderKL`` checkpoint layouts onto :mod:`gencli.models.autoencoder_kl`,
and the configuration a single file implies.

- diffusers (current): identity;
- diffusers before 0.14 (``DIFFUSERS_LEGACY``): the mid-block attention as ``query``/``key``/``value``/
  ``proj_attn``, sometimes stored as 1x1 convolutions;
- the original latent-diffusion layout (:func:`ldm_keymap`), as Stable Diffusion single files carry it
  under ``first_stage_model.`` (or ``vae.``), and standalone VAE files without a prefix:
  ``encoder.down.N.block.M``, ``downsample``/``upsample``, ``mid.block_1``/``mid.attn_1``/``mid.block_2``,
  ``nin_shortcut``, ``norm_out``; the decoder's ``up.N`` counts from the lowest resolution's
  opposite end (``up.0`` is diffusers' last up block); the attention's ``q``/``k``/``v``/``proj_out``
  are 1x1 convolutions that become linear weights.

A single file carries no ``config.json``: :func:`config_from_ldm_shapes` reads the widths, depth,
latent and image channels, quant convs and attention from the tensor shapes and takes the rest
(GroupNorm groups, scaling factor, sample size) from the standard Stable Diffusion VAE configuration
(:data:`SD_VAE_CONFIG`, or :data:`SDXL_VAE_OVERRIDES` for SDXL files).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from gencli.checkpoints.keymap import Apply, Drop, KeyMap, Rename

# The VAE configuration of Stable Diffusion 1.x/2.x (the `vae/config.json` of their diffusers
# repositories), used for single files, which carry no config.
SD_VAE_CONFIG: dict[str, Any] = {
    "_class_name": "AutoencoderKL",
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 512,
    "scaling_factor": 0.18215,
    "force_upcast": True,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "mid_block_add_attention": True,
}
# what SDXL's VAE changes (its scaling factor and training resolution)
SDXL_VAE_OVERRIDES: dict[str, Any] = {"scaling_factor": 0.13025, "sample_size": 1024}

# prefixes under which single files carry the VAE (diffusers' LDM_VAE_KEYS)
LDM_PREFIXES = ("first_stage_model.", "vae.")


def conv1x1_to_linear(t: torch.Tensor) -> torch.Tensor:
    """A 1x1 convolution weight ``(out, in, 1, 1)`` (or ``(out, in, 1)``) as a linear weight ``(out, in)``."""
    if t.ndim <= 2:
        return t
    if any(s != 1 for s in t.shape[2:]):
        raise ValueError(f"an attention weight of shape {list(t.shape)} is not a 1x1 convolution")
    return t.reshape(t.shape[0], t.shape[1])


_ATTN_WEIGHTS = r"\.mid_block\.attentions\.0\.to_(q|k|v|out\.0)\.weight$"
_ATTN_TO_LINEAR = Apply(_ATTN_WEIGHTS, conv1x1_to_linear, "1x1 conv to linear")

DIFFUSERS = KeyMap([], "diffusers AutoencoderKL")

DIFFUSERS_LEGACY = KeyMap(
    [
        Rename(r"(\.mid_block\.attentions\.0)\.query\.", r"\1.to_q."),
        Rename(r"(\.mid_block\.attentions\.0)\.key\.", r"\1.to_k."),
        Rename(r"(\.mid_block\.attentions\.0)\.value\.", r"\1.to_v."),
        Rename(r"(\.mid_block\.attentions\.0)\.proj_attn\.", r"\1.to_out.0."),
        _ATTN_TO_LINEAR,
    ],
    "diffusers AutoencoderKL (legacy attention names)",
)


def ldm_keymap(num_blocks: int, prefix: str = "") -> KeyMap:
    """The original latent-diffusion naming of a VAE with ``num_blocks`` resolutions, under ``prefix``
    (``"first_stage_model."`` in a Stable Diffusion single file: everything else in it is dropped)."""
    rules: list = []
    if prefix:
        rules += [Drop("^(?!" + re.escape(prefix) + ")"), Rename("^" + re.escape(prefix), "")]
    rules += [Drop(r"^(loss|model_ema)\.")]  # a training checkpoint's discriminator, EMA copies
    rules += [
        Rename(r"^encoder\.down\.(\d+)\.block\.", r"encoder.down_blocks.\1.resnets."),
        Rename(r"^encoder\.down\.(\d+)\.downsample\.", r"encoder.down_blocks.\1.downsamplers.0."),
    ]
    for i in range(num_blocks):
        rules += [
            Rename(rf"^decoder\.up\.{i}\.block\.", f"decoder.up_blocks.{num_blocks - 1 - i}.resnets."),
            Rename(rf"^decoder\.up\.{i}\.upsample\.", f"decoder.up_blocks.{num_blocks - 1 - i}.upsamplers.0."),
        ]
    rules += [
        Rename(r"\.mid\.block_1\.", ".mid_block.resnets.0."),
        Rename(r"\.mid\.block_2\.", ".mid_block.resnets.1."),
        Rename(r"\.mid\.attn_1\.norm\.", ".mid_block.attentions.0.group_norm."),
        Rename(r"\.mid\.attn_1\.q\.", ".mid_block.attentions.0.to_q."),
        Rename(r"\.mid\.attn_1\.k\.", ".mid_block.attentions.0.to_k."),
        Rename(r"\.mid\.attn_1\.v\.", ".mid_block.attentions.0.to_v."),
        Rename(r"\.mid\.attn_1\.proj_out\.", ".mid_block.attentions.0.to_out.0."),
        Rename(r"\.nin_shortcut\.", ".conv_shortcut."),
        Rename(r"^(encoder|decoder)\.norm_out\.", r"\1.conv_norm_out."),
        _ATTN_TO_LINEAR,
    ]
    return KeyMap(rules, f"original (latent-diffusion) VAE layout{' under ' + prefix if prefix else ''}")


def layout_of(keys: set[str]) -> tuple[str, str]:
    """``(layout, prefix)`` of a VAE's tensor names: ``("diffusers", "")``, ``("diffusers-legacy", "")``
    or ``("ldm", prefix)``; ``("", "")`` when the names are neither."""
    if any(k.startswith("encoder.down_blocks.") for k in keys):
        legacy = any(re.search(r"\.mid_block\.attentions\.0\.(query|proj_attn)\.", k) for k in keys)
        return ("diffusers-legacy" if legacy else "diffusers"), ""
    for prefix in ("",) + LDM_PREFIXES:
        if prefix + "encoder.conv_in.weight" in keys and any(k.startswith(prefix + "encoder.down.") for k in keys):
            return "ldm", prefix
    return "", ""


def keymap_for(layout: str, prefix: str, num_blocks: int) -> KeyMap:
    if layout == "diffusers":
        return DIFFUSERS
    if layout == "diffusers-legacy":
        return DIFFUSERS_LEGACY
    return ldm_keymap(num_blocks, prefix)


def config_from_ldm_shapes(shape: Callable[[str], tuple[int, ...]], keys: set[str], prefix: str = "", *, sdxl: bool = False) -> dict[str, Any]:
    """A diffusers ``AutoencoderKL`` config for an original-layout VAE, from its tensor shapes
    (``shape(name)``); what shapes cannot tell comes from :data:`SD_VAE_CONFIG`."""

    def has(name: str) -> bool:
        return prefix + name in keys

    blocks = sorted({int(m.group(1)) for k in keys if (m := re.match(re.escape(prefix) + r"encoder\.down\.(\d+)\.", k))})
    if not blocks or blocks != list(range(len(blocks))):
        raise ValueError("the encoder's down blocks are not numbered 0..N-1")
    widths = [shape(f"{prefix}encoder.down.{i}.block.0.conv2.weight")[0] for i in blocks]
    depth = len({int(m.group(1)) for k in keys if (m := re.match(re.escape(prefix) + r"encoder\.down\.0\.block\.(\d+)\.", k))})
    config = dict(SD_VAE_CONFIG)
    if sdxl:
        config.update(SDXL_VAE_OVERRIDES)
    config.update(
        in_channels=shape(prefix + "encoder.conv_in.weight")[1],
        out_channels=shape(prefix + "decoder.conv_out.weight")[0],
        down_block_types=["DownEncoderBlock2D"] * len(widths),
        up_block_types=["UpDecoderBlock2D"] * len(widths),
        block_out_channels=widths,
        layers_per_block=depth,
        latent_channels=shape(prefix + "decoder.conv_in.weight")[1],
        use_quant_conv=has("quant_conv.weight"),
        use_post_quant_conv=has("post_quant_conv.weight"),
        mid_block_add_attention=has("encoder.mid.attn_1.q.weight"),
    )
    if any(w % config["norm_num_groups"] for w in widths):
        raise ValueError(f"block widths {widths} do not fit GroupNorm with {config['norm_num_groups']} groups")
    return config


__all__ = [
    "SD_VAE_CONFIG",
    "SDXL_VAE_OVERRIDES",
    "LDM_PREFIXES",
    "DIFFUSERS",
    "DIFFUSERS_LEGACY",
    "conv1x1_to_linear",
    "ldm_keymap",
    "layout_of",
    "keymap_for",
    "config_from_ldm_shapes",
]
