"""`gencli forecast DATA`: quantile forecasts with a Temporal Fusion Transformer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import RunOptions, at_least, command, option

if TYPE_CHECKING:
    from gencli.pipelines.distributed.runtime import RayOptions

_DATA = "Data"
_OUT = "Output"
_EVAL = "Backtest and fine-tuning"


@command(app, "forecast", ray=True, seed_help="Seed for --fit-steps (batches, dropout; default 0, reported): the same seed gives the same fine-tuned model.")
def forecast(
    data: Annotated[str, typer.Argument(metavar="DATA", help="A CSV file (long or wide), a Parquet file, or - for CSV on stdin.", show_default=False)],
    horizon: Annotated[
        Optional[int],
        option(
            "--horizon",
            callback=at_least(1),
            help="Steps to forecast (default: the future rows of known covariates, else the usual horizon of the frequency); at most 4x the "
            "horizon the model was trained for.",
        ),
    ] = None,
    quantiles: Annotated[
        str,
        typer.Option(
            "--quantiles",
            help="Comma-separated quantile levels in (0, 1); levels between the model's own grid (0.01, 0.05, 0.1, ..., 0.9, 0.95, 0.99 "
            "for the default) are interpolated monotonically.",
        ),
    ] = "0.1,0.5,0.9",
    context: Annotated[Optional[int], typer.Option("--context", help="History steps the model sees (default: the model's context length).")] = None,
    time_col: Annotated[Optional[str], typer.Option("--time-col", help="Timestamp column (inferred when omitted).", rich_help_panel=_DATA)] = None,
    time_format: Annotated[
        Optional[str],
        typer.Option(
            "--time-format",
            metavar="FORMAT",
            help="How the time column's dates are written, as strftime codes, e.g. '%d/%m/%Y' (inferred for the whole column when omitted).",
            rich_help_panel=_DATA,
        ),
    ] = None,
    dayfirst: Annotated[
        Optional[bool],
        typer.Option(
            "--dayfirst/--monthfirst",
            help="Read dates like 01/03/2024 day first (1 March) or month first (3 January) (inferred when the column tells).",
            rich_help_panel=_DATA,
            show_default=False,
        ),
    ] = None,
    target_col: Annotated[Optional[str], typer.Option("--target-col", help="Column to forecast (inferred when omitted).", rich_help_panel=_DATA)] = None,
    id_col: Annotated[
        Optional[str], typer.Option("--id-col", help="Series id column of a long table with many series (inferred when omitted).", rich_help_panel=_DATA)
    ] = None,
    known_cols: Annotated[
        Optional[str],
        typer.Option(
            "--known-cols", help="Covariates known in advance (comma-separated); their future values go in rows with an empty target.", rich_help_panel=_DATA
        ),
    ] = None,
    static_cols: Annotated[
        Optional[str], typer.Option("--static-cols", help="Per-series constant covariates (numbers or categories).", rich_help_panel=_DATA)
    ] = None,
    observed_cols: Annotated[Optional[str], typer.Option("--observed-cols", help="Covariates only observed in the past.", rich_help_panel=_DATA)] = None,
    wide: Annotated[bool, typer.Option("--wide", help="Each numeric column is a series (detected when unambiguous).", rich_help_panel=_DATA)] = False,
    min_length: Annotated[int, typer.Option("--min-length", help="Series with fewer observed values are skipped.", rich_help_panel=_DATA)] = 8,
    csv: Annotated[
        bool, option("--csv", help="CSV results (a forecast's default; with --backtest, per-series rows instead of the table).", rich_help_panel=_OUT)
    ] = False,
    plot: Annotated[
        Optional[str],
        typer.Option(
            "--plot",
            help="Write a fan chart (history, median, quantile bands) to this PNG/SVG/PDF/JPG (by its suffix; -, a pipe or a device get a PNG).",
            rich_help_panel=_OUT,
        ),
    ] = None,
    plot_max: Annotated[
        int, option("--plot-max", callback=at_least(1), metavar="INT", help="Series plotted at most (one panel each).", rich_help_panel=_OUT)
    ] = 12,
    explain: Annotated[
        bool, typer.Option("--explain", help="Print variable-selection weights and attention over the history per series (stderr).", rich_help_panel=_OUT)
    ] = False,
    explain_out: Annotated[
        Optional[str],
        typer.Option("--explain-out", help="Write the explanations as CSV (id,kind,name,weight) or JSON lines (.json/.jsonl).", rich_help_panel=_OUT),
    ] = None,
    allow_negative: Annotated[
        bool, typer.Option("--allow-negative", help="Do not clip forecasts at 0 for series that were never negative.", rich_help_panel=_OUT)
    ] = False,
    model_only: Annotated[
        bool,
        typer.Option(
            "--model-only",
            help="The network's forecast alone; by default each series' forecast combines it with damped-trend ETS and Theta, weighted by "
            "how well each forecast the series' last held-out window.",
        ),
    ] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 2 if any series had to be skipped.", rich_help_panel=_OUT)] = False,
    batch_size: Annotated[
        int, option("--batch-size", callback=at_least(1), help="Series per model batch (output is streamed batch by batch).", rich_help_panel=_OUT)
    ] = 256,
    backtest: Annotated[
        Optional[int],
        typer.Option(
            "--backtest",
            help="Instead of forecasting, score the model on the last N windows of each series (rolling origin) against seasonal naive.",
            rich_help_panel=_EVAL,
        ),
    ] = None,
    fit_steps: Annotated[
        int,
        typer.Option(
            "--fit-steps", help="Fine-tune the model on your own history for N steps first, and report the gain on held-out data.", rich_help_panel=_EVAL
        ),
    ] = 0,
    fit_lr: Annotated[float, typer.Option("--fit-lr", help="Learning rate for --fit-steps (a finite number above 0).", rich_help_panel=_EVAL)] = 3e-4,
    save_model: Annotated[
        Optional[str],
        typer.Option(
            "--save-model",
            help="Save the fine-tuned model to this new folder (config.json + model.safetensors; --force replaces one it saved before).",
            rich_help_panel=_EVAL,
        ),
    ] = None,
    *,
    opts: RunOptions,
    distributed: Optional[RayOptions],
) -> None:
    """Quantile forecasts for the series in a table, with a Temporal Fusion Transformer combined per
    series with damped-trend ETS and Theta (--model-only: the network alone).

    Writes CSV rows id,time,q0.1,q0.5,q0.9 (one per series and step) to --out or stdout; --json writes
    one JSON object per series instead (error records {"id", "error"} in input order among them, then
    one {"summary"} record). The embedded default model forecasts zero-shot; --backtest N shows how
    much to trust it on your data, --fit-steps N adapts it to your data first. --ray runs it on Ray
    Data (DATA may then be a directory or glob of files) with the same output, in the same order.
    """
    from gencli.pipelines.forecast.pipeline import run
    from gencli.pipelines.forecast.request import ForecastRequest, parse_columns, parse_quantiles

    req = ForecastRequest(
        data=data,
        horizon=horizon,
        quantiles=parse_quantiles(quantiles),
        context=context,
        time_col=time_col,
        time_format=time_format,
        dayfirst=dayfirst,
        target_col=target_col,
        id_col=id_col,
        known_cols=parse_columns(known_cols),
        static_cols=parse_columns(static_cols),
        observed_cols=parse_columns(observed_cols),
        wide=wide,
        out=opts.out,
        csv=csv,
        json=opts.json,
        plot=plot,
        plot_max=plot_max,
        explain=explain,
        explain_out=explain_out,
        backtest=backtest,
        fit_steps=fit_steps,
        fit_lr=fit_lr,
        save_model=save_model,
        batch_size=batch_size,
        min_length=min_length,
        strict=strict,
        force=opts.force,
        allow_negative=allow_negative,
        model_only=model_only,
        model=opts.model,
        seed=opts.seed,
        **opts.load_options(),
    )
    if distributed is None:
        run(req, opts.report)
        return
    from gencli.pipelines.forecast import ray as ray_forecast

    ray_forecast.run(req, distributed, opts.report)
