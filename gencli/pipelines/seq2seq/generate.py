"""Text-to-text generation from a loaded :class:`~gencli.pipelines.seq2seq.loading.Seq2SeqModel`.

One decoding loop for T5, Marian and BART. A batch of sources is right-padded and encoded once; the
cross-attention keys/values of every decoder layer are projected once from the encoder output; the
decoder then runs one token per step through a preallocated self-attention KV cache.

- greedy and sampling (temperature, top-k, top-p, min-p, repetition penalty: the processors of
  :mod:`gencli.pipelines.text.sampling`, the same as ``gencli generate``'s); a row that has ended
  keeps receiving the pad token, as in transformers;
- beam search (``num_beams`` > 1) is transformers' vectorised beam search step for step: the top
  ``2 * num_beams`` continuations of all beams by accumulated log-probability, finished hypotheses
  scored ``sum(log p) / generated_length ** length_penalty``, ``early_stopping`` True / False /
  "never" with the same heuristics, ``num_return_sequences`` best hypotheses returned; the cache
  rows follow the beams they extend.

The logits processors run in transformers' order on the raw logits (greedy, sampling) or on the
log-probabilities (beam search): repetition penalty, ``no_repeat_ngram_size``, suppressed tokens
(single-token ``bad_words_ids``), ``min_new_tokens`` (and ``min_length``), the forced first token
(``forced_bos_token_id``), the forced end token on the last step (``forced_eos_token_id``), then
temperature, top-k, top-p. The masks commute with the
sampling processors, so they are applied first here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from gencli.backend.packed_linear import PackedLinear
from gencli.errors import UserError
from gencli.pipelines.seq2seq.loading import Seq2SeqModel
from gencli.pipelines.text.beam_search import ban_ngrams, banned_ngrams, beam_search
from gencli.pipelines.text.flags import check_decoding_flags, check_min_new_tokens, check_returns
from gencli.pipelines.text.sampling import SamplingParams, apply_repetition_penalty, next_tokens, warp
from gencli.tokenizers.stream import IncrementalDetokenizer

DEFAULT_MAX_NEW_TOKENS = 256
# greedy steps choose their token by the exact screened argmax of the LM head (see
# gencli.backend.screened_argmax) once the head is large and the budget long enough to repay the copy
SCREEN_MIN_HEAD_BYTES = 32 * 2**20
SCREEN_MIN_STEPS = 32


@dataclass
class Seq2SeqSettings:
    max_new_tokens: int
    sampling: SamplingParams
    min_new_tokens: int = 0
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    no_repeat_ngram_size: int = 0
    forced_eos_ids: list[int] = field(default_factory=list)
    forced_bos_id: Optional[int] = None  # the first new token (BART's forced_bos_token_id)
    suppressed_ids: list[int] = field(default_factory=list)
    seed: Optional[int] = None

    @property
    def beam_search(self) -> bool:
        return self.num_beams > 1


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def resolve_settings(
    gen_cfg: dict[str, Any],
    *,
    max_new_tokens: Optional[int] = None,
    min_new_tokens: Optional[int] = None,
    num_beams: Optional[int] = None,
    num_return_sequences: Optional[int] = None,
    length_penalty: Optional[float] = None,
    early_stopping: Optional[bool] = None,
    no_repeat_ngram_size: Optional[int] = None,
    temperature: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    eos_ids: Sequence[int] = (),
    seed: Optional[int] = None,
    warn: Callable[[str], None] = lambda m: None,
) -> Seq2SeqSettings:
    """Flags override the checkpoint's generation config, which overrides transformers' defaults.

    ``max_new_tokens``: the flag, else ``max_new_tokens`` of the config, else its ``max_length`` less
    the decoder start token (transformers' meaning for encoder-decoders), else 256."""
    from gencli.pipelines.text.generate import resolve_settings as resolve_sampling

    check_decoding_flags(
        num_beams=num_beams, num_return_sequences=num_return_sequences, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
        length_penalty=length_penalty, no_repeat_ngram_size=no_repeat_ngram_size, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty,
    )  # fmt: skip
    if max_new_tokens is None:
        configured = gen_cfg.get("max_new_tokens")
        if configured is None and gen_cfg.get("max_length") is not None:
            configured = int(gen_cfg["max_length"]) - 1
        max_new_tokens = max(1, int(configured)) if configured is not None else DEFAULT_MAX_NEW_TOKENS
        budget = "the generation config's budget of new tokens" if configured is not None else "the default budget of new tokens"
        check_min_new_tokens(min_new_tokens, max_new_tokens, budget)
    base = resolve_sampling(gen_cfg, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                            seed=seed, warn=warn)  # fmt: skip
    beams = int(_first(num_beams, gen_cfg.get("num_beams"), 1))
    returns = int(_first(num_return_sequences, gen_cfg.get("num_return_sequences"), 1))
    if beams < 1:
        raise UserError(f"the generation config's num_beams must be at least 1 (got {beams})")
    check_returns(beams, returns, base.sampling.greedy, returns_from_config=num_return_sequences is None)
    min_new = int(_first(min_new_tokens, gen_cfg.get("min_new_tokens"), 0))
    if min_new_tokens is None and gen_cfg.get("min_length"):
        min_new = max(min_new, int(gen_cfg["min_length"]) - 1)
    stop_early = _first(early_stopping, gen_cfg.get("early_stopping"), False)
    if stop_early not in (True, False, "never"):
        raise UserError(f'the generation config\'s early_stopping must be true, false or "never" (got {stop_early!r})')
    bad = [w[0] for w in gen_cfg.get("bad_words_ids") or [] if isinstance(w, list) and len(w) == 1 and w[0] not in eos_ids]
    forced = gen_cfg.get("forced_eos_token_id")
    forced_ids = [int(v) for v in (forced if isinstance(forced, list) else [forced])] if forced is not None else []
    return Seq2SeqSettings(
        max_new_tokens=max_new_tokens, sampling=base.sampling, min_new_tokens=min_new, num_beams=beams, num_return_sequences=returns,
        length_penalty=float(_first(length_penalty, gen_cfg.get("length_penalty"), 1.0)), early_stopping=stop_early,
        no_repeat_ngram_size=int(_first(no_repeat_ngram_size, gen_cfg.get("no_repeat_ngram_size"), 0)),
        forced_eos_ids=forced_ids, suppressed_ids=[int(b) for b in bad], seed=seed,
        forced_bos_id=int(gen_cfg["forced_bos_token_id"]) if gen_cfg.get("forced_bos_token_id") is not None else None,
    )  # fmt: skip


# -- inputs -----------------------------------------------------------------------------------------
def encode_input(sm: Seq2SeqModel, text: str, *, truncate: bool = True, warn: Callable[[str], None] = lambda m: None) -> list[int]:
    """Token ids of one source text (with the end token the tokenizer appends). A text longer than the
    encoder's window is cut to fit (its end token kept) with a warning, or refused."""
    if not text.strip():
        raise UserError("the input is empty")
    ids = sm.tokenizer.encode(text, add_special_tokens=True)
    if not ids:
        raise UserError("the input encodes to no tokens")
    limit = sm.max_source_tokens
    if len(ids) > limit:
        if not truncate:
            raise UserError(f"the input is {len(ids)} tokens, the encoder's window is {limit} tokens (--no-truncate): shorten it")
        tail = [ids[-1]] if ids[-1] in sm.eos_ids else []
        ids = ids[: limit - len(tail)] + tail
        warn(f"an input of more than {limit} tokens was truncated to the encoder's window of {limit} tokens")
    return ids


# -- outputs ----------------------------------------------------------------------------------------
@dataclass
class Output:
    prompt: str
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" (end token) | "length" (budget)
    index: int = 0  # which of the input's returned sequences (num_return_sequences)
    score: Optional[float] = None  # beam search: the length-normalised log-probability
    timing: dict[str, Any] = field(default_factory=dict)

    def as_json(self, model: str, seed: Optional[int], many: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.token_ids)},
            "timing": self.timing,
            "model": model,
        }
        if many:
            out["index"] = self.index
        if self.score is not None:
            out["score"] = round(self.score, 6)
        if seed is not None:
            out["seed"] = seed
        return out


# -- the logits processors that mask ---------------------------------------------------------------------
def _mask_scores(scores: torch.Tensor, seqs: torch.Tensor, settings: Seq2SeqSettings, eos_ids: list[int], step: int) -> torch.Tensor:
    """Apply the masking processors to ``scores (N, V)`` (fp32) for decoder sequences ``seqs (N, step + 1)``."""
    ban_ngrams(scores, seqs.tolist(), settings.no_repeat_ngram_size)
    if settings.suppressed_ids:
        scores[:, settings.suppressed_ids] = float("-inf")
    if step < settings.min_new_tokens and eos_ids:
        scores[:, eos_ids] = float("-inf")
    if settings.forced_bos_id is not None and step == 0:
        scores.fill_(float("-inf"))
        scores[:, settings.forced_bos_id] = 0.0
    if settings.forced_eos_ids and step == settings.max_new_tokens - 1:
        scores.fill_(float("-inf"))
        scores[:, settings.forced_eos_ids] = 0.0
    return scores


# -- the decoding loop --------------------------------------------------------------------------------------
@dataclass
class _Source:
    input_ids: torch.Tensor  # (B, S), right-padded
    mask: Optional[torch.Tensor]  # (B, S) True = a real token; None when no row is padded

    @classmethod
    def build(cls, inputs: Sequence[tuple[str, list[int]]], pad_id: int, device: torch.device) -> "_Source":
        longest = max(len(ids) for _, ids in inputs)
        input_ids = torch.full((len(inputs), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.bool)
        for i, (_, ids) in enumerate(inputs):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, : len(ids)] = True
        return cls(input_ids.to(device), None if bool(mask.all()) else mask.to(device))


def free_memory_bytes(device: torch.device) -> Optional[int]:
    """The memory a new allocation on ``device`` can have (the CPU's MemAvailable, a GPU's free memory);
    None where it cannot be told."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            with open("/proc/meminfo", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        pass
    return None


def check_cache_room(sm: Seq2SeqModel, rows: int, max_new_tokens: int, source_len: int = 0, per_input: int = 1) -> None:
    """The decoder's self-attention cache is allocated for the whole budget at once (T5 has no position
    limit to bound it), and each of the ``rows`` sequences (``per_input`` a source: beams or sampled copies)
    holds the encoder's output and its cross-attention keys and values for ``source_len`` positions: what
    the device cannot hold is one error line, not an internal error (a size past int64) or the process
    killed for memory."""
    model = sm.model
    ref = model.decoder_embeddings().weight
    per_position = 2 * model.num_decoder_layers * rows * model.num_heads * model.head_dim * ref.element_size()
    need = per_position * (max_new_tokens + 1)
    need += per_position * source_len + rows * source_len * ref.shape[1] * ref.element_size()  # the cross-attention keys/values, the encoder's output
    need += 4 * rows * ref.shape[0] * 4  # a step's fp32 scores and their copies
    free = free_memory_bytes(ref.device)
    if free is not None and need > free:
        also = " (or --num-beams / --num-return-sequences)" if per_input > 1 else ""
        raise UserError(
            f"a budget of {max_new_tokens} new tokens (--max-new-tokens) needs {need / 2**30:.3g} GiB for the decoder's cache of {rows} "
            f"sequence(s), more than the {free / 2**30:.3g} GiB free: lower it{also}"
        )


@torch.inference_mode()
def generate(
    sm: Seq2SeqModel,
    inputs: Sequence[tuple[str, list[int]]],
    settings: Seq2SeqSettings,
    *,
    on_text: Optional[Callable[[int, str], None]] = None,
    generator: Optional[torch.Generator] = None,
) -> list[Output]:
    """Generate for ``inputs`` (``(text, ids)`` pairs) as one batch: ``num_return_sequences`` outputs per
    input, in input order. ``on_text(row, piece)`` streams text as it becomes final (greedy and
    sampling only)."""
    model, device = sm.model, sm.placement.device
    # sampled outputs of one input: that many rows of it (as transformers expands the batch)
    copies = settings.num_return_sequences if settings.num_beams == 1 else 1
    per_input = copies * settings.num_beams
    check_cache_room(sm, len(inputs) * per_input, settings.max_new_tokens, max(len(ids) for _, ids in inputs), per_input)
    inputs = [x for x in inputs for _ in range(copies)]
    src = _Source.build(inputs, sm.pad_id, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    hidden = model.encode(src.input_ids, src.mask)
    k = settings.num_beams
    mask = src.mask
    if k > 1:
        hidden = hidden.repeat_interleave(k, dim=0)
        mask = mask.repeat_interleave(k, dim=0) if mask is not None else None
    cross_kv = model.cross_attention_kv(hidden)
    sync()
    t_encode = time.perf_counter() - t0
    t1 = time.perf_counter()
    if k > 1:
        outputs, steps = _beam_search(sm, inputs, settings, cross_kv, mask, generator)
    else:
        outputs, steps = _sample(sm, inputs, settings, cross_kv, mask, on_text, generator)
    sync()
    t_decode = time.perf_counter() - t1
    rows = len(inputs) * k
    timing = {
        "load_s": round(sm.load_seconds, 4),
        "encode_s": round(t_encode, 4),
        "decode_s": round(t_decode, 4),
        "decode_tokens_per_s": round(steps * rows / t_decode, 2) if t_decode > 0 and steps else None,
        "batch_size": len(inputs),
        "num_beams": k,
    }
    for i, out in enumerate(outputs):
        if copies > 1:
            out.index = i % copies
        out.timing = dict(timing)
        if not out.text:
            out.text = sm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    return outputs


def screen_for(sm: Seq2SeqModel, settings: Seq2SeqSettings):
    """The exact screened argmax of the LM head for plain greedy steps of a large fp32 head on a CPU
    with oneDNN's int8 or bf16 kernels (built once per loaded model), else None."""
    from gencli.backend.screened_argmax import ScreenedArgmax

    params = settings.sampling
    if not params.greedy or params.repetition_penalty != 1.0 or not sm.model.plain_head:
        return None
    head = sm.model.lm_head
    packed = isinstance(head, PackedLinear)
    if not packed and head.weight.dtype != torch.float32:
        return None  # a plain bf16/fp16 head's argmax is of its rounded logits: screening would change the tokens
    if sm.screen is None and not sm.screen_failed:
        # a packed bf16 head is screened as its fp32 image: fp32 weights of its bf16 values
        size = head.in_features * head.out_features * (4 if packed else head.weight.element_size())
        if settings.max_new_tokens < SCREEN_MIN_STEPS or size < SCREEN_MIN_HEAD_BYTES:
            return None
        weight = head.weight.float() if packed else head.weight
        if not ScreenedArgmax.supported(weight):
            return None
        try:
            sm.screen = ScreenedArgmax(weight)
        except ValueError:  # no copy passed its exactness check on this CPU
            sm.screen_failed = True
    return sm.screen


def _screened(screen, hidden: torch.Tensor, seqs: torch.Tensor, settings: Seq2SeqSettings, eos_ids: list[int], step: int) -> Optional[torch.Tensor]:
    """The greedy tokens by the screened argmax, or None where a masking processor bans one of them
    (the masks only lower banned tokens to -inf: an unbanned argmax is the masked argmax too)."""
    if (settings.forced_eos_ids and step == settings.max_new_tokens - 1) or (settings.forced_bos_id is not None and step == 0):
        return None
    tokens = screen(hidden.float())  # a bf16 hidden state: the argmax of its exact product with the (bf16) head
    banned = set(settings.suppressed_ids) | (set(eos_ids) if step < settings.min_new_tokens else set())
    picks = tokens.tolist()
    if banned and any(t in banned for t in picks):
        return None
    if settings.no_repeat_ngram_size > 0:
        rows = banned_ngrams(seqs.tolist(), settings.no_repeat_ngram_size)
        if any(t in row for t, row in zip(picks, rows)):
            return None
    return tokens


def _sample(sm: Seq2SeqModel, inputs, settings: Seq2SeqSettings, cross_kv, mask, on_text, generator) -> tuple[list[Output], int]:
    """Greedy decoding or sampling, one token per row and step."""
    model, device = sm.model, sm.placement.device
    screen = screen_for(sm, settings)
    b = len(inputs)
    eos = torch.tensor(sm.eos_ids or [-1], device=device)
    cache = model.new_cache(b, settings.max_new_tokens + 1)
    seqs = torch.full((b, 1), sm.decoder_start_id, dtype=torch.long, device=device)
    unfinished = torch.ones(b, dtype=torch.bool, device=device)
    outputs = [Output(text, list(ids)) for text, ids in inputs]
    detoks = [IncrementalDetokenizer(sm.tokenizer) for _ in inputs] if on_text is not None else None
    params: SamplingParams = settings.sampling
    steps = 0
    for step in range(settings.max_new_tokens):
        hidden = model.decode_hidden(seqs[:, -1:], cross_kv, mask, cache)[:, -1]
        tokens = _screened(screen, hidden, seqs, settings, sm.eos_ids, step) if screen is not None else None
        if tokens is None:
            logits = _mask_scores(model.logits(hidden).float(), seqs, settings, sm.eos_ids, step)
            tokens = next_tokens(logits, params, generator, seqs if params.repetition_penalty != 1.0 else None)
        tokens = torch.where(unfinished, tokens, torch.full_like(tokens, sm.pad_id))
        seqs = torch.cat([seqs, tokens[:, None]], dim=1)
        steps += 1
        host, live = tokens.tolist(), unfinished.tolist()
        for i, (tok, alive) in enumerate(zip(host, live)):
            if not alive:
                continue
            outputs[i].token_ids.append(tok)
            if tok in sm.eos_ids:
                outputs[i].finish_reason = "stop"
            elif detoks is not None:
                piece = detoks[i].add(tok)
                if piece:
                    on_text(i, piece)
        unfinished &= ~torch.isin(tokens, eos)
        if not bool(unfinished.any()):
            break
    for i, out in enumerate(outputs):
        if out.finish_reason is None:
            out.finish_reason = "length"
        if detoks is not None:
            tail = detoks[i].flush()
            if tail:
                on_text(i, tail)
    return outputs, steps


def _beam_search(sm: Seq2SeqModel, inputs, settings: Seq2SeqSettings, cross_kv, mask, generator) -> tuple[list[Output], int]:
    """Beam search (:func:`gencli.pipelines.text.beam_search.beam_search`) from the decoder start token;
    beam sampling where the settings sample."""
    model, device = sm.model, sm.placement.device
    b, k = len(inputs), settings.num_beams
    cache = model.new_cache(b * k, settings.max_new_tokens + 1)
    start = torch.full((b * k, 1), sm.decoder_start_id, dtype=torch.long, device=device)
    params = settings.sampling

    def step(tokens: Optional[torch.Tensor]) -> torch.Tensor:
        return model.decode(start if tokens is None else tokens.view(-1, 1), cross_kv, mask, cache)[:, -1]

    def process(log_probs: torch.Tensor, generated: torch.Tensor, g: int) -> torch.Tensor:
        seqs = torch.cat((start, generated), dim=1)
        if params.repetition_penalty != 1.0:
            log_probs = apply_repetition_penalty(log_probs, seqs, params.repetition_penalty)
        return warp(_mask_scores(log_probs, seqs, settings, sm.eos_ids, g), params, max(2, len(sm.eos_ids) + 1))

    found, steps = beam_search(
        step, cache.reorder_rows, process, batch=b, num_beams=k, budgets=[settings.max_new_tokens] * b, eos_ids=sm.eos_ids, pad_id=sm.pad_id,
        length_penalty=settings.length_penalty, early_stopping=settings.early_stopping, num_return_sequences=settings.num_return_sequences, device=device,
        sample=not params.greedy, generator=generator,
    )  # fmt: skip
    outputs = [
        Output(text, list(ids), token_ids=h.tokens, finish_reason=h.finish_reason, index=r, score=h.score)
        for (text, ids), hyps in zip(inputs, found)
        for r, h in enumerate(hyps)
    ]
    return outputs, steps
