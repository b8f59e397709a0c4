"""The blocks the VAE and the UNet share, against diffusers' own modules with the same weights."""

from __future__ import annotations

import pytest
import torch

from gencli.backend.layers import GroupNorm
from gencli.models.attention import Attention
from gencli.models.resnet2d import Downsample2D, ResnetBlock2D, Upsample2D

diffusers = pytest.importorskip("diffusers")


def _copy(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """Load diffusers' weights into ours by name (both sides must have exactly the same tensors)."""
    state = {k: v for k, v in theirs.state_dict().items() if not k.startswith("Conv2d_0.")}  # diffusers' alias of `conv`
    ours.load_state_dict(state, strict=True)


@pytest.mark.parametrize(
    "cin,cout,temb,norm",
    [(32, 32, 64, "default"), (32, 64, 64, "default"), (64, 32, None, "default"), (32, 64, 48, "scale_shift")],
)
def test_resnet_block_matches_diffusers(cin, cout, temb, norm):
    from diffusers.models.resnet import ResnetBlock2D as Ref

    torch.manual_seed(0)
    ref = Ref(in_channels=cin, out_channels=cout, temb_channels=temb, groups=8, eps=1e-6, time_embedding_norm=norm).eval()
    for p in ref.parameters():  # non-trivial norms and biases
        torch.nn.init.normal_(p, std=0.2)
    ours = ResnetBlock2D(cin, cout, temb_channels=temb, groups=8, eps=1e-6, time_embedding_norm=norm).eval()
    _copy(ours, ref)
    x = torch.randn(2, cin, 9, 7)
    t = torch.randn(2, temb) if temb else None
    with torch.no_grad():
        torch.testing.assert_close(ours(x, t), ref(x, t), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padding", [0, 1])
def test_downsample_matches_diffusers(padding):
    from diffusers.models.downsampling import Downsample2D as Ref

    torch.manual_seed(1)
    ref = Ref(16, use_conv=True, out_channels=24, padding=padding, name="conv").eval()
    ours = Downsample2D(16, out_channels=24, padding=padding).eval()
    _copy(ours, ref)
    x = torch.randn(2, 16, 10, 8)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-6)


def test_upsample_matches_diffusers_with_output_size():
    from diffusers.models.upsampling import Upsample2D as Ref

    torch.manual_seed(2)
    ref = Ref(16, use_conv=True, out_channels=8).eval()
    ours = Upsample2D(16, out_channels=8).eval()
    _copy(ours, ref)
    x = torch.randn(2, 16, 5, 3)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours(x, (11, 7)), ref(x, output_size=(11, 7)), atol=1e-6, rtol=1e-6)


def test_vae_style_spatial_attention_matches_diffusers():
    """One head of the full width, GroupNorm first, residual added: the VAE mid-block's attention."""
    from diffusers.models.attention_processor import Attention as Ref

    torch.manual_seed(3)
    c = 32
    ref = Ref(c, heads=1, dim_head=c, rescale_output_factor=1.0, eps=1e-6, norm_num_groups=8, residual_connection=True, bias=True, upcast_softmax=True).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = Attention(c, heads=1, dim_head=c, bias=True, norm_num_groups=8, eps=1e-6, residual_connection=True).eval()
    _copy(ours, ref)
    x = torch.randn(2, c, 6, 5)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_cross_attention_matches_diffusers():
    """Several heads, no q/k/v bias, keys and values from a context of another width: the UNet's attn2."""
    from diffusers.models.attention_processor import Attention as Ref

    torch.manual_seed(4)
    ref = Ref(40, cross_attention_dim=24, heads=4, dim_head=10, bias=False, upcast_attention=True).eval()
    ours = Attention(40, cross_attention_dim=24, heads=4, dim_head=10, bias=False).eval()
    _copy(ours, ref)
    x, ctx = torch.randn(3, 17, 40), torch.randn(3, 7, 24)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, ctx), ref(x, encoder_hidden_states=ctx), atol=1e-5, rtol=1e-5)


def test_token_self_attention_matches_diffusers():
    from diffusers.models.attention_processor import Attention as Ref

    torch.manual_seed(6)
    ref = Ref(32, heads=2, dim_head=16, bias=False).eval()
    ours = Attention(32, heads=2, dim_head=16, bias=False).eval()
    _copy(ours, ref)
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_group_norm_activation_matches_separate_ops():
    torch.manual_seed(5)
    norm = GroupNorm(4, 16, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x = torch.randn(2, 16, 5, 5)
    expected = torch.nn.functional.silu(torch.nn.functional.group_norm(x, 4, norm.weight, norm.bias, 1e-6))
    with torch.no_grad():
        torch.testing.assert_close(norm(x, "silu"), expected)
    torch.testing.assert_close(norm(x, "silu"), expected)  # with autograd: not in place, same values
    out = norm(x.requires_grad_(), "silu")
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with torch.no_grad():  # bf16 input: fp32 statistics, close to the fp32 result
        got = norm.to(torch.bfloat16)(x.detach().to(torch.bfloat16), "silu").float()
    torch.testing.assert_close(got, expected.detach(), atol=0.05, rtol=0.05)
