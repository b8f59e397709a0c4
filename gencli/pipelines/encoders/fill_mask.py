"""Fill-mask with a BERT-family masked-language model: the top-k tokens for each mask, scored and
spelled as transformers' fill-mask pipeline gives them ({"score", "token", "token_str", "sequence"})."""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import torch

from gencli.errors import UserError
from gencli.pipelines.encoders.loading import Encoder, batches_by_length, collate
from gencli.pipelines.encoders.texts import encode_texts


def with_model_mask(enc: Encoder, text: str) -> str:
    """``text`` with ``[MASK]`` written as the model's own mask token (``<mask>`` for RoBERTa)."""
    mask = enc.tokenizer.mask_token
    if mask and mask != "[MASK]":
        text = text.replace("[MASK]", mask)
    return text


def fill_mask(
    enc: Encoder,
    texts: Sequence[str],
    *,
    top_k: int = 5,
    max_length: Optional[int] = None,
    batch_size: int = 8,
    warn: Optional[Callable[[str], None]] = None,
) -> list[list[list[dict[str, Any]]]]:
    """For each text, one list of predictions per mask token (in text order), each
    ``{"score", "token", "token_str", "sequence"}``, best first."""
    tok = enc.tokenizer
    mask_id = tok.mask_id
    if mask_id is None:
        raise UserError(f"the tokenizer of '{enc.path}' has no mask token")
    if top_k < 1:
        raise UserError("-k must be at least 1")
    top_k = min(top_k, enc.config.vocab_size)
    texts = [with_model_mask(enc, t) for t in texts]
    for i, t in enumerate(texts):
        if t.strip() and tok.mask_token not in t:
            shown = "[MASK]" if tok.mask_token == "[MASK]" else f"[MASK] or {tok.mask_token}"
            raise UserError(f"text {i + 1} has no mask token: write {shown} where the word to predict goes")
    truncated: list[str] = []  # (said after the masks are found: a text that lost its mask is an error alone)
    encoded = encode_texts(enc, texts, max_length=max_length, warn=truncated.append)
    for i, e in enumerate(encoded):
        if mask_id not in e.ids:
            most = enc.config.max_positions
            window = enc.max_length if max_length is None else min(max_length, most)
            hint = "shorten it or raise --max-length" if window < most else f"shorten it (the model reads at most {most} tokens)"
            raise UserError(f"text {i + 1} lost its mask token to truncation at {window} tokens: {hint}")
    for message in truncated if warn is not None else ():
        warn(message)
    results: list[Any] = [None] * len(texts)
    pad = tok.pad_id
    with torch.inference_mode():
        for batch in batches_by_length([len(e.ids) for e in encoded], batch_size):
            ids, mask, types = collate([encoded[i] for i in batch], pad, enc.placement.device)
            # the vocabulary projection only where the masks are (the other positions' logits are never read)
            hidden = enc.model.hidden_states(ids, mask, types)
            rows, cols = (ids == mask_id).nonzero(as_tuple=True)
            probs = enc.model.head_output(hidden[rows, cols]).float().softmax(dim=-1)
            values_all, predictions_all = (t.cpu() for t in probs.topk(top_k))
            first = 0
            for i in batch:
                seq = encoded[i].ids
                positions = [p for p, t in enumerate(seq) if t == mask_id]
                values, predictions = values_all[first : first + len(positions)], predictions_all[first : first + len(positions)]
                first += len(positions)
                single = len(positions) == 1
                per_mask = []
                for m, pos in enumerate(positions):
                    preds = []
                    for v, p in zip(values[m].tolist(), predictions[m].tolist()):
                        filled = list(seq)
                        filled[pos] = p
                        filled = [t for t in filled if t != pad]
                        preds.append(
                            {
                                "score": v,
                                "token": p,
                                "token_str": tok.decode([p], skip_special_tokens=False),
                                "sequence": tok.decode(filled, skip_special_tokens=single),
                            }
                        )
                    per_mask.append(preds)
                results[i] = per_mask
    return results


def mask_count(text: str, mask_token: str) -> int:
    return len(re.findall(re.escape(mask_token), text))
