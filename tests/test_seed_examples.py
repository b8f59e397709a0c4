"""The checked worked examples of ../shared/seed-examples.md, sections 4-6, through the shared code.

The texts use column vectors (a token matrix is d x n); PyTorch rows are tokens, so matrices are
transposed on the way in and out. The attention head of section 4 runs through the model code:
diffusers' ``Attention`` layout (``to_q``, ``to_k``, ``to_v``, ``to_out.0``) with one head of width
d_k = 2, whose value projection is factored exactly as the text's W_Vup W_Vdown (``to_v`` projects down to
d_k, ``to_out.0`` back up to d), and :func:`multi_head_attention` for the other scale.
"""

import math

import torch
import torch.nn as nn

from gencli.backend.attention import build_mask, scaled_dot_product_attention
from gencli.backend.layers import FeedForward, LayerNorm
from gencli.backend.positional import sinusoidal_position_encoding
from gencli.models.attention import Attention, multi_head_attention, split_heads

T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731

E = T([[0.1, 0.2, 1.3], [1.2, 1.09, 1.39], [0.302, 0.502, 0.304]])  # d x n
W_Q = T([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
W_K = T([[0.15, 0.25, 0.35], [0.45, 0.55, 0.65]])
W_VDOWN = T([[0.2, 0.3, 0.4], [0.5, 0.6, 0.7]])
W_VUP = T([[0.25, 0.55], [0.35, 0.65], [0.45, 0.75]])


V = T([[0.665, 0.750, 1.133], [0.813, 0.917, 1.383], [0.961, 1.084, 1.632]])  # the text's V = W_Vup W_Vdown E
WEIGHTS_FORMULA_SCALE = T([[0.2762, 0.2993, 0.4245], [0.2688, 0.2943, 0.4369], [0.2384, 0.2724, 0.4891]])  # rows: queries
WEIGHTS_TEXT_SCALE = T([[0.2867, 0.3061, 0.4072], [0.2806, 0.3022, 0.4172], [0.2555, 0.2850, 0.4595]])


def head() -> Attention:
    """The text's head as gencli's attention module (float64, no biases)."""
    attn = Attention(3, heads=1, dim_head=2, bias=False, out_bias=False).double()
    with torch.no_grad():
        for linear, w in ((attn.to_q, W_Q), (attn.to_k, W_K), (attn.to_v, W_VDOWN), (attn.to_out[0], W_VUP)):
            linear.weight.copy_(w)
    return attn


def test_section4_projections():
    attn, tokens = head(), E.T  # n x d
    q, k = attn.to_q(tokens), attn.to_k(tokens)
    assert torch.allclose(q.T, T([[0.341, 0.389, 0.499], [0.821, 0.926, 1.397]]), atol=2e-3)
    assert torch.allclose(k.T, T([[0.421, 0.478, 0.649], [0.901, 1.016, 1.547]]), atol=2e-3)
    assert torch.allclose(attn.to_v(tokens).T, T([[0.501, 0.568, 0.799], [0.981, 1.105, 1.697]]), atol=2e-3)  # Vdown
    assert torch.allclose(attn.to_out[0](attn.to_v(tokens)).T, V, atol=2e-3)
    scores = k @ q.T  # rows keys, cols queries
    assert torch.allclose(scores, T([[0.883, 0.998, 1.469], [0.997, 1.127, 1.658], [1.491, 1.685, 2.485]]), atol=2e-3)


def _weights(attn: Attention, scale: float) -> torch.Tensor:
    """The head's attention weights (rows: queries), from its own projections, through the entry point."""
    x = E.T[None]
    q, k, v = (split_heads(p(x), 1) for p in (attn.to_q, attn.to_k, attn.to_v))
    _, w = scaled_dot_product_attention(q, k, v, scale=scale, return_weights=True)
    return w[0, 0]


def test_section4_attention_formula_scale():
    attn = head()  # the module's scale is the formula's, 1/sqrt(d_k)
    out = attn(E.T[None])[0]
    # weights: the text's columns are queries -> our rows
    assert torch.allclose(_weights(attn, 1 / math.sqrt(2)), WEIGHTS_FORMULA_SCALE, atol=2e-3)
    assert torch.allclose(out.T, T([[0.8890, 0.8944, 0.9170], [1.0860, 1.0925, 1.1200], [1.2829, 1.2906, 1.3230]]), atol=2e-3)


def test_section4_attention_text_scale():
    attn = head()
    assert torch.allclose(_weights(attn, 1 / math.sqrt(3)), WEIGHTS_TEXT_SCALE, atol=2e-3)
    # the head output V A with the text's scale: multi_head_attention with the factored value projection
    value = nn.Sequential(attn.to_v, attn.to_out[0])
    out = multi_head_attention(E.T[None], attn.to_q, attn.to_k, value, 1, scale=1 / math.sqrt(3))[0]
    assert torch.allclose(out.T, V @ WEIGHTS_TEXT_SCALE.T, atol=3e-3)


def test_section4_causal_mask_softmax():
    """The text's masked score matrix through the entry point: its finite scores as an additive mask
    (q = k = 0), the causal rule adding the -inf, identity values so the output rows are the weights."""
    ninf = float("-inf")
    scores = T([  # rows keys, cols queries
        [3.53, 0.80, 1.96, 4.48, 3.74, -1.95],
        [ninf, -0.30, -0.21, 0.82, 0.29, 2.91],
        [ninf, ninf, 0.89, 0.67, 2.99, -0.41],
        [ninf, ninf, ninf, 1.31, 1.73, -1.48],
        [ninf, ninf, ninf, ninf, 3.07, 2.94],
        [ninf, ninf, ninf, ninf, ninf, 0.31],
    ])  # fmt: skip
    finite = torch.nan_to_num(scores.T, neginf=0.0)[None, None]  # (1, 1, queries, keys)
    zeros = torch.zeros(1, 1, 6, 4, dtype=torch.float64)
    values = torch.eye(6, dtype=torch.float64)[None, None]
    out, w = scaled_dot_product_attention(zeros, zeros, values, causal=True, attn_mask=finite, return_weights=True)
    w = w[0, 0].T
    expected = T([
        [1.00, 0.75, 0.69, 0.92, 0.46, 0.00],
        [0.00, 0.25, 0.08, 0.02, 0.01, 0.46],
        [0.00, 0.00, 0.24, 0.02, 0.22, 0.02],
        [0.00, 0.00, 0.00, 0.04, 0.06, 0.01],
        [0.00, 0.00, 0.00, 0.00, 0.24, 0.48],
        [0.00, 0.00, 0.00, 0.00, 0.00, 0.03],
    ])  # fmt: skip
    assert torch.allclose(w, expected, atol=6e-3)
    assert torch.allclose(w[:, 5], T([0.0036, 0.4627, 0.0167, 0.0057, 0.4768, 0.0344]), atol=1e-4)
    # the boolean causal mask the entry point builds: key j visible to query i iff j <= i
    assert torch.equal(build_mask(6, 6, causal=True)[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    # the kernel path (no weights returned) agrees
    fast = scaled_dot_product_attention(zeros, zeros, values, causal=True, attn_mask=finite)
    assert torch.allclose(fast, out, atol=1e-6)


def test_section5_add_and_norm():
    d_e = T([[1.485, 1.308, 1.225], [0.971, 1.279, 1.515], [2.962, 2.735, 2.303]])
    total = E + d_e
    assert torch.allclose(total, T([[1.585, 1.508, 2.525], [2.171, 2.369, 2.905], [3.264, 3.237, 2.607]]), atol=1e-9)
    norm = LayerNorm(3, eps=1e-8).double()
    with torch.no_grad():
        norm.weight.fill_(0.5)
        norm.bias.fill_(0.6)
    out = norm(total.T).T
    assert torch.allclose(out, T([[0.0574, -0.0115, 0.1284], [0.4786, 0.5983, 1.2921], [1.2640, 1.2132, 0.3795]]), atol=2e-3)


def test_section5_feed_forward():
    ffn = FeedForward(3, 4, act="relu", bias=False).double()
    with torch.no_grad():
        ffn.fc1.weight.copy_(T([[0.033, 0.313, -0.012], [-0.128, 0.552, 1.312], [1.872, -0.876, 1.231], [1.277, -0.438, -0.279]]))
        ffn.fc2.weight.copy_(T([[0.542, -0.313, -0.989, -0.222], [-0.982, 1.121, -0.876, 1.122], [1.523, 0.665, 0.872, 1.878]]))
    x = T([[0.057, 0.478, 1.263], [-0.011, 0.598, 1.213], [0.128, 1.292, 0.379]])
    hidden = ffn.fc1(x)
    assert torch.allclose(hidden, T([[0.136, 1.914, 1.243, -0.489], [0.172, 1.923, 0.949, -0.614], [0.404, 1.194, -0.426, -0.508]]), atol=2e-3)
    assert torch.allclose(ffn(x), T([[-1.755, 0.923, 2.564], [-1.447, 1.155, 2.368], [-0.155, 0.942, 1.409]]), atol=3e-3)


def test_section6_sinusoidal_encoding_paper_form():
    pe = sinusoidal_position_encoding(torch.tensor([1, 2]), 3)
    assert torch.allclose(pe, torch.tensor([[0.8415, 0.5403, 0.0022], [0.9093, -0.4161, 0.0043]]), atol=1e-4)
    # not the k/d variant one text used
    assert abs(pe[0, 1].item() - 0.9989) > 0.1
    assert torch.allclose(sinusoidal_position_encoding(4, 8)[0], torch.tensor([0.0, 1.0] * 4))
