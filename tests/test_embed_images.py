"""`gencli embed --images` (CLIP image tower, ViT [CLS] feature, SimCLR encoder), `embed TEXT -m CLIP`
(the text tower), the `--query` neighbour listing, the matrix outputs and the bad-input contract,
against transformers on small random checkpoints."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, one_error_line, write_scene_folder
from PIL import Image
from typer.testing import CliRunner

from gencli.cli import app
from gencli.data import shapes
from gencli.models.simclr import SimCLRConfig, SimCLREncoder
from gencli.tokenizers.clip_bpe import train_bpe
from gencli.weights import weights_dir

transformers = pytest.importorskip("transformers")
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil  # noqa: E402

TEXTS = ["a red star", "a small blue circle at the top left", "green heart on a white background"]


def invoke(*args, input=None):
    return CliRunner().invoke(app, ["embed", *map(str, args)], input=input)


def rows(result) -> list[dict]:
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = write_scene_folder(tmp_path_factory.mktemp("images"), [(48, 40), 64, (80, 56), 64])
    return root


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip")
    corpus = [shapes.make_scene(s).caption(style) for s in range(200) for style in shapes.CAPTION_STYLES] + TEXTS
    tok = train_bpe(corpus, 300)
    tok.save(path)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=tok.vocab_size, max_position_embeddings=77,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    model = transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(path, safe_serialization=True)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def _pil(paths):
    return [Image.open(p).convert("RGB") for p in paths]


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _features(out):  # transformers 5 returns a model output whose pooler_output is the projection
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def test_clip_image_and_text_embeddings_equal_transformers(clip_dir, images):
    paths = [images / f"img{i}.png" for i in range(4)]
    model = transformers.CLIPModel.from_pretrained(str(clip_dir)).eval()
    px = CLIPImageProcessorPil.from_pretrained(str(clip_dir))(_pil(paths), return_tensors="pt")["pixel_values"]
    tok = transformers.CLIPTokenizer.from_pretrained(str(clip_dir))
    with torch.no_grad():
        want_img = _unit(_features(model.get_image_features(pixel_values=px)))
        want_txt = _unit(_features(model.get_text_features(**tok(TEXTS, padding=True, return_tensors="pt"))))
    got = rows(invoke("--images", *paths, "-m", clip_dir, "--json", "--dtype", "float32", "--batch-size", "3"))
    assert [r["image"] for r in got] == [str(p) for p in paths]
    got_img = torch.tensor([r["embedding"] for r in got])
    torch.testing.assert_close(got_img, want_img, atol=1e-4, rtol=0)
    got = rows(invoke(*TEXTS, "-m", clip_dir, "--json", "--dtype", "float32"))
    assert [r["text"] for r in got] == TEXTS
    got_txt = torch.tensor([r["embedding"] for r in got])
    torch.testing.assert_close(got_txt, want_txt, atol=1e-4, rtol=0)
    # texts and images compare by dot product: the cosine similarities transformers gives
    torch.testing.assert_close(got_img @ got_txt.t(), want_img @ want_txt.t(), atol=1e-4, rtol=0)
    raw = rows(invoke(TEXTS[0], "-m", clip_dir, "--json", "--dtype", "float32", "--no-normalize"))
    with torch.no_grad():
        want_raw = _features(model.get_text_features(**tok(TEXTS[:1], return_tensors="pt")))
    torch.testing.assert_close(torch.tensor(raw[0]["embedding"])[None], want_raw, atol=1e-4, rtol=1e-4)


def test_clip_without_center_crop_embeds_non_square_images(clip_dir, images, tmp_path):
    """A CLIP processor that resizes without cropping gives non-square pixels: the position embeddings
    are interpolated (transformers' interpolate_pos_encoding=True), one size group at a time."""
    folder = tmp_path / "clip-nocrop"
    shutil.copytree(clip_dir, folder)
    CLIPImageProcessorPil(size={"height": 32, "width": 48}, do_center_crop=False).save_pretrained(folder)
    paths = [images / f"img{i}.png" for i in range(4)]
    model = transformers.CLIPModel.from_pretrained(str(folder)).eval()
    px = CLIPImageProcessorPil.from_pretrained(str(folder))(_pil(paths), return_tensors="pt")["pixel_values"]
    assert tuple(px.shape[-2:]) == (32, 48)
    with torch.no_grad():
        want = _unit(_features(model.get_image_features(pixel_values=px, interpolate_pos_encoding=True)))
    got = rows(invoke("--images", *paths, "-m", folder, "--json", "--dtype", "float32"))
    torch.testing.assert_close(torch.tensor([r["embedding"] for r in got]), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bare", [False, True])
def test_vit_embedding_is_the_cls_token_after_the_final_layernorm(tmp_path, images, bare):
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8, num_labels=3)
    model = (transformers.ViTModel(cfg) if bare else transformers.ViTForImageClassification(cfg)).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    ViTImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    paths = [images / f"img{i}.png" for i in range(3)]
    px = ViTImageProcessorPil.from_pretrained(str(tmp_path))(_pil(paths), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        vit = model if bare else model.vit
        want = vit(pixel_values=px).last_hidden_state[:, 0]
    got = torch.tensor([r["embedding"] for r in rows(invoke("--images", *paths, "-m", tmp_path, "--json", "--dtype", "float32"))])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    unit = torch.tensor([r["embedding"] for r in rows(invoke("--images", *paths, "-m", tmp_path, "--json", "--dtype", "float32", "--normalize"))])
    torch.testing.assert_close(unit, _unit(want), atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def simclr_dir(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_simclr import export

    path = tmp_path_factory.mktemp("simclr")
    enc = SimCLREncoder(SimCLRConfig(image_size=32, stem_channels=8, block_out_channels=(8, 16), norm_num_groups=4))
    enc.init_weights(torch.Generator().manual_seed(1))
    export(enc.eval(), path, {"format": "pt"})
    return path


def test_simclr_embedding_is_the_pooled_encoder_output(simclr_dir, images):
    from gencli.checkpoints.formats import open_source
    from gencli.checkpoints.loader import load_model
    from gencli.checkpoints.reader import open_reader
    from gencli.pipelines.vision.images import ImageProcessor

    paths = [images / f"img{i}.png" for i in range(4)]
    src = open_source(simclr_dir)
    enc = load_model(lambda: SimCLREncoder(SimCLRConfig.from_dict(src.config)), open_reader(src), dtype=torch.float32)
    assert enc.conv_in.weight.dtype == torch.float32
    processor = ImageProcessor.from_pretrained(simclr_dir)
    with torch.no_grad():
        feature_map = enc.feature_map(processor(_pil(paths)))
        want = feature_map.mean(dim=(2, 3))
    assert feature_map.shape == (4, 16, 8, 8)  # 32 px: stride-2 stem, one stride-2 stage
    got = torch.tensor([r["embedding"] for r in rows(invoke("--images", *paths, "-m", simclr_dir, "--json", "--dtype", "float32", "-b", "2"))])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_outputs_stdin_and_existing_file(simclr_dir, images, tmp_path):
    paths = [str(images / f"img{i}.png") for i in range(4)]
    want = torch.tensor([r["embedding"] for r in rows(invoke("--images", *paths, "-m", simclr_dir, "--json", "--dtype", "float32"))])
    from_stdin = rows(invoke("--images", "-", "-m", simclr_dir, "--json", "--dtype", "float32", input="\n".join(paths) + "\n"))
    assert [r["image"] for r in from_stdin] == paths
    for suffix in (".npy", ".safetensors", ".jsonl"):
        out = tmp_path / f"m{suffix}"
        r = invoke("--images", *paths, "-m", simclr_dir, "--out", out, "--dtype", "float32")
        assert r.exit_code == 0 and r.stdout == "", r.output
        if suffix == ".npy":
            got = torch.from_numpy(np.load(out))
        elif suffix == ".safetensors":
            from safetensors.torch import load_file

            got = load_file(out)["embeddings"]
        else:
            lines = [json.loads(x) for x in out.read_text().splitlines()]
            assert [x["image"] for x in lines] == paths
            got = torch.tensor([x["embedding"] for x in lines])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    before = (tmp_path / "m.npy").read_bytes()
    one_error_line(invoke("--images", *paths[:1], "-m", simclr_dir, "--out", tmp_path / "m.npy"), "m.npy", "--force")
    assert (tmp_path / "m.npy").read_bytes() == before
    text = invoke("--images", images, "-m", simclr_dir)  # a directory: its images, one line each
    assert text.exit_code == 0 and len(text.stdout.splitlines()) == 4 and text.stdout.splitlines()[0].startswith("16-d  norm")


def test_unreadable_image_is_reported_and_the_others_go_on(simclr_dir, images, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image")
    good = images / "img0.png"
    r = invoke("--images", good, bad, images / "img1.png", "-m", simclr_dir, "--json")
    assert r.exit_code == 2
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["image"] for x in lines] == [str(good), str(bad), str(images / "img1.png")]
    assert "error" in lines[1] and "embedding" in lines[0] and "embedding" in lines[2]
    assert "broken.png" in r.stderr and "1 of 3 input(s) could not be read" in r.stderr
    out = tmp_path / "e.npy"  # a matrix whose rows would not match the inputs is not written
    r = invoke("--images", good, bad, "-m", simclr_dir, "--out", out)
    assert r.exit_code == 2 and not out.exists() and "not written" in r.stderr


def test_query_lists_nearest_images_by_cosine(simclr_dir, images, tmp_path):
    folder = tmp_path / "pool"
    folder.mkdir()
    for i in range(4):
        shutil.copy(images / f"img{i}.png", folder / f"img{i}.png")
    shutil.copy(images / "img2.png", folder / "copy-of-2.png")
    query = folder / "img2.png"
    r = invoke("--images", folder, "--query", query, "-k", "3", "-m", simclr_dir, "--json", "--dtype", "float32")
    (line,) = rows(r)
    assert line["query"] == str(query)
    hits = line["neighbours"]
    assert [h["rank"] for h in hits] == [1, 2, 3]
    assert hits[0]["image"] == str(folder / "copy-of-2.png") and abs(hits[0]["cosine"] - 1.0) < 1e-5  # the same pixels
    assert str(query) not in [h["image"] for h in hits]  # the query itself is left out
    assert hits[0]["cosine"] >= hits[1]["cosine"] >= hits[2]["cosine"]
    vecs = {x["image"]: torch.tensor(x["embedding"]) for x in rows(invoke("--images", folder, "-m", simclr_dir, "--json", "--dtype", "float32"))}
    q = vecs[str(query)]
    want = sorted(((float(q @ v / (q.norm() * v.norm())), k) for k, v in vecs.items() if k != str(query)), reverse=True)[:3]
    assert [h["image"] for h in hits] == [k for _c, k in want]
    table = invoke("--images", folder, "--query", query, "-k", "2", "-m", simclr_dir)
    assert table.exit_code == 0 and "copy-of-2.png" in table.stdout and "rank" in table.stdout


def test_bad_usage_one_line_exit_2_nothing_written(simclr_dir, clip_dir, images, tmp_path):
    img = images / "img0.png"
    out = tmp_path / "x.npy"
    one_error_line(invoke("hello", "--query", img), "--query needs --images")
    one_error_line(invoke("--images", img, "--pooling", "mean", "-m", simclr_dir), "--pooling")
    one_error_line(invoke("--images", img, "--texts-file", img, "-m", simclr_dir), "--texts-file")
    one_error_line(invoke("--images", "-m", simclr_dir), "no images")
    one_error_line(invoke("--images", img, "--query", tmp_path / "nope.png", "-m", simclr_dir), "--query", "nope.png")
    one_error_line(invoke("--images", img, "--query", img, "--out", out, "-m", simclr_dir), "--out")
    one_error_line(invoke("--images", img, "-m", weights_dir() / "unet-shapes", "--out", out), "gencli segment")
    one_error_line(invoke("--images", img, "-m", weights_dir() / "bert-pystdlib"), "text", "without --images")
    one_error_line(invoke("a text", "-m", simclr_dir), "gencli embed --images")
    one_error_line(invoke("a text", "-m", clip_dir, "--pooling", "cls"), "--pooling", "CLIP")
    assert not out.exists()
    r = CliRunner().invoke(app, ["classify", str(img), "-m", str(simclr_dir)])
    one_error_line(r, "SimCLR", "gencli embed --images")


def test_similarity_and_zeroshot_still_run_on_the_same_clip(clip_dir, images):
    img = images / "img0.png"
    r = CliRunner().invoke(app, ["similarity", str(img), "--texts", TEXTS[0], "--texts", TEXTS[1], "-m", str(clip_dir), "--json", "--dtype", "float32"])
    sims = [s["cosine"] for s in json.loads(r.stdout)["similarities"]]
    emb_img = torch.tensor(rows(invoke("--images", img, "-m", clip_dir, "--json", "--dtype", "float32"))[0]["embedding"])
    emb_txt = torch.tensor([x["embedding"] for x in rows(invoke(*TEXTS[:2], "-m", clip_dir, "--json", "--dtype", "float32"))])
    torch.testing.assert_close(emb_txt @ emb_img, torch.tensor(sims), atol=1e-4, rtol=0)


DEFAULT = weights_dir() / "simclr-shapes"


@pytest.mark.skipif(not (DEFAULT / "model.safetensors").is_file(), reason="weights/simclr-shapes is not installed")
def test_default_model_embeds_images_without_model_option(images):
    got = rows(invoke("--images", images / "img0.png", images / "img1.png", "--json"))
    vecs = torch.tensor([r["embedding"] for r in got])
    assert vecs.shape == (2, SimCLRConfig.from_dict(json.loads((DEFAULT / "config.json").read_text())).hidden_size)
    assert torch.isfinite(vecs).all() and (vecs.norm(dim=1) > 0).all()
