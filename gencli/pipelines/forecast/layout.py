"""Which column of the user's table plays which role (pandas + numpy; no torch).

:func:`infer_layout` decides which column is the time, the series id, the target and each covariate
role, from the options the user gave and the data: a column named like a time (``date``, ``ds``
...) or holding dates is the time; a text column (or one named like ``id``) whose values repeat the
timestamps is the series id; a numeric column named like a target (``sales``, ``y`` ...) or the only
numeric one is the target (several unnamed numeric columns: a wide table, one series each); the
other columns are covariates, known in advance when they have values in the future rows (target
empty), constant per series when static, else past-only. Anything it cannot decide is a one-line
error that lists the columns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from gencli.errors import UserError

TIME_NAMES = ("time", "date", "datetime", "timestamp", "ds", "period", "month", "week", "year", "day", "hour", "dt", "date_time", "time_stamp")
ID_NAMES = (
    "id",
    "series",
    "series_id",
    "unique_id",
    "item_id",
    "item",
    "key",
    "sku",
    "name",
    "symbol",
    "ticker",
    "store",
    "country",
    "region",
    "group",
    "entity",
)
TARGET_NAMES = ("target", "y", "value", "values", "sales", "demand", "volume", "count", "qty", "quantity", "amount", "load", "close", "observation", "obs")


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", str(name).strip().lower()).strip("_")


def list_columns(cols: Sequence[str]) -> str:
    """Column names for a message (the first twelve, then how many there are)."""
    cols = [str(c) for c in cols]
    return ", ".join(cols) if len(cols) <= 12 else ", ".join(cols[:12]) + f", ... ({len(cols)} columns)"


# -- the layout ---------------------------------------------------------------------------------
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
    # how a "datetime" time column is read, decided once for the whole column (:func:`infer_time_format`)
    time_format: Optional[str] = None  # a strptime format, "ISO8601", or "mixed" (each value on its own)
    dayfirst: bool = False  # for "mixed"
    time_zone: Any = None  # the tzinfo of offset-carrying timestamps: read as wall time, written back with it

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
        # utc: values with several UTC offsets (a daylight-saving change) are dates too
        parsed = pd.to_datetime(vals, errors="coerce", format="mixed", utc=True)
    return bool(parsed.notna().mean() >= 0.95 and not vals.str.fullmatch(r"[-+]?\d+(\.\d+)?").all())


def _year_like(series) -> bool:
    v = series.dropna()
    if v.empty or not _is_numeric(series):
        return False
    arr = v.to_numpy(dtype=np.float64)
    return bool(np.all(arr == np.round(arr)) and arr.min() >= 1678 and arr.max() <= 2261)


def _yyyymmdd(series) -> bool:
    """Whether a numeric column holds dates written as numbers, 20240131 for 31 January 2024: every
    value a whole number that reads as ``%Y%m%d`` (a step index 20240101, 20240102, ... runs past
    the month's last day and is not one)."""
    import pandas as pd

    v = series.dropna()
    if v.empty or not _is_numeric(series):
        return False
    arr = v.to_numpy(dtype=np.float64)
    if not (np.all(arr == np.round(arr)) and arr.min() >= 16780101 and arr.max() <= 22611231):
        return False
    return bool(pd.to_datetime(date_text(v), format="%Y%m%d", errors="coerce").notna().all())


def date_text(series):
    """A time column as text to read dates from: a numeric one as the digits of its whole numbers
    (20240131.0 -> '20240131'; other numbers as written, so that no date format reads them); text as it is."""
    import pandas as pd

    if not _is_numeric(series):
        return series
    v = pd.to_numeric(series, errors="coerce").astype(np.float64)
    whole = v.notna() & (v == v.round()) & (v.abs() < 1e15)
    out = pd.Series(np.nan, index=series.index, dtype=object)
    out[whole] = v[whole].astype(np.int64).astype(str)
    out[v.notna() & ~whole] = v[v.notna() & ~whole].astype(str)
    return out


def _check_columns(df, given: dict[str, Sequence[str]]) -> None:
    cols = [str(c) for c in df.columns]
    for flag, names in given.items():
        for n in names:
            if n not in cols:
                raise UserError(f"{flag}: unknown column '{n}' (columns: {list_columns(cols)})")


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
    time_format: Optional[str] = None,
    dayfirst: Optional[bool] = None,
) -> Layout:
    """Decide the role of every column (see the module docstring) and how the time column is read
    (:func:`infer_time_format`, from ``--time-format``/``--dayfirst``); ``df`` may be a leading sample."""
    layout = _infer_roles(
        df,
        time_col=time_col,
        target_col=target_col,
        id_col=id_col,
        known_cols=known_cols,
        static_cols=static_cols,
        observed_cols=observed_cols,
        wide=wide,
        dates_given=bool(time_format),
    )
    if layout.time_kind == "datetime":
        column = date_text(df[layout.time_col])
        layout.time_format, layout.dayfirst, layout.time_zone, note = infer_time_format(column, layout.time_col, time_format, dayfirst)
        if note:
            layout.notes.append(note)
    elif time_format or dayfirst is not None:
        option = "--time-format" if time_format else "--dayfirst/--monthfirst"
        raise UserError(f"{option} reads dates, but the time column '{layout.time_col or '(none)'}' holds none")
    return layout


def _infer_roles(
    df,
    *,
    time_col: Optional[str],
    target_col: Optional[str],
    id_col: Optional[str],
    known_cols: Optional[Sequence[str]],
    static_cols: Optional[Sequence[str]],
    observed_cols: Optional[Sequence[str]],
    wide: bool,
    dates_given: bool = False,
) -> Layout:
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
    if time_col is None:
        time_col = _infer_time_col(df, notes)
    time_kind = _time_kind(df, time_col, notes, dates_given)

    claimed = {c for c in (time_col, target_col, id_col) if c} | set(known_cols or []) | set(static_cols or []) | set(observed_cols or [])
    rest = [c for c in cols if c not in claimed]
    numeric_rest = [c for c in rest if _is_numeric(df[c])]
    text_rest = [c for c in rest if not _is_numeric(df[c]) and not pd.api.types.is_datetime64_any_dtype(df[c])]
    if id_col is None and not wide:
        id_col = _infer_id_col(df, rest, text_rest, time_col, notes)
    if id_col is not None:
        numeric_rest = [c for c in numeric_rest if c != id_col]
        text_rest = [c for c in text_rest if c != id_col]

    covariates_given = any(x is not None for x in (known_cols, static_cols, observed_cols))
    if wide:
        if id_col or target_col or covariates_given:
            raise UserError("--wide takes one column per series: --id-col, --target-col and covariate columns need the long format")
        series = [c for c in cols if c != time_col and _is_numeric(df[c])]
        if not series:
            raise UserError(f"no numeric column to forecast (columns: {list_columns(cols)})")
        return Layout(time_col, time_kind, None, None, True, series, notes=notes)
    if target_col is None and not numeric_rest:
        for c in (c for c in text_rest if _norm(c) in TARGET_NAMES):
            _check_target(df, c)  # a target-named column of text: name the value that is not a number
    if target_col is None:
        target_col = _infer_target_col(numeric_rest, cols, id_col, covariates_given, notes)
        if target_col is None:  # several numeric columns, nothing else: each is a series
            return Layout(time_col, time_kind, None, None, True, numeric_rest, notes=notes)
    _check_target(df, target_col)
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
    _infer_covariates(df, layout, numeric_rest, text_rest, {"static": static_cols, "known": known_cols, "observed": observed_cols})
    return layout


def _infer_time_col(df, notes: list[str]) -> Optional[str]:
    """The time column when none is given: one named like a time (and holding dates or numbers),
    else the one column holding dates; None (rows are consecutive steps) when there is none."""
    cols = list(df.columns)
    named = [c for c in cols if _norm(c) in TIME_NAMES and (_parses_as_time(df[c]) or _is_numeric(df[c]))]
    parsed = [c for c in cols if c not in named and _parses_as_time(df[c])]
    time_col = None
    if len(named) == 1:
        time_col = named[0]
    elif len(named) > 1:
        dt = [c for c in named if _parses_as_time(df[c])]
        if len(dt) != 1:
            raise UserError(f"cannot tell which column is the time among {list_columns(named)}: pass --time-col")
        time_col = dt[0]
    elif len(parsed) == 1:
        time_col = parsed[0]
    elif len(parsed) > 1:
        raise UserError(f"several columns hold dates ({list_columns(parsed)}): pass --time-col")
    notes.append(f"time column '{time_col}' (inferred)" if time_col is not None else "no time column: rows are taken as consecutive steps")
    return time_col


def _time_kind(df, time_col: Optional[str], notes: Optional[list[str]] = None, dates_given: bool = False) -> str:
    """How the time column is read: "datetime", "year" (integer years), "numeric" or "row" (none).
    Numbers are dates with ``--time-format`` (``dates_given``), or in a column named like a time
    whose every value reads as ``%Y%m%d`` (20240131)."""
    if time_col is None:
        return "row"
    if _parses_as_time(df[time_col]):
        return "datetime"
    if _is_numeric(df[time_col]) and (dates_given or (_norm(time_col) in TIME_NAMES or "date" in _norm(time_col)) and _yyyymmdd(df[time_col])):
        if not dates_given and notes is not None:
            notes.append(f"time column '{time_col}' holds dates written as numbers (%Y%m%d): read as dates (--time-format '%Y%m%d')")
        return "datetime"
    if _is_numeric(df[time_col]):
        return "year" if _norm(time_col) in ("year", "yr", "years") and _year_like(df[time_col]) else "numeric"
    example = df[time_col].dropna().astype(str).iloc[0] if df[time_col].notna().any() else ""
    raise UserError(f"time column '{time_col}' holds neither dates nor numbers (e.g. '{example}')")


# -- how dates are read ------------------------------------------------------------------------------
def _day_month_order(fmt: str) -> Optional[bool]:
    """True when ``fmt`` puts the day before the month, False when after, None when it lacks either."""
    if "%d" not in fmt or "%m" not in fmt and "%b" not in fmt and "%B" not in fmt:
        return None
    month = min(fmt.index(m) for m in ("%m", "%b", "%B") if m in fmt)
    return fmt.index("%d") < month


def _date_candidates(vals, dayfirst: Optional[bool]) -> list[str]:
    """The formats the values could be in: ISO 8601, then pandas' guesses from a spread of them, read
    month first and day first (or as ``dayfirst`` says); year-day-month orders nobody writes are left out."""
    import warnings

    from pandas.tseries.api import guess_datetime_format

    out = ["ISO8601"]
    step = max(1, len(vals) // 20)
    for v in list(vals[::step])[:20]:
        for first in (False, True) if dayfirst is None else (dayfirst,):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fmt = guess_datetime_format(v, dayfirst=first)
            if not fmt or fmt in out:
                continue
            order = _day_month_order(fmt)
            if order and "%Y" in fmt and fmt.index("%Y") < fmt.index("%d"):
                continue  # year, day, month
            if dayfirst is not None and order is not None and order != dayfirst:
                continue
            out.append(fmt)
    return out


def to_datetimes(values, fmt: Optional[str], dayfirst: bool = False, utc: bool = False):
    """``values`` read as dates in format ``fmt`` (None or "mixed": each value on its own); NaT where one does not read."""
    import warnings

    import pandas as pd

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fmt in (None, "mixed"):
            return pd.to_datetime(values, errors="coerce", format="mixed", dayfirst=dayfirst, utc=utc)
        return pd.to_datetime(values, errors="coerce", format=fmt, utc=utc)


def check_time_format(fmt: Optional[str]) -> None:
    """``--time-format`` checked before any data is read: a format pandas cannot use (an unknown
    directive such as ``%Q``, a stray ``%``, ``%U`` without a weekday) or an empty one is one UserError
    naming the option and the value. None (infer the format) passes."""
    import pandas as pd

    if fmt is None:
        return
    if not fmt.strip():
        raise UserError("--time-format is empty: give the dates' strftime codes, e.g. '%d/%m/%Y' (or leave it out to infer them)")
    try:
        to_datetimes(pd.Series([], dtype=object), fmt, utc=True)  # pandas checks the format itself, even with no values
    except ValueError as exc:
        reason = str(exc).replace(f" in format '{fmt}'", "").rstrip(".")
        raise UserError(f"--time-format '{fmt}' is not a date format: {reason} (use strftime codes, e.g. '%d/%m/%Y')") from None


def infer_time_format(series, column: str, time_format: Optional[str] = None, dayfirst: Optional[bool] = None) -> tuple[Optional[str], bool, Any, str]:
    """How to read the dates of the time column ``series`` (a leading sample), decided once for the
    whole column: ``(format, dayfirst, time_zone, note)``.

    ``time_format`` (``--time-format``) is taken as given. Otherwise the one format that reads every
    value (ISO 8601, or what pandas guesses from the values, e.g. ``%d/%m/%Y``); ``dayfirst``
    (``--dayfirst``/``--monthfirst``) settles day/month order. A column two formats read differently
    (``01/03/2024``: 1 March or 3 January) or that mixes formats is a UserError naming both readings.
    Values with UTC offsets keep them: ``time_zone`` is their offset (UTC where they differ, with a note).
    """
    import pandas as pd

    if pd.api.types.is_datetime64_any_dtype(series):
        tz = getattr(series.dt, "tz", None)
        return None, False, tz, ""
    vals = pd.Series(series.dropna().astype(str).str.strip().unique()[:2000])
    vals = vals[vals != ""].reset_index(drop=True)
    if vals.empty:
        return time_format, bool(dayfirst), None, ""
    if time_format:
        check_time_format(time_format)
        parsed = to_datetimes(vals, time_format, utc=True)
        if parsed.isna().all():
            raise UserError(f"--time-format '{time_format}' does not read the time column '{column}' (e.g. '{vals[0]}')")
        return (time_format, False, *_time_zone(vals, time_format, False))
    readings = {fmt: to_datetimes(vals, fmt, utc=True) for fmt in _date_candidates(vals, dayfirst)}
    complete = [fmt for fmt, parsed in readings.items() if parsed.notna().all()]
    if complete:
        fmt = complete[0]
        for other in complete[1:]:
            differ = (readings[other] != readings[fmt]).to_numpy()
            if differ.any():
                v = vals[int(differ.argmax())]
                a, b = readings[fmt][int(differ.argmax())], readings[other][int(differ.argmax())]
                raise UserError(
                    f"the dates in time column '{column}' read two ways: '{v}' is {a:%Y-%m-%d} as {fmt} or {b:%Y-%m-%d} as {other}: "
                    f"pass --time-format '{fmt}' or '{other}' (or --dayfirst / --monthfirst)"
                )
        return (fmt, False, *_time_zone(vals, fmt, False))
    best = max(readings, key=lambda f: int(readings[f].notna().sum()))
    if readings[best].notna().any():
        missed = readings[best].isna().to_numpy()
        for other, parsed in readings.items():
            both = missed & parsed.notna().to_numpy()
            if other != best and both.any():
                good, bad = vals[int((~missed).argmax())], vals[int(both.argmax())]
                raise UserError(
                    f"the time column '{column}' mixes date formats ('{good}' reads as {best}, '{bad}' as {other}): pass --time-format"
                    + (" (or --dayfirst / --monthfirst)" if None not in (_day_month_order(best), _day_month_order(other)) else "")
                )
        return (best, False, *_time_zone(vals, best, False))  # the values no format reads are reported per series
    return ("mixed", bool(dayfirst), *_time_zone(vals, "mixed", bool(dayfirst)))


def _time_zone(vals, fmt: str, dayfirst: bool) -> tuple[Any, str]:
    """The offset the values carry (None when they carry none), and a note when they carry several."""
    import datetime

    try:
        parsed = to_datetimes(vals, fmt, dayfirst)
    except ValueError:  # several offsets
        return datetime.timezone.utc, "the timestamps carry several UTC offsets: they are read and written in UTC"
    return getattr(parsed.dt, "tz", None) if hasattr(parsed, "dt") else None, ""


def _infer_id_col(df, rest: list[str], text_rest: list[str], time_col: Optional[str], notes: list[str]) -> Optional[str]:
    """The series id column when none is given: one named like an id, else the text column that makes
    the timestamps unique (when they repeat); None for a table of one series."""
    time_repeats = time_col is not None and df[time_col].duplicated().any()
    named = [c for c in rest if _norm(c) in ID_NAMES and not _is_numeric(df[c])] or [c for c in rest if _norm(c) in ("id", "series_id", "unique_id", "item_id")]
    id_col = None
    if len(named) == 1:
        id_col = named[0]
    elif len(named) > 1:
        raise UserError(f"cannot tell which column identifies the series among {list_columns(named)}: pass --id-col")
    elif time_repeats or (time_col is None and text_rest):
        cands = text_rest
        if time_col is not None:
            cands = [c for c in text_rest if not df.duplicated([c, time_col]).any()]
        if len(cands) == 1:
            id_col = cands[0]
        elif len(cands) > 1:
            raise UserError(f"cannot tell which column identifies the series among {list_columns(cands)}: pass --id-col")
        elif time_repeats and text_rest:
            raise UserError(f"timestamps repeat but no column identifies the series (columns: {list_columns(list(df.columns))}): pass --id-col")
    if id_col is not None:
        notes.append(f"series id column '{id_col}' (inferred)")
    return id_col


def _infer_target_col(numeric_rest: list[str], cols: list[str], id_col: Optional[str], covariates_given: bool, notes: list[str]) -> Optional[str]:
    """The target when none is given: the numeric column named like a target, else the only numeric
    one; None when several unnamed numeric columns make a wide table (one series each)."""
    named = [c for c in numeric_rest if _norm(c) in TARGET_NAMES]
    if len(named) == 1:
        notes.append(f"target column '{named[0]}' (inferred)")
        return named[0]
    if len(numeric_rest) == 1:
        notes.append(f"target column '{numeric_rest[0]}' (the only numeric column)")
        return numeric_rest[0]
    if not numeric_rest:
        raise UserError(f"no numeric column to forecast (columns: {list_columns(cols)})")
    if id_col is None and not covariates_given and not named:
        notes.append(f"wide table: each of {list_columns(numeric_rest)} is a series (pass --target-col to forecast one with the others as covariates)")
        return None
    raise UserError(
        f"cannot tell which column is the target among {list_columns(named or numeric_rest)}: pass --target-col"
        + ("" if id_col else " (or --wide if each column is a series)")
    )


def _check_target(df, target_col: str) -> None:
    if _is_numeric(df[target_col]):
        return
    import pandas as pd

    coerced = pd.to_numeric(df[target_col], errors="coerce")
    bad = df[target_col][coerced.isna() & df[target_col].notna()]
    if len(bad):
        raise UserError(f"target column '{target_col}' is not numeric (e.g. '{bad.iloc[0]}')")


def _infer_covariates(df, layout: Layout, numeric_rest: list[str], text_rest: list[str], given: dict[str, Optional[Sequence[str]]]) -> None:
    """The roles of the remaining columns, for the roles the user did not list: constant per series ->
    static; numbers present in the future rows (target empty) -> known; other numbers -> past-only;
    text that varies within a series is ignored."""
    future = df[layout.target_col].isna()
    groups = df.groupby(layout.id_col, sort=False) if layout.id_col else None
    for c in numeric_rest + text_rest:
        is_num = c in numeric_rest
        constant = bool((groups[c].nunique(dropna=True) <= 1).all()) if groups is not None else False
        if constant:
            role = "static"
        elif not is_num:
            layout.notes.append(f"column '{c}' ignored: text that varies within a series")
            continue
        elif future.any() and bool(df.loc[future, c].notna().any()):
            role = "known"
        else:
            role = "observed"
        if given[role] is not None:
            layout.notes.append(f"column '{c}' ignored (looks {role}; --{role}-cols was given without it)")
            continue
        if role == "static":
            (layout.static_real if is_num else layout.static_cat).append(c)
        else:
            getattr(layout, role).append(c)
        layout.notes.append(f"column '{c}' used as a {'past-only' if role == 'observed' else role} covariate (inferred)")


__all__ = ["Layout", "infer_layout", "check_time_format", "list_columns", "TIME_NAMES", "ID_NAMES", "TARGET_NAMES"]
