"""Normalisations and activations, written once for every family.

Key names follow transformers/diffusers (``weight``/``bias``) so checkpoints map onto them directly.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


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


class GroupNorm(nn.GroupNorm):
    """GroupNorm (UNet/VAE families), optionally followed by an activation: ``norm(x, "silu")``.

    Key names are torch's (``weight``/``bias``), as in diffusers. Under reduced precision the
    statistics are computed in fp32 and the result cast back. The activation (as in
    :class:`Linear`, named in transformers' ``hidden_act`` vocabulary) is applied in place on the
    normalised tensor at inference, so norm + SiLU (every ResNet block runs it twice) costs one
    output tensor instead of two.

    ``statistics``: when set (an object with ``normalize(norm, x) -> Tensor``), it normalises in
    place of the per-call statistics: a tiled pass over a large image uses it to give every tile the
    statistics of the whole image (:class:`gencli.models.autoencoder_kl.SharedGroupNormStatistics`).
    """

    statistics: Optional[Any] = None

    def forward(self, x: torch.Tensor, activation: Optional[str] = None) -> torch.Tensor:
        if self.statistics is not None:
            out = self.statistics.normalize(self, x)
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
}


# the same functions written in place (inference on a fresh tensor only)
_INPLACE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": lambda t: F.silu(t, inplace=True),
    "swish": lambda t: F.silu(t, inplace=True),
    "relu": lambda t: F.relu(t, inplace=True),
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


# activations oneDNN can apply inside its bf16 matmul: name -> (post-op, algorithm)
_ONEDNN_POST_OPS: dict[Optional[str], tuple[str, str]] = {None: ("none", ""), "gelu": ("gelu", "none"), "relu": ("relu", "")}
_onednn_linear_ok: Optional[bool] = None


def _onednn_linear_available() -> bool:
    global _onednn_linear_ok
    if _onednn_linear_ok is None:
        try:
            _onednn_linear_ok = bool(
                torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            )
        except (AttributeError, RuntimeError):
            _onednn_linear_ok = False
    return _onednn_linear_ok


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) that can apply an activation after it.

    For bf16 inference on a CPU with native bf16 support it runs oneDNN's matmul with the bias (and a
    GELU/ReLU) fused into the kernel: the same values as ``F.linear`` (+ activation) up to bf16
    rounding, without the separate broadcast-bias copy and activation pass (about a third less time
    for a ViT-B-sized layer). Everywhere else (training, fp32/fp16, CUDA) it is ``F.linear``.
    """

    def forward(self, x: torch.Tensor, activation: Optional[str] = None) -> torch.Tensor:
        if (
            x.dtype == torch.bfloat16
            and self.weight.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and activation in _ONEDNN_POST_OPS
            and not torch.is_grad_enabled()
            and _onednn_linear_available()
        ):
            op, algorithm = _ONEDNN_POST_OPS[activation]
            flat = x.reshape(-1, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, op, [], algorithm)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        out = F.linear(x, self.weight, self.bias)
        return get_activation(activation)(out) if activation is not None else out


class GatedMLP(nn.Module):
    """The gated feed-forward block of Llama-family models: down(act(gate(x)) * up(x)).

    With ``act="silu"`` this is SwiGLU. Key names are transformers' (gate_proj, up_proj, down_proj).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class FeedForward(nn.Module):
    """The position-wise feed-forward block W2 act(W1 x + b1) + b2 of the original transformer,
    BERT, ViT and CLIP (key names ``fc1``/``fc2``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "gelu", bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.fc2 = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


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
    "Linear",
    "GatedMLP",
    "FeedForward",
    "init_normal_",
]
