"""Normalisations and activations, written once for every family.

Key names follow transformers/diffusers (``weight``/``bias``) so checkpoints map onto them directly.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.device import MemoryTrimmer, release_free_memory
from gencli.backend.winograd import eligible as winograd_eligible
from gencli.backend.winograd import fits_in_memory as winograd_fits_in_memory
from gencli.backend.winograd import kernels as winograd_kernels
from gencli.backend.winograd import transform_bytes as winograd_transform_bytes
from gencli.backend.winograd import winograd_weight


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama family): x / sqrt(mean(x^2) + eps) * weight, computed in fp32.

    ``offset`` = 1 gives the Gemma variant (weight stored as ``w - 1``).
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not self.offset and self.weight.dtype == torch.float32:
            # one fused call (decoding runs two per layer and token): the same formula in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight + self.offset if self.offset else self.weight
        return weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """LayerNorm over the last dimension (biased variance), optionally without bias.

    Under reduced precision the statistics are computed in fp32 and the result cast back, so a
    bf16 model normalises exactly like its fp32 original up to the final rounding.
    """

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, elementwise_affine: bool = True):
        super().__init__(dim, eps=eps, elementwise_affine=elementwise_affine, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the common case, straight to the kernel (it runs per token)
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        if x.dtype in (torch.float16, torch.bfloat16):
            same = self.weight is None or self.weight.dtype == x.dtype
            if same and x.device.type in ("cpu", "cuda"):
                # these kernels already accumulate half/bf16 statistics in fp32 and round once:
                # the same result as the explicit upcast below, without two full-size copies
                return super().forward(x)
            w = self.weight.float() if self.weight is not None else None
            b = self.bias.float() if self.bias is not None else None
            return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)
        return super().forward(x)


_MIXED_GROUP_NORM_MIN = 1 << 16  # elements: below this the cast path is as fast (measured, 2-core Xeon)


class GroupNorm(nn.GroupNorm):
    """GroupNorm (UNet/VAE families), optionally followed by an activation: ``norm(x, "silu")``.

    Key names are torch's (``weight``/``bias``), as in diffusers. Under reduced precision the
    statistics are computed in fp32 and the result cast back. The activation (as in
    :class:`Linear`, named in transformers' ``hidden_act`` vocabulary) is applied in place on the
    normalised tensor at inference, so norm + SiLU (every ResNet block runs it twice) costs one
    output tensor instead of two.

    ``statistics``: when set (an object with ``normalize(norm, x) -> Tensor``), it normalises in
    place of the per-call statistics: a tiled pass over a large image uses it to give every tile the
    statistics of the whole image (:class:`gencli.models.autoencoder_kl.tiling.SharedGroupNormStatistics`).
    """

    statistics: Optional[Any] = None

    def forward(self, x: torch.Tensor, activation: Optional[str] = None) -> torch.Tensor:
        if self.statistics is not None:
            out = self.statistics.normalize(self, x)
        elif x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() >= _MIXED_GROUP_NORM_MIN and not torch.is_grad_enabled():
            # torch's CPU kernel takes bf16 in and out with fp32 statistics and arithmetic: what the cast
            # below computes (an element in a few thousand may differ by a bf16 step: the statistics'
            # summation order), 2.5-3.5x faster on a UNet's or VAE's feature maps, without two copies
            out = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        elif x.dtype in (torch.float16, torch.bfloat16):
            w = self.weight.float() if self.weight is not None else None
            b = self.bias.float() if self.bias is not None else None
            out = F.group_norm(x.float(), self.num_groups, w, b, self.eps).to(x.dtype)
        else:
            out = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        if activation is None:
            return out
        if not torch.is_grad_enabled() and activation in _INPLACE_ACTIVATIONS:
            return _INPLACE_ACTIVATIONS[activation](out)
        return get_activation(activation)(out)


_QUICK_GELU_K = 1.702


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's GELU approximation x * sigmoid(1.702 x), computed as silu(1.702 x) / 1.702: the same
    function, with one fused kernel instead of sigmoid and a product (about 1.4x faster in bf16 on CPU)."""
    return F.silu(x * _QUICK_GELU_K).mul_(1.0 / _QUICK_GELU_K)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (tanh approximation), named gelu_new / gelu_pytorch_tanh in transformers."""
    return F.gelu(x, approximate="tanh")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU combination silu(gate) * up (Shazeer 2020)."""
    return F.silu(gate) * up


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "quick_gelu": quick_gelu,
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "elu": F.elu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "leaky_relu": functools.partial(F.leaky_relu, negative_slope=0.2),  # DCGAN's discriminator slope
}


# the same functions written in place (inference on a fresh tensor only)
_INPLACE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": lambda t: F.silu(t, inplace=True),
    "swish": lambda t: F.silu(t, inplace=True),
    "relu": lambda t: F.relu(t, inplace=True),
    "leaky_relu": lambda t: F.leaky_relu(t, 0.2, inplace=True),
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config names (transformers' ``hidden_act`` vocabulary)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation '{name}' (known: {', '.join(sorted(ACTIVATIONS))})") from None


class Activation(nn.Module):
    """An activation as a module, chosen by name."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.fn = get_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


# activations oneDNN applies inside its bf16 matmul, by transformers' names: name -> (post-op, algorithm)
_ONEDNN_POST_OPS: dict[Optional[str], tuple[str, str]] = {
    None: ("none", ""),
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
    "silu": ("swish", ""),
    "swish": ("swish", ""),
    "sigmoid": ("sigmoid", ""),
    "tanh": ("tanh", ""),
}
# A single row (batch-1 decoding) stays on F.linear: there oneDNN's per-call cost outweighs the
# fused bias and activation (measured on a 2-core AMX CPU, one row through a bf16 SwiGLU block,
# three runs: 320x864 10-24% slower fused, 2048x8192 within 5% either way).
_ONEDNN_MIN_ROWS = 2


@functools.lru_cache(maxsize=None)
def _onednn_ops_available(ops: tuple[str, ...], bf16: bool = False) -> bool:
    """Whether this torch build has these ``torch.ops.mkldnn`` kernels (and, with ``bf16``, a CPU they run bf16 on)."""
    try:
        return bool(
            torch.backends.mkldnn.is_available()
            and all(hasattr(torch.ops.mkldnn, op) for op in ops)
            and (not bf16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
    except (AttributeError, RuntimeError):
        return False


def _onednn_linear_available() -> bool:
    return _onednn_ops_available(("_linear_pointwise",), bf16=True)


_CONV_OPS = ("_reorder_convolution_weight", "_convolution_pointwise")


def _onednn_conv_available() -> bool:
    return _onednn_ops_available(_CONV_OPS)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``activation(x @ weight.T + bias)``, the computation of :class:`Linear` for any weight (a row
    slice of a larger matrix, say: GEGLU multiplies by the two halves of one projection); with
    ``residual`` (no activation), ``x @ weight.T + bias + residual``.

    For bf16 inference on a CPU with native bf16 support (and more than one row) it runs oneDNN's
    matmul with the bias and the activation fused into the kernel (see :class:`Linear`); everywhere
    else ``F.linear`` followed by the activation. A residual is added inside oneDNN's matmul for
    fp32 and bf16 CPU inference (one pass over the output instead of two), else after ``F.linear``.
    """
    if residual is not None:
        if activation is not None:
            raise ValueError("linear: a residual is added to the product, not after an activation")
        return _linear_residual(x, weight, bias, residual)
    if (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and x.numel() >= _ONEDNN_MIN_ROWS * x.shape[-1]
        and _onednn_linear_available()
    ):
        fused = activation in _ONEDNN_POST_OPS
        op, algorithm = _ONEDNN_POST_OPS[activation if fused else None]
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, op, [], algorithm)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if fused else get_activation(activation)(out)
    out = F.linear(x, weight, bias)
    return get_activation(activation)(out) if activation is not None else out


def _linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
    out_shape = (*x.shape[:-1], weight.shape[0])
    if (
        x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == x.dtype
        and residual.dtype == x.dtype
        and tuple(residual.shape) == out_shape
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and x.numel() >= _ONEDNN_MIN_ROWS * x.shape[-1]
        and _onednn_ops_available(("_linear_pointwise",), bf16=x.dtype == torch.bfloat16)
    ):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise.binary(flat, residual.reshape(flat.shape[0], -1), weight, bias, "add")
        return out.reshape(out_shape)
    out = F.linear(x, weight, bias)
    return out + residual if torch.is_grad_enabled() else out.add_(residual)


def dense_of(module: nn.Module) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``(weight (out, in), bias)`` of a linear layer: ``nn.Linear`` (and its subclasses) or any module
    offering ``linear_weight()`` (GPT-2's Conv1D, stored ``(in, out)``); None for another module."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    as_linear = getattr(module, "linear_weight", None)
    if callable(as_linear):
        return as_linear(), getattr(module, "bias", None)
    return None


# A replacement linear layer built from a dense ``(out, in)`` weight and its bias (or None).
MakeLayer = Callable[[torch.Tensor, Optional[torch.Tensor]], nn.Module]


def swap_linears(
    model: nn.Module,
    make: MakeLayer,
    *,
    accept: Callable[[torch.Tensor], bool] = lambda weight: True,
    include: Optional[Callable[[str], bool]] = None,
    keep: tuple[type, ...] = (),
) -> int:
    """Replace every linear layer of ``model`` (what :func:`dense_of` finds, except modules of the
    ``keep`` types) whose name ``include`` and whose weight ``accept`` accept by ``make(weight, bias)``,
    in place, one layer at a time: each dense weight no other module holds (a tied embedding does) is
    released as soon as its replacement exists, so the peak is one layer over the model. The model's
    fused decoding step, which points at the old layers, is forgotten. Returns how many."""
    targets = []
    for name, module in model.named_modules():
        dense = dense_of(module) if name and not isinstance(module, keep) else None
        if dense is not None and (include is None or include(name)) and accept(dense[0]):
            targets.append((name, dense))
    module = dense = None  # the loop's last references
    count = len(targets)
    targets.reverse()
    while targets:
        name, (weight, bias) = targets.pop()
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(weight, bias))
        del weight, bias
    forget = getattr(model, "forget_fused_decoder", None)
    if callable(forget):
        forget()
    if count:
        release_free_memory()
    return count


def loading_builder(make: MakeLayer) -> Callable[[nn.Module, dict[str, torch.Tensor]], nn.Module]:
    """A builder for :func:`gencli.checkpoints.loader.load_state`'s ``replace``: the linear layer
    ``module`` (on meta) given its loaded ``tensors`` becomes ``make(weight, bias)``, so that a model's
    layers are converted (quantized, narrowed, made row-major) while it loads, one at a time from plain
    file reads, and the read tensors are dropped at once (the allocator trimmed every 64 MB of them)."""
    trim = MemoryTrimmer()

    def build(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
        for attr, tensor in tensors.items():
            setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
        weight, bias = dense_of(module)  # type: ignore[misc]
        layer = make(weight, bias)
        kept = any(t.data_ptr() == weight.data_ptr() for t in layer.state_dict().values())  # (an fp32 weight taken as it is)
        weight_bytes = 0 if kept else weight.numel() * weight.element_size()
        del weight, bias
        for attr, tensor in tensors.items():  # the read tensors go now, not when the caller lets go
            setattr(module, attr, nn.Parameter(tensor.to("meta"), requires_grad=False))
        tensors.clear()
        trim.freed(weight_bytes)
        return layer

    return build


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) that can apply an activation after it:
    ``lin(x, activation="gelu")``, the activation named in transformers' ``hidden_act`` vocabulary.

    For bf16 inference on a CPU with native bf16 support it runs oneDNN's matmul with the bias and
    the activation (GELU, tanh-GELU, SiLU, ReLU, sigmoid, tanh) fused into the kernel, each output
    rounded to bf16 once: the values of ``F.linear`` + activation up to bf16 rounding, without the
    separate broadcast-bias copy and activation pass (about a third less time for a ViT-B-sized
    layer); other activations (CLIP's quick_gelu) follow the fused matmul + bias. Everywhere else
    (training, fp32/fp16, CUDA, and a single row: batch-1 decoding) it is ``F.linear``.
    ``lin(x, residual=r)`` adds ``r`` to the output, inside the matmul where :func:`linear` can.
    """

    def forward(self, x: torch.Tensor, activation: Optional[str] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, activation, residual)


class Conv2d(nn.Conv2d):
    """``nn.Conv2d`` (same parameters, same state-dict keys) that can keep its weight in oneDNN's own
    layout for CPU inference, and add a residual to its output: ``conv(x, residual=r)``, or apply an
    activation to it: ``conv(x, activation="gelu")`` (transformers' ``hidden_act`` names).

    ``F.conv2d`` on a CPU reorders the weight into oneDNN's blocked layout on every call; for the
    wide, low-resolution convolutions of a UNet (1280 channels at 8x8 or 4x4) that reorder costs
    more than the convolution. After :meth:`prepack` the first inference call (no autograd, a CPU
    input in the weight's dtype) reorders the weight once for that input's shape and releases the
    dense parameter; every later call runs oneDNN's convolution on the packed weight, with the
    residual added inside the kernel, and the activations oneDNN has (GELU, tanh-GELU, SiLU, ReLU,
    sigmoid, tanh) applied inside it too. The same values as ``F.conv2d`` (+ residual, then the
    activation) up to the kernel's summation order. ``state_dict()`` still returns the dense weight; :meth:`unpack` (done
    automatically before ``.to()``, ``load_state_dict`` or a call with autograd) restores it.

    ``prepack(winograd=True)`` (asked for by a model; :mod:`gencli.backend.winograd`): a float32 3x3
    convolution of stride 1 and padding 1 keeps its dense weight and, instead of oneDNN's packed copy,
    the weight's Winograd F(2x2, 3x3) transform (16/9 of the weight's size), and runs on that: 2.25x
    fewer multiplies, the same values up to rounding.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._prepack = False
        self._packed: Optional[torch.Tensor] = None
        self._winograd = False  # asked for, and a 3x3 convolution it computes
        self._winograd_u: Optional[torch.Tensor] = None  # the weight's transform (16, C, K), made on the first packed call
        self._winograd_kernels: Any = None
        self._register_state_dict_hook(Conv2d._dense_weight_in_state_dict)

    def prepack(self, enabled: bool = True, winograd: bool = False) -> "Conv2d":
        """Pack the weight on the next CPU inference call (``enabled=False``: unpack and stop); with
        ``winograd``, a float32 3x3 convolution runs by Winograd's F(2x2, 3x3) where it can."""
        self._prepack = enabled and self.padding_mode == "zeros" and not isinstance(self.padding, str) and _onednn_conv_available()
        use_winograd = bool(winograd and self._prepack and winograd_eligible(self))
        if not self._prepack or use_winograd != self._winograd:
            self.unpack()  # packed again on the next call, the transform made or dropped with it
        self._winograd = use_winograd
        return self

    @property
    def packed(self) -> bool:
        """Whether the weight is held packed now."""
        return self._packed is not None

    @property
    def winograd(self) -> bool:
        """Whether the float32 calls run by Winograd's F(2x2, 3x3) now (after the first packed call)."""
        return self._winograd_u is not None

    @property
    def prepacking(self) -> bool:
        """Whether the weight is (or will be, on the next CPU inference call) packed."""
        return self._prepack

    def unpack(self) -> None:
        """Restore the dense ``weight`` parameter (a no-op when the weight is not packed); drop a
        Winograd transform (the dense weight stays beside it)."""
        self._winograd_u = self._winograd_kernels = None
        if self._packed is None:
            return
        dense = self._packed.to_dense()
        self._packed = None
        self.weight = nn.Parameter(dense, requires_grad=self._weight_requires_grad)

    def _pack(self, x: torch.Tensor) -> None:
        weight = self.weight.detach().contiguous()
        self._weight_requires_grad = self.weight.requires_grad
        if self._winograd and weight.dtype == torch.float32:
            self._winograd_kernels = winograd_kernels()
            if self._winograd_kernels is not None:  # the transform, beside the dense weight (what unpacking and saving read)
                self._winograd_u = winograd_weight(weight)
                return
        self._packed = torch.ops.mkldnn._reorder_convolution_weight(
            weight, list(self.padding), list(self.stride), list(self.dilation), self.groups, list(x.shape)
        )
        del self.weight, weight  # the packed copy replaces it
        release_free_memory()  # else the C allocator keeps the dense copy's memory (a few ms per call)

    def _can_pack(self, x: torch.Tensor) -> bool:
        if torch.is_grad_enabled() or x.device.type != "cpu":
            return False
        dtype = self._packed.dtype if self._packed is not None else self.weight.dtype
        if x.dtype != dtype:
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and _onednn_ops_available(_CONV_OPS, bf16=True))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, activation: Optional[str] = None) -> torch.Tensor:
        if self._prepack or self._packed is not None:
            if self._can_pack(x):
                return self._packed_forward(x, residual, activation)
            self.unpack()
        out = self._conv_forward(x, self.weight, self.bias)
        if residual is not None:
            out = out + residual if torch.is_grad_enabled() else out.add_(residual)
        return out if activation is None else get_activation(activation)(out)

    def _packed_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], activation: Optional[str]) -> torch.Tensor:
        if self._packed is None and self._winograd_u is None:
            self._pack(x)
        if self._winograd_u is not None:
            fused = residual is not None and tuple(residual.shape) == (x.shape[0], self.out_channels, *x.shape[2:])
            x = x.contiguous(memory_format=torch.channels_last)
            out = self._winograd_kernels.winograd_conv3x3(x, self._winograd_u, self.bias, residual if fused else None)
            if residual is not None and not fused:
                out.add_(residual)  # a residual that broadcasts
            return out if activation is None else get_activation(activation)(out)
        args = (list(self.padding), list(self.stride), list(self.dilation), self.groups)
        if residual is None:
            if activation in _ONEDNN_POST_OPS:
                op, algorithm = _ONEDNN_POST_OPS[activation]
                return torch.ops.mkldnn._convolution_pointwise(x, self._packed, self.bias, *args, op, [], algorithm)
            out = torch.ops.mkldnn._convolution_pointwise(x, self._packed, self.bias, *args, "none", [], "")
        else:
            cl = torch.channels_last
            if residual.dtype == x.dtype and residual.is_contiguous(memory_format=cl) and x.is_contiguous(memory_format=cl):
                out = torch.ops.mkldnn._convolution_pointwise.binary(x, residual, self._packed, self.bias, *args, "add", None, None, [], None)
            else:
                out = torch.ops.mkldnn._convolution_pointwise(x, self._packed, self.bias, *args, "none", [], "").add_(residual)
        return out if activation is None else get_activation(activation)(out)

    # the dense weight is what the rest of torch sees
    def _apply(self, fn, recurse=True):  # type: ignore[override]
        self.unpack()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.unpack()
        super()._load_from_state_dict(*args, **kwargs)

    @staticmethod
    def _dense_weight_in_state_dict(module: "Conv2d", state: dict, prefix: str, _meta: Any) -> None:
        if module._packed is not None:
            state[prefix + "weight"] = module._packed.to_dense()


def prepack_convolutions(module: nn.Module, enabled: bool = True, winograd: bool = False) -> int:
    """Call :meth:`Conv2d.prepack` on every :class:`Conv2d` inside ``module``; returns how many will
    pack (0 where oneDNN's packed convolution is not available). ``winograd``: the float32 3x3 layers
    by Winograd's F(2x2, 3x3) where their transforms fit in memory (:mod:`gencli.backend.winograd`)."""
    convs = [m for m in module.modules() if isinstance(m, Conv2d)]
    if winograd and not winograd_fits_in_memory(winograd_transform_bytes(convs)):
        winograd = False  # e.g. an SD UNet in float32 on a machine with less than 30 GB
    convs = [m.prepack(enabled, winograd) for m in convs]
    return sum(c.prepacking for c in convs)


def project(x: torch.Tensor, layers: tuple[nn.Module, ...], activations: Optional[tuple[Optional[str], ...]] = None) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x, activation=a) for layer, a in zip(layers, activations))``: several projections
    of the same ``x`` (a layer's query/key/value, a gated MLP's gate/up). A layer type that can do them
    in one call offers a static ``project_together(x, layers, activations)`` (quantized layers swapped
    in from outside the model do: :class:`gencli.backend.quantize.QuantizedLinear`); it returns None
    where it does not apply."""
    acts = activations or (None,) * len(layers)
    together = getattr(type(layers[0]), "project_together", None)
    if together is not None:
        outs = together(x, layers, acts)
        if outs is not None:
            return outs
    return tuple(m(x) if a is None else m(x, activation=a) for m, a in zip(layers, acts))


class GatedMLP(nn.Module):
    """The gated feed-forward block of Llama-family models: down(act(gate(x)) * up(x)).

    With ``act="silu"`` this is SwiGLU. Key names are transformers' (gate_proj, up_proj, down_proj);
    the projections are :class:`Linear`, the activation applied by ``gate_proj``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        get_activation(act)  # an unknown name fails here, not on the first forward pass
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, (self.gate_proj, self.up_proj), (self.act, None))  # one call when quantized
        return self.down_proj(gate * up)


class FeedForward(nn.Module):
    """The position-wise feed-forward block W2 act(W1 x + b1) + b2 of the original transformer,
    BERT, ViT and CLIP (key names ``fc1``/``fc2``); the projections are :class:`Linear`, the
    activation applied by ``fc1``."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "gelu", bias: bool = True):
        super().__init__()
        get_activation(act)  # an unknown name fails here, not on the first forward pass
        self.fc1 = Linear(hidden_size, intermediate_size, bias=bias)
        self.fc2 = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x, activation=self.act))


def init_normal_(module: nn.Module, std: float = 0.02) -> None:
    """The usual transformer initialisation for training from scratch: N(0, std) weights, zero biases,
    unit norms."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.LayerNorm, nn.GroupNorm, RMSNorm)):
            if m.weight is not None:
                nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


__all__ = [
    "RMSNorm",
    "LayerNorm",
    "GroupNorm",
    "quick_gelu",
    "gelu_tanh",
    "swiglu",
    "get_activation",
    "Activation",
    "linear",
    "Linear",
    "Conv2d",
    "prepack_convolutions",
    "GatedMLP",
    "FeedForward",
    "init_normal_",
]
