"""Loading the diffusion UNet (:class:`gencli.models.unet.unet_2d_condition.UNet2DConditionModel`) from what people
download:

- a diffusers ``unet/`` folder: ``config.json`` + ``diffusion_pytorch_model.safetensors``, a sharded
  ``diffusion_pytorch_model.safetensors.index.json``, or ``variant`` files
  (``diffusion_pytorch_model.fp16.safetensors``); a diffusers pipeline folder stands for its ``unet/``;
- a single-file Stable Diffusion checkpoint in the original layout (SD 1.x, 2.x, SDXL): the
  ``model.diffusion_model.*`` tensors, the architecture inferred from their names and shapes
  (:func:`gencli.models.unet.single_file.infer_unet_config`) unless a diffusers config is given.

Weights are memory-mapped and land once in the placement's dtype and device (built on the meta
device, each tensor read once). On a CPU the loaded UNet runs channels-last with its convolution
weights packed for oneDNN on the first call (``UNet2DConditionModel.use_channels_last`` and
``prepack_convolutions``; both reversible).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from gencli.backend.device import Placement
from gencli.backend.layers import prepack_convolutions
from gencli.checkpoints.formats import CheckpointSource, open_source
from gencli.checkpoints.keymap import Drop, KeyMap
from gencli.checkpoints.loader import load_model
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError
from gencli.io import read_json
from gencli.models.unet.single_file import UNET_PREFIX, infer_unet_config, original_unet_keymap, prediction_type_hint, unet_family
from gencli.models.unet.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel

# diffusers checkpoints saved by older versions carry no buffers; nothing to drop but what
# UNet2DConditionModel itself never had
DIFFUSERS_UNET = KeyMap([Drop(r"(^|\.)position_ids$")], "diffusers UNet2DConditionModel")


def _config_object(config: Mapping[str, Any], origin: Any) -> UNet2DConditionConfig:
    try:
        return UNet2DConditionConfig.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"'{origin}': the UNet config is not supported: {exc}") from None


def _read_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """A config dict, or a config.json file, or a folder holding one (a diffusers ``unet/`` folder,
    or a pipeline folder with ``unet/config.json``)."""
    if isinstance(config, Mapping):
        return dict(config)
    p = Path(config)
    for cand in (p, p / "config.json", p / "unet" / "config.json"):
        if cand.is_file():
            return read_json(cand)
    raise CheckpointError(f"no UNet config.json at '{p}'")


def prepare_for_device(unet: UNet2DConditionModel, placement: Placement) -> UNet2DConditionModel:
    """What the UNet runs fastest with on ``placement``: on a CPU, channels-last feature maps and
    convolution weights packed for oneDNN on the first call (measured by ``scripts/bench.py unet``)."""
    if placement.device.type == "cpu":
        packing = prepack_convolutions(unet, True)
        unet.use_channels_last(True, weights=not packing)
    return unet


def _private_reads(placement: Placement):
    """On a CPU, the conv weights are repacked on the first call: read them as private copies, not
    as views of the memory-mapped file (the file's pages would stay resident next to the packed copies)."""
    return (lambda _name, target: target.ndim == 4) if placement.device.type == "cpu" else None


def _load_diffusers_layout(src: CheckpointSource, config: Mapping[str, Any], placement: Placement, allow_pickle: bool) -> UNet2DConditionModel:
    unet_config = _config_object(config, src.path)
    with TensorReader(src, allow_pickle=allow_pickle) as reader:
        unet = load_model(
            lambda: UNet2DConditionModel(unet_config),
            reader,
            DIFFUSERS_UNET,
            device=placement.device,
            dtype=placement.dtype,
            config=dict(config),
            private=_private_reads(placement),
        )
    return prepare_for_device(unet, placement)


def load_unet_from_folder(path: str | Path, placement: Placement, *, variant: Optional[str] = None, allow_pickle: bool = False) -> UNet2DConditionModel:
    """A diffusers UNet folder (``config.json`` + weights), or a pipeline folder's ``unet/``."""
    src = open_source(path, allow_pickle=allow_pickle, variant=variant)
    if src.kind == "diffusers-pipeline":
        src = src.sub("unet")
    if not src.config:
        raise CheckpointError(f"'{src.path}' has no config.json: a diffusers UNet folder needs one")
    return _load_diffusers_layout(src, src.config, placement, allow_pickle)


def unet_shapes(reader: TensorReader, prefix: str = UNET_PREFIX) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the UNet tensors of a single file (from the headers, no tensor data read)."""
    return {k: tuple(reader.shape(k)) for k in reader.keys() if k.startswith(prefix)}


def single_file_unet_config(reader: TensorReader, config: Mapping[str, Any] | str | Path | None = None) -> dict[str, Any]:
    """The diffusers config of a single file's UNet: ``config`` when given (a dict, a config.json or a
    folder holding one), else inferred from the tensor shapes; the SD 2.x 768-v models (v-prediction,
    recognised from their weights) get their 96-latent default size."""
    if config is not None:
        return _read_config(config)
    inferred = infer_unet_config(unet_shapes(reader))
    if unet_family(inferred) == "sd2" and prediction_type_hint(inferred, reader.keys(), reader.get) == "v_prediction":
        inferred["sample_size"] = 96
    return inferred


def load_unet_from_reader(
    reader: TensorReader, placement: Placement, *, config: Mapping[str, Any] | str | Path | None = None
) -> UNet2DConditionModel:
    """The UNet of an opened single-file checkpoint (the ``model.diffusion_model.*`` tensors; the
    rest of the file is left alone, so one reader serves the VAE and text encoders too)."""
    cfg = single_file_unet_config(reader, config)
    unet_config = _config_object(cfg, reader.source.path)
    unet = load_model(
        lambda: UNet2DConditionModel(unet_config),
        reader,
        original_unet_keymap(cfg),
        device=placement.device,
        dtype=placement.dtype,
        config=cfg,
        private=_private_reads(placement),
    )
    return prepare_for_device(unet, placement)


def load_unet_single_file(
    path: str | Path, placement: Placement, *, config: Mapping[str, Any] | str | Path | None = None, allow_pickle: bool = False
) -> UNet2DConditionModel:
    """The UNet of a single-file original-layout checkpoint (see :func:`load_unet_from_reader`)."""
    src = open_source(path, allow_pickle=allow_pickle)
    with TensorReader(src, allow_pickle=allow_pickle) as reader:
        return load_unet_from_reader(reader, placement, config=config)


def load_unet(
    path: str | Path,
    placement: Placement,
    *,
    variant: Optional[str] = None,
    config: Mapping[str, Any] | str | Path | None = None,
    allow_pickle: bool = False,
) -> UNet2DConditionModel:
    """The UNet at ``path``: a diffusers ``unet/`` or pipeline folder, or a single-file checkpoint
    (original layout; ``config`` overrides the inferred architecture). A ``.safetensors`` file in
    diffusers' own layout (``conv_in.weight``, ...) loads with the ``config.json`` beside it."""
    p = Path(path).expanduser()
    if p.is_file():
        src = open_source(p, allow_pickle=allow_pickle)
        with TensorReader(src, allow_pickle=allow_pickle) as reader:
            if any(k.startswith(UNET_PREFIX) for k in reader.keys()):
                return load_unet_from_reader(reader, placement, config=config)
        if config is None and src.config is None:
            raise CheckpointError(f"'{p}' is neither a single-file Stable Diffusion checkpoint (no '{UNET_PREFIX}*' tensors) nor next to a config.json")
        return _load_diffusers_layout(src, _read_config(config) if config is not None else dict(src.config or {}), placement, allow_pickle)
    return load_unet_from_folder(p, placement, variant=variant, allow_pickle=allow_pickle)


__all__ = [
    "load_unet",
    "load_unet_from_folder",
    "load_unet_single_file",
    "load_unet_from_reader",
    "single_file_unet_config",
    "unet_shapes",
    "prepare_for_device",
]
