"""The embedded default models under ``weights/`` and resolution of ``--model`` (no torch).

``--model`` accepts a folder, a ``.safetensors`` file, or the name of an embedded default (a folder
under the weights directory). The weights directory is ``$GENCLI_WEIGHTS`` if set, else the
package's own ``_weights`` folder in an installed wheel (the repository's ``weights/``, which
``setup.py`` installs there), else the ``weights/`` folder of the checkout this package runs from
(an editable install too).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gencli.errors import UserError


def weights_dir() -> Path:
    env = os.environ.get("GENCLI_WEIGHTS")
    if env:
        return Path(env).expanduser()
    here = Path(__file__).resolve().parent
    installed = here / "_weights"
    return installed if installed.is_dir() else here.parent / "weights"


@dataclass
class DefaultModel:
    name: str
    path: Path
    title: str
    summary: str  # the README's first sentence, as plain text
    commands: list[str]  # the gencli commands it serves (the README's ``task:`` line)
    size_bytes: int  # of its weight files, as ``gencli info`` counts them

    @property
    def task(self) -> Optional[str]:
        """The first command it serves."""
        return self.commands[0] if self.commands else None


def first_sentence(paragraph: str) -> str:
    """A README paragraph's first sentence as plain text (no Markdown backticks or emphasis)."""
    text = re.sub(r"[`*]", "", paragraph).strip()
    m = re.search(r"[.!?](?=\s+[A-Z(])", text)
    return text[: m.end()] if m else text


def _readme_summary(readme: Path) -> tuple[str, str, list[str]]:
    """(title, first paragraph, commands) from a weights README; ``task: <command>[, <command>...]``
    names the commands it serves."""
    if not readme.is_file():
        return "", "", []
    text = readme.read_text(encoding="utf-8", errors="replace")
    title = ""
    paragraphs: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("# ") and not title:
            title = line[2:].strip()
            continue
        if line.strip() == "" or line.startswith("#"):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(line.strip())
    if current:
        paragraphs.append(" ".join(current))
    m = re.search(r"^\s*task:\s*(.+)$", text, re.MULTILINE | re.IGNORECASE)
    commands = [c for c in re.split(r"[\s,`]+", m.group(1)) if re.fullmatch(r"[a-z0-9_-]+", c)] if m else []
    summary = next((p for p in paragraphs if not p.lower().startswith("task:")), "")
    return title, summary, commands


def list_defaults() -> list[DefaultModel]:
    root = weights_dir()
    out = []
    if not root.is_dir():
        return out
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        title, summary, commands = _readme_summary(folder / "README.md")
        size = sum(f.stat().st_size for f in folder.rglob("*.safetensors") if f.is_file())
        out.append(DefaultModel(folder.name, folder, title or folder.name, first_sentence(summary), commands, size))
    return out


def resolve_model(spec: Optional[str], default: Optional[str] = None) -> Path:
    """The path ``--model`` means: an existing path, else an embedded default's name."""
    if spec is None:
        if default is None:
            raise UserError("no --model given and this command has no embedded default")
        path = weights_dir() / default
        if not path.exists():
            raise UserError(f"the embedded default model '{default}' is missing from '{weights_dir()}' (reinstall, or pass --model)")
        return path
    p = Path(spec).expanduser()
    if p.exists():
        return p
    named = weights_dir() / spec
    if re.fullmatch(r"[A-Za-z0-9_.-]+", spec) and named.is_dir():
        return named
    if "/" in spec or os.sep in spec or spec.startswith(".") or Path(spec).suffix:
        raise UserError(f"'{spec}' does not exist")
    names = ", ".join(d.name for d in list_defaults()) or "none installed"
    raise UserError(f"model '{spec}' not found: not an existing path, nor an embedded default (embedded: {names})")
