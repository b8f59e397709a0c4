"""Reading the user's table (pandas + numpy; no torch).

- :func:`open_table` reads CSV (also ``.tsv``, compressed ``.gz/.bz2/.zip/.xz``), Parquet (when
  pandas has an engine for it) or ``-`` (stdin, CSV or Parquet bytes).
- :func:`iter_groups` yields one ``(id, frame)`` per series of a :class:`~gencli.pipelines.forecast.layout.Layout`,
  streaming large id-sorted CSV files chunk by chunk (memory stays bounded), else from the whole
  table; :func:`prepare_frame` parses the time column once per frame.
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from gencli.errors import UserError
from gencli.pipelines.forecast.layout import Layout, date_text, to_datetimes

STREAM_BYTES = 32 * 2**20  # CSV files larger than this are streamed when their ids are contiguous
SAMPLE_ROWS = 20000


# -- reading ---------------------------------------------------------------------------------
@dataclass
class Table:
    """The user's input: a file path or stdin, read whole or in chunks."""

    name: str
    kind: str  # "csv" | "parquet"
    path: Optional[Path] = None
    sep: str = ","
    frame: Optional["object"] = None  # the whole DataFrame once read
    size: int = 0
    raw: Optional[bytes] = None  # stdin's bytes (CSV), to read a column again as text
    text_cols: tuple = ()  # columns read as text, never as numbers (series ids: '007' is not '7')
    rows_without_id: int = 0  # rows the last pass over the series skipped: their id was empty

    @property
    def streamable(self) -> bool:
        return self.kind == "csv" and self.path is not None and self.size > STREAM_BYTES

    def _read_csv(self, **kw):
        import pandas as pd

        src = self.path if self.raw is None else io.BytesIO(self.raw)
        if self.text_cols and "dtype" not in kw:
            kw["dtype"] = {c: str for c in self.text_cols}
        try:
            return pd.read_csv(src, sep=self.sep, skipinitialspace=True, **kw)
        except pd.errors.EmptyDataError:
            raise UserError(f"'{self.name}' is empty") from None
        except pd.errors.ParserError as exc:
            raise UserError(f"'{self.name}' is not a valid CSV file: {str(exc).strip().splitlines()[-1]}") from None
        except UnicodeDecodeError:
            raise UserError(f"'{self.name}' is not a text (UTF-8) CSV file") from None

    def read(self):
        """The whole table as a DataFrame."""
        if self.frame is None:
            self.frame = self._read_csv() if self.kind == "csv" else _read_parquet(self.path, self.name)
        return self.frame

    def sample(self):
        """Enough leading rows to infer the layout from (the whole table unless it is streamed)."""
        if self.streamable:
            return self._read_csv(nrows=SAMPLE_ROWS)
        return self.read()

    def chunks(self, usecols=None, chunksize: int = 200_000):
        return self._read_csv(usecols=usecols, chunksize=chunksize)

    def keep_as_text(self, column: str) -> None:
        """Read ``column`` as text from now on (and again in the frame already read, when the CSV
        reader took it for numbers): series ids '007', '7' and '7.0' stay three series, as written."""
        import pandas as pd

        if column in self.text_cols:
            return
        self.text_cols = (*self.text_cols, column)
        col = self.frame[column] if self.frame is not None and column in self.frame.columns else None
        if self.kind == "csv" and col is not None and not (pd.api.types.is_object_dtype(col) or pd.api.types.is_string_dtype(col)):
            again = self._read_csv(usecols=[column], dtype={column: str})[column]
            if len(again) == len(col):
                self.frame[column] = again.to_numpy(dtype=object)
            else:  # cannot happen (the same parser skips the same lines): read it whole
                self.frame = self._read_csv()
        self.release()

    def release(self) -> None:
        """Drop stdin's bytes once the frame read from them is final."""
        if self.path is None and self.frame is not None:
            self.raw = None


def _read_parquet(source, name: str):
    import pandas as pd

    try:
        return pd.read_parquet(source)
    except ImportError:
        raise UserError(f"reading Parquet ('{name}') needs pyarrow or fastparquet: pip install pyarrow, or pass a CSV file") from None
    except Exception as exc:  # noqa: BLE001 - a broken file
        raise UserError(f"'{name}' is not a readable Parquet file: {str(exc).splitlines()[0]}") from None


def open_table(arg: str) -> Table:
    """A :class:`Table` for a path, or ``-`` for stdin (read at once: stdin cannot be re-read)."""
    import pandas as pd

    if arg == "-":
        data = sys.stdin.buffer.read()
        if not data.strip():
            raise UserError("stdin is empty")
        if data[:4] == b"PAR1":
            t = Table("stdin", "parquet")
            t.frame = _read_parquet(io.BytesIO(data), "stdin")
            return t
        t = Table("stdin", "csv", sep=_sniff_sep(data[:4096].decode("utf-8", "replace")), raw=data)
        try:
            t.frame = pd.read_csv(io.BytesIO(data), sep=t.sep, skipinitialspace=True)
        except pd.errors.EmptyDataError:
            raise UserError("stdin is empty") from None
        except (pd.errors.ParserError, UnicodeDecodeError) as exc:
            raise UserError(f"stdin is not a valid CSV table: {str(exc).strip().splitlines()[-1]}") from None
        return t
    p = Path(arg).expanduser()
    if not p.exists():
        raise UserError(f"'{arg}' does not exist")
    if p.is_dir():
        raise UserError(f"'{arg}' is a directory, not a data file")
    size = p.stat().st_size
    if size == 0:
        raise UserError(f"'{arg}' is empty")
    suffixes = [s.lower() for s in p.suffixes]
    if suffixes and suffixes[-1] in (".parquet", ".pq"):
        return Table(arg, "parquet", p, size=size)
    with open(p, "rb") as fh:
        head = fh.read(4096)
    if head[:4] == b"PAR1":
        return Table(arg, "parquet", p, size=size)
    sep = "\t" if ".tsv" in suffixes or ".tab" in suffixes else _sniff_sep(head.decode("utf-8", "replace"))
    return Table(arg, "csv", p, sep=sep, size=size)


def _sniff_sep(head: str) -> str:
    first = head.splitlines()[0] if head.splitlines() else ""
    counts = {s: first.count(s) for s in (",", ";", "\t", "|")}
    best = max(counts, key=counts.get)
    return best if counts[best] > 0 else ","


# -- grouping -----------------------------------------------------------------------------------
def iter_groups(table: Table, layout: Layout, warn=None) -> Iterator[tuple[str, object]]:
    """``(series id, frame)`` for every series in input order.

    Long tables are split by id (first appearance order); wide tables give one frame per series
    column. A large CSV file whose ids come in contiguous blocks is streamed chunk by chunk, so
    memory does not grow with the number of series.
    """
    if layout.id_col is None:
        table.release()
    if layout.wide:
        df = prepare_frame(table.read(), layout)
        tcols = [layout.time_col, TIME_PARSED] if layout.time_col else []
        for c in layout.series_cols:
            sub = df[tcols + [c]].rename(columns={c: "__target__"})
            yield str(c), sub
        return
    if layout.id_col is None:
        yield str(layout.target_col), prepare_frame(table.read(), layout)
        return
    table.keep_as_text(layout.id_col)
    if table.streamable and _ids_contiguous(table, layout.id_col):
        table.rows_without_id = 0
        yield from _stream_groups(table, layout)
        _warn_missing_ids(table.rows_without_id, layout.id_col, warn)
        return
    if table.streamable and warn is not None:
        warn(f"the rows of each series are not contiguous in '{table.name}': reading it whole (sort it by {layout.id_col} to stream it)")
    table.rows_without_id = 0
    df = prepare_frame(_drop_missing_ids(table, table.read(), layout.id_col), layout)
    _warn_missing_ids(table.rows_without_id, layout.id_col, warn)
    for key, sub in df.groupby(layout.id_col, sort=False, dropna=False):
        yield _key(key), sub


def _drop_missing_ids(table: Table, df, id_col: str):
    """``df`` without its rows that name no series (an empty id), counted in ``table.rows_without_id``."""
    missing = df[id_col].isna()
    if not missing.any():
        return df
    table.rows_without_id += int(missing.sum())
    return df[~missing]


def _warn_missing_ids(n: int, id_col: str, warn) -> None:
    if n and warn is not None:
        warn(f"skipped {n} row{'s' if n > 1 else ''} with no series id in column '{id_col}'")


TIME_PARSED = "__time_parsed__"


def prepare_frame(df, layout: Layout):
    """Column names as strings and the time column parsed once for the whole frame (into
    ``TIME_PARSED``; unparseable values become NaT/NaN and are reported per series)."""
    import pandas as pd

    df.columns = [str(c) for c in df.columns]
    if layout.time_col is None or layout.time_col not in df.columns:
        return df
    col = df[layout.time_col]
    if layout.time_kind == "datetime":
        parsed = col if pd.api.types.is_datetime64_any_dtype(col) else _parse_times(col, layout)
        if getattr(parsed.dt, "tz", None) is not None:  # wall time in the column's own offset (written back with it)
            parsed = parsed.dt.tz_convert(layout.time_zone).dt.tz_localize(None) if layout.time_zone is not None else parsed.dt.tz_localize(None)
        df[TIME_PARSED] = parsed.astype("datetime64[ns]")
    elif layout.time_kind == "year":
        years = pd.to_numeric(col, errors="coerce")
        ok = years.notna() & (years >= 1678) & (years <= 2261)
        out = pd.Series(pd.NaT, index=col.index, dtype="datetime64[ns]")
        out[ok] = pd.to_datetime(years[ok].astype(int).astype(str), format="%Y")
        df[TIME_PARSED] = out
    else:
        df[TIME_PARSED] = pd.to_numeric(col, errors="coerce")
    return df


def _parse_times(col, layout: Layout):
    """The time column as dates, in the format and offset the layout settled on its first rows;
    offsets that appear only further down (rows without one read first) are one UserError."""
    try:
        return to_datetimes(date_text(col), layout.time_format, layout.dayfirst, utc=layout.time_zone is not None)
    except ValueError as exc:
        if "timezone" not in str(exc).lower():
            raise
        raise UserError(
            f"the time column '{layout.time_col}' mixes timestamps with and without a UTC offset (the first rows read have none): "
            "give every timestamp its offset, or none"
        ) from None


def _key(key) -> str:
    if isinstance(key, tuple):
        key = key[0]
    if isinstance(key, float) and key == int(key):
        key = int(key)
    return str(key)


def _ids_contiguous(table: Table, id_col: str) -> bool:
    done: set = set()
    last = None
    for chunk in table.chunks(usecols=[id_col], chunksize=1_000_000):
        ids = chunk[id_col].to_numpy()
        if len(ids) == 0:
            continue
        change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        starts = np.concatenate([[0], change])
        for s in starts:
            v = ids[s]
            if v == last:
                continue
            if v in done:
                return False
            if last is not None:
                done.add(last)
            last = v
    return True


def _stream_groups(table: Table, layout: Layout) -> Iterator[tuple[str, object]]:
    import pandas as pd

    pending = None
    for chunk in table.chunks():
        chunk.columns = [str(c) for c in chunk.columns]
        if pending is not None:
            chunk = pd.concat([pending, chunk], ignore_index=True)
        ids = chunk[layout.id_col].to_numpy()
        last_id = ids[-1]
        tail_start = len(ids)
        while tail_start > 0 and ids[tail_start - 1] == last_id:
            tail_start -= 1
        complete, pending = chunk.iloc[:tail_start], chunk.iloc[tail_start:]
        for key, sub in prepare_frame(_drop_missing_ids(table, complete.copy(), layout.id_col), layout).groupby(layout.id_col, sort=False, dropna=False):
            yield _key(key), sub
    if pending is not None and len(pending):
        for key, sub in prepare_frame(_drop_missing_ids(table, pending.copy(), layout.id_col), layout).groupby(layout.id_col, sort=False, dropna=False):
            yield _key(key), sub


__all__ = ["Table", "open_table", "iter_groups", "prepare_frame", "TIME_PARSED", "STREAM_BYTES"]
