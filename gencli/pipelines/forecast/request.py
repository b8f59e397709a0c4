"""What a forecast run is asked to do (:class:`ForecastRequest`, the typed form of the command's
options) and the checks on it that run before any data is read or a model is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gencli.errors import UserError
from gencli.io import ensure_writable

PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


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
    if req.csv and req.json:
        raise UserError("--csv and --json are exclusive: choose one output format")

    for path in (req.out, req.plot, req.explain_out):
        if path:
            ensure_writable(path, req.force)
    if req.plot and not req.plot.lower().endswith(PLOT_SUFFIXES):
        raise UserError(f"--plot: '{req.plot}' should end in .png, .svg, .pdf or .jpg")
    if req.save_model:
        p = Path(req.save_model)
        if p.exists() and (not p.is_dir() or any(p.iterdir())) and not req.force:
            raise UserError(f"--save-model: '{p}' already exists (use --force to overwrite)")
        if req.fit_steps == 0:
            raise UserError("--save-model saves a fine-tuned model: give --fit-steps too")


__all__ = ["ForecastRequest", "parse_quantiles", "parse_columns", "check_request", "layout_options"]
