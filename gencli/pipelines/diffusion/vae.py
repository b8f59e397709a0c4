"""Loading and saving ``AutoencoderKL`` checkpoints, and the conversions between images and the
tensors it takes.

:func:`load_autoencoder` accepts
- a diffusers ``vae/`` folder (``config.json`` + ``diffusion_pytorch_model.safetensors``, or a
  ``variant`` file such as ``diffusion_pytorch_model.fp16.safetensors``), or a diffusers pipeline
  folder (its ``vae/`` component is used);
- a bare ``.safetensors`` file next to a ``config.json`` that describes an ``AutoencoderKL``;
- a single file without a config: a Stable Diffusion checkpoint (its ``first_stage_model.*`` part)
  or a standalone VAE in the original latent-diffusion layout; the architecture is read from the
  tensor shapes, the rest is the standard Stable Diffusion VAE configuration (SDXL's scaling factor
  for SDXL checkpoints), and ``config_overrides`` can change any field.

Tensor names are mapped by :mod:`gencli.models.autoencoder_kl.keymaps`; a checkpoint that does not
fit raises a one-line :class:`~gencli.errors.CheckpointError` naming the tensor.

:func:`save_autoencoder` writes the diffusers layout, which diffusers'
``AutoencoderKL.from_pretrained`` loads as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from gencli.backend.device import Placement
from gencli.backend.layers import prepack_convolutions
from gencli.checkpoints.formats import CheckpointSource, open_source
from gencli.checkpoints.loader import load_model, save_model
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError, UserError
from gencli.io import atomic_write_bytes, read_json
from gencli.models.autoencoder_kl.keymaps import config_from_ldm_shapes, keymap_for, layout_of
from gencli.models.autoencoder_kl.model import AutoencoderKL, AutoencoderKLConfig
from gencli.models.autoencoder_kl.tiling import Tiling

WEIGHTS_NAME = "diffusion_pytorch_model"


@dataclass
class LoadedAutoencoder:
    """A loaded ``AutoencoderKL`` and what it was loaded from."""

    model: AutoencoderKL
    placement: Placement
    path: Path
    layout: str  # "diffusers", "diffusers-legacy" or "ldm"
    config: dict[str, Any]  # the diffusers config it was built from (shipped defaults for single files)


def open_autoencoder_source(path: str | Path, *, variant: Optional[str] = None, allow_pickle: bool = False) -> CheckpointSource:
    """The checkpoint source of an autoencoder: the ``vae/`` of a pipeline folder, the ``variant``
    files of a component folder (both through :func:`~gencli.checkpoints.formats.open_source`), and
    an ``AutoencoderKL`` ``config.json`` next to a bare file of any name."""
    src = open_source(path, allow_pickle=allow_pickle, variant=variant)
    if src.kind == "diffusers-pipeline":
        return src.sub("vae", variant=variant)
    if src.config is None and src.path.is_file() and src.path.suffix == ".safetensors":
        beside = src.path.parent / "config.json"
        if beside.is_file():
            cfg = read_json(beside)
            if cfg.get("_class_name") == "AutoencoderKL":
                src.config = cfg
    return src


def _is_sdxl(keys: set[str]) -> bool:
    return any(k.startswith("conditioner.embedders.") for k in keys)


def load_autoencoder(
    path: str | Path,
    placement: Placement,
    *,
    variant: Optional[str] = None,
    config_overrides: Optional[dict[str, Any]] = None,
    tiling: Optional[Tiling] = None,
    allow_pickle: bool = False,
    channels_last: Optional[bool] = None,
    prepack: bool = False,
) -> LoadedAutoencoder:
    """An ``AutoencoderKL`` in ``placement``'s device and dtype from any of the layouts above.

    ``channels_last`` (default: on a CPU or a GPU) stores the convolution weights channels-last, so
    every activation is channels-last too (faster convolutions and GroupNorm on CPU and CUDA). With
    ``force_upcast`` in the config, fp16 is replaced by fp32 (as diffusers does: the SD VAE
    overflows in fp16); bf16 is kept. ``prepack`` (for inference only: a training step unpacks the
    weights into new parameters, which an optimizer made before would not see): in float32 on a CPU,
    the ResNet blocks' convolution weights are packed for oneDNN on the first call and the 3x3 layers
    run by Winograd's F(2x2, 3x3) (:mod:`gencli.backend.winograd`: a round trip through an SD-sized VAE
    1.4-1.7x faster, its transforms taking 16/9 of those layers' weights beside them).
    """
    src = open_autoencoder_source(path, variant=variant, allow_pickle=allow_pickle)
    reader = TensorReader(src, allow_pickle=allow_pickle)
    with reader:
        keys = set(reader.keys())
        layout, prefix = layout_of(keys)
        if not layout:
            some = next(iter(sorted(keys)), "nothing")
            raise CheckpointError(
                f"'{src.path}' is not an AutoencoderKL checkpoint: no encoder/decoder tensors in diffusers or original naming (first tensor: '{some}')"
            )
        if src.config is not None:
            cfg = dict(src.config)
        elif layout == "ldm":
            try:
                cfg = config_from_ldm_shapes(reader.shape, keys, prefix, sdxl=_is_sdxl(keys))
            except (KeyError, ValueError, IndexError) as exc:
                raise CheckpointError(f"'{src.path}': cannot read the VAE's architecture from its tensors: {exc}") from None
        else:
            raise UserError(f"'{src.path}' has diffusers AutoencoderKL tensors but no config.json beside it")
        cfg.update(config_overrides or {})
        try:
            config = AutoencoderKLConfig.from_dict(cfg)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"'{src.path}': the config does not describe an AutoencoderKL: {exc}") from None
        dtype = placement.dtype
        if config.force_upcast and dtype == torch.float16:
            dtype = torch.float32
        keymap = keymap_for(layout, prefix, len(config.block_out_channels))
        model = load_model(lambda: AutoencoderKL(config, tiling), reader, keymap, device=placement.device, dtype=dtype, config=cfg)
    if channels_last is None:
        channels_last = placement.device.type in ("cpu", "cuda")
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if prepack and placement.device.type == "cpu" and dtype == torch.float32:
        prepack_convolutions(model, True, winograd=True)
    return LoadedAutoencoder(model, Placement(placement.device, dtype), src.path, layout, cfg)


def save_autoencoder(model: AutoencoderKL, folder: str | Path, *, dtype: Optional[torch.dtype] = None, metadata: Optional[dict[str, str]] = None) -> None:
    """Write ``config.json`` + ``diffusion_pytorch_model.safetensors`` (diffusers' ``vae/`` layout)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(model.to(memory_format=torch.contiguous_format), folder / f"{WEIGHTS_NAME}.safetensors", dtype=dtype, metadata=metadata)
    atomic_write_bytes(folder / "config.json", (json.dumps(model.config.to_dict(), indent=2) + "\n").encode(), force=True)


# -- images <-> tensors ------------------------------------------------------------------------------
def images_to_tensor(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 images ``(N, H, W, 3)`` (or one ``(H, W, 3)``) -> float ``(N, 3, H, W)`` in ``[-1, 1]``."""
    t = torch.as_tensor(np.ascontiguousarray(images) if isinstance(images, np.ndarray) else images)
    if t.ndim == 3:
        t = t.unsqueeze(0)
    return t.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def tensor_to_images(x: torch.Tensor) -> np.ndarray:
    """float ``(N, 3, H, W)`` in ``[-1, 1]`` -> uint8 ``(N, H, W, 3)`` (clamped, rounded)."""
    y = ((x.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return y.permute(0, 2, 3, 1).contiguous().numpy()


@torch.inference_mode()
def reconstruct(model: AutoencoderKL, images: np.ndarray, *, batch_size: int = 64, tile: Optional[bool] = None) -> tuple[np.ndarray, torch.Tensor]:
    """Round-trip uint8 images ``(N, H, W, 3)`` through ``model`` with the posterior mean (deterministic).

    Returns the reconstructions (uint8, same shape) and the unscaled latents ``(N, C, h, w)`` (fp32, CPU).
    Runs in the model's device and dtype.
    """
    weight = model.decoder.conv_out.weight
    out = np.empty_like(images)
    latents = []
    for start in range(0, len(images), batch_size):
        x = images_to_tensor(images[start : start + batch_size]).to(weight.device, weight.dtype)
        z = model.encode(x, tile=tile).mode()
        out[start : start + len(x)] = tensor_to_images(model.decode(z, tile=tile))
        latents.append(z.float().cpu())
    return out, torch.cat(latents) if latents else torch.empty(0)


def latent_statistics(latents: torch.Tensor, scaling_factor: float = 1.0) -> dict[str, Any]:
    """Per-channel mean and standard deviation of latents ``(N, C, h, w)`` (after multiplying by
    ``scaling_factor``), each channel's share of the total variance, and the overall standard
    deviation (1 is what a diffusion model wants)."""
    z = latents.float() * scaling_factor
    var = z.var(dim=(0, 2, 3))
    return {
        "mean": [round(v, 4) for v in z.mean(dim=(0, 2, 3)).tolist()],
        "std": [round(v, 4) for v in var.sqrt().tolist()],
        "variance_share": [round(v, 4) for v in (var / var.sum()).tolist()],
        "overall_std": round(float(z.std()), 4),
        "overall_mean": round(float(z.mean()), 4),
    }


__all__ = [
    "LoadedAutoencoder",
    "load_autoencoder",
    "open_autoencoder_source",
    "save_autoencoder",
    "images_to_tensor",
    "tensor_to_images",
    "reconstruct",
    "latent_statistics",
]
