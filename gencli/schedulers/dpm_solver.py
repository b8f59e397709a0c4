"""DPM-Solver++ multistep (Lu et al. 2022) as diffusers' ``DPMSolverMultistepScheduler``.

"DPM++ 2M" is ``solver_order=2`` with ``algorithm_type="dpmsolver++"``; "Karras" uses the Karras sigma
ramp; "SDE" is ``algorithm_type="sde-dpmsolver++"`` (fresh noise each step). With
lambda = log(alpha_t / sigma_t) and h = lambda_next - lambda_now, the data-prediction update is

    x_next = (sigma_next / sigma_now) x - alpha_next (e^{-h} - 1) D0 + (second/third-order terms in D1, D2)

where D0 is the newest x0 estimate and D1, D2 divided differences of the previous ones. The first
step is first order, and so is the last when it lands on sigma = 0 (``final_sigmas_type="zero"``) or
with ``lower_order_final`` and fewer than 15 steps (which also makes the second-to-last step at
most second order). Works on the unscaled x_t = alpha_t x0 + sigma_t eps: no input scaling and unit
initial noise, unlike the other sigma samplers.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gencli.backend.random import randn_tensor
from gencli.schedulers.base import (
    COMMON_DEFAULTS,
    THRESHOLDING_DEFAULTS,
    Generators,
    Scheduler,
    SigmaScheduler,
    StepOutput,
    broadcast_to,
    karras_sigmas,
    sigma_to_t,
    threshold_sample,
)

# diffusers maps these algorithm/solver names of sibling schedulers (DEIS, UniPC) onto its own
_ALGORITHM_ALIASES = {"deis": "dpmsolver++"}
_SOLVER_ALIASES = {"logrho": "midpoint", "bh1": "midpoint", "bh2": "midpoint"}


def alpha_sigma(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alpha_t, sigma_t)`` of the variance-preserving process at VE noise level ``sigma``."""
    alpha_t = 1 / ((sigma**2 + 1) ** 0.5)
    return alpha_t, sigma * alpha_t


class DPMSolverMultistepScheduler(SigmaScheduler):
    diffusers_class = "DPMSolverMultistepScheduler"
    defaults = {
        **COMMON_DEFAULTS,
        **THRESHOLDING_DEFAULTS,
        "solver_order": 2,
        "algorithm_type": "dpmsolver++",
        "solver_type": "midpoint",
        "lower_order_final": True,
        "euler_at_final": False,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "use_lu_lambdas": False,
        "use_flow_sigmas": False,
        "final_sigmas_type": "zero",
        "lambda_min_clipped": -math.inf,
        "variance_type": None,
        "rescale_betas_zero_snr": False,
        "use_dynamic_shifting": False,
    }

    def __init__(self, config=None, **options) -> None:
        super().__init__(config, **options)
        abar = self.alphas_cumprod
        self.lambda_t = torch.log(torch.sqrt(abar)) - torch.log(torch.sqrt(1 - abar))
        self.model_outputs: list[torch.Tensor | None] = [None] * self.config.solver_order
        self.lower_order_nums = 0

    @classmethod
    def choices(cls) -> dict[str, tuple]:
        return {**super().choices(), "variance_type": (None,)}

    def _check_choices(self, values) -> None:
        values["algorithm_type"] = _ALGORITHM_ALIASES.get(values["algorithm_type"], values["algorithm_type"])
        values["solver_type"] = _SOLVER_ALIASES.get(values["solver_type"], values["solver_type"])
        super()._check_choices(values)

    @property
    def display_name(self) -> str:
        sde = " SDE" if self.config.algorithm_type == "sde-dpmsolver++" else ""
        karras = " Karras" if self.config.use_karras_sigmas else ""
        return f"DPM++ {self.config.solver_order}M{sde}{karras}"

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        self._check_steps(num_inference_steps)
        cfg, n = self.config, num_inference_steps
        clipped = torch.searchsorted(torch.flip(self.lambda_t, [0]), cfg.lambda_min_clipped)
        last = cfg.num_train_timesteps - int(clipped)
        if cfg.timestep_spacing == "linspace":
            timesteps = np.linspace(0, last - 1, n + 1).round()[::-1][:-1].astype(np.int64)
        elif cfg.timestep_spacing == "leading":
            timesteps = (np.arange(0, n + 1) * (last // (n + 1))).round()[::-1][:-1].astype(np.int64) + cfg.steps_offset
        else:
            timesteps = np.arange(last, 0, -cfg.num_train_timesteps / n).round().astype(np.int64) - 1
        train = self.train_sigmas()
        if cfg.use_karras_sigmas:
            sigmas = karras_sigmas(np.flip(train).copy(), n)
            timesteps = sigma_to_t(sigmas, np.log(train))
            if cfg.beta_schedule != "squaredcos_cap_v2":
                timesteps = timesteps.round()
        else:
            sigmas = np.interp(timesteps, np.arange(0, len(train)), train)
        self.sigmas = torch.from_numpy(np.concatenate([sigmas, [self.final_sigma()]]).astype(np.float32))
        self.timesteps = torch.from_numpy(timesteps).to(device=device, dtype=torch.int64)
        self.num_inference_steps = len(timesteps)
        self.model_outputs = [None] * cfg.solver_order
        self.lower_order_nums = 0

    init_noise_sigma = Scheduler.init_noise_sigma
    scale_model_input = Scheduler.scale_model_input

    def _index_of_unknown_timestep(self, timestep) -> int:
        return len(self.timesteps) - 1  # diffusers starts at the last step for a timestep not in the schedule

    def convert_model_output(self, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """The x0 estimate (the data prediction DPM-Solver++ integrates)."""
        kind = self.config.prediction_type
        if kind == "sample":
            x0 = model_output
        else:
            alpha_t, sigma_t = alpha_sigma(self.sigmas[self._step_index])
            if kind == "epsilon":
                x0 = (sample - sigma_t * model_output) / alpha_t
            else:  # v_prediction
                x0 = alpha_t * sample - sigma_t * model_output
        if self.config.thresholding:
            x0 = threshold_sample(x0, self.config.dynamic_thresholding_ratio, self.config.sample_max_value)
        return x0

    def _update(self, order: int, sample: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """One multistep update of ``order`` (1 to 3) from the stored x0 estimates."""
        i = self._step_index
        alpha_t, sigma_t = alpha_sigma(self.sigmas[i + 1])
        alphas_sigmas = [alpha_sigma(self.sigmas[i - k]) for k in range(order)]  # now, previous, ...
        lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
        lambdas = [torch.log(a) - torch.log(s) for a, s in alphas_sigmas]
        h = lambda_t - lambdas[0]
        sigma_s0 = alphas_sigmas[0][1]
        m = self.model_outputs[::-1]  # newest first
        sde = self.config.algorithm_type == "sde-dpmsolver++"
        if sde:
            c_x = sigma_t / sigma_s0 * torch.exp(-h)
            c0 = alpha_t * (1 - torch.exp(-2.0 * h))
            c1_heun = alpha_t * ((1.0 - torch.exp(-2.0 * h)) / (-2.0 * h) + 1.0)
        else:
            c_x = sigma_t / sigma_s0
            c0 = -(alpha_t * (torch.exp(-h) - 1.0))
            c1_heun = alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)
        x = c_x * sample + c0 * m[0]
        if order == 2:
            r0 = (lambdas[0] - lambdas[1]) / h
            d1 = (1.0 / r0) * (m[0] - m[1])
            x = x + (0.5 * c0 if self.config.solver_type == "midpoint" else c1_heun) * d1
        elif order == 3:
            r0, r1 = (lambdas[0] - lambdas[1]) / h, (lambdas[1] - lambdas[2]) / h
            d1_0, d1_1 = (1.0 / r0) * (m[0] - m[1]), (1.0 / r1) * (m[1] - m[2])
            d1 = d1_0 + (r0 / (r0 + r1)) * (d1_0 - d1_1)
            d2 = (1.0 / (r0 + r1)) * (d1_0 - d1_1)
            if sde:
                c2 = alpha_t * ((1.0 - torch.exp(-2.0 * h) - 2.0 * h) / (2.0 * h) ** 2 - 0.5)
            else:
                c2 = -(alpha_t * ((torch.exp(-h) - 1.0 + h) / h**2 - 0.5))
            x = x + c1_heun * d1 + c2 * d2
        if sde:
            x = x + sigma_t * torch.sqrt(1.0 - torch.exp(-2 * h)) * noise
        return x

    def step(self, model_output, timestep, sample, generator: Generators = None) -> StepOutput:
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        self._init_step_index(timestep)
        cfg, i, n = self.config, self._step_index, len(self.timesteps)
        short = cfg.lower_order_final and n < 15
        final_first_order = i == n - 1 and (cfg.euler_at_final or short or cfg.final_sigmas_type == "zero")
        x0 = self.convert_model_output(model_output, sample)
        self.model_outputs = self.model_outputs[1:] + [x0]
        sample = sample.to(torch.float32)
        noise = None
        if cfg.algorithm_type == "sde-dpmsolver++":
            noise = randn_tensor(model_output.shape, generator, device=model_output.device, dtype=torch.float32)
        if cfg.solver_order == 1 or self.lower_order_nums < 1 or final_first_order:
            order = 1
        elif cfg.solver_order == 2 or self.lower_order_nums < 2 or (i == n - 2 and short):
            order = 2
        else:
            order = 3
        prev_sample = self._update(order, sample, noise)
        self.lower_order_nums = min(self.lower_order_nums + 1, cfg.solver_order)
        self._step_index += 1
        return StepOutput(prev_sample.to(x0.dtype), x0)

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """x_t = alpha_t x_0 + sigma_t noise at the noise level of ``timesteps``."""
        sigmas = self.sigmas.to(device=original_samples.device, dtype=original_samples.dtype)
        alpha_t, sigma_t = alpha_sigma(broadcast_to(sigmas[self._noise_indices(timesteps)], original_samples))
        return alpha_t * original_samples + sigma_t * noise
