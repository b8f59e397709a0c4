"""The diffusion UNet against diffusers' UNet2DConditionModel: random-initialised tiny SD 1.x-, 2.x- and
SDXL-shaped models saved with ``save_pretrained`` (folders, shards, fp16 variants) and written as
single-file checkpoints in the original layout, loaded by gencli and compared output for output."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gencli.backend.device import Placement
from gencli.errors import CheckpointError
from gencli.models.unet.single_file import (
    STANDARD_UNET_CONFIGS,
    infer_unet_config,
    original_unet_keymap,
    prediction_type_hint,
    standard_unet_config,
    unet_family,
)
from gencli.models.unet.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel
from gencli.pipelines.diffusion.unet_loading import load_unet, load_unet_single_file

diffusers = pytest.importorskip("diffusers")
from diffusers import UNet2DConditionModel as RefUNet  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU32 = Placement(torch.device("cpu"), torch.float32)


# Tiny configs of the three families. They follow the standard conventions that a single file's
# shapes cannot tell (SD 1.x: 8 heads; SD 2.x/SDXL: 64-wide heads; SDXL: 256-wide time-id
# embeddings; 32 GroupNorm groups), so the single-file tests can infer them back.
SD1 = dict(
    block_out_channels=(32, 64),
    layers_per_block=2,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
    sample_size=16,
)
SD2 = dict(
    block_out_channels=(64, 128, 128),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=48,
    attention_head_dim=(1, 2, 2),
    use_linear_projection=True,
    upcast_attention=True,
    sample_size=16,
)
SDXL = dict(
    block_out_channels=(64, 128, 128),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=64,
    attention_head_dim=(1, 2, 2),
    transformer_layers_per_block=(1, 1, 2),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=40 + 6 * 256,
    sample_size=16,
)
FAMILIES = {"sd1": SD1, "sd2": SD2, "sdxl": SDXL}


def _reference(kwargs: dict, seed: int = 0) -> RefUNet:
    torch.manual_seed(seed)
    ref = RefUNet(**kwargs).eval()
    with torch.no_grad():  # non-trivial weights everywhere (diffusers zero-initialises nothing here, but be sure)
        for p in ref.parameters():
            p.normal_(0.0, 0.05)
    return ref


def _inputs(kwargs: dict, batch: int = 3, size: tuple[int, int] = (16, 16), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 4, *size, generator=g)
    timesteps = torch.tensor([981, 500, 17, 250, 730][:batch])
    context = torch.randn(batch, 7, kwargs["cross_attention_dim"], generator=g)
    added = None
    if kwargs.get("addition_embed_type") == "text_time":
        pooled = kwargs["projection_class_embeddings_input_dim"] - 6 * kwargs["addition_time_embed_dim"]
        ids = torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0], [768.0, 1024.0, 16.0, 32.0, 1024.0, 1024.0], [512.0, 512.0, 0.0, 0.0, 512.0, 512.0]])
        added = {"text_embeds": torch.randn(batch, pooled, generator=g), "time_ids": ids[:batch]}
    return sample, timesteps, context, added


def _run_both(ref, ours, kwargs, **input_kwargs):
    sample, t, ctx, added = _inputs(kwargs, **input_kwargs)
    with torch.no_grad():
        expected = ref(sample, t, ctx, added_cond_kwargs=added).sample
        got = ours(sample, t, ctx, added_cond_kwargs=added)
    return got, expected


# -- the original (single-file) layout, written independently of gencli's key map ---------------
def diffusers_to_original(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A diffusers UNet state dict under the original CompVis/Stability names (``model.diffusion_model.*``)."""
    n = len(config["block_out_channels"])
    per = config["layers_per_block"]
    prefixes = {
        "time_embedding.linear_1.": "time_embed.0.",
        "time_embedding.linear_2.": "time_embed.2.",
        "add_embedding.linear_1.": "label_emb.0.0.",
        "add_embedding.linear_2.": "label_emb.0.2.",
        "conv_in.": "input_blocks.0.0.",
        "conv_norm_out.": "out.0.",
        "conv_out.": "out.2.",
        "mid_block.resnets.0.": "middle_block.0.",
        "mid_block.attentions.0.": "middle_block.1.",
        "mid_block.resnets.1.": "middle_block.2.",
    }
    for level in range(n):
        for j in range(per):
            entry = 1 + level * (per + 1) + j
            prefixes[f"down_blocks.{level}.resnets.{j}."] = f"input_blocks.{entry}.0."
            prefixes[f"down_blocks.{level}.attentions.{j}."] = f"input_blocks.{entry}.1."
        prefixes[f"down_blocks.{level}.downsamplers.0.conv."] = f"input_blocks.{1 + level * (per + 1) + per}.0.op."
    for u in range(n):
        attention = config["up_block_types"][u] == "CrossAttnUpBlock2D"
        for j in range(per + 1):
            entry = u * (per + 1) + j
            prefixes[f"up_blocks.{u}.resnets.{j}."] = f"output_blocks.{entry}.0."
            prefixes[f"up_blocks.{u}.attentions.{j}."] = f"output_blocks.{entry}.1."
        prefixes[f"up_blocks.{u}.upsamplers.0.conv."] = f"output_blocks.{u * (per + 1) + per}.{2 if attention else 1}.conv."
    resnet_layers = {
        "norm1.": "in_layers.0.",
        "conv1.": "in_layers.2.",
        "time_emb_proj.": "emb_layers.1.",
        "norm2.": "out_layers.0.",
        "conv2.": "out_layers.3.",
        "conv_shortcut.": "skip_connection.",
    }
    out = {}
    for name, tensor in state.items():
        prefix = max((p for p in prefixes if name.startswith(p)), key=len)
        rest = name[len(prefix) :]
        if ".resnets." in prefix:
            for a, b in resnet_layers.items():
                if rest.startswith(a):
                    rest = b + rest[len(a) :]
        out["model.diffusion_model." + prefixes[prefix] + rest] = tensor.contiguous()
    return out


def _write_single_file(ref: RefUNet, path: Path) -> dict[str, torch.Tensor]:
    tensors = diffusers_to_original(ref.state_dict(), dict(ref.config))
    # the other components of a real file, which the UNet loader must leave alone
    tensors["first_stage_model.decoder.conv_in.weight"] = torch.randn(8, 4, 3, 3)
    tensors["cond_stage_model.transformer.text_model.final_layer_norm.weight"] = torch.randn(8)
    tensors["model_ema.decay"] = torch.tensor(0.9999)
    save_file(tensors, str(path))
    return tensors


# -- parity: diffusers folders -------------------------------------------------------------------
@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_folder_parity(family, tmp_path):
    kwargs = FAMILIES[family]
    ref = _reference(kwargs)
    ref.save_pretrained(tmp_path / "unet")
    ours = load_unet(tmp_path / "unet", CPU32)
    got, expected = _run_both(ref, ours, kwargs)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert expected.abs().max() > 0.1  # a real signal, not a vanishing one
    # a size the downsampling does not divide: the up path follows the skip connections' sizes
    got, expected = _run_both(ref, ours, kwargs, batch=2, size=(13, 11))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_plain_layout_matches_fast_path_and_scalar_timesteps():
    """The module built directly (NCHW, unpacked) agrees with diffusers; timesteps as an int, a float
    and a 0-d tensor broadcast over the batch."""
    ref = _reference(SD2, seed=3)
    ours = UNet2DConditionModel(dict(ref.config)).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    sample, _, ctx, _ = _inputs(SD2, batch=2)
    with torch.no_grad():
        for t in (421, 421.5, torch.tensor(421)):
            torch.testing.assert_close(ours(sample, t, ctx), ref(sample, t, ctx).sample, atol=1e-4, rtol=1e-4)
        plain = ours(sample, 37, ctx)
        fast = ours.use_channels_last().prepack_convolutions()
        fast(sample, 37, ctx)  # packs
        torch.testing.assert_close(fast(sample, 37, ctx), plain, atol=1e-5, rtol=1e-5)
    assert fast(sample, 37, ctx).is_contiguous()


def test_sharded_fp16_variant_folder(tmp_path):
    ref = _reference(SD1, seed=5).to(torch.float16)
    ref.save_pretrained(tmp_path / "unet", variant="fp16", max_shard_size="100KB")
    files = sorted(p.name for p in (tmp_path / "unet").iterdir())
    assert "diffusion_pytorch_model.safetensors.index.fp16.json" in files and sum(".fp16-" in f for f in files) > 1
    ours = load_unet(tmp_path / "unet", CPU32, variant="fp16")
    assert ours.dtype == torch.float32
    got, expected = _run_both(ref.float(), ours, SD1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(CheckpointError, match="no 'bf16' variant"):
        load_unet(tmp_path / "unet", CPU32, variant="bf16")


def test_single_fp16_variant_next_to_fp32_weights(tmp_path):
    ref = _reference(SD1, seed=6)
    ref.save_pretrained(tmp_path / "unet")
    ref.half().save_pretrained(tmp_path / "unet", variant="fp16")
    (tmp_path / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    ours = load_unet(tmp_path / "unet", CPU32, variant="fp16")  # and without asking: the only weights there
    plain = load_unet(tmp_path / "unet", CPU32)
    got, expected = _run_both(ref.float(), ours, SD1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(plain(*_inputs(SD1)[:3]), got)


# -- parity: single files in the original layout --------------------------------------------------
@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_single_file_parity_with_inferred_config(family, tmp_path):
    kwargs = FAMILIES[family]
    ref = _reference(kwargs, seed=7)
    ref.save_pretrained(tmp_path / "unet")
    path = tmp_path / "model.safetensors"
    _write_single_file(ref, path)
    sample, t, ctx, added = _inputs(kwargs)
    with torch.no_grad():
        expected = ref(sample, t, ctx, added_cond_kwargs=added).sample
        # the file is what diffusers' own single-file conversion reads back into the same model
        theirs = RefUNet.from_single_file(str(path), config=str(tmp_path / "unet"), local_files_only=True)
        torch.testing.assert_close(theirs(sample, t, ctx, added_cond_kwargs=added).sample, expected, atol=1e-6, rtol=1e-6)
        ours = load_unet(path, CPU32)  # no config: inferred from the tensors
        torch.testing.assert_close(ours(sample, t, ctx, added_cond_kwargs=added), expected, atol=1e-4, rtol=1e-4)
    # every architectural field inferred as diffusers had it (the default sample size and the
    # upcast flag are not in the shapes, and change nothing here)
    built = replace(UNet2DConditionConfig.from_dict(dict(ref.config)), sample_size=ours.config.sample_size, upcast_attention=False)
    assert ours.config == built


def test_single_file_with_a_given_config_and_conv_projections_stored_as_linear(tmp_path):
    """A diffusers config overrides inference; proj_in/proj_out stored 2-D load into 1x1 convs."""
    ref = _reference(SD1, seed=8)
    ref.save_pretrained(tmp_path / "unet")
    tensors = diffusers_to_original(ref.state_dict(), dict(ref.config))
    for k in list(tensors):
        if k.endswith(("proj_in.weight", "proj_out.weight")):
            tensors[k] = tensors[k][:, :, 0, 0].contiguous()
    save_file(tensors, str(tmp_path / "sd.safetensors"))
    ours = load_unet_single_file(tmp_path / "sd.safetensors", CPU32, config=tmp_path / "unet")
    got, expected = _run_both(ref, ours, SD1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(STANDARD_UNET_CONFIGS))
def test_inference_recovers_the_standard_configs(family):
    """Full-size SD 1.x / 2.x / SDXL / refiner shapes (a meta-device diffusers model, no memory):
    inference gives back the shipped config, and the key map covers every tensor."""
    config = standard_unet_config(family)
    with torch.device("meta"):
        ref = RefUNet.from_config(config)
    state = diffusers_to_original(ref.state_dict(), dict(ref.config))
    inferred = infer_unet_config({k: tuple(v.shape) for k, v in state.items()})
    assert UNet2DConditionConfig.from_dict(inferred) == UNet2DConditionConfig.from_dict(config)
    assert inferred["sample_size"] == config["sample_size"]
    assert unet_family(inferred) == family
    plan = original_unet_keymap(inferred).plan(state.keys(), inferred)
    assert set(plan) == set(ref.state_dict())


# -- bad input --------------------------------------------------------------------------------------
def test_a_file_that_does_not_fit_names_the_tensor(tmp_path):
    ref = _reference(SD1, seed=9)
    ref.save_pretrained(tmp_path / "unet")
    tensors = diffusers_to_original(ref.state_dict(), dict(ref.config))
    key = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight"
    tensors[key] = tensors[key][:16].contiguous()  # conv1 of the first ResNet block: 16 channels instead of 32
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_unet_single_file(tmp_path / "bad.safetensors", CPU32, config=tmp_path / "unet")
    message = str(err.value)
    assert "\n" not in message and "down_blocks.0.resnets.0.conv1.weight" in message and "input_blocks.1.0.in_layers.2.weight" in message

    del tensors[key]
    save_file(tensors, str(tmp_path / "missing.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'down_blocks\.0\.resnets\.0\.conv1\.weight'"):
        load_unet_single_file(tmp_path / "missing.safetensors", CPU32, config=tmp_path / "unet")
    with pytest.raises(CheckpointError, match=r"input_blocks\.1\.0\.out_layers\.3\.weight|not a Stable Diffusion UNet"):
        del tensors["model.diffusion_model.input_blocks.1.0.out_layers.3.weight"]
        save_file(tensors, str(tmp_path / "broken.safetensors"))
        load_unet(tmp_path / "broken.safetensors", CPU32)


def test_not_a_unet(tmp_path):
    save_file({"encoder.weight": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="neither a single-file Stable Diffusion checkpoint"):
        load_unet(tmp_path / "other.safetensors", CPU32)
    with pytest.raises(CheckpointError, match="no UNet tensors"):
        infer_unet_config({"encoder.weight": (2, 2)})


def test_folder_config_that_does_not_match_the_weights(tmp_path):
    ref = _reference(SD1, seed=10)
    ref.save_pretrained(tmp_path / "unet")
    cfg = json.loads((tmp_path / "unet" / "config.json").read_text())
    cfg["cross_attention_dim"] = 40
    (tmp_path / "unet" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"attn2\.to_k\.weight' has shape \[32, 32\]"):
        load_unet(tmp_path / "unet", CPU32)


@pytest.mark.parametrize(
    "field,value",
    [
        ("class_embed_type", "projection"),
        ("down_block_types", ["AttnDownBlock2D", "DownBlock2D"]),
        ("addition_embed_type", "text"),
        ("time_embedding_type", "fourier"),
    ],
)
def test_unsupported_config_is_one_clear_error(field, value, tmp_path):
    ref = _reference(SD1, seed=11)
    ref.save_pretrained(tmp_path / "unet")
    cfg = json.loads((tmp_path / "unet" / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "unet" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not supported"):
        load_unet(tmp_path / "unet", CPU32)


# -- config and hints -----------------------------------------------------------------------------
def test_config_round_trips_through_diffusers():
    for kwargs in FAMILIES.values():
        ref = RefUNet(**kwargs)
        ours = UNet2DConditionConfig.from_dict(dict(ref.config))
        again = RefUNet.from_config(ours.to_dict())
        assert UNet2DConditionConfig.from_dict(dict(again.config)) == ours
        assert set(again.state_dict()) == set(ref.state_dict())


def test_prediction_type_hint():
    sd2 = standard_unet_config("sd2")
    name = "model.diffusion_model.output_blocks.11.1.transformer_blocks.0.norm1.bias"
    wide, narrow = torch.linspace(-0.3, 0.3, 64), torch.linspace(-0.05, 0.05, 64)
    assert prediction_type_hint(sd2, [name], lambda _: wide) == "v_prediction"
    assert prediction_type_hint(sd2, [name], lambda _: narrow) is None
    assert prediction_type_hint({**sd2, "in_channels": 9}, [name], lambda _: wide) is None  # inpainting
    assert prediction_type_hint(standard_unet_config("sd1"), [name], lambda _: wide) is None
    assert prediction_type_hint(standard_unet_config("sdxl"), ["v_pred"], lambda _: None) == "v_prediction"
    assert prediction_type_hint(standard_unet_config("sdxl"), [], lambda _: None) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        # asymmetric transformer depths per layer, up path given separately
        dict(
            transformer_layers_per_block=[[1], [2]],
            reverse_transformer_layers_per_block=[[2, 1], [1, 3]],
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        ),
        # attn1 attends to the context too
        dict(only_cross_attention=True),
        # per-level layers, scale-shift time conditioning, an activation on the embedding, 1x1 in/out
        # convs, centred input, another sinusoid convention, no middle block
        dict(
            layers_per_block=(1, 2),
            resnet_time_scale_shift="scale_shift",
            time_embedding_act_fn="silu",
            conv_in_kernel=1,
            conv_out_kernel=1,
            center_input_sample=True,
            freq_shift=1,
            flip_sin_to_cos=False,
            mid_block_type=None,
        ),
    ],
)
def test_less_common_config_fields(kwargs):
    base = dict(
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=8,
    )
    kwargs = {**base, **kwargs}
    ref = _reference(kwargs, seed=12)
    ours = UNet2DConditionModel(dict(ref.config)).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    got, expected = _run_both(ref, ours, kwargs, batch=2, size=(8, 8))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
