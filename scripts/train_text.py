#!/usr/bin/env python
"""Train the embedded default text model: a small Llama on the Python standard library's source.

    python scripts/train_text.py --out weights/llama-pystdlib          # train (resumes) and export
    python scripts/train_text.py --out weights/llama-pystdlib --export-only

Steps (each cached under --run-dir, so an interrupted run resumes where it stopped):
1. a sentencepiece BPE tokenizer (byte fallback, whitespace kept verbatim: code needs its indentation
   and newlines) trained on the training files;
2. the training files encoded once into one token stream (``<s> file </s>`` per file);
3. the model (gencli's own ``LlamaForCausalLM``) trained on random windows with AdamW, bf16 autocast
   on CPU, a warmup-stable-decay schedule; windows come from every training file during the stable
   phase and, during the decay phase, from the library modules only (the test suites, over half of
   the source, are full of repetitive assertions; ending on library code makes a better completer);
   checkpoints every --ckpt-minutes;
4. export in the Hugging Face layout: config.json, model.safetensors (bf16), tokenizer.model,
   tokenizer_config.json, special_tokens_map.json, generation_config.json.

The held-out modules (gencli.data.pysource.HELDOUT_MODULES) are never trained on; the validation loss
printed here is a quick estimate — scripts/eval_text.py measures the recorded figures.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gencli.backend.layers import init_normal_  # noqa: E402
from gencli.data.pysource import HELDOUT_MODULES, heldout_files, is_test_file, read_source, stdlib_root, training_files  # noqa: E402
from gencli.io import atomic_path, atomic_write_bytes  # noqa: E402
from gencli.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from gencli.training import load_checkpoint, save_checkpoint, set_lr, warmup_cosine_lr  # noqa: E402

UNK, BOS, EOS = 0, 1, 2


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# -- tokenizer -----------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, path: Path) -> None:
    import sentencepiece as spm

    def paragraphs():
        for t in texts:
            for para in t.split("\n\n"):
                if para.strip():
                    yield para[:8000] + "\n"

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=paragraphs(),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        normalization_rule_name="identity",  # no NFKC, keep every character as written
        remove_extra_whitespaces=False,  # indentation matters
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,  # runs of indentation become single pieces
        # a newline is always a token of its own: a prompt ending in "):" then continues exactly as
        # the training text did ("):" "\n" ...), instead of meeting a rare "):" where "):\n" was learned
        user_defined_symbols=["\n"],
        split_digits=True,
        byte_fallback=True,  # any text encodes; rare characters as UTF-8 bytes
        character_coverage=0.9999,
        max_sentence_length=16384,
        input_sentence_size=300_000,
        shuffle_input_sentence=True,
        seed_sentencepiece_size=1_000_000,
        unk_id=UNK,
        bos_id=BOS,
        eos_id=EOS,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    atomic_write_bytes(path, model.getvalue(), force=True)


def encode_files(sp, files: list[Path]) -> np.ndarray:
    chunks = []
    for f in files:
        text = read_source(f)
        if text is None:
            continue
        chunks.append(np.asarray([BOS] + sp.encode(text) + [EOS], dtype=np.uint16))
    return np.concatenate(chunks)


def prepare_data(run: Path, vocab_size: int):
    import sentencepiece as spm

    run.mkdir(parents=True, exist_ok=True)
    tok_path = run / "tokenizer.model"
    train_files = training_files()
    if not tok_path.exists():
        log(f"training the tokenizer on {len(train_files)} files")
        texts = [t for t in (read_source(f) for f in train_files) if t is not None]
        train_tokenizer(texts, vocab_size, tok_path)
    sp = spm.SentencePieceProcessor(model_file=str(tok_path))
    data = {}
    root = stdlib_root()
    library = [f for f in train_files if not is_test_file(f.relative_to(root).as_posix())]
    for split, files in (("train", train_files), ("library", library), ("heldout", heldout_files())):
        path = run / f"{split}_tokens.npy"
        if not path.exists():
            log(f"encoding {split} files")
            arr = encode_files(sp, files)
            with atomic_path(path) as tmp:
                np.save(tmp, arr)
        data[split] = np.load(path, mmap_mode="r")
        log(f"{split}: {len(data[split]):,} tokens")
    return sp, data


# -- the LM head + cross-entropy, chunked ----------------------------------------------------------
class ChunkedLMHeadLoss(torch.autograd.Function):
    """mean cross-entropy of softmax(h W^T) against targets, computed chunk by chunk in bf16 matmuls
    with fp32 softmax, never holding the full (tokens x vocab) logits: on a CPU the big elementwise
    passes over that tensor cost more than the matmul itself."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk):
        hb, wb = h.to(torch.bfloat16), weight.to(torch.bfloat16)
        n = hb.shape[0]
        lse = torch.empty(n, dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float32)
        for s in range(0, n, chunk):
            logits = (hb[s : s + chunk] @ wb.t()).float()
            lse[s : s + chunk] = torch.logsumexp(logits, -1)
            total += (lse[s : s + chunk] - logits.gather(1, targets[s : s + chunk, None]).squeeze(1)).sum()
        ctx.save_for_backward(hb, wb, targets, lse)
        ctx.chunk, ctx.h_dtype, ctx.w_dtype = chunk, h.dtype, weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad):
        hb, wb, targets, lse = ctx.saved_tensors
        n, chunk = hb.shape[0], ctx.chunk
        grad_h = torch.empty_like(hb)
        grad_w = torch.zeros(wb.shape, dtype=torch.float32)
        scale = grad / n
        for s in range(0, n, chunk):
            p = (hb[s : s + chunk] @ wb.t()).float()
            p.sub_(lse[s : s + chunk, None]).exp_()
            rows = torch.arange(p.shape[0])
            p[rows, targets[s : s + chunk]] -= 1.0
            p = p.mul_(scale).to(torch.bfloat16)
            grad_h[s : s + chunk] = p @ wb
            grad_w += (p.t() @ hb[s : s + chunk]).float()
        return grad_h.to(ctx.h_dtype), grad_w.to(ctx.w_dtype), None, None


def lm_loss(model: LlamaForCausalLM, x: torch.Tensor, y: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.hidden_states(x)
    return ChunkedLMHeadLoss.apply(h.reshape(-1, h.shape[-1]), model.lm_head.weight, y.reshape(-1), chunk)


# -- training ------------------------------------------------------------------------------------
def model_config(args, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.d_model,
        intermediate_size=args.d_ff,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


def decay_start(args) -> int:
    return int(args.steps * (1 - args.decay_frac))


def lr_at(step: int, args) -> float:
    """Warmup, a constant phase, then a cosine decay over the last --decay-frac of the steps
    (warmup-stable-decay: --steps may be changed on resume while the run is in the stable phase)."""
    return warmup_cosine_lr(step, args.steps, args.lr, warmup=args.warmup, floor=args.min_lr_ratio, decay_start=decay_start(args))


def batch(tokens: np.ndarray, step: int, args, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - args.seq - 1, (args.batch,), generator=g).tolist()
    xy = torch.from_numpy(np.stack([np.asarray(tokens[s : s + args.seq + 1], dtype=np.int64) for s in starts]))
    return xy[:, :-1], xy[:, 1:]


@torch.no_grad()
def quick_val(model, tokens: np.ndarray, seq: int, windows: int = 16) -> float:
    model.eval()
    losses = []
    n = min(windows, (len(tokens) - 1) // seq)
    for i in range(n):
        xy = torch.from_numpy(np.asarray(tokens[i * seq : i * seq + seq + 1], dtype=np.int64))[None]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(xy[:, :-1])
        losses.append(F.cross_entropy(logits.float()[0], xy[0, 1:]).item())
    model.train()
    return float(np.mean(losses))


def train(args, data, vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)
    cfg = model_config(args, vocab_size)
    model = LlamaForCausalLM(cfg)
    init_normal_(model, std=0.02)
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_hidden_layers))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8
    )
    ckpt = Path(args.run_dir) / "ckpt.pt"
    step = 0
    state = load_checkpoint(ckpt)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
        log(f"resumed from step {step}")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters; {args.steps} steps of {args.batch}x{args.seq} tokens")
    model.train()
    train_tokens, library_tokens, held = data["train"], data["library"], data["heldout"]
    last_ckpt = time.time()
    t0, tokens_done, loss_avg = time.time(), 0, None
    while step < args.steps:
        set_lr(opt, lr_at(step, args))
        x, y = batch(library_tokens if step >= decay_start(args) else train_tokens, step, args, args.seed)
        loss = lm_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_done += x.numel()
        loss_avg = loss.item() if loss_avg is None else 0.98 * loss_avg + 0.02 * loss.item()
        if step % args.log_every == 0:
            rate = tokens_done / (time.time() - t0)
            log(f"step {step}/{args.steps} loss {loss_avg:.4f} lr {lr_at(step, args):.2e} {rate:.0f} tok/s")
        if step % args.val_every == 0 or step == args.steps:
            log(f"step {step} heldout loss {quick_val(model, held, args.seq):.4f}")
        if time.time() - last_ckpt > args.ckpt_minutes * 60 or step == args.steps:
            save_checkpoint(ckpt, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "args": vars(args)})
            last_ckpt = time.time()
    return model.eval()


# -- export --------------------------------------------------------------------------------------
def export(model: LlamaForCausalLM, tok_path: Path, out: Path, args) -> None:
    from gencli.checkpoints.loader import save_model

    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out / "model.safetensors", dtype=torch.bfloat16)
    os.chmod(out / "model.safetensors", 0o644)  # written through a private temporary file
    cfg = model.config.to_hf()
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "tokenizer.model").write_bytes(tok_path.read_bytes())
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    tok_cfg = {
        "tokenizer_class": "LlamaTokenizer",
        **special,
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "add_prefix_space": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": args.seq,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "do_sample": True,
        "temperature": args.gen_temperature,
        "top_p": args.gen_top_p,
        "top_k": args.gen_top_k,
        "repetition_penalty": args.gen_repetition_penalty,
        "max_new_tokens": 200,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    log(f"exported to {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="weights/llama-pystdlib")
    p.add_argument("--run-dir", default="runs/text")
    p.add_argument("--export-only", action="store_true", help="export the last checkpoint without training further")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=320)
    p.add_argument("--d-ff", type=int, default=864)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--decay-frac", type=float, default=0.3, help="share of the steps spent decaying the learning rate")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--val-every", type=int, default=250)
    p.add_argument("--ckpt-minutes", type=float, default=5.0)
    # sampling defaults written to generation_config.json (chosen by the share of completions that parse)
    p.add_argument("--gen-temperature", type=float, default=0.3)
    p.add_argument("--gen-top-p", type=float, default=0.9)
    p.add_argument("--gen-top-k", type=int, default=50)
    p.add_argument("--gen-repetition-penalty", type=float, default=1.1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run = Path(args.run_dir)
    sp, data = prepare_data(run, args.vocab)
    log(f"held-out modules: {', '.join(HELDOUT_MODULES)}")
    if args.export_only:
        state = load_checkpoint(run / "ckpt.pt")
        saved = argparse.Namespace(
            **{**vars(args), **{k: v for k, v in state["args"].items() if k in ("d_model", "d_ff", "layers", "heads", "kv_heads", "seq", "vocab")}}
        )
        model = LlamaForCausalLM(model_config(saved, sp.get_piece_size()))
        model.load_state_dict(state["model"])
        export(model.eval(), run / "tokenizer.model", Path(args.out), saved)
        return
    model = train(args, data, sp.get_piece_size())
    export(model, run / "tokenizer.model", Path(args.out), args)


if __name__ == "__main__":
    main()
