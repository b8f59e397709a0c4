"""DDPM (Ho et al. 2020): the ancestral sampler of the source texts, as diffusers' ``DDPMScheduler``.

From x_t and the model's estimate x0 of the clean sample, draw x_{t'} (t' the previous inference
timestep) from the posterior q(x_{t'} | x_t, x0) = N(mu_tilde, beta_tilde):

    mu_tilde   = sqrt(abar_t') beta_t / (1 - abar_t) x0 + sqrt(alpha_t) (1 - abar_t') / (1 - abar_t) x_t
    beta_tilde = (1 - abar_t') / (1 - abar_t) beta_t

with alpha_t = abar_t / abar_t' and beta_t = 1 - alpha_t (one training step when t' = t - 1). With
epsilon prediction and no clipping this is x_{t-1} = (x_t - beta_t / sqrt(1 - abar_t) eps) /
sqrt(alpha_t) + sigma_t z; no noise is added at t = 0.
"""

from __future__ import annotations

import torch

from gencli.backend.random import randn_tensor
from gencli.schedulers.base import COMMON_DEFAULTS, THRESHOLDING_DEFAULTS, AlphaScheduler, Generators, StepOutput


class DDPMScheduler(AlphaScheduler):
    diffusers_class = "DDPMScheduler"
    defaults = {
        **COMMON_DEFAULTS,
        **THRESHOLDING_DEFAULTS,
        "timestep_spacing": "leading",
        "variance_type": "fixed_small",
        "clip_sample": True,
        "clip_sample_range": 1.0,
        "rescale_betas_zero_snr": False,
    }

    @property
    def display_name(self) -> str:
        return "DDPM"

    def previous_timestep(self, timestep: int) -> int:
        """The next (lower) inference timestep after ``timestep``; -1 after the last one."""
        if self.timesteps is None:
            return timestep - 1
        index = self.index_for_timestep(timestep)
        return int(self.timesteps[index + 1]) if index + 1 < len(self.timesteps) else -1

    def posterior(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x0 coefficient, x_t coefficient, beta_tilde, beta_t)`` of the step from ``t``."""
        prev_t = self.previous_timestep(t)
        abar_t, abar_prev = self.alphas_cumprod[t], self.abar(prev_t)
        alpha_t = abar_t / abar_prev
        beta_t = 1 - alpha_t
        x0_coeff = (abar_prev ** (0.5) * beta_t) / (1 - abar_t)
        xt_coeff = alpha_t ** (0.5) * (1 - abar_prev) / (1 - abar_t)
        beta_tilde = torch.clamp((1 - abar_prev) / (1 - abar_t) * beta_t, min=1e-20)
        return x0_coeff, xt_coeff, beta_tilde, beta_t

    def _noise_std(self, beta_tilde, beta_t, predicted_variance):
        kind = self.config.variance_type
        if kind == "fixed_small":
            return beta_tilde**0.5
        if kind == "fixed_small_log":
            return torch.exp(0.5 * torch.log(beta_tilde))
        if kind == "fixed_large":
            return beta_t**0.5
        if kind == "learned":
            return predicted_variance**0.5
        frac = (predicted_variance + 1) / 2  # learned_range: interpolate log variance between the two
        return torch.exp(0.5 * (frac * torch.log(beta_t) + (1 - frac) * torch.log(beta_tilde)))

    def step(self, model_output, timestep, sample, generator: Generators = None) -> StepOutput:
        t = int(timestep)
        predicted_variance = None
        if self.config.variance_type in ("learned", "learned_range") and model_output.shape[1] == sample.shape[1] * 2:
            model_output, predicted_variance = torch.split(model_output, sample.shape[1], dim=1)
        x0_coeff, xt_coeff, beta_tilde, beta_t = self.posterior(t)
        x0, _ = self.predict(model_output, sample, self.alphas_cumprod[t])
        prev_sample = x0_coeff * x0 + xt_coeff * sample
        if t > 0:
            noise = randn_tensor(model_output.shape, generator, device=model_output.device, dtype=model_output.dtype)
            prev_sample = prev_sample + self._noise_std(beta_tilde, beta_t, predicted_variance) * noise
        return StepOutput(prev_sample, x0)
