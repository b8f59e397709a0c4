"""``gencli replay`` of a ``gencli sample ddpm`` PNG: its ``parameters`` (seed or grid seeds, sampler,
steps, eta, class label, model) read back into the request that draws it again (no torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from gencli.backend.seeds import check_seed
from gencli.errors import UserError
from gencli.io import input_name
from gencli.pipelines.ddpm.jobs import DDPMRequest
from gencli.pipelines.diffusion.png_parameters import read_parameters
from gencli.pipelines.diffusion.replay import replay_out

PIPELINES = ("DDPMPipeline", "DDIMPipeline")


def is_pixel_pipeline(folder: Path) -> bool:
    """A diffusers DDPM/DDIM pipeline folder (a ``UNet2DModel`` with its scheduler), by its configs."""
    try:
        if (folder / "model_index.json").is_file():
            return json.loads((folder / "model_index.json").read_text(encoding="utf-8")).get("_class_name") in PIPELINES
        unet = folder / "unet" / "config.json"
        return unet.is_file() and json.loads(unet.read_text(encoding="utf-8")).get("_class_name") == "UNet2DModel"
    except (OSError, ValueError, AttributeError):
        return False


def replay_request(image: str, *, model: Optional[str], seed: Optional[int], out: Optional[str], force: bool) -> Optional[DDPMRequest]:
    """The request that redraws ``image`` when its model (``--model``, else the one its parameters
    name) is a DDPM/DDIM pipeline folder; None for any other PNG (a Stable Diffusion one)."""
    from gencli.weights import resolve_model

    params = read_parameters(image)
    spec = model or params.model
    if not spec:
        return None
    try:
        folder = resolve_model(spec)
    except UserError:
        return None
    if not folder.is_dir() or not is_pixel_pipeline(folder):
        return None
    name = input_name(image)
    if params.prompt:
        raise UserError(f"'{name}' has a prompt, but its model '{spec}' is a pixel-space DDPM pipeline (no prompt): pass the model it was made with (--model)")
    grid = params.extra.get("Grid seeds")
    if seed is not None:
        seeds = str(check_seed(seed))
    elif grid:
        seeds = grid
    else:
        seeds = str(check_seed(params.seed, f"'{name}': the PNG's Seed"))
    eta = params.extra.get("Eta")
    label = params.extra.get("Class label")
    row = params.extra.get("Grid row") if grid and seed is None else None
    try:
        eta_value = float(eta) if eta is not None else None
        label_value = int(label) if label is not None else None
        nrow = int(row) if row is not None else None
    except ValueError:
        raise UserError(f"'{name}': its parameters' Eta '{eta}', Class label '{label}' or Grid row '{row}' is not a number") from None
    if nrow is not None and nrow < 1:
        raise UserError(f"'{name}': its parameters' Grid row '{row}' is not a positive number")
    return DDPMRequest(
        model=str(folder), seeds=seeds, out=replay_out(image, out), steps=params.steps or None,
        sampler=params.sampler or None, eta=eta_value, class_label=label_value, force=force,
        nrow=nrow, expect_hash=params.model_hash,
    )  # fmt: skip


__all__ = ["is_pixel_pipeline", "replay_request"]
