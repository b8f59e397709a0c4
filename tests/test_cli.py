"""CLI behaviour: help without torch, exit codes, one-line errors, JSON shape, atomic outputs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import save_file
from typer.testing import CliRunner

from gencli.cli.common import RunOptions, command
from gencli.console import emit_json
from gencli.errors import UserError
from gencli.io import atomic_open, atomic_path, ensure_writable, expand_inputs

CONTRACT = ["generate", "classify", "zeroshot", "forecast", "sample", "reconstruct", "encode", "decode", "txt2img", "img2img", "replay", "info", "models"]


def imported_modules(result_stderr: str) -> set[str]:
    """Module names from `python -X importtime` output."""
    mods = set()
    for line in result_stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S.*)$", line)
        if m:
            mods.add(m.group(1).strip())
    return mods


def test_help_lists_every_command_without_importing_torch(cli):
    import subprocess

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "gencli", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0
    for name in CONTRACT:
        assert re.search(rf"│ {name}\s", proc.stdout), f"{name} missing from --help"
    mods = imported_modules(proc.stderr)
    assert "typer" in mods, "importtime output not parsed"
    heavy = {m for m in mods if m.split(".")[0] in ("torch", "numpy", "safetensors", "PIL", "transformers", "sentencepiece", "tokenizers")}
    assert not heavy, f"--help imported {sorted(heavy)[:5]}"


@pytest.mark.parametrize("name", CONTRACT)
def test_every_command_help_is_torch_free(name):
    import subprocess

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "gencli", name, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-500:]
    assert not any(m.split(".")[0] == "torch" for m in imported_modules(proc.stderr))


def test_version_and_completion(cli):
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("gencli ")
    # the shell is detected from the parent processes: run it from a bash that stays its parent
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run(["bash", "-c", f"'{sys.executable}' -m gencli --show-completion; exit $?"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "complete" in r.stdout, r.stderr


def test_unknown_command_and_option_exit_2(cli):
    assert cli("frobnicate").returncode == 2
    assert cli("info", "--bogus-flag", "x").returncode == 2


def test_info_on_file_table_and_json(cli, tmp_path):
    save_file(
        {"transformer.h.0.attn.c_attn.weight": torch.zeros(4, 12), "transformer.wte.weight": torch.zeros(10, 4, dtype=torch.float16)},
        tmp_path / "m.safetensors",
    )
    r = cli("info", str(tmp_path / "m.safetensors"))
    assert r.returncode == 0, r.stderr
    assert "GPT2LMHeadModel" in r.stdout and "transformer.wte.weight" in r.stdout and "88" in r.stdout
    r = cli("info", str(tmp_path / "m.safetensors"), "--json", "--match", "wte")
    assert r.returncode == 0
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert {"path", "format", "architecture", "parameters", "dtypes", "tensors"} <= set(d)
    assert d["parameters"] == 88 and d["dtypes"]["float16"]["tensors"] == 1
    assert [t["name"] for t in d["tensors"]] == ["transformer.wte.weight"]


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: p / "does-not-exist", "does not exist"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "no weights in"),
        (lambda p: (p / "t.safetensors").write_bytes((100).to_bytes(8, "little") + b"{}") and p / "t.safetensors", "not a valid safetensors file"),
        (lambda p: (p / "m.bin").write_bytes(b"x") and p / "m.bin", "refusing to load"),
    ],
)
def test_info_bad_input_is_one_line_exit_2(cli, tmp_path, setup, message):
    target = setup(tmp_path)
    r = cli("info", str(target))
    assert r.returncode == 2
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_truncated_file_is_clean_error(cli, tmp_path):
    save_file({"a": torch.zeros(100, 100)}, tmp_path / "full.safetensors")
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    r = cli("info", str(tmp_path / "cut.safetensors"))
    assert r.returncode == 2 and "truncated: tensor 'a'" in r.stderr and "Traceback" not in r.stderr
    r = cli("info", str(tmp_path / "cut.safetensors"), "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_models_lists_defaults(cli, tmp_path):
    w = tmp_path / "weights"
    (w / "tiny-thing").mkdir(parents=True)
    (w / "tiny-thing" / "README.md").write_text("# Tiny thing\n\ntask: generate\n\nA tiny model trained on X. Held-out loss 1.23.\n\n## More\nDetails.\n")
    (w / "tiny-thing" / "model.safetensors").write_bytes(b"0" * 1000)
    r = cli("models", "--json", env={"GENCLI_WEIGHTS": str(w)})
    assert r.returncode == 0
    row = json.loads(r.stdout.strip().splitlines()[0])
    assert row["name"] == "tiny-thing" and row["commands"] == ["generate"] and row["summary"] == "A tiny model trained on X." and row["size_bytes"] == 1000
    r = cli("models", env={"GENCLI_WEIGHTS": str(w)})
    assert "tiny-thing  generate  1.0 KB  A tiny model trained on X." in r.stdout.splitlines()[1]  # the first sentence, one line
    r = cli("info", "tiny-thing", env={"GENCLI_WEIGHTS": str(w)})
    assert r.returncode == 2 and "tiny-thing" in r.stderr  # resolved by name; its fake weights are not safetensors


def test_readme_models_example_lists_every_default():
    from conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    block = readme.split("$ gencli models | cut -c1-110\n", 1)[1].split("```", 1)[0]
    shown = [line.split()[0] for line in block.splitlines()[1:] if line.strip()]
    assert shown == sorted(p.name for p in (ROOT / "weights").iterdir() if p.is_dir() and (p / "README.md").is_file())


# -- the shared command decorator on a throwaway app --------------------------------------
def make_app():
    app = typer.Typer()

    @command(app, "run")
    def run(count: int = 1, *, opts: RunOptions) -> None:
        from gencli.backend.device import choose_placement

        if count < 0:
            raise UserError("--count must be >= 0")
        if count == 99:
            raise RuntimeError("boom")
        placement = choose_placement(opts.device, opts.dtype, threads=opts.threads)
        opts.report.debug(f"chose {placement.describe()}")
        for i in range(count):
            if opts.json:
                emit_json({"i": i, "device": str(placement.device), "dtype": str(placement.dtype)})

    @command(app, "other", model_options=False)
    def other(*, opts: RunOptions) -> None:
        assert opts.model is None

    return app


runner = CliRunner()


def test_common_options_and_json_lines():
    r = runner.invoke(make_app(), ["run", "--count", "3", "--json", "--device", "cpu", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [row["i"] for row in rows] == [0, 1, 2] and rows[0]["dtype"] == "torch.float32"


def test_verbose_prints_the_choice_on_stderr():
    r = runner.invoke(make_app(), ["run", "--device", "cpu", "--dtype", "bfloat16", "--verbose"])
    assert r.exit_code == 0 and "chose device cpu, dtype bfloat16" in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    "args, needle", [(["--device", "tpu"], "tpu"), (["--dtype", "fp8"], "fp8"), (["--count", "-1"], "--count must be >= 0"), (["--threads", "0"], "at least 1")]
)
def test_bad_usage_exit_2(args, needle):
    r = runner.invoke(make_app(), ["run", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output


def test_unavailable_cuda_is_exit_2(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = runner.invoke(make_app(), ["run", "--device", "cuda"])
    assert r.exit_code == 2 and "CUDA is not available" in r.stderr


def test_internal_error_exit_1_without_traceback_unless_debug():
    r = runner.invoke(make_app(), ["run", "--count", "99"])
    assert r.exit_code == 1 and "internal error: RuntimeError: boom" in r.stderr and "Traceback" not in r.stderr
    r = runner.invoke(make_app(), ["run", "--count", "99", "--debug"])
    assert r.exit_code == 1 and "Traceback" in r.stderr


def test_output_only_commands_have_no_model_options():
    r = runner.invoke(make_app(), ["other", "--model", "x"])
    assert r.exit_code == 2


# -- output files ---------------------------------------------------------------------------
def test_ensure_writable_refuses_existing_without_force(tmp_path):
    f = tmp_path / "out.png"
    f.write_text("keep me")
    with pytest.raises(UserError, match="already exists.*--force"):
        ensure_writable(f)
    assert ensure_writable(f, force=True) == f
    with pytest.raises(UserError, match="does not exist"):
        ensure_writable(tmp_path / "no" / "dir" / "x.png")
    with pytest.raises(UserError, match="is a directory"):
        ensure_writable(tmp_path)


def test_atomic_write_never_leaves_half_files(tmp_path):
    target = tmp_path / "result.csv"
    with pytest.raises(RuntimeError):
        with atomic_open(target, "w") as fh:
            fh.write("half a")
            raise RuntimeError("crash mid-write")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == [], "the temporary file is cleaned up"
    with atomic_open(target, "w") as fh:
        fh.write("done")
    assert target.read_text() == "done"
    target.write_text("original")
    with pytest.raises(UserError):
        with atomic_path(target):
            pass
    assert target.read_text() == "original"
    with atomic_open(target, "w", force=True) as fh:
        fh.write("replaced")
    assert target.read_text() == "replaced"


def test_read_json_side_files(tmp_path):
    from gencli.io import read_json

    f = tmp_path / "config.json"
    f.write_text('{"a": 1}')
    assert read_json(f) == {"a": 1}
    assert read_json(tmp_path / "absent.json", missing_ok=True) is None
    with pytest.raises(UserError, match="absent.json' does not exist"):
        read_json(tmp_path / "absent.json")
    f.write_text('{"a": ')
    with pytest.raises(UserError, match="config.json' is not valid JSON: .* at line 1"):
        read_json(f)
    f.write_text("[1, 2]")
    with pytest.raises(UserError, match="must hold a JSON object"):
        read_json(f)
    assert read_json(f, expect=list) == [1, 2]
    f.write_bytes(b"\xff\xfe{")
    with pytest.raises(UserError, match="config.json"):
        read_json(f)


def test_devices_and_pipes_are_written_in_place(tmp_path):
    """`--out /dev/null` (or a FIFO) needs no --force and is never replaced by a rename."""
    assert ensure_writable("/dev/null") == Path("/dev/null")
    with atomic_open("/dev/null", "w") as fh:
        fh.write("discarded")
    import stat

    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    import threading

    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    with atomic_open(fifo, "w") as fh:
        fh.write("through the pipe")
    reader.join(10)
    assert got == ["through the pipe"]
    assert list(tmp_path.iterdir()) == [fifo], "no temporary file next to a pipe"


def test_expand_inputs(tmp_path, monkeypatch):
    (tmp_path / "a.png").write_bytes(b"x")
    (tmp_path / "b.txt").write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.PNG").write_bytes(b"x")
    assert expand_inputs([str(tmp_path)], extensions=[".png"]) == [str(tmp_path / "a.png")]
    assert expand_inputs([str(tmp_path)], recursive=True, extensions=[".png"]) == [str(tmp_path / "a.png"), str(tmp_path / "sub" / "c.PNG")]
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("x.png\n\n  y.png \n"))
    assert expand_inputs(["first.png", "-"]) == ["first.png", "x.png", "y.png"]
    with pytest.raises(UserError, match="no inputs"):
        expand_inputs([])


def test_an_empty_directory_is_named(tmp_path):
    (tmp_path / "photos" / "sub").mkdir(parents=True)
    with pytest.raises(UserError, match=r"no input files \(\.png\) in directory '.*photos' \(-r searches its subdirectories\)"):
        expand_inputs([str(tmp_path / "photos")], extensions=[".png"])


def _invoke(*args, input=None):
    from gencli.cli import app

    return CliRunner().invoke(app, [*map(str, args)], input=input)


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "-m", "tft-forecast", "x"], "TemporalFusionTransformer (a forecasting model), not a text-generation model: run it with gencli forecast"),
        (["generate", "-m", "vit-shapes", "x"], "ViTForImageClassification (an image classifier), not a text-generation model: run it with gencli classify"),
        (["classify", "-m", "llama-pystdlib", "x.png"], "a LlamaForCausalLM (a text-generation model), not an image classifier: run it with gencli generate"),
        (["zeroshot", "-m", "vit-shapes", "x.png", "-l", "a,b"], "not an image-text model: run it with gencli classify"),
        (["forecast", "-m", "clip-shapes", "x.csv"], "(an image-text model), not a forecasting model: run it with gencli zeroshot or gencli similarity"),
        (["sample", "gan", "-m", "autoencoder-shapes"], "holds an AutoencoderKL (a latent-diffusion VAE), not a DCGAN: run it with gencli reconstruct"),
        (["txt2img", "-m", "tft-forecast", "a"], "holds a TemporalFusionTransformer (a forecasting model), not a Stable Diffusion pipeline"),
    ],
)
def test_a_model_of_another_family_is_named_with_its_command(tmp_path, monkeypatch, args, message):
    (tmp_path / "x.png").write_bytes(b"")
    (tmp_path / "x.csv").write_text("y\n1\n2\n")
    monkeypatch.chdir(tmp_path)
    r = _invoke(*args)
    assert r.exit_code == 2 and message in r.stderr, r.stderr


def test_one_shard_of_a_sharded_checkpoint_says_so(tmp_path):
    weight_map = {}
    for i, name in enumerate(("a", "b")):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({name: torch.zeros(2)}, str(tmp_path / shard))
        weight_map[name] = shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    r = _invoke("generate", "-m", tmp_path / "model-00001-of-00002.safetensors", "x")
    assert r.exit_code == 2 and "is one shard of a sharded checkpoint (model.safetensors.index.json lists it): pass its folder" in r.stderr, r.stderr


def test_generate_refuses_an_empty_stop_and_reports_blank_prompt_lines(tmp_path):
    r = _invoke("generate", "x", "--stop", "")
    assert r.exit_code == 2 and "--stop takes a non-empty string" in r.stderr
    prompts = tmp_path / "p.txt"
    prompts.write_text("import os\n\nimport sys\n   \n")
    r = _invoke("generate", "--prompts-file", prompts, "-n", "1", "--temperature", "0", "--threads", "1")
    assert r.exit_code == 0, r.stderr
    assert "warning: --prompts-file: skipped 2 blank line(s) (line 2, 4); 2 prompt(s) left" in r.stderr


def test_json_lines_write_nan_and_infinite_floats_as_null():
    """A model's NaN score must not make a --json line invalid JSON (json.loads would accept NaN;
    strict parsers do not)."""
    import json

    from gencli.console import json_line

    line = json_line({"score": float("nan"), "top": [{"p": float("inf")}, {"p": -float("inf")}, {"p": 0.5}], "ids": (1, 2), "t": "é"})
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard {c}")) == {
        "score": None, "top": [{"p": None}, {"p": None}, {"p": 0.5}], "ids": [1, 2], "t": "é"
    }  # fmt: skip
    assert line.endswith("\n") and "é" in line
