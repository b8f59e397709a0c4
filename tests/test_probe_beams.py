"""Beam search, beam sampling and n-gram bans of ``gencli generate`` at their edges, against transformers'
``generate`` on random GPT-2 and Llama checkpoints: several end tokens, a row of a left-padded batch
stopped by the model's context while the others go on, more beams than the vocabulary, beam sampling
with few candidates left, the scores, the fused native CPU step of quantized and bf16 models, and
beams or sampled copies too many for the memory (one error line)."""

from __future__ import annotations

import pytest
import torch
from _text_fixtures import gpt2_checkpoint, llama_checkpoint
from conftest import one_error_line, run_cli
from test_text_beam_search import _batch

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe-beams")
    return {"gpt2": (root / "gpt2", gpt2_checkpoint(root / "gpt2")), "llama": (root / "llama", llama_checkpoint(root / "llama"))}


def _load(folder, **kw):
    from gencli.pipelines.text.loading import load_text_model

    kw.setdefault("dtype", "float32")
    return load_text_model(folder, device="cpu", **kw)


def _run(tm, prompts, seed=None, **kw):
    from gencli.pipelines.text.generate import generate, resolve_settings

    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return generate(tm, [(str(i), p) for i, p in enumerate(prompts)], resolve_settings({}, **kw), generator=generator)


def _reference(ref, tm, prompts, eos, seed=None, **kw):
    """transformers' rows for the left-padded batch of ``prompts``: the new tokens, up to an end token."""
    ids, mask, width = _batch(tm, prompts)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        out = ref.generate(ids, attention_mask=mask, eos_token_id=eos, pad_token_id=tm.pad_id, output_scores=True, return_dict_in_generate=True, **kw)
    ends = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    rows = []
    for row in out.sequences[:, width:].tolist():
        cut = next((j for j, t in enumerate(row) if t in ends), None)
        rows.append(row if cut is None else row[: cut + 1])
    scores = out.sequences_scores.tolist() if getattr(out, "sequences_scores", None) is not None else None
    return rows, scores


def _prompts(tm):
    return [tm.tokenizer.encode("import os"), tm.tokenizer.encode("class Point:\n    def __init__(self, x, y):")]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_several_end_tokens_and_scores_equal_transformers(checkpoints, name):
    folder, ref = checkpoints[name]
    tm = _load(folder)
    prompts = _prompts(tm)
    beams = _run(tm, prompts, max_new_tokens=12, temperature=0.0, ignore_eos=True, num_beams=4, num_return_sequences=4)
    eos = sorted({beams[0].token_ids[3], beams[5].token_ids[4]})  # two end tokens the beams meet inside the run
    tm.eos_ids = eos
    ended = 0
    for case in ({"num_beams": 4, "num_return_sequences": 2}, {"num_beams": 3, "early_stopping": True, "length_penalty": 0.5},
                 {"num_beams": 2, "early_stopping": "never", "length_penalty": 2.0}):  # fmt: skip
        got = _run(tm, prompts, max_new_tokens=12, temperature=0.0, **case)
        rows, scores = _reference(ref, tm, prompts, eos, max_new_tokens=12, do_sample=False, **case)
        assert [c.token_ids for c in got] == rows, case
        assert [c.score for c in got] == pytest.approx(scores, abs=1e-4), case
        assert [c.finish_reason for c in got] == ["stop" if r[-1] in eos else "length" for r in rows]
        ended += sum(1 for r in rows if r[-1] in eos)
    assert ended > 0


def test_a_row_stopped_by_the_context_while_the_others_go_on(checkpoints):
    folder, ref = checkpoints["gpt2"]  # 96 positions
    tm = _load(folder)
    long = tm.tokenizer.encode("class Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 10)[:88]
    short = tm.tokenizer.encode("import os")
    for case in ({"num_beams": 3, "num_return_sequences": 2}, {"num_beams": 3, "early_stopping": "never", "length_penalty": 1.5},
                 {"num_beams": 2, "no_repeat_ngram_size": 2, "num_return_sequences": 2}):  # fmt: skip
        got = _run(tm, [long, short], max_new_tokens=14, temperature=0.0, ignore_eos=True, **case)
        n = case.get("num_return_sequences", 1)
        for j, (p, budget) in enumerate(((long, 8), (short, 14))):
            rows, _ = _reference(ref, tm, [p], None, max_new_tokens=budget, do_sample=False, **case)
            mine = got[j * n : (j + 1) * n]
            assert [c.token_ids for c in mine] == rows, (case, j)
            assert all(c.hit_context == (j == 0) and c.finish_reason == "length" for c in mine)


def test_more_beams_than_the_vocabulary(checkpoints):
    folder, ref = checkpoints["gpt2"]
    tm = _load(folder)
    k = tm.model.vocab_size + 7
    got = _run(tm, _prompts(tm)[:1], max_new_tokens=3, temperature=0.0, ignore_eos=True, num_beams=k, num_return_sequences=5)
    rows, scores = _reference(ref, tm, _prompts(tm)[:1], None, max_new_tokens=3, do_sample=False, num_beams=k, num_return_sequences=5)
    assert [c.token_ids for c in got] == rows
    assert [c.score for c in got] == pytest.approx(scores, abs=1e-4)


@pytest.mark.parametrize(
    "case",
    [{"top_k": 2, "num_beams": 3, "num_return_sequences": 3}, {"min_p": 0.5, "top_k": 0, "num_beams": 3, "num_return_sequences": 2},
     {"top_p": 0.05, "top_k": 0, "num_beams": 4, "num_return_sequences": 2}, {"top_k": 20, "num_beams": 3, "no_repeat_ngram_size": 2,
                                                                              "repetition_penalty": 1.2}],
    ids=["top-k-2", "min-p", "top-p", "ngram-penalty"],
)  # fmt: skip
def test_beam_sampling_with_few_candidates_equals_transformers(checkpoints, case):
    folder, ref = checkpoints["llama"]
    tm = _load(folder)
    prompts = [tm.tokenizer.encode("def add(a, b):")]
    seen = set()
    for seed in (0, 1, 2):
        got = _run(tm, prompts, seed=seed, max_new_tokens=8, temperature=0.8, ignore_eos=True, **case)
        rows, scores = _reference(ref, tm, prompts, None, seed=seed, max_new_tokens=8, do_sample=True, temperature=0.8, **case)
        assert [c.token_ids for c in got] == rows, seed
        assert [c.score for c in got] == pytest.approx(scores, abs=1e-4)
        seen.add(tuple(tuple(c.token_ids) for c in got))
    assert len(seen) > 1 or case.get("top_k") == 2  # the seed matters (top-k 2 of 3 beams: every candidate is drawn)


@pytest.mark.parametrize(
    "name,opts",
    [("llama", {"quantize": "int8"}), ("llama", {"dtype": "bfloat16"}), ("gpt2", {"quantize": "int4"})],
    ids=["llama-int8", "llama-bf16", "gpt2-int4"],
)
def test_fused_native_step_gives_the_layer_by_layer_tokens(checkpoints, name, opts):
    """Quantized and bf16 models step natively (the fused CPU step): beams, beam sampling and the n-gram
    ban there give the tokens of the same model stepped layer by layer."""
    folder, _ = checkpoints[name]
    cases = [{"num_beams": 4, "num_return_sequences": 2, "temperature": 0.0}, {"num_beams": 3, "temperature": 0.7, "no_repeat_ngram_size": 2},
             {"num_beams": 3, "temperature": 0.0, "repetition_penalty": 1.3, "early_stopping": True}, {"temperature": 0.0, "no_repeat_ngram_size": 2},
             {"temperature": 0.9, "no_repeat_ngram_size": 3, "num_return_sequences": 2, "top_p": 0.9}]  # fmt: skip
    results = {}
    for fused in (True, False):
        tm = _load(folder, **opts)
        native = tm.model.fused_logits
        used = []

        def counted(*a, _native=native, _used=used, **kw):
            out = _native(*a, **kw)
            _used.append(out is not None)
            return out

        tm.model.fused_logits = counted if fused else (lambda *a, **kw: None)
        if not fused:
            tm.model.fused_greedy_steps = tm.model.fused_sample_steps = lambda *a, **kw: None
        long = tm.tokenizer.encode("class Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 12)[: tm.context_length - 7]  # stopped by the context
        results[fused] = [[(c.token_ids, c.score) for c in _run(tm, [long, *_prompts(tm)], seed=5, max_new_tokens=16, ignore_eos=True, **case)]
                          for case in cases]  # fmt: skip
        if fused:
            assert used and all(used)
    assert results[True] == results[False]


def _repeats(seq: list[int], n: int, start: int) -> bool:
    """Whether an n-gram ending at a position from ``start`` on occurred earlier in ``seq``."""
    grams = [tuple(seq[j - n + 1 : j + 1]) for j in range(n - 1, len(seq))]
    return any(grams[j - n + 1] in grams[: j - n + 1] for j in range(max(start, n - 1), len(seq)))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_ngram_ban_holds_when_sampling(checkpoints, n):
    folder, _ = checkpoints["llama"]
    for opts in ({}, {"quantize": "int8"}):
        tm = _load(folder, **opts)
        budget = 12 if n == 1 else 40
        for case in ({"temperature": 1.0}, {"temperature": 1.0, "num_return_sequences": 3}, {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.2},
                     {"temperature": 0.8, "num_beams": 3, "num_return_sequences": 2}):  # fmt: skip
            for c in _run(tm, _prompts(tm), seed=1, max_new_tokens=budget, ignore_eos=True, no_repeat_ngram_size=n, **case):
                assert len(c.token_ids) == budget
                assert not _repeats(c.prompt_ids + c.token_ids, n, len(c.prompt_ids)), (opts, case, c.token_ids)
    assert _repeats([1, 2, 3, 1, 2], 2, 3) and not _repeats([1, 2, 1, 2, 3], 2, 4)  # (the check itself)


def test_beams_or_copies_past_the_free_memory_are_one_error(checkpoints, monkeypatch):
    from gencli.errors import UserError
    from gencli.pipelines.seq2seq import generate as seq2seq_generate

    folder, _ = checkpoints["gpt2"]
    tm = _load(folder)
    prompts = _prompts(tm)
    monkeypatch.setattr(seq2seq_generate, "free_memory_bytes", lambda device: 2**20)
    with pytest.raises(UserError, match="--num-beams 64"):
        _run(tm, prompts, max_new_tokens=8, temperature=0.0, num_beams=64)
    with pytest.raises(UserError, match="--num-return-sequences 64"):
        _run(tm, prompts, max_new_tokens=8, temperature=1.0, num_return_sequences=64, seed=0)
    assert len(_run(tm, prompts, max_new_tokens=2, temperature=0.0, num_beams=2)) == 2  # a small run fits


def test_cli_beams_past_any_memory_are_one_error_line(checkpoints):
    folder = str(checkpoints["gpt2"][0])
    one_error_line(run_cli("generate", "-m", folder, "import os", "-n", "4", "--num-beams", str(10**23), "--temperature", "0"), "--num-beams", "GiB")
    one_error_line(run_cli("generate", "-m", folder, "import os", "-n", "4", "--num-beams", "100000000", "--temperature", "0"), "--num-beams", "GiB")
    one_error_line(run_cli("generate", "-m", folder, "import os", "-n", "4", "--num-return-sequences", "100000000", "--temperature", "1"),
                   "--num-return-sequences", "GiB")  # fmt: skip


def test_text2text_counts_the_cross_attention_of_its_beams(monkeypatch):
    """An encoder-decoder's beams each hold the encoder's output and its cross-attention keys and values:
    a short budget with many beams is one error line naming --num-beams, not an internal error for an
    allocation past the memory (or the process killed)."""
    from gencli.errors import UserError
    from gencli.pipelines.seq2seq import generate as seq2seq_generate
    from gencli.pipelines.seq2seq.loading import load_seq2seq_model
    from gencli.weights import resolve_model

    sm = load_seq2seq_model(resolve_model(None, "t5-shapes"), device="cpu", dtype="float32")
    text = "parse: a small red star at the top on a blue background"
    inputs = [(text, sm.tokenizer.encode(text))]
    monkeypatch.setattr(seq2seq_generate, "free_memory_bytes", lambda device: 2**20)  # the decoder's own cache of 64 beams fits
    settings = seq2seq_generate.resolve_settings({}, max_new_tokens=1, num_beams=64, temperature=0.0)
    with pytest.raises(UserError, match="--num-beams"):
        seq2seq_generate.generate(sm, inputs, settings)
    few = seq2seq_generate.resolve_settings({}, max_new_tokens=1, num_beams=2, temperature=0.0)
    assert len(seq2seq_generate.generate(sm, inputs, few)) == 1


def test_ray_replicas_send_their_error_line_back(checkpoints, tmp_path):
    """A replica's UserError (beams past the memory, a generation config asking several greedy outputs) is
    the command's error line with --ray too (Ray drops the exception's cause: it was an internal error)."""
    pytest.importorskip("ray")
    folder = checkpoints["gpt2"][0]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\nclass A:\n", encoding="utf-8")
    res = run_cli("generate", "-m", str(folder), "--prompts-file", str(prompts), "-n", "3", "--num-beams", "100000000", "--ray", "--replicas", "1")
    errors = [line for line in res.stderr.splitlines() if line.startswith(("error:", "internal error:"))]
    assert res.returncode == 2 and len(errors) == 1 and "--num-beams" in errors[0] and "GiB" in errors[0], res.stderr
