"""Pixel-space diffusion (``gencli sample ddpm``): diffusers' UNet2DModel on the shared blocks, the
DDPM/DDIM samplers, and the images against diffusers' DDPMPipeline / DDIMPipeline, on tiny random
checkpoints of the two config styles saved as pipeline folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import one_error_line

diffusers = pytest.importorskip("diffusers")

# google/ddpm-cifar10-32 in miniature: flip_sin_to_cos False, freq_shift 1, attention at one level
CIFAR_STYLE = dict(
    sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D"), flip_sin_to_cos=False, freq_shift=1, norm_num_groups=4, attention_head_dim=None, norm_eps=1e-6,
    downsample_padding=0, dropout=0.0,
)  # fmt: skip
# newer diffusers training scripts: head size set, scale-shift time conditioning, class labels, learned variance
NEW_STYLE = dict(
    sample_size=8, in_channels=3, out_channels=6, block_out_channels=(8, 16), layers_per_block=2, down_block_types=("AttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "AttnUpBlock2D"), norm_num_groups=4, attention_head_dim=4, resnet_time_scale_shift="scale_shift", num_class_embeds=3,
)  # fmt: skip
TRAIN_STEPS = 40


def _random_unet(config: dict, seed: int):
    torch.manual_seed(seed)
    unet = diffusers.UNet2DModel(**config).eval()
    with torch.no_grad():
        for p in unet.parameters():
            p.normal_(0, 0.15)
    return unet


def _scheduler(**overrides):
    base = dict(num_train_timesteps=TRAIN_STEPS, beta_schedule="linear", beta_start=1e-4, beta_end=0.2, variance_type="fixed_small", clip_sample=True)
    return diffusers.DDPMScheduler(**{**base, **overrides})


@pytest.fixture(scope="module")
def folders(tmp_path_factory, one_torch_thread):
    root = tmp_path_factory.mktemp("ddpm")
    cifar = root / "cifar"
    diffusers.DDPMPipeline(unet=_random_unet(CIFAR_STYLE, 0), scheduler=_scheduler()).save_pretrained(cifar)
    new = root / "new"
    sched = _scheduler(beta_schedule="squaredcos_cap_v2", variance_type="learned_range", prediction_type="epsilon")
    diffusers.DDPMPipeline(unet=_random_unet(NEW_STYLE, 1), scheduler=sched).save_pretrained(new)
    ddim = root / "ddim"
    ddim_sched = diffusers.DDIMScheduler(num_train_timesteps=TRAIN_STEPS, beta_end=0.2, clip_sample=True)
    diffusers.DDIMPipeline(unet=_random_unet(CIFAR_STYLE, 2), scheduler=ddim_sched).save_pretrained(ddim)
    return {"cifar": cifar, "new": new, "ddim": ddim, "root": root}


def _load(folder: Path):
    from gencli.pipelines.ddpm.loading import inspect_pipeline, open_ddpm

    return open_ddpm(inspect_pipeline(folder), device="cpu", dtype="float32")


def _pixels(images: np.ndarray) -> np.ndarray:
    """diffusers' numpy_to_pil rounding, kept as an array."""
    return (images * 255).round().astype(np.uint8)


def _generators(seeds):
    return [torch.Generator("cpu").manual_seed(s) for s in seeds]


# -- the model -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [
        CIFAR_STYLE,
        NEW_STYLE,
        {**CIFAR_STYLE, "add_attention": False, "center_input_sample": True, "class_embed_type": "timestep", "mid_block_scale_factor": 1.414},
        {**CIFAR_STYLE, "act_fn": "gelu", "time_embedding_dim": 24, "attn_norm_num_groups": 2, "attention_head_dim": 8, "norm_eps": 1e-5},
    ],
    ids=["cifar-style", "new-style", "timestep-class-embedding", "gelu-attn-groups"],
)
def test_unet_matches_diffusers(config, one_torch_thread):
    from gencli.models.unet.unet_2d import UNet2DModel

    ref = _random_unet(config, 3)
    ours = UNet2DModel(dict(ref.config)).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)  # diffusers' key names, by identity
    x = torch.randn(2, ref.config.in_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 2]) if ref.config.num_class_embeds or ref.config.class_embed_type else None
    with torch.no_grad():
        for t in (torch.tensor([3, 37]), torch.tensor(11), 25):
            want = ref(x, t, class_labels=labels).sample
            got = ours(x, t, labels)
            assert (want - got).abs().max() < 1e-4


def test_unet_config_round_trip_and_refusals():
    from gencli.models.unet.unet_2d import UNet2DConfig

    cfg = UNet2DConfig.from_dict(CIFAR_STYLE)
    assert cfg.attention_head_dim is None and cfg.flip_sin_to_cos is False and cfg.freq_shift == 1 and cfg.layers_per_block == (1, 1)
    again = UNet2DConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert list(diffusers.UNet2DModel.from_config(cfg.to_dict()).config["block_out_channels"]) == [8, 16]
    for bad, message in [
        ({"time_embedding_type": "fourier"}, "time_embedding_type"),
        ({"down_block_types": ("SkipDownBlock2D", "DownBlock2D")}, "SkipDownBlock2D"),
        ({"resnet_time_scale_shift": "spatial"}, "resnet_time_scale_shift"),
        ({"_class_name": "UNet2DConditionModel"}, "UNet2DConditionModel"),
    ]:
        with pytest.raises(ValueError, match=message):
            UNet2DConfig.from_dict({**CIFAR_STYLE, **bad})


# -- images against diffusers' pipelines ---------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [{}, {"variance_type": "fixed_large", "beta_schedule": "scaled_linear", "prediction_type": "v_prediction"},
     {"clip_sample": False, "prediction_type": "sample", "timestep_spacing": "trailing"},
     {"clip_sample_range": 0.5, "beta_schedule": "squaredcos_cap_v2", "variance_type": "fixed_small_log", "timestep_spacing": "linspace"}],
    ids=["fixed_small", "fixed_large-v", "sample-trailing", "cosine-clip-range"],
)  # fmt: skip
def test_ddpm_images_match_diffusers_ddpm_pipeline(folders, tmp_path, overrides):
    from gencli.pipelines.ddpm import sampling

    folder = folders["cifar"]
    if overrides:
        folder = tmp_path / "variant"
        diffusers.DDPMPipeline.from_pretrained(folders["cifar"]).save_pretrained(folder)
        cfg = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({**cfg, **overrides}))
    seeds, steps = [5, 9], 10
    pipe = diffusers.DDPMPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    want = _pixels(pipe(batch_size=2, generator=_generators(seeds), num_inference_steps=steps, output_type="np").images)
    got = sampling.generate(_load(folder), seeds, sampler="ddpm", steps=steps)
    assert got.shape == want.shape == (2, 8, 8, 3)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 2


def test_a_wide_float32_unet_runs_its_3x3_layers_by_winograd_and_matches_diffusers(tmp_path, one_torch_thread, monkeypatch):
    from gencli.backend.layers import Conv2d
    from gencli.pipelines.ddpm import sampling
    from tests.conftest import built_quant_kernels

    built_quant_kernels()
    monkeypatch.setenv("GENCLI_WINOGRAD", "1")  # on any CPU (unset, AMD CPUs keep the direct convolution)
    folder = tmp_path / "wide"  # 64 channels: wide enough for gencli.backend.winograd
    wide = {**CIFAR_STYLE, "block_out_channels": (64, 64), "norm_num_groups": 8}
    diffusers.DDPMPipeline(unet=_random_unet(wide, 4), scheduler=_scheduler()).save_pretrained(folder)
    seeds, steps = [3, 8], 10
    pipe = diffusers.DDPMPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    want = _pixels(pipe(batch_size=2, generator=_generators(seeds), num_inference_steps=steps, output_type="np").images)
    loaded = _load(folder)
    got = sampling.generate(loaded, seeds, sampler="ddpm", steps=steps)
    convs = [m for m in loaded.unet.modules() if isinstance(m, Conv2d)]
    assert sum(c.winograd for c in convs) >= 8  # every 3x3 layer of 64 channels in and out
    assert len(np.unique(want)) > 20  # the reference draws varied pixels, not a flat field
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 2


def test_auto_dtype_is_bf16_where_the_cpu_multiplies_it_and_the_images_stay_close(folders, monkeypatch):
    """--dtype auto follows the UNet families' rule (bf16 on a CPU with native bf16, else fp32); the
    bf16 UNet's images stay within a few levels of the fp32 ones (the sampler itself stays fp32)."""
    from gencli.backend import device as devmod
    from gencli.pipelines.ddpm import sampling
    from gencli.pipelines.ddpm.loading import inspect_pipeline, open_ddpm

    checkpoint = inspect_pipeline(folders["cifar"])
    for flag, want in (("0", torch.float32), ("1", torch.bfloat16)):
        devmod.cpu_has_native_bf16.cache_clear()
        monkeypatch.setenv("GENCLI_CPU_BF16", flag)
        assert open_ddpm(checkpoint, device="cpu", dtype="auto", threads=1).placement.dtype == want
    devmod.cpu_has_native_bf16.cache_clear()
    seeds = [3, 4]
    full = sampling.generate(_load(folders["cifar"]), seeds, sampler="ddpm", steps=10)
    half = sampling.generate(open_ddpm(checkpoint, device="cpu", dtype="bfloat16", threads=1), seeds, sampler="ddpm", steps=10)
    assert np.abs(full.astype(int) - half.astype(int)).max() <= 3


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_images_match_diffusers_ddim_pipeline(folders, eta):
    from gencli.pipelines.ddpm import sampling

    seeds, steps = [0, 1, 2], 8
    pipe = diffusers.DDIMPipeline.from_pretrained(folders["ddim"])
    pipe.set_progress_bar_config(disable=True)
    want = _pixels(pipe(batch_size=3, generator=_generators(seeds), eta=eta, num_inference_steps=steps, output_type="np").images)
    loaded = _load(folders["ddim"])
    assert loaded.checkpoint.default_sampler == "ddim"
    got = sampling.generate(loaded, seeds, sampler="ddim", steps=steps, eta=eta)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 2
    # a DDPM folder sampled with DDIM, as DDIMPipeline(unet, scheduler) converts its scheduler
    pipe = diffusers.DDIMPipeline(unet=diffusers.UNet2DModel.from_pretrained(folders["cifar"] / "unet"), scheduler=_scheduler())
    pipe.set_progress_bar_config(disable=True)
    want = _pixels(pipe(batch_size=3, generator=_generators(seeds), eta=eta, num_inference_steps=steps, output_type="np").images)
    got = sampling.generate(_load(folders["cifar"]), seeds, sampler="ddim", steps=steps, eta=eta)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 2


def test_class_conditional_learned_range_matches_the_diffusers_loop(folders):
    """DDPMPipeline passes no class labels; its loop with them (and learned_range variance, cosine betas)."""
    from diffusers.utils.torch_utils import randn_tensor

    from gencli.pipelines.ddpm import sampling

    seeds, steps, label = [3, 4], 12, 2
    unet = diffusers.UNet2DModel.from_pretrained(folders["new"] / "unet").eval()
    scheduler = diffusers.DDPMScheduler.from_pretrained(folders["new"] / "scheduler")
    generators = _generators(seeds)
    image = randn_tensor((2, 3, 8, 8), generator=generators)
    scheduler.set_timesteps(steps)
    labels = torch.tensor([label, label])
    with torch.no_grad():
        for t in scheduler.timesteps:
            out = unet(image, t, class_labels=labels).sample
            image = scheduler.step(out, t, image, generator=generators).prev_sample
    want = _pixels((image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy())
    got = sampling.generate(_load(folders["new"]), seeds, sampler="ddpm", steps=steps, class_label=label)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 2


# -- the command ---------------------------------------------------------------------------------------
def invoke(*args):
    from gencli.cli import app

    return CliRunner().invoke(app, ["sample", "ddpm", *map(str, args)])


def test_a_seed_gives_the_same_bytes_alone_and_among_others(folders, tmp_path):
    r = invoke("-m", folders["cifar"], "--seeds", "2", "--steps", "6", "-o", tmp_path / "alone.png")
    assert r.exit_code == 0, r.stderr
    r = invoke("-m", folders["cifar"], "--seeds", "0-3", "--steps", "6", "-o", tmp_path / "many-{seed}.png", "--json")
    assert r.exit_code == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [rec["seed"] for rec in records] == [0, 1, 2, 3] and all(rec["steps"] == 6 and rec["sampler"] == "ddpm" for rec in records)
    assert (tmp_path / "alone.png").read_bytes() == (tmp_path / "many-2.png").read_bytes()
    from PIL import Image

    from gencli.pipelines.diffusion.png_parameters import read_parameters

    params = read_parameters(tmp_path / "many-2.png")
    assert (params.steps, params.sampler, params.seed, params.width, params.height, params.model) == (6, "DDPM", 2, 8, 8, "cifar")
    assert params.prompt == "" and len(params.model_hash) == 10
    with Image.open(tmp_path / "many-3.png") as im:
        assert im.size == (8, 8) and im.mode == "RGB"


def test_replay_redraws_a_sample_its_grid_and_its_eta_byte_for_byte(folders, tmp_path):
    from gencli.cli import app

    def replay(*args):
        return CliRunner().invoke(app, ["replay", *map(str, args)])

    assert invoke("-m", folders["cifar"], "--seeds", "5", "--steps", "5", "--sampler", "ddim", "--eta", "0.5", "-o", tmp_path / "a.png").exit_code == 0
    r = replay(tmp_path / "a.png", "-m", folders["cifar"], "-o", tmp_path / "a2.png")
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "a2.png").read_bytes() == (tmp_path / "a.png").read_bytes()
    # another seed through the PNG's other settings: what sample ddpm draws for it
    assert replay(tmp_path / "a.png", "-m", folders["cifar"], "--seed", 6, "-o", tmp_path / "b2.png").exit_code == 0
    assert invoke("-m", folders["cifar"], "--seeds", "6", "--steps", "5", "--sampler", "ddim", "--eta", "0.5", "-o", tmp_path / "b.png").exit_code == 0
    assert (tmp_path / "b2.png").read_bytes() == (tmp_path / "b.png").read_bytes() != (tmp_path / "a.png").read_bytes()
    assert invoke("-m", folders["cifar"], "--seeds", "0-2,7", "--steps", "4", "-o", tmp_path / "g.png").exit_code == 0
    assert replay(tmp_path / "g.png", "-m", folders["cifar"]).exit_code == 0  # default name: g-replay.png
    assert (tmp_path / "g-replay.png").read_bytes() == (tmp_path / "g.png").read_bytes()
    r = replay(tmp_path / "g.png", "-m", folders["cifar"], "-o", tmp_path / "g-replay.png")
    assert r.exit_code == 2 and "--force" in r.stderr  # nothing replaced without --force
    for flags in (["--lora", "x.safetensors"], ["--init-image", tmp_path / "a.png"]):
        r = replay(tmp_path / "a.png", "-m", folders["cifar"], *flags, "-o", tmp_path / "c.png")
        assert r.exit_code == 2 and "DDPM pipeline" in r.stderr and not (tmp_path / "c.png").exists(), r.stderr


def test_replay_keeps_a_grids_row_length_and_warns_of_another_model(folders, tmp_path):
    from PIL import Image

    from gencli.cli import app
    from gencli.pipelines.diffusion.png_parameters import read_parameters

    def replay(*args):
        return CliRunner().invoke(app, ["replay", *map(str, args)])

    assert invoke("-m", folders["cifar"], "--seeds", "0-5", "--nrow", "3", "--steps", "3", "-o", tmp_path / "g.png").exit_code == 0
    assert read_parameters(tmp_path / "g.png").extra["Grid row"] == "3"
    with Image.open(tmp_path / "g.png") as im:
        assert im.size[0] > im.size[1]  # 3 across, 2 down (the default row length would be 2 across)
    r = replay(tmp_path / "g.png", "-m", folders["cifar"], "-o", tmp_path / "g2.png")
    assert r.exit_code == 0 and "Model hash" not in r.stderr, r.stderr
    assert (tmp_path / "g2.png").read_bytes() == (tmp_path / "g.png").read_bytes()
    assert "Grid row" not in read_parameters(invoke_png(folders, tmp_path / "d.png", "0-3")).extra  # the default: not recorded
    # the same settings on another checkpoint: drawn, with a warning that names both hashes
    r = replay(tmp_path / "g.png", "-m", folders["ddim"], "-o", tmp_path / "g3.png")
    assert r.exit_code == 0 and "Model hash" in r.stderr and "the image will differ" in r.stderr, r.stderr
    assert (tmp_path / "g3.png").read_bytes() != (tmp_path / "g.png").read_bytes()


def invoke_png(folders, path, seeds):
    assert invoke("-m", folders["cifar"], "--seeds", seeds, "--steps", "2", "-o", path).exit_code == 0
    return path


def test_grid_out_dir_ddim_eta_and_class_labels(folders, tmp_path):
    r = invoke("-m", folders["cifar"], "-n", "3", "--seed", "7", "--steps", "4", "--sampler", "ddim", "--eta", "0.5", "-o", tmp_path / "grid.png", "--json")
    assert r.exit_code == 0, r.stderr
    (rec,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert rec["seeds"] == [7, 8, 9] and rec["eta"] == 0.5 and rec["sampler"] == "ddim"
    from gencli.pipelines.diffusion.png_parameters import read_parameters

    params = read_parameters(tmp_path / "grid.png")
    assert params.sampler == "DDIM" and params.extra["Eta"] == "0.5" and params.extra["Grid seeds"] == "7-9"
    r = invoke("-m", folders["cifar"], "--seeds", "1,4", "--steps", "3", "--out-dir", tmp_path / "dir", "--batch-size", "2")
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["ddpm-seed1.png", "ddpm-seed4.png"]
    r = invoke("-m", folders["new"], "--seeds", "1", "--steps", "3", "--class-label", "1", "-o", tmp_path / "c.png")
    assert r.exit_code == 0, r.stderr
    assert read_parameters(tmp_path / "c.png").extra["Class label"] == "1"


def test_bad_input_is_one_line_and_writes_nothing(folders, tmp_path):
    sd = tmp_path / "sd"
    (sd / "unet").mkdir(parents=True)
    (sd / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}))
    (sd / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    no_sched = tmp_path / "nosched"
    diffusers.DDPMPipeline.from_pretrained(folders["cifar"]).save_pretrained(no_sched)
    (no_sched / "scheduler" / "scheduler_config.json").unlink()
    out = tmp_path / "out.png"
    m = ["-m", folders["cifar"], "-o", out]
    cases = [
        ([*m, "--steps", "0"], "--steps"),
        ([*m, "--steps", str(TRAIN_STEPS + 1)], "training timesteps"),
        ([*m, "--sampler", "ddim", "--eta", "1.5"], "--eta"),
        ([*m, "--sampler", "ddim", "--eta", "-0.1"], "--eta"),
        ([*m, "--eta", "0.5"], "DDIM"),
        ([*m, "--sampler", "nope"], "unknown sampler"),
        (["-m", sd, "-o", out], "gencli txt2img"),
        (["-m", no_sched, "-o", out], "scheduler"),
        (["-o", out, "--steps", "1001"], "training timesteps"),  # the embedded default (1,000 timesteps)
        (["-m", folders["new"], "-o", out, "--steps", "2"], "--class-label"),
        ([*m, "--class-label", "1"], "not class-conditional"),
        ([*m, "--interpolate", "3"], "--interpolate"),
        (["-m", folders["cifar"], "-n", "2", "-o", tmp_path / "x-{bad}.png"], "{bad}"),
    ]
    for args, needle in cases:
        one_error_line(invoke(*args), needle)
    assert not out.exists() and not list(tmp_path.glob("x-*"))
    one_error_line(CliRunner().invoke(__import__("gencli.cli", fromlist=["app"]).app, ["sample", "gan", "--steps", "3"]), "--steps is for sample ddpm")


@pytest.mark.parametrize("sampler", ["euler_a", "dpmpp_2m_karras", "heun"])
def test_the_other_samplers_run_in_pixel_space_seed_by_seed(folders, sampler):
    from gencli.pipelines.ddpm import sampling

    loaded = _load(folders["new"])  # learned variance: these samplers read the mean channels
    both = sampling.generate(loaded, [0, 1], sampler=sampler, steps=4, class_label=0)
    alone = sampling.generate(loaded, [1], sampler=sampler, steps=4, class_label=0)
    assert both.shape == (2, 8, 8, 3) and both.std() > 0
    assert np.array_equal(both[1], alone[0])


def test_the_progress_bar_counts_every_image_step(folders, tmp_path):
    import contextlib

    from gencli.pipelines.ddpm.jobs import DDPMRequest, run

    seen = {}

    class Report:
        def debug(self, message):
            pass

        @contextlib.contextmanager
        def progress(self, description, total=None):
            seen["total"], seen["done"] = total, 0

            def advance(n=1, description=None):
                seen["done"] += n

            yield advance

    req = DDPMRequest(model=str(folders["cifar"]), seeds="0-2", steps=3, sampler="heun", batch_size=2, out=str(tmp_path / "p-{i}.png"))
    records = list(run(req, Report(), {"device": "cpu", "dtype": "float32"}, new_seed=lambda: 0))
    assert len(records) == 3 and seen["total"] == seen["done"] == 3 * 5  # Heun: 2 * 3 - 1 UNet calls per image


def test_other_commands_name_sample_ddpm_for_a_ddpm_folder(folders, tmp_path):
    """A DDPM/DDIM pipeline folder given to another command is named with the command that runs it."""
    from PIL import Image

    from gencli.checkpoints.formats import command_for
    from gencli.cli import app

    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    for args in (["txt2img", "a star", "-m", str(folders["cifar"])], ["classify", str(tmp_path / "x.png"), "-m", str(folders["ddim"])]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and "run it with gencli sample ddpm" in r.stderr, (args, r.stderr)
    assert command_for("diffusers pipeline (StableDiffusionPipeline)")[1] == "gencli txt2img or gencli img2img"
    assert command_for("SegformerForSemanticSegmentation")[1] == "gencli segment"


def test_a_folders_generation_config_sets_the_default_sampler_and_steps(folders, tmp_path):
    """``generation_config.json`` at a pipeline folder's root (as a text-to-image folder has): its
    sampler and steps are a run's defaults, flags still win, and the PNG records what ran."""
    import shutil

    folder = tmp_path / "cfg"
    shutil.copytree(folders["ddim"], folder)
    (folder / "generation_config.json").write_text(json.dumps({"sampler": "DDPM", "num_inference_steps": 7}))
    r = invoke("-m", folder, "--seed", "3", "-o", tmp_path / "default.png", "--json")
    assert r.exit_code == 0, r.stderr
    rec = json.loads(r.stdout)
    assert (rec["sampler"], rec["steps"]) == ("ddpm", 7)
    from gencli.pipelines.diffusion.png_parameters import read_parameters

    params = read_parameters(tmp_path / "default.png")
    assert (params.sampler, params.steps) == ("DDPM", 7)
    # the same image as asking for it, and not the folder's own DDIM
    r = invoke("-m", folders["ddim"], "--seed", "3", "--sampler", "ddpm", "--steps", "7", "-o", tmp_path / "asked.png")
    assert r.exit_code == 0, r.stderr
    assert _same_pixels(tmp_path / "default.png", tmp_path / "asked.png")
    r = invoke("-m", folder, "--seed", "3", "--sampler", "ddim", "-o", tmp_path / "flag.png", "--json")
    assert r.exit_code == 0, r.stderr
    assert (json.loads(r.stdout)["sampler"], json.loads(r.stdout)["steps"]) == ("ddim", 7)
    for bad, needle in [({"num_inference_steps": 0}, "num_inference_steps"), ({"num_inference_steps": TRAIN_STEPS + 1}, "num_inference_steps"),
                        ({"num_inference_steps": "7"}, "num_inference_steps"), ({"sampler": "nope"}, "sampler"), ([1], "JSON object")]:  # fmt: skip
        (folder / "generation_config.json").write_text(json.dumps(bad))
        one_error_line(invoke("-m", folder, "-o", tmp_path / "bad.png"), needle)
    assert not (tmp_path / "bad.png").exists()


def _same_pixels(a: Path, b: Path) -> bool:
    from PIL import Image

    with Image.open(a) as x, Image.open(b) as y:
        return np.array_equal(np.asarray(x), np.asarray(y))
