"""Loading and saving the ConvVAE and DCGAN checkpoints (and a diffusers ``AutoencoderKL`` as a VAE)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from gencli.backend.device import Placement
from gencli.checkpoints.formats import open_source, with_article, wrong_family
from gencli.checkpoints.loader import load_model, save_model
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError
from gencli.io import atomic_write_bytes
from gencli.models.gan import ARCHITECTURE as GAN_ARCHITECTURE
from gencli.models.gan import DCGAN, DCGANConfig
from gencli.models.vae import ARCHITECTURE as VAE_ARCHITECTURE
from gencli.models.vae import ConvVAE, ConvVAEConfig

FAMILIES: dict[str, tuple[str, type, type]] = {
    "vae": (VAE_ARCHITECTURE, ConvVAE, ConvVAEConfig),
    "gan": (GAN_ARCHITECTURE, DCGAN, DCGANConfig),
}


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
