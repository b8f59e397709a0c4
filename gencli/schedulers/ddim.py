"""DDIM (Song et al. 2021) as diffusers' ``DDIMScheduler``: deterministic at eta = 0, ancestral noise
of eta times the DDPM posterior deviation otherwise.

    x_{t'} = sqrt(abar_t') x0 + sqrt(1 - abar_t' - s^2) eps + s z,
    s = eta sqrt((1 - abar_t') / (1 - abar_t) (1 - abar_t / abar_t'))

As in diffusers, t' is t - num_train_timesteps // num_inference_steps whatever the spacing, and
abar of a negative t' is 1 (``set_alpha_to_one``) or abar_0. ``eta`` is an option of this sampler
(``DDIMScheduler(config, eta=0.3)``), where diffusers takes it as a ``step`` argument.
"""

from __future__ import annotations

from gencli.backend.random import randn_tensor
from gencli.schedulers.base import COMMON_DEFAULTS, THRESHOLDING_DEFAULTS, AlphaScheduler, Generators, StepOutput


class DDIMScheduler(AlphaScheduler):
    diffusers_class = "DDIMScheduler"
    defaults = {
        **COMMON_DEFAULTS,
        **THRESHOLDING_DEFAULTS,
        "timestep_spacing": "leading",
        "clip_sample": True,
        "clip_sample_range": 1.0,
        "set_alpha_to_one": True,
        "rescale_betas_zero_snr": False,
        "eta": 0.0,
    }

    @property
    def display_name(self) -> str:
        return "DDIM"

    def step(self, model_output, timestep, sample, generator: Generators = None) -> StepOutput:
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        t = int(timestep)
        prev_t = t - self.config.num_train_timesteps // self.num_inference_steps
        abar_t, abar_prev = self.alphas_cumprod[t], self.abar(prev_t)
        x0, eps = self.predict(model_output, sample, abar_t)
        eta = self.config.eta
        variance = ((1 - abar_prev) / (1 - abar_t)) * (1 - abar_t / abar_prev)
        std_dev_t = eta * variance ** (0.5)
        prev_sample = abar_prev ** (0.5) * x0 + (1 - abar_prev - std_dev_t**2) ** (0.5) * eps
        if eta > 0:
            noise = randn_tensor(model_output.shape, generator, device=model_output.device, dtype=model_output.dtype)
            prev_sample = prev_sample + std_dev_t * noise
        return StepOutput(prev_sample, x0)
