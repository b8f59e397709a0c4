"""A real wheel, installed where a user's `pip install` puts it: it carries the embedded default models
(weights/, installed inside the package by setup.py) and runs them from any folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

# what a checkout may hold besides its sources: never copied into the build
BUILD_LEFTOVERS = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "runs", ".venv", "*.tmp")


def _can_build_here() -> bool:
    """setuptools new enough to build the wheel itself (70.1: bdist_wheel without the wheel package)."""
    try:
        import setuptools
    except ImportError:
        return False
    return tuple(int(p) for p in re.findall(r"\d+", setuptools.__version__)[:2]) >= (70, 1)


def _run(args: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kwargs)


@pytest.mark.slow
def test_an_installed_wheel_runs_the_embedded_defaults_from_another_folder(tmp_path):
    from gencli.data import shapes

    source = tmp_path / "src"  # a copy: the build's own folders (build/, *.egg-info) stay out of the checkout
    shutil.copytree(ROOT, source, ignore=BUILD_LEFTOVERS)
    # without build isolation where this environment can build (no network needed), else pip fetches setuptools
    isolation = ["--no-build-isolation"] if _can_build_here() else []
    r = _run([sys.executable, "-m", "pip", "wheel", source, "-w", tmp_path / "dist", "--no-deps", *isolation, "-q"])
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("gencli-*.whl")
    with zipfile.ZipFile(wheel) as z:
        stored = {i.filename: i.file_size for i in z.infolist()}
    weights = {f.relative_to(ROOT / "weights").as_posix(): f.stat().st_size for f in (ROOT / "weights").rglob("*") if f.is_file()}
    missing = [name for name, size in weights.items() if stored.get(f"gencli/_weights/{name}") != size]
    assert not missing, f"weights/ files not in the wheel as gencli/_weights/...: {missing}"
    assert not [n for n in stored if n.startswith(("weights/", "tests/", "scripts/")) or "__pycache__" in n]
    assert wheel.stat().st_size < 1.2 * sum(weights.values()) + (8 << 20), "the models once, the code beside them"

    target = tmp_path / "target"
    r = _run([sys.executable, "-m", "pip", "install", "--target", target, "--no-deps", "--no-index", "-q", wheel])
    assert r.returncode == 0, r.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shapes.render(3, 64).pil().save(elsewhere / "star.png")  # a star (test: the classifier's 99.95% held out)
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    env.pop("GENCLI_WEIGHTS", None)
    gencli = [target / "bin" / "gencli"]  # the console script the wheel installs

    r = _run([sys.executable, "-c", "import gencli.weights as w; print(w.__file__); print(w.weights_dir())"], cwd=elsewhere, env=env)
    module, found = r.stdout.split()
    assert Path(module).is_relative_to(target) and Path(found) == target / "gencli" / "_weights", r.stdout + r.stderr
    r = _run([*gencli, "models", "--json"], cwd=elsewhere, env=env)
    assert r.returncode == 0, r.stderr
    listed = [json.loads(line) for line in r.stdout.splitlines()]
    assert sorted(m["name"] for m in listed) == sorted(p.name for p in (ROOT / "weights").iterdir() if p.is_dir())
    assert all(Path(m["path"]).parent == target / "gencli" / "_weights" for m in listed)
    r = _run([*gencli, "info", "vit-shapes"], cwd=elsewhere, env=env)
    assert r.returncode == 0 and "ViTForImageClassification" in r.stdout, r.stderr
    r = _run([*gencli, "classify", "star.png", "--json"], cwd=elsewhere, env=env)
    assert r.returncode == 0 and '"label": "star"' in r.stdout.split("},")[0], r.stdout + r.stderr
