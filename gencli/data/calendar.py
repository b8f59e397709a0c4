"""Frequencies and calendar features (numpy + pandas only; no torch).

A series' frequency is inferred from its timestamps (:func:`infer_frequency`): the typical step is
classified as sub-hourly, hourly, daily, business-daily, weekly, monthly, quarterly or yearly (with
multiples, e.g. every 2 hours or every 6 months), and every timestamp must then lie on the grid
that starts at the first one. Missing grid points are allowed (they become missing values); a
timestamp off the grid means the series is irregular.

Calendar features are sine/cosine pairs of the hour of the day, the day of the week and the day of
the year: they describe every frequency with the same six numbers (a monthly series sees the
annual cycle through the day of the year, an hourly one its daily and weekly cycles), which lets
one global model serve every frequency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from gencli.errors import UserError

CALENDAR_FEATURES = ("hour_sin", "hour_cos", "weekday_sin", "weekday_cos", "year_sin", "year_cos")


@dataclass(frozen=True)
class Frequency:
    """A sampling frequency: its family, multiple and what follows from it."""

    family: str  # "none", "subhourly", "hourly", "daily", "business", "weekly", "monthly", "quarterly", "yearly"
    multiple: int = 1
    minutes: int = 0  # subhourly: minutes per step
    anchor: str = ""  # monthly/quarterly/yearly: "start" | "end" | "day"; weekly: weekday
    step: Optional[float] = None  # "none": the numeric step of an integer/float time column

    # the categorical code the models see (static input "frequency")
    CODES = {"none": 0, "subhourly": 1, "hourly": 2, "daily": 3, "business": 3, "weekly": 4, "monthly": 5, "quarterly": 6, "yearly": 7}

    @property
    def code(self) -> int:
        return self.CODES[self.family]

    @property
    def label(self) -> str:
        base = {
            "subhourly": f"{self.minutes}min",
            "hourly": "h",
            "daily": "D",
            "business": "B",
            "weekly": "W",
            "monthly": "M",
            "quarterly": "Q",
            "yearly": "Y",
            "none": "step",
        }[self.family]
        if self.family == "none":
            return f"step {self.step:g}" if self.step is not None else "step"
        return f"{self.multiple}{base}" if self.multiple > 1 else base

    def season_length(self) -> int:
        """The seasonal period used by seasonal-naive and MASE (1 = none)."""
        f, k = self.family, self.multiple
        if f == "subhourly":
            per_day = (24 * 60) // max(1, self.minutes * k)
            return max(1, per_day)
        table = {"hourly": 24, "daily": 7, "business": 5, "weekly": 52, "monthly": 12, "quarterly": 4}
        if f not in table:
            return 1
        m = table[f]
        return m // k if m % k == 0 and k > 1 else (m if k == 1 else 1)

    def default_horizon(self) -> int:
        """Forecast length when none is given (the M4 competition's horizons)."""
        return {"subhourly": 48, "hourly": 48, "daily": 14, "business": 10, "weekly": 13, "monthly": 18, "quarterly": 8, "yearly": 6}.get(self.family, 12)

    def offset(self):
        """The pandas offset of one step (None for a numeric time axis)."""
        import pandas as pd

        k = self.multiple
        if self.family == "subhourly":
            return pd.Timedelta(minutes=self.minutes * k)
        if self.family == "hourly":
            return pd.Timedelta(hours=k)
        if self.family == "daily":
            return pd.Timedelta(days=k)
        if self.family == "business":
            return pd.offsets.BDay(k)
        if self.family == "weekly":
            return pd.Timedelta(weeks=k)
        months = {"monthly": 1, "quarterly": 3, "yearly": 12}.get(self.family)
        if months is not None:
            n = months * k
            if self.anchor == "start":
                return pd.offsets.MonthBegin(n)
            if self.anchor == "end":
                return pd.offsets.MonthEnd(n)
            return pd.DateOffset(months=n)
        return None


def _as_ns(ts: np.ndarray) -> np.ndarray:
    return np.asarray(ts).astype("datetime64[ns]")


def calendar_features(timestamps: Optional[np.ndarray], length: int) -> np.ndarray:
    """``(length, 6)`` float32 calendar features for ``datetime64`` timestamps (zeros without)."""
    out = np.zeros((length, len(CALENDAR_FEATURES)), dtype=np.float32)
    if timestamps is None:
        return out
    ts = _as_ns(timestamps)
    days = ts.astype("datetime64[D]")
    hour = (ts - days).astype("timedelta64[m]").astype(np.float64) / 60.0  # fractional hour of day
    weekday = ((days.astype(np.int64) + 3) % 7).astype(np.float64)  # Monday = 0 (1970-01-01 was a Thursday)
    year_start = ts.astype("datetime64[Y]").astype("datetime64[D]")
    doy = (days - year_start).astype(np.float64) + hour / 24.0
    two_pi = 2.0 * np.pi
    out[:, 0] = np.sin(two_pi * hour / 24.0)
    out[:, 1] = np.cos(two_pi * hour / 24.0)
    out[:, 2] = np.sin(two_pi * weekday / 7.0)
    out[:, 3] = np.cos(two_pi * weekday / 7.0)
    out[:, 4] = np.sin(two_pi * doy / 365.25)
    out[:, 5] = np.cos(two_pi * doy / 365.25)
    return out


def _month_index(ts: np.ndarray) -> np.ndarray:
    return ts.astype("datetime64[M]").astype(np.int64)


def _day_of_month(ts: np.ndarray) -> np.ndarray:
    return (ts.astype("datetime64[D]") - ts.astype("datetime64[M]").astype("datetime64[D]")).astype(np.int64) + 1


def _is_month_end(ts: np.ndarray) -> np.ndarray:
    nxt = ts.astype("datetime64[D]") + np.timedelta64(1, "D")
    return _day_of_month(nxt) == 1


class IrregularError(UserError):
    """Timestamps that lie on no regular grid."""


def infer_frequency(timestamps: np.ndarray) -> tuple[Frequency, np.ndarray]:
    """Infer the frequency of sorted, distinct ``datetime64`` timestamps.

    Returns ``(frequency, positions)`` where ``positions[i]`` is the grid index of timestamp ``i``
    (consecutive when nothing is missing). Raises :class:`IrregularError` when the timestamps do not
    lie on one grid.
    """
    ts = _as_ns(timestamps)
    n = len(ts)
    if n < 2:
        raise IrregularError("a single timestamp: the frequency cannot be inferred")
    diffs = np.diff(ts).astype("timedelta64[s]").astype(np.int64)
    if (diffs <= 0).any():
        raise IrregularError("timestamps are not increasing")
    day = 86400
    # calendar-month based grids: steps of 28-31 days multiples
    months = _month_index(ts)
    dmonths = np.diff(months)
    typical = int(np.median(diffs))
    if typical >= 27 * day:
        step_months = int(np.gcd.reduce(dmonths)) if (dmonths > 0).all() else 0
        if step_months >= 1:
            dom = _day_of_month(ts)
            if (dom == 1).all() and (ts == ts.astype("datetime64[D]")).all():
                anchor = "start"
            elif _is_month_end(ts).all():
                anchor = "end"
            elif (dom == dom[0]).all() and dom[0] <= 28:
                anchor = "day"
            else:
                anchor = ""
            if anchor:
                if step_months % 12 == 0:
                    freq = Frequency("yearly", step_months // 12, anchor=anchor)
                elif step_months % 3 == 0:
                    freq = Frequency("quarterly", step_months // 3, anchor=anchor)
                else:
                    freq = Frequency("monthly", step_months, anchor=anchor)
                pos = (months - months[0]) // step_months
                return freq, pos.astype(np.int64)
        raise IrregularError(f"irregular timestamps: steps between {_human(diffs.min())} and {_human(diffs.max())} fit no monthly grid")
    # business days: weekdays only, steps of 1 day and 3 days (over weekends)
    step = int(np.gcd.reduce(diffs))
    if step == day and typical == day:
        weekday = (ts.astype("datetime64[D]").astype(np.int64) + 3) % 7
        if (weekday < 5).all() and (diffs % day == 0).all() and (diffs == 3 * day).any():
            bdays = np.busday_count(ts[0].astype("datetime64[D]"), ts.astype("datetime64[D]"))
            if (ts == ts.astype("datetime64[D]")).all() or (ts - ts.astype("datetime64[D]") == ts[0] - ts[0].astype("datetime64[D]")).all():
                return Frequency("business"), bdays.astype(np.int64)
    # fixed steps: the grid step is the greatest common divisor; it must also be the typical step
    # (else e.g. steps of 2 and 3 days would pass as a daily grid with most points missing)
    if step <= 0 or typical % step != 0 or typical // step > 1:
        raise IrregularError(f"irregular timestamps: steps of {_human(diffs.min())} to {_human(diffs.max())} share no regular grid")
    pos = (ts - ts[0]).astype("timedelta64[s]").astype(np.int64) // step
    if step % (7 * day) == 0:
        freq = Frequency("weekly", step // (7 * day), anchor=str(int((ts[0].astype("datetime64[D]").astype(np.int64) + 3) % 7)))
    elif step % day == 0:
        freq = Frequency("daily", step // day)
    elif step % 3600 == 0:
        freq = Frequency("hourly", step // 3600)
    elif step % 60 == 0:
        freq = Frequency("subhourly", 1, minutes=step // 60)
    else:
        raise IrregularError(f"timestamps step by {step} seconds: sub-minute data is not supported")
    return freq, pos.astype(np.int64)


def infer_numeric_step(values: np.ndarray) -> tuple[Frequency, np.ndarray]:
    """A numeric time axis (years as numbers, integer steps): the step and grid positions."""
    v = np.asarray(values, dtype=np.float64)
    d = np.diff(v)
    if (d <= 0).any():
        raise IrregularError("time values are not increasing")
    step = float(np.min(d))
    ratio = d / step
    if not np.allclose(ratio, np.round(ratio), atol=1e-6):
        raise IrregularError(f"irregular time values: steps of {d.min():g} to {d.max():g} share no regular grid")
    pos = np.round((v - v[0]) / step).astype(np.int64)
    return Frequency("none", step=step), pos


def future_timestamps(last, freq: Frequency, n: int) -> np.ndarray:
    """``n`` timestamps after ``last`` on the series' grid."""
    import pandas as pd

    if freq.family == "none":
        return np.asarray(last, dtype=np.float64) + freq.step * np.arange(1, n + 1)
    off = freq.offset()
    start = pd.Timestamp(last)
    if isinstance(off, pd.Timedelta):
        return (np.datetime64(start.to_datetime64(), "ns") + np.arange(1, n + 1) * np.timedelta64(int(off.value), "ns"))
    return pd.date_range(start, periods=n + 1, freq=off)[1:].values.astype("datetime64[ns]")


def grid_timestamps(first, freq: Frequency, n: int) -> np.ndarray:
    """``n`` timestamps of the grid starting at ``first`` (``first`` included)."""
    if n <= 0:
        return np.array([], dtype="datetime64[ns]" if freq.family != "none" else np.float64)
    if freq.family == "none":
        return np.asarray(first, dtype=np.float64) + freq.step * np.arange(n)
    rest = future_timestamps(first, freq, n - 1) if n > 1 else np.array([], dtype="datetime64[ns]")
    return np.concatenate([np.array([np.datetime64(first, "ns")]), rest.astype("datetime64[ns]")])


def _human(seconds: int) -> str:
    s = int(seconds)
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if s % size == 0 and s >= size:
            v = s // size
            return f"{v} {unit[:-1] if v == 1 else unit}"
    if s >= 86400:
        return f"{s / 86400:.2f} days"
    return f"{s} seconds"
