"""ControlNet: the model against diffusers' ``ControlNetModel`` (its residuals and the UNet that adds
them), from a diffusers folder and from an original single file; whole txt2img / img2img images against
diffusers' ControlNet pipelines on tiny random SD 1.x- and SDXL-shaped models; the flags and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _diffusion_fixtures import UNETS, build_reference, save_reference
from conftest import one_error_line, run_cli
from PIL import Image
from safetensors.torch import save_file
from test_unet import diffusers_to_original

from gencli.backend.device import Placement
from gencli.errors import UserError
from gencli.pipelines.diffusion.controlnet import ControlNetSpec, check_control_flags, load_controlnet
from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, resolve_settings

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = Placement(torch.device("cpu"), torch.float32)
PROMPTS = ["a small red star at the top left on a blue background", "a green circle"]
SEEDS = [3, 11]
SIZE = 16
STEPS = 4
MAX_PIXEL_DIFF = 2  # of 255


def random_controlnet(unet, seed: int = 0):
    """diffusers' ControlNet copied from ``unet`` with every weight random (trained ones are not zero)."""
    torch.manual_seed(seed)
    cn = diffusers.ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32)).eval()  # 1/2 size: the tiny VAE's factor
    with torch.no_grad():
        for p in cn.parameters():
            p.normal_(0, 0.05)
    return cn


def control_image(path, size=(20, 24), seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def to_original(cn, unet_config: dict) -> dict[str, torch.Tensor]:
    """A diffusers ControlNet under the original names A1111's files carry (``control_model.*``)."""
    state = cn.state_dict()
    blocks = len(cn.controlnet_cond_embedding.blocks)
    special = {"controlnet_cond_embedding.conv_in.": "input_hint_block.0.", "controlnet_cond_embedding.conv_out.": f"input_hint_block.{2 * blocks + 2}.",
               "controlnet_mid_block.": "middle_block_out.0."}  # fmt: skip
    special.update({f"controlnet_cond_embedding.blocks.{j}.": f"input_hint_block.{2 * j + 2}." for j in range(blocks)})
    special.update({f"controlnet_down_blocks.{i}.": f"zero_convs.{i}.0." for i in range(len(cn.controlnet_down_blocks))})
    out, rest = {}, {}
    for name, t in state.items():
        prefix = next((p for p in special if name.startswith(p)), None)
        if prefix is not None:
            out["control_model." + special[prefix] + name[len(prefix) :]] = t.contiguous()
        else:
            rest[name] = t
    for name, t in diffusers_to_original(rest, unet_config).items():
        out[name.replace("model.diffusion_model.", "control_model.", 1)] = t
    return out


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_residuals_and_the_unet_match_diffusers(family, tmp_path):
    from gencli.pipelines.diffusion.unet_loading import load_unet_from_folder

    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**UNETS[family]).eval()
    cn = random_controlnet(unet)
    unet.save_pretrained(tmp_path / "unet")
    cn.save_pretrained(tmp_path / "cn")
    save_file(to_original(cn, dict(unet.config)), str(tmp_path / "control_tiny.safetensors"))
    image = control_image(tmp_path / "c.png")
    ours_unet = load_unet_from_folder(tmp_path / "unet", CPU)
    g = torch.Generator().manual_seed(1)
    x, cond = torch.randn(2, 4, 8, 8, generator=g), torch.rand(2, 3, 16, 16, generator=g)
    ctx = torch.randn(2, 77, UNETS[family]["cross_attention_dim"], generator=g)
    added = {"text_embeds": torch.randn(2, 48, generator=g), "time_ids": torch.tensor([[16.0, 16, 0, 0, 16, 16]] * 2)} if family == "sdxl" else None
    with torch.no_grad():
        want_down, want_mid = cn(x, 500, ctx, cond, conditioning_scale=0.7, added_cond_kwargs=added, return_dict=False)
        want = unet(x, 500, ctx, added_cond_kwargs=added, down_block_additional_residuals=want_down, mid_block_additional_residual=want_mid).sample
        plain = unet(x, 500, ctx, added_cond_kwargs=added).sample
        for where in ("cn", "control_tiny.safetensors"):
            ours = load_controlnet(ControlNetSpec(str(tmp_path / where), str(image), 0.7), ours_unet, CPU, 2).model
            down, mid = ours(x, 500, ctx, cond, 0.7, added_cond_kwargs=added)
            assert len(down) == len(want_down) and all((a - b).abs().max() < 1e-5 for a, b in zip(down, want_down)), where
            assert (mid - want_mid).abs().max() < 1e-5
            got = ours_unet(x, 500, ctx, added_cond_kwargs=added, down_block_additional_residuals=down, mid_block_additional_residual=mid)
            assert (got - want).abs().max() < 1e-4, where
    assert (want - plain).abs().max() > 1e-2  # the residuals matter


def _reference_pipeline(family: str, tmp_path_factory, kind: str = "txt2img"):
    ref = build_reference(family)
    folder = save_reference(ref, tmp_path_factory.mktemp(family))
    cn = random_controlnet(ref.unet, seed=4)
    cn_folder = tmp_path_factory.mktemp(family + "-cn")
    cn.save_pretrained(cn_folder)
    if family == "sdxl":
        cls = diffusers.StableDiffusionXLControlNetImg2ImgPipeline if kind == "img2img" else diffusers.StableDiffusionXLControlNetPipeline
    else:
        cls = diffusers.StableDiffusionControlNetImg2ImgPipeline if kind == "img2img" else diffusers.StableDiffusionControlNetPipeline
    pipe = cls.from_pretrained(str(folder), controlnet=diffusers.ControlNetModel.from_pretrained(str(cn_folder)))  # what the folders hold
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = diffusers.EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    return pipe, folder, cn_folder


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_txt2img_images_match_diffusers_controlnet_pipeline(family, tmp_path_factory, tmp_path):
    ref, folder, cn_folder = _reference_pipeline(family, tmp_path_factory)
    image = control_image(tmp_path / "edges.png")
    kw = dict(controlnet_conditioning_scale=0.8, control_guidance_start=0.0, control_guidance_end=0.75)
    out = ref(prompt=PROMPTS, negative_prompt=["", ""], image=Image.open(image), num_inference_steps=STEPS, height=SIZE, width=SIZE, guidance_scale=6.0,
              generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="np", **kw).images  # fmt: skip
    want = (out * 255).round().astype(np.uint8)
    spec = ControlNetSpec(str(cn_folder), str(image), 0.8, 0.0, 0.75)
    pipe = load_pipeline(folder, device="cpu", dtype="float32", controlnet=spec)
    settings = resolve_settings(pipe, steps=STEPS, guidance=6.0, sampler="euler", width=SIZE, height=SIZE)
    made = generate(pipe, PROMPTS, SEEDS, settings, negative_prompts=["", ""])
    got = np.stack([g.pixels for g in made])
    assert int(np.abs(got.astype(int) - want.astype(int)).max()) <= MAX_PIXEL_DIFF
    plain = load_pipeline(folder, device="cpu", dtype="float32")
    without = np.stack([g.pixels for g in generate(plain, PROMPTS, SEEDS, settings, negative_prompts=["", ""])])
    assert int(np.abs(got.astype(int) - without.astype(int)).max()) > 3 * MAX_PIXEL_DIFF  # the ControlNet changed the images
    text = made[0].parameters(pipe).to_text()
    assert f"ControlNet 0: \"Module: none, Model: {cn_folder.name} [" in text and "Weight: 0.8" in text and "Guidance End: 0.75" in text


def test_img2img_matches_diffusers_controlnet_img2img_pipeline(tmp_path_factory, tmp_path):
    from gencli.pipelines.diffusion.pipeline import prepare_init_image

    ref, folder, cn_folder = _reference_pipeline("sd1", tmp_path_factory, "img2img")
    image = control_image(tmp_path / "edges.png", size=(16, 16))
    init = control_image(tmp_path / "init.png", size=(16, 16), seed=5)
    out = ref(prompt=PROMPTS, image=Image.open(init), control_image=Image.open(image), controlnet_conditioning_scale=0.9, strength=0.75,
              num_inference_steps=STEPS, height=SIZE,
              width=SIZE, guidance_scale=6.0, generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="np").images  # fmt: skip
    want = (out * 255).round().astype(np.uint8)
    pipe = load_pipeline(folder, device="cpu", dtype="float32", controlnet=ControlNetSpec(str(cn_folder), str(image), scale=0.9))
    settings = resolve_settings(pipe, steps=STEPS, guidance=6.0, sampler="euler", width=SIZE, height=SIZE, strength=0.75)
    pixels = prepare_init_image(Image.open(init).convert("RGB"), SIZE, SIZE)
    got = np.stack([g.pixels for g in generate(pipe, PROMPTS, SEEDS, settings, init_images=[pixels] * 2)])
    assert int(np.abs(got.astype(int) - want.astype(int)).max()) <= MAX_PIXEL_DIFF


def test_a_controlnet_of_another_base_model_is_one_error(tmp_path):
    from gencli.pipelines.diffusion.unet_loading import load_unet_from_folder

    torch.manual_seed(0)
    sd1 = diffusers.UNet2DConditionModel(**UNETS["sd1"]).eval()
    sdxl = diffusers.UNet2DConditionModel(**UNETS["sdxl"]).eval()
    random_controlnet(sdxl).save_pretrained(tmp_path / "xl-cn")
    sd1.save_pretrained(tmp_path / "unet")
    image = control_image(tmp_path / "c.png")
    unet = load_unet_from_folder(tmp_path / "unet", CPU)
    with pytest.raises(UserError, match="another base model"):
        load_controlnet(ControlNetSpec(str(tmp_path / "xl-cn"), str(image)), unet, CPU, 2)
    random_controlnet(sd1).save_pretrained(tmp_path / "cn")
    with pytest.raises(UserError, match="1/2"):  # its image convolutions halve the size once; this VAE's latents are 1/8
        load_controlnet(ControlNetSpec(str(tmp_path / "cn"), str(image)), unet, CPU, 8)


@pytest.mark.parametrize(
    "args,needle",
    [
        ({"controlnet": "x", "image": None, "scale": None, "start": None, "end": None}, "--control-image"),
        ({"controlnet": None, "image": None, "scale": 0.5, "start": None, "end": None}, "--control-scale"),
        ({"controlnet": "x", "image": "y", "scale": float("nan"), "start": None, "end": None}, "--control-scale"),
        ({"controlnet": "x", "image": "y", "scale": 11.0, "start": None, "end": None}, "--control-scale"),
        ({"controlnet": "x", "image": "y", "scale": None, "start": 0.6, "end": 0.4}, "--control-start"),
        ({"controlnet": "x", "image": "y", "scale": None, "start": None, "end": 1.5}, "--control-end"),
    ],
)
def test_flags_that_cannot_hold_are_refused(args, needle):
    with pytest.raises(UserError, match=needle):
        check_control_flags(**args)


def test_cli_draws_with_a_controlnet_and_refuses_bad_input(tmp_path_factory, tmp_path):
    ref = build_reference("sd1")
    folder = save_reference(ref, tmp_path_factory.mktemp("sd1-cli"))
    cn = random_controlnet(ref.unet)
    save_file(to_original(cn, dict(ref.unet.config)), str(tmp_path / "control_tiny.safetensors"))
    image = control_image(tmp_path / "edges.png")
    info = run_cli("info", str(tmp_path / "control_tiny.safetensors"))
    assert info.returncode == 0 and "ControlNetModel (single file, original layout)" in info.stdout, info.stdout + info.stderr
    common = ["-m", str(folder), "a green circle", "--steps", "2", "--width", "16", "--height", "16", "--seed", "1"]
    r = run_cli("txt2img", *common, "--controlnet", str(tmp_path / "control_tiny.safetensors"), "--control-image", str(image), "--control-scale", "0.7",
                "--control-end", "0.5", "-o", str(tmp_path / "a.png"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    from gencli.pipelines.diffusion.png_parameters import read_parameters

    params = read_parameters(tmp_path / "a.png")
    assert "control_tiny [" in params.to_text()
    replay = run_cli("replay", str(tmp_path / "a.png"), "-m", str(folder), "-o", str(tmp_path / "b.png"))
    assert replay.returncode == 0 and "ControlNet 0" in replay.stderr, replay.stderr  # named as not applied
    assert (tmp_path / "b.png").read_bytes() != (tmp_path / "a.png").read_bytes()
    again = run_cli("replay", str(tmp_path / "a.png"), "-m", str(folder), "-o", str(tmp_path / "c.png"), "--controlnet",
                    str(tmp_path / "control_tiny.safetensors"), "--control-image", str(image))  # fmt: skip
    assert again.returncode == 0 and "ControlNet" not in again.stderr, again.stderr
    assert (tmp_path / "c.png").read_bytes() == (tmp_path / "a.png").read_bytes()  # the same PNG, byte for byte
    one_error_line(run_cli("replay", str(tmp_path / "b.png"), "-m", str(folder), "--controlnet", str(tmp_path / "control_tiny.safetensors"),
                           "--control-image", str(image)), "without a ControlNet")  # fmt: skip
    one_error_line(run_cli("txt2img", *common, "--controlnet", str(tmp_path / "control_tiny.safetensors")), "--control-image")
    one_error_line(run_cli("txt2img", *common, "--controlnet", str(tmp_path / "nope"), "--control-image", str(image)), "--controlnet", "nope")
    one_error_line(run_cli("txt2img", *common, "--controlnet", str(folder / "unet"), "--control-image", str(image)), "not a ControlNet")
    one_error_line(run_cli("txt2img", *common, "--controlnet", str(tmp_path / "control_tiny.safetensors"), "--control-image", str(tmp_path / "no.png")),
                   "no.png")  # fmt: skip
    assert not (tmp_path / "txt2img-1.png").exists()
