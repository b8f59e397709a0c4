"""The embedded default CLIP: its files load in transformers, its training data kept the evaluation
honest, and its zero-shot accuracy stays above floors set from the measured figures
(scripts/eval_clip.py; README of weights/clip-shapes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from gencli.data import shapes, shapes_clip
from gencli.weights import weights_dir

WEIGHTS = weights_dir() / "clip-shapes"

# Floors, a few points under the accuracy measured on these same scenes (the weights README:
# 99.1 / 100.0 / 98.8 % on ordinary scenes, 93.2 / 99.4 / 95.1 % on the held-out colour+shape pairs).
FLOORS = {"shape": 0.96, "colour": 0.97, "colour+shape": 0.95}
FLOORS_HELD_OUT = {"shape": 0.89, "colour": 0.96, "colour+shape": 0.91}


def test_embedded_weights_are_present():
    # the checks below must fail, never skip, when the default is missing
    for name in ("config.json", "model.safetensors", "vocab.json", "merges.txt", "preprocessor_config.json", "README.md"):
        assert (WEIGHTS / name).is_file(), name
    assert "task: zeroshot" in (WEIGHTS / "README.md").read_text()


@pytest.fixture(scope="module")
def bundle():
    from gencli.pipelines.clip import zeroshot as zs

    return zs.load(WEIGHTS, device="cpu", dtype="auto")


@pytest.mark.slow
def test_zero_shot_accuracy_floors(bundle):
    from gencli.pipelines.clip import zeroshot as zs

    def enc_images(arrays):
        return zs.encode_images(bundle, [Image.fromarray(a) for a in arrays])

    sets = shapes_clip.label_sets()
    ordinary = shapes_clip.evaluate(enc_images, bundle.encode_texts, shapes_clip.eval_scenes("test", 1000), sets)
    held = shapes_clip.evaluate(enc_images, bundle.encode_texts, shapes_clip.eval_scenes("test", 800, held_out=True, offset=500_000), sets)
    for name, floor in FLOORS.items():
        assert ordinary[name] >= floor, (name, ordinary)
    for name, floor in FLOORS_HELD_OUT.items():
        assert held[name] >= floor, (name, held)


def test_files_are_a_transformers_clip_with_matching_tokenizer(bundle):
    transformers = pytest.importorskip("transformers")
    ref = transformers.CLIPModel.from_pretrained(str(WEIGHTS), dtype=torch.float32).eval()
    tok = transformers.CLIPTokenizer.from_pretrained(str(WEIGHTS))
    prompts = ["a photo of a purple heart.", "A Large RED star, at the top-left!", "ünïcödé 123"]
    for p in prompts:
        assert bundle.tokenizer.encode(p) == tok(p)["input_ids"]
    cfg = json.loads((WEIGHTS / "config.json").read_text())
    assert cfg["text_config"]["eos_token_id"] == bundle.tokenizer.eos_token_id
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image = shapes.render(shapes.split_seeds("test", 1)[0], 100).pil()
    px = CLIPImageProcessorPil.from_pretrained(str(WEIGHTS))(image, return_tensors="pt")["pixel_values"]
    assert torch.equal(bundle.processor([image]), px)
    # transformers' model on these files gives the same cosines (gencli here in its auto dtype)
    from gencli.pipelines.clip import zeroshot as zs

    labels = [f"a {s} on a plain background" for s in shapes.SHAPES]
    with torch.no_grad():
        inputs = tok(labels, padding=True, return_tensors="pt")
        text = ref.get_text_features(**inputs).pooler_output
        img = ref.get_image_features(pixel_values=px).pooler_output
    want = torch.nn.functional.normalize(img, dim=-1) @ torch.nn.functional.normalize(text, dim=-1).t()
    got = torch.as_tensor(zs.encode_images(bundle, [image])).float() @ torch.as_tensor(bundle.encode_texts(labels)).float().t()
    assert (got - want).abs().max() < 0.02 and got.argmax() == want.argmax()


def test_held_out_pairs_and_label_prompts_never_appear_in_training():
    pairs = set(shapes_clip.HELD_OUT_PAIRS)
    assert len({c for c, _ in pairs}) == len({s for _, s in pairs}) == len(pairs) == 8 == len(shapes.SHAPES)
    captions = set()
    rng = np.random.default_rng(0)
    for i, (seed, scene, caption) in enumerate(shapes_clip.training_pairs(0)):
        if i == 3000:
            break
        assert not any((o.colour, o.shape) in pairs for o in scene.objects)
        captions.add(caption.lower())
        for variant, caption in shapes_clip.contrastive_group(seed, scene):
            assert not any((o.colour, o.shape) in pairs for o in variant.objects)
            captions.add(caption.lower())
            partial, attrs = shapes_clip.partial_caption(variant, rng)
            assert shapes_clip.caption_matches(attrs, variant) and ("shape" in attrs) != ("colour" in attrs)
            captions.add(partial.lower())
    for s in shapes_clip.label_sets():
        for label in s.labels:
            assert s.template.format(label).lower() not in captions
    # and the held-out evaluation scenes are exactly those pairs
    for scene in shapes_clip.eval_scenes("test", 16, held_out=True):
        assert (scene.main.colour, scene.main.shape) in pairs and len(scene.objects) == 1
