"""Linear multistep (LMS) in sigma space as diffusers' ``LMSDiscreteScheduler``.

x_{i+1} = x_i + sum_j c_j d_{i-j} over the last (up to 4) slopes d = (x - x0) / sigma, where c_j
integrates the Lagrange basis polynomial of sigma_{i-j} over [sigma_i, sigma_{i+1}]. diffusers
integrates numerically (scipy ``quad`` of a float32 integrand); the integrand is a polynomial of degree
at most 3, so it is integrated exactly here (the coefficients agree to ~2e-7 relative).
"""

from __future__ import annotations

import math

from gencli.schedulers.base import COMMON_DEFAULTS, Generators, SigmaScheduler, StepOutput


class LMSDiscreteScheduler(SigmaScheduler):
    diffusers_class = "LMSDiscreteScheduler"
    max_order = 4
    defaults = {**COMMON_DEFAULTS, "use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False}

    @property
    def display_name(self) -> str:
        return "LMS Karras" if self.config.use_karras_sigmas else "LMS"

    def __init__(self, config=None, **options) -> None:
        super().__init__(config, **options)
        self.derivatives: list = []  # the last slopes, oldest first

    def set_timesteps(self, num_inference_steps, device=None) -> None:
        super().set_timesteps(num_inference_steps, device)
        self._sigmas64 = self.sigmas.double().tolist()
        self.derivatives = []

    def lms_coefficient(self, order: int, index: int, j: int) -> float:
        """Integral over [sigma_index, sigma_index+1] of the Lagrange basis polynomial that is 1 at
        sigma_{index-j} and 0 at the other ``order - 1`` previous sigmas. The polynomial has degree
        at most 3, so two-point Gauss-Legendre quadrature integrates it exactly."""
        sigmas = self._sigmas64
        nodes = [sigmas[index - k] for k in range(order) if k != j]

        def basis(tau: float) -> float:
            return math.prod((tau - node) / (sigmas[index - j] - node) for node in nodes)

        a, b = sigmas[index], sigmas[index + 1]
        half, middle = (b - a) / 2, (a + b) / 2
        return half * (basis(middle - half / math.sqrt(3)) + basis(middle + half / math.sqrt(3)))

    def step(self, model_output, timestep, sample, generator: Generators = None) -> StepOutput:
        self._init_step_index(timestep)
        sigma = self.sigmas[self._step_index]
        x0 = self.predict_x0(model_output, sample, sigma)
        self.derivatives.append((sample - x0) / sigma)
        if len(self.derivatives) > self.max_order:
            self.derivatives.pop(0)
        order = min(self._step_index + 1, self.max_order)
        coeffs = [self.lms_coefficient(order, self._step_index, j) for j in range(order)]
        prev_sample = sample + sum(c * d for c, d in zip(coeffs, reversed(self.derivatives)))
        self._step_index += 1
        return StepOutput(prev_sample, x0)
