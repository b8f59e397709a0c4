"""Text generation from a loaded :class:`~gencli.pipelines.text.loading.TextModel`.

The loop prefills the prompt(s) in one forward pass, then decodes one token per step through a
preallocated KV cache. Several prompts run as one left-padded batch; each row stops on its own (EOS,
a stop string, its token budget, or the model's context). Text reaches the caller piece by piece
through an incremental detokenizer, with stop strings held back and trimmed.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from gencli.backend.packed_linear import PackedLinear
from gencli.backend.random import make_generator
from gencli.backend.screened_argmax import ScreenedArgmax
from gencli.backend.streamed_linear import StreamedLinear
from gencli.errors import UserError
from gencli.pipelines.text.beam_search import ban_ngrams
from gencli.pipelines.text.decode_step import compiled, decode_step, static_capacity, wants_static
from gencli.pipelines.text.flags import check_decoding_flags, check_min_new_tokens, check_returns
from gencli.pipelines.text.loading import TextModel
from gencli.pipelines.text.sampling import SamplingParams, loaded_native_sampler, native_settings, next_tokens
from gencli.tokenizers.stream import IncrementalDetokenizer, StopStringMatcher

DEFAULT_MAX_NEW_TOKENS = 256

# The screen of the LM head pays off once the head no longer sits in the caches, and once enough
# steps repay building it: the build reads the head a few times, each decode step then saves most
# of a read (GPT-2 on a 2-core CPU: from Python the int8 copy took 0.2 s to build and saved about 4 ms
# per token, the bf16 copy 0.1 s and about 2.5 ms; inside the fused step, the AMD EPYC's 2 threads,
# the native int8 copy takes 0.075 s and saves 1.1 ms a token of an fp32 head, 0.3 ms of a bf16 one,
# whose screen therefore waits for runs three times as long).
SCREEN_MIN_HEAD_BYTES = 32 * 2**20
SCREEN_MIN_STEPS = 128
SCREEN_KIND: Optional[str] = None  # the head copy the screen reads: "int8", "bf16", None = the best exact one
# plain greedy decoding on a CPU: steps a native call (see _Burst)
BURST_SECONDS = 0.05
BURST_TOKENS = 16


def screens_natively(tm: TextModel, params: SamplingParams, steps: int) -> bool:
    """Whether plain greedy steps choose through the fused step's screen of the LM head (its int8 copy read
    natively inside the steps, :meth:`~gencli.backend.decoder_step.FusedDecoder.screen_head`) instead of
    :func:`screen_for`'s from Python: a large dense head without a bias on gencli's kernels, and a
    generation long enough to repay building the copy (or the copy built already)."""
    head = tm.model.lm_head
    if not params.greedy or params.repetition_penalty != 1.0 or not isinstance(head, StreamedLinear) or head.bias is not None:
        return False
    if head.weight.device.type != "cpu" or head.weight.numel() * head.weight.element_size() < SCREEN_MIN_HEAD_BYTES:
        return False
    least = SCREEN_MIN_STEPS if head.weight.dtype == torch.float32 else 3 * SCREEN_MIN_STEPS  # (a bf16 head saves a third as much a step)
    return tm.model.fused_head_screen(build=steps >= least)


def screen_for(tm: TextModel, params: SamplingParams, steps: int) -> Optional[ScreenedArgmax]:
    """The exact screened argmax of the LM head (:mod:`gencli.backend.screened_argmax`), when the
    tokens are plain greedy choices from a large fp32 head, a streamed bf16 one (screened by its int8
    copy, against its own rows), or a packed bf16 one, on a CPU with
    oneDNN's int8 (VNNI) or native bf16 kernels and the generation is long enough to repay building
    it (or it is built already); else None."""
    head = tm.model.lm_head
    packed = isinstance(head, PackedLinear)
    if not packed and not head.weight.is_floating_point():  # a quantized head: already a fraction of the fp32 read
        return None
    streamed = isinstance(head, StreamedLinear)
    if not packed and not streamed and head.weight.dtype != torch.float32:
        return None  # a plain bf16/fp16 head's argmax is of its rounded logits: screening would change the tokens
    if not params.greedy or params.repetition_penalty != 1.0 or getattr(head, "bias", None) is not None:
        return None
    if tm.screen is None and not tm.screen_failed:
        # a packed bf16 head is screened as its fp32 image (fp32 weights of its bf16 values), as the
        # encoder-decoders' is: the argmax of the exact product of the bf16 hidden state and head
        size = head.in_features * head.out_features * 4 if packed else head.weight.numel() * head.weight.element_size()
        if steps < SCREEN_MIN_STEPS or size < SCREEN_MIN_HEAD_BYTES:
            return None
        weight = head.weight.float() if packed else head.weight
        if not ScreenedArgmax.supported(weight, SCREEN_KIND):
            return None
        try:
            # a streamed head decides what no copy can with its own product: the unscreened tokens
            tm.screen = ScreenedArgmax(weight, kind=SCREEN_KIND, product=head if streamed else None)
        except ValueError:  # no copy passed its exactness check on this CPU
            tm.screen_failed = True
    return tm.screen


# -- settings -------------------------------------------------------------------------------------
@dataclass
class GenerationSettings:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None
    compile: Optional[bool] = None  # the decoding step compiled for replay (None: on CUDA), see decode_step
    static_cache: Optional[bool] = None  # the fixed-shape step without compiling it (None: when compiled)
    num_beams: int = 1  # > 1: beam search (gencli.pipelines.text.beam_search)
    num_return_sequences: int = 1  # completions a prompt: sampled ones, or the best beams
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0  # end tokens banned before this many new tokens (transformers' MinNewTokensLength)


def resolve_settings(
    gen_cfg: dict[str, Any],
    *,
    max_new_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    seed: Optional[int] = None,
    num_beams: Optional[int] = None,
    num_return_sequences: Optional[int] = None,
    length_penalty: Optional[float] = None,
    early_stopping: Optional[bool] = None,
    no_repeat_ngram_size: Optional[int] = None,
    min_new_tokens: Optional[int] = None,
    warn: Callable[[str], None] = lambda m: None,
) -> GenerationSettings:
    """Flags override ``generation_config.json``, which overrides transformers' defaults.

    As in transformers, a checkpoint samples only when its generation config says ``do_sample``;
    otherwise decoding is greedy. A flag that only makes sense when sampling (--top-k/--top-p/--min-p)
    turns sampling on at temperature 1 unless --temperature is given. Beam search runs where
    ``num_beams`` (or the config's) is more than 1, as in transformers.
    """
    check_decoding_flags(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                         num_beams=num_beams, num_return_sequences=num_return_sequences, length_penalty=length_penalty,
                         no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=min_new_tokens)  # fmt: skip
    do_sample = bool(gen_cfg.get("do_sample", False))
    if temperature is None:
        if do_sample:
            temperature = float(gen_cfg.get("temperature", 1.0) or 0.0)
        elif top_k is not None or top_p is not None or min_p is not None:
            temperature = 1.0
        else:
            temperature = 0.0
    elif temperature == 0.0 and (top_k or (top_p is not None and top_p < 1) or min_p):
        warn("--top-k/--top-p/--min-p have no effect with --temperature 0 (greedy decoding)")
    sampling = SamplingParams(
        temperature=float(temperature),
        top_k=int(top_k if top_k is not None else (gen_cfg.get("top_k") if gen_cfg.get("top_k") is not None else 50)),
        top_p=float(top_p if top_p is not None else (gen_cfg.get("top_p") if gen_cfg.get("top_p") is not None else 1.0)),
        min_p=float(min_p if min_p is not None else (gen_cfg.get("min_p") or 0.0)),
        repetition_penalty=float(repetition_penalty if repetition_penalty is not None else (gen_cfg.get("repetition_penalty") or 1.0)),
    )
    max_new_tokens_given = max_new_tokens is not None
    if max_new_tokens is None:
        max_new_tokens = int(gen_cfg.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
    settings = GenerationSettings(max_new_tokens, sampling, [s for s in stop if s], ignore_eos, seed)
    settings.num_beams = int(_configured(num_beams, gen_cfg, "num_beams", 1))
    settings.num_return_sequences = int(_configured(num_return_sequences, gen_cfg, "num_return_sequences", 1))
    check_returns(settings.num_beams, settings.num_return_sequences, sampling.greedy, returns_from_config=num_return_sequences is None)
    if settings.num_beams > 1 and settings.stop:
        raise UserError("--stop ends greedy or sampled text as it streams; beam search chooses whole sequences at the end: drop --stop or use --num-beams 1")
    beam_only = [name for name, flag in (("--length-penalty", length_penalty), ("--early-stopping", early_stopping)) if flag is not None]
    if beam_only and settings.num_beams == 1:
        raise UserError(f"{beam_only[0]} applies to beam search, which this run does not use (one beam): give --num-beams 2 or more")
    settings.length_penalty = float(_configured(length_penalty, gen_cfg, "length_penalty", 1.0))
    settings.early_stopping = _configured(early_stopping, gen_cfg, "early_stopping", False)
    if settings.early_stopping not in (True, False, "never"):
        raise UserError(f'the generation config\'s early_stopping must be true, false or "never" (got {settings.early_stopping!r})')
    settings.no_repeat_ngram_size = int(_configured(no_repeat_ngram_size, gen_cfg, "no_repeat_ngram_size", 0))
    settings.min_new_tokens = int(_configured(min_new_tokens, gen_cfg, "min_new_tokens", 0))
    budget = "--max-new-tokens" if max_new_tokens_given else "the budget of new tokens (generation_config.json, else 256)"
    check_min_new_tokens(settings.min_new_tokens, settings.max_new_tokens, budget)
    return settings


def _configured(flag: Any, gen_cfg: dict[str, Any], key: str, default: Any) -> Any:
    """The flag, else the generation config's value, else ``default``."""
    if flag is not None:
        return flag
    return gen_cfg[key] if gen_cfg.get(key) is not None else default


def warn_unapplied_settings(gen_cfg: dict[str, Any], warn: Callable[[str], None]) -> None:
    """One warning naming the settings of a causal LM's generation config that gencli generate does not
    implement (diverse beam search, contrastive search, typical sampling...), rather than ignoring them silently."""
    unapplied = [f"{key}={gen_cfg[key]}" for key, off in UNAPPLIED_GENERATION_KEYS.items() if gen_cfg.get(key) not in (None, *off)]
    if unapplied:
        warn(f"generation_config.json sets {', '.join(unapplied)}, which gencli generate does not apply (it decodes greedily, "
             "by sampling or by beam search)")  # fmt: skip


# decoding settings a causal LM's generation config may hold that gencli generate does not implement, and
# the values that mean "off" (diverse beam search, contrastive search, typical sampling, ...)
UNAPPLIED_GENERATION_KEYS: dict[str, tuple[Any, ...]] = {
    "num_beam_groups": (1,),
    "penalty_alpha": (0, 0.0),
    "typical_p": (1, 1.0),
    "epsilon_cutoff": (0, 0.0),
    "eta_cutoff": (0, 0.0),
    "bad_words_ids": ([],),
}


# -- prompts ----------------------------------------------------------------------------------------
def encode_prompt(tm: TextModel, prompt: str, *, chat: bool = False, system: Optional[str] = None) -> list[int]:
    """Token ids of one prompt (through the chat template with ``chat``); checks it fits the context."""
    from gencli.tokenizers.chat import build_messages, render_chat

    if not prompt.strip():
        raise UserError("the prompt is empty")
    if chat:
        text = render_chat(tm.tokenizer.chat_template, build_messages(prompt, system), tm.tokenizer.special_token_map(), where=str(tm.path))
        ids = tm.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tm.tokenizer.encode(prompt, add_special_tokens=True)
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    if len(ids) >= tm.context_length:
        raise UserError(f"the prompt is {len(ids)} tokens, the model's context is {tm.context_length} tokens: shorten the prompt to leave room for new tokens")
    return ids


# -- generation ---------------------------------------------------------------------------------------
@dataclass
class Completion:
    prompt: str
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" (EOS or stop string) | "length" (budget or context)
    hit_context: bool = False
    timing: dict[str, float] = field(default_factory=dict)
    index: Optional[int] = None  # which of the prompt's completions (--num-return-sequences above 1)
    score: Optional[float] = None  # beam search: the length-normalised log-probability

    def as_json(self, model: str, seed: Optional[int]) -> dict[str, Any]:
        out = {
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.token_ids)},
            "timing": self.timing,
            "model": model,
        }
        if self.index is not None:
            out["index"] = self.index
        if self.score is not None:
            out["score"] = round(self.score, 6)
        if seed is not None:
            out["seed"] = seed
        return out


class _Row:
    """One sequence of a batch: its detokenizer, stop matcher and budget."""

    def __init__(self, tm: TextModel, completion: Completion, settings: GenerationSettings, budget: int):
        self.c = completion
        self.detok = IncrementalDetokenizer(tm.tokenizer, completion.prompt_ids)
        self.stops = StopStringMatcher(settings.stop)
        self.budget = budget
        self.done = False
        self.pieces: list[str] = []

    def take(self, token: int, eos: set[int], max_new_tokens: int) -> str:
        """Add the row's next token (ignored once the row is done); returns the text that became final."""
        if self.done:
            return ""
        self.c.token_ids.append(token)
        if token in eos:
            return self.finish("stop")
        piece = self.stops.feed(self.detok.add(token))
        self.pieces.append(piece)
        if self.stops.stopped is not None:
            self.finish("stop")
        elif len(self.c.token_ids) >= self.budget:
            self.c.hit_context = self.budget < max_new_tokens
            piece += self.finish("length")
        return piece

    def finish(self, reason: str) -> str:
        self.done = True
        self.c.finish_reason = reason
        tail = ""
        if self.stops.stopped is None:
            tail = self.stops.feed(self.detok.flush())
            tail += self.stops.finish() if self.stops.stopped is None else ""
        self.pieces.append(tail)
        self.c.text = "".join(self.pieces)
        return tail


@dataclass
class PromptBatch:
    """The prompts as one left-padded batch on the model's device; the mask and explicit positions
    only when the lengths differ."""

    input_ids: torch.Tensor  # (B, longest)
    lengths: list[int]
    attention_mask: Optional[torch.Tensor] = None  # (B, capacity), True = a real token
    position_ids: Optional[torch.Tensor] = None  # (B, longest)
    next_pos: Optional[torch.Tensor] = None  # (B,) the position of each row's next token

    @classmethod
    def build(cls, prompts: Sequence[tuple[str, list[int]]], pad_id: int, capacity: int, device: torch.device) -> "PromptBatch":
        lengths = [len(ids) for _, ids in prompts]
        b, longest = len(prompts), max(lengths)
        input_ids = torch.full((b, longest), pad_id, dtype=torch.long)
        for i, (_, ids) in enumerate(prompts):
            input_ids[i, longest - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        batch = cls(input_ids.to(device), lengths)
        if any(n != longest for n in lengths):
            mask = torch.ones((b, capacity), dtype=torch.bool)
            for i, n in enumerate(lengths):
                mask[i, : longest - n] = False
            batch.position_ids = (mask[:, :longest].long().cumsum(-1) - 1).clamp(min=0).to(device)
            batch.attention_mask = mask.to(device)
            batch.next_pos = torch.tensor(lengths, dtype=torch.long).to(device)
        return batch

    @property
    def padded(self) -> bool:
        return self.attention_mask is not None

    def seen_tokens(self, prompts: Sequence[tuple[str, list[int]]], capacity: int) -> torch.Tensor:
        """Every token so far per row (for the repetition penalty), room for ``capacity``; the
        padding repeats the row's first token (no effect)."""
        b, longest = self.input_ids.shape
        seen = torch.empty((b, capacity), dtype=torch.long, device=self.input_ids.device)
        seen[:, :longest] = self.input_ids
        for i, (_, ids) in enumerate(prompts):
            seen[i, : longest - len(ids)] = ids[0]
        return seen


@torch.inference_mode()
def generate(
    tm: TextModel,
    prompts: Sequence[tuple[str, list[int]]],
    settings: GenerationSettings,
    *,
    on_text: Optional[Callable[[int, str], None]] = None,
    generator: Optional[torch.Generator] = None,
    on_info: Optional[Callable[[str], None]] = None,
) -> list[Completion]:
    """Generate for ``prompts`` (``(text, ids)`` pairs) as one batch.

    ``on_text(row, piece)`` receives text as soon as it is final (streaming; not with beam search).
    Returns ``num_return_sequences`` :class:`Completion` per prompt, in prompt order.
    """
    if settings.num_beams > 1:
        from gencli.pipelines.text.beam_generate import generate_beams

        return generate_beams(tm, prompts, settings, generator)
    copies = settings.num_return_sequences  # sampled completions of one prompt: that many rows of it
    if copies > 1:
        from gencli.pipelines.text.beam_generate import check_room

        longest = max(len(ids) for _, ids in prompts)
        check_room(tm, len(prompts), copies, longest + min(settings.max_new_tokens, tm.context_length - min(len(ids) for _, ids in prompts)),
                   "--num-return-sequences")  # fmt: skip
        completions = generate(tm, [p for p in prompts for _ in range(copies)], _one_each(settings), on_text=on_text, generator=generator, on_info=on_info)
        for i, c in enumerate(completions):
            c.index = i % copies
        return completions
    model, device = tm.model, tm.placement.device
    params = settings.sampling
    ngram = settings.no_repeat_ngram_size  # the n-gram ban needs each step's logits in Python: one step a call
    b = len(prompts)
    budgets = [min(settings.max_new_tokens, tm.context_length - len(ids)) for _, ids in prompts]
    steps = max(budgets)
    batch = PromptBatch.build(prompts, tm.pad_id, max(len(ids) for _, ids in prompts) + steps, device)
    longest = batch.input_ids.shape[1]
    rows = [_Row(tm, Completion(text, list(ids)), settings, budget) for (text, ids), budget in zip(prompts, budgets)]
    eos = set() if settings.ignore_eos else set(tm.eos_ids)
    min_new = settings.min_new_tokens if eos else 0  # the end tokens banned for the first steps (one a call)
    in_python = bool(ngram or min_new)  # processors that need each step's logits here: no screens
    seen = batch.seen_tokens(prompts, longest + steps) if params.repetition_penalty != 1.0 else None
    static, compile_step = wants_static(device, settings.compile, settings.static_cache, steps)
    capacity = static_capacity(longest + steps) if static else longest + steps
    attention_mask = batch.attention_mask
    if attention_mask is not None and capacity > attention_mask.shape[1]:  # the slots past the run: never seen
        attention_mask = torch.nn.functional.pad(attention_mask, (0, capacity - attention_mask.shape[1]), value=False)
    cache = model.new_cache(b, capacity, static=static)
    native_screen = not static and not in_python and screens_natively(tm, params, steps)
    head = None if static or native_screen or in_python else screen_for(tm, params, steps)
    one_token = decode_step(model, cache, attention_mask) if static else None
    if one_token is not None and compile_step:
        one_token = compiled(one_token, on_info)
    slot = torch.zeros(1, dtype=torch.long, device=device)  # the static step's cache position, written in place
    plain_greedy = params.greedy and params.repetition_penalty == 1.0 and not in_python  # the argmax of the raw logits
    chosen = [0]  # tokens chosen so far a row

    def choose(logits: torch.Tensor, seen_so_far: Optional[torch.Tensor]) -> torch.Tensor:
        if chosen[0] < min_new:
            logits[:, sorted(eos)] = float("-inf")
        chosen[0] += 1
        if ngram:  # each row's prompt and the tokens it has taken
            ban_ngrams(logits, [r.c.prompt_ids + r.c.token_ids for r in rows], ngram)
        return next_tokens(logits, params, generator, seen_so_far)

    def advance(ids: torch.Tensor, pos: Optional[torch.Tensor], seen_so_far: Optional[torch.Tensor]) -> torch.Tensor:
        """Run ``ids`` through the model (filling the cache) and choose the next token of each row."""
        if static and ids.shape[1] == 1:
            return choose(one_token(ids, pos, slot), seen_so_far)
        if head is None and ids.shape[1] == 1:  # on a CPU, from the ids to the logits (greedy: to the choices) in one call
            done = model.fused_logits(ids, position_ids=pos, attention_mask=attention_mask, kv_cache=cache, greedy=plain_greedy)
            if done is not None:
                logits, chosen = done
                return chosen if chosen is not None else choose(logits, seen_so_far)
        where = torch.arange(ids.shape[1], device=device) if static else None  # the prompt: slots 0..L-1
        hidden = model.hidden_states(ids, position_ids=pos, attention_mask=attention_mask, kv_cache=cache, cache_position=where, logits_to_keep=1)[:, -1]
        if head is not None:
            return head(hidden.float())  # a bf16 hidden state: the argmax of its exact product with the bf16 head
        return choose(model.lm_head(hidden), seen_so_far)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    tokens = advance(batch.input_ids, batch.position_ids, seen[:, :longest] if seen is not None else None)
    host = tokens.tolist()
    sync()
    t_prefill = time.perf_counter() - t0
    decode_steps = 0
    t1 = time.perf_counter()
    # several steps a native call: plain greedy (argmax in the step), else where the native sampler chooses
    raw_greedy = params.greedy and params.repetition_penalty == 1.0
    bursts = head is None and not static and not ngram and (raw_greedy or loaded_native_sampler() is not None)
    burst = _Burst(None if raw_greedy else params, generator, screen=native_screen) if bursts else None
    ahead: list[list[int]] = []  # the choices of the steps a burst ran, after the one being taken
    for step in range(steps):
        for i, row in enumerate(rows):
            piece = row.take(host[i], eos, settings.max_new_tokens)
            if piece and on_text is not None:
                on_text(i, piece)
        if all(r.done for r in rows) or step == steps - 1:
            break
        if ahead:
            host = ahead.pop(0)
            continue
        cur = longest + step
        # rows that already finished keep stepping; their positions must stay inside the table
        pos = (batch.next_pos.view(b, 1) + step).clamp_(max=tm.context_length - 1) if batch.padded else None
        if seen is not None:
            seen[:, cur] = tokens
        if burst is not None and step + 1 >= min_new:  # (past the end-token ban: the native steps choose)
            left = [0 if r.done else r.budget - len(r.c.token_ids) for r in rows]
            so_far = seen[:, : cur + 1] if seen is not None else None
            block = burst.run(model, tokens.view(b, 1), cache, steps - 1 - step, left, eos, pos, attention_mask, tm.context_length - 1, so_far)
            if block is not None:
                k = block.shape[1]
                decode_steps += k
                if seen is not None:  # the burst's choices before its last (that one is written when it is stepped on)
                    seen[:, cur + 1 : cur + k] = block[:, : k - 1]
                tokens = block[:, -1]
                ahead = block.t().tolist()
                host = ahead.pop(0)
                continue
            burst = None
        if static:
            slot.fill_(cur)
        tokens = advance(tokens.view(b, 1), pos, seen[:, : cur + 1] if seen is not None else None)
        host = tokens.tolist()
        decode_steps += 1
    sync()
    timing = timing_of(tm, sum(batch.lengths), b, t_prefill, time.perf_counter() - t1, decode_steps)
    for row in rows:
        if not row.done:  # pragma: no cover - every row ends by its budget at the latest
            row.finish("length")
        row.c.timing = dict(timing)
    return [r.c for r in rows]


class _Burst:
    """Decoding on a CPU several steps in one native call, each step's choices fed back there: plain greedy
    (:meth:`~gencli.models.causal_lm.CausalLM.fused_greedy_steps`) or, with ``params``, sampled (and greedy
    with a repetition penalty) by the native sampler (:meth:`~gencli.models.causal_lm.CausalLM.fused_sample_steps`).
    The Python between two tokens (the loop, the detokenizer, the stop strings, the sampling) then runs once a
    burst, on caches the weights' stream has not just evicted. The first burst is one step; each next one
    lasts about :data:`BURST_SECONDS` at the pace of the last (streamed text keeps arriving smoothly), at most
    :data:`BURST_TOKENS` steps (a stop string inside a burst wastes the steps after it; the text and tokens
    are those of one step at a time). A sampled burst draws its steps' uniform numbers from ``generator``
    in the order one step at a time draws them, and leaves it where those steps would: seeded text is the same."""

    def __init__(self, params: Optional[SamplingParams] = None, generator: Optional[torch.Generator] = None, screen: bool = False) -> None:
        self.size = 1
        self.params = params
        self.generator = generator
        self.screen = screen  # plain greedy steps choose through the fused step's screen of the head

    def run(
        self, model, ids, cache, most: int, left: list[int], eos: set[int], pos, attention_mask, last_position: int, seen: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        t = time.perf_counter()
        steps = min(self.size, most)
        shared = dict(kv_cache=cache, steps=steps, left=left, stop_ids=sorted(eos), position_ids=pos, attention_mask=attention_mask)
        shared["last_position"] = last_position
        if self.params is None:
            block = model.fused_greedy_steps(ids, screen=self.screen, **shared)
        else:
            gen = self.generator if self.generator is not None else torch.default_generator
            state = uniforms = None
            if not self.params.greedy:
                state = gen.get_state()
                uniforms = torch.rand((steps, ids.shape[0]), generator=gen, dtype=torch.float64)
            penalized = seen if self.params.repetition_penalty != 1.0 else None
            block = model.fused_sample_steps(ids, sampling=native_settings(self.params), uniforms=uniforms, seen=penalized, **shared)
            ran = 0 if block is None else block.shape[1]
            if state is not None and ran < steps:  # the draws of the steps run only
                gen.set_state(state)
                torch.rand((ran, ids.shape[0]), generator=gen, dtype=torch.float64)
        if block is not None:
            per_step = (time.perf_counter() - t) / block.shape[1]
            self.size = max(1, min(BURST_TOKENS, int(BURST_SECONDS / per_step) if per_step > 0 else BURST_TOKENS))
        return block


def _one_each(settings: GenerationSettings) -> GenerationSettings:
    return dataclasses.replace(settings, num_return_sequences=1)


def timing_of(tm: TextModel, prompt_tokens: int, batch_size: int, t_prefill: float, t_decode: float, decode_steps: int) -> dict[str, Any]:
    return {
        "load_s": round(tm.load_seconds, 4),
        "prefill_s": round(t_prefill, 4),
        "decode_s": round(t_decode, 4),
        "prefill_tokens_per_s": round(prompt_tokens / t_prefill, 2) if t_prefill > 0 else None,
        "decode_tokens_per_s": round(decode_steps * batch_size / t_decode, 2) if t_decode > 0 and decode_steps else None,
        "batch_size": batch_size,
    }


def read_prompts(prompt: Optional[str], prompts_file: Optional[str], warn: Callable[[str], None]) -> list[str]:
    """The prompts of a run: ``prompt`` (``-`` = stdin, its last line end dropped) or the lines of
    ``prompts_file`` (``-`` = stdin; blank lines skipped, with a warning saying which)."""
    from gencli.io import check_text, read_lines, read_stdin_text

    if prompt is not None and prompts_file is not None:
        raise UserError("give either a PROMPT or --prompts-file, not both")
    if prompt is None and prompts_file is None:
        raise UserError("no prompt: give a PROMPT, - to read it from stdin, or --prompts-file FILE")
    if prompts_file is not None:
        lines, where = read_lines(prompts_file, what="--prompts-file")
        prompts = [line for line in lines if line.strip()]
        if not prompts:
            raise UserError(f"no prompts in {where} (one prompt per line)")
        blank = [i + 1 for i, line in enumerate(lines) if not line.strip()]
        if blank:
            shown = ", ".join(map(str, blank[:5])) + (", ..." if len(blank) > 5 else "")
            warn(f"--prompts-file: skipped {len(blank)} blank line(s) (line {shown}); {len(prompts)} prompt(s) left")
        return prompts
    if prompt == "-":
        text = read_stdin_text()
        if text.endswith("\n"):  # the line end that echo/heredocs add (Windows' too)
            text = text[:-2] if text.endswith("\r\n") else text[:-1]
        prompt = text
    check_text(prompt, "the prompt")
    if not prompt.strip():
        raise UserError("the prompt is empty")
    return [prompt]


def batch_generator(seed: Optional[int], index: int) -> Optional[torch.Generator]:
    """The sampling generator of the ``index``-th batch of a prompts file (None when greedy: no seed).

    Batch 0 draws from ``seed`` itself (one prompt gives the text it always gave); batch ``k > 0``
    from a seed derived from ``(seed, k)``. A batch's text thus depends on its prompts and the seed
    only, never on what the batches before it drew: the same on one process and on Ray replicas."""
    if seed is None:
        return None
    if index:
        import numpy as np

        seed = int(np.random.SeedSequence([seed, index]).generate_state(1)[0]) & 0x7FFFFFFF
    return make_generator(seed)[0]


def make_sampler_generator(settings: GenerationSettings) -> tuple[Optional[torch.Generator], Optional[int]]:
    """A seeded generator when sampling (a fresh seed, reported back, when none was given)."""
    if settings.sampling.greedy:
        return None, None
    gen, seed = make_generator(settings.seed)
    return gen, seed
