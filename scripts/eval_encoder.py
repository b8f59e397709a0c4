#!/usr/bin/env python
"""Measure a masked-language model's fill-mask accuracy on the held-out standard-library modules.

    python scripts/eval_encoder.py --model weights/bert-pystdlib

The English of the held-out modules (gencli.data.pysource.HELDOUT_MODULES: docstrings and comment
blocks, extracted as scripts/train_encoder.py extracts its training text) is packed into sequences of
the model's window; a fixed 15% of the non-special tokens (seeded) are replaced by [MASK] and predicted
in one pass. Reported: top-1 and top-5 accuracy of the original token, and the same for the
unigram-frequency baseline (always the training text's most frequent tokens); whole words
(tokens that are not ``##`` continuations) are reported separately too. The model runs through
gencli's own loader, so the figures are those of ``gencli fill-mask``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from train_encoder import CLS, MASK, PAD, SPECIALS, corpus, pack, to_tensor  # noqa: E402

from gencli.data.pysource import heldout_files, stdlib_root, training_files  # noqa: E402
from gencli.pipelines.encoders.loading import load_encoder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="weights/bert-pystdlib")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=0.15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    folder = Path(args.model)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    enc = load_encoder(folder, task="masked_lm", device="cpu", dtype="float32", threads=args.threads)
    window = enc.max_length
    root = stdlib_root()
    held = to_tensor(pack(tok, corpus(heldout_files(root), root), window), window)
    # the unigram baseline: the training text's token frequencies (special tokens excluded)
    counts: Counter = Counter()
    for chunks in corpus(training_files(root), root):
        for e in tok.encode_batch(chunks, add_special_tokens=False):
            counts.update(e.ids)
    ranked = [t for t, _ in counts.most_common() if t >= len(SPECIALS)]
    top5_unigram = torch.tensor(ranked[:5])

    gen = torch.Generator().manual_seed(args.seed)
    ids = held.long()
    chosen = (torch.rand(ids.shape, generator=gen) < args.rate) & (ids >= len(SPECIALS))
    inputs = ids.masked_fill(chosen, MASK)
    hits1 = hits5 = base1 = base5 = 0
    word_total = word_hits1 = word_hits5 = 0
    continuation = torch.tensor([tok.id_to_token(i).startswith("##") for i in range(tok.get_vocab_size())])
    with torch.inference_mode():
        for i in range(0, ids.shape[0], 32):
            x = inputs[i : i + 32]
            logits = enc.model(x, x.ne(PAD).long(), torch.zeros_like(x)).float()
            sel = chosen[i : i + 32]
            truth = ids[i : i + 32][sel]
            top5 = logits[sel].topk(5, dim=-1).indices
            h1 = top5[:, 0].eq(truth)
            h5 = top5.eq(truth[:, None]).any(-1)
            hits1 += int(h1.sum())
            hits5 += int(h5.sum())
            base1 += int(truth.eq(top5_unigram[0]).sum())
            base5 += int(torch.isin(truth, top5_unigram).sum())
            words = ~continuation[truth]
            word_total += int(words.sum())
            word_hits1 += int(h1[words].sum())
            word_hits5 += int(h5[words].sum())
    n = int(chosen.sum())
    figures = {
        "model": str(folder),
        "heldout_sequences": int(ids.shape[0]),
        "heldout_tokens": int(ids.ne(PAD).sum() - ids.eq(CLS).sum()),
        "masked_tokens": n,
        "top1": round(hits1 / n, 4),
        "top5": round(hits5 / n, 4),
        "unigram_top1": round(base1 / n, 4),
        "unigram_top5": round(base5 / n, 4),
        "whole_word_tokens": word_total,
        "whole_word_top1": round(word_hits1 / max(1, word_total), 4),
        "whole_word_top5": round(word_hits5 / max(1, word_total), 4),
        "unigram_most_frequent": [tok.id_to_token(int(t)) for t in top5_unigram],
    }
    if args.json:
        print(json.dumps(figures))
        return
    for k, v in figures.items():
        print(f"{k:>22}: {v}")


if __name__ == "__main__":
    main()
