"""`gencli generate` end to end on small random checkpoints: streaming, stdin, batches, JSON, stop
strings, EOS, context length, seeds, chat templates, and every bad input the contract names."""

from __future__ import annotations

import json
import shutil

import pytest
from _text_fixtures import three_text_models, write_json
from typer.testing import CliRunner

from gencli.cli import app

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return three_text_models(tmp_path_factory.mktemp("text-cli"))


def gen(*args, input=None):
    result = CliRunner().invoke(app, ["generate", *map(str, args)], input=input)
    return result


def js(result):
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_streams_the_same_text_as_json(models):
    plain = gen("import os", "-m", models / "llama", "-n", 12, "--temperature", 0, "--ignore-eos")
    assert plain.exit_code == 0, plain.stderr
    obj = js(gen("import os", "-m", models / "llama", "-n", 12, "--temperature", 0, "--ignore-eos", "--json"))[0]
    assert plain.stdout == obj["text"] + "\n"
    assert obj["prompt"] == "import os" and obj["finish_reason"] == "length"
    assert obj["usage"]["completion_tokens"] == 12 and obj["usage"]["prompt_tokens"] > 1
    assert len(obj["token_ids"]) == 12
    t = obj["timing"]
    assert t["prefill_tokens_per_s"] > 0 and t["decode_tokens_per_s"] > 0 and "seed" not in obj
    echoed = gen("import os", "-m", models / "llama", "-n", 12, "--temperature", 0, "--ignore-eos", "--echo")
    assert echoed.stdout == "import os" + obj["text"] + "\n"


def test_prompt_from_stdin(models):
    a = js(gen("-", "-m", models / "gpt2", "-n", 5, "--json", "--ignore-eos", input="for i in range(3):\n"))
    b = js(gen("for i in range(3):", "-m", models / "gpt2", "-n", 5, "--json", "--ignore-eos"))
    assert a[0]["prompt"] == "for i in range(3):" and a[0]["token_ids"] == b[0]["token_ids"]


def test_prompts_file_runs_batched_and_matches_single_runs(models, tmp_path):
    prompts = ["import os", "class Point:\n", "x = 1", "def add(a, b):"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(p.strip() for p in prompts) + "\n\n", encoding="utf-8")
    res = gen("--prompts-file", f, "-m", models / "llama", "-n", 8, "--ignore-eos", "--json", "--batch-size", 3)
    assert res.exit_code == 0, res.stderr
    out = js(res)
    assert [o["prompt"] for o in out] == [p.strip() for p in prompts]
    assert [o["timing"]["batch_size"] for o in out] == [3, 3, 3, 1]
    for o in out:
        single = js(gen(o["prompt"], "-m", models / "llama", "-n", 8, "--ignore-eos", "--json"))[0]
        assert single["token_ids"] == o["token_ids"]
    text = gen("--prompts-file", f, "-m", models / "llama", "-n", 8, "--ignore-eos")
    assert text.stdout == "".join(o["text"] + "\n\n" for o in out)


def test_stop_string_is_trimmed(models):
    full = js(gen("import os", "-m", models / "gpt2", "-n", 20, "--ignore-eos", "--json"))[0]
    text = full["text"]
    assert len(text) > 6
    stop = text[3:6]  # a stop string that is really produced, likely across token boundaries
    cut = js(gen("import os", "-m", models / "gpt2", "-n", 20, "--ignore-eos", "--json", "--stop", stop, "--stop", "NEVER-SEEN"))[0]
    assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop"
    streamed = gen("import os", "-m", models / "gpt2", "-n", 20, "--ignore-eos", "--stop", stop)
    assert streamed.stdout == cut["text"] + "\n"


def test_eos_from_generation_config_stops(models, tmp_path):
    folder = tmp_path / "gpt2-eos"
    shutil.copytree(models / "gpt2", folder)
    first = js(gen("import os", "-m", folder, "-n", 5, "--json", "--ignore-eos"))[0]["token_ids"][0]
    write_json(folder / "generation_config.json", {"eos_token_id": [first, 12345]})
    obj = js(gen("import os", "-m", folder, "-n", 5, "--json"))[0]
    assert obj["finish_reason"] == "stop" and obj["token_ids"] == [first] and obj["text"] == ""
    assert js(gen("import os", "-m", folder, "-n", 5, "--json", "--ignore-eos"))[0]["finish_reason"] == "length"


def test_generation_config_defaults_apply_unless_flags_override(models, tmp_path):
    folder = tmp_path / "llama-gc"
    shutil.copytree(models / "llama", folder)
    write_json(folder / "generation_config.json", {"do_sample": True, "temperature": 0.9, "top_p": 0.9, "max_new_tokens": 7, "eos_token_id": 2})
    obj = js(gen("import os", "-m", folder, "--json", "--ignore-eos", "--seed", 3))[0]
    assert len(obj["token_ids"]) == 7 and obj["seed"] == 3
    again = js(gen("import os", "-m", folder, "--json", "--ignore-eos", "--seed", 3))[0]
    assert again["token_ids"] == obj["token_ids"]
    other = [js(gen("import os", "-m", folder, "--json", "--ignore-eos", "--seed", s))[0]["token_ids"] for s in (4, 5)]
    assert any(o != obj["token_ids"] for o in other)
    greedy = js(gen("import os", "-m", folder, "--json", "--ignore-eos", "--temperature", 0, "-n", 3))[0]
    assert "seed" not in greedy and len(greedy["token_ids"]) == 3


def test_context_length(models):
    long = " ".join(["x"] * 200)
    res = gen(long, "-m", models / "gpt2", "-n", 4)
    assert res.exit_code == 2 and "context is 64 tokens" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    near = " ".join(["x"] * 25)  # fits, but not with 50 new tokens
    obj = js(gen(near, "-m", models / "gpt2", "-n", 50, "--json", "--ignore-eos"))[0]
    assert obj["usage"]["prompt_tokens"] + obj["usage"]["completion_tokens"] == 64 and obj["finish_reason"] == "length"
    res = gen(near, "-m", models / "gpt2", "-n", 50, "--ignore-eos")
    assert res.exit_code == 0 and "context length" in res.stderr


def test_chat_template(models):
    obj = js(gen("hello there", "-m", models / "qwen2", "--chat", "--system", "Be brief.", "-n", 4, "--ignore-eos", "--json"))[0]
    from gencli.tokenizers.text import load_tokenizer

    tok = load_tokenizer(models / "qwen2")
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert obj["usage"]["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False))
    res = gen("hello", "-m", models / "llama", "--chat")
    assert res.exit_code == 2 and "no chat template" in res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["", "-n", 3], "empty"),
        (["   ", "-n", 3], "empty"),
        (["hi", "--temperature", "-1"], "--temperature"),
        (["hi", "--top-p", "0"], "--top-p"),
        (["hi", "--top-p", "1.01"], "--top-p"),
        (["hi", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["hi", "--system", "x"], "--system needs --chat"),
        ([], "no prompt"),
        (["hi", "--prompts-file", "p.txt"], "not both"),
        (["--prompts-file", "/nonexistent/prompts.txt"], "does not exist"),
    ],
)
def test_bad_input_exits_2_with_one_line(models, args, message):
    res = gen(*args, "-m", models / "gpt2")
    assert res.exit_code == 2, res.stdout
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_bad_checkpoints_exit_2(models, tmp_path):
    unknown = tmp_path / "unknown"
    shutil.copytree(models / "gpt2", unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"] = ["BertForMaskedLM"]
    cfg["model_type"] = "bert"
    write_json(unknown / "config.json", cfg)
    res = gen("hi", "-m", unknown)
    expected = "holds a BertForMaskedLM (a masked-language model), not a text-generation model: run it with gencli fill-mask"
    assert res.exit_code == 2 and expected in res.stderr, res.stderr

    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(models / "gpt2", no_tok)
    for f in ("vocab.json", "merges.txt"):
        (no_tok / f).unlink()
    res = gen("hi", "-m", no_tok)
    assert res.exit_code == 2 and "no tokenizer in" in res.stderr

    mismatch = tmp_path / "mismatch"
    shutil.copytree(models / "llama", mismatch)
    cfg = json.loads((mismatch / "config.json").read_text())
    cfg["hidden_size"] = 128
    write_json(mismatch / "config.json", cfg)
    res = gen("hi", "-m", mismatch)
    assert res.exit_code == 2 and "shape" in res.stderr and len(res.stderr.strip().splitlines()) == 1

    res = gen("hi", "-m", tmp_path / "nowhere")
    assert res.exit_code == 2
