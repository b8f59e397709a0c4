"""Loading a BERT-family encoder folder (config.json + model.safetensors, sharded too) with its tokenizer,
and the sentence-transformers layout around it (modules.json, 1_Pooling/, 2_Normalize/,
sentence_bert_config.json)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from gencli.backend.device import Placement, choose_placement
from gencli.errors import UserError
from gencli.io import read_json
from gencli.models.bert import ARCHITECTURES, MODEL_TYPES, EncoderConfig, EncoderForTask, keymap
from gencli.tokenizers.wordpiece import EncoderTokenizer, load_encoder_tokenizer

SUPPORTED = "BERT, RoBERTa and DistilBERT checkpoints (BertModel, BertForMaskedLM, RobertaForMaskedLM, DistilBertForMaskedLM, ...)"
POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")
HEAD_NAMES = {
    "base": "a bare encoder",
    "masked_lm": "a masked-language model",
    "sequence_classification": "a sequence classifier",
    "token_classification": "a token classifier",
    "question_answering": "a question-answering model",
}
# the command that runs each head
HEAD_COMMANDS = {
    "base": "embed",
    "masked_lm": "fill-mask",
    "sequence_classification": "classify-text",
    "token_classification": "ner",
    "question_answering": "qa",
}


@dataclass
class SentenceLayout:
    """What a sentence-transformers folder says about turning token states into one vector."""

    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: Optional[int] = None
    found: bool = False  # the folder is a sentence-transformers model (modules.json)


@dataclass
class Encoder:
    model: EncoderForTask
    tokenizer: EncoderTokenizer
    placement: Placement
    config: EncoderConfig
    architecture: str
    head: str  # the checkpoint's own head
    path: Path
    layout: SentenceLayout
    max_length: int  # the most tokens one input may have (the window)
    load_seconds: float = 0.0

    def describe(self) -> str:
        return f"{self.architecture} from '{self.path}', {self.placement.describe()}, window {self.max_length} tokens"


def _pooling_mode(cfg: dict[str, Any]) -> str:
    for key, mode in (
        ("pooling_mode_cls_token", "cls"),
        ("pooling_mode_max_tokens", "max"),
        ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
        ("pooling_mode_mean_tokens", "mean"),
    ):
        if cfg.get(key):
            return mode
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        mode = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max", "mean_sqrt_len_tokens": "mean_sqrt_len"}.get(mode, mode)
        if mode in POOLING_MODES:
            return mode
        raise UserError(f"pooling mode '{mode}' is not supported (supported: {', '.join(POOLING_MODES)})")
    return "mean"


def read_sentence_layout(folder: Path) -> SentenceLayout:
    """The pooling, normalisation and window of a sentence-transformers folder (mean, no
    normalisation, the tokenizer's window for a plain transformers folder)."""
    layout = SentenceLayout()
    modules = read_json(folder / "modules.json", expect=list, missing_ok=True)
    if modules:
        layout.found = True
        for module in modules:
            kind = str(module.get("type", "")) if isinstance(module, dict) else ""
            sub = folder / str(module.get("path", "")) if isinstance(module, dict) else folder
            if kind.endswith("Pooling"):
                layout.pooling = _pooling_mode(read_json(sub / "config.json", missing_ok=True) or {})
            elif kind.endswith("Normalize"):
                layout.normalize = True
    st = read_json(folder / "sentence_bert_config.json", missing_ok=True) or {}
    if isinstance(st.get("max_seq_length"), int) and st["max_seq_length"] > 0:
        layout.max_seq_length = st["max_seq_length"]
    return layout


def _architecture(src: Any) -> tuple[str, str, str]:
    """(architecture name, model_type, head) from config.json; another family is a one-line error naming it."""
    from gencli.checkpoints.formats import wrong_family

    config = src.config or {}
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    model_type = config.get("model_type")
    if arch in ARCHITECTURES:
        mt, head = ARCHITECTURES[arch]
        return arch, model_type if model_type in MODEL_TYPES else mt, head
    if arch is None and model_type in MODEL_TYPES:
        return f"{model_type} encoder", model_type, "base"
    raise wrong_family(src, "a BERT-family encoder", f"this command runs {SUPPORTED}")


def load_encoder(
    path: Path,
    *,
    task: str = "base",
    device: str = "auto",
    dtype: str = "auto",
    threads: Optional[int] = None,
    allow_pickle: bool = False,
    accept: Optional[Callable[[str], bool]] = None,
) -> Encoder:
    """Load the encoder in ``path`` for ``task`` (a head of :data:`gencli.models.bert.HEADS`; "base"
    loads the bare encoder of any checkpoint, dropping its head). A checkpoint whose head is not
    ``task`` is a one-line error (unless ``task`` is "base")."""
    from gencli.checkpoints.formats import open_source, wrong_family
    from gencli.checkpoints.loader import build_on_meta, load_state
    from gencli.checkpoints.reader import open_reader

    start = time.perf_counter()
    src = open_source(path, allow_pickle=allow_pickle)
    if src.kind == "diffusers-pipeline":
        raise wrong_family(src, "a BERT-family encoder")
    if src.config is None:
        raise UserError(f"no config.json next to '{path}': an encoder needs its config.json (the architecture and sizes)")
    arch, model_type, head = _architecture(src)
    if task != "base" and head != task:
        raise UserError(f"'{path}' holds {arch} ({HEAD_NAMES[head]}), not {HEAD_NAMES[task]}: `gencli {HEAD_COMMANDS[head]}` runs it")
    cfg = EncoderConfig.from_hf({**src.config, "model_type": model_type})
    folder = src.folder or Path(path)
    tokenizer = load_encoder_tokenizer(folder, model_type)  # before the weights: a missing tokenizer fails fast
    layout = read_sentence_layout(folder)
    placement = choose_placement(device, dtype, "transformer", threads, n_params=src.num_parameters())
    keys = set(src.tensor_infos()) if not src.is_pickle else set()
    has_pooler = any(".pooler." in k or k.startswith("pooler.") for k in keys)
    keep_pooler = has_pooler and task == "base" and model_type == "bert" or task == "sequence_classification" and model_type == "bert"
    model = build_on_meta(lambda: EncoderForTask(cfg, task, pooler=keep_pooler))
    reader = open_reader(src, allow_pickle=allow_pickle)
    try:
        model = load_state(
            model, reader, keymap(cfg, task, keep_pooler=keep_pooler), device=placement.device, dtype=placement.dtype, config=src.config, what=arch
        )
    finally:
        reader.close()
    positions = cfg.max_positions
    window = min(positions, tokenizer.model_max_length) if tokenizer.model_max_length else positions
    if layout.max_seq_length:  # sentence-transformers' window wins over the tokenizer's
        window = min(layout.max_seq_length, positions)
    return Encoder(model, tokenizer, placement, cfg, arch, head, Path(path), layout, window, time.perf_counter() - start)


def batches_by_length(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Input indices in batches of similar length (longest first), so little padding is computed;
    callers put the results back in input order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def collate(encodings: list[Any], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, token types) of a batch, right-padded."""
    n = max(len(e.ids) for e in encodings)
    ids = torch.full((len(encodings), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encodings), n), dtype=torch.long)
    types = torch.zeros((len(encodings), n), dtype=torch.long)
    for i, e in enumerate(encodings):
        k = len(e.ids)
        ids[i, :k] = torch.tensor(e.ids)
        mask[i, :k] = 1
        types[i, :k] = torch.tensor(e.type_ids)
    return ids.to(device), mask.to(device), types.to(device)
