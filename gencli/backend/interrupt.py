"""A pending termination, checked where long computations can stop cleanly (no torch, no I/O).

The command line's SIGTERM/SIGHUP handler records the signal here and raises
:class:`~gencli.errors.Terminated`. Where that exception can be lost (raised inside a callback whose
errors are ignored, a finaliser, a library's ``except BaseException``), the run would go on to the
end; so the long loops (each UNet block, each VAE tile) call :func:`check_interrupt`, which raises
it again while the signal is pending. Models stay pure: this is a flag and a comparison.
"""

from __future__ import annotations

from gencli.errors import Terminated

_PENDING: list[int] = []


def note_signal(signum: int) -> None:
    """A termination signal arrived: the next :func:`check_interrupt` raises."""
    if not _PENDING:
        _PENDING.append(signum)


def check_interrupt() -> None:
    """Raise :class:`~gencli.errors.Terminated` if a termination signal is pending (cheap: call it often)."""
    if _PENDING:
        raise Terminated(_PENDING[0])


def clear_interrupt() -> None:
    """The run is over: no signal is pending any more."""
    _PENDING.clear()


__all__ = ["note_signal", "check_interrupt", "clear_interrupt"]
