"""A loaded TFT and what runs it on series records: batched forecasts in the series' own units and
their explanations (variable-selection weights, attention over the history). Backtests
(:mod:`~gencli.pipelines.forecast.backtest`) and fine-tuning (:mod:`~gencli.pipelines.forecast.finetune`)
build on :class:`Forecaster`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from gencli.backend.device import choose_placement
from gencli.checkpoints.formats import open_source, wrong_family
from gencli.checkpoints.loader import load_model
from gencli.checkpoints.reader import open_reader
from gencli.data.timeseries import SeriesRecord
from gencli.errors import CheckpointError
from gencli.models.tft import ARCHITECTURE, TemporalFusionTransformer, TFTConfig
from gencli.pipelines.forecast.features import Batch, Binding, make_batch, unscale
from gencli.pipelines.forecast.metrics import interpolate_quantiles
from gencli.pipelines.forecast.statistical import LABELS, MEMBERS

DEFAULT_MODEL = "tft-forecast"
ENSEMBLE_LABELS = ("network",) + tuple(LABELS[m] for m in MEMBERS)  # as the ensemble's weights
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
        raise wrong_family(src, "a forecasting model", f"forecast runs a TFT whose config.json names \"architecture\": \"{ARCHITECTURE}\"")
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

    def __init__(
        self, path: Path, *, device: str = "auto", dtype: str = "auto", threads: Optional[int] = None, allow_pickle: bool = False, ensemble: bool = False
    ):
        self.path = Path(path)
        self.ensemble = ensemble
        self.placement = choose_placement(device, dtype, "float", threads)
        self.config, src = load_config(self.path, allow_pickle)
        self.model = load_model(
            lambda: TemporalFusionTransformer(self.config),
            open_reader(src, allow_pickle=allow_pickle),
            device=self.placement.device,
            dtype=self.placement.dtype,
        )
        self.model.eval()
        extra = self.config.extra or {}
        self.context_length = int(extra.get("context_length", 256))
        self.max_horizon = int(extra["max_horizon"]) if extra.get("max_horizon") else None
        self.grid = list(self.config.quantiles)

    # -- inference ----------------------------------------------------------------------------
    def model_inputs(self, batch: Batch) -> dict[str, Optional[torch.Tensor]]:
        """The batch's tensors on the model's device, real-valued inputs in its dtype."""
        inputs = {k: (v.to(self.placement.device) if v is not None else None) for k, v in batch.tensors().items()}
        for k in ("observed_reals", "known_reals", "static_reals"):
            if inputs.get(k) is not None:
                inputs[k] = inputs[k].to(self.placement.dtype)
        return inputs

    def _run(self, batch: Batch, details: bool = False):
        inputs = self.model_inputs(batch)
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
        nonneg = np.array([r.nonnegative for r in records]) if clip_nonnegative else np.zeros(len(records), dtype=bool)
        grid[nonneg] = np.maximum(grid[nonneg], 0.0)
        ends = [rec.length if origins is None else int(origins[i]) for i, rec in enumerate(records)]
        weights = None
        if self.ensemble:
            from gencli.pipelines.forecast.ensemble import combine

            def heldout(idx: list[int], starts: list[int]) -> np.ndarray:
                return self._run(make_batch([records[i] for i in idx], self.config, binding, context, horizon, starts))[0]

            grid, weights = combine(records, ends, grid, heldout, horizon, self.grid, context, nonneg)
        wanted = interpolate_quantiles(grid, self.grid, levels)
        # levels beyond the grid's ends are extrapolated: a series never negative stays so there too
        wanted[nonneg] = np.maximum(wanted[nonneg], 0.0)
        results = []
        for i, rec in enumerate(records):
            ex = self._explanation(i, det, batch, rec, binding) if explain else None
            if ex is not None and weights is not None:
                ex["ensemble"] = {name: float(w) for name, w in zip(ENSEMBLE_LABELS, weights[i])}
            results.append(ForecastResult(rec, grid[i], wanted[i], ends[i], ex))
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


__all__ = ["DEFAULT_MODEL", "Forecaster", "ForecastResult", "load_config"]
