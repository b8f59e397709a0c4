"""SegFormer (Xie et al. 2021) for semantic segmentation, in transformers'
``SegformerForSemanticSegmentation`` layout.

The hierarchical encoder (Mix Transformer) has ``num_encoder_blocks`` stages. Each stage embeds its
input with an *overlapping* patch embedding (a strided convolution with kernel > stride and padding
``kernel // 2``, then a LayerNorm), runs ``depths[i]`` pre-norm blocks and a final LayerNorm, and
hands a ``(B, C_i, H_i, W_i)`` feature map to the next stage. A block is efficient self-attention
(queries on every token; keys and values on a map shrunk by ``sr_ratios[i]`` with a strided
convolution + LayerNorm) followed by a Mix-FFN (linear, depthwise 3x3 convolution, activation,
linear): the depthwise convolution gives the positional information, so there are no position
embeddings and any input size works. The all-MLP decode head projects every stage to
``decoder_hidden_size`` channels (``linear_c.N``), upsamples them bilinearly to the first stage's
map (1/4 of the input), concatenates them (last stage first), fuses them with a 1x1 convolution
(``linear_fuse``), a BatchNorm (``batch_norm``, running statistics: inference only) and a ReLU, and
classifies every position with a 1x1 convolution (``classifier``). The logits come out at 1/4 of the
input's size; callers resize them to the image.

The head is computed in an equivalent, cheaper order: the projections, the slice of ``linear_fuse``
that reads each stage and the BatchNorm are linear maps, and bilinear resizing commutes with them
(its weights sum to one, so constants pass through), so each stage is mapped straight to
``decoder_hidden_size`` fused channels at its own resolution, then resized and summed. That upsamples
``decoder_hidden_size`` channels per stage instead of building a ``4 x decoder_hidden_size``
concatenation; the result equals the literal order up to rounding.

A stage's token sequence ``(B, H*W, C)`` is, in memory, its ``(B, C, H, W)`` map in channels-last
layout: the convolutions (the Mix-FFN's depthwise one, the spatial reduction, the next stage's patch
embedding) read that view and return the same layout, so tokens and maps pass between them without a
copy; the stage outputs and the logits are channels-last tensors. At CPU inference the GELU runs
inside the packed depthwise convolution and each residual inside the matmul of the block's last
projection (:class:`gencli.backend.layers.Conv2d`, :func:`gencli.backend.layers.linear`).

Module attribute names are those of the files on the model hubs (``segformer.encoder.block.I.J.
attention.self.query``, ``...mlp.dwconv.dwconv``, ``decode_head.linear_c.N.proj`` ...), so a
downloaded checkpoint loads with an identity key map; :data:`HF_V5_KEYMAP` covers transformers 5's
in-memory names (``segformer.stages.I.blocks.J.attention.q_proj`` ...) should a file carry them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.layers import Conv2d, LayerNorm, Linear, get_activation, linear, prepack_convolutions
from gencli.checkpoints.config import read_config
from gencli.checkpoints.keymap import Drop, KeyMap, Rename
from gencli.models.attention import multi_head_attention


# -- layout: a token sequence (B, H*W, C) is a (B, C, H, W) map in channels-last memory --------------
def map_of(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(B, H*W, C)`` tokens as the ``(B, C, H, W)`` map they are: a channels-last view, no copy
    (oneDNN's CPU convolutions work in that layout and give their output in it)."""
    b, _, c = tokens.shape
    return tokens.reshape(b, height, width, c).permute(0, 3, 1, 2)


def tokens_of(x: torch.Tensor) -> torch.Tensor:
    """A ``(B, C, H, W)`` map as ``(B, H*W, C)`` tokens: a view of a channels-last map, a copy otherwise."""
    b, c, h, w = x.shape
    return x.permute(0, 2, 3, 1).reshape(b, h * w, c)


@dataclass
class SegformerConfig:
    """The fields of a transformers SegFormer ``config.json`` this implementation uses."""

    num_channels: int = 3
    num_encoder_blocks: int = 4
    depths: tuple[int, ...] = (2, 2, 2, 2)
    sr_ratios: tuple[int, ...] = (8, 4, 2, 1)
    hidden_sizes: tuple[int, ...] = (32, 64, 160, 256)
    patch_sizes: tuple[int, ...] = (7, 3, 3, 3)
    strides: tuple[int, ...] = (4, 2, 2, 2)
    num_attention_heads: tuple[int, ...] = (1, 2, 5, 8)
    mlp_ratios: tuple[int, ...] = (4, 4, 4, 4)
    hidden_act: str = "gelu"
    decoder_hidden_size: int = 256
    reshape_last_stage: bool = True
    layer_norm_eps: float = 1e-6  # the config's field; the modules use LayerNorm's default 1e-5, as transformers
    id2label: dict[int, str] = field(default_factory=lambda: {0: "LABEL_0", 1: "LABEL_1"})
    model_type: str = "segformer"

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SegformerConfig":
        if "id2label" in d and isinstance(d["id2label"], dict) and d["id2label"]:
            id2label = {int(k): str(v) for k, v in d["id2label"].items()}
        else:
            id2label = {i: f"LABEL_{i}" for i in range(int(d.get("num_labels", 2)))}
        if sorted(id2label) != list(range(len(id2label))):
            raise ValueError("id2label must number the labels 0..N-1")
        cfg = read_config(cls, d, id2label=id2label, what="a SegFormer model")
        n = cfg.num_encoder_blocks
        for name in ("depths", "sr_ratios", "hidden_sizes", "patch_sizes", "strides", "num_attention_heads", "mlp_ratios"):
            if len(getattr(cfg, name)) != n:
                raise ValueError(f"'{name}' has {len(getattr(cfg, name))} entries for {n} encoder blocks")
        for size, heads in zip(cfg.hidden_sizes, cfg.num_attention_heads):
            if size % heads:
                raise ValueError(f"hidden size {size} is not a multiple of its {heads} attention heads")
        get_activation(cfg.hidden_act)  # fail early on an unknown activation
        return cfg


# -- encoder (the hub files' module names) -------------------------------------------------------
class SegformerOverlapPatchEmbeddings(nn.Module):
    """A strided convolution with kernel > stride (the patches overlap), then a LayerNorm."""

    def __init__(self, patch_size: int, stride: int, num_channels: int, hidden_size: int):
        super().__init__()
        self.proj = Conv2d(num_channels, hidden_size, kernel_size=patch_size, stride=stride, padding=patch_size // 2)
        self.layer_norm = LayerNorm(hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        x = self.proj(pixel_values)
        _, _, h, w = x.shape
        return self.layer_norm(tokens_of(x)), h, w


class SegformerEfficientSelfAttention(nn.Module):
    """Self-attention whose keys and values come from the map shrunk ``sr_ratio`` times per side."""

    def __init__(self, hidden_size: int, num_heads: int, sr_ratio: int):
        super().__init__()
        self.num_heads = num_heads
        self.query = Linear(hidden_size, hidden_size)
        self.key = Linear(hidden_size, hidden_size)
        self.value = Linear(hidden_size, hidden_size)
        self.sr_ratio = sr_ratio
        if sr_ratio > 1:
            self.sr = Conv2d(hidden_size, hidden_size, kernel_size=sr_ratio, stride=sr_ratio)
            self.layer_norm = LayerNorm(hidden_size)

    def forward(self, hidden: torch.Tensor, height: int, width: int) -> torch.Tensor:
        context = hidden
        if self.sr_ratio > 1:
            context = self.layer_norm(tokens_of(self.sr(map_of(hidden, height, width))))
        return multi_head_attention(hidden, self.query, self.key, self.value, self.num_heads, context=context)


class SegformerSelfOutput(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size)

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.dense(hidden, residual=residual)


class SegformerAttention(nn.Module):
    """The efficient self-attention and its output projection (``residual``: added to the output,
    inside the projection's matmul where the backend can)."""

    def __init__(self, hidden_size: int, num_heads: int, sr_ratio: int):
        super().__init__()
        self.self = SegformerEfficientSelfAttention(hidden_size, num_heads, sr_ratio)
        self.output = SegformerSelfOutput(hidden_size)

    def forward(self, hidden: torch.Tensor, height: int, width: int, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.output(self.self(hidden, height, width), residual)


class SegformerDWConv(nn.Module):
    """The depthwise 3x3 convolution of the Mix-FFN, on the token sequence seen as its map (then
    ``activation``, inside the convolution where the backend can)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = Conv2d(dim, dim, 3, 1, 1, bias=True, groups=dim)

    def forward(self, hidden: torch.Tensor, height: int, width: int, activation: Optional[str] = None) -> torch.Tensor:
        return tokens_of(self.dwconv(map_of(hidden, height, width), activation=activation))


class SegformerMixFFN(nn.Module):
    """Mix-FFN: dense1 -> depthwise 3x3 convolution -> activation -> dense2 (+ ``residual``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        get_activation(act)  # an unknown name fails here
        self.dense1 = Linear(hidden_size, intermediate_size)
        self.dwconv = SegformerDWConv(intermediate_size)
        self.act = act
        self.dense2 = Linear(intermediate_size, hidden_size)

    def forward(self, hidden: torch.Tensor, height: int, width: int, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.dense2(self.dwconv(self.dense1(hidden), height, width, activation=self.act), residual=residual)


class SegformerLayer(nn.Module):
    """Pre-norm block: x + Attn(LN(x)), then x + MixFFN(LN(x)); each residual is added by the
    block's last projection."""

    def __init__(self, hidden_size: int, num_heads: int, sr_ratio: int, mlp_ratio: int, act: str):
        super().__init__()
        self.layer_norm_1 = LayerNorm(hidden_size)
        self.attention = SegformerAttention(hidden_size, num_heads, sr_ratio)
        self.layer_norm_2 = LayerNorm(hidden_size)
        self.mlp = SegformerMixFFN(hidden_size, int(hidden_size * mlp_ratio), act)

    def forward(self, hidden: torch.Tensor, height: int, width: int) -> torch.Tensor:
        hidden = self.attention(self.layer_norm_1(hidden), height, width, residual=hidden)
        return self.mlp(self.layer_norm_2(hidden), height, width, residual=hidden)


class SegformerEncoder(nn.Module):
    """The stages: patch embeddings, blocks and a LayerNorm each; returns every stage's map."""

    def __init__(self, config: SegformerConfig):
        super().__init__()
        c = config
        self.patch_embeddings = nn.ModuleList(
            SegformerOverlapPatchEmbeddings(c.patch_sizes[i], c.strides[i], c.num_channels if i == 0 else c.hidden_sizes[i - 1], c.hidden_sizes[i])
            for i in range(c.num_encoder_blocks)
        )
        self.block = nn.ModuleList(
            nn.ModuleList(
                SegformerLayer(c.hidden_sizes[i], c.num_attention_heads[i], c.sr_ratios[i], c.mlp_ratios[i], c.hidden_act) for _ in range(c.depths[i])
            )
            for i in range(c.num_encoder_blocks)
        )
        self.layer_norm = nn.ModuleList(LayerNorm(c.hidden_sizes[i]) for i in range(c.num_encoder_blocks))

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Every stage's map ``(B, C_i, H_i, W_i)``, in channels-last memory (its token sequence)."""
        maps = []
        x = pixel_values.contiguous(memory_format=torch.channels_last)
        for embed, blocks, norm in zip(self.patch_embeddings, self.block, self.layer_norm):
            hidden, h, w = embed(x)
            for blk in blocks:
                hidden = blk(hidden, h, w)
            x = map_of(norm(hidden), h, w)
            maps.append(x)
        return maps


class SegformerModel(nn.Module):
    def __init__(self, config: SegformerConfig):
        super().__init__()
        self.encoder = SegformerEncoder(config)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        return self.encoder(pixel_values)


# -- decode head -----------------------------------------------------------------------------------
class SegformerMLP(nn.Module):
    """``linear_c.N``: one stage's channels -> ``decoder_hidden_size``."""

    def __init__(self, input_dim: int, output_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, output_dim)


class BatchNorm2d(nn.Module):
    """A BatchNorm with its running statistics (inference: ``(x - mean) / sqrt(var + eps) * w + b``);
    torch's key names (``weight``, ``bias``, ``running_mean``, ``running_var``)."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-channel affine map it applies, in float32: ``x * scale + shift``."""
        scale = self.weight.float() * torch.rsqrt(self.running_var.float() + self.eps)
        return scale, self.bias.float() - self.running_mean.float() * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, shift = self.scale_shift()
        return x * scale.to(x.dtype)[:, None, None] + shift.to(x.dtype)[:, None, None]


class SegformerDecodeHead(nn.Module):
    """The all-MLP head: per-stage projections, upsampling to stage 1, fusion, BatchNorm, ReLU, classifier."""

    def __init__(self, config: SegformerConfig):
        super().__init__()
        d = config.decoder_hidden_size
        self.linear_c = nn.ModuleList(SegformerMLP(h, d) for h in config.hidden_sizes)
        self.linear_fuse = nn.Conv2d(d * config.num_encoder_blocks, d, kernel_size=1, bias=False)
        self.batch_norm = BatchNorm2d(d)
        self.classifier = nn.Conv2d(d, config.num_labels, kernel_size=1)

    def _head_tensors(self) -> list[torch.Tensor]:
        return [t for mlp in self.linear_c for t in (mlp.proj.weight, mlp.proj.bias)] + [
            self.linear_fuse.weight, self.batch_norm.weight, self.batch_norm.bias, self.batch_norm.running_mean, self.batch_norm.running_var,
        ]  # fmt: skip

    def composed_projections(self, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`fused_projections` in ``dtype``, composed once and kept for inference while the
        weights stay the same tensors, unchanged (their version counters), in the same dtype."""
        tensors = self._head_tensors()
        if torch.is_grad_enabled() or any(t.is_inference() for t in tensors):  # (inference tensors keep no version counter)
            return [(w.to(dtype), b.to(dtype)) for w, b in self.fused_projections()]
        key = (dtype, *((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors))
        cached = getattr(self, "_composed", None)
        if cached is None or cached[0] != key:
            cached = (key, [(w.to(dtype), b.to(dtype)) for w, b in self.fused_projections()])
            self._composed = cached
        return cached[1]

    def fused_projections(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per stage, ``(weight (D, C_i), bias (D,))`` of projection -> its slice of linear_fuse ->
        BatchNorm, composed (float32)."""
        d = self.linear_fuse.out_channels
        n = len(self.linear_c)
        fuse = self.linear_fuse.weight.float().reshape(d, n * d)
        scale, shift = self.batch_norm.scale_shift()
        out = []
        for i, mlp in enumerate(self.linear_c):
            j = n - 1 - i  # the concatenation runs from the last stage to the first
            part = fuse[:, j * d : (j + 1) * d] * scale[:, None]
            w = part @ mlp.proj.weight.float()
            b = part @ mlp.proj.bias.float()
            out.append((w, b))
        out[0] = (out[0][0], out[0][1] + shift)
        return out

    def forward(self, maps: list[torch.Tensor]) -> torch.Tensor:
        """Logits ``(B, labels, H_1, W_1)`` (channels-last memory) from the stages' maps. Every step
        runs on the maps' token layout (channels last): the projections are matrix products over
        the channels, and bilinear resizing in that layout is vectorised over them."""
        size = maps[0].shape[2:]
        dtype = maps[0].dtype
        grad = torch.is_grad_enabled()
        fused: Optional[torch.Tensor] = None
        for (w, b), x in zip(self.composed_projections(dtype), maps):
            y = map_of(linear(tokens_of(x), w, b), *x.shape[2:])
            if y.shape[2:] != size:
                y = F.interpolate(y, size=size, mode="bilinear", align_corners=False)
            fused = y if fused is None else (fused + y if grad else fused.add_(y))
        assert fused is not None
        fused = F.relu(fused) if grad else fused.relu_()
        weight = self.classifier.weight
        logits = linear(tokens_of(fused), weight.reshape(weight.shape[0], -1), self.classifier.bias)
        return map_of(logits, *size)


class SegformerForSemanticSegmentation(nn.Module):
    """SegFormer encoder + all-MLP decode head: pixel values ``(B, C, H, W)`` -> logits ``(B, labels, H/4, W/4)``
    (strides as configured; ceil-divided per stage for sizes that do not divide)."""

    def __init__(self, config: SegformerConfig):
        super().__init__()
        self.config = config
        self.segformer = SegformerModel(config)
        self.decode_head = SegformerDecodeHead(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.decode_head.classifier.weight.dtype
        return self.decode_head(self.segformer(pixel_values.to(dtype)))

    def prepack_convolutions(self, enabled: bool = True) -> "SegformerForSemanticSegmentation":
        """Keep the encoder's convolution weights in oneDNN's layout after the first CPU inference
        call (:class:`gencli.backend.layers.Conv2d`; the Mix-FFN's activation then runs inside its
        depthwise convolution): inference only, reversed by ``enabled=False``."""
        prepack_convolutions(self, enabled)
        return self


# -- checkpoint formats --------------------------------------------------------------------------
HF_KEYMAP = KeyMap([Drop(r"\.num_batches_tracked$")], "transformers-segformer")

# transformers 5's in-memory module names, should a file carry them
HF_V5_KEYMAP = KeyMap(
    [
        Drop(r"\.num_batches_tracked$"),
        Rename(r"^segformer\.stages\.(\d+)\.patch_embeddings\.", r"segformer.encoder.patch_embeddings.\1."),
        Rename(r"^segformer\.stages\.(\d+)\.layer_norm\.", r"segformer.encoder.layer_norm.\1."),
        Rename(r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.attention\.q_proj\.", r"segformer.encoder.block.\1.\2.attention.self.query."),
        Rename(r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.attention\.k_proj\.", r"segformer.encoder.block.\1.\2.attention.self.key."),
        Rename(r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.attention\.v_proj\.", r"segformer.encoder.block.\1.\2.attention.self.value."),
        Rename(r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.attention\.o_proj\.", r"segformer.encoder.block.\1.\2.attention.output.dense."),
        Rename(
            r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.attention\.sequence_reduction\.sequence_reduction\.",
            r"segformer.encoder.block.\1.\2.attention.self.sr.",
        ),
        Rename(
            r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.attention\.sequence_reduction\.layer_norm\.",
            r"segformer.encoder.block.\1.\2.attention.self.layer_norm.",
        ),
        Rename(r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.mlp\.fc1\.", r"segformer.encoder.block.\1.\2.mlp.dense1."),
        Rename(r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.mlp\.fc2\.", r"segformer.encoder.block.\1.\2.mlp.dense2."),
        Rename(r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.mlp\.dwconv\.", r"segformer.encoder.block.\1.\2.mlp.dwconv."),
        Rename(r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.layernorm_before\.", r"segformer.encoder.block.\1.\2.layer_norm_1."),
        Rename(r"^segformer\.stages\.(\d+)\.blocks\.(\d+)\.layernorm_after\.", r"segformer.encoder.block.\1.\2.layer_norm_2."),
        Rename(r"^decode_head\.linear_projections\.", "decode_head.linear_c."),
    ],
    "transformers-segformer-v5",
)


def keymap_for(keys: set[str]) -> KeyMap:
    """The key map for a checkpoint with these tensor names."""
    if any(k.startswith("segformer.stages.") for k in keys):
        return HF_V5_KEYMAP
    return HF_KEYMAP


__all__ = ["SegformerConfig", "SegformerForSemanticSegmentation", "HF_KEYMAP", "HF_V5_KEYMAP", "keymap_for"]
