"""One series of the user's table, validated and laid on its regular grid (pandas + numpy; no torch).

:func:`build_record` checks that the timestamps are increasing, distinct and on one regular grid
(missing grid points become missing values), counts and imputes the missing history values, checks
that known covariates cover the horizon, and returns a :class:`~gencli.data.timeseries.SeriesRecord`;
a problem raises :class:`SeriesError`, which the caller reports for that series alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from gencli.data.calendar import Frequency, IrregularError, grid_timestamps, infer_frequency, infer_numeric_step
from gencli.data.timeseries import SeriesRecord, impute_linear
from gencli.errors import UserError
from gencli.pipelines.forecast.layout import Layout, list_columns
from gencli.pipelines.forecast.table import TIME_PARSED, prepare_frame

MAX_MISSING_FRACTION = 0.5
# quantiles reach a few standard deviations past the history: headroom below float64's 1.8e308
MAX_TARGET_MAGNITUDE = float(np.finfo(np.float64).max) / 1e4


class SeriesError(UserError):
    """A problem with one series: reported for that series, the others go on."""


@dataclass
class RecordOptions:
    horizon: int
    min_length: int = 8
    need_future_known: bool = True


class _History(NamedTuple):
    """Where a series' history lies: its first and last observed rows, and their grid positions
    relative to the first one (the history spans ``length`` grid steps)."""

    first: int
    last: int
    positions: np.ndarray
    length: int

    def values(self, column: np.ndarray) -> np.ndarray:
        """A column's history on the grid, NaN where the grid has no row."""
        out = np.full(self.length, np.nan)
        out[self.positions] = column[self.first : self.last + 1]
        return out

    def imputed(self, column: np.ndarray) -> np.ndarray:
        """A covariate's history on the grid, gaps interpolated (zeros when it has no value at all)."""
        hist = self.values(column)
        return impute_linear(hist)[0] if np.isfinite(hist).any() else np.zeros(self.length)


def build_record(sid: str, frame, layout: Layout, opts: RecordOptions) -> SeriesRecord:
    """Validate one series and lay it on its regular grid (see the module docstring)."""
    y_all = _target_values(sid, frame, "__target__" if layout.wide else layout.target_col)
    times = _parse_times(frame, layout, sid) if layout.time_col else None
    freq, pos = _grid(sid, times, layout, len(y_all))

    # history = up to the last observed target; rows after it (empty target) are the future
    observed_idx = np.flatnonzero(np.isfinite(y_all))
    if observed_idx.size == 0:
        raise SeriesError(f"series '{sid}': no observed target values")
    peak = float(np.abs(y_all[observed_idx]).max())
    if peak > MAX_TARGET_MAGNITUDE:
        raise SeriesError(
            f"series '{sid}': target values up to {peak:.3g} are too close to the largest 64-bit float ({np.finfo(np.float64).max:.3g}) "
            "for the forecast's quantiles: divide the column by a power of ten"
        )
    first, last = int(observed_idx[0]), int(observed_idx[-1])
    positions = pos[first : last + 1] - pos[first]
    hist = _History(first, last, positions, int(positions[-1]) + 1)
    y = hist.values(y_all)
    n_missing = int(np.isnan(y).sum())
    if hist.length - n_missing < opts.min_length:
        raise SeriesError(f"series '{sid}': too short ({hist.length - n_missing} observed values, at least {opts.min_length} needed)")
    if n_missing > MAX_MISSING_FRACTION * hist.length:
        raise SeriesError(f"series '{sid}': {n_missing} of {hist.length} values are missing (more than {int(MAX_MISSING_FRACTION * 100)}%)")
    y_filled, mask = impute_linear(y)
    n_future = _future_rows(pos, hist, len(y_all))
    known = _known_covariates(sid, frame, layout, opts, hist, n_future, times)
    observed = {c: hist.imputed(_numeric(frame[c])) for c in layout.observed}
    static_reals, static_cats = _static_values(sid, frame, layout)
    obs_vals = y[np.isfinite(y)]
    return SeriesRecord(
        id=sid,
        target=y_filled,
        observed_mask=mask,
        freq=freq,
        # timestamps of the grid: history then the given future rows
        timestamps=grid_timestamps(times[first], freq, hist.length + n_future) if times is not None else None,
        known=known,
        observed=observed,
        static_reals=static_reals,
        static_cats=static_cats,
        n_future=n_future,
        imputed=n_missing,
        nonnegative=bool((obs_vals >= 0).all()),
    )


def _numeric(column) -> np.ndarray:
    import pandas as pd

    return pd.to_numeric(column, errors="coerce").to_numpy(dtype=np.float64)


def _target_values(sid: str, frame, target_col: str) -> np.ndarray:
    """The target column as float64, NaN where empty; a value that is not a number is an error."""
    import pandas as pd

    y_all = pd.to_numeric(frame[target_col], errors="coerce")
    bad = frame[target_col][y_all.isna() & frame[target_col].notna()]
    if len(bad):
        raise SeriesError(f"series '{sid}': non-numeric target value '{bad.iloc[0]}'")
    y_all = y_all.to_numpy(dtype=np.float64, copy=True)
    infinite = np.isinf(y_all)
    if infinite.any():
        raw = frame[target_col].iloc[int(np.flatnonzero(infinite)[0])]
        raise SeriesError(f"series '{sid}': target value '{raw}' is infinite or beyond the range of 64-bit floats")
    return y_all


def _grid(sid: str, times: Optional[np.ndarray], layout: Layout, n_rows: int) -> tuple[Frequency, np.ndarray]:
    """The frequency and each row's position on the regular grid: duplicates and order first."""
    if times is None:
        return Frequency("none", step=1.0), np.arange(n_rows)
    d = np.diff(times.astype(np.int64) if layout.time_kind in ("datetime", "year") else times)
    if (d == 0).any():
        i = int(np.flatnonzero(d == 0)[0]) + 1
        raise SeriesError(f"series '{sid}': duplicate timestamp {format_time(times[i])}")
    if (d < 0).any():
        i = int(np.flatnonzero(d < 0)[0]) + 1
        raise SeriesError(f"series '{sid}': timestamps are not in increasing order ({format_time(times[i - 1])} is followed by {format_time(times[i])})")
    if n_rows < 2:
        raise SeriesError(f"series '{sid}': too short (1 row)")
    try:
        return infer_numeric_step(times) if layout.time_kind == "numeric" else infer_frequency(times)
    except IrregularError as exc:
        raise SeriesError(f"series '{sid}': {exc}") from None


def _future_rows(pos: np.ndarray, hist: _History, n_rows: int) -> int:
    """How many rows after the history continue its grid step by step (the known future)."""
    fut_pos = pos[hist.last + 1 : n_rows] - pos[hist.first]
    if not fut_pos.size:
        return 0
    expected = hist.length + np.arange(fut_pos.size)
    return int(np.argmin(fut_pos == expected)) if not (fut_pos == expected).all() else fut_pos.size


def _known_covariates(sid: str, frame, layout: Layout, opts: RecordOptions, hist: _History, n_future: int, times) -> dict[str, np.ndarray]:
    """Known covariates over the history and the horizon (backtests look inside the history only)."""
    if not layout.known:
        return {}
    if not opts.need_future_known:
        return {c: hist.imputed(_numeric(frame[c])) for c in layout.known}
    if opts.horizon <= 0:
        return {}
    if n_future < opts.horizon:
        if n_future == 0:
            raise SeriesError(
                f"series '{sid}': known covariates need the future: add {opts.horizon} rows after the history with "
                f"{', '.join(layout.known)} filled and the target empty"
            )
        raise SeriesError(f"series '{sid}': known covariates cover {n_future} future rows, the horizon is {opts.horizon}")
    known: dict[str, np.ndarray] = {}
    for c in layout.known:
        v = _numeric(frame[c])
        fut = v[hist.last + 1 : hist.last + 1 + opts.horizon]
        if np.isnan(fut).any():
            i = int(np.flatnonzero(np.isnan(fut))[0])
            when = format_time(times[hist.last + 1 + i]) if times is not None else f"future row {i + 1}"
            raise SeriesError(f"series '{sid}': known covariate '{c}' is missing at {when} (a future row)")
        known[c] = np.concatenate([hist.imputed(v), fut])
    return known


def _static_values(sid: str, frame, layout: Layout) -> tuple[dict[str, float], dict[str, str]]:
    """The series' value of each static covariate (which must not change within the series)."""
    import pandas as pd

    reals: dict[str, float] = {}
    cats: dict[str, str] = {}
    for c in layout.static_real + layout.static_cat:
        vals = frame[c].dropna()
        if vals.nunique() > 1:
            raise SeriesError(f"series '{sid}': static column '{c}' takes several values ({list_columns(map(str, vals.unique()[:3]))})")
        if len(vals):
            if c in layout.static_real:
                reals[c] = float(pd.to_numeric(vals.iloc[0], errors="coerce"))
            else:
                cats[c] = str(vals.iloc[0])
    return reals, cats


def _parse_times(frame, layout: Layout, sid: str):
    """The series' time values: datetime64[ns] or float, from the column parsed by :func:`prepare_frame`."""
    if layout.time_kind == "row":
        return None
    if TIME_PARSED not in frame.columns:
        frame = prepare_frame(frame.copy(), layout)
    parsed = frame[TIME_PARSED]
    bad = parsed.isna().to_numpy()
    if bad.any():
        raw = frame[layout.time_col].iloc[int(np.flatnonzero(bad)[0])]
        what = "missing" if raw is None or (isinstance(raw, float) and np.isnan(raw)) else f"unreadable ('{raw}')"
        raise SeriesError(f"series '{sid}': {what} time value in column '{layout.time_col}'")
    if layout.time_kind in ("datetime", "year"):
        return parsed.to_numpy(dtype="datetime64[ns]")
    return parsed.to_numpy(dtype=np.float64)


def format_time(value, time_zone=None) -> str:
    """A time value as the output shows it: a date, a full timestamp (with ``time_zone``'s UTC offset,
    when the input's timestamps carried one: ``2024-03-01 00:00:00+01:00``), or a step number."""
    import pandas as pd

    if isinstance(value, (np.datetime64, pd.Timestamp)):
        ts = pd.Timestamp(value)
        if time_zone is not None:
            return str(ts.tz_localize(time_zone))
        return ts.strftime("%Y-%m-%d") if ts == ts.normalize() else str(ts)
    if isinstance(value, (float, np.floating)):
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    return str(value)


__all__ = ["SeriesError", "RecordOptions", "build_record", "format_time", "MAX_MISSING_FRACTION"]
