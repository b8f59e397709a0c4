"""Extractive question answering with a BERT-family span head, the span transformers 4.x's
question-answering pipeline picks.

The question and the context are tokenized as a pair (question first) in windows of at most
``max_length`` tokens that overlap by ``stride`` tokens when the context is longer than one window
(the context alone is cut, as ``truncation="only_second"`` cuts it). In each window the start and end
logits are softmaxed over the context tokens and the first token ([CLS]) only (the question, the other
special tokens and the padding masked); [CLS] is then excluded; the score of a span is
``p_start x p_end`` over ``start <= end < start + max_answer_length``. The best ``top_k`` spans of all
windows are kept, best first; each is widened to whole words (``align_to_words``) and cut from the
context by character offsets.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gencli.errors import UserError
from gencli.pipelines.encoders.loading import Encoder, collate
from gencli.tokenizers.wordpiece import Encoded


def windows(enc: Encoder, question: str, context: str, max_length: int, stride: Optional[int]) -> list[Any]:
    """The tokenizers ``Encoding`` of each window (question + a stretch of the context). ``stride``
    None: half a window, at most 128 tokens, and less than the context tokens a window holds."""
    tk = enc.tokenizer.tk
    n_question = len(tk.encode(question, add_special_tokens=False).ids)
    room = max_length - n_question - tk.num_special_tokens_to_add(True)
    if room < 1:
        raise UserError(f"the question takes {n_question} tokens: no room left for the context in a {max_length}-token window")
    if stride is None:  # the default must fit whatever room the question leaves: never an error about a --stride not given
        stride = min(max_length // 2, 128)
        if stride >= room:
            stride = room // 2
    if stride >= room:
        raise UserError(f"--stride {stride} must be less than the {room} context tokens a window holds (lower --stride or raise --max-length)")
    tk.enable_truncation(max_length, stride=stride, strategy="only_second")
    try:
        first = tk.encode(question, context)
    finally:
        tk.no_truncation()
    return [first] + list(first.overflowing)


def _span_scores(start: torch.Tensor, end: torch.Tensor, allowed: torch.Tensor, max_answer_len: int) -> torch.Tensor:
    """The ``(n, n)`` matrix of p_start x p_end, zero outside ``start <= end < start + max_answer_len``."""
    neg = torch.tensor(-10000.0, dtype=torch.float64)
    s = torch.where(allowed, start.double(), neg)
    e = torch.where(allowed, end.double(), neg)
    s = torch.exp(s - s.max())
    s = s / s.sum()
    e = torch.exp(e - e.max())
    e = e / e.sum()
    s[0] = 0.0
    e[0] = 0.0
    outer = s[:, None] * e[None, :]
    return torch.tril(torch.triu(outer), max_answer_len - 1)


def _word_span(w: Any, s: int, e: int) -> tuple[int, int]:
    """Character offsets of tokens ``s``..``e`` widened to whole words of the context."""
    try:
        ws, we = w.token_to_word(s), w.token_to_word(e)
        if ws is None or we is None:
            raise ValueError
        return w.word_to_chars(ws, 1)[0], w.word_to_chars(we, 1)[1]
    except Exception:
        return w.offsets[s][0], w.offsets[e][1]


def answer(
    enc: Encoder,
    question: str,
    context: str,
    *,
    top_k: int = 1,
    max_answer_length: int = 15,
    max_length: Optional[int] = None,
    stride: Optional[int] = None,
    align_to_words: bool = True,
) -> list[dict[str, Any]]:
    """The best ``top_k`` answers to ``question`` in ``context``: ``{"answer", "score", "start", "end"}``."""
    if not question.strip():
        raise UserError("the question is empty")
    if not context.strip():
        raise UserError("the context is empty")
    if top_k < 1:
        raise UserError("-k must be at least 1")
    if max_answer_length < 1:
        raise UserError("--max-answer-length must be at least 1")
    window = min(enc.max_length, 384) if max_length is None else min(max_length, enc.config.max_positions)
    if stride is not None and stride < 0:
        raise UserError("--stride must be at least 0")
    ws = windows(enc, question, context, window, stride)
    cls_id = enc.tokenizer.token_to_id(enc.tokenizer.cls_token)
    encoded = [
        Encoded(list(w.ids), list(w.type_ids), [tuple(o) for o in w.offsets], list(w.special_tokens_mask), list(w.tokens), list(w.sequence_ids), 0)
        for w in ws
    ]
    ids, mask, types = collate(encoded, enc.tokenizer.pad_id, enc.placement.device)
    with torch.inference_mode():
        logits = enc.model(ids, mask, types).float().cpu()
    answers = []
    for row, w in enumerate(ws):
        n = len(w.ids)
        allowed = torch.tensor([sid == 1 or (cls_id is not None and tid == cls_id) for sid, tid in zip(w.sequence_ids, w.ids)])
        spans = _span_scores(logits[row, :n, 0], logits[row, :n, 1], allowed, max_answer_length)
        flat = spans.flatten()
        k = min(top_k, flat.numel())
        values, order = flat.topk(k) if k > 1 else flat.max(0, keepdim=True)
        # transformers' check: both ends in the unmasked tokens (where index 0 always passes)
        ok = {0} | {i for i in range(n) if bool(allowed[i])}
        for v, pos in zip(values.tolist(), order.tolist()):
            s, e = divmod(pos, n)
            if v <= 0.0 or not s <= e < s + max_answer_length:  # outside the span triangle: not an answer (end before start)
                continue
            if s not in ok or e not in ok:
                continue
            start, end = _word_span(w, s, e) if align_to_words else (w.offsets[s][0], w.offsets[e][1])
            answers.append({"answer": context[start:end], "score": v, "start": start, "end": end})
    answers.sort(key=lambda a: -a["score"])
    return answers[:top_k]
