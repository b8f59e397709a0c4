"""Text classification: gencli's classify-text pipeline vs transformers' (BertForSequenceClassification
+ its text-classification pipeline) on an all-MiniLM-L6-v2-shaped random BERT with 4 labels.

    python scripts/bench.py classify_text --rounds 3                 # float32 on both sides
    python scripts/bench.py classify_text --dtype auto --rounds 3    # gencli's auto dtype vs transformers' fp32

Both sides do the same work, end to end, from texts: ``--sentences`` docstring sentences (8-64
tokens), tokenized, run in batches of ``--batch``, every label's softmax score, sorted. The reference
is ``transformers.pipeline("text-classification", top_k=None, batch_size=...)``. ``sentences_per_cpu_s`` counts per second of the process's CPU time (the figure
to compare at ``--threads 1`` on a shared machine).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench_cases import _encoders as E
from bench_cases._util import device_and_dtype

DESCRIPTION = "classify-text: sentences/s, all-MiniLM-L6-v2 shape (6 x 384, random weights, 4 labels), batch 32 (gencli vs transformers' pipeline)"
METRICS = {"sentences_per_s": "higher", "sentences_per_cpu_s": "higher", "load_s": "lower"}
LABELS = ("circle", "square", "triangle", "star")


def add_arguments(p):
    E.add_shape_arguments(p)
    p.set_defaults(sentences=256)
    p.add_argument("--batch", type=int, default=32)


def setup(args, workdir):
    folder = Path(workdir) / "model"
    E.save_checkpoint(args, folder, "BertForSequenceClassification", id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})
    E.write_sentences(args, folder, Path(workdir), args.sentences)


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    folder = Path(workdir) / "model"
    texts = E.read_sentences(Path(workdir))
    t0 = time.perf_counter()
    if side == "reference":
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        model = transformers.BertForSequenceClassification.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        pipe = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer, device=device, top_k=None, batch_size=args.batch)
        load_s = time.perf_counter() - t0

        def predict():
            return list(pipe(texts))

    else:
        from gencli.backend.device import DTYPE_NAMES
        from gencli.pipelines.encoders.classify import classify_texts
        from gencli.pipelines.encoders.loading import load_encoder

        enc = load_encoder(folder, task="sequence_classification", device=str(device), dtype=DTYPE_NAMES[dtype], threads=args.threads)
        load_s = time.perf_counter() - t0

        def predict():
            return classify_texts(enc, texts, batch_size=args.batch)

    labels, result = E.timed_sentences(predict, texts, args.repeat, load_s=load_s, dtype=dtype, device=device)
    scores = torch.tensor([[next(d["score"] for d in per if d["label"] == name) for name in LABELS] for per in labels])
    E.compare(Path(workdir), side, "scores", scores, result, atol_key="max_score_diff_vs_reference")
    return result
