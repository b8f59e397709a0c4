"""From series records to TFT input arrays (numpy; shared by inference, fine-tuning, backtests and
the training script, so every path sees exactly the same features).

A :class:`~gencli.data.timeseries.SeriesRecord` is one series after reading and validation (its
target history on a regular grid, missing values imputed, with an observed mask; its timestamps,
covariates and frequency). :func:`make_batch` cuts a window ending at an
origin (the end of the history for a forecast; earlier for backtests and training), scales it per
series and lays every model input out as arrays.

Inputs are matched to a model's config by name:

- observed: ``target`` (the scaled history), ``target_observed`` (1 = observed, 0 = imputed),
  ``target_diff`` (the first differences of the history over their standard deviation); any
  other name is a user column (bound by exact name, else to the next free generic slot
  ``observed_<n>``);
- known: ``relative_time`` (steps from the origin / 100), ``seasonal_lag`` (the scaled target one
  season earlier, ``m`` = the frequency's season length; over the horizon the last observed value of
  the same phase, i.e. the seasonal-naive forecast, which is known at forecast time), the calendar
  features (:data:`~gencli.data.calendar.CALENDAR_FEATURES`); other names are user
  columns (generic slots ``known_<n>``);
- static real: ``target_loc`` (asinh(loc / scale): where the series sits relative to zero); other
  names are user columns (``static_real_<n>``); static categorical: ``frequency``, else user columns
  (``static_cat_<n>``, values hashed into the embedding's buckets).

Scaling: ``scale`` is the standard deviation of the observed target values in the window's history
(floored at 1e-4 |mean|; computed on the values divided by a power of two near their peak, so that
series near 1e300 or 1e-12 scale as exactly as series near 1); ``loc`` is their mean, or with ``"scaling": "last"`` in the
config's ``extra`` the last observed value (then "no change" is exactly 0 for the model, which
keeps smooth series' levels precise). The model forecasts in that scale and :func:`unscale` maps
quantiles back. User covariates are standardised per series over the history
part of the window; static real covariates go through ``sign(x) log1p(|x|)``.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from gencli.data.calendar import CALENDAR_FEATURES, calendar_features
from gencli.data.timeseries import SeriesRecord
from gencli.errors import UserError

RELATIVE_TIME_SCALE = 100.0
INPUT_CLIP = 50.0
DIFF_CLIP = 10.0
SPECIAL = {
    "observed": ("target", "target_observed", "target_diff"),
    "known": ("relative_time", "seasonal_lag", *CALENDAR_FEATURES),
    "static_real": ("target_loc",),
    "static_cat": ("frequency",),
}
SLOT_PREFIX = {"observed": "observed_", "known": "known_", "static_real": "static_real_", "static_cat": "static_cat_"}


@dataclass
class Binding:
    """Which user column feeds which model input slot, per role."""

    known: dict[str, str] = field(default_factory=dict)  # slot -> column
    observed: dict[str, str] = field(default_factory=dict)
    static_real: dict[str, str] = field(default_factory=dict)
    static_cat: dict[str, str] = field(default_factory=dict)

    def columns(self, role: str) -> list[str]:
        return list(getattr(self, role).values())


def _role_names(config, role: str) -> list[str]:
    if role == "observed":
        return list(config.observed_reals)
    if role == "known":
        return list(config.known_reals)
    if role == "static_real":
        return list(config.static_reals)
    return list(config.static_categoricals)


def free_slots(config, role: str) -> list[str]:
    """The user-column slots a model has for a role (names that are not built-in features)."""
    return [n for n in _role_names(config, role) if n not in SPECIAL[role]]


def bind_columns(config, known: Sequence[str] = (), observed: Sequence[str] = (), static_real: Sequence[str] = (), static_cat: Sequence[str] = ()) -> Binding:
    """Match user columns to model slots: exact name first, then generic slots in order."""
    binding = Binding()
    what = {
        "known": "known covariates",
        "observed": "past-only (observed) covariates",
        "static_real": "numeric static covariates",
        "static_cat": "categorical static covariates",
    }
    for role, cols in (("known", known), ("observed", observed), ("static_real", static_real), ("static_cat", static_cat)):
        slots = free_slots(config, role)
        target = getattr(binding, role)
        rest = []
        for col in cols:
            if col in slots and col not in target:
                target[col] = col
            else:
                rest.append(col)
        generic = [s for s in slots if s not in target and re.fullmatch(re.escape(SLOT_PREFIX[role]) + r"\d+", s)]
        if len(rest) > len(generic):
            have = len(slots)
            raise UserError(
                f"the model takes at most {have} {what[role]} ({', '.join(slots) or 'none'}); got {len(cols)}: {', '.join(cols)}"
            )
        for col, slot in zip(rest, generic):
            target[slot] = col
    return binding


def _standardise(values: np.ndarray, hist: int) -> np.ndarray:
    ref = values[:hist]
    ref = ref[np.isfinite(ref)]
    if ref.size == 0:
        return np.zeros_like(values, dtype=np.float32)
    mu = float(ref.mean())
    sd = float(ref.std())
    out = (values - mu) / (sd if sd > 1e-12 else 1.0)
    out = np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)
    return np.clip(out, -INPUT_CLIP, INPUT_CLIP).astype(np.float32)


def _signed_log(x: float) -> float:
    return float(np.sign(x) * np.log1p(abs(x))) if np.isfinite(x) else 0.0


def hash_bucket(value: Any, cardinality: int) -> int:
    """A stable bucket in ``[1, cardinality)`` for a categorical value (0 = absent)."""
    if cardinality <= 1:
        return 0
    return 1 + zlib.crc32(str(value).encode("utf-8")) % (cardinality - 1)


def series_scale(values: np.ndarray, mask: Optional[np.ndarray] = None) -> tuple[float, float]:
    """``(loc, scale)`` of a history window: mean and standard deviation of its observed values (the
    standard deviation floored at 1e-4 |mean|; ``(0, 1)`` for a window of zeros or of no values).

    Both are computed in units of a power of two near the values' peak (an exact division), so the
    squares neither overflow near 1e300 nor vanish near 1e-160, and a series' forecast scales with it."""
    v = values if mask is None else values[mask]
    v = v[np.isfinite(v)]
    peak = float(np.abs(v).max()) if v.size else 0.0
    if peak == 0.0:
        return 0.0, 1.0
    unit = float(np.ldexp(1.0, int(np.frexp(peak)[1])))
    u = v / unit
    loc = float(u.mean())
    return loc * unit, max(float(u.std()), 1e-4 * abs(loc)) * unit


@dataclass
class Batch:
    """Model inputs for a batch of windows (numpy), plus what is needed to undo the scaling."""

    ids: list[str]
    observed_reals: np.ndarray  # (B, L, n_obs) float32
    known_reals: np.ndarray  # (B, L + H, n_known) float32
    static_reals: np.ndarray  # (B, n_sr) float32
    static_categoricals: np.ndarray  # (B, n_sc) int64
    encoder_lengths: np.ndarray  # (B,) int64
    loc: np.ndarray  # (B,) float64
    scale: np.ndarray  # (B,) float64
    target_future: Optional[np.ndarray] = None  # (B, H) float64 in original units (when known)
    future_mask: Optional[np.ndarray] = None  # (B, H) bool, observed future targets

    def tensors(self, device=None):
        import torch

        def t(a, dtype=None):
            x = torch.from_numpy(np.ascontiguousarray(a))
            return x.to(device) if device is not None else x

        return {
            "observed_reals": t(self.observed_reals),
            "known_reals": t(self.known_reals),
            "static_reals": t(self.static_reals) if self.static_reals.shape[1] else None,
            "static_categoricals": t(self.static_categoricals) if self.static_categoricals.shape[1] else None,
            "encoder_lengths": t(self.encoder_lengths),
        }


def seasonal_lag_index(start: int, origin: int, horizon: int, season: int) -> np.ndarray:
    """For positions ``[start, origin + horizon)``, the index of the value one season earlier; over the
    horizon, the last observed index of the same phase (seasonal naive). With less than one season
    of history the season is taken as 1 (the last value); positions before the first season point
    at themselves."""
    m = season if origin >= season else 1
    past = np.arange(start, origin)
    past_src = np.where(past >= m, past - m, past)
    h = np.arange(horizon)
    future_src = origin - m + (h % m)
    return np.concatenate([past_src, future_src])


def make_batch(
    records: Sequence[SeriesRecord],
    config,
    binding: Binding,
    context: int,
    horizon: int,
    origins: Optional[Sequence[int]] = None,
    with_future_target: bool = False,
) -> Batch:
    """Lay out windows of ``records`` as model inputs.

    ``origins[i]`` is the index of the first forecast step of record ``i`` (default: its length, i.e.
    forecast after the end of the history); the history window is ``[origin - context, origin)``
    clipped at 0, left-aligned in the arrays. Known covariates must cover ``[origin, origin + horizon)``.
    """
    b = len(records)
    origins = [r.length for r in records] if origins is None else list(origins)
    lengths = np.array([min(context, o) for o in origins], dtype=np.int64)
    if (lengths < 1).any():
        raise ValueError("a window has no history")
    lmax = int(lengths.max())
    obs_names = _role_names(config, "observed")
    known_names = _role_names(config, "known")
    sr_names = _role_names(config, "static_real")
    sc_names = _role_names(config, "static_cat")
    sc_cards = list(config.static_categoricals.values())
    obs = np.zeros((b, lmax, len(obs_names)), dtype=np.float32)
    known = np.zeros((b, lmax + horizon, len(known_names)), dtype=np.float32)
    sreal = np.zeros((b, len(sr_names)), dtype=np.float32)
    scat = np.zeros((b, len(sc_names)), dtype=np.int64)
    loc = np.zeros(b)
    scale = np.ones(b)
    fut = np.full((b, horizon), np.nan) if with_future_target else None
    fmask = np.zeros((b, horizon), dtype=bool) if with_future_target else None
    anchor_last = (getattr(config, "extra", None) or {}).get("scaling") == "last"
    cal_idx = [known_names.index(c) for c in CALENDAR_FEATURES if c in known_names]
    cal_cols = [CALENDAR_FEATURES.index(c) for c in CALENDAR_FEATURES if c in known_names]

    for i, (rec, origin) in enumerate(zip(records, origins)):
        n = int(lengths[i])
        start = origin - n
        y = rec.target[start:origin]
        m = rec.observed_mask[start:origin]
        mean, sc = series_scale(y, m)
        lo = float(y[m][-1]) if anchor_last and m.any() else mean
        loc[i], scale[i] = lo, sc
        ys = np.clip((y - lo) / sc, -INPUT_CLIP, INPUT_CLIP)
        for j, name in enumerate(obs_names):
            if name == "target":
                obs[i, :n, j] = ys
            elif name == "target_observed":
                obs[i, :n, j] = m
            elif name == "target_diff":
                d = np.diff(ys, prepend=ys[0])
                sd = float(d.std())
                obs[i, :n, j] = np.clip(d / (sd if sd > 1e-9 else 1.0), -DIFF_CLIP, DIFF_CLIP)
            elif name in binding.observed:
                col = rec.observed.get(binding.observed[name])
                if col is not None:
                    obs[i, :n, j] = _standardise(col[start:origin], n)
        span_end = origin + horizon
        # known: history rows at [0, n), horizon rows at [lmax, lmax + horizon)
        rows = np.concatenate([np.arange(n), lmax + np.arange(horizon)])
        for j, name in enumerate(known_names):
            if name == "relative_time":
                known[i, rows, j] = np.arange(-n, horizon, dtype=np.float32) / RELATIVE_TIME_SCALE
            elif name == "seasonal_lag":
                lag = seasonal_lag_index(start, origin, horizon, rec.freq.season_length())
                known[i, rows, j] = np.clip((rec.target[lag] - lo) / sc, -INPUT_CLIP, INPUT_CLIP)
            elif name in binding.known:
                col = rec.known.get(binding.known[name])
                if col is not None:
                    if len(col) < span_end:
                        raise UserError(
                            f"series '{rec.id}': known covariate '{binding.known[name]}' covers {len(col) - rec.length} future steps, the horizon is {horizon}"
                        )
                    known[i, rows, j] = _standardise(col[start:span_end], n)
        if cal_idx and rec.timestamps is not None and np.issubdtype(np.asarray(rec.timestamps).dtype, np.datetime64):
            ts = rec.timestamps
            if len(ts) < span_end:
                from gencli.data.calendar import future_timestamps

                ts = np.concatenate([ts.astype("datetime64[ns]"), future_timestamps(ts[-1], rec.freq, span_end - len(ts))])
            cal = calendar_features(ts[start:span_end], span_end - start)
            known[i, rows[:, None], np.array(cal_idx)[None, :]] = cal[:, cal_cols]
        for j, name in enumerate(sr_names):
            if name == "target_loc":
                sreal[i, j] = np.arcsinh(mean / sc)
            elif name in binding.static_real:
                sreal[i, j] = _signed_log(float(rec.static_reals.get(binding.static_real[name], 0.0)))
        for j, name in enumerate(sc_names):
            if name == "frequency":
                scat[i, j] = min(rec.freq.code, sc_cards[j] - 1)
            elif name in binding.static_cat:
                v = rec.static_cats.get(binding.static_cat[name])
                scat[i, j] = 0 if v is None else hash_bucket(v, sc_cards[j])
        if with_future_target:
            avail = min(horizon, rec.length - origin)
            if avail > 0:
                fut[i, :avail] = rec.target[origin : origin + avail]
                fmask[i, :avail] = rec.observed_mask[origin : origin + avail]
    return Batch([r.id for r in records], obs, known, sreal, scat, lengths, loc, scale, fut, fmask)


def unscale(quantiles: np.ndarray, loc: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Model-scale quantiles ``(B, H, Q)`` back to the series' units."""
    return quantiles * scale[:, None, None] + loc[:, None, None]
