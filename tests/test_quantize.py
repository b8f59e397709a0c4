"""Weight-only quantization: QuantizedLinear against its own dequantized weight, the stored codes,
text models quantized on loading and through `gencli quantize`, and the bad inputs."""

from __future__ import annotations

import json

import pytest
import torch
from _text_fixtures import three_text_models
from typer.testing import CliRunner

from gencli.backend.quantize import (
    DEQUANTIZE_MIN_ROWS,
    QuantizationSpec,
    QuantizedLinear,
    quantize_int4,
    quantize_int8,
    quantize_linears,
    unpack_int4,
)
from gencli.cli import app

pytest.importorskip("transformers")


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, "prefill"])
def test_quantized_linear_multiplies_by_its_dequantized_weight(mode, rows):
    rows = DEQUANTIZE_MIN_ROWS[mode] // 2 + 4 if rows == "prefill" else rows  # x has 2 x rows rows
    torch.manual_seed(0)
    weight, bias = torch.randn(50, 96) * 0.05, torch.randn(50)  # 50 rows: padded for the int4 kernel
    layer = QuantizedLinear.from_weight(weight, bias, QuantizationSpec.for_mode(mode))
    x = torch.randn(2, rows, 96)
    with torch.inference_mode():
        out = layer(x)
        gelu = layer(x, activation="gelu")
    ref = torch.nn.functional.linear(x, layer.dequantized(), bias)
    assert out.shape == (2, rows, 50) and out.dtype == torch.float32
    # activations go through the product in bf16: agreement to bf16 precision
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (gelu - torch.nn.functional.gelu(out)).abs().max() <= 0.01 * ref.abs().max()  # fused in bf16 from 16 rows
    # and the dequantized weight is the original up to the quantization step
    rel = ((layer.dequantized() - weight).norm() / weight.norm()).item()
    assert rel < (0.01 if mode == "int8" else 0.1)


def test_int8_codes_and_scales():
    w = torch.tensor([[0.5, -1.0, 0.25], [2.0, 0.0, -0.02]])
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16
    assert q[0].tolist() == [64, -127, 32] and q[1, 0].item() == 127 and q[1, 1].item() == 0
    assert (q.float() * scale.float()[:, None] - w).abs().max() <= scale.float().max() / 2 + 1e-6


def test_int4_codes_round_trip_within_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(16, 64)
    packed, scale, zero = quantize_int4(w, 32)
    assert packed.shape == (16, 32) and packed.dtype == torch.uint8 and scale.shape == (16, 2)
    codes = unpack_int4(packed)
    assert codes.max() <= 15 and torch.equal(codes[:, 0::2], packed & 15)
    deq = ((codes.view(16, 2, 32).float() - 8) * scale.float()[..., None] + zero.float()[..., None]).view(16, 64)
    step = scale.float().repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-2 * step).all()


def test_quantize_linears_skips_shapes_the_group_does_not_divide_and_builds_empty_layers_on_meta():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(48, 8, bias=False))
    spec = quantize_linears(model, QuantizationSpec.for_mode("int4", 32))
    assert isinstance(model[0], QuantizedLinear) and model[0].weight.is_meta and model[0].weight.shape == (32, 32)
    assert isinstance(model[1], torch.nn.Linear) and spec.modules_to_not_convert == ("1",)
    assert QuantizationSpec.from_config(spec.to_config()) == spec


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return three_text_models(tmp_path_factory.mktemp("quant"))


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_text_models_stay_close_to_fp32(models, family, mode):
    from gencli.pipelines.text.loading import load_text_model

    fp32 = load_text_model(models / family, device="cpu", threads=1)
    quant = load_text_model(models / family, device="cpu", threads=1, quantize=mode)
    layers = [m for m in quant.model.modules() if isinstance(m, QuantizedLinear)]
    # every projection and the LM head; int4 leaves the down projections (112 inputs) to fp32
    expected = 4 * 2 + 1 if family == "gpt2" else 7 * 2 + 1 - (2 if mode == "int4" else 0)
    assert len(layers) == expected
    skipped = ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj") if family != "gpt2" and mode == "int4" else ()
    assert quant.quantization.modules_to_not_convert == skipped
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 30, 4]])
    with torch.inference_mode():
        a, b = fp32.model(ids), quant.model(ids)
        last = quant.model(ids[:, -1:], position_ids=torch.tensor([[8]]))  # one row: the kernel path
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < (0.03 if mode == "int8" else 0.2), rel
    assert last.shape == (1, 1, quant.model.vocab_size) and torch.isfinite(last).all()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_bf16_file_is_quantized_from_its_own_dtype_with_the_same_result(models, family, mode, tmp_path, monkeypatch):
    """Quantizing a bf16 checkpoint on loading reads it in bf16 (no fp32 copy of the whole model) and
    gives exactly what quantizing the fp32 model gives."""
    import shutil

    from safetensors.torch import load_file, save_file

    from gencli.checkpoints import loader
    from gencli.pipelines.text import loading as text

    folder = tmp_path / family
    shutil.copytree(models / family, folder)
    weights = folder / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(weights)).items()}, str(weights))

    reference = text.load_text_model(folder, device="cpu", dtype="float32", threads=1)
    quantize_linears(reference.model, QuantizationSpec.for_mode(mode))
    dtypes = []
    real_load = loader.load_state
    monkeypatch.setattr(loader, "load_state", lambda *a, **kw: dtypes.append(kw["dtype"]) or real_load(*a, **kw))
    quant = text.load_text_model(folder, device="cpu", dtype="float32", threads=1, quantize=mode)
    assert dtypes == [torch.bfloat16]
    want, got = reference.model.state_dict(), quant.model.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert want[name].dtype == got[name].dtype and torch.equal(want[name], got[name]), name


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_quantizing_on_loading_quantizes_each_layer_as_it_is_read(models, family, monkeypatch):
    """The layers are quantized inside the load, one at a time (the dense model never exists whole);
    only a head tied to the embedding is quantized afterwards, from the loaded embedding."""
    from gencli.backend import quantize as quant
    from gencli.checkpoints import loader
    from gencli.pipelines.text.loading import load_text_model

    in_load, after = [], []
    real_state, real_from = loader.load_state, quant.QuantizedLinear.from_weight.__func__
    loading = [False]

    def load_state(*a, **kw):
        loading[0] = True
        try:
            return real_state(*a, **kw)
        finally:
            loading[0] = False

    def from_weight(cls, weight, bias, spec):
        (in_load if loading[0] else after).append(tuple(weight.shape))
        return real_from(cls, weight, bias, spec)

    monkeypatch.setattr(loader, "load_state", load_state)
    monkeypatch.setattr(quant.QuantizedLinear, "from_weight", classmethod(from_weight))
    tm = load_text_model(models / family, device="cpu", threads=1, quantize="int8")
    layers = [n for n, _ in quant.quantized_layers(tm.model)]
    tied = family in ("gpt2", "qwen2")
    assert len(in_load) == len(layers) - tied and len(after) == tied, (in_load, after)
    if tied:
        assert after == [tuple(tm.model.lm_head.weight.shape)]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_info_counts_the_parameters_of_the_model_not_the_untied_head_or_the_scales(models, mode, tmp_path):
    original = json.loads(cli("info", models / "gpt2", "--json").stdout)["parameters"]
    group = ("--group-size", "32") if mode == "int4" else ()
    assert cli("quantize", models / "gpt2", tmp_path / "q", "--mode", mode, *group).exit_code == 0
    info = json.loads(cli("info", tmp_path / "q", "--json").stdout)
    assert info["quantization"]["untied_head"] is True  # GPT-2 ties its head to the embedding
    assert info["parameters"] == original
    assert "quantized copy of the tied embedding" in cli("info", tmp_path / "q").stdout


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)])


def test_quantize_command_saves_what_generate_quantizes_on_loading(models, tmp_path):
    out = tmp_path / "llama-int4"
    r = cli("quantize", models / "llama", out, "--mode", "int4", "--group-size", "32", "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["quantization"]["mode"] == "int4" and summary["layers"] == 13
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["group_size"] == 32
    assert (out / "tokenizer.model").is_file()
    info = json.loads(cli("info", out, "--json").stdout)
    assert info["quantization"]["layers"] == 13 and "uint8" in info["dtypes"]

    args = ("import os", "-n", 10, "--temperature", 0, "--ignore-eos", "--json")
    saved = json.loads(cli("generate", *args, "-m", out).stdout)
    on_load = json.loads(cli("generate", *args, "-m", models / "llama", "--quantize", "int4").stdout)
    assert saved["token_ids"] == on_load["token_ids"] and len(saved["token_ids"]) == 10

    again = cli("quantize", out, tmp_path / "twice")
    assert again.exit_code == 2 and "quantized already" in again.stderr
    other = cli("generate", "x", "-m", out, "--quantize", "int8")
    assert other.exit_code == 2 and "quantized already" in other.stderr
    exists = cli("quantize", models / "llama", out)
    assert exists.exit_code == 2 and "already exists" in exists.stderr


def test_bad_quantization_input_is_one_line_and_exit_2(models, tmp_path):
    r = cli("generate", "x", "-m", models / "gpt2", "--quantize", "int4", "--group-size", "3")
    assert r.exit_code == 2 and "group size" in r.stderr
    r = cli("generate", "x", "-m", models / "gpt2", "--group-size", "32")
    assert r.exit_code == 2 and "--group-size applies to --quantize int4" in r.stderr
    r = cli("generate", "x", "-m", models / "gpt2", "--quantize", "int3")
    assert r.exit_code == 2
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GENCLI_QUANT_ACTIVATIONS", "int3")
        r = cli("generate", "x", "-m", models / "gpt2", "--quantize", "int8")
    assert r.exit_code == 2 and "GENCLI_QUANT_ACTIVATIONS must be one of int8, fp32" in r.stderr and "Traceback" not in r.stderr
    folder = tmp_path / "gptq"
    folder.mkdir()
    for f in (models / "gpt2").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    r = cli("generate", "x", "-m", folder)
    assert r.exit_code == 2 and "'gptq' is not supported" in r.stderr and "Traceback" not in r.stderr


def test_the_allocator_is_trimmed_every_64_mb_of_dense_weights_quantized(monkeypatch):
    """glibc's free memory is handed back as the dense weights go (else the peak is fp32's), but not
    after every small layer: each trim costs milliseconds."""
    from gencli.backend import device as devmod

    trims = []
    monkeypatch.setattr(devmod, "release_free_memory", lambda: trims.append(1))
    trim = devmod.MemoryTrimmer()
    for _ in range(15):
        trim.freed(5 << 20)  # 75 MB in layers of 5 MB: one trim, after the 13th
    assert len(trims) == 1
    trim.freed(60 << 20)
    assert len(trims) == 2


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_saved_folder_decodes_with_torchs_kernels_from_aligned_tensors(models, mode, tmp_path):
    """Without gencli's kernels (GENCLI_QUANT_KERNELS=0, no compiler, another architecture) torch's
    weight-only kernels run the saved folder's layers. A tensor mapped from the file is only as
    aligned as its offset there (8 bytes): torch's int8 kernel crashed on such a weight, so the
    quantized layers' tensors are loaded as aligned copies. The decoding runs in a subprocess: a
    crash fails this test instead of ending pytest."""
    from conftest import run_cli

    from gencli.backend.quantize import quantized_layers
    from gencli.pipelines.text.loading import load_text_model

    out = tmp_path / "q"
    assert cli("quantize", models / "llama", out, "--mode", mode).exit_code == 0
    tm = load_text_model(out, device="cpu", threads=1)
    for name, layer in quantized_layers(tm.model):
        for t in (layer.weight, layer.weight_scale, layer.weight_zero):
            assert t is None or t.data_ptr() % 64 == 0, (name, t.data_ptr() % 64)
    r = run_cli("generate", "def add(a, b):", "-m", str(out), "-n", "8", "--seed", "0", "--json", env={"GENCLI_QUANT_KERNELS": "0", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert len(json.loads(r.stdout)["token_ids"]) > 0


def _folder(path, files):
    path.mkdir()
    for name in files:
        (path / name).write_text("keep me\n")
    return path


def test_force_replaces_only_a_folder_quantize_wrote_and_swaps_it_whole(models, tmp_path):
    out = tmp_path / "q"
    assert cli("quantize", models / "llama", out, "--mode", "int8").exit_code == 0
    first = sorted(p.name for p in out.iterdir())
    r = cli("quantize", models / "llama", out, "--mode", "int4")
    assert r.exit_code == 2 and "already exists (use --force to replace it)" in r.stderr
    r = cli("quantize", models / "llama", out, "--mode", "int4", "--force", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["quantization_config"]["mode"] == "int4"
    assert sorted(p.name for p in out.iterdir()) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"], "no temporary or old folder left beside it"
    (out / "notes.txt").write_text("mine\n")  # a file gencli did not write: the folder is the user's now
    r = cli("quantize", models / "llama", out, "--force")
    assert r.exit_code == 2 and "did not write ('notes.txt')" in r.stderr and "--force" not in r.stderr, r.stderr
    assert (out / "notes.txt").read_text() == "mine\n" and (out / "model.safetensors").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("quantize", models / "llama", empty, "--force").exit_code == 0 and (empty / "model.safetensors").is_file()


def test_force_never_deletes_a_folder_gencli_did_not_write(models, tmp_path, monkeypatch):
    user = _folder(tmp_path / "user", ["a.txt", "b.csv"])
    lookalike = tmp_path / "lookalike"  # a quantized folder's files, without the record of what quantize wrote
    lookalike.mkdir()
    for f in (models / "llama").iterdir():
        (lookalike / f.name).write_bytes(f.read_bytes())
    config = json.loads((lookalike / "config.json").read_text())
    config["quantization_config"] = QuantizationSpec.for_mode("int8").to_config()
    (lookalike / "config.json").write_text(json.dumps(config))
    with_folder = _folder(tmp_path / "nested", [])
    (with_folder / "sub").mkdir()
    for folder in (user, lookalike, with_folder):
        before = sorted(p.name for p in folder.rglob("*"))
        r = cli("quantize", models / "llama", folder, "--force")
        assert r.exit_code == 2 and "did not write" in r.stderr and "--force" not in r.stderr, r.stderr
        assert sorted(p.name for p in folder.rglob("*")) == before
    work = _folder(tmp_path / "work", ["precious.txt"])
    monkeypatch.chdir(work)
    for out, says in ((".", "'.' is the current folder"), ("..", "'..' holds the current folder"), (work, "is the current folder"), ("/", "'/' is the root")):
        r = cli("quantize", models / "llama", out, "--force")
        assert r.exit_code == 2 and says in r.stderr and "--force" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = cli("quantize", models / "llama", "-", "--force")
    assert r.exit_code == 2 and "'-' means stdout" in r.stderr and "--force" not in r.stderr
    assert sorted(p.name for p in work.iterdir()) == ["precious.txt"] and not (work / "-").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lookalike", "nested", "user", "work"]


def test_quantize_says_mode_takes_threads_and_names_the_layers_kept_in_float(models, tmp_path):
    r = cli("quantize", models / "llama", tmp_path / "a", "--group-size", "32")
    assert r.exit_code == 2 and "--group-size applies to --mode int4 only" in r.stderr and "--quantize" not in r.stderr, r.stderr
    r = cli("quantize", models / "llama", tmp_path / "b", "--mode", "int4", "--threads", "1")
    assert r.exit_code == 0, r.stderr
    # the down projections' 112 inputs are not a multiple of 32: they stay in float, and it says which
    assert "warning: 2 linear layers kept in float (input size not a multiple of the group size 32): " in r.stderr
    assert "model.layers.0.mlp.down_proj, model.layers.1.mlp.down_proj" in r.stderr
    r = cli("quantize", models / "llama", tmp_path / "c", "--threads", "0")
    assert r.exit_code == 2 and "--threads" in r.stderr


def test_an_interrupted_or_failed_swap_leaves_the_replaced_folder_as_it_was(tmp_path, monkeypatch):
    import errno
    import os

    from gencli import io

    out = _folder(tmp_path / "out", ["a", "b"])

    def wrote(folder):
        return ["a", "b"]

    with pytest.raises(KeyboardInterrupt):
        with io.atomic_folder(out, True, wrote=wrote) as tmp:
            (tmp / "a").write_text("new\n")
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "a").read_text() == "keep me\n"
    rename = os.rename

    def the_new_one_cannot_move(src, dst):
        if str(src).endswith(".tmp"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", the_new_one_cannot_move)
    with pytest.raises(OSError):
        with io.atomic_folder(out, True, wrote=wrote) as tmp:
            (tmp / "a").write_text("new\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "a").read_text() == "keep me\n"
    monkeypatch.setattr(os, "rename", rename)
    with io.atomic_folder(out, True, wrote=wrote) as tmp:
        (tmp / "a").write_text("new\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and sorted(p.name for p in out.iterdir()) == ["a"]
