"""Tokenizers of BERT-family encoders, found in a model folder the way transformers finds them.

- ``tokenizer.json`` when the folder has one (transformers prefers it too), through the ``tokenizers`` library;
- a classic ``vocab.txt``-only folder: BERT WordPiece, built with the ``tokenizers`` library exactly as
  transformers' ``BertTokenizerFast`` converts it: the basic tokenizer (control characters removed,
  whitespace cleaned, CJK characters split apart, ``do_lower_case`` and ``strip_accents`` from
  ``tokenizer_config.json``, punctuation split) then greedy longest-match WordPiece with ``##``
  continuations, ``[UNK]`` for a word that cannot be spelled or is longer than 100 characters;
- RoBERTa's byte-level BPE from ``vocab.json`` + ``merges.txt``.

Every encoding carries character offsets into the text, token type ids and the special-token mask;
sentence pairs are ``[CLS] a [SEP] b [SEP]`` (``<s> a </s></s> b </s>`` for RoBERTa).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from gencli.errors import UserError
from gencli.io import read_json

TOKENIZER_FILES = "tokenizer.json, vocab.txt (WordPiece) or vocab.json + merges.txt (byte-level BPE)"


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass
class Encoded:
    """One tokenized text (or pair): ids, token types, (start, end) character offsets, special-token
    mask, and how many tokens truncation cut."""

    ids: list[int]
    type_ids: list[int]
    offsets: list[tuple[int, int]]
    special: list[int]
    tokens: list[str]
    sequence_ids: list[Optional[int]]
    cut: int = 0


class EncoderTokenizer:
    """A ``tokenizers.Tokenizer`` with the special tokens of an encoder checkpoint."""

    def __init__(self, tokenizer: Any, special: dict[str, Optional[str]], kind: str, model_max_length: Optional[int] = None, clean_up_spaces: bool = False):
        self.tk = tokenizer
        self.tk.no_truncation()
        self.tk.no_padding()
        self.kind = kind
        self.cls_token = special.get("cls_token")
        self.sep_token = special.get("sep_token")
        self.pad_token = special.get("pad_token")
        self.unk_token = special.get("unk_token")
        self.mask_token = special.get("mask_token")
        self.model_max_length = model_max_length
        self.clean_up_spaces = clean_up_spaces

    # -- lookups ----------------------------------------------------------------------------------
    def token_to_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self.tk.token_to_id(token)

    def id_to_token(self, idx: int) -> Optional[str]:
        return self.tk.id_to_token(idx)

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        pid = self.token_to_id(self.pad_token)
        return 0 if pid is None else pid

    @property
    def mask_id(self) -> Optional[int]:
        return self.token_to_id(self.mask_token)

    # -- encoding ---------------------------------------------------------------------------------
    def encode(self, text: str, pair: Optional[str] = None, *, max_length: Optional[int] = None) -> Encoded:
        """``text`` (and ``pair``) with the special tokens; at most ``max_length`` tokens (the longest
        sequence loses its last tokens first, as transformers' ``longest_first`` does)."""
        self.tk.no_truncation()
        enc = self.tk.encode(text, pair) if pair is not None else self.tk.encode(text)
        cut = 0
        if max_length is not None and len(enc.ids) > max_length:
            cut = len(enc.ids) - max_length
            specials = self.tk.num_special_tokens_to_add(pair is not None)
            if max_length <= specials:
                raise UserError(f"--max-length {max_length} leaves no room for text next to the {specials} special tokens")
            self.tk.enable_truncation(max_length, strategy="longest_first")
            try:
                enc = self.tk.encode(text, pair) if pair is not None else self.tk.encode(text)
            finally:
                self.tk.no_truncation()
        return Encoded(
            list(enc.ids),
            list(enc.type_ids),
            [tuple(o) for o in enc.offsets],
            list(enc.special_tokens_mask),
            list(enc.tokens),
            list(enc.sequence_ids),
            cut,
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_spaces else text


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and English contractions."""
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text


def _special_tokens(folder: Path, tok_config: dict[str, Any], defaults: dict[str, str]) -> dict[str, Optional[str]]:
    smap = read_json(folder / "special_tokens_map.json", missing_ok=True) or {}
    out: dict[str, Optional[str]] = {}
    for name, default in defaults.items():
        out[name] = _token_text(tok_config.get(name)) or _token_text(smap.get(name)) or default
    return out


BERT_SPECIALS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"}
ROBERTA_SPECIALS = {"cls_token": "<s>", "sep_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}


def read_vocab_txt(path: Path) -> dict[str, int]:
    """``vocab.txt``: one token a line, the line number its id (as transformers' ``load_vocab``)."""
    vocab: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            vocab[line.rstrip("\n")] = i
    return vocab


def wordpiece_tokenizer(
    vocab: dict[str, int],
    *,
    do_lower_case: bool = True,
    strip_accents: Optional[bool] = None,
    tokenize_chinese_chars: bool = True,
    specials: Optional[dict[str, Optional[str]]] = None,
) -> Any:
    """BERT's WordPiece tokenizer over ``vocab`` (a ``tokenizers.Tokenizer``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = specials or dict(BERT_SPECIALS)
    unk = specials.get("unk_token") or "[UNK]"
    tk = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tk.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=tokenize_chinese_chars, strip_accents=strip_accents, lowercase=do_lower_case
    )
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##")
    cls, sep = specials.get("cls_token") or "[CLS]", specials.get("sep_token") or "[SEP]"
    for name in (cls, sep):
        if name not in vocab:
            raise UserError(f"vocab.txt lacks the special token '{name}'")
    tk.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1", special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])]
    )
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values() if t and t in vocab])
    return tk


def byte_level_bpe_tokenizer(
    vocab: dict[str, int], merges: list[tuple[str, str]], *, add_prefix_space: bool = False, specials: dict[str, Optional[str]]
) -> Any:
    """RoBERTa's byte-level BPE over ``vocab`` and ``merges`` (a ``tokenizers.Tokenizer``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tk = Tokenizer(models.BPE(vocab, merges, unk_token=None, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tk.decoder = decoders.ByteLevel()
    cls, sep = specials["cls_token"] or "<s>", specials["sep_token"] or "</s>"
    if cls not in vocab or sep not in vocab:
        raise UserError(f"vocab.json lacks the special tokens '{cls}' / '{sep}'")
    tk.post_processor = processors.RobertaProcessing((sep, vocab[sep]), (cls, vocab[cls]), trim_offsets=True, add_prefix_space=add_prefix_space)
    added = []
    for name, tok in specials.items():
        if tok and tok in vocab:
            # RoBERTa's mask token swallows the space before it (AddedToken(lstrip=True))
            added.append(AddedToken(tok, special=True, normalized=False, lstrip=name == "mask_token"))
    tk.add_special_tokens(added)
    return tk


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.rstrip("\n")
            if not line or line.startswith("#version"):
                continue
            a, _, b = line.partition(" ")
            merges.append((a, b))
    return merges


def load_encoder_tokenizer(folder: Path, model_type: str = "bert") -> EncoderTokenizer:
    """The tokenizer of the encoder checkpoint in ``folder``; a one-line UserError when it has none."""
    folder = Path(folder)
    tok_config = read_json(folder / "tokenizer_config.json", missing_ok=True) or {}
    roberta = model_type in ("roberta", "xlm-roberta")
    defaults = ROBERTA_SPECIALS if roberta else BERT_SPECIALS
    specials = _special_tokens(folder, tok_config, defaults)
    max_len = tok_config.get("model_max_length")
    max_len = int(max_len) if isinstance(max_len, (int, float)) and max_len < 10**8 else None
    clean = bool(tok_config.get("clean_up_tokenization_spaces", False))
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the library's own error types
            raise UserError(f"cannot read '{folder / 'tokenizer.json'}': {exc}") from None
        return EncoderTokenizer(tk, specials, "tokenizer.json", max_len, clean)
    if (folder / "vocab.txt").is_file():
        lower = tok_config.get("do_lower_case", True)
        tk = wordpiece_tokenizer(
            read_vocab_txt(folder / "vocab.txt"),
            do_lower_case=bool(lower),
            strip_accents=tok_config.get("strip_accents"),
            tokenize_chinese_chars=bool(tok_config.get("tokenize_chinese_chars", True)),
            specials=specials,
        )
        return EncoderTokenizer(tk, specials, "vocab.txt (WordPiece)", max_len, clean)
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        with open(folder / "vocab.json", encoding="utf-8") as fh:
            vocab = json.load(fh)
        tk = byte_level_bpe_tokenizer(
            vocab, _read_merges(folder / "merges.txt"), add_prefix_space=bool(tok_config.get("add_prefix_space", False)), specials=specials
        )
        return EncoderTokenizer(tk, specials, "vocab.json + merges.txt (byte-level BPE)", max_len, clean)
    raise UserError(f"no tokenizer in '{folder}': expected {TOKENIZER_FILES}")
