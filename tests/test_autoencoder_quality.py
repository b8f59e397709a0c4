"""The embedded latent autoencoder (weights/autoencoder-shapes): its files are a diffusers
AutoencoderKL that diffusers loads and runs the same, its reconstructions and latent statistics stay
above floors set from the measured figures (scripts/eval_autoencoder.py; the weights README), and a
large latent decodes tiled as it does untiled."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from gencli.backend.device import Placement
from gencli.data import shapes
from gencli.weights import weights_dir

WEIGHTS = weights_dir() / "autoencoder-shapes"
FP32 = Placement(torch.device("cpu"), torch.float32)

# Floors a little under the figures measured on these same 200 held-out scenes (the full
# 1000-scene evaluation is in the weights README).
PSNR_FLOOR = 29.0
SSIM_FLOOR = 0.93


def test_embedded_weights_are_present():
    # the checks below must fail, never skip, when the default is missing
    for name in ("config.json", "diffusion_pytorch_model.safetensors", "README.md"):
        assert (WEIGHTS / name).is_file(), name
    assert "task: reconstruct" in (WEIGHTS / "README.md").read_text()
    config = json.loads((WEIGHTS / "config.json").read_text())
    assert config["_class_name"] == "AutoencoderKL" and config["latent_channels"] == 4 and len(config["block_out_channels"]) == 3


@pytest.fixture(scope="module")
def model():
    from gencli.pipelines.diffusion.vae import load_autoencoder

    return load_autoencoder(WEIGHTS, FP32).model


@pytest.fixture(scope="module")
def held_out():
    return shapes.render_batch(shapes.split_seeds("test", 200), 64)[0]


@pytest.mark.slow
def test_reconstruction_floors(model, held_out):
    from gencli.pipelines.diffusion.vae import reconstruct
    from gencli.pipelines.generative.metrics import psnr, ssim

    recon, _ = reconstruct(model, held_out)
    assert float(psnr(recon, held_out).mean()) >= PSNR_FLOOR
    assert float(ssim(recon, held_out).mean()) >= SSIM_FLOOR


def test_scaled_latents_have_unit_variance_spread_over_the_channels(model, held_out):
    from gencli.pipelines.diffusion.vae import latent_statistics, reconstruct

    _, latents = reconstruct(model, held_out[:100])
    stats = latent_statistics(latents, model.config.scaling_factor)
    assert 0.8 <= stats["overall_std"] <= 1.25, stats
    assert max(stats["variance_share"]) <= 0.5, stats  # no channel carries most of the latent
    assert min(stats["variance_share"]) >= 0.05, stats


def test_diffusers_loads_the_folder_and_reconstructs_the_same(model, held_out):
    diffusers = pytest.importorskip("diffusers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gencli.pipelines.diffusion.vae import images_to_tensor

    theirs = diffusers.AutoencoderKL.from_pretrained(WEIGHTS).eval()
    assert theirs.config.scaling_factor == model.config.scaling_factor
    x = images_to_tensor(held_out[:8])
    with torch.no_grad():
        posterior = theirs.encode(x).latent_dist
        ours = model.encode(x)
        torch.testing.assert_close(ours.mean, posterior.mean, atol=1e-4, rtol=0)
        torch.testing.assert_close(model.decode(ours.mean), theirs.decode(posterior.mean).sample, atol=1e-4, rtol=0)


def _hand_over_bands(starts: list[int], size: int, length: int, scale: float) -> np.ndarray:
    """Output positions where more than one tile has a non-zero weight (the seams' blending bands)."""
    from gencli.models.autoencoder_kl.tiling import tile_weights

    count = np.zeros(length, int)
    for s, w in zip(starts, tile_weights(starts, size, scale, "cpu")):
        o = round(s * scale)
        count[o : o + size] += (w.numpy() > 0).astype(int)
    return count > 1


def test_tiled_decode_of_a_large_latent_matches_untiled_without_visible_seams(model):
    """A 256x256 scene's 64x64 latent decoded in 128-pixel tiles (3x3 tiles). The tiles see the
    untiled pass's mid-block output and GroupNorm statistics, so what is left is the zero padding
    at tile borders reaching through the receptive field past the blending halo: a fraction of a
    level away from the blending bands (measured 0.08/255), within the issue's 2/255 everywhere
    (measured 1.6/255 at most, inside a band), and no seam line: along every row and column the
    tiled image's mean absolute step between neighbouring pixels exceeds the untiled image's by
    less than 0.25/255."""
    from gencli.models.autoencoder_kl.tiling import Tiling, tile_starts
    from gencli.pipelines.diffusion.vae import images_to_tensor

    image = shapes.render(shapes.split_seeds("test", 1, offset=7)[0], 256).image
    with torch.no_grad():
        z = model.encode(images_to_tensor(image)).mode()
        untiled = model.decode(z, tile=False)
        model.tiling = Tiling(tile_size=128, overlap=0.25, auto_above=None)
        try:
            tiled = model.decode(z, tile=True)
        finally:
            model.tiling = Tiling()
    u = (untiled[0].float() * 127.5).numpy()
    t = (tiled[0].float() * 127.5).numpy()
    f = model.config.downsampling
    lt = 128 // f
    starts = tile_starts(z.shape[-1], lt, round(lt * 0.75))
    assert len(starts) == 3
    band = _hand_over_bands(starts, 128, 256, f)
    away = ~(band[:, None] | band[None, :])
    err = np.abs(t - u)
    assert err[:, away].max() <= 0.5, err[:, away].max()
    assert err.max() <= 2.0, err.max()
    for axis in (1, 2):
        step_t = np.abs(np.diff(t, axis=axis)).mean(axis=(0, 3 - axis))
        step_u = np.abs(np.diff(u, axis=axis)).mean(axis=(0, 3 - axis))
        assert (step_t - step_u).max() < 0.25, (axis, (step_t - step_u).max())
