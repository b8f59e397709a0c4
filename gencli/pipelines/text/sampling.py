"""Choosing the next token from logits: repetition penalty, temperature, top-k, top-p, min-p.

The processors follow transformers' definitions and order (repetition penalty on the raw logits,
then temperature, top-k, top-p, min-p), so a checkpoint's ``generation_config.json`` means the same
here as there. Temperature 0 is greedy decoding. Sampling draws one uniform number a row and step from
a seeded CPU generator (:mod:`gencli.backend.random`), so a seed gives the same tokens on every device,
over the candidates the processors leave (:func:`candidates`), not the whole vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


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


def top_k_filter(logits: torch.Tensor, k: int, min_keep: int = 1) -> torch.Tensor:
    if k <= 0:
        return logits
    k = max(k, min_keep)
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float, min_keep: int = 1) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability reaches ``p``
    (transformers' rule: the token that crosses the threshold is kept; at least ``min_keep`` tokens stay)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - p)
    remove_sorted[..., -min_keep:] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float, min_keep: int = 1) -> torch.Tensor:
    """Keep tokens whose probability is at least ``min_p`` times the top token's (and the ``min_keep`` most likely)."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    remove = probs < threshold
    if min_keep > 1:
        top = torch.topk(logits, min(min_keep, logits.shape[-1]), dim=-1).indices
        remove.scatter_(-1, top, False)
    return logits.masked_fill(remove, float("-inf"))


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Raw next-token logits ``(B, V)`` -> the processed logits sampling draws from (fp32)."""
    logits = logits.float()
    if seen is not None and params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    return warp(logits, params)


def warp(scores: torch.Tensor, params: SamplingParams, min_keep: int = 1) -> torch.Tensor:
    """The sampling processors (transformers' warpers) on ``scores (B, V)`` (logits, or log-probabilities in
    beam sampling): temperature, top-k, top-p, min-p, each keeping at least ``min_keep`` tokens; none when greedy."""
    if params.greedy:
        return scores
    if params.temperature != 1.0:
        scores = scores / params.temperature
    scores = top_k_filter(scores, params.top_k, min_keep)
    scores = top_p_filter(scores, params.top_p, min_keep)
    return min_p_filter(scores, params.min_p, min_keep)


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator], seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The next token of each row, ``(B,)``. Logits on the CPU are chosen from natively where this process
    has the CPU kernels (:func:`native_sampler`): the same choices, a few microseconds instead of hundreds."""
    penalized = seen is not None and params.repetition_penalty != 1.0
    if params.greedy and not penalized:
        return logits.argmax(dim=-1)
    native = native_sampler(logits)
    if native is not None:
        u = torch.empty(0, dtype=torch.float64) if params.greedy else torch.rand((logits.shape[0],), generator=generator, dtype=torch.float64)
        return native.sample_tokens(logits, *native_settings(params), u, seen if penalized else None)
    if params.greedy:
        return process_logits(logits, params, seen).argmax(dim=-1)
    probs, ids = candidates(logits, params, seen)
    return draw(probs, ids, generator).to(logits.device)


def native_settings(params: SamplingParams) -> tuple[float, int, float, float, float]:
    """``params`` as the native sampler takes them: ``(temperature, top_k, top_p, min_p, repetition_penalty)``."""
    return (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty)


def native_sampler(logits: torch.Tensor) -> Optional[object]:
    """The CPU kernels' sampler (``csrc/sampling.cpp``: :func:`candidates` and :func:`draw` natively, the same
    tokens up to float rounding) for logits ``(B, V)`` on the CPU, where this process has built or loaded
    the kernels already (never a build just for this); else None."""
    return loaded_native_sampler() if logits.device.type == "cpu" and logits.dim() == 2 else None


def loaded_native_sampler() -> Optional[object]:
    """The CPU kernels (their ``sample_tokens``), where this process has built or loaded them; else None."""
    from gencli.backend.quant_kernels import loaded_kernels

    kernels = loaded_kernels()
    return kernels if kernels is not None and hasattr(kernels, "sample_tokens") else None


# a nucleus (top-p) or min-p without top-k is looked for among this many of the most likely tokens first
# (the whole vocabulary sorted only where they do not hold it)
NUCLEUS_SEARCH = 1024


def candidates(logits: torch.Tensor, params: SamplingParams, seen: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The distribution sampling draws from, as :func:`process_logits` followed by a softmax defines it,
    over the tokens it can choose only: ``(probs (B, K) float32 on the CPU, their token ids (B, K), or
    None where K is the whole vocabulary in order)``; tokens of another row's support have probability 0.

    Sorting the vocabulary (top-p's rule) and drawing one exponential a token (torch.multinomial) cost
    milliseconds a token for vocabularies of 50-130 k entries; here top-k's survivors (every logit equal
    to the k-th stays, as in transformers) are the candidates, and a nucleus or min-p without top-k is
    looked for among the :data:`NUCLEUS_SEARCH` most likely tokens, normalised over the whole vocabulary.
    """
    x = logits.float()
    if seen is not None and params.repetition_penalty != 1.0:
        x = apply_repetition_penalty(x, seen, params.repetition_penalty)
    if params.temperature != 1.0:
        x = x / params.temperature
    v = x.shape[-1]
    nucleus, min_p = params.top_p < 1.0, params.min_p > 0.0
    if 0 < params.top_k < v:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        k = int((x >= kth).sum(-1).max())  # (ties with the k-th value stay)
        vals, ids = torch.topk(x, k, dim=-1)
        vals = vals.masked_fill(vals < kth, float("-inf"))
        total = torch.logsumexp(vals, -1, keepdim=True)
    elif nucleus or min_p:
        total = torch.logsumexp(x, -1, keepdim=True)
        vals, ids = torch.topk(x, min(v, NUCLEUS_SEARCH), dim=-1)
        if vals.shape[-1] < v:
            probs = (vals - total).exp()
            held = torch.ones_like(total, dtype=torch.bool).squeeze(-1)
            if nucleus:  # the nucleus ends inside the candidates
                held &= probs.sum(-1) >= params.top_p
            if min_p:  # every token past them is below min-p's threshold
                held &= probs[..., -1] < probs[..., 0] * params.min_p
            if not bool(held.all()):
                vals, ids = torch.topk(x, v, dim=-1)
    else:
        return x.softmax(-1).cpu(), None  # plain temperature sampling: every token a candidate
    if nucleus:  # keep a token while the tokens more likely than it hold less than top_p (the first always)
        probs = (vals - total).exp()
        before = probs.cumsum(-1) - probs
        dropped = before >= params.top_p
        dropped[..., 0] = False  # (top_p 0, which a generation config may hold: the top token alone, as transformers keeps it)
        vals = vals.masked_fill(dropped, float("-inf"))
    if min_p:
        vals = vals.masked_fill(vals - vals[..., :1] < math.log(params.min_p), float("-inf"))
    return vals.softmax(-1).cpu(), ids.cpu()


def draw(probs: torch.Tensor, ids: Optional[torch.Tensor], generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token a row from ``probs (B, K)`` over the token ids ``ids (B, K)`` (None: the vocabulary in
    order): one uniform number a row from the CPU generator, the first candidate whose cumulative
    probability passes it (candidates of probability 0 are never chosen)."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64) * cdf[..., -1:]
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).long().argmax(-1, keepdim=True)  # (u rounding up to the total)
    pick = torch.minimum((cdf <= u).sum(-1, keepdim=True), last)
    return (pick if ids is None else ids.gather(-1, pick)).squeeze(-1)
