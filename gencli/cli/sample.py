"""`gencli sample vae|gan` and `gencli reconstruct`."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import RunOptions, command


class Family(str, enum.Enum):
    vae = "vae"
    gan = "gan"
    ddpm = "ddpm"


DEFAULTS = {"vae": "vae-shapes", "gan": "gan-shapes"}


@command(app, "sample")
def sample(
    family: Annotated[Family, typer.Argument(help="vae, gan, or ddpm (a diffusers DDPM/DDIM pipeline folder given with --model).", show_default=False)],
    n: Annotated[int, typer.Option("-n", "--num", help="Samples (seeds --seed, --seed+1, ...).")] = 16,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="Exact seeds, e.g. 0-15,40 (each seed always the same image).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="The grid PNG (or GIF with --gif). Default: samples.png / samples.gif.")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out-dir", help="Write one PNG per sample into this folder instead of a grid.")] = None,
    nrow: Annotated[Optional[int], typer.Option("--nrow", min=1, help="Images per grid row (default: about the square root).")] = None,
    interpolate: Annotated[
        Optional[int], typer.Option("--interpolate", min=2, help="Walk STEPS latents from the first seed to the second (spherical interpolation).")
    ] = None,
    gif: Annotated[bool, typer.Option("--gif", help="With --interpolate: an animated GIF instead of a grid.")] = False,
    truncation: Annotated[
        float, typer.Option("--truncation", help="GAN: pull latents towards the mean by PSI (0 < PSI <= 1: less diverse, more typical).")
    ] = 1.0,
    temperature: Annotated[float, typer.Option("--temperature", help="VAE: scale of the prior's latents (below 1: smoother, more average samples).")] = 1.0,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite existing outputs.")] = False,
    steps: Annotated[Optional[int], typer.Option("--steps", help="DDPM: denoising steps (default: 1000 for ddpm, 50 for ddim).")] = None,
    sampler: Annotated[Optional[str], typer.Option("--sampler", help="DDPM: ddpm, ddim or another gencli sampler (default: the model's).")] = None,
    eta: Annotated[Optional[float], typer.Option("--eta", help="DDPM with --sampler ddim: noise in [0, 1] (0 deterministic, 1 DDPM-like).")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="DDPM: images denoised together (1 keeps every seed's bytes fixed).")] = None,
    class_label: Annotated[Optional[int], typer.Option("--class-label", help="DDPM: the class of a class-conditional model.")] = None,
    *,
    opts: RunOptions,
) -> None:
    """Sample images from a VAE or a GAN (default: the embedded shapes models) into a grid, one PNG
    per sample, or a latent walk; or from a pixel-space DDPM/DDIM pipeline folder (ddpm, -o may hold
    {i} and {seed}). With --json: one line per written file with its seed(s)."""
    from gencli.backend.random import new_seed
    from gencli.console import emit_json
    from gencli.errors import UserError
    from gencli.io import ensure_writable
    from gencli.pipelines.generative import loading, outputs, sampling
    from gencli.weights import resolve_model

    fam = family.value
    if fam == "ddpm":
        from gencli.pipelines.ddpm.jobs import DDPMRequest, run

        other = {"--interpolate": interpolate is not None, "--gif": gif, "--truncation": truncation != 1.0, "--temperature": temperature != 1.0}
        req = DDPMRequest(opts.model, n, seeds, opts.seed, None if out is None else str(out), None if out_dir is None else str(out_dir), nrow, steps,
                          sampler, eta, batch_size, class_label, force, other)  # fmt: skip
        for record in run(req, opts.report, opts.load_options(), new_seed=new_seed):
            if opts.json:
                emit_json(record)
            else:
                opts.report.say(f"wrote {record['file']}")
        return
    ddpm_only = {"--steps": steps, "--sampler": sampler, "--eta": eta, "--batch-size": batch_size, "--class-label": class_label}
    given = [flag for flag, value in ddpm_only.items() if value is not None]
    if given:
        raise UserError(f"{given[0]} is for sample ddpm, not {fam}")
    if not 1 <= n <= sampling.MAX_SAMPLES:
        raise UserError(f"-n must be between 1 and {sampling.MAX_SAMPLES}, got {n}")
    if fam == "gan" and not 0.0 < truncation <= 1.0:
        raise UserError(f"--truncation must lie in (0, 1], got {truncation}")
    if fam == "vae" and not temperature > 0.0:
        raise UserError(f"--temperature must be positive, got {temperature}")
    if fam == "vae" and truncation != 1.0:
        raise UserError("--truncation is for GANs; a VAE's prior is scaled with --temperature")
    if fam == "gan" and temperature != 1.0:
        raise UserError("--temperature is for VAEs; a GAN's latents are pulled in with --truncation")
    if out is not None and out_dir is not None:
        raise UserError("give --out (a grid) or --out-dir (one PNG per sample), not both")
    if gif and interpolate is None:
        raise UserError("--gif writes a latent walk: give --interpolate STEPS")
    if gif and out_dir is not None:
        raise UserError("--gif writes one file: use --out, not --out-dir")
    base = opts.seed if opts.seed is not None else new_seed()
    chosen = sampling.parse_seeds(seeds) if seeds is not None else list(range(base, base + n))
    if interpolate is not None:
        if len(chosen) != 2:
            if seeds is not None:
                raise UserError(f"--interpolate walks between two seeds: --seeds gave {len(chosen)}")
            chosen = [base, base + 1]
        if interpolate > sampling.MAX_SAMPLES:
            raise UserError(f"--interpolate must be at most {sampling.MAX_SAMPLES}")

    # every output is checked before the model loads: nothing half-written, no wasted work
    if out_dir is not None:
        if interpolate is not None:
            names = [f"{fam}-walk-{chosen[0]}-{chosen[1]}-{i:03d}.png" for i in range(interpolate)]
        else:
            names = [f"{fam}-seed{s}.png" for s in chosen]
        targets = [out_dir / name for name in names]
        if out_dir.exists() and not out_dir.is_dir():
            raise UserError(f"--out-dir '{out_dir}' is not a directory")
        for t in targets:
            if t.exists() and not force:
                raise UserError(f"output '{t}' already exists (use --force to overwrite)")
    else:
        target = out or Path("samples.gif" if gif else "samples.png")
        ensure_writable(target, force)

    loaded = loading.open_generative(resolve_model(opts.model, DEFAULTS[fam]), fam, **opts.load_options())
    opts.report.debug(f"sample: {loaded.path} on {loaded.placement.describe()}")
    dim = loaded.latent_dim
    if interpolate is not None:
        latents = sampling.interpolation_latents(chosen[0], chosen[1], interpolate, dim)
    else:
        latents = sampling.seed_latents(chosen, dim)
    settings = {"model": str(loaded.path), "family": fam}
    settings.update({"temperature": temperature} if fam == "vae" else {"truncation": truncation})
    with opts.report.progress(f"sampling {fam}", total=len(latents)) as advance:
        images = sampling.generate(loaded, latents, temperature=temperature, truncation=truncation, on_batch=advance)

    written: list[tuple[Path, dict]] = []
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for i, (t, im) in enumerate(zip(targets, images)):
            if interpolate is not None:
                record = {"seeds": chosen, "t": round(i / (interpolate - 1), 6)}
            else:
                record = {"seed": chosen[i]}
            outputs.write_png(t, im, {**settings, **record}, force=force)
            written.append((t, record))
    elif gif:
        record = {"seeds": chosen, "steps": interpolate}
        outputs.write_gif(target, images, {**settings, **record}, force=force)
        written.append((target, record))
    else:
        record = {"seeds": chosen} if interpolate is None else {"seeds": chosen, "steps": interpolate}
        cols = nrow or (interpolate or max(1, round(len(images) ** 0.5)))
        outputs.write_png(target, outputs.image_grid(images, cols), {**settings, **record, "nrow": cols}, force=force)
        written.append((target, record))
    for path, record in written:
        if opts.json:
            emit_json({"file": str(path), **record})
        else:
            opts.report.say(f"wrote {path}")


@command(app, "reconstruct")
def reconstruct(
    images: Annotated[list[str], typer.Argument(metavar="IMAGE...", help="Image files or directories, or - for paths on stdin.", show_default=False)],
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Folder for the reconstructions (one PNG per input, named after it).")],
    tile: Annotated[Optional[bool], typer.Option("--tile/--no-tile", help="AutoencoderKL: tiled encode/decode (default: automatic above 1024 pixels).")] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite existing outputs.")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Round-trip images through a VAE (default: the embedded shapes VAE; or any diffusers
    AutoencoderKL folder or SD VAE file) with the posterior mean, and report PSNR and SSIM per image.
    With --json: one line per image {"image", "output", "psnr", "ssim", "resized"}."""
    from gencli.console import emit_json, print_table
    from gencli.errors import UserError
    from gencli.pipelines.generative import reconstruct as reconstruction
    from gencli.pipelines.vision.images import image_paths
    from gencli.weights import resolve_model

    paths = image_paths(images)
    targets = [out_dir / (Path(p).stem + ".png") for p in paths]
    seen: dict[Path, str] = {}
    for p, t in zip(paths, targets):
        if t in seen:
            raise UserError(f"'{p}' and '{seen[t]}' would both be written to '{t}': rename one")
        seen[t] = p
        if t.exists() and not force:
            raise UserError(f"output '{t}' already exists (use --force to overwrite)")
    model = reconstruction.load_any_vae(resolve_model(opts.model, DEFAULTS["vae"]), **opts.load_options())
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with opts.report.progress("reconstructing", total=len(paths)) as advance:
        for p, t in zip(paths, targets):
            result = reconstruction.reconstruct_file(model, p, t, tile=tile, force=force)
            if result.resized:
                opts.report.warn(f"{p}: resized from {result.resized[0]}x{result.resized[1]} to {result.size[0]}x{result.size[1]} for the model")
            record = {"image": p, "output": str(t), "psnr": round(result.psnr, 3), "ssim": round(result.ssim, 4), "resized": bool(result.resized)}
            if opts.json:
                emit_json(record)
            rows.append(record)
            advance()
    if not opts.json:
        from rich.table import Table

        table = Table("image", "output", "PSNR (dB)", "SSIM")
        for r in rows:
            table.add_row(r["image"], r["output"], f"{r['psnr']:.2f}", f"{r['ssim']:.4f}")
        print_table(table)
