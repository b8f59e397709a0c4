"""Loading, saving and sampling the image-generating families other than diffusion: the
convolutional VAE (:class:`~gencli.models.vae.ConvVAE`) and the DCGAN
(:class:`~gencli.models.gan.DCGAN`), each a ``config.json`` (with ``"architecture"``) +
``model.safetensors`` folder; ``reconstruct`` also takes any diffusers ``AutoencoderKL``.

Sampling is per seed: the latent of seed ``s`` is drawn from its own CPU generator seeded with
``s``, so a seed gives the same image whatever the batch it is in and whatever the device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from gencli.backend.device import Placement
from gencli.checkpoints.formats import open_source, with_article, wrong_family
from gencli.checkpoints.loader import load_model, save_model
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError, UserError
from gencli.io import atomic_write_bytes
from gencli.models.gan import ARCHITECTURE as GAN_ARCHITECTURE
from gencli.models.gan import DCGAN, DCGANConfig
from gencli.models.vae import ARCHITECTURE as VAE_ARCHITECTURE
from gencli.models.vae import ConvVAE, ConvVAEConfig
from gencli.pipelines.autoencoder import images_to_tensor, tensor_to_images

FAMILIES: dict[str, tuple[str, type, type]] = {
    "vae": (VAE_ARCHITECTURE, ConvVAE, ConvVAEConfig),
    "gan": (GAN_ARCHITECTURE, DCGAN, DCGANConfig),
}
MAX_SAMPLES = 4096  # -n and --seeds beyond this are refused (one grid, one process)


@dataclass
class LoadedGenerative:
    """A loaded ConvVAE or DCGAN and what it was loaded from."""

    model: Union[ConvVAE, DCGAN]
    family: str  # "vae" or "gan"
    placement: Placement
    path: Path

    @property
    def latent_dim(self) -> int:
        return self.model.config.latent_dim

    @property
    def image_size(self) -> int:
        return self.model.config.image_size


def architecture_of(config: Optional[dict[str, Any]]) -> str:
    """What a config.json says it is: its ``architecture``, diffusers' ``_class_name``,
    transformers' ``architectures[0]``, or ``'no config.json'``."""
    if not config:
        return "no config.json"
    if config.get("architecture"):
        return str(config["architecture"])
    if config.get("_class_name"):
        return str(config["_class_name"])
    archs = config.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else "an unknown architecture"


def load_generative(path: Union[str, Path], family: str, placement: Placement, *, allow_pickle: bool = False) -> LoadedGenerative:
    """A ``family`` (``"vae"``/``"gan"``) model folder (or its ``model.safetensors``) in ``placement``."""
    architecture, model_cls, config_cls = FAMILIES[family]
    src = open_source(path, allow_pickle=allow_pickle)
    found = architecture_of(src.config)
    if found != architecture:
        raise wrong_family(src, with_article(architecture), f"gencli runs a {family.upper()} whose config.json names \"architecture\": \"{architecture}\"")
    try:
        config = config_cls.from_dict(src.config)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"'{src.path}': config.json does not describe a {architecture}: {exc}") from None
    with TensorReader(src, allow_pickle=allow_pickle) as reader:
        model = load_model(lambda: model_cls(config), reader, device=placement.device, dtype=placement.dtype, config=src.config)
    return LoadedGenerative(model.eval(), family, placement, src.path)


def open_generative(
    path: Union[str, Path], family: str, *, device: str = "auto", dtype: str = "auto", threads: Optional[int] = None, allow_pickle: bool = False
) -> LoadedGenerative:
    """:func:`load_generative` with the user's ``--device/--dtype/--threads`` (fp32 unless asked)."""
    from gencli.backend.device import choose_placement

    return load_generative(path, family, choose_placement(device, dtype, "float", threads), allow_pickle=allow_pickle)


def save_generative(
    model: Union[ConvVAE, DCGAN], folder: Union[str, Path], *, dtype: Optional[torch.dtype] = None, metadata: Optional[dict[str, str]] = None
) -> None:
    """Write ``config.json`` + ``model.safetensors``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(model, folder / "model.safetensors", dtype=dtype, metadata=metadata)
    atomic_write_bytes(folder / "config.json", (json.dumps(model.config.to_dict(), indent=2) + "\n").encode(), force=True)


# -- latents -------------------------------------------------------------------------------------
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
    batch_size: int = 64,
    on_batch: Optional[Callable[[int], None]] = None,
) -> np.ndarray:
    """uint8 images ``(N, S, S, 3)`` for standard-normal ``latents`` ``(N, latent_dim)``: the VAE
    decodes ``temperature * z``, the GAN generates from ``truncation * z``."""
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


def reconstruct_vae(loaded: LoadedGenerative, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
    """Round-trip uint8 images through a ConvVAE with the posterior mean (deterministic)."""
    assert isinstance(loaded.model, ConvVAE)
    return _over_images(loaded, images, lambda x: tensor_to_images(loaded.model.decode(loaded.model.encode(x).mode())), batch_size)


# -- seeds, grids and files -----------------------------------------------------------------------
def parse_seeds(spec: str, limit: int = MAX_SAMPLES) -> list[int]:
    """``"0-15,40"`` -> ``[0, 1, ..., 15, 40]`` (ranges inclusive, order kept, at most ``limit``)."""
    seeds: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-") if not part.startswith("-") else ("", "", "")
        try:
            if sep:
                a, b = int(lo), int(hi)
                if b < a:
                    raise ValueError
                if b - a + 1 + len(seeds) > limit:
                    raise UserError(f"--seeds '{spec}' names more than {limit} seeds")
                seeds.extend(range(a, b + 1))
            else:
                value = int(part)
                if value < 0:
                    raise ValueError
                seeds.append(value)
        except ValueError:
            raise UserError(f"--seeds '{spec}' does not parse: expected non-negative seeds and ranges like 0-15,40 (bad part '{part}')") from None
    if len(seeds) > limit:
        raise UserError(f"--seeds '{spec}' names more than {limit} seeds")
    return seeds


def image_grid(images: np.ndarray, nrow: int, padding: int = 2) -> np.ndarray:
    """uint8 images ``(N, H, W, 3)`` tiled ``nrow`` per row with ``padding`` black pixels between
    and around them (torchvision's ``make_grid`` layout)."""
    n, h, w, c = images.shape
    cols = max(1, min(nrow, n))
    rows = (n + cols - 1) // cols
    grid = np.zeros((rows * (h + padding) + padding, cols * (w + padding) + padding, c), np.uint8)
    for i, im in enumerate(images):
        r, q = divmod(i, cols)
        y, x = padding + r * (h + padding), padding + q * (w + padding)
        grid[y : y + h, x : x + w] = im
    return grid


def write_png(path: Union[str, Path], image: np.ndarray, settings: dict[str, Any], *, force: bool = False) -> Path:
    """An RGB PNG, written atomically, carrying ``settings`` as JSON in a ``gencli`` text chunk."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    from gencli.io import atomic_path

    info = PngInfo()
    info.add_text("gencli", json.dumps(settings, sort_keys=True))
    with atomic_path(path, force=force) as tmp:
        Image.fromarray(image).save(tmp, format="PNG", pnginfo=info)
    return Path(path)


def write_gif(path: Union[str, Path], frames: np.ndarray, settings: dict[str, Any], *, frame_ms: int = 80, force: bool = False) -> Path:
    """An animated GIF looping forever over ``frames`` and back (a latent walk that returns), with
    ``settings`` as JSON in its comment."""
    from PIL import Image

    from gencli.io import atomic_path

    order = list(frames) + list(frames[-2:0:-1])
    images = [Image.fromarray(f) for f in order]
    with atomic_path(path, force=force) as tmp:
        images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], duration=frame_ms, loop=0,
                       comment=json.dumps(settings, sort_keys=True).encode())  # fmt: skip
    return Path(path)


__all__ = [
    "FAMILIES",
    "MAX_SAMPLES",
    "LoadedGenerative",
    "architecture_of",
    "load_generative",
    "open_generative",
    "save_generative",
    "seed_latent",
    "seed_latents",
    "slerp",
    "interpolation_latents",
    "generate",
    "realism",
    "reconstruct_vae",
    "parse_seeds",
    "image_grid",
    "write_png",
    "write_gif",
]
