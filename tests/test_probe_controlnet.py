"""ControlNet probes: an original-layout file beside an inpainting UNet, diffusers' ControlNet inpainting
pipeline, shuffle (``global_pool_conditions``) ControlNets under classifier-free guidance, a pipeline's
``--variant`` with a ControlNet folder that lacks it, ControlNets of another base, and replays of PNGs whose
ControlNet text was edited or names another ControlNet."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from _diffusion_fixtures import UNETS, build_reference, reference_scheduler, save_reference
from conftest import one_error_line, run_cli
from PIL import Image, PngImagePlugin
from safetensors.torch import load_file, save_file
from test_controlnet import control_image, random_controlnet, to_original

from gencli.backend.device import Placement
from gencli.errors import Notice, UserError
from gencli.pipelines.diffusion.controlnet import ControlNetSpec, load_controlnet
from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, prepare_mask, resolve_settings

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = Placement(torch.device("cpu"), torch.float32)
PROMPTS = ["a small red star", "a green circle"]
SEEDS = [3, 11]
SIZE = 16


def _pixels(images) -> np.ndarray:
    return np.stack([g.pixels for g in images]).astype(int)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny sd1 and sd1-inpaint pipelines, the 4-channel sd1 ControlNet as a folder and an original file."""
    root = tmp_path_factory.mktemp("cn-probe")
    out = {}
    for family in ("sd1", "sd1-inpaint"):
        out[family] = save_reference(build_reference(family), root / family)
    torch.manual_seed(0)
    base = diffusers.UNet2DConditionModel(**UNETS["sd1"]).eval()
    cn = random_controlnet(base, seed=4)
    cn.save_pretrained(root / "cn")
    save_file(to_original(cn, dict(base.config)), str(root / "control_tiny.safetensors"))
    out["cn"], out["file"] = root / "cn", root / "control_tiny.safetensors"
    out["image"] = control_image(root / "edges.png")
    return out


def test_an_original_file_beside_an_inpainting_unet_reads_4_latent_channels(models):
    """The file's own input convolution (4 channels), not the inpainting UNet's 9: it loads, and its
    residuals are the diffusers folder's."""
    pipe = load_pipeline(models["sd1-inpaint"], device="cpu", dtype="float32")
    assert pipe.is_inpainting
    from_file = load_controlnet(ControlNetSpec(str(models["file"]), str(models["image"])), pipe.unet, CPU, 2).model
    from_folder = load_controlnet(ControlNetSpec(str(models["cn"]), str(models["image"])), pipe.unet, CPU, 2).model
    assert from_file.config.in_channels == 4
    g = torch.Generator().manual_seed(1)
    x, cond, ctx = torch.randn(2, 4, 8, 8, generator=g), torch.rand(2, 3, 16, 16, generator=g), torch.randn(2, 77, 32, generator=g)
    with torch.no_grad():
        (d1, m1), (d2, m2) = from_file(x, 500, ctx, cond, 0.7), from_folder(x, 500, ctx, cond, 0.7)
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(d1, d2)) and (m1 - m2).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["sd1", "sd1-inpaint"])
def test_inpainting_matches_diffusers_controlnet_inpaint_pipeline(family, models):
    ref = diffusers.StableDiffusionControlNetInpaintPipeline.from_pretrained(
        str(models[family]), controlnet=diffusers.ControlNetModel.from_pretrained(str(models["cn"]))
    )
    ref.set_progress_bar_config(disable=True)
    ref.scheduler = reference_scheduler(ref, "ddim")
    rng = np.random.default_rng(1)
    init = (rng.random((SIZE, SIZE, 3)) * 255).astype(np.uint8)
    mask_image = np.zeros((SIZE, SIZE), np.uint8)
    mask_image[2:12, 5:14] = 255
    want = ref(prompt=PROMPTS, image=[Image.fromarray(init)] * 2, mask_image=[Image.fromarray(mask_image)] * 2,
               control_image=Image.open(models["image"]), controlnet_conditioning_scale=0.8, control_guidance_end=0.75, strength=1.0,
               num_inference_steps=4, guidance_scale=6.0, height=SIZE, width=SIZE, generator=[torch.Generator().manual_seed(s) for s in SEEDS],
               output_type="np").images  # fmt: skip
    want = (want * 255).round().astype(int)
    spec = ControlNetSpec(str(models["cn"]), str(models["image"]), 0.8, 0.0, 0.75)
    pipe = load_pipeline(models[family], device="cpu", dtype="float32", controlnet=spec)
    settings = resolve_settings(pipe, steps=4, guidance=6.0, sampler="ddim", width=SIZE, height=SIZE, strength=1.0)
    mask = prepare_mask(Image.fromarray(mask_image), SIZE, SIZE)
    got = _pixels(generate(pipe, PROMPTS, SEEDS, settings, init_images=[init] * 2, masks=[mask] * 2))
    assert int(np.abs(got - want).max()) <= 2


@pytest.mark.parametrize("guidance", [6.0, 1.0])
def test_a_shuffle_controlnet_guides_the_conditional_half_only(guidance, models, tmp_path):
    """``global_pool_conditions``: diffusers (guess mode) and A1111 run it on the conditional half and add
    nothing to the unconditional one."""
    folder = tmp_path / "shuffle"
    shutil.copytree(models["cn"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "global_pool_conditions": True}))
    ref = diffusers.StableDiffusionControlNetPipeline.from_pretrained(str(models["sd1"]), controlnet=diffusers.ControlNetModel.from_pretrained(str(folder)))
    ref.set_progress_bar_config(disable=True)
    ref.scheduler = diffusers.EulerDiscreteScheduler.from_config(ref.scheduler.config)
    want = ref(prompt=PROMPTS, image=Image.open(models["image"]), controlnet_conditioning_scale=0.8, num_inference_steps=4, guidance_scale=guidance,
               height=SIZE, width=SIZE, generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="np").images  # fmt: skip
    want = (want * 255).round().astype(int)
    pipe = load_pipeline(models["sd1"], device="cpu", dtype="float32", controlnet=ControlNetSpec(str(folder), str(models["image"]), 0.8))
    got = _pixels(generate(pipe, PROMPTS, SEEDS, resolve_settings(pipe, steps=4, guidance=guidance, sampler="euler", width=SIZE, height=SIZE)))
    assert int(np.abs(got - want).max()) <= 2


def test_the_pipelines_variant_falls_back_to_a_controlnet_folders_default_weights(models, tmp_path):
    unet = load_pipeline(models["sd1"], device="cpu", dtype="float32").unet
    loaded = load_controlnet(ControlNetSpec(str(models["cn"]), str(models["image"])), unet, CPU, 2, variant="fp16")  # the folder has no fp16 files
    assert [f.name for f in loaded.weight_files] == ["diffusion_pytorch_model.safetensors"]
    shutil.copytree(models["cn"], tmp_path / "cn16")
    plain = tmp_path / "cn16" / "diffusion_pytorch_model.safetensors"
    save_file({k: v.half() for k, v in load_file(str(plain)).items()}, str(tmp_path / "cn16" / "diffusion_pytorch_model.fp16.safetensors"))
    loaded = load_controlnet(ControlNetSpec(str(tmp_path / "cn16"), str(models["image"])), unet, CPU, 2, variant="fp16")
    assert [f.name for f in loaded.weight_files] == ["diffusion_pytorch_model.fp16.safetensors"]


def test_an_sdxl_original_file_or_a_pipeline_folder_is_told_apart(models, tmp_path):
    torch.manual_seed(0)
    sdxl = diffusers.UNet2DConditionModel(**UNETS["sdxl"]).eval()
    save_file(to_original(random_controlnet(sdxl), dict(sdxl.config)), str(tmp_path / "control_xl.safetensors"))
    unet = load_pipeline(models["sd1"], device="cpu", dtype="float32").unet
    with pytest.raises(UserError, match="another base model"):
        load_controlnet(ControlNetSpec(str(tmp_path / "control_xl.safetensors"), str(models["image"])), unet, CPU, 2)
    with pytest.raises(UserError, match="is a diffusers pipeline, not a ControlNet"):
        load_controlnet(ControlNetSpec(str(models["sd1"]), str(models["image"])), unet, CPU, 2)


def _edit(src, dst, old: str, new: str):
    im = Image.open(src)
    text = im.info["parameters"]
    assert old in text, text
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", text.replace(old, new))
    im.save(dst, pnginfo=info)
    return dst


def test_replay_checks_the_pngs_controlnet(models, tmp_path):
    from gencli.pipelines.diffusion.replay import plan_replay

    common = ["--steps", "2", "--width", "16", "--height", "16", "--seed", "1", "--threads", "1"]
    flags = ["--controlnet", str(models["file"]), "--control-image", str(models["image"])]
    made = run_cli("txt2img", "-m", str(models["sd1"]), "a green circle", *common, *flags, "--control-scale", "0.7", "-o", str(tmp_path / "a.png"))
    assert made.returncode == 0, made.stderr
    bad = _edit(tmp_path / "a.png", tmp_path / "bad.png", "Weight: 0.7", "Weight: 20")
    line = one_error_line(run_cli("replay", str(bad), "-m", str(models["sd1"]), "-o", str(tmp_path / "x.png"), *flags), "ControlNet 0 Weight", "20")
    assert "--control-scale" not in line
    other = run_cli("replay", str(tmp_path / "a.png"), "-m", str(models["sd1"]), "-o", str(tmp_path / "b.png"), "--threads", "1",
                    "--controlnet", str(models["cn"]), "--control-image", str(models["image"]))  # fmt: skip
    assert other.returncode == 0 and "ControlNet hash" in other.stderr, other.stderr  # another ControlNet than the PNG's
    same = run_cli("replay", str(tmp_path / "a.png"), "-m", str(models["sd1"]), "-o", str(tmp_path / "c.png"), "--threads", "1", *flags)
    assert same.returncode == 0 and "hash" not in same.stderr, same.stderr
    two = _edit(tmp_path / "a.png", tmp_path / "two.png", 'Guidance End: 1"', 'Guidance End: 1", ControlNet 1: "Module: none, Model: other, Weight: 1"')
    with pytest.warns(Notice, match="ControlNet 1"):
        plan_replay(str(two), model=str(models["sd1"]), seed=None, init_image=None, mask=None, out=None, force=True, vae=None,
                    controlnet=str(models["file"]), control_image=str(models["image"]))  # fmt: skip
    mode = _edit(tmp_path / "a.png", tmp_path / "mode.png", 'Guidance End: 1"', 'Guidance End: 1, Control Mode: ControlNet is more important"')
    with pytest.warns(Notice, match="Control Mode"):
        plan_replay(str(mode), model=str(models["sd1"]), seed=None, init_image=None, mask=None, out=None, force=True, vae=None,
                    controlnet=str(models["file"]), control_image=str(models["image"]))  # fmt: skip
