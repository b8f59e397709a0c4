#!/usr/bin/env python
"""Pretrain the embedded default encoder: a small BERT, masked-language modelling on the English of
the Python standard library (its docstrings and comments).

    python scripts/train_encoder.py --out weights/bert-pystdlib              # train (resumes) and export
    python scripts/train_encoder.py --out weights/bert-pystdlib --export-only

Steps (each cached under --run-dir, so an interrupted run resumes where it stopped):
1. the text: every docstring (``ast``) and every block of consecutive comment lines (``tokenize``) of
   the standard library's modules (not its test suites), code-only comments (no letters) dropped; the
   held-out modules (gencli.data.pysource.HELDOUT_MODULES) are never trained on;
2. a lower-cased WordPiece tokenizer (the tokenizers library) trained on that text, saved as
   ``vocab.txt`` and ``tokenizer.json``;
3. the text of each file packed into sequences of at most --seq-len tokens
   (``[CLS] text [SEP] text [SEP] ...``), once;
4. gencli's own ``EncoderForTask`` (BERT, masked-LM head) trained with masked-language modelling: 15%
   of the tokens chosen, of those 80% replaced by ``[MASK]``, 10% by a random token, 10% kept; AdamW,
   bf16 autocast on CPU, warmup then cosine decay; checkpoints every --ckpt-minutes;
5. export in transformers' ``BertForMaskedLM`` layout (``config.json``, fp16 ``model.safetensors``,
   ``vocab.txt``, ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``).

scripts/eval_encoder.py measures the recorded fill-mask figures on the held-out modules.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import sys
import time
import tokenize
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from gencli.data.pysource import heldout_files, is_test_file, read_source, stdlib_root, training_files  # noqa: E402
from gencli.io import atomic_path, atomic_write_bytes  # noqa: E402
from gencli.models.bert import EncoderConfig, EncoderForTask  # noqa: E402
from gencli.training import command_history, load_checkpoint, save_checkpoint, set_lr, warmup_cosine_lr  # noqa: E402

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(5)
LETTERS = re.compile(r"[A-Za-z]{2,}")


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# -- 1. text ------------------------------------------------------------------------------------
def english_of(source: str) -> list[str]:
    """The docstrings and comment blocks of one module's source, in order of appearance, whitespace
    collapsed; blocks without two letters in a row (separators, code left in comments) are dropped."""
    chunks: list[tuple[int, str]] = []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                line = node.body[0].lineno if node.body else 0
                # paragraphs of a docstring are separate chunks (doctest and code lines dropped)
                for para in re.split(r"\n\s*\n", doc):
                    lines = [x for x in para.splitlines() if not x.lstrip().startswith((">>>", "..."))]
                    if lines:
                        chunks.append((line, " ".join(x.strip() for x in lines)))
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        tokens = []
    block: list[str] = []
    start = 0
    last = -2
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        row = tok.start[0]
        if block and row != last + 1:
            chunks.append((start, " ".join(block)))
            block = []
        if not block:
            start = row
        if text and not text.startswith("!"):
            block.append(text)
        last = row
    if block:
        chunks.append((start, " ".join(block)))
    chunks.sort(key=lambda c: c[0])
    out = []
    for _, text in chunks:
        text = re.sub(r"\s+", " ", text).strip()
        if len(LETTERS.findall(text)) >= 2:
            out.append(text)
    return out


def corpus(files: list[Path], root: Path) -> list[list[str]]:
    """The English chunks of each file (test suites skipped), one list per file."""
    out = []
    for f in files:
        if is_test_file(f.relative_to(root).as_posix()):
            continue
        src = read_source(f)
        if src is None:
            continue
        chunks = english_of(src)
        if chunks:
            out.append(chunks)
    return out


# -- 2. tokenizer -------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=3, special_tokens=SPECIALS, continuing_subword_prefix="##")
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)]
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    (out / "vocab.txt").write_text("".join(t + "\n" for t, _ in vocab), encoding="utf-8")
    return tok


def tokenizer_files(folder: Path, seq_len: int) -> None:
    config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "strip_accents": None,
        "tokenize_chinese_chars": True,
        "model_max_length": seq_len,
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    specials = {k: config[k] for k in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")


# -- 3. packing ---------------------------------------------------------------------------------
def pack(tok, files: list[list[str]], seq_len: int) -> list[list[int]]:
    """``[CLS] chunk [SEP] chunk [SEP] ...`` per file, at most ``seq_len`` tokens a sequence; a chunk
    longer than a sequence is cut into pieces."""
    seqs: list[list[int]] = []
    room = seq_len - 2
    for chunks in files:
        current: list[int] = [CLS]
        for enc in tok.encode_batch(chunks, add_special_tokens=False):
            ids = enc.ids
            for i in range(0, len(ids), room):
                piece = ids[i : i + room]
                if len(current) + len(piece) + 1 > seq_len and len(current) > 1:
                    seqs.append(current)
                    current = [CLS]
                current += piece + [SEP]
        if len(current) > 1:
            seqs.append(current)
    return seqs


def to_tensor(seqs: list[list[int]], seq_len: int) -> torch.Tensor:
    t = torch.full((len(seqs), seq_len), PAD, dtype=torch.int16)
    for i, s in enumerate(seqs):
        t[i, : len(s)] = torch.tensor(s, dtype=torch.int16)
    return t


def mask_tokens(ids: torch.Tensor, vocab_size: int, gen: torch.Generator, rate: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: ``rate`` of the non-special tokens chosen; 80% -> [MASK], 10% random, 10% kept.
    Returns (inputs, labels) with labels -100 where not chosen."""
    special = ids < len(SPECIALS)
    chosen = (torch.rand(ids.shape, generator=gen) < rate) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    r = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[chosen & (r < 0.8)] = MASK
    rand = chosen & (r >= 0.8) & (r < 0.9)
    inputs[rand] = torch.randint(len(SPECIALS), vocab_size, ids.shape, generator=gen)[rand]
    return inputs, labels


def mlm_loss(model: EncoderForTask, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the chosen positions only (the LM head runs on those alone)."""
    h = model.hidden_states(inputs, inputs.ne(PAD))
    sel = labels.ne(-100)
    logits = model.cls.predictions(h[sel])
    return torch.nn.functional.cross_entropy(logits.float(), labels[sel])


def hf_config(cfg: EncoderConfig, dtype: str) -> dict:
    return {
        "architectures": ["BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.layer_norm_eps,
        "pad_token_id": PAD,
        "initializer_range": 0.02,
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
    }


def export(model: EncoderForTask, cfg: EncoderConfig, run: Path, out: Path, seq_len: int, meta: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items() if k != "cls.predictions.decoder.weight"}
    with atomic_path(out / "model.safetensors", force=True) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    atomic_write_bytes(out / "config.json", (json.dumps(hf_config(cfg, "float16"), indent=2) + "\n").encode(), force=True)
    for name in ("vocab.txt", "tokenizer.json"):
        atomic_write_bytes(out / name, (run / name).read_bytes(), force=True)
    tokenizer_files(out, seq_len)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    log(f"exported to {out} ({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")


def init_weights(model: torch.nn.Module, std: float = 0.02) -> None:
    for name, p in model.named_parameters():
        if "LayerNorm" in name or "layer_norm" in name:
            torch.nn.init.ones_(p) if name.endswith("weight") else torch.nn.init.zeros_(p)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
        else:
            torch.nn.init.normal_(p, 0.0, std)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="weights/bert-pystdlib")
    ap.add_argument("--run-dir", default="runs/bert-pystdlib")
    ap.add_argument("--vocab", type=int, default=6144)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=160)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=640)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument(
        "--until", metavar="HH:MM", help="end at this wall-clock time instead: the schedule's length is re-estimated each step from the measured speed"
    )
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ckpt-minutes", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-autocast", action="store_true", help="train in float32 (default: bf16 autocast)")
    ap.add_argument("--export-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)

    # 1-3: text, tokenizer, packed sequences (cached)
    data_path = run / "data.pt"
    if not data_path.is_file():
        root = stdlib_root()
        train_chunks = corpus(training_files(root), root)
        held_chunks = corpus(heldout_files(root), root)
        texts = [c for f in train_chunks for c in f]
        log(f"{len(train_chunks)} training files, {len(texts)} chunks, {sum(map(len, texts)) / 1e6:.1f}M characters; {len(held_chunks)} held-out files")
        tok = train_tokenizer(texts, args.vocab, run)
        train = to_tensor(pack(tok, train_chunks, args.seq_len), args.seq_len)
        held = to_tensor(pack(tok, held_chunks, args.seq_len), args.seq_len)
        save_checkpoint(data_path, {"train": train, "heldout": held, "vocab_size": tok.get_vocab_size()})
    data = load_checkpoint(data_path)
    train, held, vocab_size = data["train"].long(), data["heldout"].long(), int(data["vocab_size"])
    log(f"{train.shape[0]} training sequences ({int(train.ne(PAD).sum()) / 1e6:.2f}M tokens), {held.shape[0]} held-out, vocab {vocab_size}")

    cfg = EncoderConfig(
        model_type="bert",
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.mlp,
        max_position_embeddings=args.seq_len,
        type_vocab_size=2,
        pad_token_id=PAD,
    )
    model = EncoderForTask(cfg, "masked_lm")
    init_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    ckpt = run / "ckpt.pt"
    state = load_checkpoint(ckpt)
    step, history, seen = 0, command_history(None, 0), 0
    gen = torch.Generator().manual_seed(args.seed)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, seen = int(state["step"]), int(state.get("seen", 0))
        history = command_history(state.get("command"), step)
        log(f"resumed at step {step}")
    meta = {"command": history, "step": step, "sequences_seen": seen, "train_sequences": train.shape[0], "threads": args.threads}

    def val_loss() -> float:
        model.eval()
        g = torch.Generator().manual_seed(1234)
        total, n = 0.0, 0
        with torch.no_grad():
            for i in range(0, min(held.shape[0], 256), 64):
                inputs, labels = mask_tokens(held[i : i + 64], vocab_size, g)
                total += float(mlm_loss(model, inputs, labels)) * int(labels.ne(-100).sum())
                n += int(labels.ne(-100).sum())
        model.train()
        return total / max(1, n)

    def checkpoint() -> None:
        save_checkpoint(ckpt, {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step, "seen": seen, "command": history})

    if not args.export_only:
        model.train()
        last_ckpt = time.time()
        t0, smooth = time.time(), None
        total = args.steps
        deadline = None
        if args.until:
            hh, mm = (int(x) for x in args.until.split(":"))
            now = time.localtime()
            deadline = time.mktime((now.tm_year, now.tm_mon, now.tm_mday, hh, mm, 0, 0, 0, now.tm_isdst))
            total = max(args.steps, step + 2)  # re-estimated from the first step's time on
        step_time, t_step = None, time.time()
        while step < total:
            idx = torch.randint(0, train.shape[0], (args.batch,), generator=gen)
            batch = train[idx]
            width = int(batch.ne(PAD).sum(1).max())
            inputs, labels = mask_tokens(batch[:, :width], vocab_size, gen)
            if deadline is not None and step_time is not None:
                total = max(step + 1, step + int((deadline - time.time()) / step_time))
            set_lr(opt, warmup_cosine_lr(step, total, args.lr, warmup=args.warmup, floor=0.05))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_autocast):
                loss = mlm_loss(model, inputs, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            seen += args.batch
            dt, t_step = time.time() - t_step, time.time()
            step_time = dt if step_time is None else 0.95 * step_time + 0.05 * dt
            value = loss.item()
            smooth = value if smooth is None else 0.98 * smooth + 0.02 * value
            if step % 50 == 0:
                log(f"step {step}/{total} loss {smooth:.3f} {(time.time() - t0) / 50:.2f}s/step")
                t0 = time.time()
            if time.time() - last_ckpt > args.ckpt_minutes * 60 or step == total:
                checkpoint()
                last_ckpt = time.time()
                log(f"checkpoint at step {step}; held-out masked-LM loss {val_loss():.3f}")
                if os.path.exists(run / "STOP"):
                    log("STOP file found: stopping early")
                    break
        checkpoint()
    meta.update(lr_schedule_steps=step if args.until else args.steps, step=step, sequences_seen=seen, command=history, heldout_mlm_loss=round(val_loss(), 4))
    export(model, cfg, run, Path(args.out), args.seq_len, meta)


if __name__ == "__main__":
    main()
