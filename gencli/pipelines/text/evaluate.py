"""Language-model quality on held-out text: loss per token and bits per byte.

Each document is encoded as the model sees text at generation time (the tokenizer's BOS first) and
scored with a sliding window: windows of the model's context, advancing by ``stride`` tokens, each
token scored once with at least ``context - stride`` tokens of left context (except at the start of
a document). Bits per byte (total negative log-likelihood in bits / UTF-8 bytes) compares models
with different tokenizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.nn.functional as F


@dataclass
class LMScore:
    tokens: int = 0
    bytes: int = 0
    nll_nats: float = 0.0
    per_document: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def loss(self) -> float:
        """Mean negative log-likelihood per token (nats)."""
        return self.nll_nats / max(1, self.tokens)

    @property
    def bits_per_byte(self) -> float:
        return self.nll_nats / math.log(2) / max(1, self.bytes)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "loss": round(self.loss, 5),
            "perplexity": round(self.perplexity, 4),
            "bits_per_byte": round(self.bits_per_byte, 5),
            "documents": self.per_document,
        }


@torch.inference_mode()
def score_document(model, ids: list[int], stride: int, context: int, device) -> tuple[float, int]:
    """(sum of NLL in nats over ids[1:], number of scored tokens)."""
    if not 0 < stride < context:
        raise ValueError(f"stride must be in [1, context) (got {stride} with context {context})")
    total, scored = 0.0, 0
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)
    n = len(ids)
    start = 0
    while True:
        end = min(start + context, n)
        window = ids_t[start:end][None]
        logits = model(window)[0].float()
        # the previous window scored targets up to absolute start + context - stride - 1; the logit
        # at relative position context - stride - 1 predicts the first new one
        first = 0 if start == 0 else context - stride - 1
        targets = window[0, first + 1 :]
        if targets.numel():
            total += F.cross_entropy(logits[first : end - start - 1], targets, reduction="sum").item()
            scored += targets.numel()
        if end == n:
            break
        start += stride
    return total, scored


def evaluate_texts(tm, documents: Iterable[tuple[str, str]], *, stride: Optional[int] = None, max_tokens: Optional[int] = None) -> LMScore:
    """Score ``(name, text)`` documents with a loaded :class:`~gencli.pipelines.text.loading.TextModel`.

    ``max_tokens`` truncates each document (a quick, modest sample for tests)."""
    context = tm.context_length
    stride = stride or context // 2
    score = LMScore()
    for name, text in documents:
        ids = tm.tokenizer.encode(text, add_special_tokens=True)
        if max_tokens is not None and len(ids) > max_tokens:
            ids = ids[:max_tokens]
            text = tm.tokenizer.decode(ids)
        nll, n = score_document(tm.model, ids, stride, context, tm.placement.device)
        nbytes = len(text.encode("utf-8"))
        score.tokens += n
        score.bytes += nbytes
        score.nll_nats += nll
        score.per_document[name] = {"tokens": n, "loss": round(nll / max(1, n), 4), "bits_per_byte": round(nll / math.log(2) / max(1, nbytes), 4)}
    return score
