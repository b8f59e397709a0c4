"""The encoder commands (`qa`, `similarity`, ...) on inputs a demanding user gives them: a short
--max-length without --stride, many answers asked for, texts past CLIP's window."""

from __future__ import annotations

import json

import pytest
from conftest import one_error_line
from typer.testing import CliRunner

from gencli.cli import app

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CAPTION = "a small red star at the top left on a blue background"
QUESTION = "what colour is the star?"


def invoke(*args: object, input: str | None = None):
    return CliRunner().invoke(app, [*map(str, args)], input=input)


def js(result) -> list[dict]:
    assert result.exit_code == 0, (result.exit_code, result.stderr)
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


# -- qa ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_length", [11, 12, 14])
def test_qa_short_window_without_stride_runs(max_length):
    # the default stride (half the window) used to exceed the context tokens the window holds once the
    # question took its share: an error naming a --stride the user never gave
    answers = js(invoke("qa", QUESTION, "--context", CAPTION, "--max-length", max_length, "--json", "-k", 2))
    assert answers and all(CAPTION[a["start"] : a["end"]] == a["answer"] for a in answers)


def test_qa_explicit_stride_too_large_is_still_refused():
    one_error_line(invoke("qa", QUESTION, "--context", CAPTION, "--max-length", 16, "--stride", 20), "--stride 20")


@pytest.mark.parametrize("extra", [(), ("--max-length", 16, "--stride", 3)])
def test_qa_many_answers_are_all_spans(extra):
    # -k past the number of real spans used to list zero-score "answers" whose end comes before their
    # start: empty strings at offsets like (8-7)
    answers = js(invoke("qa", QUESTION, "--context", CAPTION, "-k", 1000, "--json", *extra))
    assert answers
    for a in answers:
        assert a["score"] > 0 and a["start"] < a["end"] and a["answer"].strip(), a
        assert CAPTION[a["start"] : a["end"]] == a["answer"]
    scores = [a["score"] for a in answers]
    assert scores == sorted(scores, reverse=True)


# -- similarity --------------------------------------------------------------------------------------
@pytest.fixture
def red_png(tmp_path):
    from PIL import Image

    path = tmp_path / "red.png"
    Image.new("RGB", (64, 64), (255, 0, 0)).save(path)
    return path


def test_similarity_warns_when_a_text_is_truncated(red_png):
    # a text past CLIP's 77-token window was cut silently (zeroshot and embed say so)
    long_text = " ".join(["red star"] * 100)
    result = invoke("similarity", red_png, "--texts", long_text, "--texts", "a red star", "--json")
    rows = js(result)
    assert [s["text"] for s in rows[0]["similarities"]] == [long_text, "a red star"]
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: text 1 was truncated to the 77-token window"), result.stderr


def test_similarity_short_texts_do_not_warn(red_png):
    result = invoke("similarity", red_png, "--texts", "a red star", "--json")
    js(result)
    assert not result.stderr.strip()


def test_embed_of_texts_with_an_image_classifier_names_embed_images():
    line = one_error_line(invoke("embed", "-m", "vit-shapes", "a red star"), "image classifier", "gencli embed --images")
    assert "gencli classify" in line


def test_classify_text_a_line_ending_in_a_tab_has_an_empty_pair(tmp_path):
    # 'text<TAB>' names a pair that is empty; the shared line stripping took the tab, and the text was
    # classified alone (stdin and --texts-file alike)
    (tmp_path / "t.txt").write_text("a good movie\t\n")
    one_error_line(invoke("classify-text", "--texts-file", tmp_path / "t.txt"), "pair of text 1 is empty")
    one_error_line(invoke("classify-text", "-", input="a good movie\t\n"), "pair of text 1 is empty")
    ok = invoke("classify-text", "-", "--json", input="  a good movie\tgreat  \n")
    assert ok.exit_code == 0, ok.output
    record = json.loads(ok.stdout.splitlines()[0])
    assert (record["text"], record["pair"]) == ("a good movie", "great")  # the spaces around the line still go
