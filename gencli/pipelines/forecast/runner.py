"""Running a TFT on series records: loading, batched forecasts, explanations, backtests, fine-tuning."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from gencli.backend.device import choose_placement
from gencli.checkpoints.formats import open_source
from gencli.checkpoints.loader import load_model, save_model
from gencli.checkpoints.reader import open_reader
from gencli.errors import CheckpointError, UserError
from gencli.models.tft import ARCHITECTURE, TemporalFusionTransformer, TFTConfig, quantile_loss
from gencli.pipelines.forecast.features import INPUT_CLIP, Batch, Binding, SeriesRecord, make_batch, unscale
from gencli.pipelines.forecast.metrics import (
    Score,
    geometric_mean,
    interpolate_quantiles,
    mase,
    quantile_loss_sum,
    seasonal_naive,
)

DEFAULT_MODEL = "tft-forecast"
PAIRS = {("hour_sin", "hour_cos"): "hour of day", ("weekday_sin", "weekday_cos"): "day of week", ("year_sin", "year_cos"): "time of year"}
BUILTIN_LABELS = {
    "target_observed": "observed flag",
    "relative_time": "time index",
    "seasonal_lag": "seasonal lag",
    "target_loc": "series level",
    "frequency": "frequency",
}


def load_config(path: Path, allow_pickle: bool = False) -> tuple[TFTConfig, object]:
    src = open_source(path, allow_pickle=allow_pickle)
    cfg = src.config
    if not cfg or cfg.get("architecture") != ARCHITECTURE:
        found = (cfg or {}).get("architecture") or (cfg or {}).get("architectures") or (cfg or {}).get("model_type")
        raise CheckpointError(
            f"'{path}' is not a TFT forecasting model: its config.json must name \"architecture\": \"{ARCHITECTURE}\""
            + (f" (it names {found})" if found else " (no config.json with an architecture found)")
        )
    try:
        return TFTConfig.from_dict(cfg), src
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"'{path}': invalid TFT config.json: {exc}") from None


@dataclass
class ForecastResult:
    """One series' forecast in its own units."""

    record: SeriesRecord
    grid: np.ndarray  # (H, G) quantiles at the model's grid levels
    quantiles: np.ndarray  # (H, R) at the requested levels
    origin: int
    explain: Optional[dict] = None


class Forecaster:
    """A loaded TFT plus everything needed to feed it."""

    def __init__(self, path: Path, *, device: str = "auto", dtype: str = "auto", threads: Optional[int] = None, allow_pickle: bool = False):
        self.path = Path(path)
        self.placement = choose_placement(device, dtype, "float", threads)
        self.config, src = load_config(self.path, allow_pickle)
        self.model = load_model(lambda: TemporalFusionTransformer(self.config), open_reader(src, allow_pickle=allow_pickle), device=self.placement.device, dtype=self.placement.dtype)
        self.model.eval()
        extra = self.config.extra or {}
        self.context_length = int(extra.get("context_length", 256))
        self.max_horizon = int(extra["max_horizon"]) if extra.get("max_horizon") else None
        self.grid = list(self.config.quantiles)

    # -- inference ----------------------------------------------------------------------------
    def _run(self, batch: Batch, details: bool = False):
        inputs = {k: (v.to(self.placement.device) if v is not None else None) for k, v in batch.tensors().items()}
        for k in ("observed_reals", "known_reals", "static_reals"):
            if inputs.get(k) is not None:
                inputs[k] = inputs[k].to(self.placement.dtype)
        with torch.inference_mode():
            out = self.model(**inputs, return_details=details)
        if details:
            q, det = out
            det = {k: (v.float().cpu().numpy() if v is not None else None) for k, v in det.items()}
        else:
            q, det = out, None
        q = unscale(q.float().cpu().numpy().astype(np.float64), batch.loc, batch.scale)
        return q, det

    def forecast(
        self,
        records: Sequence[SeriesRecord],
        binding: Binding,
        horizon: int,
        levels: Sequence[float],
        context: Optional[int] = None,
        origins: Optional[Sequence[int]] = None,
        explain: bool = False,
        clip_nonnegative: bool = True,
    ) -> list[ForecastResult]:
        """Forecast ``horizon`` steps after each origin (default: the end of each history)."""
        context = context or self.context_length
        batch = make_batch(records, self.config, binding, context, horizon, origins)
        grid, det = self._run(batch, explain)
        if clip_nonnegative:
            nonneg = np.array([r.nonnegative for r in records])
            grid[nonneg] = np.maximum(grid[nonneg], 0.0)
        wanted = interpolate_quantiles(grid, self.grid, levels)
        results = []
        for i, rec in enumerate(records):
            o = rec.length if origins is None else int(origins[i])
            ex = self._explanation(i, det, batch, rec, binding) if explain else None
            results.append(ForecastResult(rec, grid[i], wanted[i], o, ex))
        return results

    # -- interpretation -----------------------------------------------------------------------
    def _label(self, name: str, binding: Binding, role: str) -> Optional[str]:
        """A display name for an input, or None for an unused slot."""
        if name == "target":
            return "target history"
        if name in self.config.variable_groups:
            return name
        if name in BUILTIN_LABELS:
            return BUILTIN_LABELS[name]
        bound = getattr(binding, role).get(name)
        return bound

    def _weights(self, names: list[str], weights: np.ndarray, binding: Binding, roles: list[str]) -> dict[str, float]:
        out: dict[str, float] = {}
        unused = 0.0
        skip = set()
        for (a, b), label in PAIRS.items():
            if a in names and b in names:
                out[label] = float(weights[names.index(a)] + weights[names.index(b)])
                skip |= {a, b}
        for name, w, role in zip(names, weights, roles):
            if name in skip:
                continue
            label = self._label(name, binding, role)
            if label is None:
                unused += float(w)
            else:
                out[label] = out.get(label, 0.0) + float(w)
        if unused > 0:
            out["(unused inputs)"] = unused
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _explanation(self, i: int, det: dict, batch: Batch, rec: SeriesRecord, binding: Binding) -> dict:
        cfg = self.config
        n = int(batch.encoder_lengths[i])
        static = {}
        if det["static_weights"] is not None:
            names = cfg.input_names("static")
            roles = ["static_real"] * len(cfg.static_reals) + ["static_cat"] * len(cfg.static_categoricals)
            static = self._weights(names, det["static_weights"][i], binding, roles)
        past_names = cfg.past_input_names
        past_roles = ["known"] * len(cfg.input_names("known")) + ["observed"] * len(cfg.input_names("observed"))
        past = self._weights(past_names, det["encoder_weights"][i, :n].mean(axis=0), binding, past_roles)
        future = self._weights(cfg.input_names("known"), det["decoder_weights"][i].mean(axis=0), binding, ["known"] * len(cfg.input_names("known")))
        att = det["attention"][i]  # (H, lmax + H)
        hist = att[:, :n].mean(axis=0)  # attention of the horizon steps on each history step
        by_lag = hist[::-1]  # lag 1 = the last history step
        return {
            "static": static,
            "past": past,
            "future": future,
            "attention_by_lag": [float(x) for x in by_lag],
            "attention_on_history": float(att[:, :n].sum(axis=1).mean()),
        }

    # -- backtest -----------------------------------------------------------------------------
    def backtest(
        self,
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
            results = self.forecast([r for r, _ in chunk], binding, horizon, levels, context, origins=[o for _, o in chunk])
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
                median = res.grid[:, self.grid.index(0.5)]
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
            "wql": _r(self.model.wql),
            "mase": _r(self.model.mase),
            "seasonal_naive_wql": _r(self.naive.wql),
            "seasonal_naive_mase": _r(self.naive.mase),
            "relative_wql": _r(self.relative_wql),
            "relative_mase": _r(self.relative_mase),
        }


def _r(x: float, nd: int = 4):
    return None if x is None or not np.isfinite(x) else round(float(x), nd)


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
            "wql": _r(wql),
            "seasonal_naive_wql": _r(naive_wql),
            "relative_wql": _r(wql / naive_wql if naive_wql > 0 else float("nan")),
            "mase": _r(geometric_mean([s.model.mase for s in self.series])),
            "seasonal_naive_mase": _r(geometric_mean([s.naive.mase for s in self.series])),
            "relative_wql_gmean": _r(geometric_mean([s.relative_wql for s in self.series])),
            "relative_mase_gmean": _r(geometric_mean([s.relative_mase for s in self.series])),
        }


# -- fine-tuning ---------------------------------------------------------------------------------
@dataclass
class FineTuneReport:
    steps: int
    windows: int
    series: int
    before: float
    after: float
    kept: bool
    validation_series: int

    @property
    def gain(self) -> float:
        return (self.before - self.after) / self.before if self.before > 0 else 0.0

    def line(self) -> str:
        change = f"{-100 * self.gain:+.1f}%"
        verdict = "using the fine-tuned model" if self.kept else "no gain: keeping the original model"
        return (
            f"fine-tuned {self.steps} steps on {self.windows} windows from {self.series} series: held-out weighted quantile loss "
            f"{self.before:.4f} -> {self.after:.4f} ({change}; last window of {self.validation_series} series); {verdict}"
        )

    def to_dict(self) -> dict:
        return {"steps": self.steps, "training_windows": self.windows, "series": self.series, "validation_series": self.validation_series, "wql_before": _r(self.before), "wql_after": _r(self.after), "gain": _r(self.gain), "kept": self.kept}


def fine_tune(
    fc: Forecaster,
    records: Sequence[SeriesRecord],
    binding: Binding,
    horizon: int,
    steps: int,
    *,
    context: Optional[int] = None,
    lr: float = 3e-4,
    batch_size: int = 32,
    seed: int = 0,
    cutoff: Optional[Callable[[SeriesRecord], int]] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> FineTuneReport:
    """Fine-tune ``fc.model`` in place on windows of the user's own series.

    The last ``horizon`` steps before each series' cutoff (default: its end) are held out; training
    windows end before them. The held-out weighted quantile loss is measured before and after; when
    fine-tuning does not lower it, the original weights are restored.
    """
    context = context or fc.context_length
    cut = {r.id: (cutoff(r) if cutoff else r.length) for r in records}
    val = [r for r in records if cut[r.id] - horizon >= 8]
    if not val:
        raise UserError(f"--fit-steps needs series longer than the horizon plus 8 steps; none is ({horizon} + 8)")
    val_origins = [cut[r.id] - horizon for r in val]
    levels = fc.grid

    def held_out() -> float:
        num, den = np.zeros(len(levels)), 0.0
        for s in range(0, len(val), 256):
            chunk, origins = val[s : s + 256], val_origins[s : s + 256]
            res = fc.forecast(chunk, binding, horizon, levels, context, origins=origins)
            for rec, o, r in zip(chunk, origins, res):
                n, d = quantile_loss_sum(rec.target[o : o + horizon], r.grid, levels, rec.observed_mask[o : o + horizon])
                num += n
                den += d
        return float(np.mean(num) / den) if den > 0 else float("nan")

    before = held_out()
    # training windows: origin o with o >= 8 and o + horizon <= cutoff - horizon
    train = [(r, cut[r.id] - 2 * horizon) for r in records if cut[r.id] - 2 * horizon >= 8]
    if not train:
        raise UserError(f"--fit-steps: no series is long enough to train on (each needs 2 x horizon + 8 = {2 * horizon + 8} steps)")
    n_windows = int(sum(last - 7 for _, last in train))
    original = copy.deepcopy(fc.model.state_dict())
    model = fc.model
    model.train()
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    rng = np.random.default_rng(seed)
    weights = np.array([last - 7 for _, last in train], dtype=np.float64)
    weights /= weights.sum()
    for step in range(steps):
        picks = rng.choice(len(train), size=batch_size, p=weights)
        recs = [train[j][0] for j in picks]
        origins = [int(rng.integers(8, train[j][1] + 1)) for j in picks]
        batch = make_batch(recs, fc.config, binding, context, horizon, origins, with_future_target=True)
        y = np.clip((batch.target_future - batch.loc[:, None]) / batch.scale[:, None], -INPUT_CLIP, INPUT_CLIP)
        y = torch.from_numpy(np.nan_to_num(y, nan=0.0).astype(np.float32)).to(fc.placement.device)
        mask = torch.from_numpy(batch.future_mask).to(fc.placement.device)
        inputs = {k: (v.to(fc.placement.device) if v is not None else None) for k, v in batch.tensors().items()}
        for k in ("observed_reals", "known_reals", "static_reals"):
            if inputs.get(k) is not None:
                inputs[k] = inputs[k].to(fc.placement.dtype)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 10)) * (0.5 * (1 + math.cos(math.pi * step / max(1, steps))))
        loss = quantile_loss(model(**inputs).float(), y, fc.config.quantiles, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if progress:
            progress(1)
    model.eval()
    after = held_out()
    kept = np.isfinite(after) and after < before
    if not kept:
        model.load_state_dict(original)
    return FineTuneReport(steps, n_windows, len(train), before, after if np.isfinite(after) else before, bool(kept), len(val))


def save_finetuned(fc: Forecaster, out: Path, note: str) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    save_model(fc.model, out / "model.safetensors", metadata={"architecture": ARCHITECTURE})
    cfg = fc.config.to_dict()
    cfg["extra"] = {**(cfg.get("extra") or {}), "fine_tuned": note}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
