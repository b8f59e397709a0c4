"""Stable Diffusion text-to-image and image-to-image: load a pipeline, then denoise.

:func:`load_pipeline` accepts what people download:

- a diffusers pipeline folder (``model_index.json``, ``unet/``, ``vae/``, ``text_encoder/``,
  ``tokenizer/``, SDXL's ``text_encoder_2/`` and ``tokenizer_2/``, ``scheduler/``; ``variant``
  weights such as ``diffusion_pytorch_model.fp16.safetensors``), with an optional
  ``generation_config.json`` at its root whose ``num_inference_steps``, ``guidance_scale``,
  ``guidance_rescale``, ``sampler`` (a gencli sampler name), ``width`` and ``height`` are the
  defaults of a run;
- a single-file SD 1.x / 2.x / SDXL checkpoint in the original layout: the UNet, text encoders and
  VAE are read from their key prefixes, configured from their tensor shapes and the standard configs
  shipped with gencli, and sampled with the family's standard scheduler config (below);
- ``vae=``: another VAE (a diffusers ``vae/`` folder, a file with its ``config.json``, or an
  original-layout VAE file), as people swap in fine-tuned VAEs.

:func:`generate` runs one batch, each row with its own prompt, negative prompt and seed, exactly as
diffusers' ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline`` (and their img2img twins)
do: one CPU ``torch.Generator`` per image seeded with its seed; the initial latents ``(B, C, H/f,
W/f)`` (``f = 2 ** (len(vae block_out_channels) - 1)``) drawn from them and multiplied by the
sampler's initial sigma; classifier-free guidance in one batched pass over the unconditional and
conditional rows (skipped for guidance <= 1), with ``guidance_rescale``; the ancestral samplers' noise
drawn from the same generators; the VAE decode of ``latents / scaling_factor``. In float32 the image
is diffusers' to within rounding. In reduced precision the latents stay float32 between steps (the
UNet runs in the chosen dtype), which is more accurate than diffusers' reduced-precision latents.

NaN or Inf is never saved as a black image: a non-finite UNet output stops the run with an error;
a non-finite VAE decode in reduced precision (the SD VAE overflows in float16) is redone in float32
with a notice, and an image that is still not finite is an error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from gencli.backend.device import DTYPE_NAMES, Placement, choose_placement
from gencli.backend.random import randn_tensor
from gencli.checkpoints.formats import CheckpointSource, detect_architecture, open_source, wrong_family
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError, UserError
from gencli.io import read_json
from gencli.models.unet.single_file import UNET_PREFIX, prediction_type_hint, unet_family
from gencli.models.unet.unet_2d_condition import UNet2DConditionModel
from gencli.pipelines.diffusion.controlnet import ControlNetSpec, LoadedControlNet, load_controlnet
from gencli.pipelines.diffusion.lora import AppliedLora, LoraSpec, apply_loras, lora_hashes_text, strip_lora_tags
from gencli.pipelines.diffusion.png_parameters import ImageParameters, files_hash
from gencli.pipelines.diffusion.prompt_encoding import PromptEmbeddings, PromptEncoder, prompt_encoder_from_pipeline_folder, prompt_encoder_from_single_file
from gencli.pipelines.diffusion.textual_inversion import EmbeddingSpec, LoadedEmbedding, apply_embeddings, expand_prompt, ti_hashes_text
from gencli.pipelines.diffusion.unet_loading import load_unet_from_folder, load_unet_from_reader
from gencli.pipelines.diffusion.vae import LoadedAutoencoder, images_to_tensor, load_autoencoder, tensor_to_images
from gencli.schedulers import get_scheduler, resolve_sampler
from gencli.schedulers.base import Scheduler, load_scheduler_config

GENERATION_CONFIG = "generation_config.json"
REQUIRED_COMPONENTS = ("unet", "vae", "scheduler")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")  # diffusers' timestep_spacing values
MAX_SIDE = 4096  # the largest width or height accepted (pixels)
MAX_GUIDANCE = 100.0  # ComfyUI's bound too; far beyond it the guided noise overflows and the VAE decodes no image
SIZE_MULTIPLE = 8

# diffusers' defaults where neither a flag nor generation_config.json says otherwise
DEFAULT_STEPS = 50
DEFAULT_GUIDANCE = 7.5
DEFAULT_GUIDANCE_SDXL = 5.0
DEFAULT_STRENGTH = 0.8

# The scheduler configs of the standard checkpoints (a single file carries none): the reference
# repositories' scheduler/scheduler_config.json (SD 1.5, SD 2.1 base / 768-v, SDXL base 1.0).
_SD_BETAS = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "trained_betas": None}
STANDARD_SCHEDULER_CONFIGS: dict[str, dict[str, Any]] = {
    "sd1": {"_class_name": "PNDMScheduler", **_SD_BETAS, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
            "clip_sample": False, "prediction_type": "epsilon"},
    "sd2": {"_class_name": "PNDMScheduler", **_SD_BETAS, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
            "clip_sample": False, "prediction_type": "epsilon"},
    "sd2-v": {"_class_name": "DDIMScheduler", **_SD_BETAS, "set_alpha_to_one": False, "steps_offset": 1, "clip_sample": False,
              "prediction_type": "v_prediction"},
    "sdxl": {"_class_name": "EulerDiscreteScheduler", **_SD_BETAS, "steps_offset": 1, "timestep_spacing": "leading",
             "interpolation_type": "linear", "use_karras_sigmas": False, "prediction_type": "epsilon", "sample_max_value": 1.0},
}  # fmt: skip


# -- the loaded pipeline ------------------------------------------------------------------------------
@dataclass
class StableDiffusion:
    """A loaded Stable Diffusion pipeline (SD 1.x, 2.x or SDXL)."""

    unet: UNet2DConditionModel
    vae: LoadedAutoencoder
    prompt_encoder: PromptEncoder
    scheduler_config: dict[str, Any]
    placement: Placement
    path: Path
    layout: str  # "diffusers" or "single-file"
    weight_files: list[Path]  # what the model hash covers (the VAE override aside)
    generation_config: dict[str, Any] = field(default_factory=dict)
    vae_override: Optional[Path] = None
    load_seconds: float = 0.0
    loras: list[AppliedLora] = field(default_factory=list)  # merged into the weights at load
    prompt_weighting: bool = True  # A1111's (word:1.2) syntax (long prompts are chunked either way)
    timestep_spacing: Optional[str] = None  # set over the scheduler config's by --timestep-spacing
    embeddings: list[LoadedEmbedding] = field(default_factory=list)  # textual inversion
    controlnet: Optional[LoadedControlNet] = None  # with its conditioning image (gencli.pipelines.diffusion.controlnet)
    _hashes: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def is_sdxl(self) -> bool:
        return self.unet.config.addition_embed_type == "text_time"

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent pixel along a side: ``2 ** (len(vae block_out_channels) - 1)``."""
        return 2 ** (len(self.vae.model.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return self.vae.model.config.latent_channels

    @property
    def is_inpainting(self) -> bool:
        """An inpainting UNet (SD 1.5/2 inpainting): it takes the noisy latents, the mask and the
        masked image's latents stacked (4 + 1 + 4 channels)."""
        return self.unet.config.in_channels == 2 * self.latent_channels + 1

    @property
    def default_size(self) -> tuple[int, int]:
        """``(width, height)``: ``generation_config.json``'s, else the UNet's sample size in pixels."""
        side = int(self.unet.config.sample_size if not isinstance(self.unet.config.sample_size, (list, tuple)) else self.unet.config.sample_size[0])
        native = side * self.vae_scale_factor
        return int(self.generation_config.get("width", native)), int(self.generation_config.get("height", native))

    @property
    def name(self) -> str:
        """The model's name in the image parameters: the folder's name or the file's stem."""
        return self.path.stem if self.path.is_file() else self.path.resolve().name

    @property
    def model_hash(self) -> str:
        """SHA-256 (10 hex digits) of the checkpoint file, or of a folder's weight files in order."""
        if "model" not in self._hashes:
            self._hashes["model"] = files_hash(self.weight_files)
        return self._hashes["model"]

    @property
    def vae_hash(self) -> str:
        if self.vae_override is None:
            return ""
        if "vae" not in self._hashes:
            src = self.vae_override
            files = [src] if src.is_file() else sorted(src.rglob("*.safetensors"))
            self._hashes["vae"] = files_hash(files)
        return self._hashes["vae"]

    def describe(self) -> str:
        family = "SDXL" if self.is_sdxl else f"SD ({self.prompt_encoder.hidden_size}-wide text conditioning)"
        n = sum(p.numel() for p in self.unet.parameters())
        return (
            f"{family} {self.layout} pipeline '{self.path}': UNet {n / 1e6:.1f}M parameters, VAE factor {self.vae_scale_factor}, "
            f"{self.placement.describe()}, VAE dtype {DTYPE_NAMES.get(self.vae.placement.dtype, self.vae.placement.dtype)}, "
            f"attention: {attention_path(self.placement.device)}"
        )


def attention_path(device: torch.device) -> str:
    """Which kernel the attention entry point reaches on ``device`` (for --verbose)."""
    if device.type == "cuda":
        b = torch.backends.cuda
        kernels = [n for n, on in (("flash", b.flash_sdp_enabled()), ("memory-efficient", b.mem_efficient_sdp_enabled())) if on]
        return f"torch scaled_dot_product_attention ({', '.join(kernels) or 'math'} kernels)"
    return f"torch scaled_dot_product_attention on {device.type}"


def _missing_component_error(src: CheckpointSource) -> None:
    index = src.config or {}
    assert src.folder is not None
    if index.get("_class_name") in ("DDPMPipeline", "DDIMPipeline"):  # a pixel-space pipeline: another command runs it
        from gencli.checkpoints.formats import wrong_family

        raise wrong_family(src, "a Stable Diffusion pipeline")
    for name in (*REQUIRED_COMPONENTS, "text_encoder"):
        listed = isinstance(index.get(name), (list, tuple)) and index[name][0] is not None
        if name == "text_encoder" and not listed and "text_encoder_2" in index:
            continue
        if not listed:
            raise CheckpointError(f"'{src.path}' is a diffusers pipeline without a '{name}' component (model_index.json lists none)")
        if not (src.folder / name).is_dir():
            raise CheckpointError(f"'{src.path}' is missing its '{name}' component folder")


def _check_fit(unet: UNet2DConditionModel, vae: LoadedAutoencoder, encoder: PromptEncoder, where: Path) -> None:
    cfg = unet.config
    if cfg.context_dim != encoder.hidden_size:
        raise CheckpointError(f"'{where}': the UNet attends to {cfg.context_dim}-wide text states, the text encoder(s) give {encoder.hidden_size}")
    latent = vae.model.config.latent_channels
    if cfg.out_channels != latent or cfg.in_channels not in (latent, 2 * latent + 1):
        raise CheckpointError(
            f"'{where}': the VAE has {latent} latent channels, the UNet takes {cfg.in_channels} and gives {cfg.out_channels}"
            f" (supported: {latent} in and out, or an inpainting UNet's {2 * latent + 1} in)"
        )
    if cfg.addition_embed_type == "text_time":
        if encoder.pooled_size is None:
            raise CheckpointError(f"'{where}': an SDXL UNet needs the pooled output of a second text encoder (text_encoder_2)")
        want = int(cfg.projection_class_embeddings_input_dim) - 6 * int(cfg.addition_time_embed_dim)
        if want != encoder.pooled_size:
            raise CheckpointError(
                f"'{where}': the UNet's added embedding takes {cfg.projection_class_embeddings_input_dim} inputs, which does not fit "
                f"{encoder.pooled_size} pooled text features + 6 time ids (an SDXL refiner is not supported)"
            )
    elif cfg.addition_embed_type is not None:
        raise CheckpointError(f"'{where}': the UNet's addition_embed_type={cfg.addition_embed_type!r} is not supported")


def load_pipeline(
    path: str | Path,
    *,
    vae: str | Path | None = None,
    variant: Optional[str] = None,
    device: str = "auto",
    dtype: str = "auto",
    threads: Optional[int] = None,
    allow_pickle: bool = False,
    loras: Sequence[LoraSpec] = (),
    prompt_weighting: bool = True,
    timestep_spacing: Optional[str] = None,
    embeddings: Sequence[EmbeddingSpec] = (),
    controlnet: Optional[ControlNetSpec] = None,
) -> StableDiffusion:
    """A Stable Diffusion pipeline from a diffusers folder or a single-file checkpoint (see the module
    doc), with ``loras`` merged into its weights (:mod:`gencli.pipelines.diffusion.lora`) and a
    ``controlnet`` beside its UNet (:mod:`gencli.pipelines.diffusion.controlnet`)."""
    start = time.perf_counter()
    src = open_source(path, allow_pickle=allow_pickle, variant=variant)
    placement = choose_placement(device, dtype, "transformer", threads)
    vae_path = Path(vae).expanduser() if vae is not None else None
    if vae_path is not None and not vae_path.exists():
        raise UserError(f"--vae '{vae_path}' does not exist")
    if src.kind == "diffusers-pipeline":
        _missing_component_error(src)
        folder = src.folder
        unet = load_unet_from_folder(folder / "unet", placement, variant=variant, allow_pickle=allow_pickle)
        encoder = prompt_encoder_from_pipeline_folder(src, placement, variant=variant)
        autoencoder = load_autoencoder(vae_path or folder / "vae", placement, variant=None if vae_path else variant, allow_pickle=allow_pickle)
        scheduler_config = load_scheduler_config(folder / "scheduler")
        generation_config = read_json(folder / GENERATION_CONFIG, missing_ok=True) or {}
        weights = [f for name in ("unet", "text_encoder", "text_encoder_2", "vae") if (folder / name).is_dir() for f in src.sub(name).weight_files]
        layout = "diffusers"
    else:
        if src.path.is_dir():
            raise wrong_family(src, "a Stable Diffusion pipeline (a diffusers folder with model_index.json, or a single file)")
        with TensorReader(src, allow_pickle=allow_pickle) as reader:
            keys = set(reader.keys())
            if not any(k.startswith(UNET_PREFIX) for k in keys):
                looks = detect_architecture(src, keys) if not src.is_pickle else None
                raise CheckpointError(
                    f"'{src.path}' is not a single-file Stable Diffusion checkpoint (no '{UNET_PREFIX}*' tensors)"
                    + (f"; it looks like {looks}" if looks else "")
                )
            unet = load_unet_from_reader(reader, placement)
            encoder = prompt_encoder_from_single_file(reader, placement)
            scheduler_config = single_file_scheduler_config(unet.config.to_dict(), keys, reader.get)
        autoencoder = load_autoencoder(vae_path or src.path, placement, allow_pickle=allow_pickle)
        generation_config = {}
        weights = list(src.weight_files)
        layout = "single-file"
    _check_fit(unet, autoencoder, encoder, src.path)
    check_generation_config(generation_config, src.path)
    if timestep_spacing is not None:
        if timestep_spacing not in TIMESTEP_SPACINGS:
            raise UserError(f"--timestep-spacing must be one of {', '.join(TIMESTEP_SPACINGS)} (got {timestep_spacing!r})")
        scheduler_config = {**scheduler_config, "timestep_spacing": timestep_spacing}
    applied = apply_loras(unet, encoder, loras, allow_pickle=allow_pickle)
    added = apply_embeddings(encoder, embeddings, allow_pickle=allow_pickle)
    control = None
    if controlnet is not None:
        vae_factor = 2 ** (len(autoencoder.model.config.block_out_channels) - 1)
        control = load_controlnet(controlnet, unet, placement, vae_factor, variant=variant, allow_pickle=allow_pickle)
    return StableDiffusion(
        unet, autoencoder, encoder, scheduler_config, placement, Path(src.path), layout, weights,
        generation_config, vae_path, time.perf_counter() - start, applied, prompt_weighting, timestep_spacing, added, control,
    )  # fmt: skip


def single_file_scheduler_config(unet_config: dict[str, Any], keys: set[str], read: Callable[[str], Any]) -> dict[str, Any]:
    """The standard scheduler config of a single file's family (v-prediction SD 2.x files get the
    768-v config; other files of unknown family that of SD 1.x)."""
    family = unet_family(unet_config)
    v = prediction_type_hint(unet_config, keys, read) == "v_prediction"
    if family in ("sdxl", "sdxl-refiner"):
        config = dict(STANDARD_SCHEDULER_CONFIGS["sdxl"])
        if v:
            config["prediction_type"] = "v_prediction"
        return config
    return dict(STANDARD_SCHEDULER_CONFIGS["sd2-v" if v else "sd2" if family == "sd2" else "sd1"])


_GENERATION_KEYS = {
    "num_inference_steps": ((int,), "an integer"), "guidance_scale": ((int, float), "a number"), "guidance_rescale": ((int, float), "a number"),
    "sampler": ((str,), "a sampler name"), "width": ((int,), "an integer"), "height": ((int,), "an integer"),
}  # fmt: skip


def check_generation_config(config: dict[str, Any], where: Path) -> None:
    for key, (kinds, what) in _GENERATION_KEYS.items():
        if key in config and (not isinstance(config[key], kinds) or isinstance(config[key], bool)):
            raise CheckpointError(f"'{where}/{GENERATION_CONFIG}': {key} must be {what} (got {config[key]!r})")


# -- settings -------------------------------------------------------------------------------------------
@dataclass
class GenerationSettings:
    """What a run uses (flags over ``generation_config.json`` over diffusers' defaults)."""

    steps: int
    guidance: float
    guidance_rescale: float
    sampler: str  # canonical gencli name ("dpmpp_2m_karras") or a diffusers class name
    width: int
    height: int
    clip_skip: int = 0
    strength: Optional[float] = None  # img2img only
    eta: float = 0.0  # DDIM's eta

    @property
    def classifier_free_guidance(self) -> bool:
        return self.guidance > 1.0


SETTING_FLAGS = ("steps", "guidance", "guidance_rescale", "sampler", "width", "height", "clip_skip", "strength")


def check_settings(
    *,
    steps: Optional[int] = None,
    guidance: Optional[float] = None,
    guidance_rescale: Optional[float] = None,
    sampler: Optional[str] = None,
    width: Optional[int] = None,
    height: Optional[int] = None,
    clip_skip: Optional[int] = None,
    strength: Optional[float] = None,
) -> None:
    """Reject out-of-range values before anything is loaded (one line each, exit 2)."""
    if steps is not None and steps < 1:
        raise UserError(f"--steps must be at least 1 (got {steps})")
    if guidance is not None and not 0 <= guidance <= MAX_GUIDANCE:
        raise UserError(f"--guidance must be from 0 to {MAX_GUIDANCE:g} (got {guidance})")
    if guidance_rescale is not None and not 0 <= guidance_rescale <= 1:
        raise UserError(f"--guidance-rescale must be in [0, 1] (got {guidance_rescale})")
    for name, value in (("--width", width), ("--height", height)):
        if value is not None and (value % SIZE_MULTIPLE or not SIZE_MULTIPLE <= value <= MAX_SIDE):
            raise UserError(f"{name} must be a multiple of {SIZE_MULTIPLE} between {SIZE_MULTIPLE} and {MAX_SIDE} (got {value})")
    if clip_skip is not None and clip_skip < 0:
        raise UserError(f"--clip-skip must be >= 0 (got {clip_skip})")
    if strength is not None and not 0 < strength <= 1:
        raise UserError(f"--strength must be in (0, 1] (got {strength})")
    if sampler is not None:
        resolve_sampler(sampler)


def resolve_settings(pipe: StableDiffusion, **flags: Any) -> GenerationSettings:
    """Flags override the pipeline's ``generation_config.json``, which overrides diffusers' defaults
    (50 steps, guidance 7.5 or SDXL's 5, the scheduler config's own sampler, the UNet's native size)."""
    unknown = sorted(set(flags) - set(SETTING_FLAGS))
    if unknown:
        raise TypeError(f"unknown setting {unknown[0]!r}")
    steps, guidance, guidance_rescale, sampler, width, height, clip_skip, strength = (flags.get(k) for k in SETTING_FLAGS)
    gen = pipe.generation_config
    default_w, default_h = pipe.default_size
    settings = GenerationSettings(
        steps=int(steps if steps is not None else gen.get("num_inference_steps", DEFAULT_STEPS)),
        guidance=float(guidance if guidance is not None else gen.get("guidance_scale", DEFAULT_GUIDANCE_SDXL if pipe.is_sdxl else DEFAULT_GUIDANCE)),
        guidance_rescale=float(guidance_rescale if guidance_rescale is not None else gen.get("guidance_rescale", 0.0)),
        sampler=sampler or gen.get("sampler") or default_sampler(pipe.scheduler_config),
        width=int(width if width is not None else default_w),
        height=int(height if height is not None else default_h),
        clip_skip=int(clip_skip or 0),
        strength=strength,
    )
    check_settings(**{k: getattr(settings, k) for k in SETTING_FLAGS})
    settings.sampler = make_scheduler(settings.sampler, pipe.scheduler_config).sampler_name
    return settings


def default_sampler(scheduler_config: dict[str, Any]) -> str:
    """The sampler the scheduler config names (its diffusers class), as a gencli sampler name."""
    class_name = scheduler_config.get("_class_name") or "PNDMScheduler"
    try:
        resolve_sampler(class_name)
    except UserError:
        raise UserError(f"the pipeline's scheduler {class_name!r} is not one gencli runs: choose one with --sampler") from None
    return make_scheduler(class_name, scheduler_config).sampler_name


def make_scheduler(name: str, scheduler_config: dict[str, Any], eta: float = 0.0) -> Scheduler:
    """A fresh sampler ``name`` on the pipeline's scheduler config (DDIM's ``eta`` when not 0)."""
    options = {"eta": eta} if eta else {}
    return get_scheduler(name, scheduler_config, **options)


# -- generation ---------------------------------------------------------------------------------------
@dataclass
class GeneratedImage:
    """One image and what made it."""

    pixels: np.ndarray  # (H, W, 3) uint8
    prompt: str
    negative_prompt: str
    seed: int
    settings: GenerationSettings
    notices: list[str] = field(default_factory=list)
    inpainted: bool = False  # made with a mask

    def parameters(self, pipe: StableDiffusion) -> ImageParameters:
        s = self.settings
        scheduler = make_scheduler(s.sampler, pipe.scheduler_config, s.eta)
        # "Mask blur" is the key other front ends write for an inpainting (gencli's masks are sharp)
        return ImageParameters(
            prompt=self.prompt, negative_prompt=self.negative_prompt, steps=s.steps, sampler=scheduler.display_name,
            cfg_scale=s.guidance, seed=self.seed, width=s.width, height=s.height, model=pipe.name, model_hash=pipe.model_hash,
            clip_skip=s.clip_skip, guidance_rescale=s.guidance_rescale, denoising_strength=s.strength,
            vae=pipe.vae_override.stem if pipe.vae_override is not None else "", vae_hash=pipe.vae_hash,
            extra={**({"Mask blur": "0"} if self.inpainted else {}), **lora_parameters(pipe.loras), **({} if pipe.prompt_weighting else {"Emphasis": "None"}),
                   **({"Timestep spacing": pipe.timestep_spacing} if pipe.timestep_spacing else {}),
                   **({"TI hashes": ti_hashes_text(pipe.embeddings)} if pipe.embeddings else {}),
                   **(pipe.controlnet.parameters() if pipe.controlnet is not None else {})},
        )  # fmt: skip


def lora_parameters(applied: Sequence[AppliedLora]) -> dict[str, str]:
    """The PNG parameters of the merged LoRAs: A1111's ``Lora hashes`` (name: short hash), and the
    weights of those given by ``--lora`` (not by a prompt tag) as ``Lora weights`` for replay."""
    if not applied:
        return {}
    out = {"Lora hashes": lora_hashes_text(applied)}
    flagged = [a for a in applied if not a.spec.from_tag]
    if flagged:
        out["Lora weights"] = ", ".join(f"{a.name}: {a.spec.weight:g}" for a in flagged)
    return out


@dataclass
class BatchTiming:
    encode_s: float = 0.0
    denoise_s: float = 0.0
    decode_s: float = 0.0
    model_calls: int = 0

    @property
    def s_per_step(self) -> Optional[float]:
        return self.denoise_s / self.model_calls if self.model_calls else None


StepCallback = Callable[[int, int], None]  # (model calls done, model calls in this batch)
NoticeCallback = Callable[[str], None]


def rescale_noise_cfg(noise_cfg: torch.Tensor, noise_pred_text: torch.Tensor, guidance_rescale: float) -> torch.Tensor:
    """Guidance rescale (Lin et al. 2023, section 3.4): bring the guided prediction's standard
    deviation back towards the conditional one's, mixed by ``guidance_rescale``."""
    dims = list(range(1, noise_pred_text.ndim))
    std_text = noise_pred_text.std(dim=dims, keepdim=True)
    std_cfg = noise_cfg.std(dim=dims, keepdim=True)
    rescaled = noise_cfg * (std_text / std_cfg)
    return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg


def _conditioning(
    pipe: StableDiffusion, prompts: list[str], negative: Optional[list[str]], settings: GenerationSettings
) -> tuple[torch.Tensor, Optional[dict[str, torch.Tensor]], list[str]]:
    """The UNet's context (unconditional rows first under CFG), SDXL's added conditioning, notices.
    ``<lora:...>`` tags are not encoded (the LoRAs were merged at load)."""
    prompts = [expand_prompt(strip_lora_tags(p), pipe.embeddings) for p in prompts]
    negative = None if negative is None else [expand_prompt(strip_lora_tags(p), pipe.embeddings) for p in negative]
    cond, uncond = pipe.prompt_encoder.encode_prompt(
        prompts, negative, do_classifier_free_guidance=settings.classifier_free_guidance, clip_skip=settings.clip_skip or None,
        weighting=pipe.prompt_weighting,
    )  # fmt: skip
    parts: list[PromptEmbeddings] = [uncond, cond] if uncond is not None else [cond]
    notices = [n for p in parts for n in p.notices]
    context = torch.cat([p.hidden_states for p in parts])
    added = None
    if pipe.is_sdxl:
        time_ids = torch.tensor([settings.height, settings.width, 0, 0, settings.height, settings.width], dtype=context.dtype)
        added = {
            "text_embeds": torch.cat([p.pooled for p in parts]),
            "time_ids": time_ids.repeat(context.shape[0], 1).to(context.device),
        }
    return context, added, notices


def _check_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise UserError(what)


@torch.inference_mode()
def generate(
    pipe: StableDiffusion,
    prompts: Sequence[str],
    seeds: Sequence[int],
    settings: GenerationSettings,
    *,
    negative_prompts: Optional[Sequence[str]] = None,
    init_images: Optional[Sequence[np.ndarray]] = None,
    masks: Optional[Sequence[np.ndarray]] = None,
    on_step: Optional[StepCallback] = None,
    on_notice: Optional[NoticeCallback] = None,
    timing: Optional[BatchTiming] = None,
) -> list[GeneratedImage]:
    """One batch: row ``i`` is ``prompts[i]`` with ``seeds[i]`` (and ``negative_prompts[i]``; None = no
    negative prompt, diffusers' default). ``init_images`` (uint8 ``(H, W, 3)``, already at the
    settings' size) make it img2img with ``settings.strength``; ``masks`` as well (``(H, W)``, 1 where
    the image is repainted, 0 where it is kept: :func:`prepare_mask`) make it inpainting, as diffusers'
    ``StableDiffusionInpaintPipeline`` does it: with an ordinary UNet the kept part of the latents is
    reset to the init image's, noised to the next step's level, after every step; an inpainting UNet
    (9 input channels) is given the mask and the masked image's latents instead."""
    prompts = list(prompts)
    if len(seeds) != len(prompts) or (negative_prompts is not None and len(negative_prompts) != len(prompts)):
        raise ValueError("one seed (and negative prompt) per prompt")
    if init_images is not None and len(init_images) != len(prompts):
        raise ValueError("one init image per prompt")
    if masks is not None and (init_images is None or len(masks) != len(prompts)):
        raise ValueError("one mask per init image")
    if pipe.is_inpainting and masks is None:
        raise UserError("this is an inpainting UNet (9 input channels): use gencli img2img IMAGE PROMPT --mask MASK")
    timing = timing if timing is not None else BatchTiming()
    device = pipe.placement.device
    batch = len(prompts)
    generators = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]
    f = pipe.vae_scale_factor
    if settings.width % f or settings.height % f:
        raise UserError(f"the size {settings.width}x{settings.height} is not a multiple of this VAE's factor {f}")

    t0 = time.perf_counter()
    negative = list(negative_prompts) if negative_prompts is not None else None
    context, added, notices = _conditioning(pipe, prompts, negative, settings)
    for n in notices:
        if on_notice:
            on_notice(n)
    timing.encode_s += time.perf_counter() - t0

    scheduler = make_scheduler(settings.sampler, pipe.scheduler_config, settings.eta)
    scheduler.set_timesteps(settings.steps, device=device)
    shape = (batch, pipe.latent_channels, settings.height // f, settings.width // f)
    if init_images is None:
        scheduler.set_begin_index(0)
        timesteps = scheduler.timesteps
        latents = randn_tensor(shape, generators, device=device, dtype=context.dtype).float() * scheduler.init_noise_sigma
    else:
        timesteps, _ = scheduler.img2img_timesteps(float(settings.strength))
        # diffusers' inpainting starts from pure noise at full strength; img2img always noises the image
        from_noise = masks is not None and float(settings.strength) == 1.0
        t0 = time.perf_counter()
        # the order of the generators' draws is diffusers': image posterior, noise, masked-image posterior
        init = None if from_noise and pipe.is_inpainting else _encode_images(pipe, init_images, generators)
        timing.encode_s += time.perf_counter() - t0
        noise = randn_tensor(shape, generators, device=device, dtype=context.dtype).float()
        if from_noise:
            latents = noise * scheduler.init_noise_sigma
        else:
            latents = scheduler.add_noise(init, noise, timesteps[:1].repeat(batch))
    mask = masked_latents = None
    if masks is not None:
        mask = latent_masks(masks, shape[-2:]).to(device)
        # the masked image's latents: the inpainting UNet's input. diffusers encodes (and samples) them
        # for an ordinary UNet too, which moves the generators on: so do we, or an ancestral sampler's
        # noise would differ from diffusers' for the same seed
        t0 = time.perf_counter()
        pixels = torch.cat([images_to_tensor(img) for img in init_images])
        keep = torch.from_numpy(np.stack([np.asarray(m) for m in masks]).astype(np.float32))[:, None] < 0.5
        masked_latents = _encode_pixels(pipe, pixels * keep, generators)
        timing.encode_s += time.perf_counter() - t0

    t0 = time.perf_counter()
    cfg = settings.classifier_free_guidance
    total = len(timesteps)
    control = pipe.controlnet
    control_image = control.condition(settings.width, settings.height, batch * (2 if cfg else 1)) if control is not None else None
    for i, t in enumerate(timesteps):
        model_input = scheduler.scale_model_input(torch.cat([latents] * 2) if cfg else latents, t)
        residuals = control.residuals(model_input, t, context, control_image, added, i, total, cfg) if control is not None else {}
        if residuals:  # (a scale of 0 adds nothing: the call is skipped)
            timing.model_calls += 1
        if pipe.is_inpainting:
            extra = torch.cat([mask, masked_latents], dim=1)
            model_input = torch.cat([model_input, torch.cat([extra] * 2) if cfg else extra], dim=1)
        out = pipe.unet(model_input, t, context, added_cond_kwargs=added, **residuals)
        _check_finite(
            out,
            f"the UNet's output is not finite (NaN/Inf) at step {i + 1} in {DTYPE_NAMES.get(pipe.unet.dtype)}: "
            "the checkpoint overflows in this dtype; try --dtype float32 (or bfloat16)",
        )
        if cfg:
            uncond, text = out.chunk(2)
            out = uncond + settings.guidance * (text - uncond)
            if settings.guidance_rescale > 0:
                out = rescale_noise_cfg(out, text, settings.guidance_rescale)
        latents = scheduler.step(out, t, latents, generator=generators).prev_sample
        if mask is not None and not pipe.is_inpainting:
            # keep the unmasked part: the init latents at the noise level the next step starts from
            kept = init if i == total - 1 else scheduler.add_noise(init, noise, timesteps[i + 1 : i + 2])
            latents = (1 - mask) * kept + mask * latents
        timing.model_calls += 1
        if on_step:
            on_step(i + 1, total)
    timing.denoise_s += time.perf_counter() - t0

    t0 = time.perf_counter()
    pixels = decode_latents(pipe, latents, on_notice)
    timing.decode_s += time.perf_counter() - t0
    rows = []
    for i in range(batch):
        neg = negative[i] if negative is not None else ""
        rows.append(GeneratedImage(pixels[i], prompts[i], neg or "", int(seeds[i]), replace(settings), list(notices), inpainted=masks is not None))
    return rows


def _encode_images(pipe: StableDiffusion, images: Sequence[np.ndarray], generators: list[torch.Generator]) -> torch.Tensor:
    """img2img's starting latents: each image encoded and sampled from its posterior with its own
    generator (diffusers' order of draws), then scaled as the UNet sees latents. float32."""
    return _encode_pixels(pipe, torch.cat([images_to_tensor(image) for image in images]), generators)


def _encode_pixels(pipe: StableDiffusion, pixels: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Scaled latents of ``(B, 3, H, W)`` pixels in [-1, 1], row ``i`` sampled with ``generators[i]``."""
    vae = pipe.vae.model
    weight = vae.decoder.conv_out.weight
    out = []
    for x, g in zip(pixels, generators):
        z = vae.encode(x[None].to(weight.device, weight.dtype)).sample(g)
        out.append(vae.scale_latents(z.float()))
    return torch.cat(out)


def latent_masks(masks: Sequence[np.ndarray], size: tuple[int, int]) -> torch.Tensor:
    """``(B, 1, h, w)`` float32 masks at the latent size, nearest-neighbour as diffusers resizes them."""
    import torch.nn.functional as F

    m = torch.from_numpy(np.stack([np.asarray(x, dtype=np.float32) for x in masks]))[:, None]
    return F.interpolate(m, size=tuple(size))


def prepare_mask(image: Any, width: int, height: int) -> np.ndarray:
    """An inpainting mask as diffusers' mask processor makes it: grayscale, resized to the run's size
    (Lanczos), then 1 where it is at least half white (repaint) and 0 elsewhere (keep)."""
    from PIL import Image

    gray = image.convert("L")
    if gray.size != (width, height):
        gray = gray.resize((width, height), Image.LANCZOS)
    return (np.asarray(gray, dtype=np.float32) / 255.0 >= 0.5).astype(np.float32)


def decode_latents(pipe: StableDiffusion, latents: torch.Tensor, on_notice: Optional[NoticeCallback] = None) -> np.ndarray:
    """uint8 images ``(B, H, W, 3)`` from the UNet's latents; a non-finite decode in reduced
    precision is redone in float32 (the VAE stays float32 afterwards), a non-finite float32 decode
    is an error."""
    vae = pipe.vae.model
    z = vae.unscale_latents(latents.float())
    weight = vae.decoder.conv_out.weight
    image = vae.decode(z.to(weight.device, weight.dtype))
    if not bool(torch.isfinite(image).all()):
        if weight.dtype == torch.float32:
            raise UserError("the VAE decoded a non-finite image (NaN/Inf) in float32: the latents or the VAE are broken; nothing was saved")
        if on_notice:
            on_notice(f"the VAE overflowed in {DTYPE_NAMES.get(weight.dtype)} (NaN/Inf); decoding again in float32")
        vae.float()
        pipe.vae = replace(pipe.vae, placement=Placement(pipe.vae.placement.device, torch.float32))
        image = vae.decode(z.float())
        _check_finite(image, "the VAE decoded a non-finite image (NaN/Inf) even in float32; nothing was saved")
    return tensor_to_images(image)


def prepare_init_image(image: Any, width: int, height: int) -> np.ndarray:
    """An RGB PIL image as the uint8 ``(height, width, 3)`` array img2img starts from (resized with
    Lanczos when its size differs, as diffusers' image processor does)."""
    from PIL import Image

    if image.size != (width, height):
        image = image.resize((width, height), Image.LANCZOS)
    return np.array(image.convert("RGB"), dtype=np.uint8)


__all__ = [
    "StableDiffusion",
    "GenerationSettings",
    "GeneratedImage",
    "BatchTiming",
    "STANDARD_SCHEDULER_CONFIGS",
    "load_pipeline",
    "check_settings",
    "resolve_settings",
    "default_sampler",
    "make_scheduler",
    "generate",
    "decode_latents",
    "rescale_noise_cfg",
    "prepare_init_image",
    "prepare_mask",
    "latent_masks",
    "single_file_scheduler_config",
    "attention_path",
]
