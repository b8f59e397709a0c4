#!/usr/bin/env python
"""Fine-tune task heads on shapes-world captions from the pretrained default encoder (bert-pystdlib),
and score them on held-out scenes.

    python scripts/train_encoder_heads.py --task ner      --out weights/bert-shapes-ner
    python scripts/train_encoder_heads.py --task classify --out weights/bert-shapes-classify
    python scripts/train_encoder_heads.py --task qa       --out weights/bert-shapes-qa
    python scripts/train_encoder_heads.py --task qa --out weights/bert-shapes-qa --eval-only

Tasks (gencli.data.shapes_text): ``ner`` tags COLOUR, SHAPE, SIZE, POSITION and BACKGROUND spans
(B-/I- tags on every token of a span; ``BertForTokenClassification``); ``classify`` names the main
object's shape from its caption (``BertForSequenceClassification``, 8 labels); ``qa`` answers
questions about a caption with a span of it (``BertForQuestionAnswering``). Training scenes come from
the ``train`` seeds, one random caption style each, drawn afresh every step; the score is measured
through gencli's own pipelines (the ``ner``, ``classify-text`` and ``qa`` commands' code) on
``validation`` scenes: entity-level F1 (exact span and type, ``--aggregation simple``), accuracy, and
exact-match of the answer span. The encoder is gencli's ``EncoderForTask``, initialised from the
base folder's encoder weights (the head is new); AdamW, bf16 autocast on CPU, warmup then cosine
decay; checkpoints every --ckpt-minutes under --run-dir, so a run resumes; fp16 export in
transformers' layout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gencli.data import shapes, shapes_text  # noqa: E402
from gencli.io import atomic_path, atomic_write_bytes  # noqa: E402
from gencli.models.bert import EncoderConfig, EncoderForTask  # noqa: E402
from gencli.training import command_history, fit_until, load_checkpoint  # noqa: E402

HEADS = {"ner": ("token_classification", "BertForTokenClassification"), "classify": ("sequence_classification", "BertForSequenceClassification"),
         "qa": ("question_answering", "BertForQuestionAnswering")}  # fmt: skip


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def labels_of(task: str) -> list[str]:
    if task == "ner":
        return list(shapes_text.NER_LABELS)
    if task == "classify":
        return list(shapes.SHAPES)
    return ["LABEL_0", "LABEL_1"]


def make_examples(task: str, tok, seeds: list[int], rng: np.random.Generator) -> list[tuple[list[int], list[int], object]]:
    """(ids, type ids, target) per example: token labels for ner, a class for classify, (start, end) tokens for qa."""
    out = []
    styles = shapes.CAPTION_STYLES
    for seed in seeds:
        scene = shapes.make_scene(int(seed))
        style = styles[int(rng.integers(len(styles)))]
        if task == "ner":
            text, spans = shapes_text.ner_example(scene, style)
            enc = tok.encode(text)
            labels = []
            for (s, _e), special in zip(enc.offsets, enc.special_tokens_mask):
                lab = -100 if special else 0
                for a, b, kind in spans:
                    if not special and a <= s < b:
                        lab = shapes_text.NER_LABELS.index(("B-" if s == a else "I-") + kind)
                labels.append(lab)
            out.append((enc.ids, enc.type_ids, labels))
        elif task == "classify":
            text, shape = shapes_text.classify_example(scene, style)
            enc = tok.encode(text)
            out.append((enc.ids, enc.type_ids, shapes.SHAPES.index(shape)))
        else:
            qs = shapes_text.qa_examples(scene, style)
            q, ctx, a, b = qs[int(rng.integers(len(qs)))]
            enc = tok.encode(q, ctx)
            start = end = None
            for i, ((s, e), sid) in enumerate(zip(enc.offsets, enc.sequence_ids)):
                if sid != 1:
                    continue
                if start is None and s <= a < e or s == a:
                    start = i if start is None else start
                if s < b <= e:
                    end = i
            out.append((enc.ids, enc.type_ids, (start, end)))
    return out


def collate(batch, pad: int = 0):
    n = max(len(ids) for ids, _, _ in batch)
    ids = torch.full((len(batch), n), pad, dtype=torch.long)
    types = torch.zeros((len(batch), n), dtype=torch.long)
    for i, (x, t, _) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        types[i, : len(t)] = torch.tensor(t)
    return ids, ids.ne(pad).long(), types


def loss_of(task: str, model: EncoderForTask, batch) -> torch.Tensor:
    ids, mask, types = collate(batch)
    out = model(ids, mask, types).float()
    if task == "ner":
        labels = torch.full(ids.shape, -100, dtype=torch.long)
        for i, (_, _, lab) in enumerate(batch):
            labels[i, : len(lab)] = torch.tensor(lab)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1), ignore_index=-100)
    if task == "classify":
        return F.cross_entropy(out, torch.tensor([y for _, _, y in batch]))
    starts = torch.tensor([y[0] for _, _, y in batch])
    ends = torch.tensor([y[1] for _, _, y in batch])
    logits = out.masked_fill(~mask.bool()[..., None], -1e4)
    return (F.cross_entropy(logits[..., 0], starts) + F.cross_entropy(logits[..., 1], ends)) / 2


def export(model: EncoderForTask, base: Path, out: Path, task: str, cfg: dict, meta: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    with atomic_path(out / "model.safetensors", force=True) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    labels = labels_of(task)
    config = {**cfg, "architectures": [HEADS[task][1]], "id2label": {str(i): n for i, n in enumerate(labels)}, "label2id": {n: i for i, n in enumerate(labels)}}
    config.pop("tie_word_embeddings", None)
    atomic_write_bytes(out / "config.json", (json.dumps(config, indent=2) + "\n").encode(), force=True)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        atomic_write_bytes(out / name, (base / name).read_bytes(), force=True)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    log(f"exported to {out} ({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")


def evaluate(task: str, folder: Path, n: int) -> dict:
    """The held-out score through gencli's own pipelines, on ``n`` validation scenes (one caption style each, seeded)."""
    from gencli.pipelines.encoders.loading import load_encoder

    heldout = shapes_text.styled("validation", n, seed=7)
    enc = load_encoder(folder, task=HEADS[task][0], device="cpu", dtype="float32", threads=1)
    if task == "ner":
        from gencli.pipelines.encoders.ner import recognize

        examples = [shapes_text.ner_example(sc, st) for sc, st in heldout]
        found = recognize(enc, [t for t, _ in examples], aggregation="simple", batch_size=32)
        tp = fp = fn = 0
        for (_, gold), ents in zip(examples, found):
            g = {(a, b, k) for a, b, k in gold}
            p = {(e["start"], e["end"], e["entity_group"]) for e in ents}
            tp, fp, fn = tp + len(g & p), fp + len(p - g), fn + len(g - p)
        precision, recall = tp / max(1, tp + fp), tp / max(1, tp + fn)
        return {"entity_f1": round(2 * precision * recall / max(1e-9, precision + recall), 4), "precision": round(precision, 4),
                "recall": round(recall, 4), "captions": n}  # fmt: skip
    if task == "classify":
        from gencli.pipelines.encoders.classify import classify_texts

        examples = [shapes_text.classify_example(sc, st) for sc, st in heldout]
        got = classify_texts(enc, [t for t, _ in examples], top_k=1, batch_size=32)
        acc = sum(r[0]["label"] == y for r, (_, y) in zip(got, examples)) / len(examples)
        return {"accuracy": round(acc, 4), "captions": n, "chance": round(1 / len(shapes.SHAPES), 4)}
    from gencli.pipelines.encoders.qa import answer

    rng = np.random.default_rng(7)
    hits = total = 0
    for sc, st in heldout:
        qs = shapes_text.qa_examples(sc, st)
        q, ctx, a, b = qs[int(rng.integers(len(qs)))]
        best = answer(enc, q, ctx)[0]
        hits += (best["start"], best["end"]) == (a, b)
        total += 1
    return {"exact_match": round(hits / total, 4), "questions": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=sorted(HEADS), required=True)
    ap.add_argument("--base", default="weights/bert-pystdlib")
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir", default=None, help="default: runs/bert-shapes-TASK")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--until", metavar="HH:MM", help="end at this wall-clock time instead (the schedule is re-estimated from the measured speed)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--ckpt-minutes", type=float, default=2.0)
    ap.add_argument("--eval-scenes", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out, base = Path(args.out), Path(args.base)
    if args.eval_only:
        figures = evaluate(args.task, out, args.eval_scenes)
        print(json.dumps(figures))
        return
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    run = Path(args.run_dir or f"runs/bert-shapes-{args.task}")
    run.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    hf = json.loads((base / "config.json").read_text())
    cfg = EncoderConfig.from_hf({**hf, "num_labels": len(labels_of(args.task))})
    head, _ = HEADS[args.task]
    model = EncoderForTask(cfg, head)
    encoder = {k: v.float() for k, v in load_file(str(base / "model.safetensors")).items() if k.startswith("bert.")}
    missing, _unexpected = model.load_state_dict(encoder, strict=False)
    for name, p in model.named_parameters():  # the new head (and the sequence classifier's pooler)
        if name in missing:
            torch.nn.init.normal_(p, 0.0, 0.02) if name.endswith("weight") else torch.nn.init.zeros_(p)
    log(f"{args.task}: encoder from {base}; new: {', '.join(sorted(missing))}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    ckpt = run / "ckpt.pt"
    rng = np.random.default_rng(args.seed)
    step, history = 0, command_history(None, 0)
    state = load_checkpoint(ckpt)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
        rng = np.random.default_rng([args.seed, step])
        history = command_history(state.get("command"), step)
        log(f"resumed at step {step}")
    train_seeds = shapes.SPLITS["train"]

    def loss_of_step(step: int, total: int) -> torch.Tensor:
        seeds = rng.integers(train_seeds.start, train_seeds.stop, args.batch)
        batch = make_examples(args.task, tok, list(seeds), rng)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_of(args.task, model, batch)

    step, smooth = fit_until(model, opt, ckpt, loss_of_step, step=step, steps=args.steps, lr=args.lr, warmup=args.warmup, history=history,
                             until=args.until, ckpt_minutes=args.ckpt_minutes, log=log)  # fmt: skip
    model.eval()
    meta = {"command": history, "step": step, "task": args.task, "base": str(base), "train_loss": round(smooth or 0.0, 4)}
    export(model, base, out, args.task, hf, meta)
    meta["heldout"] = evaluate(args.task, out, args.eval_scenes)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    log(f"held-out: {json.dumps(meta['heldout'])}")


if __name__ == "__main__":
    main()
