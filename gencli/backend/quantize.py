"""Weight-only quantized linear layers (int8 per output channel, int4 per group), for every family.

:class:`QuantizedLinear` stores a linear layer's weight in 8 or 4 bits and is swapped into a model
from outside it (:func:`quantize_linears`, or :func:`quantizing_loader` while a checkpoint loads).
On a CPU, below ``DEQUANTIZE_MIN_ROWS[mode]`` rows (decoding), it runs gencli's own kernels
(:mod:`gencli.backend.quant_kernels`) or, where those cannot be built, torch's weight-only kernels;
from that many rows on (a prompt's prefill) the weight is dequantized for the call. Other devices
dequantize on every call. The design and its measurements: docs/quantization.md.

Stored layout (the tensors a quantized safetensors checkpoint holds, under the layer's name):

- ``int8``: ``weight`` int8 ``(out, in)``, ``weight_scale`` ``(out,)``; ``w = q * scale``
  (symmetric, per output channel, q in [-127, 127]).
- ``int4``: ``weight`` uint8 ``(out, in / 2)`` (two 4-bit codes per byte, the even input column in
  the low nibble), ``weight_scale`` and ``weight_zero`` ``(out, in / group_size)``;
  ``w = (q - 8) * scale + zero`` per group of ``group_size`` input columns (asymmetric min/max,
  q in [0, 15]: the convention of torch's int4 kernels).

Scales and zeros are rounded to bf16 before the codes are chosen (the kernels take them in the
activations' dtype), so the stored codes are the best ones for the scales the kernels use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn

from gencli.backend.device import MemoryTrimmer, release_free_memory
from gencli.backend.huge_pages import empty_on_huge_pages
from gencli.backend.layers import dense_of as _dense_of
from gencli.backend.layers import get_activation, linear, loading_builder
from gencli.backend.quant_kernels import cpu_kernels, int8_activations

MODES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 CPU kernel takes
DEFAULT_GROUP_SIZE = 32  # int4: input columns per scale/zero pair (llama.cpp's Q4_0 uses 32 too)
# from this many rows the weight is dequantized for the call and multiplied by a dense bf16 GEMM:
# the weight-only kernels cost rows x a matrix-vector product, dequantizing costs the same whatever
# the rows (int4 about twice int8). Break-even on a 2-core AMX CPU, 1 thread, layers of 3072x768,
# 768x3072 and 2816x1024 (ms, kernel / dequantize + GEMM): int8 at 32 rows 4.3-5.5 / 3.4-5.7, at 64
# rows 6.9-9.6 / 4.4-5.9; int4 at 64 rows 6.4-11.7 / 10.7-14.0, at 96 rows 10.2-13.0 / 10.9-12.1,
# at 128 rows 12.4-15.7 / 11.7-13.8
DEQUANTIZE_MIN_ROWS = {"int8": 32, "int4": 96}
_INT4_PACK_ROWS = 16  # torch's CPU int4 packing takes a multiple of 16 output rows
_SCALE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class QuantizationSpec:
    """How a model's linear layers are quantized: what ``config.json`` records under
    ``quantization_config`` (transformers' key; ``quant_method`` "gencli")."""

    mode: str  # "int8" | "int4"
    group_size: int = -1  # int4: input columns per group; int8: -1 (per output channel)
    modules_to_not_convert: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown quantization '{self.mode}' (known: {', '.join(MODES)})")
        if self.mode == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"the int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} (got {self.group_size})")

    @classmethod
    def for_mode(cls, mode: str, group_size: Optional[int] = None) -> "QuantizationSpec":
        if mode == "int4":  # (0 is not "the default": the check in __post_init__ refuses it)
            return cls(mode, DEFAULT_GROUP_SIZE if group_size is None else group_size)
        return cls(mode, -1)

    @property
    def bits(self) -> int:
        return 8 if self.mode == "int8" else 4

    def to_config(self) -> dict[str, Any]:
        return {
            "quant_method": "gencli",
            "mode": self.mode,
            "bits": self.bits,
            "group_size": self.group_size,
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "QuantizationSpec":
        """The spec a ``quantization_config`` entry describes (ValueError for other methods)."""
        method = cfg.get("quant_method")
        if method != "gencli":
            raise ValueError(f"quantization method '{method}' is not supported (gencli reads the checkpoints 'gencli quantize' writes)")
        return cls(str(cfg.get("mode")), int(cfg.get("group_size", -1)), tuple(cfg.get("modules_to_not_convert") or ()))


# -- quantizing a weight --------------------------------------------------------------------------------
_CHUNK_ROWS = 2048  # rows quantized at a time: the fp32 temporaries of a 50k-row LM head stay small


def _by_rows(fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn`` applied to blocks of rows of ``weight``, the results written into tensors of all the
    rows allocated once (no concatenation: the temporaries of every block are the same size and
    reuse the same memory, and no long-lived part sits between them in the C allocator's heap)."""
    rows = weight.shape[0]
    first = fn(weight[:_CHUNK_ROWS])
    # (on a CPU with GENCLI_HUGE_PAGES=1 the codes go on 2 MB pages, where decoding streams them faster:
    # backend.huge_pages; empty_on_huge_pages is torch.empty otherwise)
    cpu = weight.device.type == "cpu"
    shapes = [((rows, *p.shape[1:]), p.dtype) for p in first]
    outs = tuple(empty_on_huge_pages(s, d) if cpu else torch.empty(s, dtype=d, device=weight.device) for s, d in shapes)
    for out, part in zip(outs, first):
        out[: part.shape[0]] = part
    del first
    for i in range(_CHUNK_ROWS, rows, _CHUNK_ROWS):
        for out, part in zip(outs, fn(weight[i : i + _CHUNK_ROWS])):
            out[i : i + part.shape[0]] = part
    return outs


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 (out, in), scale (out,))`` with ``weight ~ q * scale[:, None]`` (symmetric per row)."""
    if weight.shape[0] > _CHUNK_ROWS:
        return _by_rows(quantize_int8, weight)  # type: ignore[return-value]
    w = weight.detach().float().contiguous()  # (GPT-2's Conv1D weights come as transposed views)
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(_SCALE_DTYPE)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed uint8 (out, in/2), scale (out, in/g), zero (out, in/g))`` with ``weight ~ (q - 8) *
    scale + zero`` per group of ``group_size`` input columns (asymmetric min/max)."""
    out_f, in_f = weight.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of the group size {group_size}")
    if out_f > _CHUNK_ROWS:
        return _by_rows(lambda rows: quantize_int4(rows, group_size), weight)  # type: ignore[return-value]
    w = weight.detach().float().contiguous().reshape(out_f, in_f // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12).to(_SCALE_DTYPE)
    zero = (lo + 8.0 * scale.float()).to(_SCALE_DTYPE)
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    q = torch.round((w - z) / s + 8.0).clamp_(0, 15).to(torch.uint8).reshape(out_f, in_f)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, zero


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes ``(out, in)`` (uint8, 0..15) of a packed ``(out, in/2)`` weight."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize(mode: str, weight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``(out, in)`` weight a stored quantized layer stands for, in ``dtype``.

    Written for the prefill, which dequantizes every layer once per prompt: the codes go straight into
    the output tensor and are scaled in place (one pass per step, no temporaries of the weight's size)."""
    if mode == "int8":
        return weight.to(dtype).mul_(scale.to(dtype)[:, None])
    out_f, groups = scale.shape
    w = torch.empty(out_f, weight.shape[1], 2, dtype=dtype, device=weight.device)
    w[..., 0] = weight & 15  # the even input column, low nibble
    w[..., 1] = weight >> 4
    w = w.view(out_f, groups, -1)
    return w.sub_(8).mul_(scale.to(dtype).unsqueeze(-1)).add_(zero.to(dtype).unsqueeze(-1)).view(out_f, -1)


@functools.lru_cache(maxsize=None)
def _cpu_kernel(mode: str) -> bool:
    ops = torch.ops.aten
    names = ("_weight_int8pack_mm",) if mode == "int8" else ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
    return all(hasattr(ops, n) for n in names)


class QuantizedLinear(nn.Module):
    """A linear layer with a weight-only quantized weight (see the module docstring for the stored
    layout); ``forward(x, activation=None)`` as :class:`gencli.backend.layers.Linear`'s. The bias,
    when there is one, stays in floating point.

    gencli's CPU kernels read the stored codes as they are. Only where they are unavailable are the
    int4 codes repacked into torch's kernel layout, on the first inference call (that packed copy is
    kept beside the stored codes, which the prefill's dequantization reads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: QuantizationSpec, *, device=None):
        super().__init__()
        self.in_features, self.out_features, self.mode = in_features, out_features, spec.mode
        self.group_size = spec.group_size
        if spec.mode == "int8":
            self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
            self.register_buffer("weight_scale", torch.empty(out_features, dtype=_SCALE_DTYPE, device=device))
            self.weight_zero = None
        else:
            if in_features % spec.group_size:
                raise ValueError(f"in_features {in_features} is not a multiple of the group size {spec.group_size}")
            groups = in_features // spec.group_size
            self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
            self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=_SCALE_DTYPE, device=device))
            self.register_buffer("weight_zero", torch.empty(out_features, groups, dtype=_SCALE_DTYPE, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None
        self._kernel: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (packed codes, scales) for the CPU kernel

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: QuantizationSpec) -> "QuantizedLinear":
        """Quantize a dense ``(out, in)`` weight (on the meta device: an empty layer of that shape)."""
        out_f, in_f = weight.shape
        layer = cls(in_f, out_f, bias is not None, spec, device=weight.device)
        if weight.is_meta:
            return layer
        if spec.mode == "int8":
            layer.weight, layer.weight_scale = quantize_int8(weight)
        else:
            layer.weight, layer.weight_scale, layer.weight_zero = quantize_int4(weight, spec.group_size)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    @staticmethod
    def supports(weight_shape: tuple[int, int], spec: QuantizationSpec) -> bool:
        """Whether a layer of this ``(out, in)`` shape can be quantized with ``spec``."""
        return spec.mode == "int8" or weight_shape[1] % spec.group_size == 0

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight this layer multiplies by."""
        return dequantize(self.mode, self.weight, self.weight_scale, self.weight_zero, dtype)

    def _cpu_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kernel is None:
            if self.mode == "int8":
                self._kernel = (self.weight, self.weight_scale.to(torch.bfloat16))
            else:
                codes = unpack_int4(self.weight).to(torch.int32)
                pad = -self.out_features % _INT4_PACK_ROWS
                scale_zero = torch.stack((self.weight_scale, self.weight_zero), dim=-1).to(torch.bfloat16)
                if pad:
                    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad), value=8)
                    scale_zero = torch.nn.functional.pad(scale_zero, (0, 0, 0, 0, 0, pad))
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
                self._kernel = (packed, scale_zero.transpose(0, 1).contiguous())  # (groups, out, 2)
        return self._kernel

    def _few_rows_on_cpu(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, bool]]:
        """``(x @ W.T, whether the bias is added)`` for a few rows of ``x (..., in)`` on a CPU by a
        quantized kernel: gencli's own (the stored codes read in place; int8 activations by default,
        fp32 with ``GENCLI_QUANT_ACTIVATIONS=fp32``; the bias added in the call; one call from
        Python, which decoding makes for every layer and token) or else torch's (bf16 activations);
        None when neither is available."""
        own = cpu_kernels()
        if own is not None:
            x = x if x.dtype == torch.float32 else x.float()
            if self.mode == "int8":
                return own.int8_gemv(x, self.weight, self.weight_scale, int8_activations(), self.bias), True
            return own.int4_gemv(x, self.weight, self.weight_scale, self.weight_zero, self.group_size, int8_activations(), self.bias), True
        if not _cpu_kernel(self.mode):
            return None
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        weight, scales = self._cpu_operands()
        if self.mode == "int8":
            out = torch.ops.aten._weight_int8pack_mm(flat, weight, scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, weight, self.group_size, scales)[:, : self.out_features]
        return out.reshape(*x.shape[:-1], self.out_features), False

    def forward(self, x: torch.Tensor, activation: Optional[str] = None) -> torch.Tensor:
        on_cpu = x.device.type == "cpu"
        if on_cpu and x.numel() < DEQUANTIZE_MIN_ROWS[self.mode] * self.in_features:
            done = self._few_rows_on_cpu(x)
            if done is not None:
                out, biased = done
                return self._finish(out if out.dtype == x.dtype else out.to(x.dtype), activation, bias=not biased)
        dtype = torch.bfloat16 if on_cpu and x.dtype == torch.float32 else x.dtype
        if self.mode == "int8":  # one scale per output channel: it scales the product's columns
            out = linear(x.to(dtype), self.weight.to(dtype)).mul_(self.weight_scale.to(dtype))
            return self._finish(out, activation).to(x.dtype)
        bias = self.bias.to(dtype) if self.bias is not None else None
        return linear(x.to(dtype), self.dequantized(dtype), bias, activation).to(x.dtype)

    def _finish(self, out: torch.Tensor, activation: Optional[str], *, bias: bool = True) -> torch.Tensor:
        """The bias (unless the product has it already) and the activation, on a product computed
        without them."""
        if bias and self.bias is not None:
            out = out.add_(self.bias.to(out.dtype))
        return out if activation is None else get_activation(activation)(out)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        self._kernel = None  # rebuilt for the new device/dtype on the next call
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.mode == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, mode={self.mode}{group}"

    @staticmethod
    def project_together(x: torch.Tensor, layers: tuple[nn.Module, ...], activations: tuple[Optional[str], ...]) -> Optional[tuple[torch.Tensor, ...]]:
        """Several projections of ``x`` in one call (:func:`project_together`); None where it does not apply."""
        return project_together(x, layers, activations)


def project_together(x: torch.Tensor, layers: tuple[nn.Module, ...], activations: tuple[Optional[str], ...]) -> Optional[tuple[torch.Tensor, ...]]:
    """The :func:`gencli.backend.layers.project` of several :class:`QuantizedLinear` of one mode
    decoding on a CPU with gencli's kernels, as one call: ``x``'s int8 activations are computed once
    and every weight's rows run in one parallel pass. None where that does not apply."""
    first = layers[0]
    if not (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.numel() < DEQUANTIZE_MIN_ROWS[first.mode] * first.in_features
        and all(isinstance(m, QuantizedLinear) and (m.mode, m.group_size, m.in_features) == (first.mode, first.group_size, first.in_features) for m in layers)
    ):
        return None
    own = cpu_kernels()
    if own is None:
        return None
    weights, scales, biases = [m.weight for m in layers], [m.weight_scale for m in layers], [m.bias for m in layers]
    if first.mode == "int8":
        outs = own.int8_gemv_many(x, weights, scales, int8_activations(), biases)
    else:
        outs = own.int4_gemv_many(x, weights, scales, [m.weight_zero for m in layers], first.group_size, int8_activations(), biases)
    return tuple(out if a is None else get_activation(a)(out) for out, a in zip(outs, activations))


# -- quantizing a model ----------------------------------------------------------------------------------
def quantization_targets(
    model: nn.Module, spec: QuantizationSpec, *, include: Optional[Callable[[str], bool]] = None
) -> tuple[list[str], QuantizationSpec]:
    """``(names, spec)``: the linear layers of ``model`` that ``spec`` quantizes (those ``include``
    accepts, not in ``spec.modules_to_not_convert``), and the spec with the layers that cannot be
    quantized (shapes the group size does not divide) added to ``modules_to_not_convert``."""
    skipped = list(spec.modules_to_not_convert)
    names = []
    for name, module in model.named_modules():
        dense = _dense_of(module) if name else None
        if dense is None or name in skipped or (include is not None and not include(name)):
            continue
        if not QuantizedLinear.supports(tuple(dense[0].shape), spec):
            skipped.append(name)
            continue
        names.append(name)
    return names, QuantizationSpec(spec.mode, spec.group_size, tuple(skipped))


def quantizing_loader(spec: QuantizationSpec) -> Callable[[nn.Module, dict[str, torch.Tensor]], nn.Module]:
    """A builder for :func:`gencli.checkpoints.loader.load_state`'s ``replace``: the linear layer
    ``module`` (on meta) given its loaded ``tensors`` becomes a :class:`QuantizedLinear`, so that a
    model is quantized one layer at a time while it loads (:func:`gencli.backend.layers.loading_builder`)."""
    return loading_builder(lambda weight, bias: QuantizedLinear.from_weight(weight, bias, spec))


def quantize_linears(
    model: nn.Module,
    spec: QuantizationSpec,
    *,
    include: Optional[Callable[[str], bool]] = None,
    report: Optional[Callable[[str], None]] = None,
) -> QuantizationSpec:
    """Replace every linear layer of ``model`` (see :func:`quantization_targets`) by a
    :class:`QuantizedLinear`, in place; tied weights are untied (an LM head tied to the embedding
    gets its own quantized copy, the embedding keeps its dtype). Each layer's dense weight is
    released as soon as it is quantized (unless something else holds it).

    On a model built on the meta device the layers are empty, ready for a quantized checkpoint.
    Returns the spec with the layers that could not be quantized added to ``modules_to_not_convert``.
    """
    names, spec = quantization_targets(model, spec, include=include)
    trim = MemoryTrimmer()
    if names:
        release_free_memory()  # what loading left free (see quantizing_loader), before a large head
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weight, bias = _dense_of(getattr(parent, attr))  # type: ignore[misc]
        setattr(parent, attr, QuantizedLinear.from_weight(weight, bias, spec))
        trim.freed(weight.numel() * weight.element_size())
        del weight, bias
        if report is not None:
            report(name)
    forget = getattr(model, "forget_fused_decoder", None)  # (a model's fused decoding step points at the old layers)
    if callable(forget):
        forget()
    return spec


def quantized_layers(model: nn.Module) -> Iterable[tuple[str, QuantizedLinear]]:
    return ((n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear))


__all__ = [
    "MODES",
    "DEFAULT_GROUP_SIZE",
    "INT4_GROUP_SIZES",
    "QuantizationSpec",
    "QuantizedLinear",
    "quantize_int8",
    "quantize_int4",
    "unpack_int4",
    "dequantize",
    "quantize_linears",
    "project_together",
    "quantization_targets",
    "quantizing_loader",
    "quantized_layers",
]
