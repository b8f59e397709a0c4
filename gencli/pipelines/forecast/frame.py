"""Reading the user's table and turning it into validated series (pandas + numpy; no torch).

- :func:`open_table` reads CSV (also ``.tsv``, compressed ``.gz/.bz2/.zip/.xz``), Parquet (when
  pandas has an engine for it) or ``-`` (stdin, CSV or Parquet bytes).
- :func:`infer_layout` decides which column is the time, the series id, the target and each
  covariate role, from the options the user gave and the data; anything it cannot decide is a
  one-line error that lists the columns.
- :func:`iter_groups` yields one ``(id, frame)`` per series, streaming large id-sorted CSV files
  chunk by chunk (memory stays bounded), else from the whole table.
- :func:`build_record` validates one series (timestamps increasing and distinct, on one regular
  grid; missing values counted and imputed; known covariates covering the horizon) and returns a
  :class:`~gencli.pipelines.forecast.features.SeriesRecord`, or raises :class:`SeriesError`, which
  the caller reports for that series alone.
"""

from __future__ import annotations

import io
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from gencli.errors import UserError
from gencli.pipelines.forecast.calendar import Frequency, IrregularError, infer_frequency, infer_numeric_step
from gencli.pipelines.forecast.features import SeriesRecord, impute_linear

TIME_NAMES = ("time", "date", "datetime", "timestamp", "ds", "period", "month", "week", "year", "day", "hour", "dt", "date_time", "time_stamp")
ID_NAMES = ("id", "series", "series_id", "unique_id", "item_id", "item", "key", "sku", "name", "symbol", "ticker", "store", "country", "region", "group", "entity")
TARGET_NAMES = ("target", "y", "value", "values", "sales", "demand", "volume", "count", "qty", "quantity", "amount", "load", "close", "observation", "obs")
STREAM_BYTES = 32 * 2**20  # CSV files larger than this are streamed when their ids are contiguous
SAMPLE_ROWS = 20000
MAX_MISSING_FRACTION = 0.5


class SeriesError(UserError):
    """A problem with one series: reported for that series, the others go on."""


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", str(name).strip().lower()).strip("_")


def _list(cols: Sequence[str]) -> str:
    cols = [str(c) for c in cols]
    return ", ".join(cols) if len(cols) <= 12 else ", ".join(cols[:12]) + f", ... ({len(cols)} columns)"


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

    @property
    def streamable(self) -> bool:
        return self.kind == "csv" and self.path is not None and self.size > STREAM_BYTES

    def _read_csv(self, **kw):
        import pandas as pd

        src = self.path
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
        t = Table("stdin", "csv")
        try:
            t.frame = pd.read_csv(io.BytesIO(data), sep=_sniff_sep(data[:4096].decode("utf-8", "replace")), skipinitialspace=True)
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


# -- layout inference --------------------------------------------------------------------------
@dataclass
class Layout:
    """Which column plays which role."""

    time_col: Optional[str]
    time_kind: str  # "datetime" | "year" | "numeric" | "row"
    id_col: Optional[str]
    target_col: Optional[str]
    wide: bool = False
    series_cols: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)
    observed: list[str] = field(default_factory=list)
    static_real: list[str] = field(default_factory=list)
    static_cat: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def columns(self) -> list[str]:
        cols = [c for c in (self.id_col, self.time_col, self.target_col) if c]
        return cols + self.known + self.observed + self.static_real + self.static_cat

    def describe(self) -> str:
        if self.wide:
            return f"wide table: time '{self.time_col or '(row order)'}', {len(self.series_cols)} series columns"
        parts = [f"time '{self.time_col or '(row order)'}'", f"target '{self.target_col}'"]
        if self.id_col:
            parts.insert(0, f"id '{self.id_col}'")
        for label, cols in (("known", self.known), ("past-only", self.observed), ("static", self.static_real + self.static_cat)):
            if cols:
                parts.append(f"{label} {', '.join(cols)}")
        return "columns: " + "; ".join(parts)


def _is_numeric(series) -> bool:
    import pandas as pd

    return pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series)


def _parses_as_time(series) -> bool:
    import pandas as pd

    if pd.api.types.is_datetime64_any_dtype(series):
        return True
    if _is_numeric(series) or not (pd.api.types.is_object_dtype(series) or pd.api.types.is_string_dtype(series)):
        return False
    vals = series.dropna().astype(str).head(200)
    if vals.empty:
        return False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parsed = pd.to_datetime(vals, errors="coerce", format="mixed")
    return bool(parsed.notna().mean() >= 0.95 and not vals.str.fullmatch(r"[-+]?\d+(\.\d+)?").all())


def _year_like(series) -> bool:
    v = series.dropna()
    if v.empty or not _is_numeric(series):
        return False
    arr = v.to_numpy(dtype=np.float64)
    return bool(np.all(arr == np.round(arr)) and arr.min() >= 1678 and arr.max() <= 2261)


def _check_columns(df, given: dict[str, Sequence[str]]) -> None:
    cols = [str(c) for c in df.columns]
    for flag, names in given.items():
        for n in names:
            if n not in cols:
                raise UserError(f"{flag}: unknown column '{n}' (columns: {_list(cols)})")


def infer_layout(
    df,
    *,
    time_col: Optional[str] = None,
    target_col: Optional[str] = None,
    id_col: Optional[str] = None,
    known_cols: Optional[Sequence[str]] = None,
    static_cols: Optional[Sequence[str]] = None,
    observed_cols: Optional[Sequence[str]] = None,
    wide: bool = False,
) -> Layout:
    """Decide the role of every column (see the module docstring); ``df`` may be a leading sample."""
    import pandas as pd

    df.columns = [str(c) for c in df.columns]
    cols = list(df.columns)
    if not cols:
        raise UserError("the table has no columns")
    if len(df) == 0:
        raise UserError("the table has a header but no rows")
    given = {"--time-col": [time_col] if time_col else [], "--target-col": [target_col] if target_col else [], "--id-col": [id_col] if id_col else []}
    given.update({"--known-cols": list(known_cols or []), "--static-cols": list(static_cols or []), "--observed-cols": list(observed_cols or [])})
    _check_columns(df, given)
    notes: list[str] = []

    # time column
    if time_col is None:
        named = [c for c in cols if _norm(c) in TIME_NAMES and (_parses_as_time(df[c]) or _is_numeric(df[c]))]
        parsed = [c for c in cols if c not in named and _parses_as_time(df[c])]
        if len(named) == 1:
            time_col = named[0]
        elif len(named) > 1:
            dt = [c for c in named if _parses_as_time(df[c])]
            if len(dt) == 1:
                time_col = dt[0]
            else:
                raise UserError(f"cannot tell which column is the time among {_list(named)}: pass --time-col")
        elif len(parsed) == 1:
            time_col = parsed[0]
        elif len(parsed) > 1:
            raise UserError(f"several columns hold dates ({_list(parsed)}): pass --time-col")
        if time_col is not None:
            notes.append(f"time column '{time_col}' (inferred)")
        else:
            notes.append("no time column: rows are taken as consecutive steps")
    if time_col is None:
        time_kind = "row"
    elif _parses_as_time(df[time_col]):
        time_kind = "datetime"
    elif _is_numeric(df[time_col]):
        time_kind = "year" if _norm(time_col) in ("year", "yr", "years") and _year_like(df[time_col]) else "numeric"
    else:
        raise UserError(f"time column '{time_col}' holds neither dates nor numbers (e.g. '{df[time_col].dropna().astype(str).iloc[0] if df[time_col].notna().any() else ''}')")

    claimed = {c for c in (time_col, target_col, id_col) if c} | set(known_cols or []) | set(static_cols or []) | set(observed_cols or [])
    rest = [c for c in cols if c not in claimed]
    numeric_rest = [c for c in rest if _is_numeric(df[c])]
    text_rest = [c for c in rest if not _is_numeric(df[c]) and not pd.api.types.is_datetime64_any_dtype(df[c])]

    # series id
    time_repeats = time_col is not None and df[time_col].duplicated().any()
    if id_col is None and not wide:
        named = [c for c in rest if _norm(c) in ID_NAMES and not _is_numeric(df[c])] or [c for c in rest if _norm(c) in ("id", "series_id", "unique_id", "item_id")]
        if len(named) == 1:
            id_col = named[0]
        elif len(named) > 1:
            raise UserError(f"cannot tell which column identifies the series among {_list(named)}: pass --id-col")
        elif time_repeats or (time_col is None and text_rest):
            cands = text_rest
            if time_col is not None:
                cands = [c for c in text_rest if not df.duplicated([c, time_col]).any()]
            if len(cands) == 1:
                id_col = cands[0]
            elif len(cands) > 1:
                raise UserError(f"cannot tell which column identifies the series among {_list(cands)}: pass --id-col")
            elif time_repeats and text_rest:
                raise UserError(f"timestamps repeat but no column identifies the series (columns: {_list(cols)}): pass --id-col")
        if id_col is not None:
            notes.append(f"series id column '{id_col}' (inferred)")
    if id_col is not None:
        rest = [c for c in rest if c != id_col]
        numeric_rest = [c for c in numeric_rest if c != id_col]
        text_rest = [c for c in text_rest if c != id_col]

    covariates_given = any(x is not None for x in (known_cols, static_cols, observed_cols))
    if wide:
        if id_col or target_col or covariates_given:
            raise UserError("--wide takes one column per series: --id-col, --target-col and covariate columns need the long format")
        series = [c for c in cols if c != time_col and _is_numeric(df[c])]
        if not series:
            raise UserError(f"no numeric column to forecast (columns: {_list(cols)})")
        return Layout(time_col, time_kind, None, None, True, series, notes=notes)

    # target
    if target_col is None:
        named = [c for c in numeric_rest if _norm(c) in TARGET_NAMES]
        if len(named) == 1:
            target_col = named[0]
            notes.append(f"target column '{target_col}' (inferred)")
        elif len(numeric_rest) == 1:
            target_col = numeric_rest[0]
            notes.append(f"target column '{target_col}' (the only numeric column)")
        elif not numeric_rest:
            raise UserError(f"no numeric column to forecast (columns: {_list(cols)})")
        elif id_col is None and not covariates_given and not named:
            notes.append(f"wide table: each of {_list(numeric_rest)} is a series (pass --target-col to forecast one with the others as covariates)")
            return Layout(time_col, time_kind, None, None, True, numeric_rest, notes=notes)
        else:
            raise UserError(f"cannot tell which column is the target among {_list(named or numeric_rest)}: pass --target-col" + ("" if id_col else " (or --wide if each column is a series)"))
    if not _is_numeric(df[target_col]):
        coerced = pd.to_numeric(df[target_col], errors="coerce")
        bad = df[target_col][coerced.isna() & df[target_col].notna()]
        if len(bad):
            raise UserError(f"target column '{target_col}' is not numeric (e.g. '{bad.iloc[0]}')")
    numeric_rest = [c for c in numeric_rest if c != target_col]
    text_rest = [c for c in text_rest if c != target_col]

    layout = Layout(time_col, time_kind, id_col, target_col, notes=notes)
    layout.known = list(known_cols or [])
    layout.observed = list(observed_cols or [])
    for c in static_cols or []:
        (layout.static_real if _is_numeric(df[c]) else layout.static_cat).append(c)
    for c in layout.known + layout.observed:
        if not _is_numeric(df[c]):
            raise UserError(f"covariate column '{c}' is not numeric: time-varying covariates must be numbers (encode categories as 0/1 columns)")

    # infer the roles of the other columns, for the roles the user did not list
    future = df[target_col].isna() if target_col else None
    groups = df.groupby(id_col, sort=False) if id_col else None
    for c in numeric_rest + text_rest:
        is_num = c in numeric_rest
        constant = bool((groups[c].nunique(dropna=True) <= 1).all()) if groups is not None else False
        if constant and id_col:
            role = "static"
        elif not is_num:
            notes.append(f"column '{c}' ignored: text that varies within a series")
            continue
        elif bool(df.loc[future, c].notna().any()) if future is not None and future.any() else False:
            role = "known"
        else:
            role = "observed"
        flag = {"static": static_cols, "known": known_cols, "observed": observed_cols}[role]
        if flag is not None:
            notes.append(f"column '{c}' ignored (looks {role}; --{role}-cols was given without it)")
            continue
        if role == "static":
            (layout.static_real if is_num else layout.static_cat).append(c)
        else:
            getattr(layout, role).append(c)
        notes.append(f"column '{c}' used as a {'past-only' if role == 'observed' else role} covariate (inferred)")
    return layout


# -- grouping -----------------------------------------------------------------------------------
def iter_groups(table: Table, layout: Layout, warn=None) -> Iterator[tuple[str, object]]:
    """``(series id, frame)`` for every series in input order.

    Long tables are split by id (first appearance order); wide tables give one frame per series
    column. A large CSV file whose ids come in contiguous blocks is streamed chunk by chunk, so
    memory does not grow with the number of series.
    """
    if layout.wide:
        df = _prepare(table.read(), layout)
        tcols = [layout.time_col, TIME_PARSED] if layout.time_col else []
        for c in layout.series_cols:
            sub = df[tcols + [c]].rename(columns={c: "__target__"})
            yield str(c), sub
        return
    if layout.id_col is None:
        yield str(layout.target_col), _prepare(table.read(), layout)
        return
    if table.streamable and _ids_contiguous(table, layout.id_col):
        yield from _stream_groups(table, layout)
        return
    if table.streamable and warn is not None:
        warn(f"the rows of each series are not contiguous in '{table.name}': reading it whole (sort it by {layout.id_col} to stream it)")
    df = _prepare(table.read(), layout)
    for key, sub in df.groupby(layout.id_col, sort=False, dropna=False):
        yield _key(key), sub


TIME_PARSED = "__time_parsed__"


def _prepare(df, layout: Layout):
    """Column names as strings and the time column parsed once for the whole frame (into
    ``TIME_PARSED``; unparseable values become NaT/NaN and are reported per series)."""
    import warnings

    import pandas as pd

    df.columns = [str(c) for c in df.columns]
    if layout.time_col is None or layout.time_col not in df.columns:
        return df
    col = df[layout.time_col]
    if layout.time_kind == "datetime":
        if pd.api.types.is_datetime64_any_dtype(col):
            parsed = col
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    parsed = pd.to_datetime(col, errors="raise")
                except (ValueError, TypeError, OverflowError):
                    parsed = pd.to_datetime(col, errors="coerce", format="mixed")
        if getattr(parsed.dt, "tz", None) is not None:
            parsed = parsed.dt.tz_localize(None)
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
        for key, sub in _prepare(complete.copy(), layout).groupby(layout.id_col, sort=False, dropna=False):
            yield _key(key), sub
    if pending is not None and len(pending):
        for key, sub in _prepare(pending.copy(), layout).groupby(layout.id_col, sort=False, dropna=False):
            yield _key(key), sub


# -- one series ---------------------------------------------------------------------------------
def _fmt_time(v) -> str:
    import pandas as pd

    if isinstance(v, (np.datetime64, pd.Timestamp)):
        ts = pd.Timestamp(v)
        return ts.strftime("%Y-%m-%d") if ts == ts.normalize() else str(ts)
    if isinstance(v, (float, np.floating)):
        return str(int(v)) if float(v).is_integer() else repr(float(v))
    return str(v)


def _parse_times(frame, layout: Layout, sid: str):
    """The series' time values: datetime64[ns] or float, from the column parsed by :func:`_prepare`."""
    if layout.time_kind == "row":
        return None
    if TIME_PARSED not in frame.columns:
        frame = _prepare(frame.copy(), layout)
    parsed = frame[TIME_PARSED]
    bad = parsed.isna().to_numpy()
    if bad.any():
        raw = frame[layout.time_col].iloc[int(np.flatnonzero(bad)[0])]
        what = "missing" if raw is None or (isinstance(raw, float) and np.isnan(raw)) else f"unreadable ('{raw}')"
        raise SeriesError(f"series '{sid}': {what} time value in column '{layout.time_col}'")
    if layout.time_kind in ("datetime", "year"):
        return parsed.to_numpy(dtype="datetime64[ns]")
    return parsed.to_numpy(dtype=np.float64)


@dataclass
class RecordOptions:
    horizon: int
    min_length: int = 8
    need_future_known: bool = True


def build_record(sid: str, frame, layout: Layout, opts: RecordOptions) -> SeriesRecord:
    """Validate one series and lay it on its regular grid (see the module docstring)."""
    import pandas as pd

    target_col = "__target__" if layout.wide else layout.target_col
    y_all = pd.to_numeric(frame[target_col], errors="coerce")
    bad = frame[target_col][y_all.isna() & frame[target_col].notna()]
    if len(bad):
        raise SeriesError(f"series '{sid}': non-numeric target value '{bad.iloc[0]}'")
    y_all = y_all.to_numpy(dtype=np.float64, copy=True)
    y_all[~np.isfinite(y_all)] = np.nan
    n_rows = len(y_all)
    times = _parse_times(frame, layout, sid) if layout.time_col else None

    # grid positions: duplicates and order first, then the frequency
    if times is None:
        freq, pos = Frequency("none", step=1.0), np.arange(n_rows)
        times_num = None
    else:
        if layout.time_kind in ("datetime", "year"):
            tv = times.astype(np.int64)
        else:
            tv = times
        d = np.diff(tv)
        if (d == 0).any():
            i = int(np.flatnonzero(d == 0)[0]) + 1
            raise SeriesError(f"series '{sid}': duplicate timestamp {_fmt_time(times[i])}")
        if (d < 0).any():
            i = int(np.flatnonzero(d < 0)[0]) + 1
            raise SeriesError(f"series '{sid}': timestamps are not in increasing order ({_fmt_time(times[i - 1])} is followed by {_fmt_time(times[i])})")
        if n_rows < 2:
            raise SeriesError(f"series '{sid}': too short (1 row)")
        try:
            if layout.time_kind == "numeric":
                freq, pos = infer_numeric_step(times)
            else:
                freq, pos = infer_frequency(times)
        except IrregularError as exc:
            raise SeriesError(f"series '{sid}': {exc}") from None
        times_num = times

    # history = up to the last observed target; rows after it (empty target) are the future
    observed_idx = np.flatnonzero(np.isfinite(y_all))
    if observed_idx.size == 0:
        raise SeriesError(f"series '{sid}': no observed target values")
    first, last = int(observed_idx[0]), int(observed_idx[-1])
    hist_pos = pos[first : last + 1] - pos[first]
    t_len = int(hist_pos[-1]) + 1
    y = np.full(t_len, np.nan)
    y[hist_pos] = y_all[first : last + 1]
    n_missing = int(np.isnan(y).sum())
    if t_len - n_missing < opts.min_length:
        raise SeriesError(f"series '{sid}': too short ({t_len - n_missing} observed values, at least {opts.min_length} needed)")
    if n_missing > MAX_MISSING_FRACTION * t_len:
        raise SeriesError(f"series '{sid}': {n_missing} of {t_len} values are missing (more than {int(MAX_MISSING_FRACTION * 100)}%)")
    y_filled, mask = impute_linear(y)

    fut_rows = np.arange(last + 1, n_rows)
    fut_pos = pos[fut_rows] - pos[first]
    n_future = 0
    if fut_rows.size:
        expected = t_len + np.arange(fut_rows.size)
        n_future = int(np.argmin(fut_pos == expected)) if not (fut_pos == expected).all() else fut_rows.size

    known: dict[str, np.ndarray] = {}
    if layout.known and not opts.need_future_known:
        # backtests only look inside the history: no future rows needed
        for c in layout.known:
            v = pd.to_numeric(frame[c], errors="coerce").to_numpy(dtype=np.float64)
            hist = np.full(t_len, np.nan)
            hist[hist_pos] = v[first : last + 1]
            known[c] = impute_linear(hist)[0] if np.isfinite(hist).any() else np.zeros(t_len)
    elif layout.known and opts.horizon > 0:
        if n_future < opts.horizon:
            if n_future == 0:
                raise SeriesError(
                    f"series '{sid}': known covariates need the future: add {opts.horizon} rows after the history with "
                    f"{', '.join(layout.known)} filled and the target empty"
                )
            raise SeriesError(f"series '{sid}': known covariates cover {n_future} future rows, the horizon is {opts.horizon}")
        for c in layout.known:
            v = pd.to_numeric(frame[c], errors="coerce").to_numpy(dtype=np.float64)
            hist = np.full(t_len, np.nan)
            hist[hist_pos] = v[first : last + 1]
            fut = v[last + 1 : last + 1 + opts.horizon]
            if np.isnan(fut).any():
                i = int(np.flatnonzero(np.isnan(fut))[0])
                when = _fmt_time(times_num[last + 1 + i]) if times_num is not None else f"future row {i + 1}"
                raise SeriesError(f"series '{sid}': known covariate '{c}' is missing at {when} (a future row)")
            if np.isfinite(hist).any():
                hist, _ = impute_linear(hist)
            else:
                hist = np.zeros(t_len)
            known[c] = np.concatenate([hist, fut])
    observed: dict[str, np.ndarray] = {}
    for c in layout.observed:
        v = pd.to_numeric(frame[c], errors="coerce").to_numpy(dtype=np.float64)
        hist = np.full(t_len, np.nan)
        hist[hist_pos] = v[first : last + 1]
        observed[c] = impute_linear(hist)[0] if np.isfinite(hist).any() else np.zeros(t_len)
    static_reals: dict[str, float] = {}
    static_cats: dict[str, str] = {}
    for c in layout.static_real + layout.static_cat:
        vals = frame[c].dropna()
        if vals.nunique() > 1:
            raise SeriesError(f"series '{sid}': static column '{c}' takes several values ({_list(map(str, vals.unique()[:3]))})")
        if len(vals):
            if c in layout.static_real:
                static_reals[c] = float(pd.to_numeric(vals.iloc[0], errors="coerce"))
            else:
                static_cats[c] = str(vals.iloc[0])

    # timestamps of the grid: history then the given future rows
    timestamps = None
    if times_num is not None:
        from gencli.pipelines.forecast.calendar import grid_timestamps

        span = t_len + max(n_future, 0)
        timestamps = grid_timestamps(times_num[first], freq, span)
    obs_vals = y[np.isfinite(y)]
    return SeriesRecord(
        id=sid,
        target=y_filled,
        observed_mask=mask,
        freq=freq,
        timestamps=timestamps,
        known=known,
        observed=observed,
        static_reals=static_reals,
        static_cats=static_cats,
        n_future=n_future,
        imputed=n_missing,
        nonnegative=bool((obs_vals >= 0).all()),
    )


def format_time(value) -> str:
    return _fmt_time(value)
