"""Named entities with a BERT-family token classifier, as transformers' token-classification pipeline
defines them.

Each token's label probabilities are a softmax of its logits; special tokens are skipped. Aggregation:

- ``none``: one entity per token, ``{"entity", "score", "index", "word", "start", "end"}``;
- ``simple``: the tokens' best labels, adjacent tokens of the same type grouped (a ``B-`` tag starts a
  new group; a label without ``B-``/``I-`` continues one): ``{"entity_group", "score" (mean), "word",
  "start", "end"}``;
- ``first`` / ``average`` / ``max``: the tokens of one word first agree on a label (the first token's
  best label; the best label of the averaged probabilities; the label of the token with the highest
  probability), then words are grouped as ``simple`` groups tokens.

A token is a continuation of the previous word when the tokenizer is word-aware (WordPiece: its
spelling, ``##`` and all, is longer than the text it covers), else when no space precedes it (the
pipeline's fallback heuristic, as for byte-level BPE). An unknown token is never a continuation and
shows the text it covers. Entities labelled ``O`` are dropped. Offsets are character offsets into the
text.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from gencli.errors import UserError
from gencli.pipelines.encoders.classify import encode_pairs, label_name
from gencli.pipelines.encoders.forward import head_logits
from gencli.pipelines.encoders.loading import Encoder

AGGREGATIONS = ("simple", "first", "average", "max", "none")


def _tokens_to_string(enc: Encoder, tokens: list[str]) -> str:
    """transformers' ``convert_tokens_to_string``: the tokenizer's decoder over the token strings."""
    decoder = enc.tokenizer.tk.decoder
    if decoder is None:
        return " ".join(tokens)
    return decoder.decode(tokens)


def _word_aware(enc: Encoder) -> bool:
    return bool(getattr(enc.tokenizer.tk.model, "continuing_subword_prefix", None))


def pre_entities(enc: Encoder, text: str, encoded: Any, scores: torch.Tensor) -> list[dict[str, Any]]:
    word_aware = _word_aware(enc)
    unk = enc.tokenizer.token_to_id(enc.tokenizer.unk_token)
    out = []
    for idx, (tid, special) in enumerate(zip(encoded.ids, encoded.special)):
        if special:
            continue
        word = enc.tokenizer.id_to_token(tid) or ""
        start, end = encoded.offsets[idx]
        ref = text[start:end]
        if word_aware:
            is_subword = len(word) != len(ref)
        else:
            is_subword = start > 0 and " " not in text[start - 1 : start + 1]
        if unk is not None and tid == unk:
            word, is_subword = ref, False
        out.append({"word": word, "scores": scores[idx], "start": start, "end": end, "index": idx, "is_subword": is_subword})
    return out


def _aggregate_word(enc: Encoder, group: list[dict[str, Any]], how: str) -> dict[str, Any]:
    if how == "first":
        probs = group[0]["scores"]
    elif how == "max":
        probs = max(group, key=lambda e: float(e["scores"].max()))["scores"]
    else:
        probs = torch.stack([e["scores"] for e in group]).mean(0)
    idx = int(probs.argmax())
    return {
        "entity": label_name(enc, idx),
        "score": float(probs[idx]),
        "word": _tokens_to_string(enc, [e["word"] for e in group]),
        "start": group[0]["start"],
        "end": group[-1]["end"],
    }


def _tag(name: str) -> tuple[str, str]:
    if name.startswith("B-"):
        return "B", name[2:]
    if name.startswith("I-"):
        return "I", name[2:]
    return "I", name


def _group(enc: Encoder, entities: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: list[list[dict[str, Any]]] = []
    for e in entities:
        if groups:
            bi, tag = _tag(e["entity"])
            _, last_tag = _tag(groups[-1][-1]["entity"])
            if tag == last_tag and bi != "B":
                groups[-1].append(e)
                continue
        groups.append([e])
    out = []
    for g in groups:
        out.append(
            {
                "entity_group": g[0]["entity"].split("-", 1)[-1],
                "score": sum(e["score"] for e in g) / len(g),
                "word": _tokens_to_string(enc, [e["word"] for e in g]),
                "start": g[0]["start"],
                "end": g[-1]["end"],
            }
        )
    return out


def entities_of(enc: Encoder, text: str, encoded: Any, logits: torch.Tensor, aggregation: str, ignore: Sequence[str] = ("O",)) -> list[dict[str, Any]]:
    scores = torch.softmax(logits.float(), dim=-1)
    pre = pre_entities(enc, text, encoded, scores)
    if aggregation in ("none", "simple"):
        entities = []
        for p in pre:
            idx = int(p["scores"].argmax())
            entities.append(
                {"entity": label_name(enc, idx), "score": float(p["scores"][idx]), "index": p["index"], "word": p["word"], "start": p["start"], "end": p["end"]}
            )
    else:
        entities = []
        group: list[dict[str, Any]] = []
        for p in pre:
            if group and not p["is_subword"]:
                entities.append(_aggregate_word(enc, group, aggregation))
                group = []
            group.append(p)
        if group:
            entities.append(_aggregate_word(enc, group, aggregation))
    if aggregation != "none":
        entities = _group(enc, entities)
    return [e for e in entities if e.get("entity", e.get("entity_group")) not in ignore]


def recognize(
    enc: Encoder,
    texts: Sequence[str],
    *,
    aggregation: str = "simple",
    max_length: Optional[int] = None,
    batch_size: int = 8,
    warn: Optional[Callable[[str], None]] = None,
) -> list[list[dict[str, Any]]]:
    """The entities of each text (``aggregation`` one of :data:`AGGREGATIONS`)."""
    if aggregation not in AGGREGATIONS:
        raise UserError(f"unknown aggregation '{aggregation}' (known: {', '.join(AGGREGATIONS)})")
    encoded = encode_pairs(enc, texts, [None] * len(texts), max_length=max_length, warn=warn)
    return [entities_of(enc, t, e, lg, aggregation) for t, e, lg in zip(texts, encoded, head_logits(enc, encoded, batch_size))]
