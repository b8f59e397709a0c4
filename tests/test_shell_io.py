"""The output layer, the input reader, the seed type and the image loader as a shell sees them (issue 30's
classes): real subprocesses, pipes, FIFOs and special files in a temporary folder, never real /dev nodes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, shapes_png
from PIL import Image

G = f"{sys.executable} -m gencli"


def _env(**extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1", **extra}
    env.pop("COLUMNS", None)
    return env


def sh(script: str, cwd: Path, timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    """A bash script with ``$G`` bound to this checkout's gencli (text output)."""
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=cwd, env=_env(G=G), timeout=timeout, **kw)


def one_error_line(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


# -- seeds: one sample never depends on its neighbours ------------------------------------------------
def test_a_seed_gives_the_same_bytes_alone_and_in_a_large_batch(tmp_path):
    r = sh("$G sample gan --seeds 0-63 --out-dir a -q && $G sample gan --seeds 5,3 --out-dir b -q", tmp_path)
    assert r.returncode == 0, r.stderr
    for s in (3, 5):
        assert (tmp_path / "a" / f"gan-seed{s}.png").read_bytes() == (tmp_path / "b" / f"gan-seed{s}.png").read_bytes(), s
    r = sh("$G sample vae --seeds 0-40 --out-dir c -q && $G sample vae --seeds 17 --out-dir d -q", tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c" / "vae-seed17.png").read_bytes() == (tmp_path / "d" / "vae-seed17.png").read_bytes()


def test_seeds_above_2_32_are_refused_everywhere(tmp_path):
    shapes_png(tmp_path / "a.png")
    big = str(2**32)
    for cmd in (f"txt2img x --seed {big}", f"sample gan --seed {big}", f"encode a.png --sample --seed {big}", "sample gan --seeds 4294967290-4294967296",
                "txt2img x --seeds 4294967296", "sample gan --seed 4294967295 -n 2", "txt2img x --seed 4294967295 -n 2"):  # fmt: skip
        r = sh(f"$G {cmd}", tmp_path)
        one_error_line(r, "")
        assert "4294967295" in r.stderr, (cmd, r.stderr)
    assert not list(tmp_path.glob("*.png"))[1:], "nothing written"


def test_sample_refuses_n_with_seeds(tmp_path):
    one_error_line(sh("$G sample gan -n 4 --seeds 1,2", tmp_path), "not both")


# -- the output layer: -, pipes, FIFOs, devices, redirects, formats ----------------------------------------
def test_binary_outputs_go_to_a_pipe_with_dash(tmp_path):
    shapes_png(tmp_path / "a.png")
    r = sh("$G encode a.png -o - | cat > z.bin && $G decode z.bin -o - | cat > d.png && $G sample gan -n 1 -o - | cat > s.png", tmp_path)
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    assert load_file(tmp_path / "z.bin")["latent_tensor"].shape[0] == 1
    assert Image.open(tmp_path / "d.png").format == "PNG" and Image.open(tmp_path / "s.png").format == "PNG"
    r = sh("$G sample gan -n 1 -o /dev/stdout > redirected.png && $G decode z.bin -o /dev/stdout > r2.png", tmp_path)
    assert r.returncode == 0, r.stderr
    assert Image.open(tmp_path / "redirected.png").format == "PNG" and Image.open(tmp_path / "r2.png").format == "PNG"


def test_fifos_and_devices_are_written_in_place_without_force(tmp_path):
    shapes_png(tmp_path / "a.png")
    os.mkfifo(tmp_path / "pipe")
    os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own, in the temp folder
    r = sh("cat pipe > got.bin & $G encode a.png -o pipe && wait && $G encode a.png -o null && $G decode got.bin -o null && $G sample gan -n 1 -o null",
           tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode) and stat.S_ISCHR(os.stat(tmp_path / "null").st_mode)
    assert (tmp_path / "got.bin").stat().st_size > 100


def test_dash_reads_stdin_for_decode_img2img_and_replay(tmp_path):
    shapes_png(tmp_path / "a.png")
    r = sh("$G encode a.png -o z.bin -q && cat z.bin | $G decode - -o d.png -q", tmp_path)
    assert r.returncode == 0, r.stderr
    assert Image.open(tmp_path / "d.png").size == (32, 32)
    r = sh("$G txt2img 'a star' --seed 3 -o t.png --steps 2 -q && cat t.png | $G replay - -o again.png -q && cmp t.png again.png", tmp_path)
    assert r.returncode == 0, r.stderr
    r = sh("cat a.png | $G img2img - 'a star' --steps 2 --seed 1 -o i.png -q", tmp_path)
    assert r.returncode == 0, r.stderr
    assert Image.open(tmp_path / "i.png").size == (32, 32)


def test_dash_is_not_a_folder(tmp_path):
    shapes_png(tmp_path / "a.png")
    for cmd in ("sample gan -n 2 --out-dir -", "encode a.png --out-dir -", "reconstruct a.png --out-dir -", "quantize llama-pystdlib -"):
        one_error_line(sh(f"$G {cmd}", tmp_path), "'-'")
    assert not (tmp_path / "-").exists()


def test_binary_never_goes_to_a_terminal_nor_into_json_lines(tmp_path):
    import pty

    main, secondary = pty.openpty()
    try:
        r = subprocess.run([sys.executable, "-m", "gencli", "sample", "gan", "-n", "1", "-o", "-"], stdout=secondary, stderr=subprocess.PIPE, text=True,
                           cwd=tmp_path, env=_env(), timeout=300)  # fmt: skip
    finally:
        os.close(secondary)
        os.close(main)
    one_error_line(r, "terminal")
    one_error_line(sh("$G sample gan -n 1 -o - --json > x.bin", tmp_path), "--json")
    one_error_line(sh("$G txt2img x -o - --json > y.bin", tmp_path), "--json")


def test_an_image_name_gets_its_own_format_or_a_refusal(tmp_path):
    r = sh("$G sample gan -n 1 -o s.jpg && $G sample gan -n 1 -o s.webp && $G txt2img x --steps 2 -o t.jpeg", tmp_path)
    assert r.returncode == 0, r.stderr
    assert [Image.open(tmp_path / n).format for n in ("s.jpg", "s.webp", "t.jpeg")] == ["JPEG", "WEBP", "JPEG"]
    one_error_line(sh("$G sample gan -n 1 -o s.txt", tmp_path), "not an image type")
    one_error_line(sh("$G txt2img x -o t.doc", tmp_path), "not an image type")


def test_a_closed_stdout_does_not_stop_the_images_asked_for(tmp_path):
    r = sh("$G txt2img x -n 5 --steps 2 --seed 1 --json | head -1; echo ${PIPESTATUS[0]}", tmp_path)
    assert r.stdout.splitlines()[-1] == "0", r.stderr
    assert len(list(tmp_path.glob("txt2img-*.png"))) == 5


# -- the image loader: every PIL mode the same way ------------------------------------------------------
def test_every_image_mode_reads_as_what_it_shows(tmp_path):
    from gencli.pipelines.vision.images import load_image

    grey16 = np.full((8, 8), 32768, np.uint16)
    Image.fromarray(grey16).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    assert abs(int(np.asarray(load_image(tmp_path / "g16.png"))[0, 0, 0]) - 128) <= 1, "16-bit grey is not white"
    Image.fromarray(np.full((8, 8), 1000, np.int32), "I").save(tmp_path / "i32.tif")
    assert int(np.asarray(load_image(tmp_path / "i32.tif"))[0, 0, 0]) == 4
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg", quality=100)
    r, g, b = np.asarray(load_image(tmp_path / "cmyk.jpg"))[4, 4]
    assert r > 200 and g < 60 and b < 60
    Image.new("LA", (8, 8), (0, 0)).save(tmp_path / "la.png")
    assert np.asarray(load_image(tmp_path / "la.png")).min() == 255, "transparent is white"
    p = Image.new("P", (8, 8), 0)
    p.putpalette([10, 20, 30] + [0] * 765)
    p.save(tmp_path / "p.png")
    assert tuple(np.asarray(load_image(tmp_path / "p.png"))[0, 0]) == (10, 20, 30)
    p.save(tmp_path / "pt.png", transparency=0)
    assert tuple(np.asarray(load_image(tmp_path / "pt.png"))[0, 0]) == (255, 255, 255)
    Image.new("1", (8, 8), 1).save(tmp_path / "b.png")
    assert np.asarray(load_image(tmp_path / "b.png")).min() == 255


def test_a_16_bit_image_encodes_like_its_8_bit_twin(tmp_path):
    grey = (np.arange(32 * 32).reshape(32, 32) % 200).astype(np.uint8)
    Image.fromarray(grey).save(tmp_path / "g8.png")
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "g16.png")
    r = sh("$G encode g8.png g16.png --out-dir z -q", tmp_path)
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / "z" / f"{n}.latent.safetensors")["latent_tensor"] for n in ("g8", "g16"))
    assert float((a - b).abs().max()) < 1e-5


# -- silent wrong results and internal errors become one line ---------------------------------------
def _latent(path: Path, z) -> Path:
    import torch
    from safetensors.torch import save_file

    save_file({"latent_tensor": torch.as_tensor(z, dtype=torch.float32), "latent_format_version_0": torch.tensor([])}, str(path))
    return path


def test_latents_that_cannot_make_an_image_are_refused(tmp_path):
    import torch

    z = torch.zeros(1, 4, 4, 4)
    z[0, 0, 0, 0] = float("nan")
    _latent(tmp_path / "nan.st", z)
    _latent(tmp_path / "inf.st", torch.full((1, 4, 4, 4), float("inf")))
    _latent(tmp_path / "empty.st", torch.zeros(0, 4, 4, 4))
    _latent(tmp_path / "flat.st", torch.zeros(1, 4, 0, 4))
    for name, needle in (("nan.st", "NaN"), ("inf.st", "NaN or infinite"), ("empty.st", "empty"), ("flat.st", "no pixels")):
        one_error_line(sh(f"$G decode {name} -o out.png", tmp_path), needle)
    assert not (tmp_path / "out.png").exists()


def test_input_mistakes_are_one_line_exit_2(tmp_path):
    shapes_png(tmp_path / "a.png")
    (tmp_path / "afile").write_text("x")
    one_error_line(sh("$G txt2img x -n 2 -o 'x-{i:q}.png'", tmp_path), "{i:q}")
    one_error_line(sh(f"$G txt2img x -o {'n' * 300}.png", tmp_path), "too long")
    one_error_line(sh(f"$G sample gan -n 1 -o {'n' * 300}.png", tmp_path), "too long")
    one_error_line(sh("$G reconstruct a.png --out-dir afile", tmp_path), "not a directory")
    r = sh("$G txt2img 'a star' --steps 2 --seed 1 -o t.png -q && $G replay t.png --init-image a.png -o r.png", tmp_path)
    one_error_line(r, "txt2img result")


def _with_parameters(src: Path, dst: Path, edit) -> Path:
    from PIL.PngImagePlugin import PngInfo

    im = Image.open(src)
    info = PngInfo()
    info.add_text("parameters", edit(im.info["parameters"]))
    im.save(dst, pnginfo=info)
    return dst


def test_replay_names_the_png_honours_seed_and_suggests_model(tmp_path):
    r = sh("$G txt2img 'a star' --steps 2 --seed 1 -o t.png -q && $G replay t.png --seed 9 -o r.png -q", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Seed: 9," in Image.open(tmp_path / "r.png").info["parameters"]
    _with_parameters(tmp_path / "t.png", tmp_path / "zero.png", lambda t: t.replace("Steps: 2", "Steps: 0"))
    r = sh("$G replay zero.png -o z.png", tmp_path)
    one_error_line(r, "Steps")
    assert "--steps" not in r.stderr and "parameters" in r.stderr
    _with_parameters(tmp_path / "t.png", tmp_path / "abc.png", lambda t: t.replace("Steps: 2", "Steps: abc"))
    r = sh("$G replay abc.png -o z.png", tmp_path)
    one_error_line(r, "'Steps: abc'")
    assert "invalid literal" not in r.stderr
    _with_parameters(tmp_path / "t.png", tmp_path / "sd.png", lambda t: t.replace("Model: txt2img-shapes", "Model: sd"))
    one_error_line(sh("$G replay sd.png -o z.png", tmp_path), "--model")


def test_reconstruct_honours_out_and_its_table_is_plain_on_a_pipe(tmp_path):
    shapes_png(tmp_path / "a.png")
    r = sh("$G reconstruct a.png --out-dir r -o table.txt && $G reconstruct a.png --out-dir r2 | cat", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "a.png" in (tmp_path / "table.txt").read_text() and "PSNR" in r.stdout
    assert not set("─│┃━┏┡└╭") & set(r.stdout)


def test_informational_lines_only_on_a_terminal_or_with_verbose(tmp_path):
    shapes_png(tmp_path / "a.png")
    r = sh("$G sample gan -n 1 -o s.png && $G encode a.png -o z.st && $G decode z.st -o d.png && $G txt2img x --steps 2 -o t.png", tmp_path)
    assert r.returncode == 0 and "wrote" not in r.stderr, r.stderr
    r = sh("$G sample gan -n 1 -o s2.png -v", tmp_path)
    assert "wrote s2.png" in r.stderr


def test_help_keeps_sentences_whole_and_ray_extra_visible(tmp_path):
    r = sh("COLUMNS=400 $G generate --help && COLUMNS=400 $G txt2img --help", tmp_path)
    assert "gencli[ray]" in r.stdout
    assert "read, and that 'gencli replay' regenerates" in r.stdout


# -- signals: a long render stops between blocks and tiles ---------------------------------------------
def test_a_pending_termination_stops_the_unet_and_the_vae_between_blocks():
    import torch

    from gencli.backend.interrupt import clear_interrupt, note_signal
    from gencli.errors import Terminated
    from gencli.models.autoencoder_kl.model import AutoencoderKL, AutoencoderKLConfig

    vae = AutoencoderKL(AutoencoderKLConfig(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                                            up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4)).eval()  # fmt: skip
    z = torch.zeros(1, 4, 8, 8)
    note_signal(signal.SIGTERM)
    try:
        with pytest.raises(Terminated), torch.no_grad():
            vae.decode(z, tile=False)
        with pytest.raises(Terminated), torch.no_grad():
            vae.decode(z, tile=True)
    finally:
        clear_interrupt()
    with torch.no_grad():
        assert vae.decode(z, tile=False).shape[-1] == 16
