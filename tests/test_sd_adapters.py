"""What Stable Diffusion users add to a checkpoint: LoRA files (kohya/A1111 and diffusers/PEFT formats)
against diffusers' ``load_lora_weights`` + ``fuse_lora``, on tiny random SD 1.x- and SDXL-shaped
pipelines; the LoRA options, tags, hashes and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _diffusion_fixtures import build_reference, save_reference
from _lora_fixtures import random_lora, save_lora

from gencli.errors import CheckpointError, UserError
from gencli.pipelines.diffusion.lora import LoraSpec, lora_hash, parse_lora_option, run_loras, strip_lora_tags
from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, resolve_settings

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["a small red star at the top left on a blue background", "a green circle"]
SEEDS = [3, 11]
SIZE = 16
STEPS = 4
MAX_PIXEL_DIFF = 2  # of 255

_FOLDERS: dict = {}


def _folder(family: str, tmp_path_factory):
    if family not in _FOLDERS:
        _FOLDERS[family] = save_reference(build_reference(family), tmp_path_factory.mktemp(family))
    return _FOLDERS[family]


def _reference(family: str, folder):
    cls = diffusers.StableDiffusionXLPipeline if family == "sdxl" else diffusers.StableDiffusionPipeline
    ref = cls.from_pretrained(str(folder))
    ref.set_progress_bar_config(disable=True)
    ref.scheduler = diffusers.EulerDiscreteScheduler.from_config(ref.scheduler.config)
    return ref


def _reference_images(ref) -> np.ndarray:
    out = ref(prompt=PROMPTS, negative_prompt=["", ""], num_inference_steps=STEPS, height=SIZE, width=SIZE, guidance_scale=6.0,
              generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="np").images  # fmt: skip
    return (out * 255).round().astype(np.uint8)


def _ours(pipe, prompts=PROMPTS) -> np.ndarray:
    settings = resolve_settings(pipe, steps=STEPS, guidance=6.0, sampler="euler", width=SIZE, height=SIZE)
    return np.stack([g.pixels for g in generate(pipe, prompts, SEEDS, settings, negative_prompts=["", ""])])


def _diff(a, b) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def _original_names(ref) -> dict:
    from gencli.models.unet.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel
    from gencli.pipelines.diffusion.lora import _weight_modules, original_unet_names

    unet = UNet2DConditionModel(UNet2DConditionConfig.from_dict(dict(ref.unet.config)))
    return {v: k for k, v in original_unet_names(unet, _weight_modules(unet)).items()}


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_lora_matches_diffusers_fuse_lora(family, tmp_path_factory, tmp_path):
    """Random LoRAs on attention, feed-forward, 3x3 convs (LoCon) and the text encoder(s): kohya's
    format (SD 1.x: diffusers paths; SDXL: original-layout paths, lora_te1/te2) and PEFT's, two at
    once with their own weights, against diffusers' load_lora_weights + fuse_lora(lora_scale=w)."""
    folder = _folder(family, tmp_path_factory)
    ref = _reference(family, folder)
    base = _reference_images(ref)
    kohya = save_lora(random_lora(ref, "kohya", seed=1, original_names=_original_names(ref) if family == "sdxl" else None), tmp_path / "k.safetensors")
    peft = save_lora(random_lora(ref, "peft", seed=2, rank=2), tmp_path / "p.safetensors")
    ref.load_lora_weights(str(kohya), adapter_name="k")
    ref.fuse_lora(lora_scale=0.7, adapter_names=["k"])
    ref.unload_lora_weights()
    want_one = _reference_images(ref)
    ref.load_lora_weights(str(peft), adapter_name="p")
    ref.fuse_lora(lora_scale=-0.4, adapter_names=["p"])
    ref.unload_lora_weights()
    want_two = _reference_images(ref)

    one = load_pipeline(folder, device="cpu", dtype="float32", loras=[LoraSpec(kohya, 0.7)])
    n_text = 2 if family == "sdxl" else 1
    assert [a.format for a in one.loras] == ["kohya"] and len(one.loras[0].layers) == 1 + n_text
    got_one = _ours(one)
    assert _diff(got_one, want_one) <= MAX_PIXEL_DIFF
    assert _diff(got_one, base) > 10  # the LoRA changes the image
    two = load_pipeline(folder, device="cpu", dtype="float32", loras=[LoraSpec(kohya, 0.7), LoraSpec(peft, -0.4)])
    assert two.loras[1].format == "peft"
    assert sum(two.loras[1].layers.values()) == len(random_lora(ref, "peft", rank=2)) // 2
    assert _diff(_ours(two), want_two) <= MAX_PIXEL_DIFF
    # a <lora:...> tag is not encoded: the prompt with it gives the same image
    assert _diff(_ours(two, [p + " <lora:k:0.7>" for p in PROMPTS]), _ours(two)) == 0


def test_lora_options_tags_and_hash(tmp_path):
    f = tmp_path / "my style.safetensors"
    save_lora({"lora_unet_x.lora_down.weight": torch.zeros(1, 2), "lora_unet_x.lora_up.weight": torch.zeros(2, 1)}, f)
    assert parse_lora_option(str(f)) == LoraSpec(f, 1.0)
    assert parse_lora_option(f"{f}:0.5") == LoraSpec(f, 0.5)
    with pytest.raises(UserError, match="not a number"):
        parse_lora_option(f"{f}:heavy")
    with pytest.raises(UserError, match="does not exist"):
        parse_lora_option(str(tmp_path / "nope.safetensors"))
    assert strip_lora_tags("a cat <lora:my style:0.8>, sitting<lora:x>") == "a cat , sitting"
    specs = run_loras([], ["a cat <lora:my style:0.8>", None], tmp_path)
    assert specs == [LoraSpec(f, 0.8, from_tag=True)]
    assert run_loras([], ["a cat <lora:my style>"], tmp_path)[0].weight == 1.0
    with pytest.raises(UserError, match="no file 'other.safetensors'"):
        run_loras([], ["<lora:other:1>"], tmp_path)
    with pytest.raises(UserError, match="--lora-dir"):
        run_loras([], ["<lora:other:1>"], None)
    with pytest.raises(UserError, match="not a number"):
        run_loras([], ["<lora:my style:x>"], tmp_path)
    # A1111's hash: SHA-256 of the bytes after the safetensors header, 12 hex digits
    import hashlib

    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert lora_hash(f) == hashlib.sha256(data[8 + n :]).hexdigest()[:12]


@pytest.fixture(scope="module")
def sd1_folder(tmp_path_factory):
    return _folder("sd1", tmp_path_factory)


def _bad(folder, path, match):
    with pytest.raises(CheckpointError, match=match):
        load_pipeline(folder, device="cpu", dtype="float32", loras=[LoraSpec(path)])


def test_bad_loras_are_one_line_errors(sd1_folder, tmp_path_factory, tmp_path):
    sd1 = _reference("sd1", sd1_folder)
    good = random_lora(sd1, "kohya", rank=2)
    # truncated
    f = save_lora(good, tmp_path / "t.safetensors")
    f.write_bytes(f.read_bytes()[:-100])
    _bad(sd1_folder, f, "truncated")
    # an SDXL LoRA on SD 1.x
    xl = _reference("sdxl", _folder("sdxl", tmp_path_factory))
    _bad(sd1_folder, save_lora(random_lora(xl, "kohya", rank=2, original_names=_original_names(xl)), tmp_path / "xl.safetensors"), "made for SDXL")
    _bad(
        sd1_folder,
        save_lora(random_lora(xl, "peft", rank=2, text=False), tmp_path / "xlp.safetensors"),
        "made for a 96-wide text context .* this model is a 32-wide",
    )
    # a key that matches no layer
    bad = dict(
        good, **{"lora_unet_down_blocks_7_attn_to_q.lora_down.weight": torch.zeros(2, 4), "lora_unet_down_blocks_7_attn_to_q.lora_up.weight": torch.zeros(4, 2)}
    )
    _bad(sd1_folder, save_lora(bad, tmp_path / "nomatch.safetensors"), "lora_unet_down_blocks_7_attn_to_q' matches no layer")
    # a rank mismatch
    key = next(k for k in good if k.endswith("lora_up.weight"))
    bad = dict(good, **{key: torch.zeros(good[key].shape[0], 3)})
    _bad(sd1_folder, save_lora(bad, tmp_path / "rank.safetensors"), "rank mismatch")
    # a full checkpoint given as a LoRA
    _bad(
        sd1_folder,
        save_lora({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2, 2)}, tmp_path / "full.safetensors"),
        "full Stable Diffusion checkpoint",
    )
    _bad(sd1_folder, save_lora({"x.hada_w1_a": torch.zeros(2, 2)}, tmp_path / "loha.safetensors"), "LoHa")


def test_cli_lora_flag_tag_parameters_and_replay(sd1_folder, tmp_path, monkeypatch):
    """--lora and <lora:NAME:W> on txt2img: the PNG records 'Lora hashes' as A1111 does, replay finds
    the files again (--lora-dir, or the --lora path given) and makes the same PNG; --verbose says how
    many layers each file touched; bad LoRA input is one line, exit 2, nothing written."""
    from conftest import one_error_line
    from PIL import Image
    from typer.testing import CliRunner

    from gencli.cli import app

    monkeypatch.chdir(tmp_path)
    ref = _reference("sd1", sd1_folder)
    loras = tmp_path / "loras"
    loras.mkdir()
    save_lora(random_lora(ref, "kohya", seed=5, rank=2), loras / "style.safetensors")
    other = save_lora(random_lora(ref, "peft", seed=6, rank=2, text=False), tmp_path / "detail.safetensors")

    def invoke(*args):
        return CliRunner().invoke(app, ["txt2img", "-m", str(sd1_folder), "--steps", "2", "--width", "16", "--height", "16", "--seed", "1", *args])

    r = invoke("a red star <lora:style:0.6>", "--lora-dir", str(loras), "--lora", f"{other}:0.5", "-o", "a.png", "--verbose")
    assert r.exit_code == 0, r.output
    assert "LoRA '" in r.stderr and "layers (" in r.stderr
    text = Image.open("a.png").info["parameters"]
    assert text.splitlines()[0] == "a red star <lora:style:0.6>"
    assert f'Lora hashes: "detail: {lora_hash(other)}, style: {lora_hash(loras / "style.safetensors")}"' in text
    assert 'Lora weights: "detail: 0.5"' in text
    plain = invoke("a red star", "-o", "plain.png")
    assert plain.exit_code == 0, plain.output
    assert _diff(np.asarray(Image.open("a.png")), np.asarray(Image.open("plain.png"))) > 5
    r = CliRunner().invoke(app, ["replay", "a.png", "-m", str(sd1_folder), "--lora-dir", str(loras), "--lora", str(other), "-o", "b.png"])
    assert r.exit_code == 0, r.output
    assert open("a.png", "rb").read() == open("b.png", "rb").read()
    # replay without the files: one line naming what is missing
    one_error_line(CliRunner().invoke(app, ["replay", "a.png", "-m", str(sd1_folder), "-o", "c.png"]), "detail")
    # bad input: a tag naming no file, a weight that is not a number, a truncated file
    one_error_line(invoke("a <lora:nope:1>", "--lora-dir", str(loras), "-o", "d.png"), "nope")
    one_error_line(invoke("a <lora:style:x>", "--lora-dir", str(loras), "-o", "d.png"), "not a number")
    one_error_line(invoke("a", "--lora", f"{other}:lots", "-o", "d.png"), "not a number")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(other.read_bytes()[:200])
    one_error_line(invoke("a", "--lora", str(broken), "-o", "d.png"), "broken.safetensors")
    assert not (tmp_path / "c.png").exists() and not (tmp_path / "d.png").exists()
