"""Choosing one token: the Python sampler (``candidates()`` + ``draw()`` of
gencli.pipelines.text.sampling, torch operations) against the native one (``csrc/sampling.cpp``, what
``next_tokens`` uses on a CPU where the kernels are loaded), side by side in one process.

Rows of logits shaped like a language model's (a Zipf law over the vocabulary in a random order,
scaled so that the most likely token holds about a third of the mass, plus noise) at several
vocabulary sizes; each setting timed on both samplers in alternating rounds (medians reported, with the
ratio python / native), the chosen tokens compared on the same uniform numbers.

    python scripts/bench_sampling.py --threads 1 --rounds 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from bench_cases._machine import cpu_info
from gencli.backend.quant_kernels import cpu_kernels
from gencli.pipelines.text.sampling import SamplingParams, candidates, draw, native_settings

SETTINGS = {
    "top-k 50, top-p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "min-p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "temperature only": SamplingParams(temperature=1.0),
    "greedy, penalty 1.2": SamplingParams(temperature=0.0, repetition_penalty=1.2),
}


def lm_like_logits(vocab: int, rows: int, seed: int = 0) -> torch.Tensor:
    """Rows of logits with a Zipf law's ranks in a random order of the vocabulary, plus noise."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.1 * ranks.log() * 2.0
    out = torch.empty(rows, vocab)
    for r in range(rows):
        out[r, torch.randperm(vocab, generator=g)] = base + 0.5 * torch.randn(vocab, generator=g)
    return out


def python_choice(x, params, u_gen, seen):
    if params.greedy:
        from gencli.pipelines.text.sampling import process_logits

        return process_logits(x, params, seen).argmax(-1)
    return draw(*candidates(x, params, seen), u_gen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 50257, 128256])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200, help="tokens chosen per timing (one row each)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels are not available here")
    cpu = cpu_info()
    print(f"{cpu.get('cpu', platform.machine())}, torch {torch.__version__}, {args.threads} thread(s), kernels on {kernels.isa()}")
    print(f"{'vocabulary':>10}  {'setting':<22} {'python ms':>10} {'native ms':>10} {'ratio':>7}  same tokens")
    for vocab in args.vocab:
        rows = lm_like_logits(vocab, 16)
        seen = torch.randint(0, vocab, (16, 64), generator=torch.Generator().manual_seed(1))
        for name, params in SETTINGS.items():
            # the same uniform numbers on both sides: the tokens compared
            same = 0
            for r in range(16):
                gen = torch.Generator().manual_seed(r)
                u = torch.rand(1, generator=gen, dtype=torch.float64)
                gen.manual_seed(r)
                x, s = rows[r : r + 1], seen[r : r + 1]
                want = python_choice(x, params, gen, s)
                got = kernels.sample_tokens(x, *native_settings(params), torch.empty(0, dtype=torch.float64) if params.greedy else u, s)
                same += int(torch.equal(want, got))
            times = {"python": [], "native": []}
            gen = torch.Generator().manual_seed(0)
            for _ in range(args.rounds):
                for side in ("python", "native"):
                    t = time.perf_counter()
                    for i in range(args.calls):
                        x, s = rows[i % 16 : i % 16 + 1], seen[i % 16 : i % 16 + 1]
                        if side == "python":
                            python_choice(x, params, gen, s)
                        else:
                            u = torch.empty(0, dtype=torch.float64) if params.greedy else torch.rand(1, generator=gen, dtype=torch.float64)
                            kernels.sample_tokens(x, *native_settings(params), u, s)
                    times[side].append((time.perf_counter() - t) / args.calls * 1e3)
            py, nat = statistics.median(times["python"]), statistics.median(times["native"])
            print(f"{vocab:>10}  {name:<22} {py:>10.3f} {nat:>10.3f} {py / nat:>6.1f}x  {same}/16")


if __name__ == "__main__":
    main()
