"""Outputs that are not regular files, and names that must not lie about their bytes: `embed`'s
matrix and `segment`'s masks and overlays written into FIFOs and to stdout (``-``) through the output
layer, `sample --gif` and `encode` refusing a suffix that names another type. Real subprocesses and
FIFOs in a temporary folder, never real /dev nodes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import ROOT, one_error_line, shapes_png
from PIL import Image


def gencli(*args: str, cwd: Path, text: bool = True) -> subprocess.CompletedProcess:
    """``python -m gencli ARGS`` in ``cwd`` (stdout as bytes with ``text=False``; stderr always text)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "gencli", *args], capture_output=True, cwd=cwd, env=env, timeout=300)
    err = r.stderr.decode("utf-8", "replace")
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode("utf-8", "replace") if text else r.stdout, err)


def into_fifo(fifo: Path, *args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, bytes]:
    """Run gencli ARGS while a reader drains ``fifo``; the run and the bytes the reader got (a
    reader no writer ever came to is released, so a broken run fails the test instead of hanging it)."""
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    r = gencli(*args, cwd=cwd)
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))  # a writer opened and closed: the reader sees EOF
    try:
        data, _ = reader.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        reader.kill()
        data, _ = reader.communicate()
    return r, data


def is_fifo(path: Path) -> bool:
    return stat.S_ISFIFO(os.lstat(path).st_mode)


# -- embed ----------------------------------------------------------------------------------------------
def test_embed_writes_npy_and_safetensors_into_fifos_in_place(tmp_path):
    from safetensors.torch import load

    for name in ("e.safetensors", "e.npy"):
        os.mkfifo(tmp_path / name)
    r, data = into_fifo(tmp_path / "e.safetensors", "embed", "a red star", "a blue heart", "-o", "e.safetensors", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert is_fifo(tmp_path / "e.safetensors"), "the FIFO was replaced by a regular file"
    assert tuple(load(data)["embeddings"].shape) == (2, 160)
    r, data = into_fifo(tmp_path / "e.npy", "embed", "a red star", "a blue heart", "-o", "e.npy", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert is_fifo(tmp_path / "e.npy")
    assert np.load(io.BytesIO(data)).shape == (2, 160)


def test_embed_dash_writes_json_lines_or_the_format_asked(tmp_path):
    lines = gencli("embed", "a red star", "a blue heart", "-o", "-", cwd=tmp_path)
    assert lines.returncode == 0, lines.stderr
    assert lines.stdout == gencli("embed", "a red star", "a blue heart", "--json", cwd=tmp_path).stdout
    assert [json.loads(x)["text"] for x in lines.stdout.splitlines()] == ["a red star", "a blue heart"]
    r = gencli("embed", "a red star", "a blue heart", "-o", "-", "--format", "npy", cwd=tmp_path, text=False)
    assert r.returncode == 0, r.stderr
    matrix = np.load(io.BytesIO(r.stdout))
    np.testing.assert_allclose(matrix, np.array([json.loads(x)["embedding"] for x in lines.stdout.splitlines()]), atol=1e-6)
    os.mkfifo(tmp_path / "pipe")  # a name that says no format: --format decides
    r, data = into_fifo(tmp_path / "pipe", "embed", "a red star", "-o", "pipe", "--format", "safetensors", cwd=tmp_path)
    assert r.returncode == 0 and is_fifo(tmp_path / "pipe"), r.stderr
    from safetensors.torch import load

    assert tuple(load(data)["embeddings"].shape) == (1, 160)


def test_embed_format_mistakes_are_one_line_and_write_nothing(tmp_path):
    one_error_line(gencli("embed", "a", "-o", "-", "--json", cwd=tmp_path), "--json")
    one_error_line(gencli("embed", "a", "-o", "e.npy", "--format", "jsonl", cwd=tmp_path), "--format", ".jsonl")
    one_error_line(gencli("embed", "a", "--format", "npy", cwd=tmp_path), "--out")
    one_error_line(gencli("embed", "a", "-o", "e.txt", cwd=tmp_path), ".npy")
    assert not list(tmp_path.iterdir())


# -- segment --------------------------------------------------------------------------------------------
def test_segment_writes_masks_and_overlays_into_fifos(tmp_path):
    shapes_png(tmp_path / "scene.png", 48)
    os.mkfifo(tmp_path / "mask.png")
    os.mkfifo(tmp_path / "overlay")  # a pipe's name need not end in .png
    r, data = into_fifo(tmp_path / "mask.png", "segment", "scene.png", "-o", "mask.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert is_fifo(tmp_path / "mask.png")
    mask = Image.open(io.BytesIO(data))
    assert (mask.format, mask.mode, mask.size) == ("PNG", "P", (48, 48))
    r, data = into_fifo(tmp_path / "overlay", "segment", "scene.png", "--overlay", "overlay", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert is_fifo(tmp_path / "overlay") and json.loads(r.stdout)["overlay"] == "overlay"
    assert Image.open(io.BytesIO(data)).format == "PNG"


def test_segment_dash_writes_the_png_and_its_table_goes_to_stderr(tmp_path):
    shapes_png(tmp_path / "scene.png", 48)
    r = gencli("segment", "scene.png", "-o", "-", cwd=tmp_path, text=False)
    assert r.returncode == 0, r.stderr
    assert np.asarray(Image.open(io.BytesIO(r.stdout))).shape == (48, 48)
    assert "background" in r.stderr and "fraction" in r.stderr  # the per-class table, beside the image
    one_error_line(gencli("segment", "scene.png", "-o", "-", "--json", cwd=tmp_path), "--json")
    one_error_line(gencli("segment", "scene.png", "-o", "-", "--overlay", "-", cwd=tmp_path), "stdout")
    one_error_line(gencli("segment", "scene.png", "-o", "mask.jpg", cwd=tmp_path), ".png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scene.png"]


# -- a name never lies about its bytes -----------------------------------------------------------------
def test_gif_and_latent_names_must_not_name_another_type(tmp_path):
    shapes_png(tmp_path / "scene.png", 32)
    one_error_line(gencli("sample", "gan", "--interpolate", "3", "--gif", "-o", "walk.png", cwd=tmp_path), "walk.png", ".gif")
    one_error_line(gencli("encode", "scene.png", "-o", "latent.png", cwd=tmp_path), "latent.png", ".safetensors")
    one_error_line(gencli("encode", "scene.png", "-o", "latent.npy", cwd=tmp_path), ".safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scene.png"]
    os.mkfifo(tmp_path / "walk.png")  # a pipe's suffix means nothing: the GIF goes in
    r, data = into_fifo(tmp_path / "walk.png", "sample", "gan", "--interpolate", "3", "--gif", "-o", "walk.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert is_fifo(tmp_path / "walk.png") and Image.open(io.BytesIO(data)).format == "GIF"
    r = gencli("encode", "scene.png", "-o", "scene.latent", cwd=tmp_path)  # ComfyUI's suffix (and other names) still work
    assert r.returncode == 0, r.stderr
