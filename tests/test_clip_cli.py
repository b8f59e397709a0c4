"""`gencli zeroshot` and `gencli similarity` end to end on a small random CLIP in transformers' layout:
scores identical to transformers' own pipeline, inputs (files, directories, stdin), output formats,
per-file errors and the exit-code contract."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch
from conftest import write_scene_folder
from typer.testing import CliRunner

from gencli.cli import app
from gencli.data import shapes
from gencli.tokenizers.clip_bpe import train_bpe

transformers = pytest.importorskip("transformers")
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402

LABELS = ["red star", "blue circle", "green heart", "a yellow square"]
TEMPLATES = ["a photo of a {}.", "{} on a background"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip")
    corpus = [shapes.make_scene(s).caption(style) for s in range(300) for style in shapes.CAPTION_STYLES] + TEMPLATES
    tok = train_bpe(corpus, 300)
    tok.save(path)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=tok.vocab_size, max_position_embeddings=77,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model = transformers.CLIPModel(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights large enough that the scores are far from uniform
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        model.logit_scale.fill_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = write_scene_folder(tmp_path_factory.mktemp("images"), [(48, 40), (64, 40), (80, 40)])
    (root / "broken.png").write_bytes(b"not an image")
    return root


def invoke(*args, input=None):
    return CliRunner().invoke(app, [*map(str, args)], input=input)


def _reference(model_dir, paths, labels, templates):
    """transformers' way: CLIPTokenizer + CLIPImageProcessor + CLIPModel, prompt embeddings averaged."""
    from PIL import Image

    model = transformers.CLIPModel.from_pretrained(str(model_dir)).eval()
    tok = transformers.CLIPTokenizer.from_pretrained(str(model_dir))
    proc = CLIPImageProcessorPil.from_pretrained(str(model_dir))
    with torch.no_grad():
        per_template = []
        for t in templates:
            inputs = tok([t.replace("{}", label) for label in labels], padding=True, return_tensors="pt")
            e = model.get_text_features(**inputs).pooler_output
            per_template.append(e / e.norm(dim=-1, keepdim=True))
        text = torch.stack(per_template).mean(0)
        text = text / text.norm(dim=-1, keepdim=True)
        px = proc([Image.open(p).convert("RGB") for p in paths], return_tensors="pt")["pixel_values"]
        img = model.get_image_features(pixel_values=px).pooler_output
        img = img / img.norm(dim=-1, keepdim=True)
        cos = img @ text.t()
        return cos, (model.logit_scale.exp() * cos).softmax(dim=-1)


def test_zeroshot_scores_match_transformers(model_dir, images):
    paths = [images / "img0.png", images / "img1.png", images / "img2.png"]
    args = ["zeroshot", *paths, "--model", model_dir, "--labels", ",".join(LABELS), "--json", "--dtype", "float32", "-k", "10"]
    r = invoke(*args, *[x for t in TEMPLATES for x in ("--template", t)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    _, probs = _reference(model_dir, paths, LABELS, TEMPLATES)
    assert probs.max() > 0.5  # the check below is not between two uniform distributions
    for row, path, want in zip(rows, paths, probs):
        assert row["image"] == str(path)
        preds = row["predictions"]
        assert [p["score"] for p in preds] == sorted((p["score"] for p in preds), reverse=True)
        assert {p["label"] for p in preds} == set(LABELS)
        for p in preds:
            assert abs(p["score"] - float(want[LABELS.index(p["label"])])) < 1e-4
    # one template only: a different ensemble, still transformers' numbers
    r = invoke("zeroshot", paths[0], "--model", model_dir, "--labels", ",".join(LABELS), "--json", "--dtype", "float32", "--template", TEMPLATES[1], "-k", "1")
    _, probs = _reference(model_dir, paths[:1], LABELS, TEMPLATES[1:])
    top = json.loads(r.stdout)["predictions"]
    assert len(top) == 1 and top[0]["label"] == LABELS[int(probs[0].argmax())]
    assert abs(top[0]["score"] - float(probs[0].max())) < 1e-4


def test_label_embeddings_are_computed_once(model_dir, images, monkeypatch):
    from gencli.pipelines.clip.loading import ClipBundle

    calls = []
    original = ClipBundle.encode_texts

    def counting(self, texts, *a, **k):
        calls.append(len(texts))
        return original(self, texts, *a, **k)

    monkeypatch.setattr(ClipBundle, "encode_texts", counting)
    r = invoke(
        "zeroshot",
        images,
        "--recursive",
        "--model",
        model_dir,
        "--labels",
        ",".join(LABELS),
        "--template",
        TEMPLATES[0],
        "--template",
        TEMPLATES[1],
        "--batch-size",
        "1",
        "--json",
    )
    assert r.exit_code == 2  # broken.png
    assert len([x for x in r.stdout.splitlines() if '"predictions"' in x]) == 4
    assert calls == [len(LABELS) * len(TEMPLATES)]


def test_inputs_stdin_labels_file_errors_and_table(model_dir, images, tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text("red star\n\nblue circle\n")
    r = invoke(
        "zeroshot",
        "-",
        "--model",
        model_dir,
        "--labels-file",
        labels,
        "-k",
        "2",
        input=f"{images / 'img2.png'}\n{images / 'broken.png'}\n{images / 'img0.png'}\n",
    )
    assert r.exit_code == 2
    out = r.stdout
    assert out.index("img2.png") < out.index("img0.png") and "red star" in out and "blue circle" in out
    assert "broken.png" in r.stderr and "could not be read" in r.stderr
    # JSON: the error has its own line, in input order
    r = invoke("zeroshot", images / "broken.png", images / "img1.png", "--model", model_dir, "--labels", "a,b", "--json")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.exit_code == 2 and "error" in lines[0] and "predictions" in lines[1]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--labels", " , "], "no labels"),
        (["--labels", "a,b,a"], "given twice"),
        (["--labels", "a,b", "--template", "a photo"], "no {}"),
        (["--labels-file", "/nonexistent/labels.txt"], "cannot read"),
        (["--labels", "a,b", "--model", "/nonexistent/model"], "does not exist"),
        (["--labels", "a,b", "--labels-file", "/dev/null"], "either --labels or --labels-file, not both"),
    ],
)
def test_bad_usage_exits_2_with_one_line(model_dir, images, args, message):
    args = args if "--model" in args else [*args, "--model", model_dir]
    r = invoke("zeroshot", images / "img0.png", *args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and "Traceback" not in r.output


def test_one_label_and_over_long_labels_get_a_notice(model_dir, images):
    r = invoke("zeroshot", images / "img0.png", "--model", model_dir, "--labels", "star", "--json")
    assert r.exit_code == 0 and "warning: one label ('star'): every image scores 1.0" in r.stderr, r.stderr
    long_label = " ".join(["star"] * 100)
    r = invoke("zeroshot", images / "img0.png", "--model", model_dir, "--labels", f"circle,{long_label}", "--json")
    assert r.exit_code == 0, r.stderr
    notices = [line for line in r.stderr.splitlines() if "truncated" in line]
    assert len(notices) == 1 and notices[0].startswith("warning: label 2 was truncated to the 77-token window of CLIP; dropped:"), r.stderr


def test_stdin_cannot_be_both_images_and_labels(model_dir):
    r = invoke("zeroshot", "-", "--labels-file", "-", "--model", model_dir, input="x\n")
    assert r.exit_code == 2 and "stdin" in r.stderr


def test_a_model_without_both_towers_is_refused(tmp_path, images):
    cfg = transformers.CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    transformers.CLIPTextModel(cfg).save_pretrained(tmp_path, safe_serialization=True)
    r = invoke("zeroshot", images / "img0.png", "--labels", "a,b", "--model", tmp_path)
    assert r.exit_code == 2 and "holds a CLIPTextModel (a CLIP text encoder), not an image-text model" in r.stderr, r.stderr


def test_similarity_matrix_formats(model_dir, images, tmp_path):
    paths = [images / "img0.png", images / "img1.png"]
    texts = ["a red star, large", "a blue circle"]
    common = ["similarity", *paths, "--model", model_dir, "--dtype", "float32", "--texts", texts[0], "--texts", texts[1]]
    cos, _ = _reference(model_dir, paths, texts, ["{}"])
    r = invoke(*common, "--json")
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    for row, want in zip(rows, cos):
        assert [s["text"] for s in row["similarities"]] == texts
        assert all(abs(s["cosine"] - float(w)) < 1e-4 for s, w in zip(row["similarities"], want))
    r = invoke(*common, "--csv")
    table = list(csv.reader(io.StringIO(r.stdout)))
    assert table[0] == ["image", *texts] and len(table) == 3
    assert abs(float(table[2][2]) - float(cos[1, 1])) < 1e-4
    r = invoke(*common)
    assert r.exit_code == 0 and "a blue circle" in r.stdout and "img1.png" in r.stdout
    # --images as an option, a directory, and an output file that is never overwritten silently
    target = tmp_path / "sim.csv"
    r = invoke("similarity", "--images", images / "sub", "--model", model_dir, "--texts", "x", "--csv", "--out", target)
    assert r.exit_code == 0 and target.read_text().splitlines()[1].startswith(str(images / "sub" / "deep.jpg"))
    r = invoke("similarity", "--images", images / "sub", "--model", model_dir, "--texts", "x", "--csv", "--out", target)
    assert r.exit_code == 2 and "already exists" in r.stderr
    r = invoke("similarity", "-i", images / "sub", "--model", model_dir, "--texts", "x", "--out", target, "--force")
    assert r.exit_code == 0 and "deep.jpg" in target.read_text()


def test_similarity_bad_usage(model_dir, images, tmp_path):
    r = invoke("similarity", images / "img0.png", "--model", model_dir)
    assert r.exit_code == 2 and "no texts" in r.stderr
    r = invoke("similarity", "--texts", "a", "--model", model_dir)
    assert r.exit_code == 2 and "no images" in r.stderr
    r = invoke("similarity", images / "img0.png", "--texts", "a", "--csv", "--json", "--model", model_dir)
    assert r.exit_code == 2 and "exclusive" in r.stderr
    texts = tmp_path / "texts.txt"
    texts.write_text("a red star\na blue circle\n")
    r = invoke("similarity", images / "img0.png", images / "broken.png", "--texts-file", texts, "--model", model_dir, "--json")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.exit_code == 2 and len(lines[0]["similarities"]) == 2 and "error" in lines[1]


def test_model_folder_recommends_its_templates(model_dir, images, tmp_path):
    """Without --template a model's zeroshot_templates.json is used (the embedded default ships one);
    an explicit --template wins; a malformed file is one clear error."""
    import shutil

    folder = tmp_path / "clip"
    shutil.copytree(model_dir, folder)
    (folder / "zeroshot_templates.json").write_text(json.dumps(TEMPLATES))
    img = images / "img0.png"

    def scores(*extra):
        r = invoke("zeroshot", img, "--model", folder, "--labels", ",".join(LABELS), "--json", "--dtype", "float32", "-k", "10", *extra)
        assert r.exit_code == 0, r.output
        return {p["label"]: p["score"] for p in json.loads(r.stdout)["predictions"]}

    implicit = scores()
    explicit = scores("--template", TEMPLATES[0], "--template", TEMPLATES[1])
    assert implicit == explicit
    _, probs = _reference(model_dir, [img], LABELS, ["a photo of a {}."])
    overridden = scores("--template", "a photo of a {}.")
    assert overridden != implicit
    assert all(abs(overridden[label] - float(probs[0, i])) < 1e-4 for i, label in enumerate(LABELS))
    for bad in ('{"templates": 1}', "[]", '["no placeholder"]', "not json"):
        (folder / "zeroshot_templates.json").write_text(bad)
        r = invoke("zeroshot", img, "--model", folder, "--labels", "a,b")
        assert r.exit_code == 2, (bad, r.output)
        assert "zeroshot_templates.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1, (bad, r.stderr)
