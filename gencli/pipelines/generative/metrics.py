"""Image comparison metrics for reconstructions: PSNR and SSIM, on uint8-range images.

Both take tensors or arrays of shape ``(N, H, W, C)`` or ``(N, C, H, W)`` (say which with
``channels_last``) holding values on the 0-255 scale (uint8 or float), and return one value per
image. SSIM is Wang et al. (2004) with the usual constants: an 11x11 Gaussian window of sigma 1.5,
K1 = 0.01, K2 = 0.03, data range 255, averaged over the window positions that fit inside the image
and over the channels (what ``skimage.metrics.structural_similarity(..., gaussian_weights=True,
sigma=1.5, use_sample_covariance=False, data_range=255, channel_axis=-1)`` computes).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def _as_nchw(images, channels_last: bool) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    if t.ndim == 3:
        t = t.unsqueeze(0)
    if t.ndim != 4:
        raise ValueError(f"expected a batch of images (N, H, W, C) or (N, C, H, W), got shape {list(t.shape)}")
    t = t.to(torch.float64)
    return t.permute(0, 3, 1, 2) if channels_last else t


def psnr(a, b, *, channels_last: bool = True, data_range: float = 255.0) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB per image (``inf`` for identical images)."""
    x, y = _as_nchw(a, channels_last), _as_nchw(b, channels_last)
    if x.shape != y.shape:
        raise ValueError(f"images of different shapes: {list(x.shape)} and {list(y.shape)}")
    mse = (x - y).pow(2).flatten(1).mean(1)
    return 10.0 * torch.log10(data_range**2 / mse)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    r = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(r**2) / (2 * sigma**2))
    return g / g.sum()


def ssim(a, b, *, channels_last: bool = True, data_range: float = 255.0, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Structural similarity per image (mean over channels and valid window positions)."""
    x, y = _as_nchw(a, channels_last), _as_nchw(b, channels_last)
    if x.shape != y.shape:
        raise ValueError(f"images of different shapes: {list(x.shape)} and {list(y.shape)}")
    n, c, h, w = x.shape
    if min(h, w) < window:
        raise ValueError(f"images of {w}x{h} are smaller than the {window}x{window} SSIM window")
    g = _gaussian_window(window, sigma)
    kx = g.view(1, 1, 1, window).expand(c, 1, 1, window)
    ky = g.view(1, 1, window, 1).expand(c, 1, window, 1)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.conv2d(t, kx, groups=c), ky, groups=c)

    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mx, my = blur(x), blur(y)
    sxx = blur(x * x) - mx * mx
    syy = blur(y * y) - my * my
    sxy = blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return s.flatten(1).mean(1)


def mean_db(values: torch.Tensor) -> float:
    """The mean of per-image PSNRs, ignoring identical images (infinite PSNR)."""
    finite = values[torch.isfinite(values)]
    return float(finite.mean()) if finite.numel() else math.inf


__all__ = ["psnr", "ssim", "mean_db"]
