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
