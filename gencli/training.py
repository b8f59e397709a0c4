"""What every training loop shares: the learning-rate schedule, resumable checkpoints, the run's
command history. Used by ``scripts/train_*.py`` (which reproduce ``weights/``) and by the forecast
fine-tuning.

Checkpoints are written atomically (:func:`gencli.io.atomic_path`: a crash mid-write leaves the
previous checkpoint intact) and read back with ``torch.load(weights_only=True)`` only, so a
checkpoint holds tensors, numbers, strings, lists and dicts, nothing that unpickles code.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from gencli.io import atomic_path


def warmup_cosine_lr(step: int, total: int, peak: float, *, warmup: int = 0, floor: float = 0.0, decay_start: Optional[int] = None) -> float:
    """Linear warmup over ``warmup`` steps to ``peak``, then a cosine decay to ``floor * peak`` at
    ``total`` steps (and flat after it).

    ``decay_start`` holds the rate at ``peak`` from the end of the warmup until that step and starts
    the cosine there (a warmup-stable-decay schedule, whose ``total`` may still change while the
    rate is stable)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    start = warmup if decay_start is None else decay_start
    if step < start:
        return peak
    progress = min(1.0, (step - start) / max(1, total - start))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write a training state (model/optimizer state dicts, step, cursors, history...) atomically."""
    with atomic_path(path, force=True) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: str | Path) -> Optional[dict[str, Any]]:
    """The state saved by :func:`save_checkpoint`, or None when there is none yet (a fresh run)."""
    p = Path(path)
    if not p.is_file():
        return None
    return torch.load(p, map_location="cpu", weights_only=True)


def command_history(previous: Optional[str], step: int, argv: Optional[list[str]] = None) -> str:
    """The command line(s) that produced a run: the first one, then each resumption with its step,
    so the weights README can cite exactly how the weights were made."""
    command = "python " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv))
    if not previous:
        return command
    last = previous.rsplit(": ", 1)[-1] if "  # then, resumed at step" in previous else previous
    return previous if last == command else f"{previous}  # then, resumed at step {step}: {command}"


def resume(path: str | Path, **stateful: Any) -> tuple[int, str, Optional[dict[str, Any]]]:
    """Resume a run from its checkpoint at ``path`` when there is one: ``stateful`` maps checkpoint
    keys to the objects restored from them (modules, optimizers: anything with ``load_state_dict``).
    Returns ``(step, command history, the whole checkpoint or None)``; a fresh run is step 0."""
    state = load_checkpoint(path)
    if state is None:
        return 0, command_history(None, 0), None
    for key, obj in stateful.items():
        obj.load_state_dict(state[key])
    step = int(state["step"])
    return step, command_history(state.get("command"), step), state


__all__ = ["warmup_cosine_lr", "set_lr", "save_checkpoint", "load_checkpoint", "command_history", "resume", "prefetched", "StepBudget"]


def training_parser(description: str, *, out: str, steps: int, batch: int, lr: float) -> argparse.ArgumentParser:
    """The arguments a small training script starts with (``--out``, ``--steps``, ``--batch``, ``--lr``,
    with its defaults); it adds its own, then :func:`parse_training_args` adds the run's and parses."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=Path(out))
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--lr", type=float, default=lr)
    return p


def parse_training_args(p: argparse.ArgumentParser, argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Add ``--threads`` (default 1), ``--ckpt-every`` (default 50), ``--export`` (a folder: export
    the model there, training first only if the checkpoint has not reached ``--steps``), ``--device``
    (default cpu), ``--data-workers`` (processes that render the next batches ahead, 0: in the loop)
    and ``--time-budget`` (seconds: :class:`StepBudget` re-plans ``--steps`` from the measured speed
    so that the run, schedule included, ends within it), parse, and pin torch's threads and seed (0)
    for a reproducible run."""
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--export", type=Path, default=None)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--data-workers", type=int, default=0, help="processes that prepare batches ahead (0: in the training loop)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds: re-plan --steps from the measured speed so the run ends within it")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return args


class _StepDataset(torch.utils.data.Dataset):
    def __init__(self, make: Callable[[int], Any], start: int, stop: int):
        self.make, self.start, self.stop = make, start, stop

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __getitem__(self, i: int) -> Any:
        return self.make(self.start + i)


def prefetched(make: Callable[[int], Any], start: int, stop: int, workers: int) -> Iterator[Any]:
    """``make(step)`` for ``step`` in ``[start, stop)``, in order: computed in the loop when ``workers``
    is 0, else by that many worker processes ahead of the loop (a training loop whose data is rendered
    on the CPU keeps a GPU busy this way). The stream is the same either way: each item depends on its
    step alone."""
    if workers <= 0:
        return (make(s) for s in range(start, stop))
    loader = torch.utils.data.DataLoader(_StepDataset(make, start, stop), batch_size=None, num_workers=workers, prefetch_factor=4, persistent_workers=False)
    return iter(loader)



def fit_until(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ckpt: str | Path,
    loss_of_step: Callable[[int, int], torch.Tensor],
    *,
    step: int,
    steps: int,
    lr: float,
    warmup: int,
    history: str,
    until: Optional[str] = None,
    ckpt_minutes: float = 5.0,
    log: Callable[[str], None] = print,
    log_every: int = 25,
) -> tuple[int, Optional[float]]:
    """The loop of the encoder scripts: from ``step`` to ``steps`` (or, with ``until`` = ``"HH:MM"``, to
    that wall-clock time, the total re-estimated every step from the measured speed), each step
    ``loss_of_step(step, total)`` under a warmup-cosine learning rate (floor 5%), gradients clipped at
    1, a smoothed loss logged every ``log_every`` steps, a checkpoint ``{"model", "opt", "step",
    "command"}`` every ``ckpt_minutes`` and at the end. Returns the last step and the smoothed loss."""
    model.train()
    last, t0, smooth = time.time(), time.time(), None
    total, deadline, step_time, t_step = steps, None, None, time.time()
    if until:
        total = max(steps, step + 2)  # re-estimated from the first step's time on
        hh, mm = (int(x) for x in until.split(":"))
        now = time.localtime()
        deadline = time.mktime((now.tm_year, now.tm_mon, now.tm_mday, hh, mm, 0, 0, 0, now.tm_isdst))

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": optimizer.state_dict(), "step": step, "command": history}

    while step < total:
        if deadline is not None and step_time is not None:
            total = max(step + 1, step + int((deadline - time.time()) / step_time))
        set_lr(optimizer, warmup_cosine_lr(step, total, lr, warmup=warmup, floor=0.05))
        loss = loss_of_step(step, total)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        dt, t_step = time.time() - t_step, time.time()
        step_time = dt if step_time is None else 0.9 * step_time + 0.1 * dt
        value = loss.item()
        smooth = value if smooth is None else 0.95 * smooth + 0.05 * value
        if step % log_every == 0:
            log(f"step {step}/{total} loss {smooth:.4f} {(time.time() - t0) / log_every:.2f}s/step")
            t0 = time.time()
        if time.time() - last > ckpt_minutes * 60:
            save_checkpoint(ckpt, state())
            last = time.time()
    save_checkpoint(ckpt, state())
    return step, smooth

class StepBudget:
    """``--time-budget``: every ``every`` steps, the total number of steps that ends the run within
    ``seconds`` of :meth:`begin` at the recent speed (the first interval's speed includes the warm-up;
    later ones the interval since the last plan). A schedule that depends on the total (a cosine
    decay) is re-planned with it, so it still ends at its floor when the time is up."""

    def __init__(self, seconds: Optional[float], *, every: int = 200):
        self.seconds, self.every = seconds, every
        self.t_start = self.t_mark = time.time()
        self.first = self.mark = 0
        self.seconds_per_step: Optional[float] = None

    def begin(self, step: int) -> None:
        self.t_start = self.t_mark = time.time()
        self.first = self.mark = step

    def steps(self, step: int) -> Optional[int]:
        """The new total number of steps when it is time to re-plan, else None."""
        if not self.seconds or step <= self.first or (step - self.first) % self.every:
            return None
        now = time.time()
        self.seconds_per_step = (now - self.t_mark) / (step - self.mark)
        self.t_mark, self.mark = now, step
        return step + max(1, int((self.seconds - (now - self.t_start)) / self.seconds_per_step))
