"""What every decoder-only language model in gencli offers the generation loop.

A model takes token ids ``(B, L)`` and returns next-token logits. With a :class:`KVCache` (from the
backend, preallocated once for the whole generation) each call only processes the new positions:
the prompt in one call (prefill), then one token per call (decode). Left-padded batches pass
``attention_mask (B, cache capacity)`` with True for real tokens and explicit ``position_ids``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from gencli.backend.attention import KVCache, StaticKVCache
from gencli.backend.decoder_step import DecoderStackParts, FusedDecoder

_UNSET = object()


class CausalLM(nn.Module):
    """Base class: subclasses set the ``num_layers``, ``num_kv_heads``, ``head_dim``, ``context_length``
    and ``vocab_size`` attributes, own an ``lm_head``, and implement ``backbone`` and ``final_norm``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    vocab_size: int

    def new_cache(self, batch_size: int, max_len: int, *, static: bool = False) -> KVCache:
        """A KV cache for ``batch_size`` sequences of up to ``max_len`` positions, in the model's dtype
        (``static``: a :class:`StaticKVCache`, for decoding steps of fixed shapes)."""
        ref = self.get_input_embeddings().weight
        kind = StaticKVCache if static else KVCache
        return kind(self.num_layers, batch_size, self.num_kv_heads, self.head_dim, max_len, dtype=ref.dtype, device=ref.device)

    def get_input_embeddings(self) -> nn.Embedding:
        raise NotImplementedError

    def fused_decoder_parts(self) -> Optional[DecoderStackParts]:
        """The decoder layers as :class:`gencli.backend.decoder_step.FusedDecoder` reads them (None:
        this model always decodes layer by layer)."""
        return None

    def fused_decoder(self, x: torch.Tensor, kv_cache: Optional[KVCache]) -> Optional[FusedDecoder]:
        """The one-call decoding step for the embeddings ``x`` of one new position per sequence, where
        it applies (quantized layers on a CPU: see :mod:`gencli.backend.decoder_step`), else None.
        Built on the first decoding step and kept until the model is moved or re-quantized."""
        return self._built_fused_decoder() if FusedDecoder.applies(x, kv_cache) else None

    def _built_fused_decoder(self) -> Optional[FusedDecoder]:
        fused = self.__dict__.get("_fused_decoder", _UNSET)
        if fused is _UNSET:
            parts = self.fused_decoder_parts()
            fused = FusedDecoder.build(parts) if parts is not None else None
            self.__dict__["_fused_decoder"] = fused
        return fused

    def fused_logits(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        greedy: bool = False,
    ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """A decoding step of one new token a sequence, ``input_ids (B, 1)``, from the ids to the next
        logits in one native call (embeddings, every layer, the final norm and the LM head: see
        :meth:`FusedDecoder.logits`): ``(logits (B, V), the greedy choices (B,) where greedy)``; None where
        it does not apply (then :meth:`hidden_states` and the head). Arguments as :meth:`hidden_states`'s."""
        if not FusedDecoder.applies_to_ids(input_ids, kv_cache):
            return None
        fused = self._built_fused_decoder()
        if fused is None or not fused.takes_ids:
            return None
        return fused.logits(input_ids, kv_cache, self.key_mask(attention_mask, kv_cache, 1), position_ids, greedy)

    def fused_greedy_steps(
        self,
        input_ids: torch.Tensor,
        *,
        kv_cache: KVCache,
        steps: int,
        left: list[int],
        stop_ids: Sequence[int] = (),
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        last_position: int = 0,
        screen: bool = False,
    ) -> Optional[torch.Tensor]:
        """Up to ``steps`` plain greedy decoding steps in one native call (:meth:`FusedDecoder.greedy_steps`),
        from the tokens ``input_ids (B, 1)``: the choices ``(B, k)``; None where :meth:`fused_logits` would not
        apply. ``left``: each row's budget of new tokens; ``stop_ids`` end a row; ``position_ids (B, 1)`` move
        one a step (at most ``last_position``); ``attention_mask (B, >= cached + steps)`` as :meth:`hidden_states`'s."""
        if not FusedDecoder.applies_to_ids(input_ids, kv_cache):
            return None
        fused = self._built_fused_decoder()
        if fused is None or not fused.takes_ids:
            return None
        return fused.greedy_steps(input_ids, kv_cache, steps, left, stop_ids, attention_mask, position_ids, last_position, screen)

    def fused_head_screen(self, build: bool = True) -> bool:
        """Whether the fused step screens this model's LM head in greedy steps (a dense head on a CPU, see
        :meth:`FusedDecoder.screen_head`): built here once where ``build``, else only whether it is built."""
        fused = self._built_fused_decoder()
        if fused is None or not fused.takes_ids:
            return False
        return fused.screen_head() if build else bool(fused.native.has_head_screen)

    def fused_sample_steps(
        self,
        input_ids: torch.Tensor,
        *,
        kv_cache: KVCache,
        steps: int,
        left: list[int],
        sampling: tuple[float, int, float, float, float],
        uniforms: Optional[torch.Tensor],
        seen: Optional[torch.Tensor] = None,
        stop_ids: Sequence[int] = (),
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        last_position: int = 0,
    ) -> Optional[torch.Tensor]:
        """:meth:`fused_greedy_steps` with the tokens sampled in the native call (:meth:`FusedDecoder.sample_steps`:
        ``sampling`` is ``(temperature, top_k, top_p, min_p, repetition_penalty)``, ``uniforms (steps, B)`` the
        draws, ``seen (B, n)`` the repetition penalty's tokens before the first step); None where
        :meth:`fused_logits` would not apply."""
        if not FusedDecoder.applies_to_ids(input_ids, kv_cache):
            return None
        fused = self._built_fused_decoder()
        if fused is None or not fused.takes_ids:
            return None
        return fused.sample_steps(input_ids, kv_cache, steps, left, sampling, uniforms, seen, stop_ids, attention_mask, position_ids, last_position)

    def forget_fused_decoder(self) -> None:
        """Drop the fused step (its layers were replaced or moved): the next decoding step rebuilds it."""
        self.__dict__.pop("_fused_decoder", None)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        self.forget_fused_decoder()
        return super()._apply(fn, recurse)

    def backbone(self, input_ids: torch.Tensor, position_ids: torch.Tensor, key_mask: Optional[torch.Tensor], kv_cache: Optional[KVCache]) -> torch.Tensor:
        """Embeddings, decoder blocks and the final norm: the hidden states the LM head multiplies."""
        raise NotImplementedError

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fused_states(self, fused: FusedDecoder, hidden: torch.Tensor) -> torch.Tensor:
        """The fused step's output after the final norm (applied here unless the step did)."""
        return hidden if fused.normalizes else self.final_norm(hidden)

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """``input_ids (B, L)`` -> logits ``(B, L or logits_to_keep, V)``; the keyword arguments are
        those of :meth:`hidden_states`."""
        return self.lm_head(self.hidden_states(input_ids, **kwargs))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        cache_position: Optional[torch.Tensor] = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """The final normalised hidden states (what the LM head multiplies).

        ``attention_mask (B, >= cached + L)`` is True for real tokens (left-padded batches); only the
        last ``logits_to_keep`` positions are kept (0 = all). With a :class:`StaticKVCache`,
        ``cache_position (L,)`` gives the slots of the new positions (a tensor, so that a captured
        step is replayed unchanged) and ``attention_mask`` covers every slot."""
        if isinstance(kv_cache, StaticKVCache):
            if cache_position is None:
                raise ValueError("a static KV cache needs the cache_position of the new tokens")
            kv_cache.bind(cache_position)
            if position_ids is None:
                position_ids = cache_position.unsqueeze(0).expand(input_ids.shape[0], -1)
        pos = self.positions(input_ids, position_ids, kv_cache)
        mask = self.key_mask(attention_mask, kv_cache, input_ids.shape[1])
        return self.keep_last(self.backbone(input_ids, pos, mask, kv_cache), logits_to_keep)

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
        if attention_mask is None or isinstance(kv_cache, StaticKVCache):
            return attention_mask  # a static cache: the mask covers every slot
        total = (kv_cache.length if kv_cache is not None else 0) + new_len
        return attention_mask[:, :total]

    @staticmethod
    def keep_last(hidden: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """Only the last ``logits_to_keep`` positions go through the LM head (0 = all of them)."""
        return hidden if logits_to_keep <= 0 else hidden[:, -logits_to_keep:]
