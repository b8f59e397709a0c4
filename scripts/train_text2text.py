#!/usr/bin/env python
"""Train a small T5 on shapes-world text-to-text pairs: caption -> structured scene description, and back.

    python scripts/train_text2text.py --run-dir runs/t5-shapes --export weights/t5-shapes            # train (resumes), export, evaluate
    nohup python scripts/train_text2text.py --run-dir runs/t5-shapes --export weights/t5-shapes > runs/t5-shapes.log 2>&1 &
    python scripts/train_text2text.py --run-dir runs/t5-shapes --export weights/t5-shapes --eval-only

The tasks and the structure format are :mod:`gencli.data.shapes_text2text`'s: ``parse: CAPTION`` ->
``size=... colour=... shape=... position=... ; ... ; background=...`` and ``describe: STRUCTURE`` ->
the full caption. Training scenes come from the ``train`` seeds, captions in the full, list and
background-first styles and (``--augment``, half of them by default) the varied phrasings of
:func:`gencli.data.shapes_text2text.augmented_caption`; the ``picture`` style and the paraphrases stay
held out.

Steps (each cached under --run-dir, so an interrupted run resumes where it stopped):
1. a T5-style sentencepiece BPE tokenizer (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, no sentinels)
   trained on captions and structures of training scenes (and every printable ASCII character);
2. gencli's own ``T5ForConditionalGeneration`` (v1.0 layout: ReLU feed-forward, head tied to the
   embedding) with T5's initialisation, trained with AdamW on freshly drawn pairs (each batch depends on
   its step alone), warmup then cosine decay; a checkpoint every --ckpt-every steps (atomic writes);
3. export in the Hugging Face layout (config.json, model.safetensors in fp16 unless --fp32, spiece.model,
   tokenizer_config.json, generation_config.json): ``gencli text2text -m FOLDER`` runs it;
4. evaluation through the exported folder and gencli's own loader and decoder (greedy): exact match on
   held-out ``test`` scenes for parse (the training styles, augmented phrasings), parse (the held-out
   ``picture`` style and the never-written paraphrases) and describe, next to the rule-based
   baseline parser; outputs cut by the token budget and a few wrong ones are logged.
"""

from __future__ import annotations

import functools
import io
import json
import string
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gencli.data import shapes  # noqa: E402
from gencli.data import shapes_text2text as st  # noqa: E402
from gencli.io import atomic_write_bytes  # noqa: E402
from gencli.models.t5 import T5Config, T5ForConditionalGeneration  # noqa: E402
from gencli.training import StepBudget, parse_training_args, prefetched, resume, save_checkpoint, set_lr, training_parser, warmup_cosine_lr  # noqa: E402

PAD, EOS, UNK = 0, 1, 2
# the decoding budget the exported generation_config.json sets: twice the longest structure (34
# tokens with the BPE tokenizer; the earlier 64 cut 15% of the two-object structures short)
MAX_NEW_TOKENS = 96


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def train_tokenizer(path: Path, vocab_size: int) -> None:
    import sentencepiece as spm

    rng = np.random.default_rng(0)
    lines = []
    for seed in shapes.split_seeds("train", 4000):
        scene = shapes.make_scene(seed)
        lines += [st.PARSE + scene.random_caption(rng, st.TRAIN_STYLES), st.PARSE + st.augmented_caption(scene, rng), st.DESCRIBE + st.structure(scene)]
    # every printable ASCII character gets a piece (no <unk> for a bracket or a digit in an input)
    lines.append(" ".join(string.ascii_letters + string.digits + string.punctuation))
    buf = io.BytesIO()
    # BPE rather than unigram: on this small corpus the unigram model kept the structure's keys as
    # single letters ("s h a p e ="), which made a two-object structure more than 64 tokens long
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, hard_vocab_limit=False, model_type="bpe",
        character_coverage=1.0, pad_id=PAD, eos_id=EOS, unk_id=UNK, bos_id=-1, minloglevel=2, num_threads=1,
    )  # fmt: skip
    atomic_write_bytes(path, buf.getvalue(), force=True)


def t5_init_(model: T5ForConditionalGeneration) -> None:
    """T5's initialisation (transformers' ``T5PreTrainedModel._init_weights`` with factor 1)."""
    cfg = model.config
    with torch.no_grad():
        nn.init.normal_(model.shared.weight, std=1.0)
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".q.weight"):
                p.normal_(std=(cfg.d_model * cfg.d_kv) ** -0.5)
            elif name.endswith((".k.weight", ".v.weight")):
                p.normal_(std=cfg.d_model**-0.5)
            elif name.endswith(".o.weight"):
                p.normal_(std=(cfg.num_heads * cfg.d_kv) ** -0.5)
            elif name.endswith("relative_attention_bias.weight"):
                p.normal_(std=cfg.d_model**-0.5)
            elif name.endswith(".wi.weight"):
                p.normal_(std=cfg.d_model**-0.5)
            elif name.endswith(".wo.weight"):
                p.normal_(std=cfg.d_ff**-0.5)


def make_batch(sp, step: int, *, batch: int, augment: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, decoder_input_ids, labels)`` of step ``step`` (depends on the step alone)."""
    rng = np.random.default_rng([step, 0x7E57])
    seeds = rng.integers(0, len(shapes.SPLITS["train"]), size=batch)
    pairs = [st.pair(int(s), rng, augment=augment) for s in seeds]
    src = [sp.encode(a) + [EOS] for a, _ in pairs]
    tgt = [sp.encode(b) + [EOS] for _, b in pairs]
    ls, lt = max(map(len, src)), max(map(len, tgt))
    input_ids = torch.tensor([s + [PAD] * (ls - len(s)) for s in src])
    mask = torch.tensor([[1] * len(s) + [0] * (ls - len(s)) for s in src], dtype=torch.bool)
    labels = torch.tensor([t + [-100] * (lt - len(t)) for t in tgt])
    dec = torch.tensor([[PAD] + t[:-1] + [PAD] * (lt - len(t)) for t in tgt])
    return input_ids, mask, dec, labels


def export(model: T5ForConditionalGeneration, run: Path, out: Path, history: str, *, fp16: bool = True) -> None:
    from gencli.checkpoints.loader import save_model

    cfg = model.config
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "d_kv": cfg.d_kv,
        "d_ff": cfg.d_ff, "num_layers": cfg.num_layers, "num_decoder_layers": cfg.num_decoder_layers, "num_heads": cfg.num_heads,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets, "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "layer_norm_epsilon": cfg.layer_norm_epsilon, "feed_forward_proj": cfg.feed_forward_proj, "tie_word_embeddings": True,
        "decoder_start_token_id": PAD, "pad_token_id": PAD, "eos_token_id": EOS, "n_positions": 128, "is_encoder_decoder": True,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"decoder_start_token_id": PAD, "eos_token_id": EOS, "pad_token_id": PAD, "max_new_tokens": MAX_NEW_TOKENS}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({"extra_ids": 0, "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}, indent=2) + "\n")
    atomic_write_bytes(out / "spiece.model", (run / "spiece.model").read_bytes(), force=True)
    save_model(model, out / "model.safetensors", dtype=torch.float16 if fp16 else None, metadata={"command": history})
    log(f"exported to {out}")


def evaluate(folder: Path, n: int, batch: int = 32) -> dict:
    """Exact match through gencli's own loader and greedy decoder, with the baseline beside it."""
    from gencli.pipelines.seq2seq.generate import encode_input, generate, resolve_settings
    from gencli.pipelines.seq2seq.loading import load_seq2seq_model

    sm = load_seq2seq_model(folder, device="cpu", dtype="float32")
    settings = resolve_settings(sm.generation_config, eos_ids=sm.eos_ids, temperature=0.0)
    scenes = [shapes.make_scene(s) for s in shapes.split_seeds("test", n)]
    sets = {f"parse/{s}": [(st.PARSE + sc.caption(s), st.structure(sc)) for sc in scenes] for s in st.TRAIN_STYLES + st.HELDOUT_STYLES}
    sets.update({f"parse/{p} (paraphrase)": [(st.PARSE + st.paraphrase(sc, p), st.structure(sc)) for sc in scenes] for p in st.PARAPHRASES})
    rng = np.random.default_rng(0xA06)
    sets["parse/augmented"] = [(st.PARSE + st.augmented_caption(sc, rng), st.structure(sc)) for sc in scenes]
    sets["describe"] = [(st.DESCRIBE + st.structure(sc), sc.caption("full")) for sc in scenes]
    results = {}
    for name, items in sets.items():
        correct = cut = 0
        wrong = []
        for start in range(0, len(items), batch):
            chunk = items[start : start + batch]
            outs = generate(sm, [(a, encode_input(sm, a)) for a, _ in chunk], settings)
            for o, (a, want) in zip(outs, chunk):
                correct += o.text.strip() == want
                cut += o.finish_reason == "length"
                if o.text.strip() != want and len(wrong) < 3:
                    wrong.append(f"{a!r} -> {o.text.strip()!r} (want {want!r})")
        if cut:
            log(f"{name}: {cut} output(s) reached the {settings.max_new_tokens}-token budget")
        for w in wrong:
            log(f"{name}: wrong: {w}")
        row = {"model": round(correct / len(items), 4)}
        if name.startswith("parse/"):
            row["baseline"] = round(sum(st.baseline_parse(a[len(st.PARSE) :]) == want for a, want in items) / len(items), 4)
        results[name] = row
        log(f"{name}: exact match {row}")
    return results


def main() -> None:
    p = training_parser(__doc__.split("\n\n")[0], out="weights/t5-shapes", steps=6000, batch=64, lr=2e-3)
    p.add_argument("--run-dir", type=Path, default=Path("runs/t5-shapes"))
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=320)
    p.add_argument("--augment", type=float, default=0.5, help="share of parse captions drawn from the augmented phrasings")
    p.add_argument("--fp32", action="store_true", help="export float32 weights (default: float16)")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--eval-scenes", type=int, default=500)
    p.add_argument("--eval-only", action="store_true")
    args = parse_training_args(p)
    out = args.export or args.out
    run = args.run_dir
    run.mkdir(parents=True, exist_ok=True)
    if args.eval_only:
        results = evaluate(out, args.eval_scenes)
        (out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
        return
    import sentencepiece as spm

    if not (run / "spiece.model").is_file():
        log("training the tokenizer")
        train_tokenizer(run / "spiece.model", args.vocab)
    sp = spm.SentencePieceProcessor(model_file=str(run / "spiece.model"))
    d = args.d_model
    cfg = T5Config(
        vocab_size=sp.get_piece_size(), d_model=d, d_kv=d // args.heads, d_ff=4 * d, num_layers=args.layers, num_decoder_layers=args.layers,
        num_heads=args.heads, relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="relu",
    )  # fmt: skip
    device = torch.device(args.device)
    model = T5ForConditionalGeneration(cfg)
    t5_init_(model)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    ckpt = run / "checkpoint.pt"
    step, history, state = resume(ckpt, model=model, optimizer=opt)
    if state and "steps" in state and args.time_budget:  # a resumed --time-budget run goes on from the length it planned
        args.steps = state["steps"]
    log(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {cfg.vocab_size}; starting at step {step} of {args.steps}")
    t0, seen = time.perf_counter(), 0
    budget = StepBudget(args.time_budget)
    budget.begin(step)
    data = prefetched(functools.partial(make_batch, sp, batch=args.batch, augment=args.augment), step, 10**9, args.data_workers)
    while step < args.steps:
        set_lr(opt, warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=args.lr * 0.05))
        input_ids, mask, dec, labels = (t.to(device) for t in next(data))
        logits = model(input_ids, dec, mask)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += 1
        planned = budget.steps(step)
        if planned is not None:
            args.steps = max(step, planned)
        if step % 50 == 0 or step == args.steps:
            rate = seen / (time.perf_counter() - t0)
            log(f"step {step}/{args.steps} loss {loss.item():.4f} ({rate:.2f} steps/s)")
        if step % args.ckpt_every == 0 or step == args.steps:
            save_checkpoint(ckpt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "steps": args.steps, "command": history})
    model.eval()
    export(model.cpu(), run, out, history, fp16=not args.fp32)
    results = evaluate(out, args.eval_scenes)
    (out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
