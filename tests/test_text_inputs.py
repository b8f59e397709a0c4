"""Text that is not UTF-8 (a file, stdin, an argument) and bad lines of a prompts file: one error line
naming where it came from, exit 2 — never an internal error."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gencli.errors import UserError
from gencli.io import check_text, decode_text, read_lines
from tests.conftest import one_error_line

LATIN1 = "café\n".encode("latin-1")  # 0xe9 at offset 3: not UTF-8
ARG = "caf\udce9"  # what Python makes of the same bytes in sys.argv


def _invoke(*args, input=None):
    from gencli.cli import app

    return CliRunner().invoke(app, [*map(str, args)], input=input)


def test_decode_text_names_the_first_bad_byte_and_drops_a_byte_order_mark():
    assert decode_text("\ufeffé\n".encode("utf-8"), "x") == "é\n"
    with pytest.raises(UserError, match=r"^stdin is not UTF-8 text \(byte 0xe9 at offset 3\)$"):
        decode_text(LATIN1, "stdin")
    with pytest.raises(UserError, match=r"^the prompt is not UTF-8 text \(at character 4\)$"):
        check_text(ARG, "the prompt")
    assert check_text("café ☃", "x") == "café ☃"


def test_read_lines_errors_name_the_option(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(LATIN1)
    with pytest.raises(UserError, match=r"--texts-file '.*bad.txt' is not UTF-8 text"):
        read_lines(str(bad), what="--texts-file")
    with pytest.raises(UserError, match="it is a directory"):
        read_lines(str(tmp_path), what="--texts-file")
    with pytest.raises(UserError, match="it does not exist"):
        read_lines(str(tmp_path / "none.txt"), what="--texts-file")


@pytest.mark.parametrize("command", ["embed", "fill-mask", "classify-text", "ner"])
def test_encoder_texts_file_not_utf8(tmp_path, command):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(LATIN1)
    one_error_line(_invoke(command, "--texts-file", bad), "--texts-file", "is not UTF-8 text (byte 0xe9 at offset 3)")
    one_error_line(_invoke(command, "--texts-file", tmp_path), "--texts-file", "is a directory")


@pytest.mark.parametrize(
    "args",
    [
        ["embed", "-"],
        ["ner", "-"],
        ["classify-text", "-"],
        ["fill-mask", "--texts-file", "-"],
        ["text2text", "-"],
        ["generate", "-", "-n", "2"],
        ["qa", "-", "--context", "a red star"],
        ["qa", "what?", "--context-file", "-"],
        ["txt2img", "-", "--steps", "1"],
        ["generate", "--prompts-file", "-", "-n", "2"],
    ],
    ids=lambda a: " ".join(a),
)
def test_stdin_not_utf8(args):
    one_error_line(_invoke(*args, input=LATIN1), "stdin is not UTF-8 text (byte 0xe9 at offset 3)")


def test_zeroshot_and_similarity_stdin_not_utf8(tmp_path):
    from PIL import Image

    Image.new("RGB", (32, 32), "red").save(tmp_path / "x.png")
    one_error_line(_invoke("zeroshot", tmp_path / "x.png", "--labels-file", "-", input=LATIN1), "stdin is not UTF-8 text")
    one_error_line(_invoke("similarity", tmp_path / "x.png", "--texts-file", "-", input=LATIN1), "stdin is not UTF-8 text")
    one_error_line(_invoke("zeroshot", tmp_path / "x.png", "--labels", f"{ARG},dog"), "--labels is not UTF-8 text")
    one_error_line(_invoke("similarity", tmp_path / "x.png", "--texts", ARG), "--texts is not UTF-8 text")


@pytest.mark.parametrize(
    "args, name",
    [
        (["generate", ARG, "-n", "2"], "the prompt"),
        (["text2text", "fine", ARG], "text 2"),
        (["embed", ARG], "text 1"),
        (["qa", "what?", "--context", ARG], "--context"),
        (["txt2img", ARG, "--steps", "1"], "the prompt"),
        (["txt2img", "a star", "--negative-prompt", ARG, "--steps", "1"], "--negative-prompt"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else a,
)
def test_arguments_not_utf8(args, name):
    one_error_line(_invoke(*args), f"{name} is not UTF-8 text (at character 4)")


def test_qa_context_file_not_utf8_and_utf8_with_byte_order_mark(tmp_path):
    bad = tmp_path / "context.txt"
    bad.write_bytes(LATIN1)
    one_error_line(_invoke("qa", "what?", "--context-file", bad), "--context-file", "is not UTF-8 text")
    good = tmp_path / "good.txt"
    good.write_bytes("\ufeffa red star on a blue background".encode("utf-8"))
    r = _invoke("qa", "what is red?", "--context-file", good, "--json")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a"}', '{"prompt": "b", "steps": 0}'], "line 2: --steps must be at least 1 (got 0)"),
        (['{"prompt": "a", "strength": 0.5}'], "line 1: 'strength' is not a setting of txt2img"),
        (['{"prompt": "a", "seed": -1}'], 'line 1: "seed" must be an integer'),
        (['{"prompt": "a", "width": "x"}'], "line 1: --width must be a number (got 'x')"),
        (["# a comment", '{"prompt": "a", "n": 0}'], "line 2: -n must be at least 1 (got 0)"),
        (['{"prompt": "a", "n": "3"}'], "line 1: -n must be a whole number (got '3')"),
        (['{"prompt": "a", "sampler": "nope"}'], "line 1: unknown sampler 'nope'"),
        (['{"prompt": "a", "negative_prompt": 5}'], 'line 1: "negative_prompt" must be a string (got 5)'),
        (['{"prompt": "a\\ud800"}'], 'line 1: "prompt" is not UTF-8 text'),
        (['{"prompt": "a", "seeds": "3-1"}'], "line 1:"),
    ],
)
def test_prompts_file_errors_name_the_file_and_line(tmp_path, lines, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    r = _invoke("txt2img", "--prompts-file", prompts, "-o", tmp_path / "img-{i}.png", "--steps", "1")
    one_error_line(r, "prompts.jsonl' " + message)
    assert not list(tmp_path.glob("*.png"))
