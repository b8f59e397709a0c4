"""Beam search for causal LMs (``gencli generate --num-beams K``).

The prompts are prefilled once, as the left-padded batch greedy decoding uses; each prompt's cache is
then copied to its ``K`` beams, and :func:`gencli.pipelines.text.beam_search.beam_search` runs the
steps: every beam's next logits from the fused CPU step where it applies (else the model's layers
and head), the cache rows following the beams they extend. The logits processors are transformers'
for beam search, on the log-probabilities: the repetition penalty and the n-gram ban, over the prompt
and the beam's tokens. A prompt's budget of new tokens stops at the model's context, as in greedy
decoding.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from gencli.errors import UserError
from gencli.pipelines.text.beam_search import ban_ngrams, beam_search
from gencli.pipelines.text.generate import Completion, GenerationSettings, PromptBatch, timing_of
from gencli.pipelines.text.loading import TextModel
from gencli.pipelines.text.sampling import apply_repetition_penalty, warp
from gencli.tokenizers.stream import IncrementalDetokenizer


@torch.inference_mode()
def generate_beams(
    tm: TextModel, prompts: Sequence[tuple[str, list[int]]], settings: GenerationSettings, generator: Optional[torch.Generator] = None
) -> list[Completion]:
    """Beam search for ``prompts`` (``(text, ids)`` pairs) as one batch: ``num_return_sequences``
    completions per prompt, best first, in prompt order (each with its ``index`` and ``score``); beam
    sampling from ``generator`` where the settings sample."""
    model, device = tm.model, tm.placement.device
    b, k = len(prompts), settings.num_beams
    budgets = [min(settings.max_new_tokens, tm.context_length - len(ids)) for _, ids in prompts]
    longest = max(len(ids) for _, ids in prompts)
    check_room(tm, b, k, longest + max(budgets), "--num-beams", copied=longest)
    batch = PromptBatch.build(prompts, tm.pad_id, longest + max(budgets), device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    t0 = time.perf_counter()
    prompt_cache = model.new_cache(b, longest)
    hidden = model.hidden_states(batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask, kv_cache=prompt_cache,
                                 logits_to_keep=1)[:, -1]  # fmt: skip
    first = model.lm_head(hidden).repeat_interleave(k, dim=0)
    cache = model.new_cache(b * k, longest + max(budgets))  # each prompt's keys and values, once a beam
    for mine, theirs in ((cache.keys, prompt_cache.keys), (cache.values, prompt_cache.values)):
        mine.narrow(3, 0, longest).copy_(theirs.repeat_interleave(k, dim=1))
    for layer in cache.layers:
        layer.length = longest
    del prompt_cache
    sync()
    t_prefill = time.perf_counter() - t0

    mask = batch.attention_mask.repeat_interleave(k, dim=0) if batch.padded else None
    next_pos = batch.next_pos.repeat_interleave(k, dim=0).view(-1, 1) if batch.padded else None
    taken = [0]  # the steps fed so far

    def step(tokens: Optional[torch.Tensor]) -> torch.Tensor:
        if tokens is None:
            return first
        ids = tokens.view(-1, 1)
        pos = (next_pos + taken[0]).clamp_(max=tm.context_length - 1) if next_pos is not None else None  # beams past their budget stay in the table
        taken[0] += 1
        done = model.fused_logits(ids, position_ids=pos, attention_mask=mask, kv_cache=cache)
        if done is not None:
            return done[0]
        return model.lm_head(model.hidden_states(ids, position_ids=pos, attention_mask=mask, kv_cache=cache)[:, -1])

    params = settings.sampling
    eos_ids = [] if settings.ignore_eos else sorted(set(tm.eos_ids))
    prompt_rows = [ids for _, ids in prompts for _ in range(k)]
    seen = batch.seen_tokens(prompts, longest).repeat_interleave(k, dim=0) if params.repetition_penalty != 1.0 else None

    def process(log_probs: torch.Tensor, generated: torch.Tensor, g: int) -> torch.Tensor:
        if g < settings.min_new_tokens and eos_ids:
            log_probs[:, eos_ids] = float("-inf")
        if seen is not None:
            log_probs = apply_repetition_penalty(log_probs, torch.cat((seen, generated), dim=1), params.repetition_penalty)
        if settings.no_repeat_ngram_size:
            ban_ngrams(log_probs, [p + gen for p, gen in zip(prompt_rows, generated.tolist())], settings.no_repeat_ngram_size)
        return warp(log_probs, params, max(2, len(eos_ids) + 1))

    t1 = time.perf_counter()
    found, steps = beam_search(
        step, cache.reorder_rows, process, batch=b, num_beams=k, budgets=budgets, eos_ids=eos_ids, pad_id=tm.pad_id,
        length_penalty=settings.length_penalty, early_stopping=settings.early_stopping, num_return_sequences=settings.num_return_sequences, device=device,
        sample=not params.greedy, generator=generator,
    )  # fmt: skip
    sync()
    timing = timing_of(tm, sum(batch.lengths), b * k, t_prefill, time.perf_counter() - t1, steps)
    timing["num_beams"] = k
    completions = []
    many = settings.num_return_sequences > 1
    for (text, ids), hyps, budget in zip(prompts, found, budgets):
        for r, h in enumerate(hyps):
            detok = IncrementalDetokenizer(tm.tokenizer, ids)
            words = [detok.add(t) for t in h.tokens if t not in eos_ids] + [detok.flush()]
            c = Completion(text, list(ids), "".join(words), h.tokens, h.finish_reason, timing=dict(timing), index=r if many else None, score=h.score)
            c.hit_context = h.finish_reason == "length" and budget < settings.max_new_tokens and len(h.tokens) >= budget
            completions.append(c)
    return completions


def check_room(tm: TextModel, prompts: int, per_prompt: int, positions: int, flag: str, copied: int = 0) -> None:
    """``prompts x per_prompt`` sequences (beams, or sampled copies of each prompt) of up to ``positions``
    positions: their KV cache (and a copy of its first ``copied`` positions: the prompts' cache given to the
    beams) and their scores must fit the device's free memory, else one error line naming ``flag`` (not an
    internal error for a size past int64, nor the process killed for memory)."""
    from gencli.pipelines.seq2seq.generate import free_memory_bytes

    model = tm.model
    rows = prompts * per_prompt  # (Python ints: no overflow)
    ref = model.get_input_embeddings().weight
    cache = 2 * model.num_layers * rows * model.num_kv_heads * model.head_dim * (positions + copied) * ref.element_size()
    scores = 6 * rows * model.vocab_size * 4 + 6 * rows * positions * 8  # the step's fp32 scores and copies, beam search's rows of tokens
    need = cache + scores
    free = free_memory_bytes(ref.device)
    if free is not None and need > free:
        raise UserError(
            f"{flag} {per_prompt} makes {rows} sequence(s) of {prompts} prompt(s) of up to {positions} positions, which need {need / 2**30:.3g} GiB "
            f"(KV cache and scores), more than the {free / 2**30:.3g} GiB free: lower {flag}, --max-new-tokens or --batch-size"
        )


__all__ = ["check_room", "generate_beams"]
