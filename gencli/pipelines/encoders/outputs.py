"""Writing an embedding matrix: ``.npy``, ``.safetensors`` (tensor ``embeddings``) or ``.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from gencli.errors import UserError
from gencli.io import atomic_path

MATRIX_SUFFIXES = (".npy", ".safetensors", ".jsonl")


def check_matrix_path(path: str) -> None:
    if Path(path).suffix.lower() not in MATRIX_SUFFIXES:
        raise UserError(f"--out '{path}': expected a {', '.join(MATRIX_SUFFIXES)} file")


def write_matrix(path: str, vectors: torch.Tensor, texts: Sequence[str], force: bool = False, key: str = "text") -> None:
    """The ``(n, d)`` matrix to ``path``, written atomically (rows in input order)."""
    check_matrix_path(path)
    suffix = Path(path).suffix.lower()
    with atomic_path(path, force) as tmp:
        if suffix == ".npy":
            import numpy as np

            with open(tmp, "wb") as fh:
                np.save(fh, vectors.float().numpy())
        elif suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({"embeddings": vectors.float().contiguous()}, str(tmp), metadata={"format": "pt", "rows": str(len(texts))})
        else:
            with open(tmp, "w", encoding="utf-8") as fh:
                for text, vec in zip(texts, vectors.tolist()):
                    fh.write(json.dumps({key: text, "embedding": vec}, ensure_ascii=False) + "\n")
