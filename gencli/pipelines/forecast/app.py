"""`gencli forecast` end to end: read -> validate per series -> (fine-tune) -> forecast or backtest
-> write CSV / JSON lines / plot / explanations, streaming in batches."""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Optional

import numpy as np

from gencli.errors import UserError
from gencli.io import atomic_open, ensure_writable
from gencli.pipelines.forecast.frame import (
    Layout,
    RecordOptions,
    SeriesError,
    build_record,
    format_time,
    infer_layout,
    iter_groups,
    open_table,
)


@dataclass
class ForecastRequest:
    data: str
    horizon: Optional[int] = None
    quantiles: list = field(default_factory=lambda: [0.1, 0.5, 0.9])
    context: Optional[int] = None
    time_col: Optional[str] = None
    target_col: Optional[str] = None
    id_col: Optional[str] = None
    known_cols: Optional[list] = None
    static_cols: Optional[list] = None
    observed_cols: Optional[list] = None
    wide: bool = False
    out: Optional[str] = None
    plot: Optional[str] = None
    plot_max: int = 12
    explain: bool = False
    explain_out: Optional[str] = None
    backtest: Optional[int] = None
    fit_steps: int = 0
    fit_lr: float = 3e-4
    save_model: Optional[str] = None
    batch_size: int = 256
    min_length: int = 8
    strict: bool = False
    force: bool = False
    allow_negative: bool = False


def parse_quantiles(text: str) -> list[float]:
    levels = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            q = float(part)
        except ValueError:
            raise UserError(f"--quantiles: '{part}' is not a number") from None
        if not 0.0 < q < 1.0:
            raise UserError(f"--quantiles: {part} is not inside (0, 1)")
        levels.append(q)
    if not levels:
        raise UserError("--quantiles: no quantile levels given")
    return sorted(set(levels))


def parse_columns(text: Optional[str]) -> Optional[list[str]]:
    if text is None:
        return None
    return [c.strip() for c in text.split(",") if c.strip()]


def quantile_name(q: float) -> str:
    return f"q{q:g}"


def _say(opts, message: str) -> None:
    """A report line on stderr the user asked for (not only on terminals); silent with --quiet."""
    if not opts.quiet:
        from gencli.cli.common import stderr

        stderr.print(message, markup=False)


def _value(v: float) -> str:
    if not np.isfinite(v):
        return ""
    return f"{v:.8g}"


class Failures:
    """Series that could not be used: reported as warnings once something succeeded."""

    def __init__(self, opts, json_out: bool):
        self.opts = opts
        self.items: list[tuple[str, str]] = []
        self.pending: list[tuple[str, str]] = []
        self.live = False
        self.json_out = json_out

    def add(self, sid: str, message: str) -> None:
        self.items.append((sid, message))
        if self.live:
            self._report(sid, message)
        else:
            self.pending.append((sid, message))

    def _report(self, sid: str, message: str) -> None:
        self.opts.warn(f"skipped {message}")
        if self.json_out:
            from gencli.cli.common import emit_json

            emit_json({"id": sid, "error": message})

    def success(self) -> None:
        if not self.live:
            self.live = True
            for sid, msg in self.pending:
                self._report(sid, msg)
            self.pending = []

    def finish(self, done: int, strict: bool) -> None:
        if done == 0:
            if self.items:
                sid, msg = self.items[0]
                more = f" ({len(self.items) - 1} more series failed the same way or otherwise)" if len(self.items) > 1 else ""
                raise UserError(msg + more)
            raise UserError("no series to forecast")
        if self.items and strict:
            raise UserError(f"{len(self.items)} series failed (--strict): first: {self.items[0][1]}")


def _records(table, layout: Layout, opts_rec: RecordOptions, failures: Failures, warn) -> Iterator:
    for sid, frame in iter_groups(table, layout, warn):
        try:
            yield build_record(sid, frame, layout, opts_rec)
        except SeriesError as exc:
            failures.add(sid, str(exc))


def _batches(it, size: int):
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _first_horizon(table, layout, req: ForecastRequest, opts) -> int:
    """The horizon when none is given: the future rows of the first series with known covariates, else
    the usual horizon of its frequency."""
    for sid, frame in iter_groups(table, layout, None):
        try:
            rec = build_record(sid, frame, layout, RecordOptions(horizon=0, min_length=1))
        except SeriesError:
            continue
        h = rec.n_future if (layout.known and rec.n_future > 0) else rec.freq.default_horizon()
        opts.log(f"horizon {h} ({'the future rows of the known covariates' if layout.known and rec.n_future else f'the usual horizon for frequency {rec.freq.label}'}; set it with --horizon)")
        return h
    return 12


def future_times(res, horizon: int) -> list[str]:
    rec = res.record
    o = res.origin
    if rec.timestamps is None:
        return [str(o + i) for i in range(horizon)]
    ts = rec.timestamps
    if len(ts) >= o + horizon:
        fut = ts[o : o + horizon]
    else:
        from gencli.pipelines.forecast.calendar import future_timestamps

        base = ts[:o]
        fut = np.concatenate([ts[o : len(ts)], future_timestamps(ts[len(ts) - 1], rec.freq, o + horizon - len(ts))]) if len(ts) > o else future_timestamps(base[-1], rec.freq, horizon)
    return [format_time(v) for v in fut]


def run(req: ForecastRequest, opts) -> None:
    # -- arguments first: fail fast, before reading data or loading a model
    if req.horizon is not None and req.horizon < 1:
        raise UserError(f"--horizon must be at least 1 (got {req.horizon})")
    if req.context is not None and req.context < 1:
        raise UserError(f"--context must be at least 1 (got {req.context})")
    if req.backtest is not None and req.backtest < 1:
        raise UserError(f"--backtest must be at least 1 window (got {req.backtest})")
    if req.fit_steps < 0:
        raise UserError(f"--fit-steps must be 0 or more (got {req.fit_steps})")
    if req.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    for flag, path in (("--out", req.out), ("--plot", req.plot), ("--explain-out", req.explain_out)):
        if path:
            ensure_writable(path, req.force)
    if req.plot and not req.plot.lower().endswith((".png", ".svg", ".pdf", ".jpg", ".jpeg")):
        raise UserError(f"--plot: '{req.plot}' should end in .png, .svg, .pdf or .jpg")
    if req.save_model:
        p = Path(req.save_model)
        if p.exists() and (not p.is_dir() or any(p.iterdir())) and not req.force:
            raise UserError(f"--save-model: '{p}' already exists (use --force to overwrite)")
        if req.fit_steps == 0:
            raise UserError("--save-model saves a fine-tuned model: give --fit-steps too")

    table = open_table(req.data)
    layout = infer_layout(
        table.sample(),
        time_col=req.time_col,
        target_col=req.target_col,
        id_col=req.id_col,
        known_cols=req.known_cols,
        static_cols=req.static_cols,
        observed_cols=req.observed_cols,
        wide=req.wide,
    )
    for note in layout.notes:
        opts.log(note)
    opts.debug_log(layout.describe())

    from gencli.pipelines.forecast.features import bind_columns
    from gencli.pipelines.forecast.runner import DEFAULT_MODEL, Forecaster
    from gencli.weights import resolve_model

    fc = Forecaster(resolve_model(opts.model, DEFAULT_MODEL), device=opts.device, dtype=opts.dtype, threads=opts.threads, allow_pickle=opts.allow_pickle)
    opts.debug_log(f"model {fc.path} ({fc.placement.describe()}), context {fc.context_length}")
    binding = bind_columns(fc.config, layout.known, layout.observed, layout.static_real, layout.static_cat)
    horizon = req.horizon or _first_horizon(table, layout, req, opts)
    if fc.max_horizon and horizon > fc.max_horizon:
        opts.warn(f"horizon {horizon} is longer than the {fc.max_horizon} steps this model was trained for: quality degrades further out")
    context = req.context or fc.context_length
    if context > fc.context_length:
        opts.warn(f"context {context} is longer than the {fc.context_length} steps this model was trained with")
    min_length = max(1, req.min_length)
    failures = Failures(opts, opts.json)
    rec_opts = RecordOptions(horizon=horizon, min_length=min_length, need_future_known=not req.backtest)
    records = _records(table, layout, rec_opts, failures, opts.warn)

    if req.backtest:
        _run_backtest(req, opts, fc, binding, records, horizon, context, failures)
        return

    fit_report = None
    if req.fit_steps:
        records = list(records)
        if not records:
            failures.finish(0, req.strict)
        with opts.progress("fine-tuning", total=req.fit_steps) as advance:
            from gencli.pipelines.forecast.runner import fine_tune

            fit_report = fine_tune(fc, records, binding, horizon, req.fit_steps, context=context, lr=req.fit_lr, seed=opts.seed or 0, progress=advance)
        _say(opts, fit_report.line())
        if req.save_model and fit_report.kept:
            from gencli.pipelines.forecast.runner import save_finetuned

            save_finetuned(fc, Path(req.save_model), f"{req.fit_steps} steps on '{req.data}'")
            _say(opts, f"saved the fine-tuned model to {req.save_model}")
        elif req.save_model:
            _say(opts, f"nothing saved to {req.save_model}: fine-tuning did not improve the model")
        records = iter(records)

    _run_forecast(req, opts, fc, binding, records, horizon, context, failures, fit_report)


def _run_forecast(req, opts, fc, binding, records, horizon, context, failures: Failures, fit_report) -> None:
    from gencli.cli.common import emit_json

    levels = req.quantiles
    header = ["id", "time"] + [quantile_name(q) for q in levels]
    csv_to_stdout = req.out is None and not opts.json
    plots: list = []
    explain_rows = 0
    imputed: list[tuple[str, int]] = []
    done = 0
    printed_explain = 0
    with contextlib.ExitStack() as stack:
        out_fh: Optional[IO] = stack.enter_context(atomic_open(req.out, "w", req.force, newline="")) if req.out else None
        ex_fh: Optional[IO] = stack.enter_context(atomic_open(req.explain_out, "w", req.force, newline="")) if req.explain_out else None
        ex_json = bool(req.explain_out and req.explain_out.lower().endswith((".json", ".jsonl")))
        csv_fh = out_fh if out_fh is not None else (sys.stdout if csv_to_stdout else None)
        wrote_header = False
        advance = stack.enter_context(opts.progress("forecasting", total=None))
        want_explain = req.explain or bool(req.explain_out)
        for batch in _batches(records, req.batch_size):
            results = fc.forecast(batch, binding, horizon, levels, context, explain=want_explain, clip_nonnegative=not req.allow_negative)
            failures.success()
            for res in results:
                times = future_times(res, horizon)
                if csv_fh is not None:
                    if not wrote_header:
                        csv_fh.write(",".join(header) + "\n")
                        wrote_header = True
                    sid = _csv_field(res.record.id)
                    csv_fh.write("".join(f"{sid},{_csv_field(t)}," + ",".join(_value(v) for v in res.quantiles[h]) + "\n" for h, t in enumerate(times)))
                if opts.json:
                    emit_json(_json_record(res, times, levels, fc))
                if want_explain and res.explain is not None:
                    if req.explain and printed_explain < 20 and not opts.quiet:
                        _say(opts, explain_text(res))
                        printed_explain += 1
                    if ex_fh is not None:
                        if ex_json:
                            ex_fh.write(json.dumps({"id": res.record.id, **res.explain}) + "\n")
                        else:
                            if explain_rows == 0:
                                ex_fh.write("id,kind,name,weight\n")
                            for row in explain_csv_rows(res):
                                ex_fh.write(",".join(_csv_field(x) for x in row) + "\n")
                                explain_rows += 1
                if req.plot and len(plots) < req.plot_max:
                    plots.append(_plot_item(res, times, fc, context))
                if res.record.imputed:
                    imputed.append((res.record.id, res.record.imputed))
                done += 1
            if csv_fh is sys.stdout:
                sys.stdout.flush()
            advance(len(results))
        if req.explain and printed_explain == 20 and done > 20:
            _say(opts, f"(explanations shown for the first 20 of {done} series; --explain-out FILE writes all of them)")
        failures.finish(done, req.strict)
        if imputed:
            _say(opts, imputed_note(imputed))
        if req.plot:
            from gencli.pipelines.forecast.plot import fan_chart

            fan_chart(plots, levels, req.plot, req.force)
    summary = {"series": done, "failed": len(failures.items), "horizon": horizon, "quantiles": levels}
    if fit_report is not None:
        summary["fine_tune"] = fit_report.to_dict()
    if opts.json:
        emit_json({"summary": summary})
    opts.log(f"forecast {done} series x {horizon} steps" + (f"; {len(failures.items)} skipped" if failures.items else "") + (f" -> {req.out}" if req.out else ""))
    if req.plot:
        opts.log(f"plot -> {req.plot}")


def imputed_note(imputed: list[tuple[str, int]]) -> str:
    """One line on the missing history values that were filled in (per series, or a total)."""
    total = sum(n for _, n in imputed)
    how = "by linear interpolation between observed neighbours (the model also sees which values were missing)"
    if len(imputed) <= 3:
        where = ", ".join(f"{n} in series '{sid}'" for sid, n in imputed)
        return f"note: {total} missing history value{'s' if total != 1 else ''} imputed ({where}) {how}"
    return f"note: {total} missing history values in {len(imputed)} series imputed {how}; --json gives the count per series"


def _csv_field(x) -> str:
    s = str(x)
    if any(c in s for c in ',"\n\r'):
        return '"' + s.replace('"', '""') + '"'
    return s


def _json_record(res, times, levels, fc) -> dict:
    rec = res.record
    out = {
        "id": rec.id,
        "frequency": rec.freq.label,
        "history_length": rec.length,
        "imputed": rec.imputed,
        "time": times,
        "quantiles": {f"{q:g}": [_json_num(v) for v in res.quantiles[:, j]] for j, q in enumerate(levels)},
        "median": [_json_num(v) for v in res.grid[:, fc.grid.index(0.5)]],
    }
    if res.explain is not None:
        out["explain"] = {k: (v[:64] if k == "attention_by_lag" else v) for k, v in res.explain.items()}
    return out


def _json_num(v: float):
    return float(f"{v:.8g}") if np.isfinite(v) else None


def explain_text(res) -> str:
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
    return "\n".join(lines)


def explain_csv_rows(res):
    ex = res.explain
    sid = res.record.id
    for kind in ("static", "past", "future"):
        for name, w in ex[kind].items():
            yield (sid, kind, name, f"{w:.6g}")
    for lag, w in enumerate(ex["attention_by_lag"], start=1):
        yield (sid, "attention", f"t-{lag}", f"{w:.6g}")
    yield (sid, "attention", "horizon", f"{1.0 - ex['attention_on_history']:.6g}")  # earlier forecast steps


def _plot_item(res, times, fc, context):
    rec = res.record
    n = min(rec.length, max(3 * len(times), min(context, 200)))
    hist_y = rec.target[rec.length - n :]
    if rec.timestamps is not None:
        hist_t = rec.timestamps[rec.length - n : rec.length]
        fut_t = np.array(times, dtype="datetime64[ns]") if np.issubdtype(rec.timestamps.dtype, np.datetime64) else np.array(times, dtype=float)
    else:
        hist_t = np.arange(rec.length - n, rec.length)
        fut_t = np.arange(rec.length, rec.length + len(times))
    return {"id": rec.id, "hist_t": hist_t, "hist_y": hist_y, "fut_t": fut_t, "quantiles": res.quantiles, "grid": res.grid, "grid_levels": fc.grid}


def _run_backtest(req, opts, fc, binding, records, horizon, context, failures: Failures) -> None:
    from gencli.cli.common import emit_json
    from gencli.pipelines.forecast.runner import BacktestReport, fine_tune

    levels = req.quantiles if len(req.quantiles) >= 3 else fc.grid
    windows = req.backtest
    fitted = None
    if req.fit_steps:
        recs = list(records)
        report0 = BacktestReport(levels=list(levels), horizon=horizon, windows=windows)
        with opts.progress("backtest (zero-shot)", total=len(recs)) as advance:
            for batch in _batches(recs, req.batch_size):
                r = fc.backtest(batch, binding, horizon, windows, levels, context, min_history=req.min_length)
                report0.series += r.series
                report0.skipped += r.skipped
                advance(len(batch))
        with opts.progress("fine-tuning", total=req.fit_steps) as advance:
            fit = fine_tune(
                fc, recs, binding, horizon, req.fit_steps, context=context, lr=req.fit_lr, seed=opts.seed or 0,
                cutoff=lambda r: r.length - windows * horizon, progress=advance,
            )
        _say(opts, fit.line() + " (trained only on data before the first backtest window)")
        fitted = (report0, fit)
        records = iter(recs)
    report = BacktestReport(levels=list(levels), horizon=horizon, windows=windows)
    done = 0
    with opts.progress("backtest", total=None) as advance:
        for batch in _batches(records, req.batch_size):
            r = fc.backtest(batch, binding, horizon, windows, levels, context, min_history=req.min_length)
            failures.success()
            report.series += r.series
            for sid, msg in r.skipped:
                failures.add(sid, f"series '{sid}': {msg}")
            done += len(r.series)
            advance(len(batch))
    failures.finish(done, req.strict)
    summary = report.summary()
    if fitted is None:
        label = "TFT"
    else:
        label = f"TFT fine-tuned ({req.fit_steps} steps)" if fitted[1].kept else "TFT (fine-tuning not kept)"
    if req.out:
        with atomic_open(req.out, "w", req.force, newline="") as fh:
            cols = ["id", "windows", "wql", "mase", "seasonal_naive_wql", "seasonal_naive_mase", "relative_wql", "relative_mase"]
            fh.write(",".join(cols) + "\n")
            for s in report.series:
                d = s.to_dict()
                fh.write(",".join(_csv_field("" if d[c] is None else d[c]) for c in cols) + "\n")
    if opts.json:
        for s in report.series:
            emit_json(s.to_dict())
        out = {"summary": {"model": label, **summary}}
        if fitted is not None:
            out["summary"]["zero_shot"] = fitted[0].summary()
            out["summary"]["fine_tune"] = fitted[1].to_dict()
        emit_json(out)
        return
    print(render_backtest(report, summary, label, fitted))


def _fmt(x, nd=4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render_backtest(report, summary: dict, label: str, fitted=None) -> str:
    lines = [
        f"backtest: last {report.windows} window(s) of {report.horizon} steps, {summary['series']} series, {summary['windows']} windows",
        f"weighted quantile loss over levels {', '.join(f'{q:g}' for q in report.levels)}; MASE of the median, scaled by the in-sample seasonal-naive error",
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
    lines.append(f"{'':<{w}}  {'wQL':>8} {'MASE':>7}  {'rel wQL':>8} {'rel MASE':>8}   (relative: to seasonal naive; wQL pooled, MASE and per-series ratios geometric means)")
    for name, s in rows:
        lines.append(f"{name:<{w}}  {_fmt(s['wql']):>8} {_fmt(s['mase'], 3):>7}  {_fmt(s['relative_wql'], 3):>8} {_fmt(s['relative_mase_gmean'], 3):>8}")
    s = rows[-1][1]
    lines.append(f"{'seasonal naive':<{w}}  {_fmt(s['seasonal_naive_wql']):>8} {_fmt(s['seasonal_naive_mase'], 3):>7}  {'1.000':>8} {'1.000':>8}")
    return "\n".join(lines)
