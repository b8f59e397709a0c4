#!/usr/bin/env python
"""The quantized matrix-vector kernels alone, at a few activation rows: gencli's CPU kernels against
torch's weight-only kernels and fp32 ``F.linear``, with fp32 activations and with
activations quantized to int8 (integer dot products), on GPT-2-124M's layer shapes, in CPU time.

    python scripts/bench_quant_gemv.py --threads 1 --copies 24
    python scripts/bench_quant_gemv.py --threads 2 --clock wall
    python scripts/bench_quant_gemv.py --threads 2 --stack       # a Llama-shaped stack, from memory
    python scripts/bench_quant_gemv.py --threads 2 --attention   # decoding's attention kernel
    python scripts/bench_quant_gemv.py --threads 2 --in-generate int4   # the products' share of a token
    python scripts/bench_quant_gemv.py --threads 2 --projections int4   # fused q/k/v, gate/up vs one by one
    python scripts/bench_quant_gemv.py --threads 2 --fused int8 --arch gpt2   # one native call a token vs layer by layer

Each weight is held in ``--copies`` copies used in turn, so that the weights come from memory rather
than the caches (``--copies 1`` measures them cache-hot; on a CPU with a large last-level cache, 24
copies of GPT-2's smaller layers may still fit in it: ``--stack`` is the from-memory figure). GB/s is
the bytes of the codes and scales (fp32: of the weight) over the time.

``--stack``: the int8 and int4 layers of a Llama shape (16 layers of 1024x1024 x4, 2816x1024 x2,
1024x2816; 196 / 122 MB of codes and scales), one row through all of them in turn, wall clock, next
to a streaming read of 256 MB (``torch.max``): what decoding a model larger than the caches reads.
``--attention``: the decode-attention kernel (one query over a KV cache) against torch's
``F.scaled_dot_product_attention``, wall clock.
``--in-generate MODE``: greedy decoding of 64 tokens on the bench's random GPT-2-124M-shaped model
quantized as MODE, every kernel call timed inside ``generate``: the products' share of the wall
clock and their GB/s per layer shape.
``--projections MODE``: the bench's random Llama shape (16 layers, hidden 1024) quantized as MODE,
decoding 32 tokens with a layer's q/k/v (and gate/up) projections in one kernel call
(:func:`gencli.backend.layers.project`) and with the layers called one by one, alternating in one
process: ms a token, best and median of ``--repeat`` / 4 rounds each.
``--in-generate`` and ``--projections`` time the layer-by-layer path (``GENCLI_FUSED_DECODE=0``: with
the fused decoding step the products are inside one native call a token).
``--fused MODE``: the bench's random model (``--arch gpt2``: GPT-2-124M shape, ``llama``: 16 layers,
hidden 1024) quantized as MODE, decoding 32 tokens with the fused decoding step
(:mod:`gencli.backend.decoder_step`) and layer by layer, alternating in one process: ms a token,
best and median of ``--repeat`` / 4 rounds each.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_cases

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
    p.add_argument("--stack", action="store_true", help="a Llama-shaped stack of layers read from memory (wall clock)")
    p.add_argument("--attention", action="store_true", help="the decode-attention kernel against torch's (wall clock)")
    p.add_argument("--in-generate", choices=("int8", "int4"), help="time the kernel calls inside generate (GPT-2 shape, random weights)")
    p.add_argument("--projections", choices=("int8", "int4"), help="fused projections against one call a layer (Llama shape, random weights)")
    p.add_argument("--fused", choices=("int8", "int4"), help="the fused decoding step against layer by layer (--arch, random weights)")
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2", help="--fused: the model shape")
    args = p.parse_args()
    global clock
    clock = CLOCK["wall" if args.stack or args.attention or args.in_generate or args.projections or args.fused else args.clock]
    if args.in_generate or args.projections:
        from gencli.backend.decoder_step import ENV_SWITCH

        os.environ[ENV_SWITCH] = "0"  # the layer-by-layer path, whose calls these modes time
    torch.set_num_threads(args.threads)
    own = cpu_kernels()
    if own is None:
        raise SystemExit("gencli's quantized CPU kernels cannot be built here")
    if args.stack:
        return stack(own, args)
    if args.attention:
        return attention(own, args)
    if args.in_generate:
        return in_generate(own, args)
    if args.projections:
        return projections(args)
    if args.fused:
        return fused_step(args)
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


def stack(own, args) -> None:
    import torch

    from gencli.backend.quantize import quantize_int4, quantize_int8

    shapes = [(1024, 1024)] * 4 + [(2816, 1024)] * 2 + [(1024, 2816)]
    layers = []
    for _ in range(16):
        for out_f, in_f in shapes:
            w = torch.randn(out_f, in_f) * 0.02
            layers.append((in_f, quantize_int8(w), quantize_int4(w, 32)))
    x = {k: torch.randn(args.rows, k) for k in (1024, 2816)}
    calls = {
        "int8": ([lambda k=k, q=q: own.int8_gemv(x[k], q[0], q[1], True) for k, q, _ in layers], [t for _, q, _ in layers for t in q]),
        "int4": ([lambda k=k, q=q: own.int4_gemv(x[k], q[0], q[1], q[2], 32, True) for k, _, q in layers], [t for _, _, q in layers for t in q]),
    }
    big = torch.randn(64 << 20)
    print(f"threads {args.threads}, rows {args.rows}, kernels {own.int_isa()} (int8 activations), wall clock")
    for name, (fns, tensors) in calls.items():
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        t = best_cpu_time([lambda fns=fns: [f() for f in fns]], args.repeat)
        print(f"{name}: {nbytes / 2**20:.0f} MB in {t * 1e3:.1f} ms, {nbytes / t / 1e9:.1f} GB/s")
    t = best_cpu_time([big.max], args.repeat)
    print(f"streaming read (torch.max): {big.numel() * 4 / 2**20:.0f} MB in {t * 1e3:.1f} ms, {big.numel() * 4 / t / 1e9:.1f} GB/s")


def _bench_model(work: Path, arch: str, mode: str, threads: int):
    """The generate bench case's random model (GPT-2-124M shape, or its Llama shape of 16 layers,
    hidden 1024), written into ``work`` and loaded quantized; with its 32-token prompt."""
    import json
    from types import SimpleNamespace

    from bench_cases import generate as case
    from gencli.pipelines.text.loading import load_text_model

    shape = dict(layers=12, hidden=768) if arch == "gpt2" else dict(layers=16, hidden=1024, intermediate=None, kv_heads=None, vocab=32000)
    case.setup(SimpleNamespace(arch=arch, prompt_tokens=32, saved=False, llama_cpp=False, **shape), work)
    tm = load_text_model(work / "gpt2", device="cpu", threads=threads, quantize=mode)
    return tm, json.loads((work / "prompt.json").read_text())


def projections(args) -> None:
    import tempfile

    import gencli.backend.layers as layers
    import gencli.models.llama as llama

    fused = layers.project

    def one_by_one(x, layers, activations=None):
        return tuple(m(x) if a is None else m(x, activation=a) for m, a in zip(layers, activations or (None,) * len(layers)))

    def use(fn):
        def setup():
            layers.project = llama.project = fn

        return setup

    with tempfile.TemporaryDirectory() as tmp:
        tm, prompt = _bench_model(Path(tmp), "llama", args.projections, args.threads)
        try:
            times = _timed_runs(tm, prompt, [("fused", use(fused)), ("one by one", use(one_by_one))], max(1, args.repeat // 4))
        finally:
            layers.project = llama.project = fused
    _report(times, f"threads {args.threads}, {args.projections}, Llama shape, 32 tokens a round (ms a token, wall clock)")


def _timed_runs(tm, prompt, variants, rounds: int) -> dict:
    """Seconds a token of 32 greedy decoding steps (generate's own decode timing: the prompt and the
    first token left out) for each (name, setup) of ``variants``, alternating, ``rounds`` each."""
    from gencli.pipelines.text.generate import GenerationSettings, generate
    from gencli.pipelines.text.sampling import SamplingParams

    def per_token():
        settings = GenerationSettings(max_new_tokens=33, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        return 1.0 / generate(tm, [("", prompt)], settings)[0].timing["decode_tokens_per_s"]

    times: dict = {name: [] for name, _ in variants}
    for _ in range(rounds):
        for name, setup in variants:
            setup()
            per_token()  # (the fused step is built on the first one)
            times[name].append(per_token())
    return times


def _report(times: dict, title: str) -> None:
    import statistics

    print(title)
    for name, t in times.items():
        print(f"  {name}: best {min(t) * 1e3:.2f}, median {statistics.median(t) * 1e3:.2f}")
    (a, ta), (b, tb) = list(times.items())[:2]
    print(f"  {a} / {b}: best {min(ta) / min(tb):.2f}x the time, median {statistics.median(ta) / statistics.median(tb):.2f}x")


def fused_step(args) -> None:
    import tempfile

    from gencli.backend.decoder_step import ENV_SWITCH

    with tempfile.TemporaryDirectory() as tmp:
        tm, prompt = _bench_model(Path(tmp), args.arch, args.fused, args.threads)

        def switch(value):
            def setup():
                os.environ[ENV_SWITCH] = value
                tm.model.forget_fused_decoder()  # rebuilt (or not) on the next step

            return setup

        times = _timed_runs(tm, prompt, [("fused step", switch("1")), ("layer by layer", switch("0"))], max(1, args.repeat // 4))
    _report(times, f"threads {args.threads}, {args.fused}, {args.arch} shape, 32 tokens a round (ms a token, wall clock)")


def in_generate(own, args) -> None:
    import tempfile
    from collections import defaultdict

    import gencli.backend.quantize as quantize
    from gencli.pipelines.text.generate import GenerationSettings, generate
    from gencli.pipelines.text.sampling import SamplingParams

    spent: dict = defaultdict(lambda: [0.0, 0, 0])  # shape -> [seconds, calls, bytes a call]

    class Timed:
        def __getattr__(self, name):
            return getattr(own, name)

        def _timed(self, fn, codes, *rest):
            start = time.perf_counter()
            out = fn(*rest[:1], codes, *rest[1:])
            entry = spent[tuple(codes.shape)]
            entry[0] += time.perf_counter() - start
            entry[1] += 1
            entry[2] = codes.numel() + sum(t.numel() * t.element_size() for t in rest[1:3] if hasattr(t, "numel"))
            return out

        def int8_gemv(self, x, q, *rest):
            return self._timed(own.int8_gemv, q, x, *rest)

        def int4_gemv(self, x, q, *rest):
            return self._timed(own.int4_gemv, q, x, *rest)

    with tempfile.TemporaryDirectory() as tmp:
        tm, prompt = _bench_model(Path(tmp), "gpt2", args.in_generate, args.threads)
        settings = GenerationSettings(max_new_tokens=65, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        quantize.cpu_kernels = lambda: Timed()
        best = None
        for _ in range(args.repeat // 4 or 1):
            spent.clear()
            start = time.perf_counter()
            generate(tm, [("", prompt)], settings)
            wall = time.perf_counter() - start
            if best is None or wall < best[0]:
                best = (wall, {k: list(v) for k, v in spent.items()})
    wall, shapes = best
    products = sum(v[0] for v in shapes.values())
    print(f"threads {args.threads}, {args.in_generate}, 65 tokens after a 32-token prompt: {wall * 1e3:.0f} ms, of which the kernels "
          f"{products * 1e3:.0f} ms ({products / wall:.0%}; the 32-row prompt goes through them for int4, is dequantized for int8)")
    for shape, (sec, calls, nbytes) in sorted(shapes.items()):
        print(f"  codes {shape}: {calls} calls, {sec / calls * 1e6:.0f} us a call, {nbytes * calls / sec / 1e9:.1f} GB/s")


def attention(own, args) -> None:
    import torch
    import torch.nn.functional as F

    print(f"threads {args.threads}: one query over a KV cache (us per call, wall clock)")
    for heads, kv_heads, dim, length in ((12, 12, 64, 64), (12, 12, 64, 300), (16, 4, 64, 64), (32, 8, 128, 500)):
        q = torch.randn(1, 1, 3, heads, dim).permute(2, 0, 3, 1, 4)[0]  # a view into a fused projection
        cache = torch.randn(2, 1, kv_heads, length + 32, dim)
        k, v = cache[0].narrow(2, 0, length), cache[1].narrow(2, 0, length)
        scale = dim**-0.5
        theirs = functools.partial(F.scaled_dot_product_attention, q, k, v, scale=scale, enable_gqa=heads != kv_heads)
        t_torch = best_cpu_time([theirs] * 200, args.repeat)
        t_own = best_cpu_time([functools.partial(own.decode_attention, q, k, v, scale)] * 200, args.repeat)
        print(f"heads {heads}/{kv_heads}, dim {dim}, {length} positions: torch {t_torch * 1e6:.1f}, gencli {t_own * 1e6:.1f} ({t_own / t_torch:.2f}x the time)")


if __name__ == "__main__":
    main()
