"""Tokenizers of encoder-decoder checkpoints (T5, Marian), with the interface of
:class:`gencli.tokenizers.text.TextTokenizer` (``encode``, ``decode``, ids of the special tokens).

- :class:`T5SentencePieceTokenizer`: a T5 folder with ``spiece.model`` alone (older uploads). The ids
  are sentencepiece's own (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2), the ``extra_ids`` sentinels
  (``tokenizer_config.json``, default 100) follow the sentencepiece vocabulary in reverse order
  (``<extra_id_0>`` is the last id), and ``</s>`` ends every input, as transformers' ``T5Tokenizer``
  builds them. A folder with ``tokenizer.json`` uses that file instead (:func:`load_seq2seq_tokenizer`).
- :class:`MarianTokenizer`: ``source.spm`` splits the source text into pieces, ``vocab.json`` maps each
  piece to its id (unknown pieces to ``<unk>``), ``</s>`` is appended; a leading language code such
  as ``>>fra<<`` is one token. Output ids map back to pieces through the same vocabulary (or
  ``target_vocab.json`` with separate vocabularies) and are joined by ``target.spm``.

Decoding with ``skip_special_tokens`` drops the special tokens (``<pad>``, ``</s>``, ``<unk>`` and the
sentinels), as transformers does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Sequence

from gencli.errors import UserError
from gencli.tokenizers.text import TextTokenizer, load_tokenizer, read_json

SPIECE_UNDERLINE = "\u2581"


def _load_spm(path: Path) -> Any:
    import sentencepiece as spm

    if not path.is_file():
        raise UserError(f"'{path}' is missing: the checkpoint's sentencepiece model is needed to tokenize")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as exc:
        raise UserError(f"'{path}' is not a sentencepiece model: {str(exc).splitlines()[0]}") from None
    return sp


def _splitter(specials: Sequence[str]) -> Optional[re.Pattern]:
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")") if specials else None


class T5SentencePieceTokenizer(TextTokenizer):
    kind = "sentencepiece"

    def __init__(self, model_file: Path, tok_config: dict[str, Any]):
        super().__init__(model_file.parent, tok_config)
        self.sp = _load_spm(model_file)
        self.pad_token = self.pad_token or "<pad>"
        self.eos_token = self.eos_token or "</s>"
        self.unk_token = self.unk_token or "<unk>"
        extra = tok_config.get("extra_ids")
        self.extra_ids = int(extra) if isinstance(extra, int) else 100
        self.sp_size = self.sp.get_piece_size()
        specials = {t: self.sp.piece_to_id(t) for t in (self.pad_token, self.eos_token, self.unk_token)}
        for i in range(self.extra_ids):
            specials[f"<extra_id_{i}>"] = self.sp_size + self.extra_ids - 1 - i
        self.special_tokens = specials
        self._special_ids = set(specials.values())
        self._split = _splitter(list(specials))
        self.add_eos = True

    def token_to_id(self, token: str) -> Optional[int]:
        if token in self.special_tokens:
            return self.special_tokens[token]
        idx = self.sp.piece_to_id(token)
        return None if idx == self.sp.unk_id() and token != self.unk_token else idx

    def id_to_token(self, idx: int) -> Optional[str]:
        if 0 <= idx < self.sp_size:
            return self.sp.id_to_piece(idx)
        if self.sp_size <= idx < self.sp_size + self.extra_ids:
            return f"<extra_id_{self.sp_size + self.extra_ids - 1 - idx}>"
        return None

    @property
    def vocab_size(self) -> int:
        return self.sp_size + self.extra_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        parts = self._split.split(text) if self._split else [text]
        for i, part in enumerate(parts):
            if i % 2 == 1:
                ids.append(self.special_tokens[part])
            elif part.strip():
                ids.extend(self.sp.encode(part))
        if add_special_tokens and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        run: list[int] = []
        for i in (int(x) for x in ids):
            if i in self._special_ids or not 0 <= i < self.sp_size:
                if skip_special_tokens:
                    continue
                out.append(self.sp.decode(run))
                run = []
                out.append(self.id_to_token(i) or "")
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)


class MarianTokenizer(TextTokenizer):
    kind = "marian"

    def __init__(self, folder: Path, tok_config: dict[str, Any]):
        super().__init__(folder, tok_config)
        self.pad_token = self.pad_token or "<pad>"
        self.eos_token = self.eos_token or "</s>"
        self.unk_token = self.unk_token or "<unk>"
        self.source = _load_spm(folder / "source.spm")
        self.target = _load_spm(folder / "target.spm") if (folder / "target.spm").is_file() else self.source
        self.encoder = self._vocab(folder / "vocab.json")
        separate = bool(tok_config.get("separate_vocabs"))
        target_vocab = folder / str(tok_config.get("target_vocab_file") or "target_vocab.json")
        self.target_encoder = self._vocab(target_vocab) if separate and target_vocab.is_file() else self.encoder
        self.decoder = {v: k for k, v in self.target_encoder.items()}
        if self.unk_token not in self.encoder:
            raise UserError(f"'{folder / 'vocab.json'}' has no '{self.unk_token}' token")
        self.special_tokens = {t: self.encoder[t] for t in (self.pad_token, self.eos_token, self.unk_token) if t in self.encoder}
        self._special_ids = {self.target_encoder[t] for t in (self.pad_token, self.eos_token, self.unk_token) if t in self.target_encoder}
        self._split = _splitter(list(self.special_tokens))
        self.add_eos = True

    @staticmethod
    def _vocab(path: Path) -> dict[str, int]:
        if not path.is_file():
            raise UserError(f"'{path}' is missing: a Marian checkpoint needs its vocab.json")
        data = read_json(path)
        if not isinstance(data, dict) or not all(isinstance(v, int) for v in data.values()):
            raise UserError(f"'{path}' is not a token -> id vocabulary")
        return data

    def token_to_id(self, token: str) -> Optional[int]:
        return self.encoder.get(token)

    def id_to_token(self, idx: int) -> Optional[str]:
        return self.decoder.get(idx)

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def pad_id_or(self, default: int) -> int:
        return self.encoder.get(self.pad_token, default)

    def _pieces(self, text: str) -> list[str]:
        code: list[str] = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2 :]
        return code + self.source.encode(text, out_type=str)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        unk = self.encoder[self.unk_token]
        ids: list[int] = []
        parts = self._split.split(text) if self._split else [text]
        for i, part in enumerate(parts):
            if i % 2 == 1:
                ids.append(self.special_tokens[part])
            elif part:
                ids.extend(self.encoder.get(p, unk) for p in self._pieces(part))
        if add_special_tokens:
            ids.append(self.encoder[self.eos_token])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = ""
        run: list[str] = []
        for i in (int(x) for x in ids):
            token = self.decoder.get(i)
            if token is None:
                token = self.target.id_to_piece(i) if 0 <= i < self.target.get_piece_size() else self.unk_token
            if i in self._special_ids:
                if skip_special_tokens:
                    continue
                out += self.target.decode_pieces(run) + token + " "
                run = []
            else:
                run.append(token)
        out += self.target.decode_pieces(run)
        return out.replace(SPIECE_UNDERLINE, " ").strip()


def load_seq2seq_tokenizer(folder: Path, family: str) -> TextTokenizer:
    """The tokenizer of a T5, Marian or BART folder: ``tokenizer.json`` when present (T5, BART), else
    the family's own files (sentencepiece models; BART: GPT-2's vocab.json + merges.txt)."""
    folder = Path(folder)
    if folder.is_file():
        folder = folder.parent
    tok_config = read_json(folder / "tokenizer_config.json")
    for key, value in read_json(folder / "special_tokens_map.json").items():
        tok_config.setdefault(key, value)
    if family == "marian":
        if not (folder / "source.spm").is_file():
            raise UserError(f"no tokenizer in '{folder}': a Marian checkpoint needs source.spm, target.spm and vocab.json")
        return MarianTokenizer(folder, tok_config)
    if family == "bart":
        tok = load_tokenizer(folder)  # tokenizer.json, or GPT-2's vocab.json + merges.txt
        if not (folder / "tokenizer.json").is_file():  # BART writes <s> TEXT </s>
            tok.add_bos = tok.add_eos = True
        return tok
    if (folder / "tokenizer.json").is_file():
        return load_tokenizer(folder)
    if (folder / "spiece.model").is_file():
        return T5SentencePieceTokenizer(folder / "spiece.model", tok_config)
    raise UserError(f"no tokenizer in '{folder}': a T5 checkpoint needs tokenizer.json or spiece.model")
