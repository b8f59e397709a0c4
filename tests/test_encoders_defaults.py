"""The embedded encoder defaults: bert-pystdlib (the default of `gencli fill-mask` and `gencli embed`)
and the shapes-world task heads (`gencli ner`, `classify-text`, `qa`): they load in transformers with
the same logits, the commands run without --model, and the heads do their task on held-out captions."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from conftest import run_cli  # noqa: E402

from gencli.weights import list_defaults, weights_dir  # noqa: E402

BASE = weights_dir() / "bert-pystdlib"
HEADS = {"ner": "bert-shapes-ner", "classify-text": "bert-shapes-classify", "qa": "bert-shapes-qa"}


def test_base_is_small_fp16_and_listed():
    from safetensors import safe_open

    assert (BASE / "model.safetensors").stat().st_size < 10 * 2**20
    with safe_open(str(BASE / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    entry = next(d for d in list_defaults() if d.name == "bert-pystdlib")
    assert entry.commands == ["fill-mask"] and "top-1" in entry.summary


def test_base_loads_in_transformers_with_the_same_logits():
    transformers = pytest.importorskip("transformers")
    from gencli.pipelines.encoders.loading import load_encoder

    ref, info = transformers.BertForMaskedLM.from_pretrained(str(BASE), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = transformers.AutoTokenizer.from_pretrained(str(BASE))
    enc = load_encoder(BASE, task="masked_lm", device="cpu", dtype="float32")
    batch = tok(["Return the [MASK] of the list.", "Raise ValueError if the file does not exist."], padding=True, return_tensors="pt")
    with torch.inference_mode():
        got = enc.model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        expected = ref.eval()(**batch).logits
    mask = batch["attention_mask"].bool()
    assert (got[mask] - expected[mask]).abs().max().item() < 1e-3
    assert enc.tokenizer.encode("Return the [MASK] of the list.").ids == batch["input_ids"][0][mask[0]].tolist()


def test_fill_mask_and_embed_without_model():
    r = run_cli("fill-mask", "--json", "-k", "3", "Return a copy of the [MASK].")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert len(rec["predictions"]) == 3 and all(p["sequence"] for p in rec["predictions"])
    r = run_cli("embed", "--json", "read the file", "write the file")
    assert r.returncode == 0, r.stderr
    vecs = [json.loads(line)["embedding"] for line in r.stdout.splitlines()]
    embed_cfg = json.loads((weights_dir() / "bert-shapes-embed" / "config.json").read_text())
    assert len(vecs) == 2 and len(vecs[0]) == embed_cfg["hidden_size"]
    assert all(abs(sum(v * v for v in vec) - 1.0) < 1e-3 for vec in vecs)  # its folder says: normalise


def head(command):
    folder = weights_dir() / HEADS[command]
    if not folder.is_dir():
        pytest.skip(f"{HEADS[command]} is not shipped")
    return folder


def test_ner_default_tags_a_caption():
    head("ner")
    text = "a small red star at the top left on a blue background"
    r = run_cli("ner", "--json", text)
    assert r.returncode == 0, r.stderr
    found = {(text[e["start"] : e["end"]], e["entity_group"]) for e in json.loads(r.stdout)["entities"]}
    assert {("red", "COLOUR"), ("star", "SHAPE"), ("small", "SIZE"), ("top left", "POSITION"), ("blue", "BACKGROUND")} <= found


def test_classify_text_default_names_the_shape():
    head("classify-text")
    r = run_cli("classify-text", "--json", "-k", "1", "a large green heart in the center", "a picture of a small cyan crescent at the top, on a red background")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["labels"][0]["label"] for line in r.stdout.splitlines()] == ["heart", "crescent"]


def test_qa_default_answers_about_a_caption():
    head("qa")
    ctx = "a picture of a small red star at the top left, on a blue background"
    r = run_cli("qa", "--json", "--context", ctx, "what colour is the star?", "how big is the star?", "what colour is the background?")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["answer"] for line in r.stdout.splitlines()] == ["red", "small", "blue"]


@pytest.mark.parametrize("command", sorted(HEADS))
def test_heads_listed_with_their_score(command):
    head(command)
    entry = next(d for d in list_defaults() if d.name == HEADS[command])
    assert entry.commands[0] == command and "held-out" in entry.summary
    assert (entry.path / "model.safetensors").stat().st_size < 6 * 2**20
