"""The outputs of a forecast run, written series by series as the batches finish: CSV rows (``--out``
or stdout), JSON lines (``--json``), explanations (``--explain`` on stderr, ``--explain-out``
CSV or JSON lines), fan-chart panels (``--plot``) and the note on imputed values."""

from __future__ import annotations

import contextlib
import json
from typing import IO, Any, Optional, Sequence

import numpy as np

from gencli.console import Reporter, csv_line, emit_json, open_output
from gencli.data.calendar import future_timestamps
from gencli.pipelines.forecast.forecaster import ForecastResult
from gencli.pipelines.forecast.metrics import level_label
from gencli.pipelines.forecast.records import format_time
from gencli.pipelines.forecast.request import ForecastRequest

MAX_PRINTED_EXPLANATIONS = 20


def quantile_name(q: float) -> str:
    return f"q{level_label(q)}"


def format_value(v: float) -> str:
    """A forecast value for the CSV: 8 significant digits, empty when not finite."""
    if not np.isfinite(v):
        return ""
    return f"{v:.8g}"


class ForecastWriter:
    """Writes every output a forecast run asked for, one series at a time (:meth:`write`), and the
    closing notes and plot (:meth:`finish`). Output files are written atomically: they appear only
    when the ``contextlib.ExitStack`` they were opened on closes without an error."""

    def __init__(
        self,
        req: ForecastRequest,
        report: Reporter,
        grid: Sequence[float],
        horizon: int,
        context: int,
        stack: contextlib.ExitStack,
        results: IO[str],
        time_zone: Any = None,
    ):
        self.req = req
        self.time_zone = time_zone
        self.report = report
        self.grid = list(grid)
        self.horizon = horizon
        self.context = context
        self.levels = req.quantiles
        self.want_explain = req.explain or bool(req.explain_out)
        # the results (--out, else stdout): CSV rows, or JSON lines with --json
        self.results = results
        self.csv: Optional[IO[str]] = None if report.json else results
        self.explain_file: Optional[IO[str]] = stack.enter_context(open_output(req.explain_out, req.force, newline="")) if req.explain_out else None
        self.explain_json = bool(req.explain_out and req.explain_out.lower().endswith((".json", ".jsonl")))
        self.wrote_header = False
        self.explain_rows = 0
        self.printed_explain = 0
        self.plots: list[dict] = []
        self.imputed: list[tuple[str, int]] = []
        self.done = 0

    def write(self, res: ForecastResult) -> None:
        times = future_times(res, self.horizon, self.time_zone)
        if self.csv is not None:
            if not self.wrote_header:
                self.csv.write(csv_line(["id", "time"] + [quantile_name(q) for q in self.levels]))
                self.wrote_header = True
            self.csv.write("".join(csv_line([res.record.id, t, *(format_value(v) for v in res.quantiles[h])]) for h, t in enumerate(times)))
        if self.report.json:
            emit_json(json_record(res, times, self.levels, self.grid), self.results)
        if self.want_explain and res.explain is not None:
            self._explain(res)
        if self.req.plot and len(self.plots) < self.req.plot_max:
            self.plots.append(plot_item(res, future_times(res, self.horizon) if self.time_zone else times, self.grid, self.context))
        if res.record.imputed:
            self.imputed.append((res.record.id, res.record.imputed))
        self.done += 1

    def _explain(self, res: ForecastResult) -> None:
        if self.req.explain and self.printed_explain < MAX_PRINTED_EXPLANATIONS and not self.report.quiet:
            self.report.say(explain_text(res))
            self.printed_explain += 1
        if self.explain_file is None:
            return
        if self.explain_json:
            self.explain_file.write(json.dumps({"id": res.record.id, **res.explain}) + "\n")
            return
        if self.explain_rows == 0:
            self.explain_file.write("id,kind,name,weight\n")
        for row in explain_csv_rows(res):
            self.explain_file.write(csv_line(row))
            self.explain_rows += 1

    def flush(self) -> None:
        """After each batch: the rows written are visible at once (a pipe sees them as they come)."""
        self.results.flush()

    def notes(self) -> None:
        """The closing lines on stderr: explanations not shown, values imputed."""
        if self.req.explain and self.printed_explain == MAX_PRINTED_EXPLANATIONS and self.done > MAX_PRINTED_EXPLANATIONS:
            self.report.say(f"(explanations shown for the first {MAX_PRINTED_EXPLANATIONS} of {self.done} series; --explain-out FILE writes all of them)")

    def finish(self) -> None:
        """The imputation note and the fan chart, once every series is written."""
        if self.imputed:
            self.report.say(imputed_note(self.imputed))
        if self.req.plot:
            from gencli.pipelines.forecast.plot import fan_chart

            fan_chart(self.plots, self.levels, self.req.plot, self.req.force)


def future_times(res: ForecastResult, horizon: int, time_zone: Any = None) -> list[str]:
    """The time labels of the forecast steps after the result's origin (with ``time_zone``'s offset
    where the input's timestamps carried one)."""
    rec = res.record
    o = res.origin
    if rec.timestamps is None:
        return [str(o + i) for i in range(horizon)]
    ts = rec.timestamps
    if len(ts) >= o + horizon:
        fut = ts[o : o + horizon]
    else:
        base = ts[:o]
        fut = (
            np.concatenate([ts[o : len(ts)], future_timestamps(ts[len(ts) - 1], rec.freq, o + horizon - len(ts))])
            if len(ts) > o
            else future_timestamps(base[-1], rec.freq, horizon)
        )
    return [format_time(v, time_zone) for v in fut]


def json_record(res: ForecastResult, times: Sequence[str], levels: Sequence[float], grid: Sequence[float]) -> dict:
    """The --json object of one series' forecast."""
    rec = res.record
    out = {
        "id": rec.id,
        "frequency": rec.freq.label,
        "history_length": rec.length,
        "imputed": rec.imputed,
        "time": times,
        "quantiles": {level_label(q): [json_number(v) for v in res.quantiles[:, j]] for j, q in enumerate(levels)},
        "median": [json_number(v) for v in res.grid[:, list(grid).index(0.5)]],
    }
    if res.explain is not None:
        out["explain"] = {k: (v[:64] if k == "attention_by_lag" else v) for k, v in res.explain.items()}
    return out


def json_number(v: float) -> Optional[float]:
    """A value for JSON: 8 significant digits, null when not finite."""
    return float(f"{v:.8g}") if np.isfinite(v) else None


def explain_text(res: ForecastResult) -> str:
    """The --explain lines of one series: its most important inputs and where its attention goes."""
    ex = res.explain

    def top(d: dict, k: int = 5) -> str:
        return ", ".join(f"{name} {w:.2f}" for name, w in list(d.items())[:k]) or "-"

    lags = np.asarray(ex["attention_by_lag"])
    order = np.argsort(-lags)[:5]
    peaks = ", ".join(f"t-{int(i) + 1} ({lags[i]:.2f})" for i in order)
    lines = [
        f"series '{res.record.id}':",
        f"  history inputs: {top(ex['past'])}",
        f"  future inputs:  {top(ex['future'])}",
    ]
    if ex["static"]:
        lines.append(f"  static inputs:  {top(ex['static'])}")
    lines.append(f"  attention: {100 * ex['attention_on_history']:.0f}% on the history; peaks at {peaks}")
    if ex.get("ensemble"):
        lines.append(f"  ensemble weights: {ensemble_weights_text(ex['ensemble'])}")
    return "\n".join(lines)


def ensemble_weights_text(weights: dict) -> str:
    """Every member with a non-zero weight, heaviest first (a member that carries the forecast is never hidden)."""
    members = sorted(((name, w) for name, w in weights.items() if w > 0), key=lambda item: -item[1])
    return ", ".join(f"{name} {w:.2f}" if w >= 0.005 else f"{name} {w:.1e}" for name, w in members) or "-"


def explain_csv_rows(res: ForecastResult):
    """The --explain-out CSV rows ``(id, kind, name, weight)`` of one series."""
    ex = res.explain
    sid = res.record.id
    for kind in ("static", "past", "future", "ensemble"):
        for name, w in ex.get(kind, {}).items():
            yield (sid, kind, name, f"{w:.6g}")
    for lag, w in enumerate(ex["attention_by_lag"], start=1):
        yield (sid, "attention", f"t-{lag}", f"{w:.6g}")
    yield (sid, "attention", "horizon", f"{1.0 - ex['attention_on_history']:.6g}")  # earlier forecast steps


def plot_item(res: ForecastResult, times: Sequence[str], grid: Sequence[float], context: int) -> dict:
    """One panel of the fan chart: the recent history and the forecast's quantiles."""
    rec = res.record
    n = min(rec.length, max(3 * len(times), min(context, 200)))
    hist_y = rec.target[rec.length - n :]
    if rec.timestamps is not None:
        hist_t = rec.timestamps[rec.length - n : rec.length]
        fut_t = np.array(times, dtype="datetime64[ns]") if np.issubdtype(rec.timestamps.dtype, np.datetime64) else np.array(times, dtype=float)
    else:
        hist_t = np.arange(rec.length - n, rec.length)
        fut_t = np.arange(rec.length, rec.length + len(times))
    return {"id": rec.id, "hist_t": hist_t, "hist_y": hist_y, "fut_t": fut_t, "quantiles": res.quantiles, "grid": res.grid, "grid_levels": grid}


def imputed_note(imputed: list[tuple[str, int]]) -> str:
    """One line on the missing history values that were filled in (per series, or a total)."""
    total = sum(n for _, n in imputed)
    how = "by linear interpolation between observed neighbours (the model also sees which values were missing)"
    if len(imputed) <= 3:
        where = ", ".join(f"{n} in series '{sid}'" for sid, n in imputed)
        return f"note: {total} missing history value{'s' if total != 1 else ''} imputed ({where}) {how}"
    return f"note: {total} missing history values in {len(imputed)} series imputed {how}; --json gives the count per series"


__all__ = [
    "ForecastWriter",
    "quantile_name",
    "format_value",
    "future_times",
    "json_record",
    "json_number",
    "explain_text",
    "explain_csv_rows",
    "plot_item",
    "imputed_note",
]
