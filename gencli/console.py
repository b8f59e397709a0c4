"""The output layer every command and pipeline shares (no torch): stderr lines, JSON lines, tables,
CSV rows, output files, human-readable numbers, and :class:`Reporter`, the small typed object a
pipeline receives to report progress, logs and warnings.

stdout carries results only (text, JSON lines, tables, CSV); logs, progress, warnings and errors go
to stderr. It sits below ``cli`` and ``pipelines`` (and imports neither), so a pipeline reports
through a :class:`Reporter` or callbacks and never reaches up into the command-line layer.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Iterator, Optional

from rich.console import Console

# Logs, progress and errors: always stderr. stdout carries results only.
stderr = Console(stderr=True, highlight=False, soft_wrap=True)

Advance = Callable[..., None]  # advance(n=1, description=None): one step of a progress bar


# -- stdout: results -------------------------------------------------------------------------------
def json_line(obj: Any) -> str:
    """One JSON object as one line (UTF-8 kept as is), newline included; a NaN or infinite float (a
    model's NaN score) is written as null, so that every line is valid JSON."""
    return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False) + "\n"


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def emit_json(obj: Any, file: Optional[IO[str]] = None) -> None:
    """Write one JSON object as one line on stdout (or ``file``) and flush (JSON lines for pipelines)."""
    out = sys.stdout if file is None else file
    out.write(json_line(obj))
    out.flush()


def csv_field(value: Any) -> str:
    """One CSV field: quoted (quotes doubled) when it holds a comma, a quote or a line break."""
    s = str(value)
    if any(c in s for c in ',"\n\r'):
        return '"' + s.replace('"', '""') + '"'
    return s


def csv_line(values: Iterable[Any]) -> str:
    """One CSV row, newline included."""
    return ",".join(csv_field(v) for v in values) + "\n"


class ResultConsole(Console):
    """A rich console for results: a closed reader is a ``BrokenPipeError`` that the command's
    :class:`StdoutGuard` policy and exit code decide on (rich itself would exit 1)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


# Wide enough that no table column is ever wrapped or cut when the output is not a terminal.
UNLIMITED_WIDTH = 1_000_000


def is_terminal(file: Optional[IO[str]] = None) -> bool:
    """Whether ``file`` (default: stdout) is a terminal a person reads."""
    f = sys.stdout if file is None else file
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def stdout_console(file: Optional[IO[str]] = None) -> Console:
    """A rich console for human-facing results (tables, summaries) on stdout or ``file``.

    On a terminal it fits the window. Anywhere else (a pipe, a file) it writes plain rows: no
    colour, no wrapping, no truncation, so ``grep``, ``awk`` and ``sort`` see whole lines.
    """
    if is_terminal(file):
        return ResultConsole(file=file, highlight=False, soft_wrap=True)
    return ResultConsole(file=file, highlight=False, soft_wrap=True, width=UNLIMITED_WIDTH, color_system=None, force_terminal=False, emoji=False)


def print_table(table: Any, file: Optional[IO[str]] = None) -> None:
    """A rich table on stdout or into ``file``: fitted to a terminal, else plain whole rows."""
    out = stdout_console(file)
    if is_terminal(file):
        out.print(table)
        return
    # plain rows: the table is measured without a width limit, and no cell is padded at the line end
    with out.capture() as cap:
        out.print(table, crop=False)
    out.file.write("".join(line.rstrip() + "\n" for line in cap.get().splitlines()))


@contextlib.contextmanager
def open_output(path: Optional[str], force: bool = False, *, newline: Optional[str] = None) -> Iterator[IO[str]]:
    """Where a command writes its results: the file ``path`` (written atomically, never
    overwritten without ``force``), or stdout when ``path`` is None or ``-``."""
    from gencli.io import atomic_open, is_stdout

    if path is None or is_stdout(path):
        yield sys.stdout
        return

    with atomic_open(path, "w", force, encoding="utf-8", newline=newline) as fh:
        yield fh


# -- stdout as a shell citizen ---------------------------------------------------------------------
class StdoutGuard:
    """``sys.stdout`` during a command: what happens when stdout cannot be written.

    * The reader went away (``| head``): stdout is pointed at /dev/null. If an output file is being
      written (``--out``, ``--plot`` ...), the run goes on and finishes it, its stdout discarded;
      otherwise ``BrokenPipeError`` ends the run (exit 0: nobody wants the rest).
    * The write was refused (``> /dev/full``, a full disk): :class:`gencli.io.CannotWrite`
      ("cannot write stdout: No space left on device", exit 2).

    Everything else is the wrapped stream's (``isatty``, ``encoding``, ``buffer``...).
    """

    def __init__(self, stream: IO[str]):
        self.stream = stream
        self.discarding = False

    def write(self, text: str) -> int:
        if self.discarding:
            return len(text)
        try:
            return self.stream.write(text)
        except OSError as exc:
            self._failed(exc)
            return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.discarding:
            return
        try:
            self.stream.flush()
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        from gencli.io import cannot_write, is_write_failure, outputs_in_progress

        broken = isinstance(exc, BrokenPipeError)
        if not broken and not is_write_failure(exc):
            raise exc
        self._silence()
        if not broken:
            raise cannot_write("stdout", exc) from None
        if outputs_in_progress():
            self.discarding = True  # finish the requested files; the rest of stdout goes nowhere
            return
        raise exc

    def _silence(self) -> None:
        """Point stdout's descriptor at /dev/null, so no later flush (at exit too) fails again."""
        import os

        with contextlib.suppress(Exception):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def guarded_stdout() -> Iterator[StdoutGuard]:
    """Run a command with ``sys.stdout`` wrapped in a :class:`StdoutGuard` (restored afterwards)."""
    original = sys.stdout
    guard = original if isinstance(original, StdoutGuard) else StdoutGuard(original)
    sys.stdout = guard
    try:
        yield guard
    finally:
        sys.stdout = original


# -- numbers for people ------------------------------------------------------------------------------
def human_count(n: float) -> str:
    """1234 -> '1.2K', 124_439_808 -> '124.4M'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


def human_bytes(n: float) -> str:
    """Decimal units, as file managers and hubs show sizes: 18_153_600 -> '18.2 MB'."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


# -- stderr: the reporter -------------------------------------------------------------------------------
@dataclass
class Reporter:
    """How a run talks to its user on stderr, and whether its results are JSON lines.

    ``quiet`` silences everything but errors; ``verbose`` adds :meth:`debug` lines (choices,
    timings); informational :meth:`log` lines appear on a terminal or with ``verbose``; progress
    bars only on a terminal. ``json`` says the results go to stdout as JSON lines.
    """

    quiet: bool = False
    verbose: bool = False
    json: bool = False

    @property
    def interactive(self) -> bool:
        """Human-facing extras (progress bars, info logs) only on a terminal and not --quiet."""
        return not self.quiet and stderr.is_terminal

    def log(self, message: str) -> None:
        """An informational line: shown on a terminal or with --verbose, never with --quiet."""
        if not self.quiet and (self.verbose or stderr.is_terminal):
            stderr.print(message, markup=False)

    def debug(self, message: str) -> None:
        """A line shown only with --verbose (device/dtype choices, timings)."""
        if self.verbose and not self.quiet:
            stderr.print(message, markup=False)

    def say(self, message: str) -> None:
        """A report the user asked for (not only on terminals); silent with --quiet."""
        if not self.quiet:
            stderr.print(message, markup=False)

    def warn(self, message: str) -> None:
        """A warning; shown unless --quiet."""
        if not self.quiet:
            stderr.print(f"warning: {message}", markup=False, style="yellow")

    def error(self, message: str) -> None:
        """An error line (always shown): one input failed, or the run failed."""
        stderr.print(f"error: {message}", markup=False, style="red")

    @contextlib.contextmanager
    def progress(self, description: str, total: Optional[float] = None) -> Iterator[Advance]:
        """A rich progress bar on stderr when it is a terminal; a no-op in pipelines and with --quiet.

        Yields ``advance(n=1, description=None)``.
        """
        if not self.interactive:
            yield lambda n=1, description=None: None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
        if total is not None:
            columns += [MofNCompleteColumn(), TimeRemainingColumn()]
        columns.append(TimeElapsedColumn())
        with Progress(*columns, console=stderr, transient=True) as bar:
            task = bar.add_task(description, total=total)

            def advance(n: float = 1, description: Optional[str] = None) -> None:
                bar.update(task, advance=n, **({"description": description} if description else {}))

            yield advance


__all__ = [
    "stderr",
    "Advance",
    "json_line",
    "emit_json",
    "csv_field",
    "csv_line",
    "UNLIMITED_WIDTH",
    "is_terminal",
    "stdout_console",
    "print_table",
    "StdoutGuard",
    "guarded_stdout",
    "open_output",
    "human_count",
    "human_bytes",
    "Reporter",
]
