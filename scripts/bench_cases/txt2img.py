"""Text-to-image end to end: gencli's Stable Diffusion pipeline vs diffusers' StableDiffusionPipeline on
the same random-weight diffusers folder, same prompt, seed, sampler and guidance.

    python scripts/bench.py txt2img --dtype float32 --rounds 3
    python scripts/bench.py txt2img --channels 160,320,640,640     # a narrower UNet
    python scripts/bench.py txt2img --dtype auto                   # gencli's auto dtype vs diffusers' default (fp32)

The pipeline is SD-1.5-shaped (UNet block_out_channels 320/640/1280/1280, 8 heads, 768-wide context;
the standard SD VAE; a CLIP ViT-L-shaped text tower with fewer layers, ``--text-layers``), run at a
32x32 latent (256x256 pixels) with classifier-free guidance (a batch of 2 through the UNet).
``s_per_step``: the median wall-clock seconds of one denoising step with CFG (from the pipeline's
per-step callback, after the first step); ``end_to_end_s``: a fresh process's load + one image of
``--steps`` steps, written to memory as PNG-ready pixels; ``load_s`` the load alone. The reference
side saves its image; the gencli side reports the largest pixel difference to it.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

from bench_cases._util import device_and_dtype, peak_gpu_mb, sync

DESCRIPTION = "txt2img with CFG: s/step and end to end, SD-1.5-shaped random pipeline at a --latent-sized latent, 32x32 by default (gencli vs diffusers)"
METRICS = {"s_per_step": "lower", "end_to_end_s": "lower", "load_s": "lower", "max_pixel_diff_vs_reference": "lower"}
PROMPT = "a red star on a blue background"


def add_arguments(p):
    p.add_argument("--latent", type=int, default=32, help="latent height and width (pixels / 8)")
    p.add_argument("--channels", default="320,640,1280,1280", help="UNet block_out_channels")
    p.add_argument("--text-layers", type=int, default=4, help="layers of the CLIP ViT-L-shaped text encoder (12 in SD 1.5)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps")
    p.add_argument("--sampler", default="euler", choices=["euler", "ddim", "euler_a", "dpmpp_2m_karras"])


def setup(args, workdir):
    import diffusers
    import transformers

    from gencli.tokenizers.clip_bpe import read_openai_bpe

    channels = tuple(int(c) for c in args.channels.split(","))
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(block_out_channels=channels, cross_attention_dim=768, sample_size=args.latent)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2, latent_channels=4, sample_size=args.latent * 8,
    )  # fmt: skip
    text = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=args.text_layers, num_attention_heads=12,
                                    max_position_embeddings=77, vocab_size=49408, bos_token_id=49406, eos_token_id=49407)
    )  # fmt: skip
    vocab, merges = read_openai_bpe()
    tokenizer = transformers.CLIPTokenizer(vocab=dict(vocab), merges=list(merges), pad_token="<|endoftext|>", model_max_length=77)
    scheduler = diffusers.PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", set_alpha_to_one=False,
                                        skip_prk_steps=True, steps_offset=1)  # fmt: skip
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet, scheduler=scheduler, safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )  # fmt: skip
    pipe.save_pretrained(str(workdir / "pipe"))


def _reference_scheduler(pipe, name):
    import diffusers

    config = pipe.scheduler.config
    return {
        "ddim": lambda: diffusers.DDIMScheduler.from_config(config),
        "euler": lambda: diffusers.EulerDiscreteScheduler.from_config(config),
        "euler_a": lambda: diffusers.EulerAncestralDiscreteScheduler.from_config(config),
        "dpmpp_2m_karras": lambda: diffusers.DPMSolverMultistepScheduler.from_config(config, use_karras_sigmas=True),
    }[name]()


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    size = args.latent * 8
    step_times: list[float] = []
    last = [0.0]

    def tick():
        sync(device)
        now = time.perf_counter()
        step_times.append(now - last[0])
        last[0] = now

    start = time.perf_counter()
    if side == "gencli":
        from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, resolve_settings

        pipe = load_pipeline(workdir / "pipe", device=str(device), dtype=str(dtype).replace("torch.", ""), threads=args.threads)
        sync(device)
        load_s = time.perf_counter() - start
        settings = resolve_settings(pipe, steps=args.steps, guidance=7.5, sampler=args.sampler, width=size, height=size)
        last[0] = time.perf_counter()
        pixels = generate(pipe, [PROMPT], [0], settings, on_step=lambda *_: tick())[0].pixels
    else:
        import diffusers

        pipe = diffusers.StableDiffusionPipeline.from_pretrained(str(workdir / "pipe"), torch_dtype=dtype).to(device)
        pipe.set_progress_bar_config(disable=True)
        pipe.scheduler = _reference_scheduler(pipe, args.sampler)
        sync(device)
        load_s = time.perf_counter() - start
        last[0] = time.perf_counter()
        out = pipe(
            PROMPT, num_inference_steps=args.steps, guidance_scale=7.5, height=size, width=size,
            generator=[torch.Generator().manual_seed(0)], output_type="np", callback_on_step_end=lambda *a: (tick(), a[3])[1],
        ).images  # fmt: skip
        pixels = (out[0] * 255).round().astype(np.uint8)
    sync(device)
    end_to_end = time.perf_counter() - start
    result = {
        "s_per_step": round(statistics.median(step_times[1:] or step_times), 4),
        "end_to_end_s": round(end_to_end, 3),
        "load_s": round(load_s, 3),
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "peak_gpu_mb": peak_gpu_mb(device),
    }
    ref_path = workdir / f"reference_image_{result['dtype']}.json"
    if side == "reference":
        ref_path.write_text(json.dumps(pixels.tolist()))
    elif ref_path.exists():
        ref = np.array(json.loads(ref_path.read_text()), dtype=np.int64)
        result["max_pixel_diff_vs_reference"] = int(np.abs(ref - pixels.astype(np.int64)).max())
    return result
