"""Fine-tuning a :class:`~gencli.pipelines.forecast.forecaster.Forecaster` on the user's own series
(``--fit-steps``): the last window before each series' cutoff is held out, the model trains on
earlier windows, and the fine-tuned weights are kept only if the held-out loss went down."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from gencli.checkpoints.loader import save_model
from gencli.data.timeseries import SeriesRecord
from gencli.errors import UserError
from gencli.models.tft import ARCHITECTURE, quantile_loss
from gencli.pipelines.forecast.features import INPUT_CLIP, Binding, make_batch
from gencli.pipelines.forecast.forecaster import Forecaster
from gencli.pipelines.forecast.metrics import quantile_loss_sum, rounded
from gencli.training import set_lr, warmup_cosine_lr


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
        return {
            "steps": self.steps,
            "training_windows": self.windows,
            "series": self.series,
            "validation_series": self.validation_series,
            "wql_before": rounded(self.before),
            "wql_after": rounded(self.after),
            "gain": rounded(self.gain),
            "kept": self.kept,
        }


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
        # a linear warmup over the first tenth of the steps on top of a cosine decay over all of them
        set_lr(opt, lr * min(1.0, (step + 1) / max(1, steps // 10)) * warmup_cosine_lr(step, steps, 1.0))
        loss = quantile_loss(model(**fc.model_inputs(batch)).float(), y, fc.config.quantiles, mask)
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


def save_finetuned(fc: Forecaster, out: Path, note: str, force: bool = False) -> None:
    """Write the fine-tuned model as a folder ``--model`` takes (config.json + model.safetensors),
    through the output layer (:func:`gencli.io.atomic_folder`): built beside ``out`` and renamed into
    place, so ``out`` is whole or untouched; ``force`` replaces only a folder ``--save-model`` wrote."""
    import json

    from gencli.io import atomic_folder
    from gencli.pipelines.forecast.request import saved_model_files

    cfg = fc.config.to_dict()
    cfg["extra"] = {**(cfg.get("extra") or {}), "fine_tuned": note}
    with atomic_folder(out, force, wrote=saved_model_files) as tmp:
        save_model(fc.model, tmp / "model.safetensors", metadata={"architecture": ARCHITECTURE})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


__all__ = ["FineTuneReport", "fine_tune", "save_finetuned"]
