"""Pieces shared by the transformer encoders (ViT, CLIP's vision and text towers, BERT-like models).

Each architecture keeps its own module classes and attribute names (so its checkpoints load with an
identity key map); what they share is the computation, written once here on top of the one
attention entry point of :mod:`gencli.backend.attention`:

- :func:`multi_head_attention`: project with the given q/k/v linears, split heads, attend, merge;
- :func:`split_heads` / :func:`merge_heads`: ``(B, L, H*D) <-> (B, H, L, D)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from gencli.backend.attention import scaled_dot_product_attention


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, L, H*D) -> (B, H, L, D)``."""
    b, n, _ = x.shape
    return x.view(b, n, num_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, L, D) -> (B, L, H*D)``."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def multi_head_attention(
    hidden: torch.Tensor,
    query: nn.Linear,
    key: nn.Linear,
    value: nn.Linear,
    num_heads: int,
    *,
    context: Optional[torch.Tensor] = None,
    causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Multi-head (self or cross) attention before the output projection: ``(B, L, H*D)``.

    ``hidden`` gives the queries; keys and values come from ``context`` (cross attention) or from
    ``hidden`` itself. Masks and ``causal`` as in :func:`gencli.backend.attention.scaled_dot_product_attention`
    (boolean masks: True = may attend; ``key_padding_mask`` (B, Lk) with True for real tokens).
    """
    source = hidden if context is None else context
    q = split_heads(query(hidden), num_heads)
    k = split_heads(key(source), num_heads)
    v = split_heads(value(source), num_heads)
    out = scaled_dot_product_attention(
        q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask, scale=scale, dropout_p=dropout_p
    )
    return merge_heads(out)


__all__ = ["split_heads", "merge_heads", "multi_head_attention"]
