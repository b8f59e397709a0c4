"""T5 (transformers' ``T5ForConditionalGeneration`` layout): T5 v1.0, T5 v1.1, Flan-T5 and mT5.

An encoder and a decoder of pre-norm blocks joined by cross-attention. T5's own choices:

- the layer norm is an RMS norm (no mean subtraction, no bias; variance in fp32);
- no biases anywhere, and no 1/sqrt(d) scaling of the attention scores (T5 folds it into the
  initialisation of the query projection);
- positions enter only as a learned relative position bias added to the attention scores: the
  distance key - query falls into one of ``relative_attention_num_buckets`` buckets (exact for short
  distances, logarithmic up to ``relative_attention_max_distance``), signed in the encoder
  (bidirectional), past-only in the decoder (causal). Only the first block of each stack owns the
  bias table; the bias is computed once per stack and shared by all its blocks. Cross-attention
  has no position bias;
- the feed-forward block is ``wo(relu(wi x))`` (v1.0) or the gated ``wo(gelu_new(wi_0 x) * wi_1 x)``
  (v1.1, Flan-T5, mT5: ``feed_forward_proj: gated-gelu``);
- v1.0 ties the LM head to the shared embedding and scales the decoder output by ``d_model**-0.5``
  before it; v1.1 has a separate ``lm_head`` and no scaling. transformers 5 writes the scaling as
  ``scale_decoder_outputs`` in config.json; older configs say ``tie_word_embeddings: false`` for v1.1.

Attribute names mirror transformers': ``shared``, ``encoder.block.N.layer.0.SelfAttention.{q,k,v,o}``,
``...SelfAttention.relative_attention_bias`` (block 0), ``encoder.block.N.layer.1.DenseReluDense.{wi,wo}``
(or ``wi_0, wi_1, wo``), ``decoder.block.N.layer.1.EncDecAttention``, ``decoder.block.N.layer.2``
(the feed-forward), ``layer.M.layer_norm``, ``{encoder,decoder}.final_layer_norm``, ``lm_head``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from gencli.backend.attention import KVCache, LayerKVCache, scaled_dot_product_attention
from gencli.backend.layers import Linear, RMSNorm, get_activation, project
from gencli.checkpoints.config import read_config
from gencli.checkpoints.keymap import Drop, KeyMap
from gencli.errors import CheckpointError
from gencli.models.attention import merge_heads, split_heads
from gencli.models.seq2seq import CrossKV, Seq2SeqLM

ARCHITECTURES = {"T5ForConditionalGeneration": "t5", "MT5ForConditionalGeneration": "mt5"}
MODEL_TYPES = {"t5", "mt5"}


@dataclass
class T5Config:
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: Optional[int] = None
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    n_positions: int = 512  # the source length the tokenizers truncate to (T5 itself has no fixed window)
    tie_lm_head: bool = True  # the LM head is the shared embedding (the checkpoint has no lm_head.weight)
    scale_decoder_outputs: bool = True  # decoder output * d_model**-0.5 before the head (v1.0)
    pad_token_id: Any = 0
    eos_token_id: Any = 1
    decoder_start_token_id: Any = 0
    model_type: str = "t5"

    def __post_init__(self) -> None:
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        parts = self.feed_forward_proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise CheckpointError(f"config.json: feed_forward_proj '{self.feed_forward_proj}' is not 'ACT' or 'gated-ACT'")

    @property
    def is_gated(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def activation(self) -> str:
        act = self.feed_forward_proj.split("-")[-1]
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else act  # transformers' backward-compatible reading

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, has_lm_head: bool = False) -> "T5Config":
        """Read a transformers ``config.json``; ``has_lm_head``: the checkpoint stores its own ``lm_head.weight``."""
        scale = cfg.get("scale_decoder_outputs")
        if scale is None:
            scale = cfg.get("tie_word_embeddings", True) is not False
        model_type = cfg.get("model_type") or ARCHITECTURES.get((cfg.get("architectures") or [""])[0], "t5")
        required = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads")
        return read_config(
            cls, cfg, what="a T5 model", required=required, tie_lm_head=not has_lm_head, scale_decoder_outputs=bool(scale), model_type=str(model_type)
        )


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position (key - query), as Mesh TensorFlow and transformers compute it."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, large)


class T5Attention(nn.Module):
    """Self or cross attention without biases or score scaling; block 0's self attention owns the
    relative position bias table (``has_relative_attention_bias``)."""

    def __init__(self, cfg: T5Config, *, has_relative_attention_bias: bool = False, bidirectional: bool = True):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q = Linear(cfg.d_model, cfg.inner_dim, bias=False)
        self.k = Linear(cfg.d_model, cfg.inner_dim, bias=False)
        self.v = Linear(cfg.d_model, cfg.inner_dim, bias=False)
        self.o = Linear(cfg.inner_dim, cfg.d_model, bias=False)
        self.bidirectional = bidirectional
        self.num_buckets = cfg.relative_attention_num_buckets
        self.max_distance = cfg.relative_attention_max_distance
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads)

    def compute_bias(self, query_start: int, query_len: int, key_len: int, device: torch.device) -> torch.Tensor:
        """The position bias ``(1, H, query_len, key_len)`` of queries at ``query_start..`` over keys ``0..key_len-1``."""
        q = torch.arange(query_start, query_start + query_len, dtype=torch.long, device=device)[:, None]
        k = torch.arange(key_len, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(k - q, self.bidirectional, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)

    def forward(
        self,
        x: torch.Tensor,
        bias: Optional[torch.Tensor],
        key_padding_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[LayerKVCache] = None,
        causal: bool = False,
    ) -> torch.Tensor:
        q, k, v = project(x, (self.q, self.k, self.v))
        h = self.num_heads
        out = scaled_dot_product_attention(
            split_heads(q, h), split_heads(k, h), split_heads(v, h),
            causal=causal, key_padding_mask=key_padding_mask, attn_mask=bias.to(q.dtype) if bias is not None else None, kv_cache=kv_cache, scale=1.0,
        )  # fmt: skip
        return self.o(merge_heads(out))

    def cross(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], key_padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Cross attention over keys/values projected once from the encoder output."""
        q = split_heads(self.q(x), self.num_heads)
        out = scaled_dot_product_attention(q, kv[0], kv[1], key_padding_mask=key_padding_mask, scale=1.0)
        return self.o(merge_heads(out))

    def project_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = project(context, (self.k, self.v))
        return split_heads(k, self.num_heads), split_heads(v, self.num_heads)


class T5LayerSelfAttention(nn.Module):
    def __init__(self, cfg: T5Config, *, has_relative_attention_bias: bool, bidirectional: bool):
        super().__init__()
        self.SelfAttention = T5Attention(cfg, has_relative_attention_bias=has_relative_attention_bias, bidirectional=bidirectional)
        self.layer_norm = RMSNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)


class T5LayerCrossAttention(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.EncDecAttention = T5Attention(cfg)
        self.layer_norm = RMSNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)


class T5DenseActDense(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.wi = Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.act = cfg.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.wi(x, activation=self.act))


class T5DenseGatedActDense(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.wi_0 = Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wi_1 = Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.act = cfg.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, (self.wi_0, self.wi_1), (self.act, None))
        return self.wo(gate * up)


class T5LayerFF(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        get_activation(cfg.activation)  # an unknown name fails when the model is built
        self.DenseReluDense = T5DenseGatedActDense(cfg) if cfg.is_gated else T5DenseActDense(cfg)
        self.layer_norm = RMSNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nn.Module):
    def __init__(self, cfg: T5Config, *, is_decoder: bool, has_relative_attention_bias: bool):
        super().__init__()
        layers: list[nn.Module] = [T5LayerSelfAttention(cfg, has_relative_attention_bias=has_relative_attention_bias, bidirectional=not is_decoder)]
        if is_decoder:
            layers.append(T5LayerCrossAttention(cfg))
        layers.append(T5LayerFF(cfg))
        self.layer = nn.ModuleList(layers)


class T5Stack(nn.Module):
    def __init__(self, cfg: T5Config, embed_tokens: nn.Embedding, *, is_decoder: bool):
        super().__init__()
        self.embed_tokens = embed_tokens
        n = cfg.num_decoder_layers if is_decoder else cfg.num_layers
        self.block = nn.ModuleList(T5Block(cfg, is_decoder=is_decoder, has_relative_attention_bias=i == 0) for i in range(n))
        self.final_layer_norm = RMSNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)


class T5ForConditionalGeneration(Seq2SeqLM):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.config = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = T5Stack(cfg, self.shared, is_decoder=False)
        self.decoder = T5Stack(cfg, self.shared, is_decoder=True)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_lm_head:
            self.lm_head.weight = self.shared.weight
        self.num_decoder_layers = int(cfg.num_decoder_layers or cfg.num_layers)
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.d_kv
        self.vocab_size = cfg.vocab_size
        self.output_scale = cfg.d_model**-0.5 if cfg.scale_decoder_outputs else None

    def decoder_embeddings(self) -> nn.Embedding:
        return self.shared

    def encode(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        stack = self.encoder
        x = stack.embed_tokens(input_ids)
        n = input_ids.shape[1]
        bias = stack.block[0].layer[0].SelfAttention.compute_bias(0, n, n, x.device)
        for block in stack.block:
            sa, ff = block.layer
            x = x + sa.SelfAttention(sa.layer_norm(x), bias, attention_mask)
            x = ff(x)
        return stack.final_layer_norm(x)

    def cross_attention_kv(self, encoder_hidden: torch.Tensor) -> CrossKV:
        return [block.layer[1].EncDecAttention.project_kv(encoder_hidden) for block in self.decoder.block]

    def decode_hidden(
        self,
        decoder_input_ids: torch.Tensor,
        cross_kv: CrossKV,
        encoder_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        stack = self.decoder
        x = stack.embed_tokens(decoder_input_ids)
        start = kv_cache.length if kv_cache is not None else 0
        n = decoder_input_ids.shape[1]
        bias = stack.block[0].layer[0].SelfAttention.compute_bias(start, n, start + n, x.device)
        for i, block in enumerate(stack.block):
            sa, ca, ff = block.layer
            x = x + sa.SelfAttention(sa.layer_norm(x), bias, None, kv_cache[i] if kv_cache is not None else None, causal=True)
            x = x + ca.EncDecAttention.cross(ca.layer_norm(x), cross_kv[i], encoder_mask)
            x = ff(x)
        x = stack.final_layer_norm(x)
        if self.output_scale is not None:
            x = x * self.output_scale
        return x


# old exports carry an unused position-bias table in the first decoder block's cross attention
HF_KEYMAP = KeyMap([Drop(r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$")], "transformers-t5")
