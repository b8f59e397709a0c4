"""What a forecast run is asked to do (:class:`ForecastRequest`, the typed form of the command's
options) and the checks on it that run before any data is read or a model is loaded."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gencli.errors import UserError
from gencli.io import ensure_folder_writable, is_in_place, names_stdout, plan_outputs, read_json, refuse_binary_terminal

# --plot's formats by suffix; a name without one of them is a PNG where it is written in place
# (``-``, a pipe, a device), refused for a regular file
PLOT_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf", ".jpg": "jpeg", ".jpeg": "jpeg"}
SAVED_MODEL_FILES = ("config.json", "model.safetensors")  # what --save-model writes into its folder
MAX_FIT_LR = 1.0  # --fit-lr: AdamW steps every weight by about lr; past 1 it only wrecks the model (past 3.4e38, float32 overflows)
# -o FILE suffixes that name a format the results are not written in (they are CSV, JSON lines with --json)
OTHER_FORMATS = {
    **dict.fromkeys((".parquet", ".pq"), "Parquet"),
    **dict.fromkeys((".feather", ".arrow"), "Arrow"),
    **dict.fromkeys((".xlsx", ".xls"), "Excel"),
    **dict.fromkeys((".tsv", ".tab"), "TSV"),
}
NO_MATPLOTLIB = "--plot needs matplotlib: pip install 'gencli[plot]' (or pip install matplotlib)"


@dataclass
class ForecastRequest:
    data: str
    horizon: Optional[int] = None
    quantiles: list = field(default_factory=lambda: [0.1, 0.5, 0.9])
    context: Optional[int] = None
    time_col: Optional[str] = None
    time_format: Optional[str] = None  # a strptime format for the time column (inferred when omitted)
    dayfirst: Optional[bool] = None  # day/month order of ambiguous dates (inferred when omitted)
    target_col: Optional[str] = None
    id_col: Optional[str] = None
    known_cols: Optional[list] = None
    static_cols: Optional[list] = None
    observed_cols: Optional[list] = None
    wide: bool = False
    out: Optional[str] = None  # the results (CSV, or JSON lines with json; - = stdout)
    csv: bool = False
    json: bool = False
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
    model_only: bool = False  # the network alone, without the statistical ensemble
    # the model and where it runs (``--model/--device/--dtype/--threads/--allow-pickle``), the fine-tuning seed
    model: Optional[str] = None
    device: str = "auto"
    dtype: str = "auto"
    threads: Optional[int] = None
    allow_pickle: bool = False
    seed: Optional[int] = None


LAYOUT_OPTIONS = ("time_col", "time_format", "dayfirst", "target_col", "id_col", "known_cols", "static_cols", "observed_cols", "wide")


def layout_options(req: ForecastRequest) -> dict:
    """The options :func:`~gencli.pipelines.forecast.layout.infer_layout` takes, from the request."""
    return {name: getattr(req, name) for name in LAYOUT_OPTIONS}


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


def check_request(req: ForecastRequest) -> None:
    """Fail fast on the arguments, before reading data or loading a model."""
    from gencli.pipelines.forecast.layout import check_time_format

    if req.horizon is not None and req.horizon < 1:
        raise UserError(f"--horizon must be at least 1 (got {req.horizon})")
    if req.context is not None and req.context < 1:
        raise UserError(f"--context must be at least 1 (got {req.context})")
    if req.backtest is not None and req.backtest < 1:
        raise UserError(f"--backtest must be at least 1 window (got {req.backtest})")
    if req.fit_steps < 0:
        raise UserError(f"--fit-steps must be 0 or more (got {req.fit_steps})")
    if not (math.isfinite(req.fit_lr) and req.fit_lr > 0):
        raise UserError(f"--fit-lr must be a finite number above 0 (got {req.fit_lr:g})")
    if req.fit_lr > MAX_FIT_LR:
        raise UserError(f"--fit-lr must be at most {MAX_FIT_LR:g} (got {req.fit_lr:g}): AdamW moves every weight by about the learning rate a step")
    if req.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    if req.min_length < 1:
        raise UserError(f"--min-length must be at least 1 observed value (got {req.min_length})")
    if req.plot_max < 1:
        raise UserError(f"--plot-max must be at least 1 (got {req.plot_max})")
    if req.csv and req.json:
        raise UserError("--csv and --json are exclusive: choose one output format")
    check_time_format(req.time_format)
    if req.save_model and req.fit_steps == 0:
        raise UserError("--save-model saves a fine-tuned model: give --fit-steps too")
    _check_backtest_outputs(req)
    check_outputs(req)


def _check_backtest_outputs(req: ForecastRequest) -> None:
    """``--backtest`` writes its score table only: an output only a forecast writes is refused, not
    silently left unwritten."""
    unwritten = [option for option, value in (("--plot", req.plot), ("--explain-out", req.explain_out), ("--save-model", req.save_model)) if value]
    if req.backtest and unwritten:
        them = "them" if len(unwritten) > 1 else "it"
        raise UserError(
            f"--backtest writes a score table, not forecasts: {' and '.join(unwritten)} would write nothing (drop {them}, or forecast without --backtest)"
        )


def plot_format(path: str) -> Optional[str]:
    """The format ``--plot`` writes to ``path``, by its suffix (png, svg, pdf, jpeg); a name without
    one of them is a PNG where it is written in place (``-``, a pipe, a device), else None."""
    fmt = PLOT_FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None and is_in_place(path):
        return "png"
    return fmt


def writes_to_stdout(path: Optional[str]) -> bool:
    """Whether an output named ``path`` goes to stdout: ``-`` or ``/dev/stdout``."""
    return names_stdout(path)


def output_files(req: ForecastRequest) -> list[tuple[str, str]]:
    """The files a run writes besides the model folder, as (option, path)."""
    named = (("-o/--out", req.out), ("--explain-out", req.explain_out), ("--plot", req.plot))
    return [(option, path) for option, path in named if path]


def check_outputs(req: ForecastRequest) -> None:
    """Every output checked before any work: the plot's format, nothing else on stdout beside a
    plot there (never a terminal), no two outputs the same file and none inside the ``--save-model``
    folder, each file writable and planned (:func:`~gencli.io.plan_outputs`)."""
    if req.plot and plot_format(req.plot) is None:
        raise UserError(f"--plot: '{req.plot}' should end in .png, .svg, .pdf or .jpg (or be - for a PNG on stdout)")
    if req.plot and importlib.util.find_spec("matplotlib") is None:
        raise UserError(NO_MATPLOTLIB)
    _check_out_suffix(req)
    _check_stdout(req)
    taken: dict[str, str] = {}
    for option, path in output_files(req):
        if not is_in_place(path):
            _claim(taken, option, path)
    if req.save_model:
        _check_model_folder(req, taken)
    plan_outputs([path for _, path in output_files(req)], req.force)  # each writable (ensure_writable), and pending


def _check_out_suffix(req: ForecastRequest) -> None:
    """``-o FILE`` holds what the run writes (CSV rows; JSON lines with --json; with --backtest and
    neither, a text table): a file name that says another format is refused, not filled with the wrong one."""
    if not req.out or is_in_place(req.out):
        return
    suffix = os.path.splitext(req.out)[1].lower()
    if suffix in OTHER_FORMATS:
        writes = "JSON lines" if req.json else "CSV" if req.csv or not req.backtest else "a text table"
        raise UserError(f"-o/--out '{req.out}' names a {OTHER_FORMATS[suffix]} file, but forecast writes {writes} there: name it .csv (or .jsonl with --json)")
    if suffix in (".json", ".jsonl", ".ndjson") and not req.json:
        raise UserError(f"-o/--out '{req.out}' names a JSON file: add --json to write JSON lines (or name it .csv)")
    if suffix == ".csv" and req.json:
        raise UserError(f"-o/--out '{req.out}' names a CSV file, but --json writes JSON lines: name it .jsonl (or drop --json)")
    if suffix == ".csv" and req.backtest and not req.csv:
        raise UserError(f"-o/--out '{req.out}' names a CSV file, but --backtest writes a text table: add --csv for per-series CSV rows (or name it .txt)")


def _check_stdout(req: ForecastRequest) -> None:
    """``--plot -`` and ``--explain-out -`` share stdout with nothing: the results go to stdout
    unless ``-o FILE``; a PNG is never written to a terminal."""
    results = req.out is None or writes_to_stdout(req.out)
    on_stdout = [option for option, path in output_files(req) if writes_to_stdout(path) and option != "-o/--out"]
    sharing = on_stdout + (["the results"] if results else [])
    if on_stdout and len(sharing) > 1:
        fix = f"give {on_stdout[0]} a file (or the results one with -o FILE)" if results else "give one of them a file"
        raise UserError(f"{' and '.join(sharing)} would share stdout: {fix}")
    if "--plot" in on_stdout:
        refuse_binary_terminal(sys.stdout, req.plot)


def _claim(taken: dict[str, str], option: str, path: str) -> None:
    """Record that ``option`` writes ``path``; a file another option writes already is a UserError."""
    key = os.path.realpath(path)
    if key in taken:
        raise UserError(f"{taken[key]} and {option} would both be written to '{path}': give each its own name")
    taken[key] = option


def _check_model_folder(req: ForecastRequest, taken: dict[str, str]) -> None:
    """``--save-model``: a folder it may write (a new one, or with --force one an earlier
    --save-model wrote) that no other output names or lies inside."""
    try:
        ensure_folder_writable(req.save_model, req.force, wrote=saved_model_files)
    except UserError as exc:
        raise UserError(f"--save-model: {exc}") from None
    folder = os.path.realpath(req.save_model)
    for key, option in taken.items():
        if key == folder or Path(folder) in Path(key).parents:
            where = "is" if key == folder else "is inside"
            raise UserError(f"{option} {where} the --save-model folder '{req.save_model}': write it elsewhere")


def saved_model_files(folder: Path) -> Optional[list[str]]:
    """The files ``--save-model`` wrote in ``folder`` (what ``--force`` may replace), or None when
    it is not a folder ``--save-model`` wrote (its config.json records the fine-tuning)."""
    try:
        config = read_json(folder / "config.json")
    except UserError:  # missing, not JSON, not an object: not a folder --save-model wrote
        return None
    extra = config.get("extra")
    if config.get("architecture") != "TemporalFusionTransformer" or not isinstance(extra, dict) or "fine_tuned" not in extra:
        return None
    return list(SAVED_MODEL_FILES)


__all__ = ["ForecastRequest", "parse_quantiles", "parse_columns", "check_request", "check_outputs", "plot_format", "saved_model_files", "layout_options"]
