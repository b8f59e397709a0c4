"""Beam search, shared by ``gencli generate`` (causal LMs) and ``text2text`` (encoder-decoders).

transformers' vectorised beam search step for step: each step the top ``2 * num_beams`` continuations
of all beams of an input by accumulated log-probability (more when there are several end tokens);
those that end with an end token (or at the budget) become finished hypotheses scored
``sum(log p) / generated_length ** length_penalty``, the best ``num_beams`` of the others go on;
``early_stopping`` True / False / "never" with transformers' heuristics for when the running beams can
no longer beat the finished ones. The model side is three callbacks: the next logits of every beam,
the beams' new order (the caches follow it), and the logits processors.

Inputs may have budgets of their own (a causal LM's rows stop at its context): an input whose budget is
spent finishes all its candidates that step, as transformers does at ``max_length``, and takes no
further hypotheses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

NEG = -1.0e9  # transformers' "never chosen" score in beam search


@dataclass
class Hypothesis:
    """One returned sequence of an input: its new tokens, its length-normalised log-probability, and
    whether it ended with an end token ("stop") or at its budget ("length")."""

    tokens: list[int]
    score: float
    finish_reason: str


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """transformers' ``_gather_beams``: rows of dim 1 picked by ``index (B, n)``."""
    while index.dim() < t.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(t, index, dim=1)


@torch.inference_mode()
def beam_search(
    step: Callable[[Optional[torch.Tensor]], torch.Tensor],
    reorder: Callable[[torch.Tensor], None],
    process: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    *,
    batch: int,
    num_beams: int,
    budgets: Sequence[int],
    eos_ids: Sequence[int],
    pad_id: int,
    length_penalty: float = 1.0,
    early_stopping: Union[bool, str] = False,
    num_return_sequences: int = 1,
    sample: bool = False,
    generator: Optional[torch.Generator] = None,
    device: torch.device | str = "cpu",
) -> tuple[list[list[Hypothesis]], int]:
    """Beam search over ``batch`` inputs of ``num_beams`` beams each (the beams of input ``i`` are rows
    ``i * num_beams ...`` of every callback's tensors).

    - ``step(None)``: the logits ``(batch * num_beams, V)`` after each input's prompt (every beam of an
      input the same); ``step(tokens)``: the logits after feeding each beam its new token ``tokens (N,)``.
    - ``reorder(rows)``: after each step, beam ``j`` now extends the sequence of row ``rows[j]`` (``(N,)``,
      long): whatever the model caches follows.
    - ``process(log_probs, generated, g)``: the logits processors on ``log_probs (N, V)`` (fp32, changed
      in place or returned), ``generated (N, g)`` the beams' new tokens so far; with ``sample`` the
      sampling processors too (transformers' beam sampling: the candidates are drawn from the softmax of
      the beams' accumulated scores, without replacement, on the CPU from ``generator``, then ordered).

    ``budgets[i]``: the most new tokens of input ``i``. Returns ``num_return_sequences`` hypotheses per
    input, best first, and the number of steps run."""
    b, k = batch, num_beams
    eos = torch.tensor(list(eos_ids) or [-1], device=device)
    keep = max(2, 1 + len(eos_ids)) * k
    top_mask = torch.cat((torch.ones(k, dtype=torch.bool), torch.zeros(keep - k, dtype=torch.bool))).to(device)
    most = max(budgets)
    budget = torch.tensor(list(budgets), device=device).view(b, 1)
    lp, early = length_penalty, early_stopping
    running = torch.full((b, k, most), pad_id, dtype=torch.long, device=device)
    sequences = running.clone()
    running_scores = torch.zeros((b, k), dtype=torch.float, device=device)
    running_scores[:, 1:] = NEG  # every beam of an input starts the same: the first step extends one
    beam_scores = torch.full((b, k), NEG, dtype=torch.float, device=device)
    finished = torch.zeros((b, k), dtype=torch.bool, device=device)
    improvable = torch.ones((b, 1), dtype=torch.bool, device=device)
    running_idx = torch.full((b, k, most), -1, dtype=torch.int32, device=device)
    beam_idx = running_idx.clone()
    offset = torch.arange(b, device=device).view(-1, 1) * k
    g = 0  # new tokens so far
    feed: Optional[torch.Tensor] = None
    while True:
        log_probs = torch.nn.functional.log_softmax(step(feed).float(), dim=-1)
        log_probs = process(log_probs, running[:, :, :g].reshape(b * k, g), g)
        vocab = log_probs.shape[-1]
        log_probs = (log_probs.view(b, k, vocab) + running_scores[:, :, None]).reshape(b, k * vocab)
        # the top continuations of all beams (or drawn from them)
        if sample:
            top_i = _draw(log_probs, keep, generator).to(log_probs.device)
            top_lp, order = torch.gather(log_probs, 1, top_i).sort(dim=-1, descending=True)  # the best drawn first
            top_i = top_i.gather(1, order)
        else:
            top_lp, top_i = torch.topk(log_probs, k=keep)
        from_beam = top_i // vocab
        top_running_idx = _gather(running_idx, from_beam)
        top_seqs = _gather(running, from_beam)
        top_ids = top_i % vocab
        top_seqs[:, :, g] = top_ids
        top_running_idx[:, :, g] = (from_beam + offset).to(torch.int32)
        hits = torch.isin(top_ids, eos) | (g + 1 >= budget)
        # the beams that go on
        go_on = top_lp + hits.to(torch.float32) * NEG
        nxt = torch.topk(go_on, k=k)[1]
        running, running_scores, running_idx = _gather(top_seqs, nxt), _gather(go_on, nxt), _gather(top_running_idx, nxt)
        # the hypotheses that end here
        just_finished = hits & top_mask[None, :]
        scored = top_lp / ((g + 1) ** lp)
        scored = scored + (torch.all(finished, dim=-1, keepdim=True) & (early is True)).to(torch.float32) * NEG
        scored = scored + (~improvable).to(torch.float32) * NEG
        scored = scored + (~just_finished) * NEG
        merged_scores = torch.cat((beam_scores, scored), dim=1)
        best = torch.topk(merged_scores, k=k)[1]
        sequences = _gather(torch.cat((sequences, top_seqs), dim=1), best)
        beam_scores = _gather(merged_scores, best)
        beam_idx = _gather(torch.cat((beam_idx, top_running_idx), dim=1), best)
        finished = _gather(torch.cat((finished, just_finished), dim=1), best)
        reorder(running_idx[..., g].reshape(-1).long())
        g += 1
        # can the running beams still beat the finished ones (transformers' heuristic)?
        best_len = budget if (early == "never" and lp > 0.0) else torch.full_like(budget, g)
        best_running = running_scores[:, :1] / (best_len**lp)
        worst_finished = torch.where(finished, torch.min(beam_scores, dim=1, keepdim=True)[0], -1.0e9)
        improvable = improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True) & (g < budget)
        open_beams = not (bool(torch.all(finished)) and early is True)
        if not (bool(torch.any(improvable)) and open_beams and not bool(torch.all(hits))):
            break
        feed = running[:, :, g - 1].reshape(b * k)
    out: list[list[Hypothesis]] = []
    seqs_host, idx_host, scores_host = sequences.tolist(), beam_idx.tolist(), beam_scores.tolist()
    ends = set(eos_ids)
    for i in range(b):
        hyps = []
        for r in range(num_return_sequences):
            n = sum(1 for v in idx_host[i][r] if v != -1)
            tokens = seqs_host[i][r][:n]
            hyps.append(Hypothesis(tokens, scores_host[i][r], "stop" if tokens and tokens[-1] in ends else "length"))
        out.append(hyps)
    return out, g


def _draw(scores: torch.Tensor, n: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``n`` indices a row drawn without replacement from ``softmax(scores)`` (torch.multinomial's draws, on
    the CPU). A row with fewer than ``n`` possible continuations (the sampling processors left few) takes
    impossible ones after them (their scores -inf: never a running beam while a possible one is left)."""
    probs = torch.softmax(scores.float().cpu(), dim=-1)
    probs = probs.masked_fill(probs == 0, 1e-30)
    return torch.multinomial(probs, n, replacement=False, generator=generator)


def banned_ngrams(seqs: list[list[int]], n: int) -> list[list[int]]:
    """transformers' NoRepeatNGramLogitsProcessor: the tokens that would repeat an n-gram of each row."""
    out = []
    for toks in seqs:
        cur = len(toks)
        if cur + 1 < n:
            out.append([])
            continue
        grams: dict[tuple[int, ...], list[int]] = {}
        for gram in zip(*[toks[i:] for i in range(n)]):
            grams.setdefault(tuple(gram[:-1]), []).append(gram[-1])
        out.append(grams.get(tuple(toks[cur + 1 - n : cur]), []))
    return out


def ban_ngrams(scores: torch.Tensor, seqs: list[list[int]], n: int) -> torch.Tensor:
    """``scores (N, V)`` with the tokens that would repeat an n-gram of ``seqs[row]`` at -inf (in place)."""
    if n > 0:
        for row, banned in enumerate(banned_ngrams(seqs, n)):
            if banned:
                scores[row, banned] = float("-inf")
    return scores


__all__ = ["Hypothesis", "NEG", "ban_ngrams", "banned_ngrams", "beam_search"]
