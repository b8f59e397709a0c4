"""File conventions shared by all commands (no torch): atomic outputs, no silent overwrite, inputs from
arguments, directories or stdin.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Optional, Sequence

from gencli.errors import UserError


def read_json(path: str | os.PathLike, *, expect: type = dict, missing_ok: bool = False) -> Optional[Any]:
    """A JSON side file (config, index, tokenizer or preprocessor file): its value, which must be a
    ``expect`` (object by default). Unreadable, invalid or mis-typed files are one clear UserError;
    an absent file is None with ``missing_ok``, else an error too."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if missing_ok:
            return None
        raise UserError(f"'{p}' does not exist") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"'{p}' is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read '{p}': {getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(data, expect):
        raise UserError(f"'{p}' must hold a JSON {'object' if expect is dict else 'list' if expect is list else expect.__name__}")
    return data


def ensure_writable(path: str | os.PathLike, force: bool = False) -> Path:
    """Check up front (before any long work) that ``path`` may be written.

    Refuses an existing file unless ``force`` and a missing parent directory; returns the Path.
    A device or pipe (``/dev/null``, ``/dev/stdout``, a FIFO) is always writable: nothing is lost.
    """
    p = Path(path)
    if p.is_dir():
        raise UserError(f"output '{p}' is a directory")
    if is_special_file(p):
        return p
    if p.exists() and not force:
        raise UserError(f"output '{p}' already exists (use --force to overwrite)")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"output directory '{parent}' does not exist")
    if not os.access(parent, os.W_OK):
        raise UserError(f"output directory '{parent}' is not writable")
    return p


def is_special_file(path: Path) -> bool:
    """A character device or a FIFO: written in place, never replaced by a rename."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success rename it onto ``path`` atomically.

    On any error the temporary file is removed and ``path`` is untouched: an output is never
    half-written. The existence check is repeated at the end, so a file that appeared meanwhile
    is not clobbered without ``force``. A device or pipe is yielded as is (written in place).
    """
    target = ensure_writable(path, force)
    if is_special_file(target):
        yield target
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp" + target.suffix, dir=target.parent if str(target.parent) else ".")
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if target.exists() and not force:
            raise UserError(f"output '{target}' already exists (use --force to overwrite)")
        os.replace(tmp_path, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", force: bool = False, **kwargs) -> Iterator[IO]:
    """``open()`` for writing through :func:`atomic_path`."""
    with atomic_path(path, force) as tmp:
        with open(tmp, mode, **kwargs) as fh:
            yield fh


def atomic_write_bytes(path: str | os.PathLike, data: bytes, force: bool = False) -> Path:
    with atomic_open(path, "wb", force) as fh:
        fh.write(data)
    return Path(path)


def read_stdin_lines() -> list[str]:
    """Non-empty, stripped lines from stdin (only ever called when the user passed ``-``)."""
    return [line.strip() for line in sys.stdin if line.strip()]


def expand_inputs(args: Sequence[str], *, recursive: bool = False, extensions: Iterable[str] | None = None) -> list[str]:
    """Expand command-line inputs into a list of file paths, keeping their order.

    ``-`` reads one path per line from stdin; a directory contributes its files with the given
    extensions (recursively with ``recursive``). Paths that do not exist are kept as given so the
    caller can report them per file without losing the others.
    """
    exts = {e.lower() for e in extensions} if extensions else None
    out: list[str] = []
    for arg in args:
        if arg == "-":
            out.extend(read_stdin_lines())
            continue
        p = Path(arg)
        if p.is_dir():
            walker = p.rglob("*") if recursive else p.iterdir()
            files = sorted(str(f) for f in walker if f.is_file() and (exts is None or f.suffix.lower() in exts))
            out.extend(files)
        else:
            out.append(arg)
    if not out:
        raise UserError("no inputs given")
    return out
