"""`gencli txt2img`, `gencli img2img` and `gencli replay`: Stable Diffusion from diffusers folders and
single-file checkpoints (the embedded default: txt2img-shapes)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from gencli.cli import app
from gencli.cli.common import RunOptions, command, option, option_group

if TYPE_CHECKING:
    from gencli.pipelines.distributed.runtime import RayOptions

DEFAULT_MODEL = "txt2img-shapes"
_GEN = "Generation"
_IO = "Files"


def _sampler_help() -> str:
    from gencli.schedulers import sampler_names

    return f"Sampler: {', '.join(sampler_names())}, or the names other front ends use ('Euler a', 'DPM++ 2M Karras') (default: the model's)."


def _opt(kind: Any, *names: str, help: str, panel: str = _GEN, show_default: bool = False) -> Any:
    """An option of these commands; short forms come from the one vocabulary (``SHORT_OPTIONS``)."""
    longs = list(names)
    return Annotated[kind, option(*longs, help=help, rich_help_panel=panel, show_default=show_default)]


NegativeOpt = _opt(Optional[str], "--negative-prompt", help="What the image should not show.")
StepsOpt = _opt(Optional[int], "--steps", help="Denoising steps (default: the model's generation_config.json, else 50).")
GuidanceOpt = _opt(
    Optional[float], "--guidance", "--cfg-scale", help="Classifier-free guidance scale; <= 1 turns guidance off (default: the model's, else 7.5)."
)
RescaleOpt = _opt(Optional[float], "--guidance-rescale", help="Guidance rescale in [0, 1] (0 = off).")
SamplerOpt = _opt(Optional[str], "--sampler", help=_sampler_help())
WidthOpt = _opt(Optional[int], "--width", help="Width in pixels, a multiple of 8 up to 4096 (default: the model's).")
HeightOpt = _opt(Optional[int], "--height", help="Height in pixels, a multiple of 8 up to 4096 (default: the model's).")
CountOpt = _opt(Optional[int], "--num-images", help="Images per prompt (seeds S, S+1, ...).")
SeedsOpt = _opt(Optional[str], "--seeds", help="Seeds, e.g. 0-7 or 1,5,9-11: one image per seed and prompt.")
ClipSkipOpt = _opt(
    Optional[int], "--clip-skip",
    help="Condition on a text encoder layer this many before the last (diffusers' count: 1 = penultimate, 'Clip skip: 2' elsewhere).",
)  # fmt: skip
BatchOpt = _opt(int, "--batch-size", help="Images denoised together (1 keeps every image reproducible by replay byte for byte).", show_default=True)
OutOpt = _opt(Optional[str], "--out", help="Output PNG; {i} (index from 0) and {seed} placeholders for many images.", panel=_IO)
ForceOpt = _opt(bool, "--force", help="Overwrite existing files.", panel=_IO, show_default=True)
PromptsFileOpt = _opt(Optional[str], "--prompts-file", help="One prompt per line, or JSON lines with per-prompt settings; - = stdin.", panel=_IO)
VaeOpt = _opt(Optional[str], "--vae", help="Another VAE: a diffusers vae/ folder or a .safetensors file.", panel="Common options")
VariantOpt = _opt(Optional[str], "--variant", help="diffusers weight variant to load, e.g. fp16.", panel="Common options")
StrengthOpt = _opt(float, "--strength", help="How much to change the image, in (0, 1]: the share of the steps run.", show_default=True)
InitImageOpt = _opt(Optional[str], "--init-image", help="The source image of an img2img PNG.", panel=_IO)
MaskOpt = _opt(Optional[str], "--mask", help="Inpaint: an image, white where IMAGE is repainted, black where it is kept.", panel=_IO)
LoraOpt = _opt(
    Optional[list[str]], "--lora", help="A LoRA to merge: FILE or FILE:WEIGHT (repeatable; kohya/A1111 or diffusers format; weight 1 by default).",
    panel="Common options",
)  # fmt: skip
LoraDirOpt = _opt(Optional[str], "--lora-dir", help="Where the prompt's <lora:NAME:WEIGHT> tags are looked up (NAME.safetensors).", panel="Common options")
NoWeightingOpt = _opt(bool, "--no-weighting", help="Read (word:1.2), (word), \\[word] as text, not as A1111's attention weights.", show_default=True)
SpacingOpt = _opt(Optional[str], "--timestep-spacing", help="leading, trailing (SD-Turbo) or linspace, over the model's scheduler config.")
EmbeddingOpt = _opt(
    Optional[list[str]], "--embedding", help="A textual-inversion embedding: FILE or FILE:TOKEN (repeatable; the token is the file's stem).",
    panel="Common options",
)  # fmt: skip
EmbeddingsDirOpt = _opt(Optional[str], "--embeddings-dir", help="Embeddings used by name in the prompt (NAME.safetensors).", panel="Common options")
_CN = "ControlNet"
ControlNetOpt = _opt(
    Optional[str], "--controlnet", help="A ControlNet: a diffusers ControlNetModel folder or an A1111 control_*.safetensors file (with --control-image).",
    panel=_CN,
)  # fmt: skip
ControlImageOpt = _opt(Optional[str], "--control-image", help="The image that guides the ControlNet (edges, depth, pose...; resized to the output).", panel=_CN)
ControlScaleOpt = _opt(Optional[float], "--control-scale", help="How strongly the ControlNet guides, 0 to 10 (default 1).", panel=_CN)
ControlStartOpt = _opt(Optional[float], "--control-start", help="The fraction of the steps before the ControlNet starts (default 0).", panel=_CN)
ControlEndOpt = _opt(Optional[float], "--control-end", help="The fraction of the steps after which it stops (default 1).", panel=_CN)
PromptArg = Annotated[Optional[str], typer.Argument(metavar="PROMPT", help="The prompt ('' = unconditional); - reads it from stdin.", show_default=False)]


@option_group
class DiffusionOptions:
    """The options txt2img and img2img share: what to sample, how, how many, and where it goes."""

    negative_prompt: NegativeOpt = None
    steps: StepsOpt = None
    guidance: GuidanceOpt = None
    guidance_rescale: RescaleOpt = None
    sampler: SamplerOpt = None
    width: WidthOpt = None
    height: HeightOpt = None
    n: CountOpt = None
    seeds: SeedsOpt = None
    clip_skip: ClipSkipOpt = None
    batch_size: BatchOpt = 1
    out: OutOpt = None
    force: ForceOpt = False
    prompts_file: PromptsFileOpt = None
    vae: VaeOpt = None
    variant: VariantOpt = None
    lora: LoraOpt = None
    lora_dir: LoraDirOpt = None
    no_weighting: NoWeightingOpt = False
    timestep_spacing: SpacingOpt = None
    embedding: EmbeddingOpt = None
    embeddings_dir: EmbeddingsDirOpt = None
    controlnet: ControlNetOpt = None
    control_image: ControlImageOpt = None
    control_scale: ControlScaleOpt = None
    control_start: ControlStartOpt = None
    control_end: ControlEndOpt = None

    def control(self):
        """The ControlNet the run asks for (checked; its image read), or None."""
        from gencli.pipelines.diffusion.controlnet import ControlNetSpec, check_control_flags, read_control_image

        check_control_flags(self.controlnet, self.control_image, self.control_scale, self.control_start, self.control_end)
        if self.controlnet is None:
            return None
        read_control_image(self.control_image)  # an unreadable image: one error line before any model loads
        scale, start, end = self.control_scale, self.control_start, self.control_end
        return ControlNetSpec(self.controlnet, self.control_image, 1.0 if scale is None else scale, start or 0.0, 1.0 if end is None else end)

    def flags(self, **more: Any) -> dict[str, Any]:
        """The sampling settings a prompt's JSON line may override (``diffusion_jobs.check_job_flags``), plus ``more``."""
        return dict(steps=self.steps, guidance=self.guidance, guidance_rescale=self.guidance_rescale, sampler=self.sampler, width=self.width,
                    height=self.height, clip_skip=self.clip_skip, **more)  # fmt: skip


@command(app, "txt2img", ray=True)
def txt2img(
    prompt: PromptArg = None,
    *,
    settings: DiffusionOptions,
    opts: RunOptions,
    distributed: Optional[RayOptions],
) -> None:
    """Generate images from a text prompt with Stable Diffusion (SD 1.x, 2.x, SDXL).

    Each PNG carries the settings in a 'parameters' text chunk that other front ends read, and that
    'gencli replay' regenerates the image from. Settings not given as flags come from the model's
    generation_config.json. Examples:

    gencli txt2img "a red star on a blue background" -o star.png

    gencli txt2img "a green circle" --seeds 0-3 -o "circle-{seed}.png" --json

    gencli txt2img -m ./stable-diffusion-v1-5 "a lighthouse at dusk" --steps 25 --sampler "DPM++ 2M Karras" --width 512 --height 512

    gencli txt2img --prompts-file prompts.txt --seed 1 --ray --replicas 4 --out-dir renders/

    gencli txt2img -m ./sd15 "a house by a lake" --controlnet ./control_v11p_sd15_canny.safetensors --control-image edges.png
    """
    _run(opts, prompt, settings, settings.flags(), "txt2img", distributed=distributed)


@command(app, "img2img")
def img2img(
    image: Annotated[str, typer.Argument(metavar="IMAGE", help="The image to start from.", show_default=False)],
    prompt: PromptArg = None,
    strength: StrengthOpt = 0.8,
    mask: MaskOpt = None,
    *,
    settings: DiffusionOptions,
    opts: RunOptions,
) -> None:
    """Change an image following a prompt: encode it, noise it to --strength, denoise.

    The image is resized to --width/--height when given, else kept at its size rounded down to a
    multiple of 8. With --mask only the mask's white part is repainted (inpainting; an inpainting
    checkpoint such as SD 1.5 inpainting, or any other, as diffusers does it; --strength 1 starts from
    pure noise there). Examples:

    gencli img2img star.png "a red heart on a blue background" --strength 0.6 -o heart.png

    gencli img2img photo.png "a wooden bench" --mask bench-mask.png --strength 1 -o bench.png
    """
    _run(opts, prompt, settings, settings.flags(strength=strength), "img2img", image=image, mask=mask)


@command(app, "replay")
def replay(
    image: Annotated[str, typer.Argument(metavar="IMAGE", help="A PNG with a 'parameters' text chunk.", show_default=False)],
    out: OutOpt = None,
    force: ForceOpt = False,
    init_image: InitImageOpt = None,
    mask: MaskOpt = None,
    vae: VaeOpt = None,
    lora: LoraOpt = None,
    lora_dir: LoraDirOpt = None,
    embedding: EmbeddingOpt = None,
    embeddings_dir: EmbeddingsDirOpt = None,
    controlnet: ControlNetOpt = None,
    control_image: ControlImageOpt = None,
    *,
    opts: RunOptions,
) -> None:
    """Make an image again from the settings in its PNG 'parameters' (prompt, seed, steps, sampler, CFG
    scale, size, model). With the same checkpoint on the same machine the PNG is the same, byte for byte.
    A ControlNet image replays with --controlnet and --control-image (its weight and start/end from the PNG).

    The model is the one named in the parameters (an embedded default or a path), or --model; a
    different Model hash is a warning. Example:

    gencli replay star.png -o star-again.png
    """
    from gencli.pipelines.ddpm.replay import replay_request
    from gencli.pipelines.diffusion.lora import replay_loras
    from gencli.pipelines.diffusion.replay import plan_replay

    ddpm = replay_request(image, model=opts.model, seed=opts.seed, out=out, force=force)
    if ddpm is not None:  # a gencli sample ddpm PNG: its pipeline draws it again
        _replay_ddpm(opts, ddpm, {"--init-image": init_image, "--mask": mask, "--vae": vae, "--lora": lora, "--embedding": embedding,
                                  "--controlnet": controlnet})  # fmt: skip
        return
    from gencli.pipelines.diffusion.controlnet import check_control_flags

    check_control_flags(controlnet, control_image, None, None, None)
    plan = plan_replay(image, model=opts.model, seed=opts.seed, init_image=init_image, mask=mask, out=out, force=force, vae=vae, controlnet=controlnet,
                       control_image=control_image)  # fmt: skip
    opts.model, opts.seed = plan.model, None  # the seed is in the settings' --seeds
    extra = plan.params.extra
    settings = DiffusionOptions(
        **plan.settings, lora_dir=lora_dir, embedding=embedding, embeddings_dir=embeddings_dir,
        no_weighting=extra.get("Emphasis") == "None", timestep_spacing=extra.get("Timestep spacing") or None,
    )  # fmt: skip
    loras = replay_loras(extra, [plan.params.prompt, plan.params.negative_prompt], lora or [], lora_dir, allow_pickle=opts.allow_pickle)
    _run(opts, plan.params.prompt, settings, plan.flags, "replay", image=init_image, mask=mask, expect_hash=plan.expect_hash, loras=(loras, extra))


def _replay_ddpm(opts: RunOptions, req: Any, sd_only: dict[str, Any]) -> None:
    from gencli.backend.random import new_seed
    from gencli.cli.render import check_binary_stdout, report_written
    from gencli.errors import UserError
    from gencli.pipelines.ddpm.jobs import run

    given = [flag for flag, value in sd_only.items() if value]
    if given:
        raise UserError(f"{given[0]} is for Stable Diffusion PNGs; this one was drawn by a DDPM pipeline (gencli sample ddpm)")
    check_binary_stdout(opts, req.out)
    for record in run(req, opts.report, opts.load_options(), new_seed=new_seed):
        report_written(opts, record)


def _run(
    opts: RunOptions,
    prompt: Optional[str],
    settings: DiffusionOptions,
    flags: dict[str, Any],
    kind: str,
    *,
    image: Optional[str] = None,
    mask: Optional[str] = None,
    expect_hash: str = "",
    distributed: Optional[RayOptions] = None,
    loras: Optional[tuple[list, dict]] = None,
) -> None:
    from gencli.backend.random import new_seed
    from gencli.cli.render import check_binary_stdout
    from gencli.pipelines.diffusion.jobs import plan_run
    from gencli.weights import resolve_model

    report = opts.report
    out, force, batch_size = settings.out, settings.force, settings.batch_size
    check_binary_stdout(opts, out)
    control = settings.control()
    if distributed is not None:
        out = _ray_out(distributed, settings.prompts_file, out)
    plan = plan_run(
        prompt, settings.prompts_file, kind=kind, flags=flags, negative_prompt=settings.negative_prompt, seed=opts.seed, seeds=settings.seeds,
        n=settings.n, out=out, force=force, batch_size=batch_size, new_seed=new_seed, image=image, mask=mask,
    )  # fmt: skip
    jobs = plan.jobs

    from gencli.pipelines.diffusion.lora import lora_hash_warnings, run_loras
    from gencli.pipelines.diffusion.pipeline import load_pipeline
    from gencli.pipelines.diffusion.textual_inversion import run_embeddings

    prompts = ["\n".join(t for t in (j.prompt, j.negative_prompt) if t) for j in jobs]  # each image's text: its LoRA tags
    lora_specs = loras[0] if loras is not None else run_loras(settings.lora or [], prompts, settings.lora_dir, allow_pickle=opts.allow_pickle)
    embeddings = run_embeddings(settings.embedding or [], settings.embeddings_dir, prompts, allow_pickle=opts.allow_pickle)
    path = resolve_model(opts.model, DEFAULT_MODEL)
    load_kw = {"vae": settings.vae, "variant": settings.variant, **opts.load_options()}
    load_kw.update(loras=lora_specs, prompt_weighting=not settings.no_weighting, timestep_spacing=settings.timestep_spacing, embeddings=embeddings,
                   controlnet=control)  # fmt: skip
    if distributed is not None:
        import functools

        from gencli.cli.render import report_written
        from gencli.pipelines.diffusion.ray import make_images

        load = functools.partial(load_pipeline, path, **load_kw)
        for record in make_images(jobs, load, distributed, report, batch_size=batch_size, force=force, device=opts.device):
            report_written(opts, record)
        return
    with report.progress("loading model"):
        pipe = load_pipeline(path, **load_kw)
    report.debug(pipe.describe())
    for applied in pipe.loras:
        report.debug(applied.describe())
    for line in lora_hash_warnings(loras[1].get("Lora hashes", ""), pipe.loras) if loras is not None else []:
        report.warn(line)
    report.debug(f"loaded in {pipe.load_seconds:.2f}s")
    from gencli.pipelines.diffusion.replay import control_hash_warning, model_hash_warning

    warning = model_hash_warning(expect_hash, path, pipe.model_hash)
    if warning:
        report.warn(warning)
    warning = control_hash_warning(loras[1], pipe.controlnet) if loras is not None else None  # a replay: the PNG's ControlNet hash
    if warning:
        report.warn(warning)
    _generate(opts, pipe, jobs, batch_size, plan.init, plan.mask, force)


def _ray_out(distributed, prompts_file: Optional[str], out: Optional[str]) -> Optional[str]:
    """``--ray`` (``--prompts-file`` only): the output pattern, ``--out-dir DIR`` putting the default
    names in DIR (created here)."""
    from pathlib import Path

    from gencli.errors import UserError
    from gencli.pipelines.distributed.runtime import check_options

    if prompts_file is None:
        raise UserError("--ray needs --prompts-file (one prompt runs in this process)")
    check_options(distributed, out=out)
    if distributed.out_dir is None:
        return out
    Path(distributed.out_dir).mkdir(parents=True, exist_ok=True)
    return str(Path(distributed.out_dir) / "txt2img-{i:03d}-{seed}.png")


def _generate(opts: RunOptions, pipe, jobs, batch_size: int, init, mask, force: bool) -> None:
    from gencli.cli.render import report_written
    from gencli.pipelines.diffusion.jobs import model_calls, run_jobs, write_image

    report = opts.report
    notices_seen: set[str] = set()

    def notice(message: str) -> None:
        if message not in notices_seen:
            notices_seen.add(message)
            report.warn(message)

    def batch_done(group, timing) -> None:
        per = f", {timing.s_per_step:.3f} s/step" if timing.s_per_step else ""
        report.debug(
            f"images {group[0].index}-{group[-1].index}: encode {timing.encode_s:.2f}s, {timing.model_calls} steps in {timing.denoise_s:.2f}s{per}, "
            f"decode {timing.decode_s:.2f}s"
        )

    start = time.perf_counter()
    total = model_calls(pipe, jobs, batch_size) if report.interactive else None
    with report.progress("denoising", total=total) as advance:
        for job, image in run_jobs(pipe, jobs, batch_size=batch_size, init_image=init, mask=mask, on_step=advance, on_notice=notice, on_batch=batch_done):
            report_written(opts, write_image(job, image, pipe, force=force))
    report.debug(f"{len(jobs)} image(s) in {time.perf_counter() - start:.2f}s")
