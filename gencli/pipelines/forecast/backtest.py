"""Backtests: rolling-origin evaluation of a :class:`~gencli.pipelines.forecast.forecaster.Forecaster`
over the last windows of each series, scored against seasonal naive on the same windows (weighted
quantile loss and MASE), and the report's table and CSV rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from gencli.data.timeseries import SeriesRecord
from gencli.pipelines.forecast.features import Binding
from gencli.pipelines.forecast.forecaster import Forecaster
from gencli.pipelines.forecast.metrics import Score, geometric_mean, level_label, mase, quantile_loss_sum, rounded, seasonal_naive

# the columns of the per-series CSV (--backtest N --out FILE)
CSV_COLUMNS = ["id", "windows", "wql", "mase", "seasonal_naive_wql", "seasonal_naive_mase", "relative_wql", "relative_mase"]


def backtest(
    fc: Forecaster,
    records: Sequence[SeriesRecord],
    binding: Binding,
    horizon: int,
    windows: int,
    levels: Sequence[float],
    context: Optional[int] = None,
    min_history: int = 8,
    batch_size: int = 256,
) -> "BacktestReport":
    """Rolling-origin evaluation over the last ``windows`` windows of each series."""
    report = BacktestReport(levels=list(levels), horizon=horizon, windows=windows)
    jobs: list[tuple[SeriesRecord, int]] = []
    for rec in records:
        origins = [rec.length - (windows - k) * horizon for k in range(windows)]
        origins = [o for o in origins if o >= min_history]
        if not origins:
            report.skipped.append((rec.id, f"too short for a backtest ({rec.length} steps; {horizon} per window plus {min_history} of history needed)"))
            continue
        jobs.extend((rec, o) for o in origins)
    per_series: dict[str, SeriesScore] = {}
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        results = fc.forecast([r for r, _ in chunk], binding, horizon, levels, context, origins=[o for _, o in chunk])
        for (rec, o), res in zip(chunk, results):
            y = rec.target[o : o + horizon]
            mask = rec.observed_mask[o : o + horizon]
            hist = rec.target[:o]
            m = rec.freq.season_length()
            m = m if len(hist) >= 2 * m else 1
            naive = seasonal_naive(hist, m, horizon)
            s = per_series.setdefault(rec.id, SeriesScore(rec.id, len(levels)))
            num, den = quantile_loss_sum(y, res.quantiles, levels, mask)
            naive_num, _ = quantile_loss_sum(y, np.repeat(naive[:, None], len(levels), axis=1), levels, mask)
            y_obs = np.where(mask, y, np.nan)
            median = res.grid[:, fc.grid.index(0.5)]
            s.add(num, naive_num, den, mase(y_obs, median, hist, m), mase(y_obs, naive, hist, m))
    report.series = list(per_series.values())
    return report


@dataclass
class SeriesScore:
    """A series' backtest: the model's and seasonal naive's scores on the same windows."""

    id: str
    n_levels: int
    model: Score = None
    naive: Score = None

    def __post_init__(self) -> None:
        self.model = Score(self.n_levels)
        self.naive = Score(self.n_levels)

    def add(self, ql, naive_ql, abs_sum, m, nm) -> None:
        self.model.add(ql, abs_sum, m)
        self.naive.add(naive_ql, abs_sum, nm)

    @property
    def relative_wql(self) -> float:
        return self.model.wql / self.naive.wql if self.naive.wql > 0 else float("nan")

    @property
    def relative_mase(self) -> float:
        return self.model.mase / self.naive.mase if self.naive.mase > 0 else float("nan")

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "windows": self.model.windows,
            "wql": rounded(self.model.wql),
            "mase": rounded(self.model.mase),
            "seasonal_naive_wql": rounded(self.naive.wql),
            "seasonal_naive_mase": rounded(self.naive.mase),
            "relative_wql": rounded(self.relative_wql),
            "relative_mase": rounded(self.relative_mase),
        }


@dataclass
class BacktestReport:
    levels: list
    horizon: int
    windows: int
    series: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def summary(self) -> dict:
        ok = [s for s in self.series if s.model.abs_sum > 0]
        total_ql = sum((s.model.ql for s in ok), np.zeros(len(self.levels)))
        total_naive = sum((s.naive.ql for s in ok), np.zeros(len(self.levels)))
        total_abs = sum(s.model.abs_sum for s in ok)
        wql = float(np.mean(total_ql) / total_abs) if total_abs > 0 else float("nan")
        naive_wql = float(np.mean(total_naive) / total_abs) if total_abs > 0 else float("nan")
        return {
            "series": len(self.series),
            "windows": sum(s.model.windows for s in self.series),
            "horizon": self.horizon,
            "wql": rounded(wql),
            "seasonal_naive_wql": rounded(naive_wql),
            "relative_wql": rounded(wql / naive_wql if naive_wql > 0 else float("nan")),
            "mase": rounded(geometric_mean([s.model.mase for s in self.series])),
            "seasonal_naive_mase": rounded(geometric_mean([s.naive.mase for s in self.series])),
            "relative_wql_gmean": rounded(geometric_mean([s.relative_wql for s in self.series])),
            "relative_mase_gmean": rounded(geometric_mean([s.relative_mase for s in self.series])),
        }


def csv_rows(report: BacktestReport):
    """The per-series rows of the CSV (:data:`CSV_COLUMNS`), empty where a figure is undefined."""
    for s in report.series:
        d = s.to_dict()
        yield ["" if d[c] is None else d[c] for c in CSV_COLUMNS]


def _fmt(x, nd=4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render_backtest(report, summary: dict, label: str, fitted=None) -> str:
    used = [s.model.windows for s in report.series]
    if used and min(used) == max(used) == report.windows:
        head = f"backtest: last {report.windows} window(s) of {report.horizon} steps"
    elif used and min(used) == max(used):
        head = f"backtest: last {max(used)} window(s) of {report.horizon} steps (of the {report.windows} asked, {max(used)} fit the history)"
    else:
        lo, hi = min(used, default=0), max(used, default=0)
        head = f"backtest: {lo} to {hi} window(s) of {report.horizon} steps per series (of the {report.windows} asked, as many as fit)"
    lines = [
        f"{head}, {summary['series']} series, {summary['windows']} windows",
        f"weighted quantile loss over levels {', '.join(map(level_label, report.levels))}; MASE of the median, scaled by the in-sample seasonal-naive error",
        "",
    ]
    if len(report.series) <= 30:
        w = max(8, max(len(str(s.id)) for s in report.series))
        lines.append(f"{'series':<{w}}  {'wQL':>8} {'naive wQL':>10} {'rel wQL':>8}  {'MASE':>7} {'naive MASE':>10} {'rel MASE':>8}")
        for s in report.series:
            d = s.to_dict()
            lines.append(
                f"{str(s.id):<{w}}  {_fmt(d['wql']):>8} {_fmt(d['seasonal_naive_wql']):>10} {_fmt(d['relative_wql'], 3):>8}  "
                f"{_fmt(d['mase'], 3):>7} {_fmt(d['seasonal_naive_mase'], 3):>10} {_fmt(d['relative_mase'], 3):>8}"
            )
        lines.append("")
    rows = [(label, summary)]
    if fitted is not None:
        rows.insert(0, ("TFT zero-shot", fitted[0].summary()))
    w = max(len(r[0]) for r in rows + [("seasonal naive", None)])
    lines.append(
        f"{'':<{w}}  {'wQL':>8} {'MASE':>7}  {'rel wQL':>8} {'rel MASE':>8}"
        "   (relative: to seasonal naive; wQL pooled, MASE and per-series ratios geometric means)"
    )
    for name, s in rows:
        lines.append(f"{name:<{w}}  {_fmt(s['wql']):>8} {_fmt(s['mase'], 3):>7}  {_fmt(s['relative_wql'], 3):>8} {_fmt(s['relative_mase_gmean'], 3):>8}")
    s = rows[-1][1]
    lines.append(f"{'seasonal naive':<{w}}  {_fmt(s['seasonal_naive_wql']):>8} {_fmt(s['seasonal_naive_mase'], 3):>7}  {'1.000':>8} {'1.000':>8}")
    return "\n".join(lines)


__all__ = ["backtest", "BacktestReport", "SeriesScore", "render_backtest", "csv_rows", "CSV_COLUMNS"]
