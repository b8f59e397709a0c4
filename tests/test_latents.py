"""`gencli encode` / `gencli decode`: latent files match diffusers' AutoencoderKL built from a small
random config, encode then decode is the reconstruction, posterior samples are seeded, scaled
(marker-less) files are unscaled, and bad input is one line with nothing written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gencli.cli import app
from gencli.data import shapes

diffusers = pytest.importorskip("diffusers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A random SD-1.x-shaped (small widths, 3 down blocks) diffusers AutoencoderKL, saved with
    save_pretrained, with GroupNorm affine parameters moved away from 1/0 and a non-trivial
    scaling/shift."""
    root = tmp_path_factory.mktemp("latents")
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKL(
        block_out_channels=(16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        layers_per_block=1, norm_num_groups=8, latent_channels=4, scaling_factor=0.5, shift_factor=0.1,
    ).eval()  # fmt: skip
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(root / "vae")
    for i, size in enumerate((32, 34)):  # 34 is not a multiple of the downsampling factor 4
        Image.fromarray(shapes.render(shapes.split_seeds("test", 2)[i], size).image).save(root / f"s{i}.png")
    return ref, root


@pytest.fixture
def cli(one_torch_thread):
    """The commands in-process (each subprocess would load torch again)."""
    from typer.testing import CliRunner

    def invoke(*args: str):
        r = CliRunner().invoke(app, [*map(str, args)])
        r.returncode = r.exit_code
        return r

    return invoke


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int64)


def test_latents_and_images_match_diffusers(cli, reference, tmp_path):
    ref, root = reference
    r = cli("encode", str(root / "s0.png"), "-m", str(root / "vae"), "-o", str(tmp_path / "z.safetensors"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"image": str(root / "s0.png"), "latent": str(tmp_path / "z.safetensors"), "shape": [1, 4, 8, 8],
                                    "resized": False, "posterior": "mean"}  # fmt: skip
    ours = load_file(tmp_path / "z.safetensors")
    assert set(ours) == {"latent_tensor", "latent_format_version_0"} and ours["latent_tensor"].dtype == torch.float32
    x = torch.from_numpy(_pixels(root / "s0.png")).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        mean = ref.encode(x).latent_dist.mean
        torch.testing.assert_close(ours["latent_tensor"], mean, atol=1e-4, rtol=0)
        image = ((ref.decode(mean).sample + 1) * 127.5).round().clamp(0, 255)[0].permute(1, 2, 0).numpy()
    with safe_open(tmp_path / "z.safetensors", "pt") as fh:
        meta = json.loads(fh.metadata()["gencli"])
    assert meta["posterior"] == "mean" and (meta["width"], meta["height"]) == (32, 32) and meta["source"] == str(root / "s0.png")
    r = cli("decode", str(tmp_path / "z.safetensors"), "-m", str(root / "vae"), "--out-dir", str(tmp_path / "d"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"latent": str(tmp_path / "z.safetensors"), "index": 0, "image": str(tmp_path / "d" / "z.png"), "size": [32, 32]}
    assert np.abs(_pixels(tmp_path / "d" / "z.png") - image).max() <= 1  # fp32 rounding at a .5 boundary at most


def test_encode_then_decode_is_the_reconstruction(cli, reference, tmp_path):
    _, root = reference
    vae = str(root / "vae")
    r = cli("encode", str(root / "s0.png"), str(root / "s1.png"), "-m", vae, "--out-dir", str(tmp_path / "z"))
    assert r.returncode == 0, r.stderr
    assert "s1.png: resized from 34x34 to 32x32" in r.stderr
    files = sorted(p.name for p in (tmp_path / "z").iterdir())
    assert files == ["s0.latent.safetensors", "s1.latent.safetensors"]
    r = cli("decode", *[str(tmp_path / "z" / f) for f in files], "-m", vae, "--out-dir", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr
    assert cli("reconstruct", str(root / "s0.png"), str(root / "s1.png"), "-m", vae, "--out-dir", str(tmp_path / "r")).returncode == 0
    for name in ("s0.png", "s1.png"):
        assert np.array_equal(_pixels(tmp_path / "d" / name), _pixels(tmp_path / "r" / name)), name


def test_posterior_samples_are_seeded(cli, reference, tmp_path):
    _, root = reference
    args = ("encode", str(root / "s0.png"), "-m", str(root / "vae"), "--sample")
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        r = cli(*args, "--seed", seed, "-o", str(tmp_path / f"{name}.safetensors"), "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["seed"] == int(seed), r.stderr
    a, b, c = (load_file(tmp_path / f"{n}.safetensors")["latent_tensor"] for n in "abc")
    mean = load_file(_encode_mean(cli, root, tmp_path))["latent_tensor"]
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, mean)


def _encode_mean(cli, root, tmp_path):
    target = tmp_path / "mean.safetensors"
    assert cli("encode", str(root / "s0.png"), "-m", str(root / "vae"), "-o", str(target)).returncode == 0
    return target


def test_a_file_without_the_version_marker_holds_scaled_latents(reference, tmp_path):
    from gencli.backend.device import Placement
    from gencli.pipelines.diffusion.latents import load_latent_autoencoder, read_latents, write_latents

    _, root = reference
    loaded = load_latent_autoencoder(root / "vae", device="cpu", dtype="float32")
    assert isinstance(loaded.placement, Placement)
    z = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(0))
    write_latents(tmp_path / "new.safetensors", z, {})
    back = read_latents(tmp_path / "new.safetensors", loaded)
    assert not back.scaled and torch.equal(back.latents, z)
    save_file({"latent_tensor": (z - 0.1) * 0.5}, str(tmp_path / "old.latent"))  # ComfyUI's first files: scaled, no marker
    old = read_latents(tmp_path / "old.latent", loaded)
    assert old.scaled
    torch.testing.assert_close(old.latents, z, atol=1e-6, rtol=0)


def test_bad_input_is_one_line_and_nothing_is_written(cli, reference, tmp_path):
    from gencli.models.vae import ConvVAE, ConvVAEConfig
    from gencli.pipelines.generative.loading import save_generative

    _, root = reference
    vae = str(root / "vae")
    save_generative(ConvVAE(ConvVAEConfig(image_size=32, latent_dim=8, block_out_channels=(8, 16), norm_num_groups=4)), tmp_path / "conv")
    save_file({"latent_tensor": torch.zeros(1, 3, 4, 4), "latent_format_version_0": torch.tensor([])}, str(tmp_path / "c3.safetensors"))
    save_file({"weight": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    (tmp_path / "exists.safetensors").write_bytes(b"keep")
    out = tmp_path / "x"
    for args, message in [
        (("encode", str(root / "s0.png"), "-m", str(tmp_path / "conv"), "--out-dir", str(out)), "is a ConvVAE"),
        (("encode", str(root / "s0.png"), str(root / "s1.png"), "-m", vae, "-o", str(out / "z.safetensors")), "use --out-dir"),
        (("encode", str(tmp_path / "missing.png"), "-m", vae, "--out-dir", str(out)), "missing.png"),
        (("encode", str(root / "s0.png"), "-m", vae, "-o", str(tmp_path / "exists.safetensors")), "already exists"),
        (("decode", str(tmp_path / "c3.safetensors"), "-m", vae, "--out-dir", str(out)), "do not fit"),
        (("decode", str(tmp_path / "w.safetensors"), "-m", vae, "--out-dir", str(out)), "not a latent file"),
        (("decode", str(root / "s0.png"), "-m", vae, "--out-dir", str(out)), "not a valid safetensors file"),
        (("decode", str(tmp_path / "nope.safetensors"), "-m", vae, "--out-dir", str(out)), "no such file"),
    ]:
        r = cli(*args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and (tmp_path / "exists.safetensors").read_bytes() == b"keep"
