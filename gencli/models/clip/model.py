"""CLIP (Radford et al. 2021) in transformers' ``CLIPModel`` layout.

Two towers and two projections:

- the **vision tower** (:class:`CLIPVisionTransformer`): a ViT with a class token, learned position
  embeddings, a LayerNorm *before* the encoder (``pre_layrnorm``, spelled as in the checkpoints) and
  the class token's final state, normalised by ``post_layernorm``, as the pooled output;
- the **text tower** (:class:`CLIPTextTransformer`): a causal transformer over BPE tokens with learned
  positions and ``final_layer_norm``; the pooled output is the final state at the end-of-text token.
  This tower is also the conditioning encoder of Stable Diffusion (its per-token hidden states of the
  last or penultimate layer), so it is usable on its own: :meth:`CLIPTextTransformer.forward` returns
  every layer's hidden states on request;
- ``visual_projection`` / ``text_projection`` (no bias) into the shared embedding space, and a learned
  temperature ``logit_scale`` (stored as its logarithm).

Attribute names mirror transformers', so a ``CLIPModel`` checkpoint maps onto these modules by
identity (see :mod:`gencli.pipelines.clip.loading` for loading). Attention goes through the backend's one
entry point (via :func:`gencli.models.attention.multi_head_attention`, shared with ViT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.layers import FeedForward, LayerNorm, Linear
from gencli.backend.positional import interpolate_position_table
from gencli.checkpoints.config import read_config
from gencli.models.attention import multi_head_attention

# The token id transformers treats as "legacy": configs written before CLIP's eos_token_id was fixed
# carry eos_token_id = 2, and for them the pooled token is the one with the highest id (the end-of-text
# token has the highest id in OpenAI's vocabulary).
LEGACY_EOS_TOKEN_ID = 2


@dataclass
class CLIPTextConfig:
    """The fields of transformers' ``CLIPTextConfig`` that shape the model (defaults are ViT-B/32's)."""

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    bos_token_id: int = 49406
    eos_token_id: Any = 49407  # int, or a list of ids any of which ends the text
    pad_token_id: int = 1

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "CLIPTextConfig":
        return read_config(cls, cfg, where="config.json (text_config)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# The text encoders of Stable Diffusion, configured as diffusers' reference folders configure them. A
# single-file checkpoint carries no config: its tensor shapes give the widths, depth, vocabulary and
# context; these give what shapes cannot tell (activation, norm epsilon, special-token ids).
SD_TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    # OpenAI CLIP ViT-L/14's text tower: SD 1.x's text_encoder and SDXL's first (CLIPTextModel)
    "clip-vit-large-patch14": dict(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=2, pad_token_id=1,
    ),
    # OpenCLIP ViT-H/14's text tower less its last layer (SD 2.x conditions on the penultimate one)
    "open-clip-vit-h-14-penultimate": dict(
        vocab_size=49408, hidden_size=1024, intermediate_size=4096, projection_dim=512, num_hidden_layers=23,
        num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=2, pad_token_id=1,
    ),
    # OpenCLIP ViT-bigG/14's text tower and projection: SDXL's text_encoder_2 (CLIPTextModelWithProjection)
    "open-clip-vit-bigg-14": dict(
        vocab_size=49408, hidden_size=1280, intermediate_size=5120, projection_dim=1280, num_hidden_layers=32,
        num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=2, pad_token_id=1,
    ),
}  # fmt: skip


def sd_text_encoder_config(name: str, **overrides: Any) -> CLIPTextConfig:
    """One of :data:`SD_TEXT_ENCODER_CONFIGS`, with fields replaced by ``overrides`` (those read from shapes)."""
    return CLIPTextConfig.from_dict({**SD_TEXT_ENCODER_CONFIGS[name], **overrides})


@dataclass
class CLIPVisionConfig:
    """The fields of transformers' ``CLIPVisionConfig`` that shape the model (defaults are ViT-B/32's)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "CLIPVisionConfig":
        square = {}
        for name in ("image_size", "patch_size"):
            v = cfg.get(name)
            if isinstance(v, (list, tuple)):
                if len(set(v)) != 1:
                    raise ValueError(f"non-square {name} {list(v)} is not supported by CLIP")
                square[name] = v[0]
        return read_config(cls, {**cfg, **square}, where="config.json (vision_config)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass
class CLIPConfig:
    """transformers' ``CLIPConfig``: the two towers, the shared projection width and the initial temperature."""

    text_config: CLIPTextConfig = field(default_factory=CLIPTextConfig)
    vision_config: CLIPVisionConfig = field(default_factory=CLIPVisionConfig)
    projection_dim: int = 512
    logit_scale_init_value: float = 2.6592

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "CLIPConfig":
        # Old configs also carry text_config_dict / vision_config_dict, which take precedence (as in transformers).
        text = {**(cfg.get("text_config") or {}), **(cfg.get("text_config_dict") or {})}
        vision = {**(cfg.get("vision_config") or {}), **(cfg.get("vision_config_dict") or {})}
        return read_config(cls, cfg, text_config=CLIPTextConfig.from_dict(text), vision_config=CLIPVisionConfig.from_dict(vision))

    def to_dict(self) -> dict[str, Any]:
        """A transformers-compatible ``config.json`` body for ``CLIPModel``."""
        from dataclasses import asdict

        text = asdict(self.text_config)
        text.update(model_type="clip_text_model", projection_dim=self.projection_dim)
        vision = asdict(self.vision_config)
        vision.update(model_type="clip_vision_model", projection_dim=self.projection_dim)
        return {
            "architectures": ["CLIPModel"],
            "model_type": "clip",
            "projection_dim": self.projection_dim,
            "logit_scale_init_value": self.logit_scale_init_value,
            "initializer_factor": 1.0,
            "text_config": text,
            "vision_config": vision,
        }


@dataclass
class CLIPTowerOutput:
    """What a tower returns: per-token states, the pooled vector, and (on request) every layer's states.

    ``hidden_states`` follows transformers' convention: the embeddings (encoder input) first, then the
    output of each layer, so ``hidden_states[-1]`` is the last layer's output *before* the final norm
    and ``hidden_states[-2]`` the penultimate layer's.
    """

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor
    hidden_states: Optional[tuple[torch.Tensor, ...]] = None


class CLIPAttention(nn.Module):
    """Multi-head self attention with separate q/k/v projections (transformers' key names)."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}")
        self.embed_dim = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        self.dropout = dropout
        self.k_proj = Linear(hidden_size, hidden_size)
        self.v_proj = Linear(hidden_size, hidden_size)
        self.q_proj = Linear(hidden_size, hidden_size)
        self.out_proj = Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, *, causal: bool = False, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = multi_head_attention(
            x, self.q_proj, self.k_proj, self.v_proj, self.num_heads,
            causal=causal, key_padding_mask=key_padding_mask, scale=self.scale, dropout_p=self.dropout if self.training else 0.0,
        )  # fmt: skip
        return self.out_proj(out)


class CLIPEncoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, act: str, eps: float, dropout: float = 0.0):
        super().__init__()
        self.self_attn = CLIPAttention(hidden_size, num_heads, dropout)
        self.layer_norm1 = LayerNorm(hidden_size, eps=eps)
        self.mlp = FeedForward(hidden_size, intermediate_size, act=act)
        self.layer_norm2 = LayerNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, *, causal: bool = False, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), causal=causal, key_padding_mask=key_padding_mask)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: CLIPTextConfig | CLIPVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            CLIPEncoderLayer(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.hidden_act, cfg.layer_norm_eps, cfg.attention_dropout)
            for _ in range(cfg.num_hidden_layers)
        )
        self.gradient_checkpointing = False

    def forward(
        self,
        x: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Optional[torch.Tensor] = None,
        output_hidden_states: bool = False,
        num_layers: Optional[int] = None,
    ) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, ...]]]:
        """Run the first ``num_layers`` layers (all by default); optionally collect every layer's output."""
        states = [x] if output_hidden_states else None
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer in layers:
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, causal=causal, key_padding_mask=key_padding_mask)
            else:
                x = layer(x, causal=causal, key_padding_mask=key_padding_mask)
            if states is not None:
                states.append(x)
        return x, (tuple(states) if states is not None else None)


# -- text tower ------------------------------------------------------------------------------
class CLIPTextEmbeddings(nn.Module):
    def __init__(self, cfg: CLIPTextConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = input_ids.shape[-1]
        max_len = self.position_embedding.weight.shape[0]
        if n > max_len:
            raise ValueError(f"{n} tokens are more than the text model's {max_len} positions")
        if position_ids is None:
            pos = self.position_embedding.weight[:n].unsqueeze(0)
        else:
            pos = self.position_embedding(position_ids)
        return self.token_embedding(input_ids) + pos


class CLIPTextTransformer(nn.Module):
    """CLIP's text tower (transformers' ``CLIPTextModel``, whose weights live under ``text_model.``)."""

    def __init__(self, cfg: CLIPTextConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = CLIPTextEmbeddings(cfg)
        self.encoder = CLIPEncoder(cfg)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.final_layer_norm.weight.dtype

    def eos_positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Where each sequence's pooled (end-of-text) token is, by transformers' rule: the first
        occurrence of ``eos_token_id``; for legacy configs (``eos_token_id == 2``) the highest id."""
        eos = self.config.eos_token_id
        if eos == LEGACY_EOS_TOKEN_ID:
            return input_ids.to(torch.int).argmax(dim=-1)
        ids = torch.as_tensor(eos if isinstance(eos, (list, tuple)) else [eos], device=input_ids.device)
        hits = torch.isin(input_ids, ids)
        return hits.to(torch.int).argmax(dim=-1)  # first True (0 when absent, as in transformers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        *,
        output_hidden_states: bool = False,
        num_layers: Optional[int] = None,
    ) -> CLIPTowerOutput:
        """Encode token ids ``(B, L)``.

        ``attention_mask (B, L)`` (1 = real token) masks padding keys on top of the causal rule.
        ``last_hidden_state`` has ``final_layer_norm`` applied (as in transformers); the pooled output is
        its state at the end-of-text token. ``output_hidden_states`` returns every layer's raw output
        (Stable Diffusion's "clip skip" / SDXL take ``hidden_states[-2]``). ``num_layers`` stops after
        that many layers (then the pooled output is of the truncated stack).
        """
        if input_ids.ndim == 1:
            input_ids = input_ids.unsqueeze(0)
        x = self.embeddings(input_ids, position_ids)
        kpm = None
        if attention_mask is not None and not bool(attention_mask.all()):
            kpm = attention_mask.to(device=x.device, dtype=torch.bool)
        x, states = self.encoder(x, causal=True, key_padding_mask=kpm, output_hidden_states=output_hidden_states, num_layers=num_layers)
        last = self.final_layer_norm(x)
        pooled = last[torch.arange(last.shape[0], device=last.device), self.eos_positions(input_ids).to(last.device)]
        return CLIPTowerOutput(last, pooled, states)


# -- vision tower ----------------------------------------------------------------------------
class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.embed_dim = cfg.hidden_size
        self.image_size = cfg.image_size
        self.patch_size = cfg.patch_size
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.num_patches = cfg.num_patches
        self.position_embedding = nn.Embedding(self.num_patches + 1, cfg.hidden_size)
        self._interpolated: dict[tuple, torch.Tensor] = {}  # resized tables, see interpolate_position_table

    def interpolated_positions(self, height: int, width: int) -> torch.Tensor:
        """Position embeddings for a ``height x width`` input: the patch grid's table resized bicubically
        (as transformers' ``interpolate_pos_encoding``), the class position kept."""
        grid = int(math.sqrt(self.num_patches))
        new_grid = (height // self.patch_size, width // self.patch_size)
        table = self.position_embedding.weight.unsqueeze(0)
        return interpolate_position_table(table, (grid, grid), new_grid, num_prefix=1, cache=self._interpolated)

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        b, _, h, w = pixel_values.shape
        if not interpolate_pos_encoding and (h != self.image_size or w != self.image_size):
            raise ValueError(f"input image size ({h}x{w}) does not match the model's {self.image_size}x{self.image_size}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.to(patches.dtype).expand(b, 1, -1)
        x = torch.cat([cls, patches], dim=1)
        if interpolate_pos_encoding:
            return x + self.interpolated_positions(h, w)
        return x + self.position_embedding.weight.unsqueeze(0)


class CLIPVisionTransformer(nn.Module):
    """CLIP's vision tower (transformers' ``CLIPVisionModel``, weights under ``vision_model.``)."""

    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = CLIPEncoder(cfg)
        self.post_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.post_layernorm.weight.dtype

    def forward(self, pixel_values: torch.Tensor, *, interpolate_pos_encoding: bool = False, output_hidden_states: bool = False) -> CLIPTowerOutput:
        """``pixel_values (B, C, H, W)`` -> per-patch states (no final norm, as in transformers) and the
        pooled class token (``post_layernorm`` applied)."""
        x = self.pre_layrnorm(self.embeddings(pixel_values, interpolate_pos_encoding))
        x, states = self.encoder(x, output_hidden_states=output_hidden_states)
        return CLIPTowerOutput(x, self.post_layernorm(x[:, 0]), states)


# -- the dual encoder ------------------------------------------------------------------------
@dataclass
class CLIPOutput:
    logits_per_image: torch.Tensor  # (images, texts) = logit_scale.exp() * cosine
    logits_per_text: torch.Tensor
    image_embeds: torch.Tensor  # L2-normalised, fp32
    text_embeds: torch.Tensor


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """Unit vectors along the last dimension, computed in fp32 (a bf16 norm loses three digits)."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


class CLIPModel(nn.Module):
    """The dual encoder: both towers, their projections and the learned temperature."""

    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        self.config = cfg
        self.text_model = CLIPTextTransformer(cfg.text_config)
        self.vision_model = CLIPVisionTransformer(cfg.vision_config)
        self.visual_projection = nn.Linear(cfg.vision_config.hidden_size, cfg.projection_dim, bias=False)
        self.text_projection = nn.Linear(cfg.text_config.hidden_size, cfg.projection_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(float(cfg.logit_scale_init_value)))

    def get_image_features(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        """Projected (not normalised) image embeddings ``(B, projection_dim)``."""
        return self.visual_projection(self.vision_model(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding).pooler_output)

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Projected (not normalised) text embeddings ``(B, projection_dim)``."""
        return self.text_projection(self.text_model(input_ids, attention_mask).pooler_output)

    def temperature(self) -> torch.Tensor:
        """The multiplier of cosine similarities: ``exp(logit_scale)`` in fp32."""
        return self.logit_scale.float().exp()

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> CLIPOutput:
        image = l2_normalize(self.get_image_features(pixel_values))
        text = l2_normalize(self.get_text_features(input_ids, attention_mask))
        logits_per_text = text @ image.t() * self.temperature()
        return CLIPOutput(logits_per_text.t(), logits_per_text, image, text)


class CLIPTextModelWithProjection(nn.Module):
    """transformers' ``CLIPTextModelWithProjection`` (e.g. SDXL's second text encoder): the text tower and
    its projection, without the vision side."""

    def __init__(self, cfg: CLIPTextConfig, projection_dim: Optional[int] = None):
        super().__init__()
        self.config = cfg
        self.text_model = CLIPTextTransformer(cfg)
        self.text_projection = nn.Linear(cfg.hidden_size, projection_dim or cfg.projection_dim, bias=False)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *, output_hidden_states: bool = False
    ) -> tuple[torch.Tensor, CLIPTowerOutput]:
        out = self.text_model(input_ids, attention_mask, output_hidden_states=output_hidden_states)
        return self.text_projection(out.pooler_output), out


def contrastive_loss(logits_per_image: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric InfoNCE: the mean of the image->text and text->image cross-entropies, with
    matching pairs on the diagonal."""
    target = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
    logits = logits_per_image.float()
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))


def init_clip_weights(model: CLIPModel, factor: float = 1.0) -> None:
    """The initialisation of transformers' ``CLIPPreTrainedModel._init_weights`` (for training from scratch)."""

    def normal(t: torch.Tensor, std: float) -> None:
        nn.init.normal_(t, mean=0.0, std=std)

    for tower in (model.text_model, model.vision_model):
        cfg = tower.config
        d, n_layers = cfg.hidden_size, cfg.num_hidden_layers
        for m in tower.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for layer in tower.encoder.layers:
            in_std = d**-0.5 * (2 * n_layers) ** -0.5 * factor
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                normal(proj.weight, in_std)
            normal(layer.self_attn.out_proj.weight, d**-0.5 * factor)
            normal(layer.mlp.fc1.weight, (2 * d) ** -0.5 * factor)
            normal(layer.mlp.fc2.weight, in_std)
    emb = model.text_model.embeddings
    normal(emb.token_embedding.weight, 0.02 * factor)
    normal(emb.position_embedding.weight, 0.02 * factor)
    vemb = model.vision_model.embeddings
    normal(vemb.class_embedding, vemb.embed_dim**-0.5 * factor)
    normal(vemb.patch_embedding.weight, 0.02 * factor)
    normal(vemb.position_embedding.weight, 0.02 * factor)
    normal(model.text_projection.weight, model.config.text_config.hidden_size**-0.5 * factor)
    normal(model.visual_projection.weight, model.config.vision_config.hidden_size**-0.5 * factor)
    with torch.no_grad():
        model.logit_scale.fill_(model.config.logit_scale_init_value)


__all__ = [
    "CLIPTextConfig",
    "SD_TEXT_ENCODER_CONFIGS",
    "sd_text_encoder_config",
    "CLIPVisionConfig",
    "CLIPConfig",
    "CLIPTowerOutput",
    "CLIPAttention",
    "CLIPEncoderLayer",
    "CLIPEncoder",
    "CLIPTextEmbeddings",
    "CLIPTextTransformer",
    "CLIPVisionEmbeddings",
    "CLIPVisionTransformer",
    "CLIPOutput",
    "CLIPModel",
    "CLIPTextModelWithProjection",
    "contrastive_loss",
    "init_clip_weights",
    "l2_normalize",
    "LEGACY_EOS_TOKEN_ID",
]
