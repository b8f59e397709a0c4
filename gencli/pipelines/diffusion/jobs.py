"""Turning a command line (a prompt or a prompts file, seeds, ``-n``, an output pattern) into the images
to make, and making them in batches. Torch is imported only by :func:`run_jobs` (through
:mod:`gencli.pipelines.diffusion.pipeline`).

- Seeds: ``--seeds 0-3,7`` lists them (one image per seed and prompt); ``--seed S -n N`` gives
  ``S, S+1, ..., S+N-1`` (other front ends count up the same way); no seed draws a random one.
- A prompts file holds one prompt per line, or JSON lines ``{"prompt": ..., "negative_prompt": ...,
  "steps": ..., "guidance": ..., "guidance_rescale": ..., "sampler": ..., "width": ..., "height": ...,
  "clip_skip": ..., "seed": ..., "seeds": ..., "n": ...}`` whose keys override the flags for that prompt.
- ``-o/--out`` may hold ``{i}`` (the image's index in the run, from 0) and ``{seed}``, with format
  specs (``{i:03d}``). Every output is checked before anything is loaded: two images may not share a
  name, and an existing file is never replaced without ``--force``.
"""

from __future__ import annotations

import contextlib
import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from gencli.backend.seeds import check_seed
from gencli.backend.seeds import parse_seeds as _parse_seeds
from gencli.errors import UserError
from gencli.io import check_text, format_name, plan_outputs, read_stdin_text

if TYPE_CHECKING:
    import numpy as np

    from gencli.pipelines.diffusion.pipeline import BatchTiming, GeneratedImage, StableDiffusion

# per-prompt keys of a JSON-lines prompts file -> the flag they stand for
PROMPT_KEYS = {
    "negative_prompt": "--negative-prompt", "steps": "--steps", "guidance": "--guidance", "guidance_rescale": "--guidance-rescale",
    "sampler": "--sampler", "width": "--width", "height": "--height", "clip_skip": "--clip-skip", "seed": "--seed", "seeds": "--seeds",
    "n": "-n", "strength": "--strength",
}  # fmt: skip
MAX_IMAGES = 100_000


def parse_seeds(text: Any) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]`` (:func:`gencli.backend.seeds.parse_seeds`, at most ``MAX_IMAGES``)."""
    return _parse_seeds(text, limit=MAX_IMAGES)


@dataclass
class PromptSpec:
    """One prompt and what its line of a prompts file overrides."""

    prompt: str
    overrides: dict[str, Any] = field(default_factory=dict)
    origin: str = ""  # where it was read ("'FILE' line N"), named by its errors

    @contextlib.contextmanager
    def located(self) -> Iterator[None]:
        """Errors raised inside name the line the prompt came from."""
        try:
            yield
        except UserError as exc:
            if not self.origin:
                raise
            raise UserError(f"{self.origin}: {exc}") from None


def read_prompts_file(path: str) -> list[PromptSpec]:
    """Prompts from a file (``-`` = stdin): plain lines, or JSON objects one per line (blank lines and
    lines starting with ``#`` skipped)."""
    from gencli.io import read_lines

    lines, where = read_lines(path, what="--prompts-file")
    specs = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where} line {number}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise UserError(f'{where} line {number}: a JSON line needs a "prompt" string')
            unknown = sorted(set(obj) - set(PROMPT_KEYS) - {"prompt"})
            if unknown:
                raise UserError(f"{where} line {number}: unknown key {unknown[0]!r} (known: prompt, {', '.join(PROMPT_KEYS)})")
            negative = obj.get("negative_prompt")
            if negative is not None and not isinstance(negative, str):
                raise UserError(f'{where} line {number}: "negative_prompt" must be a string (got {negative!r})')
            spec = PromptSpec(obj.pop("prompt"), obj, f"{where} line {number}")
            with spec.located():
                check_text(spec.prompt, '"prompt"')
                if negative is not None:
                    check_text(negative, '"negative_prompt"')
            specs.append(spec)
        else:
            specs.append(PromptSpec(line.strip(), origin=f"{where} line {number}"))
    if not specs:
        raise UserError(f"no prompts in {where}")
    return specs


@dataclass
class Job:
    """One image to make: its prompt, seed, settings overrides and output file."""

    index: int
    prompt: str
    negative_prompt: Optional[str]
    seed: int
    flags: dict[str, Any]  # the settings flags for this image (None = the pipeline's default)
    out: Path


def check_image_name(name: str) -> None:
    """An output name whose type gencli writes (:func:`~gencli.pipelines.vision.images.image_format`)."""
    from gencli.pipelines.vision.images import image_format

    image_format(name)


def check_out_pattern(pattern: str) -> None:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None]
    except ValueError as exc:
        raise UserError(f"-o/--out {pattern!r}: {exc} (use {{i}} and {{seed}}; double a literal brace)") from None
    bad = [f for f in fields if f not in ("i", "seed")]
    if bad:
        raise UserError(f"-o/--out {pattern!r}: unknown placeholder {{{bad[0]}}} (use {{i}} and {{seed}})")


def plan_jobs(
    specs: Sequence[PromptSpec],
    *,
    negative_prompt: Optional[str],
    flags: dict[str, Any],
    seed: Optional[int],
    seeds: Optional[str],
    n: Optional[int],
    out: Optional[str],
    default_out: str,
    force: bool,
    new_seed: Callable[[], int],
) -> list[Job]:
    """Every image of a run, its output path checked (see the module doc)."""
    from gencli.pipelines.diffusion.pipeline import SETTING_FLAGS

    if n is not None and n < 1:
        raise UserError(f"-n must be at least 1 (got {n})")
    if seed is not None and seeds is not None:
        raise UserError("give --seed (the first of -n seeds) or --seeds (the exact seeds), not both")
    if negative_prompt is not None:
        check_text(negative_prompt, "--negative-prompt")
    if seed is not None or seeds is not None:  # the command's own seeds, checked once and named by their flags
        _spec_seeds(PromptSpec(""), seed=seed, seeds=seeds, n=n, new_seed=new_seed)
    jobs: list[Job] = []
    for spec in specs:
        with spec.located():
            listed = _spec_seeds(spec, seed=seed, seeds=seeds, n=n, new_seed=new_seed)
        merged = {**flags, **{k: v for k, v in spec.overrides.items() if k in SETTING_FLAGS}}
        negative = spec.overrides.get("negative_prompt", negative_prompt)
        for s in listed:
            jobs.append(Job(len(jobs), spec.prompt, negative, s, merged, Path()))
        if len(jobs) > MAX_IMAGES:
            raise UserError(f"at most {MAX_IMAGES} images per run")
    return _name_outputs(jobs, out=out, default_out=default_out, force=force)


def _spec_seeds(spec: PromptSpec, *, seed: Optional[int], seeds: Optional[str], n: Optional[int], new_seed: Callable[[], int]) -> list[int]:
    """The seeds of one prompt's images: its own ``seeds``/``seed``/``n`` over the command's."""
    o = spec.overrides
    spec_seeds = o.get("seeds", seeds)
    count = o.get("n", n)
    if count is not None and (not isinstance(count, int) or isinstance(count, bool)):
        raise UserError(f"-n must be a whole number (got {count!r})")
    if spec_seeds is not None:
        listed = parse_seeds(spec_seeds)
        if count is not None and count != len(listed):
            raise UserError(f"-n {count} does not match the {len(listed)} seeds of --seeds")
        return listed
    base = o.get("seed", seed)
    if base is None:
        base = new_seed()
    check_seed(base, "--seed" if "seed" not in o else '"seed"')
    count = 1 if count is None else count
    if count < 1:
        raise UserError(f"-n must be at least 1 (got {count})")
    return [check_seed(base + k, f"--seed {base} with -n {count}: seed") for k in range(count)]


def _name_outputs(jobs: list[Job], *, out: Optional[str], default_out: str, force: bool) -> list[Job]:
    """Each job's output path from the ``-o`` pattern (or the default), checked: no two images share a
    name, no existing file is replaced without ``force``."""
    pattern = out if out is not None else default_out
    check_out_pattern(pattern)
    if len(jobs) > 1 and "{i" not in pattern and "{seed" not in pattern:
        raise UserError(f"-o {pattern!r} names one file for {len(jobs)} images: add {{i}} or {{seed}} to it")
    seen: dict[str, int] = {}
    for job in jobs:
        name = format_name(pattern, i=job.index, seed=job.seed)
        if name in seen:
            raise UserError(f"-o {pattern!r} gives images {seen[name]} and {job.index} the same name '{name}': add {{i}} to it")
        seen[name] = job.index
    check_image_name(format_name(pattern, i=0, seed=jobs[0].seed) if jobs else pattern)
    for job, target in zip(jobs, plan_outputs([format_name(pattern, i=j.index, seed=j.seed) for j in jobs], force, what="images")):
        job.out = target
    return jobs


@dataclass
class RunPlan:
    """A txt2img/img2img/replay run, checked before any model loads: its images, and the img2img
    source and inpainting mask at the run's size."""

    jobs: list[Job]
    init: Optional[np.ndarray] = None
    mask: Optional[np.ndarray] = None


def plan_run(
    prompt: Optional[str],
    prompts_file: Optional[str],
    *,
    kind: str,
    flags: dict[str, Any],
    negative_prompt: Optional[str],
    seed: Optional[int],
    seeds: Optional[str],
    n: Optional[int],
    out: Optional[str],
    force: bool,
    batch_size: int,
    new_seed: Callable[[], int],
    image: Optional[str] = None,
    mask: Optional[str] = None,
) -> RunPlan:
    """Every check of a ``kind`` run (``txt2img``, ``img2img``, ``replay``) and its plan: the prompts
    (``PROMPT``, ``-`` = stdin, or a prompts file), the settings, the seeds, the output names
    (default ``KIND-{seed}.png`` for one image, ``KIND-{i:03d}-{seed}.png`` for many) and the source
    image and mask (``flags`` gets the run's size from the source image when no size was given)."""
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 (got {batch_size})")
    if prompt is not None and prompts_file is not None:
        raise UserError("give a PROMPT or --prompts-file, not both")
    if "-" in (prompt, prompts_file) and "-" in (image, mask):
        raise UserError("stdin holds either the image or the prompt: give one of them as a file")
    if prompts_file is not None:
        specs = read_prompts_file(prompts_file)
    elif prompt is None:
        raise UserError(f"no prompt: gencli {kind} PROMPT, or --prompts-file FILE ('' is an unconditional prompt)")
    else:
        specs = [PromptSpec(read_stdin_text().strip() if prompt == "-" else check_text(prompt, "the prompt"))]
    check_job_flags(flags)
    for spec in specs:
        with spec.located():
            check_spec_flags(spec, flags, kind)
    if seed is not None:
        check_seed(seed)
    init = read_init_image(image, flags) if image is not None else None
    mask_pixels = read_mask(mask, flags) if mask is not None else None
    if init is not None:
        for spec in specs:
            with spec.located():
                check_spec_size(spec, flags)
    one_image = len(specs) == 1 and not n and not seeds
    default_out = f"{'txt2img' if kind == 'replay' else kind}-{{seed}}.png" if one_image else f"{kind}-{{i:03d}}-{{seed}}.png"
    jobs = plan_jobs(
        specs, negative_prompt=negative_prompt, flags=flags, seed=seed, seeds=seeds, n=n, out=out, default_out=default_out, force=force,
        new_seed=new_seed,
    )  # fmt: skip
    return RunPlan(jobs, init, mask_pixels)


def read_init_image(image: str, flags: dict[str, Any]) -> np.ndarray:
    """The img2img source at the run's size: --width/--height, else its own rounded down to a
    multiple of 8 (``flags`` gets that size)."""
    from gencli.pipelines.diffusion.pipeline import SIZE_MULTIPLE, prepare_init_image
    from gencli.pipelines.vision.images import load_image

    pil = load_image(image)
    w = flags.get("width") or pil.width // SIZE_MULTIPLE * SIZE_MULTIPLE
    h = flags.get("height") or pil.height // SIZE_MULTIPLE * SIZE_MULTIPLE
    if w < SIZE_MULTIPLE or h < SIZE_MULTIPLE:
        raise UserError(f"'{image}' is {pil.width}x{pil.height}: too small (at least {SIZE_MULTIPLE}x{SIZE_MULTIPLE})")
    flags["width"], flags["height"] = w, h
    return prepare_init_image(pil, w, h)


def check_spec_size(spec: PromptSpec, flags: dict[str, Any]) -> None:
    """img2img: the source image (and mask) is read once at the run's size (``flags``), so a prompt
    may not ask for another size."""
    for key in ("width", "height"):
        value = spec.overrides.get(key)
        if value is not None and value != flags[key]:
            raise UserError(
                f'"{key}": {value} differs from the run\'s {flags["width"]}x{flags["height"]} (the source image is resized once for all prompts): '
                f"give {PROMPT_KEYS[key]} instead, or run this prompt separately"
            )


def read_mask(mask: str, flags: dict[str, Any]) -> np.ndarray:
    """The inpainting mask at the run's size (that of the init image, read first)."""
    from gencli.pipelines.diffusion.pipeline import prepare_mask
    from gencli.pipelines.vision.images import load_image

    return prepare_mask(load_image(mask), flags["width"], flags["height"])


def check_job_flags(job_flags: dict[str, Any]) -> None:
    """The per-prompt settings' types and ranges (flags are checked by typer and check_settings)."""
    from gencli.pipelines.diffusion.pipeline import check_settings

    kinds = {"steps": int, "width": int, "height": int, "clip_skip": int, "sampler": str, "guidance": (int, float),
             "guidance_rescale": (int, float), "strength": (int, float)}  # fmt: skip
    for key, value in job_flags.items():
        if value is not None and (not isinstance(value, kinds[key]) or isinstance(value, bool)):
            raise UserError(f"{PROMPT_KEYS[key]} must be {'a string' if key == 'sampler' else 'a number'} (got {value!r})")
    check_settings(**{k: v for k, v in job_flags.items() if v is not None})


def check_spec_flags(spec: PromptSpec, flags: dict[str, Any], kind: str) -> None:
    """One prompt's settings over the command's ``flags``: only settings the command has (``strength``
    is img2img's), of the right types and ranges."""
    from gencli.pipelines.diffusion.pipeline import SETTING_FLAGS

    foreign = sorted(k for k in spec.overrides if k in SETTING_FLAGS and k not in flags)
    if foreign:
        raise UserError(f"{foreign[0]!r} is not a setting of {kind} ({PROMPT_KEYS[foreign[0]]} is img2img's)")
    check_job_flags({**flags, **{k: v for k, v in spec.overrides.items() if k in flags}})


def batches(jobs: Sequence[Job], batch_size: int) -> Iterator[list[Job]]:
    """Consecutive jobs with the same settings, at most ``batch_size`` at a time."""
    current: list[Job] = []
    for job in jobs:
        if current and (len(current) == batch_size or job.flags != current[0].flags):
            yield current
            current = []
        current.append(job)
    if current:
        yield current


def run_jobs(
    pipe: StableDiffusion,
    jobs: Sequence[Job],
    *,
    batch_size: int = 1,
    init_image: Optional[np.ndarray] = None,
    mask: Optional[np.ndarray] = None,
    on_step: Optional[Callable[[], None]] = None,
    on_notice: Optional[Callable[[str], None]] = None,
    on_batch: Optional[Callable[[list[Job], BatchTiming], None]] = None,
) -> Iterator[tuple[Job, GeneratedImage]]:
    """Make the images, ``batch_size`` at a time (same settings within a batch), yielding each with
    its job as soon as its batch is done. ``init_image`` (uint8 ``(H, W, 3)`` at the run's size) makes
    every image an img2img of it, and ``mask`` (``(H, W)``, 1 = repaint) an inpainting."""
    from gencli.pipelines.diffusion.pipeline import BatchTiming, generate, resolve_settings

    unused_told: set[str] = set()
    for group in batches(jobs, batch_size):
        settings = resolve_settings(pipe, **group[0].flags)
        negatives = [j.negative_prompt for j in group]
        if on_notice is not None and not settings.classifier_free_guidance:
            given = {"a negative prompt": any(negatives), "--guidance-rescale": bool(group[0].flags.get("guidance_rescale"))}  # asked for, not a config's
            unused = [name for name, asked in given.items() if asked]
            for name in unused:
                if name not in unused_told:
                    unused_told.add(name)
                    on_notice(f"{name} has no effect at guidance {settings.guidance:g}: guidance <= 1 runs no unconditional pass (raise --guidance)")
        timing = BatchTiming()
        images = generate(
            pipe,
            [j.prompt for j in group],
            [j.seed for j in group],
            settings,
            negative_prompts=None if all(n is None for n in negatives) else [n or "" for n in negatives],
            init_images=None if init_image is None else [init_image] * len(group),
            masks=None if mask is None else [mask] * len(group),
            on_step=(lambda _done, _total: on_step()) if on_step else None,
            on_notice=on_notice,
            timing=timing,
        )
        if on_batch:
            on_batch(group, timing)
        yield from zip(group, images)


def write_image(job: Job, image: Any, pipe: StableDiffusion, *, force: bool, to: Optional[Path] = None) -> dict[str, Any]:
    """Write one generated image (PNG with its settings in the 'parameters' chunk, or the type its
    name asks for) to ``job.out`` (or ``to``: the same file by an absolute name, for a Ray worker)
    and return its JSON record."""
    from gencli.pipelines.diffusion.png_parameters import PARAMETERS_KEY
    from gencli.pipelines.vision.images import write_image as write

    params = image.parameters(pipe)
    write(to or job.out, image.pixels, {PARAMETERS_KEY: params.to_text()}, force=force)
    s = image.settings
    return {
        "file": str(job.out), "prompt": image.prompt, "negative_prompt": image.negative_prompt, "seed": image.seed,
        "steps": s.steps, "sampler": params.sampler, "guidance": s.guidance, "guidance_rescale": s.guidance_rescale,
        "width": s.width, "height": s.height, "clip_skip": s.clip_skip, "strength": s.strength,
        "model": str(pipe.path), "model_hash": pipe.model_hash, "parameters": params.to_text(),
    }  # fmt: skip


def model_calls(pipe: StableDiffusion, jobs: Sequence[Job], batch_size: int) -> int:
    """How many UNet calls the run makes (for a progress bar)."""
    from gencli.pipelines.diffusion.pipeline import make_scheduler, resolve_settings

    total = 0
    for group in batches(jobs, batch_size):
        s = resolve_settings(pipe, **group[0].flags)
        scheduler = make_scheduler(s.sampler, pipe.scheduler_config)
        scheduler.set_timesteps(s.steps)
        total += len(scheduler.img2img_timesteps(s.strength)[0]) if s.strength is not None else len(scheduler.timesteps)
    return total


__all__ = [
    "parse_seeds", "RunPlan", "plan_run", "read_init_image", "read_mask", "PromptSpec", "read_prompts_file", "Job", "plan_jobs", "check_job_flags",
    "check_spec_flags", "batches", "run_jobs", "write_image", "model_calls",
]  # fmt: skip
