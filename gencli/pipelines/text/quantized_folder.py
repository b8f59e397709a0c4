"""``gencli quantize``: a text checkpoint written back as a folder with its linear layers quantized."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from gencli.errors import UserError
from gencli.pipelines.text.loading import load_text_model
from gencli.pipelines.text.quantization import check_quantization_flags
from gencli.tokenizers.text import read_json


@dataclass
class QuantizedCheckpoint:
    out: Path
    spec: Any
    layers: int  # linear layers quantized
    bytes_before: int
    bytes_after: int


def quantize_checkpoint(
    path: Path, out: Path, mode: str, *, group_size: Optional[int] = None, force: bool = False, allow_pickle: bool = False, threads: Optional[int] = None
) -> QuantizedCheckpoint:
    """Write ``out``, a model folder holding the text model at ``path`` with its linear layers
    quantized (``mode`` "int8" | "int4", see :mod:`gencli.backend.quantize`): the quantized layers'
    codes and scales, the other tensors in the dtype the checkpoint stored them in, ``config.json``
    with a ``quantization_config`` entry, and the tokenizer and generation files. The folder loads
    quantized, without quantizing again. Written into a temporary folder beside ``out`` renamed into
    place (:func:`gencli.io.atomic_folder`); ``force`` replaces only a folder an earlier run wrote
    (the files it wrote are recorded in ``model.safetensors``' metadata), never anything else."""
    import shutil

    from gencli.backend.quantize import quantized_layers
    from gencli.checkpoints.formats import open_source
    from gencli.checkpoints.loader import save_model
    from gencli.io import atomic_folder, ensure_folder_writable

    check_quantization_flags(mode, group_size, mode_flag="--mode")
    out = Path(out)
    ensure_folder_writable(out, force, wrote=quantized_folder_files)
    src = open_source(path, allow_pickle=allow_pickle)
    if src.config is not None and "quantization_config" in src.config:
        raise UserError(f"'{path}' is quantized already")
    tm = load_text_model(path, device="cpu", dtype="float32", threads=threads, allow_pickle=allow_pickle, quantize=mode, group_size=group_size)
    floats = [i.dtype for i in src.tensor_infos().values() if i.dtype in ("F32", "BF16", "F16")] if not src.is_pickle else []
    names = {"BF16": torch.bfloat16, "F16": torch.float16}
    store = max(set(floats), key=floats.count) if floats else "F32"
    config = dict(src.config or {})
    config["quantization_config"] = tm.quantization.to_config()
    folder = src.folder or Path(path).parent
    weight_files = {f.resolve() for f in src.weight_files}
    copies = []
    for f in sorted(folder.iterdir()):
        # the weights' README describes the unquantized model: not carried over
        skip = f.name in ("config.json", "README.md") or f.resolve() in weight_files
        skip = skip or f.name.endswith((".index.json", *WEIGHT_SUFFIXES))
        if f.is_file() and not skip:
            copies.append(f)
    written = json.dumps(sorted(["model.safetensors", "config.json", *(f.name for f in copies)]))
    with atomic_folder(out, force, wrote=quantized_folder_files) as tmp:
        save_model(tm.model, tmp / "model.safetensors", dtype=names.get(store, torch.float32), keep_dtype=(r"\.weight_(scale|zero)$",),
                   metadata={QUANTIZED_FILES_KEY: written})  # fmt: skip
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for f in copies:
            shutil.copy2(f, tmp / f.name)
    layers = sum(1 for _ in quantized_layers(tm.model))
    before = sum(f.stat().st_size for f in src.weight_files)
    return QuantizedCheckpoint(out, tm.quantization, layers, before, (out / "model.safetensors").stat().st_size)


# the unquantized weights a model folder may hold besides the ones read (other frameworks' copies, as a
# Hugging Face repository ships them: TensorFlow, Flax, rust-bert, ONNX, TFLite, llama.cpp): never
# carried over into the quantized folder (they would outweigh it, and describe the float model)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".ot", ".onnx", ".onnx_data", ".tflite", ".gguf", ".ggml", ".npz")

QUANTIZED_FILES_KEY = "gencli_quantize_files"  # model.safetensors' metadata: the files `gencli quantize` wrote


def quantized_folder_files(folder: Path) -> Optional[list[str]]:
    """The files ``gencli quantize`` wrote in ``folder``, as it recorded them, or None when it is not
    a folder it wrote (what ``--force`` may replace)."""
    from safetensors import safe_open

    try:
        entry = read_json(folder / "config.json").get("quantization_config")
    except UserError:  # not JSON, not an object: not a config.json gencli wrote
        return None
    if not isinstance(entry, dict) or entry.get("quant_method") != "gencli":
        return None
    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
            files = json.loads((fh.metadata() or {}).get(QUANTIZED_FILES_KEY, "null"))
    except Exception:  # unreadable, not safetensors, no record: not known to be ours
        return None
    return files if isinstance(files, list) and all(isinstance(f, str) for f in files) else None
