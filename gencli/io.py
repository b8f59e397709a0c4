"""File conventions shared by all commands (no torch): atomic outputs, no silent overwrite, inputs from
arguments, directories or stdin.

An output file is written to a temporary file next to it and renamed into place when complete, so a
crash, Ctrl-C or SIGTERM never leaves half a file. The result looks like a plain ``open()`` had
written it: a new file gets the mode the umask gives (0666 & ~umask), a replaced file keeps its
mode, a symlink is written through (its target is replaced, the link stays). ``-`` means stdout, and
a device or a pipe (``/dev/null``, ``/dev/stdout``, a FIFO) is written in place. A full disk or
another failed write is one clear :class:`~gencli.errors.UserError` naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Optional, Sequence

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


def ensure_writable(path: str | os.PathLike, force: bool = False, *, new_folder: bool = False) -> Path:
    """Check up front (before any long work) that ``path`` may be written.

    Refuses an existing file unless ``force``, a missing parent directory and a name the system
    cannot hold; returns the Path. ``-`` (stdout), a device or a pipe (``/dev/null``, a FIFO) and a
    descriptor's name (``/dev/stdout``, ``/dev/fd/N``) are written in place and always writable:
    nothing is lost. A symlink is checked as the file it points to. ``new_folder``: the parent is
    a folder the command creates (``--out-dir``), so only the name is checked.
    """
    if is_stdout(path):
        return Path(STDOUT)
    if not os.fspath(path):
        raise UserError("the output name is empty: give a file name")
    p = Path(path)
    if new_folder and not p.parent.exists():
        if len(os.fsencode(p.name)) > 255:
            raise UserError(f"output '{p}': file name too long")
        return p
    try:
        if is_in_place(p):
            return p
        if p.is_dir():
            raise UserError(f"output '{p}' is a directory")
        if p.exists() and not force:
            raise UserError(f"output '{p}' already exists (use --force to overwrite)")
        parent = _resolved(p).parent
        if not parent.is_dir():
            raise UserError(f"output directory '{parent}' {'is a file, not a directory' if parent.exists() else 'does not exist'}")
    except OSError as exc:
        raise bad_name(p, exc) from None
    if not os.access(parent, os.W_OK):
        raise UserError(f"output directory '{parent}' is not writable")
    name_max = _name_max(parent)
    if len(os.fsencode(p.name)) > name_max:
        raise UserError(f"output '{p}': file name too long (this file system allows {name_max} bytes)")
    return p


def bad_name(p: Path, exc: OSError) -> UserError:
    """The one-line error for a path the system refuses to look up (too long, a loop...)."""
    return UserError(f"output '{p}': {exc.strerror or exc}")


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


# Names of an open descriptor rather than of a file: written in place, whatever they point at
# (a redirect's regular file too: the shell opened it, the command writes into it).
DESCRIPTOR_NAMES = ("/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/self/fd/")


def names_stdout(path: str | os.PathLike | None) -> bool:
    """Whether an output named ``path`` is this process's stdout: ``-``, ``/dev/stdout`` or
    descriptor 1's name (``/dev/fd/1``, ``/proc/self/fd/1``)."""
    return path is not None and (is_stdout(path) or os.fspath(path) in ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"))


def is_in_place(path: str | os.PathLike) -> bool:
    """An output written where it is, never through a temporary file and a rename: ``-``, a
    descriptor's name (``/dev/stdout``, ``/dev/fd/1``), a character device or a FIFO."""
    if is_stdout(path):
        return True
    name = os.fspath(path)
    if name in DESCRIPTOR_NAMES[:2] or name.startswith(DESCRIPTOR_NAMES[2:]):
        return True
    return is_special_file(Path(name))


def check_output_dir(path: Optional[str | os.PathLike], option: str = "--out-dir") -> Optional[Path]:
    """A folder the command will write several files into (created when it writes): not ``-``
    (stdout holds one stream, not a folder), not an existing file. None stays None."""
    if path is None:
        return None
    if is_stdout(path):
        raise UserError(f"{option} names a folder, and '-' is stdout: give a folder (or -o - for one output)")
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            raise UserError(f"{option} '{p}' is not a directory")
    except OSError as exc:
        raise bad_name(p, exc) from None
    return p


def make_output_dir(path: Path) -> Path:
    """Create the folder of :func:`check_output_dir` (and its parents) when the outputs are ready."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"'{path}' is not a directory") from None
    except OSError as exc:
        if is_write_failure(exc):
            raise cannot_write(str(path), exc) from None
        raise bad_name(path, exc) from None
    return path


def format_name(pattern: str, *, option: str = "-o/--out", **fields: Any) -> str:
    """``pattern`` (a file-name pattern given to ``option``) with its placeholders filled; an unknown
    placeholder or a format spec that does not fit (``{i:q}``) is one UserError naming the pattern."""
    try:
        return pattern.format(**fields)
    except KeyError as exc:
        raise UserError(f"{option} {pattern!r}: unknown placeholder {{{exc.args[0]}}} (use {', '.join('{' + k + '}' for k in fields)})") from None
    except (ValueError, IndexError, TypeError, AttributeError) as exc:
        raise UserError(f"{option} {pattern!r}: {exc} (use {', '.join('{' + k + '}' for k in fields)}; double a literal brace)") from None


def plan_outputs(targets: Iterable[str | os.PathLike], force: bool = False, *, what: str = "outputs", new_folder: bool = False) -> list[Path]:
    """The output files of a run, checked before any work: each writable (:func:`ensure_writable`),
    no two the same file (in-place targets such as ``/dev/null`` may repeat). The regular files are
    registered as pending: a closed stdout (``| head``) does not end the run before they are written."""
    planned: list[Path] = []
    seen: dict[Path, int] = {}
    for k, t in enumerate(targets):
        p = ensure_writable(t, force, new_folder=new_folder)
        if not is_in_place(p):
            key = Path(os.path.normpath(_resolved(p)))
            if key in seen:
                raise UserError(f"two {what} would both be written to '{p}': give each its own name")
            seen[key] = k
        planned.append(p)
    _PENDING.update(_resolved(p) for p in planned if not is_in_place(p))
    return planned


def plan_files(
    names: Sequence[str], *, out: Optional[str | os.PathLike] = None, out_dir: Optional[str | os.PathLike] = None, what: str = "outputs", force: bool = False
) -> list[Path]:
    """Where each of a run's outputs goes: ``out`` (exactly one output: a file, ``-`` or a device)
    or ``out_dir`` (default: the current folder) with ``names``; every target is checked before any
    work (:func:`plan_outputs`: nothing half-written, nothing replaced without ``force``)."""
    if out is not None and out_dir is not None:
        raise UserError("give --out (one output) or --out-dir (a folder), not both")
    if out is not None:
        if len(names) != 1:
            raise UserError(f"--out names one file but there are {len(names)} {what}: use --out-dir")
        return plan_outputs([out], force, what=what)
    folder = check_output_dir(out_dir) or Path(".")
    return plan_outputs([folder / n for n in names], force, what=what, new_folder=True)


def forget_pending_outputs() -> None:
    """The run is over (or failed): no planned output is pending any more, and the stdin it read is
    forgotten (a next run in the same process reads its own)."""
    _PENDING.clear()
    _STDIN_BYTES.clear()


STDOUT = "-"

# Error numbers that mean the environment refused a write (not a bug of ours): reported as
# "cannot write FILE: REASON", exit 2.
WRITE_ERRNOS = frozenset(
    e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM, errno.EBUSY) if e is not None
)


class CannotWrite(UserError):
    """An output could not be written (disk full, quota, read-only file system, I/O error)."""


def cannot_write(what: str, exc: OSError) -> CannotWrite:
    """The one-line error for a failed write of ``what`` (a path, or "stdout")."""
    name = what if what == "stdout" else f"'{what}'"
    return CannotWrite(f"cannot write {name}: {exc.strerror or exc}")


def is_write_failure(exc: BaseException) -> bool:
    """An OSError that says the environment refused a write (disk full, quota, read-only...)."""
    return isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS


def is_stdout(path: str | os.PathLike | None) -> bool:
    """``-`` as an output path means stdout (as ``-`` means stdin for inputs)."""
    return path is not None and os.fspath(path) == STDOUT


def _resolved(p: Path) -> Path:
    """Where writing ``p`` lands: a symlink (also a dangling one, or a chain) is followed, so the
    link stays and its target is written, as editors and ``cp`` do."""
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def _umask() -> int:
    """The process umask (read without changing it where the system tells it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def output_mode(target: Path) -> int:
    """The permission bits an output written to ``target`` gets: those of the file it replaces,
    else what ``open()`` would give a new file (0666 minus the umask)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return 0o666 & ~_umask()


# Atomic outputs being written right now. A closed stdout (`| head`) ends a run only when none is:
# a requested output file is finished, not silently dropped (see gencli.console).
_IN_PROGRESS: list[Path] = []


# Outputs a run planned (:func:`plan_outputs`) and has not written yet.
_PENDING: set[Path] = set()


def outputs_in_progress() -> list[Path]:
    """The output files being written now, or planned and not written yet (their final paths)."""
    return list(_IN_PROGRESS) + sorted(_PENDING - set(_IN_PROGRESS))


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

    On any error (and on Ctrl-C or SIGTERM, which the command line turns into exceptions) the
    temporary file is removed and ``path`` is untouched: an output is never half-written. The
    existence check is repeated at the end, so a file that appeared meanwhile is not clobbered
    without ``force``. The file gets the mode of the file it replaces, else 0666 minus the umask; a
    symlink is written through. A device or pipe is yielded as is (written in place); ``-`` yields
    ``/dev/stdout``. A write the environment refuses (disk full...) is a :class:`CannotWrite`.
    """
    target = ensure_writable(path, force)
    if is_stdout(target):
        target = Path("/dev/stdout")
    if is_in_place(target):
        sys.stdout.flush()
        try:
            yield target
        except OSError as exc:
            if is_write_failure(exc):
                raise cannot_write(str(path), exc) from None
            raise
        return
    final = _resolved(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp" + final.suffix, dir=final.parent)
    except OSError as exc:
        if is_write_failure(exc):
            raise cannot_write(str(path), exc) from None
        raise
    os.close(fd)
    tmp_path = Path(tmp)
    _IN_PROGRESS.append(final)
    try:
        yield tmp_path
        if final.exists() and not force:
            raise UserError(f"output '{target}' already exists (use --force to overwrite)")
        os.chmod(tmp_path, output_mode(final))
        os.replace(tmp_path, final)
    except OSError as exc:
        if is_write_failure(exc):
            raise cannot_write(str(path), exc) from None
        raise
    finally:
        _IN_PROGRESS.remove(final)
        _PENDING.discard(final)
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", force: bool = False, **kwargs) -> Iterator[IO]:
    """``open()`` for writing through :func:`atomic_path`; ``-`` and ``/dev/stdout`` write to
    ``sys.stdout`` (its binary buffer for a binary ``mode``), which stays open. Binary data is
    refused on a terminal (one line: redirect it or name a file)."""
    if names_stdout(path):
        if "b" in mode:
            refuse_binary_terminal(sys.stdout, path)
        sys.stdout.flush()
        yield sys.stdout.buffer if "b" in mode else sys.stdout
        sys.stdout.flush()
        return
    with atomic_path(path, force) as tmp:
        with open(tmp, mode, **kwargs) as fh:
            if "b" in mode:
                refuse_binary_terminal(fh, path)
            yield fh


def refuse_binary_terminal(fh: Any, path: str | os.PathLike) -> None:
    """Binary data (an image, a latent file) is never written to a terminal: one UserError."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        if fh.isatty():
            shown = "stdout" if is_stdout(path) else f"'{os.fspath(path)}'"
            raise UserError(f"{shown} is a terminal: binary output is not written there (redirect it to a file or a pipe, or give -o FILE)")


def write_output(path: str | os.PathLike, data: bytes, force: bool = False) -> Path:
    """The one way a command writes a file's bytes: a regular file atomically (:func:`atomic_path`),
    ``-``, a descriptor's name, a device or a FIFO in place; never to a terminal."""
    with atomic_open(path, "wb", force) as fh:
        fh.write(data)
    return Path(path)


atomic_write_bytes = write_output  # the name the model-saving code knows


# -- output folders -------------------------------------------------------------------------------
def ensure_folder_writable(path: str | os.PathLike, force: bool = False, *, wrote: Callable[[Path], Optional[Iterable[str]]]) -> Path:
    """Check up front that the folder ``path`` may be written (by :func:`atomic_folder`); return it.

    A new folder needs an existing parent. An existing folder is replaced only with ``force``, and
    only when gencli itself wrote it: empty, or holding nothing but the plain files ``wrote(folder)``
    names (None: not a folder gencli wrote). Anything else is refused, and so are ``-`` (stdout),
    the root of the file system and the current folder or one that holds it, ``--force`` or not."""
    if is_stdout(path):
        raise UserError("'-' means stdout, which cannot hold a folder: name the folder to write")
    p = Path(path)
    final = Path(os.path.realpath(p))
    if final == Path(final.anchor):
        raise UserError(f"'{p}' is the root of the file system: name a new folder to write")
    try:
        cwd = Path(os.getcwd())
    except OSError:  # the current folder was removed: nothing of it to protect
        cwd = None
    if cwd is not None and (final == cwd or final in cwd.parents):
        held = "is the current folder" if final == cwd else "holds the current folder"
        raise UserError(f"'{p}' {held}: name a new folder to write")
    if final.exists() and not final.is_dir():
        raise UserError(f"output '{p}' exists and is not a folder")
    if final.is_dir():
        entries = sorted(final.iterdir())
        known = set(wrote(final) or ()) if entries else set()
        other = [e.name for e in entries if e.name not in known or e.is_symlink() or not e.is_file()]
        if other:
            more = f" and {len(other) - 1} more" if len(other) > 1 else ""
            raise UserError(f"output '{p}' is a folder holding files gencli did not write ('{other[0]}'{more}): name a new folder to write")
        if not force:
            raise UserError(f"output '{p}' already exists (use --force to replace it)")
    elif not final.parent.is_dir():
        raise UserError(f"output directory '{final.parent}' does not exist")
    return p


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, force: bool = False, *, wrote: Callable[[Path], Optional[Iterable[str]]]) -> Iterator[Path]:
    """Yield a new temporary folder beside ``path`` (in the same parent); on success it takes
    ``path``'s place by rename. A folder already there (one :func:`ensure_folder_writable` lets
    ``force`` replace, checked again at the end) is renamed aside first and removed only once the
    new one is in place. On any error, Ctrl-C or SIGTERM the temporary folder is removed and
    ``path`` is untouched. A symlink to a folder is written through (its target is replaced)."""
    ensure_folder_writable(path, force, wrote=wrote)
    final = Path(os.path.realpath(path))
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    except OSError as exc:
        if is_write_failure(exc):
            raise cannot_write(str(path), exc) from None
        raise
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it owner-only
        ensure_folder_writable(path, force, wrote=wrote)  # nothing else arrived there meanwhile
        if not final.exists():
            os.rename(tmp, final)
            return
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
        try:
            os.rename(final, old)  # onto an empty folder: allowed
            os.rename(tmp, final)
        except BaseException:
            if not os.path.lexists(final):  # moved aside, not replaced: put back
                os.rename(old, final)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)  # the replaced folder (or the empty name it would have taken)
    except OSError as exc:
        if is_write_failure(exc):
            raise cannot_write(str(path), exc) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def decode_text(data: bytes, name: str) -> str:
    """``data`` as UTF-8 text (a leading byte-order mark dropped); text that is not UTF-8 is one
    UserError naming ``name`` and where the first bad byte is."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def check_text(text: str, name: str) -> str:
    """``text`` (an argument) back if it is valid Unicode; bytes that were not UTF-8 (decoded by
    Python as lone surrogates) are one UserError naming ``name``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(f"{name} is not UTF-8 text (at character {exc.start + 1})") from None
    return text


def read_stdin_text() -> str:
    """All of stdin as UTF-8 text (read once a run: every reader of ``-`` sees the same data)."""
    return decode_text(read_input_bytes(STDOUT), "stdin")


def read_stdin_lines(*, keep_tabs: bool = False) -> list[str]:
    """Non-empty, stripped lines from stdin (only ever called when the user passed ``-``); with
    ``keep_tabs`` a line's leading and trailing tabs stay (they separate fields: ``text<TAB>`` is a
    text with an empty second field)."""
    return [strip_line(line, keep_tabs=keep_tabs) for line in read_stdin_text().splitlines() if line.strip()]


def strip_line(line: str, *, keep_tabs: bool = False) -> str:
    """``line`` without its leading and trailing whitespace (but its tabs, with ``keep_tabs``)."""
    return re.sub(r"^[^\S\t]+|[^\S\t]+$", "", line) if keep_tabs else line.strip()


_STDIN_BYTES: list[bytes] = []  # stdin read once, as bytes: every reader of ``-`` in a run sees the same data


def read_input_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of an input file, ``-`` being stdin (read once, whole). A missing or unreadable
    file is one UserError naming it."""
    if is_stdout(path):
        if not _STDIN_BYTES:
            raw = getattr(sys.stdin, "buffer", None)  # None where stdin was replaced by a text stream
            _STDIN_BYTES.append(raw.read() if raw is not None else sys.stdin.read().encode("utf-8", "surrogateescape"))
        return _STDIN_BYTES[0]
    p = Path(path)
    try:
        return p.read_bytes()
    except FileNotFoundError:
        raise UserError(f"'{p}': no such file") from None
    except IsADirectoryError:
        raise UserError(f"'{p}': is a directory") from None
    except OSError as exc:
        raise UserError(f"cannot read '{p}': {exc.strerror or exc}") from None


def input_name(path: str | os.PathLike) -> str:
    """How messages name an input: ``stdin`` for ``-``, else the path as given."""
    return "stdin" if is_stdout(path) else os.fspath(path)


def read_text(path: str, *, what: str) -> tuple[str, str]:
    """The UTF-8 text of an input file (``-`` = stdin), and how to name it in messages (``stdin``
    or ``'PATH'``). A missing, unreadable or non-UTF-8 file is one UserError naming ``what`` (the
    option it came from)."""
    if is_stdout(path):
        return read_stdin_text(), "stdin"
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise UserError(f"cannot read {what} '{p}': it does not exist") from None
    except IsADirectoryError:
        raise UserError(f"cannot read {what} '{p}': it is a directory") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} '{p}': {exc.strerror or exc}") from None
    return decode_text(data, f"{what} '{p}'"), f"'{p}'"


def read_lines(path: str, *, what: str) -> tuple[list[str], str]:
    """The lines of a one-item-per-line text file (``-`` = stdin), and how to name it in messages
    (see :func:`read_text`)."""
    text, name = read_text(path, what=what)
    return text.splitlines(), name


def expand_inputs(args: Sequence[str], *, recursive: bool = False, extensions: Iterable[str] | None = None) -> list[str]:
    """Expand command-line inputs into a list of file paths, keeping their order.

    ``-`` reads one path per line from stdin; a directory contributes its files with the given
    extensions (recursively with ``recursive``). Paths that do not exist are kept as given so the
    caller can report them per file without losing the others.
    """
    exts = {e.lower() for e in extensions} if extensions else None
    out: list[str] = []
    empty_dirs: list[Path] = []
    for arg in args:
        if arg == "-":
            out.extend(line.strip() for line in read_lines("-", what="stdin")[0] if line.strip())
            continue
        p = Path(arg)
        if p.is_dir():
            walker = p.rglob("*") if recursive else p.iterdir()
            files = sorted(str(f) for f in walker if f.is_file() and (exts is None or f.suffix.lower() in exts))
            out.extend(files)
            if not files:
                empty_dirs.append(p)
        else:
            out.append(arg)
    if not out:
        if empty_dirs:
            d = empty_dirs[0]
            kinds = (f" ({', '.join(sorted(exts))})" if len(exts) <= 6 else " of a type it reads") if exts else ""
            deeper = " (-r searches its subdirectories)" if not recursive and any(c.is_dir() for c in d.iterdir()) else ""
            raise UserError(f"no input files{kinds} in directory '{d}'{deeper}")
        raise UserError("no inputs given" + (" (stdin had no lines)" if "-" in args else ""))
    return out
