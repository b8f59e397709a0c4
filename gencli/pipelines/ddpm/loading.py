"""Loading a pixel-space diffusion pipeline folder as diffusers writes it (``DDPMPipeline.save_pretrained``,
the google/ddpm-* downloads): ``model_index.json``, ``unet/`` (a ``UNet2DModel``: ``config.json`` +
``diffusion_pytorch_model.safetensors``) and ``scheduler/scheduler_config.json``; an optional
``generation_config.json`` at the root whose ``sampler`` (a gencli sampler name) and
``num_inference_steps`` are the defaults of a run, as in a text-to-image folder (diffusers ignores it).

Everything that can be refused is refused before a weight is read: a folder that is not a pipeline,
a Stable Diffusion pipeline (its UNet is a ``UNet2DConditionModel``: ``gencli txt2img`` runs it), a
missing or unsupported scheduler config, a UNet config this model cannot build.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gencli.backend.device import Placement
from gencli.backend.layers import prepack_convolutions
from gencli.checkpoints.formats import CheckpointSource, open_source
from gencli.checkpoints.loader import load_model
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError, UserError
from gencli.io import read_json
from gencli.models.unet.unet_2d import CLASS_NAME, UNet2DConfig, UNet2DModel
from gencli.schedulers import resolve_sampler
from gencli.schedulers.base import load_scheduler_config

SD_HINT = "a Stable Diffusion pipeline (its UNet is a UNet2DConditionModel): run it with gencli txt2img"


@dataclass
class DDPMCheckpoint:
    """What a pipeline folder holds, read without its weights: the UNet's config, the scheduler config."""

    path: Path
    unet_source: CheckpointSource
    unet_config: UNet2DConfig
    scheduler_config: dict[str, Any]
    model_index: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)  # generation_config.json: a run's defaults

    @property
    def name(self) -> str:
        """The model's name in the image parameters: the folder's name."""
        return self.path.resolve().name

    @property
    def scheduler_class(self) -> str:
        """The scheduler class the folder names (``DDPMScheduler`` when it names none)."""
        return str(self.scheduler_config.get("_class_name") or "DDPMScheduler")

    @property
    def num_train_timesteps(self) -> int:
        return int(self.scheduler_config.get("num_train_timesteps", 1000))

    @property
    def default_sampler(self) -> str:
        """``generation_config.json``'s sampler, else the folder's own (``ddpm`` for a DDPMScheduler,
        ``ddim`` for a DDIMScheduler, ...)."""
        if "sampler" in self.generation_config:
            return resolve_sampler(self.generation_config["sampler"]).name
        own = {"DDPMScheduler": "ddpm", "DDIMScheduler": "ddim"}.get(self.scheduler_class)
        if own is not None:
            return own
        try:
            return resolve_sampler(self.scheduler_class).name  # another diffusers class: every option from the config
        except UserError:
            return "ddpm"

    def model_hash(self) -> str:
        """SHA-256 (10 hex digits) of the UNet's weight files, as other front ends show a model hash."""
        from gencli.pipelines.diffusion.png_parameters import files_hash

        return files_hash(self.unet_source.weight_files)


def _unet_config_dict(folder: Path) -> dict[str, Any]:
    cfg_file = folder / "unet" / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"'{folder}' has no unet/config.json: a DDPM pipeline folder holds model_index.json, unet/ and scheduler/")
    return read_json(cfg_file)


def inspect_pipeline(path: str | Path, *, allow_pickle: bool = False) -> DDPMCheckpoint:
    """The configs of the pipeline folder at ``path``; one-line :class:`UserError` for what it cannot run."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"'{p}' does not exist")
    if not p.is_dir():
        raise UserError(f"'{p}' is not a folder: a DDPM pipeline is a folder with model_index.json, unet/ and scheduler/")
    index = read_json(p / "model_index.json") if (p / "model_index.json").is_file() else {}
    if not isinstance(index, dict):
        raise UserError(f"'{p}/model_index.json' is not a JSON object")
    if (p / "unet").is_dir() and (p / "unet" / "config.json").is_file():
        unet_cfg = _unet_config_dict(p)
    elif (p / "config.json").is_file():
        cfg = read_json(p / "config.json")
        if isinstance(cfg, dict) and cfg.get("_class_name") == "UNet2DConditionModel":
            raise UserError(f"'{p}' holds a Stable Diffusion UNet (UNet2DConditionModel): run its pipeline folder with gencli txt2img")
        raise UserError(f"'{p}' is not a DDPM pipeline folder: expected model_index.json, unet/ and scheduler/")
    else:
        raise UserError(f"'{p}' is not a DDPM pipeline folder: expected model_index.json, unet/ and scheduler/")
    if not isinstance(unet_cfg, dict):
        raise UserError(f"'{p}/unet/config.json' is not a JSON object")
    unet_class = unet_cfg.get("_class_name")
    if unet_class == "UNet2DConditionModel" or "text_encoder" in index or (p / "text_encoder").is_dir():
        raise UserError(f"'{p}' is {SD_HINT}")
    if unet_class not in (None, CLASS_NAME):
        raise UserError(f"'{p}/unet' holds a {unet_class}, not a {CLASS_NAME}: gencli sample ddpm runs UNet2DModel pipelines")
    sched_file = p / "scheduler" / "scheduler_config.json"
    if not sched_file.is_file():
        raise UserError(f"'{p}' has no scheduler/scheduler_config.json: a DDPM pipeline needs its scheduler config (the noise schedule)")
    scheduler_config = load_scheduler_config(sched_file)
    try:
        config = UNet2DConfig.from_dict(unet_cfg)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"'{p}/unet': the UNet config is not supported: {exc}") from None
    if config.sample_size is None:
        raise CheckpointError(f"'{p}/unet/config.json' has no sample_size: the image size is unknown")
    factor = 2 ** (config.num_levels - 1)
    if any(s % factor for s in config.image_size):
        raise CheckpointError(f"'{p}/unet': sample_size {config.sample_size} is not a multiple of {factor} ({config.num_levels} levels)")
    generation_config = _generation_config(p, int(scheduler_config.get("num_train_timesteps", 1000)))
    src = open_source(p / "unet", allow_pickle=allow_pickle)
    return DDPMCheckpoint(p, src, config, scheduler_config, index, generation_config)


def _generation_config(folder: Path, timesteps: int) -> dict[str, Any]:
    """``generation_config.json`` (``{}`` without one), typed as a text-to-image folder's, its steps
    within the training timesteps and its sampler one gencli has."""
    from gencli.pipelines.diffusion.pipeline import GENERATION_CONFIG, check_generation_config

    config = read_json(folder / GENERATION_CONFIG, missing_ok=True) or {}
    where = f"'{folder}/{GENERATION_CONFIG}'"
    check_generation_config(config, folder)
    if not 1 <= config.get("num_inference_steps", 1) <= timesteps:
        raise CheckpointError(f"{where}: num_inference_steps must be from 1 to {timesteps}, the training timesteps (got {config['num_inference_steps']})")
    if "sampler" in config:
        try:
            resolve_sampler(config["sampler"])
        except UserError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
    return config


@dataclass
class LoadedDDPM:
    """A loaded pipeline: the UNet in its placement and the folder it came from."""

    checkpoint: DDPMCheckpoint
    unet: UNet2DModel
    placement: Placement
    _hash: Optional[str] = None

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @property
    def model_hash(self) -> str:
        if self._hash is None:
            self._hash = self.checkpoint.model_hash()
        return self._hash


def load_unet(checkpoint: DDPMCheckpoint, placement: Placement, *, allow_pickle: bool = False) -> UNet2DModel:
    """The UNet of ``checkpoint`` in ``placement`` (memory-mapped, each tensor moved once); on a CPU
    with channels-last feature maps and its convolution weights packed for oneDNN on the first call."""
    cfg = checkpoint.unet_config
    cpu = placement.device.type == "cpu"
    private = (lambda _name, target: target.ndim == 4) if cpu else None  # conv weights are repacked: no views of the mapped file
    with TensorReader(checkpoint.unet_source, allow_pickle=allow_pickle) as reader:
        unet = load_model(lambda: UNet2DModel(cfg), reader, device=placement.device, dtype=placement.dtype, config=dict(cfg.raw), what="a UNet2DModel",
                          private=private)  # fmt: skip
    unet.eval()
    if cpu:  # what the SD UNet runs fastest with on a CPU (scripts/bench.py ddpm measures it)
        packing = prepack_convolutions(unet, True, winograd=True)  # the float32 3x3 layers by Winograd's F(2x2, 3x3)
        unet.use_channels_last(True, weights=not packing)
    return unet


def open_ddpm(
    checkpoint: DDPMCheckpoint, *, device: str = "auto", dtype: str = "auto", threads: Optional[int] = None, allow_pickle: bool = False
) -> LoadedDDPM:
    """Load the UNet of an inspected pipeline with the user's ``--device/--dtype/--threads``. ``auto``
    is the UNet families' choice (:func:`gencli.backend.device.resolve_dtype`, ``"transformer"``):
    bf16 on a CPU that multiplies bf16 natively (AMX, AVX512-BF16), else fp32 on a CPU; bf16 on CUDA
    where supported, else fp16; fp16 on MPS. The sampler's arithmetic stays fp32 whatever the UNet's
    dtype; its threads, every usable core."""
    from gencli.backend.device import choose_placement

    placement = choose_placement(device, dtype, "transformer", threads)
    return LoadedDDPM(checkpoint, load_unet(checkpoint, placement, allow_pickle=allow_pickle), placement)


__all__ = ["DDPMCheckpoint", "LoadedDDPM", "inspect_pipeline", "load_unet", "open_ddpm"]
