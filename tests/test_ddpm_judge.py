"""The geometric judge of scripts/eval_generative.py: real shapes-world scenes match the shape
templates, degraded ones (blurred, warped into blobs, empty) do not."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from gencli.data import shapes

ROOT = Path(__file__).resolve().parent.parent
N = 48


@pytest.fixture(scope="module")
def judge():
    sys.path.insert(0, str(ROOT))
    from scripts.eval_generative import GeometricJudge

    return GeometricJudge()


@pytest.fixture(scope="module")
def scenes():
    return shapes.render_batch(shapes.split_seeds("test", N), 64)


def _blur(images: np.ndarray, sigma: float) -> np.ndarray:
    from scipy import ndimage

    return ndimage.gaussian_filter(images.astype(np.float64), (0, sigma, sigma, 0)).round().astype(np.uint8)


def _warp(images: np.ndarray, amplitude: float, seed: int = 0) -> np.ndarray:
    """Each image resampled along a smooth random displacement field of ``amplitude`` pixels (RMS)."""
    from scipy import ndimage

    rng = np.random.default_rng(seed)
    out = np.empty_like(images)
    yy, xx = np.mgrid[0 : images.shape[1], 0 : images.shape[2]].astype(np.float64)
    for i, im in enumerate(images):
        dy, dx = (ndimage.gaussian_filter(rng.normal(size=im.shape[:2]), 4) for _ in range(2))
        dy, dx = dy * amplitude / dy.std(), dx * amplitude / dx.std()
        for c in range(3):
            out[i, ..., c] = ndimage.map_coordinates(im[..., c].astype(np.float64), [yy + dy, xx + dx], order=1, mode="nearest").round()
    return out


def test_real_scenes_match_and_their_shapes_are_named(judge, scenes):
    images, truth = scenes
    report = judge.judge(images)
    assert report["matching"] >= 0.95 and report["empty"] == 0.0
    singles = [(judge.judge_image(im), sc) for im, sc in zip(images, truth) if len(sc.objects) == 1]
    assert singles and all(r["shapes"] == [sc.main.shape] for r, sc in singles)
    assert all(r["objects"] == 1 for r, _ in singles)


def test_blurred_warped_and_empty_images_do_not(judge, scenes):
    images, truth = scenes
    assert judge.judge(_blur(images, 2.5))["matching"] <= 0.05
    assert judge.judge(_warp(images, 3.0))["matching"] <= 0.25
    empty = np.stack([np.full_like(im, sc.background_rgb) for im, sc in zip(images, truth)])
    report = judge.judge(empty)
    assert report["matching"] == 0.0 and report["empty"] == 1.0


def test_eval_generative_judges_a_ddpm_pipeline_folder(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    import torch

    sys.path.insert(0, str(ROOT))
    from scripts import eval_generative

    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(sample_size=16, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, attention_head_dim=8,
                                 down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"))  # fmt: skip
    diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=20)).save_pretrained(tmp_path / "p")
    report = eval_generative.evaluate("ddpm", str(tmp_path / "p"), 6, [2.0, 3.0], threads=1, sampler="ddim")
    assert [s["steps"] for s in report["samples"]] == [2, 3]
    assert all(0.0 <= s["geometric"]["matching"] <= 1.0 and s["n"] == 6 for s in report["samples"])
    assert "matching a shape (IoU >= 0.8)" in eval_generative.markdown(report)
