"""`gencli classify` end to end: inputs (files, directories, stdin), table and JSON output, per-file
errors and exit codes, on a small random checkpoint in transformers' layout."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_scene_folder
from typer.testing import CliRunner

from gencli.cli import app

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8,
        num_labels=4, id2label={0: "zero", 1: "one", 2: "two", 3: "three"}, label2id={"zero": 0, "one": 1, "two": 2, "three": 3},
    )  # fmt: skip
    transformers.ViTForImageClassification(cfg).save_pretrained(path, safe_serialization=True)
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    ViTImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_scene_folder(tmp_path_factory.mktemp("images"), [48, 56, 64])


def invoke(*args, input=None):
    return CliRunner().invoke(app, ["classify", *map(str, args)], input=input)


def test_json_lines_per_image_with_top_k(model_dir, images):
    r = invoke(images / "img0.png", images / "img1.png", "--model", model_dir, "--json", "--top-k", "3", "--dtype", "float32")
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["image"] for x in lines] == [str(images / "img0.png"), str(images / "img1.png")]
    for line in lines:
        preds = line["predictions"]
        assert len(preds) == 3 and set(preds[0]) == {"label", "id", "score"}
        assert preds[0]["label"] == ["zero", "one", "two", "three"][preds[0]["id"]]
        assert preds[0]["score"] >= preds[1]["score"] >= preds[2]["score"]
    # scores are the softmax over all labels: top-4 sums to one
    r = invoke(images / "img0.png", "--model", model_dir, "--json", "--top-k", "10", "--dtype", "float32")
    preds = json.loads(r.stdout)["predictions"]
    assert len(preds) == 4 and abs(sum(p["score"] for p in preds) - 1) < 1e-4


def test_batching_does_not_change_results(model_dir, images):
    common = [images, "--model", model_dir, "--json", "--dtype", "float32", "--recursive"]
    one = invoke(*common, "--batch-size", "1")
    many = invoke(*common, "--batch-size", "8")
    assert one.exit_code == many.exit_code == 0
    a = [json.loads(x) for x in one.stdout.splitlines()]
    b = [json.loads(x) for x in many.stdout.splitlines()]
    assert len(a) == 4 and any(x["image"].endswith("deep.jpg") for x in a)
    for x, y in zip(a, b):
        assert x["image"] == y["image"] and x["predictions"][0]["id"] == y["predictions"][0]["id"]
        assert abs(x["predictions"][0]["score"] - y["predictions"][0]["score"]) < 1e-4


def test_directories_descend_only_with_recursive(model_dir, images):
    flat = invoke(images, "--model", model_dir, "--json", "-k", "1")
    deep = invoke(images, "--model", model_dir, "--json", "-k", "1", "--recursive")
    assert flat.exit_code == deep.exit_code == 0
    names = lambda r: sorted(json.loads(x)["image"].rsplit("/", 1)[-1] for x in r.stdout.splitlines())  # noqa: E731
    assert names(flat) == ["img0.png", "img1.png", "img2.png"]
    assert names(deep) == ["deep.jpg", "img0.png", "img1.png", "img2.png"]


def test_paths_from_stdin_and_table_output(model_dir, images):
    r = invoke("-", "--model", model_dir, "-k", "2", input=f"{images / 'img2.png'}\n{images / 'img0.png'}\n")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.index("img2.png") < out.index("img0.png")
    assert "label" in out and "score" in out and any(w in out for w in ("zero", "one", "two", "three"))


def test_unreadable_file_reported_and_rest_processed_exit_2(model_dir, images, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    r = invoke(images / "img0.png", bad, tmp_path / "missing.jpg", images / "img1.png", "--model", model_dir, "--json")
    assert r.exit_code == 2
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [("error" in x) for x in lines] == [False, True, True, False]
    assert "broken.png" in r.stderr and "missing.jpg" in r.stderr and "2 of 4" in r.stderr


def test_bad_usage_exits_2_with_one_line(model_dir, images, tmp_path):
    r = invoke(images / "img0.png", "--model", model_dir, "--top-k", "0")
    assert r.exit_code == 2
    r = invoke(images / "img0.png", "--model", tmp_path / "nowhere")
    assert r.exit_code == 2 and "does not exist" in r.stderr
    r = invoke(tmp_path, "--model", model_dir)  # an empty directory: nothing to classify
    assert r.exit_code == 2 and f"no input files of a type it reads in directory '{tmp_path}'" in r.stderr, r.stderr


def test_help_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; from gencli.cli import app; sys.argv=['gencli','classify','--help']\n"
        "try:\n    app()\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"
