"""bf16 linear layers with their weights held in oneDNN's blocked layout, for CPU decoding.

``F.linear`` on bf16 CPU tensors hands the dense weight to oneDNN on every call, which reorders it
into its own blocked layout first; for the few rows of a decoding step (one per sequence or beam)
that reorder costs as much as the product. :func:`pack_linears` swaps every linear layer of a bf16
model for a :class:`PackedLinear` whose weight is reordered once, when the model is loaded; each call
then runs oneDNN's matmul (AMX tiles where the CPU has them) with the bias and the activation fused
into it. Measured on a 2-core AMX CPU, one thread, one row: a 2048x512 layer 149 us -> 75 us, a
32128x512 LM head 2.7 ms -> 1.4 ms; with four rows (4-beam search) the fp32 head takes 7.2 ms.

The values are those of ``F.linear`` in bf16 up to the kernel's summation order. Swapping is done from
outside the model (as :func:`gencli.backend.quantize.quantize_linears` does): a tied LM head gets
its own packed copy and the embedding keeps its dense weight. A packed layer serves inference only;
with autograd on, or for an input of another dtype or device, it falls back to ``F.linear`` on its
weight unpacked.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.device import cpu_has_native_bf16
from gencli.backend.layers import _ONEDNN_POST_OPS, _onednn_ops_available, get_activation, swap_linears
from gencli.errors import Notice

_OPS = ("_reorder_linear_weight", "_linear_pointwise")


def packing_available() -> bool:
    """Whether this torch build and CPU run oneDNN's packed bf16 matmul."""
    return _onednn_ops_available(_OPS, bf16=True)


class PackedLinear(nn.Module):
    """A bf16 linear layer (``forward(x, activation=None)`` as :class:`gencli.backend.layers.Linear`'s)
    whose weight is held reordered for oneDNN; ``weight`` gives it back dense."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], rows_hint: int = 1):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        dense = weight.detach().to(torch.bfloat16).contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, rows_hint)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor, activation: Optional[str] = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or torch.is_grad_enabled():
            out = F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
            return out if activation is None else get_activation(activation)(out)
        fused = activation in _ONEDNN_POST_OPS
        op, algorithm = _ONEDNN_POST_OPS[activation if fused else None]
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, op, [], algorithm)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if fused else get_activation(activation)(out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, bf16 packed"


def pack_linears(model: nn.Module, *, include: Optional[Callable[[str], bool]] = None, rows_hint: int = 1) -> int:
    """Replace every linear layer of a bf16 CPU ``model`` whose name ``include`` accepts by a
    :class:`PackedLinear`, in place; returns how many. Linear layers are ``nn.Linear`` (gencli's
    :class:`~gencli.backend.layers.Linear` included) and modules offering ``linear_weight()`` (GPT-2's
    Conv1D, stored ``(in, out)``), as :func:`gencli.backend.layers.dense_of` finds them. Nothing is swapped
    where :func:`packing_available` is False. Each dense weight no other module holds (a tied
    embedding does) is released."""
    if not packing_available():
        return 0
    return swap_linears(
        model,
        lambda weight, bias: PackedLinear(weight, bias, rows_hint),
        accept=lambda weight: weight.dtype == torch.bfloat16 and weight.device.type == "cpu",
        include=include,
        keep=(PackedLinear,),
    )


def stream_bf16_weights(model: torch.nn.Module) -> bool:
    """Hold the linear layers of a bf16 CPU ``model`` (the LM head included) in oneDNN's packed layout
    (:func:`pack_linears`) where the CPU multiplies bf16 natively
    (AVX512_BF16 or AMX): a decoding step then streams the weights instead of reordering them on
    every product (GPT-2-124M shape, one thread: about 1.6x the steps of ``F.linear`` in bf16, see
    docs/benchmarks.md). Elsewhere the model runs as it is, correct but slower than fp32, after one
    notice. Returns whether the layers were packed."""
    if cpu_has_native_bf16() and packing_available():
        return pack_linears(model) > 0
    warnings.warn(
        "decoding in bfloat16: this CPU has no native bf16 products (AVX512_BF16/AMX): computed correctly "
        "but slower than in float32",
        Notice,
        stacklevel=2,
    )
    return False
