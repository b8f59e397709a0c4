"""The UNet of a single-file Stable Diffusion checkpoint (the original CompVis/Stability layout,
``model.diffusion_model.*``): its architecture read from tensor names and shapes, and the key map
onto :class:`gencli.models.unet.unet_2d_condition.UNet2DConditionModel` (diffusers' names).

A single file carries no config. :func:`infer_unet_config` reads what the shapes tell, as ComfyUI's
model detection does: input/output channels and kernel sizes (``input_blocks.0.0``, ``out.2``), the
channel width of every level and the number of ResNet layers per level (``input_blocks.N.0``, a
stride-2 ``op`` conv ending each level but the last), which levels have spatial transformers and how
many transformer blocks each holds (``input_blocks.N.1.transformer_blocks.K``; the up path's depths
from ``output_blocks``), the context width (``attn2.to_k``), linear or 1x1-conv ``proj_in`` (SD 2.x,
SDXL: linear), ``only_cross_attention`` (``attn1`` reading the context), and SDXL's additional
embedding (``label_emb.0.0``: its input width). What shapes cannot tell comes from the standard
configs in :data:`STANDARD_UNET_CONFIGS`: the head count (SD 1.x: 8 heads; SD 2.x and SDXL: 64-wide
heads), the 256-wide embedding of each SDXL time id, the default sample size, GroupNorm's 32 groups.

The original layout numbers its blocks flatly: ``input_blocks.0`` is ``conv_in``; then per level
``layers_per_block`` entries ``[ResBlock, (SpatialTransformer)]`` and, but for the last level, one
``[Downsample]`` entry (``.0.op``); ``middle_block.0/1/2`` is ResBlock, transformer, ResBlock;
``output_blocks`` run the levels bottom-up with ``layers_per_block + 1`` entries each, the upsampler
(``.conv``) after the last ResBlock/transformer of every level but the top. ResBlocks name their
layers ``in_layers.0/2``, ``emb_layers.1``, ``out_layers.0/3``, ``skip_connection``; the transformers
already use diffusers' names. :func:`original_unet_keymap` turns that into a
:class:`gencli.checkpoints.keymap.KeyMap` for a given config.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from gencli.checkpoints.keymap import Apply, Drop, KeyMap, Rename, Rule
from gencli.errors import CheckpointError
from gencli.models.unet.unet_2d_condition import UNet2DConditionConfig

UNET_PREFIX = "model.diffusion_model."

_SD_COMMON: dict[str, Any] = {
    "_class_name": "UNet2DConditionModel",
    "act_fn": "silu",
    "center_input_sample": False,
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
}

# The unet/config.json of the reference diffusers repositories (runwayml/stable-diffusion-v1-5,
# stabilityai/stable-diffusion-2-1 and -2-1-base, stabilityai/stable-diffusion-xl-base-1.0 and
# -refiner-1.0), for what a single file's shapes cannot tell.
STANDARD_UNET_CONFIGS: dict[str, dict[str, Any]] = {
    "sd1": {
        **_SD_COMMON,
        "attention_head_dim": 8,
        "block_out_channels": [320, 640, 1280, 1280],
        "cross_attention_dim": 768,
        "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
        "sample_size": 64,
    },
    "sd2": {
        **_SD_COMMON,
        "attention_head_dim": [5, 10, 20, 20],
        "block_out_channels": [320, 640, 1280, 1280],
        "cross_attention_dim": 1024,
        "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
        "use_linear_projection": True,
        "sample_size": 64,  # 2.x-base (512 px); the 768-v models: 96
    },
    "sdxl": {
        **_SD_COMMON,
        "addition_embed_type": "text_time",
        "addition_embed_type_num_heads": 64,
        "addition_time_embed_dim": 256,
        "attention_head_dim": [5, 10, 20],
        "block_out_channels": [320, 640, 1280],
        "cross_attention_dim": 2048,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "projection_class_embeddings_input_dim": 2816,
        "transformer_layers_per_block": [1, 2, 10],
        "use_linear_projection": True,
        "sample_size": 128,
    },
    "sdxl-refiner": {
        **_SD_COMMON,
        "addition_embed_type": "text_time",
        "addition_embed_type_num_heads": 64,
        "addition_time_embed_dim": 256,
        "attention_head_dim": [6, 12, 24, 24],
        "block_out_channels": [384, 768, 1536, 1536],
        "cross_attention_dim": 1280,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "projection_class_embeddings_input_dim": 2560,
        "transformer_layers_per_block": 4,
        "use_linear_projection": True,
        "sample_size": 128,
    },
}

SD1_HEADS = 8  # SD 1.x: 8 heads at every level
SD2_HEAD_WIDTH = 64  # SD 2.x and SDXL: heads of 64 channels
SDXL_TIME_ID_WIDTH = 256  # SDXL: sinusoidal width of each size/crop (/aesthetic score) id
V_PREDICTION_NORM_STD = 0.09  # SD 2.x: std of one LayerNorm bias above which the model predicts v (ComfyUI's hint)


def standard_unet_config(family: str) -> dict[str, Any]:
    """A copy of the shipped diffusers UNet config of ``family`` (``sd1``, ``sd2``, ``sdxl``, ``sdxl-refiner``)."""
    try:
        return copy.deepcopy(STANDARD_UNET_CONFIGS[family])
    except KeyError:
        raise ValueError(f"unknown Stable Diffusion family '{family}' (known: {', '.join(STANDARD_UNET_CONFIGS)})") from None


def unet_family(config: Mapping[str, Any]) -> str:
    """``sd1``, ``sd2``, ``sdxl``, ``sdxl-refiner`` or ``custom`` for a diffusers UNet config, by its
    context width, projection kind and additional embedding (what the rest of a pipeline differs by:
    text encoders, default size, default scheduler)."""
    cross = config.get("cross_attention_dim", 1280)
    cross = cross[-1] if isinstance(cross, (list, tuple)) else cross
    if config.get("addition_embed_type") == "text_time":
        return {2048: "sdxl", 1280: "sdxl-refiner"}.get(int(cross), "custom")
    if int(cross) == 768 and not config.get("use_linear_projection", False):
        return "sd1"
    if int(cross) == 1024:
        return "sd2"
    return "custom"


# -- config inference ----------------------------------------------------------------------------
def _fail(what: str) -> CheckpointError:
    return CheckpointError(f"not a Stable Diffusion UNet in the original layout: {what}")


def _count(prefixes: set[str], prefix: str) -> int:
    """How many consecutive indices ``prefix{i}.`` exist (0, 1, 2, ...) among the dotted prefixes of the names."""
    n = 0
    while f"{prefix}{n}." in prefixes:
        n += 1
    return n


@dataclass
class _Tensors:
    """The UNet's tensor shapes (names without the prefix) and the dotted prefixes of their names."""

    sd: dict[str, tuple[int, ...]]
    prefix: str

    def __post_init__(self) -> None:
        self.keys = set(self.sd)
        self.prefixes = {name[: i + 1] for name in self.keys for i, ch in enumerate(name) if ch == "."}

    def shape(self, name: str) -> tuple[int, ...]:
        try:
            return self.sd[name]
        except KeyError:
            raise _fail(f"tensor '{self.prefix}{name}' is missing") from None

    def count(self, prefix: str) -> int:
        return _count(self.prefixes, prefix)


@dataclass
class _Level:
    """One down level: per ResNet layer its width, transformer depth and attn1.to_k shape."""

    layers: list[tuple[int, int, Optional[tuple[int, ...]]]]

    @property
    def attention(self) -> bool:
        return self.layers[0][1] > 0


def _down_path(ts: _Tensors, context_dims: set[int], linear_proj: set[bool]) -> tuple[list[_Level], list[int]]:
    """The down levels (``[ResBlock, (transformer)]`` entries closed by a downsampler) and their widths."""
    levels = [_Level([])]
    for i in range(1, ts.count("input_blocks.")):
        if f"input_blocks.{i}.0.op.weight" in ts.keys:
            levels.append(_Level([]))
            continue
        width = ts.shape(f"input_blocks.{i}.0.out_layers.3.weight")[0]
        depth = ts.count(f"input_blocks.{i}.1.transformer_blocks.")
        to_k = None
        if depth:
            p = f"input_blocks.{i}.1."
            context_dims.add(ts.shape(p + "transformer_blocks.0.attn2.to_k.weight")[1])
            linear_proj.add(len(ts.shape(p + "proj_in.weight")) == 2)
            to_k = ts.shape(p + "transformer_blocks.0.attn1.to_k.weight")
        levels[-1].layers.append((width, depth, to_k))
    if any(not level.layers for level in levels):
        raise _fail(f"a level of '{ts.prefix}input_blocks' has no ResNet block")
    channels = []
    for li, level in enumerate(levels):
        widths = {w for w, _, _ in level.layers}
        if len(widths) != 1:
            raise _fail(f"level {li} of '{ts.prefix}input_blocks' mixes channel widths {sorted(widths)}")
        channels.append(widths.pop())
        if len({d > 0 for _, d, _ in level.layers}) != 1:
            raise _fail(f"level {li} of '{ts.prefix}input_blocks' has transformers after some ResNet blocks only")
    return levels, channels


def _up_depths(ts: _Tensors, levels: list[_Level]) -> list[list[int]]:
    """The transformer depth of every up layer, level by level from the bottom."""
    n, layers = len(levels), [len(level.layers) for level in levels]
    n_output = ts.count("output_blocks.")
    if n_output != sum(x + 1 for x in layers):
        raise _fail(f"{n_output} '{ts.prefix}output_blocks' for {sum(layers)} down layers in {n} levels (expected {sum(x + 1 for x in layers)})")
    up_depths: list[list[int]] = []
    k = 0
    for u in range(n):
        level = n - 1 - u
        row = []
        for _ in range(layers[level] + 1):
            row.append(ts.count(f"output_blocks.{k}.1.transformer_blocks."))
            k += 1
        if any(d > 0 for d in row) != levels[level].attention:
            raise _fail(f"'{ts.prefix}output_blocks' of level {level} disagree with 'input_blocks' about having transformers")
        up_depths.append(row)
    return up_depths


def _transformer_depths(levels: list[_Level], up_depths: list[list[int]], mid_depth: int) -> tuple[Any, Optional[list[list[int]]]]:
    """``transformer_layers_per_block`` (one number, one per level, or one per layer) and, where the
    up path cannot be derived from it, ``reverse_transformer_layers_per_block``."""
    n = len(levels)
    attention = [level.attention for level in levels]
    # levels without transformers: 1 (diffusers' default), but the last level's entry is the middle block's depth
    down_depths = [
        [d for _, d, _ in level.layers] if attention[li] else [mid_depth if li == n - 1 else 1] * len(level.layers) for li, level in enumerate(levels)
    ]
    uniform = all(len(set(d)) == 1 for d in down_depths) and all(
        row == [down_depths[n - 1 - u][0]] * len(row) for u, row in enumerate(up_depths) if attention[n - 1 - u]
    )
    if uniform and down_depths[-1][0] == mid_depth:
        depths: Any = [d[0] for d in down_depths]
        used = {d for d, a in zip(depths, attention) if a} | {mid_depth}
        if len(used) == 1:  # one depth wherever there are transformers (SD 1.x/2.x: 1, the SDXL refiner: 4)
            depths = used.pop()
        return depths, None
    if down_depths[-1][0] != mid_depth:
        raise _fail(f"the middle block's {mid_depth} transformer blocks differ from the last level's {down_depths[-1][0]} (diffusers cannot express that)")
    return down_depths, [row if attention[n - 1 - u] else [mid_depth] * len(row) for u, row in enumerate(up_depths)]


def _head_counts(family_guess: Optional[str], channels: list[int], attention: list[bool]) -> list[int]:
    """The standard head counts per level (SD 1.x: 8 everywhere; later families: 64-wide heads)."""
    n = len(channels)
    heads = [SD1_HEADS] * n if family_guess == "sd1" else [max(1, c // SD2_HEAD_WIDTH) for c in channels]
    for li, c in enumerate(channels):
        if (attention[li] or li == n - 1) and c % heads[li]:
            raise _fail(f"level {li} has {c} channels, not a multiple of the standard {heads[li]} heads")
    return heads


def infer_unet_config(shapes: Mapping[str, Sequence[int]], *, prefix: str = UNET_PREFIX) -> dict[str, Any]:
    """The diffusers ``UNet2DConditionModel`` config of the UNet whose tensors ``shapes`` lists
    (tensor name -> shape, names with ``prefix``; other names are ignored).

    Raises :class:`CheckpointError` (one line, naming the tensor) when the names do not follow the
    original layout. The result is a plain config.json dict (diffusers can read it too).
    """
    sd = {k[len(prefix) :]: tuple(int(d) for d in v) for k, v in shapes.items() if k.startswith(prefix)}
    if not sd:
        raise CheckpointError(f"no UNet tensors ('{prefix}*') in this checkpoint")
    ts = _Tensors(sd, prefix)
    conv_in = ts.shape("input_blocks.0.0.weight")
    if len(conv_in) != 4:
        raise _fail(f"'{prefix}input_blocks.0.0.weight' has shape {list(conv_in)}, not a conv weight")
    conv_out = ts.shape("out.2.weight")
    model_channels = conv_in[0]

    context_dims: set[int] = set()
    linear_proj: set[bool] = set()
    levels, channels = _down_path(ts, context_dims, linear_proj)
    layers = [len(level.layers) for level in levels]
    attention = [level.attention for level in levels]

    # middle block: ResBlock, transformer, ResBlock
    mid_depth = ts.count("middle_block.1.transformer_blocks.")
    if not mid_depth:
        raise _fail(f"'{prefix}middle_block.1' has no transformer blocks")
    context_dims.add(ts.shape("middle_block.1.transformer_blocks.0.attn2.to_k.weight")[1])
    linear_proj.add(len(ts.shape("middle_block.1.proj_in.weight")) == 2)

    up_depths = _up_depths(ts, levels)
    if len(context_dims) != 1 or len(linear_proj) != 1:
        raise _fail("its transformers differ in context width or projection kind")
    context_dim = context_dims.pop()
    linear = linear_proj.pop()
    depths, reverse = _transformer_depths(levels, up_depths, mid_depth)

    # only_cross_attention: attn1 reads the context (its keys are context-wide, not channel-wide)
    only_cross = []
    for li, level in enumerate(levels):
        to_k = level.layers[0][2]
        only_cross.append(bool(to_k is not None and to_k[1] != channels[li] and to_k[1] == context_dim))

    adm = sd.get("label_emb.0.0.weight")
    time_embed = ts.shape("time_embed.0.weight")
    if adm is not None:
        family_guess = {2048: "sdxl", 1280: "sdxl-refiner"}.get(context_dim)
    else:
        family_guess = "sd2" if (linear or context_dim == 1024) else "sd1"
    standard = STANDARD_UNET_CONFIGS.get(family_guess or "sdxl", STANDARD_UNET_CONFIGS["sdxl"])
    heads = _head_counts(family_guess, channels, attention)

    config: dict[str, Any] = {
        **_SD_COMMON,
        "in_channels": conv_in[1],
        "out_channels": conv_out[0],
        "conv_in_kernel": conv_in[-1],
        "conv_out_kernel": conv_out[-1],
        "block_out_channels": channels,
        "layers_per_block": layers[0] if len(set(layers)) == 1 else layers,
        "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attention],
        "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attention)],
        "cross_attention_dim": context_dim,
        "attention_head_dim": heads[0] if len(set(heads)) == 1 else heads,
        "transformer_layers_per_block": depths,
        "use_linear_projection": linear,
        "only_cross_attention": only_cross[0] if len(set(only_cross)) == 1 else only_cross,
        "upcast_attention": False,
        "sample_size": standard["sample_size"],
    }
    if reverse is not None:
        config["reverse_transformer_layers_per_block"] = reverse
    if time_embed[0] != 4 * model_channels:
        config["time_embedding_dim"] = time_embed[0]
    if adm is not None:
        config.update(
            addition_embed_type="text_time",
            addition_embed_type_num_heads=64,
            addition_time_embed_dim=SDXL_TIME_ID_WIDTH,
            projection_class_embeddings_input_dim=adm[1],
        )
    return config


def prediction_type_hint(config: Mapping[str, Any], keys: Iterable[str], read: Callable[[str], Any], *, prefix: str = UNET_PREFIX) -> Optional[str]:
    """``"v_prediction"`` when a single file's weights say so, else None (assume ``epsilon``).

    SD 2.x (768-v) models are recognised as ComfyUI does, by the spread of one LayerNorm bias
    (``output_blocks.11.1.transformer_blocks.0.norm1.bias``, std > 0.09; inpainting models excluded);
    v-prediction SDXL fine-tunes carry an empty ``v_pred`` marker tensor. ``read(name)`` returns a tensor.
    """
    keys = set(keys)
    family = unet_family(config)
    if family in ("sdxl", "sdxl-refiner") and "v_pred" in keys:
        return "v_prediction"
    name = prefix + "output_blocks.11.1.transformer_blocks.0.norm1.bias"
    if family == "sd2" and config.get("in_channels", 4) == 4 and name in keys:
        bias = read(name).float()
        if float(bias.std(unbiased=False)) > V_PREDICTION_NORM_STD:
            return "v_prediction"
    return None


# -- key map -------------------------------------------------------------------------------------
_RESNET_RENAMES = [
    (r"\.in_layers\.0\.", ".norm1."),
    (r"\.in_layers\.2\.", ".conv1."),
    (r"\.emb_layers\.1\.", ".time_emb_proj."),
    (r"\.out_layers\.0\.", ".norm2."),
    (r"\.out_layers\.3\.", ".conv2."),
    (r"\.skip_connection\.", ".conv_shortcut."),
]


def _block_renames(config: Mapping[str, Any]) -> list[Rule]:
    cfg = UNet2DConditionConfig.from_dict(config)
    n = cfg.num_levels
    rules: list[Rule] = []

    def move(old: str, new: str) -> None:
        rules.append(Rename("^" + re.escape(old + "."), new + "."))

    i = 1
    for level in range(n):
        for j in range(cfg.layers_per_block[level]):
            move(f"input_blocks.{i}.0", f"down_blocks.{level}.resnets.{j}")
            if cfg.has_attention(level):
                move(f"input_blocks.{i}.1", f"down_blocks.{level}.attentions.{j}")
            i += 1
        if level < n - 1:
            move(f"input_blocks.{i}.0.op", f"down_blocks.{level}.downsamplers.0.conv")
            i += 1
    move("middle_block.0", "mid_block.resnets.0")
    move("middle_block.1", "mid_block.attentions.0")
    move("middle_block.2", "mid_block.resnets.1")
    k = 0
    for u in range(n):
        level = n - 1 - u
        attention = cfg.up_block_types[u] == "CrossAttnUpBlock2D"
        count = cfg.layers_per_block[level] + 1
        for j in range(count):
            move(f"output_blocks.{k}.0", f"up_blocks.{u}.resnets.{j}")
            if attention:
                move(f"output_blocks.{k}.1", f"up_blocks.{u}.attentions.{j}")
            if j == count - 1 and u < n - 1:
                move(f"output_blocks.{k}.{2 if attention else 1}.conv", f"up_blocks.{u}.upsamplers.0.conv")
            k += 1
    return rules


def original_unet_keymap(config: Mapping[str, Any], *, prefix: str = UNET_PREFIX) -> KeyMap:
    """The key map from a single file's ``{prefix}*`` tensors (original layout) onto
    :class:`gencli.models.unet.unet_2d_condition.UNet2DConditionModel` built from ``config`` (a diffusers config dict).
    Every other tensor of the file (VAE, text encoders, EMA copies, schedules) is dropped."""
    linear = bool(config.get("use_linear_projection", False))
    if linear:  # stored as 1x1 convs by some conversions: same numbers
        proj = Apply(r"\.proj_(in|out)\.weight$", lambda t: t[:, :, 0, 0] if t.ndim == 4 else t, "1x1 conv as linear")
    else:
        proj = Apply(r"\.proj_(in|out)\.weight$", lambda t: t[:, :, None, None] if t.ndim == 2 else t, "linear as 1x1 conv")
    rules: list[Rule] = [
        Drop("^(?!" + re.escape(prefix) + ")"),
        Rename("^" + re.escape(prefix), ""),
        Rename(r"^time_embed\.0\.", "time_embedding.linear_1."),
        Rename(r"^time_embed\.2\.", "time_embedding.linear_2."),
        Rename(r"^label_emb\.0\.0\.", "add_embedding.linear_1."),
        Rename(r"^label_emb\.0\.2\.", "add_embedding.linear_2."),
        Rename(r"^input_blocks\.0\.0\.", "conv_in."),
        Rename(r"^out\.0\.", "conv_norm_out."),
        Rename(r"^out\.2\.", "conv_out."),
        *_block_renames(config),
        *(Rename(p, r) for p, r in _RESNET_RENAMES),
        proj,
    ]
    return KeyMap(rules, "original Stable Diffusion UNet (model.diffusion_model.*)")


__all__ = [
    "UNET_PREFIX",
    "STANDARD_UNET_CONFIGS",
    "standard_unet_config",
    "unet_family",
    "infer_unet_config",
    "prediction_type_hint",
    "original_unet_keymap",
]
