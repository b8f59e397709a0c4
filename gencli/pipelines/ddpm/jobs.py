"""``gencli sample ddpm`` from its options to written PNGs: the seeds, the output files (checked before
anything loads), the settings (checked against the model before its weights load), the sampling
and the files. The command parses options and renders the records :func:`run` yields.

- Seeds: ``--seeds 0-7,12`` lists them; ``--seed S -n N`` gives ``S, ..., S+N-1``; no seed draws one.
- Outputs: ``--out-dir DIR`` writes ``DIR/ddpm-seed{seed}.png`` per image; ``-o`` with ``{i}`` (index
  from 0) and/or ``{seed}`` writes one PNG per image by that pattern; ``-o FILE`` without them writes
  one image when there is one and a grid (``--nrow`` per row) otherwise; default ``samples.png``.
  An existing file is never replaced without ``--force``; two images may not share a name.
- Every PNG carries the settings in the ``parameters`` text other Stable Diffusion front ends write
  (empty prompt, steps, sampler, seed, size, model and its hash, DDIM's eta, the class label).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from gencli import io
from gencli.backend.seeds import choose_seeds
from gencli.errors import UserError
from gencli.io import plan_files

FAMILY = "ddpm"
DEFAULT_MODEL = "ddpm-shapes"  # the embedded default: a DDIMPipeline folder under weights/


@dataclass
class DDPMRequest:
    """The options of one ``gencli sample ddpm`` run (None: not given)."""

    model: Optional[str] = None
    n: Optional[int] = None
    seeds: Optional[str] = None
    seed: Optional[int] = None
    out: Optional[str] = None
    out_dir: Optional[str] = None
    nrow: Optional[int] = None
    steps: Optional[int] = None
    sampler: Optional[str] = None
    eta: Optional[float] = None
    batch_size: Optional[int] = None
    class_label: Optional[int] = None
    force: bool = False
    other_flags: dict[str, bool] = field(default_factory=dict)  # flags of the other families: given or not
    expect_hash: str = ""  # replay: the Model hash the PNG was made with (a warning when the folder's differs)


@dataclass
class SamplePlan:
    """The seeds and where their images go: one file per image, or one grid file."""

    seeds: list[int]
    files: list[Path] = field(default_factory=list)  # one per seed (empty for a grid)
    grid: Optional[Path] = None
    nrow: int = 1


def _placeholders(pattern: str) -> list[str]:
    try:
        return [f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None]
    except ValueError as exc:
        raise UserError(f"-o/--out {pattern!r}: {exc} (use {{i}} and {{seed}}; double a literal brace)") from None


def plan_outputs(req: DDPMRequest, new_seed: Callable[[], int]) -> SamplePlan:
    """The seeds and output files of ``req``, every file checked (see the module doc)."""
    seeds = choose_seeds(req.n, req.seeds, req.seed, default_count=16, new_seed=new_seed)
    if req.out is not None and req.out_dir is not None:
        raise UserError("give -o/--out (a grid or a file pattern) or --out-dir (one PNG per sample), not both")
    pattern = str(req.out) if req.out is not None else "samples.png"
    fields = _placeholders(pattern)
    if req.nrow is not None and (req.out_dir is not None or fields or len(seeds) == 1):
        why = "--out-dir writes" if req.out_dir is not None else "a {i}/{seed} pattern writes" if fields else "one seed makes"
        raise UserError(f"--nrow lays out a grid: {why} one PNG per sample")
    if req.out_dir is not None:  # one PNG per seed, named after it
        names = [f"{FAMILY}-seed{s}.png" for s in seeds]
        return SamplePlan(seeds, files=plan_files(names, out_dir=req.out_dir, what="images", force=req.force))
    bad = [f for f in fields if f not in ("i", "seed") and not f.startswith(("i:", "seed:"))]
    if bad:
        raise UserError(f"-o/--out {pattern!r}: unknown placeholder {{{bad[0]}}} (use {{i}} and {{seed}})")
    if not fields:  # one file: the image, or a grid of them
        # a literal brace is written doubled ({{ -> {), as in a pattern with {i}/{seed}
        target = io.plan_outputs([io.format_name(pattern) if req.out is not None else pattern], req.force, what="images")[0]
        if len(seeds) == 1:
            return SamplePlan(seeds, files=[target])
        return SamplePlan(seeds, grid=target, nrow=req.nrow or max(1, round(len(seeds) ** 0.5)))
    names = [io.format_name(pattern, i=i, seed=s) for i, s in enumerate(seeds)]
    return SamplePlan(seeds, files=io.plan_outputs(names, req.force, what="images"))


def check_request(req: DDPMRequest) -> None:
    """What can be checked before the model is looked at."""
    given = [flag for flag, on in req.other_flags.items() if on]
    if given:
        raise UserError(f"{given[0]} is for sample vae|gan, not ddpm")
    if req.steps is not None and req.steps < 1:
        raise UserError(f"--steps must be at least 1, got {req.steps}")
    if req.eta is not None and not 0.0 <= req.eta <= 1.0:
        raise UserError(f"--eta must lie in [0, 1] (0: deterministic DDIM, 1: DDPM-like noise), got {req.eta}")
    if req.batch_size is not None and req.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {req.batch_size}")
    if req.sampler is not None:
        from gencli.schedulers import resolve_sampler

        resolve_sampler(req.sampler)


def run(req: DDPMRequest, report: Any, load_options: dict[str, Any], *, new_seed: Callable[[], int]) -> Iterator[dict[str, Any]]:
    """Check, plan, load, sample and write; yield one JSON record per written file.

    ``report``: a :class:`gencli.console.Reporter` (progress bar, debug lines)."""
    check_request(req)
    plan = plan_outputs(req, new_seed)
    from gencli.pipelines.ddpm import loading, outputs, sampling
    from gencli.schedulers import resolve_sampler
    from gencli.weights import resolve_model

    checkpoint = loading.inspect_pipeline(resolve_model(req.model, DEFAULT_MODEL), allow_pickle=bool(load_options.get("allow_pickle")))
    sampler = resolve_sampler(req.sampler).name if req.sampler is not None else checkpoint.default_sampler
    if req.eta is not None and resolve_sampler(sampler).class_name != "DDIMScheduler":
        raise UserError(f"--eta is DDIM's: it does nothing with --sampler {sampler} (use --sampler ddim)")
    eta = req.eta if req.eta is not None else 0.0
    steps = req.steps if req.steps is not None else sampling.default_steps(checkpoint, sampler)
    sampling.check_settings(checkpoint, sampler, steps, eta, req.class_label)

    loaded = loading.open_ddpm(checkpoint, **load_options)
    from gencli.pipelines.diffusion.replay import model_hash_warning

    warning = model_hash_warning(req.expect_hash, loaded.path, loaded.model_hash)
    if warning:
        report.warn(warning)
    report.debug(f"sample ddpm: {loaded.path} on {loaded.placement.describe()}, {sampler}, {steps} steps")
    total = len(plan.seeds) * sampling.model_calls(checkpoint, sampler, steps, eta)  # image-steps: each UNet call advances by its batch
    with report.progress(f"sampling ddpm ({sampler}, {steps} steps)", total=total) as advance:
        images = sampling.generate(
            loaded, plan.seeds, sampler=sampler, steps=steps, eta=eta, class_label=req.class_label, batch_size=req.batch_size or 1, on_step=advance,
        )  # fmt: skip
    settings = sampling.settings_record(checkpoint, sampler, steps, eta, req.class_label)
    yield from outputs.write_samples(plan, images, loaded, sampler=sampler, steps=steps, eta=eta, class_label=req.class_label, settings=settings,
                                     force=req.force, nrow_given=req.nrow is not None)  # fmt: skip


__all__ = ["DDPMRequest", "SamplePlan", "plan_outputs", "check_request", "run", "DEFAULT_MODEL"]
