"""The embedded text2text default (weights/t5-shapes) and the caption augmentation it was trained with."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from gencli.data import shapes
from gencli.data import shapes_text2text as st
from gencli.weights import weights_dir
from tests.conftest import run_cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def folder():
    path = weights_dir() / "t5-shapes"
    if not path.is_dir():
        pytest.skip("t5-shapes is not shipped")
    return path


def test_augmented_captions_keep_the_held_out_phrasings_out():
    """Training variety that never writes what evaluation holds out: the picture style's lead-in and
    its ", on a" ending, parentheses, "there is", a leading "on a ... background"."""
    rng = np.random.default_rng(0)
    seen = set()
    for seed in range(400):
        scene = shapes.make_scene(seed)
        caption = st.augmented_caption(scene, rng)
        seen.add(caption)
        assert "picture" not in caption and "(" not in caption and "there is" not in caption
        assert ", on a" not in caption and not re.match(r"on an? \w+ background", caption)
        assert scene.background in caption and all(o.shape in caption and o.colour in caption and o.size in caption for o in scene.objects)
    assert len(seen) == 400  # varied
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    assert st.augmented_caption(shapes.make_scene(7), a) == st.augmented_caption(shapes.make_scene(7), b)


def test_text2text_without_model_runs_t5_shapes():
    """No --model: the shipped t5-shapes parses held-out (test-split) captions of the training styles
    into their structures and describes structures as the full caption."""
    folder()
    scenes = [shapes.make_scene(s) for s in shapes.split_seeds("test", 6)]
    inputs = [st.PARSE + sc.caption(style) for sc in scenes for style in st.TRAIN_STYLES] + [st.DESCRIBE + st.structure(sc) for sc in scenes]
    wanted = [st.structure(sc) for sc in scenes for _ in st.TRAIN_STYLES] + [sc.caption("full") for sc in scenes]
    r = run_cli("text2text", "--json", *inputs)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [rec["prompt"] for rec in records] == inputs
    assert all(rec["model"].endswith("t5-shapes") and rec["finish_reason"] == "stop" for rec in records)
    correct = sum(rec["text"] == want for rec, want in zip(records, wanted))
    assert correct >= len(inputs) - 1, [(rec["text"], want) for rec, want in zip(records, wanted) if rec["text"] != want]
    parsed = st.parse_structure(records[0]["text"])
    assert parsed == scenes[0].labels()


def test_t5_shapes_folder_is_small_fp16_and_loads_in_transformers():
    from safetensors import safe_open
    from transformers import T5ForConditionalGeneration

    from gencli.pipelines.seq2seq.loading import load_seq2seq_model

    path = folder()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    assert (path / "model.safetensors").stat().st_size < 4 * 2**20
    assert json.loads((path / "eval.json").read_text())["parse/full"]["model"] >= 0.98
    sm = load_seq2seq_model(path, device="cpu", dtype="float32")
    ref = T5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([sm.tokenizer.encode("parse: a small red star at the top left on a blue background")])
    dec = torch.tensor([[0, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(sm.model(ids, dec), ref(input_ids=ids, decoder_input_ids=dec).logits, atol=1e-4, rtol=1e-4)
