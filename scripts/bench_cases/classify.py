"""Image classification: gencli's ViT vs transformers' ViTForImageClassification, same checkpoint and inputs.

    python scripts/bench.py classify --dtype float32      # parity in the same dtype
    python scripts/bench.py classify --dtype bfloat16
    python scripts/bench.py classify --dtype auto         # gencli's auto dtype vs transformers' default fp32
"""

from __future__ import annotations

import time

import torch

from bench_cases._util import best_time, device_and_dtype, peak_gpu_mb

DESCRIPTION = "ViT-B/16 (224x224, 1000 labels, random weights): images/s at batch 1 and 32, load time"
METRICS = {"images_per_s_b1": "higher", "images_per_s_b32": "higher", "load_s": "lower"}


def add_arguments(p):
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--patch-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--batch", type=int, default=32, help="the large batch size")


def setup(args, workdir):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        intermediate_size=4 * args.hidden,
        image_size=args.image_size,
        patch_size=args.patch_size,
        num_labels=1000,
        initializer_range=0.05,
    )
    ViTForImageClassification(config).save_pretrained(workdir / "model", safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    torch.save(torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g), workdir / "pixels.pt")


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    pixels = torch.load(workdir / "pixels.pt", weights_only=True)
    start = time.perf_counter()
    if side == "gencli":
        from gencli.backend.device import DTYPE_NAMES
        from gencli.pipelines.vision.classify import ImageClassifier

        clf = ImageClassifier.load(workdir / "model", device=str(device), dtype=DTYPE_NAMES[dtype], threads=args.threads)
        model = clf.model
    else:
        from transformers import ViTForImageClassification

        model = ViTForImageClassification.from_pretrained(workdir / "model", dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - start

    def forward(x):
        out = model(x)
        return out if side == "gencli" else out.logits

    big = pixels.to(device, dtype)
    one = big[:1].contiguous()
    with torch.inference_mode():
        t1 = best_time(lambda: forward(one), device, max(args.repeat, 5))
        t32 = best_time(lambda: forward(big), device, args.repeat)
        logits = forward(big).float().cpu()
    result = {
        "images_per_s_b1": round(1 / t1, 2),
        "images_per_s_b32": round(big.shape[0] / t32, 2),
        "load_s": round(load_s, 3),
        "dtype": str(dtype).replace("torch.", ""),
        "peak_gpu_mb": peak_gpu_mb(device),
    }
    # the reference side runs first and leaves its logits; gencli reports how far it is from them
    ref_path = workdir / "reference_logits.pt"
    if side == "reference":
        torch.save(logits, ref_path)
    elif ref_path.exists():
        ref = torch.load(ref_path, weights_only=True)
        result["max_abs_diff_vs_reference"] = round((logits - ref).abs().max().item(), 6)
        result["top1_agreement"] = round((logits.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4)
    return result
