"""Sentence embeddings from a BERT-family encoder, as sentence-transformers computes them: the token
states pooled (mean over the real tokens, the first token, the element-wise max, or the mean times
sqrt(length)) and optionally L2-normalised."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from gencli.errors import UserError
from gencli.pipelines.encoders.loading import POOLING_MODES, Encoder, batches_by_length, collate
from gencli.pipelines.encoders.texts import encode_texts


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``(B, n, d)`` token states and their ``(B, n)`` mask -> ``(B, d)`` (in fp32)."""
    hidden = hidden.float()
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(m == 0, -1e9).max(dim=1).values
    total = (hidden * m).sum(dim=1)
    count = m.sum(dim=1).clamp(min=1e-9)
    if mode == "mean":
        return total / count
    if mode == "mean_sqrt_len":
        return total / count.sqrt()
    raise UserError(f"unknown pooling '{mode}' (known: {', '.join(POOLING_MODES)})")


def embed_texts(
    enc: Encoder,
    texts: Sequence[str],
    *,
    pooling: Optional[str] = None,
    normalize: Optional[bool] = None,
    max_length: Optional[int] = None,
    batch_size: int = 32,
    warn: Optional[Callable[[str], None]] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> torch.Tensor:
    """``(len(texts), hidden)`` float32 embeddings in input order. Pooling and normalisation default to
    the folder's sentence-transformers modules (mean, none for a plain encoder)."""
    mode = pooling or enc.layout.pooling
    if mode not in POOLING_MODES:
        raise UserError(f"unknown pooling '{mode}' (known: {', '.join(POOLING_MODES)})")
    norm = enc.layout.normalize if normalize is None else normalize
    if batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    encoded = encode_texts(enc, texts, max_length=max_length, warn=warn)
    out = torch.empty(len(texts), enc.config.hidden_size, dtype=torch.float32)
    device = enc.placement.device
    with torch.inference_mode():
        for batch in batches_by_length([len(e.ids) for e in encoded], batch_size):
            ids, mask, types = collate([encoded[i] for i in batch], enc.tokenizer.pad_id, device)
            hidden = enc.model.hidden_states(ids, mask, types)
            vecs = pool(hidden, mask, mode)
            if norm:
                vecs = torch.nn.functional.normalize(vecs, p=2, dim=1)
            out[torch.tensor(batch)] = vecs.cpu()
            if progress is not None:
                progress(len(batch))
    if not torch.isfinite(out).all():
        raise UserError("the embeddings are not finite (try --dtype float32)")
    return out


def similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two vectors."""
    return float(torch.dot(a, b) / max(float(a.norm() * b.norm()), math.ulp(1.0)))
