"""Shared test fixtures. Tests never need a GPU and never assert on wall-clock time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_cli(*args: str, input: str | None = None, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m gencli ARGS`` in a fresh process (what a user's shell does)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run([sys.executable, "-m", "gencli", *args], capture_output=True, text=True, input=input, env=full_env, cwd=cwd, timeout=600)


def one_error_line(result, *needles: str) -> str:
    """The contract for bad input: exit code 2 and exactly one ``error: ...`` line on stderr that
    names each of ``needles``. ``result`` is a subprocess result or a typer ``CliRunner`` result."""
    code = getattr(result, "returncode", getattr(result, "exit_code", None))
    assert code == 2, (code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """Model hashes are remembered in the user's cache directory: the tests (and the commands they
    start) use a cache of their own."""
    os.environ["GENCLI_CACHE_DIR"] = str(tmp_path_factory.mktemp("gencli-cache"))


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    """rich tables render at the terminal's width, 80 columns when there is none: a wide one keeps
    the temporary paths in the tests' tables from folding (where they fold moves with their length)."""
    monkeypatch.setenv("COLUMNS", "400")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: one torch thread is as fast, and does not wait on a busy machine's other cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cli():
    return run_cli


def on_ci() -> bool:
    """Whether this run is CI's (``CI`` set, as CI services and .ci/run set it)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def cannot_run_here(reason: str) -> None:
    """A test whose requirement this machine lacks: a skip whose one-line reason says why, except on
    CI, where the requirement is part of the setup and its absence is a failure, not a silent skip."""
    if on_ci():
        pytest.fail(f"{reason} (CI must be able to run this test)", pytrace=False)
    pytest.skip(reason)


def built_quant_kernels():
    """gencli's compiled CPU extension, or :func:`cannot_run_here` with the reason it cannot be built."""
    from gencli.backend import quant_kernels

    kernels = quant_kernels.cpu_kernels()
    if kernels is None:
        cannot_run_here(f"the quantized CPU kernels cannot be built here: {quant_kernels.unavailable_reason()}")
    return kernels


@pytest.fixture
def quant_kernels_built():
    """For ``pytest.mark.usefixtures``: the test needs gencli's CPU extension (see built_quant_kernels)."""
    return built_quant_kernels()


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    """gencli's CPU kernels on each instruction set the CPU has, forced in turn (the best one restored
    afterwards); where the extension cannot be built, see built_quant_kernels."""
    kernels = built_quant_kernels()
    best = kernels.isa()
    if not kernels.use_isa(request.param):
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    kernels.use_isa(best)


def shapes_png(path: Path, size: int = 32) -> Path:
    """A red square on black, ``size`` pixels wide, saved as ``path`` (PNG by its name)."""
    import numpy as np
    from PIL import Image

    x = np.zeros((size, size, 3), np.uint8)
    x[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = (200, 40, 40)
    Image.fromarray(x).save(path)
    return path


def write_scene_folder(root: Path, sizes) -> Path:
    """Test-split shapes-world scenes as ``img0.png``, ``img1.png`` ... (one per size: an int or a
    (width, height) pair) and one more in ``sub/deep.jpg`` (found only with --recursive)."""
    from gencli.data import shapes

    (root / "sub").mkdir()
    for i, (seed, size) in enumerate(zip(shapes.split_seeds("test", len(sizes)), sizes)):
        shapes.render(seed, size).pil().save(root / f"img{i}.png")
    shapes.render(9, 40).pil().save(root / "sub" / "deep.jpg")
    return root
