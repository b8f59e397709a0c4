"""`gencli forecast` end to end: check the request -> read the table and infer its layout -> load
the model -> validate each series -> (fine-tune) -> forecast or backtest -> write the outputs,
streaming in batches. Reports go through the :class:`~gencli.console.Reporter` it is handed."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Optional

from gencli.console import Reporter, csv_line, emit_json, open_output
from gencli.data.timeseries import SeriesRecord
from gencli.errors import UserError
from gencli.pipelines.forecast.features import Binding
from gencli.pipelines.forecast.forecaster import ENSEMBLE_LABELS, Forecaster, ForecastResult
from gencli.pipelines.forecast.layout import Layout, infer_layout
from gencli.pipelines.forecast.outputs import ForecastWriter
from gencli.pipelines.forecast.records import RecordOptions, SeriesError, build_record
from gencli.pipelines.forecast.request import ForecastRequest, check_request, layout_options
from gencli.pipelines.forecast.table import Table, iter_groups, open_table

# The longest --horizon, as a multiple of the horizon the model was trained for: beyond it a forecast is
# extrapolation far outside what the model learned, and its memory grows with the horizon.
HORIZON_LIMIT_FACTOR = 4


class Failures:
    """Series that could not be used: reported as warnings (and JSON error records with --json, in
    input order among the results) once something succeeded; the run fails if nothing did, or with
    ``--strict``. ``position`` is the series' place in the input (see :meth:`before`)."""

    def __init__(self, report: Reporter, results: Optional[IO[str]] = None):
        self.report = report
        self.results = results
        self.items: list[tuple[int, str, str]] = []
        self.reported = 0

    def add(self, sid: str, message: str, position: int = -1) -> None:
        self.items.append((position, sid, message))
        self.items.sort(key=lambda it: it[0])

    def before(self, position: float) -> None:
        """Report the failures of the series that came before ``position`` in the input (called
        just before a result is written, and with infinity at the end, so records keep input order)."""
        while self.reported < len(self.items) and self.items[self.reported][0] < position:
            _, sid, message = self.items[self.reported]
            self.report.warn(f"skipped {message}")
            if self.report.json:
                emit_json({"id": sid, "error": message}, self.results)
            self.reported += 1

    def finish(self, done: int, strict: bool) -> None:
        if done == 0:
            if self.items:
                _, sid, msg = self.items[0]
                more = f" ({len(self.items) - 1} more series failed the same way or otherwise)" if len(self.items) > 1 else ""
                raise UserError(msg + more)
            raise UserError("no series to forecast")
        self.before(float("inf"))
        if self.items and strict:
            raise UserError(f"{len(self.items)} series failed (--strict): first: {self.items[0][2]}")


def run(req: ForecastRequest, report: Reporter) -> None:
    """Run the forecast (or the backtest) ``req`` describes, writing its outputs."""
    check_request(req)
    table = open_table(req.data)
    setup = prepare(req, report, table)
    positions: dict[str, int] = {}
    with open_output(req.out, req.force, newline="") as results:
        failures = Failures(report, results)
        records = _records(table, setup.layout, setup.record_options, failures, report.warn, positions)
        run = RunState(req, report, setup.fc, setup.binding, setup.horizon, setup.context, failures, results, positions, setup.layout.time_zone)
        if req.backtest:
            _run_backtest(run, records)
            return
        fit_report = None
        if req.fit_steps:
            records, fit_report = _fine_tune(req, report, setup.fc, setup.binding, list(records), setup.horizon, setup.context, failures)
        write_forecasts(run, forecast_batches(run, records), fit_report)


@dataclass
class Setup:
    """What a run settles before the first series is read: the table's layout, the loaded model, the
    column binding, the horizon, the context and the options each series is validated with."""

    layout: Layout
    fc: Forecaster
    binding: Binding
    horizon: int
    context: int
    record_options: RecordOptions


def load_forecaster(req: ForecastRequest, path: Path) -> Forecaster:
    """The model as ``req`` runs it (device, dtype, threads; the ensemble unless --model-only): the
    one place the single-process run and the Ray replicas load it."""
    return Forecaster(path, device=req.device, dtype=req.dtype, threads=req.threads, allow_pickle=req.allow_pickle, ensemble=not req.model_only)


def prepare(req: ForecastRequest, report: Reporter, table: Table) -> Setup:
    """Infer the layout from ``table``, load the model and settle the horizon and context (with the
    run's notes and warnings); a horizon far beyond the model's training is a UserError."""
    layout = infer_layout(table.sample(), **layout_options(req))
    for note in layout.notes:
        report.log(note)
    report.debug(layout.describe())

    from gencli.pipelines.forecast.features import bind_columns
    from gencli.pipelines.forecast.forecaster import DEFAULT_MODEL
    from gencli.weights import resolve_model

    fc = load_forecaster(req, resolve_model(req.model, DEFAULT_MODEL))
    report.debug(
        f"model {fc.path} ({fc.placement.describe()}), context {fc.context_length}"
        + ("" if req.model_only else "; combined per series with damped-trend ETS and Theta (--model-only: the network alone)")
    )
    binding = bind_columns(fc.config, layout.known, layout.observed, layout.static_real, layout.static_cat)
    horizon = req.horizon or _first_horizon(table, layout, report)
    limit = HORIZON_LIMIT_FACTOR * (fc.max_horizon or fc.context_length)
    if horizon > limit:
        raise UserError(
            f"--horizon {horizon} is more than {HORIZON_LIMIT_FACTOR}x the {fc.max_horizon or fc.context_length} steps this model was trained for "
            f"(at most {limit}): forecast in shorter steps, or fine-tune a model for longer horizons"
        )
    if fc.max_horizon and horizon > fc.max_horizon:
        report.warn(f"horizon {horizon} is longer than the {fc.max_horizon} steps this model was trained for: quality degrades further out")
    context = req.context or fc.context_length
    if context > fc.context_length:
        report.warn(f"context {context} is longer than the {fc.context_length} steps this model was trained with")
    rec_opts = RecordOptions(horizon=horizon, min_length=max(1, req.min_length), need_future_known=not req.backtest)
    return Setup(layout, fc, binding, horizon, context, rec_opts)


def _records(table: Table, layout: Layout, opts_rec: RecordOptions, failures: Failures, warn, positions: dict[str, int]) -> Iterator[SeriesRecord]:
    """The series as records, in input order (``positions`` maps each id to its place)."""
    for i, (sid, frame) in enumerate(iter_groups(table, layout, warn)):
        positions[sid] = i
        try:
            yield build_record(sid, frame, layout, opts_rec)
        except SeriesError as exc:
            failures.add(sid, str(exc), i)


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
    report.say(f"{fit_report.line()} (seed {req.seed or 0})")
    if req.save_model and fit_report.kept:
        save_finetuned(fc, Path(req.save_model), f"{req.fit_steps} steps on '{req.data}' (seed {req.seed or 0})", req.force)
        report.say(f"saved the fine-tuned model to {req.save_model}")
    elif req.save_model:
        report.say(f"nothing saved to {req.save_model}: fine-tuning did not improve the model")
    return iter(records), fit_report


@dataclass
class RunState:
    """What the forecast and the backtest of one run share: the request, the model and the column
    binding, the horizon and context, the failures, the results stream and each series' input position."""

    req: ForecastRequest
    report: Reporter
    fc: Forecaster
    binding: Binding
    horizon: int
    context: int
    failures: Failures
    results: IO[str]
    positions: dict[str, int]
    time_zone: Any = None  # the offset the input's timestamps carried: the output's carry it too


def forecast_batches(run: RunState, records: Iterable[SeriesRecord]) -> Iterator[list[ForecastResult]]:
    """The forecasts of ``records``, one model batch (``--batch-size`` series) at a time."""
    req = run.req
    for batch in _batches(records, req.batch_size):
        yield run.fc.forecast(
            batch, run.binding, run.horizon, req.quantiles, run.context, explain=req.explain or bool(req.explain_out), clip_nonnegative=not req.allow_negative
        )


def write_forecasts(run: RunState, batches: Iterable[list[ForecastResult]], fit_report) -> None:
    """Write the forecasts (batches of results in input order), the failures among them, the notes,
    the plot and the summary: every output of a forecast run, wherever the batches were computed."""
    req, report, fc, horizon, context, failures = run.req, run.report, run.fc, run.horizon, run.context, run.failures
    results_file, positions = run.results, run.positions
    with contextlib.ExitStack() as stack:
        writer = ForecastWriter(req, report, fc.grid, horizon, context, stack, results_file, time_zone=run.time_zone)
        advance = stack.enter_context(report.progress("forecasting", total=None))
        for results in batches:
            for res in results:
                failures.before(positions[res.record.id])
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
            emit_json({"summary": summary}, results_file)
    report.log(
        f"forecast {writer.done} series x {horizon} steps"
        + (f"; {len(failures.items)} skipped" if failures.items else "")
        + (f" -> {req.out}" if req.out else "")
    )
    if req.plot:
        report.log(f"plot -> {req.plot}")


def _run_backtest(run: RunState, records: Iterable[SeriesRecord]) -> None:
    """The backtest's results go to the results stream: the table, per-series CSV rows (``--csv``) or
    JSON lines (``--json``: one per series and error in input order, then the summary)."""
    req, report, fc, binding, horizon, context, failures = run.req, run.report, run.fc, run.binding, run.horizon, run.context, run.failures
    results_file, positions = run.results, run.positions
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
            result.series += r.series
            for sid, msg in r.skipped:
                failures.add(sid, f"series '{sid}': {msg}", positions[sid])
            done += len(r.series)
            advance(len(batch))
    failures.finish(done, req.strict)
    summary = result.summary()
    name = backtest_label(req.model_only)
    if fitted is None:
        label = name
    else:
        label = f"{name}, fine-tuned ({req.fit_steps} steps)" if fitted[1].kept else f"{name} (fine-tuning not kept)"
    if report.json:
        for s in result.series:
            failures.before(positions[s.id])
            emit_json(s.to_dict(), results_file)
        failures.before(float("inf"))
        out = {"summary": {"model": label, **summary}}
        if fitted is not None:
            out["summary"]["zero_shot"] = fitted[0].summary()
            out["summary"]["fine_tune"] = fitted[1].to_dict()
        emit_json(out, results_file)
        return
    failures.before(float("inf"))
    if req.csv:
        results_file.write(csv_line(CSV_COLUMNS))
        results_file.writelines(csv_line(row) for row in csv_rows(result))
        return
    results_file.write(render_backtest(result, summary, label, fitted) + "\n")


def backtest_label(model_only: bool) -> str:
    """What a backtest ran, as its row names it: the network alone, or the network with every statistical member."""
    return "TFT" if model_only else f"TFT + statistical ensemble ({', '.join(ENSEMBLE_LABELS[1:])})"


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
    report.say(fit.line() + f" (trained only on data before the first backtest window; seed {req.seed or 0})")
    return iter(records), (zero_shot, fit)


__all__ = ["ForecastRequest", "run", "prepare", "Setup", "RunState", "Failures", "forecast_batches", "write_forecasts"]
