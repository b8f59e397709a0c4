"""Heun's method (Karras et al. 2022, Algorithm 1 without churn) as diffusers' ``HeunDiscreteScheduler``.

Two model evaluations per step: an Euler step from sigma_i to sigma_{i+1}, then the model at the
predicted point and the average of the two slopes from x_i. The interface keeps this invisible to
the pipeline, as diffusers does: :attr:`timesteps` lists every inner timestep twice
(t_0, t_1, t_1, ..., t_{n-1}, t_{n-1}; 2n - 1 entries) and the loop simply calls
``scale_model_input`` / model / ``step`` once per entry. The last step is a plain Euler step to
sigma = 0. :attr:`order` is 2 (img2img skips ``2 k`` entries for ``k`` skipped steps).
"""

from __future__ import annotations

import numpy as np
import torch

from gencli.schedulers.base import COMMON_DEFAULTS, Generators, SigmaScheduler, StepOutput


class HeunDiscreteScheduler(SigmaScheduler):
    diffusers_class = "HeunDiscreteScheduler"
    order = 2
    _first_slope: torch.Tensor | None = None  # set between the two halves of a step
    _dt: torch.Tensor | None = None
    _start: torch.Tensor | None = None
    defaults = {
        **COMMON_DEFAULTS,
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "clip_sample": False,
        "clip_sample_range": 1.0,
    }

    @property
    def display_name(self) -> str:
        return "Heun Karras" if self.config.use_karras_sigmas else "Heun"

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        self._check_steps(num_inference_steps)
        timesteps, sigmas = self.sigma_schedule(num_inference_steps)
        sigmas = torch.from_numpy(np.concatenate([sigmas, [0.0]]).astype(np.float32))
        self.sigmas = torch.cat([sigmas[:1], sigmas[1:-1].repeat_interleave(2), sigmas[-1:]])
        timesteps = torch.from_numpy(timesteps)
        self.timesteps = torch.cat([timesteps[:1], timesteps[1:].repeat_interleave(2)]).to(device=device, dtype=torch.float32)
        self._first_slope = self._dt = self._start = None

    @property
    def state_in_first_order(self) -> bool:
        """True when the next ``step`` call starts a new step (False: it completes one)."""
        return self._dt is None

    def step(self, model_output, timestep, sample, generator: Generators = None) -> StepOutput:
        self._init_step_index(timestep)
        first = self.state_in_first_order
        if first:
            sigma, sigma_next = self.sigmas[self._step_index], self.sigmas[self._step_index + 1]
        else:
            sigma, sigma_next = self.sigmas[self._step_index - 1], self.sigmas[self._step_index]
        x0 = self.predict_x0(model_output, sample, sigma if first else sigma_next)
        if self.config.clip_sample:
            x0 = x0.clamp(-self.config.clip_sample_range, self.config.clip_sample_range)
        if first:
            slope = (sample - x0) / sigma
            self._first_slope, self._dt, self._start = slope, sigma_next - sigma, sample
            dt = self._dt
        else:
            slope = (self._first_slope + (sample - x0) / sigma_next) / 2
            dt, sample = self._dt, self._start
            self._first_slope = self._dt = self._start = None
        self._step_index += 1
        return StepOutput(sample + slope * dt, x0)
