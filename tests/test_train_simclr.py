"""scripts/train_simclr.py: the NT-Xent loss, the augmentations, and a tiny run that resumes exactly
where it stopped and exports an encoder folder that `gencli embed --images` loads."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from conftest import ROOT
from safetensors import safe_open

TINY = ["--size", "32", "--channels", "8,16", "--stem", "8", "--projection-dim", "8", "--batch", "6", "--ckpt-every", "1"]


@pytest.fixture(scope="module")
def train_simclr():
    sys.path.insert(0, str(ROOT))
    from scripts import train_simclr

    return train_simclr


def _run(train_simclr, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["train_simclr.py", *map(str, args)])
    threads = torch.get_num_threads()
    try:
        train_simclr.main()
    finally:
        torch.set_num_threads(threads)


def test_nt_xent_matches_its_definition(train_simclr):
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    t = 0.3
    z = torch.nn.functional.normalize(torch.cat((z1, z2)), dim=1)
    n = len(z)
    total = 0.0
    for i in range(n):  # l(i, j) = -log exp(s_ij / t) / sum_{k != i} exp(s_ik / t), j = i's partner
        j = (i + 5) % n
        denom = sum(math.exp(float(z[i] @ z[k]) / t) for k in range(n) if k != i)
        total += -math.log(math.exp(float(z[i] @ z[j]) / t) / denom)
    assert abs(train_simclr.nt_xent(z1, z2, t).item() - total / n) < 1e-5
    # identical views whose pairs are far from the rest: the loss is near its floor
    far = torch.eye(5) * 10
    assert train_simclr.nt_xent(far, far, 0.1).item() < 1e-3


def test_augmentations(train_simclr):
    from gencli.data import shapes

    x = train_simclr.render_scenes(3, 4, 32)
    assert x.shape == (4, 3, 32, 32) and 0 <= x.min() and x.max() <= 1
    g = torch.Generator().manual_seed(0)
    whole = train_simclr.random_resized_crop(x, g, (1.0, 1.0), flip=0.0)  # aspect ratio aside, a full crop keeps the image
    assert (whole - x).abs().mean() < 0.05
    flipped = train_simclr.random_resized_crop(x, torch.Generator().manual_seed(0), (1.0, 1.0), flip=1.0)
    assert (flipped.flip(3) - whole).abs().max() < 1e-5
    assert torch.equal(train_simclr.colour_jitter(x, g, 0.5, p=0.0, p_gray=0.0), x)
    grey = train_simclr.colour_jitter(x, g, 0.5, p=0.0, p_gray=1.0)
    assert (grey[:, 0] - grey[:, 1]).abs().max() < 1e-6 and (grey[:, 1] - grey[:, 2]).abs().max() < 1e-6
    # no colour change at zero strength, whatever the probability
    assert (train_simclr.colour_jitter(x, g, 0.0, p=1.0, p_gray=0.0) - x).abs().max() < 1e-4
    v1, v2 = train_simclr.make_views(5, 4, 32, (0.5, 1.0), 0.5)
    w1, w2 = train_simclr.make_views(5, 4, 32, (0.5, 1.0), 0.5)
    assert torch.equal(v1, w1) and torch.equal(v2, w2) and not torch.equal(v1, v2)  # a step's views depend on the step alone
    assert -1 <= v1.min() and v1.max() <= 1
    assert shapes.SPLITS["train"].start == 0


def test_a_run_resumes_exactly_and_exports_an_encoder_folder(train_simclr, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from gencli.cli import app
    from gencli.data import shapes

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(train_simclr, monkeypatch, "--out", straight, "--steps", "3", *TINY)
    _run(train_simclr, monkeypatch, "--out", resumed, "--steps", "3", "--stop-after", "1", *TINY)
    assert torch.load(resumed / "state.pt", weights_only=True)["step"] == 1
    _run(train_simclr, monkeypatch, "--out", resumed, "--steps", "3", *TINY, "--export", tmp_path / "enc")
    a = torch.load(straight / "state.pt", weights_only=True)
    b = torch.load(resumed / "state.pt", weights_only=True)
    assert b["step"] == 3 and "resumed at step 1" in b["command"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    folder = tmp_path / "enc"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "simclr" and cfg["block_out_channels"] == [8, 16]
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.float16 for n in names)
    assert "conv_in.weight" in names and not any("fc1" in n or "fc2" in n for n in names)  # the projection head is dropped
    img = tmp_path / "scene.png"
    shapes.render(shapes.SPLITS["test"].start, 48).pil().save(img)
    r = CliRunner().invoke(app, ["embed", "--images", str(img), "-m", str(folder), "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["embedding"]) == 16
