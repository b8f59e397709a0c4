"""The shared training helpers: schedule values, atomic resumable checkpoints, command history."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from gencli.training import command_history, load_checkpoint, parse_training_args, save_checkpoint, training_parser, warmup_cosine_lr


def test_warmup_cosine_schedule_values():
    assert warmup_cosine_lr(0, 100, 1.0, warmup=10) == pytest.approx(0.1)
    assert warmup_cosine_lr(9, 100, 1.0, warmup=10) == pytest.approx(1.0)
    assert warmup_cosine_lr(10, 100, 1.0, warmup=10) == pytest.approx(1.0)
    assert warmup_cosine_lr(55, 100, 1.0, warmup=10) == pytest.approx(0.5)  # half way through the decay
    assert warmup_cosine_lr(100, 100, 2.0, warmup=10, floor=0.05) == pytest.approx(0.1)
    assert warmup_cosine_lr(500, 100, 2.0, floor=0.05) == pytest.approx(0.1)  # flat after the end
    assert warmup_cosine_lr(25, 100, 1.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))


def test_warmup_stable_decay_schedule():
    # warmup to the peak, held until decay_start, then the cosine over the remaining steps
    assert warmup_cosine_lr(4, 100, 2.0, warmup=10, decay_start=70) == pytest.approx(1.0)
    assert warmup_cosine_lr(10, 100, 2.0, warmup=10, decay_start=70) == 2.0
    assert warmup_cosine_lr(69, 100, 2.0, warmup=10, decay_start=70) == 2.0
    assert warmup_cosine_lr(85, 100, 2.0, warmup=10, decay_start=70, floor=0.1) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert warmup_cosine_lr(100, 100, 2.0, warmup=10, decay_start=70, floor=0.1) == pytest.approx(0.2)


def test_checkpoint_round_trip_and_fresh_run(tmp_path):
    path = tmp_path / "ckpt.pt"
    assert load_checkpoint(path) is None
    model = torch.nn.Linear(3, 2)
    save_checkpoint(path, {"model": model.state_dict(), "step": 7, "history": [{"loss": 0.5}]})
    state = load_checkpoint(path)
    assert state["step"] == 7 and state["history"] == [{"loss": 0.5}]
    torch.testing.assert_close(state["model"]["weight"], model.weight.detach())
    save_checkpoint(path, {"step": 8})  # overwrites the previous checkpoint in place
    assert load_checkpoint(path)["step"] == 8
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary left behind


def test_checkpoint_refuses_pickled_objects(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"fn": print}, path)  # a callable needs unpickling of code: refused
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_checkpoint(path)


def test_command_history_records_resumptions():
    first = command_history(None, 0, ["train.py", "--out", "runs/a"])
    assert first == "python train.py --out runs/a"
    again = command_history(first, 100, ["train.py", "--out", "runs/a"])
    assert again == first  # the same command resumed: not repeated
    other = command_history(first, 250, ["train.py", "--out", "runs/a", "--steps", "9"])
    assert other == "python train.py --out runs/a  # then, resumed at step 250: python train.py --out runs/a --steps 9"


def test_resume_restores_every_named_object_and_the_history(tmp_path):
    from gencli.training import resume

    path = tmp_path / "ckpt.pt"
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert resume(path, model=model, optimizer=opt)[:1] == (0,)  # a fresh run
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    save_checkpoint(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7, "command": "python train.py --steps 7"})
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    step, command, state = resume(path, model=fresh, optimizer=fresh_opt)
    assert step == 7 and state["step"] == 7
    assert torch.equal(fresh.weight, model.weight) and fresh_opt.state_dict()["state"][0]["step"] == 1
    assert command.startswith("python train.py --steps 7  # then, resumed at step 7: ")


def test_training_arguments_defaults_and_run_settings():
    from pathlib import Path

    before = torch.get_num_threads()
    try:
        p = training_parser("demo", out="runs/demo", steps=7, batch=3, lr=0.5)
        p.add_argument("--widths", default="8,16")
        args = parse_training_args(p, ["--lr", "0.25", "--threads", "1", "--export", "exported"])
        assert (args.out, args.steps, args.batch, args.lr, args.widths) == (Path("runs/demo"), 7, 3, 0.25, "8,16")
        assert (args.threads, args.ckpt_every, args.export) == (1, 50, Path("exported"))
        assert torch.get_num_threads() == 1
        assert torch.initial_seed() == 0
    finally:
        torch.set_num_threads(before)


def _square(step: int) -> torch.Tensor:
    return torch.full((2,), float(step * step))


def test_prefetched_stream_is_the_same_with_worker_processes():
    from gencli.training import prefetched

    inline = [x.tolist() for x in prefetched(_square, 3, 9, workers=0)]
    ahead = [x.tolist() for x in prefetched(_square, 3, 9, workers=2)]
    assert inline == ahead == [[float(s * s)] * 2 for s in range(3, 9)]


def test_step_budget_replans_from_the_recent_speed(monkeypatch):
    import gencli.training as training

    now = [1000.0]
    monkeypatch.setattr(training.time, "time", lambda: now[0])
    budget = training.StepBudget(100.0, every=10)
    budget.begin(50)
    assert budget.steps(55) is None  # not at a planning step
    now[0] += 20.0  # 10 steps in 20 s: 2 s/step, 80 s left -> 40 more steps
    assert budget.steps(60) == 100
    now[0] += 10.0  # the next 10 steps took 1 s each: 70 s left -> 70 more
    assert budget.steps(70) == 140
    assert training.StepBudget(None).steps(200) is None


def test_fit_until_trains_checkpoints_and_schedules(tmp_path):
    """The shared encoder-script loop: it reaches the step count, lowers the loss, follows the
    warmup-cosine schedule (the last step runs at the 5% floor's neighbourhood) and leaves a checkpoint
    that holds the model, the optimizer, the step and the command."""
    from gencli.training import fit_until

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    seen: list[tuple[int, int, float]] = []

    def loss_of_step(step, total):
        seen.append((step, total, opt.param_groups[0]["lr"]))
        return torch.nn.functional.mse_loss(model(x), y)

    first = float(torch.nn.functional.mse_loss(model(x), y))
    logs: list[str] = []
    step, smooth = fit_until(model, opt, tmp_path / "ckpt.pt", loss_of_step, step=0, steps=60, lr=0.1, warmup=5, history="cmd", log=logs.append, log_every=20)
    assert step == 60 and [s for s, _, _ in seen] == list(range(60)) and len(logs) == 3
    assert seen[0][2] == pytest.approx(warmup_cosine_lr(0, 60, 0.1, warmup=5, floor=0.05))
    assert seen[-1][2] < seen[10][2]
    assert smooth is not None and float(torch.nn.functional.mse_loss(model(x), y)) < 0.1 * first
    state = load_checkpoint(tmp_path / "ckpt.pt")
    assert state["step"] == 60 and state["command"] == "cmd" and set(state) == {"model", "opt", "step", "command"}
    # resuming at the end runs no step and keeps the checkpoint's step
    step, _ = fit_until(model, opt, tmp_path / "ckpt.pt", loss_of_step, step=60, steps=60, lr=0.1, warmup=5, history="cmd", log=logs.append)
    assert step == 60 and len(seen) == 60
