"""The one attention entry point every model family calls.

``scaled_dot_product_attention`` covers self attention (optionally causal), padding masks, cross
attention, grouped-query attention and incremental decoding with a preallocated KV cache, on top of
``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels where the
backend has them). ``reference_attention`` is the plain softmax(QK^T/sqrt(d))V formula, used by the
tests to check it and by callers that need the attention weights themselves (``return_weights``).

Shapes: queries ``(B, H, Lq, D)``, keys and values ``(B, Hkv, Lk, D)`` with ``H % Hkv == 0``.
Masks in this module are boolean with True = "may attend".
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


class LayerKVCache:
    """One layer's slice of a :class:`KVCache`: appends new keys/values in place, no concatenation."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys = keys  # (B, Hkv, max_len, D) view into the cache storage
        self.values = values
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` (B, Hkv, n, D) after the cached positions; return views over all of them."""
        n = k.shape[2]
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} positions needed, capacity {self.capacity}")
        # narrow() is one call into C++ where basic indexing parses a tuple of slices: it matters
        # once per layer and token
        self.keys.narrow(2, self.length, n).copy_(k)
        self.values.narrow(2, self.length, n).copy_(v)
        self.length = end
        return self.keys.narrow(2, 0, end), self.values.narrow(2, 0, end)

    def visible(self) -> Optional[torch.Tensor]:
        """The keys each new query may see when the cache decides it (a static cache); None: the
        causal rule aligned to the end of the cached keys."""
        return None


class KVCache:
    """Keys and values of every layer, preallocated once for ``max_len`` positions.

    Each new token costs one forward step: layers write their new keys/values into the next free
    slots and attend over the views ``[:length]``.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [LayerKVCache(self.keys[i], self.values[i]) for i in range(num_layers)]

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        """Positions already cached (what the next token's position offset is)."""
        return self.layers[0].length if self.layers else 0

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def reset(self) -> None:
        for layer in self.layers:
            layer.length = 0

    def reorder_rows(self, index: torch.Tensor) -> None:
        """Each sequence's cached keys/values replaced by those of sequence ``index[i]`` (``(B,)``, long),
        in place: beam search keeps the beams it extends."""
        n = self.length
        if n == 0:
            return
        for store in (self.keys, self.values):
            part = store.narrow(3, 0, n)
            part.copy_(part.index_select(1, index))


class StaticLayerKVCache(LayerKVCache):
    """One layer's slice of a :class:`StaticKVCache`: new keys/values are written at the cache's
    position tensor and attention always runs over every slot, masked: shapes never change."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: "StaticKVCache"):
        super().__init__(keys, values)
        self.owner = owner

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        position = self.owner.cache_position
        self.keys.index_copy_(2, position, k)
        self.values.index_copy_(2, position, v)
        return self.keys, self.values

    def visible(self) -> Optional[torch.Tensor]:
        return self.owner.visible_keys


class StaticKVCache(KVCache):
    """A :class:`KVCache` for decoding steps of fixed shapes (what a captured CUDA graph or a compiled
    step replays): before each forward pass :meth:`bind` gives the slots of the new positions as a
    tensor; the layers write there (``index_copy_``) and attend over all ``max_len`` slots with the
    mask "slot <= the query's position", so no shape depends on how much is cached."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layers = [StaticLayerKVCache(self.keys[i], self.values[i], self) for i in range(len(self.layers))]
        self.cache_position: Optional[torch.Tensor] = None
        self.visible_keys: Optional[torch.Tensor] = None
        self._slots = torch.arange(self.max_len, device=self.keys.device)

    def bind(self, cache_position: torch.Tensor) -> None:
        """The slots ``(n,)`` the next forward pass writes (its positions in the cache)."""
        self.cache_position = cache_position
        self.visible_keys = (self._slots[None, :] <= cache_position[:, None])[None, None]  # (1, 1, n, max_len)


def build_mask(
    q_len: int,
    k_len: int,
    *,
    causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    device: torch.device | str | None = None,
) -> Optional[torch.Tensor]:
    """Combine the causal rule, a key padding mask and an explicit mask into one boolean mask.

    The causal rule is bottom-right aligned: query ``i`` sits at absolute position ``k_len - q_len + i``
    and may attend keys at positions ``<=`` its own (so it also holds with a KV cache).
    ``key_padding_mask`` is ``(B, k_len)`` with True for real tokens. ``attn_mask`` is boolean
    (True = attend) or additive float, broadcastable to ``(B, H, q_len, k_len)``.
    Returns None when nothing is masked, else a tensor broadcastable to ``(B, H, q_len, k_len)``
    (boolean unless ``attn_mask`` was additive).
    """
    mask: Optional[torch.Tensor] = None
    if causal and not (q_len == 1 and k_len >= 1):
        offset = k_len - q_len
        if offset < 0:
            raise ValueError(f"causal attention with more queries ({q_len}) than keys ({k_len})")
        qi = torch.arange(q_len, device=device).unsqueeze(1) + offset
        kj = torch.arange(k_len, device=device).unsqueeze(0)
        mask = (kj <= qi).view(1, 1, q_len, k_len)
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(device=device, dtype=torch.bool)
        if kpm.shape[-1] != k_len:
            raise ValueError(f"key_padding_mask covers {kpm.shape[-1]} keys, attention has {k_len}")
        kpm = kpm.view(kpm.shape[0], 1, 1, k_len)
        mask = kpm if mask is None else (mask & kpm)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask if mask is None else (mask & attn_mask)
        else:
            additive = attn_mask
            if mask is not None:
                additive = additive.masked_fill(~mask, float("-inf"))
            return additive
    if mask is not None:
        # A query that may attend nothing (e.g. a left-padding position) would give NaN; let it
        # attend everything instead: its output is never used, but it stays finite.
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T * scale + mask) V, written out; returns (output, weights).

    Computed in at least fp32 (fp64 inputs stay fp64); the output is cast back to ``q.dtype``.
    """
    work = torch.promote_types(q.dtype, torch.float32)
    n_rep = q.shape[1] // k.shape[1]
    k = _repeat_kv(k, n_rep).to(work)
    v = _repeat_kv(v, n_rep).to(work)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.to(work), k.transpose(-1, -2)) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(work)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, v).to(q.dtype), weights


def _decode_attention(q, k, v, key_padding_mask, scale) -> Optional[torch.Tensor]:
    """One query position per sequence (decoding; the causal rule then allows every cached key) by
    the CPU kernel of ``csrc/decode_attention.cpp``: torch's CPU flash kernel spends most of its
    ~30 us a call on fixed costs at this size. Only where the compiled CPU extension is loaded
    already (quantized decoding, :func:`gencli.backend.quant_kernels.loaded_kernels`), for fp32
    tensors on a CPU outside autograd; else None (torch's kernel runs)."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    from gencli.backend.quant_kernels import loaded_kernels

    kernels = loaded_kernels()
    if kernels is None or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (q.shape[0], k.shape[2])):
        return None  # (build_mask says what is wrong with a mask of another shape)
    return kernels.decode_attention(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale, key_padding_mask)


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    kv_cache: Optional[LayerKVCache] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
):
    """Attention for every family in gencli.

    - self attention: ``q, k, v`` from the same sequence; ``causal=True`` for decoders;
    - cross attention: ``k, v`` from a context sequence (``causal=False``), optionally with a
      ``key_padding_mask`` over the context;
    - incremental decoding: pass the layer's ``kv_cache``; ``k, v`` are then only the new positions,
      they are appended to the cache and attention runs over every cached position (the causal rule
      is aligned to the end, so a chunk of several new tokens also works);
    - grouped-query attention: ``k, v`` may have fewer heads than ``q``.

    Returns the output ``(B, H, Lq, D)``, or ``(output, weights)`` with ``return_weights=True``
    (computed by the explicit formula, for interpretability).
    """
    if kv_cache is not None:
        k, v = kv_cache.update(k, v)
        visible = kv_cache.visible()
        if visible is not None:  # a static cache: which slots each query sees is its mask, not the causal rule
            attn_mask, causal = visible if attn_mask is None else attn_mask & visible, False
    q_len, k_len = q.shape[2], k.shape[2]
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")

    if return_weights:
        mask = build_mask(q_len, k_len, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask, device=q.device)
        out, weights = reference_attention(q, k, v, mask, scale)
        if dropout_p > 0.0:
            raise ValueError("return_weights is for inference; dropout is not applied on that path")
        return out, weights

    if q_len == 1 and attn_mask is None and dropout_p == 0.0:
        out = _decode_attention(q, k, v, key_padding_mask, scale)
        if out is not None:
            return out
    # Fast path: plain causal self attention over the whole sequence uses the kernel's own flag.
    use_flag = causal and q_len == k_len and key_padding_mask is None and attn_mask is None
    mask = None if use_flag else build_mask(q_len, k_len, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask, device=q.device)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    if gqa and mask is not None:
        # enable_gqa is not implemented by every kernel together with a mask: expand explicitly.
        n_rep = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        gqa = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=use_flag, scale=scale, enable_gqa=gqa
    )
