"""MarianMT (transformers' ``MarianMTModel`` layout): the opus-mt translation checkpoints.

The original Transformer's encoder-decoder in the BART-style layout: post-LN blocks (attention or
feed-forward, residual add, then LayerNorm), biases everywhere, attention scores scaled by
``head_dim**-0.5``, fixed sinusoidal positions added to the token embeddings (scaled by
``sqrt(d_model)`` when ``scale_embedding``), ``final_logits_bias`` added to the logits. Marian's
sinusoid is not interleaved: the sines fill the first half of each position vector, the cosines the
second half (transformers' ``MarianSinusoidalPositionalEmbedding``); the table is computed here, and the
copies old exports store are dropped. Vocabularies are shared (``model.shared``, the usual case) or
separate (``share_encoder_decoder_embeddings: false``: ``model.encoder.embed_tokens`` and
``model.decoder.embed_tokens`` of ``decoder_vocab_size``); the LM head is tied to the decoder's
embedding.

Attribute names mirror transformers': ``model.{encoder,decoder}.layers.N.self_attn.{q,k,v,out}_proj``,
``...self_attn_layer_norm``, ``...fc1``, ``...fc2``, ``...final_layer_norm``, decoder
``...encoder_attn`` and ``...encoder_attn_layer_norm``, ``lm_head``, ``final_logits_bias``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn

from gencli.backend.attention import KVCache, LayerKVCache, scaled_dot_product_attention
from gencli.backend.layers import LayerNorm, Linear, get_activation, project
from gencli.checkpoints.config import read_config
from gencli.checkpoints.keymap import Drop, KeyMap
from gencli.errors import CheckpointError
from gencli.models.attention import merge_heads, split_heads
from gencli.models.seq2seq import CrossKV, Seq2SeqLM

ARCHITECTURES = {"MarianMTModel": "marian"}
MODEL_TYPES = {"marian"}


@dataclass
class MarianConfig:
    vocab_size: int = 58101
    decoder_vocab_size: Optional[int] = None
    d_model: int = 1024
    encoder_layers: int = 12
    decoder_layers: int = 12
    encoder_attention_heads: int = 16
    decoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    decoder_ffn_dim: int = 4096
    activation_function: str = "gelu"
    max_position_embeddings: int = 1024
    scale_embedding: bool = False
    share_encoder_decoder_embeddings: bool = True
    normalize_before: bool = False
    has_final_logits_bias: bool = True  # the checkpoint stores final_logits_bias (else zeros)
    learned_positions: bool = False  # BART: a learned position table (offset by 2) instead of the sinusoid
    layernorm_embedding: bool = False  # BART: a LayerNorm on the embeddings + positions of each stack
    pad_token_id: Any = 58100
    eos_token_id: Any = 0
    decoder_start_token_id: Any = 58100

    def __post_init__(self) -> None:
        if self.decoder_vocab_size is None or self.share_encoder_decoder_embeddings:
            self.decoder_vocab_size = self.vocab_size
        if self.normalize_before:
            raise CheckpointError("config.json: normalize_before (pre-LN) is not Marian's layout and is not supported")
        get_activation(self.activation_function)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, has_final_logits_bias: bool = True) -> "MarianConfig":
        required = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads")
        return read_config(cls, cfg, what="a Marian model", required=required, has_final_logits_bias=has_final_logits_bias)


def marian_positions(n_positions: int, dim: int) -> torch.Tensor:
    """Marian's sinusoidal table ``(n_positions, dim)``: sin(pos / 10000^(2i/dim)) in the first half,
    the matching cosines in the second (computed in float64 as transformers does, stored fp32)."""
    pos = np.arange(n_positions, dtype=np.float64)[:, None]
    j = np.arange(dim)
    angle = pos / np.power(10000, 2 * (j // 2) / dim)
    sentinel = dim // 2 if dim % 2 == 0 else dim // 2 + 1
    out = torch.empty(n_positions, dim, dtype=torch.float32)
    out[:, :sentinel] = torch.from_numpy(np.sin(angle[:, 0::2])).float()
    out[:, sentinel:] = torch.from_numpy(np.cos(angle[:, 1::2])).float()
    return out


class SinusoidalPositions(nn.Module):
    """The fixed position table as a non-persistent buffer (rebuilt after a meta-device build)."""

    def __init__(self, n_positions: int, dim: int):
        super().__init__()
        self.n_positions, self.dim = n_positions, dim
        self.register_buffer("table", marian_positions(n_positions, dim), persistent=False)

    def init_buffers(self, device: torch.device) -> None:
        self.table = marian_positions(self.n_positions, self.dim).to(device)

    def forward(self, start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        if start + n > self.n_positions:
            raise ValueError(f"position {start + n - 1} is past the model's {self.n_positions} positions")
        return self.table[start : start + n].to(dtype)


class LearnedPositions(nn.Embedding):
    """BART's learned position table: ``max_position_embeddings + 2`` rows, position p at row p + 2."""

    offset = 2

    def __init__(self, n_positions: int, dim: int):
        super().__init__(n_positions + self.offset, dim)

    def forward(self, start: int, n: int, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        if start + n + self.offset > self.weight.shape[0]:
            raise ValueError(f"position {start + n - 1} is past the model's {self.weight.shape[0] - self.offset} positions")
        return self.weight[start + self.offset : start + n + self.offset].to(dtype)


def _positions(cfg: "MarianConfig") -> nn.Module:
    kind = LearnedPositions if cfg.learned_positions else SinusoidalPositions
    return kind(cfg.max_position_embeddings, cfg.d_model)


class MarianAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise CheckpointError(f"d_model ({dim}) is not a multiple of the attention heads ({num_heads})")
        self.num_heads = num_heads
        self.q_proj = Linear(dim, dim)
        self.k_proj = Linear(dim, dim)
        self.v_proj = Linear(dim, dim)
        self.out_proj = Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None, kv_cache: Optional[LayerKVCache] = None, causal: bool = False):
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        h = self.num_heads
        out = scaled_dot_product_attention(
            split_heads(q, h), split_heads(k, h), split_heads(v, h), causal=causal, key_padding_mask=key_padding_mask, kv_cache=kv_cache
        )
        return self.out_proj(merge_heads(out))

    def cross(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], key_padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
        q = split_heads(self.q_proj(x), self.num_heads)
        out = scaled_dot_product_attention(q, kv[0], kv[1], key_padding_mask=key_padding_mask)
        return self.out_proj(merge_heads(out))

    def project_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = project(context, (self.k_proj, self.v_proj))
        return split_heads(k, self.num_heads), split_heads(v, self.num_heads)


class MarianEncoderLayer(nn.Module):
    def __init__(self, cfg: MarianConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = MarianAttention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = LayerNorm(d)
        self.fc1 = Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = LayerNorm(d)
        self.act = cfg.activation_function

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        x = self.self_attn_layer_norm(x + self.self_attn(x, mask))
        return self.final_layer_norm(x + self.fc2(self.fc1(x, activation=self.act)))


class MarianDecoderLayer(nn.Module):
    def __init__(self, cfg: MarianConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = MarianAttention(d, cfg.decoder_attention_heads)
        self.self_attn_layer_norm = LayerNorm(d)
        self.encoder_attn = MarianAttention(d, cfg.decoder_attention_heads)
        self.encoder_attn_layer_norm = LayerNorm(d)
        self.fc1 = Linear(d, cfg.decoder_ffn_dim)
        self.fc2 = Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = LayerNorm(d)
        self.act = cfg.activation_function

    def forward(self, x, cross_kv, encoder_mask, kv_cache) -> torch.Tensor:
        x = self.self_attn_layer_norm(x + self.self_attn(x, None, kv_cache, causal=True))
        x = self.encoder_attn_layer_norm(x + self.encoder_attn.cross(x, cross_kv, encoder_mask))
        return self.final_layer_norm(x + self.fc2(self.fc1(x, activation=self.act)))


class MarianEncoder(nn.Module):
    def __init__(self, cfg: MarianConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_positions = _positions(cfg)
        if cfg.layernorm_embedding:
            self.layernorm_embedding = LayerNorm(cfg.d_model)
        self.layers = nn.ModuleList(MarianEncoderLayer(cfg) for _ in range(cfg.encoder_layers))


class MarianDecoder(nn.Module):
    def __init__(self, cfg: MarianConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_positions = _positions(cfg)
        if cfg.layernorm_embedding:
            self.layernorm_embedding = LayerNorm(cfg.d_model)
        self.layers = nn.ModuleList(MarianDecoderLayer(cfg) for _ in range(cfg.decoder_layers))


class MarianModel(nn.Module):
    def __init__(self, cfg: MarianConfig):
        super().__init__()
        if cfg.share_encoder_decoder_embeddings:
            self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
            enc_emb = dec_emb = self.shared
        else:
            enc_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            dec_emb = nn.Embedding(int(cfg.decoder_vocab_size or cfg.vocab_size), cfg.d_model)
        self.encoder = MarianEncoder(cfg, enc_emb)
        self.decoder = MarianDecoder(cfg, dec_emb)


class MarianMTModel(Seq2SeqLM):
    def __init__(self, cfg: MarianConfig):
        super().__init__()
        self.config = cfg
        self.model = MarianModel(cfg)
        target_vocab = int(cfg.decoder_vocab_size or cfg.vocab_size)
        self.lm_head = nn.Linear(cfg.d_model, target_vocab, bias=False)
        self.lm_head.weight = self.model.decoder.embed_tokens.weight
        self.register_buffer("final_logits_bias", torch.zeros(1, target_vocab), persistent=cfg.has_final_logits_bias)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.num_decoder_layers = cfg.decoder_layers
        self.num_heads = cfg.decoder_attention_heads
        self.head_dim = cfg.d_model // cfg.decoder_attention_heads
        self.vocab_size = target_vocab

    def init_buffers(self, device: torch.device) -> None:
        if not self.config.has_final_logits_bias:
            self.final_logits_bias = torch.zeros(1, self.vocab_size, device=device)

    def decoder_embeddings(self) -> nn.Embedding:
        return self.model.decoder.embed_tokens

    def encode(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        enc = self.model.encoder
        x = enc.embed_tokens(input_ids) * self.embed_scale
        x = x + enc.embed_positions(0, input_ids.shape[1], x.dtype)
        if self.config.layernorm_embedding:
            x = enc.layernorm_embedding(x)
        for layer in enc.layers:
            x = layer(x, attention_mask)
        return x

    def cross_attention_kv(self, encoder_hidden: torch.Tensor) -> CrossKV:
        return [layer.encoder_attn.project_kv(encoder_hidden) for layer in self.model.decoder.layers]

    def decode_hidden(
        self,
        decoder_input_ids: torch.Tensor,
        cross_kv: CrossKV,
        encoder_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        dec = self.model.decoder
        start = kv_cache.length if kv_cache is not None else 0
        x = dec.embed_tokens(decoder_input_ids) * self.embed_scale
        x = x + dec.embed_positions(start, decoder_input_ids.shape[1], x.dtype)
        if self.config.layernorm_embedding:
            x = dec.layernorm_embedding(x)
        for i, layer in enumerate(dec.layers):
            x = layer(x, cross_kv[i], encoder_mask, kv_cache[i] if kv_cache is not None else None)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) + self.final_logits_bias.to(hidden.dtype)

    @property
    def plain_head(self) -> bool:
        return False


# old exports store the fixed position tables; they are computed from the config instead
HF_KEYMAP = KeyMap([Drop(r"^model\.(encoder|decoder)\.embed_positions\.weight$")], "transformers-marian")
