"""Semantic segmentation: gencli's SegFormer vs transformers' SegformerForSemanticSegmentation, same
checkpoint and inputs (the segformer-b0 shape by default: MiT-b0 encoder, 256-channel head, 150 labels).

    python scripts/bench.py segment --dtype float32      # parity in the same dtype
    python scripts/bench.py segment --dtype auto         # gencli's auto dtype vs transformers' default fp32
"""

from __future__ import annotations

import time

import torch

from bench_cases._util import best_time, device_and_dtype, peak_gpu_mb

DESCRIPTION = "SegFormer-b0 shape (512x512, 150 labels, random weights): images/s at batch 1 and 8, load time"
METRICS = {"images_per_s_b1": "higher", "images_per_s_b8": "higher", "load_s": "lower"}


def add_arguments(p):
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="the large batch size")
    p.add_argument("--labels", type=int, default=150)


def setup(args, workdir):
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    config = SegformerConfig(
        hidden_sizes=[32, 64, 160, 256], depths=[2, 2, 2, 2], num_attention_heads=[1, 2, 5, 8], decoder_hidden_size=256, num_labels=args.labels
    )
    model = SegformerForSemanticSegmentation(config).eval()
    with torch.no_grad():  # running statistics other than the initial ones, so the BatchNorm matters
        model.decode_head.batch_norm.running_mean.normal_(0, 0.1)
        model.decode_head.batch_norm.running_var.uniform_(0.5, 2.0)
    model.save_pretrained(workdir / "model")
    g = torch.Generator().manual_seed(1)
    torch.save(torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g), workdir / "pixels.pt")


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    pixels = torch.load(workdir / "pixels.pt", weights_only=True)
    start = time.perf_counter()
    if side == "gencli":
        from gencli.backend.device import DTYPE_NAMES
        from gencli.pipelines.segmentation.loading import Segmenter

        seg = Segmenter.load(workdir / "model", device=str(device), dtype=DTYPE_NAMES[dtype], threads=args.threads)
        model = seg.model
    else:
        from transformers import SegformerForSemanticSegmentation

        model = SegformerForSemanticSegmentation.from_pretrained(workdir / "model", dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - start

    def forward(x):
        out = model(x)
        return out if side == "gencli" else out.logits

    big = pixels.to(device, dtype)
    one = big[:1].contiguous()
    with torch.inference_mode():
        t1 = best_time(lambda: forward(one), device, max(args.repeat, 3))
        tb = best_time(lambda: forward(big), device, args.repeat)
        logits = forward(big).float().cpu()
    result = {
        "images_per_s_b1": round(1 / t1, 2),
        "images_per_s_b8": round(big.shape[0] / tb, 2),
        "load_s": round(load_s, 3),
        "dtype": str(dtype).replace("torch.", ""),
        "peak_gpu_mb": peak_gpu_mb(device),
    }
    ref_path = workdir / "reference_logits.pt"
    if side == "reference":
        torch.save(logits, ref_path)
    elif ref_path.exists():
        ref = torch.load(ref_path, weights_only=True)
        result["max_abs_diff_vs_reference"] = round((logits - ref).abs().max().item(), 6)
        result["pixel_agreement"] = round((logits.argmax(1) == ref.argmax(1)).float().mean().item(), 5)
    return result
