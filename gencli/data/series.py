"""A deterministic generator of varied synthetic time series (the forecasting model's training corpus).

Every series is a draw from a random composition of the things real series are made of:

- a frequency (sub-hourly, hourly, daily, business-daily, weekly, monthly, quarterly, yearly or a
  plain step index) with real timestamps from a random start date;
- calendar seasonalities locked to those timestamps (time of day, day of week, time of year; random
  Fourier shapes, additive or multiplicative, with slowly drifting amplitude), and quasi-periodic
  cycles that are not calendar-bound (period 3-80 steps, sunspot-like skewed shapes);
- a trend: none, linear, piecewise linear with changepoints, damped, a random walk, a smooth
  integrated (macro-economic-like) trend or exponential growth;
- level shifts, outliers, AR(1) noise of very different levels, heavy tails, heteroscedasticity;
- intermittent demand (Bernoulli occurrence x gamma sizes) and low counts (Poisson);
- covariates in the generic slots the default model exposes: known future inputs (promotion-like
  events with an effect, continuous drivers with a linear effect, or irrelevant noise),
  past-only inputs (a leading indicator, or noise) and static inputs (irrelevant: the model learns
  to ignore them zero-shot; fine-tuning can give them meaning);
- missing stretches (imputed, with an observed mask, exactly as the CLI does for user data).

``generate(seed, length)`` returns one :class:`~gencli.data.timeseries.SeriesRecord`;
the same seed gives the same series on every machine (numpy's PCG64).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from gencli.data.calendar import Frequency
from gencli.data.timeseries import SeriesRecord, impute_linear

FREQ_WEIGHTS = {
    "subhourly": 0.05,
    "hourly": 0.13,
    "daily": 0.17,
    "business": 0.04,
    "weekly": 0.12,
    "monthly": 0.19,
    "quarterly": 0.11,
    "yearly": 0.12,
    "none": 0.07,
}
NUM_KNOWN_SLOTS = 2
NUM_OBSERVED_SLOTS = 1
NUM_STATIC_REAL_SLOTS = 2
NUM_STATIC_CAT_SLOTS = 1


def _timestamps(rng: np.random.Generator, freq: Frequency, n: int) -> Optional[np.ndarray]:
    f = freq.family
    if f == "none":
        return None
    year = int(rng.integers(1900, 2030)) if f in ("monthly", "quarterly", "yearly") else int(rng.integers(1985, 2030))
    if f == "yearly":
        year = int(rng.integers(1700, 2030 - n)) if n < 300 else 1700
    day0 = np.datetime64(f"{year}-01-01") + np.timedelta64(int(rng.integers(0, 365)), "D")
    if f == "subhourly":
        return day0.astype("datetime64[m]") + np.arange(n) * np.timedelta64(freq.minutes, "m")
    if f == "hourly":
        return day0.astype("datetime64[h]") + np.arange(n) * np.timedelta64(freq.multiple, "h")
    if f == "daily":
        return day0 + np.arange(n) * np.timedelta64(freq.multiple, "D")
    if f == "business":
        return np.busday_offset(np.busday_offset(day0, 0, roll="forward"), np.arange(n))
    if f == "weekly":
        return day0 + np.arange(n) * np.timedelta64(7, "D")
    months = {"monthly": 1, "quarterly": 3, "yearly": 12}[f] * freq.multiple
    m0 = np.datetime64(f"{year}-01", "M") + np.timedelta64(int(rng.integers(0, 12)) if f != "yearly" else 0, "M")
    starts = m0 + np.arange(n) * np.timedelta64(months, "M")
    if freq.anchor == "end":
        return (starts + np.timedelta64(1, "M")).astype("datetime64[D]") - np.timedelta64(1, "D")
    return starts.astype("datetime64[D]")


def _frequency(rng: np.random.Generator, family: Optional[str]) -> Frequency:
    if family is None:
        names = list(FREQ_WEIGHTS)
        p = np.array(list(FREQ_WEIGHTS.values()))
        family = names[int(rng.choice(len(names), p=p / p.sum()))]
    if family == "subhourly":
        return Frequency("subhourly", minutes=int(rng.choice([5, 10, 15, 30])))
    if family in ("monthly", "quarterly", "yearly"):
        return Frequency(family, anchor="end" if rng.random() < 0.3 else "start")
    if family == "none":
        return Frequency("none", step=1.0)
    return Frequency(family)


def _fourier(phase: np.ndarray, rng: np.random.Generator, harmonics: int) -> np.ndarray:
    """A random periodic shape of a phase in [0, 1), unit standard deviation."""
    out = np.zeros_like(phase)
    for k in range(1, harmonics + 1):
        a, b = rng.normal(size=2) / k ** rng.uniform(0.5, 1.5)
        out += a * np.sin(2 * np.pi * k * phase) + b * np.cos(2 * np.pi * k * phase)
    sd = out.std()
    return out / sd if sd > 1e-9 else out


def _calendar_phases(ts: np.ndarray) -> dict[str, np.ndarray]:
    t = ts.astype("datetime64[m]")
    days = t.astype("datetime64[D]")
    minutes = (t - days).astype(np.int64)
    weekday = (days.astype(np.int64) + 3) % 7
    doy = (days - days.astype("datetime64[Y]").astype("datetime64[D]")).astype(np.float64)
    return {"day": minutes / 1440.0, "week": (weekday + minutes / 1440.0) / 7.0, "year": (doy + minutes / 1440.0) / 365.25}


def _seasonality(rng: np.random.Generator, freq: Frequency, ts: Optional[np.ndarray], n: int) -> np.ndarray:
    """Calendar-locked and free cycles, summed, unit-ish scale."""
    season = np.zeros(n)
    f = freq.family
    if ts is not None:
        ph = _calendar_phases(ts)
        cycles = {
            "subhourly": [("day", 0.9), ("week", 0.5)],
            "hourly": [("day", 0.9), ("week", 0.6), ("year", 0.15)],
            "daily": [("week", 0.75), ("year", 0.5)],
            "business": [("week", 0.5), ("year", 0.5)],
            "weekly": [("year", 0.7)],
            "monthly": [("year", 0.75)],
            "quarterly": [("year", 0.65)],
            "yearly": [],
        }[f]
        for name, prob in cycles:
            if rng.random() < prob:
                if name == "week" and rng.random() < 0.4:
                    # weekday profile: e.g. weekends low
                    prof = rng.normal(size=7)
                    if rng.random() < 0.5:
                        prof[5:] -= rng.uniform(1, 3)
                    shape = prof[np.floor(ph["week"] * 7).astype(int) % 7]
                    shape = (shape - shape.mean()) / (shape.std() + 1e-9)
                else:
                    shape = _fourier(ph[name], rng, int(rng.integers(1, 5)))
                amp = rng.uniform(0.2, 1.5)
                drift = 1.0 + (np.cumsum(rng.normal(0, 0.02, n)) if rng.random() < 0.3 else 0.0)
                season += amp * shape * drift
    # free (non-calendar) cycles
    p_free = 0.55 if f in ("yearly", "none") else 0.15
    if rng.random() < p_free:
        period = float(np.exp(rng.uniform(np.log(3), np.log(80))))
        period = min(period, max(3.0, n / 2))
        inc = 2 * np.pi / period * (1 + np.cumsum(rng.normal(0, 0.01, n)).clip(-0.3, 0.3)) if rng.random() < 0.5 else np.full(n, 2 * np.pi / period)
        phase = rng.uniform(0, 2 * np.pi) + np.cumsum(inc)
        base = np.sin(phase)
        if rng.random() < 0.4:  # skewed, sunspot-like cycles
            base = np.abs(np.sin(phase / 2)) ** rng.uniform(1.0, 2.5)
        amp_mod = np.exp(np.cumsum(rng.normal(0, 0.03, n)).clip(-1, 1)) if rng.random() < 0.5 else 1.0
        shape = base * amp_mod
        shape = (shape - shape.mean()) / (shape.std() + 1e-9)
        season += rng.uniform(0.3, 2.0) * shape
    return season


def _trend(rng: np.random.Generator, n: int) -> np.ndarray:
    t = np.linspace(0.0, 1.0, n)
    kind = rng.choice(["none", "linear", "piecewise", "damped", "walk", "smooth", "exp"], p=[0.2, 0.2, 0.12, 0.1, 0.16, 0.14, 0.08])
    mag = rng.uniform(0.5, 4.0) * rng.choice([-1, 1])
    if kind == "none":
        return np.zeros(n)
    if kind == "linear":
        return mag * t
    if kind == "piecewise":
        k = int(rng.integers(1, 4))
        knots = np.sort(rng.uniform(0.1, 0.9, k))
        slopes = rng.normal(0, 1, k + 1) * abs(mag)
        y = slopes[0] * t
        for kn, s in zip(knots, np.diff(slopes)):
            y += s * np.maximum(t - kn, 0)
        return y
    if kind == "damped":
        return mag * (1 - np.exp(-t * rng.uniform(1, 6)))
    if kind == "walk":
        return np.cumsum(rng.normal(0, 1, n)) * abs(mag) / np.sqrt(n) * rng.uniform(1, 3)
    if kind == "smooth":
        drift = np.cumsum(rng.normal(0, 1, n)) / np.sqrt(n)
        y = np.cumsum(drift + rng.normal(0.5, 0.5)) / n * abs(mag) * 3
        return y - y[0]
    growth = rng.uniform(0.5, 2.5) * rng.choice([-1, 1], p=[0.2, 0.8])
    return mag * (np.exp(growth * t) - 1) / (np.exp(abs(growth)) - 1)


def _noise(rng: np.random.Generator, n: int) -> np.ndarray:
    phi = rng.uniform(-0.3, 0.95) if rng.random() < 0.6 else 0.0
    eps = rng.standard_t(df=3, size=n) / np.sqrt(3) if rng.random() < 0.2 else rng.normal(size=n)
    if phi == 0.0:
        return eps
    out = np.empty(n)
    prev = eps[0] / np.sqrt(max(1e-6, 1 - phi * phi))
    for i in range(n):
        prev = phi * prev + eps[i]
        out[i] = prev
    return out * np.sqrt(1 - phi * phi)


def _events(rng: np.random.Generator, n: int) -> np.ndarray:
    rate = rng.uniform(0.02, 0.2)
    ev = (rng.random(n) < rate).astype(np.float64)
    if rng.random() < 0.4:  # events lasting several steps
        width = int(rng.integers(2, 5))
        ev = np.convolve(ev, np.ones(width), mode="full")[:n].clip(0, 1)
    return ev


def _smooth_driver(rng: np.random.Generator, n: int, season: np.ndarray) -> np.ndarray:
    x = _noise(rng, n) * rng.uniform(0.2, 1.0)
    if season.std() > 0 and rng.random() < 0.6:
        x += season * rng.uniform(0.5, 1.5)
    return x


def generate(seed, length: int, frequency: Optional[str] = None, covariates: bool = True, missing: bool = True) -> SeriesRecord:
    """One synthetic series of ``length`` steps (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    n = int(length)
    freq = _frequency(rng, frequency)
    ts = _timestamps(rng, freq, n)
    season = _seasonality(rng, freq, ts, n)
    trend = _trend(rng, n)
    noise = _noise(rng, n)
    sigma = float(np.exp(rng.uniform(np.log(0.03), np.log(1.2))))
    latent = trend + season + sigma * noise
    if rng.random() < 0.15:  # level shifts
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(1, n))
            latent[at:] += rng.normal(0, 1.5)
    known: dict[str, np.ndarray] = {}
    observed: dict[str, np.ndarray] = {}
    if covariates:
        for k in range(1, NUM_KNOWN_SLOTS + 1):
            if rng.random() < 0.22:
                kind = rng.choice(["event", "driver", "noise"], p=[0.45, 0.3, 0.25])
                if kind == "event":
                    x = _events(rng, n)
                    latent += x * rng.uniform(0.5, 3.0) * rng.choice([-1, 1], p=[0.25, 0.75])
                elif kind == "driver":
                    x = _smooth_driver(rng, n, season)
                    latent += x * rng.normal(0, 0.8)
                else:
                    x = rng.normal(size=n) if rng.random() < 0.5 else _events(rng, n)
                known[f"known_{k}"] = x * rng.uniform(0.1, 100) + rng.normal(0, 10)
    kind = rng.choice(["plain", "positive", "multiplicative", "intermittent", "counts"], p=[0.3, 0.33, 0.2, 0.08, 0.09])
    scale = float(np.exp(rng.uniform(np.log(0.01), np.log(1e4))))
    if kind == "plain":
        y = scale * latent + rng.normal(0, 3) * scale
    elif kind == "positive":
        span = latent.max() - latent.min() + 1e-6
        y = scale * (latent - latent.min() + span * float(np.exp(rng.uniform(np.log(0.05), np.log(30.0)))))
    elif kind == "multiplicative":
        log_y = 0.25 * latent * rng.uniform(0.3, 1.2)
        y = scale * np.exp(log_y - log_y.mean())
    elif kind == "intermittent":
        p = 1 / (1 + np.exp(-(rng.uniform(-2.5, 0.5) + 0.5 * season)))
        occur = rng.random(n) < p
        sizes = rng.gamma(rng.uniform(1, 5), 1.0, n) * np.exp(0.3 * (latent - latent.mean()) / (latent.std() + 1e-9))
        y = np.where(occur, sizes, 0.0) * max(1.0, scale)
        if rng.random() < 0.5:
            y = np.round(y)
    else:
        rate = np.exp(np.log(rng.uniform(0.5, 30)) + 0.4 * (latent - latent.mean()) / (latent.std() + 1e-9))
        y = rng.poisson(rate).astype(np.float64)
    if rng.random() < 0.04:  # outliers
        idx = rng.integers(0, n, int(rng.integers(1, 4)))
        y[idx] += rng.normal(0, 5) * (y.std() + 1e-9)
    if covariates:
        for k in range(1, NUM_OBSERVED_SLOTS + 1):
            if rng.random() < 0.12:
                if rng.random() < 0.6:
                    lag = int(rng.integers(1, 6))
                    lead = np.concatenate([y[lag:], np.full(lag, y[-1])])
                    observed[f"observed_{k}"] = lead + rng.normal(0, 0.3 * (y.std() + 1e-9), n)
                else:
                    observed[f"observed_{k}"] = rng.normal(size=n)
    static_reals = {f"static_real_{k}": float(rng.normal(0, 100)) for k in range(1, NUM_STATIC_REAL_SLOTS + 1) if covariates and rng.random() < 0.15}
    static_cats = {f"static_cat_{k}": str(int(rng.integers(0, 1000))) for k in range(1, NUM_STATIC_CAT_SLOTS + 1) if covariates and rng.random() < 0.15}
    mask = np.ones(n, dtype=bool)
    if missing and rng.random() < 0.08:
        for _ in range(int(rng.integers(1, 4))):
            a = int(rng.integers(0, n))
            mask[a : a + int(rng.integers(1, max(2, n // 20)))] = False
        mask[0] = True
        y_obs = np.where(mask, y, np.nan)
        y, mask = impute_linear(y_obs)
    return SeriesRecord(
        id=f"synthetic-{seed}",
        target=y.astype(np.float64),
        observed_mask=mask,
        freq=freq,
        timestamps=ts.astype("datetime64[ns]") if ts is not None else None,
        known=known,
        observed=observed,
        static_reals=static_reals,
        static_cats=static_cats,
        n_future=0,
        imputed=int((~mask).sum()),
        nonnegative=bool((y >= 0).all()),
    )


def demo_sales(n_stores: int = 3, days: int = 120, horizon: int = 14, seed: int = 7):
    """A small long-format demo table: daily sales of a few stores with a known promotion
    calendar (including the next ``horizon`` days, target empty), store size and area."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    dates = pd.date_range("2024-01-01", periods=days + horizon, freq="D")
    rows = []
    weekly = np.array([0.9, 0.95, 1.0, 1.05, 1.2, 1.45, 0.6])[dates.day_of_week]
    for k in range(n_stores):
        promo = (rng.random(len(dates)) < 0.12).astype(int)
        level = 80 + 40 * k
        trend = 1 + 0.002 * np.arange(len(dates))
        sales = level * weekly * trend * (1 + 0.35 * promo) * np.exp(rng.normal(0, 0.06, len(dates)))
        for i, d in enumerate(dates):
            rows.append(
                {
                    "store": f"store_{k + 1}",
                    "date": d.strftime("%Y-%m-%d"),
                    "sales": round(float(sales[i]), 1) if i < days else None,
                    "promo": int(promo[i]),
                    "size_m2": 250 + 90 * k,
                    "area": ["urban", "suburban", "rural"][k % 3],
                }
            )
    return pd.DataFrame(rows)


if __name__ == "__main__":
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "sales.csv"
    demo_sales().to_csv(out, index=False)
    print(f"wrote {out}")
