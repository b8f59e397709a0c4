"""The Latent Consistency Model sampler (Luo et al. 2023) as diffusers' ``LCMScheduler``: for LCM
checkpoints and LCM-LoRA, good images in 2 to 8 steps.

Timesteps: the distillation schedule ``k - 1, 2k - 1, ..., original_inference_steps * k - 1``
(``k = num_train_timesteps // original_inference_steps``, 50 original steps by default), reversed,
and ``num_inference_steps`` of them taken at ``floor(linspace(0, len, n, endpoint=False))``; the
config's ``timestep_spacing`` plays no part, as in diffusers. Each step predicts x0 (by
``prediction_type``, clipped or thresholded as configured), applies the consistency boundary
condition ``denoised = c_out x0 + c_skip x`` with ``c_skip = s^2 / ((t * scaling)^2 + s^2)``,
``c_out = t * scaling / sqrt((t * scaling)^2 + s^2)`` (``s = 0.5``, ``scaling = timestep_scaling``,
10 by default), and noises ``denoised`` afresh to the next timestep,
``x' = sqrt(abar_t') denoised + sqrt(1 - abar_t') z``, with noise drawn from the run's generators;
the last step returns ``denoised``.
"""

from __future__ import annotations

import numpy as np
import torch

from gencli.backend.random import randn_tensor
from gencli.errors import UserError
from gencli.schedulers.base import COMMON_DEFAULTS, THRESHOLDING_DEFAULTS, AlphaScheduler, Generators, StepOutput

SIGMA_DATA = 0.5


class LCMScheduler(AlphaScheduler):
    diffusers_class = "LCMScheduler"
    defaults = {
        **COMMON_DEFAULTS,
        **THRESHOLDING_DEFAULTS,
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "original_inference_steps": 50,
        "clip_sample": False,
        "clip_sample_range": 1.0,
        "set_alpha_to_one": True,
        "timestep_spacing": "leading",
        "timestep_scaling": 10.0,
        "rescale_betas_zero_snr": False,
    }

    @property
    def display_name(self) -> str:
        return "LCM"

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        self._check_steps(num_inference_steps)
        original = int(self.config.original_inference_steps)
        if not 1 <= original <= self.config.num_train_timesteps:
            raise UserError(f"scheduler config: original_inference_steps={original} must be between 1 and {self.config.num_train_timesteps}")
        if num_inference_steps > original:
            raise UserError(f"the LCM sampler takes at most {original} steps (the distillation schedule's original_inference_steps)")
        k = self.config.num_train_timesteps // original
        origin = (np.asarray(list(range(1, original + 1))) * k - 1)[::-1].copy()
        indices = np.floor(np.linspace(0, len(origin), num=num_inference_steps, endpoint=False)).astype(np.int64)
        self.timesteps = torch.from_numpy(origin[indices]).to(device=device, dtype=torch.long)

    def boundary_scalings(self, t: int) -> tuple[float, float]:
        """``(c_skip, c_out)`` of the consistency boundary condition at timestep ``t``."""
        scaled = t * self.config.timestep_scaling
        return SIGMA_DATA**2 / (scaled**2 + SIGMA_DATA**2), scaled / (scaled**2 + SIGMA_DATA**2) ** 0.5

    def step(self, model_output, timestep, sample, generator: Generators = None) -> StepOutput:
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        self._init_step_index(timestep)
        t = int(timestep)
        nxt = self._step_index + 1
        prev_t = int(self.timesteps[nxt]) if nxt < len(self.timesteps) else t
        abar_t, abar_prev = self.alphas_cumprod[t], self.abar(prev_t)
        x0, _ = self.predict(model_output, sample, abar_t)
        c_skip, c_out = self.boundary_scalings(t)
        denoised = c_out * x0 + c_skip * sample
        if self._step_index != self.num_inference_steps - 1:
            noise = randn_tensor(model_output.shape, generator, device=model_output.device, dtype=denoised.dtype)
            prev_sample = abar_prev.sqrt() * denoised + (1 - abar_prev).sqrt() * noise
        else:
            prev_sample = denoised
        self._step_index += 1
        return StepOutput(prev_sample, denoised)
