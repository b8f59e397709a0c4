"""3x3 convolutions by Winograd's minimal filtering F(2x2, 3x3), for float32 UNets on a CPU.

A 3x3 convolution (stride 1, padding 1, one group) computes each 2x2 block of outputs from a 4x4
window of its input. Winograd's algorithm (Lavin and Gray, "Fast Algorithms for Convolutional Neural
Networks", 2016) writes that block as ``A^T [(G g G^T) * (B^T d B)] A``: the weight ``g`` and the window
``d`` are transformed into 4x4 tiles, multiplied elementwise (16 multiplies per pair of channels where
the direct convolution makes 36), and transformed back. Summed over the input channels, the 16
elementwise products become 16 matrix products ``V_k (tiles, C) @ U_k (C, K)``: the work oneDNN's direct
convolution does at the cores' fp32 FMA peak, 2.25x smaller.

:func:`winograd_weight` makes ``U = G g G^T`` once (in float32, within a unit of the last place of the
exact transform; 8 ms for a 512x512-channel layer, 4x faster than in float64); the extension's
``winograd_conv3x3`` (``csrc/winograd_conv.cpp``) does the rest on channels-last feature maps: the tiles in chunks that stay in a core's cache, spread over
torch's threads, the bias and a residual added on the way out. The values equal ``F.conv2d``'s up to
the order of the sums (measured against float64: as close as the direct convolution, or closer).

:class:`gencli.backend.layers.Conv2d` takes this path for the layers :func:`eligible` accepts when a
model asks for it (``prepack(winograd=True)``: the DDPM UNets, the AutoencoderKL of ``reconstruct``,
``encode`` and ``decode``) and the transforms fit in :data:`MEMORY_SHARE` of the
machine's memory. Whether it is on by default depends on the CPU (:func:`default_for`): on an AMD CPU
torch's fp32 batched products, which do the 16 products here, run MKL's AVX2 code (about 100 GFLOP/s
a core on the 2-core AMD EPYC, Zen 5) while oneDNN's direct convolution runs at about 240, so the
direct convolution is the faster one there. ``GENCLI_WINOGRAD=1`` turns it on and ``=0`` off on any CPU.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Optional

import torch

ENV_SWITCH = "GENCLI_WINOGRAD"
# narrower layers stay direct: at 32 channels the transforms cost more than the products save (0.87-0.96x
# oneDNN's direct convolution at 64x64, batch 1 and 16, 2 threads; 64 channels at 32x32: 1.26-1.41x)
MIN_CHANNELS = 64

# the transforms of a model's convolutions may take this share of the machine's memory at most (beside the
# dense weights they are made from): a DDPM or VAE's few hundred MB take the path, an SD UNet's 3.7 GB
# in float32 does not on a 24 GB machine
MEMORY_SHARE = 1 / 8


def choice() -> Optional[bool]:
    """``GENCLI_WINOGRAD`` as set: False for 0 / false / off / no, True for any other value, None when
    unset (the CPU's default, :func:`default_for`)."""
    value = os.environ.get(ENV_SWITCH)
    if value is None or not value.strip():
        return None
    return value.strip().lower() not in ("0", "false", "off", "no")


def enabled() -> bool:
    """False when ``GENCLI_WINOGRAD`` turns the path off."""
    return choice() is not False


def default_for(amd: bool) -> bool:
    """Whether the path is on when ``GENCLI_WINOGRAD`` is unset: on, except on AMD CPUs, where MKL's
    batched products run its AVX2 code. Measured on the 2-core AMD EPYC (Zen 5), 2 threads: the
    ddpm-cifar10-32-shaped UNet 0.0481 s/step by Winograd against 0.0386 direct (diffusers 0.059-0.067),
    an SD-shaped VAE's 256x256 decode 1.72-1.81 s against 1.51-1.59; on the Intel Xeon (AVX-512, AMX)
    Winograd was the faster, 0.66x diffusers' s/step against 0.90x (docs/benchmarks.md)."""
    return not amd


# G of F(2x2, 3x3): the weight's transform G g G^T
_G = ((1.0, 0.0, 0.0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0.0, 0.0, 1.0))


def winograd_weight(weight: torch.Tensor) -> torch.Tensor:
    """A conv weight ``(K, C, 3, 3)`` as its F(2x2, 3x3) transform ``(16, C, K)`` float32 contiguous:
    ``U[4 i + j, c, k] = (G g[k, c] G^T)[i, j]``."""
    if weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3):
        raise ValueError(f"winograd_weight: a (K, C, 3, 3) weight, got {tuple(weight.shape)}")
    g = torch.tensor(_G, dtype=torch.float32, device=weight.device)
    u = torch.einsum("ia,kcab,jb->ijck", g, weight.detach().to(torch.float32), g)
    return u.reshape(16, weight.shape[1], weight.shape[0]).contiguous()


def eligible(conv: torch.nn.Conv2d) -> bool:
    """Whether ``conv`` is a convolution this path computes: 3x3, stride 1, padding 1 (zeros), no
    dilation, one group, at least :data:`MIN_CHANNELS` input and output channels."""
    return (
        tuple(conv.kernel_size) == (3, 3)
        and tuple(conv.stride) == (1, 1)
        and not isinstance(conv.padding, str)
        and tuple(conv.padding) == (1, 1)
        and tuple(conv.dilation) == (1, 1)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
        and conv.in_channels >= MIN_CHANNELS
        and conv.out_channels >= MIN_CHANNELS
    )


def transform_bytes(convs: Iterable[torch.nn.Conv2d]) -> int:
    """The memory the Winograd transforms of the float32 convolutions among ``convs`` that
    :func:`eligible` accepts would take (16/9 of their weights)."""
    return sum(16 * c.in_channels * c.out_channels * 4 for c in convs if eligible(c) and _dtype(c) == torch.float32)


def _dtype(conv: torch.nn.Conv2d) -> Optional[torch.dtype]:
    weight = conv._parameters.get("weight")
    if weight is None:  # packed: the packed copy holds the values (gencli.backend.layers.Conv2d)
        weight = getattr(conv, "_packed", None)
    return None if weight is None else weight.dtype


def fits_in_memory(nbytes: int) -> bool:
    """Whether ``nbytes`` of transforms stay within :data:`MEMORY_SHARE` of this machine's memory."""
    from gencli.backend.device import physical_memory_bytes

    return nbytes <= physical_memory_bytes() * MEMORY_SHARE


def kernels() -> Optional[Any]:
    """The extension when this path runs here (switched on, or unset on a CPU whose default it is; an
    x86-64 CPU with AVX2 or AVX-512; the extension built or buildable), else None."""
    if not enabled():
        return None
    from gencli.backend.quant_kernels import cpu_kernels

    own = cpu_kernels()
    if own is None or not own.isa() or not hasattr(own, "winograd_conv3x3"):
        return None
    if choice() is None and not default_for(bool(own.cpu_vendor_amd())):
        return None
    return own



__all__ = [
    "ENV_SWITCH",
    "MEMORY_SHARE",
    "MIN_CHANNELS",
    "choice",
    "default_for",
    "eligible",
    "enabled",
    "fits_in_memory",
    "kernels",
    "transform_bytes",
    "winograd_weight",
]
