"""Norms, activations, position encodings, device/dtype rules and seeding, checked against the
reference implementations where one exists."""


import pytest
import torch

from gencli.backend import device as devmod
from gencli.backend.layers import GatedMLP, GroupNorm, LayerNorm, RMSNorm, get_activation, swiglu
from gencli.backend.positional import RotaryEmbedding, apply_rotary, rope_inverse_frequencies, timestep_embedding
from gencli.backend.random import make_generator, multinomial, randn
from gencli.errors import UserError


def test_rmsnorm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(2, 5, 16)
    ours, ref = RMSNorm(16, eps=1e-5), LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        w = torch.randn(16)
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    assert torch.allclose(ours(x.bfloat16()).float(), ref(x.bfloat16()).float(), atol=1e-2)
    manual = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * w
    assert torch.allclose(ours(x), manual, atol=1e-5)


def test_layernorm_and_groupnorm_reduced_precision_uses_fp32_statistics():
    x = torch.randn(4, 8, 32) * 30 + 100
    ln = LayerNorm(32)
    ref = torch.nn.functional.layer_norm(x, (32,))
    assert torch.allclose(ln(x), ref, atol=1e-5)
    assert (ln(x.bfloat16()).float() - ref).abs().max() < 0.05
    gn = GroupNorm(4, 8)
    img = torch.randn(2, 8, 6, 6) * 10 + 50
    ref = torch.nn.functional.group_norm(img, 4, gn.weight, gn.bias)
    assert torch.allclose(gn(img), ref, atol=1e-5)
    assert (gn(img.bfloat16()).float() - ref).abs().max() < 0.05
    assert LayerNorm(8, bias=False).bias is None


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_pytorch_tanh", "quick_gelu", "silu", "relu"])
def test_activations_match_transformers(name):
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 101)
    assert torch.allclose(get_activation(name)(x), ACT2FN[name](x), atol=1e-6)


def test_unknown_activation():
    with pytest.raises(ValueError, match="unknown activation"):
        get_activation("mish2")


def test_swiglu_and_gated_mlp():
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.allclose(swiglu(gate, up), gate * torch.sigmoid(gate) * up)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = LlamaConfig(hidden_size=8, intermediate_size=20, num_attention_heads=2, num_key_value_heads=2)
    ref = LlamaMLP(cfg)
    ours = GatedMLP(8, 20)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 8)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)


def test_timestep_embedding_matches_diffusers():
    from diffusers.models.embeddings import get_timestep_embedding

    t = torch.tensor([0, 1, 10, 999])
    for dim, flip, shift in [(320, True, 0), (33, False, 1), (64, False, 1)]:
        ours = timestep_embedding(t, dim, flip_sin_to_cos=flip, downscale_freq_shift=shift)
        ref = get_timestep_embedding(t, dim, flip_sin_to_cos=flip, downscale_freq_shift=shift)
        assert torch.allclose(ours, ref, atol=1e-5), (dim, flip, shift)


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}],
)
def test_rope_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"rope_scaling": scaling} if scaling else {}
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0, **kwargs)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        ref = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    ours, factor = rope_inverse_frequencies(16, 500000.0, scaling)
    assert factor == 1.0
    assert torch.allclose(ours, ref, rtol=1e-6)


def test_rotary_application_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rope = RotaryEmbedding(16, base=10000.0)
    pos = torch.arange(6)[None].expand(2, 6)
    cos, sin = rope(pos, torch.float32)
    q, k = torch.randn(2, 3, 6, 16), torch.randn(2, 3, 6, 16)
    rq, rk = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.allclose(apply_rotary(q, cos, sin), rq, atol=1e-6)
    assert torch.allclose(apply_rotary(k, cos, sin), rk, atol=1e-6)
    # a rotation: norms are kept, and relative positions are what matters
    assert torch.allclose(apply_rotary(q, cos, sin).norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        rope_inverse_frequencies(16, 10000.0, {"rope_type": "yarn-ish"})


def test_resolve_device_rules(monkeypatch):
    assert devmod.resolve_device("cpu") == torch.device("cpu")
    for bad in ["gpu", "cuda:x", "tpu", ""]:
        if bad == "":
            continue
        with pytest.raises(UserError, match="unknown device"):
            devmod.resolve_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="CUDA is not available"):
        devmod.resolve_device("cuda:0")
    assert devmod.resolve_device("auto").type in ("cpu", "mps")


def test_resolve_dtype_rules(monkeypatch):
    cpu = torch.device("cpu")
    assert devmod.resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(UserError, match="unknown dtype"):
        devmod.resolve_dtype("fp8", cpu)
    devmod.cpu_has_native_bf16.cache_clear()
    monkeypatch.setenv("GENCLI_CPU_BF16", "1")
    assert devmod.resolve_dtype("auto", cpu, "transformer") == torch.bfloat16
    assert devmod.resolve_dtype("auto", cpu, "float") == torch.float32
    # decoders: fp32 on CPU (bf16 matrix-vector products are not faster), bf16 when fp32 would not fit
    assert devmod.resolve_dtype("auto", cpu, "decoder", n_params=10_000_000) == torch.float32
    assert devmod.resolve_dtype("auto", cpu, "decoder") == torch.float32
    huge = devmod._physical_memory_bytes() // 4  # fp32 copy = all of the memory
    assert devmod.resolve_dtype("auto", cpu, "decoder", n_params=huge) == torch.bfloat16
    assert devmod.resolve_dtype("bfloat16", cpu, "decoder") == torch.bfloat16
    devmod.cpu_has_native_bf16.cache_clear()
    monkeypatch.setenv("GENCLI_CPU_BF16", "0")
    assert devmod.resolve_dtype("auto", cpu, "decoder", n_params=huge) == torch.float32
    assert devmod.resolve_dtype("auto", cpu, "transformer") == torch.float32
    devmod.cpu_has_native_bf16.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert devmod.resolve_dtype("auto", torch.device("cuda", 0), "transformer") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert devmod.resolve_dtype("auto", torch.device("cuda", 0), "transformer") == torch.bfloat16
    assert devmod.resolve_dtype("auto", torch.device("cuda", 0), "float") == torch.float32
    assert devmod.resolve_dtype("auto", torch.device("cuda", 0), "decoder") == torch.bfloat16


def test_threads_respected():
    before = torch.get_num_threads()
    try:
        devmod.choose_placement("cpu", "float32", threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_seeded_noise_is_reproducible_and_device_independent():
    g1, s1 = make_generator(123)
    g2, _ = make_generator(123)
    a = randn((3, 4), g1)
    b = randn((3, 4), g2, dtype=torch.bfloat16)
    assert s1 == 123
    assert torch.allclose(a.bfloat16().float(), b.float())
    g3, s3 = make_generator(None)
    assert 0 <= s3 < 2**31
    assert not torch.equal(randn((3, 4), make_generator(124)[0]), a)
    probs = torch.tensor([[0.1, 0.9, 0.0], [0.5, 0.0, 0.5]])
    draws = [multinomial(probs, make_generator(7)[0]).tolist() for _ in range(2)]
    assert draws[0] == draws[1]
    assert all(row[0] != 2 for row in [draws[0][0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv2d_prepacked_matches_plain_and_stays_a_conv(dtype):
    """Packed for oneDNN on the first inference call: same outputs (residual fused), other input
    sizes too, the dense weight in state_dict, and back to a plain trainable conv on demand."""
    from gencli.backend.layers import Conv2d, _onednn_conv_available, prepack_convolutions

    torch.manual_seed(0)
    conv = Conv2d(16, 24, kernel_size=3, padding=1)
    weight = conv.weight.detach().clone()
    x = torch.randn(2, 16, 9, 7).to(dtype).to(memory_format=torch.channels_last)
    residual = torch.randn(2, 24, 9, 7).to(dtype).to(memory_format=torch.channels_last)
    conv = conv.to(dtype)
    with torch.no_grad():
        plain = torch.nn.functional.conv2d(x.float(), weight, conv.bias.float(), padding=1)
        assert prepack_convolutions(torch.nn.Sequential(conv)) == (1 if _onednn_conv_available() else 0)
        first = conv(x)  # packs
        assert conv.packed == _onednn_conv_available()
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
        torch.testing.assert_close(first.float(), plain, **tol)
        torch.testing.assert_close(conv(x, residual=residual).float(), plain + residual.float(), **tol)
        other = torch.randn(1, 16, 5, 12).to(dtype).to(memory_format=torch.channels_last)
        torch.testing.assert_close(conv(other).float(), torch.nn.functional.conv2d(other.float(), weight, conv.bias.float(), padding=1), **tol)
        assert torch.equal(conv.state_dict()["weight"], weight.to(dtype))
    # autograd needs the dense parameter back
    conv = conv.float()
    assert not conv.packed and conv.weight.requires_grad
    out = conv(x.float().requires_grad_())
    out.sum().backward()
    assert conv.weight.grad is not None and conv.weight.grad.shape == weight.shape
