"""``gencli quantize``: a text checkpoint written back as a folder with its linear layers quantized."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from gencli.errors import UserError
from gencli.pipelines.text.loading import load_text_model


@dataclass
class QuantizedCheckpoint:
    out: Path
    spec: Any
    layers: int  # linear layers quantized
    bytes_before: int
    bytes_after: int


def quantize_checkpoint(
    path: Path, out: Path, mode: str, *, group_size: Optional[int] = None, force: bool = False, allow_pickle: bool = False
) -> QuantizedCheckpoint:
    """Write ``out``, a model folder holding the text model at ``path`` with its linear layers
    quantized (``mode`` "int8" | "int4", see :mod:`gencli.backend.quantize`): the quantized layers'
    codes and scales, the other tensors in the dtype the checkpoint stored them in, ``config.json``
    with a ``quantization_config`` entry, and the tokenizer and generation files. The folder loads
    quantized, without quantizing again. Written into a temporary folder renamed into place."""
    import shutil
    import tempfile

    from gencli.backend.quantize import quantized_layers
    from gencli.checkpoints.formats import open_source
    from gencli.checkpoints.loader import save_model

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"output '{out}' exists and is not a folder")
    if out.exists() and not force:
        raise UserError(f"output '{out}' already exists (use --force to replace it)")
    if not out.parent.is_dir():
        raise UserError(f"output directory '{out.parent}' does not exist")
    src = open_source(path, allow_pickle=allow_pickle)
    if src.config is not None and "quantization_config" in src.config:
        raise UserError(f"'{path}' is quantized already")
    tm = load_text_model(path, device="cpu", dtype="float32", threads=None, allow_pickle=allow_pickle, quantize=mode, group_size=group_size)
    floats = [i.dtype for i in src.tensor_infos().values() if i.dtype in ("F32", "BF16", "F16")] if not src.is_pickle else []
    names = {"BF16": torch.bfloat16, "F16": torch.float16}
    store = max(set(floats), key=floats.count) if floats else "F32"
    config = dict(src.config or {})
    config["quantization_config"] = tm.quantization.to_config()
    folder = src.folder or Path(path).parent
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_model(tm.model, tmp / "model.safetensors", dtype=names.get(store, torch.float32), keep_dtype=(r"\.weight_(scale|zero)$",))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        weight_files = {f.resolve() for f in src.weight_files}
        for f in sorted(folder.iterdir()):
            # the weights' README describes the unquantized model: not carried over
            skip = f.name in ("config.json", "README.md") or f.resolve() in weight_files
            skip = skip or f.name.endswith((".index.json", ".safetensors", ".bin", ".pt", ".ckpt"))
            if f.is_file() and not skip:
                shutil.copy2(f, tmp / f.name)
        tmp.chmod(0o755)  # mkdtemp/mkstemp create owner-only entries
        (tmp / "model.safetensors").chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    layers = sum(1 for _ in quantized_layers(tm.model))
    before = sum(f.stat().st_size for f in src.weight_files)
    return QuantizedCheckpoint(out, tm.quantization, layers, before, (out / "model.safetensors").stat().st_size)
