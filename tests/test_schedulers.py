"""The samplers against diffusers' schedulers of the same config, step for step.

Both sides run the loop a diffusers pipeline runs (set_timesteps, initial noise times
init_noise_sigma, scale_model_input, a model call, step) on the same pseudo-model: an analytic
denoiser that is a deterministic function of its (scaled) input and the timestep only, so each side
feeds back its own samples. Ancestral samplers get identically seeded CPU generators.
"""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gencli.backend.random import randn_tensor
from gencli.errors import UserError
from gencli.schedulers import SAMPLERS, get_scheduler, resolve_sampler, sampler_names
from gencli.schedulers.base import load_scheduler_config

diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import StableDiffusionImg2ImgPipeline  # noqa: E402
from diffusers.utils.torch_utils import randn_tensor as diffusers_randn_tensor  # noqa: E402

# diffusers' schedulers build numpy arrays from tensors the way numpy 2 deprecates; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

SD1_LEADING = {  # SD 1.x as its folders ship it (PNDM's keys) with the leading spacing made explicit
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "steps_offset": 1,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "clip_sample": False,
    "timestep_spacing": "leading",
}
CONFIGS = {
    "sd1_leading": SD1_LEADING,
    # no timestep_spacing: each sampler takes its own diffusers default (linspace for the sigma samplers)
    "sd1_default_spacing": {k: v for k, v in SD1_LEADING.items() if k != "timestep_spacing"},
    "sd2_v": {**SD1_LEADING, "prediction_type": "v_prediction", "timestep_spacing": "linspace"},
    "zero_snr_trailing": {
        **SD1_LEADING,
        "prediction_type": "v_prediction",
        "timestep_spacing": "trailing",
        "rescale_betas_zero_snr": True,
    },
    "ddpm_linear": {"beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02, "timestep_spacing": "linspace"},
    "cosine_trailing": {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing", "clip_sample": True},
}
STEPS = (1, 7, 25, 50)

# our name -> (diffusers class, the options that name fixes on the diffusers side)
REFERENCES = {
    "ddpm": ("DDPMScheduler", {}),
    "ddim": ("DDIMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_karras": ("EulerDiscreteScheduler", {"use_karras_sigmas": True}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "heun_karras": ("HeunDiscreteScheduler", {"use_karras_sigmas": True}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {}),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "dpmpp_2m_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "dpmpp_2m_sde_karras": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True}),
    "dpmpp_3m": ("DPMSolverMultistepScheduler", {"solver_order": 3}),
    "lms": ("LMSDiscreteScheduler", {}),
    "lms_karras": ("LMSDiscreteScheduler", {"use_karras_sigmas": True}),
    "plms": ("PNDMScheduler", {"skip_prk_steps": True}),
    "pndm": ("PNDMScheduler", {"skip_prk_steps": False}),
}
# the full grid of configs x step counts for these; the other names on fewer configs
CORE = ("ddpm", "ddim", "euler", "euler_karras", "euler_a", "heun", "dpmpp_2m", "dpmpp_2m_karras", "plms")
SHAPE = (2, 4, 4, 4)


def _tolerance(name: str) -> dict:
    """1e-5 absolute; for LMS 1e-4 of the largest magnitude in the compared tensor.

    diffusers integrates LMS's polynomial coefficients numerically (scipy ``quad``) from an integrand
    evaluated in float32; they are exact here (see test_lms_coefficients_are_exact). The two differ
    by up to ~2e-7 relative, which LMS's alternating fourth-order sums carry into the samples at the
    level of float32 rounding of the largest values on the way (sigma_max is 2e4 on the cosine
    schedule). With diffusers' own coefficients patched in, the runs agree to 1e-5 absolute."""
    return {"atol": 1e-4 if name.startswith("lms") else 1e-5, "scale_relative": name.startswith("lms")}


class PseudoModel:
    """The exact denoiser for data x0 ~ N(0.3, 0.5^2) per element, plus a small fixed channel-mixing
    nonlinearity: a deterministic function of (model input, t), in the parametrisation the config
    names. ``t`` may be fractional (Karras timesteps): abar is interpolated."""

    def __init__(self, alphas_cumprod: torch.Tensor, prediction_type: str) -> None:
        self.abar = alphas_cumprod.double().numpy()
        self.prediction_type = prediction_type
        self.mix = torch.randn(SHAPE[1], SHAPE[1], generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 0.3

    def __call__(self, x_in: torch.Tensor, t) -> torch.Tensor:
        abar = float(np.interp(float(t), np.arange(len(self.abar)), self.abar))
        x = x_in.double()
        mu, var = 0.3, 0.25
        centred = (x - math.sqrt(abar) * mu) / (abar * var + 1 - abar)
        eps = math.sqrt(1 - abar) * centred + 0.05 * torch.tanh((self.mix @ x.flatten(2)).view_as(x))
        if self.prediction_type == "epsilon":
            return eps.to(x_in.dtype)
        x0 = mu + math.sqrt(abar) * var * centred
        out = x0 if self.prediction_type == "sample" else math.sqrt(abar) * eps - math.sqrt(1 - abar) * x0
        return out.to(x_in.dtype)


def _reference(name: str, config: dict):
    class_name, fixed = REFERENCES[name]
    return getattr(diffusers, class_name).from_config({**config, **fixed})


def _run(scheduler, model, timesteps, sample, generator, *, reference: bool, eta=0.0):
    """The pipeline loop; returns the final sample and every model input and x0 estimate on the way."""
    inputs, x0s = [], []
    kwargs = {"generator": generator}
    if reference:  # what StableDiffusionPipeline.prepare_extra_step_kwargs passes
        params = inspect.signature(scheduler.step).parameters
        kwargs = {k: v for k, v in (("generator", generator), ("eta", eta)) if k in params}
    for t in timesteps:
        model_input = scheduler.scale_model_input(sample, t)
        inputs.append(model_input)
        result = scheduler.step(model(model_input, t), t, sample, **kwargs)
        sample = result.prev_sample
        x0s.append(getattr(result, "pred_original_sample", None))
    return sample, inputs, x0s


def _compare_runs(ours, ref, config, steps, *, seed=0, eta=0.0, tolerance=None):
    """set_timesteps, the initial noise and the whole loop on both sides; returns our final sample."""
    label = f"{ours.sampler_name}, {steps} steps"
    tolerance = tolerance or {"atol": 1e-5, "scale_relative": False}
    ours.set_timesteps(steps)
    ref.set_timesteps(steps)
    assert ours.timesteps.dtype == ref.timesteps.dtype, label
    assert torch.equal(ours.timesteps, ref.timesteps), label
    assert float(ours.init_noise_sigma) == float(ref.init_noise_sigma), label
    model = PseudoModel(ref.alphas_cumprod, config.get("prediction_type", "epsilon"))
    # Karras sigmas on a zero-SNR schedule repeat the first timestep; diffusers' lookup of the first
    # step index then picks the repeat and runs off the end, so both sides start at 0 explicitly
    begin_at_zero = len(ref.timesteps) > 1 and ref.timesteps[0] == ref.timesteps[1] and hasattr(ref, "set_begin_index")
    results = []
    for scheduler, is_ref in ((ours, False), (ref, True)):
        if begin_at_zero:
            scheduler.set_begin_index(0)
        generator = torch.Generator().manual_seed(seed)
        latents = randn_tensor(SHAPE, generator, dtype=torch.float32) * scheduler.init_noise_sigma
        results.append(_run(scheduler, model, scheduler.timesteps, latents, generator, reference=is_ref, eta=eta))
    (x_ours, in_ours, x0_ours), (x_ref, in_ref, x0_ref) = results

    def close(a, b):
        atol = tolerance["atol"] * (max(1.0, float(b.abs().max())) if tolerance["scale_relative"] else 1.0)
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=lambda m: f"{label}: {m}")

    for a, b in zip(in_ours, in_ref):
        close(a, b)
    for a, b in zip(x0_ours, x0_ref):
        if b is not None:
            close(a, b)
    assert torch.isfinite(x_ours).all(), label
    close(x_ours, x_ref)
    return x_ours


def _grid():
    for name in REFERENCES:
        if name in CORE:
            yield from ((name, config_name) for config_name in CONFIGS)
        elif name == "lms":  # diffusers' LMS is slow (a scipy quadrature per coefficient)
            yield from ((name, config_name) for config_name in ("sd1_leading", "cosine_trailing"))
        elif name == "lms_karras":
            yield name, "sd1_leading"
        else:
            yield from ((name, config_name) for config_name in ("sd1_leading", "zero_snr_trailing"))


@pytest.mark.parametrize("name,config_name", list(_grid()))
def test_sampling_loop_matches_diffusers(name, config_name):
    """Timesteps, initial sigma, every scaled model input, every x0 estimate and the final sample,
    for 1, 7, 25 and 50 steps (one scheduler object per side, reused as a pipeline reuses it)."""
    config = CONFIGS[config_name]
    ours, ref = get_scheduler(name, config), _reference(name, config)
    for steps in STEPS:
        if name == "pndm" and steps < 4:  # its Runge-Kutta warm-up needs 4 (test_pndm_needs_four_steps)
            continue
        _compare_runs(ours, ref, config, steps, tolerance=_tolerance(name))


def test_pndm_needs_four_steps():
    with pytest.raises(UserError, match="at least 4 steps"):
        get_scheduler("pndm", SD1_LEADING).set_timesteps(3)


@pytest.mark.parametrize("name", ["ddpm", "ddim", "euler", "heun", "dpmpp_2m", "lms"])
def test_sample_prediction_and_thresholding(name):
    config = {**SD1_LEADING, "prediction_type": "sample", "thresholding": True, "sample_max_value": 1.5}
    _compare_runs(get_scheduler(name, config), _reference(name, config), config, 20, tolerance=_tolerance(name))


@pytest.mark.parametrize("variance_type", ["fixed_small", "fixed_small_log", "fixed_large"])
def test_ddpm_variance_types(variance_type):
    config = {**CONFIGS["ddpm_linear"], "variance_type": variance_type}
    _compare_runs(get_scheduler("ddpm", config), _reference("ddpm", config), config, 25)


@pytest.mark.parametrize("variance_type", ["learned", "learned_range"])
def test_ddpm_learned_variance(variance_type):
    """The model's second half of channels carries the variance (learned_range: an interpolation
    value in [-1, 1] between beta_tilde and beta in log space)."""
    config = {**CONFIGS["ddpm_linear"], "variance_type": variance_type, "clip_sample": False}
    ours, ref = get_scheduler("ddpm", config), _reference("ddpm", config)
    model = PseudoModel(ref.alphas_cumprod, "epsilon")
    finals = []
    for scheduler in (ours, ref):
        scheduler.set_timesteps(10)
        generator = torch.Generator().manual_seed(3)
        x = randn_tensor(SHAPE, generator)
        for t in scheduler.timesteps:
            eps = model(x, t)
            variance = torch.tanh(eps) if variance_type == "learned_range" else 0.01 * torch.sigmoid(eps)
            x = scheduler.step(torch.cat([eps, variance], dim=1), t, x, generator=generator).prev_sample
        finals.append(x)
    torch.testing.assert_close(finals[0], finals[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("eta", [0.5, 1.0])
def test_ddim_eta(eta):
    config = CONFIGS["sd1_leading"]
    _compare_runs(get_scheduler("ddim", config, eta=eta), _reference("ddim", config), config, 25, eta=eta)


@pytest.mark.parametrize(
    "options",
    [
        {"final_sigmas_type": "sigma_min"},
        {"lower_order_final": False},
        {"euler_at_final": True},
        {"solver_type": "heun"},
        {"solver_order": 1},
    ],
)
def test_dpm_solver_options(options):
    config = {**CONFIGS["sd1_default_spacing"], **options}
    _compare_runs(get_scheduler("DPMSolverMultistepScheduler", config), _reference("dpmpp_2m", config), config, 12)


def test_dpm_solver_sde_third_order_and_clipped_lambda():
    config = {**CONFIGS["sd2_v"], "solver_order": 3, "lambda_min_clipped": -5.1}
    _compare_runs(get_scheduler("dpmpp_3m_sde", config), _reference("dpmpp_2m_sde", config), config, 20)


def test_euler_karras_sigma_bounds_and_final_sigma_min():
    config = {**SD1_LEADING, "sigma_min": 0.1, "sigma_max": 10.0, "final_sigmas_type": "sigma_min"}
    _compare_runs(get_scheduler("euler_karras", config), _reference("euler_karras", config), config, 15)


def test_heun_doubles_the_timesteps_and_counts_as_order_two():
    heun = get_scheduler("heun", SD1_LEADING)
    heun.set_timesteps(10)
    assert heun.order == 2 and len(heun.timesteps) == 19
    assert torch.equal(heun.timesteps[1::2], heun.timesteps[2::2])  # t_1, t_1, t_2, t_2, ...
    assert heun.state_in_first_order


@pytest.mark.parametrize("name", ["euler_a", "ddpm", "dpmpp_2m_sde_karras"])
def test_per_image_generators_match_diffusers(name):
    """A list of generators (one per image) draws row i from generator i, as diffusers does."""
    config = CONFIGS["sd1_default_spacing"]
    ours, ref = get_scheduler(name, config), _reference(name, config)
    model = PseudoModel(ref.alphas_cumprod, "epsilon")
    finals = []
    for scheduler, is_ref in ((ours, False), (ref, True)):
        scheduler.set_timesteps(8)
        generators = [torch.Generator().manual_seed(s) for s in (11, 12)]
        x = randn_tensor(SHAPE, generators) * scheduler.init_noise_sigma
        finals.append(_run(scheduler, model, scheduler.timesteps, x, generators, reference=is_ref)[0])
    torch.testing.assert_close(finals[0], finals[1], rtol=0, atol=1e-5)
    # and the first image is the one a batch of one with its generator gives
    scheduler = get_scheduler(name, config)
    scheduler.set_timesteps(8)
    generator = torch.Generator().manual_seed(11)
    x = randn_tensor((1, *SHAPE[1:]), generator) * scheduler.init_noise_sigma
    single = _run(scheduler, model, scheduler.timesteps, x, generator, reference=False)[0]
    torch.testing.assert_close(single[0], finals[0][0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_randn_tensor_matches_diffusers(dtype):
    for generator_seeds in ([5], [5, 6, 7]):
        ours = randn_tensor(
            (3, 4, 5, 7),
            [torch.Generator().manual_seed(s) for s in generator_seeds]
            if len(generator_seeds) > 1
            else torch.Generator().manual_seed(5),
            dtype=dtype,
        )
        theirs = diffusers_randn_tensor(
            (3, 4, 5, 7),
            generator=[torch.Generator().manual_seed(s) for s in generator_seeds]
            if len(generator_seeds) > 1
            else torch.Generator().manual_seed(5),
            device=torch.device("cpu"),
            dtype=dtype,
        )
        assert ours.dtype == dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("name", list(REFERENCES))
def test_add_noise_matches_diffusers(name):
    config = CONFIGS["sd2_v"]
    ours, ref = get_scheduler(name, config), _reference(name, config)
    ours.set_timesteps(20)
    ref.set_timesteps(20)
    gen = torch.Generator().manual_seed(1)
    original, noise = torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
    timesteps = ours.timesteps[torch.tensor([3, 10])]
    torch.testing.assert_close(
        ours.add_noise(original, noise, timesteps), ref.add_noise(original, noise, timesteps), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("name", ["ddpm", "ddim"])
def test_add_noise_and_velocity_for_training(name):
    config = CONFIGS["ddpm_linear"]
    ours, ref = get_scheduler(name, config), _reference(name, config)
    gen = torch.Generator().manual_seed(2)
    original, noise = torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
    timesteps = torch.randint(0, 1000, (SHAPE[0],), generator=gen)
    torch.testing.assert_close(
        ours.add_noise(original, noise, timesteps), ref.add_noise(original, noise, timesteps), rtol=0, atol=0
    )
    torch.testing.assert_close(
        ours.get_velocity(original, noise, timesteps), ref.get_velocity(original, noise, timesteps), rtol=0, atol=0
    )


@pytest.mark.parametrize("strength", [0.3, 0.75, 1.0])
@pytest.mark.parametrize("name", [*CORE, "heun_karras", "dpmpp_2m_sde_karras", "lms"])
def test_img2img_matches_diffusers(name, strength):
    """diffusers' StableDiffusionImg2ImgPipeline.get_timesteps on the reference, then the noising
    of the image latents to the first timestep and the loop from there."""
    config, steps = CONFIGS["sd1_leading"], 20
    ours, ref = get_scheduler(name, config), _reference(name, config)
    ours.set_timesteps(steps)
    ref.set_timesteps(steps)
    ref_timesteps, ref_n = StableDiffusionImg2ImgPipeline.get_timesteps(SimpleNamespace(scheduler=ref), steps, strength, "cpu")
    our_timesteps, our_n = ours.img2img_timesteps(strength)
    assert our_n == ref_n and torch.equal(our_timesteps, ref_timesteps)
    if hasattr(ref, "set_begin_index"):  # diffusers' DDPM and DDIM have none (they step by timestep value)
        assert ours.begin_index == ref.begin_index
    model = PseudoModel(ref.alphas_cumprod, "epsilon")
    image_latents = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9)) * 0.5
    finals = []
    for scheduler, timesteps, is_ref in ((ours, our_timesteps, False), (ref, ref_timesteps, True)):
        generator = torch.Generator().manual_seed(4)
        noise = randn_tensor(SHAPE, generator)
        latents = scheduler.add_noise(image_latents, noise, timesteps[:1].repeat(SHAPE[0]))
        finals.append(_run(scheduler, model, timesteps, latents, generator, reference=is_ref)[0])
    tolerance = _tolerance(name)
    scale = max(1.0, float(finals[1].abs().max())) if tolerance["scale_relative"] else 1.0
    torch.testing.assert_close(finals[0], finals[1], rtol=0, atol=tolerance["atol"] * scale)


def test_lms_coefficients_are_exact():
    """Against a float64 quadrature of the Lagrange basis polynomial, and close to diffusers' float32 one."""
    integrate = pytest.importorskip("scipy.integrate")
    ours, ref = get_scheduler("lms", SD1_LEADING), _reference("lms", SD1_LEADING)
    ours.set_timesteps(25)
    ref.set_timesteps(25)
    sigmas = ours.sigmas.double().tolist()
    for index in (0, 1, 2, 3, 12, 24):
        order = min(index + 1, 4)
        for j in range(order):
            nodes = [sigmas[index - k] for k in range(order) if k != j]

            def basis(tau, nodes=nodes, at=sigmas[index - j]):
                return math.prod((tau - node) / (at - node) for node in nodes)

            exact = integrate.quad(basis, sigmas[index], sigmas[index + 1], epsabs=0, epsrel=1e-13)[0]
            coefficient = ours.lms_coefficient(order, index, j)
            assert coefficient == pytest.approx(exact, rel=1e-11, abs=1e-13)
            assert coefficient == pytest.approx(ref.get_lms_coefficient(order, index, j), rel=1e-6)


def test_img2img_bad_strength():
    scheduler = get_scheduler("euler", SD1_LEADING)
    scheduler.set_timesteps(10)
    for strength in (0.0, -0.1, 1.5):
        with pytest.raises(UserError, match="strength"):
            scheduler.img2img_timesteps(strength)
    with pytest.raises(UserError, match="no denoising step"):
        scheduler.img2img_timesteps(0.05)  # int(10 * 0.05) == 0 steps


# --- DDPM: the source texts' formulas (seed-examples section 7) as explicit vectors ---------------


def test_scaled_linear_terminal_alpha_bar():
    scheduler = get_scheduler("ddpm", {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012})
    assert float(scheduler.alphas_cumprod[-1]) == pytest.approx(4.66e-3, abs=1e-5)
    linear = get_scheduler("ddpm", {"beta_schedule": "linear", "beta_start": 1e-4, "beta_end": 0.02})
    expected = math.prod(1 - (1e-4 + (0.02 - 1e-4) * i / 999) for i in range(1000))
    assert float(linear.alphas_cumprod[-1]) == pytest.approx(expected, rel=1e-3)


# near t = 0 beta_t = 1 - abar_t / abar_t' is ~1e-4 and float32 keeps ~3 of its digits
@pytest.mark.parametrize("steps,t,tol", [(1000, 500, 1e-5), (1000, 1, 5e-4), (50, 480, 1e-5)])
def test_ddpm_step_is_the_posterior_of_the_texts(steps, t, tol):
    """x0_hat = (x_t - sqrt(1-abar_t) eps) / sqrt(abar_t); the step draws from N(mu_tilde, beta_tilde)
    with mu_tilde = sqrt(alpha_t)(1-abar_{t'})/(1-abar_t) x_t + sqrt(abar_{t'}) beta_t/(1-abar_t) x0;
    with 1000 steps (t' = t - 1) it is x_{t-1} = (x_t - beta_t/sqrt(1-abar_t) eps)/sqrt(alpha_t) + sigma_t z."""
    scheduler = get_scheduler(
        "ddpm",
        {"beta_schedule": "linear", "beta_start": 1e-4, "beta_end": 0.02, "clip_sample": False, "timestep_spacing": "leading"},
    )
    scheduler.set_timesteps(steps)
    assert t in scheduler.timesteps.tolist()
    prev_t = scheduler.previous_timestep(t)
    assert prev_t == (t - 1 if steps == 1000 else t - 20)
    abar = scheduler.alphas_cumprod.double()
    abar_t, abar_prev = float(abar[t]), float(abar[prev_t])
    alpha_t = abar_t / abar_prev
    beta_t = 1 - alpha_t
    x_t = torch.tensor([0.8, -1.3, 0.05, 2.0]).reshape(1, 4, 1, 1)
    eps = torch.tensor([0.3, -0.7, 1.1, -0.2]).reshape(1, 4, 1, 1)
    x0_hat = (x_t.double() - math.sqrt(1 - abar_t) * eps.double()) / math.sqrt(abar_t)
    mu = (
        math.sqrt(alpha_t) * (1 - abar_prev) / (1 - abar_t) * x_t.double() + math.sqrt(abar_prev) * beta_t / (1 - abar_t) * x0_hat
    )
    beta_tilde = (1 - abar_prev) / (1 - abar_t) * beta_t
    result = scheduler.step(eps, t, x_t, generator=torch.Generator().manual_seed(21))
    z = torch.randn(x_t.shape, generator=torch.Generator().manual_seed(21)).double()
    torch.testing.assert_close(result.pred_original_sample.double(), x0_hat, rtol=tol, atol=tol)
    torch.testing.assert_close(result.prev_sample.double(), mu + math.sqrt(beta_tilde) * z, rtol=tol, atol=tol)
    if steps == 1000:
        textbook = (x_t.double() - beta_t / math.sqrt(1 - abar_t) * eps.double()) / math.sqrt(alpha_t)
        torch.testing.assert_close(mu, textbook, rtol=1e-9, atol=1e-9)


def test_ddpm_last_step_adds_no_noise():
    scheduler = get_scheduler("ddpm", {"clip_sample": False, "timestep_spacing": "linspace"})
    scheduler.set_timesteps(10)
    assert int(scheduler.timesteps[-1]) == 0
    x_t, eps = torch.full((1, 1, 2, 2), 0.4), torch.full((1, 1, 2, 2), 0.1)
    a = scheduler.step(eps, 0, x_t, generator=torch.Generator().manual_seed(1)).prev_sample
    b = scheduler.step(eps, 0, x_t, generator=torch.Generator().manual_seed(2)).prev_sample
    abar0 = float(scheduler.alphas_cumprod[0])
    assert torch.equal(a, b)  # z = 0 at the last step: the mean, which is x0_hat itself at t = 0
    torch.testing.assert_close(a, (x_t - math.sqrt(1 - abar0) * eps) / math.sqrt(abar0))


# --- config, names, errors -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ddim", "euler", "dpmpp_2m_karras", "heun"])
def test_config_saved_by_diffusers_loads_the_same_schedule(tmp_path, name):
    ref = _reference(name, CONFIGS["sd2_v"])
    ref.save_config(tmp_path / "scheduler")
    config = load_scheduler_config(tmp_path)  # a pipeline folder: finds scheduler/scheduler_config.json
    assert config["_class_name"] == type(ref).__name__
    ours = get_scheduler(config["_class_name"], config)  # a class name keeps the config's options
    assert ours.display_name == resolve_sampler(name).display_name
    ours.set_timesteps(30)
    ref.set_timesteps(30)
    assert torch.equal(ours.timesteps, ref.timesteps)
    assert load_scheduler_config(tmp_path / "scheduler" / "scheduler_config.json") == config


def test_config_errors(tmp_path):
    with pytest.raises(UserError, match="no scheduler_config.json"):
        load_scheduler_config(tmp_path)
    (tmp_path / "scheduler_config.json").write_text("{not json")
    with pytest.raises(UserError, match="not a readable scheduler config"):
        load_scheduler_config(tmp_path)
    (tmp_path / "scheduler_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(UserError, match="JSON object"):
        load_scheduler_config(tmp_path)
    bad = [
        ("ddim", {"beta_schedule": "sigmoid"}, "beta_schedule"),
        ("euler", {"prediction_type": "flow_prediction"}, "prediction_type"),
        ("euler", {"timestep_spacing": "uniform"}, "timestep_spacing"),
        ("euler", {"use_exponential_sigmas": True}, "use_exponential_sigmas"),
        ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver"}, "algorithm_type"),
        ("dpmpp_2m", {"variance_type": "learned_range"}, "variance_type"),
        ("plms", {"prediction_type": "sample"}, "prediction_type"),
    ]
    for name, config, key in bad:
        with pytest.raises(UserError, match=key):
            get_scheduler(name, config)
    scheduler = get_scheduler("euler")
    for steps in (0, 1001):
        with pytest.raises(UserError, match="steps must be between 1 and 1000"):
            scheduler.set_timesteps(steps)


def test_keys_a_sampler_does_not_read_are_ignored_like_diffusers():
    heun = get_scheduler("heun", {"rescale_betas_zero_snr": True, "use_lu_lambdas": True, "eta": 1.0})
    assert not hasattr(heun.config, "rescale_betas_zero_snr") and float(heun.alphas_cumprod[-1]) > 0
    # DPM's siblings' names are mapped as diffusers maps them
    assert (
        get_scheduler("DPMSolverMultistepScheduler", {"algorithm_type": "deis", "solver_type": "bh2"}).config.solver_type
        == "midpoint"
    )


def test_names_round_trip_and_aliases():
    for sampler in SAMPLERS:
        scheduler = get_scheduler(sampler.name, SD1_LEADING)
        assert scheduler.display_name == sampler.display_name
        assert scheduler.sampler_name == sampler.name
        assert resolve_sampler(sampler.display_name) is sampler
    aliases = {
        "Euler a": "euler_a",
        "k_euler_a": "euler_a",
        "euler_ancestral": "euler_a",
        "DPM++ 2M Karras": "dpmpp_2m_karras",
        "dpmpp-2m-karras": "dpmpp_2m_karras",
        "k_dpmpp_2m": "dpmpp_2m",
        "DPM++ 2M": "dpmpp_2m",
        "DPM++ 2M SDE Karras": "dpmpp_2m_sde_karras",
        "LMS": "lms",
        "LMS Karras": "lms_karras",
        " DDIM ": "ddim",
        "sample_heun": "heun",
    }
    for alias, name in aliases.items():
        assert resolve_sampler(alias).name == name, alias
    assert {"ddpm", "ddim", "euler", "euler_a", "heun", "dpmpp_2m", "dpmpp_2m_karras", "lms"} <= set(sampler_names())


def test_a_name_fixes_the_flavour_and_a_class_name_keeps_the_config():
    karras_config = {**SD1_LEADING, "use_karras_sigmas": True}
    assert get_scheduler("dpmpp_2m", karras_config).display_name == "DPM++ 2M"
    assert get_scheduler("DPMSolverMultistepScheduler", karras_config).display_name == "DPM++ 2M Karras"
    assert get_scheduler("EulerDiscreteScheduler", karras_config).sampler_name == "euler_karras"
    assert get_scheduler("dpmpp_2m_karras", SD1_LEADING, use_karras_sigmas=False).display_name == "DPM++ 2M"  # options last


def test_unknown_sampler_lists_the_valid_names():
    with pytest.raises(UserError) as info:
        get_scheduler("euler_b")
    message = str(info.value)
    assert "\n" not in message and "euler_b" in message
    for name in sampler_names():
        assert name in message


def test_registry_is_torch_free():
    code = (
        "import sys, gencli.schedulers as s; s.resolve_sampler('Euler a'); s.sampler_names(); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
