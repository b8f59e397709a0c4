"""The Stable Diffusion pipeline against diffusers: tiny random SD 1.x-, 2.x- (v-prediction, linear
projections) and SDXL-shaped pipelines saved with ``save_pretrained`` and reloaded by both, the full
image compared for the same seeds, prompts, negative prompts, steps, sampler and guidance; img2img
against ``StableDiffusionImg2ImgPipeline``; a single-file SD 1.x checkpoint in the original layout
against diffusers' ``from_single_file``; the settings, NaN handling and bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _diffusion_fixtures import UNETS, VAE, build_reference, reference_scheduler, save_reference, text_config

from gencli.errors import CheckpointError, UserError
from gencli.pipelines.diffusion.pipeline import STANDARD_SCHEDULER_CONFIGS, GenerationSettings, decode_latents, generate, load_pipeline, resolve_settings
from gencli.pipelines.diffusion.png_parameters import ImageParameters

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["a small red star at the top left on a blue background", "a green circle"]
NEGATIVE = ["blurry, lowres", "a square"]
SEEDS = [3, 11]
SIZE = 16
STEPS = 5
MAX_PIXEL_DIFF = 2  # of 255


_BUILT: dict = {}


def _pipelines(family: str, tmp_path_factory):
    """(family, diffusers pipeline reloaded from the folder, gencli pipeline, folder), built once."""
    if family not in _BUILT:
        folder = save_reference(build_reference(family), tmp_path_factory.mktemp(family))
        ref = (diffusers.StableDiffusionXLPipeline if family == "sdxl" else diffusers.StableDiffusionPipeline).from_pretrained(str(folder))
        ref.set_progress_bar_config(disable=True)
        _BUILT[family] = (family, ref, load_pipeline(folder, device="cpu", dtype="float32"), folder)
    return _BUILT[family]


@pytest.fixture(scope="module", params=["sd1", "sd2", "sdxl"])
def family_pipelines(request, tmp_path_factory):
    return _pipelines(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    return _pipelines("sd1", tmp_path_factory)


@pytest.fixture(scope="module")
def sd2(tmp_path_factory):
    return _pipelines("sd2", tmp_path_factory)


def reference_images(ref, sampler: str, *, seeds=SEEDS, prompts=PROMPTS, negative=NEGATIVE, **kw) -> np.ndarray:
    ref.scheduler = reference_scheduler(ref, sampler)
    out = ref(
        prompt=list(prompts), negative_prompt=None if negative is None else list(negative), num_inference_steps=kw.pop("steps", STEPS),
        height=SIZE, width=SIZE, generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="np", **kw,
    ).images  # fmt: skip
    return (out * 255).round().astype(np.uint8)


def ours(pipe, sampler: str, *, seeds=SEEDS, prompts=PROMPTS, negative=NEGATIVE, steps=STEPS, guidance=7.0, **kw) -> np.ndarray:
    settings = resolve_settings(pipe, steps=steps, guidance=guidance, sampler=sampler, width=SIZE, height=SIZE, **kw)
    return np.stack([g.pixels for g in generate(pipe, prompts, seeds, settings, negative_prompts=negative)])


def pixel_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.mark.parametrize("sampler", ["ddim", "euler", "euler_a", "dpmpp_2m_karras"])
def test_txt2img_matches_diffusers(family_pipelines, sampler):
    family, ref, pipe, _ = family_pipelines
    assert pipe.vae_scale_factor == 2 and pipe.is_sdxl == (family == "sdxl")
    if family == "sd2":
        assert pipe.scheduler_config["prediction_type"] == "v_prediction"
    want = reference_images(ref, sampler, guidance_scale=7.0)
    got = ours(pipe, sampler)
    assert pixel_diff(got, want) <= MAX_PIXEL_DIFF
    # a test that can fail: the images are not flat, and another seed gives another image
    assert want.std() > 10 and pixel_diff(got[0], got[1]) > 20
    if sampler == "ddim":
        assert pixel_diff(ours(pipe, sampler, seeds=[4, 11])[0], want[0]) > 20


def test_guidance_rescale_clip_skip_and_no_guidance(sd1):
    family, ref, pipe, _ = sd1
    te = ref.text_encoder  # diffusers reads clip skip's final norm through transformers 4's text_model nesting
    object.__setattr__(te, "text_model", type("T", (), {"final_layer_norm": te.final_layer_norm})())
    want = reference_images(ref, "euler_a", guidance_scale=5.0, guidance_rescale=0.7, clip_skip=1)
    got = ours(pipe, "euler_a", guidance=5.0, guidance_rescale=0.7, clip_skip=1)
    assert pixel_diff(got, want) <= MAX_PIXEL_DIFF
    assert pixel_diff(got, ours(pipe, "euler_a", guidance=5.0)) > 5  # both options change the image
    # guidance <= 1: no unconditional pass (the negative prompt then plays no part)
    want = reference_images(ref, "euler", guidance_scale=1.0, negative=None)
    plain = ours(pipe, "euler", guidance=1.0, negative=None)
    assert pixel_diff(plain, want) <= MAX_PIXEL_DIFF
    assert pixel_diff(ours(pipe, "euler", guidance=1.0, negative=["anything", "else"]), plain) == 0


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_img2img_matches_diffusers(family, tmp_path_factory):
    _, _, pipe, folder = _pipelines(family, tmp_path_factory)
    from PIL import Image

    img2img = diffusers.StableDiffusionImg2ImgPipeline.from_pretrained(str(folder))
    img2img.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    init = (rng.random((SIZE, SIZE, 3)) * 255).astype(np.uint8)
    for sampler, strength in (("ddim", 0.6), ("euler_a", 0.8)):
        img2img.scheduler = reference_scheduler(img2img, sampler)
        want = img2img(
            prompt=PROMPTS, negative_prompt=NEGATIVE, image=[Image.fromarray(init)] * 2, strength=strength, num_inference_steps=STEPS,
            guidance_scale=6.0, generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="np",
        ).images  # fmt: skip
        want = (want * 255).round().astype(np.uint8)
        settings = resolve_settings(pipe, steps=STEPS, guidance=6.0, sampler=sampler, width=SIZE, height=SIZE, strength=strength)
        got = np.stack([g.pixels for g in generate(pipe, PROMPTS, SEEDS, settings, negative_prompts=NEGATIVE, init_images=[init] * 2)])
        assert pixel_diff(got, want) <= MAX_PIXEL_DIFF, (sampler, strength)
        assert pixel_diff(got, ours(pipe, sampler, guidance=6.0)) > 5  # the init image matters


@pytest.mark.parametrize("family", ["sd1", "sd1-inpaint"])
def test_inpainting_matches_diffusers(family, tmp_path_factory):
    """--mask: an ordinary UNet (the kept part reset to the init latents after every step) and an
    inpainting UNet (9 input channels), against StableDiffusionInpaintPipeline, at full and partial
    strength (full strength starts from pure noise there)."""
    from PIL import Image

    from gencli.pipelines.diffusion.pipeline import prepare_mask

    _, _, pipe, folder = _pipelines(family, tmp_path_factory)
    assert pipe.is_inpainting == (family == "sd1-inpaint")
    inpaint = diffusers.StableDiffusionInpaintPipeline.from_pretrained(str(folder))
    inpaint.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(1)
    init = (rng.random((SIZE, SIZE, 3)) * 255).astype(np.uint8)
    mask_image = np.zeros((SIZE, SIZE), np.uint8)
    mask_image[2:12, 5:14] = 255  # repaint a rectangle
    mask = prepare_mask(Image.fromarray(mask_image), SIZE, SIZE)
    assert mask.sum() == 10 * 9
    for sampler, strength in (("ddim", 1.0), ("euler_a", 0.75)):
        inpaint.scheduler = reference_scheduler(inpaint, sampler)
        want = inpaint(
            prompt=PROMPTS, negative_prompt=NEGATIVE, image=[Image.fromarray(init)] * 2, mask_image=[Image.fromarray(mask_image)] * 2,
            strength=strength, num_inference_steps=STEPS, guidance_scale=6.0, height=SIZE, width=SIZE,
            generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="np",
        ).images  # fmt: skip
        want = (want * 255).round().astype(np.uint8)
        settings = resolve_settings(pipe, steps=STEPS, guidance=6.0, sampler=sampler, width=SIZE, height=SIZE, strength=strength)
        images = generate(pipe, PROMPTS, SEEDS, settings, negative_prompts=NEGATIVE, init_images=[init] * 2, masks=[mask] * 2)
        got = np.stack([g.pixels for g in images])
        assert pixel_diff(got, want) <= MAX_PIXEL_DIFF, (family, sampler, strength)
        assert images[0].parameters(pipe).extra == {"Mask blur": "0"}
        if family == "sd1":  # the mask matters
            plain = np.stack([g.pixels for g in generate(pipe, PROMPTS, SEEDS, settings, negative_prompts=NEGATIVE, init_images=[init] * 2)])
            assert pixel_diff(got, plain) > 5
    if family == "sd1-inpaint":
        with pytest.raises(UserError, match="inpainting UNet"):
            ours(pipe, "ddim")


def test_single_file_sd1_matches_from_single_file(tmp_path):
    """An SD 1.x checkpoint in the original layout (UNet, CLIP text tower, VAE under their original
    prefixes), loaded by gencli from its shapes and the shipped configs, and by diffusers'
    from_single_file with the saved folder as its (offline) config."""
    from _sd_original_layout import openai_clip_to_original
    from safetensors.torch import save_file
    from test_autoencoder_kl import _to_original as vae_to_original
    from test_unet import diffusers_to_original

    torch.manual_seed(5)
    # shapes that follow SD 1.x's conventions (8 heads, 64-wide CLIP heads, 32 GroupNorm groups), so they can be inferred back
    unet = diffusers.UNet2DConditionModel(**{**UNETS["sd1"], "cross_attention_dim": 64}).eval()
    vae = diffusers.AutoencoderKL(**VAE).eval()
    te = transformers.CLIPTextModel(text_config(64, 2, "quick_gelu", 1)).eval()
    from _diffusion_fixtures import SCHEDULER, hf_tokenizer

    scheduler = diffusers.PNDMScheduler(**SCHEDULER)
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=te, tokenizer=hf_tokenizer("<|endoftext|>"), unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    pipe.save_pretrained(str(tmp_path / "folder"))
    # the reference reads the scheduler config of the SD 1.5 repository, which gencli ships for single files
    (tmp_path / "folder" / "scheduler" / "scheduler_config.json").write_text(json.dumps(STANDARD_SCHEDULER_CONFIGS["sd1"]))
    state = diffusers_to_original(unet.state_dict(), dict(unet.config))
    state.update(openai_clip_to_original(te.state_dict(), "cond_stage_model.transformer."))
    state.update({"first_stage_model." + k: v for k, v in vae_to_original(vae.state_dict(), 2).items()})
    save_file(state, str(tmp_path / "tiny-sd1.safetensors"))

    ref = diffusers.StableDiffusionPipeline.from_single_file(
        str(tmp_path / "tiny-sd1.safetensors"), config=str(tmp_path / "folder"), local_files_only=True,
        safety_checker=None, requires_safety_checker=False,
    )  # fmt: skip
    ref.set_progress_bar_config(disable=True)
    mine = load_pipeline(tmp_path / "tiny-sd1.safetensors", device="cpu", dtype="float32")
    assert mine.layout == "single-file" and mine.vae_scale_factor == 2
    assert mine.scheduler_config["_class_name"] == "PNDMScheduler"  # the shipped SD 1.x scheduler config
    for sampler in ("euler_a", "dpmpp_2m_karras"):
        assert pixel_diff(ours(mine, sampler), reference_images(ref, sampler, guidance_scale=7.0)) <= MAX_PIXEL_DIFF
    # the default sampler of a single file is the standard config's (PLMS), and the hash is the file's
    assert resolve_settings(mine).sampler == "plms"
    assert len(mine.model_hash) == 10 and mine.name == "tiny-sd1"


def test_generation_config_defaults_and_flags(sd1, tmp_path):
    family, _, pipe, folder = sd1
    s = resolve_settings(pipe)
    assert (s.steps, s.guidance, s.guidance_rescale, s.sampler, s.width, s.height) == (50, 7.5, 0.0, "plms", 16, 16)
    (folder / "generation_config.json").write_text(
        json.dumps({"num_inference_steps": 12, "guidance_scale": 3.5, "guidance_rescale": 0.2, "sampler": "DPM++ 2M Karras", "width": 24, "height": 32})
    )
    try:
        again = load_pipeline(folder, device="cpu", dtype="float32")
        s = resolve_settings(again)
        assert (s.steps, s.guidance, s.guidance_rescale, s.sampler, s.width, s.height) == (12, 3.5, 0.2, "dpmpp_2m_karras", 24, 32)
        s = resolve_settings(again, steps=3, guidance=1.0, sampler="euler_a", width=8, height=40)
        assert (s.steps, s.guidance, s.sampler, s.width, s.height) == (3, 1.0, "euler_a", 8, 40)
        out = generate(again, ["x"], [0], s)
        assert out[0].pixels.shape == (40, 8, 3)
        (folder / "generation_config.json").write_text(json.dumps({"num_inference_steps": "many"}))
        with pytest.raises(CheckpointError, match="num_inference_steps must be an integer"):
            load_pipeline(folder, device="cpu", dtype="float32")
    finally:
        (folder / "generation_config.json").unlink()


def test_parameters_text_round_trips(sd2):
    family, _, pipe, _ = sd2
    s = resolve_settings(pipe, steps=2, sampler="dpmpp_2m_karras", clip_skip=1, width=SIZE, height=SIZE)
    image = generate(pipe, ['a "quoted", colon: prompt\nsecond line'], [7], s, negative_prompts=["neg, with comma"])[0]
    params = image.parameters(pipe)
    text = params.to_text()
    assert "Sampler: DPM++ 2M Karras" in text and "Clip skip: 2" in text and "Seed: 7" in text and f"Size: {SIZE}x{SIZE}" in text
    back = ImageParameters.from_text(text)
    assert back == params
    assert (
        ImageParameters.from_text("a cat\nSteps: 20, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7, Seed: 1, Size: 512x768").sampler
        == "DPM++ 2M Karras"
    )


def test_nan_vae_is_rerun_in_float32_and_nan_latents_are_an_error(sd1):
    family, _, pipe, _ = sd1
    latents = torch.randn(1, 4, 8, 8)
    vae = pipe.vae.model
    notices = []
    try:
        vae.to(torch.bfloat16)
        original = vae.decode

        def overflowing(z, **kw):  # what the fp16 SD VAE does: NaN in reduced precision only
            out = original(z, **kw)
            return out * float("nan") if z.dtype != torch.float32 else out

        vae.decode = overflowing
        pixels = decode_latents(pipe, latents, notices.append)
        assert pixels.shape == (1, 16, 16, 3) and len(notices) == 1 and "decoding again in float32" in notices[0]
        assert vae.decoder.conv_out.weight.dtype == torch.float32
        with pytest.raises(UserError, match="non-finite"):
            decode_latents(pipe, latents * float("nan"))
    finally:
        vae.__dict__.pop("decode", None)
        vae.float()


def test_bad_inputs_are_one_line_errors(tmp_path, sd1):
    family, _, pipe, folder = sd1
    for kw, match in (
        ({"steps": 0}, "--steps"), ({"guidance": -1.0}, "--guidance"), ({"width": 20}, "multiple of 8"),
        ({"height": 8192}, "multiple of 8"), ({"sampler": "warp"}, "valid: ddpm, ddim"), ({"strength": 1.5}, "--strength"),
        ({"guidance_rescale": 2.0}, "--guidance-rescale"), ({"clip_skip": 9}, None),
    ):  # fmt: skip
        if match is None:
            settings = resolve_settings(pipe, steps=1, **kw)
            with pytest.raises(UserError, match="clip skip 9 is out of range"):
                generate(pipe, ["x"], [0], settings)
            continue
        with pytest.raises(UserError, match=match):
            resolve_settings(pipe, **kw)
    # a folder without a component names it; a file that is not SD says what it looks like
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(CheckpointError, match="missing its 'vae' component"):
        load_pipeline(broken, device="cpu")
    from safetensors.torch import save_file

    save_file({"encoder.conv_in.weight": torch.zeros(4, 3, 3, 3), "encoder.down.0.block.0.conv1.weight": torch.zeros(1), "decoder.up.0.x": torch.zeros(1)},
              str(tmp_path / "vae.safetensors"))  # fmt: skip
    with pytest.raises(CheckpointError, match="not a single-file Stable Diffusion checkpoint.*looks like AutoencoderKL"):
        load_pipeline(tmp_path / "vae.safetensors", device="cpu")


def test_empty_prompt_is_unconditional_generation(sd1):
    family, ref, pipe, _ = sd1
    want = reference_images(ref, "ddim", prompts=[""], negative=None, seeds=[1], guidance_scale=7.0)
    assert pixel_diff(ours(pipe, "ddim", prompts=[""], negative=None, seeds=[1]), want) <= MAX_PIXEL_DIFF


def test_settings_dataclass_guidance_flag():
    base = dict(steps=1, guidance_rescale=0.0, sampler="euler", width=8, height=8)
    assert GenerationSettings(guidance=1.0, **base).classifier_free_guidance is False
    assert GenerationSettings(guidance=1.5, **base).classifier_free_guidance is True
