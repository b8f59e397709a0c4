"""What every diffusion sampler shares: the scheduler config, the noise schedule and one interface.

A sampler is built from a diffusers ``scheduler/scheduler_config.json`` (read with
:func:`load_scheduler_config`) and matches the diffusers scheduler of the same name and config step
for step: the same timesteps, the same input scaling, the same samples out for the same model
outputs in, and the same noise draws for the same seeded CPU generator. Keys a sampler does not use
are ignored and missing keys take that sampler's diffusers default, exactly as diffusers'
``SchedulerClass.from_config(pipe.scheduler.config)`` does.

The denoising loop a pipeline writes against this interface (the one diffusers pipelines run)::

    scheduler.set_timesteps(num_inference_steps, device=device)
    scheduler.set_begin_index(0)           # optional; see below
    latents = randn_tensor(shape, generators, device=device, dtype=dtype) * scheduler.init_noise_sigma
    for t in scheduler.timesteps:          # Heun lists each inner timestep twice: two model calls a step
        model_input = scheduler.scale_model_input(latents, t)      # may be the CFG-doubled batch
        model_output = unet(model_input, t, ...)                   # then combine CFG halves
        latents = scheduler.step(model_output, t, latents, generator=generators).prev_sample

For img2img: ``timesteps, n = scheduler.img2img_timesteps(strength)`` after ``set_timesteps``,
``latents = scheduler.add_noise(image_latents, noise, timesteps[:1].repeat(batch))``, then the same
loop over ``timesteps``.

Without a begin index the first step's index is looked up from its timestep, as diffusers does;
that lookup takes the second of two equal timesteps (right for an img2img start inside Heun's
doubled list, wrong for a schedule that repeats its first timestep, such as Karras sigmas on a
zero-SNR schedule, where diffusers then fails on the last step). ``set_begin_index(0)`` gives the
same result wherever diffusers works and also works there.

The schedule arithmetic follows diffusers' dtypes on purpose (betas and their cumulative product in
float32 torch, the sigma grids in numpy float64 then float32) so that results agree to float
rounding, not merely to a tolerance.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from gencli.errors import UserError
from gencli.schedulers import normalize_name

Generators = torch.Generator | Sequence[torch.Generator] | None

# The values each config key may take here. A key outside a sampler's defaults is never checked (the
# sampler ignores it, as diffusers does); flags that select schedules not implemented here may only
# keep their default, so a config asking for them fails loudly instead of sampling differently.
CHOICES: dict[str, tuple] = {
    "beta_schedule": ("linear", "scaled_linear", "squaredcos_cap_v2"),
    "prediction_type": ("epsilon", "v_prediction", "sample"),
    "timestep_spacing": ("leading", "trailing", "linspace"),
    "variance_type": ("fixed_small", "fixed_small_log", "fixed_large", "learned", "learned_range"),
    "final_sigmas_type": ("zero", "sigma_min"),
    "algorithm_type": ("dpmsolver++", "sde-dpmsolver++"),
    "solver_type": ("midpoint", "heun"),
    "solver_order": (1, 2, 3),
    "interpolation_type": ("linear",),
    "timestep_type": ("discrete",),
    "use_exponential_sigmas": (False,),
    "use_beta_sigmas": (False,),
    "use_lu_lambdas": (False,),
    "use_flow_sigmas": (False,),
    "use_dynamic_shifting": (False,),
}


# Defaults shared by every diffusers scheduler here (each class adds its own keys and may differ).
COMMON_DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "trained_betas": None,
    "prediction_type": "epsilon",
    "timestep_spacing": "linspace",
    "steps_offset": 0,
}
THRESHOLDING_DEFAULTS: dict[str, Any] = {"thresholding": False, "dynamic_thresholding_ratio": 0.995, "sample_max_value": 1.0}


def load_scheduler_config(path: str | Path) -> dict[str, Any]:
    """The raw dict of a diffusers scheduler config.

    ``path`` is a ``scheduler_config.json``, a folder holding one, or a pipeline folder with a
    ``scheduler/`` subfolder. Missing or unreadable files raise :class:`UserError` (one line).
    """
    path = Path(path)
    candidates = [path] if path.is_file() else [path / "scheduler_config.json", path / "scheduler" / "scheduler_config.json"]
    for candidate in candidates:
        if candidate.is_file():
            try:
                config = json.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise UserError(f"{candidate}: not a readable scheduler config ({exc})") from None
            if not isinstance(config, dict):
                raise UserError(f"{candidate}: a scheduler config must be a JSON object")
            return config
    raise UserError(f"{path}: no scheduler_config.json found (looked for {', '.join(str(c) for c in candidates)})")


# ---------------------------------------------------------------------------------------------
# the noise schedule


def cosine_betas(num_train_timesteps: int, max_beta: float = 0.999) -> torch.Tensor:
    """``squaredcos_cap_v2``: betas that discretise abar(t) = cos^2((t + 0.008) / 1.008 * pi / 2)."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    steps = [(i / num_train_timesteps, (i + 1) / num_train_timesteps) for i in range(num_train_timesteps)]
    return torch.tensor([min(1 - alpha_bar(t2) / alpha_bar(t1), max_beta) for t1, t2 in steps], dtype=torch.float32)


def rescale_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Shift and scale sqrt(abar) so that the last timestep has zero SNR (Lin et al. 2023, Algorithm 1)."""
    sqrt_abar = torch.cumprod(1.0 - betas, dim=0).sqrt()
    first, last = sqrt_abar[0].clone(), sqrt_abar[-1].clone()
    sqrt_abar = (sqrt_abar - last) * (first / (first - last))
    abar = sqrt_abar**2
    alphas = torch.cat([abar[0:1], abar[1:] / abar[:-1]])
    return 1 - alphas


def make_betas(config: SimpleNamespace) -> torch.Tensor:
    """The float32 betas of a config: ``trained_betas`` when given, else ``beta_schedule``."""
    n = config.num_train_timesteps
    if config.trained_betas is not None:
        betas = torch.tensor(config.trained_betas, dtype=torch.float32)
    elif config.beta_schedule == "linear":
        betas = torch.linspace(config.beta_start, config.beta_end, n, dtype=torch.float32)
    elif config.beta_schedule == "scaled_linear":
        betas = torch.linspace(config.beta_start**0.5, config.beta_end**0.5, n, dtype=torch.float32) ** 2
    else:  # squaredcos_cap_v2 (validated)
        betas = cosine_betas(n)
    if getattr(config, "rescale_betas_zero_snr", False):
        betas = rescale_zero_terminal_snr(betas)
    return betas


def timestep_grid(config: SimpleNamespace, num_inference_steps: int, *, rounded: bool) -> np.ndarray:
    """The inference timesteps, high to low, by ``timestep_spacing`` (leading adds ``steps_offset``).

    ``rounded`` picks the DDPM/DDIM flavour of ``linspace`` (rounded to integers in float64); the
    sigma samplers use float32 ``linspace`` points as they are. Leading and trailing are integers in
    both flavours. Returns float64 (rounded) or float32 (not rounded) like diffusers does.
    """
    n_train = config.num_train_timesteps
    spacing = config.timestep_spacing
    if spacing == "linspace":
        if rounded:
            return np.linspace(0, n_train - 1, num_inference_steps).round()[::-1].copy()
        return np.linspace(0, n_train - 1, num_inference_steps, dtype=np.float32)[::-1].copy()
    if spacing == "leading":
        ratio = n_train // num_inference_steps
        grid = (np.arange(0, num_inference_steps) * ratio).round()[::-1].copy()
        grid = grid if rounded else grid.astype(np.float32)
        return grid + config.steps_offset
    grid = np.round(np.arange(n_train, 0, -n_train / num_inference_steps))  # trailing
    grid = grid if rounded else grid.astype(np.float32)
    return grid - 1


def karras_sigmas(
    in_sigmas: np.ndarray, num_inference_steps: int, sigma_min=None, sigma_max=None, rho: float = 7.0
) -> np.ndarray:
    """Karras et al. (2022) noise levels between the ends of ``in_sigmas`` (high to low), rho = 7."""
    sigma_min = sigma_min if sigma_min is not None else in_sigmas[-1].item()
    sigma_max = sigma_max if sigma_max is not None else in_sigmas[0].item()
    ramp = np.linspace(0, 1, num_inference_steps)
    min_inv_rho, max_inv_rho = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Fractional training timesteps of ``sigmas``: linear interpolation in log-sigma."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return ((1 - w) * low + w * (low + 1)).reshape(np.shape(sigmas))


def broadcast_to(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` (one per batch row) reshaped to broadcast over ``like``."""
    values = values.flatten()
    return values.reshape(values.shape + (1,) * (like.dim() - 1))


def threshold_sample(sample: torch.Tensor, ratio: float, max_value: float) -> torch.Tensor:
    """Dynamic thresholding (Imagen): clamp each sample to its ``ratio`` quantile of |x| (at least 1)
    and divide by it."""
    dtype = sample.dtype
    batch, channels, *rest = sample.shape
    flat = sample.float() if dtype not in (torch.float32, torch.float64) else sample
    flat = flat.reshape(batch, channels * int(np.prod(rest)))
    s = torch.quantile(flat.abs(), ratio, dim=1).clamp(min=1, max=max_value).unsqueeze(1)
    return (torch.clamp(flat, -s, s) / s).reshape(batch, channels, *rest).to(dtype)


# ---------------------------------------------------------------------------------------------
# the interface


class StepOutput(NamedTuple):
    """What :meth:`Scheduler.step` returns: the sample for the next timestep and the model's current
    estimate of the clean sample (``None`` where a sampler has none)."""

    prev_sample: torch.Tensor
    pred_original_sample: torch.Tensor | None


class Scheduler:
    """Base of every sampler. Subclasses set :attr:`defaults` (the diffusers ``__init__`` defaults
    of the keys they read) and implement :meth:`set_timesteps` and :meth:`step`."""

    #: diffusers class this sampler reproduces
    diffusers_class: ClassVar[str] = ""
    #: config keys this sampler reads and their defaults (diffusers' defaults for that class)
    defaults: ClassVar[dict[str, Any]] = {}
    #: model evaluations per inference step (2 for Heun); img2img offsets count in these
    order: ClassVar[int] = 1

    def __init__(self, config: Mapping[str, Any] | None = None, **options: Any) -> None:
        """``config``: a diffusers scheduler config dict (see :func:`load_scheduler_config`);
        ``options`` override it. Keys this sampler does not read are ignored."""
        values = dict(self.defaults)
        for source in (config or {}, options):
            values.update({k: v for k, v in source.items() if k in self.defaults})
        self._check_choices(values)
        self.config = SimpleNamespace(**values)
        self.betas = make_betas(self.config)
        self.alphas = 1.0 - self.betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)
        self.num_inference_steps: int | None = None
        self.timesteps: torch.Tensor | None = None
        self._step_index: int | None = None
        self._begin_index: int | None = None

    def _check_choices(self, values: dict[str, Any]) -> None:
        for key, allowed in self.choices().items():
            if key in values and values[key] not in allowed:
                raise UserError(
                    f"scheduler config: {key}={values[key]!r} is not supported by {self.diffusers_class} "
                    f"(supported: {', '.join(map(str, allowed))})"
                )
        if values.get("trained_betas") is None and values.get("beta_schedule") not in CHOICES["beta_schedule"]:
            raise UserError(f"scheduler config: beta_schedule={values.get('beta_schedule')!r} is not supported")

    @classmethod
    def choices(cls) -> dict[str, tuple]:
        """Allowed values per config key (a subclass may narrow them)."""
        return {k: v for k, v in CHOICES.items() if k != "beta_schedule"}

    # -- names ---------------------------------------------------------------------------------
    @property
    def sampler_name(self) -> str:
        """The canonical sampler name (``get_scheduler(s.sampler_name, config)`` rebuilds it)."""
        return normalize_name(self.display_name)

    @property
    def display_name(self) -> str:
        """The name other front ends write in a PNG's ``parameters`` (e.g. ``DPM++ 2M Karras``)."""
        raise NotImplementedError

    # -- the interface -------------------------------------------------------------------------
    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        """Prepare ``num_inference_steps`` steps; fills :attr:`timesteps` (on ``device``) and resets
        the step counter. Call before every sampling run."""
        raise NotImplementedError

    def _check_steps(self, num_inference_steps: int) -> None:
        if not 1 <= num_inference_steps <= self.config.num_train_timesteps:
            raise UserError(
                f"steps must be between 1 and {self.config.num_train_timesteps} (the model's training "
                f"timesteps), got {num_inference_steps}"
            )
        self.num_inference_steps = num_inference_steps
        self._step_index = None
        self._begin_index = None

    @property
    def init_noise_sigma(self) -> float | torch.Tensor:
        """Standard deviation of the initial noise: multiply unit Gaussian latents by it."""
        return 1.0

    def scale_model_input(self, sample: torch.Tensor, timestep: float | torch.Tensor) -> torch.Tensor:
        """The model's input at ``timestep`` (the sigma samplers divide by sqrt(sigma^2 + 1))."""
        return sample

    def step(
        self, model_output: torch.Tensor, timestep: float | torch.Tensor, sample: torch.Tensor, generator: Generators = None
    ) -> StepOutput:
        """One denoising update from ``timestep`` (an entry of :attr:`timesteps`) to the next.

        ``generator``: the CPU generator(s) of the ancestral noise (one per batch row, or one for
        the batch), drawn exactly as diffusers draws it; ignored by deterministic samplers."""
        raise NotImplementedError

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The forward process: ``original_samples`` noised to ``timesteps`` (one per batch row)."""
        raise NotImplementedError

    # -- step counter and img2img ---------------------------------------------------------------
    @property
    def step_index(self) -> int | None:
        """Index into :attr:`timesteps` of the next step (None before the first step)."""
        return self._step_index

    @property
    def begin_index(self) -> int | None:
        return self._begin_index

    def set_begin_index(self, begin_index: int = 0) -> None:
        """Start the step counter at ``begin_index`` instead of looking up the first timestep."""
        self._begin_index = begin_index

    def index_for_timestep(self, timestep: float | torch.Tensor) -> int:
        """Position of ``timestep`` in :attr:`timesteps`; the second match when it occurs twice (an
        img2img start inside Heun's doubled list)."""
        matches = (self.timesteps.cpu() == torch.as_tensor(timestep).cpu()).nonzero()
        if len(matches) == 0:
            return self._index_of_unknown_timestep(timestep)
        return matches[1 if len(matches) > 1 else 0].item()

    def _index_of_unknown_timestep(self, timestep: float | torch.Tensor) -> int:
        raise ValueError(f"timestep {float(timestep)} is not in the schedule")

    def _init_step_index(self, timestep: float | torch.Tensor) -> None:
        if self._step_index is None:
            self._step_index = self.index_for_timestep(timestep) if self._begin_index is None else self._begin_index

    def img2img_timesteps(self, strength: float) -> tuple[torch.Tensor, int]:
        """The tail of :attr:`timesteps` that img2img denoises for ``strength`` in (0, 1], and the
        number of inference steps it makes; sets the begin index. This is diffusers'
        ``StableDiffusionImg2ImgPipeline.get_timesteps``: the first ``n - int(n * strength)`` steps
        are skipped. Noise the encoded image to the first returned timestep with :meth:`add_noise`."""
        if self.timesteps is None:
            raise ValueError("call set_timesteps before img2img_timesteps")
        if not 0 < strength <= 1:
            raise UserError(f"strength must be in (0, 1], got {strength}")
        n = self.num_inference_steps
        t_start = max(n - min(int(n * strength), n), 0)
        if t_start == n:
            raise UserError(f"strength {strength} with {n} steps leaves no denoising step; raise --strength or --steps")
        self.set_begin_index(t_start * self.order)
        return self.timesteps[t_start * self.order :], n - t_start

    def __len__(self) -> int:
        return self.config.num_train_timesteps


class AlphaScheduler(Scheduler):
    """Samplers that work on abar_t directly (DDPM, DDIM, PNDM): integer timesteps, unit initial noise."""

    def __init__(self, config: Mapping[str, Any] | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        # abar "before" the first training step: 1, or abar_0 with set_alpha_to_one=False (DDIM, PNDM)
        set_alpha_to_one = getattr(self.config, "set_alpha_to_one", True)
        self.final_alpha_cumprod = torch.tensor(1.0) if set_alpha_to_one else self.alphas_cumprod[0]

    def abar(self, t: int) -> torch.Tensor:
        """abar_t, and :attr:`final_alpha_cumprod` for t < 0 (the step after the last)."""
        return self.alphas_cumprod[t] if t >= 0 else self.final_alpha_cumprod

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        self._check_steps(num_inference_steps)
        grid = timestep_grid(self.config, num_inference_steps, rounded=True)
        self.timesteps = torch.from_numpy(grid.astype(np.int64)).to(device)

    def predict(self, model_output: torch.Tensor, sample: torch.Tensor, alpha_prod_t: torch.Tensor):
        """``(x0, eps)`` estimated from the model output by ``prediction_type``, x0 clipped or
        thresholded as configured (eps is from the unclipped x0, as diffusers does)."""
        beta_prod_t = 1 - alpha_prod_t
        kind = self.config.prediction_type
        if kind == "epsilon":
            x0 = (sample - beta_prod_t ** (0.5) * model_output) / alpha_prod_t ** (0.5)
            eps = model_output
        elif kind == "sample":
            x0 = model_output
            eps = (sample - alpha_prod_t ** (0.5) * x0) / beta_prod_t ** (0.5)
        else:  # v_prediction
            x0 = (alpha_prod_t**0.5) * sample - (beta_prod_t**0.5) * model_output
            eps = (alpha_prod_t**0.5) * model_output + (beta_prod_t**0.5) * sample
        if self.config.thresholding:
            x0 = threshold_sample(x0, self.config.dynamic_thresholding_ratio, self.config.sample_max_value)
        elif self.config.clip_sample:
            x0 = x0.clamp(-self.config.clip_sample_range, self.config.clip_sample_range)
        return x0, eps

    def _sqrt_alphas(self, timesteps: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        abar = self.alphas_cumprod.to(device=like.device, dtype=like.dtype)[timesteps.to(like.device)]
        return broadcast_to(abar**0.5, like), broadcast_to((1 - abar) ** 0.5, like)

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise (training and img2img)."""
        sqrt_abar, sqrt_one_minus = self._sqrt_alphas(timesteps, original_samples)
        return sqrt_abar * original_samples + sqrt_one_minus * noise

    def get_velocity(self, sample: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The v-prediction training target v = sqrt(abar_t) noise - sqrt(1 - abar_t) x_0."""
        sqrt_abar, sqrt_one_minus = self._sqrt_alphas(timesteps, sample)
        return sqrt_abar * noise - sqrt_one_minus * sample


class SigmaScheduler(Scheduler):
    """Samplers on the variance-exploding noise levels sigma = sqrt((1 - abar) / abar) (Euler, Euler
    ancestral, Heun, LMS): the input is scaled by 1/sqrt(sigma^2 + 1) and the initial noise by the
    largest sigma. :attr:`sigmas` (on the CPU) holds one noise level per timestep plus the final one."""

    def __init__(self, config: Mapping[str, Any] | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        if getattr(self.config, "rescale_betas_zero_snr", False):
            self.alphas_cumprod[-1] = 2**-24  # sigma stays finite at zero terminal SNR
        self.sigmas: torch.Tensor | None = None

    def train_sigmas(self) -> np.ndarray:
        """The noise level of every training timestep (float32, low to high)."""
        return (((1 - self.alphas_cumprod) / self.alphas_cumprod) ** 0.5).numpy()

    def sigma_schedule(self, num_inference_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """``(timesteps, sigmas)`` before the final sigma is appended: the spaced timesteps and their
        interpolated sigmas, or the Karras sigmas and their fractional timesteps."""
        timesteps = timestep_grid(self.config, num_inference_steps, rounded=False)
        train = self.train_sigmas()
        sigmas = np.interp(timesteps, np.arange(0, len(train)), train)
        if getattr(self.config, "use_karras_sigmas", False):
            sigmas = karras_sigmas(
                sigmas, num_inference_steps, getattr(self.config, "sigma_min", None), getattr(self.config, "sigma_max", None)
            )
            timesteps = sigma_to_t(sigmas, np.log(train))
        return timesteps, sigmas

    def final_sigma(self) -> float:
        if getattr(self.config, "final_sigmas_type", "zero") == "sigma_min":
            return float(((1 - self.alphas_cumprod[0]) / self.alphas_cumprod[0]) ** 0.5)
        return 0.0

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        self._check_steps(num_inference_steps)
        timesteps, sigmas = self.sigma_schedule(num_inference_steps)
        self.sigmas = torch.from_numpy(np.concatenate([sigmas, [self.final_sigma()]]).astype(np.float32))
        self.timesteps = torch.from_numpy(timesteps.astype(np.float32)).to(device)

    @property
    def init_noise_sigma(self) -> torch.Tensor:
        max_sigma = self.sigmas.max()
        if self.config.timestep_spacing in ("linspace", "trailing"):
            return max_sigma
        return (max_sigma**2 + 1) ** 0.5

    def scale_model_input(self, sample: torch.Tensor, timestep: float | torch.Tensor) -> torch.Tensor:
        self._init_step_index(timestep)
        sigma = self.sigmas[self._step_index]
        return sample / ((sigma**2 + 1) ** 0.5)

    def predict_x0(self, model_output: torch.Tensor, sample: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The clean-sample estimate at noise level ``sigma`` (``sample`` is the unscaled x)."""
        kind = self.config.prediction_type
        if kind == "epsilon":
            return sample - sigma * model_output
        if kind == "v_prediction":
            return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + (sample / (sigma**2 + 1))
        return model_output

    def _noise_indices(self, timesteps: torch.Tensor) -> list[int]:
        """Step indices for :meth:`add_noise`: looked up per timestep, or the begin/current index."""
        if self._begin_index is None:
            return [self.index_for_timestep(t) for t in timesteps]
        index = self._step_index if self._step_index is not None else self._begin_index
        return [index] * timesteps.shape[0]

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """x = x_0 + sigma_t noise (the sigma-space forward process)."""
        sigmas = self.sigmas.to(device=original_samples.device, dtype=original_samples.dtype)
        sigma = broadcast_to(sigmas[self._noise_indices(timesteps)], original_samples)
        return original_samples + noise * sigma
