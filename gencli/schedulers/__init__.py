"""Diffusion samplers, one module each, behind one interface (:class:`gencli.schedulers.base.Scheduler`).

This package's top level is torch-free (the CLI validates ``--sampler`` without importing torch);
:func:`get_scheduler` imports the sampler's module when it builds one.

Names: each sampler has a canonical name (``dpmpp_2m_karras``) and a display name (``DPM++ 2M
Karras``, what other front ends write in a PNG's ``parameters``); both are accepted, case and
punctuation aside, and so are k-diffusion / ComfyUI spellings (``k_euler_a``, ``euler_ancestral``)
and diffusers class names (``EulerDiscreteScheduler``, which take every option from the config).
A name fixes the sampler's flavour (Karras sigmas or not, SDE or not, order 2 for "2M"); the config
gives the noise schedule (betas, prediction type, timestep spacing, offset).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gencli.errors import UserError

if TYPE_CHECKING:
    from gencli.schedulers.base import Scheduler


@dataclass(frozen=True)
class Sampler:
    """One entry of the registry: a name, the class it builds and the options the name fixes."""

    name: str
    display_name: str
    class_name: str  # diffusers' class name, also the class's name here
    options: Mapping[str, Any] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()


_MODULES = {
    "DDPMScheduler": "ddpm",
    "DDIMScheduler": "ddim",
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler_ancestral",
    "HeunDiscreteScheduler": "heun",
    "DPMSolverMultistepScheduler": "dpm_solver",
    "LMSDiscreteScheduler": "lms",
    "PNDMScheduler": "pndm",
    "LCMScheduler": "lcm",
}


def _dpm(order: int, sde: bool, karras: bool) -> Sampler:
    name = f"dpmpp_{order}m" + ("_sde" if sde else "") + ("_karras" if karras else "")
    display = f"DPM++ {order}M" + (" SDE" if sde else "") + (" Karras" if karras else "")
    options = {
        "solver_order": order,
        "algorithm_type": "sde-dpmsolver++" if sde else "dpmsolver++",
        "use_karras_sigmas": karras,
    }
    return Sampler(name, display, "DPMSolverMultistepScheduler", options)


SAMPLERS: tuple[Sampler, ...] = (
    Sampler("ddpm", "DDPM", "DDPMScheduler"),
    Sampler("ddim", "DDIM", "DDIMScheduler"),
    Sampler("euler", "Euler", "EulerDiscreteScheduler", {"use_karras_sigmas": False}),
    Sampler("euler_karras", "Euler Karras", "EulerDiscreteScheduler", {"use_karras_sigmas": True}),
    Sampler("euler_a", "Euler a", "EulerAncestralDiscreteScheduler", aliases=("euler_ancestral",)),
    Sampler("heun", "Heun", "HeunDiscreteScheduler", {"use_karras_sigmas": False}),
    Sampler("heun_karras", "Heun Karras", "HeunDiscreteScheduler", {"use_karras_sigmas": True}),
    *(_dpm(order, sde, karras) for order in (2, 3) for sde in (False, True) for karras in (False, True)),
    Sampler("lms", "LMS", "LMSDiscreteScheduler", {"use_karras_sigmas": False}),
    Sampler("lms_karras", "LMS Karras", "LMSDiscreteScheduler", {"use_karras_sigmas": True}),
    Sampler("plms", "PLMS", "PNDMScheduler", {"skip_prk_steps": True}),
    Sampler("pndm", "PNDM", "PNDMScheduler", {"skip_prk_steps": False}),
    Sampler("lcm", "LCM", "LCMScheduler"),
)


def normalize_name(name: str) -> str:
    """``"DPM++ 2M Karras"``, ``"dpmpp-2m-karras"`` and ``"k_dpmpp_2m_karras"`` -> ``dpmpp_2m_karras``."""
    key = re.sub(r"[^a-z0-9]+", "_", name.strip().lower().replace("++", "pp")).strip("_")
    for prefix in ("k_", "sample_"):  # A1111's old API names, k-diffusion's function names
        key = key.removeprefix(prefix)
    return key


_BY_KEY: dict[str, Sampler] = {}
for _sampler in SAMPLERS:
    for _alias in (_sampler.name, _sampler.display_name, *_sampler.aliases):
        _BY_KEY[normalize_name(_alias)] = _sampler
for _class_name in _MODULES:  # a class name keeps every option of the config
    _BY_KEY[normalize_name(_class_name)] = Sampler(normalize_name(_class_name), _class_name, _class_name)


def sampler_names() -> list[str]:
    """The canonical sampler names, in registry order."""
    return [s.name for s in SAMPLERS]


def resolve_sampler(name: str) -> Sampler:
    """The registry entry for ``name`` (any accepted spelling); :class:`UserError` listing the valid
    names when there is none. Torch-free: the CLI can check ``--sampler`` before loading anything."""
    sampler = _BY_KEY.get(normalize_name(name or ""))
    if sampler is None:
        raise UserError(
            f"unknown sampler {name!r}; valid: {', '.join(sampler_names())} "
            '(display names such as "Euler a" and "DPM++ 2M Karras" work too)'
        )
    return sampler


def scheduler_class(class_name: str) -> type[Scheduler]:
    """The sampler class named like diffusers' ``class_name``."""
    module = importlib.import_module(f"gencli.schedulers.{_MODULES[class_name]}")
    return getattr(module, class_name)


def get_scheduler(name: str, config: Mapping[str, Any] | None = None, **options: Any) -> Scheduler:
    """A new sampler: ``name`` (see :func:`resolve_sampler`) built on ``config`` (a diffusers
    scheduler config dict, e.g. from :func:`gencli.schedulers.base.load_scheduler_config`).

    Precedence: the sampler's diffusers defaults < ``config`` < what the name fixes < ``options``
    (e.g. ``eta=0.5`` for DDIM). Keys a sampler does not read are ignored, as diffusers ignores them.
    """
    sampler = resolve_sampler(name)
    return scheduler_class(sampler.class_name)(config, **{**sampler.options, **options})


def display_name(name: str) -> str:
    """The display name of a sampler name (``dpmpp_2m_karras`` -> ``DPM++ 2M Karras``). For a class
    name, whose flavour depends on the config, build the sampler and read its ``display_name``."""
    return resolve_sampler(name).display_name


__all__ = [
    "SAMPLERS",
    "Sampler",
    "display_name",
    "get_scheduler",
    "normalize_name",
    "resolve_sampler",
    "sampler_names",
    "scheduler_class",
]
