"""The embedded ControlNet (weights/controlnet-shapes): found by its name, and it draws the prompt's shape
where and as large as the outline says, which the base model alone does not."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from gencli.data import shapes
from gencli.data.shapes_txt2img import judge_image, object_mask, outline

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_outline_places_the_shape(tmp_path):
    from gencli.pipelines.diffusion.controlnet import ControlNetSpec, load_controlnet, resolve_controlnet
    from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, resolve_settings
    from gencli.weights import weights_dir

    assert resolve_controlnet("controlnet-shapes") == weights_dir() / "controlnet-shapes"
    pipe = load_pipeline(weights_dir() / "txt2img-shapes", device="cpu", dtype="float32")
    with_iou, without_iou = [], []
    for i, seed in enumerate(shapes.split_seeds("test", 4, offset=70_000)):
        scene = shapes.make_scene(seed, n_objects=1)
        obj = scene.objects[0]
        prompt = f"a {obj.colour} {obj.shape} on a {scene.background} background"
        Image.fromarray(outline(scene)).convert("RGB").save(tmp_path / f"{i}.png")
        truth = shapes.render_mask(scene, 64) > 0
        for store, control in ((without_iou, None), (with_iou, ControlNetSpec("controlnet-shapes", str(tmp_path / f"{i}.png")))):
            pipe.controlnet = load_controlnet(control, pipe.unet, pipe.placement, 4) if control else None
            image = generate(pipe, [prompt], [i], resolve_settings(pipe, steps=12))[0].pixels
            drawn, _ = object_mask(image)
            store.append((drawn & truth).sum() / max(1, (drawn | truth).sum()))
            if control is not None:
                assert judge_image(image, obj.shape)["colour"] == obj.colour, prompt  # the prompt still picks the colour
    assert np.mean(with_iou) > 0.5 and np.mean(with_iou) > np.mean(without_iou) + 0.3, (with_iou, without_iou)


def test_diffusers_reads_the_folder_and_computes_the_same_residuals(tmp_path):
    import torch

    diffusers = pytest.importorskip("diffusers")
    from gencli.backend.device import Placement
    from gencli.pipelines.diffusion.controlnet import ControlNetSpec, load_controlnet
    from gencli.pipelines.diffusion.unet_loading import load_unet_from_folder
    from gencli.weights import weights_dir

    ref = diffusers.ControlNetModel.from_pretrained(str(weights_dir() / "controlnet-shapes")).eval()
    cpu = Placement(torch.device("cpu"), torch.float32)
    scene = shapes.make_scene(shapes.split_seeds("test", 1, offset=70_000)[0], n_objects=1)
    Image.fromarray(outline(scene)).convert("RGB").save(tmp_path / "c.png")
    unet = load_unet_from_folder(weights_dir() / "txt2img-shapes" / "unet", cpu)
    ours = load_controlnet(ControlNetSpec("controlnet-shapes", str(tmp_path / "c.png")), unet, cpu, 4)
    g = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(1, 4, 16, 16, generator=g), torch.randn(1, 77, 128, generator=g)
    cond = ours.condition(64, 64, 1)
    with torch.no_grad():
        want_down, want_mid = ref(x, 500, ctx, cond, return_dict=False)
        down, mid = ours.model(x, 500, ctx, cond)
    assert max(float((a - b).abs().max()) for a, b in zip(down, want_down)) < 1e-4
    assert float((mid - want_mid).abs().max()) < 1e-4 and float(want_mid.abs().max()) > 1e-3
