"""The image commands used as a demanding user uses them: prompts files with per-prompt sizes and LoRA
tags, unreadable inputs among readable ones, replaying a JPEG. Each test fails without its fix."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import one_error_line, shapes_png
from PIL import Image
from typer.testing import CliRunner

from gencli.cli import app
from gencli.errors import UserError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def invoke(*args, input=None):
    return CliRunner().invoke(app, [*map(str, args)], input=input)


def truncated_png(path, size: int = 64):
    """A PNG cut short in its image data: PIL opens it, decoding it fails."""
    shapes_png(path, size)
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"IDAT") + 20])
    return path


def test_img2img_prompt_line_with_another_size_is_one_error(tmp_path, monkeypatch):
    # the source image is read once at the run's size: a prompt line asking for another size used to
    # reach the UNet with mismatched latents (an internal error, exit 1)
    monkeypatch.chdir(tmp_path)
    shapes_png(tmp_path / "src.png", 64)
    (tmp_path / "p.jsonl").write_text('{"prompt": "a red star", "width": 32}\n')
    r = invoke("img2img", "src.png", "--prompts-file", "p.jsonl", "--steps", "2", "--seed", "1", "-o", "out.png")
    one_error_line(r, "'p.jsonl' line 1", '"width": 32', "64x64")
    assert not (tmp_path / "out.png").exists()


def test_img2img_prompt_line_with_the_run_size_is_fine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shapes_png(tmp_path / "src.png", 64)
    (tmp_path / "p.jsonl").write_text('{"prompt": "a red star", "height": 32}\n')
    r = invoke("img2img", "src.png", "--prompts-file", "p.jsonl", "--height", "32", "--steps", "2", "--seed", "1", "-o", "out.png")
    assert r.exit_code == 0, r.output
    assert Image.open(tmp_path / "out.png").size == (64, 32)


def test_lora_tag_in_some_prompts_only_is_refused(tmp_path, monkeypatch):
    # the LoRAs are merged into the model once per run: the prompt without a tag used to be drawn
    # with the other prompt's LoRA, its PNG recording a Lora hash that replay then refused
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("a yellow arrow <lora:lora-arrow:1>\na red star\n")
    r = invoke("txt2img", "--prompts-file", "p.txt", "--steps", "1", "--seed", "0", "-o", "out-{i}.png")
    one_error_line(r, "<lora:lora-arrow:1>", "no <lora:...> tag", "separately")
    assert not list(tmp_path.glob("out-*.png"))


def test_run_loras_compares_every_image_text():
    from gencli.pipelines.diffusion.lora import run_loras

    with pytest.raises(UserError, match="different <lora"):
        run_loras([], ["a star", "an arrow <lora:lora-arrow:0.5>"], None)
    with pytest.raises(UserError, match="different <lora"):
        run_loras([], ["an arrow <lora:lora-arrow:0.5>", "a star"], None)
    # the same tags in every image (a tag in a negative prompt counts for its image), None skipped
    specs = run_loras([], ["an arrow <lora:lora-arrow:0.5>", None, "a star\nblurry <lora:lora-arrow:0.5>"], None)
    assert [(s.name, s.weight) for s in specs] == [("lora-arrow", 0.5)]


@pytest.mark.parametrize("command", ["encode", "reconstruct"])
def test_an_unreadable_input_after_a_readable_one_writes_nothing(tmp_path, monkeypatch, command):
    # the inputs used to be read one by one as they were processed: the first output was written,
    # then the run stopped at the unreadable one (half the outputs, no results for the written one)
    monkeypatch.chdir(tmp_path)
    shapes_png(tmp_path / "good.png", 64)
    truncated_png(tmp_path / "bad.png")
    r = invoke(command, "good.png", "bad.png", "--out-dir", "out")
    one_error_line(r, "'bad.png'", "truncated")
    assert not (tmp_path / "out").exists()


def test_replay_reads_the_parameters_of_a_jpeg(tmp_path, monkeypatch):
    # -o NAME.jpg writes the parameters into the JPEG comment; replay said the file had none
    monkeypatch.chdir(tmp_path)
    for name in ("a.png", "a.jpg"):
        r = invoke("txt2img", "a red star on a blue background", "--steps", "1", "--seed", "3", "-o", name)
        assert r.exit_code == 0, r.output
    r = invoke("replay", "a.jpg", "-o", "again.png")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "again.png").read_bytes() == (tmp_path / "a.png").read_bytes()
    assert np.array_equal(np.asarray(Image.open(tmp_path / "again.png")), np.asarray(Image.open(tmp_path / "a.png")))


def test_webp_and_jpeg_carry_the_parameters_in_exif_user_comment(tmp_path, monkeypatch):
    # a .webp output held no parameters at all, and a JPEG only a comment: A1111 and the image sites
    # read JPEG/WebP settings from EXIF's UserComment (UNICODE, UTF-16 big-endian, as piexif writes it)
    from gencli.pipelines.vision.images import EXIF_IFD, EXIF_USER_COMMENT

    monkeypatch.chdir(tmp_path)
    for name in ("a.png", "a.webp", "a.jpg"):
        r = invoke("txt2img", "a red star on a blue background", "--steps", "1", "--seed", "3", "-o", name)
        assert r.exit_code == 0, r.output
    png_text = Image.open("a.png").info["parameters"]
    for name in ("a.webp", "a.jpg"):
        raw = Image.open(name).getexif().get_ifd(EXIF_IFD)[EXIF_USER_COMMENT]
        assert raw == b"UNICODE\x00" + png_text.encode("utf-16-be"), name
    r = invoke("replay", "a.webp", "-o", "again.png")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "again.png").read_bytes() == (tmp_path / "a.png").read_bytes()
    # a file whose only parameters are a little-endian UserComment (another writer's) replays too
    exif = Image.Exif()
    exif.get_ifd(EXIF_IFD)[EXIF_USER_COMMENT] = b"UNICODE\x00" + png_text.encode("utf-16-le")
    Image.open("a.png").convert("RGB").save("le.jpg", exif=exif.tobytes())
    r = invoke("replay", "le.jpg", "-o", "le-again.png")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "le-again.png").read_bytes() == (tmp_path / "a.png").read_bytes()
