"""Writing an embedding matrix: ``.npy``, ``.safetensors`` (tensor ``embeddings``) or ``.jsonl``.

The format is the one the file's name says; ``-`` (stdout), a pipe or a device has no suffix that
means anything (``--format`` chooses, JSON lines by default), so the matrix is rendered in memory
and handed to the output layer (:mod:`gencli.io`): a file atomically, anything else in place.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from gencli.errors import UserError
from gencli.io import atomic_open, is_in_place, write_output

MATRIX_FORMATS = {".npy": "npy", ".safetensors": "safetensors", ".jsonl": "jsonl"}
MATRIX_SUFFIXES = tuple(MATRIX_FORMATS)
STREAM_DEFAULT = "jsonl"  # what -o - (a pipe, a device) gets without --format: text, readable anywhere


def matrix_format(path: str, fmt: Optional[str] = None) -> str:
    """The format ``path`` is written in: its suffix (``.npy``, ``.safetensors``, ``.jsonl``), which
    ``fmt`` (--format) must not contradict. ``-``, a pipe or a device: ``fmt``, else the name's
    matrix suffix, else JSON lines. Any other name is one UserError saying which suffixes work."""
    named = MATRIX_FORMATS.get(Path(path).suffix.lower())
    if is_in_place(path):
        return fmt or named or STREAM_DEFAULT
    if named is None:
        raise UserError(f"--out '{path}': expected a {', '.join(MATRIX_SUFFIXES)} file (--format applies to -, a pipe or a device)")
    if fmt is not None and fmt != named:
        raise UserError(f"--out '{path}' names a {Path(path).suffix} file but --format is {fmt}: name it .{fmt}, or drop --format")
    return named


def matrix_bytes(fmt: str, vectors: torch.Tensor, rows: int) -> bytes:
    """The ``(n, d)`` matrix as a binary file's bytes (``npy`` or ``safetensors``), float32."""
    matrix = vectors.detach().float().cpu().contiguous()
    if fmt == "npy":
        import numpy as np

        buf = io.BytesIO()
        np.save(buf, matrix.numpy())
        return buf.getvalue()
    from safetensors.torch import save

    return save({"embeddings": matrix}, metadata={"format": "pt", "rows": str(rows)})


def matrix_lines(vectors: torch.Tensor, texts: Sequence[str], key: str = "text") -> str:
    """The matrix as JSON lines ``{key: name, "embedding": [...]}``, one per row in input order."""
    return "".join(json.dumps({key: text, "embedding": vec}, ensure_ascii=False) + "\n" for text, vec in zip(texts, vectors.tolist()))


def write_matrix(path: str, vectors: torch.Tensor, texts: Sequence[str], force: bool = False, key: str = "text", fmt: Optional[str] = None) -> None:
    """The ``(n, d)`` matrix to ``path`` through the output layer (rows in input order): a file
    atomically, ``-``, a pipe or a device in place; binary formats never to a terminal."""
    fmt = matrix_format(path, fmt)
    if fmt == "jsonl":
        with atomic_open(path, "w", force, encoding="utf-8") as fh:
            fh.write(matrix_lines(vectors, texts, key))
        return
    write_output(path, matrix_bytes(fmt, vectors, len(texts)), force)
