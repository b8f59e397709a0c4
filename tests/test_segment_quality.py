"""Quality floor of the embedded default segmenter (weights/unet-shapes): mean IoU and pixel accuracy
on held-out shapes-world scenes (test split), through the same path as `gencli segment`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gencli.weights import weights_dir

ROOT = Path(__file__).resolve().parent.parent
MODEL = weights_dir() / "unet-shapes"

pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="weights/unet-shapes is not installed")


@pytest.fixture(scope="module")
def segmenter():
    from gencli.pipelines.segmentation.loading import Segmenter

    return Segmenter.load(MODEL, device="cpu", dtype="float32", threads=1)


@pytest.mark.slow
@pytest.mark.parametrize("size, two", [(64, 1.0), (128, 0.5)])
def test_held_out_mean_iou_floor(segmenter, size, two):
    sys.path.insert(0, str(ROOT / "scripts"))
    from eval_segmenter import MIOU_FLOOR, evaluate

    r = evaluate(segmenter, 40, size, two, offset=7000)
    assert r["pixel_accuracy"] >= 0.95 and r["mean_iou"] >= MIOU_FLOOR, r
