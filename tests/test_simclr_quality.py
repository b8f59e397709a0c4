"""Quality floor of the embedded SimCLR encoder (weights/simclr-shapes): linear-probe and k-NN accuracy
on held-out shapes-world scenes, through the path `gencli embed --images` uses, and above the same
probes on the randomly initialised encoder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gencli.weights import weights_dir

ROOT = Path(__file__).resolve().parent.parent
MODEL = weights_dir() / "simclr-shapes"

pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="weights/simclr-shapes is not installed")


@pytest.mark.slow
def test_probes_beat_the_random_encoder_and_the_floors(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from eval_simclr import FLOORS, evaluate, random_encoder

    threads = torch.get_num_threads()
    try:
        r = evaluate({"simclr": MODEL, "random": random_encoder(tmp_path / "random", MODEL)}, 800, 400, test_offset=5000, quiet=True)
    finally:
        torch.set_num_threads(threads)
    for (task, probe), floor in FLOORS.items():
        assert r["simclr"][task][probe] >= floor, (task, probe, r["simclr"][task])
    # what SimCLR learnt about shape and position, beyond what random features give
    assert r["simclr"]["shape"]["linear"] >= r["random"]["shape"]["linear"] + 0.25, r
    assert r["simclr"]["shape"]["knn"] >= r["random"]["shape"]["knn"] + 0.03, r
    assert r["simclr"]["position"]["linear"] >= r["random"]["position"]["linear"] + 0.3, r
