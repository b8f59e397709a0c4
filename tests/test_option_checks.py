"""Option checks of `quantize`, `generate` and `text2text`, and unreadable images: bad input is one
`error:` line naming the option and the value, exit code 2, before any model loads (a model that
does not exist proves it: its error would come first otherwise), and never silently a default."""

from __future__ import annotations

import json

import pytest
from conftest import one_error_line, write_scene_folder
from typer.testing import CliRunner

from gencli.cli import app
from gencli.errors import Reported, UserError

MISSING = "/nonexistent/model"  # a model the checks must not get to


def invoke(*args: object, input: str | None = None):
    return CliRunner().invoke(app, [*map(str, args)], input=input)


# -- quantize / generate --group-size ------------------------------------------------------------
@pytest.mark.parametrize("size", ["0", "-1", "-32", "48", "512"])
def test_quantize_refuses_an_int4_group_size_the_kernels_do_not_take(tmp_path, size):
    out = tmp_path / "q"
    line = one_error_line(invoke("quantize", "llama-pystdlib", out, "--mode", "int4", "--group-size", size), "--group-size", f"got {size}")
    assert "32, 64, 128, 256" in line
    assert not out.exists()


def test_group_size_is_checked_before_anything_is_read(tmp_path):
    one_error_line(invoke("quantize", MISSING, tmp_path / "q", "--mode", "int4", "--group-size", "0"), "--group-size", "got 0")
    one_error_line(invoke("quantize", MISSING, tmp_path / "q", "--group-size", "32"), "--group-size applies to --mode int4 only", "int8")
    one_error_line(invoke("generate", "x", "-m", MISSING, "--quantize", "int4", "--group-size", "0"), "--group-size", "got 0")
    one_error_line(invoke("generate", "x", "-m", MISSING, "--quantize", "int8", "--group-size", "64"), "--group-size applies to --quantize int4 only")
    one_error_line(invoke("generate", "x", "-m", MISSING, "--group-size", "0"), "--group-size applies to --quantize int4 only")


def test_the_default_group_size_only_when_none_is_given():
    from gencli.backend.quantize import DEFAULT_GROUP_SIZE, QuantizationSpec

    assert QuantizationSpec.for_mode("int4").group_size == DEFAULT_GROUP_SIZE
    assert QuantizationSpec.for_mode("int4", 64).group_size == 64
    with pytest.raises(ValueError, match="got 0"):
        QuantizationSpec.for_mode("int4", 0)


# -- generate / text2text decoding flags ---------------------------------------------------------
GENERATE_BAD = [
    ("--temperature", "inf"),
    ("--temperature", "nan"),
    ("--temperature", "-1"),
    ("--temperature", "1e-300"),  # 0 in fp32: a division by zero, not greedy decoding
    ("--temperature", "1e300"),
    ("--top-p", "nan"),
    ("--top-p", "inf"),
    ("--top-p", "0"),
    ("--min-p", "nan"),
    ("--min-p", "-inf"),
    ("--min-p", "1.5"),
    ("--repetition-penalty", "inf"),
    ("--repetition-penalty", "nan"),
    ("--repetition-penalty", "0"),
    ("--repetition-penalty", "1e-300"),
    ("--top-k", "-1"),
    ("--max-new-tokens", "0"),
]


@pytest.mark.parametrize("flag, value", GENERATE_BAD)
def test_generate_refuses_non_finite_and_out_of_range_numbers(flag, value):
    line = one_error_line(invoke("generate", "x", "-m", MISSING, flag, value), flag)
    assert line.endswith(f"got {float(value)!r}") or line.endswith(f"got {value}"), line


TEXT2TEXT_BAD = [
    *[(flag, value) for flag, value in GENERATE_BAD if flag != "--min-p"],  # (text2text has no --min-p)
    ("--length-penalty", "nan"),
    ("--length-penalty", "inf"),
    ("--length-penalty", "-inf"),
    ("--length-penalty", "1e300"),  # length ** 1e300 overflows: was an internal error
    ("--length-penalty", "-11"),
    ("--min-new-tokens", "-1"),
    ("--num-beams", "0"),
    ("--num-return-sequences", "0"),
    ("--no-repeat-ngram-size", "-1"),
]


@pytest.mark.parametrize("command", ["text2text", "translate"])
@pytest.mark.parametrize("flag, value", TEXT2TEXT_BAD)
def test_text2text_refuses_non_finite_and_out_of_range_numbers(command, flag, value):
    line = one_error_line(invoke(command, "x", "-m", MISSING, flag, value), flag)
    assert line.endswith(f"got {float(value)!r}") or line.endswith(f"got {value}"), line


def test_min_new_tokens_above_max_new_tokens_is_refused():
    one_error_line(invoke("text2text", "x", "-m", MISSING, "--min-new-tokens", "50", "-n", "10"), "--min-new-tokens (50)", "--max-new-tokens (10)")
    # against the generation config's budget (the checkpoint's own: known once it is read)
    from gencli.pipelines.seq2seq.generate import resolve_settings

    with pytest.raises(UserError, match=r"--min-new-tokens \(50\) is more than the generation config's budget of new tokens \(20\)"):
        resolve_settings({"max_new_tokens": 20}, min_new_tokens=50)
    with pytest.raises(UserError, match=r"the default budget of new tokens \(256\)"):
        resolve_settings({}, min_new_tokens=300)
    settings = resolve_settings({"max_new_tokens": 20}, min_new_tokens=20)  # equal: fine
    assert (settings.min_new_tokens, settings.max_new_tokens) == (20, 20)


def test_the_edges_of_the_ranges_still_pass():
    from gencli.pipelines.seq2seq.generate import resolve_settings as resolve_seq2seq
    from gencli.pipelines.text.flags import check_decoding_flags
    from gencli.pipelines.text.generate import resolve_settings

    check_decoding_flags(temperature=1e-6, top_p=1.0, min_p=0.0, repetition_penalty=1e6, top_k=0, length_penalty=-10.0, min_new_tokens=0)
    check_decoding_flags(temperature=1e6, top_p=1e-9, min_p=1.0, repetition_penalty=1e-6, length_penalty=10.0, min_new_tokens=5, max_new_tokens=5)
    assert resolve_settings({"do_sample": True, "temperature": 0.7}, temperature=0.0).sampling.greedy  # 0 = greedy, kept
    assert resolve_seq2seq({}, num_beams=2, length_penalty=-2.0).length_penalty == -2.0  # < 0 favours shorter outputs


def test_decoding_flags_are_checked_in_one_place():
    from gencli.pipelines.text.flags import RANGES, check_decoding_flags

    with pytest.raises(TypeError, match="not a decoding flag"):
        check_decoding_flags(temprature=1.0)  # a typo is a bug of the caller, not a user's bad value
    import gencli.cli.text2text as t2t

    assert set(t2t._SETTING_NAMES) - {"early_stopping"} <= set(RANGES)  # every number text2text takes has a range


def test_valid_settings_still_run():
    r = invoke("text2text", "parse: a small red star", "-n", "4", "--min-new-tokens", "4", "--num-beams", "2", "--length-penalty", "-1.5")
    assert r.exit_code == 0 and r.stdout.strip(), r.stderr
    r = invoke("generate", "import os", "-n", "3", "--temperature", "0", "--ignore-eos")
    assert r.exit_code == 0 and r.stdout.strip(), r.stderr


# -- unreadable images -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = write_scene_folder(tmp_path_factory.mktemp("images"), [48])
    (root / "bad.png").write_text("not an image")
    whole = (root / "img0.png").read_bytes()
    (root / "truncated.png").write_bytes(whole[: len(whole) // 2])
    return root


IMAGE_COMMANDS = [
    ("classify", "{}"),
    ("zeroshot", "{} -l circle,star"),
    ("similarity", "-i {} --text circle"),
    ("segment", "{}"),
    ("embed", "--images {}"),
    ("embed", "--images {} -o e.npy"),
    ("img2img", "{} x --steps 1"),
]


@pytest.mark.parametrize("name", ["bad.png", "truncated.png"])
@pytest.mark.parametrize("command, args", IMAGE_COMMANDS, ids=[f"{c} {a.replace('{}', '').strip()}" for c, a in IMAGE_COMMANDS])
def test_a_single_unreadable_image_is_one_error_line(images, tmp_path, monkeypatch, command, args, name):
    monkeypatch.chdir(tmp_path)
    path = images / name
    line = one_error_line(invoke(command, *args.format(path).split()), name)
    assert "could not be read" not in line  # the file's own line, not a count of one
    assert not (tmp_path / "e.npy").exists()


def test_zeroshot_labels_repeat_and_add_up(images):
    r = invoke("zeroshot", images / "img0.png", "-l", "circle", "-l", "star,square", "--json")
    assert r.exit_code == 0, r.output
    assert sorted(p["label"] for p in json.loads(r.stdout)["predictions"]) == ["circle", "square", "star"]
    one_error_line(invoke("zeroshot", images / "img0.png", "-l", "circle", "-l", "circle"), "label 'circle' is given twice")


@pytest.mark.parametrize("fmt", [[], ["--json"]])
def test_several_inputs_keep_a_line_per_file_then_the_count(images, fmt):
    r = invoke("classify", images / "img0.png", images / "bad.png", images / "truncated.png", "-k", "1", *fmt)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["error"] * 3, r.stderr
    assert "bad.png': not an image file PIL can read" in lines[0] and "truncated.png': cannot decode the image" in lines[1]
    assert lines[2] == f"error: 2 of 3 input(s) could not be read (first: '{images / 'bad.png'}')"
    assert "img0.png" in r.stdout
    one = invoke("classify", images / "img0.png", images / "bad.png", "-k", "1")
    assert one.exit_code == 2 and one.stderr.strip().splitlines()[-1] == "error: 1 of 2 input(s) could not be read"


def test_the_count_is_reported_already_for_a_single_input():
    from gencli.pipelines.vision.images import unreadable_inputs_error

    single = unreadable_inputs_error(["a.png"], 1)
    assert isinstance(single, Reported) and str(single) == "1 of 1 input(s) could not be read"
    assert not isinstance(unreadable_inputs_error(["a.png"], 2), Reported)


# -- found by a probe of every command: each was exit 1, a machine out of memory, or silently something else
@pytest.mark.parametrize("command", ["fill-mask", "ner", "classify-text", "embed"])
@pytest.mark.parametrize("size", ["0", "-1"])
def test_text_encoder_batch_size_below_one_is_one_line(command, size):
    one_error_line(invoke(command, "a [MASK] b", "-m", MISSING, "-b", size), "--batch-size", f"must be at least 1 (got {size})")


@pytest.mark.parametrize("value", ["inf", "1e30", "nan", "0", "-1"])
def test_vae_sample_temperature_is_finite_and_bounded(tmp_path, value):
    one_error_line(invoke("sample", "vae", "--temperature", value, "-n", "1", "-o", tmp_path / "a.png"), "--temperature must be above 0 and at most 100")
    assert not (tmp_path / "a.png").exists()


@pytest.mark.parametrize("args", [["sample", "gan"], ["txt2img", "a", "--steps", "1"]], ids=["sample", "txt2img"])
def test_seed_and_seeds_together_are_refused_not_one_ignored(tmp_path, args):
    one_error_line(invoke(*args, "--seeds", "1", "--seed", "5", "-o", tmp_path / "x.png"), "give --seed", "or --seeds", "not both")


def test_latents_too_large_to_decode_are_refused_before_they_are_read(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"latent_format_version_0": torch.zeros(0), "latent_tensor": torch.zeros(1, 4, 2048, 8)}, str(tmp_path / "tall.safetensors"))
    r = invoke("decode", tmp_path / "tall.safetensors", "--no-tile", "-o", tmp_path / "x.png")
    one_error_line(r, "2048x8 (height x width)", "more than 4096 a side untiled")
    save_file({"latent_format_version_0": torch.zeros(0), "latent_tensor": torch.zeros(1, 4, 8192, 8)}, str(tmp_path / "huge.safetensors"))
    one_error_line(invoke("decode", tmp_path / "huge.safetensors", "-o", tmp_path / "x.png"), "8192x8 (height x width)", "more than 16384 a side")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("name", ["../outside", "sub/../../outside", "/abs/outside"])
def test_a_lora_tag_names_no_file_outside_lora_dir(tmp_path, name):
    from gencli.pipelines.diffusion.lora import find_lora

    (tmp_path / "loras").mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match="not a path out of it"):
        find_lora(name if not name.startswith("/") else str(tmp_path / "outside"), tmp_path / "loras")


def test_a_folder_write_the_file_system_refuses_is_one_line(tmp_path, monkeypatch):
    import errno
    import tempfile

    from gencli.io import CannotWrite, atomic_folder, atomic_path

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(CannotWrite, match="cannot write '.*q': Read-only file system"):
        with atomic_folder(tmp_path / "q", wrote=lambda folder: None):
            pass
    with pytest.raises(CannotWrite, match="cannot write '.*f.txt': Read-only file system"):
        with atomic_path(tmp_path / "f.txt"):
            pass


@pytest.mark.parametrize("pattern, needle", [("{stem}-{foo}.png", "unknown placeholder {foo}"), ("{index:q}.png", "Unknown format code 'q'")])
def test_segment_output_patterns_fill_known_placeholders_only(images, tmp_path, monkeypatch, pattern, needle):
    monkeypatch.chdir(tmp_path)
    one_error_line(invoke("segment", images / "img0.png", "-o", pattern), f"--out '{pattern}'", needle)
    one_error_line(invoke("segment", images / "img0.png", "--overlay", pattern), f"--overlay '{pattern}'", needle)
    assert not list(tmp_path.glob("*.png"))
    r = invoke("segment", images / "img0.png", "-o", "{stem}-{index:03d}.png", "--json")
    assert r.exit_code == 0 and (tmp_path / "img0-000.png").is_file(), r.output


@pytest.mark.parametrize(
    "args, needle",
    [
        (["sample", "gan", "--interpolate", "3", "-n", "7"], "-n does not apply"),
        (["sample", "gan", "-n", "2", "--nrow", "2", "--out-dir", "od"], "--nrow lays out a grid: --out-dir"),
        (["sample", "gan", "--interpolate", "3", "--gif", "--nrow", "2", "-o", "x.gif"], "--nrow lays out a grid: --gif"),
        (["embed", "a red star", "-k", "3"], "--top-k needs --images"),
        (["embed", "a red star", "-r"], "--recursive needs --images"),
        (["translate", "-m", MISSING, "--source", "", "--target", "German", "x"], "--source is empty"),
        (["translate", "-m", MISSING, "--source", "English", "--target", " ", "x"], "--target is empty"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_options_that_would_do_nothing_are_refused(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    one_error_line(invoke(*args), needle)
    assert not list(tmp_path.iterdir())


def test_embed_images_top_k_needs_query(images):
    one_error_line(invoke("embed", "--images", images / "img0.png", "-k", "3"), "--top-k is the number of neighbours --query lists")


def test_guidance_at_most_one_says_negative_prompt_and_rescale_do_nothing(tmp_path):
    r = invoke("txt2img", "a red star", "--steps", "1", "--guidance", "1", "--negative-prompt", "blue", "--guidance-rescale", "0.5", "-o", tmp_path / "a.png")
    assert r.exit_code == 0, r.output
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert any("a negative prompt has no effect at guidance 1" in w for w in warned), r.stderr
    assert any("--guidance-rescale has no effect at guidance 1" in w for w in warned), r.stderr
    r = invoke("txt2img", "a red star", "--steps", "1", "--guidance", "5", "--negative-prompt", "blue", "-o", tmp_path / "b.png")
    assert r.exit_code == 0 and "no effect" not in r.stderr, r.stderr


def test_replay_names_the_a1111_settings_it_does_not_apply(tmp_path):
    from PIL import Image, PngImagePlugin

    extra = ", Hires upscale: 2, Eta: 0.7, ENSD: 31337, Eta DDIM: 0.3"
    for sampler, named in [("euler_a", "Hires upscale: 2, Eta: 0.7, ENSD: 31337"), ("euler", "Hires upscale: 2"), ("ddim", "Hires upscale: 2, Eta DDIM: 0.3")]:
        # Eta and ENSD act on samplers that draw noise as they sample, Eta DDIM on DDIM alone
        assert invoke("txt2img", "a red star", "--steps", "1", "--seed", "1", "--sampler", sampler, "-o", tmp_path / f"{sampler}.png").exit_code == 0
        im = Image.open(tmp_path / f"{sampler}.png")
        info = PngImagePlugin.PngInfo()
        info.add_text("parameters", im.text["parameters"] + extra)
        im.save(tmp_path / f"{sampler}-more.png", pnginfo=info)
        r = invoke("replay", tmp_path / f"{sampler}-more.png", "-o", tmp_path / f"{sampler}-again.png")
        assert r.exit_code == 0, r.output
        assert f"does not apply ({named}):" in r.stderr, (sampler, r.stderr)
    r = invoke("replay", tmp_path / "euler.png", "-o", tmp_path / "plain.png")
    assert r.exit_code == 0 and "does not apply" not in r.stderr


def test_a_library_warning_is_one_warning_line_with_its_category(tmp_path):
    from PIL import Image

    Image.new("RGB", (9500, 9500)).save(tmp_path / "big.png")  # over PIL's decompression-bomb warning limit
    r = invoke("classify", tmp_path / "big.png", "-k", "1")
    assert r.exit_code == 0, r.output
    warned = [line for line in r.stderr.splitlines() if "DecompressionBombWarning" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: Image size"), r.stderr
    assert "warnings.warn" not in r.stderr and ".py:" not in r.stderr


def test_messages_say_what_is_wrong(images, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exist.txt").write_text("x")
    one_error_line(invoke("info", "llama-pystdlib", "-o", "exist.txt/x.txt"), "output directory 'exist.txt' is a file, not a directory")
    one_error_line(invoke("info", "llama-pystdlib", "-o", ""), "the output name is empty")
    one_error_line(invoke("encode", images / "img0.png", "-o", "-", "--json"), "-o - writes the latent file (binary)")
    one_error_line(invoke("img2img", images, "a", "-o", "x.png"), "is a directory, not an image file")
    assert invoke("sample", "gan", "-n", "1", "-o", "g.png").exit_code == 0
    one_error_line(invoke("replay", "g.png"), "has no 'parameters' text to replay")


def test_more_options_that_would_do_nothing_are_refused(images, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    img = images / "img0.png"
    one_error_line(invoke("segment", img, "--alpha", "0.3"), "--alpha is the opacity of the --overlay image")
    one_error_line(invoke("reconstruct", img, "--out-dir", "rec", "--tile"), "--tile/--no-tile applies to AutoencoderKL models", "ConvVAE")
    one_error_line(invoke("info", "llama-pystdlib", "--all", "--limit", "3"), "--all lists every tensor and --limit some")
    one_error_line(invoke("similarity", "-i", img, "--text", "", "--text", "a star"), "--texts 1 is empty")
    one_error_line(invoke("text2text", "a red star", "--length-penalty", "2"), "--length-penalty applies to beam search", "--num-beams 2")
    one_error_line(invoke("text2text", "a red star", "--early-stopping"), "--early-stopping applies to beam search")
    assert not list(tmp_path.iterdir())
    r = invoke("segment", img, "--overlay", "o.png", "--alpha", "0.3", "--json")
    assert r.exit_code == 0 and (tmp_path / "o.png").is_file(), r.output
    r = invoke("text2text", "a red star", "--num-beams", "2", "--length-penalty", "2", "-n", "4", "--json")
    assert r.exit_code == 0, r.output


def test_review_findings(images, tmp_path, monkeypatch):
    """Found by reading the change: each was exit 1, a wrong refusal or a misleading line."""
    monkeypatch.chdir(tmp_path)
    big = "9" * 400  # an integer click accepts and math.isfinite cannot take
    one_error_line(invoke("generate", "x", "-m", MISSING, "--top-k", big), "does not exist")  # checked without an OverflowError (exit 1)
    one_error_line(invoke("segment", images / "img0.png", "-o", "{stem.x}.png"), "--out '{stem.x}.png'")
    import shutil

    for name in ("a.png", "b.png"):
        shutil.copy(images / "img0.png", tmp_path / name)
    r = invoke("segment", "a.png", "b.png", "-o", "m-{index:03d}.png", "--json")
    assert r.exit_code == 0 and (tmp_path / "m-001.png").is_file(), r.output
    bad = "caf\udce9"
    one_error_line(invoke("generate", "x", "-m", MISSING, "--stop", bad), "--stop is not UTF-8 text")
    one_error_line(invoke("generate", "x", "-m", MISSING, "--chat", "--system", bad), "--system is not UTF-8 text")
    one_error_line(invoke("translate", "-m", MISSING, "--source", bad, "--target", "German", "x"), "--source is not UTF-8 text")
    one_error_line(invoke("zeroshot", images / "img0.png", "-l", "a,b", "--template", f"{bad} {{}}"), "--template is not UTF-8 text")
    one_error_line(invoke("sample", "ddpm", "-n", "2", "--nrow", "2", "--out-dir", "od"), "--nrow lays out a grid: --out-dir")
    one_error_line(invoke("sample", "ddpm", "--seed", "1", "-n", "1", "--nrow", "2"), "--nrow lays out a grid: one seed")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a star\n")
    line = one_error_line(invoke("txt2img", "--prompts-file", prompts, "--seed", "4294967295", "-n", "2", "--steps", "1"), "--seed 4294967295 with -n 2")
    assert "line 1" not in line  # the command's own flags, not the file's line
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["a.png", "b.png", "m-000.png", "m-001.png"]


def test_every_name_of_stdout_is_one_with_json(images):
    from gencli.io import names_stdout

    assert all(names_stdout(n) for n in ("-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"))
    assert not any(names_stdout(n) for n in (None, "/dev/fd/2", "/dev/stderr", "out.png", "-x"))
    for args in (["embed", "a", "-o", "/dev/fd/1"], ["encode", images / "img0.png", "-o", "/dev/fd/1"], ["segment", images / "img0.png", "-o", "/dev/fd/1"]):
        one_error_line(invoke(*args, "--json"), "--json")
