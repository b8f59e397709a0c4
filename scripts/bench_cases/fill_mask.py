"""Fill-mask: gencli's fill-mask pipeline vs transformers' (BertForMaskedLM + its fill-mask pipeline's
top-k) on an all-MiniLM-L6-v2-shaped random BERT with a masked-LM head.

    python scripts/bench.py fill_mask --rounds 3                 # float32 on both sides
    python scripts/bench.py fill_mask --dtype auto --rounds 3    # gencli's auto dtype vs transformers' fp32

Both sides do the same work, end to end, from texts: ``--sentences`` docstring sentences (8-64
tokens) with one word replaced by ``[MASK]``, tokenized, run in batches of ``--batch``, the top ``-k``
tokens of each mask with their scores and filled-in sequences. The reference is
``transformers.pipeline("fill-mask", batch_size=...)``. ``sentences_per_cpu_s`` counts per second of the process's CPU time (the figure
to compare at ``--threads 1`` on a shared machine).
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import torch

from bench_cases import _encoders as E
from bench_cases._util import device_and_dtype

DESCRIPTION = "fill-mask: sentences/s, all-MiniLM-L6-v2 shape (6 x 384, vocab 30522, random weights), batch 32 (gencli vs transformers' pipeline)"
METRICS = {"sentences_per_s": "higher", "sentences_per_cpu_s": "higher", "load_s": "lower"}


def add_arguments(p):
    E.add_shape_arguments(p)
    p.set_defaults(sentences=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("-k", type=int, default=5)


def setup(args, workdir):
    folder = Path(workdir) / "model"
    E.save_checkpoint(args, folder, "BertForMaskedLM")
    texts = E.write_sentences(args, folder, Path(workdir), args.sentences)
    rng = random.Random(1)
    masked = []
    for t in texts:
        words = [m for m in re.finditer(r"\b[A-Za-z]{3,}\b", t)]
        w = words[rng.randrange(len(words))] if words else None
        masked.append(t[: w.start()] + "[MASK]" + t[w.end() :] if w else t + " [MASK]")
    (Path(workdir) / "masked.json").write_text(json.dumps(masked))


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    folder = Path(workdir) / "model"
    texts = json.loads((Path(workdir) / "masked.json").read_text())
    t0 = time.perf_counter()
    if side == "reference":
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        model = transformers.BertForMaskedLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        pipe = transformers.pipeline("fill-mask", model=model, tokenizer=tokenizer, device=device, top_k=args.k, batch_size=args.batch)
        load_s = time.perf_counter() - t0

        def predict():
            return [out for out in pipe(texts)]

    else:
        from gencli.backend.device import DTYPE_NAMES
        from gencli.pipelines.encoders.fill_mask import fill_mask
        from gencli.pipelines.encoders.loading import load_encoder

        enc = load_encoder(folder, task="masked_lm", device=str(device), dtype=DTYPE_NAMES[dtype], threads=args.threads)
        load_s = time.perf_counter() - t0

        def predict():
            return [per_mask[0] for per_mask in fill_mask(enc, texts, top_k=args.k, batch_size=args.batch)]

    preds, result = E.timed_sentences(predict, texts, args.repeat, load_s=load_s, dtype=dtype, device=device)
    tokens = torch.tensor([[p["token"] for p in per] for per in preds])
    scores = torch.tensor([[p["score"] for p in per] for per in preds])
    E.compare(Path(workdir), side, "scores", scores, result, atol_key="max_score_diff_vs_reference")
    ref = Path(workdir) / "reference_tokens.pt"
    if side == "reference":
        torch.save(tokens, ref)
    elif ref.exists():
        result["top1_agreement"] = round(float((torch.load(ref, weights_only=True)[:, 0] == tokens[:, 0]).float().mean()), 4)
    return result
