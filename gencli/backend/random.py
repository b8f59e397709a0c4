"""Seeded randomness that gives the same numbers on every device.

Noise is drawn from a CPU ``torch.Generator`` in float32 and then moved to the target device and
dtype, so ``--seed 7`` produces the same image or the same sampled tokens on CPU, CUDA and MPS
(up to the model's own arithmetic differences).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch


def new_seed() -> int:
    """A fresh random seed (reported back to the user so a run can be repeated)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def make_generator(seed: Optional[int]) -> tuple[torch.Generator, int]:
    """A CPU generator seeded with ``seed`` (a fresh seed when None); returns ``(generator, seed)``."""
    if seed is None:
        seed = new_seed()
    if seed < 0:
        raise ValueError("seed must be non-negative")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    return gen, int(seed)


def randn(
    shape: Sequence[int], generator: Optional[torch.Generator], *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Standard normal noise drawn on the CPU in fp32, then moved to ``device`` and cast to ``dtype``."""
    return _draw(torch.randn, shape, generator, device, dtype)


def randn_tensor(
    shape: Sequence[int],
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Standard normal noise drawn exactly as diffusers' ``randn_tensor`` draws it.

    Seeded diffusion runs reproduce diffusers' images only if every draw matches: the draw happens in
    ``dtype`` itself (a float16 draw is not a float32 draw cast down), on the generator's device (a
    CPU generator draws on the CPU and the result is moved to ``device``), and a list of generators
    (one per image) draws row ``i`` of the batch from ``generator[i]`` with shape
    ``(1, *shape[1:])``. A list of one generator is the same as that generator.
    """
    shape = tuple(shape)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if isinstance(generator, (list, tuple)) and len(generator) == 1:
        generator = generator[0]
    first = generator[0] if isinstance(generator, (list, tuple)) else generator
    draw_device = device
    if first is not None and first.device.type != device.type:
        if first.device.type != "cpu":
            raise ValueError(f"cannot draw a {device} tensor from a {first.device.type} generator")
        draw_device = torch.device("cpu")
    if isinstance(generator, (list, tuple)):
        rows = [torch.randn((1, *shape[1:]), generator=g, device=draw_device, dtype=dtype) for g in generator[: shape[0]]]
        if len(rows) != shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {shape[0]}")
        return torch.cat(rows, dim=0).to(device)
    return torch.randn(shape, generator=generator, device=draw_device, dtype=dtype).to(device)


def rand(
    shape: Sequence[int], generator: Optional[torch.Generator], *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Uniform [0, 1) noise, drawn like :func:`randn`."""
    return _draw(torch.rand, shape, generator, device, dtype)


def _draw(sample, shape: Sequence[int], generator: Optional[torch.Generator], device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    x = sample(tuple(shape), generator=generator, dtype=torch.float32, device="cpu")
    return x.to(device=device, dtype=dtype)


def multinomial(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One sample per row of ``probs (B, V)``, drawn with the CPU generator (device-independent)."""
    sample = torch.multinomial(probs.detach().float().cpu(), num_samples=1, generator=generator)
    return sample.to(probs.device)


def seed_everything(seed: int) -> None:
    """Seed torch's global generators too (for training scripts)."""
    torch.manual_seed(seed)
    import random

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover
        pass
