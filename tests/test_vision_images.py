"""Image inputs: reading files, the reference preprocessing (bit-identical to transformers' PIL image
processors), and the per-file loop of the image commands."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest
from PIL import Image

from gencli.cli.images import write_predictions
from gencli.console import Reporter
from gencli.errors import UserError
from gencli.pipelines.vision.images import ImageProcessor, ImageReadError, image_paths, load_image, predict_image_files

transformers = pytest.importorskip("transformers")
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.deit.image_processing_pil_deit import DeiTImageProcessorPil  # noqa: E402
from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil  # noqa: E402


@pytest.fixture(scope="module")
def photos():
    """Random images of awkward sizes (smaller and larger than the crops, odd, non-square)."""
    rng = np.random.default_rng(0)
    sizes = [(50, 70), (300, 200), (224, 224), (17, 33), (481, 640), (231, 97), (1, 5)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


REFERENCE_CASES = [
    (ViTImageProcessorPil, {}),
    (ViTImageProcessorPil, {"size": {"height": 48, "width": 64}, "resample": 3}),
    (ViTImageProcessorPil, {"size": 32, "resample": 0, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}),
    (ViTImageProcessorPil, {"do_rescale": False, "image_mean": [100, 110, 120], "image_std": [50, 60, 70]}),
    (ViTImageProcessorPil, {"do_normalize": False, "resample": 4}),
    (DeiTImageProcessorPil, {}),
    (CLIPImageProcessorPil, {}),
    (CLIPImageProcessorPil, {"size": {"shortest_edge": 40}, "crop_size": {"height": 64, "width": 48}}),
    (CLIPImageProcessorPil, {"size": {"shortest_edge": 200, "longest_edge": 300}, "crop_size": 150, "resample": 1}),
    (CLIPImageProcessorPil, {"size": 30, "crop_size": 64, "resample": 5}),  # crop larger than the image: zero padding
]


@pytest.mark.parametrize("cls,kwargs", REFERENCE_CASES, ids=lambda v: v.__name__ if isinstance(v, type) else json.dumps(v, sort_keys=True))
def test_pixel_values_identical_to_transformers(tmp_path, photos, cls, kwargs):
    ref = cls(**kwargs)
    ref.save_pretrained(tmp_path)
    ours = ImageProcessor.from_pretrained(tmp_path)
    for im in photos:
        want = ref(im, return_tensors="pt")["pixel_values"]
        got = ours([im])
        assert got.dtype == want.dtype and got.shape == want.shape
        assert bool((got == want).all()), (cls.__name__, kwargs, im.size, (got - want).abs().max())
        assert ours.output_size(im.height, im.width) == tuple(want.shape[-2:])


def test_processor_fields_left_out_take_the_class_defaults(tmp_path, photos):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "CLIPImageProcessor"}))
    ours = ImageProcessor.from_pretrained(tmp_path)
    assert ours.size == {"shortest_edge": 224} and ours.crop_size == {"height": 224, "width": 224} and ours.resample == 3
    want = CLIPImageProcessorPil()(photos[1], return_tensors="pt")["pixel_values"]
    assert bool((ours([photos[1]]) == want).all())
    # legacy feature-extractor configs: size as an int
    legacy = ImageProcessor.from_dict({"feature_extractor_type": "ViTFeatureExtractor", "size": 32})
    assert legacy.size == {"height": 32, "width": 32}
    assert ImageProcessor.from_dict(legacy.to_dict()) == legacy


def test_rgba_images_are_composited_on_white_like_the_reference(tmp_path):
    rgba = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 30, 4), dtype=np.uint8), "RGBA")
    rgba.save(tmp_path / "a.png")
    img = load_image(tmp_path / "a.png")
    assert img.mode == "RGB"
    ref = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size=32)
    ref.save_pretrained(tmp_path)
    want = ref(rgba, return_tensors="pt")["pixel_values"]
    assert bool((ImageProcessor.from_pretrained(tmp_path)([img]) == want).all())


def test_processor_config_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="preprocessor_config.json"):
        ImageProcessor.from_pretrained(tmp_path)
    with pytest.raises(UserError, match="resample"):
        ImageProcessor.from_dict({"resample": 9})
    with pytest.raises(UserError, match="size"):
        ImageProcessor.from_dict({"size": {"depth": 3}})
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        ImageProcessor.from_pretrained(tmp_path)


def test_load_image_applies_exif_orientation_and_converts_to_rgb(tmp_path):
    arr = np.zeros((20, 40, 3), dtype=np.uint8)
    arr[:, :20] = (255, 0, 0)  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.fromarray(arr).save(tmp_path / "rot.jpg", exif=exif.tobytes(), quality=95)
    img = load_image(tmp_path / "rot.jpg")
    assert img.size == (20, 40)  # width and height swapped
    top = np.asarray(img)[:5].reshape(-1, 3).mean(0)
    assert top[0] > 200 and top[1] < 60  # the red half is now at the top
    Image.fromarray(np.full((8, 8), 100, np.uint8), "L").save(tmp_path / "gray.png")
    g = load_image(tmp_path / "gray.png")
    assert g.mode == "RGB" and np.asarray(g)[0, 0].tolist() == [100, 100, 100]


def test_unreadable_files_raise_a_clear_user_error(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"this is not an image")
    good = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(good, "PNG")
    (tmp_path / "cut.png").write_bytes(good.getvalue()[:60])
    for name, pattern in [("bad.png", "not an image"), ("cut.png", "decode|not an image"), ("missing.png", "no such file")]:
        with pytest.raises(ImageReadError, match=pattern) as info:
            load_image(tmp_path / name)
        assert isinstance(info.value, UserError) and name in str(info.value)


def _predict(images):
    return [[{"label": f"w{im.width}", "id": im.width, "score": 1.0}] for im in images]


def _classify(inputs, report, *, recursive=False, batch_size=16):
    """The image commands' loop: paths, batched predictions, then the output (JSON lines with --json)."""
    paths = image_paths(inputs, recursive=recursive)
    fmt = "json" if report.json else "table"
    return write_predictions(predict_image_files(paths, _predict, batch_size=batch_size), len(paths), report, "classifying", fmt)


def test_image_loop_reports_failures_per_file_and_exits_2_at_the_end(tmp_path, capsys):
    for i, w in enumerate([10, 11, 12]):
        Image.new("RGB", (w, 8)).save(tmp_path / f"{i}.png")
    (tmp_path / "1b.png").write_text("broken")
    (tmp_path / "notes.txt").write_text("not an image, not picked from a directory")
    sub = tmp_path / "sub"
    sub.mkdir()
    Image.new("RGB", (13, 8)).save(sub / "deep.jpg")
    with pytest.raises(UserError, match="1 of 5"):
        _classify([str(tmp_path)], Reporter(json=True, quiet=True), recursive=True, batch_size=2)
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["image"].split("/")[-1] for line in lines] == ["0.png", "1.png", "1b.png", "2.png", "deep.jpg"]
    assert lines[2]["error"] and "predictions" not in lines[2]
    assert lines[0]["predictions"] == [{"label": "w10", "id": 10, "score": 1.0}]
    assert "1b.png" in err
    # without --recursive a directory contributes only its own images
    assert len(image_paths([str(tmp_path)])) == 4


def test_image_loop_reads_paths_from_stdin_and_prints_a_table(tmp_path, capsys, monkeypatch):
    paths = []
    for w in (20, 21):
        p = tmp_path / f"{w}.png"
        Image.new("RGB", (w, 8)).save(p)
        paths.append(str(p))
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(paths) + "\n\n"))
    n = _classify(["-"], Reporter(quiet=True), batch_size=8)
    assert n == 2
    out = capsys.readouterr().out
    assert "w20" in out and "w21" in out and "20.png" in out
