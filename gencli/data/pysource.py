"""The Python standard library's own source, as training and evaluation text for the default LM.

Every machine with Python has it. Files are listed in a fixed (sorted) order; a fixed list of
modules is held out for evaluation and never trained on. Excluded everywhere: third-party packages
(``site-packages``), the generated pydoc topic dump and the generated character-map codec tables
(data, not code).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Any, Optional

# Held out for evaluation (paths relative to the stdlib root). Varied styles: numeric code, text
# processing, data structures, a package module, docstring-heavy and comment-heavy files.
HELDOUT_MODULES: tuple[str, ...] = (
    "bisect.py",
    "colorsys.py",
    "fractions.py",
    "graphlib.py",
    "heapq.py",
    "shlex.py",
    "statistics.py",
    "textwrap.py",
    "json/encoder.py",
    "email/quoprimime.py",
    "sched.py",
    "calendar.py",
)

# beside the default text model's weights: the held-out text its recorded figures were measured on
# (each module's SHA-256 and size). Another Python's standard library may differ, and its figures with it.
HELDOUT_RECORD = "heldout_text.json"

EXCLUDED_DIRS = ("site-packages", "__pycache__")
EXCLUDED_FILES = ("pydoc_data/topics.py",)
GENERATED_MARKER = "Python Character Mapping Codec"


TEST_DIRS = ("test", "tests", "idle_test")


def is_test_file(rel: str) -> bool:
    """True for the standard library's own test suites (``test/``, ``*/tests/``, ``test_*.py``)."""
    parts = rel.split("/")
    return any(p in TEST_DIRS for p in parts[:-1]) or parts[-1].startswith("test_")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_source(path: Path) -> Optional[str]:
    """The file's text, or None when it is not UTF-8 (a few test fixtures on purpose) or generated data."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if GENERATED_MARKER in text[:2000]:
        return None
    return text


def _all_files(root: Path) -> list[str]:
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if any(part in EXCLUDED_DIRS for part in p.relative_to(root).parts) or rel in EXCLUDED_FILES:
            continue
        out.append(rel)
    return sorted(out)


def training_files(root: Optional[Path] = None) -> list[Path]:
    """Every stdlib ``.py`` file except the held-out modules and the exclusions, in sorted order."""
    root = root or stdlib_root()
    held = set(HELDOUT_MODULES)
    return [root / rel for rel in _all_files(root) if rel not in held]


def heldout_files(root: Optional[Path] = None) -> list[Path]:
    """The held-out modules present on this machine, in the fixed order of HELDOUT_MODULES."""
    root = root or stdlib_root()
    return [root / rel for rel in HELDOUT_MODULES if (root / rel).is_file()]


def heldout_fingerprint(root: Optional[Path] = None) -> dict[str, dict[str, Any]]:
    """``{module: {"sha256": ..., "bytes": ...}}`` for the held-out modules present on this machine."""
    out = {}
    for f in heldout_files(root):
        data = f.read_bytes()
        out[f.relative_to(root or stdlib_root()).as_posix()] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    return out


def heldout_differences(recorded: dict[str, dict[str, Any]], root: Optional[Path] = None) -> list[str]:
    """The held-out modules whose text here is not the ``recorded`` one (a :func:`heldout_fingerprint`),
    as ``"statistics.py (changed)"`` / ``"graphlib.py (missing)"`` / ``"x.py (not recorded)"``; [] when
    every one is the same."""
    here = heldout_fingerprint(root)
    diffs = [f"{m} ({'missing' if m not in here else 'changed'})" for m in recorded if here.get(m) != recorded[m]]
    return diffs + [f"{m} (not recorded)" for m in here if m not in recorded]
