"""Running a command body under the exit-code contract: errors as one line (exit 2 or 1), Ctrl-C and
SIGTERM/SIGHUP after removing partial outputs, a closed stdout, notices from below as warning lines."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import traceback
import warnings
from typing import Any, Callable, Iterator

import typer

from gencli.cli.options import RunOptions
from gencli.console import guarded_stdout, stderr
from gencli.errors import Notice, Reported, Terminated, UserError


def _terminate(signum: int, frame: Any) -> None:
    from gencli.backend.interrupt import note_signal

    note_signal(signum)  # raised again by the long loops' checks, should this exception be lost
    raise Terminated(signum)


@contextlib.contextmanager
def _termination_as_exception() -> Iterator[None]:
    """SIGTERM/SIGHUP raise :class:`Terminated` while a command runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _notices_as_warnings(opts: RunOptions) -> Iterator[None]:
    """:class:`gencli.errors.Notice` warnings raised below the command line become ``warning:`` lines
    (once each); another library's warning is one ``warning:`` line too (its first line and its
    category), shown as Python shows it (file, line, source) only with --debug."""
    with warnings.catch_warnings():
        original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, Notice):
                opts.report.warn(str(message))
            elif opts.debug:
                original(message, category, filename, lineno, file, line)
            else:
                first = next((part.strip() for part in str(message).splitlines() if part.strip()), "")
                opts.report.warn(f"{first} ({category.__name__})")

        warnings.simplefilter("default", Notice)
        warnings.showwarning = show
        yield


def run_guarded(opts: RunOptions, body: Callable[[], Any]) -> Any:
    """Run a command body, mapping errors onto the exit-code contract.

    UserError (a refused write too: disk full) -> one line on stderr, exit 2 (none more for
    :class:`~gencli.errors.Reported`, whose line is out already). Anything unexpected ->
    one line (traceback with --debug), exit 1. Ctrl-C -> exit 130; SIGTERM -> 143 (SIGHUP -> 129),
    both after removing partial outputs. A closed stdout (``| head``) -> exit 0, once the output
    files the run was writing are finished (see :class:`gencli.console.StdoutGuard`).
    """
    from gencli.backend.interrupt import clear_interrupt
    from gencli.io import forget_pending_outputs

    try:
        with _termination_as_exception(), guarded_stdout(), _notices_as_warnings(opts):
            result = body()
            sys.stdout.flush()
            return result
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except UserError as exc:
        if opts.debug:
            traceback.print_exc()
        if not isinstance(exc, Reported):
            opts.report.error(str(exc))
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        stderr.print("interrupted", markup=False)
        raise typer.Exit(130) from None
    except Terminated as exc:
        stderr.print(f"terminated ({signal.Signals(exc.signum).name})", markup=False)
        raise typer.Exit(128 + exc.signum) from None
    except BrokenPipeError:
        # the reader of our stdout went away (e.g. `| head`) and no output file was pending: not an
        # error of ours; stdout already points at /dev/null, so nothing fails at exit either
        raise typer.Exit(0) from None
    except Exception as exc:  # noqa: BLE001 - the contract: exit 1 for internal errors
        if opts.debug:
            traceback.print_exc()
            stderr.print(f"internal error: {type(exc).__name__}: {exc}", markup=False, style="red")
        else:
            stderr.print(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", markup=False, style="red")
        raise typer.Exit(1) from None
    finally:
        clear_interrupt()
        forget_pending_outputs()


def usage_error_line(exc: typer.TyperException) -> str:
    """A click/typer usage error as the one ``error:`` line of the contract."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return f"error: {message}{hint}"

