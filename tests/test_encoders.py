"""BERT-family encoders (BERT, RoBERTa, DistilBERT) against transformers on random tiny checkpoints:
every head's logits, WordPiece / byte-level BPE tokenisation, sentence embeddings, fill-mask, and the
commands' bad-input contract."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import one_error_line, run_cli  # noqa: E402

from gencli.models.bert import HEADS  # noqa: E402
from gencli.pipelines.encoders.loading import load_encoder  # noqa: E402

WORDS = (
    "the a an is was of and to in it on at cat dog sat mat hello world paris capital france city river "
    "un ##believ ##able ##s ##ing ##ed run play cafe naive resume 中 国 日 本 hello , . ! ? ' - ( ) : ; "
).split()
CASED_EXTRA = "The Hello World Paris France Café café naïve Naïve".split()
CHARS = list("abcdefghijklmnopqrstuvwxyz") + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TRICKY = [
    "Hello, world! The café is naïve.",
    "unbelievable running cats",
    "中国 is in 日本? no: (xyz) qqqq",
    "Résumé  RÉSUMÉ\tnaïveté\u0000 done",
    "supercalifragilisticexpialidocious" * 4,
    "the cat sat on the mat.",
]
SENTENCES = ["the cat sat on the mat", "hello world", "paris is the capital of france", "a dog in the river", "the city"]


def bert_vocab(cased: bool) -> list[str]:
    words = WORDS + (CASED_EXTRA if cased else [])
    seen: list[str] = []
    for w in BERT_SPECIALS + words + CHARS:
        if w not in seen:
            seen.append(w)
    return seen


def tiny_config(model_type: str, vocab_size: int, **extra):
    if model_type == "bert":
        return transformers.BertConfig(
            vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64, **extra
        )
    if model_type == "roberta":
        return transformers.RobertaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            max_position_embeddings=66,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            type_vocab_size=1,
            **extra,
        )
    return transformers.DistilBertConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=64, **extra)


HF_CLASS = {
    ("bert", "base"): "BertModel",
    ("bert", "masked_lm"): "BertForMaskedLM",
    ("bert", "sequence_classification"): "BertForSequenceClassification",
    ("bert", "token_classification"): "BertForTokenClassification",
    ("bert", "question_answering"): "BertForQuestionAnswering",
    ("roberta", "base"): "RobertaModel",
    ("roberta", "masked_lm"): "RobertaForMaskedLM",
    ("roberta", "sequence_classification"): "RobertaForSequenceClassification",
    ("roberta", "token_classification"): "RobertaForTokenClassification",
    ("roberta", "question_answering"): "RobertaForQuestionAnswering",
    ("distilbert", "base"): "DistilBertModel",
    ("distilbert", "masked_lm"): "DistilBertForMaskedLM",
    ("distilbert", "sequence_classification"): "DistilBertForSequenceClassification",
    ("distilbert", "token_classification"): "DistilBertForTokenClassification",
    ("distilbert", "question_answering"): "DistilBertForQuestionAnswering",
}


def write_bert_tokenizer(folder, cased: bool = False) -> None:
    (folder / "vocab.txt").write_text("\n".join(bert_vocab(cased)) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": not cased, "tokenizer_class": "BertTokenizer"}))


def write_roberta_tokenizer(folder) -> int:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    corpus = [" ".join(SENTENCES)] * 5 + TRICKY + ["The quick brown fox jumps over the lazy dog."] * 3
    bpe.train_from_iterator(corpus, vocab_size=400, min_frequency=1, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], show_progress=False)
    bpe.save_model(str(folder))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "RobertaTokenizer"}))
    return bpe.get_vocab_size()


def build_checkpoint(folder, model_type: str, head: str, *, num_labels: int = 3, problem_type=None, seed: int = 0):
    folder.mkdir(parents=True, exist_ok=True)
    if model_type == "roberta":
        vocab_size = write_roberta_tokenizer(folder)
    else:
        write_bert_tokenizer(folder)
        vocab_size = len(bert_vocab(False))
    extra = {"num_labels": num_labels}
    if problem_type:
        extra["problem_type"] = problem_type
    cfg = tiny_config(model_type, vocab_size, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, HF_CLASS[(model_type, head)])(cfg).eval()
    with torch.no_grad():  # random LayerNorm weights and biases too, so a mix-up cannot pass unseen
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def hf_tokenizer(folder, model_type: str):
    if model_type == "roberta":
        return roberta_reference(folder)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def roberta_reference(folder):
    """transformers' RobertaTokenizer with RoBERTa's own mask token, which takes the space before it
    (``lstrip``: as roberta-base's tokenizer.json and transformers 4 define it; transformers 5 no
    longer sets it when a tokenizer is built from vocab.json + merges.txt)."""
    from tokenizers import AddedToken

    return transformers.RobertaTokenizer.from_pretrained(
        str(folder), mask_token=AddedToken("<mask>", lstrip=True, rstrip=False, special=True, normalized=False)
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    built = {}
    for mt in ("bert", "roberta", "distilbert"):
        for head in HEADS:
            folder = root / f"{mt}-{head}"
            built[(mt, head)] = (folder, build_checkpoint(folder, mt, head, num_labels=2 if head == "question_answering" else 3))
    return built


def batch_of(tok, texts, pairs=None):
    if pairs is None:
        return tok(texts, padding=True, return_tensors="pt")
    return tok(texts, pairs, padding=True, return_tensors="pt")


@pytest.mark.parametrize("model_type", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("head", HEADS)
def test_logits_equal_transformers(checkpoints, model_type, head):
    folder, ref = checkpoints[(model_type, head)]
    enc = load_encoder(folder, task=head, device="cpu", dtype="float32")
    tok = hf_tokenizer(folder, model_type)
    texts = ["the cat sat on the mat", "hello world", "paris is the capital of france and a city on a river"]
    batch = batch_of(tok, texts, ["a dog", "the city", "hello"] if model_type == "bert" else None)
    with torch.no_grad():
        out = ref(**batch)
        expected = (
            out.last_hidden_state if head == "base" else (out.logits if head != "question_answering" else torch.stack([out.start_logits, out.end_logits], -1))
        )
        got = enc.model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    mask = batch["attention_mask"].bool()
    if got.dim() == 3:  # padded positions are not compared: nothing reads them
        got, expected = got[mask], expected[mask]
    assert got.shape == expected.shape
    assert expected.std() > 1e-3
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    if head == "base" and model_type == "bert":  # BertModel's pooler is kept for the bare encoder
        torch.testing.assert_close(
            enc.model.pooled(enc.model.hidden_states(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])),
            out.pooler_output,
            atol=1e-4,
            rtol=1e-4,
        )


@pytest.mark.parametrize("problem_type,num_labels", [("multi_label_classification", 3), (None, 1)])
def test_classification_problem_types_load(tmp_path, problem_type, num_labels):
    ref = build_checkpoint(tmp_path / "m", "bert", "sequence_classification", num_labels=num_labels, problem_type=problem_type)
    enc = load_encoder(tmp_path / "m", task="sequence_classification", device="cpu", dtype="float32")
    assert enc.config.num_labels == num_labels and enc.config.problem_type == problem_type
    ids = torch.tensor([[2, 10, 11, 12, 3]])
    with torch.no_grad():
        torch.testing.assert_close(enc.model(ids), ref(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


# -- tokenizers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cased", [False, True])
def test_wordpiece_equals_transformers(tmp_path, cased):
    from gencli.tokenizers.wordpiece import load_encoder_tokenizer

    write_bert_tokenizer(tmp_path, cased=cased)
    ours = load_encoder_tokenizer(tmp_path, "bert")
    assert ours.kind.startswith("vocab.txt")
    ref = transformers.BertTokenizer(vocab=str(tmp_path / "vocab.txt"), do_lower_case=not cased)
    unk = ref.unk_token_id
    for text in TRICKY + ["[MASK] is a [MASK]."]:
        want = ref(text, return_offsets_mapping=True)
        got = ours.encode(text)
        assert got.ids == want["input_ids"], text
        assert got.offsets == [tuple(o) for o in want["offset_mapping"]], text
    real = [i for i in ours.encode(TRICKY[0]).ids if i not in (unk, ref.cls_token_id, ref.sep_token_id)]
    assert len(set(real)) > 5  # real ids, not all unknown
    a, b = "hello world", "the cat sat"
    want = ref(a, b)
    got = ours.encode(a, b)
    assert got.ids == want["input_ids"] and got.type_ids == want["token_type_ids"]
    assert ours.encode("supercalifragilisticexpialidocious" * 4).ids[1] == unk  # longer than 100 characters
    if not cased:
        assert ours.encode("Café").ids == ours.encode("cafe").ids  # lower case strips accents
    else:
        assert ours.encode("Café").ids != ours.encode("cafe").ids


def test_tokenizer_json_preferred_and_equal(tmp_path):
    from gencli.tokenizers.wordpiece import load_encoder_tokenizer

    write_bert_tokenizer(tmp_path)
    ref = transformers.BertTokenizer(vocab=str(tmp_path / "vocab.txt"), do_lower_case=True)
    ref.save_pretrained(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "tokenizer.json").is_file()
    ours = load_encoder_tokenizer(tmp_path / "saved", "bert")
    assert ours.kind == "tokenizer.json"
    for text in TRICKY:
        assert ours.encode(text).ids == ref(text)["input_ids"]


def test_roberta_bpe_equals_transformers(tmp_path):
    from gencli.tokenizers.wordpiece import load_encoder_tokenizer

    write_roberta_tokenizer(tmp_path)
    ours = load_encoder_tokenizer(tmp_path, "roberta")
    ref = roberta_reference(tmp_path)
    for text in TRICKY + ["The <mask> sat on the mat."]:
        want = ref(text, return_offsets_mapping=True)
        got = ours.encode(text)
        assert got.ids == want["input_ids"], text
        assert got.offsets == [tuple(o) for o in want["offset_mapping"]], text
    assert len(set(ours.encode("the cat sat on the mat").ids)) > 4
    want = ref("hello world", "the cat")
    assert ours.encode("hello world", "the cat").ids == want["input_ids"]


# -- embeddings ------------------------------------------------------------------------------------
def sentence_transformers_folder(folder, model_type="bert", pooling="mean", normalize=True, max_seq_length=None):
    build_checkpoint(folder, model_type, "base")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, f"pooling_mode_{pooling}": True}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    if max_seq_length:
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))


def reference_embeddings(folder, texts, pooling="mean", normalize=True, max_length=None):
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    batch = tok(texts, padding=True, truncation=max_length is not None, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    if pooling == "mean":
        v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    elif pooling == "mean_sqrt_len":
        v = (h * m).sum(1) / m.sum(1).sqrt()
    elif pooling == "cls":
        v = h[:, 0]
    else:
        v = h.masked_fill(m == 0, -1e9).max(1).values
    return torch.nn.functional.normalize(v, dim=1) if normalize else v


@pytest.mark.parametrize(
    "model_type,pooling,normalize",
    [("bert", "mean_tokens", True), ("roberta", "cls_token", False), ("distilbert", "max_tokens", True), ("bert", "mean_sqrt_len_tokens", False)],
)
def test_embed_equals_sentence_transformers_style(tmp_path, model_type, pooling, normalize):
    from gencli.pipelines.encoders.embed import embed_texts

    folder = tmp_path / "st"
    sentence_transformers_folder(folder, model_type, pooling, normalize)
    enc = load_encoder(folder, device="cpu", dtype="float32")
    mode = pooling.removesuffix("_tokens").removesuffix("_token")
    assert enc.layout.pooling == mode and enc.layout.normalize == normalize
    got = embed_texts(enc, SENTENCES, batch_size=2)  # length-sorted batches, results in input order
    want = reference_embeddings(folder, SENTENCES, mode, normalize)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got[0] - got[1]).abs().max() > 1e-3  # the inputs matter


def test_embed_cli_json_out_and_truncation(tmp_path):
    import numpy as np

    folder = tmp_path / "st"
    sentence_transformers_folder(folder, max_seq_length=6)
    res = run_cli("embed", "-m", str(folder), "-", "--json", "--batch-size", "2", "--dtype", "float32", input="\n".join(SENTENCES) + "\n")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["text"] for r in rows] == SENTENCES
    want = reference_embeddings(folder, SENTENCES, max_length=6)
    torch.testing.assert_close(torch.tensor([r["embedding"] for r in rows]), want, atol=1e-4, rtol=1e-4)
    assert "truncated" in res.stderr and "token(s) cut" in res.stderr
    out = tmp_path / "m.npy"
    res = run_cli("embed", "-m", str(folder), *SENTENCES[:2], "--out", str(out), "--no-normalize", "--pooling", "cls", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    mat = np.load(out)
    want = reference_embeddings(folder, SENTENCES[:2], "cls", False, max_length=6)
    np.testing.assert_allclose(mat, want.numpy(), atol=1e-4)


# -- fill-mask -------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["bert", "roberta", "distilbert"])
def test_fill_mask_equals_pipeline(checkpoints, model_type):
    from gencli.pipelines.encoders.fill_mask import fill_mask

    folder, ref = checkpoints[(model_type, "masked_lm")]
    tok = hf_tokenizer(folder, model_type)
    pipe = transformers.pipeline("fill-mask", model=ref, tokenizer=tok, device="cpu")
    enc = load_encoder(folder, task="masked_lm", device="cpu", dtype="float32")
    texts = ["the cat sat on the [MASK].", "paris is the [MASK] of france", "hello [MASK] world [MASK]"]
    got = fill_mask(enc, texts, top_k=4)
    tops = set()
    for text, per_mask in zip(texts, got):
        want = pipe(text.replace("[MASK]", tok.mask_token), top_k=4)
        want = [want] if isinstance(want[0], dict) else want
        assert len(per_mask) == len(want)
        for g, w in zip(per_mask, want):
            assert [p["token"] for p in g] == [p["token"] for p in w]
            assert [p["token_str"] for p in g] == [p["token_str"] for p in w]
            assert [p["sequence"] for p in g] == [p["sequence"] for p in w]
            for a, b in zip(g, w):
                assert abs(a["score"] - b["score"]) < 1e-5
            tops.add(g[0]["token"])
    assert len(tops) > 1  # the random model's predictions depend on the input


def test_fill_mask_cli(checkpoints):
    folder, _ = checkpoints[("bert", "masked_lm")]
    res = run_cli("fill-mask", "-m", str(folder), "the cat sat on the [MASK].", "[MASK] and [MASK]", "--json", "-k", "3")
    assert res.returncode == 0, res.stderr
    a, b = (json.loads(line) for line in res.stdout.splitlines())
    assert a["text"] == "the cat sat on the [MASK]." and len(a["predictions"]) == 3
    assert set(a["predictions"][0]) == {"score", "token", "token_str", "sequence"}
    assert len(b["predictions"]) == 2 and all(len(p) == 3 for p in b["predictions"])


# -- bad input -------------------------------------------------------------------------------------
def test_bad_input(checkpoints, tmp_path):
    mlm, _ = checkpoints[("bert", "masked_lm")]
    one_error_line(run_cli("fill-mask", "-m", str(mlm), "no mask here"), "mask")
    one_error_line(run_cli("embed", "-m", str(mlm), ""), "empty")
    one_error_line(run_cli("fill-mask", "no mask here"), "mask")  # the embedded default too
    # a mask cut off by the window: raising --max-length helps only below the model's positions (64)
    long_text = "the cat sat " * 40 + "[MASK]"
    line = one_error_line(run_cli("fill-mask", "-m", str(mlm), long_text, "--max-length", "16"), "lost its mask token", "at 16 tokens")
    assert "raise --max-length" in line
    line = one_error_line(run_cli("fill-mask", "-m", str(mlm), long_text, "--max-length", "100000"), "at 64 tokens", "at most 64 tokens")
    assert "raise --max-length" not in line
    base, _ = checkpoints[("bert", "base")]
    one_error_line(run_cli("fill-mask", "-m", str(base), "[MASK] x"), "not a masked-language model")
    one_error_line(run_cli("embed", "-m", str(mlm), "x", "--out", str(tmp_path / "a.txt")), ".npy")
    gpt2 = tmp_path / "gpt2"
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(gpt2, safe_serialization=True)
    one_error_line(run_cli("embed", "-m", str(gpt2), "hello"), "gencli generate")


def test_sharded_checkpoint_and_texts_file(tmp_path):
    folder = tmp_path / "sharded"
    ref = build_checkpoint(folder, "bert", "masked_lm")
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    ref.save_pretrained(folder, safe_serialization=True, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    enc = load_encoder(folder, task="masked_lm", device="cpu", dtype="float32")
    ids = torch.tensor([[2, 10, 4, 12, 3]])
    with torch.no_grad():
        torch.testing.assert_close(enc.model(ids), ref(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    texts = tmp_path / "texts.txt"
    texts.write_text("the [MASK] sat\n\nhello [MASK]\n")
    res = run_cli("fill-mask", "-m", str(folder), "--texts-file", str(texts), "--json", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    assert [json.loads(line)["text"] for line in res.stdout.splitlines()] == ["the [MASK] sat", "hello [MASK]"]


def test_roberta_window_and_default_dtype(checkpoints):
    from gencli.pipelines.encoders.embed import embed_texts

    folder, _ = checkpoints[("roberta", "base")]
    enc = load_encoder(folder, device="cpu", dtype="float32")
    assert enc.max_length == 64  # 66 positions, the first two below RoBERTa's padding index + 1
    warnings = []
    vec = embed_texts(enc, ["the cat " * 80], warn=warnings.append)
    assert vec.shape == (1, 32) and torch.isfinite(vec).all()
    assert len(warnings) == 1 and "64-token window" in warnings[0]
    res = run_cli("embed", "-m", str(folder), "the cat sat", "--json")  # --dtype auto (bf16 where the CPU has it)
    assert res.returncode == 0, res.stderr
    auto = torch.tensor(json.loads(res.stdout)["embedding"])
    want = embed_texts(enc, ["the cat sat"])[0]
    assert torch.nn.functional.cosine_similarity(auto, want, dim=0) > 0.99


def test_keymap_names():
    from gencli.models.bert import EncoderConfig, keymap

    bert = EncoderConfig.from_hf({"model_type": "bert", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})
    plan = keymap(bert, "base", keep_pooler=False).plan(
        ["embeddings.LayerNorm.gamma", "embeddings.position_ids", "pooler.dense.weight", "cls.predictions.bias", "cls.seq_relationship.weight"]
    )
    assert set(plan) == {"bert.embeddings.LayerNorm.weight"}
    distil = EncoderConfig.from_hf({"model_type": "distilbert", "vocab_size": 10, "dim": 8, "n_layers": 1, "n_heads": 2, "hidden_dim": 16})
    assert (distil.hidden_size, distil.intermediate_size, distil.type_vocab_size) == (8, 16, 0)
    plan = keymap(distil, "masked_lm", keep_pooler=False).plan(
        ["distilbert.transformer.layer.0.ffn.lin1.weight", "vocab_projector.weight", "vocab_projector.bias"]
    )
    assert set(plan) == {"distilbert.encoder.layer.0.intermediate.dense.weight", "vocab_projector.bias"}


@pytest.mark.parametrize("name", ["embed", "fill-mask", "classify-text", "ner", "qa"])
def test_command_help_is_torch_free(name):
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "gencli", name, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-500:]
    assert "--model" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "typer" in imported and "torch" not in imported
