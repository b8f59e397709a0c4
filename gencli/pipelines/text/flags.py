"""The decoding flags of ``gencli generate``, ``text2text`` and ``translate``, checked in one place
before anything is loaded: every number finite and in its range (:data:`RANGES`), else one line
naming the flag and the value.

The temperature and the repetition penalty divide (or multiply) fp32 logits: beyond
:data:`SCALE_LIMITS` the logits overflow to infinity or round to zero and sampling draws from NaNs
(a temperature of 1e-300 is 0 in fp32, 1e300 infinite). The length penalty is an exponent of a
beam's length: beyond :data:`LENGTH_PENALTY_LIMIT` the long beams' scores overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from gencli.errors import UserError

SCALE_LIMITS = (1e-6, 1e6)  # temperature (besides 0 = greedy), repetition penalty
LENGTH_PENALTY_LIMIT = 10.0

Number = Union[int, float]


@dataclass(frozen=True)
class Range:
    """The values a numeric flag takes: from ``low`` (excluded with ``open_low``) to ``high``, and 0
    too with ``zero`` (temperature 0 = greedy); ``text`` says so in the error line."""

    text: str
    low: float
    high: float = math.inf
    open_low: bool = False
    zero: bool = False

    def holds(self, value: Number) -> bool:
        if isinstance(value, float) and not math.isfinite(value):  # (an int of any size compares as it is)
            return False
        if self.zero and value == 0:
            return True
        return (value > self.low if self.open_low else value >= self.low) and value <= self.high


_LOW, _HIGH = SCALE_LIMITS
RANGES: dict[str, Range] = {
    "max_new_tokens": Range("at least 1", 1),
    "min_new_tokens": Range(">= 0", 0),
    "num_beams": Range("at least 1", 1),
    "num_return_sequences": Range("at least 1", 1),
    "no_repeat_ngram_size": Range(">= 0 (0 = off)", 0),
    "top_k": Range(">= 0 (0 = off)", 0),
    "temperature": Range(f"0 (greedy) or from {_LOW:g} to {_HIGH:g}", _LOW, _HIGH, zero=True),
    "top_p": Range("in (0, 1] (1 = off)", 0, 1, open_low=True),
    "min_p": Range("in [0, 1] (0 = off)", 0, 1),
    "repetition_penalty": Range(f"from {_LOW:g} to {_HIGH:g} (1 = off)", _LOW, _HIGH),
    "length_penalty": Range(f"from {-LENGTH_PENALTY_LIMIT:g} to {LENGTH_PENALTY_LIMIT:g} (> 0 favours longer outputs)", -LENGTH_PENALTY_LIMIT,
                            LENGTH_PENALTY_LIMIT),
}  # fmt: skip


def flag_name(key: str) -> str:
    """``top_p`` -> ``--top-p``."""
    return "--" + key.replace("_", "-")


def check_number(key: str, value: Optional[Number]) -> None:
    """One decoding flag (``key`` as in :data:`RANGES`) against its range; None = not given."""
    if value is None:
        return
    if not RANGES[key].holds(value):
        raise UserError(f"{flag_name(key)} must be {RANGES[key].text}, got {value!r}")


def check_decoding_flags(*, stop: Optional[Sequence[str]] = None, **values: Optional[Number]) -> None:
    """Reject out-of-range decoding flags (the keys of :data:`RANGES`; None = not given) and
    combinations that cannot hold, before anything is loaded."""
    unknown = sorted(set(values) - set(RANGES))
    if unknown:
        raise TypeError(f"not a decoding flag: {', '.join(unknown)}")
    if any(s == "" for s in stop or ()):
        raise UserError("--stop takes a non-empty string (an empty one would match before the first token)")
    for key, value in values.items():
        check_number(key, value)
    beams, returns = values.get("num_beams"), values.get("num_return_sequences")
    if beams is not None and beams > 1 and returns is not None and returns > beams:
        raise UserError(f"--num-return-sequences ({returns}) is more than --num-beams ({beams}): at most one sequence per beam")
    check_min_new_tokens(values.get("min_new_tokens"), values.get("max_new_tokens"))


def check_returns(beams: int, returns: int, greedy: bool, returns_from_config: bool = False) -> None:
    """Several outputs an input come from beam search (at most one a beam) or from sampling (as many as
    asked); greedy decoding has one. ``returns_from_config``: the number came from the checkpoint's
    generation config, not the flag (the message says so)."""
    what = f"generation_config.json's num_return_sequences ({returns})" if returns_from_config else f"--num-return-sequences ({returns})"
    if beams > 1 and returns > beams:
        raise UserError(f"{what} is more than the {beams} beam(s): at most one sequence per beam (raise --num-beams)")
    if beams == 1 and returns > 1 and greedy:
        raise UserError(
            f"{what} needs sampling (--temperature above 0) or beam search (--num-beams {returns} or more): greedy decoding gives one output"
            + (" (or give --num-return-sequences 1)" if returns_from_config else "")
        )


def check_min_new_tokens(min_new: Optional[int], max_new: Optional[int], budget: str = "--max-new-tokens") -> None:
    """``--min-new-tokens`` above the budget of new tokens (``budget`` names where it comes from)
    could never be honoured: an error, not an output that silently stops short."""
    if min_new is not None and max_new is not None and min_new > max_new:
        raise UserError(f"--min-new-tokens ({min_new}) is more than {budget} ({max_new}): lower it or raise --max-new-tokens")


# -- a checkpoint's generation config --------------------------------------------------------------
# the settings a generation_config.json (or an old config.json) holds, checked as the flags are: a value
# of the wrong type or out of range is one error line naming the file, the key and the value, before
# decoding, never an internal error deep in the loop or a silently odd decoding (a negative
# temperature inverts the distribution, a negative budget overflows the KV cache)
_CONFIG_INTS: dict[str, Range] = {
    "max_new_tokens": RANGES["max_new_tokens"],
    "max_length": Range("at least 1", 1),
    "min_new_tokens": RANGES["min_new_tokens"],
    "min_length": Range(">= 0", 0),
    "num_beams": RANGES["num_beams"],
    "num_return_sequences": RANGES["num_return_sequences"],
    "top_k": RANGES["top_k"],
    "no_repeat_ngram_size": RANGES["no_repeat_ngram_size"],
}
_CONFIG_FLOATS: dict[str, Range] = {
    "temperature": RANGES["temperature"],
    "top_p": Range("in [0, 1] (1 = off)", 0, 1),  # transformers takes 0 (the top token only)
    "min_p": RANGES["min_p"],
    "repetition_penalty": RANGES["repetition_penalty"],
    "length_penalty": RANGES["length_penalty"],
}
# token ids the model reads back (its decoder's first token, tokens forced into the scores): within the vocabulary
_CONFIG_INPUT_IDS = ("decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id")
# token ids only compared with the chosen ones (pad -1 is what some Llama conversions carry): integers
_CONFIG_IDS = ("eos_token_id", "pad_token_id", "bos_token_id")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_generation_config(config: dict, where: str, vocab_size: Optional[int] = None) -> None:
    """The generation settings of ``config`` (a generation_config.json, or the generation keys of a
    config.json; named ``where`` in the error) against the flags' ranges; ``None`` values are unset.
    Token ids are integers (or lists of them), those fed to the model within ``vocab_size``."""

    def bad(key: str, text: str, value: object) -> UserError:
        return UserError(f"{where}: {key} must be {text}, got {value!r}")

    for key, value in config.items():
        if value is None:
            continue
        if key == "do_sample" and not isinstance(value, bool):
            raise bad(key, "true or false", value)
        if key in _CONFIG_INTS:
            if not _is_int(value) or not _CONFIG_INTS[key].holds(value):
                raise bad(key, f"an integer {_CONFIG_INTS[key].text}", value)
        elif key in _CONFIG_FLOATS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _CONFIG_FLOATS[key].holds(value):
                raise bad(key, f"a number {_CONFIG_FLOATS[key].text}", value)
        elif key in _CONFIG_IDS or key in _CONFIG_INPUT_IDS:
            ids = value if isinstance(value, list) else [value]
            if not all(v is None or _is_int(v) for v in ids):
                raise bad(key, "a token id (an integer) or a list of them", value)
            if key in _CONFIG_INPUT_IDS and vocab_size is not None and any(v is not None and not 0 <= v < vocab_size for v in ids):
                raise bad(key, f"a token id from 0 to {vocab_size - 1} (the model's vocabulary)", value)
        elif key == "bad_words_ids":
            lists = value if isinstance(value, list) else None
            if lists is None or not all(isinstance(w, list) and all(_is_int(v) for v in w) for w in lists):
                raise bad(key, "a list of lists of token ids", value)
            if vocab_size is not None and any(not 0 <= v < vocab_size for w in lists for v in w):
                raise bad(key, f"lists of token ids from 0 to {vocab_size - 1} (the model's vocabulary)", value)


def usable_pad_id(candidates: Sequence[int], vocab_size: int) -> int:
    """The padding token: the first of ``candidates`` inside the vocabulary (a pad id of -1, or one past
    the embedding, would be looked up for the padded slots), else 0 (padding is masked: any id does)."""
    return next((i for i in candidates if 0 <= i < vocab_size), 0)


__all__ = ["LENGTH_PENALTY_LIMIT", "RANGES", "Range", "SCALE_LIMITS", "check_decoding_flags", "check_generation_config", "check_min_new_tokens",
           "check_number", "check_returns", "flag_name", "usable_pad_id"]  # fmt: skip
