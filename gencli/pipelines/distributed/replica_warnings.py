"""Warnings raised inside Ray workers, shown on the driver's stderr once each.

A worker's stderr is not the user's (and with several replicas each would print the same line), so a
replica or reader task reports through a :class:`ReplicaReporter` that keeps its warnings; they
travel back with the batch results (a ``warnings`` column holding a JSON list) and the driver's
:class:`ForwardedWarnings` prints each once, as the single-process run prints it once.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Optional

from gencli.console import Reporter


@dataclass
class ReplicaReporter(Reporter):
    """The :class:`~gencli.console.Reporter` of a Ray replica or task: it prints nothing (a worker's
    stderr is not the user's), but keeps each warning, once, for :meth:`take` to send back to the
    driver with the batch's results, where :class:`ForwardedWarnings` prints it. Python warnings
    raised inside :meth:`collecting` are kept too (as ``Category: message``)."""

    quiet: bool = True
    pending: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)

    def warn(self, message: str) -> None:
        if message not in self.seen:
            self.seen.add(message)
            self.pending.append(message)

    @contextlib.contextmanager
    def collecting(self) -> Iterator["ReplicaReporter"]:
        """Keep the Python warnings raised in the block (the single process shows them on stderr)."""
        with warnings.catch_warnings(record=True) as caught:  # the worker's filters: those of a single process
            yield self
        for w in caught:
            self.warn(f"{w.category.__name__}: {w.message}")

    def take(self) -> str:
        """The warnings kept since the last call, as a JSON list: one value of a result column."""
        out, self.pending = json.dumps(self.pending), []
        return out


class ForwardedWarnings:
    """The driver's end of :class:`ReplicaReporter`: each warning a worker sent back is shown once
    (every replica loads the same model and may warn the same), through the run's reporter."""

    def __init__(self, report: Reporter):
        self.report = report
        self.shown: set[str] = set()

    def __call__(self, payload: Optional[str]) -> None:
        for message in json.loads(payload or "[]"):
            if message not in self.shown:
                self.shown.add(message)
                self.report.warn(message)


__all__ = ["ReplicaReporter", "ForwardedWarnings"]
