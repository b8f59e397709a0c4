"""Text generation: load a GPT-2 / Llama-family checkpoint with its tokenizer, then generate.

The loop prefills the prompt(s) in one forward pass, then decodes one token per step through a
preallocated KV cache. Several prompts run as one left-padded batch; each row stops on its own (EOS,
a stop string, its token budget, or the model's context). Text reaches the caller piece by piece
through an incremental detokenizer, with stop strings held back and trimmed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from gencli.backend.device import DTYPE_NAMES, Placement, choose_placement
from gencli.backend.random import make_generator
from gencli.backend.screened_argmax import ScreenedArgmax
from gencli.console import Reporter, emit_json
from gencli.errors import UserError
from gencli.models.causal_lm import CausalLM
from gencli.pipelines.sampling import SamplingParams, next_tokens
from gencli.tokenizers.stream import IncrementalDetokenizer, StopStringMatcher
from gencli.tokenizers.text import TextTokenizer, load_tokenizer, read_json

DEFAULT_MAX_NEW_TOKENS = 256
SUPPORTED = "GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"


# fp32 models at least this big load their linear weights column-major on a CPU (see below)
COLUMN_MAJOR_MIN_BYTES = 128 * 2**20


# -- loading ------------------------------------------------------------------------------------
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


# The screen of the LM head pays off once the head no longer sits in the caches, and once enough
# steps repay building it: the build reads the head a few times, each decode step then saves most
# of a read (GPT-2 on a 2-core CPU: the int8 copy takes 0.2 s to build and saves about 4 ms per
# token, the bf16 copy 0.1 s and about 2.5 ms).
SCREEN_MIN_HEAD_BYTES = 32 * 2**20
SCREEN_MIN_STEPS = 128
SCREEN_KIND: Optional[str] = None  # the head copy the screen reads: "int8", "bf16", None = the best exact one


def screen_for(tm: TextModel, params: SamplingParams, steps: int) -> Optional[ScreenedArgmax]:
    """The exact screened argmax of the LM head (:mod:`gencli.backend.screened_argmax`), when the
    tokens are plain greedy choices from a large fp32 head on a CPU with oneDNN's int8 (VNNI) or
    native bf16 kernels and the generation is long enough to repay building it (or it is built
    already); else None."""
    weight = tm.model.lm_head.weight
    if not weight.is_floating_point():  # a quantized head: already a fraction of the fp32 read
        return None
    if not params.greedy or params.repetition_penalty != 1.0 or getattr(tm.model.lm_head, "bias", None) is not None:
        return None
    if tm.screen is None and not tm.screen_failed:
        if steps < SCREEN_MIN_STEPS or weight.numel() * weight.element_size() < SCREEN_MIN_HEAD_BYTES:
            return None
        if not ScreenedArgmax.supported(weight, SCREEN_KIND):
            return None
        try:
            tm.screen = ScreenedArgmax(weight, kind=SCREEN_KIND)
        except ValueError:  # no copy passed its exactness check on this CPU
            tm.screen_failed = True
    return tm.screen


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
    from gencli.backend.quantize import quantization_targets, quantize_linears, quantized_layers, quantizing_loader
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
    n_params = src.num_parameters()
    placement = choose_placement(device, dtype, "decoder", threads, n_params=n_params)
    reader = open_reader(src, allow_pickle=allow_pickle)
    try:
        # batch-1 decoding streams every weight from memory once per token: on a CPU in fp32 the
        # products run faster over column-major weights once the model is too big for the caches
        # (measured: +9% per product at 500 MB, -10% tokens/s for the 36 MB default model). Only
        # weights converted on loading (bf16/fp16 files) change layout; fp32 files stay zero-copy.
        fast_layout = spec is None and placement.device.type == "cpu" and placement.dtype == torch.float32 and (n_params or 0) * 4 >= COLUMN_MAJOR_MIN_BYTES
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
            model = build_on_meta(lambda: model_class(cfg))
            replace = {}
            if spec is not None:  # each linear layer quantized as soon as it is read (see load_state)
                names, spec = quantization_targets(model, spec)
                replace = dict.fromkeys(names, quantizing_loader(spec))
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
    gen_cfg = read_json(folder / "generation_config.json")
    eos = _ids(gen_cfg.get("eos_token_id")) or _ids(src.config.get("eos_token_id"))
    if tokenizer.eos_id is not None and tokenizer.eos_id not in eos:
        eos.append(tokenizer.eos_id)
    pad = next(iter(_ids(gen_cfg.get("pad_token_id")) + _ids(src.config.get("pad_token_id")) + _ids(tokenizer.pad_id) + eos), 0)
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


def _convert_unquantized(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters to ``dtype``, except the quantized layers' scales and zero points."""
    from gencli.backend.quantize import QuantizedLinear

    for module in model.modules():
        keep = ("weight_scale", "weight_zero") if isinstance(module, QuantizedLinear) else ()
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_floating_point() and param.dtype != dtype and name not in keep:
                setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))


def quantization_of(config: dict[str, Any], quantize: Optional[str], group_size: Optional[int]) -> tuple[bool, Any]:
    """``(stored, spec)``: the :class:`~gencli.backend.quantize.QuantizationSpec` the model runs
    with (None: not quantized) and whether the checkpoint already holds it."""
    from gencli.backend.quantize import MODES, QuantizationSpec

    if quantize is not None and quantize not in MODES:
        raise UserError(f"--quantize must be one of {', '.join(MODES)} (got '{quantize}')")
    if group_size is not None and quantize != "int4":
        raise UserError("--group-size applies to --quantize int4 only")
    entry = config.get("quantization_config")
    if entry is None:
        if quantize is None:
            return False, None
        try:
            spec = QuantizationSpec.for_mode(quantize, group_size)
        except ValueError as exc:
            raise UserError(f"--group-size: {exc}") from None
        _check_activation_setting()
        return False, spec
    try:
        spec = QuantizationSpec.from_config(entry if isinstance(entry, dict) else {})
    except ValueError as exc:
        raise UserError(f"config.json: {exc}") from None
    if quantize is not None and (quantize != spec.mode or (group_size is not None and group_size != spec.group_size)):
        raise UserError(f"the checkpoint is quantized already ({describe_quantization(spec)}): it cannot be quantized as {quantize} again")
    _check_activation_setting()
    return True, spec


def _check_activation_setting() -> None:
    """A bad ``GENCLI_QUANT_ACTIVATIONS`` is a usage error before anything loads, not a failure in
    the first quantized product."""
    from gencli.backend.quant_kernels import int8_activations

    try:
        int8_activations()
    except ValueError as exc:
        raise UserError(str(exc)) from None


def describe_quantization(spec: Any) -> str:
    """``int8 per output channel`` / ``int4 in groups of 32``."""
    return f"{spec.mode} " + ("per output channel" if spec.mode == "int8" else f"in groups of {spec.group_size}")


# -- quantized checkpoints -------------------------------------------------------------------------
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

    out = Path(out)
    ensure_folder_writable(out, force, wrote=quantized_folder_files)
    if group_size is not None and mode != "int4":
        raise UserError("--group-size applies to --mode int4 only")
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
        skip = skip or f.name.endswith((".index.json", ".safetensors", ".bin", ".pt", ".ckpt"))
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


# -- settings -------------------------------------------------------------------------------------
@dataclass
class GenerationSettings:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None


def check_flags(*, max_new_tokens=None, temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None, stop=()) -> None:
    """Reject out-of-range values before anything is loaded."""
    if any(s == "" for s in stop or ()):
        raise UserError("--stop takes a non-empty string (an empty one would match before the first token)")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    if temperature is not None and not temperature >= 0:
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = off), got {top_k}")
    if top_p is not None and not (0 < top_p <= 1):
        raise UserError(f"--top-p must be in (0, 1], got {top_p}")
    if min_p is not None and not (0 <= min_p <= 1):
        raise UserError(f"--min-p must be in [0, 1], got {min_p}")
    if repetition_penalty is not None and not repetition_penalty > 0:
        raise UserError(f"--repetition-penalty must be > 0 (1 = off), got {repetition_penalty}")


def resolve_settings(
    gen_cfg: dict[str, Any],
    *,
    max_new_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    seed: Optional[int] = None,
    warn: Callable[[str], None] = lambda m: None,
) -> GenerationSettings:
    """Flags override ``generation_config.json``, which overrides transformers' defaults.

    As in transformers, a checkpoint samples only when its generation config says ``do_sample``;
    otherwise decoding is greedy. A flag that only makes sense when sampling (--top-k/--top-p/--min-p)
    turns sampling on at temperature 1 unless --temperature is given.
    """
    check_flags(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
    do_sample = bool(gen_cfg.get("do_sample", False))
    if temperature is None:
        if do_sample:
            temperature = float(gen_cfg.get("temperature", 1.0) or 0.0)
        elif top_k is not None or top_p is not None or min_p is not None:
            temperature = 1.0
        else:
            temperature = 0.0
    elif temperature == 0.0 and (top_k or (top_p is not None and top_p < 1) or min_p):
        warn("--top-k/--top-p/--min-p have no effect with --temperature 0 (greedy decoding)")
    sampling = SamplingParams(
        temperature=float(temperature),
        top_k=int(top_k if top_k is not None else (gen_cfg.get("top_k") if gen_cfg.get("top_k") is not None else 50)),
        top_p=float(top_p if top_p is not None else (gen_cfg.get("top_p") if gen_cfg.get("top_p") is not None else 1.0)),
        min_p=float(min_p if min_p is not None else (gen_cfg.get("min_p") or 0.0)),
        repetition_penalty=float(repetition_penalty if repetition_penalty is not None else (gen_cfg.get("repetition_penalty") or 1.0)),
    )
    if max_new_tokens is None:
        max_new_tokens = int(gen_cfg.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
    return GenerationSettings(max_new_tokens, sampling, [s for s in stop if s], ignore_eos, seed)


# -- prompts ----------------------------------------------------------------------------------------
def encode_prompt(tm: TextModel, prompt: str, *, chat: bool = False, system: Optional[str] = None) -> list[int]:
    """Token ids of one prompt (through the chat template with ``chat``); checks it fits the context."""
    from gencli.tokenizers.chat import build_messages, render_chat

    if not prompt.strip():
        raise UserError("the prompt is empty")
    if chat:
        text = render_chat(tm.tokenizer.chat_template, build_messages(prompt, system), tm.tokenizer.special_token_map(), where=str(tm.path))
        ids = tm.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tm.tokenizer.encode(prompt, add_special_tokens=True)
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    if len(ids) >= tm.context_length:
        raise UserError(f"the prompt is {len(ids)} tokens, the model's context is {tm.context_length} tokens: shorten the prompt to leave room for new tokens")
    return ids


# -- generation ---------------------------------------------------------------------------------------
@dataclass
class Completion:
    prompt: str
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" (EOS or stop string) | "length" (budget or context)
    hit_context: bool = False
    timing: dict[str, float] = field(default_factory=dict)

    def as_json(self, model: str, seed: Optional[int]) -> dict[str, Any]:
        out = {
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.token_ids)},
            "timing": self.timing,
            "model": model,
        }
        if seed is not None:
            out["seed"] = seed
        return out


class _Row:
    """One sequence of a batch: its detokenizer, stop matcher and budget."""

    def __init__(self, tm: TextModel, completion: Completion, settings: GenerationSettings, budget: int):
        self.c = completion
        self.detok = IncrementalDetokenizer(tm.tokenizer, completion.prompt_ids)
        self.stops = StopStringMatcher(settings.stop)
        self.budget = budget
        self.done = False
        self.pieces: list[str] = []

    def take(self, token: int, eos: set[int], max_new_tokens: int) -> str:
        """Add the row's next token (ignored once the row is done); returns the text that became final."""
        if self.done:
            return ""
        self.c.token_ids.append(token)
        if token in eos:
            return self.finish("stop")
        piece = self.stops.feed(self.detok.add(token))
        self.pieces.append(piece)
        if self.stops.stopped is not None:
            self.finish("stop")
        elif len(self.c.token_ids) >= self.budget:
            self.c.hit_context = self.budget < max_new_tokens
            piece += self.finish("length")
        return piece

    def finish(self, reason: str) -> str:
        self.done = True
        self.c.finish_reason = reason
        tail = ""
        if self.stops.stopped is None:
            tail = self.stops.feed(self.detok.flush())
            tail += self.stops.finish() if self.stops.stopped is None else ""
        self.pieces.append(tail)
        self.c.text = "".join(self.pieces)
        return tail


@dataclass
class _PromptBatch:
    """The prompts as one left-padded batch on the model's device; the mask and explicit positions
    only when the lengths differ."""

    input_ids: torch.Tensor  # (B, longest)
    lengths: list[int]
    attention_mask: Optional[torch.Tensor] = None  # (B, capacity), True = a real token
    position_ids: Optional[torch.Tensor] = None  # (B, longest)
    next_pos: Optional[torch.Tensor] = None  # (B,) the position of each row's next token

    @classmethod
    def build(cls, prompts: Sequence[tuple[str, list[int]]], pad_id: int, capacity: int, device: torch.device) -> "_PromptBatch":
        lengths = [len(ids) for _, ids in prompts]
        b, longest = len(prompts), max(lengths)
        input_ids = torch.full((b, longest), pad_id, dtype=torch.long)
        for i, (_, ids) in enumerate(prompts):
            input_ids[i, longest - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        batch = cls(input_ids.to(device), lengths)
        if any(n != longest for n in lengths):
            mask = torch.ones((b, capacity), dtype=torch.bool)
            for i, n in enumerate(lengths):
                mask[i, : longest - n] = False
            batch.position_ids = (mask[:, :longest].long().cumsum(-1) - 1).clamp(min=0).to(device)
            batch.attention_mask = mask.to(device)
            batch.next_pos = torch.tensor(lengths, dtype=torch.long).to(device)
        return batch

    @property
    def padded(self) -> bool:
        return self.attention_mask is not None

    def seen_tokens(self, prompts: Sequence[tuple[str, list[int]]], capacity: int) -> torch.Tensor:
        """Every token so far per row (for the repetition penalty), room for ``capacity``; the
        padding repeats the row's first token (no effect)."""
        b, longest = self.input_ids.shape
        seen = torch.empty((b, capacity), dtype=torch.long, device=self.input_ids.device)
        seen[:, :longest] = self.input_ids
        for i, (_, ids) in enumerate(prompts):
            seen[i, : longest - len(ids)] = ids[0]
        return seen


@torch.inference_mode()
def generate(
    tm: TextModel,
    prompts: Sequence[tuple[str, list[int]]],
    settings: GenerationSettings,
    *,
    on_text: Optional[Callable[[int, str], None]] = None,
    generator: Optional[torch.Generator] = None,
) -> list[Completion]:
    """Generate for ``prompts`` (``(text, ids)`` pairs) as one batch.

    ``on_text(row, piece)`` receives text as soon as it is final (streaming). Returns one
    :class:`Completion` per prompt, in order.
    """
    model, device = tm.model, tm.placement.device
    params = settings.sampling
    b = len(prompts)
    budgets = [min(settings.max_new_tokens, tm.context_length - len(ids)) for _, ids in prompts]
    steps = max(budgets)
    batch = _PromptBatch.build(prompts, tm.pad_id, max(len(ids) for _, ids in prompts) + steps, device)
    longest = batch.input_ids.shape[1]
    rows = [_Row(tm, Completion(text, list(ids)), settings, budget) for (text, ids), budget in zip(prompts, budgets)]
    eos = set() if settings.ignore_eos else set(tm.eos_ids)
    seen = batch.seen_tokens(prompts, longest + steps) if params.repetition_penalty != 1.0 else None
    cache = model.new_cache(b, longest + steps)
    head = screen_for(tm, params, steps)

    def advance(ids: torch.Tensor, pos: Optional[torch.Tensor], seen_so_far: Optional[torch.Tensor]) -> torch.Tensor:
        """Run ``ids`` through the model (filling the cache) and choose the next token of each row."""
        hidden = model.hidden_states(ids, position_ids=pos, attention_mask=batch.attention_mask, kv_cache=cache, logits_to_keep=1)[:, -1]
        if head is not None:
            return head(hidden)
        return next_tokens(model.lm_head(hidden), params, generator, seen_so_far)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    tokens = advance(batch.input_ids, batch.position_ids, seen[:, :longest] if seen is not None else None)
    host = tokens.tolist()
    sync()
    t_prefill = time.perf_counter() - t0
    decode_steps = 0
    t1 = time.perf_counter()
    for step in range(steps):
        for i, row in enumerate(rows):
            piece = row.take(host[i], eos, settings.max_new_tokens)
            if piece and on_text is not None:
                on_text(i, piece)
        if all(r.done for r in rows) or step == steps - 1:
            break
        cur = longest + step
        # rows that already finished keep stepping; their positions must stay inside the table
        pos = (batch.next_pos.view(b, 1) + step).clamp_(max=tm.context_length - 1) if batch.padded else None
        if seen is not None:
            seen[:, cur] = tokens
        tokens = advance(tokens.view(b, 1), pos, seen[:, : cur + 1] if seen is not None else None)
        host = tokens.tolist()
        decode_steps += 1
    sync()
    timing = _timing(tm, sum(batch.lengths), b, t_prefill, time.perf_counter() - t1, decode_steps)
    for row in rows:
        if not row.done:  # pragma: no cover - every row ends by its budget at the latest
            row.finish("length")
        row.c.timing = dict(timing)
    return [r.c for r in rows]


def _timing(tm: TextModel, prompt_tokens: int, batch_size: int, t_prefill: float, t_decode: float, decode_steps: int) -> dict[str, Any]:
    return {
        "load_s": round(tm.load_seconds, 4),
        "prefill_s": round(t_prefill, 4),
        "decode_s": round(t_decode, 4),
        "prefill_tokens_per_s": round(prompt_tokens / t_prefill, 2) if t_prefill > 0 else None,
        "decode_tokens_per_s": round(decode_steps * batch_size / t_decode, 2) if t_decode > 0 and decode_steps else None,
        "batch_size": batch_size,
    }


def write_completions(batches, report: Reporter, out, *, stream: bool = False, echo: bool = False, many: bool = True) -> None:
    """Write each batch's completions (``batches``: ``(completions, model path, context length,
    seed)`` in prompt order) as they come: JSON lines with --json, else the texts (a blank line between
    them when ``many``; only the line end when ``stream``ed already)."""
    context_warned = False
    for completions, model_path, context_length, seed in batches:
        for c in completions:
            if c.hit_context and not context_warned:
                report.warn(f"stopped at the model's context length ({context_length} tokens)")
                context_warned = True
            if report.json:
                emit_json(c.as_json(model_path, seed), out)
            elif stream:
                out.write("\n")
            else:
                out.write((c.prompt if echo else "") + c.text + "\n")
                if many:
                    out.write("\n")
            out.flush()
        t = completions[0].timing
        report.debug(
            f"prefill {t['prefill_s']:.3f}s ({t['prefill_tokens_per_s'] or 0:.1f} tokens/s), "
            f"decode {t['decode_s']:.3f}s ({t['decode_tokens_per_s'] or 0:.1f} tokens/s), batch of {len(completions)}"
        )


def describe(tm: TextModel) -> str:
    dtype = DTYPE_NAMES.get(tm.placement.dtype, tm.placement.dtype)
    if tm.quantization is not None:
        dtype = f"{dtype} with {describe_quantization(tm.quantization)} linear weights"
    threads = f" ({tm.placement.threads} thread(s))" if tm.placement.device.type == "cpu" and tm.placement.threads else ""
    return f"{tm.architecture} from '{tm.path}', {dtype} on {tm.placement.device}{threads}, context {tm.context_length} tokens"


def batch_generator(seed: Optional[int], index: int) -> Optional[torch.Generator]:
    """The sampling generator of the ``index``-th batch of a prompts file (None when greedy: no seed).

    Batch 0 draws from ``seed`` itself (one prompt gives the text it always gave); batch ``k > 0``
    from a seed derived from ``(seed, k)``. A batch's text thus depends on its prompts and the seed
    only, never on what the batches before it drew: the same on one process and on Ray replicas."""
    if seed is None:
        return None
    if index:
        import numpy as np

        seed = int(np.random.SeedSequence([seed, index]).generate_state(1)[0]) & 0x7FFFFFFF
    return make_generator(seed)[0]


def make_sampler_generator(settings: GenerationSettings) -> tuple[Optional[torch.Generator], Optional[int]]:
    """A seeded generator when sampling (a fresh seed, reported back, when none was given)."""
    if settings.sampling.greedy:
        return None, None
    gen, seed = make_generator(settings.seed)
    return gen, seed
