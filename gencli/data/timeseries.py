"""One time series as the forecasting code sees it: :class:`SeriesRecord` (its target on a regular
grid, missing values imputed with an observed mask, its timestamps, covariates and frequency) and
:func:`impute_linear`. User tables are read into records by :mod:`gencli.pipelines.forecast`; the
synthetic corpus (:mod:`gencli.data.series`) generates them directly. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from gencli.data.calendar import Frequency
from gencli.errors import UserError


@dataclass
class SeriesRecord:
    """One validated series on a regular grid."""

    id: str
    target: np.ndarray  # (T,) float64, history, imputed where missing
    observed_mask: np.ndarray  # (T,) bool, False where the value was imputed
    freq: Frequency
    timestamps: Optional[np.ndarray] = None  # (T + F,) datetime64[ns] or float; None = plain steps
    known: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (T + F,)
    observed: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (T,)
    static_reals: dict[str, float] = field(default_factory=dict)
    static_cats: dict[str, str] = field(default_factory=dict)
    n_future: int = 0  # future rows with known values after the history
    imputed: int = 0  # how many history values were missing
    nonnegative: bool = False  # every observed value >= 0 (forecasts are clipped at 0)

    @property
    def length(self) -> int:
        return len(self.target)


def impute_linear(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fill NaNs by linear interpolation between observed neighbours (the nearest observed value at
    the ends); returns ``(filled, observed_mask)``."""
    v = np.asarray(values, dtype=np.float64)
    mask = np.isfinite(v)
    if mask.all():
        return v.copy(), mask
    if not mask.any():
        raise UserError("no observed values")
    idx = np.arange(len(v))
    filled = np.interp(idx, idx[mask], v[mask])
    return filled, mask


__all__ = ["SeriesRecord", "impute_linear"]
