"""`gencli encode` (images -> latent files) and `gencli decode` (latent files -> images)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, command, option
from gencli.cli.render import check_binary_stdout

DEFAULT_MODEL = "autoencoder-shapes"
TILE_HELP = "Tiled encode/decode, blended across the seams (default: automatic above 1024 pixels)."


@command(app, "encode", seed_help="With --sample: the seed of the posterior sample (default: the posterior mean, no randomness).")
def encode(
    images: Annotated[list[str], typer.Argument(metavar="IMAGE...", help="Image files or directories, or - for paths on stdin.", show_default=False)],
    out: Annotated[Optional[str], option("--out", help="The latent file, e.g. NAME.latent.safetensors (one input only); - = stdout.")] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out-dir", help="Folder for NAME.latent.safetensors per input (default: the current folder).")] = None,
    sample: Annotated[bool, typer.Option("--sample", help="Draw from the posterior (seeded by --seed) instead of taking its mean.")] = False,
    tile: Annotated[Optional[bool], typer.Option("--tile/--no-tile", help=TILE_HELP)] = None,
    force: Annotated[bool, option("--force", help="Overwrite existing outputs.")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Encode images into AutoencoderKL latents (default model: the embedded autoencoder-shapes; or any diffusers AutoencoderKL folder or SD VAE file).

    One latent .safetensors file per image (unscaled latents under 'latent_tensor', the layout of ComfyUI's .latent files). Images whose size is
    not a multiple of the model's downsampling factor are resized, with a notice. With --json: one line per file {"image", "latent", "shape",
    "resized"}.
    """
    from gencli.backend.random import new_seed
    from gencli.backend.seeds import check_seed
    from gencli.console import emit_json
    from gencli.io import make_output_dir, plan_files
    from gencli.pipelines.diffusion import latents as lat
    from gencli.pipelines.generative.reconstruct import check_readable
    from gencli.pipelines.vision.images import image_paths
    from gencli.weights import resolve_model

    check_binary_stdout(opts, out, what="the latent file")
    if out is not None:
        lat.check_latent_name(out)
    paths = image_paths(images)
    targets = plan_files([Path(p).stem + ".latent.safetensors" for p in paths], out=out, out_dir=out_dir, what="images", force=force)
    seed = (opts.seed if opts.seed is not None else new_seed()) if sample else None
    if seed is not None:
        check_seed(seed + len(paths) - 1, f"--seed {seed} for {len(paths)} image(s): seed")
    check_readable(paths)  # every input before any output: nothing half-written
    loaded = lat.load_latent_autoencoder(resolve_model(opts.model, DEFAULT_MODEL), **opts.load_options())
    opts.report.debug(f"encode: {loaded.path} on {loaded.placement.describe()}")
    with opts.report.progress("encoding", total=len(paths)) as advance:
        for i, (p, t) in enumerate(zip(paths, targets)):
            enc = lat.encode_file(loaded, p, tile=tile, seed=None if seed is None else seed + i)
            if enc.resized:
                opts.report.warn(f"{p}: resized from {enc.resized[0]}x{enc.resized[1]} to {enc.size[0]}x{enc.size[1]} for the model")
            posterior = {"posterior": "mean"} if seed is None else {"posterior": "sample", "seed": seed + i}
            meta = {"model": str(loaded.path), "source": p, "width": enc.size[0], "height": enc.size[1], **posterior}
            if out_dir is not None:
                make_output_dir(Path(out_dir))
            lat.write_latents(t, enc.latents, meta, force=force)
            if opts.json:
                emit_json({"image": p, "latent": str(t), "shape": list(enc.latents.shape), "resized": bool(enc.resized), **posterior})
            else:
                opts.report.log(f"wrote {t} ({'x'.join(str(d) for d in enc.latents.shape[1:])} latents)")
            advance()


@command(app, "decode", seed_help=DETERMINISTIC_SEED_HELP)
def decode(
    latents: Annotated[
        list[str],
        typer.Argument(
            metavar="LATENT...", help="Latent .safetensors files (from gencli encode, or ComfyUI .latent files); - reads one from stdin.", show_default=False
        ),
    ],
    out: Annotated[Optional[str], option("--out", help="The image (one latent only; PNG unless the name says .jpg, .webp ...); - = stdout.")] = None,
    out_dir: Annotated[
        Optional[str], typer.Option("--out-dir", help="Folder for NAME.png per latent, NAME-I.png for a batch (default: the current folder).")
    ] = None,
    tile: Annotated[Optional[bool], typer.Option("--tile/--no-tile", help=TILE_HELP)] = None,
    force: Annotated[bool, option("--force", help="Overwrite existing outputs.")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Decode latent files into PNGs with an AutoencoderKL (default: the embedded autoencoder-shapes; use the model the latents came from).

    With --json: one line per image {"latent", "index", "image", "size"}.
    """
    from gencli.console import emit_json
    from gencli.io import make_output_dir, plan_files
    from gencli.pipelines.diffusion import latents as lat
    from gencli.pipelines.generative.outputs import write_png
    from gencli.pipelines.vision.images import image_format
    from gencli.weights import resolve_model

    check_binary_stdout(opts, out)
    if out is not None:
        image_format(out)
    loaded = lat.load_latent_autoencoder(resolve_model(opts.model, DEFAULT_MODEL), **opts.load_options())
    files = [lat.read_latents(p, loaded, tile=tile) for p in latents]  # every input is checked before any output
    names = [
        f"{lat.latent_stem(p)}.png" if len(f.latents) == 1 else f"{lat.latent_stem(p)}-{i}.png" for p, f in zip(latents, files) for i in range(len(f.latents))
    ]
    targets = iter(plan_files(names, out=out, out_dir=out_dir, what="decoded images", force=force))
    opts.report.debug(f"decode: {loaded.path} on {loaded.placement.describe()}")
    with opts.report.progress("decoding", total=len(names)) as advance:
        for p, f in zip(latents, files):
            for i, image in enumerate(lat.decode_latents(loaded, f.latents, tile=tile)):
                t = next(targets)
                if out_dir is not None:
                    make_output_dir(Path(out_dir))
                write_png(t, image, {"model": str(loaded.path), "latent": str(p), "index": i}, force=force)
                if opts.json:
                    emit_json({"latent": str(p), "index": i, "image": str(t), "size": [image.shape[1], image.shape[0]]})
                else:
                    opts.report.log(f"wrote {t}")
                advance()
