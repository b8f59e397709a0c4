#!/usr/bin/env python
"""Train a sentence embedding contrastively on shapes-world captions (captions of one scene nearer
than captions of others), from the pretrained default encoder (bert-pystdlib), and score it on
held-out scenes.

    python scripts/train_sentence_embedding.py --out weights/bert-shapes-embed --until 11:40
    python scripts/train_sentence_embedding.py --out weights/bert-shapes-embed --eval-only
    python scripts/train_sentence_embedding.py --out weights/bert-pystdlib --eval-only     # the baseline

Data: each training scene (``train`` seeds) is captioned twice, in two different styles of
:data:`TRAIN_STYLES`; half of each batch's scenes are random, the other half copies of them with one
attribute changed (an object's shape, colour, size or position, or the background) or, for half of
the two-object scenes, one attribute exchanged between the two objects, so the batch's negatives
include scenes that differ by one word and scenes described by the same words in another binding. Loss: the multiple-negatives ranking loss (InfoNCE
with in-batch negatives), symmetric (caption A finds its caption B among the batch's B captions and the
other way round), temperature ``--temperature`` on the cosine similarity of mean-pooled, L2-normalised
token states; a batch's scenes with the same description are not counted as negatives of each other.

Evaluation (:func:`evaluate`, through gencli's own ``embed`` code on the exported folder): ``N``
distinct ``test`` scenes (no two with the same description); a caption of each scene in a query style
finds, among the ``N`` captions in a gallery style, the one of its own scene: recall@1 at N=100 and
N=1000, and the share of (same-scene, other-scene) pairs ordered correctly (the same-scene caption
more similar than the other scene's). Style pairs: the trained styles against each other, and the
styles never trained on (the ``picture`` caption style and the ``paren`` / ``there_is`` phrasings of
:mod:`gencli.data.shapes_text2text`) against the trained ones. A bag-of-words cosine baseline shows what
exact word overlap alone achieves; the ``binding`` figures (captions of the same words in another
binding, :func:`binding_scores`) are where word overlap cannot help.

AdamW, bf16 autocast on CPU, warmup then cosine decay; checkpoints every --ckpt-minutes under --run-dir
(a run resumes); the export is a sentence-transformers folder (BertModel in fp16, modules.json, mean
pooling, Normalize).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gencli.data import shapes, shapes_text2text  # noqa: E402
from gencli.io import atomic_path, atomic_write_bytes  # noqa: E402
from gencli.models.bert import EncoderConfig, EncoderForTask  # noqa: E402
from gencli.training import command_history, fit_until, load_checkpoint  # noqa: E402

TRAIN_STYLES: tuple[str, ...] = ("full", "list", "background_first")
HELDOUT_STYLES: tuple[str, ...] = ("picture", "paren", "there_is")  # never trained on


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def caption(scene: shapes.Scene, style: str) -> str:
    if style in shapes_text2text.PARAPHRASES:
        return shapes_text2text.paraphrase(scene, style)
    return scene.caption(style)


def mutate(scene: shapes.Scene, rng: np.random.Generator) -> shapes.Scene:
    """The scene with one attribute changed: an object's shape, colour, size or position, or the background."""
    what = ("shape", "colour", "size", "position", "background")[int(rng.integers(5))]
    if what == "background":
        options = [b for b in shapes.BACKGROUNDS if b != scene.background and all(o.colour != b for o in scene.objects)]
        return shapes.with_changes(scene, background=options[int(rng.integers(len(options)))]) if options else scene
    vocab = {"shape": shapes.SHAPES, "colour": tuple(c for c in shapes.COLOURS if c != scene.background), "size": tuple(shapes.SIZES),
             "position": shapes.POSITIONS}[what]  # fmt: skip
    i = int(rng.integers(len(scene.objects)))
    current = getattr(scene.objects[i], what)
    value = [v for v in vocab if v != current][int(rng.integers(len(vocab) - 1))]
    objects = list(scene.objects)
    objects[i] = dataclasses.replace(objects[i], **{what: value})
    return shapes.with_changes(scene, objects=tuple(objects))


SWAPPABLE = ("shape", "colour", "size", "position")


def swapped(scene: shapes.Scene, what: str) -> shapes.Scene | None:
    """The two-object scene with attribute ``what`` exchanged between its objects (the same words in
    another binding), or None when the scene has one object or both share that value."""
    if len(scene.objects) != 2 or getattr(scene.objects[0], what) == getattr(scene.objects[1], what):
        return None
    a, b = scene.objects
    return shapes.with_changes(
        scene, objects=(dataclasses.replace(a, **{what: getattr(b, what)}), dataclasses.replace(b, **{what: getattr(a, what)}))
    )


def hard_negative(scene: shapes.Scene, rng: np.random.Generator) -> shapes.Scene:
    """A scene a caption of ``scene`` must not match: one attribute changed (:func:`mutate`), or, for
    half of the two-object scenes, one attribute exchanged between the objects (:func:`swapped`)."""
    if len(scene.objects) == 2 and rng.random() < 0.5:
        options = [s for s in (swapped(scene, w) for w in SWAPPABLE) if s is not None]
        if options:
            return options[int(rng.integers(len(options)))]
    return mutate(scene, rng)


def make_batch(rng: np.random.Generator, n_scenes: int) -> tuple[list[str], list[str], list[str]]:
    """(captions A, captions B, descriptions): two captions in two different trained styles per scene."""
    train = shapes.SPLITS["train"]
    base = [shapes.make_scene(int(s)) for s in rng.integers(train.start, train.stop, n_scenes - n_scenes // 2)]
    scenes = base + [hard_negative(sc, rng) for sc in base[: n_scenes // 2]]
    a, b = [], []
    for sc in scenes:
        i, j = rng.choice(len(TRAIN_STYLES), 2, replace=False)
        a.append(caption(sc, TRAIN_STYLES[int(i)]))
        b.append(caption(sc, TRAIN_STYLES[int(j)]))
    return a, b, [shapes_text2text.structure(sc) for sc in scenes]


def tokenize(tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    encs = tok.encode_batch(texts)
    n = max(len(e.ids) for e in encs)
    ids = torch.zeros((len(encs), n), dtype=torch.long)
    for i, e in enumerate(encs):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
    return ids, ids.ne(0).long()


def embed(model: EncoderForTask, tok, texts: list[str]) -> torch.Tensor:
    from gencli.pipelines.encoders.embed import pool

    ids, mask = tokenize(tok, texts)
    return F.normalize(pool(model.hidden_states(ids, mask), mask, "mean"), dim=-1)


def contrastive_loss(za: torch.Tensor, zb: torch.Tensor, descriptions: list[str], temperature: float) -> torch.Tensor:
    """Symmetric multiple-negatives ranking loss; pairs of scenes with the same description are not negatives."""
    logits = za @ zb.T / temperature
    same = torch.tensor([[x == y for y in descriptions] for x in descriptions])
    logits = logits.masked_fill(same & ~torch.eye(len(descriptions), dtype=torch.bool), float("-inf"))
    target = torch.arange(len(descriptions))
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


# -- evaluation ----------------------------------------------------------------------------------
def heldout_scenes(n: int) -> list[shapes.Scene]:
    """The first ``n`` test scenes with distinct descriptions (so every query has one right answer)."""
    out, seen = [], set()
    for seed in shapes.SPLITS["test"]:
        sc = shapes.make_scene(seed)
        key = shapes_text2text.structure(sc)
        if key not in seen:
            seen.add(key)
            out.append(sc)
            if len(out) == n:
                return out
    raise AssertionError("unreachable")


def ranking_scores(q: torch.Tensor, g: torch.Tensor) -> tuple[float, float]:
    """(recall@1, share of (same, other) pairs ordered correctly) of queries ``q`` against gallery ``g``
    (row i of each is scene i; cosine similarity of normalised vectors)."""
    sims = q @ g.T
    pos = sims.diag()
    recall = float((sims.argmax(dim=1) == torch.arange(len(q))).float().mean())
    others = ~torch.eye(len(q), dtype=torch.bool)
    ordered = float(((pos[:, None] > sims) & others).sum() / others.sum())
    return recall, ordered


def bag_of_words(texts: list[str], vocab: dict[str, int]) -> torch.Tensor:
    """L2-normalised word counts (the word-overlap baseline)."""
    rows = torch.zeros(len(texts), len(vocab))
    for i, t in enumerate(texts):
        for w, c in Counter(re.findall(r"[a-z]+", t.lower())).items():
            rows[i, vocab[w]] = c
    return F.normalize(rows, dim=-1)


def binding_scores(folder: Path | None, groups: dict, n: int, threads: int = 1) -> dict:
    """Captions with the same words in another binding: for the two-object scenes among the first
    ``n`` held-out ones, each attribute the objects do not share exchanged between them; the share of
    (query, own caption, exchanged scene's caption) triples where the own caption is the more similar
    (a tie counts half: a bag of words scores 0.5 by construction)."""
    pairs = [(sc, sw) for sc in heldout_scenes(n) for w in SWAPPABLE if (sw := swapped(sc, w)) is not None]
    styles = TRAIN_STYLES + HELDOUT_STYLES
    if folder is None:
        words = sorted({w for s in styles for sc, sw in pairs for t in (caption(sc, s), caption(sw, s)) for w in re.findall(r"[a-z]+", t.lower())})
        vocab = {w: i for i, w in enumerate(words)}

        def vec(texts: list[str]) -> torch.Tensor:
            return bag_of_words(texts, vocab)
    else:
        from gencli.pipelines.encoders.embed import embed_texts
        from gencli.pipelines.encoders.loading import load_encoder

        enc = load_encoder(folder, device="cpu", dtype="float32", threads=threads)

        def vec(texts: list[str]) -> torch.Tensor:
            return embed_texts(enc, texts, pooling="mean", normalize=True, batch_size=64)

    own = {s: vec([caption(sc, s) for sc, _ in pairs]) for s in styles}
    other = {s: vec([caption(sw, s) for _, sw in pairs]) for s in styles}
    out: dict = {"triples_per_style_pair": len(pairs)}
    for name, style_pairs in groups.items():
        shares = []
        for a, b in style_pairs:
            pos, neg = (own[a] * own[b]).sum(-1), (own[a] * other[b]).sum(-1)
            shares.append(float(((pos > neg).float() + 0.5 * (pos == neg).float()).mean()))
        out[name] = round(float(np.mean(shares)), 4)
    return out


def evaluate(folder: Path | None, sizes: tuple[int, ...] = (100, 1000), threads: int = 1) -> dict:
    """Held-out figures of the embedding in ``folder`` (through gencli's embed pipeline), or of the
    bag-of-words cosine baseline when ``folder`` is None."""
    scenes = heldout_scenes(max(sizes))
    styles = TRAIN_STYLES + HELDOUT_STYLES
    texts = {s: [caption(sc, s) for sc in scenes] for s in styles}
    if folder is None:
        words = sorted({w for s in styles for t in texts[s] for w in re.findall(r"[a-z]+", t.lower())})
        vocab = {w: i for i, w in enumerate(words)}
        vecs = {s: bag_of_words(texts[s], vocab) for s in styles}
    else:
        from gencli.pipelines.encoders.embed import embed_texts
        from gencli.pipelines.encoders.loading import load_encoder

        enc = load_encoder(folder, device="cpu", dtype="float32", threads=threads)
        vecs = {s: embed_texts(enc, texts[s], pooling="mean", normalize=True, batch_size=64) for s in styles}
    groups = {
        "trained_styles": [(a, b) for a in TRAIN_STYLES for b in TRAIN_STYLES if a != b],
        "heldout_styles": [(a, b) for a in HELDOUT_STYLES for b in TRAIN_STYLES],
    }
    out: dict = {"scenes": list(sizes)}
    out["binding"] = binding_scores(folder, groups, max(sizes), threads)
    for name, pairs in groups.items():
        figures = {}
        for n in sizes:
            per = [ranking_scores(vecs[a][:n], vecs[b][:n]) for a, b in pairs]
            figures[f"recall@1_n{n}"] = round(float(np.mean([r for r, _ in per])), 4)
            figures[f"ordered_pairs_n{n}"] = round(float(np.mean([o for _, o in per])), 4)
        for a, b in pairs:  # each pair at the largest N, for the README
            r, o = ranking_scores(vecs[a], vecs[b])
            figures[f"{a}->{b}"] = {"recall@1": round(r, 4), "ordered_pairs": round(o, 4)}
        out[name] = figures
    return out


# -- export --------------------------------------------------------------------------------------
def export(model: EncoderForTask, base: Path, out: Path, cfg: dict, meta: dict) -> None:
    """A sentence-transformers folder: the bare encoder in transformers' BertModel layout (fp16), mean pooling, Normalize."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    prefix = model.base_name + "."
    state = {k[len(prefix) :]: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items() if k.startswith(prefix)}
    with atomic_path(out / "model.safetensors", force=True) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    config = {**cfg, "architectures": ["BertModel"]}
    config.pop("tie_word_embeddings", None)
    hidden = int(cfg["hidden_size"])

    def write_json(path: Path, obj) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode(), force=True)

    write_json(out / "config.json", config)
    write_json(
        out / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}  # fmt: skip
    write_json(out / "1_Pooling" / "config.json", pooling)
    write_json(out / "sentence_bert_config.json", {"max_seq_length": int(cfg["max_position_embeddings"]), "do_lower_case": False})
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        atomic_write_bytes(out / name, (base / name).read_bytes(), force=True)
    write_json(out / "training.json", meta)
    log(f"exported to {out} ({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="weights/bert-pystdlib")
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir", default="runs/bert-shapes-embed")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--until", metavar="HH:MM", help="end at this wall-clock time instead (the schedule is re-estimated from the measured speed)")
    ap.add_argument("--batch", type=int, default=64, help="scenes per batch (two captions each)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--ckpt-minutes", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-only", action="store_true", help="score --out (a folder; 'bag-of-words' for the word-overlap baseline)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out, base = Path(args.out), Path(args.base)
    if args.eval_only:
        print(json.dumps(evaluate(None if args.out == "bag-of-words" else out, threads=args.threads), indent=2))
        return
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    hf = json.loads((base / "config.json").read_text())
    model = EncoderForTask(EncoderConfig.from_hf(hf), "base")
    model.load_state_dict({k: v.float() for k, v in load_file(str(base / "model.safetensors")).items() if k.startswith("bert.")})
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

    def loss_of_step(step: int, total: int) -> torch.Tensor:
        a, b, desc = make_batch(rng, args.batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            za, zb = embed(model, tok, a), embed(model, tok, b)
        return contrastive_loss(za.float(), zb.float(), desc, args.temperature)

    step, smooth = fit_until(model, opt, ckpt, loss_of_step, step=step, steps=args.steps, lr=args.lr, warmup=args.warmup, history=history,
                             until=args.until, ckpt_minutes=args.ckpt_minutes, log=log)  # fmt: skip
    model.eval()
    meta = {"command": history, "step": step, "base": str(base), "batch_scenes": args.batch, "temperature": args.temperature,
            "train_styles": list(TRAIN_STYLES), "train_loss": round(smooth or 0.0, 4)}  # fmt: skip
    export(model, base, out, hf, meta)
    meta["heldout"] = evaluate(out, threads=args.threads)
    atomic_write_bytes(out / "training.json", (json.dumps(meta, indent=2) + "\n").encode(), force=True)
    log(f"held-out: {json.dumps(meta['heldout'])}")


if __name__ == "__main__":
    main()
