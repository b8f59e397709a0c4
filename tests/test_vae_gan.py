"""The ConvVAE and DCGAN: architecture scaling with the config, folders that round-trip, per-seed
sampling, spherical interpolation, and the `sample` / `reconstruct` commands (tiny random models)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from gencli.backend.device import Placement
from gencli.backend.seeds import MAX_SAMPLES, parse_seeds
from gencli.errors import UserError
from gencli.models.gan import DCGAN, DCGANConfig
from gencli.models.vae import ConvVAE, ConvVAEConfig
from gencli.pipelines.generative import loading, sampling

FP32 = Placement(torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def saved():
    """The models the folders hold, as they were saved."""
    torch.manual_seed(0)
    vae = ConvVAE(ConvVAEConfig(image_size=32, latent_dim=8, block_out_channels=(8, 16), norm_num_groups=4))
    gan = DCGAN(DCGANConfig(image_size=32, latent_dim=8, generator_channels=(16, 8), discriminator_channels=(8, 16), norm_num_groups=4))
    return {"vae": vae.eval(), "gan": gan.eval()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, saved):
    root = tmp_path_factory.mktemp("models")
    for name, model in saved.items():
        loading.save_generative(model, root / name)
    return root


@pytest.mark.parametrize("size,widths,layers", [(32, (8, 16), 0), (64, (8, 16, 16), 1), (16, (8,), 2)])
def test_vae_architecture_scales_with_image_size_and_widths(size, widths, layers):
    model = ConvVAE(ConvVAEConfig(image_size=size, latent_dim=5, block_out_channels=widths, layers_per_block=layers, norm_num_groups=4))
    x = torch.rand(2, 3, size, size) * 2 - 1
    recon, posterior = model(x)
    assert recon.shape == x.shape and posterior.mean.shape == (2, 5) and posterior.kl().shape == (2,)
    assert len(model.encoder.down_blocks) == len(widths) and len(model.encoder.down_blocks[0].resnets) == layers


@pytest.mark.parametrize("size,g,d", [(32, (16, 8), (8, 16)), (64, (32, 16, 8), (8, 16, 32, 32))])
def test_gan_architecture_scales_with_image_size_and_widths(size, g, d):
    model = DCGAN(DCGANConfig(image_size=size, latent_dim=7, generator_channels=g, discriminator_channels=d, norm_num_groups=4))
    images = model(torch.randn(3, 7))
    assert images.shape == (3, 3, size, size) and images.abs().max() <= 1
    assert model.discriminator(images).shape == (3,)


def test_configs_refuse_what_cannot_be_built():
    with pytest.raises(ValueError, match="divisible"):
        ConvVAEConfig(image_size=48, block_out_channels=(8, 8, 8, 8, 8))
    with pytest.raises(ValueError, match="norm_num_groups"):
        DCGANConfig(generator_channels=(12, 8), norm_num_groups=8)


def test_folders_round_trip_and_name_what_they_are(folders, saved):
    vae = loading.load_generative(folders / "vae", "vae", FP32)
    assert vae.latent_dim == 8 and vae.image_size == 32
    z = torch.randn(2, 8)
    for name, loaded in (("vae", vae.model), ("gan", loading.load_generative(folders / "gan", "gan", FP32).model)):
        original = saved[name]  # the model that was saved, not one rebuilt from what was loaded
        assert loaded.config == original.config
        state, want = loaded.state_dict(), original.state_dict()
        assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want), name
        with torch.no_grad():
            torch.testing.assert_close(loaded.decode(z) if name == "vae" else loaded(z), original.decode(z) if name == "vae" else original(z), rtol=0, atol=0)
    with pytest.raises(UserError, match=r"holds a DCGAN \(a GAN\), not a ConvVAE: run it with gencli sample gan"):
        loading.load_generative(folders / "gan", "vae", FP32)
    with pytest.raises(UserError, match=r"holds a ConvVAE \(a VAE\), not a DCGAN: run it with gencli sample vae or gencli reconstruct"):
        loading.load_generative(folders / "vae", "gan", FP32)


def test_a_seed_gives_the_same_image_whatever_the_batch(folders):
    loaded = loading.load_generative(folders / "gan", "gan", FP32)
    alone = sampling.generate(loaded, sampling.seed_latents([5], 8))
    batch = sampling.generate(loaded, sampling.seed_latents([1, 2, 5, 9], 8), batch_size=3)
    assert np.array_equal(alone[0], batch[2])
    assert not np.array_equal(batch[0], batch[1])
    truncated = sampling.generate(loaded, sampling.seed_latents([1, 2, 5, 9], 8), truncation=0.5)
    assert not np.array_equal(truncated, batch)
    # truncation pulls the samples together: less spread between them
    assert truncated.astype(float).std(axis=0).mean() < batch.astype(float).std(axis=0).mean()


def test_slerp_keeps_the_ends_and_the_norm_of_gaussian_latents():
    a, b = sampling.seed_latent(0, 256), sampling.seed_latent(1, 256)
    walk = sampling.interpolation_latents(0, 1, 5, 256)
    torch.testing.assert_close(walk[0], a)
    torch.testing.assert_close(walk[-1], b, atol=1e-5, rtol=0)
    norms = walk.norm(dim=1)
    assert float(norms.min()) > 0.95 * min(float(a.norm()), float(b.norm()))  # a straight line dips to ~0.7
    assert float(((a + b) / 2).norm()) < 0.8 * float(a.norm())


def test_parse_seeds():
    assert parse_seeds("0-3,40", limit=MAX_SAMPLES) == [0, 1, 2, 3, 40]
    assert parse_seeds(" 7 ", limit=MAX_SAMPLES) == [7]
    for bad in ("1-x", "3-1", "", "a", "-2"):
        with pytest.raises(UserError, match="does not parse"):
            parse_seeds(bad, limit=MAX_SAMPLES)
    with pytest.raises(UserError, match="more than"):
        parse_seeds("0-100000", limit=MAX_SAMPLES)


def test_sample_cli_grids_files_gifs_and_errors(cli, folders, tmp_path):
    vae, ganf = str(folders / "vae"), str(folders / "gan")
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    r = cli("sample", "vae", "-m", vae, "-n", "4", "--seed", "3", "--out", str(a), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"file": str(a), "seeds": [3, 4, 5, 6]}
    assert cli("sample", "vae", "-m", vae, "--seeds", "3-6", "--out", str(b)).returncode == 0
    assert a.read_bytes() == b.read_bytes()  # same seeds, byte-identical PNG
    meta = json.loads(Image.open(a).text["gencli"])
    assert meta["seeds"] == [3, 4, 5, 6] and meta["family"] == "vae" and meta["temperature"] == 1.0
    assert Image.open(a).size == (2 * 34 + 2, 2 * 34 + 2)  # 2x2 grid of 32-pixel images, 2-pixel padding
    r = cli("sample", "gan", "-m", ganf, "--seeds", "1,8", "--out-dir", str(tmp_path / "d"), "--json", "--truncation", "0.7")
    assert [json.loads(line) for line in r.stdout.splitlines()] == [
        {"file": str(tmp_path / "d" / "gan-seed1.png"), "seed": 1}, {"file": str(tmp_path / "d" / "gan-seed8.png"), "seed": 8}]  # fmt: skip
    assert json.loads(Image.open(tmp_path / "d" / "gan-seed8.png").text["gencli"])["truncation"] == 0.7
    g = tmp_path / "walk.gif"
    assert cli("sample", "gan", "-m", ganf, "--seeds", "1,8", "--interpolate", "4", "--gif", "--out", str(g)).returncode == 0
    assert Image.open(g).n_frames == 6  # there and back
    for args, message in [
        (("sample", "vae", "-m", ganf, "--out", str(tmp_path / "x.png")), "holds a DCGAN (a GAN), not a ConvVAE: run it with gencli sample gan"),
        (("sample", "gan", "-m", ganf, "--seeds", "4-x", "--out", str(tmp_path / "x.png")), "does not parse"),
        (("sample", "gan", "-m", ganf, "--seeds", "4", "--interpolate", "3", "--out", str(tmp_path / "x.png")), "two seeds"),
        (("sample", "vae", "-m", vae, "-n", "0", "--out", str(tmp_path / "x.png")), "-n must be"),
        (("sample", "vae", "-m", vae, "--seeds", "3", "--out", str(a)), "already exists"),
    ]:
        r = cli(*args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert not (tmp_path / "x.png").exists()


def test_reconstruct_cli_with_a_conv_vae_and_an_autoencoder_kl(cli, folders, tmp_path):
    from gencli.data import shapes
    from gencli.models.autoencoder_kl.model import AutoencoderKL, AutoencoderKLConfig
    from gencli.pipelines.diffusion.vae import save_autoencoder

    for i, size in enumerate((32, 40)):
        Image.fromarray(shapes.render(shapes.split_seeds("test", 2)[i], size).image).save(tmp_path / f"s{i}.png")
    r = cli("reconstruct", str(tmp_path / "s0.png"), str(tmp_path / "s1.png"), "-m", str(folders / "vae"), "--out-dir", str(tmp_path / "r"), "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["resized"] for row in rows] == [False, True] and "resized from 40x40 to 32x32" in r.stderr
    assert all(np.isfinite(row["psnr"]) and -1 <= row["ssim"] <= 1 for row in rows)
    assert Image.open(tmp_path / "r" / "s1.png").size == (32, 32)
    torch.manual_seed(1)
    kl = AutoencoderKL(AutoencoderKLConfig(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                                           up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4))  # fmt: skip
    save_autoencoder(kl, tmp_path / "kl")
    r = cli("reconstruct", str(tmp_path / "s1.png"), "-m", str(tmp_path / "kl"), "--out-dir", str(tmp_path / "r2"))
    assert r.returncode == 0 and "s1.png" in r.stdout and Image.open(tmp_path / "r2" / "s1.png").size == (40, 40)
    r = cli("reconstruct", str(tmp_path / "s0.png"), "-m", str(folders / "gan"), "--out-dir", str(tmp_path / "r3"))
    assert r.returncode == 2 and "GAN" in r.stderr and not (tmp_path / "r3").exists()
