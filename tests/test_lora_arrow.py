"""The shipped example LoRA, weights/lora-arrow: it teaches txt2img-shapes the arrow, a shape the base
model never saw (it draws circles for it), in kohya's format; found by its name with --lora and by a
<lora:lora-arrow> tag without --lora-dir; recorded in the PNG and found again by replay."""

from __future__ import annotations

import numpy as np
import torch

from gencli.weights import weights_dir

BASE = weights_dir() / "txt2img-shapes"
FILE = weights_dir() / "lora-arrow" / "lora-arrow.safetensors"


def test_the_file_is_a_small_kohya_lora_of_the_unets_attention():
    from safetensors import safe_open

    assert FILE.is_file() and FILE.stat().st_size < 600_000
    with safe_open(str(FILE), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
        assert all(f.get_tensor(k).dtype == torch.float16 for k in keys)
    assert len(keys) == 3 * 56 and all(k.startswith("lora_unet_") and k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for k in keys)
    assert meta["gencli_trigger_word"] == "arrow" and meta["ss_base_model"] == "txt2img-shapes"


def test_it_draws_arrows_where_the_base_model_draws_none():
    """Eight held-out arrow prompts (test-split scenes), judged by the shape templates: the base model
    draws no arrow, the LoRA at weight 1 draws them (91% of 200 in scripts/eval_txt2img.py)."""
    from gencli.data.shapes_txt2img import eval_items
    from gencli.pipelines.diffusion.lora import LoraSpec
    from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, resolve_settings
    from scripts.eval_txt2img import geometric_shapes

    items = eval_items(8, shape="arrow")
    prompts, seeds = [it.prompt for it in items], [it.seed for it in items]
    verdicts = {}
    for name, loras in (("base", []), ("lora", [LoraSpec(FILE, 1.0)])):
        pipe = load_pipeline(BASE, device="cpu", dtype="float32", loras=loras)
        images = np.stack([r.pixels for r in generate(pipe, prompts, seeds, resolve_settings(pipe))])
        verdicts[name] = geometric_shapes(images)
    assert verdicts["base"].count("arrow") == 0, verdicts
    assert verdicts["lora"].count("arrow") >= 6, verdicts


def test_found_by_name_and_by_tag_recorded_and_replayed(tmp_path, monkeypatch):
    from PIL import Image
    from typer.testing import CliRunner

    from gencli.cli import app
    from gencli.pipelines.diffusion.lora import embedded_lora, lora_hash, parse_lora_option

    assert embedded_lora("lora-arrow") == FILE and embedded_lora("no-such-lora") is None and embedded_lora("../x") is None
    assert parse_lora_option("lora-arrow:0.8").path == FILE and parse_lora_option("lora-arrow:0.8").weight == 0.8
    monkeypatch.chdir(tmp_path)

    def invoke(*args):
        r = CliRunner().invoke(app, [*args])
        assert r.exit_code == 0, r.output
        return r

    prompt = "a green arrow on a black background"
    invoke("txt2img", f"{prompt} <lora:lora-arrow:0.8>", "--seed", "4", "--steps", "8", "-o", "tag.png")
    invoke("txt2img", prompt, "--lora", "lora-arrow:0.8", "--seed", "4", "--steps", "8", "-o", "name.png")
    invoke("txt2img", prompt, "--lora", f"{FILE}:0.8", "--seed", "4", "--steps", "8", "-o", "file.png")
    tag, name, file = (np.asarray(Image.open(f"{n}.png").convert("RGB")) for n in ("tag", "name", "file"))
    assert np.array_equal(tag, file) and np.array_equal(name, file)
    assert f'Lora hashes: "lora-arrow: {lora_hash(FILE)}"' in Image.open("tag.png").info["parameters"]
    invoke("replay", "tag.png", "-o", "again.png")
    assert np.array_equal(np.asarray(Image.open("again.png").convert("RGB")), tag)


def test_a_tag_naming_no_embedded_lora_still_asks_for_lora_dir(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from gencli.cli import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["txt2img", "a red arrow <lora:lora-zigzag:1>", "--steps", "2", "-o", "x.png"])
    assert r.exit_code == 2 and "--lora-dir" in r.output
    assert not (tmp_path / "x.png").exists()
