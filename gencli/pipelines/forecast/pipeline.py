"""`gencli forecast` end to end: check the request -> read the table and infer its layout -> load
the model -> validate each series -> (fine-tune) -> forecast or backtest -> write the outputs,
streaming in batches. Reports go through the :class:`~gencli.console.Reporter` it is handed."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator, Optional

from gencli.console import Reporter, csv_line, emit_json, open_output
from gencli.data.timeseries import SeriesRecord
from gencli.errors import UserError
from gencli.pipelines.forecast.features import Binding
from gencli.pipelines.forecast.forecaster import Forecaster
from gencli.pipelines.forecast.layout import Layout, infer_layout
from gencli.pipelines.forecast.outputs import ForecastWriter
from gencli.pipelines.forecast.records import RecordOptions, SeriesError, build_record
from gencli.pipelines.forecast.request import ForecastRequest, check_request, layout_options
from gencli.pipelines.forecast.table import Table, iter_groups, open_table


class Failures:
    """Series that could not be used: reported as warnings (and JSON error lines with --json) once
    something succeeded; the run fails if nothing did, or with ``--strict``."""

    def __init__(self, report: Reporter):
        self.report = report
        self.items: list[tuple[str, str]] = []
        self.pending: list[tuple[str, str]] = []
        self.live = False

    def add(self, sid: str, message: str) -> None:
        self.items.append((sid, message))
        if self.live:
            self._report(sid, message)
        else:
            self.pending.append((sid, message))

    def _report(self, sid: str, message: str) -> None:
        self.report.warn(f"skipped {message}")
        if self.report.json:
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


def run(req: ForecastRequest, report: Reporter) -> None:
    """Run the forecast (or the backtest) ``req`` describes, writing its outputs."""
    check_request(req)
    table = open_table(req.data)
    layout = infer_layout(table.sample(), **layout_options(req))
    for note in layout.notes:
        report.log(note)
    report.debug(layout.describe())

    from gencli.pipelines.forecast.features import bind_columns
    from gencli.pipelines.forecast.forecaster import DEFAULT_MODEL
    from gencli.weights import resolve_model

    fc = Forecaster(resolve_model(req.model, DEFAULT_MODEL), device=req.device, dtype=req.dtype, threads=req.threads, allow_pickle=req.allow_pickle)
    report.debug(f"model {fc.path} ({fc.placement.describe()}), context {fc.context_length}")
    binding = bind_columns(fc.config, layout.known, layout.observed, layout.static_real, layout.static_cat)
    horizon = req.horizon or _first_horizon(table, layout, report)
    if fc.max_horizon and horizon > fc.max_horizon:
        report.warn(f"horizon {horizon} is longer than the {fc.max_horizon} steps this model was trained for: quality degrades further out")
    context = req.context or fc.context_length
    if context > fc.context_length:
        report.warn(f"context {context} is longer than the {fc.context_length} steps this model was trained with")
    failures = Failures(report)
    rec_opts = RecordOptions(horizon=horizon, min_length=max(1, req.min_length), need_future_known=not req.backtest)
    records = _records(table, layout, rec_opts, failures, report.warn)
    if req.backtest:
        _run_backtest(req, report, fc, binding, records, horizon, context, failures)
        return
    fit_report = None
    if req.fit_steps:
        records, fit_report = _fine_tune(req, report, fc, binding, list(records), horizon, context, failures)
    _run_forecast(req, report, fc, binding, records, horizon, context, failures, fit_report)


def _records(table: Table, layout: Layout, opts_rec: RecordOptions, failures: Failures, warn) -> Iterator[SeriesRecord]:
    for sid, frame in iter_groups(table, layout, warn):
        try:
            yield build_record(sid, frame, layout, opts_rec)
        except SeriesError as exc:
            failures.add(sid, str(exc))


def _batches(it: Iterable, size: int) -> Iterator[list]:
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _first_horizon(table: Table, layout: Layout, report: Reporter) -> int:
    """The horizon when none is given: the future rows of the first series with known covariates, else
    the usual horizon of its frequency."""
    for sid, frame in iter_groups(table, layout, None):
        try:
            rec = build_record(sid, frame, layout, RecordOptions(horizon=0, min_length=1))
        except SeriesError:
            continue
        h = rec.n_future if (layout.known and rec.n_future > 0) else rec.freq.default_horizon()
        why = "the future rows of the known covariates" if layout.known and rec.n_future else f"the usual horizon for frequency {rec.freq.label}"
        report.log(f"horizon {h} ({why}; set it with --horizon)")
        return h
    return 12


def _fine_tune(
    req: ForecastRequest, report: Reporter, fc: Forecaster, binding: Binding, records: list[SeriesRecord], horizon: int, context: int, failures: Failures
):
    """``--fit-steps``: fine-tune on the series first (and ``--save-model``); returns the records and the report."""
    from gencli.pipelines.forecast.finetune import fine_tune, save_finetuned

    if not records:
        failures.finish(0, req.strict)
    with report.progress("fine-tuning", total=req.fit_steps) as advance:
        fit_report = fine_tune(fc, records, binding, horizon, req.fit_steps, context=context, lr=req.fit_lr, seed=req.seed or 0, progress=advance)
    report.say(fit_report.line())
    if req.save_model and fit_report.kept:
        save_finetuned(fc, Path(req.save_model), f"{req.fit_steps} steps on '{req.data}'")
        report.say(f"saved the fine-tuned model to {req.save_model}")
    elif req.save_model:
        report.say(f"nothing saved to {req.save_model}: fine-tuning did not improve the model")
    return iter(records), fit_report


def _run_forecast(
    req: ForecastRequest,
    report: Reporter,
    fc: Forecaster,
    binding: Binding,
    records: Iterable[SeriesRecord],
    horizon: int,
    context: int,
    failures: Failures,
    fit_report,
) -> None:
    with contextlib.ExitStack() as stack:
        writer = ForecastWriter(req, report, fc.grid, horizon, context, stack)
        advance = stack.enter_context(report.progress("forecasting", total=None))
        for batch in _batches(records, req.batch_size):
            results = fc.forecast(batch, binding, horizon, req.quantiles, context, explain=writer.want_explain, clip_nonnegative=not req.allow_negative)
            failures.success()
            for res in results:
                writer.write(res)
            writer.flush()
            advance(len(results))
        writer.notes()
        failures.finish(writer.done, req.strict)
        writer.finish()
    summary = {"series": writer.done, "failed": len(failures.items), "horizon": horizon, "quantiles": req.quantiles}
    if fit_report is not None:
        summary["fine_tune"] = fit_report.to_dict()
    if report.json:
        emit_json({"summary": summary})
    report.log(
        f"forecast {writer.done} series x {horizon} steps"
        + (f"; {len(failures.items)} skipped" if failures.items else "")
        + (f" -> {req.out}" if req.out else "")
    )
    if req.plot:
        report.log(f"plot -> {req.plot}")


def _run_backtest(
    req: ForecastRequest, report: Reporter, fc: Forecaster, binding: Binding, records: Iterable[SeriesRecord], horizon: int, context: int, failures: Failures
) -> None:
    from gencli.pipelines.forecast.backtest import CSV_COLUMNS, BacktestReport, backtest, csv_rows, render_backtest

    levels = req.quantiles if len(req.quantiles) >= 3 else fc.grid
    windows = req.backtest
    fitted = None
    if req.fit_steps:
        records, fitted = _backtest_fine_tuned(req, report, fc, binding, list(records), horizon, context, levels)
    result = BacktestReport(levels=list(levels), horizon=horizon, windows=windows)
    done = 0
    with report.progress("backtest", total=None) as advance:
        for batch in _batches(records, req.batch_size):
            r = backtest(fc, batch, binding, horizon, windows, levels, context, min_history=req.min_length)
            failures.success()
            result.series += r.series
            for sid, msg in r.skipped:
                failures.add(sid, f"series '{sid}': {msg}")
            done += len(r.series)
            advance(len(batch))
    failures.finish(done, req.strict)
    summary = result.summary()
    if fitted is None:
        label = "TFT"
    else:
        label = f"TFT fine-tuned ({req.fit_steps} steps)" if fitted[1].kept else "TFT (fine-tuning not kept)"
    if req.out:
        with open_output(req.out, req.force, newline="") as fh:
            fh.write(csv_line(CSV_COLUMNS))
            for row in csv_rows(result):
                fh.write(csv_line(row))
    if report.json:
        for s in result.series:
            emit_json(s.to_dict())
        out = {"summary": {"model": label, **summary}}
        if fitted is not None:
            out["summary"]["zero_shot"] = fitted[0].summary()
            out["summary"]["fine_tune"] = fitted[1].to_dict()
        emit_json(out)
        return
    print(render_backtest(result, summary, label, fitted))


def _backtest_fine_tuned(
    req: ForecastRequest, report: Reporter, fc: Forecaster, binding: Binding, records: list[SeriesRecord], horizon: int, context: int, levels
) -> tuple[Iterator[SeriesRecord], Optional[tuple]]:
    """``--backtest`` with ``--fit-steps``: the zero-shot backtest first, then fine-tuning on the data
    before the first backtest window; returns the records and (zero-shot report, fine-tune report)."""
    from gencli.pipelines.forecast.backtest import BacktestReport, backtest
    from gencli.pipelines.forecast.finetune import fine_tune

    windows = req.backtest
    zero_shot = BacktestReport(levels=list(levels), horizon=horizon, windows=windows)
    with report.progress("backtest (zero-shot)", total=len(records)) as advance:
        for batch in _batches(records, req.batch_size):
            r = backtest(fc, batch, binding, horizon, windows, levels, context, min_history=req.min_length)
            zero_shot.series += r.series
            zero_shot.skipped += r.skipped
            advance(len(batch))
    with report.progress("fine-tuning", total=req.fit_steps) as advance:
        fit = fine_tune(
            fc, records, binding, horizon, req.fit_steps, context=context, lr=req.fit_lr, seed=req.seed or 0,
            cutoff=lambda r: r.length - windows * horizon, progress=advance,
        )  # fmt: skip
    report.say(fit.line() + " (trained only on data before the first backtest window)")
    return iter(records), (zero_shot, fit)


__all__ = ["ForecastRequest", "run"]
