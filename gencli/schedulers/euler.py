"""Euler (Karras et al. 2022, Algorithm 2 without churn) as diffusers' ``EulerDiscreteScheduler``.

In sigma space, x_{i+1} = x_i + (x_i - x0_i) / sigma_i * (sigma_{i+1} - sigma_i). Sigmas follow the
spaced timesteps, or the Karras ramp (``use_karras_sigmas``, optionally bounded by ``sigma_min`` /
``sigma_max``); ``final_sigmas_type`` ends at 0 or at the smallest training sigma.
"""

from __future__ import annotations

import torch

from gencli.schedulers.base import COMMON_DEFAULTS, Generators, SigmaScheduler, StepOutput


class EulerDiscreteScheduler(SigmaScheduler):
    diffusers_class = "EulerDiscreteScheduler"
    defaults = {
        **COMMON_DEFAULTS,
        "interpolation_type": "linear",
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "sigma_min": None,
        "sigma_max": None,
        "timestep_type": "discrete",
        "rescale_betas_zero_snr": False,
        "final_sigmas_type": "zero",
    }

    @property
    def display_name(self) -> str:
        return "Euler Karras" if self.config.use_karras_sigmas else "Euler"

    def step(self, model_output, timestep, sample, generator: Generators = None) -> StepOutput:
        self._init_step_index(timestep)
        sample = sample.to(torch.float32)
        sigma = self.sigmas[self._step_index]
        x0 = self.predict_x0(model_output, sample, sigma)
        derivative = (sample - x0) / sigma
        prev_sample = sample + derivative * (self.sigmas[self._step_index + 1] - sigma)
        self._step_index += 1
        return StepOutput(prev_sample.to(model_output.dtype), x0)
