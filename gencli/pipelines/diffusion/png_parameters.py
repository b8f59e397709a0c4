"""The ``parameters`` text a generated PNG carries, in the format other Stable Diffusion front ends write
and read (AUTOMATIC1111's web UI, and the tools that read its files), and the PNG itself. No torch.

The text is the prompt, then ``Negative prompt: ...`` on its own line when there is one, then one
line of ``Key: value`` pairs separated by ``", "``::

    a red star on a blue background
    Negative prompt: blurry
    Steps: 20, Sampler: Euler a, CFG scale: 7.5, Seed: 42, Size: 64x64, Model hash: 1a2b3c4d5e, Model: txt2img-shapes

A value holding a comma, a colon or a line break is written as a JSON string (what those front ends
do). ``Clip skip`` counts as they count (1 = the last layer, 2 = the penultimate), one more than
diffusers' ``clip_skip``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from gencli.errors import UserError

PARAMETERS_KEY = "parameters"
NEGATIVE_PREFIX = "Negative prompt:"
# one "Key: value" pair: a key of word characters, spaces, '-' and '/', then a plain or JSON-quoted value
_PAIR = re.compile(r'\s*(\w[\w \-/]*):\s*("(?:\\.|[^\\"])*"|[^,]*)(?:,|$)')
_SIZE = re.compile(r"^(\d+)x(\d+)$")


@dataclass
class ImageParameters:
    """The settings an image was made with, as the ``parameters`` chunk records them."""

    prompt: str
    negative_prompt: str = ""
    steps: int = 0
    sampler: str = ""  # the display name ("Euler a", "DPM++ 2M Karras")
    cfg_scale: float = 0.0
    seed: int = 0
    width: int = 0
    height: int = 0
    model: str = ""
    model_hash: str = ""
    clip_skip: int = 0  # diffusers' count: 0 = last layer (written as "Clip skip: 1" only when > 0)
    guidance_rescale: float = 0.0
    denoising_strength: Optional[float] = None  # img2img
    vae: str = ""
    vae_hash: str = ""
    extra: dict[str, str] = field(default_factory=dict)  # keys this module does not know, kept in order

    def to_text(self) -> str:
        pairs: list[tuple[str, Any]] = [
            ("Steps", self.steps),
            ("Sampler", self.sampler),
            ("CFG scale", _number(self.cfg_scale)),
            ("Seed", self.seed),
            ("Size", f"{self.width}x{self.height}"),
            ("Model hash", self.model_hash),
            ("Model", self.model),
        ]
        if self.vae:
            pairs += [("VAE hash", self.vae_hash), ("VAE", self.vae)]
        if self.denoising_strength is not None:
            pairs.append(("Denoising strength", _number(self.denoising_strength)))
        if self.clip_skip:
            pairs.append(("Clip skip", self.clip_skip + 1))
        if self.guidance_rescale:
            pairs.append(("Guidance rescale", _number(self.guidance_rescale)))
        pairs += list(self.extra.items())
        line = ", ".join(f"{k}: {_quote(str(v))}" for k, v in pairs if str(v) != "")
        lines = [self.prompt]
        if self.negative_prompt:
            lines.append(f"{NEGATIVE_PREFIX} {self.negative_prompt}")
        lines.append(line)
        return "\n".join(lines)

    @classmethod
    def from_text(cls, text: str) -> "ImageParameters":
        """Parse a ``parameters`` text; :class:`UserError` when it lacks what a regeneration needs."""
        lines = text.strip("\n").split("\n")
        if not lines or not _PAIR.match(lines[-1]) or "Steps:" not in lines[-1]:
            raise UserError("the image's parameters have no settings line ('Steps: ..., Sampler: ..., Seed: ...')")
        settings = _parse_pairs(lines[-1])
        prompt_lines, negative_lines, in_negative = [], [], False
        for line in lines[:-1]:
            if line.startswith(NEGATIVE_PREFIX):
                in_negative = True
                line = line[len(NEGATIVE_PREFIX) :].lstrip()
            (negative_lines if in_negative else prompt_lines).append(line)
        p = cls("\n".join(prompt_lines), "\n".join(negative_lines))
        known = {"Steps", "Sampler", "Schedule type", "CFG scale", "Seed", "Size", "Model", "Model hash", "Clip skip",
                 "Guidance rescale", "Denoising strength", "VAE", "VAE hash"}  # fmt: skip
        def value(key: str, kind: type, default: Any = None) -> Any:
            if key not in settings:
                if default is None:
                    raise UserError(f"the image's parameters have no {key!r}")
                return default
            try:
                number = kind(settings[key])
            except ValueError:
                number = None
            if number is None or (kind is float and not math.isfinite(number)):
                what = "a whole number" if kind is int else "a number"
                raise UserError(f"the image's parameters say '{key}: {settings[key]}', which is not {what}") from None
            return number

        p.steps = value("Steps", int)
        p.sampler = settings.get("Sampler", "")
        if settings.get("Schedule type", "").lower() == "karras" and "karras" not in p.sampler.lower():
            p.sampler += " Karras"  # newer files write the schedule apart from the sampler
        p.cfg_scale = value("CFG scale", float, 7.0)
        p.seed = value("Seed", int)
        if "Size" in settings:
            m = _SIZE.match(settings["Size"])
            if not m:
                raise UserError(f"the image's parameters say 'Size: {settings['Size']}', which is not WIDTHxHEIGHT")
            p.width, p.height = int(m.group(1)), int(m.group(2))
        p.clip_skip = max(0, value("Clip skip", int, 1) - 1)
        p.guidance_rescale = value("Guidance rescale", float, 0.0)
        if "Denoising strength" in settings:
            p.denoising_strength = value("Denoising strength", float)
        p.model, p.model_hash = settings.get("Model", ""), settings.get("Model hash", "")
        p.vae, p.vae_hash = settings.get("VAE", ""), settings.get("VAE hash", "")
        p.extra = {k: v for k, v in settings.items() if k not in known}
        return p


def _number(x: float) -> str:
    return f"{float(x):g}"


def _quote(value: str) -> str:
    if "," not in value and "\n" not in value and ":" not in value and '"' not in value:
        return value
    return json.dumps(value, ensure_ascii=False)


def _parse_pairs(line: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in _PAIR.findall(line):
        value = value.strip()
        if value.startswith('"') and value.endswith('"') and len(value) >= 2:
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        out[key.strip()] = value
    return out


# -- PNG files --------------------------------------------------------------------------------------
def png_bytes(pixels: np.ndarray, parameters: Optional[str]) -> bytes:
    """``pixels (H, W, 3)`` uint8 as PNG bytes, with the ``parameters`` text chunk (deterministic:
    the same pixels and text give the same bytes)."""
    from gencli.pipelines.vision.images import image_bytes

    return image_bytes(pixels, "image.png", None if parameters is None else {PARAMETERS_KEY: parameters})


def read_parameters(path: str | Path) -> ImageParameters:
    """The :class:`ImageParameters` of a PNG (or any image PIL reads with a ``parameters`` text)."""
    import io

    from PIL import Image, UnidentifiedImageError

    from gencli.io import input_name, is_stdout, read_input_bytes
    from gencli.pipelines.vision.images import read_user_comment

    source = io.BytesIO(read_input_bytes(path)) if is_stdout(path) else path
    path = input_name(path)
    try:
        with Image.open(source) as im:
            text = im.info.get(PARAMETERS_KEY) or getattr(im, "text", {}).get(PARAMETERS_KEY) or _comment_parameters(im.info.get("comment"))
            text = text or _comment_parameters(read_user_comment(im))  # JPEG/WebP: EXIF's UserComment (A1111's place)
    except FileNotFoundError:
        raise UserError(f"'{path}' does not exist") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise UserError(f"'{path}' is not a readable image: {exc}") from None
    if not text:
        raise UserError(f"'{path}' has no 'parameters' text to replay (txt2img, img2img and sample ddpm write one, as other Stable Diffusion front ends do)")
    return ImageParameters.from_text(text)


def _comment_parameters(comment: Any) -> Optional[str]:
    """The parameters a JPEG's or GIF's comment holds (where ``-o NAME.jpg`` writes them), if it
    holds a settings line."""
    if isinstance(comment, bytes):
        try:
            comment = comment.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(comment, str) and "Steps:" in comment:
        return comment
    return None


# -- model hashes -----------------------------------------------------------------------------------
HASH_CACHE_ENTRIES = 512


def hash_cache_path() -> Optional[Path]:
    """Where computed model hashes are remembered: ``$GENCLI_CACHE_DIR/hashes.json``, else
    ``$XDG_CACHE_HOME/gencli/hashes.json``, else ``~/.cache/gencli/hashes.json``; ``GENCLI_CACHE_DIR=""``
    turns the cache off (None)."""
    import os

    env = os.environ.get("GENCLI_CACHE_DIR")
    if env is not None:
        return Path(env) / "hashes.json" if env else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gencli" / "hashes.json"


def _file_key(files: list[Path]) -> str:
    """Identifies the files' current contents without reading them: path, size, mtime (ns), inode."""
    parts = []
    for f in files:
        st = f.stat()
        parts.append(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}")
    return "\n".join(parts)


def _read_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def files_hash(files: Iterable[Path], length: int = 10) -> str:
    """The first ``length`` hex digits of the SHA-256 of the files' bytes, one after the other (for
    one file, what other front ends show as a checkpoint's "Model hash").

    A multi-GB checkpoint takes seconds to hash, so the digest is remembered in
    :func:`hash_cache_path` under the files' paths, sizes, modification times and inodes (as other
    front ends keep a hash cache); a changed or replaced file is hashed again. A cache that cannot be
    read or written is ignored."""
    files = [Path(f) for f in files]
    cache_path = hash_cache_path()
    key = _file_key(files) if cache_path is not None else ""
    cache = _read_cache(cache_path) if cache_path is not None else {}
    digest = cache.get(key)
    if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        h = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
        digest = h.hexdigest()
        if cache_path is not None:
            from gencli.io import atomic_write_bytes

            cache.pop(key, None)
            cache[key] = digest  # newest last; the oldest entries go first
            cache = dict(list(cache.items())[-HASH_CACHE_ENTRIES:])
            try:
                cache_path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(cache_path, (json.dumps(cache, indent=0) + "\n").encode(), force=True)
            except (OSError, UserError):  # a read-only or full cache directory costs only the time
                pass
    return digest[:length]


__all__ = ["ImageParameters", "PARAMETERS_KEY", "png_bytes", "read_parameters", "files_hash", "hash_cache_path"]
