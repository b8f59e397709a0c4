"""The image commands (segment, embed --images, sample) used as a demanding user uses them: models of
more than 256 classes, file names and labels with brackets, output-name patterns, seeds at the top
of their range. Each test fails without its fix."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import one_error_line, shapes_png
from PIL import Image
from typer.testing import CliRunner

from gencli.cli import app

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def invoke(*args, input=None):
    return CliRunner().invoke(app, [*map(str, args)], input=input)


def unet_folder(path, labels: int, favourite: int):
    """A random UNetSegmenter of ``labels`` classes whose every pixel is ``favourite``."""
    from gencli.checkpoints.loader import save_model
    from gencli.models.unet_segmenter import UNetSegmenter, UNetSegmenterConfig

    torch.manual_seed(0)
    cfg = UNetSegmenterConfig(channels=(4, 8), norm_groups=0, id2label={i: "background" if i == 0 else f"class{i}" for i in range(labels)})
    model = UNetSegmenter(cfg)
    model.init_weights()
    with torch.no_grad():
        model.classifier.bias[favourite] += 100.0
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_model(model, path / "model.safetensors")
    return path


# -- segment ------------------------------------------------------------------------------------------
def test_a_mask_of_class_ids_above_255_is_a_16_bit_png(tmp_path, monkeypatch):
    # the mask was made with Image.fromarray(ids, "I;16"), which Pillow 13 refuses: an internal
    # error (exit 1) for every image of a 300-class model with a pixel of class 256 or above
    monkeypatch.chdir(tmp_path)
    model = unet_folder(tmp_path / "unet300", 300, favourite=299)
    shapes_png(tmp_path / "scene.png", 16)
    r = invoke("segment", "-m", model, "scene.png", "-o", "mask.png", "--overlay", "overlay.png", "--json")
    assert r.exit_code == 0, r.output
    record = json.loads(r.stdout)
    assert record["labels"] == [{"id": 299, "label": "class299", "pixels": 256, "fraction": 1.0}]
    mask = Image.open(tmp_path / "mask.png")
    assert mask.mode == "I;16" and np.asarray(mask).dtype == np.uint16
    assert (np.asarray(mask) == 299).all()
    assert Image.open(tmp_path / "overlay.png").size[0] > 16  # the picture and its legend


def test_every_mask_of_a_model_of_more_than_256_classes_has_the_same_format(tmp_path):
    from gencli.pipelines.segmentation.masks import mask_image, png_bytes

    low = np.array([[0, 3], [7, 255]])
    assert mask_image(low).mode == "P"  # a model of few classes: a palette PNG
    for ids in (low, np.array([[0, 256], [65535, 1]])):  # 300 classes: 16-bit, whatever the image holds
        back = Image.open(__import__("io").BytesIO(png_bytes(mask_image(ids, 300))))
        assert back.mode == "I;16"
        assert np.array_equal(np.asarray(back), ids)


def test_segment_table_prints_names_with_brackets_as_they_are(tmp_path, monkeypatch):
    # the table went through rich's markup: 'cat[red].png' printed as 'cat.png', a label '[/]sky'
    # was an internal error (MarkupError, exit 1)
    monkeypatch.chdir(tmp_path)
    model = unet_folder(tmp_path / "unet", 3, favourite=1)
    config = json.loads((model / "config.json").read_text())
    config["id2label"]["1"] = "[/]sky [bold]blue"
    (model / "config.json").write_text(json.dumps(config))
    shapes_png(tmp_path / "cat[red].png", 16)
    r = invoke("segment", "-m", model, "cat[red].png")
    assert r.exit_code == 0, r.output
    assert r.stdout.split() == ["image", "id", "label", "pixels", "fraction", "cat[red].png", "1", "[/]sky", "[bold]blue", "256", "1.0000"]


# -- embed --images -------------------------------------------------------------------------------------
def test_embed_query_table_prints_names_with_brackets_as_they_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shapes_png(tmp_path / "a[bold].png", 32)
    shapes_png(tmp_path / "b[dim].png", 24)
    r = invoke("embed", "--images", "a[bold].png", "b[dim].png", "--query", "a[bold].png")
    assert r.exit_code == 0, r.output
    row = r.stdout.splitlines()[1].split()
    assert row[0] == "a[bold].png" and row[-1] == "b[dim].png", r.stdout


def test_classify_zeroshot_similarity_tables_print_brackets_as_they_are(tmp_path, monkeypatch):
    # the tables went through rich's markup: a label '[/]circle' was an internal error (MarkupError, exit 1),
    # 'cat[red].png' printed as 'cat.png', a text '[b]star' as the column 'star'
    monkeypatch.chdir(tmp_path)
    shapes_png(tmp_path / "cat[red].png", 32)
    r = invoke("zeroshot", "cat[red].png", "--labels", "[/]circle,star")
    assert r.exit_code == 0, r.output
    assert "[/]circle" in r.stdout and "cat[red].png" in r.stdout
    r = invoke("classify", "cat[red].png")
    assert r.exit_code == 0 and r.stdout.splitlines()[1].split()[0] == "cat[red].png", r.output
    r = invoke("similarity", "cat[red].png", "--texts", "[b]star")
    assert r.exit_code == 0, r.output
    assert r.stdout.split()[:3] == ["image", "[b]star", "cat[red].png"], r.stdout


# -- sample vae|gan ------------------------------------------------------------------------------------
def test_sample_gan_pattern_writes_one_file_per_seed(tmp_path, monkeypatch):
    # -o 'x-{seed}.png' wrote one grid named literally 'x-{seed}.png' (sample ddpm fills the pattern)
    monkeypatch.chdir(tmp_path)
    r = invoke("sample", "gan", "--seeds", "3,7", "-o", "x-{seed}.png", "--json")
    assert r.exit_code == 0, r.output
    assert [json.loads(line) for line in r.stdout.splitlines()] == [{"file": "x-3.png", "seed": 3}, {"file": "x-7.png", "seed": 7}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-3.png", "x-7.png"]
    assert invoke("sample", "gan", "--seeds", "7", "--out-dir", "alone").exit_code == 0
    same = [np.asarray(Image.open(p)) for p in (tmp_path / "alone" / "gan-seed7.png", tmp_path / "x-7.png")]
    assert np.array_equal(*same)  # the image a seed always gives
    r = invoke("sample", "vae", "--seeds", "1,2", "--interpolate", "3", "-o", "walk-{i:02d}.png", "--json")
    assert r.exit_code == 0, r.output
    assert [json.loads(line)["file"] for line in r.stdout.splitlines()] == ["walk-00.png", "walk-01.png", "walk-02.png"]
    assert Image.open(tmp_path / "walk-01.png").size == (64, 64)


@pytest.mark.parametrize(
    "args, needles",
    [
        (("--seeds", "3,7", "-o", "x-{foo}.png"), ("unknown placeholder {foo}",)),
        (("--seeds", "3,3", "-o", "x-{seed}.png"), ("x-3.png",)),
        (("--seeds", "3,7", "-o", "x-{i}.png", "--nrow", "2"), ("--nrow",)),
        (("--seeds", "3,7", "--interpolate", "3", "-o", "w-{seed}.png"), ("{i}",)),
        (("--seeds", "3,7", "--interpolate", "3", "--gif", "-o", "w-{i}.gif"), ("--gif",)),
        (("--seeds", "3,7", "-o", "x-{i}.txt"), ("'.txt'",)),
    ],
)
def test_sample_gan_bad_patterns_are_one_error_and_write_nothing(tmp_path, monkeypatch, args, needles):
    monkeypatch.chdir(tmp_path)
    one_error_line(invoke("sample", "gan", *args), *needles)
    assert not list(tmp_path.iterdir())


def test_a_literal_brace_in_an_output_name_is_written_once(tmp_path, monkeypatch):
    # a brace is doubled in a pattern ({{ for {): the name without placeholders kept it doubled
    monkeypatch.chdir(tmp_path)
    assert invoke("sample", "gan", "--seeds", "3", "-o", "a{{1}}.png").exit_code == 0
    assert invoke("sample", "ddpm", "--seeds", "3", "--steps", "1", "-o", "b{{1}}.png").exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a{1}.png", "b{1}.png"]


def test_a_walk_from_a_seed_near_the_top_of_the_range_runs(tmp_path, monkeypatch):
    # --interpolate walks from S to S+1, but the seeds were first checked as a 16-image grid:
    # '--seed 4294967290 --interpolate 2' was refused with '--seed 4294967290 with -n 16'
    monkeypatch.chdir(tmp_path)
    r = invoke("sample", "gan", "--seed", "4294967290", "--interpolate", "2", "-o", "w.png", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["seeds"] == [4294967290, 4294967291]
    line = one_error_line(invoke("sample", "gan", "--seed", "4294967295", "--interpolate", "2", "-o", "w2.png"), "--interpolate")
    assert "-n 16" not in line
    one_error_line(invoke("sample", "gan", "--interpolate", "3", "-n", "0", "-o", "w3.png"), "-n does not apply")
