#!/usr/bin/env python
"""Train the embedded default forecaster: a global TFT on the synthetic corpus of gencli/data/series.py.

    python scripts/train_forecast.py --out runs/forecast --steps 30000          # train (resumable)
    python scripts/train_forecast.py --out runs/forecast --export weights/tft-forecast   # write the default

Every batch is freshly generated (seed = (--seed, step)), so the corpus never repeats and a resumed
run continues exactly where it stopped. Each batch draws one history length (16-256 steps, 30% of
the batches at the full 256) and one horizon (1-64); series are scaled per window (the std of the
history, anchored at its last observed value; --scaling mean anchors at the mean) and the loss is the
pinball loss averaged over the quantile grid, on the scaled target.
Checkpoints (model + optimiser + step) are written every --save-every steps, atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QUANTILE_GRID = [0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99]
CONTEXT = 256
MAX_HORIZON = 64
PRE = 128


def default_config(hidden: int = 64, variable_size: int = 16, heads: int = 4, dropout: float = 0.1, scaling: str = "last", target_diff: bool = True):
    from gencli.data.calendar import CALENDAR_FEATURES
    from gencli.data.series import NUM_KNOWN_SLOTS, NUM_OBSERVED_SLOTS, NUM_STATIC_CAT_SLOTS, NUM_STATIC_REAL_SLOTS
    from gencli.models.tft import TFTConfig

    return TFTConfig(
        hidden_size=hidden,
        variable_size=variable_size,
        num_attention_heads=heads,
        lstm_layers=1,
        dropout=dropout,
        quantiles=QUANTILE_GRID,
        static_reals=["target_loc"] + [f"static_real_{k}" for k in range(1, NUM_STATIC_REAL_SLOTS + 1)],
        static_categoricals={"frequency": 8, **{f"static_cat_{k}": 64 for k in range(1, NUM_STATIC_CAT_SLOTS + 1)}},
        observed_reals=["target", "target_observed"] + [f"observed_{k}" for k in range(1, NUM_OBSERVED_SLOTS + 1)] + (["target_diff"] if target_diff else []),
        known_reals=["relative_time", "seasonal_lag", *CALENDAR_FEATURES] + [f"known_{k}" for k in range(1, NUM_KNOWN_SLOTS + 1)],
        variable_groups={
            "target history": ["target", "target_observed"] + (["target_diff"] if target_diff else []),
            "hour of day": ["hour_sin", "hour_cos"],
            "day of week": ["weekday_sin", "weekday_cos"],
            "time of year": ["year_sin", "year_cos"],
        },
        extra={"context_length": CONTEXT, "max_horizon": MAX_HORIZON, "scaling": scaling, "task": "forecast"},
    )


def identity_binding(config):
    from gencli.pipelines.forecast.features import Binding, free_slots

    return Binding(
        known={s: s for s in free_slots(config, "known")},
        observed={s: s for s in free_slots(config, "observed")},
        static_real={s: s for s in free_slots(config, "static_real")},
        static_cat={s: s for s in free_slots(config, "static_cat")},
    )


def sample_batch(config, binding, seed: int, step: int, batch_size: int):
    """One training batch: (tensors, scaled future targets, mask)."""
    import torch

    from gencli.data.series import generate
    from gencli.pipelines.forecast.features import INPUT_CLIP, make_batch

    rng = np.random.default_rng([seed, step, 7])
    context = CONTEXT if rng.random() < 0.3 else int(rng.integers(16, CONTEXT + 1))
    horizon = int(rng.choice([int(rng.integers(1, MAX_HORIZON + 1)), int(rng.integers(4, 25))]))
    # PRE steps before the window give the seasonal lag feature a history, as a user's series has
    records = [generate([seed, step, i], PRE + context + horizon) for i in range(batch_size)]
    batch = make_batch(records, config, binding, context, horizon, origins=[PRE + context] * batch_size, with_future_target=True)
    y = np.clip((batch.target_future - batch.loc[:, None]) / batch.scale[:, None], -INPUT_CLIP, INPUT_CLIP)
    y = np.nan_to_num(y, nan=0.0)
    return batch.tensors(), torch.from_numpy(y.astype(np.float32)), torch.from_numpy(batch.future_mask)


def fixed_validation(config, binding, n_batches: int = 6, batch_size: int = 64):
    return [sample_batch(config, binding, seed=10_000_019, step=i, batch_size=batch_size) for i in range(n_batches)]


def evaluate(model, batches) -> float:
    import torch

    from gencli.models.tft import quantile_loss

    model.eval()
    total = 0.0
    with torch.inference_mode():
        for inputs, y, mask in batches:
            total += float(quantile_loss(model(**inputs), y, model.config.quantiles, mask))
    model.train()
    return total / len(batches)


def checkpoint_state(model, optimizer, step: int, extra: dict) -> dict:
    """What a checkpoint holds: weights, optimiser, step, the architecture (a resumed run keeps it)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "config": json.dumps(model.config.to_dict()), **extra}


def export(model, out: Path, meta: dict, dtype: str = "float32") -> None:
    import torch

    from gencli.checkpoints.loader import save_model

    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out / "model.safetensors", dtype=getattr(torch, dtype), metadata={"architecture": "TemporalFusionTransformer"})
    cfg = model.config.to_dict()
    cfg["extra"] = {**cfg.get("extra", {}), **meta}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/forecast", help="run folder (checkpoint, log)")
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--variable-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0, help="0 by default: the corpus is infinite, nothing to overfit")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bf16", action="store_true", help="autocast matmuls to bfloat16 (AMX)")
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--export", help="write the trained model (config.json + model.safetensors) to this folder and exit")
    p.add_argument("--scaling", choices=["last", "mean"], default="last", help="window loc: the last observed value (default) or the mean")
    p.add_argument("--no-target-diff", action="store_true", help="leave out the target-differences input")
    p.add_argument("--stop-at", type=int, default=0, help="stop (with a checkpoint) at this step, keeping the --steps schedule")
    p.add_argument("--init-from", help="start a new run from this run folder's checkpoint (tensors of matching shape are copied)")
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument(
        "--export-from",
        choices=["best", "last", "average"],
        default="best",
        help="which weights --export writes: best (lowest synthetic validation loss), last, or average (of the snapshots in --snapshots "
        "from step --average-from on, if its synthetic validation loss is not worse than best's)",
    )
    p.add_argument("--snapshots", help="folder of checkpoint copies taken during training (for --export-from average)")
    p.add_argument("--average-from", type=int, default=0)
    p.add_argument(
        "--export-dtype", choices=["float32", "float16"], default="float32", help="tensor dtype of the exported safetensors (loaded back in the run's dtype)"
    )
    p.add_argument("--time-steps", type=int, default=0, help="time this many steps and exit (no checkpoint)")
    args = p.parse_args(argv)
    if args.export_from == "average" and not args.snapshots:
        p.error("--export-from average needs --snapshots FOLDER")

    import torch

    from gencli.models.tft import TemporalFusionTransformer, TFTConfig, quantile_loss
    from gencli.training import load_checkpoint, save_checkpoint, set_lr, warmup_cosine_lr

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    config = default_config(args.hidden, args.variable_size, args.heads, args.dropout, args.scaling, not args.no_target_diff)
    state = load_checkpoint(ckpt_path)
    if state is not None and "config" in state:
        # a resumed run keeps the architecture it started with, whatever the flags say now
        config = TFTConfig.from_dict(json.loads(state["config"]))
    torch.manual_seed(args.seed)
    model = TemporalFusionTransformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    step = 0
    best = float("inf")
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        best = float(state.get("best", best))
        if not args.export:
            print(f"resumed at step {step}", flush=True)
    if state is None and args.init_from and not args.export:
        src = load_checkpoint(Path(args.init_from) / "checkpoint.pt")["model"]
        own = model.state_dict()
        copied = 0
        for k, v in src.items():
            if k in own and own[k].shape == v.shape:
                own[k].copy_(v)
                copied += 1
            elif k in own and own[k].dim() == v.dim() and all(a >= b for a, b in zip(own[k].shape, v.shape)):
                own[k][tuple(slice(0, n) for n in v.shape)].copy_(v)  # grown input tables: old rows kept
                copied += 1
        print(f"initialised {copied} of {len(own)} tensors from {args.init_from}", flush=True)
    if args.export:
        best_path = out / "best.pt"
        src = best_path if best_path.exists() and args.export_from in ("best", "average") else ckpt_path
        state = load_checkpoint(src)
        model.load_state_dict(state["model"])
        model.eval()
        meta = {"trained_steps": int(state["step"]), "train_batch_size": args.batch_size, "train_seed": args.seed}
        if args.export_from == "average":
            val = fixed_validation(config, identity_binding(config))
            best_val = evaluate(model, val)
            snaps = [load_checkpoint(f) for f in sorted(Path(args.snapshots).glob("*.pt"))]
            snaps = [x for x in snaps if int(x["step"]) >= args.average_from]
            if not snaps:
                raise SystemExit(f"no checkpoint in {args.snapshots} from step {args.average_from} on")
            steps = sorted({int(x["step"]) for x in snaps})
            snaps = [next(x for x in snaps if int(x["step"]) == st) for st in steps]
            avg = {k: sum(x["model"][k].float() for x in snaps) / len(snaps) for k in snaps[0]["model"]}
            model.load_state_dict(avg)
            avg_val = evaluate(model, val)
            print(f"best.pt (step {state['step']}) validation {best_val:.4f}; average of steps {steps} validation {avg_val:.4f}")
            if avg_val <= best_val:
                meta.update({"trained_steps": steps[-1], "weights": f"average of the checkpoints at steps {', '.join(map(str, steps))}"})
            else:
                model.load_state_dict(state["model"])
        export(model, Path(args.export), meta, args.export_dtype)
        print(f"exported to {args.export}: {meta}")
        return

    binding = identity_binding(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"TFT with {n_params:,} parameters; steps {step}..{args.steps}", flush=True)
    val = fixed_validation(config, binding)
    model.train()
    log = open(out / "train.log", "a")
    t0 = time.time()
    seen = 0
    running = None
    end = min(args.steps, args.stop_at) if args.stop_at else args.steps
    while step < end:
        lr = warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=0.03)
        set_lr(optimizer, lr)
        inputs, y, mask = sample_batch(config, binding, args.seed, step, args.batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            pred = model(**inputs)
        loss = quantile_loss(pred.float(), y, config.quantiles, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        seen += y.shape[0]
        lv = loss.item()
        running = lv if running is None else 0.98 * running + 0.02 * lv
        if args.time_steps and step >= args.time_steps:
            dt = time.time() - t0
            print(f"{args.time_steps} steps in {dt:.1f}s: {dt / args.time_steps:.3f} s/step, {seen / dt:.1f} series/s")
            return
        if step % 50 == 0:
            dt = time.time() - t0
            msg = f"step {step} loss {running:.4f} lr {lr:.2e} {seen / dt:.1f} series/s"
            print(msg, flush=True)
            log.write(msg + "\n")
            log.flush()
        if step % args.eval_every == 0 or step == args.steps:
            v = evaluate(model, val)
            msg = f"step {step} validation {v:.4f}"
            print(msg, flush=True)
            log.write(msg + "\n")
            log.flush()
            if v < best:
                best = v
                save_checkpoint(out / "best.pt", checkpoint_state(model, optimizer, step, {"best": best}))
        if step % args.save_every == 0 or step == end:
            save_checkpoint(ckpt_path, checkpoint_state(model, optimizer, step, {"best": best}))


if __name__ == "__main__":
    main()
