"""A1111's prompt syntax and long prompts: attention weights in brackets, prompts in 75-token chunks.

Syntax (AUTOMATIC1111's web UI, ``prompt_parser.parse_prompt_attention``), parsed by
:func:`parse_prompt_attention` into ``[text, weight]`` runs:

- ``(words)`` multiplies the weight of ``words`` by 1.1, ``((words))`` by 1.21, ``[words]`` divides it
  by 1.1, ``(words:1.3)`` multiplies it by 1.3; brackets nest and multiply;
- ``\\(``, ``\\)``, ``\\[``, ``\\]`` and ``\\\\`` are the characters themselves;
- ``BREAK`` (in capitals, a word of its own) ends the current chunk;
- as in A1111, a ``(`` or ``[`` left open applies its multiplier up to the end of the prompt, and a
  ``)`` or ``]`` that closes nothing is text (:func:`bracket_notice` says so, for a warning).

Encoding (:func:`encode_chunks`), as A1111's ``FrozenCLIPEmbedderWithCustomWords`` does it: each run is
tokenized on its own, the tokens go into chunks of 75 (a chunk that fills up just after a comma no
more than 20 tokens back moves the words after that comma to the next chunk, A1111's
``comma_padding_backtrack``), each chunk becomes ``[BOS] + 75 tokens + [EOS]``, padded with EOS and,
after the first EOS, with the tokenizer's pad token (what diffusers' tokenizer pads with), and is
encoded on its own; the chunks' hidden states are concatenated along the tokens (77 * k). Where a
chunk has weights other than 1, its hidden states are multiplied token by token by their weights and
then rescaled so that their mean is the mean before weighting (A1111's "Original" emphasis; A1111
takes that mean over its whole batch, gencli over each prompt, the same for a batch of one prompt).
SDXL: both encoders chunk alike; the pooled embedding is that of the first chunk. A prompt of at
most 75 tokens without brackets gives the ids and the states diffusers' tokenizer and encoder give.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from gencli.errors import UserError

if TYPE_CHECKING:
    import torch

    from gencli.pipelines.diffusion.prompt_encoding import TextEncoderPart

CHUNK_LENGTH = 75  # tokens per chunk, BOS and EOS aside
COMMA_PADDING_BACKTRACK = 20  # A1111's default
ROUND_MULTIPLIER = 1.1
SQUARE_MULTIPLIER = 1 / 1.1
BREAK = "BREAK"

_ATTENTION = re.compile(
    r"""
    \\\(|\\\)|\\\[|\\]|\\\\|\\|   # escapes
    \(|\[|                         # openers
    :\s*([+-]?[.\d]+)\s*\)|        # an explicit weight closing a round bracket
    \)|]|                          # closers
    [^\\()\[\]:]+|                 # text
    :
    """,
    re.X,
)
_BREAK = re.compile(r"\s*\bBREAK\b\s*", re.S)


def parse_prompt_attention(text: str) -> list[list]:
    """``[[text, weight], ...]`` of a prompt in A1111's syntax (see the module doc); runs of equal
    weight are merged; ``BREAK`` is the run ``["BREAK", -1]``."""
    res: list[list] = []
    round_open: list[int] = []
    square_open: list[int] = []

    def multiply(start: int, by: float) -> None:
        for p in range(start, len(res)):
            res[p][1] *= by

    for m in _ATTENTION.finditer(text):
        piece, weight = m.group(0), m.group(1)
        if piece.startswith("\\"):
            res.append([piece[1:], 1.0])  # a lone backslash is dropped, as A1111 does
        elif piece == "(":
            round_open.append(len(res))
        elif piece == "[":
            square_open.append(len(res))
        elif weight is not None and round_open:
            try:
                value = float(weight)
            except ValueError:
                raise UserError(f"the prompt's weight ':{weight})' is not a number") from None
            multiply(round_open.pop(), value)
        elif piece == ")" and round_open:
            multiply(round_open.pop(), ROUND_MULTIPLIER)
        elif piece == "]" and square_open:
            multiply(square_open.pop(), SQUARE_MULTIPLIER)
        else:
            for i, part in enumerate(_BREAK.split(piece)):
                if i > 0:
                    res.append([BREAK, -1])
                res.append([part, 1.0])
    for pos in round_open:
        multiply(pos, ROUND_MULTIPLIER)
    for pos in square_open:
        multiply(pos, SQUARE_MULTIPLIER)
    if not res:
        res = [["", 1.0]]
    i = 0
    while i + 1 < len(res):
        if res[i][1] == res[i + 1][1] and res[i][1] != -1:
            res[i][0] += res[i + 1][0]
            res.pop(i + 1)
        else:
            i += 1
    return res


def bracket_notice(text: str) -> Optional[str]:
    """A warning line when the prompt's brackets do not balance (escapes aside), else None."""
    depth = {"(": 0, "[": 0}
    closes = {")": "(", "]": "["}
    stray = []
    for m in re.finditer(r"\\.|[()\[\]]", text):
        ch = m.group(0)
        if ch in depth:
            depth[ch] += 1
        elif ch in closes:
            if depth[closes[ch]]:
                depth[closes[ch]] -= 1
            else:
                stray.append(ch)
    unclosed = [ch for ch, n in depth.items() if n]
    if not unclosed and not stray:
        return None
    what = []
    if unclosed:
        what.append(f"'{unclosed[0]}' left open (weighted up to the end of the prompt)")
    if stray:
        what.append(f"'{stray[0]}' closing nothing (taken as text)")
    return f"unbalanced brackets in the prompt {text[:40]!r}{'...' if len(text) > 40 else ''}: " + " and ".join(what) + ", as A1111 reads them"


@dataclass
class PromptChunk:
    """One chunk: its 77 token ids and their weights."""

    tokens: list[int] = field(default_factory=list)
    multipliers: list[float] = field(default_factory=list)


def tokenize_chunks(tokenizer, text: str, *, weighting: bool = True) -> list[PromptChunk]:
    """A prompt's chunks (each 77 ids with BOS, EOS and padding; see the module doc)."""
    parsed = parse_prompt_attention(text) if weighting else [[text, 1.0]]
    comma = tokenizer.tokenize_ids(",")
    comma_id = comma[0] if len(comma) == 1 else None
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    chunks: list[PromptChunk] = []
    chunk = PromptChunk()
    last_comma = -1

    def next_chunk() -> None:
        nonlocal chunk, last_comma
        fill = CHUNK_LENGTH - len(chunk.tokens)
        tokens = [bos, *chunk.tokens, *([eos] * fill), eos]
        first_end = tokens.index(eos)
        tokens = tokens[: first_end + 1] + [pad] * (len(tokens) - first_end - 1)
        chunks.append(PromptChunk(tokens, [1.0, *chunk.multipliers, *([1.0] * fill), 1.0]))
        chunk = PromptChunk()
        last_comma = -1

    for part, weight in parsed:
        if part == BREAK and weight == -1:
            next_chunk()
            continue
        for token in tokenizer.tokenize_ids(part):
            if token == comma_id:
                last_comma = len(chunk.tokens)
            elif len(chunk.tokens) == CHUNK_LENGTH and last_comma != -1 and len(chunk.tokens) - last_comma <= COMMA_PADDING_BACKTRACK:
                cut = last_comma + 1
                moved = PromptChunk(chunk.tokens[cut:], chunk.multipliers[cut:])
                chunk = PromptChunk(chunk.tokens[:cut], chunk.multipliers[:cut])
                next_chunk()
                chunk = moved
            if len(chunk.tokens) == CHUNK_LENGTH:
                next_chunk()
            chunk.tokens.append(token)
            chunk.multipliers.append(float(weight))
    if chunk.tokens or not chunks:
        next_chunk()
    return chunks


def empty_chunk(tokenizer) -> PromptChunk:
    """The chunk of the empty prompt (what shorter prompts are padded with)."""
    return tokenize_chunks(tokenizer, "", weighting=False)[0]


def encode_chunks(part: "TextEncoderPart", rows: Sequence[list[PromptChunk]], *, skip: int, final_norm: bool) -> tuple["torch.Tensor", "torch.Tensor"]:
    """``(hidden (B, 77 * k, D), pooled of the first chunk (B, D'))`` for ``rows`` of ``k`` chunks each."""
    import torch

    from gencli.pipelines.clip.loading import encode_layer

    device = part.tower.final_layer_norm.weight.device
    eos = part.tokenizer.eos_token_id
    states, pooled = [], None
    for i in range(len(rows[0])):
        ids = torch.tensor([row[i].tokens for row in rows], dtype=torch.long, device=device)
        mask = None
        if part.use_attention_mask:
            ends = [row[i].tokens.index(eos) for row in rows]
            mask = torch.tensor([[1] * (e + 1) + [0] * (len(row[i].tokens) - e - 1) for e, row in zip(ends, rows)], device=device)
        h, p = encode_layer(part.encoder, ids, skip=skip, final_norm=final_norm, attention_mask=mask)
        weights = torch.tensor([row[i].multipliers for row in rows], dtype=torch.float32, device=h.device)
        if bool((weights != 1.0).any()):
            z = h.float()
            before = z.mean(dim=(1, 2), keepdim=True)
            z = z * weights[..., None]
            after = z.mean(dim=(1, 2), keepdim=True)
            h = (z * (before / after)).to(h.dtype)
        states.append(h)
        if i == 0:
            pooled = p
    return torch.cat(states, dim=1), pooled


__all__ = [
    "CHUNK_LENGTH",
    "PromptChunk",
    "parse_prompt_attention",
    "bracket_notice",
    "tokenize_chunks",
    "empty_chunk",
    "encode_chunks",
]
