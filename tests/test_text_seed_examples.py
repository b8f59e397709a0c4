"""The worked examples of the source texts (seed-examples.md, sections 4-6) through the shared code.

The texts write tokens as columns (y = W x); in PyTorch terms a token matrix is transposed (tokens
as rows) and W is exactly ``nn.Linear(in, out, bias=False).weight``.
"""

from __future__ import annotations

import math

import torch

from gencli.backend.attention import build_mask, scaled_dot_product_attention
from gencli.backend.layers import FeedForward, LayerNorm
from gencli.backend.positional import sinusoidal_position_encoding

T = torch.tensor
TOL = 2e-3

E = T([[0.1, 0.2, 1.3], [1.2, 1.09, 1.39], [0.302, 0.502, 0.304]])  # d x n, columns are tokens
W_Q = T([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
W_K = T([[0.15, 0.25, 0.35], [0.45, 0.55, 0.65]])
W_VDOWN = T([[0.2, 0.3, 0.4], [0.5, 0.6, 0.7]])
W_VUP = T([[0.25, 0.55], [0.35, 0.65], [0.45, 0.75]])


def _close(a, b, tol=TOL):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), f"{a} != {b}"


def _projections():
    x = E.t()  # tokens as rows
    q = torch.nn.functional.linear(x, W_Q)
    k = torch.nn.functional.linear(x, W_K)
    vdown = torch.nn.functional.linear(x, W_VDOWN)
    v = torch.nn.functional.linear(vdown, W_VUP)
    return q, k, vdown, v


def test_section4_projections():
    q, k, vdown, v = _projections()
    _close(q.t(), [[0.341, 0.389, 0.499], [0.821, 0.926, 1.397]])
    _close(k.t(), [[0.421, 0.478, 0.649], [0.901, 1.016, 1.547]])
    _close(vdown.t(), [[0.501, 0.568, 0.799], [0.981, 1.105, 1.697]])
    _close(v.t(), [[0.665, 0.750, 1.133], [0.813, 0.917, 1.383], [0.961, 1.084, 1.632]])
    # scores K^T Q: rows keys, columns queries (the corrected values)
    _close(k @ q.t(), [[0.883, 0.998, 1.469], [0.997, 1.127, 1.658], [1.491, 1.685, 2.485]])


def test_section4_attention_weights_and_head_output():
    q, k, _, v = _projections()
    q4, k4, v4 = q[None, None], k[None, None], v[None, None]  # (B, H, n, d)
    # the formula's scale 1/sqrt(d_k) = 1/sqrt(2) is the default of the entry point
    out, weights = scaled_dot_product_attention(q4, k4, v4, return_weights=True)
    cols = weights[0, 0]  # rows = queries, so each row is one column of the text's matrix
    _close(cols, [[0.2762, 0.2993, 0.4245], [0.2688, 0.2943, 0.4369], [0.2384, 0.2724, 0.4891]])
    _close(out[0, 0].t(), [[0.8890, 0.8944, 0.9170], [1.0860, 1.0925, 1.1200], [1.2829, 1.2906, 1.3230]])
    # the fast kernel path gives the same output
    _close(scaled_dot_product_attention(q4, k4, v4)[0, 0], out[0, 0], 1e-5)
    # the text's own choice of scale, 1/sqrt(3)
    _, w3 = scaled_dot_product_attention(q4, k4, v4, scale=1 / math.sqrt(3), return_weights=True)
    _close(w3[0, 0], [[0.2867, 0.3061, 0.4072], [0.2806, 0.3022, 0.4172], [0.2555, 0.2850, 0.4595]])


def test_section4_causal_mask_example():
    inf = float("-inf")
    scores = T(
        [
            [3.53, 0.80, 1.96, 4.48, 3.74, -1.95],
            [inf, -0.30, -0.21, 0.82, 0.29, 2.91],
            [inf, inf, 0.89, 0.67, 2.99, -0.41],
            [inf, inf, inf, 1.31, 1.73, -1.48],
            [inf, inf, inf, inf, 3.07, 2.94],
            [inf, inf, inf, inf, inf, 0.31],
        ]
    )  # rows keys, columns queries
    # q = k = 0 and the finite scores as an additive mask: the entry point's causal rule adds the -inf
    finite = torch.where(torch.isinf(scores), torch.zeros(()), scores).t()[None, None]  # (1, 1, queries, keys)
    zeros = torch.zeros(1, 1, 6, 4)
    values = torch.eye(6)[None, None]
    out, w = scaled_dot_product_attention(zeros, zeros, values, causal=True, attn_mask=finite, return_weights=True)
    expected = T(
        [
            [1.00, 0.75, 0.69, 0.92, 0.46, 0.00],
            [0.00, 0.25, 0.08, 0.02, 0.01, 0.46],
            [0.00, 0.00, 0.24, 0.02, 0.22, 0.02],
            [0.00, 0.00, 0.00, 0.04, 0.06, 0.01],
            [0.00, 0.00, 0.00, 0.00, 0.24, 0.48],
            [0.00, 0.00, 0.00, 0.00, 0.00, 0.03],
        ]
    )
    _close(w[0, 0].t(), expected, 6e-3)
    _close(w[0, 0, 5], [0.0036, 0.4627, 0.0167, 0.0057, 0.4768, 0.0344], 1e-4)
    # the boolean causal mask the entry point builds: key j visible to query i iff j <= i
    mask = build_mask(6, 6, causal=True)[0, 0]
    assert torch.equal(mask, torch.ones(6, 6, dtype=torch.bool).tril())
    # with identity values the output rows are the weights themselves (kernel path agrees)
    fast = scaled_dot_product_attention(zeros, zeros, values, causal=True, attn_mask=finite)
    _close(fast[0, 0], w[0, 0], 1e-5)


def test_section5_add_norm_and_ffn():
    dE = T([[1.485, 1.308, 1.225], [0.971, 1.279, 1.515], [2.962, 2.735, 2.303]])
    s = E + dE
    _close(s, [[1.585, 1.508, 2.525], [2.171, 2.369, 2.905], [3.264, 3.237, 2.607]])
    norm = LayerNorm(3, eps=1e-8)
    with torch.no_grad():
        norm.weight.fill_(0.5)
        norm.bias.fill_(0.6)
        normed = norm(s.t()).t()  # per token = per column
    _close(normed, [[0.0574, -0.0115, 0.1284], [0.4786, 0.5983, 1.2921], [1.2640, 1.2132, 0.3795]])

    ffn = FeedForward(3, 4, act="relu", bias=False)
    w1 = T([[0.033, 0.313, -0.012], [-0.128, 0.552, 1.312], [1.872, -0.876, 1.231], [1.277, -0.438, -0.279]])
    w2 = T([[0.542, -0.313, -0.989, -0.222], [-0.982, 1.121, -0.876, 1.122], [1.523, 0.665, 0.872, 1.878]])
    with torch.no_grad():
        ffn.fc1.weight.copy_(w1)
        ffn.fc2.weight.copy_(w2)
        x = T([[0.057, 0.478, 1.263], [-0.011, 0.598, 1.213], [0.128, 1.292, 0.379]])  # tokens as rows
        _close(ffn.fc1(x), [[0.136, 1.914, 1.243, -0.489], [0.172, 1.923, 0.949, -0.614], [0.404, 1.194, -0.426, -0.508]])
        _close(ffn(x), [[-1.755, 0.923, 2.564], [-1.447, 1.155, 2.368], [-0.155, 0.942, 1.409]])


def test_section6_sinusoidal_positions():
    pe = sinusoidal_position_encoding(T([1, 2]), 3)
    _close(pe[0], [0.8415, 0.5403, 0.0022], 1e-4)
    _close(pe[1], [0.9093, -0.4161, 0.0043], 1e-4)
    # the k/d variant one text used is not what we compute
    assert abs(pe[0, 1].item() - 0.9989) > 0.1
