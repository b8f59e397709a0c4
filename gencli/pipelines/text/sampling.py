"""Choosing the next token from logits: repetition penalty, temperature, top-k, top-p, min-p.

The processors follow transformers' definitions and order (repetition penalty on the raw logits,
then temperature, top-k, top-p, min-p), so a checkpoint's ``generation_config.json`` means the same
here as there. Temperature 0 is greedy decoding. Random draws come from a seeded CPU generator
(:mod:`gencli.backend.random`), so a seed gives the same tokens on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gencli.backend.random import multinomial


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al. 2019) as transformers applies it: every token already in ``seen
    (B, n)`` has its logit divided by ``penalty`` when positive, multiplied when negative."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    scores = logits.gather(1, seen)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(1, seen, scores)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability reaches ``p``
    (transformers' rule: the token that crosses the threshold is kept; at least one token stays)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is at least ``min_p`` times the top token's."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Raw next-token logits ``(B, V)`` -> the processed logits sampling draws from (fp32)."""
    logits = logits.float()
    if seen is not None and params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits
    if params.temperature != 1.0:
        logits = logits / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return min_p_filter(logits, params.min_p)


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator], seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The next token of each row, ``(B,)``."""
    processed = process_logits(logits, params, seen)
    if params.greedy:
        return processed.argmax(dim=-1)
    return multinomial(processed.softmax(dim=-1), generator).squeeze(-1)
