"""What a ``sample`` run makes and where it goes, decided before any model loads (no torch): the
flag rules, the seeds (:mod:`gencli.backend.seeds`), the file names and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from gencli.backend.seeds import MAX_SAMPLES, check_seed, choose_seeds
from gencli.errors import UserError
from gencli.io import check_output_dir, format_name, make_output_dir, plan_files, plan_outputs

DEFAULT_COUNT = 16
MAX_TEMPERATURE = 100.0  # a VAE prior scaled further decodes to saturated noise (1e30: a black image)


@dataclass
class SamplePlan:
    """One ``sample`` run: the seeds, what is written (``"files"``: one PNG per sample, ``"gif"``:
    a latent walk, ``"grid"``: one image) and where."""

    family: str
    seeds: list[int]
    interpolate: Optional[int]
    kind: str
    targets: list[Path]
    nrow: Optional[int] = None
    settings: dict[str, Any] = field(default_factory=dict)
    out_dir: Optional[Path] = None


def plan_samples(
    family: str,
    *,
    n: Optional[int],
    seeds: Optional[str],
    seed: Optional[int],
    out: Optional[str],
    out_dir: Optional[str],
    nrow: Optional[int],
    interpolate: Optional[int],
    gif: bool,
    truncation: float,
    temperature: float,
    force: bool,
    new_seed: Callable[[], int],
) -> SamplePlan:
    """Check a ``sample`` command line and plan its outputs (every target checked before any work)."""
    if interpolate is not None and n is not None:
        raise UserError("--interpolate walks from --seed S to S+1 (or the two --seeds): -n does not apply")
    # a walk takes one seed (S, then S+1 below): the grid's default count of 16 does not apply to it
    chosen = choose_seeds(n, seeds, seed, default_count=DEFAULT_COUNT if interpolate is None else 1, new_seed=new_seed)
    if family == "gan" and not 0.0 < truncation <= 1.0:
        raise UserError(f"--truncation must lie in (0, 1], got {truncation}")
    if family == "vae" and not 0.0 < temperature <= MAX_TEMPERATURE:
        raise UserError(f"--temperature must be above 0 and at most {MAX_TEMPERATURE:g} (the prior's scale), got {temperature}")
    if family == "vae" and truncation != 1.0:
        raise UserError("--truncation is for GANs; a VAE's prior is scaled with --temperature")
    if family == "gan" and temperature != 1.0:
        raise UserError("--temperature is for VAEs; a GAN's latents are pulled in with --truncation")
    if out is not None and out_dir is not None:
        raise UserError("give --out (a grid) or --out-dir (one PNG per sample), not both")
    if gif and interpolate is None:
        raise UserError("--gif writes a latent walk: give --interpolate STEPS")
    if gif and out_dir is not None:
        raise UserError("--gif writes one file: use --out, not --out-dir")
    if nrow is not None and (out_dir is not None or gif):
        raise UserError(f"--nrow lays out a grid: {'--out-dir writes one PNG per sample' if out_dir is not None else '--gif writes frames'}")
    folder = check_output_dir(out_dir)
    if interpolate is not None:
        if len(chosen) != 2:
            if seeds is not None:
                raise UserError(f"--interpolate walks between two seeds: --seeds gave {len(chosen)}")
            base = chosen[0]
            chosen = [base, check_seed(base + 1, f"--seed {base} with --interpolate: seed")]
        if interpolate > MAX_SAMPLES:
            raise UserError(f"--interpolate must be at most {MAX_SAMPLES}")
    settings: dict[str, Any] = {"family": family, **({"temperature": temperature} if family == "vae" else {"truncation": truncation})}
    if folder is not None:
        if interpolate is not None:
            names = [f"{family}-walk-{chosen[0]}-{chosen[1]}-{i:03d}.png" for i in range(interpolate)]
        else:
            names = [f"{family}-seed{s}.png" for s in chosen]
        targets = plan_files(names, out_dir=folder, what="samples", force=force)
        return SamplePlan(family, chosen, interpolate, "files", targets, nrow, settings, folder)
    target = out if out is not None else ("samples.gif" if gif else "samples.png")
    fields = _placeholders(target)
    if fields:  # -o 'x-{seed}.png': one file per sample (per frame of a walk), as sample ddpm writes them
        bad = [f for f in fields if f not in ("i", "seed") and not f.startswith(("i:", "seed:"))]
        if bad:
            raise UserError(f"-o/--out {target!r}: unknown placeholder {{{bad[0]}}} (use {{i}} and {{seed}})")
        if gif:
            raise UserError(f"-o/--out {target!r}: --gif writes one animated file, so its name takes no {{i}} or {{seed}}")
        if nrow is not None:
            raise UserError("--nrow lays out a grid: a {i}/{seed} pattern writes one file per sample")
        if interpolate is not None and any(f == "seed" or f.startswith("seed:") for f in fields):
            raise UserError(f"-o/--out {target!r}: the frames of a walk have no seed of their own: name them with {{i}}")
        if interpolate is not None:
            names = [format_name(target, i=i) for i in range(interpolate)]
        else:
            names = [format_name(target, i=i, seed=s) for i, s in enumerate(chosen)]
        _check_image_names(names)
        return SamplePlan(family, chosen, interpolate, "files", plan_outputs(names, force, what="samples"), None, settings)
    target = format_name(target) if out is not None else target  # a literal brace is written doubled: {{ -> {
    if not gif:
        _check_image_names([target])
    return SamplePlan(family, chosen, interpolate, "gif" if gif else "grid", plan_outputs([target], force), nrow, settings)


def _placeholders(pattern: str) -> list[str]:
    """The replacement fields of an output name (``{i}``, ``{seed:05d}`` ...); a malformed one is one error."""
    import string

    try:
        return [f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None]
    except ValueError as exc:
        raise UserError(f"-o/--out {pattern!r}: {exc} (use {{i}} and {{seed}}; double a literal brace)") from None


def _check_image_names(names: list[str]) -> None:
    """Each name's suffix must be an image type gencli writes."""
    from gencli.pipelines.vision.images import image_format

    for name in names:
        image_format(name)


def write_samples(plan: SamplePlan, images: Any, model: str, *, force: bool) -> list[dict[str, Any]]:
    """Write a run's images as :func:`plan_samples` planned; one record per written file
    (``{"file", "seed"}`` or ``{"file", "seeds", ...}``)."""
    from gencli.pipelines.generative import outputs

    settings = {"model": model, **plan.settings}
    written: list[dict[str, Any]] = []
    if plan.kind == "files":
        if plan.out_dir is not None:
            make_output_dir(plan.out_dir)
        for i, (t, im) in enumerate(zip(plan.targets, images)):
            if plan.interpolate is not None:
                record: dict[str, Any] = {"seeds": plan.seeds, "t": round(i / (plan.interpolate - 1), 6)}
            else:
                record = {"seed": plan.seeds[i]}
            outputs.write_png(t, im, {**settings, **record}, force=force)
            written.append({"file": str(t), **record})
        return written
    target = plan.targets[0]
    if plan.kind == "gif":
        record = {"seeds": plan.seeds, "steps": plan.interpolate}
        outputs.write_gif(target, images, {**settings, **record}, force=force)
    else:
        record = {"seeds": plan.seeds} if plan.interpolate is None else {"seeds": plan.seeds, "steps": plan.interpolate}
        cols = plan.nrow or (plan.interpolate or max(1, round(len(images) ** 0.5)))
        outputs.write_png(target, outputs.image_grid(images, cols), {**settings, **record, "nrow": cols}, force=force)
    return [{"file": str(target), **record}]


__all__ = ["MAX_SAMPLES", "SamplePlan", "plan_samples", "write_samples"]
