"""Sentence embeddings: gencli's embed pipeline vs transformers' BertModel + mean pooling + L2
normalisation as sentence-transformers computes them, on an all-MiniLM-L6-v2-shaped random BERT.

    python scripts/bench.py embed --rounds 3                 # float32 on both sides
    python scripts/bench.py embed --dtype auto --rounds 3    # gencli's auto dtype vs transformers' fp32

Both sides do the same work, end to end, from texts: tokenize, run the encoder, mean-pool the token
states over the real tokens, L2-normalise. The reference batches as sentence-transformers' ``encode``
does (sorted by text length, longest first); gencli's pipeline sorts by token count. ``sentences_per_s_b64``
embeds ``--sentences`` docstring sentences (8-64 tokens) in batches of ``--batch``; ``sentences_per_s_b1``
embeds the first ``--single`` of them one at a time. ``sentences_per_cpu_s_*`` count the same per
second of the process's CPU time: on a shared machine, at ``--threads 1``, the figure to compare.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench_cases import _encoders as E
from bench_cases._util import device_and_dtype, peak_gpu_mb

DESCRIPTION = "embed: sentences/s, all-MiniLM-L6-v2 shape (6 x 384, random weights), batch 1 and 64 (gencli vs transformers + mean pooling)"
METRICS = {"sentences_per_s_b1": "higher", "sentences_per_s_b64": "higher", "sentences_per_cpu_s_b1": "higher", "sentences_per_cpu_s_b64": "higher",
           "load_s": "lower"}  # fmt: skip


def add_arguments(p):
    E.add_shape_arguments(p)
    p.add_argument("--batch", type=int, default=64, help="the large batch size")
    p.add_argument("--single", type=int, default=32, help="sentences embedded one at a time")


def setup(args, workdir):
    folder = Path(workdir) / "model"
    E.save_checkpoint(args, folder, "BertModel", add_pooling_layer=False)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": args.hidden, "pooling_mode_mean_tokens": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    E.write_sentences(args, folder, Path(workdir), args.sentences)


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    folder = Path(workdir) / "model"
    texts = E.read_sentences(Path(workdir))
    singles = texts[: args.single]
    t0 = time.perf_counter()
    if side == "reference":
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        model = transformers.AutoModel.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        load_s = time.perf_counter() - t0

        def embed(batch_texts: list[str], batch: int) -> torch.Tensor:
            out = torch.empty(len(batch_texts), args.hidden)
            with torch.inference_mode():
                for idx in E.length_sorted_batches(batch_texts, batch):
                    features = tokenizer([batch_texts[i] for i in idx], padding=True, truncation=True, max_length=256, return_tensors="pt").to(device)
                    hidden = model(**features).last_hidden_state
                    m = features["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    vecs = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
                    out[torch.tensor(idx)] = torch.nn.functional.normalize(vecs, p=2, dim=1).float().cpu()
            return out

    else:
        from gencli.backend.device import DTYPE_NAMES
        from gencli.pipelines.encoders.embed import embed_texts
        from gencli.pipelines.encoders.loading import load_encoder

        enc = load_encoder(folder, device=str(device), dtype=DTYPE_NAMES[dtype], threads=args.threads)
        load_s = time.perf_counter() - t0

        def embed(batch_texts: list[str], batch: int) -> torch.Tensor:
            return embed_texts(enc, batch_texts, batch_size=batch)

    t1, c1 = E.best_times(lambda: [embed([t], 1) for t in singles], args.repeat)
    t64, c64 = E.best_times(lambda: embed(texts, args.batch), args.repeat)
    vectors = embed(texts, args.batch)
    result = {
        "sentences_per_s_b1": round(len(singles) / t1, 2),
        "sentences_per_s_b64": round(len(texts) / t64, 2),
        "sentences_per_cpu_s_b1": round(len(singles) / c1, 2),
        "sentences_per_cpu_s_b64": round(len(texts) / c64, 2),
        "load_s": round(load_s, 3),
        "dtype": str(dtype).replace("torch.", ""),
        "sentences": len(texts),
        "peak_gpu_mb": peak_gpu_mb(device),
    }
    E.compare(Path(workdir), side, "embeddings", vectors, result)
    if "max_abs_diff_vs_reference" in result:
        ref = torch.load(Path(workdir) / "reference_embeddings.pt", weights_only=True)
        result["min_cosine_vs_reference"] = round(float((ref * vectors).sum(-1).min()), 6)
    return result
