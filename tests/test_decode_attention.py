"""The single-query attention kernel of the CPU extension (``csrc/decode_attention.cpp``) against
``reference_attention`` in float64, on every instruction set this CPU offers (and the portable loop),
and its use by the one attention entry point while decoding."""

from __future__ import annotations

import pytest
import torch

from gencli.backend import attention, quant_kernels
from gencli.backend.attention import KVCache, build_mask, reference_attention, scaled_dot_product_attention

kernels = quant_kernels.cpu_kernels()
needs_kernels = pytest.mark.usefixtures("quant_kernels_built")  # a skip saying why, a failure on CI


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request):
    """Each code path the CPU can run, forced in turn (the best one restored afterwards)."""
    if not kernels.use_attention_isa(request.param):
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    for best in ("avx512", "avx2", "scalar"):
        if kernels.use_attention_isa(best):
            break


def _reference(q, k, v, scale, key_mask=None):
    mask = build_mask(1, k.shape[2], causal=True, key_padding_mask=key_mask)
    rep = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    return reference_attention(q.double(), k64, v64, mask, scale)[0]


@needs_kernels
@pytest.mark.parametrize("heads, kv_heads, dim", [(12, 12, 64), (16, 4, 64), (4, 2, 128), (6, 3, 80), (3, 1, 72), (2, 2, 20)])
@pytest.mark.parametrize("length", [1, 3, 17, 130])
def test_the_kernel_is_softmax_attention_over_the_cache(isa, heads, kv_heads, dim, length):
    torch.manual_seed(length * dim + heads)
    b, cap = 2, length + 5
    # q a view into a fused projection, k and v views into a larger cache: strided as in decoding
    q = torch.randn(b, 1, 3, heads, dim).permute(2, 0, 3, 1, 4)[0]
    cache_k, cache_v = torch.randn(b, kv_heads, cap, dim) * 3, torch.randn(b, kv_heads, cap, dim)
    k, v = cache_k.narrow(2, 0, length), cache_v.narrow(2, 0, length)
    got = kernels.decode_attention(q, k, v, dim**-0.5)
    assert got.shape == (b, heads, 1, dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(q, k, v, dim**-0.5), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_masked_keys_are_skipped_and_a_row_with_none_attends_all(isa):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 1, 64), torch.randn(3, 2, 40, 64), torch.randn(3, 2, 40, 64)
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[0, :7] = False  # left padding
    mask[1, ::3] = False
    mask[2] = False  # nothing to attend: every key, as build_mask does (finite, never used)
    got = kernels.decode_attention(q, k, v, 0.125, mask)
    torch.testing.assert_close(got.double(), _reference(q, k, v, 0.125, mask), rtol=1e-5, atol=1e-5)
    big = torch.full_like(v, 1e6)  # a masked value must not leak in, however large
    v2 = torch.where(mask[:, None, :, None], v, big)
    torch.testing.assert_close(kernels.decode_attention(q, k, v2, 0.125, mask)[:2], got[:2])


@needs_kernels
def test_large_score_gaps_underflow_to_exact_zeros(isa):
    """The vector exponential is exact enough far from zero and gives 0 below e^-87, not garbage."""
    q = torch.zeros(1, 1, 1, 64)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 20, 64)
    k[0, 0, :, 0] = torch.linspace(-200, 0, 20)
    v = torch.randn(1, 1, 20, 64)
    got = kernels.decode_attention(q, k, v, 1.0)
    torch.testing.assert_close(got.double(), _reference(q, k, v, 1.0), rtol=1e-5, atol=1e-6)


@needs_kernels
def test_the_kernel_refuses_what_it_cannot_compute():
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 3, 9, 64)
    with pytest.raises(RuntimeError, match="multiple"):
        kernels.decode_attention(q, k, k, 0.1)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.decode_attention(q.double(), k.double()[:, :2], k.double()[:, :2], 0.1)
    with pytest.raises(RuntimeError, match="q \\(B, H, 1, D\\)"):
        kernels.decode_attention(torch.randn(1, 4, 2, 64), k[:, :2], k[:, :2], 0.1)


@needs_kernels
def test_decoding_uses_the_kernel_once_the_extension_is_loaded(monkeypatch):
    """With a KV cache and one new position the entry point runs the kernel (the extension is loaded
    here); its output matches torch's kernel; without the extension torch's kernel runs."""
    torch.manual_seed(1)
    calls = []
    real = kernels.decode_attention

    class Spy:
        def __getattr__(self, name):
            return getattr(kernels, name)

        def decode_attention(self, *args):
            calls.append(args[0].shape)
            return real(*args)

    cache = KVCache(1, 2, 2, 64, 16)
    q, k, v = torch.randn(2, 4, 5, 64), torch.randn(2, 2, 5, 64), torch.randn(2, 2, 5, 64)
    scaled_dot_product_attention(q, k, v, causal=True, kv_cache=cache[0])  # a prompt of 5: torch's kernel
    q1, k1, v1 = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64)
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[1, :2] = False
    monkeypatch.setattr(quant_kernels, "loaded_kernels", lambda: Spy())
    got = scaled_dot_product_attention(q1, k1, v1, causal=True, kv_cache=cache[0], key_padding_mask=pad)
    assert calls == [(2, 4, 1, 64)]
    cache[0].length -= 1  # the same step again, through torch's kernel
    monkeypatch.setattr(quant_kernels, "loaded_kernels", lambda: None)
    want = scaled_dot_product_attention(q1, k1, v1, causal=True, kv_cache=cache[0], key_padding_mask=pad)
    assert calls == [(2, 4, 1, 64)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # gradients, other dtypes and explicit masks keep torch's kernel
    monkeypatch.setattr(quant_kernels, "loaded_kernels", lambda: Spy())
    scaled_dot_product_attention(q1.double(), k1.double(), v1.double())
    scaled_dot_product_attention(q1.requires_grad_(), k1, v1)
    scaled_dot_product_attention(q1.detach(), k1, v1, attn_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool))
    assert len(calls) == 1


def test_loaded_kernels_never_builds(monkeypatch):
    """Unquantized decoding does not pay for a compilation: before anything built the extension,
    the attention runs torch's kernel."""
    built = []

    class NotBuilt:
        def cache_info(self):
            return functools_info(0)

        def __call__(self):
            built.append(1)

    monkeypatch.setattr(quant_kernels, "_build", NotBuilt())
    assert quant_kernels.loaded_kernels() is None and not built
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 2, 8)
    assert attention._decode_attention(q, k, k, None, None) is None and not built


def functools_info(currsize: int):
    from functools import _CacheInfo

    return _CacheInfo(0, 0, None, currsize)


@needs_kernels
def test_the_kernel_benchmark_compares_with_torch_side_by_side():
    """``scripts/bench_quant_gemv.py --attention`` times both kernels on the same inputs and prints ratios."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_quant_gemv.py"
    run = subprocess.run([sys.executable, str(script), "--attention", "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if "positions:" in line]
    assert len(lines) == 4 and all("torch" in line and "x the time" in line for line in lines)
