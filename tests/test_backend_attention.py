"""The attention entry point against the written-out formula: causal, padding, cross, GQA, KV cache."""

import math

import pytest
import torch

from gencli.backend.attention import KVCache, build_mask, reference_attention, scaled_dot_product_attention


def qkv(b=2, h=4, hkv=4, lq=7, lk=7, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    return q, k, v


def naive(q, k, v, allowed):
    """Loops over every (batch, head, query): the formula with nothing clever."""
    b, h, lq, d = q.shape
    rep = h // k.shape[1]
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                s = torch.tensor([float(q[bi, hi, i] @ k[bi, hi // rep, j]) / math.sqrt(d) for j in range(k.shape[2])])
                ok = allowed(bi, i)
                s = torch.where(ok, s, torch.tensor(float("-inf")))
                w = torch.softmax(s, 0)
                out[bi, hi, i] = (w[:, None] * v[bi, hi // rep]).sum(0)
    return out


def test_reference_matches_naive_loops_causal():
    q, k, v = qkv(b=1, h=2, hkv=2, lq=5, lk=5, d=4)
    mask = build_mask(5, 5, causal=True)
    ref, w = reference_attention(q, k, v, mask)
    loops = naive(q, k, v, lambda b, i: torch.arange(5) <= i)
    assert torch.allclose(ref, loops, atol=1e-5)
    assert torch.allclose(w.sum(-1), torch.ones(1, 2, 5))
    assert torch.all(w[0, 0].triu(1) == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention(causal):
    q, k, v = qkv()
    out = scaled_dot_product_attention(q, k, v, causal=causal)
    ref, _ = reference_attention(q, k, v, build_mask(7, 7, causal=causal))
    assert torch.allclose(out, ref, atol=1e-5)


def test_causal_actually_masks_the_future():
    q, k, v = qkv()
    base = scaled_dot_product_attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] += 5.0
    changed = scaled_dot_product_attention(q, k2, v2, causal=True)
    assert torch.allclose(base[:, :, :-1], changed[:, :, :-1], atol=1e-6)
    assert not torch.allclose(base[:, :, -1], changed[:, :, -1])


def test_key_padding_mask_left_padding():
    q, k, v = qkv()
    kpm = torch.ones(2, 7, dtype=torch.bool)
    kpm[0, :3] = False  # first sequence left-padded by 3
    out = scaled_dot_product_attention(q, k, v, causal=True, key_padding_mask=kpm)
    assert torch.isfinite(out).all(), "fully masked padding queries must stay finite"
    # the real positions of the padded sequence equal attention over the unpadded sequence alone
    alone = scaled_dot_product_attention(q[:1, :, 3:], k[:1, :, 3:], v[:1, :, 3:], causal=True)
    assert torch.allclose(out[:1, :, 3:], alone, atol=1e-5)
    ref, _ = reference_attention(q, k, v, build_mask(7, 7, causal=True, key_padding_mask=kpm))
    assert torch.allclose(out[1], ref[1], atol=1e-5)


def test_cross_attention_with_context_padding():
    q, _, _ = qkv(lq=5)
    _, k, v = qkv(lk=9, seed=1)
    kpm = torch.ones(2, 9, dtype=torch.bool)
    kpm[1, 6:] = False
    out = scaled_dot_product_attention(q, k, v, key_padding_mask=kpm)
    loops = naive(q, k, v, lambda b, i: kpm[b])
    assert torch.allclose(out, loops, atol=1e-5)


def test_grouped_query_attention():
    q, k, v = qkv(h=8, hkv=2)
    out = scaled_dot_product_attention(q, k, v, causal=True)
    expanded = scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), causal=True)
    assert torch.allclose(out, expanded, atol=1e-5)
    kpm = torch.ones(2, 7, dtype=torch.bool)
    kpm[0, 0] = False
    out_m = scaled_dot_product_attention(q, k, v, causal=True, key_padding_mask=kpm)
    ref, _ = reference_attention(q, k, v, build_mask(7, 7, causal=True, key_padding_mask=kpm))
    assert torch.allclose(out_m, ref, atol=1e-5)
    with pytest.raises(ValueError):
        scaled_dot_product_attention(q[:, :3], k, v)


@pytest.mark.parametrize("chunks", [[7], [1] * 7, [3, 1, 1, 2], [4, 3]])
def test_kv_cache_incremental_equals_full(chunks):
    q, k, v = qkv(h=4, hkv=2)
    full = scaled_dot_product_attention(q, k, v, causal=True)
    cache = KVCache(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=16, max_len=10)
    outs, pos = [], 0
    for n in chunks:
        sl = slice(pos, pos + n)
        outs.append(scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True, kv_cache=cache[1]))
        pos += n
    assert cache[1].length == 7 and cache[0].length == 0
    assert torch.allclose(torch.cat(outs, 2), full, atol=1e-5)


def test_kv_cache_is_preallocated_and_overflow_is_an_error():
    cache = KVCache(1, 1, 2, 4, max_len=3)
    storage = cache.keys.data_ptr()
    q, k, v = qkv(b=1, h=2, hkv=2, lq=1, lk=1, d=4)
    for _ in range(3):
        scaled_dot_product_attention(q, k, v, causal=True, kv_cache=cache[0])
    assert cache.keys.data_ptr() == storage and cache.length == 3
    with pytest.raises(RuntimeError, match="overflow"):
        scaled_dot_product_attention(q, k, v, causal=True, kv_cache=cache[0])
    cache.reset()
    assert cache.length == 0


def test_kv_cache_with_padding_mask_over_cached_positions():
    q, k, v = qkv(lq=6, lk=6)
    kpm = torch.ones(2, 6, dtype=torch.bool)
    kpm[1, :2] = False
    full = scaled_dot_product_attention(q, k, v, causal=True, key_padding_mask=kpm)
    cache = KVCache(1, 2, 4, 16, max_len=6)
    a = scaled_dot_product_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], causal=True, key_padding_mask=kpm[:, :4], kv_cache=cache[0])
    b = scaled_dot_product_attention(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], causal=True, key_padding_mask=kpm, kv_cache=cache[0])
    assert torch.allclose(torch.cat([a, b], 2)[:, :, 2:], full[:, :, 2:], atol=1e-5)


def test_additive_float_mask_and_scale():
    q, k, v = qkv()
    bias = torch.randn(1, 1, 7, 7)
    out = scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)
    ref, _ = reference_attention(q, k, v, bias, scale=0.3)
    assert torch.allclose(out, ref, atol=1e-5)


def test_return_weights_path():
    q, k, v = qkv()
    out, w = scaled_dot_product_attention(q, k, v, causal=True, return_weights=True)
    assert torch.allclose(out, scaled_dot_product_attention(q, k, v, causal=True), atol=1e-5)
    assert w.shape == (2, 4, 7, 7) and torch.allclose(w.sum(-1), torch.ones(2, 4, 7))


def test_bfloat16_close_to_float32():
    q, k, v = qkv()
    out = scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert out.dtype == torch.bfloat16
    ref = scaled_dot_product_attention(q, k, v, causal=True)
    assert (out.float() - ref).abs().max() < 0.05


def test_causal_needs_enough_keys():
    with pytest.raises(ValueError):
        build_mask(5, 3, causal=True)


@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("padded", [False, True])
def test_single_query_decode_step_matches_the_formula(hkv, padded):
    # a decode step (one query over every cached key): GQA, padding, explicit scale
    q, k, v = qkv(b=2, h=4, hkv=hkv, lq=1, lk=9, seed=3)
    kpm = torch.ones(2, 9, dtype=torch.bool)
    if padded:
        kpm[1, :4] = False
    out = scaled_dot_product_attention(q, k, v, causal=True, key_padding_mask=kpm if padded else None, scale=0.3)
    ref, _ = reference_attention(q, k, v, build_mask(1, 9, key_padding_mask=kpm), scale=0.3)
    assert out.shape == (2, 4, 1, 16)
    assert torch.allclose(out, ref, atol=1e-6)
    # the padded row ignores its padding: the same as attending the real keys alone
    if padded:
        alone = scaled_dot_product_attention(q[1:], k[1:, :, 4:], v[1:, :, 4:], scale=0.3)
        assert torch.allclose(out[1:], alone, atol=1e-6)


def test_single_query_in_bfloat16_stays_close_to_fp32():
    q, k, v = qkv(b=1, h=4, hkv=2, lq=1, lk=33, dtype=torch.bfloat16)
    out = scaled_dot_product_attention(q, k, v, causal=True)
    ref, _ = reference_attention(q.float(), k.float(), v.float())
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, atol=2e-2)
