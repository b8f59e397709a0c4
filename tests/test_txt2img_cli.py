"""`gencli txt2img`, `gencli img2img` and `gencli replay` on a tiny random diffusers pipeline: the
embedded-default lookup, generation_config.json defaults, seeds and output names, prompts files, the
PNG parameters and replay byte for byte, --json lines, and bad inputs (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from _diffusion_fixtures import build_reference, save_reference
from PIL import Image
from typer.testing import CliRunner

from gencli.cli import app

pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GENERATION = {"num_inference_steps": 3, "guidance_scale": 5.0, "sampler": "euler_a", "width": 16, "height": 16}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A weights/ folder whose txt2img-shapes is a tiny SD 1.x-shaped pipeline with a generation_config.json."""
    root = tmp_path_factory.mktemp("weights")
    save_reference(build_reference("sd1"), root / "txt2img-shapes", GENERATION)
    return root


@pytest.fixture
def env(weights, monkeypatch, tmp_path):
    monkeypatch.setenv("GENCLI_WEIGHTS", str(weights))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def invoke(*args, input=None):
    return CliRunner().invoke(app, [*map(str, args)], input=input)


def parameters(path) -> str:
    with Image.open(path) as im:
        return im.info["parameters"]


def test_default_model_seeds_json_and_replay(env):
    r = invoke("txt2img", "a red star", "--seeds", "4-5", "-o", "star-{seed}.png", "--json", "--negative-prompt", "blurry, dark")
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["file"] for row in rows] == ["star-4.png", "star-5.png"] and [row["seed"] for row in rows] == [4, 5]
    row = rows[0]
    assert (row["steps"], row["sampler"], row["guidance"], row["width"], row["height"]) == (3, "Euler a", 5.0, 16, 16)  # generation_config.json
    text = parameters(env / "star-4.png")
    assert text == row["parameters"]
    assert text.splitlines()[0] == "a red star" and text.splitlines()[1] == "Negative prompt: blurry, dark"
    assert "Steps: 3, Sampler: Euler a, CFG scale: 5, Seed: 4, Size: 16x16, Model hash: " in text and "Model: txt2img-shapes" in text
    a, b = (np.asarray(Image.open(env / f"star-{s}.png")) for s in (4, 5))
    assert a.shape == (16, 16, 3) and np.abs(a.astype(int) - b).max() > 10

    # replay: the model named in the parameters, the same bytes
    r = invoke("replay", "star-4.png", "-o", "again.png")
    assert r.exit_code == 0, r.output
    assert (env / "again.png").read_bytes() == (env / "star-4.png").read_bytes()
    # flags override the model's defaults; the same seed with other settings is another image
    r = invoke("txt2img", "a red star", "--seed", "4", "--steps", "2", "--sampler", "DPM++ 2M Karras", "-g", "1", "--width", "24", "-o", "other.png")
    assert r.exit_code == 0, r.output
    text = parameters(env / "other.png")
    assert "Steps: 2, Sampler: DPM++ 2M Karras, CFG scale: 1, Seed: 4, Size: 24x16" in text
    assert Image.open(env / "other.png").size == (24, 16)


def test_prompts_file_from_stdin_with_json_lines(env):
    lines = "\n".join([
        "a green circle",
        "# a comment",
        json.dumps({"prompt": "a blue square", "steps": 2, "seed": 9, "n": 2, "negative_prompt": "red"}),
        json.dumps({"prompt": "", "seeds": "1,3", "sampler": "ddim"}),
    ])  # fmt: skip
    r = invoke("txt2img", "--prompts-file", "-", "--seed", "100", "-o", "{i:02d}-{seed}.png", "--json", input=lines)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(row["file"], row["prompt"], row["seed"], row["steps"]) for row in rows] == [
        ("00-100.png", "a green circle", 100, 3),
        ("01-9.png", "a blue square", 9, 2),
        ("02-10.png", "a blue square", 10, 2),
        ("03-1.png", "", 1, 3),
        ("04-3.png", "", 3, 3),
    ]
    assert rows[1]["negative_prompt"] == "red" and rows[3]["sampler"] == "DDIM"
    assert parameters(env / "03-1.png").startswith("\nSteps: 3, Sampler: DDIM")  # the empty prompt: unconditional


def test_img2img_and_its_replay(env):
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((18, 21, 3)) * 255).astype(np.uint8)).save(env / "src.png")
    r = invoke("img2img", "src.png", "a red heart", "--strength", "0.7", "--seed", "2", "-o", "out.png", "--steps", "4")
    assert r.exit_code == 0, r.output
    assert Image.open(env / "out.png").size == (16, 16)  # rounded down to multiples of 8
    text = parameters(env / "out.png")
    assert "Denoising strength: 0.7" in text and "Steps: 4" in text
    r = invoke("replay", "out.png", "-o", "again.png")
    assert r.exit_code == 2 and "--init-image" in r.stderr and not (env / "again.png").exists()
    r = invoke("replay", "out.png", "-o", "again.png", "--init-image", "src.png")
    assert r.exit_code == 0, r.output
    assert (env / "again.png").read_bytes() == (env / "out.png").read_bytes()
    r = invoke("img2img", "src.png", "a red heart", "--strength", "0.3", "--seed", "2", "-o", "weak.png", "--steps", "4")
    assert r.exit_code == 0 and np.abs(np.asarray(Image.open("weak.png")).astype(int) - np.asarray(Image.open("out.png"))).max() > 5


def test_inpainting_keeps_the_black_part_and_replays_with_its_mask(env):
    rng = np.random.default_rng(1)
    Image.fromarray((rng.random((16, 16, 3)) * 255).astype(np.uint8)).save(env / "src.png")
    mask = np.zeros((16, 16), np.uint8)
    mask[:, 8:] = 255  # repaint the right half
    Image.fromarray(mask).save(env / "mask.png")
    args = ("img2img", "src.png", "a red heart", "--strength", "1", "--seed", "2", "--steps", "4")
    assert invoke(*args, "-o", "plain.png").exit_code == 0
    r = invoke(*args, "--mask", "mask.png", "-o", "inpainted.png")
    assert r.exit_code == 0, r.output
    assert "Mask blur: 0" in parameters(env / "inpainted.png")
    plain, inpainted = (np.asarray(Image.open(env / f)).astype(int) for f in ("plain.png", "inpainted.png"))
    assert np.abs(plain - inpainted).max() > 5
    r = invoke("replay", "inpainted.png", "-o", "again.png", "--init-image", "src.png")
    assert r.exit_code == 2 and "--mask" in r.stderr and not (env / "again.png").exists()
    r = invoke("replay", "inpainted.png", "-o", "again.png", "--init-image", "src.png", "--mask", "mask.png")
    assert r.exit_code == 0, r.output
    assert (env / "again.png").read_bytes() == (env / "inpainted.png").read_bytes()
    r = invoke("img2img", "src.png", "x", "--mask", "missing.png", "-o", "never.png")
    assert r.exit_code == 2 and "missing.png" in r.stderr and not (env / "never.png").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["x", "--width", "20"], "--width must be a multiple of 8"),
        (["x", "--height", "8192"], "--height must be a multiple of 8"),
        (["x", "--steps", "0"], "--steps must be at least 1"),
        (["x", "--guidance", "-1"], "--guidance must be from 0 to 100 (got -1.0)"),
        (["x", "--guidance", "1e30"], "--guidance must be from 0 to 100 (got 1e+30)"),
        (["x", "--guidance", "nan"], "--guidance must be from 0 to 100 (got nan)"),
        (["x", "--sampler", "nope"], "unknown sampler 'nope'; valid: ddpm, ddim"),
        (["x", "--seeds", "5-2"], "runs backwards"),
        (["x", "-n", "2", "-o", "one.png"], "names one file for 2 images"),
        (["x", "-o", "{name}.png"], "unknown placeholder {name}"),
        (["--prompts-file", "missing.txt"], "does not exist"),
        ([], "no prompt"),
        (["x", "-m", "nowhere/model"], "does not exist"),
    ],
)
def test_bad_inputs_one_line_exit_2(env, args, message):
    r = invoke("txt2img", *args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert list(env.glob("*.png")) == []


def test_files_are_never_replaced_without_force_and_broken_models(env, weights, tmp_path_factory):
    (env / "taken.png").write_bytes(b"keep")
    r = invoke("txt2img", "x", "-o", "taken.png")
    assert r.exit_code == 2 and "already exists" in r.stderr and (env / "taken.png").read_bytes() == b"keep"
    r = invoke("img2img", "nothere.png", "x", "-o", "y.png")
    assert r.exit_code == 2 and "nothere.png" in r.stderr
    r = invoke("img2img", "taken.png", "x", "--strength", "1.5")
    assert r.exit_code == 2 and "--strength must be in (0, 1]" in r.stderr
    r = invoke("replay", "taken.png")
    assert r.exit_code == 2 and "not a readable image" in r.stderr
    Image.new("RGB", (8, 8)).save(env / "plain.png")
    r = invoke("replay", "plain.png")
    assert r.exit_code == 2 and "has no 'parameters' text" in r.stderr
    # a pipeline folder missing a component, and a file that is not a Stable Diffusion checkpoint
    broken = tmp_path_factory.mktemp("broken") / "pipe"
    shutil.copytree(weights / "txt2img-shapes", broken)
    shutil.rmtree(broken / "unet")
    r = invoke("txt2img", "x", "-m", broken, "-o", "b.png")
    assert r.exit_code == 2 and "missing its 'unet' component" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = invoke("txt2img", "x", "-m", weights / "txt2img-shapes" / "vae" / "diffusion_pytorch_model.safetensors", "-o", "b.png")
    assert r.exit_code == 2 and "not a single-file Stable Diffusion checkpoint" in r.stderr and "AutoencoderKL" in r.stderr
    assert not (env / "b.png").exists()


def test_missing_default_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("GENCLI_WEIGHTS", str(tmp_path))
    r = invoke("txt2img", "x", "-o", str(tmp_path / "x.png"))
    assert r.exit_code == 2 and "txt2img-shapes" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_verbose_reports_device_dtype_attention_and_timing(env):
    r = invoke("txt2img", "x", "--seed", "1", "-o", "v.png", "--verbose", "--dtype", "float32")
    assert r.exit_code == 0, r.output
    assert "dtype float32" in r.stderr and "attention: torch scaled_dot_product_attention" in r.stderr
    assert "loaded in" in r.stderr and "s/step" in r.stderr
