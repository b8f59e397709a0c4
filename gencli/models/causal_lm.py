"""What every decoder-only language model in gencli offers the generation loop.

A model takes token ids ``(B, L)`` and returns next-token logits. With a :class:`KVCache` (from the
backend, preallocated once for the whole generation) each call only processes the new positions:
the prompt in one call (prefill), then one token per call (decode). Left-padded batches pass
``attention_mask (B, cache capacity)`` with True for real tokens and explicit ``position_ids``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from gencli.backend.attention import KVCache


class CausalLM(nn.Module):
    """Base class: subclasses set the ``num_layers``, ``num_kv_heads``, ``head_dim``, ``context_length``
    and ``vocab_size`` attributes and implement ``forward``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    vocab_size: int

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """A KV cache for ``batch_size`` sequences of up to ``max_len`` positions, in the model's dtype."""
        ref = self.get_input_embeddings().weight
        return KVCache(self.num_layers, batch_size, self.num_kv_heads, self.head_dim, max_len, dtype=ref.dtype, device=ref.device)

    def get_input_embeddings(self) -> nn.Embedding:
        raise NotImplementedError

    @staticmethod
    def positions(input_ids: torch.Tensor, position_ids: Optional[torch.Tensor], kv_cache: Optional[KVCache]) -> torch.Tensor:
        """Explicit ``position_ids``, else consecutive positions after what the cache holds."""
        if position_ids is not None:
            return position_ids
        start = kv_cache.length if kv_cache is not None else 0
        return torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)

    @staticmethod
    def key_mask(attention_mask: Optional[torch.Tensor], kv_cache: Optional[KVCache], new_len: int) -> Optional[torch.Tensor]:
        """The padding mask over the keys the attention will see (cached ones plus the new ones)."""
        if attention_mask is None:
            return None
        total = (kv_cache.length if kv_cache is not None else 0) + new_len
        return attention_mask[:, :total]

    @staticmethod
    def keep_last(hidden: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """Only the last ``logits_to_keep`` positions go through the LM head (0 = all of them)."""
        return hidden if logits_to_keep <= 0 else hidden[:, -logits_to_keep:]
