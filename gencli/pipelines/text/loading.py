"""Loading a GPT-2 / Llama-family text checkpoint with its tokenizer into a :class:`TextModel`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from gencli.backend.device import DTYPE_NAMES, Placement, choose_placement
from gencli.backend.huge_pages import move_buffers_to_huge_pages
from gencli.backend.layers import dense_of
from gencli.backend.packed_linear import stream_bf16_weights
from gencli.backend.screened_argmax import ScreenedArgmax
from gencli.backend.streamed_linear import StreamedLinear, stream_linears, streaming_available, streaming_loader
from gencli.errors import UserError
from gencli.models.causal_lm import CausalLM
from gencli.pipelines.text.flags import check_generation_config, usable_pad_id
from gencli.pipelines.text.quantization import describe_quantization, quantization_of
from gencli.tokenizers.text import TextTokenizer, load_tokenizer, read_json

SUPPORTED = "GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"


# fp32 models at least this big load their linear weights column-major on a CPU (see below)
COLUMN_MAJOR_MIN_BYTES = 128 * 2**20


@dataclass
class TextModel:
    model: CausalLM
    tokenizer: TextTokenizer
    placement: Placement
    path: Path
    architecture: str
    generation_config: dict[str, Any]
    eos_ids: list[int]
    pad_id: int
    context_length: int
    load_seconds: float
    screen: Optional[ScreenedArgmax] = None  # the screened argmax of the LM head, built on first use
    screen_failed: bool = False  # no exact screen could be built on this CPU: not tried again
    quantization: Any = None  # the QuantizationSpec of the linear layers (None: not quantized)


def _family(src) -> tuple[str, str]:
    """(family, architecture name) from config.json; another architecture is a user error that names it."""
    from gencli.checkpoints.formats import wrong_family
    from gencli.models import gpt2, llama

    config = src.config or {}
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    model_type = config.get("model_type")
    if arch in llama.ARCHITECTURES or (arch is None and model_type in llama.MODEL_TYPES):
        return "llama", arch or f"{model_type}"
    if arch in gpt2.ARCHITECTURES or (arch is None and model_type in gpt2.MODEL_TYPES):
        return "gpt2", arch or "gpt2"
    raise wrong_family(src, "a text-generation model", f"gencli generate runs {SUPPORTED}")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def load_text_model(
    path: Path,
    *,
    device: str = "auto",
    dtype: str = "auto",
    threads: Optional[int] = None,
    allow_pickle: bool = False,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
) -> TextModel:
    """Load a text model with its tokenizer. ``quantize`` ("int8" | "int4") quantizes the linear
    layers (LM head included) on loading, see :mod:`gencli.backend.quantize`; a checkpoint written by
    ``gencli quantize`` loads quantized as it was saved (``quantize`` may then name the same mode)."""
    from gencli.backend.quantize import QuantizedLinear, quantization_targets, quantize_linears, quantized_layers, quantizing_loader
    from gencli.checkpoints.formats import command_for, detect_architecture, open_source, shard_index, wrong_family
    from gencli.checkpoints.loader import build_on_meta, load_state
    from gencli.checkpoints.reader import open_reader
    from gencli.models import gpt2, llama

    start = time.perf_counter()
    src = open_source(path, allow_pickle=allow_pickle)
    if src.kind == "diffusers-pipeline":
        raise wrong_family(src, "a text-generation model")
    folder = src.folder or Path(path)
    if src.config is None:
        runs = command_for(detect_architecture(src))
        if shard_index(src.path) is not None or (runs and runs[1] != "gencli generate"):
            raise wrong_family(src, "a text-generation model", f"gencli generate runs {SUPPORTED}")
        raise UserError(f"no config.json next to '{path}': a text model needs its config.json (the architecture and sizes)")
    family, arch = _family(src)
    module = llama if family == "llama" else gpt2
    cfg = (llama.LlamaConfig if family == "llama" else gpt2.GPT2Config).from_hf(src.config)
    model_class = llama.LlamaForCausalLM if family == "llama" else gpt2.GPT2LMHeadModel
    stored, spec = quantization_of(src.config, quantize, group_size)
    tokenizer = load_tokenizer(folder)  # before the weights: a missing tokenizer fails fast
    # the generation settings too: a bad value is one error line before the weights load
    gen_cfg = read_json(folder / "generation_config.json")
    check_generation_config(gen_cfg, str(folder / "generation_config.json"), cfg.vocab_size)
    check_generation_config({k: src.config.get(k) for k in ("eos_token_id", "pad_token_id", "bos_token_id")}, str(folder / "config.json"))
    n_params = src.num_parameters()
    placement = choose_placement(device, dtype, "decoder", threads, n_params=n_params)
    bf16_file = not src.is_pickle and _narrow_source_dtype(src, torch.float32) == torch.bfloat16
    streamed = _streamed_dtype(spec, placement, n_params, bf16_file=dtype == "auto" and bf16_file)
    reader = open_reader(src, allow_pickle=allow_pickle)
    try:
        # batch-1 decoding streams every weight from memory once per token: on a CPU in fp32 the
        # products run faster over column-major weights once the model is too big for the caches
        # (measured: +9% per product at 500 MB, -10% tokens/s for the 36 MB default model). Only
        # weights converted on loading (bf16/fp16 files) change layout; fp32 files stay zero-copy.
        # (Where gencli's kernels stream the weights instead, they read rows: no column-major.)
        big = (n_params or 0) * 4 >= COLUMN_MAJOR_MIN_BYTES
        fast_layout = streamed is None and spec is None and placement.device.type == "cpu" and placement.dtype == torch.float32 and big
        if stored:  # the quantized layers are built empty and filled from the checkpoint
            model = build_on_meta(lambda: model_class(cfg))
            quantize_linears(model, spec)
            # their tensors are read as private copies, not views of the mapped file: a mapped tensor is
            # only as aligned as its offset in the file (8 bytes), and torch's int8 kernel, the fallback
            # without gencli's own, assumes more (a segfault)
            owners = {name for name, _ in quantized_layers(model)}
            private = lambda name, _target: name.rpartition(".")[0] in owners  # noqa: E731
            model = load_state(model, reader, module.HF_KEYMAP, device=placement.device, dtype=placement.dtype, config=src.config, private=private)
        else:
            # quantizing on loading: the weights are read in the file's own dtype when it is narrower
            # (a bf16 file is not copied into fp32 before its linears are quantized), the rest is
            # converted afterwards; the codes and scales are the same either way (computed in fp32)
            load_dtype = placement.dtype
            if spec is not None and not src.is_pickle:
                narrow = _narrow_source_dtype(src, placement.dtype)
                load_dtype = narrow or placement.dtype
            if streamed == torch.bfloat16:  # a bf16 file as it is (no fp32 copy), else fp32 (the linears rounded once); the rest fp32 after
                load_dtype = torch.bfloat16 if bf16_file else torch.float32
            model = build_on_meta(lambda: model_class(cfg))
            replace = {}
            if spec is not None:  # each linear layer quantized as soon as it is read (see load_state)
                names, spec = quantization_targets(model, spec)
                replace = dict.fromkeys(names, quantizing_loader(spec))
            elif streamed is not None:  # each linear layer made a streamed one as soon as it is read
                replace = dict.fromkeys((n for n, m in model.named_modules() if n and dense_of(m) is not None), streaming_loader(streamed))
            model = load_state(
                model,
                reader,
                module.HF_KEYMAP,
                device=placement.device,
                dtype=load_dtype,
                config=src.config,
                column_major=module.CPU_COLUMN_MAJOR if fast_layout else (),
                replace=replace,
            )
            if spec is not None:
                spec = quantize_linears(model, spec)  # the rest: a head tied to the embedding
                if load_dtype != placement.dtype:
                    _convert_unquantized(model, placement.dtype)
    finally:
        reader.close()
    if streamed is not None:
        stream_linears(model, streamed)  # the rest: a head tied to the embedding
        _convert_unquantized(model, torch.float32)  # embeddings, norms: fp32 activations all along
    elif spec is None and placement.device.type == "cpu" and placement.dtype == torch.bfloat16:
        stream_bf16_weights(model)
    if placement.device.type == "cpu" and (streamed is not None or spec is not None):
        # the weights a decoding step streams, on 2 MB pages: +7-9% read bandwidth (backend.huge_pages)
        move_buffers_to_huge_pages(model, lambda m: isinstance(m, (StreamedLinear, QuantizedLinear)))
        model.forget_fused_decoder()
    eos = _ids(gen_cfg.get("eos_token_id")) or _ids(src.config.get("eos_token_id"))
    if tokenizer.eos_id is not None and tokenizer.eos_id not in eos:
        eos.append(tokenizer.eos_id)
    pad = usable_pad_id(_ids(gen_cfg.get("pad_token_id")) + _ids(src.config.get("pad_token_id")) + _ids(tokenizer.pad_id) + eos, cfg.vocab_size)
    context = model.context_length
    window = src.config.get("sliding_window")
    if family == "llama" and isinstance(window, int) and window > 0 and src.config.get("use_sliding_window", True) and window < context:
        context = window  # within the window, full causal attention is exactly what the model computes
    elapsed = time.perf_counter() - start
    return TextModel(model, tokenizer, placement, Path(path), arch, gen_cfg, eos, pad, context, elapsed, quantization=spec)


def _narrow_source_dtype(src: Any, dtype: torch.dtype) -> Optional[torch.dtype]:
    """The checkpoint's one floating-point dtype when it is narrower than ``dtype`` (else None)."""
    from gencli.checkpoints.header import DTYPE_NAMES

    floats = {info.dtype for info in src.tensor_infos().values() if info.dtype in ("F32", "F16", "BF16", "F64")}
    if len(floats) != 1:
        return None
    found = getattr(torch, DTYPE_NAMES[floats.pop()])
    return found if found.itemsize < dtype.itemsize else None


def _streamed_dtype(spec: Any, placement: Placement, n_params: Optional[int], *, bf16_file: bool = False) -> Optional[torch.dtype]:
    """The dtype the linear weights of an unquantized CPU model are held in for gencli's decoding
    kernels (:mod:`gencli.backend.streamed_linear`), or None where the model runs as torch runs it.

    bf16: with ``--dtype bfloat16``, and with ``--dtype auto`` when the checkpoint's weights are bf16
    (``bf16_file``: the values are the file's either way, fp32 would only widen them; half the bytes
    a token reads); the activations, the KV cache and the sums stay fp32. fp32 (``auto`` on an fp32
    or fp16 checkpoint, or ``--dtype float32``): models of ``COLUMN_MAJOR_MIN_BYTES`` or more (where the
    weights no longer sit in the caches and the fused step's gain is worth the kernels' one-time
    build); a smaller fp32 model decodes through torch. None where the kernels cannot be built."""
    if spec is not None or placement.device.type != "cpu" or placement.dtype not in (torch.float32, torch.bfloat16):
        return None
    dtype = torch.bfloat16 if bf16_file else placement.dtype
    if dtype == torch.float32 and (n_params or 0) * 4 < COLUMN_MAJOR_MIN_BYTES:
        return None
    return dtype if streaming_available() else None


def _convert_unquantized(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters to ``dtype``, except the quantized layers' scales and zero points
    (the streamed layers' weights are buffers: they keep their dtype)."""
    from gencli.backend.quantize import QuantizedLinear

    for module in model.modules():
        keep = ("weight_scale", "weight_zero") if isinstance(module, QuantizedLinear) else ()
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_floating_point() and param.dtype != dtype and name not in keep:
                setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))


def describe(tm: TextModel) -> str:
    dtype = DTYPE_NAMES.get(tm.placement.dtype, tm.placement.dtype)
    if tm.quantization is not None:
        dtype = f"{dtype} with {describe_quantization(tm.quantization)} linear weights"
    elif isinstance(tm.model.lm_head, StreamedLinear) and tm.model.lm_head.weight.dtype == torch.bfloat16:
        dtype = "bfloat16 linear weights, float32 activations"
    threads = f" ({tm.placement.threads} thread(s))" if tm.placement.device.type == "cpu" and tm.placement.threads else ""
    return f"{tm.architecture} from '{tm.path}', {dtype} on {tm.placement.device}{threads}, context {tm.context_length} tokens"
