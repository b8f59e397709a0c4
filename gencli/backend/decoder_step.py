"""A whole decoding step of a stack of pre-norm decoder layers in one native call (CPU decoding).

Decoding one token layer by layer from Python costs ~20 tensor operations a layer besides the
products (norms, views, rotary, the cache write, residual adds, the activation), a few microseconds
of dispatch each, on caches the weight streams have just evicted: on GPT-2's shape with int8
weights, about a third of a token's time. :class:`FusedDecoder` runs every layer of one step in
``csrc/decoder_step.cpp`` (the same products, :mod:`gencli.backend.quant_kernels`, and the same
decode attention, no tensor created in between). Where the model names them, the same call applies its
final norm and computes RoPE's cos/sin rows from the positions (each otherwise a few tensor operations
from Python a token, on cold caches). Where the parts name the embeddings and the LM head too,
:meth:`FusedDecoder.logits` goes from the token ids to the logits (and the greedy choices) in one call:
the table rows looked up, every layer, the final norm and the head's product in the same parallel
region (on the 2-core AMD EPYC, 1.01-1.12x the tokens/s of the layers' step followed by the head and the
argmax from Python), and :meth:`FusedDecoder.greedy_steps` runs several plain greedy steps in one call,
each step's choices the next one's ids (the Python between two tokens then runs once a burst).

A model offers it by describing its layers (:class:`DecoderStackParts`, from
:meth:`gencli.models.causal_lm.CausalLM.fused_decoder_parts`). It applies where every projection
is a :class:`~gencli.backend.quantize.QuantizedLinear` (one mode) or every one a
:class:`~gencli.backend.streamed_linear.StreamedLinear` (fp32 or bf16 weights, one dtype) on a CPU
with gencli's kernels, the norms are LayerNorm or RMSNorm and the MLP's activation is tanh-GELU, SiLU
or ReLU; the step then takes one new position per sequence, float32 activations and a float32
:class:`~gencli.backend.attention.KVCache`. Anything else (prefill, layers of other kinds, other
devices) keeps the layer-by-layer path. ``GENCLI_FUSED_DECODE=0`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from gencli.backend.attention import KVCache, StaticKVCache
from gencli.backend.layers import LayerNorm, RMSNorm
from gencli.backend.quant_kernels import cpu_kernels, int8_activations
from gencli.backend.quantize import QuantizedLinear
from gencli.backend.streamed_linear import DTYPES as DENSE_DTYPES
from gencli.backend.streamed_linear import StreamedLinear

ENV_SWITCH = "GENCLI_FUSED_DECODE"
# transformers' hidden_act names -> the activations the native step has
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu", "relu": "relu"}


@dataclass(frozen=True)
class DecoderLayerParts:
    """One pre-norm decoder layer: ``x += o_proj(attention(q, k, v of norm1(x)))``, then
    ``x += mlp_out(act(mlp_in[0](norm2(x))) [* mlp_in[1](norm2(x))])``."""

    norm1: nn.Module
    attn_in: tuple[nn.Module, ...]  # one fused q/k/v projection (q, k, v blocks of its outputs), or q, k, v
    o_proj: nn.Module
    norm2: nn.Module
    mlp_in: tuple[nn.Module, ...]  # fc, or gate and up (a gated MLP: act(gate) * up)
    mlp_out: nn.Module
    attn_scale: float


@dataclass(frozen=True)
class DecoderStackParts:
    layers: tuple[DecoderLayerParts, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    activation: str  # transformers' hidden_act name
    rotary: bool  # queries and keys rotated by half-split tables (Llama); else absolute positions (GPT-2)
    final_norm: Optional[nn.Module] = None  # the model's norm after the last layer, applied in the same call
    rotary_emb: Optional[nn.Module] = None  # a RotaryEmbedding: the step computes its cos/sin rows from the positions
    # the input embeddings (tokens, then positions where they are absolute) and the LM head: with them and
    # the final norm, a step goes from token ids to logits in the same call
    embeddings: tuple[nn.Module, ...] = ()
    lm_head: Optional[nn.Module] = None


def enabled() -> bool:
    """False when ``GENCLI_FUSED_DECODE`` is 0 / false / off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def _norm(m: nn.Module, hidden: int) -> Optional[tuple[Any, ...]]:
    if isinstance(m, RMSNorm) and not m.offset and m.weight.shape == (hidden,):
        return (m.weight, None, float(m.eps), True)
    if isinstance(m, LayerNorm) and m.weight is not None and tuple(m.normalized_shape) == (hidden,):
        return (m.weight, m.bias, float(m.eps), False)
    return None


def _linear(m: nn.Module) -> tuple[Any, ...]:
    if isinstance(m, StreamedLinear):
        return (m.weight, None, None, -1, m.bias)
    return (m.weight, m.weight_scale, m.weight_zero, m.group_size, m.bias)


def _table(m: nn.Module, hidden: int) -> Optional[torch.Tensor]:
    """A plain embedding's float32 rows on the CPU (what the native step looks up), else None."""
    w = getattr(m, "weight", None)
    if type(m) is not nn.Embedding or m.max_norm is not None or w is None:
        return None
    ok = w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and w.shape[1] == hidden and w.is_contiguous()
    return w.detach() if ok else None


def _kind(m: nn.Module) -> Optional[tuple[Any, ...]]:
    """What the native step must know is shared by all the layers: the quantization (mode, group size)
    or the dense weights' dtype; None for a layer it cannot take."""
    if m.weight.device.type != "cpu":
        return None
    if isinstance(m, QuantizedLinear):
        return ("quantized", m.mode, m.group_size)
    if isinstance(m, StreamedLinear) and m.weight.dtype in DENSE_DTYPES:
        return ("dense", m.weight.dtype)
    return None


def _one_new_position(t: torch.Tensor, kv_cache: Any, dims: int) -> bool:
    """``t`` holds one new position a sequence (``(B, 1, ...)`` of ``dims`` dimensions) on the CPU, over a
    growing float32 :class:`KVCache` (a static one's slots are bound by the model, not the native step)."""
    return (
        isinstance(kv_cache, KVCache)
        and not isinstance(kv_cache, StaticKVCache)
        and t.dim() == dims
        and t.shape[1] == 1
        and t.device.type == "cpu"
        and kv_cache.keys.dtype == torch.float32
    )


class FusedDecoder:
    """The native stack of one model's layers (built once; it references the layers' tensors)."""

    def __init__(self, native: Any, dense_head: Optional[torch.Tensor] = None):
        self.native = native
        self.dense_head = dense_head  # the head's fp32 or bf16 weight (V, hidden) where it is dense, for screen_head()
        self.normalizes = bool(native.has_final_norm)  # the step's output is after the model's final norm
        self.takes_positions = bool(native.has_rotary_tables)  # rotary: positions instead of cos/sin tables
        # token ids to logits in one call (embeddings, layers, final norm, head): :meth:`logits`
        self.takes_ids = bool(native.has_embeddings and native.has_head and native.has_final_norm)

    @classmethod
    def build(cls, parts: DecoderStackParts) -> Optional["FusedDecoder"]:
        """The fused step for these layers, or None where it does not apply (see the module docstring)."""
        if not enabled() or not parts.layers or parts.activation not in ACTIVATIONS:
            return None
        linears = [m for p in parts.layers for m in (*p.attn_in, p.o_proj, *p.mlp_in, p.mlp_out)]
        kinds = {_kind(m) for m in linears}
        if len(kinds) != 1 or None in kinds:
            return None
        hidden = parts.layers[0].o_proj.out_features
        norms = [(_norm(p.norm1, hidden), _norm(p.norm2, hidden)) for p in parts.layers]
        if any(n is None for pair in norms for n in pair):
            return None
        kernels = cpu_kernels()  # (the quantized or streamed layers have built it already)
        if kernels is None or not hasattr(kernels, "DecoderStack"):
            return None
        native = kernels.DecoderStack(hidden, parts.num_heads, parts.num_kv_heads, parts.head_dim, ACTIVATIONS[parts.activation], parts.rotary)
        for p, (n1, n2) in zip(parts.layers, norms):
            attn_in, mlp_in = [_linear(m) for m in p.attn_in], [_linear(m) for m in p.mlp_in]
            native.add_layer(n1, attn_in, _linear(p.o_proj), n2, mlp_in, _linear(p.mlp_out), float(p.attn_scale))
        final = _norm(parts.final_norm, hidden) if parts.final_norm is not None else None
        if final is not None:  # (a norm of another kind: the model applies it after the step)
            native.set_final_norm(final)
        rope = parts.rotary_emb
        if parts.rotary and rope is not None and rope.inv_freq.device.type == "cpu":
            native.set_rotary(rope.inv_freq, float(rope.attention_factor))
        tables = [_table(m, hidden) for m in parts.embeddings]
        head = parts.lm_head
        if (
            final is not None
            and (native.has_rotary_tables or not parts.rotary)
            and len(tables) == (1 if parts.rotary else 2)
            and all(t is not None for t in tables)
            and head is not None
            and _kind(head) is not None
            and head.in_features == hidden
        ):
            native.set_embeddings(*tables)
            native.set_head(_linear(head))
            if isinstance(head, StreamedLinear) and head.bias is None:
                return cls(native, head.weight.detach())
        return cls(native)

    def screen_head(self) -> bool:
        """Give the native step the screen of a dense head (built once; :meth:`greedy_steps` with ``screen``
        then reads the head's int8 copy and recomputes only the rows the bounds leave, choosing what the
        head would): whether it has one."""
        if self.native.has_head_screen:
            return True
        if self.dense_head is None:
            return False
        codes, scale, bound = head_screen(self.dense_head)
        self.native.set_head_screen(codes, scale, bound)
        return True

    @staticmethod
    def applies(x: torch.Tensor, kv_cache: Any) -> bool:
        """Whether this step can take ``x (B, 1, hidden)`` with this cache."""
        return _one_new_position(x, kv_cache, 3) and x.dtype == torch.float32 and not (torch.is_grad_enabled() and x.requires_grad)

    @staticmethod
    def applies_to_ids(ids: torch.Tensor, kv_cache: Any) -> bool:
        """Whether :meth:`logits` can take the token ids ``(B, 1)`` with this cache (and :attr:`takes_ids`)."""
        return _one_new_position(ids, kv_cache, 2)

    def __call__(
        self,
        x: torch.Tensor,
        kv_cache: KVCache,
        key_mask: Optional[torch.Tensor] = None,
        cos: Optional[torch.Tensor] = None,
        sin: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Every layer for ``x (B, 1, hidden)`` (the embeddings of the new positions): the hidden states
        ``(B, 1, hidden)``, after the model's final norm where :attr:`normalizes` (the parts named it),
        else before it; the new keys and values are written into the cache.
        ``key_mask (B, cached + 1)`` True for real tokens; for rotary models ``cos, sin (B, 1, head_dim)``, or
        the ``positions (B, 1)`` where :attr:`takes_positions` (the tables' rows are computed natively)."""
        b = x.shape[0]
        h = x.reshape(b, x.shape[-1]).contiguous()
        if h.data_ptr() == x.data_ptr() and x._base is not None:  # (a view of someone's tensor: work on a copy)
            h = h.clone()
        mask = key_mask if key_mask is None or key_mask.dtype == torch.bool else key_mask.bool()
        c = cos.reshape(b, -1) if cos is not None else None
        s = sin.reshape(b, -1) if sin is not None else None
        self.native.step(h, kv_cache.keys, kv_cache.values, kv_cache.length, mask, c, s, int8_activations(), positions)
        for layer in kv_cache.layers:
            layer.length += 1
        return h.view(b, 1, -1)

    def logits(
        self,
        ids: torch.Tensor,
        kv_cache: KVCache,
        key_mask: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        greedy: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Where :attr:`takes_ids`: the token ids ``(B, 1)`` of the new positions (``positions (B, 1)``, or
        the cache's length) through the embeddings, every layer, the final norm and the LM head in one
        call: ``(logits (B, V), the greedy choices (B,) or None)`` (``greedy``: torch.argmax's choices,
        computed in the same call); the new keys and values are written into the cache."""
        b = ids.shape[0]
        logits = torch.empty((b, self.native.vocab_size), dtype=torch.float32)
        chosen = torch.empty(b, dtype=torch.long) if greedy else None
        mask = key_mask if key_mask is None or key_mask.dtype == torch.bool else key_mask.bool()
        pos = positions.reshape(b) if positions is not None else None
        self.native.token_step(ids.reshape(b), pos, kv_cache.keys, kv_cache.values, kv_cache.length, mask, int8_activations(), logits, chosen)
        for layer in kv_cache.layers:
            layer.length += 1
        return logits, chosen

    def greedy_steps(
        self,
        ids: torch.Tensor,
        kv_cache: KVCache,
        steps: int,
        left: list[int],
        stop_ids: Sequence[int] = (),
        attention_mask: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        last_position: int = 0,
        screen: bool = False,
    ) -> torch.Tensor:
        """Where :attr:`takes_ids`: up to ``steps`` greedy decoding steps in one call, each step's choices the
        next step's ids (:meth:`logits` with ``greedy``, with no Python between the steps): ``ids (B, 1)``
        the first step's tokens, at ``positions (B, 1)`` (each step one further, at most ``last_position``)
        or the cache's length; ``left`` each row's budget of new tokens (0: finished); a row also finishes
        when it chooses one of ``stop_ids``. Returns the choices ``(B, k)``, ``k`` the steps run (fewer than
        ``steps`` where every row finished first); the cache holds their keys and values.
        ``attention_mask (B, >= cached + steps)`` True for real tokens. ``screen``: the choices through the
        head's screen (:meth:`screen_head`, given before), the same tokens for a fraction of the head's bytes."""
        screened = screen and self.native.has_head_screen
        return self._steps(ids, kv_cache, steps, left, stop_ids, attention_mask, positions, last_position, self.native.greedy_steps, screened)

    def sample_steps(
        self,
        ids: torch.Tensor,
        kv_cache: KVCache,
        steps: int,
        left: list[int],
        sampling: tuple[float, int, float, float, float],
        uniforms: Optional[torch.Tensor],
        seen: Optional[torch.Tensor] = None,
        stop_ids: Sequence[int] = (),
        attention_mask: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        last_position: int = 0,
    ) -> torch.Tensor:
        """:meth:`greedy_steps` with each step's tokens sampled natively (``csrc/sampling.cpp``: the choices of
        :func:`gencli.pipelines.text.sampling.next_tokens` up to float rounding): ``sampling`` is
        ``(temperature, top_k, top_p, min_p, repetition_penalty)`` (temperature 0: greedy after the penalty),
        ``uniforms (steps, B)`` float64 the draws (row b of step s takes ``uniforms[s, b]``; None when greedy),
        ``seen (B, n)`` the tokens each row has before the first step (the penalty's; each choice is added)."""
        draws = uniforms if uniforms is not None else torch.empty(0, dtype=torch.float64)
        return self._steps(ids, kv_cache, steps, left, stop_ids, attention_mask, positions, last_position, self.native.sample_steps, *sampling, draws, seen)

    @staticmethod
    def _steps(ids, kv_cache, steps, left, stop_ids, attention_mask, positions, last_position, run, *extra) -> torch.Tensor:
        """The native ``run`` (greedy_steps or sample_steps, ``extra`` its own arguments) over ``ids (B, 1)``:
        the choices ``(B, k)`` of the ``k`` steps it ran, their keys and values counted into the cache."""
        b = ids.shape[0]
        tokens = torch.empty((b, steps), dtype=torch.long)
        mask = attention_mask if attention_mask is None or attention_mask.dtype == torch.bool else attention_mask.bool()
        pos = positions.reshape(b) if positions is not None else None
        stop = torch.tensor(list(stop_ids), dtype=torch.long)
        budget = torch.tensor(left, dtype=torch.long)
        k = run(ids.reshape(b), pos, kv_cache.keys, kv_cache.values, kv_cache.length, mask, int8_activations(), tokens, stop, budget, last_position, *extra)
        for layer in kv_cache.layers:
            layer.length += k
        return tokens[:, :k]


def head_screen(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense head's screen for the native greedy step (built natively, ``csrc/decoder_step.cpp``):
    ``(codes (V, D) int8, scale (V,) bf16, bound (V,) float32)``. Each row ``w`` becomes ``w~ = q s`` (``s``
    its largest magnitude / 127 rounded to bf16, ``q`` the rounded quotients in [-127, 127]), and its bound
    per unit of the hidden state's norm covers

    - the copy's error: ``|h . w - h . w~| <= |h| |w - w~|`` (Cauchy-Schwarz, ``|w - w~|`` computed in
      double), and
    - both fp32 products' rounding: a sum of D products in any order is within ``(D + 2) 2^-24`` of
      ``sum |h_i w_i| <= |h| |w|`` (the head's, then ``|h| |w~|`` the copy's; doubled for safety),

    so the head's logit lies within ``|h| bound`` of the copy's: rows whose upper bound is below the best
    lower bound cannot be the head's choice."""
    from gencli.backend.quant_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        raise RuntimeError("the CPU kernels are not available")
    return kernels.head_screen(weight.detach())


__all__ = ["ACTIVATIONS", "DecoderLayerParts", "DecoderStackParts", "ENV_SWITCH", "FusedDecoder", "enabled", "head_screen"]
