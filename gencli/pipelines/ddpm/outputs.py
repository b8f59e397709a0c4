"""Writing DDPM samples: one PNG per image or a grid, each with the A1111-style ``parameters`` text
(:mod:`gencli.pipelines.diffusion.png_parameters`) that records how it was made."""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import numpy as np

from gencli.pipelines.ddpm.jobs import SamplePlan
from gencli.pipelines.ddpm.loading import LoadedDDPM
from gencli.pipelines.diffusion.png_parameters import ImageParameters


def seeds_spec(seeds: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3,7"`` (what ``--seeds`` reads back)."""
    parts: list[str] = []
    i = 0
    while i < len(seeds):
        j = i
        while j + 1 < len(seeds) and seeds[j + 1] == seeds[j] + 1:
            j += 1
        parts.append(str(seeds[i]) if i == j else f"{seeds[i]}-{seeds[j]}")
        i = j + 1
    return ",".join(parts)


def parameters(
    loaded: LoadedDDPM,
    *,
    seed: int,
    sampler: str,
    steps: int,
    eta: float,
    class_label: Optional[int],
    seeds: Optional[Sequence[int]] = None,
    nrow: Optional[int] = None,
) -> ImageParameters:
    """The ``parameters`` of one image (or of a grid: ``seeds``, and ``nrow`` when ``--nrow`` set its
    row length): no prompt, no guidance (CFG scale 1)."""
    from gencli.pipelines.ddpm.sampling import make_scheduler

    h, w = loaded.checkpoint.unet_config.image_size
    scheduler = make_scheduler(loaded.checkpoint, sampler, eta)
    extra: dict[str, str] = {}
    if scheduler.diffusers_class == "DDIMScheduler":
        extra["Eta"] = f"{eta:g}"
    if class_label is not None:
        extra["Class label"] = str(class_label)
    if seeds is not None and len(seeds) > 1:
        extra["Grid seeds"] = seeds_spec(seeds)
        if nrow is not None:
            extra["Grid row"] = str(nrow)
    return ImageParameters(
        prompt="", steps=steps, sampler=scheduler.display_name, cfg_scale=1.0, seed=seed, width=w, height=h, model=loaded.checkpoint.name,
        model_hash=loaded.model_hash, extra=extra,
    )  # fmt: skip


def _rgb(image: np.ndarray) -> np.ndarray:
    """A grey (one-channel) sample as RGB; RGB as it is."""
    return np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image[..., :3]


def write_samples(
    plan: SamplePlan,
    images: np.ndarray,
    loaded: LoadedDDPM,
    *,
    sampler: str,
    steps: int,
    eta: float,
    class_label: Optional[int],
    settings: dict[str, Any],
    force: bool = False,
    nrow_given: bool = False,
) -> Iterator[dict[str, Any]]:
    """Write the plan's files (atomically) and yield one record per file (``nrow_given``: the grid's
    row length was chosen, so its parameters record it for replay)."""
    from gencli.io import atomic_write_bytes
    from gencli.pipelines.diffusion.png_parameters import PARAMETERS_KEY
    from gencli.pipelines.generative.outputs import image_grid
    from gencli.pipelines.vision.images import image_bytes

    common = {"model": str(loaded.path), "model_hash": loaded.model_hash, **settings}
    if plan.grid is not None:
        params = parameters(loaded, seed=plan.seeds[0], sampler=sampler, steps=steps, eta=eta, class_label=class_label, seeds=plan.seeds,
                            nrow=plan.nrow if nrow_given else None)  # fmt: skip
        grid = image_grid(np.stack([_rgb(im) for im in images]), plan.nrow)
        plan.grid.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(plan.grid, image_bytes(grid, str(plan.grid), {PARAMETERS_KEY: params.to_text()}), force=force)
        yield {"file": str(plan.grid), "seeds": list(plan.seeds), "nrow": plan.nrow, **common, "parameters": params.to_text()}
        return
    for path, seed, image in zip(plan.files, plan.seeds, images):
        params = parameters(loaded, seed=seed, sampler=sampler, steps=steps, eta=eta, class_label=class_label)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, image_bytes(_rgb(image), str(path), {PARAMETERS_KEY: params.to_text()}), force=force)
        yield {"file": str(path), "seed": seed, **common, "parameters": params.to_text()}


__all__ = ["seeds_spec", "parameters", "write_samples"]
