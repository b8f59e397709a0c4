"""The contrastive sentence embedding: scripts/train_sentence_embedding.py (its data, loss and scores,
a tiny run that resumes and exports a sentence-transformers folder) and the shipped
weights/bert-shapes-embed (its held-out retrieval floors through `gencli embed`'s own code); and the
encoder's fast paths (unpadded token-wise work, first-token-only classifier, masked-positions-only
fill-mask head) against the plain computation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gencli.data import shapes, shapes_text2text  # noqa: E402
from gencli.weights import list_defaults, weights_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EMBED = weights_dir() / "bert-shapes-embed"


@pytest.fixture(scope="module")
def tse():
    sys.path.insert(0, str(ROOT))
    from scripts import train_sentence_embedding

    return train_sentence_embedding


def test_a_mutation_changes_exactly_one_attribute(tse):
    rng = np.random.default_rng(0)
    for seed in range(200):
        scene = shapes.make_scene(seed)
        other = tse.mutate(scene, rng)
        a, b = scene.labels(), other.labels()
        diffs = int(a["background"] != b["background"]) + sum(
            x[k] != y[k] for x, y in zip(a["objects"], b["objects"]) for k in ("shape", "colour", "size", "position")
        )
        assert diffs == 1, (a, b)


def test_a_swap_keeps_the_words_and_changes_the_binding(tse):
    found = 0
    for seed in range(100):
        scene = shapes.make_scene(seed)
        for what in tse.SWAPPABLE:
            other = tse.swapped(scene, what)
            if other is None:
                continue
            found += 1
            assert shapes_text2text.structure(other) != shapes_text2text.structure(scene)
            for style in tse.TRAIN_STYLES + tse.HELDOUT_STYLES:
                a, b = tse.caption(scene, style), tse.caption(other, style)
                assert sorted(a.replace(",", " ").split()) == sorted(b.replace(",", " ").split())
    assert found > 50
    # a bag of words cannot tell a swap from the scene: exactly one half by construction
    groups = {"trained_styles": [("full", "list")], "heldout_styles": [("paren", "full")]}
    scores = tse.binding_scores(None, groups, 40)
    assert scores["trained_styles"] == scores["heldout_styles"] == 0.5


def test_batches_pair_two_styles_of_one_scene(tse):
    a, b, desc = tse.make_batch(np.random.default_rng(1), 16)
    assert len(a) == len(b) == len(desc) == 16
    for x, y in zip(a, b):
        assert x != y  # two different trained styles
    # the second half are one-attribute variants of the first: never the same description
    assert all(desc[i] != desc[i + 8] for i in range(8))


def test_contrastive_loss_ignores_duplicate_scenes(tse):
    z = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    perfect = tse.contrastive_loss(z, z, ["a", "b", "c", "d"], 0.05)
    # scenes 0 and 1 have the same description: each is not a negative of the other
    dup = tse.contrastive_loss(torch.stack([z[0], z[0], z[2], z[3]]), torch.stack([z[0], z[0], z[2], z[3]]), ["a", "a", "c", "d"], 0.05)
    assert dup.item() < 1e-3 and perfect.item() < 0.1
    worse = tse.contrastive_loss(z, z.flip(0), ["a", "b", "c", "d"], 0.05)
    assert worse.item() > 1.0


def test_ranking_scores_count_what_they_say(tse):
    q = torch.eye(3)
    g = torch.tensor([[1.0, 0, 0], [0, 0, 1.0], [0, 1.0, 0]])  # scene 0 right, 1 and 2 swapped
    recall, ordered = tse.ranking_scores(q, g)
    assert recall == pytest.approx(1 / 3)
    # query 0: both others below its own; queries 1 and 2: their own (similarity 0) above neither
    # (a tie is not ordered correctly)
    assert ordered == pytest.approx((2 + 0 + 0) / 6)
    g2 = torch.tensor([[1.0, 0, 0], [0, 0.6, 0.8], [0, 0.8, 0.6]])  # query 1: own 0.6 vs 0 and 0.8
    assert tse.ranking_scores(q, g2) == (pytest.approx(1 / 3), pytest.approx((2 + 1 + 1) / 6))


def test_heldout_scenes_are_test_scenes_with_distinct_descriptions(tse):
    scenes = tse.heldout_scenes(300)
    assert all(shapes.split_of(s.seed) == "test" for s in scenes)
    assert len({shapes_text2text.structure(s) for s in scenes}) == 300


def test_a_tiny_run_resumes_and_exports_a_sentence_transformers_folder(tse, monkeypatch, tmp_path, capsys):
    out, run = tmp_path / "embed", tmp_path / "run"
    monkeypatch.setattr(tse, "evaluate", lambda folder, threads=1: {"evaluated": "by its own test"})
    threads = torch.get_num_threads()
    try:
        for steps in (2, 3):
            monkeypatch.setattr(sys, "argv", ["x", "--out", str(out), "--run-dir", str(run), "--steps", str(steps), "--batch", "4", "--warmup", "1"])
            tse.main()
    finally:
        torch.set_num_threads(threads)
    assert "resumed at step 2" in capsys.readouterr().out
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertModel"]
    assert json.loads((out / "training.json").read_text())["step"] == 3
    from gencli.pipelines.encoders.embed import embed_texts
    from gencli.pipelines.encoders.loading import load_encoder

    enc = load_encoder(out, device="cpu", dtype="float32")
    assert enc.layout.found and enc.layout.normalize and enc.layout.pooling == "mean"
    v = embed_texts(enc, ["a red star", "a blue square on a white background"])
    torch.testing.assert_close(v.norm(dim=-1), torch.ones(2))


# -- the shipped default -------------------------------------------------------------------------
def shipped():
    if not (EMBED / "model.safetensors").is_file():
        pytest.skip("bert-shapes-embed is not shipped")
    return EMBED


def test_default_is_small_fp16_listed_and_loads_in_transformers():
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    folder = shipped()
    assert (folder / "model.safetensors").stat().st_size < 6 * 2**20
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    entry = next(d for d in list_defaults() if d.name == "bert-shapes-embed")
    assert entry.commands[0] == "embed" and "held-out" in entry.summary
    from gencli.pipelines.encoders.embed import embed_texts
    from gencli.pipelines.encoders.loading import load_encoder

    texts = ["a small red star at the top left on a blue background", "green heart, large, center, black background"]
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    got = embed_texts(load_encoder(folder, device="cpu", dtype="float32"), texts)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_default_finds_captions_of_the_same_scene(tse):
    folder = shipped()
    figures = tse.evaluate(folder, sizes=(100,))
    recorded = json.loads((folder / "training.json").read_text())["heldout"]
    for group in ("trained_styles", "heldout_styles"):
        # the recorded figures (1000 scenes) are what the README states; these floors sit below them
        assert figures[group]["recall@1_n100"] >= recorded[group]["recall@1_n100"] - 0.02
        assert figures[group]["ordered_pairs_n100"] > 0.95
    base = tse.evaluate(weights_dir() / "bert-pystdlib", sizes=(100,))
    assert figures["heldout_styles"]["recall@1_n100"] > base["heldout_styles"]["recall@1_n100"] + 0.2


# -- the encoder's fast paths --------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_bert():
    from gencli.models.bert import EncoderConfig, EncoderForTask

    cfg = EncoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, num_labels=3)
    torch.manual_seed(0)
    models = {head: EncoderForTask(cfg, head).eval() for head in ("base", "sequence_classification", "masked_lm")}
    for m in models.values():  # one set of encoder weights
        m.load_state_dict(models["base"].state_dict(), strict=False)
        for p in m.parameters():
            if p.std() == 0:
                torch.nn.init.normal_(p, 0, 0.2)
    lengths = [7, 3, 5, 1]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, 50, (n,))
    return models, ids, lengths


def test_unpadded_batch_equals_each_sequence_alone(small_bert):
    models, ids, lengths = small_bert
    mask = ids.ne(0).long()
    with torch.no_grad():
        batched = models["base"](ids, mask)
        for i, n in enumerate(lengths):
            alone = models["base"](ids[i : i + 1, :n])  # no padding: the plain path
            torch.testing.assert_close(batched[i, :n], alone[0], atol=1e-5, rtol=1e-5)
        assert batched[mask == 0].abs().max() == 0  # padded positions come back as zeros


def test_first_token_only_classifier_equals_the_full_last_layer(small_bert):
    models, ids, lengths = small_bert
    model = models["sequence_classification"]
    mask = ids.ne(0).long()
    with torch.no_grad():
        full = model.base(ids, mask)  # every position through every layer
        expected = model.classifier(model.base.pooler(full))
        torch.testing.assert_close(model(ids, mask), expected, atol=1e-5, rtol=1e-5)


def test_masked_lm_head_on_selected_positions(small_bert):
    models, ids, lengths = small_bert
    model = models["masked_lm"]
    mask = ids.ne(0).long()
    with torch.no_grad():
        logits = model(ids, mask)
        h = model.hidden_states(ids, mask)
        rows, cols = torch.tensor([0, 2, 2]), torch.tensor([3, 0, 4])
        torch.testing.assert_close(model.head_output(h[rows, cols]), logits[rows, cols], atol=1e-5, rtol=1e-5)
