"""Decoding with the streamed weights on 2 MB pages against 4 KB pages, in one process (GENCLI_HUGE_PAGES).

Separate processes differ by more than the few percent at stake (the machine drifts between runs), so
this loads the model once with ``GENCLI_HUGE_PAGES=1`` (its streamed / quantized weights on huge pages),
makes a 4 KB-page copy of every such weight, and times the same greedy decoding with either set swapped
in, alternating, each round after a short warm-up; the random model is the one ``bench.py generate``
writes (the same ``--arch``/``--hidden``/``--layers`` options).

    python scripts/bench_huge_pages.py --arch llama --hidden 1024 --layers 16 --mode none --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
os.environ["GENCLI_HUGE_PAGES"] = "1"  # before gencli decides


def main() -> None:
    from bench_cases import generate as case
    from bench_cases._machine import cpu_info

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    case.add_arguments(p)
    p.add_argument("--mode", choices=case.MODES, default="none", help="fp32 (none), bf16, int8 or int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    args.saved, args.llama_cpp = False, False

    from gencli.backend.huge_pages import huge_pages_available, is_on_huge_pages
    from gencli.backend.quantize import QuantizedLinear
    from gencli.backend.streamed_linear import StreamedLinear
    from gencli.pipelines.text.generate import GenerationSettings, generate
    from gencli.pipelines.text.loading import load_text_model
    from gencli.pipelines.text.sampling import SamplingParams

    if not huge_pages_available():
        sys.exit("this kernel offers no transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled)")
    with tempfile.TemporaryDirectory(prefix="gencli-bench-huge-pages-") as tmp:
        workdir = Path(tmp)
        case.setup(args, workdir)
        prompt = json.loads((workdir / "prompt.json").read_text())
        dtype = "bfloat16" if args.mode == "bf16" else "float32"
        quantize = args.mode if args.mode in ("int8", "int4") else None
        tm = load_text_model(workdir / "gpt2", device="cpu", dtype=dtype, threads=args.threads, quantize=quantize)
        layers = [m for m in tm.model.modules() if isinstance(m, (StreamedLinear, QuantizedLinear))]
        huge = [m.weight for m in layers]
        small = [w.clone() for w in huge]
        moved = sum(w.numel() * w.element_size() for w in huge if is_on_huge_pages(w))
        info = cpu_info()
        print(f"cpu {info.get('cpu', 'unknown')}; isa {' '.join(info.get('isa', []))}; caches {info.get('caches', {})}", flush=True)
        print(f"{len(layers)} layers, {moved / 2**20:.0f} MB of weights on huge pages; {args.mode}, {args.threads} thread(s), "
              f"{args.new_tokens} new tokens after {len(prompt)}", flush=True)  # fmt: skip

        def use(weights):
            for m, w in zip(layers, weights):
                m._buffers["weight"] = w
                if isinstance(m, QuantizedLinear):
                    m._kernel = None
            tm.model.forget_fused_decoder()

        def decode(k: int) -> list[int]:
            settings = GenerationSettings(max_new_tokens=k, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
            return generate(tm, [("", prompt)], settings)[0].token_ids

        speeds: dict[str, list[float]] = {"4 KB": [], "2 MB": []}
        ids = {}
        for _ in range(args.rounds):
            for name, weights in (("4 KB", small), ("2 MB", huge)):
                use(weights)
                decode(2)
                start = time.perf_counter()
                ids[name] = decode(args.new_tokens)
                whole = time.perf_counter() - start
                start = time.perf_counter()
                decode(1)
                first = time.perf_counter() - start
                speeds[name].append((args.new_tokens - 1) / (whole - first))
        if ids["4 KB"] != ids["2 MB"]:
            sys.exit("the two kinds of pages gave different tokens")
        for name, values in speeds.items():
            print(f"{name} pages: decode tokens/s {' '.join(f'{v:.2f}' for v in values)}, median {statistics.median(values):.2f}")
        ratios = [b / a for a, b in zip(speeds["4 KB"], speeds["2 MB"])]
        print(f"2 MB / 4 KB per round {' '.join(f'{r:.3f}' for r in ratios)}, median {statistics.median(ratios):.3f}x (same tokens)")


if __name__ == "__main__":
    main()
