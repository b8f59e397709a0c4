"""Norms, activations, position encodings, device/dtype rules and seeding, checked against the
reference implementations where one exists."""


import pytest
import torch
import torch.nn.functional as F

from gencli.backend import device as devmod
from gencli.backend.layers import FeedForward, GatedMLP, GroupNorm, LayerNorm, Linear, RMSNorm, get_activation, swiglu
from gencli.backend.positional import RotaryEmbedding, apply_rotary, rope_inverse_frequencies, timestep_embedding
from gencli.backend.random import make_generator, multinomial, rand, randn
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


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_bf16_groupnorm_inference_on_large_maps_runs_in_bf16_with_fp32_statistics(weights, channels_last, monkeypatch):
    """Large bf16 feature maps at inference go through torch's mixed-precision kernel (no fp32 copy of
    the map): the values of the fp32-statistics path, up to a bf16 step on a rare element (summation order)."""
    torch.manual_seed(3)
    gn = GroupNorm(8, 64).to(weights)
    with torch.no_grad():
        gn.weight.normal_()
        gn.bias.normal_()
    img = (torch.randn(2, 64, 32, 32) * 10 + 50).bfloat16()
    if channels_last:
        img = img.contiguous(memory_format=torch.channels_last)
    want = torch.nn.functional.group_norm(img.float(), 8, gn.weight.float(), gn.bias.float()).bfloat16()
    seen = []
    real = torch.nn.functional.group_norm
    monkeypatch.setattr(torch.nn.functional, "group_norm", lambda x, *a, **k: seen.append(x.dtype) or real(x, *a, **k))
    with torch.no_grad():
        got = gn(img, "silu")
    assert seen == [torch.bfloat16] and got.dtype == torch.bfloat16
    want = torch.nn.functional.silu(want.float()).bfloat16()
    close = (got.float() - want.float()).abs() <= 2.0**-7 * want.float().abs().clamp(min=2.0**-100)
    assert close.all() and (got == want).float().mean() > 0.99
    seen.clear()
    gn(img)  # training (a graph to keep): the cast path, whose backward is the faster one
    gn(img[:, :, :4, :4].contiguous())  # a small map: the cast path is as fast
    assert seen == [torch.float32, torch.float32]


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
    with torch.inference_mode():  # bf16 inference: the gate's activation applied by its Linear
        assert torch.allclose(ours.bfloat16()(x.bfloat16()).float(), ref(x), atol=5e-2, rtol=5e-2)


def test_feed_forward_blocks_use_the_one_linear_with_activation():
    ff, mlp = FeedForward(8, 16, act="quick_gelu"), GatedMLP(8, 16)
    assert all(isinstance(m, Linear) for m in (ff.fc1, ff.fc2, mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    with pytest.raises(ValueError, match="unknown activation"):
        FeedForward(8, 16, act="nope")


@pytest.mark.parametrize("act", [None, "gelu", "gelu_new", "silu", "relu", "sigmoid", "tanh", "quick_gelu"])
def test_linear_with_activation_matches_the_formula_in_bf16(act):
    """The oneDNN path (bias and activation fused; used where the CPU multiplies bf16 natively) and
    the plain path (one row: batch-1 decoding) both compute act(x W^T + b)."""
    torch.manual_seed(0)
    lin = Linear(64, 96).bfloat16()
    x = torch.randn(5, 7, 64).bfloat16()
    ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    ref = get_activation(act)(ref) if act else ref
    with torch.inference_mode():
        many, one = lin(x, activation=act), lin(x[:1, :1], activation=act)
    assert many.shape == (5, 7, 96) and many.dtype == torch.bfloat16
    assert torch.allclose(many.float(), ref, atol=3e-2, rtol=2e-2)
    assert torch.allclose(one.float(), ref[:1, :1], atol=3e-2, rtol=2e-2)


def test_timestep_embedding_matches_diffusers():
    from diffusers.models.embeddings import get_timestep_embedding

    t = torch.tensor([0, 1, 10, 999])
    for dim, flip, shift in [(320, True, 0), (33, False, 1), (64, False, 1)]:
        ours = timestep_embedding(t, dim, flip_sin_to_cos=flip, downscale_freq_shift=shift)
        ref = get_timestep_embedding(t, dim, flip_sin_to_cos=flip, downscale_freq_shift=shift)
        assert torch.allclose(ours, ref, atol=1e-5), (dim, flip, shift)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ],
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
    huge = devmod.physical_memory_bytes() // 4  # fp32 copy = all of the memory
    assert devmod.resolve_dtype("auto", cpu, "decoder", n_params=huge) == torch.bfloat16
    assert devmod.resolve_dtype("bfloat16", cpu, "decoder") == torch.bfloat16
    devmod.cpu_has_native_bf16.cache_clear()
    monkeypatch.setenv("GENCLI_CPU_BF16", "0")
    # without native bf16 too: a model that fits beats one that does not (gencli's kernels multiply bf16 weights anyway)
    assert devmod.resolve_dtype("auto", cpu, "decoder", n_params=huge) == torch.bfloat16
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


def test_default_threads_fit_the_work_and_never_exceed_the_usable_cores(monkeypatch):
    monkeypatch.setattr(devmod, "usable_cores", lambda: 4)
    monkeypatch.setattr(devmod, "_TORCH_STARTING_THREADS", 2)  # each case starts from torch's own count
    monkeypatch.setattr(devmod, "_last_set", None)
    before = torch.get_num_threads()
    try:
        for kind, n_params, expected in [
            ("decoder", 9_000_000, 1),  # batch-1 decoding of a small model: 1 thread
            ("decoder", None, 1),
            ("decoder", 7_000_000_000, 4),  # a big decoder: the usable cores
            ("float", None, 1),  # TFT/VAE/GAN: small
            ("transformer", 3_000_000, 1),  # a tiny ViT/CLIP
            ("transformer", None, 4),  # a diffusion pipeline
            ("transformer", 300_000_000, 4),
        ]:
            torch.set_num_threads(2)
            placement = devmod.choose_placement("cpu", "float32", kind, None, n_params=n_params)
            assert torch.get_num_threads() == expected == placement.threads, (kind, n_params)
        devmod.choose_placement("cpu", "float32", threads=64)  # an explicit count is capped
        assert torch.get_num_threads() == 4
        assert devmod.default_threads("transformer", None, 64) == devmod.MAX_DEFAULT_THREADS
    finally:
        torch.set_num_threads(before)


def test_the_default_rule_leaves_the_applications_threads_and_a_bigger_models_alone(monkeypatch):
    """torch's count is the process's: a small model loaded second (a judge beside a training run)
    must not drop everything to one thread."""
    monkeypatch.setattr(devmod, "usable_cores", lambda: 4)
    monkeypatch.setattr(devmod, "_TORCH_STARTING_THREADS", 4)
    monkeypatch.setattr(devmod, "_last_set", None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert devmod.choose_placement("cpu", "float32", "transformer", None, n_params=300_000_000).threads == 4
        assert devmod.choose_placement("cpu", "float32", "transformer", None, n_params=3_000_000).threads == 4  # smaller, second
        assert torch.get_num_threads() == 4
        torch.set_num_threads(3)  # the application's own choice
        assert devmod.choose_placement("cpu", "float32", "decoder", None, n_params=9_000_000).threads == 3
        assert devmod.choose_placement("cpu", "float32", "transformer", None, n_params=300_000_000).threads == 3
        assert torch.get_num_threads() == 3
        assert devmod.choose_placement("cpu", "float32", threads=1).threads == 1  # an explicit count always applies
        assert devmod.choose_placement("cpu", "float32", "transformer", None, n_params=300_000_000).threads == 1  # and is kept
        assert devmod.choose_placement("cpu", "float32", threads=4).threads == 4  # even where it equals torch's starting count
        assert devmod.choose_placement("cpu", "float32", "decoder", None, n_params=9_000_000).threads == 4
        torch.set_num_threads(2)  # the application again
        assert devmod.choose_placement("cpu", "float32", "transformer", None, n_params=300_000_000).threads == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# torch's CPU generator (mt19937) seeded with 123: the sequence every device's noise comes from.
# Pinned, so that a change of generator, of the dtype of the draw or of the order of draws shows.
SEED_123_RANDN_2x3 = [[-0.111467, 0.120363, -0.369635], [-0.240418, -1.196924, 0.209269]]
SEED_123_RANDN_4_NEXT = [-0.972355, -0.755045, 0.323903, -0.108523]
SEED_123_RAND_3_NEXT = [0.853572, 0.593153, 0.636725]


def test_seeded_noise_is_a_pinned_cpu_sequence():
    g, seed = make_generator(123)
    assert seed == 123
    a = randn((2, 3), g)
    b = randn((4,), g)  # the generator advances: later draws continue the sequence
    u = rand((3,), g)
    assert a.dtype == torch.float32 and a.device.type == "cpu"
    assert torch.allclose(a, torch.tensor(SEED_123_RANDN_2x3), atol=1e-6)
    assert torch.allclose(b, torch.tensor(SEED_123_RANDN_4_NEXT), atol=1e-6)
    assert torch.allclose(u, torch.tensor(SEED_123_RAND_3_NEXT), atol=1e-6)
    # a reduced-precision draw is the fp32 draw rounded, not a different sequence
    half = randn((2, 3), make_generator(123)[0], dtype=torch.bfloat16)
    assert torch.equal(half, a.bfloat16())
    assert not torch.equal(randn((2, 3), make_generator(124)[0]), a)
    assert 0 <= make_generator(None)[1] < 2**31
    probs = torch.tensor([[0.1, 0.9, 0.0], [0.5, 0.0, 0.5]])
    g7 = make_generator(7)[0]
    assert [multinomial(probs, g7).tolist() for _ in range(3)] == [[[1], [0]], [[1], [2]], [[1], [0]]]


_MPS = getattr(torch.backends, "mps", None)
ACCELERATORS = [d for d, ok in (("cuda", torch.cuda.is_available()), ("mps", _MPS is not None and _MPS.is_available())) if ok]


@pytest.mark.parametrize("device", ACCELERATORS or [pytest.param("cuda", marks=pytest.mark.skip(reason="no accelerator on this machine"))])
def test_seeded_noise_is_the_same_on_every_device(device):
    """Noise drawn for an accelerator is the CPU sequence, moved: the same seed, the same image anywhere."""
    cpu_gen, dev_gen = make_generator(123)[0], make_generator(123)[0]
    for dtype in (torch.float32, torch.float16):
        a = randn((2, 3), cpu_gen, dtype=dtype)
        b = randn((2, 3), dev_gen, device=device, dtype=dtype)
        assert b.device.type == device and b.dtype == dtype
        assert torch.equal(b.cpu(), a)
    assert torch.equal(rand((5,), dev_gen, device=device).cpu(), rand((5,), cpu_gen))
    probs = torch.tensor([[0.1, 0.9, 0.0], [0.5, 0.0, 0.5]])
    on_device = multinomial(probs.to(device), make_generator(7)[0])
    assert on_device.device.type == device and on_device.cpu().tolist() == multinomial(probs, make_generator(7)[0]).tolist()


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["gelu", "silu", "quick_gelu"])
def test_conv2d_activation_packed_or_not_is_the_conv_then_the_activation(dtype, act):
    """``conv(x, activation=...)``: inside oneDNN's packed convolution where it has the activation
    (a depthwise conv, as SegFormer's Mix-FFN runs it), after it otherwise; the same values."""
    from gencli.backend.layers import Conv2d

    torch.manual_seed(0)
    conv = Conv2d(12, 12, 3, padding=1, groups=12).to(dtype)
    x = torch.randn(2, 12, 7, 5).to(dtype).to(memory_format=torch.channels_last)
    with torch.no_grad():
        want = get_activation(act)(F.conv2d(x.float(), conv.weight.float(), conv.bias.float(), padding=1, groups=12))
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
        torch.testing.assert_close(conv(x, activation=act).float(), want, **tol)  # plain
        conv.prepack()
        torch.testing.assert_close(conv(x, activation=act).float(), want, **tol)  # packed (where oneDNN is)
        assert not torch.equal(conv(x, activation=act), conv(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_with_residual_adds_it_to_the_product(dtype):
    """``lin(x, residual=r)`` equals ``lin(x) + r``: in oneDNN's matmul at inference on the CPU, by
    a separate addition under autograd (which then reaches the residual)."""
    if dtype == torch.bfloat16 and not devmod.cpu_has_native_bf16():
        pytest.skip("no native bf16 on this CPU")
    torch.manual_seed(0)
    lin = Linear(24, 16).to(dtype)
    x = torch.randn(3, 10, 24).to(dtype)
    r = torch.randn(3, 10, 16).to(dtype)
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float()) + r.float()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    with torch.no_grad():
        torch.testing.assert_close(lin(x, residual=r).float(), want, **tol)
        torch.testing.assert_close(lin(x[:1, :1], residual=r[:1, :1]).float(), want[:1, :1], **tol)  # one row: F.linear + r
    if dtype == torch.float32:
        rg = r.clone().requires_grad_()
        out = lin(x, residual=rg)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        out.sum().backward()
        assert torch.equal(rg.grad, torch.ones_like(r))
    with pytest.raises(ValueError, match="residual"):
        lin(x, activation="gelu", residual=r)
