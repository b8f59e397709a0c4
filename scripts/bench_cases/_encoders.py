"""What the encoder cases (embed, fill_mask, classify_text) share: a BERT checkpoint of the
all-MiniLM-L6-v2 shape with random weights, saved by transformers, and the sentences both sides read.

The tokenizer is the embedded default's lower-cased WordPiece vocabulary (``weights/bert-pystdlib``,
6,144 tokens) padded with ``[unusedN]`` entries to the model's 30,522; both sides build their fast
tokenizer from that ``vocab.txt``. The sentences are the English of the Python standard library's
docstrings (one sentence each), those of 8 to 64 tokens with the special tokens, in a seeded random
order, so a batch holds varied lengths as real input does.
"""

from __future__ import annotations

import ast
import json
import random
import re
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
BASE_VOCAB = ROOT / "weights" / "bert-pystdlib" / "vocab.txt"


def add_shape_arguments(p) -> None:
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--sentences", type=int, default=512, help="sentences per timed pass at the large batch")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)


def save_checkpoint(args, folder: Path, model_class: str, **extra) -> None:
    """A random-weight BERT (``model_class``: BertModel, BertForMaskedLM, ...) in transformers' layout, with the tokenizer files."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=512,
        **extra,
    )
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).eval().save_pretrained(str(folder), safe_serialization=True)
    base = BASE_VOCAB.read_text(encoding="utf-8").splitlines()
    vocab = base + [f"[unused{i}]" for i in range(args.vocab - len(base))]
    (folder / "vocab.txt").write_text("\n".join(vocab[: args.vocab]) + "\n", encoding="utf-8")
    specials = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]"}
    tok_config = {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 512, **specials}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))


def docstring_sentences() -> list[str]:
    from gencli.data.pysource import read_source, training_files

    out = []
    for path in training_files()[:400]:
        text = read_source(path)
        if not text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    flat = " ".join(doc.split())
                    out += [s for s in re.split(r"(?<=[.!?])\s+", flat) if re.search(r"[a-z]{3}", s) and ">>>" not in s]
    return out


def write_sentences(args, folder: Path, workdir: Path, n: int, seed: int = 0) -> list[str]:
    """``n`` distinct docstring sentences of ``--min-tokens`` to ``--max-tokens`` tokens, shuffled (seeded), into workdir/sentences.json."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate((folder / "vocab.txt").read_text(encoding="utf-8").splitlines())}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    pool = sorted(set(docstring_sentences()))
    random.Random(seed).shuffle(pool)
    chosen = []
    for s in pool:
        if args.min_tokens <= len(tok.encode(s).ids) + 2 <= args.max_tokens:
            chosen.append(s)
            if len(chosen) == n:
                break
    (workdir / "sentences.json").write_text(json.dumps(chosen))
    return chosen


def read_sentences(workdir: Path) -> list[str]:
    return json.loads((workdir / "sentences.json").read_text())


def token_counts(tokenizer, texts: list[str]) -> list[int]:
    return [len(x) for x in tokenizer(texts)["input_ids"]]


def length_sorted_batches(texts: list[str], batch: int) -> list[list[int]]:
    """sentence-transformers' order: indices sorted by text length, longest first, in batches."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    return [order[i : i + batch] for i in range(0, len(order), batch)]


def compare(workdir: Path, side: str, name: str, values: torch.Tensor, result: dict, *, atol_key: str = "max_abs_diff_vs_reference") -> None:
    """The reference side saves ``values``; the gencli side reports its largest difference from them."""
    path = workdir / f"reference_{name}.pt"
    if side == "reference":
        torch.save(values, path)
    elif path.exists():
        ref = torch.load(path, weights_only=True)
        if ref.shape == values.shape:
            result[atol_key] = float((values.float() - ref.float()).abs().max())


def best_times(fn: Callable[[], object], repeat: int = 3, warmup: int = 1) -> tuple[float, float]:
    """(best wall-clock seconds, best CPU seconds of this process) of ``repeat`` calls after ``warmup``.

    On a CPU shared with other jobs the wall clock measures the neighbours as much as the code; the
    process's CPU time (``time.process_time``, every thread) is the work itself, and at one thread it
    is the figure to compare."""
    for _ in range(warmup):
        fn()
    wall = cpu = float("inf")
    for _ in range(max(1, repeat)):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c)
    return wall, cpu


def timed_sentences(predict: Callable[[], object], texts: list[str], repeat: int, *, load_s: float, dtype, device) -> tuple[object, dict]:
    """``predict``'s best times over ``repeat`` runs and one more run's output, with the figures every
    encoder case reports: sentences per second (wall and CPU), load time, dtype, count, peak GPU memory."""
    from bench_cases._util import peak_gpu_mb

    seconds, cpu_seconds = best_times(predict, repeat)
    out = predict()
    return out, {
        "sentences_per_s": round(len(texts) / seconds, 2),
        "sentences_per_cpu_s": round(len(texts) / cpu_seconds, 2),
        "load_s": round(load_s, 3),
        "dtype": str(dtype).replace("torch.", ""),
        "sentences": len(texts),
        "peak_gpu_mb": peak_gpu_mb(device),
    }
