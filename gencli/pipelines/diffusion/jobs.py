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

import json
import re
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from gencli.errors import UserError
from gencli.io import ensure_writable

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


def parse_seeds(text: str) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]`` (ranges inclusive; seeds are 0 to 2**32 - 1)."""
    seeds: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise UserError(f"--seeds: {part!r} is not a seed or a range such as 0-7 (seeds are non-negative integers)")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise UserError(f"--seeds: the range {part!r} runs backwards")
        if hi >= 2**32 or len(seeds) + hi - lo + 1 > MAX_IMAGES:
            raise UserError(f"--seeds: {part!r} is too large (seeds below 2**32, at most {MAX_IMAGES} images)")
        seeds.extend(range(lo, hi + 1))
    return seeds


@dataclass
class PromptSpec:
    """One prompt and what its line of a prompts file overrides."""

    prompt: str
    overrides: dict[str, Any] = field(default_factory=dict)


def read_prompts_file(path: str) -> list[PromptSpec]:
    """Prompts from a file (``-`` = stdin): plain lines, or JSON objects one per line (blank lines and
    lines starting with ``#`` skipped)."""
    if path == "-":
        text = sys.stdin.read()
        where = "stdin"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"--prompts-file '{path}' does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read --prompts-file '{path}': {exc}") from None
        where = f"'{path}'"
    specs = []
    for number, line in enumerate(text.splitlines(), 1):
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
            specs.append(PromptSpec(obj.pop("prompt"), obj))
        else:
            specs.append(PromptSpec(line.strip()))
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
    jobs: list[Job] = []
    for spec in specs:
        o = spec.overrides
        spec_seeds = o.get("seeds", seeds)
        count = o.get("n", n)
        if spec_seeds is not None:
            listed = parse_seeds(",".join(map(str, spec_seeds)) if isinstance(spec_seeds, list) else str(spec_seeds))
            if count is not None and count != len(listed):
                raise UserError(f"-n {count} does not match the {len(listed)} seeds of --seeds")
        else:
            base = o.get("seed", seed)
            if base is None:
                base = new_seed()
            if not isinstance(base, int) or base < 0:
                raise UserError(f"a seed must be a non-negative integer (got {base!r})")
            if not isinstance(count, int) or isinstance(count, bool):
                count = 1 if count is None else count
            listed = [(base + k) % 2**32 for k in range(count)]
            if count < 1:
                raise UserError(f"-n must be at least 1 (got {count})")
        merged = {**flags, **{k: v for k, v in o.items() if k in SETTING_FLAGS}}
        negative = o.get("negative_prompt", negative_prompt)
        for s in listed:
            jobs.append(Job(len(jobs), spec.prompt, negative, s, merged, Path()))
        if len(jobs) > MAX_IMAGES:
            raise UserError(f"at most {MAX_IMAGES} images per run")
    pattern = out if out is not None else default_out
    check_out_pattern(pattern)
    if len(jobs) > 1 and "{i" not in pattern and "{seed" not in pattern:
        raise UserError(f"-o {pattern!r} names one file for {len(jobs)} images: add {{i}} or {{seed}} to it")
    seen: dict[str, int] = {}
    for job in jobs:
        name = pattern.format(i=job.index, seed=job.seed)
        if name in seen:
            raise UserError(f"-o {pattern!r} gives images {seen[name]} and {job.index} the same name '{name}': add {{i}} to it")
        seen[name] = job.index
        job.out = ensure_writable(name, force)
    return jobs


def check_job_flags(job_flags: dict[str, Any]) -> None:
    """The per-prompt settings' types and ranges (flags are checked by typer and check_settings)."""
    from gencli.pipelines.diffusion.pipeline import check_settings

    kinds = {"steps": int, "width": int, "height": int, "clip_skip": int, "sampler": str, "guidance": (int, float),
             "guidance_rescale": (int, float), "strength": (int, float)}  # fmt: skip
    for key, value in job_flags.items():
        if value is not None and (not isinstance(value, kinds[key]) or isinstance(value, bool)):
            raise UserError(f"{PROMPT_KEYS[key]} must be {'a string' if key == 'sampler' else 'a number'} (got {value!r})")
    check_settings(**{k: v for k, v in job_flags.items() if v is not None})


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

    for group in batches(jobs, batch_size):
        settings = resolve_settings(pipe, **group[0].flags)
        negatives = [j.negative_prompt for j in group]
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
    """Write one generated image as PNG (its settings in the 'parameters' chunk) to ``job.out`` (or
    ``to``: the same file by an absolute name, for a Ray worker) and return its JSON record."""
    from gencli.io import atomic_write_bytes
    from gencli.pipelines.diffusion.png_parameters import png_bytes

    params = image.parameters(pipe)
    atomic_write_bytes(to or job.out, png_bytes(image.pixels, params.to_text()), force=force)
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


__all__ = ["parse_seeds", "PromptSpec", "read_prompts_file", "Job", "plan_jobs", "check_job_flags", "batches", "run_jobs", "write_image", "model_calls"]
