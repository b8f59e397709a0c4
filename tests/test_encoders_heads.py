"""classify-text, ner and qa against transformers on random tiny BERT, RoBERTa and DistilBERT
checkpoints: the text-classification and token-classification pipelines, and the question-answering
span transformers 4.x's pipeline picks (computed here from the transformers model's logits, as
transformers 5 no longer ships that pipeline); the commands' JSON and bad-input contract."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import one_error_line, run_cli  # noqa: E402
from test_encoders import build_checkpoint, hf_tokenizer  # noqa: E402

from gencli.pipelines.encoders.classify import classify_texts  # noqa: E402
from gencli.pipelines.encoders.loading import load_encoder  # noqa: E402
from gencli.pipelines.encoders.ner import recognize  # noqa: E402
from gencli.pipelines.encoders.qa import answer  # noqa: E402

FAMILIES = ("bert", "roberta", "distilbert")
TEXTS = ["the cat sat on the mat", "Hello, world! The café is naïve.", "unbelievable running cats in paris", "a dog"]
NER_LABELS = ["O", "B-COL", "I-COL", "B-SHP", "I-SHP"]


def labelled(folder, labels):
    """Give a saved checkpoint's config named labels (id2label / label2id)."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg["id2label"] = {str(i): name for i, name in enumerate(labels)}
    cfg["label2id"] = {name: i for i, name in enumerate(labels)}
    (folder / "config.json").write_text(json.dumps(cfg))


def reference_model(folder, cls):
    return getattr(transformers, cls).from_pretrained(str(folder)).eval()


def auto_cls(model_type, head):
    return {"bert": "Bert", "roberta": "Roberta", "distilbert": "DistilBert"}[model_type] + head


def same_records(got, expected, atol=1e-4):
    """Lists of dicts equal, their "score" fields within ``atol``."""
    assert [{k: v for k, v in g.items() if k != "score"} for g in got] == [{k: v for k, v in e.items() if k != "score"} for e in expected]
    np.testing.assert_allclose([g["score"] for g in got], [e["score"] for e in expected], atol=atol)


# -- classify-text -------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("problem_type,num_labels", [(None, 3), ("multi_label_classification", 3), (None, 1), ("regression", 1)])
def test_classify_equals_pipeline(tmp_path, model_type, problem_type, num_labels):
    folder = tmp_path / "m"
    build_checkpoint(folder, model_type, "sequence_classification", num_labels=num_labels, problem_type=problem_type, seed=3)
    if num_labels == 3:
        labelled(folder, ["negative", "neutral", "positive"])
    ref = reference_model(folder, auto_cls(model_type, "ForSequenceClassification"))
    pipe = transformers.pipeline("text-classification", model=ref, tokenizer=hf_tokenizer(folder, model_type), device="cpu")
    enc = load_encoder(folder, task="sequence_classification", device="cpu", dtype="float32")
    pairs = [None, "hello world", None, "the city"] if model_type != "distilbert" else [None] * 4
    got = classify_texts(enc, TEXTS, pairs, batch_size=3)
    for text, pair, result in zip(TEXTS, pairs, got):
        expected = pipe({"text": text, "text_pair": pair} if pair else text, top_k=None)
        if num_labels == 1:
            assert isinstance(result, float)
            assert result == pytest.approx(expected[0]["score"], abs=1e-5)
            continue
        assert [r["label"] for r in result] == [e["label"] for e in expected]
        np.testing.assert_allclose([r["score"] for r in result], [e["score"] for e in expected], atol=1e-5)
    top = classify_texts(enc, TEXTS[:1], top_k=2)[0]
    if num_labels == 3:
        assert len(top) == 2 and top[0]["score"] >= top[1]["score"]
        if problem_type is None:
            assert sum(r["score"] for r in classify_texts(enc, TEXTS[:1])[0]) == pytest.approx(1.0, abs=1e-5)


def test_classify_text_cli(tmp_path):
    folder = tmp_path / "m"
    build_checkpoint(folder, "bert", "sequence_classification", num_labels=3, seed=1)
    labelled(folder, ["contradiction", "entailment", "neutral"])
    r = run_cli("classify-text", "-m", str(folder), "--json", "-k", "2", "the cat sat", "--pair", "a dog")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["text"] == "the cat sat" and rec["pair"] == "a dog" and len(rec["labels"]) == 2
    assert rec["labels"][0]["score"] >= rec["labels"][1]["score"]
    r = run_cli("classify-text", "-m", str(folder), "--dtype", "float32", "--json", "-", input="the cat sat\ta dog\nhello world\n")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert recs[0]["pair"] == "a dog" and "pair" not in recs[1] and len(recs[1]["labels"]) == 3
    enc = load_encoder(folder, task="sequence_classification", device="cpu", dtype="float32")
    same_records(recs[0]["labels"], classify_texts(enc, ["the cat sat"], ["a dog"])[0])
    # a regression / cross-encoder head: one score
    build_checkpoint(tmp_path / "r", "bert", "sequence_classification", num_labels=1)
    r = run_cli("classify-text", "-m", str(tmp_path / "r"), "--json", "the cat")
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)) == {"text", "score"}


# -- ner -------------------------------------------------------------------------------------------
NER_TEXTS = ["the red cat sat on the mat in paris", "Hello, world! unbelievable running cats. The café is naïve.", "qqqq 中国 xyz"]


def ner_checkpoint(folder, model_type):
    """A token classifier whose predictions on NER_TEXTS use several labels (checked), with B-/I- tags."""
    for seed in range(20):
        build_checkpoint(folder, model_type, "token_classification", num_labels=len(NER_LABELS), seed=seed)
        labelled(folder, NER_LABELS)
        ref = reference_model(folder, auto_cls(model_type, "ForTokenClassification"))
        tok = hf_tokenizer(folder, model_type)
        batch = tok(NER_TEXTS, padding=True, return_tensors="pt")
        with torch.no_grad():
            preds = ref(**batch).logits.argmax(-1)[batch["attention_mask"].bool()]
        if len(set(preds.tolist())) >= 4:
            return ref, tok
    raise AssertionError("no seed gives varied predictions")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_ner_equals_pipeline(tmp_path, model_type):
    folder = tmp_path / "m"
    ref, tok = ner_checkpoint(folder, model_type)
    enc = load_encoder(folder, task="token_classification", device="cpu", dtype="float32")
    import warnings

    for aggregation in ("none", "simple", "first", "average", "max"):
        pipe = transformers.pipeline("token-classification", model=ref, tokenizer=tok, aggregation_strategy=aggregation, device="cpu")
        got = recognize(enc, NER_TEXTS, aggregation=aggregation, batch_size=2)
        for text, entities in zip(NER_TEXTS, got):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected = pipe(text)
            key = "entity" if aggregation == "none" else "entity_group"
            assert [(e[key], e["word"], e["start"], e["end"]) for e in entities] == [(e[key], e["word"], e["start"], e["end"]) for e in expected], (
                aggregation,
                text,
            )
            np.testing.assert_allclose([e["score"] for e in entities], [float(e["score"]) for e in expected], atol=1e-5)
            if aggregation == "none":
                assert [e["index"] for e in entities] == [e["index"] for e in expected]
        assert sum(len(x) for x in got) > 0


def test_ner_cli(tmp_path):
    folder = tmp_path / "m"
    ner_checkpoint(folder, "bert")
    enc = load_encoder(folder, task="token_classification", device="cpu", dtype="float32")
    r = run_cli("ner", "-m", str(folder), "--dtype", "float32", "--json", "--aggregation", "first", NER_TEXTS[0])
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["text"] == NER_TEXTS[0]
    same_records(rec["entities"], recognize(enc, NER_TEXTS[:1], aggregation="first")[0])
    for e in rec["entities"]:
        assert set(e) == {"entity_group", "score", "word", "start", "end"}
        assert 0 <= e["start"] < e["end"] <= len(NER_TEXTS[0])
    r = run_cli("ner", "-m", str(folder), "--json", "--aggregation", "none", NER_TEXTS[0])
    assert r.returncode == 0, r.stderr
    assert all("entity" in e for e in json.loads(r.stdout)["entities"])
    r = run_cli("ner", "-m", str(folder), NER_TEXTS[0])
    assert r.returncode == 0 and r.stdout.startswith(NER_TEXTS[0])


# -- qa --------------------------------------------------------------------------------------------
def reference_answers(ref, tok, question, context, top_k=1, max_answer_len=15, max_len=384, stride=128):
    """transformers 4.x's question-answering pipeline (preprocess, select_starts_ends, decode_spans,
    get_indices), over the transformers model's logits."""
    enc = tok(
        question,
        context,
        truncation="only_second",
        max_length=max_len,
        stride=stride,
        padding="longest",
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        kwargs = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
        out = ref(**kwargs)
    answers = []
    for span in range(enc["input_ids"].shape[0]):
        seq_ids = enc.sequence_ids(span)
        p_mask = np.array([tid != 1 for tid in seq_ids], dtype=int)
        ids = enc["input_ids"][span].numpy()
        p_mask[ids == tok.cls_token_id] = 0
        undesired = np.abs(p_mask - 1) & enc["attention_mask"][span].numpy()
        start = out.start_logits[span].numpy()[None]
        end = out.end_logits[span].numpy()[None]
        start = np.where(undesired[None] == 0, -10000.0, start)
        end = np.where(undesired[None] == 0, -10000.0, end)
        start = np.exp(start - start.max(axis=-1, keepdims=True))
        start = start / start.sum()
        end = np.exp(end - end.max(axis=-1, keepdims=True))
        end = end / end.sum()
        start[0, 0] = end[0, 0] = 0.0
        outer = np.matmul(np.expand_dims(start, -1), np.expand_dims(end, 1))
        candidates = np.tril(np.triu(outer), max_answer_len - 1)
        flat = candidates.flatten()
        if top_k == 1:
            order = [np.argmax(flat)]
        elif len(flat) < top_k:
            order = np.argsort(-flat)
        else:
            idx = np.argpartition(-flat, top_k)[0:top_k]
            order = idx[np.argsort(-flat[idx])]
        starts, ends = np.unravel_index(order, candidates.shape)[1:]
        keep = np.isin(starts, undesired[None].nonzero()) & np.isin(ends, undesired[None].nonzero())
        for s, e in zip(starts[keep], ends[keep]):
            try:
                sw, ew = enc.token_to_word(span, int(s)), enc.token_to_word(span, int(e))
                a, b = enc.word_to_chars(span, sw, sequence_index=1)[0], enc.word_to_chars(span, ew, sequence_index=1)[1]
            except Exception:
                a, b = enc["offset_mapping"][span][s][0].item(), enc["offset_mapping"][span][e][1].item()
            answers.append({"score": float(candidates[0, s, e]), "start": a, "end": b, "answer": context[a:b]})
    return sorted(answers, key=lambda x: x["score"], reverse=True)[:top_k]


QUESTIONS = ["where is the cat?", "what is the capital of france?"]
CONTEXT = "the cat sat on the mat. paris is the capital of france, a city on a river. hello world, unbelievable running dogs."


@pytest.mark.parametrize("model_type", FAMILIES)
def test_qa_equals_reference(tmp_path, model_type):
    folder = tmp_path / "m"
    build_checkpoint(folder, model_type, "question_answering", num_labels=2, seed=5)
    ref = reference_model(folder, auto_cls(model_type, "ForQuestionAnswering"))
    tok = hf_tokenizer(folder, model_type)
    enc = load_encoder(folder, task="question_answering", device="cpu", dtype="float32")
    long_context = " ".join([CONTEXT] * 2)
    for q in QUESTIONS:
        for k, ml, stride, ctx in ((1, None, None, CONTEXT), (3, None, None, CONTEXT), (4, 40, 10, long_context), (1, 24, 5, long_context)):
            got = answer(enc, q, ctx, top_k=k, max_length=ml, stride=stride)
            kwargs = {"max_len": ml, "stride": stride} if ml else {"max_len": min(enc.max_length, 384), "stride": min(min(enc.max_length, 384) // 2, 128)}
            expected = reference_answers(ref, tok, q, ctx, top_k=k, **kwargs)
            assert [(a["start"], a["end"], a["answer"]) for a in got] == [(a["start"], a["end"], a["answer"]) for a in expected], (q, k, ml)
            np.testing.assert_allclose([a["score"] for a in got], [a["score"] for a in expected], rtol=1e-4, atol=1e-7)
            assert all(a["answer"] == ctx[a["start"] : a["end"]] for a in got)


def test_qa_cli(tmp_path):
    folder = tmp_path / "m"
    build_checkpoint(folder, "bert", "question_answering", num_labels=2, seed=5)
    r = run_cli("qa", "-m", str(folder), "--json", "--context", CONTEXT, *QUESTIONS)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["question"] for x in recs] == QUESTIONS
    for x in recs:
        assert set(x) == {"question", "answer", "score", "start", "end"} and CONTEXT[x["start"] : x["end"]] == x["answer"]
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(CONTEXT)
    r = run_cli("qa", "-m", str(folder), "--json", "-k", "3", "--context-file", str(ctx), QUESTIONS[0])
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 3


# -- bad input -------------------------------------------------------------------------------------
def test_bad_input(tmp_path):
    mlm = tmp_path / "mlm"
    build_checkpoint(mlm, "bert", "masked_lm")
    qa = tmp_path / "qa"
    build_checkpoint(qa, "bert", "question_answering", num_labels=2)
    out = tmp_path / "out.jsonl"
    cases = [
        (("classify-text", "-m", str(mlm), "hello"), ("masked-language model", "sequence classifier", "gencli fill-mask")),
        (("ner", "-m", str(mlm), "hello"), ("token classifier",)),
        (("qa", "-m", str(mlm), "--context", "the cat", "where?"), ("question-answering",)),
        (("classify-text", "-m", str(qa), ""), ("empty",)),
        (("qa", "-m", str(qa), "--context", "  ", "where?"), ("context is empty",)),
        (("qa", "-m", str(qa), "where?"), ("--context",)),
        (("qa", "-m", str(qa), "--context", "the cat", ""), ("question 1 is empty",)),
        (("qa", "-m", str(qa), "--context-file", str(tmp_path / "nope.txt"), "where?"), ("does not exist",)),
        (("ner", "-m", str(qa), "--aggregation", "first", ""), ("empty",)),
        (("classify-text", "-m", str(qa), "-k", "0", "hi"), ("-k",)),
    ]
    for args, needles in cases:
        r = run_cli(*args, "--out", str(out))
        one_error_line(r, *needles)
        assert not out.exists()
