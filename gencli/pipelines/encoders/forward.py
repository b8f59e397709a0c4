"""Running an encoder's head over many tokenized inputs: batches of similar length, one logits tensor
per input (float32, on the CPU, padding removed), in input order."""

from __future__ import annotations

from typing import Sequence

import torch

from gencli.pipelines.encoders.loading import Encoder, batches_by_length, collate
from gencli.tokenizers.wordpiece import Encoded


def head_logits(enc: Encoder, encoded: Sequence[Encoded], batch_size: int = 8) -> list[torch.Tensor]:
    """The head's output for each input: ``(labels,)`` for a sequence classifier, ``(n, labels)`` for a
    token classifier, ``(n, 2)`` for question answering (``n`` = that input's own token count)."""
    if batch_size < 1:
        from gencli.errors import UserError

        raise UserError("--batch-size must be at least 1")
    out: list[torch.Tensor] = [torch.empty(0)] * len(encoded)
    per_token = enc.model.head != "sequence_classification"
    with torch.inference_mode():
        for batch in batches_by_length([len(e.ids) for e in encoded], batch_size):
            ids, mask, types = collate([encoded[i] for i in batch], enc.tokenizer.pad_id, enc.placement.device)
            logits = enc.model(ids, mask, types).float().cpu()
            for row, i in enumerate(batch):
                out[i] = logits[row, : len(encoded[i].ids)] if per_token else logits[row]
    return out
