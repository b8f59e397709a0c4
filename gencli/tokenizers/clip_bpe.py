"""CLIP's byte-level BPE tokenizer, read from ``vocab.json`` + ``merges.txt``.

The text pipeline reproduces transformers' ``CLIPTokenizer`` id for id:

1. special tokens written literally in the text (``<|startoftext|>``, ``<|endoftext|>``) are taken as
   those tokens, before anything else;
2. normalisation: Unicode NFC, every run of Unicode white space replaced by one space, lower case
   (character by character, so a final Greek sigma stays ``σ``, as in the Rust implementation);
3. pre-tokenisation with CLIP's pattern
   ``<|startoftext|>|<|endoftext|>|'s|'t|'re|'ve|'m|'ll|'d|\\p{L}+|\\p{N}|[^\\s\\p{L}\\p{N}]+``
   (letters in runs, digits one by one, other symbols in runs; white space dropped), followed by the
   byte-level stage's own split by character class, which only ever cuts a special token's spelling
   that normalisation produced (``<|ENDOFTEXT|>``) into ``<|``, the name and ``|>``;
4. each piece's UTF-8 bytes mapped to printable characters (GPT-2's byte-to-unicode table), the end of
   the piece marked by ``</w>`` on its last symbol, and BPE merges applied lowest rank first;
5. ``<|startoftext|>`` + ids + ``<|endoftext|>``, truncated to the model's context (77) with the end
   token kept, optionally padded.

:func:`train_bpe` learns a vocabulary in exactly this format (256 byte symbols, the same 256 with
``</w>``, then one token per merge, then the two special tokens), so a model trained here ships the same
files a downloaded CLIP has.

Single-file Stable Diffusion checkpoints carry no tokenizer. gencli ships the vocabulary SD 1.x, 2.x and
SDXL use (OpenAI CLIP's, 49,408 tokens) as ``data/bpe_simple_vocab_16e6.txt.gz`` (MIT; notice beside
it): :meth:`CLIPTokenizer.from_openai_bpe` builds the tokenizer from it exactly as OpenAI's
``simple_tokenizer`` lays the vocabulary out (see :func:`read_openai_bpe`).
"""

from __future__ import annotations

import gzip
import json
import os
import unicodedata
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional, Sequence

from gencli.errors import CheckpointError, UserError
from gencli.io import read_json as _read_json

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
END_OF_WORD = "</w>"
DEFAULT_CONTEXT = 77
# The vocabulary OpenAI CLIP, and with it Stable Diffusion 1.x/2.x/SDXL, tokenizes with.
OPENAI_BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
OPENAI_VOCAB_SIZE = 49408
OPENAI_NUM_MERGES = 49152 - 256 - 2  # the merges simple_tokenizer reads: 48,894

# Unicode's White_Space property (what `\s` means in the Rust regex engine used by the reference);
# Python's str.isspace() differs on U+001C..U+001F.
WHITE_SPACE = frozenset(
    "\u0009\u000a\u000b\u000c\u000d\u0020\u0085\u00a0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (no white space or controls)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def normalize(text: str) -> str:
    """NFC, white-space runs to one space, lower case (per character)."""
    text = unicodedata.normalize("NFC", text)
    out: list[str] = []
    in_space = False
    for ch in text:
        if ch in WHITE_SPACE:
            if not in_space:
                out.append(" ")
            in_space = True
            continue
        in_space = False
        out.append(ch.lower())
    return "".join(out)


def _kind(ch: str) -> str:
    """'L' letter, 'N' number, 'S' white space, 'P' anything else."""
    if ch in WHITE_SPACE:
        return "S"
    cat = unicodedata.category(ch)
    if cat[0] == "L":
        return "L"
    if cat[0] == "N":
        return "N"
    return "P"


def pre_tokenize(text: str) -> list[str]:
    """Split normalised text into pieces with CLIP's pattern (see the module doc)."""
    pieces: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith(BOS, i) or text.startswith(EOS, i):
            # The pattern keeps a special token's spelling in one piece, but the byte-level stage that
            # follows splits it again by character class (GPT-2's pattern): "<|", the name, "|>".
            tok = BOS if text.startswith(BOS, i) else EOS
            pieces.extend(("<|", tok[2:-2], "|>"))
            i += len(tok)
            continue
        if text[i] == "'":
            hit = next((c for c in CONTRACTIONS if text.startswith(c, i)), None)
            if hit:
                pieces.append(hit)
                i += len(hit)
                continue
        kind = _kind(text[i])
        if kind == "S":
            i += 1
            continue
        if kind == "N":
            pieces.append(text[i])
            i += 1
            continue
        j = i + 1
        while j < n and _kind(text[j]) == kind:
            j += 1
        pieces.append(text[i:j])
        i = j
    return pieces


def _split_specials(text: str, specials: Sequence[str]) -> list[tuple[str, bool]]:
    """Cut raw text around literal special tokens: [(segment, is_special), ...]."""
    out: list[tuple[str, bool]] = []
    i = start = 0
    while i < len(text):
        hit = next((s for s in specials if s and text.startswith(s, i)), None)
        if hit is None:
            i += 1
            continue
        if i > start:
            out.append((text[start:i], False))
        out.append((hit, True))
        i += len(hit)
        start = i
    if start < len(text):
        out.append((text[start:], False))
    return out


@dataclass
class Encoding:
    """Token ids of a batch, padded to a common length, with the attention mask (1 = real token)."""

    input_ids: list[list[int]]
    attention_mask: list[list[int]]

    def tensors(self, device=None):
        import torch

        return (
            torch.tensor(self.input_ids, dtype=torch.long, device=device),
            torch.tensor(self.attention_mask, dtype=torch.long, device=device),
        )


class CLIPTokenizer:
    """Byte-level BPE with CLIP's text rules (see the module doc)."""

    def __init__(
        self,
        vocab: dict[str, int],
        merges: Sequence[tuple[str, str]],
        *,
        bos_token: str = BOS,
        eos_token: str = EOS,
        pad_token: Optional[str] = EOS,
        unk_token: Optional[str] = EOS,
        model_max_length: int = DEFAULT_CONTEXT,
    ):
        self.encoder = dict(vocab)
        self.decoder = {i: t for t, i in self.encoder.items()}
        self.ranks = {tuple(pair): rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        for name, tok in (("bos", bos_token), ("eos", eos_token)):
            if tok not in self.encoder:
                raise UserError(f"the tokenizer's {name} token '{tok}' is not in its vocabulary")
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token = pad_token if pad_token in self.encoder else eos_token
        self.unk_token = unk_token if unk_token in self.encoder else None
        self.bos_token_id = self.encoder[bos_token]
        self.eos_token_id = self.encoder[eos_token]
        self.pad_token_id = self.encoder[self.pad_token]
        self.unk_token_id = self.encoder[self.unk_token] if self.unk_token else None
        self.model_max_length = int(model_max_length)
        self.specials = sorted({bos_token, eos_token, self.pad_token, *( [self.unk_token] if self.unk_token else [])}, key=len, reverse=True)
        self._cache: dict[str, list[int]] = {}

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: str | os.PathLike, *, model_max_length: Optional[int] = None) -> "CLIPTokenizer":
        """Read ``vocab.json`` + ``merges.txt`` (or a BPE ``tokenizer.json``) and the special tokens and
        context length of ``tokenizer_config.json`` / ``special_tokens_map.json`` from ``folder``."""
        folder = Path(folder)
        vocab_file, merges_file, tok_file = folder / "vocab.json", folder / "merges.txt", folder / "tokenizer.json"
        if vocab_file.is_file() and merges_file.is_file():
            vocab = _read_json(vocab_file)
            merges = read_merges(merges_file)
        elif tok_file.is_file():
            vocab, merges = _bpe_from_tokenizer_json(tok_file)
        else:
            raise UserError(f"no CLIP tokenizer in '{folder}': expected vocab.json and merges.txt (or tokenizer.json)")
        settings: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            f = folder / name
            if f.is_file():
                for key, value in _read_json(f).items():
                    if isinstance(value, dict) and "content" in value:  # AddedToken serialisation
                        value = value["content"]
                    settings[key] = value
        kwargs = {k: settings[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if isinstance(settings.get(k), str)}
        length = settings.get("model_max_length")
        if model_max_length is not None:
            length = model_max_length
        if not isinstance(length, int) or length <= 2 or length > 1_000_000:
            length = DEFAULT_CONTEXT  # absent, or transformers' "very large" placeholder
        return cls(vocab, merges, model_max_length=length, **kwargs)

    @classmethod
    def from_openai_bpe(
        cls,
        path: str | os.PathLike | None = None,
        *,
        pad_token: str = EOS,
        model_max_length: int = DEFAULT_CONTEXT,
    ) -> "CLIPTokenizer":
        """OpenAI CLIP's tokenizer from its ``bpe_simple_vocab_16e6.txt.gz`` (default: the copy shipped
        with gencli, :func:`shipped_vocabulary`).

        The file has no special-token settings: Stable Diffusion 1.x pads with ``<|endoftext|>`` (the
        default), SD 2.x and SDXL's second tokenizer with ``"!"`` (id 0). As in transformers, the pad
        token is a special token, so a literal ``"!"`` in a prompt encodes as id 0 for the latter.
        """
        vocab, merges = read_openai_bpe(path)
        return cls(vocab, merges, pad_token=pad_token, model_max_length=model_max_length)

    def save(self, folder: str | os.PathLike) -> None:
        """Write ``vocab.json``, ``merges.txt`` and the tokenizer configuration (transformers' file names)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "vocab.json").write_text(json.dumps(self.encoder, ensure_ascii=False), encoding="utf-8")
        merges = sorted(self.ranks, key=self.ranks.get)
        (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
        config = {
            "tokenizer_class": "CLIPTokenizer",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token or self.eos_token,
            "model_max_length": self.model_max_length,
            "do_lower_case": True,
            "errors": "replace",
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        specials = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    # -- encoding -----------------------------------------------------------------------------
    def bpe(self, piece: str) -> list[str]:
        """BPE of one pre-tokenised piece (already byte-mapped): symbols, the last one carrying ``</w>``."""
        word = list(piece[:-1]) + [piece[-1] + END_OF_WORD]
        ranks = self.ranks
        while len(word) > 1:
            best, best_rank = None, None
            for pair in zip(word, word[1:]):
                r = ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = pair, r
            if best is None:
                break
            first, second = best
            merged: list[str] = []
            i = 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def _piece_ids(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids = []
            for sym in self.bpe(mapped):
                i = self.encoder.get(sym)
                if i is None:
                    if self.unk_token_id is None:
                        continue
                    i = self.unk_token_id
                ids.append(i)
            if len(self._cache) < 100_000:
                self._cache[piece] = ids
        return ids

    def tokenize_ids(self, text: str) -> list[int]:
        """Ids of ``text`` without the start/end tokens and without truncation."""
        ids: list[int] = []
        for segment, special in _split_specials(text, self.specials):
            if special:
                ids.append(self.encoder[segment])
                continue
            for piece in pre_tokenize(normalize(segment)):
                ids.extend(self._piece_ids(piece))
        return ids

    def encode(self, text: str, *, max_length: Optional[int] = None, truncation: bool = True) -> list[int]:
        """``[bos] + ids + [eos]``, the content truncated so the whole fits ``max_length`` (default: the
        model's context)."""
        limit = self.model_max_length if max_length is None else max_length
        ids = self.tokenize_ids(text)
        if truncation and len(ids) > limit - 2:
            ids = ids[: max(limit - 2, 0)]
        return [self.bos_token_id, *ids, self.eos_token_id]

    def __call__(
        self,
        texts: str | Sequence[str],
        *,
        padding: str | bool = "longest",
        max_length: Optional[int] = None,
        truncation: bool = True,
    ) -> Encoding:
        """Encode a batch. ``padding``: ``"longest"`` (or True), ``"max_length"`` (to the context, as
        Stable Diffusion pipelines do) or ``"do_not_pad"``/False (then every text must have the same length)."""
        if isinstance(texts, str):
            texts = [texts]
        limit = self.model_max_length if max_length is None else max_length
        seqs = [self.encode(t, max_length=limit, truncation=truncation) for t in texts]
        if padding in (True, "longest"):
            width = max((len(s) for s in seqs), default=0)
        elif padding == "max_length":
            width = max(limit, max((len(s) for s in seqs), default=0))
        elif padding in (False, "do_not_pad"):
            width = None
        else:
            raise ValueError(f"unknown padding '{padding}'")
        if width is None:
            return Encoding(seqs, [[1] * len(s) for s in seqs])
        ids = [s + [self.pad_token_id] * (width - len(s)) for s in seqs]
        mask = [[1] * len(s) + [0] * (width - len(s)) for s in seqs]
        return Encoding(ids, mask)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``: ``</w>`` becomes a space, bytes are reassembled (invalid UTF-8 replaced)."""
        specials = {self.bos_token_id, self.eos_token_id, self.pad_token_id}
        parts = []
        for i in ids:
            if skip_special_tokens and i in specials:
                continue
            parts.append(self.decoder.get(int(i), ""))
        text = "".join(parts)
        data = bytearray()
        out = []
        for ch in text.replace(END_OF_WORD, " "):
            b = self.byte_decoder.get(ch)
            if b is None:
                out.append(data.decode("utf-8", errors="replace"))
                data.clear()
                out.append(ch)
            else:
                data.append(b)
        out.append(data.decode("utf-8", errors="replace"))
        return "".join(out).strip()


# -- files ------------------------------------------------------------------------------------
def read_merges(path: Path) -> list[tuple[str, str]]:
    """``merges.txt``: an optional ``#version`` line, then one ``left right`` pair per line."""
    merges: list[tuple[str, str]] = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as exc:
        raise UserError(f"cannot read '{path}': {exc.strerror or exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip() or (n == 1 and line.startswith("#version")):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise UserError(f"'{path}' line {n} is not a merge ('left right'): {line[:60]!r}")
        merges.append((parts[0], parts[1]))
    return merges


def shipped_vocabulary() -> Path:
    """Where gencli's copy of OpenAI CLIP's ``bpe_simple_vocab_16e6.txt.gz`` is (package data)."""
    return Path(__file__).resolve().parent / "data" / OPENAI_BPE_FILE


@lru_cache(maxsize=2)
def _openai_bpe(path: Path) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            lines = fh.read().split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read the CLIP vocabulary '{path}': {exc}") from None
    merges = []
    for n, line in enumerate(lines[1 : 1 + OPENAI_NUM_MERGES], 2):
        parts = line.split()
        if len(parts) != 2:
            raise CheckpointError(f"'{path}' line {n} is not a merge ('left right'): {line[:60]!r}")
        merges.append((parts[0], parts[1]))
    if len(merges) != OPENAI_NUM_MERGES:
        raise CheckpointError(f"'{path}' holds {len(merges)} merges, OpenAI CLIP's vocabulary {OPENAI_NUM_MERGES}")
    symbols = list(bytes_to_unicode().values())  # the table's order: printable bytes first, as OpenAI's
    tokens = symbols + [s + END_OF_WORD for s in symbols] + ["".join(m) for m in merges] + [BOS, EOS]
    return tuple(tokens), tuple(merges)


def read_openai_bpe(path: str | os.PathLike | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of OpenAI CLIP's gzipped BPE file, laid out as its ``simple_tokenizer``
    does: a header line, then the first ``49152 - 256 - 2`` merge lines are used; the vocabulary is the
    256 byte symbols (in the byte-to-unicode table's order), the same with ``</w>``, one token per merge,
    then ``<|startoftext|>`` and ``<|endoftext|>`` (49,408 tokens). The same ids as the ``vocab.json``
    of transformers' CLIP tokenizers."""
    tokens, merges = _openai_bpe(Path(path).resolve() if path is not None else shipped_vocabulary())
    return {tok: i for i, tok in enumerate(tokens)}, list(merges)


def _bpe_from_tokenizer_json(path: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    data = _read_json(path)
    model = data.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UserError(f"'{path}' is not a BPE tokenizer")
    merges = []
    for m in model.get("merges") or []:
        pair = m.split(" ") if isinstance(m, str) else m
        if len(pair) != 2:
            raise UserError(f"'{path}' has a malformed merge {m!r}")
        merges.append((pair[0], pair[1]))
    vocab = dict(model["vocab"])
    for added in data.get("added_tokens") or []:
        vocab.setdefault(added["content"], added["id"])
    return vocab, merges


# -- training ---------------------------------------------------------------------------------
def train_bpe(texts: Iterable[str], num_merges: int, *, min_frequency: int = 2, model_max_length: int = DEFAULT_CONTEXT) -> CLIPTokenizer:
    """Learn a CLIP-format byte-level BPE from ``texts``.

    The vocabulary is laid out as OpenAI's: the 256 byte symbols, the same with ``</w>``, one token per
    merge (most frequent adjacent pair first, ties broken by the pair itself so the result does not
    depend on hash order), then ``<|startoftext|>`` and ``<|endoftext|>``. Pieces are counted after
    the same normalisation and pre-tokenisation the tokenizer applies.
    """
    byte_enc = bytes_to_unicode()
    words: Counter[str] = Counter()
    for text in texts:
        for segment, special in _split_specials(text, (BOS, EOS)):
            if not special:
                words.update(pre_tokenize(normalize(segment)))
    corpus: list[tuple[list[str], int]] = []
    for piece, count in words.items():
        mapped = "".join(byte_enc[b] for b in piece.encode("utf-8"))
        corpus.append((list(mapped[:-1]) + [mapped[-1] + END_OF_WORD], count))

    base = [byte_enc[b] for b in range(256)]
    vocab_list = base + [s + END_OF_WORD for s in base]
    merges: list[tuple[str, str]] = []
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for idx, (syms, count) in enumerate(corpus):
        for pair in zip(syms, syms[1:]):
            pair_counts[pair] += count
            where.setdefault(pair, set()).add(idx)
    seen = set(vocab_list)
    while len(merges) < num_merges and pair_counts:
        best = max(pair_counts.items(), key=lambda kv: (kv[1], kv[0]))
        pair, count = best
        if count < min_frequency:
            break
        merges.append(pair)
        new = pair[0] + pair[1]
        if new not in seen:
            vocab_list.append(new)
            seen.add(new)
        for idx in list(where.get(pair, ())):
            syms, c = corpus[idx]
            for p in zip(syms, syms[1:]):
                pair_counts[p] -= c
                if pair_counts[p] <= 0:
                    del pair_counts[p]
            out: list[str] = []
            i = 0
            while i < len(syms):
                if i < len(syms) - 1 and syms[i] == pair[0] and syms[i + 1] == pair[1]:
                    out.append(new)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            corpus[idx] = (out, c)
            for p in zip(out, out[1:]):
                pair_counts[p] += c
                where.setdefault(p, set()).add(idx)
        where.pop(pair, None)
    vocab_list += [BOS, EOS]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    return CLIPTokenizer(vocab, merges, model_max_length=model_max_length)


__all__ = [
    "CLIPTokenizer",
    "Encoding",
    "bytes_to_unicode",
    "normalize",
    "pre_tokenize",
    "read_merges",
    "read_openai_bpe",
    "shipped_vocabulary",
    "train_bpe",
    "BOS",
    "EOS",
    "OPENAI_VOCAB_SIZE",
]
