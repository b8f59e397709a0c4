"""Vision Transformer (Dosovitskiy et al. 2020) for image classification, in transformers'
``ViTForImageClassification`` layout; DeiT checkpoints (Touvron et al. 2021: a distillation token
next to the class token, optionally a second head on it) through the same modules.

The image is cut into non-overlapping patches by a strided convolution, a learned class token is
prepended (and a distillation token for DeiT), learned position embeddings are added (bicubically
interpolated when the input's patch grid differs from the trained one, as transformers'
``interpolate_pos_encoding`` does), pre-norm encoder blocks follow, then a final LayerNorm and a
linear classifier on the class token (for DeiT with a teacher head: the mean of the class-token and
distillation-token heads).

Module attribute names are transformers' (``vit.embeddings.patch_embeddings.projection``,
``vit.encoder.layer.N.attention.attention.query``, ``...intermediate.dense``, ``classifier``...), so a
downloaded checkpoint loads with an identity key map; :func:`keymap_for` covers DeiT's and
transformers' newer in-memory naming.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from gencli.backend.layers import LayerNorm, Linear, get_activation
from gencli.backend.positional import interpolate_position_table
from gencli.checkpoints.config import read_config
from gencli.checkpoints.keymap import Drop, KeyMap, Rename
from gencli.models.attention import multi_head_attention


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, (list, tuple)):
        if len(v) != 2:
            raise ValueError(f"expected an int or a pair, got {v!r}")
        return int(v[0]), int(v[1])
    return int(v), int(v)


@dataclass
class ViTConfig:
    """The fields of a transformers ViT/DeiT ``config.json`` this implementation uses."""

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    image_size: tuple[int, int] = (224, 224)
    patch_size: tuple[int, int] = (16, 16)
    num_channels: int = 3
    qkv_bias: bool = True
    id2label: dict[int, str] = field(default_factory=lambda: {0: "LABEL_0", 1: "LABEL_1"})
    model_type: str = "vit"
    distillation_token: bool = False  # DeiT: a second learned token after the class token
    distillation_head: bool = False  # DeiT with teacher: a classifier on the distillation token too
    problem_type: Optional[str] = None
    initializer_range: float = 0.02

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid(self) -> tuple[int, int]:
        """The patch grid (rows, columns) the position embeddings were trained for."""
        return self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1]

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, distillation_head: Optional[bool] = None) -> "ViTConfig":
        model_type = str(d.get("model_type", "vit"))
        if "id2label" in d and isinstance(d["id2label"], dict) and d["id2label"]:
            id2label = {int(k): str(v) for k, v in d["id2label"].items()}
        else:
            id2label = {i: f"LABEL_{i}" for i in range(int(d.get("num_labels", 2)))}
        if sorted(id2label) != list(range(len(id2label))):
            raise ValueError("id2label must number the labels 0..N-1")
        archs = d.get("architectures") or []
        if distillation_head is None:
            distillation_head = any("WithTeacher" in a for a in archs)
        cfg = read_config(
            cls, d, id2label=id2label, model_type=model_type, distillation_token=model_type == "deit", distillation_head=bool(distillation_head),
            image_size=_pair(d.get("image_size", 224)), patch_size=_pair(d.get("patch_size", 16)),
        )  # fmt: skip
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} is not a multiple of num_attention_heads {cfg.num_attention_heads}")
        get_activation(cfg.hidden_act)  # fail early on an unknown activation
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """A transformers-compatible ``config.json``."""
        arch = "ViTForImageClassification"
        if self.model_type == "deit":
            arch = "DeiTForImageClassificationWithTeacher" if self.distillation_head else "DeiTForImageClassification"
        square = lambda p: p[0] if p[0] == p[1] else list(p)  # noqa: E731
        out = {
            "architectures": [arch],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            "layer_norm_eps": self.layer_norm_eps,
            "image_size": square(self.image_size),
            "patch_size": square(self.patch_size),
            "num_channels": self.num_channels,
            "qkv_bias": self.qkv_bias,
            "initializer_range": self.initializer_range,
            "id2label": {str(k): v for k, v in sorted(self.id2label.items())},
            "label2id": {v: k for k, v in sorted(self.id2label.items())},
        }
        if self.problem_type:
            out["problem_type"] = self.problem_type
        return out


# -- modules (transformers' names) ---------------------------------------------------------------
class ViTPatchEmbeddings(nn.Module):
    """Non-overlapping patches -> tokens by a convolution with kernel = stride = patch size."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.patch_size = config.patch_size
        self.num_channels = config.num_channels
        self.projection = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.shape[1] != self.num_channels:
            raise ValueError(f"expected {self.num_channels} channels, got {pixel_values.shape[1]}")
        return self.projection(pixel_values).flatten(2).transpose(1, 2)


class ViTEmbeddings(nn.Module):
    """Class token (+ DeiT distillation token) + patch embeddings + learned positions."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        d = config.hidden_size
        self.grid = config.grid
        self.patch_size = config.patch_size
        self.num_prefix = 2 if config.distillation_token else 1
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        if config.distillation_token:
            self.distillation_token = nn.Parameter(torch.zeros(1, 1, d))
        self.patch_embeddings = ViTPatchEmbeddings(config)
        self.position_embeddings = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1] + self.num_prefix, d))
        self._interpolated: dict[tuple, torch.Tensor] = {}

    def interpolate_pos_encoding(self, height: int, width: int) -> torch.Tensor:
        """Position embeddings for an input of ``height x width`` pixels.

        As transformers: the trained table when the patch grid is unchanged, else the patch part
        resized bicubically (align_corners=False) to the new grid; the prefix tokens keep theirs.
        Resized tables are cached per grid (and recomputed if the weights change).
        """
        new_grid = (height // self.patch_size[0], width // self.patch_size[1])
        return interpolate_position_table(self.position_embeddings, self.grid, new_grid, num_prefix=self.num_prefix, cache=self._interpolated)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        b, _, height, width = pixel_values.shape
        tokens = self.patch_embeddings(pixel_values)
        prefix = [self.cls_token.expand(b, -1, -1)]
        if self.num_prefix == 2:
            prefix.append(self.distillation_token.expand(b, -1, -1))
        tokens = torch.cat((*prefix, tokens), dim=1)
        return tokens + self.interpolate_pos_encoding(height, width)


class ViTSelfAttention(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query = Linear(d, d, bias=config.qkv_bias)
        self.key = Linear(d, d, bias=config.qkv_bias)
        self.value = Linear(d, d, bias=config.qkv_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return multi_head_attention(hidden, self.query, self.key, self.value, self.num_heads)


class ViTSelfOutput(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dense(hidden)


class ViTAttention(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.attention = ViTSelfAttention(config)
        self.output = ViTSelfOutput(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.attention(hidden))


class ViTIntermediate(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)
        self.act = config.hidden_act  # applied by the linear layer (fused into the matmul where it can be)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dense(hidden, activation=self.act)


class ViTOutput(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.dense = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dense(hidden)


class ViTLayer(nn.Module):
    """Pre-norm encoder block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.layernorm_before = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = ViTAttention(config)
        self.layernorm_after = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = ViTIntermediate(config)
        self.output = ViTOutput(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attention(self.layernorm_before(hidden))
        return hidden + self.output(self.intermediate(self.layernorm_after(hidden)))


class ViTEncoder(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.layer = nn.ModuleList(ViTLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.layer:
            hidden = block(hidden)
        return hidden


class ViTModel(nn.Module):
    """Embeddings, encoder and the final LayerNorm: ``(B, C, H, W) -> (B, prefix + patches, D)``."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.embeddings = ViTEmbeddings(config)
        self.encoder = ViTEncoder(config)
        self.layernorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.embeddings.patch_embeddings.projection.weight.dtype
        return self.layernorm(self.encoder(self.embeddings(pixel_values.to(dtype))))


class ViTForImageClassification(nn.Module):
    """ViT / DeiT with a linear classifier on the class token: pixel values -> logits ``(B, labels)``."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        self.vit = ViTModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        if config.distillation_head:
            self.distillation_classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.vit(pixel_values)
        logits = self.classifier(hidden[:, 0])
        if self.config.distillation_head:
            logits = (logits + self.distillation_classifier(hidden[:, 1])) / 2
        return logits

    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """Initialisation for training from scratch (truncated normal, as transformers' ViT)."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(m.weight, std=std, a=-2 * std, b=2 * std, generator=generator)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        emb = self.vit.embeddings
        nn.init.trunc_normal_(emb.position_embeddings, std=std, a=-2 * std, b=2 * std, generator=generator)
        nn.init.trunc_normal_(emb.cls_token, std=std, a=-2 * std, b=2 * std, generator=generator)
        if emb.num_prefix == 2:
            nn.init.trunc_normal_(emb.distillation_token, std=std, a=-2 * std, b=2 * std, generator=generator)


# -- checkpoint formats --------------------------------------------------------------------------
# transformers' ViT/DeiT files (and gencli's own): identity apart from the DeiT prefix and head name
HF_KEYMAP = KeyMap(
    [
        Rename(r"^deit\.", "vit."),
        Rename(r"^cls_classifier\.", "classifier."),
        Drop(r"^vit\.pooler\."),  # ViTModel's pooler is not used by the classification head
        Drop(r"^vit\.embeddings\.mask_token$"),
    ],
    "transformers-vit",
)

# transformers 5's in-memory module names (vit.layers.N.attention.q_proj ...), should a file carry them
_LAYER = r"^vit\.layers\.(\d+)\."
HF_V5_KEYMAP = HF_KEYMAP + KeyMap(
    [
        Rename(_LAYER + r"attention\.q_proj\.", r"vit.encoder.layer.\1.attention.attention.query."),
        Rename(_LAYER + r"attention\.k_proj\.", r"vit.encoder.layer.\1.attention.attention.key."),
        Rename(_LAYER + r"attention\.v_proj\.", r"vit.encoder.layer.\1.attention.attention.value."),
        Rename(_LAYER + r"attention\.o_proj\.", r"vit.encoder.layer.\1.attention.output.dense."),
        Rename(_LAYER + r"mlp\.fc1\.", r"vit.encoder.layer.\1.intermediate.dense."),
        Rename(_LAYER + r"mlp\.fc2\.", r"vit.encoder.layer.\1.output.dense."),
        Rename(_LAYER + r"(layernorm_before|layernorm_after)\.", r"vit.encoder.layer.\1.\2."),
    ],
    "transformers-vit-v5",
)


def keymap_for(keys: set[str]) -> KeyMap:
    """The key map for a checkpoint with these tensor names."""
    if any(k.startswith(("vit.layers.", "deit.layers.")) for k in keys):
        return KeyMap([Rename(r"^deit\.", "vit.")]) + HF_V5_KEYMAP
    return HF_KEYMAP


__all__ = ["ViTConfig", "ViTForImageClassification", "ViTModel", "HF_KEYMAP", "keymap_for"]
