#!/usr/bin/env python
"""The quantized matrix-vector kernels alone, at a few activation rows: gencli's CPU kernels against
torch's weight-only kernels and fp32 ``F.linear``, with fp32 activations and with
activations quantized to int8 (integer dot products), on GPT-2-124M's layer shapes, in CPU time.

    python scripts/bench_quant_gemv.py --threads 1 --copies 24
    python scripts/bench_quant_gemv.py --threads 2 --clock wall

Each weight is held in ``--copies`` copies used in turn, so that the weights come from memory rather
than the caches (``--copies 1`` measures them cache-hot). GB/s is the bytes of the codes and scales
(fp32: of the weight) over the time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ((2304, 768), (768, 768), (3072, 768), (768, 3072), (50257, 768))  # (out, in): GPT-2's layers and LM head


CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCK["cpu"]


def best_cpu_time(calls, repeat: int) -> float:
    """The best over ``repeat`` passes of the time per call (``--clock``), one pass calling each once."""
    for f in calls:
        f()
    best = float("inf")
    for _ in range(repeat):
        start = clock()
        for f in calls:
            f()
        best = min(best, (clock() - start) / len(calls))
    return best


def main() -> None:
    import torch
    import torch.nn.functional as F

    from gencli.backend.quant_kernels import cpu_kernels
    from gencli.backend.quantize import QuantizationSpec, QuantizedLinear

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=1, help="activation rows (1: decoding)")
    p.add_argument("--copies", type=int, default=24, help="copies of each weight, used in turn (the LM head: at most 3)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument(
        "--clock", choices=tuple(CLOCK), default="cpu", help="process CPU time, or wall clock (with several threads CPU time also counts OpenMP's waiting)"
    )
    args = p.parse_args()
    global clock
    clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    own = cpu_kernels()
    if own is None:
        raise SystemExit("gencli's quantized CPU kernels cannot be built here")
    print(f"threads {args.threads}, rows {args.rows}, copies {args.copies}, kernels {own.isa()} / {own.int_isa()} (ms per call, {args.clock} time; GB/s)")
    for out_f, in_f in SHAPES:
        copies = min(3, args.copies) if out_f > 10000 else args.copies
        weights = [torch.randn(out_f, in_f) * 0.02 for _ in range(copies)]
        x = torch.randn(args.rows, in_f)
        xb = x.bfloat16()
        t = best_cpu_time([lambda w=w, x=x: F.linear(x, w) for w in weights], args.repeat)
        line = [f"{out_f}x{in_f}", f"fp32 {t * 1e3:.3f} {weights[0].numel() * 4 / t / 1e9:.1f}"]
        for mode in ("int8", "int4"):
            layers = [QuantizedLinear.from_weight(w, None, QuantizationSpec.for_mode(mode)) for w in weights]
            nbytes = sum(b.numel() * b.element_size() for b in (layers[0].weight, layers[0].weight_scale, layers[0].weight_zero) if b is not None)
            packed = [q._cpu_operands() for q in layers]  # torch's layout (int4: a repacked copy)
            if mode == "int8":
                ours = [lambda q=q, x=x, a=a: own.int8_gemv(x, q.weight, q.weight_scale, a) for q in layers for a in (False, True)]
                torchs = [lambda o=o, xb=xb: torch.ops.aten._weight_int8pack_mm(xb, o[0], o[1]) for o in packed]
            else:
                ours = [lambda q=q, x=x, a=a: own.int4_gemv(x, q.weight, q.weight_scale, q.weight_zero, q.group_size, a) for q in layers for a in (False, True)]
                torchs = [lambda o=o, xb=xb, g=layers[0].group_size: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, o[0], g, o[1]) for o in packed]
            t_f32, t_q8 = best_cpu_time(ours[0::2], args.repeat), best_cpu_time(ours[1::2], args.repeat)
            t_torch = best_cpu_time(torchs, args.repeat)
            line.append(
                f"{mode} gencli fp32-act {t_f32 * 1e3:.3f} {nbytes / t_f32 / 1e9:.1f} int8-act {t_q8 * 1e3:.3f} {nbytes / t_q8 / 1e9:.1f}"
                f" torch {t_torch * 1e3:.3f} ({t_torch / t_q8:.2f}x int8-act's time)"
            )
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
