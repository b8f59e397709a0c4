"""`gencli segment` end to end: masks, overlays, JSON lines and tables, and bad inputs, on tiny
random SegFormer and U-Net checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import one_error_line
from PIL import Image
from test_segment_models import SHAPE_LABELS, tiny_segformer, tiny_unet
from typer.testing import CliRunner

from gencli.cli import app

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def seg_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("segformer")
    # no resize: the model sees each image at its own (odd) size; ImageNet mean/std
    model = tiny_segformer(path, preprocessor={"image_processor_type": "SegformerImageProcessor", "do_resize": False})
    return path, model


@pytest.fixture(scope="module")
def unet_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("unet") / "unet"
    return path, tiny_unet(path)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from gencli.data import shapes

    root = tmp_path_factory.mktemp("images")
    for i, (seed, size) in enumerate(zip(shapes.split_seeds("test", 3), [(53, 37), (48, 64), 40])):
        shapes.render(seed, size).pil().save(root / f"img{i}.png")
    return root


# -- the command ---------------------------------------------------------------------------------------------
def invoke(*args, input=None):
    return CliRunner().invoke(app, ["segment", *map(str, args)], input=input)


def test_json_lines_masks_and_overlays(seg_dir, images, tmp_path):
    path, _ = seg_dir
    r = invoke(images / "img0.png", images / "img1.png", "--model", path, "--dtype", "float32", "--json",
               "-o", tmp_path / "{stem}-mask.png", "--overlay", tmp_path / "{stem}-overlay.png")  # fmt: skip
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["image"] for x in lines] == [str(images / "img0.png"), str(images / "img1.png")]
    for rec, size in zip(lines, [(53, 37), (48, 64)]):
        mask = Image.open(rec["mask"])
        assert mask.mode == "P" and mask.size == size
        ids = np.asarray(mask)
        assert {x["id"] for x in rec["labels"]} == set(np.unique(ids).tolist())
        assert sum(x["pixels"] for x in rec["labels"]) == ids.size
        assert set(rec["labels"][0]) == {"id", "label", "pixels", "fraction"}
        ov = Image.open(rec["overlay"])
        assert ov.mode == "RGB" and ov.size[1] >= size[1] and ov.size[0] > size[0]  # the legend on the right


def test_table_and_out_dir(seg_dir, images, tmp_path):
    path, _ = seg_dir
    r = invoke(images, "--model", path, "--out-dir", tmp_path / "masks")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "masks").iterdir()) == ["img0.png", "img1.png", "img2.png"]
    assert "fraction" in r.stdout and "img2.png" in r.stdout


def test_unet_model_through_the_command(unet_dir, images, tmp_path):
    path, _ = unet_dir
    r = invoke(images / "img2.png", "--model", path, "-o", tmp_path / "m.png", "--json")
    assert r.exit_code == 0, r.output
    assert np.asarray(Image.open(tmp_path / "m.png")).shape == (40, 40)
    assert all(x["label"] in SHAPE_LABELS.values() for x in json.loads(r.stdout)["labels"])


def test_unreadable_image_reported_others_go_on_exit_2(seg_dir, images, tmp_path):
    path, _ = seg_dir
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    r = invoke(images / "img0.png", bad, images / "img1.png", "--model", path, "--json", "-o", tmp_path / "{stem}.mask.png")
    assert r.exit_code == 2
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [("error" in x) for x in lines] == [False, True, False]
    assert (tmp_path / "img0.mask.png").exists() and (tmp_path / "img1.mask.png").exists() and not (tmp_path / "broken.mask.png").exists()
    assert "broken.png" in r.stderr and "1 of 3" in r.stderr


def test_checkpoint_of_another_family_names_its_command(images, tmp_path):
    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=16, patch_size=8, num_labels=2)
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path / "vit")
    r = invoke(images / "img0.png", "--model", tmp_path / "vit")
    one_error_line(r, "ViTForImageClassification", "gencli classify")


def test_existing_output_without_force_is_refused_before_any_work(seg_dir, images, tmp_path):
    path, _ = seg_dir
    (tmp_path / "img1.png").write_bytes(b"keep")
    r = invoke(images / "img0.png", images / "img1.png", "--model", path, "--out-dir", tmp_path)
    one_error_line(r, "already exists", "--force")
    assert not (tmp_path / "img0.png").exists() and (tmp_path / "img1.png").read_bytes() == b"keep"
    r = invoke(images / "img0.png", images / "img1.png", "--model", path, "--out-dir", tmp_path, "--force")
    assert r.exit_code == 0, r.output
    assert Image.open(tmp_path / "img1.png").mode == "P"


def test_overlay_and_output_usage_errors(seg_dir, images, tmp_path):
    path, _ = seg_dir
    # one overlay file for several images: no single mask to draw on it
    one_error_line(invoke(images / "img0.png", images / "img1.png", "--model", path, "--overlay", tmp_path / "o.png"), "--overlay", "{stem}")
    one_error_line(invoke(images / "img0.png", "--model", path, "--overlay"), "--overlay")
    one_error_line(invoke(images / "img0.png", images / "img1.png", "--model", path, "-o", tmp_path / "m.png"), "--out", "{stem}")
    one_error_line(invoke(images / "img0.png", "--model", path, "-o", tmp_path / "m.jpg"), ".png")
    one_error_line(invoke(images / "img0.png", "--model", path, "-o", tmp_path / "x.png", "--overlay", tmp_path / "x.png"), "both")
    one_error_line(invoke(images / "img0.png", "--model", path, "-o", tmp_path / "m.png", "--out-dir", tmp_path), "not both")
    assert list(tmp_path.iterdir()) == []


def test_the_embedded_default_names_the_shapes(tmp_path):
    from gencli.data import shapes
    from gencli.weights import weights_dir

    if not (weights_dir() / "unet-shapes" / "model.safetensors").is_file():
        pytest.skip("weights/unet-shapes is not installed")
    seeds = shapes.split_seeds("test", 4, offset=300)
    for i, seed in enumerate(seeds):
        shapes.render(seed, 64 + 32 * (i % 2), n_objects=1 + i % 2).pil().save(tmp_path / f"s{i}.png")
    r = invoke(*[tmp_path / f"s{i}.png" for i in range(4)], "--json", "-o", tmp_path / "{stem}-mask.png")
    assert r.exit_code == 0, r.output
    for i, (seed, line) in enumerate(zip(seeds, r.stdout.splitlines())):
        scene = shapes.make_scene(seed, n_objects=1 + i % 2)
        found = {x["label"] for x in json.loads(line)["labels"] if x["fraction"] >= 0.005}  # not a few stray pixels
        assert {o.shape for o in scene.objects} | {"background"} == found, (scene.caption(), found)


def test_a_missing_default_names_the_model_option(images, tmp_path, monkeypatch):
    monkeypatch.setenv("GENCLI_WEIGHTS", str(tmp_path))
    one_error_line(invoke(images / "img0.png"), "unet-shapes", "--model")


def test_an_image_too_small_for_the_model_is_reported_and_the_others_go_on(unet_dir, images, tmp_path):
    path, _ = unet_dir
    Image.new("RGB", (3, 5), (10, 200, 30)).save(tmp_path / "tiny.png")
    r = invoke(images / "img2.png", tmp_path / "tiny.png", "--model", path, "--json")
    assert r.exit_code == 2
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert "labels" in lines[0] and "too small" in lines[1]["error"]
