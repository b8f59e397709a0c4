"""What every encoder-decoder model in gencli (T5, Marian) offers the seq2seq decoding loop.

The source is encoded once (:meth:`Seq2SeqLM.encode`); the keys and values every decoder layer's
cross-attention reads are projected from it once (:meth:`Seq2SeqLM.cross_attention_kv`); the decoder
then runs one step per new token (:meth:`Seq2SeqLM.decode`) through a preallocated self-attention
:class:`~gencli.backend.attention.KVCache`. Source padding is described by ``encoder_mask (B, S)``,
True for real tokens (batches are right-padded, as transformers' tokenizers pad them).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from gencli.backend.attention import KVCache

CrossKV = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder layer: keys, values (B, H, S, D)


class Seq2SeqLM(nn.Module):
    """Base class: subclasses set ``num_decoder_layers``, ``num_heads``, ``head_dim`` and
    ``vocab_size`` (the decoder's), and implement ``encode``, ``cross_attention_kv`` and ``decode``."""

    num_decoder_layers: int
    num_heads: int
    head_dim: int
    vocab_size: int

    def decoder_embeddings(self) -> nn.Embedding:
        raise NotImplementedError

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """A self-attention KV cache for ``batch_size`` decoder sequences of up to ``max_len`` positions."""
        ref = self.decoder_embeddings().weight
        return KVCache(self.num_decoder_layers, batch_size, self.num_heads, self.head_dim, max_len, dtype=ref.dtype, device=ref.device)

    def encode(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``input_ids (B, S)`` -> the encoder's last hidden states ``(B, S, d_model)``."""
        raise NotImplementedError

    def cross_attention_kv(self, encoder_hidden: torch.Tensor) -> CrossKV:
        """The keys and values of every decoder layer's cross-attention, computed once per source."""
        raise NotImplementedError

    def decode_hidden(
        self,
        decoder_input_ids: torch.Tensor,
        cross_kv: CrossKV,
        encoder_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """``decoder_input_ids (B, n)`` (the positions after what ``kv_cache`` holds) -> the hidden states
        ``(B, n, d_model)`` the LM head multiplies."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head (plus any logits bias) on hidden states from :meth:`decode_hidden`."""
        return self.lm_head(hidden)

    @property
    def plain_head(self) -> bool:
        """True when the logits are the LM head's product alone (no bias): greedy decoding may then
        choose tokens by a screened argmax over the head."""
        return True

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        cross_kv: CrossKV,
        encoder_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """``decoder_input_ids (B, n)`` (the positions after what ``kv_cache`` holds) -> logits ``(B, n, V)``."""
        return self.logits(self.decode_hidden(decoder_input_ids, cross_kv, encoder_mask, kv_cache))

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Teacher-forced logits ``(B, n, V)`` of ``decoder_input_ids`` given the source (no cache)."""
        mask = attention_mask.bool() if attention_mask is not None else None
        hidden = self.encode(input_ids, mask)
        return self.decode(decoder_input_ids, self.cross_attention_kv(hidden), mask)
