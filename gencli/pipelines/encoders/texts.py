"""Tokenizing a list of input texts for an encoder: empty texts refused, truncation reported."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from gencli.errors import UserError
from gencli.pipelines.encoders.loading import Encoder
from gencli.tokenizers.wordpiece import Encoded


def encode_texts(
    enc: Encoder, texts: Sequence[str], *, max_length: Optional[int] = None, warn: Optional[Callable[[str], None]] = None, what: str = "text"
) -> list[Encoded]:
    """Each text tokenized with the special tokens, at most ``max_length`` tokens (default: the model's
    window); an empty text is a one-line UserError; truncation is reported through ``warn`` with the
    number of texts and tokens cut."""
    if not texts:
        raise UserError(f"no {what} given")
    for i, t in enumerate(texts):
        if not t.strip():
            raise UserError(f"{what} {i + 1} is empty")
    window = enc.max_length
    if max_length is not None:
        if max_length < 1:
            raise UserError("--max-length must be at least 1")
        window = min(max_length, enc.config.max_positions)
    out = [enc.tokenizer.encode(t, max_length=window) for t in texts]
    cut = [e.cut for e in out if e.cut]
    if cut and warn is not None:
        which = "1 text was" if len(cut) == 1 else f"{len(cut)} texts were"
        warn(f"{which} longer than the {window}-token window and truncated: {sum(cut)} token(s) cut")
    return out
