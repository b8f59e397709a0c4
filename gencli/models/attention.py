"""Multi-head attention for the model families, written once on top of the backend's one entry point
(:func:`gencli.backend.attention.scaled_dot_product_attention`).

- :func:`multi_head_attention`: project with the given q/k/v linears, split heads, attend, merge.
  The transformer encoders (ViT, CLIP's towers) keep their own module classes and attribute names
  (so their checkpoints load with an identity key map) and call this for the computation;
- :func:`split_heads` / :func:`merge_heads`: ``(B, L, H*D) <-> (B, H, L, D)``;
- :class:`Attention`: diffusers' ``Attention`` layout (``to_q``, ``to_k``, ``to_v``, ``to_out.0``),
  self or cross attention over token sequences or over the pixels of a feature map, as the VAE's
  mid-block and the UNet's transformer blocks use it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from gencli.backend.attention import scaled_dot_product_attention
from gencli.backend.layers import GroupNorm, Linear


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


class Attention(nn.Module):
    """Self or cross attention in diffusers' ``Attention`` layout.

    ``to_q`` reads the hidden states; ``to_k``/``to_v`` read ``context`` (cross attention, width
    ``cross_attention_dim``) or the hidden states; ``to_out.0`` projects back (``to_out.1`` is
    diffusers' dropout, parameter-free). A 4-D input ``(B, C, H, W)`` attends over its ``H*W``
    pixels and comes back in the same shape. With ``norm_num_groups`` a GroupNorm (``group_norm``)
    runs on the input first; ``residual_connection`` adds the input back; the result is divided by
    ``rescale_output_factor``. The VAE mid-block uses it with one head of the full width, a
    GroupNorm and the residual; the UNet's transformer blocks with several heads and no bias on
    q/k/v. Softmax runs in at least fp32 inside the attention kernels, so diffusers'
    ``upcast_attention``/``upcast_softmax`` need no separate path.
    """

    def __init__(
        self,
        query_dim: int,
        *,
        cross_attention_dim: Optional[int] = None,
        heads: int = 8,
        dim_head: int = 64,
        bias: bool = False,
        out_bias: bool = True,
        norm_num_groups: Optional[int] = None,
        eps: float = 1e-5,
        residual_connection: bool = False,
        rescale_output_factor: float = 1.0,
        out_dim: Optional[int] = None,
    ):
        super().__init__()
        inner = heads * dim_head
        context_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.heads = heads
        self.residual_connection = residual_connection
        self.rescale_output_factor = rescale_output_factor
        self.group_norm = GroupNorm(norm_num_groups, query_dim, eps=eps, affine=True) if norm_num_groups else None
        self.to_q = Linear(query_dim, inner, bias=bias)
        self.to_k = Linear(context_dim, inner, bias=bias)
        self.to_v = Linear(context_dim, inner, bias=bias)
        self.to_out = nn.ModuleList([Linear(inner, out_dim or query_dim, bias=out_bias), nn.Dropout(0.0)])

    def forward(self, hidden: torch.Tensor, context: Optional[torch.Tensor] = None, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        residual = hidden
        spatial = hidden.ndim == 4
        if spatial:
            b, c, h, w = hidden.shape
            if self.group_norm is not None:
                hidden = self.group_norm(hidden)
            hidden = hidden.reshape(b, c, h * w).transpose(1, 2)
        elif self.group_norm is not None:
            hidden = self.group_norm(hidden.transpose(1, 2)).transpose(1, 2)
        out = multi_head_attention(hidden, self.to_q, self.to_k, self.to_v, self.heads, context=context, key_padding_mask=key_padding_mask)
        out = self.to_out[0](out)
        if spatial:
            out = out.transpose(1, 2).reshape(b, -1, h, w)
        inplace = not torch.is_grad_enabled()  # ``out`` is a fresh tensor at inference
        if self.residual_connection:
            out = out.add_(residual) if inplace else out + residual
        if self.rescale_output_factor != 1.0:
            out = out.div_(self.rescale_output_factor) if inplace else out / self.rescale_output_factor
        return out


__all__ = ["split_heads", "merge_heads", "multi_head_attention", "Attention"]
