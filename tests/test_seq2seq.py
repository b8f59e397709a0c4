"""Encoder-decoder models (T5 v1.0, T5 v1.1, Marian): logits, tokenizers and generated ids equal to
transformers' on tiny random checkpoints, and the text2text / translate commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._seq2seq_fixtures import EXTRA_IDS, INPUTS, bart_checkpoint, marian_checkpoint, t5_checkpoint
from tests.conftest import one_error_line, run_cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seq2seq")
    return {
        "t5-v1.0": t5_checkpoint(root / "t5-v1.0", "v1.0", seed=0),
        "t5-v1.1": t5_checkpoint(root / "t5-v1.1", "v1.1", seed=1),
        "marian": marian_checkpoint(root / "marian", seed=2),
        "bart": bart_checkpoint(root / "bart", seed=4),
    }


def _ours(folder: Path):
    from gencli.pipelines.seq2seq.loading import load_seq2seq_model

    return load_seq2seq_model(folder, device="cpu", dtype="float32")


def _reference(folder: Path, family: str):
    if family == "bart":
        from transformers import BartForConditionalGeneration

        return BartForConditionalGeneration.from_pretrained(folder).eval()
    if family == "marian":
        from transformers import MarianMTModel

        return MarianMTModel.from_pretrained(folder).eval()
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration.from_pretrained(folder).eval()


def _batch(sm, texts):
    from gencli.pipelines.seq2seq.generate import encode_input

    encoded = [(t, encode_input(sm, t)) for t in texts]
    longest = max(len(ids) for _, ids in encoded)
    input_ids = torch.tensor([ids + [sm.pad_id] * (longest - len(ids)) for _, ids in encoded])
    mask = torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for _, ids in encoded])
    return encoded, input_ids, mask


FAMILIES = [("t5-v1.0", "t5"), ("t5-v1.1", "t5"), ("marian", "marian"), ("bart", "bart")]


@pytest.mark.parametrize("name,family", FAMILIES)
def test_encoder_outputs_and_logits_match_transformers(folders, name, family):
    sm = _ours(folders[name])
    ref = _reference(folders[name], family)
    _, input_ids, mask = _batch(sm, INPUTS)
    dec = torch.randint(3, sm.model.vocab_size - 1, (len(INPUTS), 6), generator=torch.Generator().manual_seed(0))
    dec[:, 0] = sm.decoder_start_id
    with torch.no_grad():
        want_enc = ref.get_encoder()(input_ids=input_ids, attention_mask=mask).last_hidden_state
        want = ref(input_ids=input_ids, attention_mask=mask, decoder_input_ids=dec).logits
        got_enc = sm.model.encode(input_ids, mask.bool())
        got = sm.model(input_ids, dec, mask)
        # the cached path: the decoder one token at a time gives the same logits
        cache = sm.model.new_cache(len(INPUTS), 6)
        kv = sm.model.cross_attention_kv(got_enc)
        stepped = torch.cat([sm.model.decode(dec[:, i : i + 1], kv, mask.bool(), cache) for i in range(6)], dim=1)
    real = mask.bool()
    assert want.abs().max() > 0.1  # a real comparison, not two zero tensors
    assert torch.allclose(got_enc[real], want_enc[real], atol=1e-4, rtol=0)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    assert torch.allclose(stepped, want, atol=1e-4, rtol=0)


def test_t5_v11_has_its_own_head_and_v10_scales_the_tied_one(folders):
    v10, v11 = _ours(folders["t5-v1.0"]).model, _ours(folders["t5-v1.1"]).model
    assert v10.lm_head.weight is v10.shared.weight and v10.output_scale == pytest.approx(32**-0.5)
    assert v11.lm_head.weight is not v11.shared.weight and v11.output_scale is None
    assert v11.config.is_gated and v11.config.activation == "gelu_new"


def test_marian_with_separate_vocabularies_matches(tmp_path):
    folder = marian_checkpoint(tmp_path / "marian-separate", seed=3, shared=False)
    sm = _ours(folder)
    ref = _reference(folder, "marian")
    assert sm.model.model.encoder.embed_tokens is not sm.model.model.decoder.embed_tokens
    _, input_ids, mask = _batch(sm, INPUTS)
    dec = torch.full((len(INPUTS), 3), sm.decoder_start_id)
    dec[:, 1:] = torch.tensor([[5, 9], [7, 3], [11, 2], [4, 4]])
    with torch.no_grad():
        assert torch.allclose(sm.model(input_ids, dec, mask), ref(input_ids=input_ids, attention_mask=mask, decoder_input_ids=dec).logits, atol=1e-4)


def test_marian_positions_are_transformers_table():
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    from gencli.models.marian import marian_positions

    for dim in (32, 33):
        ref = MarianSinusoidalPositionalEmbedding(40, dim)
        assert torch.equal(marian_positions(40, dim), ref.create_weight())


TEXTS = INPUTS + ["Zebra <extra_id_0> quux </s> x", "  leading   spaces", "ünïcode 3.14", "a\tb\nc"]


def test_t5_spiece_tokenizer_matches_transformers(folders):
    from transformers import T5Tokenizer

    from gencli.tokenizers.seq2seq import T5SentencePieceTokenizer, load_seq2seq_tokenizer

    folder = folders["t5-v1.0"]
    ref = T5Tokenizer.from_pretrained(folder, extra_ids=EXTRA_IDS)
    ours = load_seq2seq_tokenizer(folder, "t5")
    assert isinstance(ours, T5SentencePieceTokenizer)
    seen = set()
    for text in TEXTS:
        want = ref(text).input_ids
        assert ours.encode(text) == want, text
        assert ours.decode(want) == ref.decode(want, skip_special_tokens=True), text
        seen.add(tuple(want))
    # a sane reference: real ids (not all unknown), the end token last, a different encoding per input
    assert len(seen) == len(TEXTS)
    first = ref(INPUTS[0]).input_ids
    assert len(first) > 5 and first[-1] == 1 and 2 not in first
    assert ours.encode("<extra_id_0>") == [ref.convert_tokens_to_ids("<extra_id_0>"), 1] == [ours.vocab_size - 1, 1]


def test_t5_tokenizer_json_folder_gives_the_same_ids(tmp_path, folders):
    from gencli.tokenizers.seq2seq import load_seq2seq_tokenizer

    folder = t5_checkpoint(tmp_path / "t5-json", "v1.0", seed=0, tokenizer="json")
    assert (folder / "tokenizer.json").is_file() and not (folder / "spiece.model").exists()
    spiece = load_seq2seq_tokenizer(folders["t5-v1.0"], "t5")
    tj = load_seq2seq_tokenizer(folder, "t5")
    for text in INPUTS:
        assert tj.encode(text) == spiece.encode(text)
        assert tj.decode(spiece.encode(text)) == spiece.decode(spiece.encode(text))


def test_marian_tokenizer_matches_transformers(folders):
    from transformers import MarianTokenizer as Reference

    from gencli.tokenizers.seq2seq import MarianTokenizer, load_seq2seq_tokenizer

    folder = folders["marian"]
    ref = Reference(str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json"))
    ours = load_seq2seq_tokenizer(folder, "marian")
    assert isinstance(ours, MarianTokenizer)
    vocab = json.loads((folder / "vocab.json").read_text())
    seen = set()
    for text in TEXTS:
        want = ref(text).input_ids
        assert ours.encode(text) == want, text
        seen.add(tuple(want))
    assert len(seen) == len(TEXTS)
    first = ref(INPUTS[0]).input_ids
    assert len(first) > 5 and first[-1] == vocab["</s>"] and vocab["<unk>"] not in first
    target = [vocab[p] for p in ("▁oben", "▁links") if p in vocab] + [vocab["</s>"], vocab["<pad>"]]
    assert ours.decode(target) == ref.decode(target, skip_special_tokens=True)


def _generated(sm, want: torch.Tensor) -> list[list[int]]:
    """transformers' output rows as gencli reports them: after the start token, up to the end token."""
    rows = []
    for row in want.tolist():
        row = row[1:]
        if any(t in sm.eos_ids for t in row):
            row = row[: next(i for i, t in enumerate(row) if t in sm.eos_ids) + 1]
        else:
            while row and row[-1] == sm.pad_id:
                row.pop()
        rows.append(row)
    return rows


CASES = [
    {},
    {"num_beams": 4},
    {"num_beams": 4, "no_repeat_ngram_size": 2},
    {"num_beams": 4, "num_return_sequences": 2},
    {"min_new_tokens": 9},
    {"num_beams": 4, "length_penalty": 0.6, "early_stopping": True},
]


@pytest.mark.parametrize("name,family", FAMILIES)
def test_generated_ids_equal_transformers(folders, name, family):
    from gencli.pipelines.seq2seq.generate import generate, resolve_settings

    sm = _ours(folders[name])
    ref = _reference(folders[name], family)
    encoded, input_ids, mask = _batch(sm, INPUTS)
    distinct = set()
    for case in CASES:
        beams = case.get("num_beams", 1)
        settings = resolve_settings(sm.generation_config, max_new_tokens=12, eos_ids=sm.eos_ids, num_beams=beams, temperature=0.0,
                                    **{k: v for k, v in case.items() if k != "num_beams"})  # fmt: skip
        got = [o.token_ids for o in generate(sm, encoded, settings)]
        with torch.no_grad():
            want = ref.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, num_beams=beams,
                                **{k: v for k, v in case.items() if k != "num_beams"})  # fmt: skip
        assert got == _generated(sm, want), (name, case)
        distinct.update(tuple(g) for g in got)
        if "min_new_tokens" in case:
            assert all(len(g) >= 9 for g in got)
    assert len(distinct) > len(INPUTS)  # the outputs vary by input and by setting


def test_marian_defaults_come_from_generation_config(folders):
    from gencli.pipelines.seq2seq.generate import generate, resolve_settings

    sm = _ours(folders["marian"])
    settings = resolve_settings(sm.generation_config, eos_ids=sm.eos_ids)
    assert settings.num_beams == 4 and settings.max_new_tokens == 63 and settings.suppressed_ids == [sm.pad_id] and settings.forced_eos_ids == [0]
    encoded, input_ids, mask = _batch(sm, INPUTS[:2])
    got = [o.token_ids for o in generate(sm, encoded, resolve_settings(sm.generation_config, eos_ids=sm.eos_ids, max_new_tokens=10))]
    with torch.no_grad():
        want = _reference(folders["marian"], "marian").generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=10)
    assert got == _generated(sm, want)
    assert all(g[-1] == 0 for g in got)  # the forced end token on the last step at the latest


def test_bart_generation_config_forces_the_first_and_last_tokens(folders):
    from gencli.pipelines.seq2seq.generate import generate, resolve_settings

    sm = _ours(folders["bart"])
    settings = resolve_settings(sm.generation_config, eos_ids=sm.eos_ids, max_new_tokens=12)
    assert (settings.forced_bos_id, settings.forced_eos_ids, settings.num_beams, settings.no_repeat_ngram_size) == (0, [2], 4, 3)
    assert settings.min_new_tokens == 4 and settings.length_penalty == 2.0 and settings.early_stopping is True
    encoded, input_ids, mask = _batch(sm, INPUTS)
    got = [o.token_ids for o in generate(sm, encoded, settings)]
    with torch.no_grad():
        want = _reference(folders["bart"], "bart").generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=12)
    assert got == _generated(sm, want)
    assert all(g[0] == 0 and g[-1] == 2 and len(g) >= 5 for g in got)


def test_seeded_sampling_is_reproducible_and_top_k_1_gives_transformers_greedy_tokens(folders):
    """Sampling draws from a seeded CPU generator (one uniform number a row and step, over the
    candidates the processors leave: transformers' distribution, tested in test_text_sampling): the same
    seed gives the same tokens, another seed others; top-k 1 leaves one candidate, transformers' greedy token."""
    from gencli.backend.random import make_generator
    from gencli.pipelines.seq2seq.generate import generate, resolve_settings

    sm = _ours(folders["t5-v1.0"])
    ref = _reference(folders["t5-v1.0"], "t5")
    encoded, input_ids, mask = _batch(sm, INPUTS)
    settings = resolve_settings(sm.generation_config, max_new_tokens=10, eos_ids=sm.eos_ids, temperature=0.8, top_p=0.9)

    def run(seed, s=settings):
        return [o.token_ids for o in generate(sm, encoded, s, generator=make_generator(seed)[0])]

    assert run(7) == run(7)
    assert run(7) != run(8)
    one = resolve_settings(sm.generation_config, max_new_tokens=10, eos_ids=sm.eos_ids, temperature=0.8, top_k=1)
    with torch.no_grad():
        want = ref.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert run(7, one) == _generated(sm, want)


@pytest.mark.parametrize("name,family", [("t5-v1.0", "t5"), ("bart", "bart")])
def test_beam_sampling_equals_transformers_for_a_seed(folders, name, family):
    """Beam sampling (a sampling config with --num-beams): transformers' candidates drawn from the beams'
    accumulated scores, for the same seed the same token ids."""
    from gencli.pipelines.seq2seq.generate import generate, resolve_settings

    sm = _ours(folders[name])
    ref = _reference(folders[name], family)
    encoded, input_ids, mask = _batch(sm, INPUTS[:2])
    kw = dict(max_new_tokens=10, temperature=0.9, top_k=30, num_beams=3, num_return_sequences=2)
    seen = set()
    for seed in (0, 1):
        settings = resolve_settings(sm.generation_config, eos_ids=sm.eos_ids, **kw)
        got = [o.token_ids for o in generate(sm, encoded, settings, generator=torch.Generator().manual_seed(seed))]
        torch.manual_seed(seed)
        with torch.no_grad():
            want = ref.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, **kw)
        width = want.shape[1] - 1  # (a generated pad id is a token here: compare whole padded rows)
        assert [g + [sm.pad_id] * (width - len(g)) for g in got] == want[:, 1:].tolist(), seed
        seen.add(tuple(map(tuple, got)))
    assert len(seen) == 2


def test_sampled_outputs_of_one_input(folders):
    """--num-return-sequences with sampling: that many rows of the input, numbered; the CLI prints each."""
    from gencli.pipelines.seq2seq.generate import generate, resolve_settings

    sm = _ours(folders["t5-v1.0"])
    encoded, _, _ = _batch(sm, INPUTS[:2])
    settings = resolve_settings(sm.generation_config, max_new_tokens=8, eos_ids=sm.eos_ids, temperature=1.0, num_return_sequences=3)
    outs = generate(sm, encoded, settings, generator=torch.Generator().manual_seed(1))
    assert [(o.prompt, o.index) for o in outs] == [(t, i) for t, _ in encoded for i in range(3)]
    tripled = resolve_settings(sm.generation_config, max_new_tokens=8, eos_ids=sm.eos_ids, temperature=1.0)
    rows = generate(sm, [e for e in encoded for _ in range(3)], tripled, generator=torch.Generator().manual_seed(1))
    assert [o.token_ids for o in outs] == [o.token_ids for o in rows]
    assert len({tuple(o.token_ids) for o in outs}) > 2
    folder = str(folders["t5-v1.0"])
    cli = run_cli("text2text", "-m", folder, INPUTS[0], "-n", "5", "--temperature", "1", "--num-return-sequences", "2", "--seed", "3", "--json")
    assert cli.returncode == 0, cli.stderr
    assert [json.loads(line)["index"] for line in cli.stdout.splitlines()] == [0, 1]
    one_error_line(run_cli("text2text", "-m", folder, INPUTS[0], "--temperature", "0", "--num-return-sequences", "2"), "--num-return-sequences", "sampling")
    one_error_line(run_cli("text2text", "-m", folder, INPUTS[0], "--temperature", "1", "--num-return-sequences", "2", "--stream"), "--stream")


def test_truncation_of_long_inputs(folders):
    from gencli.errors import UserError
    from gencli.pipelines.seq2seq.generate import encode_input

    sm = _ours(folders["marian"])
    warned = []
    ids = encode_input(sm, " ".join(["a small red star"] * 40), warn=warned.append)
    assert len(ids) == sm.max_source_tokens == 64 and ids[-1] == 0 and warned
    with pytest.raises(UserError, match="window"):
        encode_input(sm, " ".join(["a small red star"] * 40), truncate=False)


# -- the commands ---------------------------------------------------------------------------------
def test_text2text_writes_one_line_per_input_and_json_records(folders):
    folder = str(folders["t5-v1.0"])
    plain = run_cli("text2text", "-m", folder, INPUTS[0], INPUTS[2], "-n", "6")
    assert plain.returncode == 0, plain.stderr
    assert len(plain.stdout.splitlines()) == 2
    piped = run_cli("text2text", "-m", folder, "-", "-n", "6", "--json", input=f"{INPUTS[0]}\n{INPUTS[2]}\n")
    assert piped.returncode == 0, piped.stderr
    records = [json.loads(line) for line in piped.stdout.splitlines()]
    assert [r["prompt"] for r in records] == [INPUTS[0], INPUTS[2]]
    assert [r["text"] for r in records] == plain.stdout.splitlines()
    for r in records:
        assert set(r) >= {"prompt", "text", "token_ids", "finish_reason", "usage", "timing"}
        assert r["usage"]["completion_tokens"] == len(r["token_ids"]) and r["finish_reason"] in ("stop", "length")
    beams = run_cli("text2text", "-m", folder, INPUTS[0], "-n", "6", "--num-beams", "3", "--num-return-sequences", "2", "--json")
    assert beams.returncode == 0, beams.stderr
    assert [json.loads(line)["index"] for line in beams.stdout.splitlines()] == [0, 1]


def test_stream_prints_the_same_text(folders, tmp_path):
    folder = str(folders["t5-v1.1"])
    prompts = tmp_path / "inputs.txt"
    prompts.write_text(f"{INPUTS[0]}\n\n{INPUTS[3]}\n")
    batch = run_cli("text2text", "-m", folder, "--prompts-file", str(prompts), "-n", "8")
    streamed = run_cli("text2text", "-m", folder, "--prompts-file", str(prompts), "-n", "8", "--stream")
    assert batch.returncode == 0 and streamed.returncode == 0, batch.stderr + streamed.stderr
    assert streamed.stdout == batch.stdout and len(batch.stdout.splitlines()) == 2
    assert "blank line" in batch.stderr


def test_translate_adds_t5_prefix_and_runs_marian(folders):
    t5 = run_cli("translate", "-m", str(folders["t5-v1.0"]), "a big green heart in the middle.", "--source", "English", "--target", "German", "-n", "6",
                 "--json")  # fmt: skip
    assert t5.returncode == 0, t5.stderr
    assert json.loads(t5.stdout)["prompt"] == "translate English to German: a big green heart in the middle."
    marian = run_cli("translate", "-m", str(folders["marian"]), INPUTS[0], "-n", "6")
    assert marian.returncode == 0, marian.stderr
    assert len(marian.stdout.splitlines()) == 1


def test_bad_inputs_are_one_line_exit_2(folders, tmp_path):
    from tests._text_fixtures import gpt2_checkpoint

    t5 = str(folders["t5-v1.0"])
    one_error_line(run_cli("translate", "hello"), "--model")  # translate has no embedded default
    one_error_line(run_cli("text2text", "-m", t5, ""), "empty")
    one_error_line(run_cli("text2text", "-m", t5, "-", input="\n\n"), "empty")
    one_error_line(run_cli("text2text", "-m", t5, "x", "--num-beams", "0"), "--num-beams")
    one_error_line(run_cli("text2text", "-m", t5, "x", "--num-beams", "2", "--num-return-sequences", "3"), "--num-return-sequences")
    one_error_line(run_cli("translate", "-m", t5, "x", "--source", "English"), "--target")
    gpt2 = tmp_path / "gpt2"
    gpt2_checkpoint(gpt2)
    one_error_line(run_cli("text2text", "-m", str(gpt2), "x"), "gencli generate")
    long = " ".join(["a small red star"] * 40)
    one_error_line(run_cli("translate", "-m", str(folders["marian"]), long, "--no-truncate"), "window")
    truncated = run_cli("translate", "-m", str(folders["marian"]), long, "-n", "4")
    assert truncated.returncode == 0 and "truncated" in truncated.stderr
    broken = tmp_path / "t5-broken"
    broken.mkdir()
    for f in folders["t5-v1.0"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "spiece.model").write_bytes(b"not a sentencepiece model")
    one_error_line(run_cli("text2text", "-m", str(broken), "x"), "sentencepiece")
    (broken / "spiece.model").unlink()
    one_error_line(run_cli("text2text", "-m", str(broken), "x"), "spiece.model")


def test_shapes_text2text_pairs_and_baseline():
    import numpy as np

    from gencli.data import shapes
    from gencli.data import shapes_text2text as st

    scenes = [shapes.make_scene(s) for s in shapes.split_seeds("test", 200)]
    for scene in scenes:
        assert st.parse_structure(st.structure(scene)) == scene.labels()
        # the baseline is written from the caption templates: exact on every complete one
        for style in st.TRAIN_STYLES + st.HELDOUT_STYLES:
            assert st.baseline_parse(scene.caption(style)) == st.structure(scene)
    assert sum(st.baseline_parse(st.paraphrase(s, "paren")) == st.structure(s) for s in scenes) == 0
    rng = np.random.default_rng(0)
    tasks = [st.pair(s, rng) for s in range(50)]
    assert {a.split(":")[0] for a, _ in tasks} == {"parse", "describe"}
    assert all(st.parse_structure(b) is not None for a, b in tasks if a.startswith(st.PARSE))


def test_greedy_with_the_screened_head_gives_the_same_ids(folders, monkeypatch):
    """Greedy steps choose by the exact screened argmax of a large head (forced on here for the tiny
    one); a pick the masks ban falls back to the full product."""
    from gencli.backend.screened_argmax import ScreenedArgmax
    from gencli.pipelines.seq2seq import generate as seq2seq

    sm = _ours(folders["t5-v1.0"])
    if not ScreenedArgmax.supported(sm.model.lm_head.weight):
        pytest.skip("no screened argmax on this CPU")
    encoded, input_ids, mask = _batch(sm, INPUTS)
    plain = {}
    for case in ({}, {"min_new_tokens": 9}, {"no_repeat_ngram_size": 2}):
        settings = seq2seq.resolve_settings(sm.generation_config, max_new_tokens=12, eos_ids=sm.eos_ids, temperature=0.0, **case)
        plain[str(case)] = [o.token_ids for o in seq2seq.generate(sm, encoded, settings)]
    monkeypatch.setattr(seq2seq, "SCREEN_MIN_HEAD_BYTES", 0)
    monkeypatch.setattr(seq2seq, "SCREEN_MIN_STEPS", 0)
    for case in ({}, {"min_new_tokens": 9}, {"no_repeat_ngram_size": 2}):
        settings = seq2seq.resolve_settings(sm.generation_config, max_new_tokens=12, eos_ids=sm.eos_ids, temperature=0.0, **case)
        assert [o.token_ids for o in seq2seq.generate(sm, encoded, settings)] == plain[str(case)], case
    assert sm.screen is not None


def test_train_text2text_resumes_and_exports_a_t5_folder(tmp_path):
    """A few steps of scripts/train_text2text.py: resumable, and the export loads in gencli and in
    transformers with the same logits."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    run, out = tmp_path / "run", tmp_path / "export"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_text2text.py"), "--run-dir", str(run), "--export", str(out), "--batch", "4", "--ckpt-every", "2",
           "--eval-scenes", "2", "--d-model", "32", "--layers", "1", "--warmup", "1"]  # fmt: skip
    first = subprocess.run([*cmd, "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    second = subprocess.run([*cmd, "--steps", "3"], capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "starting at step 2 of 3" in second.stdout
    results = json.loads((out / "eval.json").read_text())
    assert results["parse/full"]["baseline"] == 1.0 and "describe" in results
    from transformers import T5ForConditionalGeneration

    sm = _ours(out)
    ref = T5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()  # the export is fp16
    ids = torch.tensor([sm.tokenizer.encode("parse: a small red star at the top left on a blue background")])
    dec = torch.tensor([[0, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(sm.model(ids, dec), ref(input_ids=ids, decoder_input_ids=dec).logits, atol=1e-4)


def test_decoding_runs_in_inference_mode(folders, monkeypatch):
    """Outside inference mode every packed bf16 linear layer unpacks its weight a call (torch's own
    product): text2text decoded at half speed and held 40 MB more a step (a decorator once moved off
    generate by a helper inserted under it)."""
    from gencli.pipelines.seq2seq.generate import generate, resolve_settings

    sm = _ours(folders["t5-v1.0"])
    seen = []
    decode = sm.model.decode_hidden

    def spy(*args, **kwargs):
        seen.append(torch.is_inference_mode_enabled())
        return decode(*args, **kwargs)

    monkeypatch.setattr(sm.model, "decode_hidden", spy)
    encoded, _, _ = _batch(sm, INPUTS[:1])
    generate(sm, encoded, resolve_settings(sm.generation_config, max_new_tokens=4, eos_ids=sm.eos_ids, temperature=0.0))
    assert seen and all(seen)
