"""Text classification with a BERT-family sequence classifier, as transformers' text-classification
pipeline scores it: softmax over the labels for a single-label head, a sigmoid per label for a
multi-label head (``problem_type`` ``multi_label_classification``) or a one-logit head (cross-encoders),
the raw value for a regression head (``problem_type`` ``regression``)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from gencli.errors import UserError
from gencli.pipelines.encoders.forward import head_logits
from gencli.pipelines.encoders.loading import Encoder

FUNCTIONS = ("softmax", "sigmoid", "none")


def score_function(enc: Encoder) -> str:
    """What transformers' pipeline applies to the logits by default (``function_to_apply``)."""
    cfg = enc.config
    if cfg.problem_type == "regression":
        return "none"
    if cfg.problem_type == "multi_label_classification" or cfg.num_labels == 1:
        return "sigmoid"
    return "softmax"


def is_single_score(enc: Encoder) -> bool:
    """A head with one output (a regression or a cross-encoder's relevance): one score, no labels."""
    return enc.config.num_labels == 1


def label_name(enc: Encoder, i: int) -> str:
    id2label = enc.config.id2label or {}
    name = id2label.get(str(i), id2label.get(i)) if isinstance(id2label, dict) else None
    return str(name) if name is not None else f"LABEL_{i}"


def encode_pairs(
    enc: Encoder,
    texts: Sequence[str],
    pairs: Sequence[Optional[str]],
    *,
    max_length: Optional[int] = None,
    warn: Optional[Callable[[str], None]] = None,
) -> list[Any]:
    """Each text (with its pair, when it has one) tokenized with the special tokens, at most the
    window's tokens (longest first); empty texts refused, truncation reported."""
    if not texts:
        raise UserError("no text given")
    for i, (t, p) in enumerate(zip(texts, pairs)):
        if not t.strip():
            raise UserError(f"text {i + 1} is empty")
        if p is not None and not p.strip():
            raise UserError(f"the pair of text {i + 1} is empty")
    window = enc.max_length
    if max_length is not None:
        if max_length < 1:
            raise UserError("--max-length must be at least 1")
        window = min(max_length, enc.config.max_positions)
    out = [enc.tokenizer.encode(t, p, max_length=window) for t, p in zip(texts, pairs)]
    cut = [e.cut for e in out if e.cut]
    if cut and warn is not None:
        which = "1 input was" if len(cut) == 1 else f"{len(cut)} inputs were"
        warn(f"{which} longer than the {window}-token window and truncated: {sum(cut)} token(s) cut")
    return out


def classify_texts(
    enc: Encoder,
    texts: Sequence[str],
    pairs: Optional[Sequence[Optional[str]]] = None,
    *,
    top_k: Optional[int] = None,
    function: Optional[str] = None,
    max_length: Optional[int] = None,
    batch_size: int = 8,
    warn: Optional[Callable[[str], None]] = None,
) -> list[Any]:
    """For each text: its labels ``[{"label", "score"}]`` sorted by score (the best ``top_k``; all when
    None), or, for a one-output head, its score (a float)."""
    if function is not None and function not in FUNCTIONS:
        raise UserError(f"unknown score function '{function}' (known: {', '.join(FUNCTIONS)})")
    if top_k is not None and top_k < 1:
        raise UserError("-k must be at least 1")
    pairs = list(pairs) if pairs is not None else [None] * len(texts)
    encoded = encode_pairs(enc, texts, pairs, max_length=max_length, warn=warn)
    fn = function or score_function(enc)
    results: list[Any] = []
    for logits in head_logits(enc, encoded, batch_size):
        if fn == "softmax":
            scores = torch.softmax(logits, dim=-1)
        elif fn == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = logits
        values = scores.tolist()
        if is_single_score(enc):
            results.append(values[0])
            continue
        labels = sorted(({"label": label_name(enc, i), "score": v} for i, v in enumerate(values)), key=lambda d: -d["score"])
        results.append(labels[:top_k] if top_k is not None else labels)
    return results
