"""PNDM / PLMS (Liu et al. 2022) as diffusers' ``PNDMScheduler``: the sampler Stable Diffusion 1.x
folders name in their ``scheduler_config.json`` (with ``skip_prk_steps: true``, i.e. PLMS).

Pseudo linear multistep: the DDIM-like transfer from t to t' = t - T // n uses an Adams-Bashforth
combination of the last (up to 4) noise predictions. PLMS warms up with one extra model call (the
second timestep is listed twice: n + 1 calls for n steps); PNDM proper warms up with three
Runge-Kutta steps of four calls each instead (``skip_prk_steps: false``).
"""

from __future__ import annotations

import numpy as np
import torch

from gencli.errors import UserError
from gencli.schedulers.base import COMMON_DEFAULTS, AlphaScheduler, Generators, StepOutput, timestep_grid


class PNDMScheduler(AlphaScheduler):
    diffusers_class = "PNDMScheduler"
    pndm_order = 4
    defaults = {**COMMON_DEFAULTS, "timestep_spacing": "leading", "skip_prk_steps": False, "set_alpha_to_one": False}

    @classmethod
    def choices(cls) -> dict[str, tuple]:
        return {**super().choices(), "prediction_type": ("epsilon", "v_prediction")}

    def __init__(self, config=None, **options) -> None:
        super().__init__(config, **options)
        self.cur_sample = None

    @property
    def display_name(self) -> str:
        return "PLMS" if self.config.skip_prk_steps else "PNDM"

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        self._check_steps(num_inference_steps)
        if not self.config.skip_prk_steps and num_inference_steps < self.pndm_order:
            raise UserError(f"PNDM needs at least {self.pndm_order} steps (its Runge-Kutta warm-up takes 3); use PLMS for fewer")
        n, gap = num_inference_steps, self.config.num_train_timesteps // num_inference_steps
        ascending = timestep_grid(self.config, n, rounded=True)[::-1]
        if self.config.skip_prk_steps:
            self.prk_timesteps = np.array([], dtype=np.int64)
            plms = np.concatenate([ascending[:-1], ascending[-2:-1], ascending[-1:]])[::-1].copy()
        else:
            prk = np.array(ascending[-self.pndm_order :]).repeat(2) + np.tile(np.array([0, gap // 2]), self.pndm_order)
            self.prk_timesteps = prk[:-1].repeat(2)[1:-1][::-1].copy()
            plms = ascending[:-3][::-1].copy()
        self.timesteps = torch.from_numpy(np.concatenate([self.prk_timesteps, plms]).astype(np.int64)).to(device)
        self.ets: list[torch.Tensor] = []
        self.counter = 0
        self.cur_model_output = 0
        self.cur_sample = None

    def _transfer(self, sample: torch.Tensor, t: int, prev_t: int, model_output: torch.Tensor) -> torch.Tensor:
        """x_{t'} from x_t and a noise prediction (Liu et al. eq. 9): the DDIM step written as
        x_t' = sqrt(abar_t'/abar_t) x_t - (abar_t' - abar_t) eps / (abar_t sqrt(1-abar_t') + sqrt(abar_t (1-abar_t) abar_t'))."""
        abar_t, abar_prev = self.alphas_cumprod[t], self.abar(prev_t)
        beta_t, beta_prev = 1 - abar_t, 1 - abar_prev
        if self.config.prediction_type == "v_prediction":
            model_output = (abar_t**0.5) * model_output + (beta_t**0.5) * sample
        denominator = abar_t * beta_prev ** (0.5) + (abar_t * beta_t * abar_prev) ** (0.5)
        return (abar_prev / abar_t) ** (0.5) * sample - (abar_prev - abar_t) * model_output / denominator

    def step(self, model_output, timestep, sample, generator: Generators = None) -> StepOutput:
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        if self.counter < len(self.prk_timesteps) and not self.config.skip_prk_steps:
            prev_sample = self._step_prk(model_output, int(timestep), sample)
        else:
            prev_sample = self._step_plms(model_output, int(timestep), sample)
        self.counter += 1
        return StepOutput(prev_sample, None)

    def _step_prk(self, model_output, t, sample):
        """One of the four stages of a Runge-Kutta warm-up step (weights 1/6, 1/3, 1/3, 1/6)."""
        half = self.config.num_train_timesteps // self.num_inference_steps // 2
        prev_t = t - (0 if self.counter % 2 else half)
        t = int(self.prk_timesteps[self.counter // 4 * 4])
        stage = self.counter % 4
        if stage == 0:
            self.cur_model_output += 1 / 6 * model_output
            self.ets.append(model_output)
            self.cur_sample = sample
        elif stage in (1, 2):
            self.cur_model_output += 1 / 3 * model_output
        else:
            model_output = self.cur_model_output + 1 / 6 * model_output
            self.cur_model_output = 0
        start = self.cur_sample if self.cur_sample is not None else sample
        return self._transfer(start, t, prev_t, model_output)

    def _step_plms(self, model_output, t, sample):
        """A linear multistep step; the first two calls of PLMS form one second-order warm-up step."""
        gap = self.config.num_train_timesteps // self.num_inference_steps
        prev_t = t - gap
        if self.counter != 1:
            self.ets = self.ets[-3:] + [model_output]
        else:  # the repeated timestep: redo the first step with the averaged prediction
            prev_t, t = t, t + gap
        ets = self.ets
        if len(ets) == 1 and self.counter == 0:
            self.cur_sample = sample
        elif len(ets) == 1 and self.counter == 1:
            model_output = (model_output + ets[-1]) / 2
            sample, self.cur_sample = self.cur_sample, None
        elif len(ets) == 2:
            model_output = (3 * ets[-1] - ets[-2]) / 2
        elif len(ets) == 3:
            model_output = (23 * ets[-1] - 16 * ets[-2] + 5 * ets[-3]) / 12
        else:
            model_output = (1 / 24) * (55 * ets[-1] - 59 * ets[-2] + 37 * ets[-3] - 9 * ets[-4])
        return self._transfer(sample, t, prev_t, model_output)
