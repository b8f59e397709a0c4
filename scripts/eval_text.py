#!/usr/bin/env python
"""Measure the default text model on the held-out standard-library modules.

    python scripts/eval_text.py                          # weights/llama-pystdlib, --dtype auto
    python scripts/eval_text.py --model PATH --dtype float32 --json
    python scripts/eval_text.py --quantize int8          # weight-only int8 (int4: --quantize int4)
    python scripts/eval_text.py --quantize int4 --agreement 200   # + greedy agreement with fp32
    python scripts/eval_text.py --dtype bfloat16 --agreement 200  # bf16 (packed on CPUs with native bf16) vs fp32
    python scripts/eval_text.py --quantize int4 --decode-kernels  # every row through the decoding kernels

Reports loss per token (nats), perplexity and bits per byte over the modules listed in
gencli.data.pysource.HELDOUT_MODULES (never trained on), scored with a sliding window (see
gencli.pipelines.text.evaluate). These are the figures recorded in the weights README and the main README,
measured on the held-out text whose SHA-256 and sizes the model folder's heldout_text.json records:
another Python's standard library may differ, and the run says so (--record-heldout rewrites the
record, for figures measured anew).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-pystdlib", help="a model folder or an embedded default's name")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantize", choices=("int8", "int4"), default=None, help="quantize the linear layers on loading")
    p.add_argument("--group-size", type=int, default=None, help="int4: input columns per group (default 32)")
    p.add_argument("--stride", type=int, default=None, help="window advance in tokens (default: half the context)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of each module")
    p.add_argument("--agreement", type=int, default=0, metavar="N", help="with --quantize or --dtype bfloat16: greedy 16-token agreement with fp32 on N lines")
    p.add_argument(
        "--decode-kernels",
        action="store_true",
        help="with --quantize: score every row through the decoding kernels (a prompt's rows are otherwise multiplied by the dequantized weight)",
    )
    p.add_argument("--record-heldout", action="store_true", help="write this Python's held-out text's SHA-256 and sizes into the model folder's record")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from gencli.data.pysource import HELDOUT_RECORD, heldout_differences, heldout_files, heldout_fingerprint, read_source, stdlib_root
    from gencli.io import atomic_write_bytes, read_json
    from gencli.pipelines.text.evaluate import evaluate_texts
    from gencli.pipelines.text.loading import describe, load_text_model
    from gencli.weights import resolve_model

    if args.decode_kernels:
        from gencli.backend import quantize

        quantize.DEQUANTIZE_MIN_ROWS = {mode: 1 << 62 for mode in quantize.DEQUANTIZE_MIN_ROWS}
    tm = load_text_model(
        resolve_model(args.model), device=args.device, dtype=args.dtype, threads=args.threads, quantize=args.quantize, group_size=args.group_size
    )
    root = stdlib_root()
    docs = [(f.relative_to(root).as_posix(), read_source(f)) for f in heldout_files(root)]
    docs = [(name, text) for name, text in docs if text]
    record_path = resolve_model(args.model) / HELDOUT_RECORD
    python = sys.version.split()[0]
    if args.record_heldout:
        about = (
            "The held-out standard-library modules (gencli.data.pysource.HELDOUT_MODULES) the figures in README.md were measured on, by "
            "scripts/eval_text.py, and the floors of tests/test_text_default_model.py set: each module's SHA-256 and size in bytes. Another "
            "Python's standard library may hold other text: those figures do not apply to it."
        )
        record = {"python": python, "about": about, "modules": heldout_fingerprint(root)}
        atomic_write_bytes(record_path, (json.dumps(record, indent=2) + "\n").encode(), force=True)
    record = read_json(record_path, missing_ok=True)
    if record is None:
        heldout_text = f"not recorded ({record_path} is absent)"
    else:
        diffs = heldout_differences(record.get("modules", {}), root)
        heldout_text = f"as recorded (Python {record.get('python')})" if not diffs else (
            f"NOT the recorded one (Python {record.get('python')}): {', '.join(diffs)}; the recorded figures do not apply"
        )  # fmt: skip
    start = time.perf_counter()
    score = evaluate_texts(tm, docs, stride=args.stride, max_tokens=args.max_tokens)
    report = {
        "model": describe(tm),
        "python": python,
        "heldout_text": heldout_text,
        "modules": len(docs),
        **score.as_dict(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    if args.agreement and (args.quantize or args.dtype not in ("auto", "float32")):
        # the reference: the same dtype unquantized (--quantize), else float32 (--dtype bfloat16)
        ref_dtype = args.dtype if args.quantize else "float32"
        fp32 = load_text_model(resolve_model(args.model), device=args.device, dtype=ref_dtype, threads=args.threads)
        report["agreement"] = greedy_agreement(fp32, tm, docs, args.agreement)
    if args.json:
        print(json.dumps(report))
        return
    print(f"{report['model']}; Python {report['python']} standard library, {len(docs)} held-out modules, their text {heldout_text}")
    for name, d in score.per_document.items():
        print(f"  {name:<24} {d['tokens']:>7} tokens  loss {d['loss']:.3f}  {d['bits_per_byte']:.3f} bits/byte")
    if "agreement" in report:
        a = report["agreement"]
        print(
            f"greedy agreement with fp32 over {a['prompts']} held-out lines, {a['new_tokens']} new tokens: first token {a['first_token']:.1%}, "
            f"whole continuation {a['all_tokens']:.1%}, position-wise {a['position_wise']:.1%}"
        )
    print(
        f"total: {score.tokens} tokens, {score.bytes} bytes; loss {score.loss:.4f} nats/token, "
        f"perplexity {score.perplexity:.2f}, {score.bits_per_byte:.4f} bits per byte"
    )


def greedy_agreement(reference, model, docs, n: int, new_tokens: int = 16) -> dict:
    """How often ``model`` picks the same greedy tokens as ``reference``, prompted with ``n`` lines
    (over 20 characters) spread evenly over the held-out modules."""
    from gencli.pipelines.text.generate import GenerationSettings, encode_prompt, generate
    from gencli.pipelines.text.sampling import SamplingParams

    lines = [line.rstrip() for _, text in docs for line in text.splitlines() if len(line.strip()) > 20]
    prompts = lines[:: max(1, len(lines) // n)][:n]
    settings = GenerationSettings(max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    outs = []
    for tm in (reference, model):
        encoded = [(t, encode_prompt(tm, t)) for t in prompts]
        outs.append([c.token_ids for i in range(0, len(encoded), 8) for c in generate(tm, encoded[i : i + 8], settings)])
    pairs = list(zip(*outs))
    return {
        "prompts": len(pairs),
        "new_tokens": new_tokens,
        "first_token": sum(a[0] == b[0] for a, b in pairs) / len(pairs),
        "all_tokens": sum(a == b for a, b in pairs) / len(pairs),
        "position_wise": sum(x == y for a, b in pairs for x, y in zip(a, b)) / (new_tokens * len(pairs)),
    }


if __name__ == "__main__":
    main()
