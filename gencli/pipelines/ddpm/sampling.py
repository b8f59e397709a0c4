"""Sampling a pixel-space diffusion UNet seed by seed, drawing the noise exactly as diffusers'
``DDPMPipeline`` / ``DDIMPipeline`` draw it.

Each image has its own CPU ``torch.Generator`` seeded with its seed. It draws the initial noise
``(1, C, H, W)`` and then, at every ancestral step, that step's noise ``(1, C, H, W)``, in this
order: what diffusers' pipelines draw when they are handed one generator per image. A batch of
images draws row ``i`` from generator ``i`` (:func:`gencli.backend.random.randn_tensor`), so a
seed's noise never depends on the other seeds; with ``batch_size=1`` (the default) its image is the
same bytes whatever else the run samples. The samples stay in float32 whatever the UNet's dtype,
and become pixels as diffusers makes them: ``round(255 * clamp(x / 2 + 0.5, 0, 1))``.

Any sampler of :mod:`gencli.schedulers` runs (``init_noise_sigma``, ``scale_model_input``, ``step``);
DDPM (``variance_type`` fixed_small / fixed_large / learned_range, ``clip_sample``) and DDIM (``eta``)
are the pipelines' own.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from gencli.backend.random import randn_tensor
from gencli.errors import UserError
from gencli.pipelines.ddpm.loading import DDPMCheckpoint, LoadedDDPM
from gencli.schedulers import get_scheduler, resolve_sampler
from gencli.schedulers.base import Scheduler

StepCallback = Callable[[int], None]  # called after each UNet call with the number of images it denoised


def default_steps(checkpoint: DDPMCheckpoint, sampler: str) -> int:
    """Steps when none are asked for: ``generation_config.json``'s ``num_inference_steps``, else the
    training timesteps for DDPM (``DDPMPipeline``'s 1000), 50 otherwise (``DDIMPipeline``'s)."""
    if "num_inference_steps" in checkpoint.generation_config:
        return int(checkpoint.generation_config["num_inference_steps"])
    return checkpoint.num_train_timesteps if resolve_sampler(sampler).class_name == "DDPMScheduler" else min(50, checkpoint.num_train_timesteps)


def make_scheduler(checkpoint: DDPMCheckpoint, sampler: str, eta: float = 0.0) -> Scheduler:
    """A fresh sampler ``sampler`` on the folder's scheduler config (DDIM's ``eta`` when not 0).

    Only DDPM reads a learned variance; the other samplers get the config without ``variance_type``
    (:func:`denoise` hands them the mean channels of a learned-variance model)."""
    config = dict(checkpoint.scheduler_config)
    if resolve_sampler(sampler).class_name != "DDPMScheduler":
        config.pop("variance_type", None)
    return get_scheduler(sampler, config, **({"eta": eta} if eta else {}))


def check_settings(checkpoint: DDPMCheckpoint, sampler: str, steps: int, eta: float, class_label: Optional[int]) -> None:
    """The settings against the model, before anything runs: one-line :class:`UserError`."""
    if not 1 <= steps <= checkpoint.num_train_timesteps:
        raise UserError(f"--steps must be between 1 and {checkpoint.num_train_timesteps} (the model's training timesteps), got {steps}")
    make_scheduler(checkpoint, sampler, eta).set_timesteps(steps)  # the scheduler config's own checks
    cfg = checkpoint.unet_config
    if cfg.class_conditional:
        if cfg.class_embed_type == "identity":
            raise UserError(f"'{checkpoint.path}': class_embed_type 'identity' takes embedding vectors, not labels: gencli cannot condition it")
        if class_label is None:
            classes = f" ({cfg.num_class_embeds} classes)" if cfg.num_class_embeds else ""
            raise UserError(f"'{checkpoint.path}' is class-conditional{classes}: pass --class-label")
        if cfg.num_class_embeds is not None and not 0 <= class_label < cfg.num_class_embeds:
            raise UserError(f"--class-label must be between 0 and {cfg.num_class_embeds - 1}, got {class_label}")
    elif class_label is not None:
        raise UserError(f"'{checkpoint.path}' is not class-conditional: drop --class-label")


def model_calls(checkpoint: DDPMCheckpoint, sampler: str, steps: int, eta: float = 0.0) -> int:
    """UNet calls per image of ``steps`` steps (Heun makes two per step but the last): a progress bar's unit."""
    scheduler = make_scheduler(checkpoint, sampler, eta)
    scheduler.set_timesteps(steps)
    return len(scheduler.timesteps)


def to_pixels(x: torch.Tensor) -> np.ndarray:
    """float samples ``(N, C, H, W)`` in ``[-1, 1]`` -> uint8 ``(N, H, W, C)``, as diffusers' pipelines convert them."""
    images = (x.float() / 2 + 0.5).clamp(0, 1).cpu().permute(0, 2, 3, 1).numpy()
    return (images * 255).round().astype(np.uint8)


@torch.inference_mode()
def denoise(
    loaded: LoadedDDPM,
    seeds: Sequence[int],
    *,
    sampler: str,
    steps: int,
    eta: float = 0.0,
    class_label: Optional[int] = None,
    on_step: Optional[StepCallback] = None,
) -> torch.Tensor:
    """One batch: the final float32 samples ``(len(seeds), C, H, W)`` (before clamping)."""
    unet = loaded.unet
    cfg = loaded.checkpoint.unet_config
    device = unet.device
    generators = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
    scheduler = make_scheduler(loaded.checkpoint, sampler, eta)
    scheduler.set_timesteps(steps, device=device)
    scheduler.set_begin_index(0)  # a schedule that repeats a timestep (Karras sigmas on cosine betas) steps through it in order
    height, width = cfg.image_size
    shape = (len(seeds), cfg.in_channels, height, width)
    x = randn_tensor(shape, generators, device=device, dtype=torch.float32) * scheduler.init_noise_sigma
    labels = torch.full((len(seeds),), int(class_label), dtype=torch.long, device=device) if class_label is not None else None
    channels = cfg.in_channels
    for t in scheduler.timesteps:
        out = unet(scheduler.scale_model_input(x, t), t, labels)
        if out.shape[1] == 2 * channels and not (scheduler.diffusers_class == "DDPMScheduler" and "learned" in str(scheduler.config.variance_type)):
            out = out[:, :channels]  # a learned-variance model under a sampler that uses only the mean
        x = scheduler.step(out, t, x, generator=generators).prev_sample
        if on_step is not None:
            on_step(len(seeds))
    return x


def generate(
    loaded: LoadedDDPM,
    seeds: Sequence[int],
    *,
    sampler: str,
    steps: int,
    eta: float = 0.0,
    class_label: Optional[int] = None,
    batch_size: int = 1,
    on_step: Optional[StepCallback] = None,
) -> np.ndarray:
    """uint8 images ``(len(seeds), H, W, C)``, ``batch_size`` seeds denoised together (see the module doc)."""
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    out = []
    for start in range(0, len(seeds), batch_size):
        group = list(seeds[start : start + batch_size])
        out.append(to_pixels(denoise(loaded, group, sampler=sampler, steps=steps, eta=eta, class_label=class_label, on_step=on_step)))
    h, w = loaded.checkpoint.unet_config.image_size
    return np.concatenate(out) if out else np.empty((0, h, w, loaded.checkpoint.unet_config.in_channels), np.uint8)


def settings_record(checkpoint: DDPMCheckpoint, sampler: str, steps: int, eta: float, class_label: Optional[int]) -> dict[str, Any]:
    """The settings of a run as the JSON records name them."""
    record: dict[str, Any] = {"sampler": resolve_sampler(sampler).name, "steps": steps}
    if resolve_sampler(sampler).class_name == "DDIMScheduler":
        record["eta"] = eta
    if class_label is not None:
        record["class_label"] = class_label
    return record


__all__ = ["default_steps", "make_scheduler", "model_calls", "check_settings", "to_pixels", "denoise", "generate", "settings_record"]
