"""ViT / DeiT parity with transformers on random-initialised checkpoints, loaded through the same path a
downloaded checkpoint takes (save_pretrained -> folder -> gencli loader)."""

from __future__ import annotations

import json

import pytest
import torch

from gencli.checkpoints.loader import load_model, save_model
from gencli.checkpoints.reader import open_reader
from gencli.errors import CheckpointError, UserError
from gencli.models.vit import ViTConfig, ViTForImageClassification, keymap_for
from gencli.pipelines.vision.classify import ImageClassifier

transformers = pytest.importorskip("transformers")

CPU32 = {"device": "cpu", "dtype": "float32"}

CONFIGS = {
    # image 32, patch 8 (4x4 grid), GELU, qkv bias
    "p8-i32": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8, num_labels=5),
    # image 30, patch 6 (5x5 grid), tanh-GELU, no qkv bias, 3 heads
    "p6-i30": dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=3, intermediate_size=96, image_size=30, patch_size=6,
                   num_labels=7, hidden_act="gelu_new", qkv_bias=False, layer_norm_eps=1e-6),
}  # fmt: skip
# input sizes per config: the trained size, a larger square, and non-square grids (interpolated positions)
SIZES = {"p8-i32": [(32, 32), (48, 48), (32, 64), (40, 24)], "p6-i30": [(30, 30), (36, 60), (18, 30)]}


def _save(model, path):
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


def _load_ours(path) -> ViTForImageClassification:
    cfg = ViTConfig.from_dict(json.loads((path / "config.json").read_text()))
    reader = open_reader(path)
    return load_model(lambda: ViTForImageClassification(cfg), reader, keymap_for(set(reader.keys())))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_vit_logits_match_transformers(tmp_path, name):
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(transformers.ViTConfig(initializer_range=0.2, **CONFIGS[name]))
    ours = _load_ours(_save(hf, tmp_path))
    for h, w in SIZES[name]:
        x = torch.randn(3, 3, h, w)
        with torch.no_grad():
            want = hf(x, interpolate_pos_encoding=True).logits
            got = ours(x)
        assert want.abs().max() > 0.1  # logits with signal, so the comparison means something
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0), (name, h, w)


@pytest.mark.parametrize("teacher", [True, False])
def test_deit_logits_match_transformers(tmp_path, teacher):
    torch.manual_seed(1)
    cfg = transformers.DeiTConfig(initializer_range=0.2, **CONFIGS["p8-i32"])
    cls = transformers.DeiTForImageClassificationWithTeacher if teacher else transformers.DeiTForImageClassification
    hf = cls(cfg)
    with torch.no_grad():  # DeiT initialises its extra tokens to zero: give them values
        hf.deit.embeddings.distillation_token.normal_(0, 0.5)
        hf.deit.embeddings.cls_token.normal_(0, 0.5)
    clf = ImageClassifier.load(_save(hf, tmp_path), **CPU32)
    assert clf.config.distillation_token and clf.config.distillation_head == teacher
    for h, w in [(32, 32), (48, 32)]:
        x = torch.randn(2, 3, h, w)
        with torch.no_grad():
            want = hf(x, interpolate_pos_encoding=True).logits
        torch.testing.assert_close(clf.logits(x), want, atol=1e-4, rtol=0)


def test_transformers_v5_module_names_also_load(tmp_path):
    """A file carrying transformers 5's in-memory names (vit.layers.N.attention.q_proj ...)."""
    from safetensors.torch import save_file

    torch.manual_seed(2)
    hf = transformers.ViTForImageClassification(transformers.ViTConfig(initializer_range=0.2, **CONFIGS["p8-i32"])).eval()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.startswith("vit.layers.") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    hf.config.to_json_file(tmp_path / "config.json")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(_load_ours(tmp_path)(x), hf(x).logits, atol=1e-4, rtol=0)


def test_gencli_saved_model_is_a_transformers_checkpoint(tmp_path):
    """What the training script writes loads in transformers and gives the same logits."""
    cfg = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=(16, 16),
                    patch_size=(4, 4), id2label={0: "a", 1: "b", 2: "c"})  # fmt: skip
    ours = ViTForImageClassification(cfg)
    ours.init_weights(torch.Generator().manual_seed(0))
    save_model(ours, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path).eval()
    assert hf.config.id2label == {0: "a", 1: "b", 2: "c"}
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), hf(x).logits, atol=1e-5, rtol=0)
    assert ViTConfig.from_dict(cfg.to_dict()) == cfg


def test_bfloat16_stays_close_to_float32(tmp_path):
    torch.manual_seed(3)
    hf = transformers.ViTForImageClassification(transformers.ViTConfig(initializer_range=0.1, **CONFIGS["p8-i32"]))
    path = _save(hf, tmp_path)
    f32 = ImageClassifier.load(path, **CPU32)
    b16 = ImageClassifier.load(path, device="cpu", dtype="bfloat16")
    assert next(b16.model.parameters()).dtype == torch.bfloat16
    x = torch.randn(8, 3, 40, 24)  # with interpolation
    a, b = f32.logits(x), b16.logits(x)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max() + 0.02


def test_interpolated_positions_are_cached_and_refreshed():
    cfg = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=(16, 16), patch_size=(4, 4))
    model = ViTForImageClassification(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    emb = model.vit.embeddings
    with torch.no_grad():
        first = emb.interpolate_pos_encoding(24, 32)
        assert first.shape == (1, 1 + 6 * 8, 32)
        assert emb.interpolate_pos_encoding(24, 32) is first
        assert emb.interpolate_pos_encoding(16, 16) is emb.position_embeddings
        emb.position_embeddings.add_(1.0)  # new weights: the cached table is stale
        again = emb.interpolate_pos_encoding(24, 32)
    assert torch.allclose(again[:, 0], first[:, 0] + 1.0)


def test_unsuitable_checkpoints_are_refused_clearly(tmp_path):
    torch.manual_seed(4)
    backbone = transformers.ViTModel(transformers.ViTConfig(**CONFIGS["p8-i32"]))
    with pytest.raises(CheckpointError, match="no classification head"):
        ImageClassifier.load(_save(backbone, tmp_path / "backbone"), **CPU32)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16))
    with pytest.raises(UserError, match=r"holds a GPT2LMHeadModel \(a text-generation model\), not an image classifier: run it with gencli generate"):
        ImageClassifier.load(_save(gpt2, tmp_path / "gpt2"), **CPU32)
    # weights that do not fit the config: the tensor is named
    hf = transformers.ViTForImageClassification(transformers.ViTConfig(**CONFIGS["p8-i32"]))
    path = _save(hf, tmp_path / "vit")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="intermediate.dense.weight"):
        ImageClassifier.load(path, **CPU32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layernorm_in_half_precision_rounds_the_fp32_result(dtype):
    """The backend LayerNorm on CPU runs the native half/bf16 kernel (fp32 statistics inside): its
    output is the fp32 LayerNorm rounded once, up to one unit in the last place."""
    from gencli.backend.layers import LayerNorm

    torch.manual_seed(0)
    ln = LayerNorm(256, eps=1e-6)
    with torch.no_grad():
        ln.weight.normal_(1, 0.2)
        ln.bias.normal_(0, 0.2)
    x = (torch.randn(8, 50, 256) * 3 + 1).to(dtype)
    ln = ln.to(dtype)
    ref = torch.nn.functional.layer_norm(x.float(), (256,), ln.weight.float(), ln.bias.float(), 1e-6)
    got = ln(x)
    assert got.dtype == dtype
    ulp = torch.finfo(dtype).eps * ref.abs().clamp_min(1.0)
    assert bool(((got.float() - ref).abs() <= ulp).all())
    assert (got != ref.to(dtype)).float().mean() < 1e-3


@pytest.mark.parametrize("activation", [None, "gelu", "relu", "gelu_new"])
@pytest.mark.parametrize("bias", [True, False])
def test_backend_linear_fused_bf16_path_matches_unfused(activation, bias):
    """backend.layers.Linear: same result as F.linear (+ activation) in fp32, and within bf16 rounding
    of the fp32 result when the fused oneDNN bf16 kernel runs; gradients flow in training."""
    import torch.nn.functional as F

    from gencli.backend.layers import Linear, get_activation

    torch.manual_seed(0)
    layer = Linear(48, 40, bias=bias)
    x = torch.randn(2, 7, 48)
    act = get_activation(activation) if activation else (lambda t: t)
    want = act(F.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(layer(x, activation=activation), want, atol=0, rtol=0)
    with torch.inference_mode():
        got = layer.to(torch.bfloat16)(x.bfloat16(), activation=activation)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 7, 40)
    torch.testing.assert_close(got.float(), want, atol=0.03, rtol=0.02)
    layer.float()
    out = layer(x.requires_grad_(), activation=activation)
    out.sum().backward()
    assert layer.weight.grad is not None and x.grad is not None
