"""Loading, saving and sampling the image-generating families other than diffusion: the
convolutional VAE (:class:`~gencli.models.vae.ConvVAE`) and the DCGAN
(:class:`~gencli.models.gan.DCGAN`), each a ``config.json`` (with ``"architecture"``) +
``model.safetensors`` folder; ``reconstruct`` also takes any diffusers ``AutoencoderKL``.

Sampling is per seed: the latent of seed ``s`` is drawn from its own CPU generator seeded with
``s``, so a seed gives the same image whatever the batch it is in and whatever the device.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from gencli.models.gan import DCGAN
from gencli.models.vae import ConvVAE
from gencli.pipelines.diffusion.vae import images_to_tensor, tensor_to_images
from gencli.pipelines.generative.loading import LoadedGenerative


def seed_latent(seed: int, dim: int) -> torch.Tensor:
    """The standard-normal latent ``(dim,)`` of one seed (its own CPU generator, fp32)."""
    return torch.randn(dim, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float32)


def seed_latents(seeds: Sequence[int], dim: int) -> torch.Tensor:
    return torch.stack([seed_latent(s, dim) for s in seeds]) if seeds else torch.empty(0, dim)


def slerp(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation between two latents (Shoemake 1985; White 2016 for generative
    models): it keeps the norm that Gaussian latents concentrate at, where a straight line passes
    through the improbable middle of the ball. Falls back to the straight line when a and b are
    (anti)parallel."""
    af, bf = a.double(), b.double()
    cos = torch.dot(af, bf) / (af.norm() * bf.norm())
    omega = torch.arccos(cos.clamp(-1.0, 1.0))
    if float(torch.sin(omega)) < 1e-6:
        return ((1 - t) * af + t * bf).to(a.dtype)
    so = torch.sin(omega)
    return ((torch.sin((1 - t) * omega) / so) * af + (torch.sin(t * omega) / so) * bf).to(a.dtype)


def interpolation_latents(seed_a: int, seed_b: int, steps: int, dim: int) -> torch.Tensor:
    """``steps`` latents from seed ``a``'s to seed ``b``'s (both ends included) along the great circle."""
    a, b = seed_latent(seed_a, dim), seed_latent(seed_b, dim)
    return torch.stack([slerp(a, b, i / (steps - 1)) for i in range(steps)])


# -- sampling ------------------------------------------------------------------------------------
@torch.inference_mode()
def generate(
    loaded: LoadedGenerative,
    latents: torch.Tensor,
    *,
    temperature: float = 1.0,
    truncation: float = 1.0,
    batch_size: int = 1,
    on_batch: Optional[Callable[[int], None]] = None,
) -> np.ndarray:
    """uint8 images ``(N, S, S, 3)`` for standard-normal ``latents`` ``(N, latent_dim)``: the VAE
    decodes ``temperature * z``, the GAN generates from ``truncation * z``.

    Each latent runs as its own batch by default: batched convolutions round differently with the
    batch's size and neighbours, so only a batch of one gives a seed the same bytes whatever else
    the run samples (measured on CPU: no slower than batches of 64 for the shapes models)."""
    model = loaded.model
    scale = temperature if loaded.family == "vae" else truncation
    out = []
    for start in range(0, len(latents), batch_size):
        z = (latents[start : start + batch_size] * scale).to(loaded.placement.device, loaded.placement.dtype)
        x = model.decode(z) if isinstance(model, ConvVAE) else model.generator(z)
        out.append(tensor_to_images(x))
        if on_batch is not None:
            on_batch(len(z))
    return np.concatenate(out) if out else np.empty((0, loaded.image_size, loaded.image_size, 3), np.uint8)


@torch.inference_mode()
def _over_images(loaded: LoadedGenerative, images: np.ndarray, fn: Callable[[torch.Tensor], np.ndarray], batch_size: int) -> np.ndarray:
    """``fn`` over uint8 images in batches, each converted to ``[-1, 1]`` in the model's placement."""
    out = [fn(images_to_tensor(images[i : i + batch_size]).to(loaded.placement.device, loaded.placement.dtype)) for i in range(0, len(images), batch_size)]
    return np.concatenate(out)


def realism(loaded: LoadedGenerative, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
    """The GAN discriminator's realism probability (sigmoid of its logit) for uint8 images."""
    assert isinstance(loaded.model, DCGAN)
    return _over_images(loaded, images, lambda x: torch.sigmoid(loaded.model.discriminator(x).float()).cpu().numpy(), batch_size)


def reconstruct_vae(loaded: LoadedGenerative, images: np.ndarray, batch_size: int = 1) -> np.ndarray:
    """Round-trip uint8 images through a ConvVAE with the posterior mean (deterministic; each image
    its own batch by default, so its result does not depend on the others)."""
    assert isinstance(loaded.model, ConvVAE)
    return _over_images(loaded, images, lambda x: tensor_to_images(loaded.model.decode(loaded.model.encode(x).mode())), batch_size)


# -- seeds, grids and files -----------------------------------------------------------------------
