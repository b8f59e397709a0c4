"""The GAN training recipe of scripts/train_gan.py (what reproduces weights/gan-shapes): its
differentiable augmentation, and a two-step run that judges, keeps the best checkpoint and exports a
folder that `gencli sample gan` loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def train_gan():
    sys.path.insert(0, str(ROOT))
    from scripts import train_gan

    return train_gan


def test_translation_moves_content_by_at_most_an_eighth(train_gan):
    x = -torch.ones(6, 3, 64, 64)
    x[:, :, 30, 20] = 1.0  # one bright pixel
    y = train_gan.diff_augment(x, ("translation",), torch.Generator().manual_seed(0))
    assert y.shape == x.shape
    moved = []
    for img in y:
        r, c = (img[0] == 1.0).nonzero()[0].tolist()
        assert abs(r - 30) <= 8 and abs(c - 20) <= 8
        moved.append((r, c))
    assert len(set(moved)) > 1  # each image draws its own shift
    assert ((y == 1.0).sum(dim=(1, 2, 3)) == 3).all()  # the pixel is moved, not lost or copied


def test_cutout_blanks_one_half_side_square_and_keeps_gradients(train_gan):
    x = (torch.rand(4, 3, 64, 64) + 0.5).requires_grad_()  # no zeros of its own
    y = train_gan.diff_augment(x, ("cutout",), torch.Generator().manual_seed(1))
    zeros = (y == 0).all(dim=1)  # (B, H, W)
    assert (zeros.sum(dim=(1, 2)) == 32 * 32).all()
    rows, cols = zeros.any(2), zeros.any(1)
    assert (rows.sum(1) == 32).all() and (cols.sum(1) == 32).all()  # one square, not scattered pixels
    y.sum().backward()
    assert x.grad is not None and (x.grad.sum(dim=1) == 3 * (~zeros)).all()


def test_two_steps_judge_keep_the_best_and_export(tmp_path):
    out = tmp_path / "gan"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_gan.py"), "--out", str(out), "--steps", "2", "--batch", "4",
           "--g-widths", "32,16,16,8", "--d-widths", "8,16,16,32", "--eval-every", "1", "--eval-n", "16", "--r1", "1", "--threads", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("eval step") == 2 and "exporting the best checkpoint" in done.stdout
    assert (out / "best.pt").is_file() and (out / "ckpt.pt").is_file()
    from gencli.backend.device import Placement
    from gencli.pipelines.generative import loading, sampling

    loaded = loading.load_generative(out / "model", "gan", Placement(torch.device("cpu"), torch.float32))
    images = sampling.generate(loaded, sampling.seed_latents(range(2), loaded.latent_dim))
    assert images.shape == (2, 64, 64, 3)
