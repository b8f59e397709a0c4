"""AutoencoderKL: parity with diffusers on random-initialised configs, the checkpoint layouts it
loads (diffusers folders, fp16 variants, bare files, legacy attention names, original single files
checked against diffusers' own conversion), tiled encode/decode, and checkpoint errors."""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

from gencli.backend.device import Placement
from gencli.errors import CheckpointError, UserError
from gencli.models.autoencoder_kl.model import AutoencoderKL, AutoencoderKLConfig
from gencli.models.autoencoder_kl.tiling import Tiling, tile_starts
from gencli.pipelines.diffusion.vae import load_autoencoder, save_autoencoder

diffusers = pytest.importorskip("diffusers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FP32 = Placement(torch.device("cpu"), torch.float32)


def _reference(seed: int = 0, **kw):
    """A random diffusers AutoencoderKL (SD-1.x-shaped by default, small widths) with non-trivial norms."""
    from diffusers import AutoencoderKL as Ref

    n = len(kw.get("block_out_channels", (32, 64, 64, 64)))
    args = dict(
        block_out_channels=(32, 64, 64, 64),
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        layers_per_block=2,
        norm_num_groups=32,
        latent_channels=4,
    )
    args.update(kw)
    torch.manual_seed(seed)
    ref = Ref(**args).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:  # GroupNorm weights/biases away from 1/0
                p.add_(torch.randn_like(p) * 0.1)
    return ref


CASES = {
    "sd1-4blocks": {},
    "3blocks-no-quant-conv": dict(block_out_channels=(32, 64, 64), use_quant_conv=False, use_post_quant_conv=False, layers_per_block=1, norm_num_groups=16),
    "4blocks-no-mid-attention-gelu": dict(block_out_channels=(16, 32, 32, 32), mid_block_add_attention=False, act_fn="gelu", norm_num_groups=8, latent_channels=8),  # noqa: E501
    "3blocks-quant-conv-only": dict(block_out_channels=(32, 32, 64), use_post_quant_conv=False, in_channels=4, out_channels=2),
}


@pytest.mark.parametrize("prepack", [False, True], ids=["as-loaded", "prepacked"])
@pytest.mark.parametrize("case", list(CASES))
def test_encode_decode_match_diffusers(tmp_path, case, prepack, monkeypatch):
    monkeypatch.setenv("GENCLI_WINOGRAD", "1")  # the Winograd path on any CPU (unset, AMD CPUs stay direct)
    ref = _reference(**CASES[case])
    ref.save_pretrained(tmp_path / "vae")
    loaded = load_autoencoder(tmp_path / "vae", FP32, prepack=prepack)
    ours = loaded.model
    assert loaded.layout == "diffusers"
    cin = ref.config.in_channels
    f = 2 ** (len(ref.config.block_out_channels) - 1)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, cin, 3 * f, 5 * f, generator=g) * 2 - 1
    z = torch.randn(2, ref.config.latent_channels, 3, 5, generator=g)
    with torch.no_grad():
        theirs = ref.encode(x).latent_dist
        mine = ours.encode(x)
        torch.testing.assert_close(mine.mean, theirs.mean, atol=1e-4, rtol=0)
        torch.testing.assert_close(mine.logvar, theirs.logvar, atol=1e-4, rtol=0)
        torch.testing.assert_close(ours.decode(z), ref.decode(z).sample, atol=1e-4, rtol=0)
        # a posterior sample with the same generator is the same sample
        a = mine.sample(torch.Generator().manual_seed(5))
        b = theirs.sample(torch.Generator().manual_seed(5))
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        torch.testing.assert_close(mine.kl(), theirs.kl(), rtol=1e-4, atol=1e-3)
    if prepack and case == "sd1-4blocks":  # inference's path: the 64-channel 3x3 layers by Winograd (gencli.backend.winograd)
        from gencli.backend.layers import Conv2d
        from tests.conftest import built_quant_kernels

        built_quant_kernels()
        assert sum(m.winograd for m in ours.modules() if isinstance(m, Conv2d)) >= 10


def test_config_round_trip_and_latent_scaling():
    cfg = AutoencoderKLConfig.from_dict({"_class_name": "AutoencoderKL", "block_out_channels": [32, 64], "down_block_types": ["DownEncoderBlock2D"] * 2,
                                         "up_block_types": ["UpDecoderBlock2D"] * 2, "scaling_factor": 0.5, "shift_factor": 0.25, "unknown_field": 1})  # fmt: skip  # noqa: E501
    assert AutoencoderKLConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.downsampling == 2
    model = AutoencoderKL(cfg)
    z = torch.randn(1, 4, 3, 3)
    torch.testing.assert_close(model.scale_latents(z), (z - 0.25) * 0.5)
    torch.testing.assert_close(model.unscale_latents(model.scale_latents(z)), z)
    with pytest.raises(ValueError, match="block type"):
        AutoencoderKLConfig(down_block_types=("AttnDownEncoderBlock2D",))


def _to_original(state: dict[str, torch.Tensor], num_blocks: int, *, attention_as_conv: bool = True) -> dict[str, torch.Tensor]:
    """diffusers names -> the original latent-diffusion names (the inverse of the mapping under test)."""
    n = num_blocks
    out = {}
    for k, v in state.items():
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", k)
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", k)
        k = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.", lambda m: f"decoder.up.{n - 1 - int(m.group(1))}.block.", k)
        k = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"decoder.up.{n - 1 - int(m.group(1))}.upsample.", k)
        k = k.replace("mid_block.resnets.0.", "mid.block_1.").replace("mid_block.resnets.1.", "mid.block_2.")
        k = k.replace("mid_block.attentions.0.group_norm.", "mid.attn_1.norm.")
        for new, old in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
            k = k.replace(f"mid_block.attentions.0.{new}.", f"mid.attn_1.{old}.")
        k = k.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        if attention_as_conv and re.search(r"attn_1\.(q|k|v|proj_out)\.weight$", k):
            v = v[:, :, None, None]
        out[k] = v.contiguous()
    return out


def test_single_file_matches_diffusers_conversion(tmp_path):
    """An SD single file (original layout under first_stage_model., with UNet tensors beside it),
    loaded by diffusers' from_single_file and by gencli from the shapes alone: same weights, same outputs."""
    from diffusers import AutoencoderKL as Ref
    from safetensors.torch import save_file

    ref = _reference(seed=3)
    ref.save_pretrained(tmp_path / "vae")
    state = {"first_stage_model." + k: v for k, v in _to_original(ref.state_dict(), 4).items()}
    state["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(8, 4, 3, 3)
    state["cond_stage_model.transformer.text_model.embeddings.position_ids"] = torch.zeros(1, 77)
    save_file(state, tmp_path / "sd.safetensors")

    theirs = Ref.from_single_file(str(tmp_path / "sd.safetensors"), config=str(tmp_path / "vae"), local_files_only=True).eval()
    loaded = load_autoencoder(tmp_path / "sd.safetensors", FP32)
    assert loaded.layout == "ldm"
    assert loaded.config["block_out_channels"] == [32, 64, 64, 64] and loaded.config["layers_per_block"] == 2
    assert loaded.model.config.scaling_factor == 0.18215  # the standard SD VAE config fills what shapes cannot tell
    mine = loaded.model.state_dict()
    reference = theirs.state_dict()
    assert set(mine) == set(reference)
    for k, v in reference.items():
        assert torch.equal(mine[k], v), k
    x = torch.rand(1, 3, 32, 24) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(loaded.model.encode(x).mean, theirs.encode(x).latent_dist.mean, atol=1e-4, rtol=0)
        z = torch.randn(1, 4, 4, 3)
        torch.testing.assert_close(loaded.model.decode(z), theirs.decode(z).sample, atol=1e-4, rtol=0)


def test_standalone_original_file_and_sdxl_scaling(tmp_path):
    """A standalone original-layout VAE (no prefix, 3 blocks, no quant convs) and an SDXL single file."""
    from safetensors.torch import save_file

    ref = _reference(seed=4, block_out_channels=(32, 64, 64), use_quant_conv=False, use_post_quant_conv=False, layers_per_block=1)
    save_file(_to_original(ref.state_dict(), 3, attention_as_conv=False), tmp_path / "vae.safetensors")
    loaded = load_autoencoder(tmp_path / "vae.safetensors", FP32)
    cfg = loaded.model.config
    assert (cfg.block_out_channels, cfg.layers_per_block, cfg.use_quant_conv, cfg.use_post_quant_conv) == ((32, 64, 64), 1, False, False)
    z = torch.randn(1, 4, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model.decode(z), ref.decode(z).sample, atol=1e-4, rtol=0)

    sdxl = {"first_stage_model." + k: v for k, v in _to_original(ref.state_dict(), 3).items()}
    sdxl["conditioner.embedders.0.transformer.text_model.final_layer_norm.weight"] = torch.ones(8)
    sdxl["model.diffusion_model.out.2.bias"] = torch.zeros(4)
    save_file(sdxl, tmp_path / "xl.safetensors")
    assert load_autoencoder(tmp_path / "xl.safetensors", FP32).model.config.scaling_factor == 0.13025
    # and any field can be overridden
    assert load_autoencoder(tmp_path / "xl.safetensors", FP32, config_overrides={"scaling_factor": 0.5}).model.config.scaling_factor == 0.5


def test_legacy_attention_names(tmp_path):
    """diffusers checkpoints from before 0.14 name the mid-block attention query/key/value/proj_attn."""
    from safetensors.torch import save_file

    ref = _reference(seed=5, block_out_channels=(32, 32), layers_per_block=1)
    ref.save_pretrained(tmp_path / "vae")
    old = {}
    for k, v in ref.state_dict().items():
        for new, legacy in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"), ("to_out.0", "proj_attn")):
            k = k.replace(f".attentions.0.{new}.", f".attentions.0.{legacy}.")
        old[k] = v
    (tmp_path / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    save_file(old, tmp_path / "vae" / "diffusion_pytorch_model.safetensors")
    loaded = load_autoencoder(tmp_path / "vae", FP32)
    assert loaded.layout == "diffusers-legacy"
    x = torch.rand(1, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), ref(x).sample, atol=1e-4, rtol=0)


def test_fp16_variant_and_bare_file_next_to_config(tmp_path):
    ref = _reference(seed=6, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=16)
    ref.save_pretrained(tmp_path / "both")
    copy.deepcopy(ref).half().save_pretrained(tmp_path / "both", variant="fp16")
    assert (tmp_path / "both" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    x = torch.rand(1, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        want = ref(x).sample
        plain = load_autoencoder(tmp_path / "both", FP32)
        fp16 = load_autoencoder(tmp_path / "both", FP32, variant="fp16")
        assert plain.path.name == "both" and fp16.path.name == "both"
        torch.testing.assert_close(plain.model(x), want, atol=1e-4, rtol=0)
        got = fp16.model(x)
        assert got.dtype == torch.float32  # fp16 weights, loaded into fp32 as asked
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
        assert not torch.equal(got, want)  # really the fp16 file
        # a folder holding only the variant file loads it
        copy.deepcopy(ref).half().save_pretrained(tmp_path / "only16", variant="fp16")
        only = load_autoencoder(tmp_path / "only16", FP32)
        torch.testing.assert_close(only.model(x), got, atol=0, rtol=0)
        # a bare file given by path, next to a config.json, among other files
        bare = load_autoencoder(tmp_path / "both" / "diffusion_pytorch_model.fp16.safetensors", FP32)
        torch.testing.assert_close(bare.model(x), got, atol=0, rtol=0)
    with pytest.raises(UserError, match="bf16"):
        load_autoencoder(tmp_path / "both", FP32, variant="bf16")


def test_force_upcast_keeps_fp16_requests_in_fp32(tmp_path):
    ref = _reference(seed=7, block_out_channels=(32, 32), layers_per_block=1)
    ref.save_pretrained(tmp_path / "vae")
    loaded = load_autoencoder(tmp_path / "vae", Placement(torch.device("cpu"), torch.float16))
    assert loaded.placement.dtype == torch.float32 and loaded.model.decoder.conv_out.weight.dtype == torch.float32


def test_saved_folder_loads_in_diffusers(tmp_path):
    from diffusers import AutoencoderKL as Ref

    cfg = AutoencoderKLConfig(block_out_channels=(32, 64, 64), down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                              norm_num_groups=16, scaling_factor=0.4, force_upcast=False)  # fmt: skip
    torch.manual_seed(8)
    model = AutoencoderKL(cfg).eval()
    save_autoencoder(model, tmp_path / "vae")
    theirs = Ref.from_pretrained(tmp_path / "vae").eval()
    assert theirs.config.scaling_factor == 0.4 and list(theirs.config.block_out_channels) == [32, 64, 64]
    x = torch.rand(2, 3, 24, 16) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(model(x), theirs(x).sample, atol=1e-4, rtol=0)
    assert json.loads((tmp_path / "vae" / "config.json").read_text())["_class_name"] == "AutoencoderKL"


def test_mismatching_checkpoints_give_one_line_errors(tmp_path):
    ref = _reference(seed=9, block_out_channels=(32, 64), layers_per_block=1)
    ref.save_pretrained(tmp_path / "vae")
    cfg_path = tmp_path / "vae" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "latent_channels": 8}))
    with pytest.raises(CheckpointError) as err:
        load_autoencoder(tmp_path / "vae", FP32)
    msg = str(err.value)
    assert "\n" not in msg and "tensor 'encoder.conv_out.weight' has shape [8, 64, 3, 3]" in msg and "expects [16, 64, 3, 3]" in msg

    cfg_path.write_text(json.dumps({**cfg, "block_out_channels": [32, 32]}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'decoder\.up_blocks\.1\.resnets\.0\.conv_shortcut\.(weight|bias)'"):
        load_autoencoder(tmp_path / "vae", FP32)

    cfg["block_out_channels"] = [32, 64, 64]
    cfg["down_block_types"] = ["DownEncoderBlock2D"] * 3
    cfg["up_block_types"] = ["UpDecoderBlock2D"] * 3
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing tensor 'encoder\.down_blocks\.1\.downsamplers\.0\.conv\.weight'"):
        load_autoencoder(tmp_path / "vae", FP32)

    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}, tmp_path / "llama.safetensors")
    with pytest.raises(CheckpointError, match="not an AutoencoderKL checkpoint"):
        load_autoencoder(tmp_path / "llama.safetensors", FP32)


def test_info_describes_vae_folders_and_files(tmp_path):
    from safetensors.torch import save_file

    from gencli.checkpoints.describe import describe

    ref = _reference(seed=10, block_out_channels=(32, 32), layers_per_block=1)
    ref.save_pretrained(tmp_path / "vae")
    d = describe(tmp_path / "vae")
    assert d["architecture"] == "AutoencoderKL"
    assert d["config"]["block_out_channels"] == [32, 32] and d["config"]["scaling_factor"] == 0.18215
    save_file(_to_original(ref.state_dict(), 2), tmp_path / "orig.safetensors")
    assert "original latent-diffusion layout" in describe(tmp_path / "orig.safetensors")["architecture"]


# -- tiling ---------------------------------------------------------------------------------------------
def test_tile_starts_cover_with_full_tiles():
    assert tile_starts(64, 64, 48) == [0]
    assert tile_starts(100, 32, 24) == [0, 24, 48, 68]
    for length, tile, stride in [(100, 32, 24), (257, 64, 40), (65, 64, 1)]:
        starts = tile_starts(length, tile, stride)
        assert starts[-1] + tile == length and all(b - a <= stride for a, b in zip(starts, starts[1:]))


def test_tiling_of_an_image_that_fits_one_tile_changes_nothing():
    torch.manual_seed(11)
    model = AutoencoderKL(AutoencoderKLConfig(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                                              up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=16), Tiling(tile_size=32)).eval()  # fmt: skip
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        assert torch.equal(model.encode(x, tile=True).mean, model.encode(x, tile=False).mean)


def test_blended_tiles_of_a_local_operation_equal_the_untiled_result():
    """A stack of two 3x3 convolutions sees 2 pixels around each output: with a 2-pixel halo the
    weights never use a padding-affected output, and they sum to one, so tiling changes nothing."""
    from gencli.models.autoencoder_kl.tiling import blend_tiles, tile_weights

    torch.manual_seed(12)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Tanh(), torch.nn.Conv2d(8, 5, 3, padding=1)).eval()
    x = torch.randn(2, 3, 70, 53)
    with torch.no_grad():
        whole = net(x)
        tiled = blend_tiles(net, x, in_tile=24, in_stride=16, scale=1.0, out_channels=5)  # overlap 8: halo 2, ramp 4
        torch.testing.assert_close(tiled, whole, atol=1e-5, rtol=0)
        # without the halo the padding shows
        assert (blend_tiles(net, x, 24, 16, 1.0, 5, halo=0.0) - whole).abs().max() > 1e-2
    starts = tile_starts(70, 24, 16)
    total = torch.zeros(70)
    for s, w in zip(starts, tile_weights(starts, 24, 1.0, "cpu")):
        total[s : s + 24] += w
    torch.testing.assert_close(total, torch.ones(70))


def test_tiles_share_the_whole_images_groupnorm_statistics():
    """A tile of plain background normalised with its own statistics comes out unlike the untiled
    pass; with the tiles advancing together from norm to norm, every GroupNorm (not only the first)
    normalises each tile as the untiled pass does."""
    from gencli.backend.layers import GroupNorm
    from gencli.models.autoencoder_kl.tiling import NormStep, blend_tiles, blend_tiles_with_shared_statistics, module_step

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 1)
            self.norm = GroupNorm(4, 8, eps=1e-6)
            self.conv2 = torch.nn.Conv2d(8, 8, 1)
            self.norm2 = GroupNorm(2, 8, eps=1e-6)

        def forward(self, x):
            return self.norm2(self.conv2(self.norm(self.conv(x), "silu")), "silu")

        def steps(self):
            return [module_step(self.conv), NormStep(self.norm, "silu"), module_step(self.conv2), NormStep(self.norm2, "silu")]

    torch.manual_seed(13)
    net = Net().eval()
    x = torch.zeros(1, 3, 64, 64)
    x[:, :, 40:, 40:] = torch.randn(1, 3, 24, 24) * 3  # an object in one corner, background elsewhere
    with torch.no_grad():
        whole = net(x)
        own = blend_tiles(net, x, 32, 24, 1.0, 8)
        together = blend_tiles_with_shared_statistics(net.steps(), x, 32, 24, 1.0, 8)
    assert net.norm.statistics is None and net.norm2.statistics is None
    assert (own - whole).abs().max() > 0.1
    torch.testing.assert_close(together, whole, atol=1e-5, rtol=0)


def _tiny_autoencoder(seed: int, tile_size: int = 64, overlap: float = 0.25) -> AutoencoderKL:
    """Three blocks of two ResNets (widths 16/32/32: a shortcut conv in each direction), random
    norm affines so that every GroupNorm matters."""
    torch.manual_seed(seed)
    config = AutoencoderKLConfig(block_out_channels=(16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 3,
                                 up_block_types=("UpDecoderBlock2D",) * 3, norm_num_groups=8, layers_per_block=2)  # fmt: skip
    model = AutoencoderKL(config, Tiling(tile_size=tile_size, overlap=overlap, auto_above=None)).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    return model


def test_the_step_queues_compute_what_the_forward_passes_do():
    """One tile covering the whole input: the step queues (split at every GroupNorm) give the
    encoder's and decoder's local parts exactly as their forward passes do."""
    from gencli.models.autoencoder_kl.tiling import blend_tiles_with_shared_statistics

    model = _tiny_autoencoder(15)
    x = torch.rand(1, 3, 40, 48) * 2 - 1
    h = torch.randn(1, 32, 6, 5)
    with torch.no_grad():
        enc = blend_tiles_with_shared_statistics(model.encoder.feature_steps(), x, 48, 48, 0.25, 32)
        torch.testing.assert_close(enc, model.encoder.features(x), atol=1e-5, rtol=1e-5)
        dec = blend_tiles_with_shared_statistics(model.decoder.pixel_steps(), h, 6, 6, 4.0, 3)
        torch.testing.assert_close(dec, model.decoder.pixels(h), atol=1e-5, rtol=1e-5)


def _gathered_layer_by_layer(modules: list[torch.nn.Module], run, x: torch.Tensor, in_tile: int, in_stride: int, scale: float, out_channels: int):
    """The reference for the tiled pass with shared statistics, computed the slow way: the k-th pass
    runs every tile through ``run`` (the network's own forward) up to its k-th GroupNorm (of those in ``modules``), the earlier
    ones normalising with the statistics gathered by the earlier passes, and adds that norm's
    weighted sums; a last pass normalises every tile with all of them. (Quadratic in depth.)"""
    from gencli.backend.layers import GroupNorm
    from gencli.models.autoencoder_kl.tiling import SharedGroupNormStatistics, blend_tiles, tile_grid

    class Reached(Exception):
        pass

    class Hook:
        def __init__(self):
            self.closed: list[SharedGroupNormStatistics] = []
            self.gathering = SharedGroupNormStatistics()
            self.weights, self.calls = None, 0

        def normalize(self, norm, t):
            index, self.calls = self.calls, self.calls + 1
            if index == len(self.closed):
                self.gathering.add(t, norm.num_groups, self.weights)
                raise Reached
            return self.closed[index].normalize(norm, t)

    hook = Hook()
    norms = [m for module in modules for m in module.modules() if isinstance(m, GroupNorm)]
    for m in norms:
        m.statistics = hook
    try:
        for _ in norms:
            for piece, _, wt in tile_grid(x, in_tile, in_stride, scale):
                hook.weights, hook.calls = wt, 0
                with pytest.raises(Reached):
                    run(piece)
            hook.gathering.close()
            hook.closed.append(hook.gathering)
            hook.gathering = SharedGroupNormStatistics()

        def final(piece):
            hook.calls = 0
            return run(piece)

        return blend_tiles(final, x, in_tile, in_stride, scale, out_channels)
    finally:
        for m in norms:
            m.statistics = None


def test_tiles_advancing_together_match_the_pass_per_groupnorm():
    """The layer-by-layer pass (all tiles advance together, one pass) gives what gathering each
    GroupNorm's statistics with its own pass from the network's input gives, to float rounding;
    with per-tile statistics the output is far off, so the comparison would catch a tile
    normalising with its own statistics at any norm."""
    from gencli.models.autoencoder_kl.tiling import blend_tiles, blend_tiles_with_shared_statistics

    model = _tiny_autoencoder(16)
    x = torch.zeros(1, 3, 96, 80)
    x[:, :, 52:, 44:] = torch.rand(1, 3, 44, 36) * 2 - 1  # an object in one corner, background elsewhere
    enc, dec = model.encoder, model.decoder
    with torch.no_grad():
        h = enc.features(x)
        want = _gathered_layer_by_layer([enc.down_blocks], enc.features, x, 32, 24, 0.25, 32)
        got = blend_tiles_with_shared_statistics(enc.feature_steps(), x, 32, 24, 0.25, 32)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert (blend_tiles(enc.features, x, 32, 24, 0.25, 32) - want).abs().max() > 0.1
        want = _gathered_layer_by_layer([dec.up_blocks, dec.conv_norm_out], dec.pixels, h, 8, 6, 4.0, 3)
        got = blend_tiles_with_shared_statistics(dec.pixel_steps(), h, 8, 6, 4.0, 3)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert (blend_tiles(dec.pixels, h, 8, 6, 4.0, 3) - want).abs().max() > 0.1


def test_tiled_encode_and_decode_of_a_random_autoencoder_match_untiled():
    """The mid-block attention runs on the whole latent and the GroupNorms use whole-image
    statistics, so tiles differ from the untiled pass only through the zero padding at their
    borders, which the blending halo keeps out: the encoder's receptive field (8 pixels) fits in
    the halo (a quarter of a 32-pixel overlap), the decoder's reaches a little past it."""
    torch.manual_seed(14)
    config = AutoencoderKLConfig(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                                 up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8)  # fmt: skip
    model = AutoencoderKL(config, Tiling(tile_size=64, overlap=0.5, auto_above=None)).eval()
    x = torch.zeros(1, 3, 128, 128)
    x[:, :, 68:, 68:] = torch.rand(1, 3, 60, 60) * 2 - 1  # an object in one corner, background elsewhere
    with torch.no_grad():
        mean = model.encode(x, tile=False).mean
        torch.testing.assert_close(model.encode(x, tile=True).mean, mean, atol=1e-4, rtol=0)
        image = model.decode(mean, tile=False)
        torch.testing.assert_close(model.decode(mean, tile=True), image, atol=0.02, rtol=0)
        model.tiling.shared_norm_statistics = False  # per-tile statistics: visibly off
        assert (model.encode(x, tile=True).mean - mean).abs().max() > 0.5
        assert (model.decode(mean, tile=True) - image).abs().max() > 0.5


def test_psnr_and_ssim():
    import numpy as np

    from gencli.data import shapes
    from gencli.pipelines.generative.metrics import psnr, ssim

    a = shapes.render(5, 64).image
    shifted = np.clip(a.astype(int) + 5, 0, 255).astype(np.uint8)
    exact = shifted.astype(float) - a  # 5 except where clipped
    want = 10 * np.log10(255.0**2 / np.mean(exact**2))
    assert abs(float(psnr(shifted, a)) - want) < 1e-9 and float(psnr(a, a)) == float("inf")
    assert abs(float(ssim(a, a)) - 1.0) < 1e-12
    noisy = np.clip(a.astype(int) + np.random.default_rng(0).integers(-20, 20, a.shape), 0, 255).astype(np.uint8)
    # skimage.metrics.structural_similarity(a, noisy, gaussian_weights=True, sigma=1.5,
    # use_sample_covariance=False, data_range=255, channel_axis=-1) == 0.3977659715511887 (skimage 0.24)
    assert abs(float(ssim(noisy, a)) - 0.3977659715511887) < 1e-9
    both = ssim(np.stack([a, noisy]), np.stack([a, a]))
    assert both.shape == (2,) and float(both[0]) == pytest.approx(1.0)
