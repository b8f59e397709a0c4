"""Real time series that ship with statsmodels (available offline), for evaluating forecasters.

Each entry is ``(dataset, name, frame)`` with ``frame`` a two-column DataFrame ``time, value`` in the
layout a user would give ``gencli forecast``. None of these series is used for training.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

HEADLINE = ("co2", "sunspots", "macrodata", "elnino", "nile", "elec_equip", "danish_data", "interest_inflation")


def _frame(times, values):
    import pandas as pd

    return pd.DataFrame({"time": times, "value": np.asarray(values, dtype=np.float64)})


def _quarters(years, quarters):
    import pandas as pd

    return [pd.Timestamp(year=int(y), month=3 * (int(q) - 1) + 1, day=1) for y, q in zip(years, quarters)]


def load(dataset: str) -> list[tuple[str, str, object]]:
    """The series of one statsmodels dataset as ``(dataset, name, frame)``."""
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
