"""What ``gencli info`` reports about a checkpoint: format, architecture, parameters, dtypes, tensors.

Torch-free for safetensors (headers only, nothing is loaded); an opted-in pickle checkpoint is
loaded with ``torch.load(weights_only=True)`` to list it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from gencli.checkpoints.formats import CheckpointSource, detect_architecture, open_source
from gencli.checkpoints.header import DTYPE_SIZES

FORMAT_NAMES = {
    "safetensors": "safetensors",
    "safetensors-sharded": "safetensors (sharded)",
    "pickle": "pickle (loaded with weights_only=True)",
    "pickle-sharded": "pickle, sharded (loaded with weights_only=True)",
    "diffusers-pipeline": "diffusers pipeline folder",
}

CONFIG_FIELDS = (
    "model_type", "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
    "num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings", "n_positions",
    "image_size", "patch_size", "num_labels", "projection_dim", "sample_size", "in_channels", "latent_channels",
    "block_out_channels", "layers_per_block", "norm_num_groups", "scaling_factor", "shift_factor", "force_upcast",
    "cross_attention_dim", "torch_dtype", "dtype",
)  # fmt: skip


def _tensors(src: CheckpointSource, allow_pickle: bool) -> list[dict[str, Any]]:
    if src.is_pickle:
        from gencli.checkpoints.reader import TensorReader

        reader = TensorReader(src, allow_pickle=allow_pickle)
        out = []
        for name in reader.keys():
            t = reader.get(name)
            out.append({"name": name, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "bytes": t.numel() * t.element_size()})
        return out
    out = []
    for name, info in sorted(src.tensor_infos().items()):
        out.append({"name": name, "dtype": info.dtype_name, "shape": list(info.shape), "bytes": info.numel * DTYPE_SIZES[info.dtype]})
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def summarize(tensors: list[dict[str, Any]]) -> tuple[int, dict[str, dict[str, int]]]:
    total = 0
    dtypes: dict[str, dict[str, int]] = {}
    for t in tensors:
        n = _numel(t["shape"])
        total += n
        d = dtypes.setdefault(t["dtype"], {"tensors": 0, "parameters": 0, "bytes": 0})
        d["tensors"] += 1
        d["parameters"] += n
        d["bytes"] += t["bytes"]
    return total, dtypes


def describe(path: str | Path, *, allow_pickle: bool = False, source: Optional[CheckpointSource] = None) -> dict[str, Any]:
    """A JSON-ready description of a checkpoint file or folder (recursing into pipeline components)."""
    src = source or open_source(path, allow_pickle=allow_pickle)
    result: dict[str, Any] = {
        "path": str(src.path),
        "format": FORMAT_NAMES.get(src.kind, src.kind),
        "architecture": None,
        "parameters": 0,
        "size_bytes": 0,
        "dtypes": {},
        "files": [],
        "config": None,
        "metadata": {},
        "tensors": [],
    }
    if src.kind == "diffusers-pipeline":
        result["architecture"] = detect_architecture(src)
        components: dict[str, Any] = {}
        for name, spec in sorted((src.config or {}).items()):
            if name.startswith("_") or not isinstance(spec, list) or not (src.folder / name).is_dir():
                continue
            try:
                sub = open_source(src.folder / name, allow_pickle=allow_pickle)
            except Exception as exc:  # a component without weights (tokenizer, scheduler)
                components[name] = {"class": spec[-1] if spec else None, "weights": False, "note": str(exc) if "no weights" not in str(exc) else None}
                continue
            d = describe(sub.path, allow_pickle=allow_pickle, source=sub)
            d["class"] = spec[-1] if spec else None
            components[name] = d
            result["parameters"] += d["parameters"]
            result["size_bytes"] += d["size_bytes"]
            for dt, agg in d["dtypes"].items():
                tgt = result["dtypes"].setdefault(dt, {"tensors": 0, "parameters": 0, "bytes": 0})
                for k in tgt:
                    tgt[k] += agg[k]
            result["tensors"].extend({**t, "name": f"{name}/{t['name']}"} for t in d["tensors"])
        result["components"] = components
        return result
    tensors = _tensors(src, allow_pickle)
    total, dtypes = summarize(tensors)
    result.update(
        architecture=detect_architecture(src, {t["name"] for t in tensors}),
        parameters=total,
        size_bytes=sum(f.stat().st_size for f in src.weight_files),
        dtypes=dtypes,
        files=[str(f) for f in src.weight_files],
        config={k: src.config[k] for k in CONFIG_FIELDS if src.config and k in src.config} or None,
        metadata=src.metadata(),
        tensors=tensors,
    )
    quant = (src.config or {}).get("quantization_config")
    if isinstance(quant, dict):
        result["quantization"], result["parameters"] = _quantization(quant, tensors, total, src.config or {})
    return result


def _quantization(entry: dict[str, Any], tensors: list[dict[str, Any]], total: int, config: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(the ``quantization_config`` entry with the number of quantized layers, the parameter count the
    weights stand for). A layer quantized by ``gencli quantize`` stores ``weight`` (int8, or two
    4-bit codes per uint8) beside ``weight_scale`` (and ``weight_zero``); the scales are not
    parameters of the model, and a 4-bit byte holds two. An LM head tied to the embedding is stored
    as its own quantized copy: not a parameter of the model either (``untied_head`` says so)."""
    by_name = {t["name"]: t for t in tensors}
    layers = [n[: -len(".weight_scale")] for n in by_name if n.endswith(".weight_scale")]
    params = total
    for layer in layers:
        params -= sum(_numel(by_name[f"{layer}.{k}"]["shape"]) for k in ("weight_scale", "weight_zero") if f"{layer}.{k}" in by_name)
        weight = by_name.get(f"{layer}.weight")
        if weight is not None and entry.get("bits") == 4:
            params += _numel(weight["shape"])
    tied = config.get("tie_word_embeddings", config.get("model_type") == "gpt2")  # transformers' defaults
    head = by_name.get("lm_head.weight")
    untied_head = bool(tied) and "lm_head.weight_scale" in by_name and head is not None
    if untied_head:
        params -= _numel(head["shape"]) * (2 if entry.get("bits") == 4 else 1)
    return {**entry, "layers": len(layers), "untied_head": untied_head}, params
