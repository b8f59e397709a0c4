"""`gencli sample vae|gan` and `gencli reconstruct`."""

from __future__ import annotations

import enum
from typing import Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import RunOptions, command
from gencli.cli.render import check_binary_stdout, report_written


class Family(str, enum.Enum):
    vae = "vae"
    gan = "gan"
    ddpm = "ddpm"


DEFAULTS = {"vae": "vae-shapes", "gan": "gan-shapes"}


@command(app, "sample")
def sample(
    family: Annotated[Family, typer.Argument(help="vae, gan, or ddpm (a diffusers DDPM/DDIM pipeline folder given with --model).", show_default=False)],
    n: Annotated[Optional[int], typer.Option("-n", "--num", help="Samples: seeds --seed, --seed+1, ... (default 16).", show_default=False)] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="Exact seeds, e.g. 0-15,40 (each seed always the same image).")] = None,
    out: Annotated[
        Optional[str], typer.Option("--out", "-o", help="The grid image (or a .gif with --gif); - = stdout. Default: samples.png / samples.gif.")
    ] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out-dir", help="Write one PNG per sample into this folder instead of a grid.")] = None,
    nrow: Annotated[Optional[int], typer.Option("--nrow", min=1, help="Images per grid row (default: about the square root).")] = None,
    interpolate: Annotated[
        Optional[int], typer.Option("--interpolate", min=2, help="Walk STEPS latents from the first seed to the second (spherical interpolation).")
    ] = None,
    gif: Annotated[bool, typer.Option("--gif", help="With --interpolate: an animated GIF instead of a grid.")] = False,
    truncation: Annotated[
        float, typer.Option("--truncation", help="GAN: pull latents towards the mean by PSI (0 < PSI <= 1: less diverse, more typical).")
    ] = 1.0,
    temperature: Annotated[float, typer.Option("--temperature", help="VAE: scale of the prior's latents (below 1: smoother, more average samples).")] = 1.0,
    steps: Annotated[Optional[int], typer.Option("--steps", help="DDPM: denoising steps (default: generation_config.json, else 1000 ddpm / 50 ddim).")] = None,
    sampler: Annotated[Optional[str], typer.Option("--sampler", "-s", help="DDPM: ddpm, ddim or another sampler (default: generation_config.json).")] = None,
    eta: Annotated[Optional[float], typer.Option("--eta", help="DDPM with --sampler ddim: noise in [0, 1] (0 deterministic, 1 DDPM-like).")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", "-b", help="DDPM: images denoised together (1 keeps every seed's bytes fixed).")] = None,
    class_label: Annotated[Optional[int], typer.Option("--class-label", help="DDPM: the class of a class-conditional model.")] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite existing outputs.")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Sample images from a VAE or a GAN (default: the embedded shapes models) into a grid, one PNG per sample, or a latent walk.

    ddpm: a pixel-space DDPM/DDIM pipeline folder (--model); -o may hold {i} and {seed}.

    With --json: one line per written file with its seed(s).
    """
    from gencli.backend.random import new_seed
    from gencli.pipelines.generative import loading, sampling
    from gencli.pipelines.generative.outputs import check_gif_name
    from gencli.pipelines.generative.plan import plan_samples, write_samples
    from gencli.weights import resolve_model

    fam = family.value
    check_binary_stdout(opts, out)
    if fam == "ddpm":
        from gencli.pipelines.ddpm.jobs import DDPMRequest, run

        other = {"--interpolate": interpolate is not None, "--gif": gif, "--truncation": truncation != 1.0, "--temperature": temperature != 1.0}
        req = DDPMRequest(
            model=opts.model, n=n, seeds=seeds, seed=opts.seed, out=out, out_dir=out_dir, nrow=nrow, steps=steps, sampler=sampler, eta=eta,
            batch_size=batch_size, class_label=class_label, force=force, other_flags=other,
        )  # fmt: skip
        for record in run(req, opts.report, opts.load_options(), new_seed=new_seed):
            report_written(opts, record)
        return
    ddpm_only = {"--steps": steps, "--sampler": sampler, "--eta": eta, "--batch-size": batch_size, "--class-label": class_label}
    given = [flag for flag, value in ddpm_only.items() if value is not None]
    if given:
        from gencli.errors import UserError

        raise UserError(f"{given[0]} is for sample ddpm, not {fam}")
    plan = plan_samples(
        fam, n=n, seeds=seeds, seed=opts.seed, out=out, out_dir=out_dir, nrow=nrow, interpolate=interpolate, gif=gif, truncation=truncation,
        temperature=temperature, force=force, new_seed=new_seed,
    )  # fmt: skip
    if plan.kind == "gif":
        check_gif_name(plan.targets[0])
    loaded = loading.open_generative(resolve_model(opts.model, DEFAULTS[fam]), fam, **opts.load_options())
    opts.report.debug(f"sample: {loaded.path} on {loaded.placement.describe()}")
    if interpolate is not None:
        latents = sampling.interpolation_latents(plan.seeds[0], plan.seeds[1], interpolate, loaded.latent_dim)
    else:
        latents = sampling.seed_latents(plan.seeds, loaded.latent_dim)
    with opts.report.progress(f"sampling {fam}", total=len(latents)) as advance:
        images = sampling.generate(loaded, latents, temperature=temperature, truncation=truncation, on_batch=advance)
    for record in write_samples(plan, images, str(loaded.path), force=force):
        report_written(opts, record)


@command(app, "reconstruct")
def reconstruct(
    images: Annotated[list[str], typer.Argument(metavar="IMAGE...", help="Image files or directories, or - for paths on stdin.", show_default=False)],
    out_dir: Annotated[str, typer.Option("--out-dir", help="Folder for the reconstructions (one PNG per input, named after it).")],
    tile: Annotated[Optional[bool], typer.Option("--tile/--no-tile", help="AutoencoderKL: tiled encode/decode (default: automatic above 1024 pixels).")] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite existing outputs.")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Round-trip images through a VAE (default: the embedded shapes VAE; or any diffusers AutoencoderKL folder or SD VAE file) with the posterior mean.

    Reports PSNR and SSIM per image: a table, or with --json one line per image {"image", "output", "psnr", "ssim", "resized"}, on stdout or
    into --out.
    """
    from gencli.console import emit_json, print_table
    from gencli.errors import UserError
    from gencli.pipelines.generative import reconstruct as reconstruction
    from gencli.pipelines.generative.loading import LoadedGenerative
    from gencli.pipelines.vision.images import image_paths
    from gencli.weights import resolve_model

    paths = image_paths(images)
    folder, targets = reconstruction.plan_reconstructions(paths, out_dir, force=force)
    reconstruction.check_readable(paths)
    model = reconstruction.load_any_vae(resolve_model(opts.model, DEFAULTS["vae"]), **opts.load_options())
    if tile is not None and isinstance(model, LoadedGenerative):
        raise UserError(f"--tile/--no-tile applies to AutoencoderKL models; '{model.path}' is a ConvVAE, which takes the whole image at its size")
    rows = []
    with opts.results() as results, opts.report.progress("reconstructing", total=len(paths)) as advance:
        for p, t in zip(paths, targets):
            result = reconstruction.reconstruct_file(model, p, t, tile=tile, force=force)
            if result.resized:
                opts.report.warn(f"{p}: resized from {result.resized[0]}x{result.resized[1]} to {result.size[0]}x{result.size[1]} for the model")
            record = {"image": p, "output": str(t), "psnr": round(result.psnr, 3), "ssim": round(result.ssim, 4), "resized": bool(result.resized)}
            if opts.json:
                emit_json(record, results)
            rows.append(record)
            advance()
        if not opts.json:
            print_table(reconstruction.results_table(rows), results)
    opts.report.debug(f"{len(rows)} reconstruction(s) in {folder}")
