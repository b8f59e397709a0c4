"""Loading a T5 / mT5 / Marian checkpoint with its tokenizer into a :class:`Seq2SeqModel`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from gencli.backend.device import DTYPE_NAMES, Placement, choose_placement, cpu_has_native_bf16, resolve_device
from gencli.backend.packed_linear import packing_available, stream_bf16_weights
from gencli.errors import UserError
from gencli.models.seq2seq import Seq2SeqLM
from gencli.pipelines.text.flags import check_generation_config, usable_pad_id
from gencli.tokenizers.seq2seq import load_seq2seq_tokenizer
from gencli.tokenizers.text import TextTokenizer, read_json

SUPPORTED = "T5ForConditionalGeneration, MT5ForConditionalGeneration, MarianMTModel, BartForConditionalGeneration"
WANTED = "a text-to-text model"
PACKED_BF16_MIN_PARAMS = 20_000_000  # smaller models decode in fp32 under --dtype auto (bf16 would not pay)
# generation settings an old config.json carries itself (transformers reads them there when the
# folder has no generation_config.json)
_GENERATION_KEYS = (
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "num_beams", "length_penalty", "early_stopping", "no_repeat_ngram_size",
    "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "num_return_sequences", "bad_words_ids", "forced_eos_token_id",
    "decoder_start_token_id", "eos_token_id", "pad_token_id", "forced_bos_token_id",
)  # fmt: skip


@dataclass
class Seq2SeqModel:
    model: Seq2SeqLM
    tokenizer: TextTokenizer
    placement: Placement
    path: Path
    family: str  # "t5" | "marian" | "bart"
    architecture: str
    generation_config: dict[str, Any]  # config.json's generation keys, overridden by generation_config.json
    eos_ids: list[int]
    pad_id: int
    decoder_start_id: int
    max_source_tokens: int  # inputs longer than this are truncated (or refused)
    load_seconds: float
    screen: Any = None  # the screened argmax of the LM head (greedy decoding), built on first use
    screen_failed: bool = False  # no exact screen could be built on this CPU: not tried again
    # the most new tokens the decoder's position table holds (Marian, BART: learned or sinusoidal
    # positions, the decoder start token at position 0); None: no limit (T5's relative positions)
    max_target_tokens: Optional[int] = None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _auto_dtype(device: str, dtype: str, n_params: Optional[int]) -> str:
    """``--dtype auto`` for an encoder-decoder: bf16 with oneDNN's packed matmul on a CPU with native
    bf16 (AMX) for a model of at least :data:`PACKED_BF16_MIN_PARAMS` parameters, where decoding
    reads half the bytes per step (a T5-small shape, one thread: about 1.2x fp32's greedy and 2x its
    4-beam steps per CPU-second, see docs/benchmarks.md); else the rule every decoder follows (fp32 on
    a CPU). ``--dtype float32`` gives transformers' fp32 output."""
    if (dtype or "auto").strip().lower() != "auto" or n_params is None or n_params < PACKED_BF16_MIN_PARAMS:
        return dtype
    if resolve_device(device).type != "cpu" or not cpu_has_native_bf16() or not packing_available():
        return dtype
    return "bfloat16"


def family_of(src) -> tuple[str, str]:
    """``(family, architecture)`` from config.json; another architecture is a one-line error naming
    the command that runs it."""
    from gencli.checkpoints.formats import wrong_family
    from gencli.models import bart, marian, t5

    config = src.config or {}
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    model_type = config.get("model_type")
    if arch in t5.ARCHITECTURES or (arch is None and model_type in t5.MODEL_TYPES):
        return "t5", arch or "T5ForConditionalGeneration"
    if arch in marian.ARCHITECTURES or (arch is None and model_type in marian.MODEL_TYPES):
        return "marian", arch or "MarianMTModel"
    if arch in bart.ARCHITECTURES or (arch is None and model_type in bart.MODEL_TYPES):
        return "bart", arch or "BartForConditionalGeneration"
    raise wrong_family(src, WANTED, f"gencli text2text runs {SUPPORTED}")


def load_seq2seq_model(path: Path, *, device: str = "auto", dtype: str = "auto", threads: Optional[int] = None, allow_pickle: bool = False) -> Seq2SeqModel:
    """Load an encoder-decoder checkpoint folder with its tokenizer (the tokenizer first: a missing
    or corrupt sentencepiece model fails before any weight is read)."""
    from gencli.checkpoints.formats import open_source, wrong_family
    from gencli.checkpoints.loader import build_on_meta, load_state
    from gencli.checkpoints.reader import open_reader
    from gencli.models import bart, marian, t5

    start = time.perf_counter()
    src = open_source(path, allow_pickle=allow_pickle)
    if src.kind == "diffusers-pipeline":
        raise wrong_family(src, WANTED)
    if src.config is None:
        raise wrong_family(src, WANTED, f"gencli text2text runs {SUPPORTED} folders with their config.json")
    family, arch = family_of(src)
    folder = src.folder or Path(path)
    tokenizer = load_seq2seq_tokenizer(folder, family)
    reader = open_reader(src, allow_pickle=allow_pickle)
    try:
        keys = set(reader.keys())
        if family == "t5":
            cfg: Any = t5.T5Config.from_hf(src.config, has_lm_head="lm_head.weight" in keys)
            factory, keymap = (lambda: t5.T5ForConditionalGeneration(cfg)), t5.HF_KEYMAP
            window = int(src.config.get("n_positions") or 512)
            target = None
        elif family == "bart":
            cfg = bart.config_from_hf(src.config, has_final_logits_bias="final_logits_bias" in keys)
            factory, keymap = (lambda: bart.BartForConditionalGeneration(cfg)), bart.HF_KEYMAP
            window = target = cfg.max_position_embeddings
        else:
            cfg = marian.MarianConfig.from_hf(src.config, has_final_logits_bias="final_logits_bias" in keys)
            factory, keymap = (lambda: marian.MarianMTModel(cfg)), marian.HF_KEYMAP
            window = target = cfg.max_position_embeddings
        # the generation settings before the weights load, each file's checked as the flags are (the
        # vocabulary: the smaller of the encoder's and the decoder's, which read the ids back)
        vocab = min(v for v in (getattr(cfg, "vocab_size", None), getattr(cfg, "decoder_vocab_size", None)) if v)
        gen_cfg = {k: src.config[k] for k in _GENERATION_KEYS if src.config.get(k) is not None}
        check_generation_config(gen_cfg, str(folder / "config.json"), vocab)
        gen_file = read_json(folder / "generation_config.json")
        check_generation_config(gen_file, str(folder / "generation_config.json"), vocab)
        gen_cfg.update({k: v for k, v in gen_file.items() if v is not None})
        n_params = src.num_parameters()
        placement = choose_placement(device, _auto_dtype(device, dtype, n_params), "decoder", threads, n_params=n_params)
        model = load_state(build_on_meta(factory), reader, keymap, device=placement.device, dtype=placement.dtype, config=src.config)
        if placement.dtype == torch.bfloat16 and placement.device.type == "cpu":
            stream_bf16_weights(model)
    finally:
        reader.close()
    eos = _ids(gen_cfg.get("eos_token_id")) or _ids(src.config.get("eos_token_id"))
    if not eos and tokenizer.eos_id is not None:
        eos = [tokenizer.eos_id]
    candidates = _ids(gen_cfg.get("pad_token_id")) + _ids(src.config.get("pad_token_id")) + _ids(tokenizer.pad_id) + eos
    pad = usable_pad_id(candidates, vocab)
    start_ids = _ids(gen_cfg.get("decoder_start_token_id")) or _ids(src.config.get("decoder_start_token_id")) or [pad]
    elapsed = time.perf_counter() - start
    return Seq2SeqModel(model, tokenizer, placement, Path(path), family, arch, gen_cfg, eos, pad, start_ids[0], window, elapsed, max_target_tokens=target)


def describe(sm: Seq2SeqModel) -> str:
    dtype = DTYPE_NAMES.get(sm.placement.dtype, sm.placement.dtype)
    threads = f" ({sm.placement.threads} thread(s))" if sm.placement.device.type == "cpu" and sm.placement.threads else ""
    return f"{sm.architecture} from '{sm.path}', {dtype} on {sm.placement.device}{threads}"


def check_not_empty(text: str) -> None:
    if not text.strip():
        raise UserError("the input is empty")
