"""`gencli encode` / `gencli decode`: images to ``AutoencoderKL`` latents in a file, and back.

A latent file is a safetensors file in the layout ComfyUI's SaveLatent/LoadLatent nodes use (its
``.latent`` files): the tensor ``latent_tensor`` ``(B, C, h, w)`` of *unscaled* latents (what the
autoencoder's decoder takes; a diffusion model sees them multiplied by ``scaling_factor``), float32,
and the empty marker tensor ``latent_format_version_0``. A file without the marker holds latents
scaled by the model's ``scaling_factor`` (ComfyUI's earlier files, scaled by SD's 0.18215), and
:func:`read_latents` unscales them. The safetensors metadata carries the model, the source image,
the posterior used (mean, or a sample with its seed) and the image size, as JSON under ``gencli``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from gencli.checkpoints.header import read_header
from gencli.errors import CheckpointError, UserError
from gencli.io import input_name, is_stdout, read_input_bytes, write_output
from gencli.pipelines.diffusion.vae import LoadedAutoencoder, images_to_tensor, tensor_to_images
from gencli.pipelines.generative.loading import LoadedGenerative
from gencli.pipelines.generative.reconstruct import load_any_vae, read_model_image

LATENT_KEY = "latent_tensor"
VERSION_KEY = "latent_format_version_0"
METADATA_KEY = "gencli"


@dataclass
class Encoded:
    latents: torch.Tensor  # (1, C, h, w) unscaled, float32, CPU
    size: tuple[int, int]  # (width, height) the model saw
    resized: Optional[tuple[int, int]]  # the file's (width, height) when it had to be resized


@dataclass
class LatentFile:
    latents: torch.Tensor  # (B, C, h, w) unscaled, float32
    metadata: dict[str, Any] = field(default_factory=dict)
    scaled: bool = False  # the file held scaled latents (no version marker)


def load_latent_autoencoder(path: Union[str, Path], **options: Any) -> LoadedAutoencoder:
    """An ``AutoencoderKL`` (any layout :func:`~gencli.pipelines.diffusion.vae.load_autoencoder`
    reads); a ConvVAE or DCGAN folder is refused naming what it is (their latents are vectors)."""
    loaded = load_any_vae(path, **options)
    if isinstance(loaded, LoadedGenerative):
        raise UserError(
            f"'{loaded.path}' is a ConvVAE: encode/decode write and read AutoencoderKL latent maps; pass an AutoencoderKL (e.g. autoencoder-shapes)"
        )
    return loaded


@torch.inference_mode()
def encode_file(loaded: LoadedAutoencoder, path: str, *, tile: Optional[bool] = None, seed: Optional[int] = None) -> Encoded:
    """The latents of one image file: the posterior mean, or with ``seed`` a posterior sample drawn
    from a CPU generator seeded with it (the same latents on any device)."""
    x, size, resized = read_model_image(loaded, path)
    model = loaded.model
    posterior = model.encode(images_to_tensor(x).to(loaded.placement.device, loaded.placement.dtype), tile=tile)
    z = posterior.mode() if seed is None else posterior.sample(torch.Generator().manual_seed(int(seed)))
    return Encoded(z.float().cpu().contiguous(), size, resized)


# Suffixes that name a file type other than a latent (safetensors) file, beside the image types.
OTHER_TYPES = {".npy": "a NumPy array", ".npz": "NumPy arrays", ".json": "JSON", ".jsonl": "JSON lines", ".txt": "text", ".csv": "CSV",
               ".pt": "a pickled torch file", ".pth": "a pickled torch file", ".ckpt": "a pickled checkpoint"}  # fmt: skip


def check_latent_name(path: Union[str, Path]) -> Path:
    """A latent file's output name: one whose suffix names another type (an image's ``.png``,
    ``.npy``, ``.json`` ...) is one UserError naming the suffix to use; other names (``.safetensors``,
    ComfyUI's ``.latent``, ``.bin``, none) are kept, and ``-``, a pipe or a device take any name."""
    from PIL import Image

    from gencli.io import is_in_place

    suffix = Path(path).suffix.lower()
    if not suffix or is_in_place(path):
        return Path(path)
    kind = "an image" if suffix in Image.registered_extensions() else OTHER_TYPES.get(suffix)
    if kind is not None:
        raise UserError(f"output '{path}': '{suffix}' names {kind}, but a latent file is safetensors: give it the .safetensors suffix (or .latent)")
    return Path(path)


def write_latents(path: Union[str, Path], latents: torch.Tensor, metadata: dict[str, Any], *, force: bool = False) -> Path:
    """Write unscaled latents ``(B, C, h, w)`` as a latent file through the output layer (a file
    atomically; ``-``, a pipe or a device in place)."""
    from safetensors.torch import save

    tensors = {LATENT_KEY: latents.detach().float().cpu().contiguous(), VERSION_KEY: torch.tensor([])}
    return write_output(path, save(tensors, metadata={METADATA_KEY: json.dumps(metadata, sort_keys=True)}), force=force)


def read_latents(path: Union[str, Path], loaded: LoadedAutoencoder, *, tile: Optional[bool] = None) -> LatentFile:
    """A latent file's unscaled latents for ``loaded`` (scaled ones are unscaled with its config);
    ``-`` reads the file from stdin. A file that is not one, whose latents the model cannot take,
    that holds no latent, an empty map or a NaN/infinite value is a one-line error (never a black image),
    as are latents too large to decode (:func:`check_decoded_size`, with the decode's ``tile``)."""
    if is_stdout(path):
        import tempfile

        data = read_input_bytes(path)
        with tempfile.TemporaryDirectory(prefix="gencli-latent-") as folder:
            tmp = Path(folder) / "stdin.latent.safetensors"
            tmp.write_bytes(data)
            try:
                return _read_latent_file(tmp, loaded, "stdin", tile)
            except UserError as exc:
                raise type(exc)(str(exc).replace(str(tmp), "stdin")) from None
    return _read_latent_file(Path(path), loaded, input_name(path), tile)


MAX_TILED_SIDE = 16384  # a tiled decode's memory is its tiles': only the image itself grows (16384^2 RGB: 0.8 GB)


def check_decoded_size(shape: Sequence[int], loaded: LoadedAutoencoder, name: str, tile: Optional[bool] = None) -> None:
    """Latents that would decode to more pixels a side than a decode can hold are refused before
    they are read: ``MAX_SIDE`` (txt2img's limit) with ``--no-tile``, whose memory grows with the
    image (a 16384-pixel square would take tens of GB), else ``MAX_TILED_SIDE``."""
    from gencli.pipelines.diffusion.pipeline import MAX_SIDE

    limit = MAX_SIDE if tile is False else MAX_TILED_SIDE
    factor = loaded.model.config.downsampling
    height, width = shape[2] * factor, shape[3] * factor
    if max(height, width) > limit:
        hint = " untiled (drop --no-tile)" if tile is False and max(height, width) <= MAX_TILED_SIDE else ""
        raise UserError(f"'{name}': latents of {shape[2]}x{shape[3]} (height x width) decode to {height}x{width} pixels, more than {limit} a side{hint}")


def _read_latent_file(p: Path, loaded: LoadedAutoencoder, name: str, tile: Optional[bool] = None) -> LatentFile:
    from safetensors.torch import load_file

    if not p.is_file():
        raise UserError(f"latent file '{name}': {'is a directory' if p.is_dir() else 'no such file'}")
    header = read_header(p)
    if LATENT_KEY not in header.tensors:
        found = ", ".join(sorted(header.tensors)[:4]) or "no tensors"
        raise CheckpointError(f"'{name}' is not a latent file: no '{LATENT_KEY}' tensor (found {found})")
    info = header.tensors[LATENT_KEY]
    channels = loaded.model.config.latent_channels
    if len(info.shape) != 4 or info.shape[1] != channels:
        raise UserError(f"'{name}': latents of shape {list(info.shape)} do not fit the model's (N, {channels}, h, w) latents ({loaded.path})")
    if info.shape[0] == 0:
        raise UserError(f"'{name}': the latent batch is empty (shape {list(info.shape)}): nothing to decode")
    if 0 in info.shape[2:]:
        raise UserError(f"'{name}': the latents have no pixels (shape {list(info.shape)})")
    if not str(info.dtype).upper().startswith(("F", "BF")):
        raise CheckpointError(f"'{name}': '{LATENT_KEY}' holds {info.dtype} values, not floating point")
    check_decoded_size(info.shape, loaded, name, tile)
    z = load_file(str(p))[LATENT_KEY].float()
    if not bool(torch.isfinite(z).all()):
        bad = int((~torch.isfinite(z)).sum())
        raise UserError(f"'{name}': {bad} latent value(s) are NaN or infinite: they would decode to a blank image")
    scaled = VERSION_KEY not in header.tensors
    if scaled:
        z = loaded.model.unscale_latents(z)
    try:
        meta = json.loads(header.metadata.get(METADATA_KEY, "{}"))
    except json.JSONDecodeError:
        meta = {}
    return LatentFile(z, meta if isinstance(meta, dict) else {}, scaled)


@torch.inference_mode()
def decode_latents(loaded: LoadedAutoencoder, latents: torch.Tensor, *, tile: Optional[bool] = None) -> np.ndarray:
    """uint8 images ``(B, h * f, w * f, 3)`` for unscaled latents, one at a time (a latent file's
    batch may be large)."""
    out = [tensor_to_images(loaded.model.decode(z[None].to(loaded.placement.device, loaded.placement.dtype), tile=tile)) for z in latents]
    return np.concatenate(out) if out else np.empty((0, 0, 0, 3), np.uint8)


def latent_stem(path: Union[str, Path]) -> str:
    """The name a latent file's images are named after: ``cat.latent.safetensors`` -> ``cat``
    (``-``, stdin: ``stdin``)."""
    name = "stdin" if is_stdout(path) else Path(path).name
    for suffix in (".safetensors", ".latent"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
    return name


__all__ = [
    "LATENT_KEY",
    "VERSION_KEY",
    "Encoded",
    "LatentFile",
    "load_latent_autoencoder",
    "encode_file",
    "check_latent_name",
    "write_latents",
    "read_latents",
    "decode_latents",
    "latent_stem",
]
