"""``gencli replay``: the settings of a run read back from a PNG's ``parameters``, and the rules for
regenerating it (no torch). A value that came from the PNG is named as the PNG names it, never as a
flag the user did not pass."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gencli.backend.seeds import check_seed
from gencli.errors import UserError
from gencli.io import input_name, is_stdout
from gencli.pipelines.diffusion.png_parameters import ImageParameters, read_parameters
from gencli.schedulers import resolve_sampler

# the flag a setting has on the command line -> the key the PNG's parameters give it
PNG_KEYS = {"--steps": "Steps", "--guidance": "CFG scale", "--guidance-rescale": "Guidance rescale", "--sampler": "Sampler", "--width": "Size",
            "--height": "Size", "--clip-skip": "Clip skip", "--strength": "Denoising strength"}  # fmt: skip


@dataclass
class Replay:
    """What to run again: the settings (``DiffusionOptions`` fields), the sampling flags, the model
    and its expected hash, and the output file."""

    params: ImageParameters
    settings: dict[str, Any]
    flags: dict[str, Any]
    model: str
    expect_hash: str


def replay_out(image: str, out: Optional[str]) -> str:
    """Where a replay of ``image`` is written: ``out``, else ``NAME-replay.png`` beside it (``stdin-replay.png`` for ``-``)."""
    stem = "stdin" if is_stdout(image) else Path(image).stem
    return out or str(Path(image).with_name(stem + "-replay.png"))


def model_hash_warning(expected: str, path: Any, actual: str) -> Optional[str]:
    """The warning a replay gives when the folder's Model hash is not the one the PNG records (None
    when they agree or the PNG records none)."""
    if not expected or expected == actual:
        return None
    return f"the image was made with Model hash {expected}, '{path}' has {actual}: the image will differ"


def plan_replay(
    image: str, *, model: Optional[str], seed: Optional[int], init_image: Optional[str], mask: Optional[str], out: Optional[str], force: bool,
    vae: Optional[str], controlnet: Optional[str] = None, control_image: Optional[str] = None,
) -> Replay:  # fmt: skip
    """Read ``image``'s parameters and check them, and the flags given with them, before any model loads.

    ``--seed`` replaces the PNG's seed; ``--model`` its model (which must otherwise be found: an
    embedded default or a path here). A PNG made with a ControlNet replays with it when ``controlnet``
    and ``control_image`` are given (its weight and guidance start/end from the PNG)."""
    from gencli.pipelines.diffusion.jobs import check_job_flags
    from gencli.weights import resolve_model

    name = input_name(image)
    params = read_parameters(image)
    if model is None:
        if not params.model:
            raise UserError(f"'{name}' does not name its model: pass --model")
        try:
            resolve_model(params.model)
        except UserError:
            raise UserError(
                f"'{name}' was made with model '{params.model}', which is neither a path here nor an embedded default: pass it with --model"
            ) from None
        model = params.model
    if params.denoising_strength is not None and init_image is None:
        raise UserError(f"'{name}' is an img2img result (Denoising strength {params.denoising_strength:g}): pass its source image with --init-image")
    if params.denoising_strength is None and init_image is not None:
        raise UserError(f"'{name}' is a txt2img result (its parameters have no Denoising strength): --init-image is for img2img results")
    if "Mask blur" in params.extra and mask is None:
        raise UserError(f"'{name}' was inpainted: pass its source image with --init-image and its mask with --mask")
    if mask is not None and init_image is None:
        raise UserError("--mask needs --init-image (the image the mask applies to)")
    control = recorded_control(params.extra) if controlnet is not None else None
    if controlnet is not None and control is None:
        raise UserError(f"'{name}' was made without a ControlNet (its parameters have no ControlNet 0): drop --controlnet")
    applied = {"ControlNet 0" if "ControlNet 0" in params.extra else "ControlNet"} if control is not None else set()
    unapplied = [k for k in params.extra if (k in UNAPPLIED_KEYS or re.fullmatch(r"ControlNet \d+", k)) and k not in applied
                 and changes_the_image(k, params.extra[k], params.sampler)]  # fmt: skip
    if control is not None:
        _check_recorded_control(name, control, controlnet, control_image)
    if unapplied:
        import warnings

        from gencli.errors import Notice

        shown = ", ".join(f"{k}: {params.extra[k]}" for k in unapplied)
        warnings.warn(f"'{name}' records settings gencli does not apply ({shown}): the replay will differ from that image", Notice, stacklevel=2)
    chosen = check_seed(seed) if seed is not None else check_seed(params.seed, f"'{name}': the PNG's Seed")
    settings = dict(
        negative_prompt=params.negative_prompt or None, steps=params.steps, guidance=params.cfg_scale, guidance_rescale=params.guidance_rescale or None,
        sampler=params.sampler, width=params.width or None, height=params.height or None, seeds=str(chosen), clip_skip=params.clip_skip or None,
        out=replay_out(image, out), force=force, vae=vae,
    )  # fmt: skip
    if control is not None:
        settings.update(controlnet=controlnet, control_image=control_image, control_scale=control["scale"], control_start=control["start"],
                        control_end=control["end"])  # fmt: skip
    flags = {k: settings[k] for k in ("steps", "guidance", "guidance_rescale", "sampler", "width", "height", "clip_skip")}
    flags["strength"] = params.denoising_strength
    try:
        check_job_flags(flags)
    except UserError as exc:
        raise from_the_png(name, exc) from None
    return Replay(params, settings, flags, model, params.model_hash)


def recorded_control(extra: dict[str, str]) -> Optional[dict[str, Any]]:
    """The weight and guidance start/end of the ControlNet a PNG records (A1111's ControlNet extension's
    ``ControlNet 0: "Module: ..., Model: ..., Weight: 1, Guidance Start: 0, Guidance End: 1"``), or None."""
    text = extra.get("ControlNet 0") or extra.get("ControlNet")
    if not text:
        return None
    fields = {k.strip(): v.strip() for k, _, v in (part.partition(":") for part in text.split(","))}
    out = {}
    for key, name, default in (("scale", "Weight", 1.0), ("start", "Guidance Start", 0.0), ("end", "Guidance End", 1.0)):
        try:
            out[key] = float(fields.get(name, default))
        except ValueError:
            raise UserError(f"the PNG's ControlNet 0 {name} is not a number ({fields[name]!r})") from None
    m = re.search(r"\[([0-9a-fA-F]{8,})\]\s*$", fields.get("Model", ""))
    out.update(hash=m.group(1).lower() if m else "", mode=fields.get("Control Mode", ""))  # type: ignore[dict-item]
    return out


def _check_recorded_control(name: str, control: dict[str, Any], controlnet: Optional[str], control_image: Optional[str]) -> None:
    """The PNG's ControlNet weight, start and end in range (an error naming the PNG's key, not a flag), and
    a warning where it records an A1111 setting gencli does not apply (a Control Mode other than Balanced)."""
    import warnings

    from gencli.errors import Notice
    from gencli.pipelines.diffusion.controlnet import check_control_flags

    try:
        check_control_flags("-", "-", control["scale"], control["start"], control["end"])
    except UserError as exc:
        message = str(exc)
        for flag, key in (("--control-scale", "Weight"), ("--control-start", "Guidance Start"), ("--control-end", "Guidance End")):
            message = message.replace(flag, f"the PNG's ControlNet 0 {key}")
        raise UserError(f"'{name}': {message} (the value comes from the image's parameters, not from a flag)") from None
    mode = control.get("mode") or ""
    if mode and mode.lower() != "balanced":
        warnings.warn(f"'{name}' records ControlNet Control Mode '{mode}', which gencli does not apply (it draws Balanced): the replay will differ",
                      Notice, stacklevel=3)  # fmt: skip


def control_hash_warning(extra: dict[str, str], control: Any) -> Optional[str]:
    """The warning a replay gives when the loaded ControlNet's hash is not the one the PNG records (None
    when they agree, or when the PNG records none or no ControlNet was loaded)."""
    recorded = recorded_control(extra) if control is not None else None
    expected = recorded.get("hash") if recorded else ""
    if not expected or expected == control.hash:
        return None
    return f"the image was made with ControlNet hash {expected}, '{control.path}' has {control.hash}: the image will differ"


# A1111 settings that change the image and gencli does not implement: a replay says so
UNAPPLIED_KEYS = frozenset({
    "Hires upscale", "Hires steps", "Hires upscaler", "Hires resize", "Denoising strength 2", "Variation seed", "Variation seed strength",
    "Seed resize from", "Eta", "Eta DDIM", "ENSD", "Refiner", "Refiner switch at", "Face restoration", "Sigma min", "Sigma max", "Sigma churn",
    "Noise multiplier", "Token merging ratio", "ADetailer model", "ControlNet 0", "ControlNet",
})  # fmt: skip


def changes_the_image(key: str, value: str, sampler: str) -> bool:
    """Whether an unapplied A1111 setting would have changed the image ``sampler`` made: Eta and ENSD (the
    noise seed delta) act only on samplers that draw noise while they sample (ancestral, SDE, DDPM, LCM),
    Eta DDIM only on DDIM; an ENSD of 0 on none."""
    if key not in ("Eta", "ENSD", "Eta DDIM"):
        return True
    try:
        chosen = resolve_sampler(sampler)
    except UserError:  # no or an unknown sampler: it may have
        return True
    if key == "Eta DDIM":
        return chosen.class_name == "DDIMScheduler"
    if key == "ENSD" and value.strip() in ("0", "0.0"):
        return False
    sde = "sde" in str(chosen.options.get("algorithm_type", ""))
    return sde or chosen.class_name in ("EulerAncestralDiscreteScheduler", "DDPMScheduler", "LCMScheduler")


def from_the_png(name: str, exc: UserError) -> UserError:
    """A settings error whose value came from the PNG: named by the PNG's key, not by a flag."""
    message = str(exc)
    m = re.match(r"(--[a-z-]+)\b", message)
    if m and m.group(1) in PNG_KEYS:
        message = f"the PNG's '{PNG_KEYS[m.group(1)]}'" + message[m.end() :]
    return UserError(f"'{name}': {message} (the value comes from the image's parameters, not from a flag)")


__all__ = ["control_hash_warning", "model_hash_warning", "Replay", "plan_replay", "from_the_png", "PNG_KEYS"]
