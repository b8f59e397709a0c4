"""The Llama family of decoder-only language models (transformers' ``LlamaForCausalLM`` layout).

Pre-norm blocks with RMSNorm, rotary position embeddings (``rope_theta``; ``linear`` and ``llama3``
frequency scaling), grouped-query attention (``num_key_value_heads``), a SwiGLU MLP, tied or untied
input/output embeddings. The same layout covers Mistral (``MistralForCausalLM``) and Qwen2
(``Qwen2ForCausalLM``: q/k/v projections with a bias) checkpoints.

Attribute names mirror transformers' so a checkpoint's keys map onto this module unchanged:
``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``, ``model.layers.N.mlp.{gate,up,down}_proj``,
``model.layers.N.{input,post_attention}_layernorm``, ``model.norm``, ``lm_head``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from gencli.backend.attention import LayerKVCache, scaled_dot_product_attention
from gencli.backend.decoder_step import DecoderLayerParts, DecoderStackParts
from gencli.backend.layers import GatedMLP, RMSNorm, project
from gencli.backend.positional import RotaryEmbedding, apply_rotary
from gencli.checkpoints.config import read_config
from gencli.checkpoints.keymap import Drop, KeyMap
from gencli.errors import CheckpointError
from gencli.models.causal_lm import CausalLM

# config.json "architectures" / "model_type" values this module loads
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
MODEL_TYPES = {"llama", "mistral", "qwen2"}
# weights stored column-major for CPU fp32 decoding (see gencli.checkpoints.loader.load_state)
CPU_COLUMN_MAJOR = (r"_proj\.weight$", r"^lm_head\.weight$")


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """``(rope_theta, scaling)`` from a config in either convention.

    transformers 4 writes ``rope_theta`` and ``rope_scaling`` at the top level; transformers 5 writes
    a ``rope_parameters`` dict holding ``rope_theta`` and the scaling fields (``rope_type`` ...).
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    merged: dict[str, Any] = {}
    for part in (params, scaling):
        if isinstance(part, dict):
            merged.update(part)
    if theta is None:
        theta = merged.get("rope_theta", 10000.0)
    kind = merged.get("rope_type", merged.get("type", "default"))
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial rotary embeddings (partial_rotary_factor < 1) are not supported for Llama-family models")
    if kind in (None, "default"):
        return float(theta), None
    if kind not in ("linear", "llama3"):
        raise CheckpointError(f"rope scaling type '{kind}' is not supported (supported: default, linear, llama3)")
    if "factor" not in merged:
        raise CheckpointError(f"rope scaling '{kind}' needs a 'factor' in config.json")
    out = {k: v for k, v in merged.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = kind
    if kind == "llama3":
        # transformers fills the pre-scaling context from max_position_embeddings when it is absent
        out.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
    return float(theta), out


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    qkv_bias: bool = False  # bias on q/k/v projections (Llama attention_bias, Qwen2 always)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias only)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: Any = None
    eos_token_id: Any = None
    pad_token_id: Any = None
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        """Read a transformers ``config.json`` of a Llama, Mistral or Qwen2 checkpoint."""
        model_type = cfg.get("model_type") or ARCHITECTURES.get((cfg.get("architectures") or [""])[0], "llama")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        theta, scaling = _rope_settings(cfg)
        is_qwen2 = model_type == "qwen2"
        attention_bias = bool(cfg.get("attention_bias", False))
        # Qwen2 configs set tie_word_embeddings explicitly; Llama/Mistral default to untied
        tie = bool(cfg.get("tie_word_embeddings", False))
        return read_config(
            cls, cfg, what=f"a {model_type} model", required=required, rope_theta=theta, rope_scaling=scaling,
            qkv_bias=is_qwen2 or attention_bias, o_bias=attention_bias and not is_qwen2, tie_word_embeddings=tie, model_type=model_type,
        )  # fmt: skip

    def to_hf(self) -> dict[str, Any]:
        """A transformers ``config.json`` for this model (readable by transformers 4 and 5)."""
        if self.model_type != "llama" or self.o_bias != self.qkv_bias:
            raise ValueError("only plain Llama configs are written by gencli")
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "attention_bias": self.qkv_bias,
            "attention_dropout": 0.0,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "initializer_range": 0.02,
            "use_cache": True,
        }
        return d


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: Optional[LayerKVCache] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))  # one call when quantized
        q = q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = scaled_dot_product_attention(q, k, v, causal=True, key_padding_mask=key_padding_mask, kv_cache=kv_cache)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache=None, key_padding_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, key_padding_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, base=cfg.rope_theta, scaling=cfg.rope_scaling)


class LlamaForCausalLM(CausalLM):
    """Llama-family decoder with its LM head (``forward`` and the KV-cache contract: :class:`CausalLM`)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.context_length = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def backbone(self, input_ids, position_ids, key_mask, kv_cache):
        x = self.model.embed_tokens(input_ids)
        fused = self.fused_decoder(x, kv_cache)
        if fused is not None and fused.takes_positions:
            return self.fused_states(fused, fused(x, kv_cache, key_mask, positions=position_ids))
        cos, sin = self.model.rotary_emb(position_ids, x.dtype)
        if fused is not None:
            return self.fused_states(fused, fused(x, kv_cache, key_mask, cos, sin))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, L, D): broadcast over the heads, once
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv_cache[i] if kv_cache is not None else None, key_mask)
        return self.final_norm(x)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    def fused_decoder_parts(self) -> DecoderStackParts:
        cfg = self.config
        layers = tuple(
            DecoderLayerParts(
                layer.input_layernorm,
                (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                layer.self_attn.o_proj,
                layer.post_attention_layernorm,
                (layer.mlp.gate_proj, layer.mlp.up_proj),
                layer.mlp.down_proj,
                cfg.head_dim**-0.5,
            )
            for layer in self.model.layers
        )
        return DecoderStackParts(
            layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_act,
            rotary=True,
            final_norm=self.model.norm,
            rotary_emb=self.model.rotary_emb,
            embeddings=(self.model.embed_tokens,),
            lm_head=self.lm_head,
        )


# transformers' checkpoints map onto this module unchanged; some exports carry the rotary table,
# which is recomputed from the config.
HF_KEYMAP = KeyMap([Drop(r"rotary_emb\.inv_freq$")], "transformers-llama")
