"""Tiny random T5 (v1.0, v1.1) and Marian checkpoints, built through transformers and saved as
people download them, with sentencepiece models trained here on generated sentences."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
SHAPES = ["circle", "square", "triangle", "star", "heart", "cross"]
PLACES = ["at the top left", "in the middle", "at the bottom right", "near the centre", "on the left"]
SIZES = ["small", "large", "tiny", "big"]
GERMAN = ["ein kleiner roter Stern", "oben links", "auf blauem Grund", "ein großes grünes Herz", "in der Mitte", "unten rechts"]

INPUTS = [
    "a small red star at the top left on a blue background",
    "translate English to German: a big green heart in the middle.",
    "a tiny white cross",
    "hello",
]
EXTRA_IDS = 10


def sentences(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = f"a {rng.choice(SIZES)} {rng.choice(COLOURS)} {rng.choice(SHAPES)} {rng.choice(PLACES)} on a {rng.choice(COLOURS)} background"
        if i % 3 == 0:
            s = "translate English to German: " + s.capitalize() + "."
        if i % 5 == 0:
            s += f" ({i} items, 3.5%)"
        out.append(s)
    return out


def train_spm(path: Path, lines: list[str], vocab_size: int, **ids) -> None:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, hard_vocab_limit=False, model_type="unigram",
        character_coverage=1.0, minloglevel=2, num_threads=1, **ids,
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def _save(model, folder: Path, config_updates: dict | None = None, generation: dict | None = None) -> None:
    model.save_pretrained(folder)
    if config_updates:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config_updates)
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))


def t5_checkpoint(folder: Path, version: str = "v1.0", seed: int = 0, tokenizer: str = "spiece") -> Path:
    """A T5 folder: ``spiece.model`` alone (plus tokenizer_config.json naming the sentinel count), or
    ``tokenizer.json`` written by transformers from it (``tokenizer="json"``)."""
    import sentencepiece as spm
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    train_spm(folder / "spiece.model", sentences(), 100, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    (folder / "tokenizer_config.json").write_text(json.dumps({"extra_ids": EXTRA_IDS}))
    vocab = spm.SentencePieceProcessor(model_file=str(folder / "spiece.model")).get_piece_size() + EXTRA_IDS
    torch.manual_seed(seed)
    v11 = version == "v1.1"
    cfg = T5Config(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        feed_forward_proj="gated-gelu" if v11 else "relu", tie_word_embeddings=not v11,
    )  # fmt: skip
    model = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # softer logits than the unit-variance default: outputs that vary by input
        model.shared.weight.mul_(0.3)
    if v11:
        from safetensors.torch import save_file

        model.lm_head.weight = torch.nn.Parameter(torch.randn(vocab, 32) * 0.3)
        _save(model, folder, {"tie_word_embeddings": False})
        state = {k: v.contiguous() for k, v in model.state_dict().items() if "embed_tokens" not in k}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        _save(model, folder)
    if tokenizer == "json":
        from transformers import T5Tokenizer

        T5Tokenizer.from_pretrained(folder, extra_ids=EXTRA_IDS).save_pretrained(folder)
        (folder / "spiece.model").unlink(missing_ok=True)
    return folder


def marian_checkpoint(folder: Path, seed: int = 0, shared: bool = True) -> Path:
    """A Marian folder: source.spm, target.spm, vocab.json (pieces of both models; ``</s>`` 0,
    ``<unk>`` 1, ``<pad>`` last, as opus-mt has them), config.json and a generation_config.json
    with the opus-mt settings (bad_words_ids = the pad, forced end token, 4 beams)."""
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel

    folder.mkdir(parents=True, exist_ok=True)
    train_spm(folder / "source.spm", sentences(300, seed=1), 90)
    rng = random.Random(2)
    german = [" ".join(rng.sample(GERMAN, 3)) for _ in range(300)]
    train_spm(folder / "target.spm", german, 80)
    pieces: list[str] = []
    for name in ("source.spm", "target.spm"):
        sp = spm.SentencePieceProcessor(model_file=str(folder / name))
        pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_control(i) and not sp.is_unknown(i)]
    vocab = {"</s>": 0, "<unk>": 1}
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({"source_lang": "en", "target_lang": "de", "model_max_length": 64}))
    pad = vocab["<pad>"]
    torch.manual_seed(seed)
    cfg = MarianConfig(
        vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64, scale_embedding=True,
        pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, activation_function="swish", share_encoder_decoder_embeddings=shared, init_std=0.3,
    )  # fmt: skip
    model = MarianMTModel(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(std=0.1)
    generation = {"bad_words_ids": [[pad]], "decoder_start_token_id": pad, "eos_token_id": 0, "forced_eos_token_id": 0, "max_length": 64, "num_beams": 4,
                  "pad_token_id": pad}  # fmt: skip
    _save(model, folder, generation=generation)
    return folder


def bart_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A BART folder (tokenizer.json with <s> <pad> </s> <unk> first) with bart-large-cnn's kind of
    generation settings: forced first and last tokens, 4 beams, no_repeat_ngram_size 3, length penalty 2."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    from tests._text_fixtures import hf_json_tokenizer

    vocab = hf_json_tokenizer(folder, ["<s>", "<pad>", "</s>", "<unk>"])
    torch.manual_seed(seed)
    cfg = BartConfig(
        vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
        decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, init_std=0.3,
        forced_bos_token_id=None, forced_eos_token_id=None,
    )  # fmt: skip
    model = BartForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(std=0.1)
    generation = {"bos_token_id": 0, "decoder_start_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "forced_bos_token_id": 0, "forced_eos_token_id": 2,
                  "no_repeat_ngram_size": 3, "num_beams": 4, "length_penalty": 2.0, "early_stopping": True, "max_length": 40, "min_length": 5}  # fmt: skip
    _save(model, folder, generation=generation)
    return folder
