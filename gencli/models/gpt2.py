"""GPT-2 (transformers' ``GPT2LMHeadModel`` layout): gpt2 .. gpt2-xl, distilgpt2 and their fine-tunes.

Pre-norm blocks with LayerNorm, learned absolute position embeddings, one fused q/k/v projection,
a GELU (tanh approximation) MLP, the LM head tied to the token embedding. The projections are
"Conv1D" layers as in the original TensorFlow code: their weight is stored ``(in, out)``, the
transpose of ``nn.Linear``'s. :class:`Conv1D` keeps that orientation, so checkpoints load without a
transposed copy.

Attribute names mirror transformers': ``transformer.wte``, ``transformer.wpe``,
``transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}``, ``transformer.ln_f``,
``lm_head``. Checkpoints saved from ``GPT2Model`` (like the original ``gpt2`` upload) lack the
``transformer.`` prefix; the key map adds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from gencli.backend.attention import LayerKVCache, scaled_dot_product_attention
from gencli.backend.decoder_step import DecoderLayerParts, DecoderStackParts
from gencli.backend.layers import LayerNorm, get_activation
from gencli.checkpoints.config import read_config
from gencli.checkpoints.keymap import Drop, KeyMap, Rename
from gencli.errors import CheckpointError
from gencli.models.causal_lm import CausalLM

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "GPT2Model": "gpt2"}
MODEL_TYPES = {"gpt2"}
# weights stored column-major for CPU fp32 decoding (see gencli.checkpoints.loader.load_state): the
# Conv1D projections already hold (in, out); the LM head (the tied token embedding) is the one to turn
CPU_COLUMN_MAJOR = (r"^lm_head\.weight$",)


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: Optional[int] = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: Any = 50256
    eos_token_id: Any = 50256
    pad_token_id: Any = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "GPT2Config":
        if cfg.get("add_cross_attention"):
            raise CheckpointError("GPT-2 checkpoints with cross attention (add_cross_attention) are not supported")
        required = ("vocab_size", "n_embd", "n_layer", "n_head")
        return read_config(cls, cfg, what="a GPT-2 model", required=required, renames={"n_positions": ("n_positions", "n_ctx")})


class Conv1D(nn.Module):
    """A linear layer whose weight is stored ``(in_features, out_features)`` (GPT-2's layout)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def linear_weight(self) -> torch.Tensor:
        """The weight as ``nn.Linear`` holds it, ``(out_features, in_features)`` (a view)."""
        return self.weight.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bias + x @ weight in one BLAS call over the stored (in, out) matrix
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], out.shape[-1])


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int):
        super().__init__()
        self.num_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)
        scale = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.scale = scale

    def forward(self, x: torch.Tensor, kv_cache: Optional[LayerKVCache] = None, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, n, d = x.shape
        # (B, n, 3, H, D) -> three (B, H, n, D) views, no copies
        q, k, v = self.c_attn(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = scaled_dot_product_attention(q, k, v, causal=True, key_padding_mask=key_padding_mask, kv_cache=kv_cache, scale=self.scale)
        return self.c_proj(out.transpose(1, 2).reshape(b, n, d))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        inner = cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd
        self.c_fc = Conv1D(cfg.n_embd, inner)
        self.c_proj = Conv1D(inner, cfg.n_embd)
        self.act = get_activation(cfg.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x, kv_cache=None, key_padding_mask=None):
        x = x + self.attn(self.ln_1(x), kv_cache, key_padding_mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)


class GPT2LMHeadModel(CausalLM):
    """GPT-2 with its LM head (``forward`` and the KV-cache contract: :class:`CausalLM`)."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise CheckpointError(f"n_embd ({cfg.n_embd}) is not a multiple of n_head ({cfg.n_head})")
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.num_layers = cfg.n_layer
        self.num_kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.context_length = cfg.n_positions
        self.vocab_size = cfg.vocab_size

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def backbone(self, input_ids, position_ids, key_mask, kv_cache):
        t = self.transformer
        x = t.wte(input_ids) + t.wpe(position_ids)
        fused = self.fused_decoder(x, kv_cache)
        if fused is not None:
            return self.fused_states(fused, fused(x, kv_cache, key_mask))
        for i, block in enumerate(t.h):
            x = block(x, kv_cache[i] if kv_cache is not None else None, key_mask)
        return self.final_norm(x)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transformer.ln_f(hidden)

    def fused_decoder_parts(self) -> DecoderStackParts:
        layers = tuple(
            DecoderLayerParts(b.ln_1, (b.attn.c_attn,), b.attn.c_proj, b.ln_2, (b.mlp.c_fc,), b.mlp.c_proj, b.attn.scale) for b in self.transformer.h
        )
        cfg = self.config
        t = self.transformer
        return DecoderStackParts(
            layers, cfg.n_head, cfg.n_head, self.head_dim, cfg.activation_function, rotary=False, final_norm=t.ln_f,
            embeddings=(t.wte, t.wpe), lm_head=self.lm_head,
        )


# transformers' checkpoints: the causal-mask buffers of old exports are dropped; the files saved from
# GPT2Model have no "transformer." prefix.
HF_KEYMAP = KeyMap(
    [
        Drop(r"\.attn\.(bias|masked_bias)$"),
        Rename(r"^(?!transformer\.|lm_head\.)", "transformer."),
    ],
    "transformers-gpt2",
)
