"""`gencli reconstruct`: round-trip image files through any VAE (a ConvVAE folder, or an
``AutoencoderKL`` in any layout :func:`~gencli.pipelines.diffusion.vae.load_autoencoder` reads) with
the posterior mean, and measure PSNR/SSIM against the input."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from gencli.backend.device import choose_placement
from gencli.checkpoints.formats import open_source
from gencli.errors import UserError
from gencli.pipelines.diffusion.vae import LoadedAutoencoder, load_autoencoder
from gencli.pipelines.diffusion.vae import reconstruct as reconstruct_kl
from gencli.pipelines.generative.loading import LoadedGenerative, architecture_of, load_generative
from gencli.pipelines.generative.metrics import psnr, ssim
from gencli.pipelines.generative.outputs import write_png
from gencli.pipelines.generative.sampling import reconstruct_vae
from gencli.pipelines.vision.images import load_image


@dataclass
class Reconstruction:
    psnr: float
    ssim: float
    size: tuple[int, int]  # (width, height) the model saw
    resized: Optional[tuple[int, int]]  # the input's (width, height) when it had to be resized


def load_any_vae(
    path: Union[str, Path], *, device: str = "auto", dtype: str = "auto", threads: Optional[int] = None, allow_pickle: bool = False
) -> Union[LoadedGenerative, LoadedAutoencoder]:
    """A ConvVAE folder, or an AutoencoderKL (diffusers folder, pipeline, bare or single file),
    placed by the user's ``--device/--dtype/--threads`` (fp32 unless asked)."""
    placement = choose_placement(device, dtype, "float", threads)
    p = Path(path)
    config = None
    if p.is_dir() and (p / "config.json").is_file():
        config = open_source(p, allow_pickle=allow_pickle).config
    arch = architecture_of(config) if config else None
    if arch == "ConvVAE":
        return load_generative(p, "vae", placement, allow_pickle=allow_pickle)
    if arch == "DCGAN":
        raise UserError(f"'{p}' is a GAN (DCGAN) checkpoint: a GAN has no encoder to reconstruct with; pass a VAE")
    return load_autoencoder(p, placement, allow_pickle=allow_pickle, prepack=True)


def model_size(model: Union[LoadedGenerative, LoadedAutoencoder], width: int, height: int) -> tuple[int, int]:
    """The input size the model takes for an image of ``width`` x ``height``: a ConvVAE its
    ``image_size`` square, an AutoencoderKL the nearest multiples of its downsampling factor."""
    if isinstance(model, LoadedGenerative):
        return model.image_size, model.image_size
    f = model.model.config.downsampling
    return max(f, round(width / f) * f), max(f, round(height / f) * f)


def read_model_image(model, path: str) -> tuple[np.ndarray, tuple[int, int], Optional[tuple[int, int]]]:
    """One image file as the model takes it: uint8 ``(1, H, W, 3)``, the size it has (width, height)
    and, when it had to be resized (bicubic) to fit the model, the file's own size."""
    from PIL import Image

    image = load_image(path)
    size = model_size(model, *image.size)
    resized = None
    if size != image.size:
        resized = image.size
        image = image.resize(size, Image.Resampling.BICUBIC)
    return np.array(image, dtype=np.uint8)[None], size, resized


def check_readable(paths: list[str]) -> None:
    """Read every input image once before the model loads: an unreadable one is the run's one error
    line, before any output is written (never a run that stops half-way with some files written)."""
    for path in paths:
        load_image(path)


def reconstruct_file(model, path: str, target: Path, *, tile: Optional[bool] = None, force: bool = False) -> Reconstruction:
    """Reconstruct one image file into ``target`` (a PNG with the model in a text chunk; its folder created)."""
    from gencli.io import make_output_dir

    make_output_dir(target.parent)
    x, size, resized = read_model_image(model, path)
    if isinstance(model, LoadedGenerative):
        y = reconstruct_vae(model, x)
    else:
        y, _ = reconstruct_kl(model.model, x, tile=tile)
    write_png(target, y[0], {"model": str(model.path), "source": str(path), "posterior": "mean"}, force=force)
    s = float(ssim(y, x)[0]) if min(size) >= 11 else float("nan")
    return Reconstruction(float(psnr(y, x)[0].clamp(max=99.0)), s, size, resized)


def plan_reconstructions(paths: list[str], out_dir: str, *, force: bool = False) -> tuple[Path, list[Path]]:
    """The folder and the PNG each input is reconstructed into (named after it), all checked before
    any work (the folder is created when the first is written): the folder is not a file nor ``-``, no two inputs
    share a name, nothing is replaced without ``force``."""
    from gencli.io import check_output_dir, plan_outputs

    folder = check_output_dir(out_dir)
    targets = [folder / ("stdin.png" if p == "-" else Path(p).stem + ".png") for p in paths]
    seen: dict[Path, str] = {}
    for p, t in zip(paths, targets):
        if t in seen:
            raise UserError(f"'{p}' and '{seen[t]}' would both be written to '{t}': rename one")
        seen[t] = p
    return folder, plan_outputs(targets, force, what="reconstructions", new_folder=True)


def results_table(rows: list[dict]):
    """The PSNR/SSIM table of a run (plain rows on a pipe: no box)."""
    from rich.table import Table

    table = Table("image", "output", "PSNR (dB)", "SSIM", box=None, header_style="bold", show_edge=False, pad_edge=False)
    for r in rows:
        table.add_row(r["image"], r["output"], f"{r['psnr']:.2f}", f"{r['ssim']:.4f}")
    return table


__all__ = ["Reconstruction", "check_readable", "plan_reconstructions", "results_table", "load_any_vae", "model_size", "read_model_image", "reconstruct_file"]
