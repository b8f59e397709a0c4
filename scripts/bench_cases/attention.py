"""Attention: gencli's entry point vs the written-out softmax(QK^T/sqrt(d))V formula."""

from __future__ import annotations

import torch

from bench_cases._util import best_time, device_and_dtype

DESCRIPTION = "causal self-attention, batch x 12 heads x seq x 64, default 4 x 1024 (gencli entry point vs eager formula)"
METRICS = {"ms_per_call": "lower", "max_abs_diff": "lower"}


def add_arguments(p):
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)


def run(side, args, workdir):
    from gencli.backend.attention import build_mask, reference_attention, scaled_dot_product_attention

    device, dtype = device_and_dtype(args, side)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, 12, args.seq, 64, generator=g).to(device, dtype) for _ in range(3))
    if side == "gencli":
        fn = lambda: scaled_dot_product_attention(q, k, v, causal=True)  # noqa: E731
    else:
        mask = build_mask(args.seq, args.seq, causal=True, device=device)
        fn = lambda: reference_attention(q, k, v, mask)[0]  # noqa: E731
    with torch.inference_mode():
        seconds = best_time(fn, device, args.repeat)
        ref = reference_attention(q[:1], k[:1], v[:1], build_mask(args.seq, args.seq, causal=True, device=device))[0]
        diff = (fn()[:1].float() - ref.float()).abs().max().item()
    return {"ms_per_call": round(seconds * 1000, 2), "max_abs_diff": diff}
