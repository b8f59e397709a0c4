"""The text commands (`generate`, `text2text`, `translate`) on inputs a demanding user gives them: a
checkpoint's generation config with values of the wrong type or out of range (one error line naming
the file, never an internal error or a silently odd decoding), pad ids outside the vocabulary, and
stdin named twice."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import one_error_line
from typer.testing import CliRunner

from gencli.cli import app

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def invoke(*args: object, input: str | None = None):
    return CliRunner().invoke(app, [*map(str, args)], input=input)


def js(result) -> list[dict]:
    assert result.exit_code == 0, (result.exit_code, result.stderr)
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from _text_fixtures import llama_checkpoint

    folder = tmp_path_factory.mktemp("probe-llama") / "llama"
    llama_checkpoint(folder)
    return folder


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    from _seq2seq_fixtures import t5_checkpoint

    return t5_checkpoint(tmp_path_factory.mktemp("probe-t5") / "t5")


def with_generation_config(folder, tmp_path, config: dict, name: str = "model"):
    copy = tmp_path / name
    shutil.copytree(folder, copy)
    (copy / "generation_config.json").write_text(json.dumps(config), encoding="utf-8")
    return copy


# -- a checkpoint's generation config is checked as the flags are ---------------------------------------
BAD_CAUSAL = [
    ({"do_sample": True, "top_k": "abc"}, "top_k"),  # was an internal error (int('abc'))
    ({"max_new_tokens": "ten"}, "max_new_tokens"),  # was an internal error
    ({"max_new_tokens": -5}, "max_new_tokens"),  # was an internal error: KV cache overflow
    ({"max_new_tokens": 2.7}, "max_new_tokens"),  # was silently 2
    ({"do_sample": True, "temperature": -1}, "temperature"),  # was sampling from the inverted distribution
    ({"do_sample": True, "top_p": 1.5}, "top_p"),
    ({"do_sample": True, "min_p": 2}, "min_p"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"do_sample": "no"}, "do_sample"),  # was sampling: bool("no") is True
    ({"eos_token_id": "x"}, "eos_token_id"),  # was an internal error
]


@pytest.mark.parametrize(("config", "key"), BAD_CAUSAL, ids=[k for _, k in BAD_CAUSAL])
def test_generate_refuses_a_bad_generation_config_value(llama, tmp_path, config, key):
    folder = with_generation_config(llama, tmp_path, config)
    line = one_error_line(invoke("generate", "hello", "-m", folder, "--seed", 1), "generation_config.json", key)
    assert repr(config[key]) in line


def test_generate_refuses_a_bad_token_id_in_config_json(llama, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eos_token_id"] = "</s>"
    (folder / "config.json").write_text(json.dumps(cfg))
    one_error_line(invoke("generate", "hello", "-m", folder, "-n", 2), "config.json", "eos_token_id")


def test_generate_takes_a_good_generation_config(llama, tmp_path):
    good = {"do_sample": True, "temperature": 0.7, "top_p": 0.0, "top_k": 0, "min_p": 0.05, "max_new_tokens": 3, "eos_token_id": [2, 12345]}
    folder = with_generation_config(llama, tmp_path, good)
    (out,) = js(invoke("generate", "hello", "-m", folder, "--seed", 1, "--json"))
    assert out["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize("pad", [-1, 100000])
def test_generate_batches_with_a_pad_id_outside_the_vocabulary(llama, tmp_path, pad):
    """Early Llama conversions carry pad_token_id -1: the padding of a batch of prompts of different
    lengths looked it up in the embedding (an internal error); any id in the vocabulary pads (masked)."""
    folder = with_generation_config(llama, tmp_path, {"pad_token_id": pad})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\nclass Foo(object):\nx\n", encoding="utf-8")
    batched = js(invoke("generate", "--prompts-file", prompts, "-m", folder, "-n", 4, "--temperature", 0, "--ignore-eos", "--json"))
    single = js(invoke("generate", "--prompts-file", prompts, "-m", llama, "-n", 4, "--temperature", 0, "--ignore-eos", "--json", "--batch-size", 1))
    assert [o["token_ids"] for o in batched] == [o["token_ids"] for o in single]


BAD_SEQ2SEQ = [
    ({"num_beams": "4"}, "num_beams"),  # was silently int("4")
    ({"length_penalty": "x"}, "length_penalty"),  # was an internal error
    ({"max_new_tokens": -3}, "max_new_tokens"),  # was silently 1 new token
    ({"no_repeat_ngram_size": -2}, "no_repeat_ngram_size"),
    ({"do_sample": True, "temperature": -2}, "temperature"),
    ({"decoder_start_token_id": -1}, "decoder_start_token_id"),  # was an internal error (embedding index)
    ({"forced_bos_token_id": "a"}, "forced_bos_token_id"),  # was an internal error
    ({"bad_words_ids": [[100000]]}, "bad_words_ids"),  # was an internal error (scores index)
]


@pytest.mark.parametrize(("config", "key"), BAD_SEQ2SEQ, ids=[k for _, k in BAD_SEQ2SEQ])
def test_text2text_refuses_a_bad_generation_config_value(t5, tmp_path, config, key):
    folder = with_generation_config(t5, tmp_path, config)
    one_error_line(invoke("text2text", "-m", folder, "hello", "--seed", 1), "generation_config.json", key)


def test_text2text_pads_with_an_id_inside_the_vocabulary(t5, tmp_path):
    """A pad_token_id past the embedding (the generation config's) was looked up for the padded
    sources and the ended rows: an internal error; config.json's pad id pads instead."""
    cfg = json.loads((t5 / "generation_config.json").read_text())
    folder = with_generation_config(t5, tmp_path, {**cfg, "pad_token_id": 99999})
    args = ("hello", "hello world big", "-n", 4, "--temperature", 0, "--json")
    got = js(invoke("text2text", "-m", folder, *args))
    want = js(invoke("text2text", "-m", t5, *args))
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]


# -- stdin named twice ---------------------------------------------------------------------------------
def test_text2text_reads_stdin_once(t5):
    """`text2text - -` read stdin's lines twice (every input run twice, the blank lines counted twice)."""
    one_error_line(invoke("text2text", "-m", t5, "-", "-", input="hello\n\nworld\n"), "stdin", "once")
    one_error_line(invoke("translate", "-m", t5, "--source", "English", "--target", "German", "-", "-", input="hello\n"), "stdin", "once")


# -- text2text --stream keeps one line per output ------------------------------------------------------
def test_text2text_stream_keeps_one_line_per_output(tmp_path):
    """Plain text2text prints one line per output (a newline in the text becomes a space); --stream
    printed the newline as it came, so an output spanning lines no longer lined up with its input."""
    from _seq2seq_fixtures import bart_checkpoint

    from gencli.tokenizers.seq2seq import load_seq2seq_tokenizer

    folder = bart_checkpoint(tmp_path / "bart")
    newline = load_seq2seq_tokenizer(folder, "bart").encode("a\nb", add_special_tokens=False)[1]
    cfg = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**cfg, "forced_bos_token_id": newline}))  # every output starts with a newline
    args = ("-m", folder, "hello world", "the cat", "-n", 6, "--temperature", 0, "--num-beams", 1)
    plain, streamed, as_json = invoke("text2text", *args), invoke("text2text", *args, "--stream"), js(invoke("text2text", *args, "--json"))
    assert all(o["text"].startswith("\n") for o in as_json)
    assert plain.exit_code == 0 and streamed.exit_code == 0, (plain.stderr, streamed.stderr)
    assert plain.stdout.count("\n") == 2
    assert streamed.stdout == plain.stdout


# -- Marian / BART: the decoder's position table bounds the new tokens ------------------------------------
@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    from _seq2seq_fixtures import marian_checkpoint

    return marian_checkpoint(tmp_path_factory.mktemp("probe-marian") / "marian")


def test_translate_stops_at_the_decoders_positions(marian, tmp_path):
    """-n past a Marian decoder's positions (64 here) was an internal error ("position 64 is past the
    model's 64 positions") once the output got there; it stops there, as generate stops at the context."""
    positions = json.loads((marian / "config.json").read_text())["max_position_embeddings"]
    for n in (positions + 100, 10**20):
        out = js(invoke("translate", "-m", marian, "hello", "the cat", "-n", n, "--min-new-tokens", positions - 4, "--json"))
        assert all(len(o["token_ids"]) == positions for o in out)  # the forced end token on the last step
    # without a forced end token: the outputs end by length there, with one warning
    folder = tmp_path / "no-forced-eos"
    shutil.copytree(marian, folder)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((folder / name).read_text())
        cfg.pop("forced_eos_token_id", None)
        (folder / name).write_text(json.dumps(cfg))
    res = invoke("translate", "-m", folder, "hello", "the cat", "-n", positions + 1, "--min-new-tokens", positions - 1, "--num-beams", 1, "--json")
    out = js(res)
    assert [(len(o["token_ids"]), o["finish_reason"]) for o in out] == [(positions, "length")] * 2
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"{positions} positions" in warnings[0], res.stderr


def test_translate_refuses_a_minimum_past_the_decoders_positions(marian):
    positions = json.loads((marian / "config.json").read_text())["max_position_embeddings"]
    one_error_line(invoke("translate", "-m", marian, "hello", "-n", 1000, "--min-new-tokens", positions + 1), "--min-new-tokens", f"{positions} positions")


# -- generate --quantize int4 says which layers it left in float ------------------------------------------
def test_generate_quantize_int4_warns_about_layers_kept_in_float(tmp_path):
    """A model whose linear inputs no int4 group size divides (48 wide): `gencli quantize` warned that
    it kept them in float, `generate --quantize int4` ran them in float silently."""
    from _text_fixtures import gpt2_bpe_files
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2-48"
    vocab = gpt2_bpe_files(folder)
    cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=48, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(folder, safe_serialization=True)
    res = invoke("generate", "hello", "-m", folder, "--quantize", "int4", "-n", 2, "--temperature", 0)
    assert res.exit_code == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]  # (not the kernels' one-time build line)
    assert len(warnings) == 1 and warnings[0].startswith("warning: 4 linear layers kept in float"), res.stderr
    quantized = invoke("quantize", folder, tmp_path / "q", "--mode", "int4")
    assert quantized.exit_code == 0 and warnings[0] in quantized.stderr, quantized.stderr
    plain = invoke("generate", "hello", "-m", folder, "--quantize", "int8", "-n", 2, "--temperature", 0)
    assert plain.exit_code == 0 and "warning:" not in plain.stderr, plain.stderr


# -- quantize carries the tokenizer and generation files over, not other frameworks' float weights ----------
def test_quantize_leaves_other_frameworks_weights_behind(tmp_path):
    """A Hugging Face repository ships TensorFlow, Flax, rust-bert and ONNX copies of the weights beside
    model.safetensors: they were copied into the quantized folder (several times its size)."""
    from _text_fixtures import gpt2_checkpoint

    source = tmp_path / "gpt2"
    gpt2_checkpoint(source, n_positions=64)
    for name in ("tf_model.h5", "flax_model.msgpack", "rust_model.ot", "model.onnx", "consolidated.pth", "model-q8_0.gguf"):
        (source / name).write_bytes(b"\0" * 4096)
    res = invoke("quantize", source, tmp_path / "q")
    assert res.exit_code == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["config.json", "generation_config.json", "merges.txt", "model.safetensors", "vocab.json"]
    assert js(invoke("generate", "hello", "-m", tmp_path / "q", "-n", 2, "--json"))[0]["usage"]["completion_tokens"] <= 2


# -- info on quantization entries gencli did not write -------------------------------------------------------
@pytest.fixture(scope="module")
def int4_folder(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("probe-int4") / "q"
    res = invoke("quantize", llama, out, "--mode", "int4", "--group-size", 32)
    assert res.exit_code == 0, res.stderr
    return out


def with_quantization_config(folder, tmp_path, entry):
    copy = tmp_path / "q"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "quantization_config": entry}))
    return copy


def quantization_line(result) -> str:
    assert result.exit_code == 0, (result.exit_code, result.stderr)
    return next(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("quantization"))


def test_info_names_another_tools_quantization_as_it_is(int4_folder, tmp_path):
    """A GPTQ entry read "None (gptq), 13 linear layers in groups of 128": no mode, and a count of
    layers by gencli's own layout."""
    folder = with_quantization_config(int4_folder, tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False})
    line = quantization_line(invoke("info", folder))
    assert line == "quantization  gptq, 4 bits, in groups of 128 (not a gencli quantize folder)"
    assert quantization_line(invoke("info", int4_folder)) == "quantization  int4 (gencli), 13 linear layers in groups of 32"


def test_info_shows_a_malformed_group_size_without_crashing(int4_folder, tmp_path):
    """A group size that is not a number was an internal error (str <= int) in info; generate names it."""
    folder = with_quantization_config(int4_folder, tmp_path, {"quant_method": "gencli", "mode": "int4", "bits": 4, "group_size": "a"})
    assert "group size 'a'" in quantization_line(invoke("info", folder))
    one_error_line(invoke("generate", "x", "-m", folder), "config.json")


# -- translate --source/--target are T5's ---------------------------------------------------------------------
def test_translate_refuses_source_and_target_for_a_marian_model(marian, t5):
    """--source/--target put T5's task prefix ("translate English to German: ") before the text: a Marian
    model translated the prefix as part of the input, silently."""
    one_error_line(invoke("translate", "-m", marian, "--source", "English", "--target", "German", "hello"), "--source", "MarianMTModel")
    (out,) = js(invoke("translate", "-m", t5, "--source", "English", "--target", "German", "hello", "-n", 2, "--json"))
    assert out["prompt"] == "translate English to German: hello"
    assert js(invoke("translate", "-m", marian, "hello", "-n", 2, "--json"))[0]["prompt"] == "hello"


def test_text2text_refuses_an_empty_argument_beside_stdin(t5):
    """An empty TEXT argument is an error; beside - it was skipped as "1 blank line" with a warning."""
    one_error_line(invoke("text2text", "-m", t5, "", "-", input="hello\n"), "empty TEXT argument")
    one_error_line(invoke("text2text", "-m", t5, "hello", " "), "empty TEXT argument")
    res = invoke("text2text", "-m", t5, "-", "-n", 2, input="hello\n\nworld\n")
    assert res.exit_code == 0 and len(res.stdout.splitlines()) == 2 and res.stderr.startswith("warning: skipped 1 blank line(s)"), res.stderr


def test_a_prompt_from_stdin_drops_a_windows_line_end(llama):
    (crlf,) = js(invoke("generate", "-", "-m", llama, "-n", 1, "--temperature", 0, "--json", input="import os\r\n"))
    (lf,) = js(invoke("generate", "-", "-m", llama, "-n", 1, "--temperature", 0, "--json", input="import os\n"))
    assert crlf["prompt"] == lf["prompt"] == "import os" and crlf["token_ids"] == lf["token_ids"]


@pytest.mark.parametrize("n", ["100000000", "99999999999999999999"])
def test_text2text_refuses_a_budget_whose_cache_cannot_be_held(t5, n):
    """T5 has no position limit: the decoder's cache for the whole budget is one error line when the
    memory cannot hold it (was an overflow error past int64, or the process killed for memory)."""
    one_error_line(invoke("text2text", "-m", t5, "hello", "-n", n), "new tokens", "GiB", "lower it")
    one_error_line(invoke("text2text", "-m", t5, "hello", "-n", n, "--num-beams", 2), "new tokens", "GiB")


def test_generate_names_the_generation_settings_it_does_not_apply(llama, tmp_path):
    """A causal LM's generation config asking for typical sampling or contrastive search: one warning
    naming them, and the run goes on; its beam search and n-gram ban are applied (no warning)."""
    folder = with_generation_config(llama, tmp_path, {"typical_p": 0.9, "penalty_alpha": 0.6, "epsilon_cutoff": 0.0})
    res = invoke("generate", "hello", "-m", folder, "-n", 2, "--temperature", 0)
    assert res.exit_code == 0, res.output
    warned = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "penalty_alpha=0.6, typical_p=0.9" in warned[0] and "epsilon" not in warned[0], res.stderr
    beams = with_generation_config(llama, tmp_path, {"num_beams": 4, "no_repeat_ngram_size": 3}, name="beams")
    (out,) = js(invoke("generate", "hello", "-m", beams, "-n", 2, "--temperature", 0, "--json"))
    assert "score" in out and out["timing"]["num_beams"] == 4
    plain = with_generation_config(llama, tmp_path, {"num_beams": 1, "do_sample": False}, name="plain")
    res = invoke("generate", "hello", "-m", plain, "-n", 2)
    assert res.exit_code == 0 and "does not apply" not in res.stderr
