"""Euler ancestral ("Euler a") as diffusers' ``EulerAncestralDiscreteScheduler``.

Each step goes down to sigma_down by an Euler step and adds fresh noise of deviation sigma_up, with
sigma_up^2 = sigma_next^2 (sigma^2 - sigma_next^2) / sigma^2 and sigma_down^2 = sigma_next^2 - sigma_up^2.
Noise is drawn on every step, the last one included (where sigma_up is 0), exactly as diffusers
draws it, so a seeded generator gives diffusers' image.
"""

from __future__ import annotations

import torch

from gencli.backend.random import randn_tensor
from gencli.schedulers.base import COMMON_DEFAULTS, Generators, SigmaScheduler, StepOutput


class EulerAncestralDiscreteScheduler(SigmaScheduler):
    diffusers_class = "EulerAncestralDiscreteScheduler"
    defaults = {**COMMON_DEFAULTS, "rescale_betas_zero_snr": False}

    @property
    def display_name(self) -> str:
        return "Euler a"

    def step(self, model_output, timestep, sample, generator: Generators = None) -> StepOutput:
        self._init_step_index(timestep)
        sigma = self.sigmas[self._step_index]
        sample = sample.to(torch.float32)
        x0 = self.predict_x0(model_output, sample, sigma)
        sigma_to = self.sigmas[self._step_index + 1]
        sigma_up = (sigma_to**2 * (sigma**2 - sigma_to**2) / sigma**2) ** 0.5
        sigma_down = (sigma_to**2 - sigma_up**2) ** 0.5
        prev_sample = sample + (sample - x0) / sigma * (sigma_down - sigma)
        noise = randn_tensor(model_output.shape, generator, device=model_output.device, dtype=model_output.dtype)
        prev_sample = prev_sample + noise * sigma_up
        self._step_index += 1
        return StepOutput(prev_sample.to(model_output.dtype), x0)
