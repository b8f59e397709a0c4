"""Quality floor of the embedded default classifier (weights/vit-shapes): shape accuracy on held-out
shapes-world scenes (test split), in gencli's auto dtype, through the same path as `gencli classify`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gencli.data import shapes
from gencli.weights import weights_dir

ROOT = Path(__file__).resolve().parent.parent
MODEL = weights_dir() / "vit-shapes"



@pytest.fixture(scope="module")
def classifier():
    from gencli.pipelines.vision.classify import ImageClassifier

    return ImageClassifier.load(MODEL, device="cpu", dtype="auto")


@pytest.mark.slow
def test_held_out_shape_accuracy_at_least_97_percent(classifier):
    sys.path.insert(0, str(ROOT / "scripts"))
    from eval_classifier import evaluate

    result = evaluate(classifier, shapes.split_seeds("test", 480, offset=5000), 64)
    assert result["accuracy"] >= 0.97, result
    # every shape is recognised, not just the average
    assert min(result["per_shape"].values()) >= 0.9, result


@pytest.mark.slow
def test_other_resolutions_through_the_preprocessor(classifier):
    sys.path.insert(0, str(ROOT / "scripts"))
    from eval_classifier import evaluate

    result = evaluate(classifier, shapes.split_seeds("test", 160, offset=9000), 150)
    assert result["accuracy"] >= 0.95, result


def test_default_is_a_transformers_checkpoint_with_shape_labels():
    config = json.loads((MODEL / "config.json").read_text())
    assert config["architectures"] == ["ViTForImageClassification"] and config["model_type"] == "vit"
    assert [config["id2label"][str(i)] for i in range(len(shapes.SHAPES))] == list(shapes.SHAPES)
    pre = json.loads((MODEL / "preprocessor_config.json").read_text())
    assert pre["size"] == {"height": config["image_size"], "width": config["image_size"]}
    readme = (MODEL / "README.md").read_text()
    assert "task: classify" in readme
    size = sum(f.stat().st_size for f in MODEL.iterdir())
    assert size < 6_000_000
