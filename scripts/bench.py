#!/usr/bin/env python
"""Side-by-side benchmarks: gencli against its reference implementation, in one run, same inputs.

    python scripts/bench.py --list
    python scripts/bench.py attention --device cpu --dtype float32
    python scripts/bench.py load --json

Each case lives in ``scripts/bench_cases/<name>.py`` and defines:

    DESCRIPTION = "one line"
    METRICS = {"tokens_per_s": "higher", "load_s": "lower", ...}   # what is better
    def add_arguments(parser): ...          # optional, case-specific options
    def setup(args, workdir): ...           # optional, once, in this process: shared inputs/checkpoints
    def run(side, args, workdir) -> dict     # side is "reference" or "gencli"; returns metric values
    def summarize(results) -> dict           # optional: figures drawn from both sides' results
    def sides(args) -> list[str]: ...       # optional: more sides than the two (e.g. gencli-int8, llama.cpp-Q8_0)
    def comparisons(args) -> list[tuple[str, str]]: ...  # optional: the (ours, theirs) pairs given as ratios

Each side runs in its own fresh subprocess (so peak memory and load time are its own) on the inputs
``setup`` wrote into ``workdir``. The table shows both values and the ratio gencli / reference with
the direction that is better. ``--rounds N`` runs the two sides N times, alternating which goes
first: each value is then the median over the rounds and each ratio the median of the per-round
ratios, so a machine whose speed drifts (a shared VM) affects both sides alike. Speed targets are
checked here, never by timed unit tests.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

SIDES = ("reference", "gencli")


def available_cases() -> dict[str, object]:
    import bench_cases

    cases = {}
    for info in pkgutil.iter_modules(bench_cases.__path__):
        if not info.name.startswith("_"):
            cases[info.name] = importlib.import_module(f"bench_cases.{info.name}")
    return cases


def build_parser(cases: dict[str, object]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    sub = parser.add_subparsers(dest="case")
    for name, mod in cases.items():
        p = sub.add_parser(name, help=getattr(mod, "DESCRIPTION", ""))
        p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps (default cpu)")
        p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16, or auto (gencli's choice; reference side uses float32)")
        p.add_argument("--threads", type=int, default=None, help="torch threads for both sides")
        p.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is kept)")
        p.add_argument("--rounds", type=int, default=1, help="alternating runs of both sides (medians are reported)")
        p.add_argument("--only", help="run one side only (reference, gencli, or a side the case adds)")
        p.add_argument("--json", action="store_true", help="print the result as one JSON object")
        p.add_argument("--worker", help=argparse.SUPPRESS)
        p.add_argument("--workdir", help=argparse.SUPPRESS)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p)
    return parser


def run_worker(mod, args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = mod.run(args.worker, args, Path(args.workdir))
    result.setdefault("peak_rss_mb", _peak_rss_mb())
    print("BENCH-RESULT " + json.dumps(result), flush=True)


def _peak_rss_mb() -> float:
    """This worker's peak resident memory. On Linux ``VmHWM``: ``ru_maxrss`` keeps the high-water
    mark of the parent it was forked from (a parent that built a large checkpoint in ``setup`` would
    set a floor under both sides)."""
    import resource

    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024, 1)


def run_side(side: str, argv: list[str], workdir: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", side, "--workdir", workdir]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH-RESULT "):
            return json.loads(line[len("BENCH-RESULT ") :])
    sys.stderr.write(proc.stdout + proc.stderr)
    raise SystemExit(f"the {side} side failed (exit {proc.returncode})")


def environment() -> dict:
    import torch

    from bench_cases._machine import cpu_info

    env = {"torch": torch.__version__, "python": platform.python_version(), "cpu_threads": torch.get_num_threads(), "machine": platform.machine()}
    env.update(cpu_info())
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cases = available_cases()
    parser = build_parser(cases)
    args = parser.parse_args(argv)
    if args.list or not args.case:
        for name, mod in cases.items():
            print(f"{name:<12} {getattr(mod, 'DESCRIPTION', '')}")
        return
    mod = cases[args.case]
    if args.worker:
        run_worker(mod, args)
        return
    metrics: dict[str, str] = getattr(mod, "METRICS", {})
    all_sides = list(mod.sides(args)) if hasattr(mod, "sides") else list(SIDES)
    if args.only and args.only not in all_sides:
        raise SystemExit(f"--only: this run has the sides {', '.join(all_sides)}")
    sides = [args.only] if args.only else all_sides
    pairs = [(a, b) for a, b in (mod.comparisons(args) if hasattr(mod, "comparisons") else [("gencli", "reference")]) if a in sides and b in sides]
    measure_bandwidth = None
    if args.device == "cpu" or args.device.startswith("cuda"):
        from bench_cases._machine import read_bandwidth_gbs

        def measure_bandwidth() -> float:
            return read_bandwidth_gbs(args.threads, megabytes=1024 if args.device == "cpu" else 4096, device=args.device)

    with tempfile.TemporaryDirectory(prefix=f"gencli-bench-{args.case}-") as workdir:
        if hasattr(mod, "setup"):
            mod.setup(args, Path(workdir))
        passthrough = [a for a in argv if a not in ("--json",)]
        rounds, bandwidths = [], []
        for r in range(max(1, args.rounds)):
            order = sides if r % 2 == 0 else sides[::-1]
            rounds.append({})
            measured = {}
            for side in order:
                # each side's own, before and after it: a shared machine's memory speed can change within a
                # round, even within a side (then the side's fraction is left out)
                before = measure_bandwidth() if measure_bandwidth else None
                rounds[-1][side] = run_side(side, passthrough, workdir)
                if measure_bandwidth:
                    measured[side] = [before, measure_bandwidth()]
            if measured:
                bandwidths.append(measured)
    results = {side: _median_result([rnd[side] for rnd in rounds]) for side in sides}
    every = [bw for each in bandwidths for pair in each.values() for bw in pair]
    bandwidth = statistics.median(every) if every else None
    for side, fraction in _bandwidth_fractions(rounds, bandwidths).items():  # decode speed as a share of what the memory allows
        results[side]["bandwidth_fraction"] = fraction
    report = {"case": args.case, "device": args.device, "dtype": args.dtype, "environment": environment(), "results": results, "ratios": {}}
    if len(rounds) > 1:
        report["bandwidth_fraction_rounds"] = _bandwidth_fraction_rounds(rounds, bandwidths)
    if args.case == "generate" and args.device == "cpu":  # the decoding kernels' per-CPU choices the gencli sides ran with
        from bench_cases._machine import kernel_tuning

        report["environment"]["kernel_tuning"] = kernel_tuning()
    report["environment"]["read_bandwidth_gbs"] = bandwidth
    report["environment"]["read_bandwidth_rounds_gbs"] = bandwidths
    # per pair: the median over the rounds of the per-round ratio of each metric (and the ratios)
    compared = {f"{a}/{b}": _round_ratios(rounds, a, b, {**metrics, "peak_rss_mb": "lower"}) for a, b in pairs}
    if list(compared) == ["gencli/reference"]:  # the two-side layout: one ratio per metric
        report["ratios"] = {k: v[0] for k, v in compared["gencli/reference"].items()}
        if len(rounds) > 1:
            report["round_ratios"] = {k: v[1] for k, v in compared["gencli/reference"].items()}
    else:
        report["ratios"] = {pair: {k: v[0] for k, v in per.items()} for pair, per in compared.items()}
        if len(rounds) > 1:
            report["round_ratios"] = {pair: {k: v[1] for k, v in per.items()} for pair, per in compared.items()}
    if hasattr(mod, "summarize"):
        report["summary"] = mod.summarize(results)
    report["load_average"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    if args.json:
        print(json.dumps(report))
        return
    print(f"case {args.case}: {getattr(mod, 'DESCRIPTION', '')}")
    env = dict(report["environment"])
    caches = " ".join(f"{k} {v}" for k, v in env.pop("caches", {}).items())
    machine = [f"cpu {env.pop('cpu', '?')}", "isa " + " ".join(env.pop("isa", []) or ["-"]), f"caches {caches}"]
    if env.get("kernel_tuning"):
        machine.append(f"kernel tuning {env.pop('kernel_tuning')}")
    env.pop("kernel_tuning", None)
    per_round = env.pop("read_bandwidth_rounds_gbs", None) or []
    per_side = [bw for each in per_round for pair in each.values() for bw in pair]
    if env.get("read_bandwidth_gbs"):
        each = f" (median; {min(per_side):g}-{max(per_side):g} before and after the sides)" if len(per_side) > 1 else ""
        machine.append(f"read bandwidth {env.pop('read_bandwidth_gbs'):g} GB/s at {args.threads or 'default'} thread(s){each}")
    env.pop("read_bandwidth_gbs", None)
    print(f"device {args.device}, dtype {args.dtype}, " + ", ".join(f"{k} {v}" for k, v in env.items()))
    print("; ".join(machine))
    keys = list(dict.fromkeys([*metrics, *(k for r in results.values() for k in r)]))
    width = max(len(k) for k in keys) + 2
    col = max(14, *(len(s) + 2 for s in sides))
    two_sides = list(compared) == ["gencli/reference"]
    header = f"{'metric':<{width}}" + "".join(f"{s:>{col}}" for s in sides) + ("   gencli/reference" if two_sides else "")
    print(header)
    for key in keys:
        row = f"{key:<{width}}"
        for side in sides:
            v = results[side].get(key)
            row += f"{_fmt(v):>{col}}"
        if two_sides and key in report["ratios"]:
            better = metrics.get(key, "lower" if key == "peak_rss_mb" else "")
            row += f"   {report['ratios'][key]:.2f}x" + (f" ({better} is better)" if better else "")
        print(row)
    if not two_sides and compared:
        print("ratios (median of the per-round ratios):")
        pw = max(len(p) for p in compared) + 2
        shown = [k for k in {**metrics, "peak_rss_mb": "lower"} if any(k in per for per in compared.values())]
        print(f"  {'':<{pw}}" + "".join(f"{k:>{len(k) + 2}}" for k in shown))
        for pair, per in compared.items():
            print(f"  {pair:<{pw}}" + "".join(f"{(f'{per[k][0]:.2f}x' if k in per else '-'):>{len(k) + 2}}" for k in shown))
    if len(rounds) > 1:
        print(f"medians of {len(rounds)} rounds; per-round ratios:")
        labels = {(pair, key): key if two_sides else f"{pair} {key}" for pair, per in compared.items() for key in per}
        lw = max([width, *(len(x) + 2 for x in labels.values())])
        for pair, per in compared.items():
            for key, (_, ratios) in per.items():
                print(f"  {labels[pair, key]:<{lw}}" + " ".join(f"{x:.2f}" for x in ratios))

    if _bandwidth_changed(per_side):
        print(
            f"note: the memory's read bandwidth changed within the run ({min(per_side):g} to {max(per_side):g} GB/s): "
            "each side's bandwidth fraction in each round uses the bandwidth measured just before and after it (none, '-', where "
            "those two differ: the memory changed state during the side), and only same-round ratios compare the sides"
        )
        print(
            "  bandwidth before/after each side, GB/s: "
            + "; ".join(f"{side} {' '.join('/'.join(f'{x:g}' for x in each[side]) for each in per_round)}" for side in sides)
        )
        same = []
        for pair, per in compared.items():
            a, b = pair.split("/")
            steady = _same_state(per_round, a, b)
            if "decode_tokens_per_s" in per and len(steady) == len(per["decode_tokens_per_s"][1]):
                kept = [f"{x:.2f}" for x, ok in zip(per["decode_tokens_per_s"][1], steady) if ok]
                same.append(f"{pair} {' '.join(kept) or '-'}")
        if same:
            print("  decode tokens/s ratios of the rounds whose two sides ran in one memory state: " + "; ".join(same))
        shares = report.get("bandwidth_fraction_rounds", {})
        print(
            "  per-round bandwidth fractions: "
            + "; ".join(f"{side} {' '.join('-' if x is None else f'{x:.2f}' for x in each)}" for side, each in shares.items())
        )
    for key, value in report.get("summary", {}).items():
        print(f"{key:<{width}}{_fmt(value):>14}")
    if report["load_average"]:
        print("load average at the end (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in report["load_average"]))


def _round_ratios(rounds: list[dict], ours: str, theirs: str, keys) -> dict[str, tuple[float, list[float]]]:
    """``{metric: (median ratio, per-round ratios)}`` of side ``ours`` over side ``theirs``."""
    out = {}
    for key in keys:
        pairs = [(rnd[theirs].get(key), rnd[ours].get(key)) for rnd in rounds]
        ratios = [a / b for b, a in pairs if isinstance(b, (int, float)) and isinstance(a, (int, float)) and b]
        if ratios:
            out[key] = (round(statistics.median(ratios), 3), [round(x, 3) for x in ratios])
    return out


STEADY = 1.15  # a side's bandwidth before and after it within this factor: the memory kept its state


def _steady_bandwidth(bw) -> Optional[float]:
    """One figure a side's speed is a share of: a number as it is; ``[before, after]`` their mean, or
    None where they differ by more than :data:`STEADY` (the state changed while the side ran)."""
    if not isinstance(bw, (list, tuple)):
        return bw
    if not all(bw) or max(bw) / min(bw) > STEADY:
        return None
    return sum(bw) / len(bw)


def _bandwidth_fraction_rounds(rounds: list[dict], bandwidths: list) -> dict[str, list[Optional[float]]]:
    """Per side with a decode speed and the bytes a token reads: each round's share of the bandwidth
    measured around it: ``bandwidths[r]`` for ``rounds[r]``, one figure for the round's sides or a
    ``{side: GB/s or [before, after]}`` measured for each side (None in a round where the side's two
    figures differ: see :func:`_steady_bandwidth`)."""
    from bench_cases._machine import bandwidth_fraction

    out = {}
    for side in rounds[0] if rounds and len(bandwidths) == len(rounds) else []:
        shares: list[Optional[float]] = []
        for rnd, bw in zip(rounds, bandwidths):
            measured = bw.get(side) if isinstance(bw, dict) else bw
            if measured and rnd[side].get("weight_bytes_per_token") and rnd[side].get("decode_tokens_per_s"):
                steady = _steady_bandwidth(measured)
                shares.append(None if steady is None else bandwidth_fraction(rnd[side]["weight_bytes_per_token"], rnd[side]["decode_tokens_per_s"], steady))
        if any(x is not None for x in shares):
            out[side] = shares
    return out


def _same_state(bandwidths: list, a: str, b: str) -> list[bool]:
    """Per round: whether sides ``a`` and ``b`` both ran in one state of the memory (each steady, their
    bandwidths within :data:`STEADY` of each other)."""
    out = []
    for each in bandwidths:
        x = _steady_bandwidth(each.get(a)) if isinstance(each, dict) else each
        y = _steady_bandwidth(each.get(b)) if isinstance(each, dict) else each
        out.append(bool(x and y and max(x, y) / min(x, y) <= STEADY))
    return out


def _bandwidth_fractions(rounds: list[dict], bandwidths: list) -> dict[str, float]:
    """The median over the rounds of :func:`_bandwidth_fraction_rounds` (the rounds it has a share for)."""
    return {
        side: round(statistics.median([x for x in shares if x is not None]), 3)
        for side, shares in _bandwidth_fraction_rounds(rounds, bandwidths).items()
    }


def _bandwidth_changed(bandwidths: list[float], tolerance: float = 1.2) -> bool:
    """Whether the run's measured bandwidths differ by more than ``tolerance`` (highest / lowest)."""
    return len(bandwidths) > 1 and min(bandwidths) > 0 and max(bandwidths) / min(bandwidths) > tolerance


def _median_result(runs: list[dict]) -> dict:
    """One side's values over the rounds: the median of each number, the first run's other values."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        if isinstance(value, (int, float)) and all(isinstance(v, (int, float)) for v in values):
            out[key] = statistics.median(values)
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
