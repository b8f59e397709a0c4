"""The seed type every command shares (no torch): one range, one parser, one message.

A seed is an integer from 0 to 2**32 - 1 (what every front end's seed field holds and what a PNG's
``Seed:`` records). ``--seed``, ``--seeds``, a prompts file's ``seed``/``seeds`` and a replayed PNG's
seed are checked here; a value outside the range is refused, never wrapped.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from gencli.errors import UserError

MAX_SEED = 2**32 - 1
MAX_SAMPLES = 4096  # -n and --seeds of the sampling commands beyond this are refused (one grid, one process)


def check_seed(value: Any, what: str = "--seed") -> int:
    """``value`` as a seed, or one UserError naming ``what`` (the flag or file it came from)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise UserError(f"{what} must be an integer from 0 to {MAX_SEED} (2**32 - 1), got {value!r}")
    return int(value)


def parse_seeds(spec: Any, *, limit: int, what: str = "--seeds") -> list[int]:
    """``"0-15,40"`` (or a list of seeds) -> ``[0, 1, ..., 15, 40]``: ranges inclusive, order
    kept, every seed in range (:data:`MAX_SEED`), at most ``limit`` seeds."""
    text = ",".join(map(str, spec)) if isinstance(spec, (list, tuple)) else str(spec)
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise UserError(f"{what} '{text}' does not parse: expected seeds and ranges such as 0-15,40 (bad part '{part}')")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise UserError(f"{what} '{text}' does not parse: the range '{part}' runs backwards")
        if hi > MAX_SEED:
            raise UserError(f"{what} '{text}': seed {hi} is above {MAX_SEED} (seeds are 0 to 2**32 - 1)")
        if len(seeds) + hi - lo + 1 > limit:
            raise UserError(f"{what} '{text}' names more than {limit} seeds")
        seeds.extend(range(lo, hi + 1))
    return seeds


def choose_seeds(n: Any, seeds: Any, seed: Any, *, default_count: int, new_seed: Callable[[], int], limit: int = MAX_SAMPLES) -> list[int]:
    """The seeds of a sampling run: ``--seeds`` lists them; ``--seed S -n N`` gives ``S, ..., S+N-1``
    (``N`` defaults to ``default_count``); without a seed ``new_seed()`` draws the first. ``-n`` and
    ``--seeds`` together are refused, as is a count outside ``1..limit``."""
    if seeds is not None:
        if n is not None:
            raise UserError("give -n (seeds --seed, --seed+1, ...) or --seeds (the exact seeds), not both")
        if seed is not None:
            raise UserError("give --seed (the first of -n seeds) or --seeds (the exact seeds), not both")
        return parse_seeds(seeds, limit=limit)
    count = default_count if n is None else n
    if not 1 <= count <= limit:
        raise UserError(f"-n must be between 1 and {limit}, got {count}")
    base = check_seed(seed) if seed is not None else new_seed()
    return [check_seed(base + k, f"--seed {base} with -n {count}: seed") for k in range(count)]


__all__ = ["MAX_SAMPLES", "MAX_SEED", "check_seed", "choose_seeds", "parse_seeds"]
