"""scripts/train_ddpm.py: a tiny run that checkpoints, resumes where it stopped, and exports a
diffusers DDPMPipeline folder that diffusers and `gencli sample ddpm` both load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--size", "16", "--widths", "8,16", "--layers", "1", "--attention-from", "1", "--head-dim", "8", "--groups", "4", "--batch", "4",
        "--timesteps", "50", "--eval-every", "0", "--warmup", "2", "--ckpt-every", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def train_ddpm():
    sys.path.insert(0, str(ROOT))
    from scripts import train_ddpm

    return train_ddpm


def _run(train_ddpm, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["train_ddpm.py", *map(str, args)])
    threads = torch.get_num_threads()
    try:
        train_ddpm.main()
    finally:
        torch.set_num_threads(threads)


def test_a_run_resumes_and_exports_a_pipeline_folder(train_ddpm, monkeypatch, tmp_path, capsys):
    out = tmp_path / "run"
    _run(train_ddpm, monkeypatch, "--out", out, "--steps", "3", *TINY)
    state = torch.load(out / "ckpt.pt", weights_only=True)
    assert state["step"] == 3 and "python" in state["command"]
    _run(train_ddpm, monkeypatch, "--out", out, "--steps", "5", *TINY)
    log = capsys.readouterr().out
    assert "from step 3" in log and "exported to" in log
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 5
    folder = out / "pipeline"
    for name in ("model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"):
        assert (folder / name).is_file(), name

    from gencli.pipelines.ddpm.loading import inspect_pipeline, open_ddpm

    ours = open_ddpm(inspect_pipeline(folder), device="cpu", dtype="float32").unet
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    diffusers = pytest.importorskip("diffusers")
    pipe = diffusers.DDPMPipeline.from_pretrained(folder)
    with torch.no_grad():
        assert (pipe.unet(x, 7).sample - ours(x, 7)).abs().max() < 1e-4
    assert pipe.scheduler.config.num_train_timesteps == 50
    # a DDIMPipeline by default: 50 deterministic steps unless asked, as the training's judge samples
    assert type(pipe.scheduler).__name__ == "DDIMScheduler" and pipe.scheduler.config.set_alpha_to_one
    assert inspect_pipeline(folder).default_sampler == "ddim"
    assert type(diffusers.DiffusionPipeline.from_pretrained(folder)).__name__ == "DDIMPipeline"
    # v-prediction on the schedule rescaled to zero terminal SNR, "trailing" timesteps: as diffusers reads it
    assert pipe.scheduler.config.prediction_type == "v_prediction" and pipe.scheduler.config.rescale_betas_zero_snr
    assert pipe.scheduler.config.timestep_spacing == "trailing" and float(pipe.scheduler.alphas_cumprod[-1]) < 1e-6
    _run(train_ddpm, monkeypatch, "--out", out, "--steps", "5", *TINY, "--export", tmp_path / "half", "--fp16")
    weights = "unet/diffusion_pytorch_model.safetensors"
    assert (tmp_path / "half" / weights).stat().st_size < (folder / weights).stat().st_size


def test_epsilon_prediction_at_zero_terminal_snr_is_refused(train_ddpm, monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="--no-zero-snr"):
        _run(train_ddpm, monkeypatch, "--out", tmp_path / "r", "--steps", "1", *TINY, "--prediction-type", "epsilon")
    _run(train_ddpm, monkeypatch, "--out", tmp_path / "r", "--steps", "1", *TINY, "--prediction-type", "epsilon", "--no-zero-snr")
    assert torch.load(tmp_path / "r" / "ckpt.pt", weights_only=True)["step"] == 1


def test_a_ddpm_pipeline_export(train_ddpm, monkeypatch, tmp_path):
    _run(train_ddpm, monkeypatch, "--out", tmp_path / "r", "--steps", "1", *TINY, "--export", tmp_path / "p", "--pipeline", "ddpm")
    from gencli.pipelines.ddpm.loading import inspect_pipeline

    checkpoint = inspect_pipeline(tmp_path / "p")
    assert checkpoint.default_sampler == "ddpm" and checkpoint.scheduler_class == "DDPMScheduler"
    assert not (tmp_path / "p" / "generation_config.json").exists()
    # --default-sampler/--default-steps: generation_config.json, what gencli sample ddpm runs by default
    defaults = ["--default-sampler", "ddpm", "--default-steps", "9"]
    _run(train_ddpm, monkeypatch, "--out", tmp_path / "r", "--steps", "1", *TINY, "--export", tmp_path / "g", *defaults)
    from gencli.pipelines.ddpm.sampling import default_steps

    checkpoint = inspect_pipeline(tmp_path / "g")
    assert (checkpoint.default_sampler, default_steps(checkpoint, "ddpm")) == ("ddpm", 9) and checkpoint.scheduler_class == "DDIMScheduler"
    diffusers = pytest.importorskip("diffusers")
    pipe = diffusers.DiffusionPipeline.from_pretrained(tmp_path / "p")
    assert type(pipe).__name__ == "DDPMPipeline" and pipe.scheduler.config.variance_type == "fixed_small"


def test_timesteps_drawn_at_a_normal_log_snr(train_ddpm):
    from gencli.schedulers.ddpm import DDPMScheduler

    abar = DDPMScheduler(train_ddpm.scheduler_config(1000, "linear")).alphas_cumprod
    log_snr = torch.log(abar / (1 - abar))
    gen = torch.Generator().manual_seed(0)
    uniform = train_ddpm.timestep_sampler(abar, -1.0, 2.5, 1.0)(20000, gen)
    assert torch.equal(uniform, torch.randint(0, 1000, (20000,), generator=torch.Generator().manual_seed(0)))  # Ho et al.'s draw, unchanged
    drawn = log_snr[train_ddpm.timestep_sampler(abar, -1.0, 2.5, 0.0)(20000, torch.Generator().manual_seed(1))]
    assert abs(float(drawn.mean()) + 1.0) < 0.1 and abs(float(drawn.std()) - 2.5) < 0.1
    uniform_lo = float((log_snr[uniform] < -4).float().mean())
    assert uniform_lo > 0.35 and float((drawn < -4).float().mean()) < 0.15  # the pure-noise end gets far fewer draws
    mixed = train_ddpm.timestep_sampler(abar, -1.0, 2.5, 0.3)(20000, torch.Generator().manual_seed(2))
    assert int(mixed.min()) >= 0 and int(mixed.max()) <= 999 and 0.15 < float((log_snr[mixed] < -4).float().mean()) < 0.25


def test_a_compiled_run_checkpoints_the_models_own_keys(train_ddpm, monkeypatch, tmp_path):
    """``--compile``: the compiled forward trains the same parameters; the checkpoint and the export
    keep the plain module's keys (no ``_orig_mod.`` prefix), so an eager run resumes from it."""
    out = tmp_path / "run"
    _run(train_ddpm, monkeypatch, "--out", out, "--steps", "2", "--compile", "default", *TINY)
    state = torch.load(out / "ckpt.pt", weights_only=True)
    assert state["step"] == 2 and not any("_orig_mod" in k for k in state["model"])
    _run(train_ddpm, monkeypatch, "--out", out, "--steps", "3", *TINY)
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 3


def test_a_fresh_run_can_start_from_an_exported_pipelines_weights(train_ddpm, monkeypatch, tmp_path, capsys):
    from safetensors.torch import load_file

    _run(train_ddpm, monkeypatch, "--out", tmp_path / "a", "--steps", "3", *TINY)
    _run(train_ddpm, monkeypatch, "--out", tmp_path / "a", "--steps", "3", *TINY, "--export", tmp_path / "p")
    weights = "unet/diffusion_pytorch_model.safetensors"
    source = load_file(str(tmp_path / "p" / weights))
    # no steps: the new run's export is the weights it started from
    _run(train_ddpm, monkeypatch, "--out", tmp_path / "b", "--steps", "0", *TINY, "--init-from", tmp_path / "p")
    assert "trained 3 steps" in capsys.readouterr().out
    started = load_file(str(tmp_path / "b" / "pipeline" / weights))
    assert source.keys() == started.keys() and all(torch.equal(source[k], started[k]) for k in source)
    # one step: the checkpoint records where the run started, the weights move from there
    _run(train_ddpm, monkeypatch, "--out", tmp_path / "c", "--steps", "1", *TINY, "--init-from", tmp_path / "p")
    state = torch.load(tmp_path / "c" / "ckpt.pt", weights_only=True)
    assert f"started from the weights of {tmp_path / 'p'} (trained 3 steps)" in state["command"]
    moved = state["model"]
    assert all(torch.allclose(moved[k], source[k], atol=1e-2) for k in source) and any(not torch.equal(moved[k], source[k]) for k in source)
    # another UNet or another schedule: one clear line
    with pytest.raises(SystemExit, match="block_out_channels"):
        _run(train_ddpm, monkeypatch, "--out", tmp_path / "d", "--steps", "1", *TINY, "--widths", "8,8", "--init-from", tmp_path / "p")
    with pytest.raises(SystemExit, match="no unet/config.json"):
        _run(train_ddpm, monkeypatch, "--out", tmp_path / "f", "--steps", "1", *TINY, "--init-from", tmp_path / "missing")
    with pytest.raises(SystemExit, match="prediction_type"):
        _run(train_ddpm, monkeypatch, "--out", tmp_path / "e", "--steps", "1", *TINY, "--prediction-type", "epsilon", "--no-zero-snr",
             "--init-from", tmp_path / "p")  # fmt: skip
