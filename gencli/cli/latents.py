"""`gencli encode` (images -> latent files) and `gencli decode` (latent files -> images)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, command, option

DEFAULT_MODEL = "autoencoder-shapes"
TILE_HELP = "Tiled encode/decode, blended across the seams (default: automatic above 1024 pixels)."


def _targets(out: Optional[Path], out_dir: Optional[Path], names: list[str], what: str, force: bool) -> list[Path]:
    """Where each output goes: ``--out`` (exactly one output) or ``--out-dir`` (default: the current
    folder) with ``names``; every target is checked before any work (nothing half-written)."""
    from gencli.errors import UserError

    if out is not None and out_dir is not None:
        raise UserError("give --out (one output) or --out-dir (a folder), not both")
    if out is not None:
        if len(names) != 1:
            raise UserError(f"--out names one file but there are {len(names)} {what}: use --out-dir")
        targets = [out]
    else:
        folder = out_dir if out_dir is not None else Path(".")
        if folder.exists() and not folder.is_dir():
            raise UserError(f"--out-dir '{folder}' is not a directory")
        targets = [folder / n for n in names]
    seen: set[Path] = set()
    for t in targets:
        if t in seen:
            raise UserError(f"two inputs would both be written to '{t}': rename one or use --out-dir with distinct names")
        seen.add(t)
        if t.exists() and not force:
            raise UserError(f"output '{t}' already exists (use --force to overwrite)")
    return targets


@command(app, "encode", seed_help="With --sample: the seed of the posterior sample (default: the posterior mean, no randomness).")
def encode(
    images: Annotated[list[str], typer.Argument(metavar="IMAGE...", help="Image files or directories, or - for paths on stdin.", show_default=False)],
    out: Annotated[Optional[Path], option("--out", help="The latent file (one input only).")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out-dir", help="Folder for NAME.latent.safetensors per input (default: the current folder).")] = None,
    sample: Annotated[bool, typer.Option("--sample", help="Draw from the posterior (seeded by --seed) instead of taking its mean.")] = False,
    tile: Annotated[Optional[bool], typer.Option("--tile/--no-tile", help=TILE_HELP)] = None,
    force: Annotated[bool, option("--force", help="Overwrite existing outputs.")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Encode images into AutoencoderKL latents (default model: the embedded autoencoder-shapes; or
    any diffusers AutoencoderKL folder or SD VAE file): one latent .safetensors file per image
    (unscaled latents under 'latent_tensor', the layout of ComfyUI's .latent files). Images whose
    size is not a multiple of the model's downsampling factor are resized, with a notice.
    With --json: one line per file {"image", "latent", "shape", "resized"}."""
    from gencli.backend.random import new_seed
    from gencli.console import emit_json
    from gencli.pipelines.diffusion import latents as lat
    from gencli.pipelines.vision.images import image_paths
    from gencli.weights import resolve_model

    paths = image_paths(images)
    targets = _targets(out, out_dir, [Path(p).stem + ".latent.safetensors" for p in paths], "images", force)
    seed = (opts.seed if opts.seed is not None else new_seed()) if sample else None
    loaded = lat.load_latent_autoencoder(resolve_model(opts.model, DEFAULT_MODEL), **opts.load_options())
    opts.report.debug(f"encode: {loaded.path} on {loaded.placement.describe()}")
    with opts.report.progress("encoding", total=len(paths)) as advance:
        for i, (p, t) in enumerate(zip(paths, targets)):
            enc = lat.encode_file(loaded, p, tile=tile, seed=None if seed is None else seed + i)
            if enc.resized:
                opts.report.warn(f"{p}: resized from {enc.resized[0]}x{enc.resized[1]} to {enc.size[0]}x{enc.size[1]} for the model")
            posterior = {"posterior": "mean"} if seed is None else {"posterior": "sample", "seed": seed + i}
            meta = {"model": str(loaded.path), "source": p, "width": enc.size[0], "height": enc.size[1], **posterior}
            t.parent.mkdir(parents=True, exist_ok=True)
            lat.write_latents(t, enc.latents, meta, force=force)
            if opts.json:
                emit_json({"image": p, "latent": str(t), "shape": list(enc.latents.shape), "resized": bool(enc.resized), **posterior})
            else:
                opts.report.say(f"wrote {t} ({'x'.join(str(d) for d in enc.latents.shape[1:])} latents)")
            advance()


@command(app, "decode", seed_help=DETERMINISTIC_SEED_HELP)
def decode(
    latents: Annotated[
        list[Path], typer.Argument(metavar="LATENT...", help="Latent .safetensors files (from gencli encode, or ComfyUI .latent files).", show_default=False)
    ],
    out: Annotated[Optional[Path], option("--out", help="The PNG (one latent only).")] = None,
    out_dir: Annotated[
        Optional[Path], typer.Option("--out-dir", help="Folder for NAME.png per latent, NAME-I.png for a batch (default: the current folder).")
    ] = None,
    tile: Annotated[Optional[bool], typer.Option("--tile/--no-tile", help=TILE_HELP)] = None,
    force: Annotated[bool, option("--force", help="Overwrite existing outputs.")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Decode latent files into PNGs with an AutoencoderKL (default: the embedded autoencoder-shapes;
    use the model the latents came from). With --json: one line per image {"latent", "index", "image", "size"}."""
    from gencli.console import emit_json
    from gencli.pipelines.diffusion import latents as lat
    from gencli.pipelines.generative.outputs import write_png
    from gencli.weights import resolve_model

    loaded = lat.load_latent_autoencoder(resolve_model(opts.model, DEFAULT_MODEL), **opts.load_options())
    files = [lat.read_latents(p, loaded) for p in latents]  # every input is checked before any output
    names = [
        f"{lat.latent_stem(p)}.png" if len(f.latents) == 1 else f"{lat.latent_stem(p)}-{i}.png" for p, f in zip(latents, files) for i in range(len(f.latents))
    ]
    targets = iter(_targets(out, out_dir, names, "decoded images", force))
    opts.report.debug(f"decode: {loaded.path} on {loaded.placement.describe()}")
    with opts.report.progress("decoding", total=len(names)) as advance:
        for p, f in zip(latents, files):
            for i, image in enumerate(lat.decode_latents(loaded, f.latents, tile=tile)):
                t = next(targets)
                t.parent.mkdir(parents=True, exist_ok=True)
                write_png(t, image, {"model": str(loaded.path), "latent": str(p), "index": i}, force=force)
                if opts.json:
                    emit_json({"latent": str(p), "index": i, "image": str(t), "size": [image.shape[1], image.shape[0]]})
                else:
                    opts.report.say(f"wrote {t}")
                advance()
