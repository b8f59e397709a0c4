"""Linear layers held for CPU decoding: dense row-major weights in float32 or bfloat16, multiplied in fp32.

Decoding one token multiplies every weight of a model by one activation row (a few with beams or
batches): its time is the time it takes to read the weights. :class:`StreamedLinear` holds a layer's
weight as ``(out, in)`` rows, contiguous, in float32 or in bfloat16 (half the bytes to read), and
multiplies up to a few dozen rows by gencli's kernels (``csrc/quant_gemv.cpp``: the bf16 values widened to fp32
in registers, FMA into fp32 sums), so with bf16 weights only the weights are rounded: activations,
accumulation, norms, attention and the KV cache stay fp32 (llama.cpp's BF16 rounds the activations to
bf16 as well). From ``DENSE_MAX_ROWS`` rows on (a prompt's prefill) the product is torch's, over the
weight widened to fp32 for the call. The fused decoding step (:mod:`gencli.backend.decoder_step`)
reads the same tensors in place.

:func:`stream_linears` swaps them into a model from outside it, as
:func:`gencli.backend.quantize.quantize_linears` does with quantized layers: GPT-2's ``Conv1D``
(stored ``(in, out)``) gets a row-major copy, an fp32 ``nn.Linear`` is referenced as it is (no copy),
a tied LM head in bf16 gets its own copy and the embedding keeps its weight.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.huge_pages import empty_on_huge_pages, on_huge_pages
from gencli.backend.layers import get_activation, loading_builder, swap_linears
from gencli.backend.quant_kernels import cpu_kernels

DTYPES = (torch.float32, torch.bfloat16)
# below this many rows gencli's kernel (the weight read from memory once, each chunk of it multiplied by
# 4 rows at a time from the cache); from there on torch's GEMM, over the weight widened to fp32 when it
# is bf16 (a copy of the weight per call). Measured on the 2-core AMX CPU, 2 threads, layers of
# 2816x1024, 1024x2816 and 3072x768 (ms, kernel / torch): bf16 at 32 rows 0.73-0.87 / 1.23-1.43, at 64
# 1.44-1.76 / 1.83-1.96, at 128 2.84-3.58 / 2.31-3.88; fp32 at 16 rows 0.40-0.48 / 0.46-0.70, at 32
# 0.73-0.87 / 0.68-0.95
DENSE_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 96}


class StreamedLinear(nn.Module):
    """A linear layer (``forward(x, activation=None)`` as :class:`gencli.backend.layers.Linear`'s)
    whose ``weight`` is a contiguous ``(out, in)`` float32 or bfloat16 buffer; the bias, when there is
    one, is fp32. Outputs are fp32 for fp32 inputs whatever the weight's dtype."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        if weight.dim() != 2 or weight.dtype not in DTYPES:
            raise ValueError(f"StreamedLinear takes a 2-D float32 or bfloat16 weight (got {tuple(weight.shape)} {weight.dtype})")
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()  # a contiguous weight as it is (it may be tied); a copy onto 2 MB pages (backend.huge_pages)
        self.register_buffer("weight", weight if weight.is_contiguous() else on_huge_pages(weight).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def linear_weight(self) -> torch.Tensor:
        """The ``(out, in)`` weight (what :func:`gencli.backend.layers.dense_of` reads)."""
        return self.weight

    def forward(self, x: torch.Tensor, activation: Optional[str] = None) -> torch.Tensor:
        kernels = cpu_kernels() if x.device.type == "cpu" and self.weight.device.type == "cpu" else None
        rows = x.numel() // max(1, self.in_features)
        few = rows < DENSE_MAX_ROWS.get(self.weight.dtype, 0)  # (a weight converted to another dtype since: torch's product)
        if kernels is not None and x.dtype == torch.float32 and few and not (torch.is_grad_enabled() and x.requires_grad):
            out = kernels.dense_gemv(x, self.weight, self.bias)
        else:
            out = F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return out if activation is None else get_activation(activation)(out)

    def extra_repr(self) -> str:
        dtype = str(self.weight.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {dtype} weights, fp32 products"


def streaming_available() -> bool:
    """Whether gencli's CPU kernels (the products and the fused step) can be had here."""
    return cpu_kernels() is not None


def streaming_loader(dtype: torch.dtype) -> Callable[[nn.Module, dict[str, torch.Tensor]], nn.Module]:
    """A builder for :func:`gencli.checkpoints.loader.load_state`'s ``replace``: the linear layer
    ``module`` (on meta) given its loaded ``tensors`` becomes a :class:`StreamedLinear` of ``dtype``
    weights while the model loads, one layer at a time from plain file reads
    (:func:`gencli.backend.layers.loading_builder`): neither the file's pages nor a second copy of the
    model are held."""
    build = loading_builder(lambda weight, bias: StreamedLinear(weight.detach().to(dtype), bias))
    build.allocate = empty_on_huge_pages  # type: ignore[attr-defined]  # (read where StreamedLinear keeps it: no copy)
    return build


def stream_linears(model: nn.Module, dtype: torch.dtype, *, include: Optional[Callable[[str], bool]] = None) -> int:
    """Replace every linear layer of a CPU ``model`` whose name ``include`` accepts (``nn.Linear`` and
    modules offering ``linear_weight()``, as :func:`~gencli.backend.layers.dense_of` finds them) by a
    :class:`StreamedLinear` of ``dtype`` weights, in place (:func:`gencli.backend.layers.swap_linears`:
    one layer at a time); returns how many (0 where gencli's kernels cannot be built)."""
    if dtype not in DTYPES:
        raise ValueError(f"stream_linears: float32 or bfloat16 (got {dtype})")
    if not streaming_available():
        return 0
    return swap_linears(
        model,
        lambda weight, bias: StreamedLinear(weight.detach().to(dtype), bias),
        accept=lambda weight: weight.is_floating_point() and weight.device.type == "cpu" and weight.dim() == 2,
        include=include,
        keep=(StreamedLinear,),
    )


__all__ = ["DENSE_MAX_ROWS", "DTYPES", "StreamedLinear", "stream_linears", "streaming_available", "streaming_loader"]
