"""Turning a growing list of token ids into text pieces as they arrive.

:class:`IncrementalDetokenizer` decodes a small sliding window of ids and emits only what the newest
tokens added, so each step costs O(1) and the result equals decoding the whole sequence:

- a multi-byte character split over several byte tokens is held back until it is complete (a
  window that decodes to a trailing U+FFFD is incomplete), so no broken character is ever printed;
- tokenizers that drop a leading space when decoding from the start of a sequence (sentencepiece's
  dummy prefix, the Metaspace decoder) still give the right spacing, because the window always starts
  a few tokens back, inside already-printed text.

:class:`StopStringMatcher` finds stop strings in the decoded text across token boundaries and holds
back any tail that could still become one, so a stop string is never printed, even in part.
"""

from __future__ import annotations

from typing import Optional, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, context_ids: Sequence[int] = (), *, context_window: int = 6, skip_special_tokens: bool = True):
        """``context_ids``: the prompt's ids; its last few tokens seed the window so the first
        generated token decodes with its real leading space."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(context_ids[-context_window:]) if context_window else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly '')."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            # keep the window short: drop ids that no longer take part
            if self.prefix_offset > 64:
                self.ids = self.ids[self.prefix_offset :]
                self.read_offset -= self.prefix_offset
                self.prefix_offset = 0
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes as U+FFFD)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


class StopStringMatcher:
    """Accumulates decoded text; releases what can safely be shown and detects stop strings."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.released = 0  # characters of self.text already handed out
        self.stopped: Optional[str] = None  # the stop string found

    def _held_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def feed(self, piece: str) -> str:
        """Add decoded text; return the part that may be shown now ('' once a stop string matched)."""
        if self.stopped is not None or not piece:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += piece
        if self.stops:
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                cut, stop = min(hits)
                self.stopped = stop
                self.text = self.text[:cut]
                out = self.text[self.released :]
                self.released = len(self.text)
                return out
        safe = len(self.text) - self._held_tail()
        out = self.text[self.released : safe]
        self.released = max(self.released, safe)
        return out

    def finish(self) -> str:
        """The rest of the text at the end of generation (a held tail that never became a stop string)."""
        out = self.text[self.released :]
        self.released = len(self.text)
        return out
