"""Tiny random Stable Diffusion pipelines built with diffusers and saved with ``save_pretrained``, for
the pipeline parity tests and the CLI tests (SD 1.x-, 2.x- and SDXL-shaped; a VAE with a 2x
downsampling factor, so nothing may assume SD's 8)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from gencli.tokenizers.clip_bpe import EOS, OPENAI_VOCAB_SIZE, read_openai_bpe

SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
             "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1}  # fmt: skip

UNETS = {
    "sd1": dict(
        block_out_channels=(32, 64), layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8, sample_size=8,
    ),
    "sd2": dict(
        block_out_channels=(32, 64), layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=(2, 4),
        use_linear_projection=True, upcast_attention=True, sample_size=8,
    ),
    "sdxl": dict(
        block_out_channels=(32, 64), layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=96, attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=48 + 6 * 8, sample_size=8,
    ),
}  # fmt: skip
UNETS["sd1-inpaint"] = {**UNETS["sd1"], "in_channels": 9}  # an inpainting UNet: latents, mask, masked-image latents
VAE = dict(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
           latent_channels=4, norm_num_groups=32, layers_per_block=1, sample_size=16)  # fmt: skip


@functools.lru_cache(maxsize=1)
def openai_bpe():
    return read_openai_bpe()


def hf_tokenizer(pad: str):
    import transformers

    vocab, merges = openai_bpe()
    return transformers.CLIPTokenizer(vocab=dict(vocab), merges=list(merges), pad_token=pad, model_max_length=77)


def text_config(hidden: int, layers: int, act: str, heads: int, **kw):
    import transformers

    return transformers.CLIPTextConfig(
        vocab_size=OPENAI_VOCAB_SIZE, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=77, hidden_act=act, bos_token_id=49406, eos_token_id=49407, pad_token_id=1, **kw,
    )  # fmt: skip


def build_reference(family: str, seed: int = 0):
    """A diffusers pipeline of ``family`` with random weights (the modules' own initialisation)."""
    import diffusers
    import transformers

    torch.manual_seed(seed)
    unet = diffusers.UNet2DConditionModel(**UNETS[family]).eval()
    vae = diffusers.AutoencoderKL(**VAE).eval()
    prediction = "v_prediction" if family == "sd2" else "epsilon"
    if family == "sdxl":
        scheduler = diffusers.EulerDiscreteScheduler(**{k: v for k, v in SCHEDULER.items() if k not in ("set_alpha_to_one", "skip_prk_steps")},
                                                     timestep_spacing="leading")  # fmt: skip
        te = transformers.CLIPTextModel(text_config(32, 2, "quick_gelu", 4)).eval()
        te2 = transformers.CLIPTextModelWithProjection(text_config(64, 2, "gelu", 4, projection_dim=48)).eval()
        return diffusers.StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=te,
            text_encoder_2=te2,
            tokenizer=hf_tokenizer(EOS),
            tokenizer_2=hf_tokenizer("!"),
            unet=unet,
            scheduler=scheduler,
        )
    scheduler = diffusers.PNDMScheduler(**SCHEDULER, prediction_type=prediction)
    sd1 = family.startswith("sd1")
    te = transformers.CLIPTextModel(text_config(32, 3, "quick_gelu" if sd1 else "gelu", 4)).eval()
    return diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=te, tokenizer=hf_tokenizer(EOS if sd1 else "!"), unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


def save_reference(pipe, folder: Path, generation_config: dict | None = None) -> Path:
    pipe.save_pretrained(str(folder))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def reference_scheduler(pipe, name: str):
    """The diffusers scheduler a gencli sampler name stands for, on ``pipe``'s scheduler config."""
    import diffusers

    config = pipe.scheduler.config
    return {
        "ddim": lambda: diffusers.DDIMScheduler.from_config(config),
        "euler": lambda: diffusers.EulerDiscreteScheduler.from_config(config),
        "euler_a": lambda: diffusers.EulerAncestralDiscreteScheduler.from_config(config),
        "dpmpp_2m_karras": lambda: diffusers.DPMSolverMultistepScheduler.from_config(
            config, use_karras_sigmas=True, algorithm_type="dpmsolver++", solver_order=2
        ),
    }[name]()
