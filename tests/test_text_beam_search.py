"""Beam search, beam sampling, n-gram bans and several completions a prompt in ``gencli generate``:
the same token ids as transformers' ``generate`` on random GPT-2 and Llama checkpoints (one prompt and a
left-padded batch; end tokens met inside the run), and the command's flags."""

from __future__ import annotations

import json

import pytest
import torch
from _text_fixtures import gpt2_checkpoint, llama_checkpoint
from conftest import one_error_line, run_cli

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-beams")
    return {"gpt2": (root / "gpt2", gpt2_checkpoint(root / "gpt2")), "llama": (root / "llama", llama_checkpoint(root / "llama"))}


def _load(folder):
    from gencli.pipelines.text.loading import load_text_model

    return load_text_model(folder, device="cpu", dtype="float32")


def _settings(tm, **kw):
    from gencli.pipelines.text.generate import resolve_settings

    return resolve_settings({}, **kw)


def _reference_rows(out: torch.Tensor, width: int, eos: int | None) -> list[list[int]]:
    """transformers' rows as gencli reports them: the new tokens, up to an end token."""
    rows = []
    for row in out[:, width:].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append(row)
    return rows


def _batch(tm, prompts: list[list[int]]):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tm.pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask, width


CASES = [
    {"num_beams": 4},
    {"num_beams": 4, "num_return_sequences": 3},
    {"num_beams": 3, "no_repeat_ngram_size": 2},
    {"num_beams": 3, "length_penalty": 0.6, "early_stopping": True},
    {"num_beams": 3, "length_penalty": 1.5, "early_stopping": "never"},
    {"num_beams": 2, "repetition_penalty": 1.4},
    {"no_repeat_ngram_size": 2},  # greedy, one step a call with the ban
    {"min_new_tokens": 9},  # greedy: the end token banned for 9 steps, then native bursts
    {"num_beams": 3, "min_new_tokens": 9},
]


@pytest.mark.parametrize("ends", [False, True], ids=["to-the-budget", "end-tokens"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_token_ids_equal_transformers(checkpoints, name, ends):
    from gencli.pipelines.text.generate import generate

    folder, ref = checkpoints[name]
    tm = _load(folder)
    prompts = [tm.tokenizer.encode("import os"), tm.tokenizer.encode("class Point:\n    def __init__(self, x, y):")]
    eos = None
    if ends:  # an end token the beams meet: one greedy run chooses it early
        probe = generate(tm, [("p", prompts[1])], _settings(tm, max_new_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
        eos = probe[3]
        tm.eos_ids = [eos]
    ids, mask, width = _batch(tm, prompts)
    distinct, ended = set(), 0
    for case in CASES:
        settings = _settings(tm, max_new_tokens=14, temperature=0.0, ignore_eos=not ends, **case)
        got = [c.token_ids for c in generate(tm, [(str(i), p) for i, p in enumerate(prompts)], settings)]
        with torch.inference_mode():
            out = ref.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=eos, pad_token_id=tm.pad_id, **case)
        assert got == _reference_rows(out, width, eos), case
        distinct.update(tuple(g) for g in got)
        ended += sum(1 for g in got if g[-1] == eos)
        if ends and "min_new_tokens" in case:
            assert all(len(g) >= case["min_new_tokens"] for g in got), case
    assert len(distinct) > 6  # the settings change the outputs
    assert (ended > 0) == ends  # outputs did end on the end token


def test_each_row_of_a_batch_equals_its_own_run(checkpoints):
    from gencli.pipelines.text.generate import generate

    tm = _load(checkpoints["llama"][0])
    prompts = [("a", tm.tokenizer.encode("import os")), ("b", tm.tokenizer.encode("for i in range(10):\n"))]
    settings = _settings(tm, max_new_tokens=10, temperature=0.0, num_beams=3, num_return_sequences=2, ignore_eos=True)
    both = generate(tm, prompts, settings)
    assert [(c.prompt, c.index) for c in both] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert both[0].score >= both[1].score and both[2].score >= both[3].score
    for i, p in enumerate(prompts):
        alone = generate(tm, [p], settings)
        assert [c.token_ids for c in alone] == [c.token_ids for c in both[2 * i : 2 * i + 2]]


def test_beam_sampling_equals_transformers_for_a_seed(checkpoints):
    from gencli.pipelines.text.generate import generate

    folder, ref = checkpoints["gpt2"]
    tm = _load(folder)
    prompt = tm.tokenizer.encode("def add(a, b):")
    seen = set()
    for seed in (0, 1, 2):
        settings = _settings(tm, max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.95, num_beams=3, num_return_sequences=2, ignore_eos=True)
        got = [c.token_ids for c in generate(tm, [("p", prompt)], settings, generator=torch.Generator().manual_seed(seed))]
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, top_p=0.95, num_beams=3,
                               num_return_sequences=2, eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert got == _reference_rows(out, len(prompt), None), seed
        seen.add(tuple(got[0]))
    assert len(seen) > 1  # the seed matters


def test_sampled_completions_of_one_prompt(checkpoints):
    from gencli.pipelines.text.generate import generate

    tm = _load(checkpoints["llama"][0])
    prompt = [("p", tm.tokenizer.encode("import os"))]
    settings = _settings(tm, max_new_tokens=12, temperature=1.0, num_return_sequences=3, ignore_eos=True)
    first = generate(tm, prompt, settings, generator=torch.Generator().manual_seed(3))
    again = generate(tm, prompt, settings, generator=torch.Generator().manual_seed(3))
    assert [c.index for c in first] == [0, 1, 2]
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) == 3
    # the rows are those of a batch holding the prompt three times
    one_each = _settings(tm, max_new_tokens=12, temperature=1.0, ignore_eos=True)
    tripled = generate(tm, prompt * 3, one_each, generator=torch.Generator().manual_seed(3))
    assert [c.token_ids for c in tripled] == [c.token_ids for c in first]


def test_generation_config_beams_are_applied(checkpoints):
    from gencli.pipelines.text.generate import resolve_settings, warn_unapplied_settings

    warned = []
    cfg = {"num_beams": 4, "no_repeat_ngram_size": 3, "length_penalty": 0.8, "early_stopping": True, "num_return_sequences": 2}
    warn_unapplied_settings(cfg, warned.append)
    assert warned == []
    s = resolve_settings(cfg)
    assert (s.num_beams, s.no_repeat_ngram_size, s.length_penalty, s.early_stopping, s.num_return_sequences) == (4, 3, 0.8, True, 2)
    assert resolve_settings(cfg, num_beams=1, temperature=0.7, num_return_sequences=1).num_beams == 1


def test_cli_beams_and_returns(checkpoints):
    folder = str(checkpoints["gpt2"][0])
    beams = run_cli("generate", "-m", folder, "def add(a, b):", "-n", "8", "--num-beams", "3", "--num-return-sequences", "2", "--temperature", "0",
                    "--ignore-eos", "--json")  # fmt: skip
    assert beams.returncode == 0, beams.stderr
    lines = [json.loads(line) for line in beams.stdout.splitlines()]
    assert [x["index"] for x in lines] == [0, 1] and lines[0]["score"] >= lines[1]["score"]
    assert all(len(x["token_ids"]) == 8 for x in lines)
    text = run_cli("generate", "-m", folder, "def add(a, b):", "-n", "8", "--num-beams", "3", "--temperature", "0", "--ignore-eos")
    assert text.returncode == 0, text.stderr
    tm = _load(folder)
    assert text.stdout == tm.tokenizer.decode(lines[0]["token_ids"]) + "\n"
    sampled = run_cli("generate", "-m", folder, "def add(a, b):", "-n", "6", "--num-return-sequences", "3", "--temperature", "1", "--seed", "4",
                      "--ignore-eos", "--json")  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    assert [json.loads(line)["index"] for line in sampled.stdout.splitlines()] == [0, 1, 2]


def test_cli_refuses_what_cannot_hold(checkpoints):
    folder = str(checkpoints["gpt2"][0])
    one_error_line(run_cli("generate", "-m", folder, "x", "--num-return-sequences", "2", "--temperature", "0"), "--num-return-sequences", "sampling")
    one_error_line(run_cli("generate", "-m", folder, "x", "--num-beams", "2", "--num-return-sequences", "3"), "--num-return-sequences")
    one_error_line(run_cli("generate", "-m", folder, "x", "--num-beams", "2", "--stop", "a"), "--stop")
    one_error_line(run_cli("generate", "-m", folder, "x", "--length-penalty", "0.5", "--temperature", "0"), "--length-penalty", "--num-beams")
    one_error_line(run_cli("generate", "-m", folder, "x", "--num-beams", "0"), "--num-beams")
    one_error_line(run_cli("generate", "-m", folder, "x", "--no-repeat-ngram-size", "-1"), "--no-repeat-ngram-size")
    one_error_line(run_cli("generate", "-m", folder, "x", "-n", "5", "--min-new-tokens", "9"), "--min-new-tokens (9)", "--max-new-tokens (5)")


def test_a_generation_configs_returns_are_named_as_its_own():
    from gencli.errors import UserError
    from gencli.pipelines.text.generate import resolve_settings

    with pytest.raises(UserError, match=r"generation_config.json's num_return_sequences \(2\) needs sampling.*--num-return-sequences 1"):
        resolve_settings({"num_return_sequences": 2})
    with pytest.raises(UserError, match=r"^--num-return-sequences \(2\) needs sampling"):
        resolve_settings({}, num_return_sequences=2)
    with pytest.raises(UserError, match=r"generation_config.json's num_return_sequences \(5\) is more than the 3 beam"):
        resolve_settings({"num_beams": 3, "num_return_sequences": 5})
