"""Tokenizers of text-generation checkpoints, found in a model folder the way the hub's tooling does.

- ``tokenizer.json`` (any model: Llama 3, Qwen2, Mistral, GPT-2 ...) through the ``tokenizers`` library;
- ``tokenizer.model`` (Llama 2, Mistral v0.1, and gencli's embedded default) through sentencepiece;
- GPT-2's ``vocab.json`` + ``merges.txt`` (byte-level BPE) through the ``tokenizers`` library.

Special tokens (BOS/EOS/PAD/UNK and added tokens such as ``<|im_start|>``) come from
``tokenizer_config.json`` / ``special_tokens_map.json``; whether a BOS is prepended follows
``add_bos_token`` (or, for ``tokenizer.json``, the file's own post-processor). Special tokens written
in the text (as chat templates do) are encoded as those tokens, never spelled out as characters.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Sequence

from gencli.errors import UserError
from gencli.io import read_json as _read_json

TOKENIZER_FILES = "tokenizer.json, tokenizer.model, or vocab.json + merges.txt"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a checkpoint's side file; {} when the file is absent."""
    return _read_json(path, missing_ok=True) or {}


def _token_text(value: Any) -> Optional[str]:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class TextTokenizer:
    """The interface generation needs; subclasses implement ``_encode_plain``, ``_decode`` and lookups."""

    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    pad_token: Optional[str] = None
    unk_token: Optional[str] = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: Optional[str] = None
    kind: str = ""

    def __init__(self, folder: Optional[Path], tok_config: dict[str, Any]):
        self.folder = folder
        self.config = tok_config
        for name in ("bos", "eos", "pad", "unk"):
            setattr(self, f"{name}_token", _token_text(tok_config.get(f"{name}_token")))
        self.special_tokens: dict[str, int] = {}

    # -- lookups ----------------------------------------------------------------------------------
    def token_to_id(self, token: str) -> Optional[int]:
        raise NotImplementedError

    def id_to_token(self, idx: int) -> Optional[str]:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def _id_of(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self.token_to_id(token)

    @property
    def bos_id(self) -> Optional[int]:
        return self._id_of(self.bos_token)

    @property
    def eos_id(self) -> Optional[int]:
        return self._id_of(self.eos_token)

    @property
    def pad_id(self) -> Optional[int]:
        return self._id_of(self.pad_token)

    # -- encoding -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS (and EOS) the tokenizer adds."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def special_token_map(self) -> dict[str, str]:
        """Special tokens by role, as chat templates refer to them (``bos_token``, ``eos_token`` ...)."""
        return {f"{k}_token": v for k in ("bos", "eos", "pad", "unk") if (v := getattr(self, f"{k}_token"))}


class SentencePieceTokenizer(TextTokenizer):
    """``tokenizer.model`` through the sentencepiece library (HF ``LlamaTokenizer`` semantics)."""

    kind = "sentencepiece"

    def __init__(self, model_file: Path, tok_config: dict[str, Any]):
        import sentencepiece as spm

        super().__init__(model_file.parent, tok_config)
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(model_file))
        except (OSError, RuntimeError) as exc:
            raise UserError(f"'{model_file}' is not a sentencepiece model: {str(exc).splitlines()[0]}") from None
        # fall back on the model's own control symbols
        if self.bos_token is None and self.sp.bos_id() >= 0:
            self.bos_token = self.sp.id_to_piece(self.sp.bos_id())
        if self.eos_token is None and self.sp.eos_id() >= 0:
            self.eos_token = self.sp.id_to_piece(self.sp.eos_id())
        if self.unk_token is None and self.sp.unk_id() >= 0:
            self.unk_token = self.sp.id_to_piece(self.sp.unk_id())
        self.add_bos = bool(tok_config.get("add_bos_token", True))
        self.add_eos = bool(tok_config.get("add_eos_token", False))
        # tokens written literally in text that must encode as one id: the control symbols plus any
        # added tokens the config declares
        specials: dict[str, int] = {}
        for tok in (self.bos_token, self.eos_token, self.unk_token, self.pad_token):
            if tok is not None:
                idx = self.token_to_id(tok)
                if idx is not None:
                    specials[tok] = idx
        for idx, spec in (tok_config.get("added_tokens_decoder") or {}).items():
            text = _token_text(spec)
            if text is not None:
                specials[text] = int(idx)
        self.special_tokens = specials
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")") if specials else None
        self._special_ids = set(specials.values())

    def token_to_id(self, token: str) -> Optional[int]:
        if token in self.special_tokens:
            return self.special_tokens[token]
        idx = self.sp.piece_to_id(token)
        return None if idx == self.sp.unk_id() and token != self.unk_token else idx

    def id_to_token(self, idx: int) -> Optional[str]:
        return self.sp.id_to_piece(idx) if 0 <= idx < self.sp.get_piece_size() else None

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        parts = self._split.split(text) if self._split else [text]
        for i, part in enumerate(parts):
            if not part:
                continue
            if i % 2 == 1:  # a special token written in the text
                ids.append(self.special_tokens[part])
            else:
                ids.extend(self.sp.encode(part))
        if add_special_tokens:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids and not self.sp.is_control(i)]
            return self.sp.decode(ids)
        # keep special tokens as their text, decoding the runs between them
        out, run = [], []
        for i in ids:
            if i in self._special_ids or self.sp.is_control(i):
                out.append(self.sp.decode(run))
                run = []
                out.append(self.id_to_token(i) or "")
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)


class HFTokenizer(TextTokenizer):
    """``tokenizer.json`` (or GPT-2's vocab.json + merges.txt) through the ``tokenizers`` library."""

    kind = "tokenizers"

    def __init__(self, tok: Any, folder: Optional[Path], tok_config: dict[str, Any], *, add_bos: Optional[bool] = None):
        super().__init__(folder, tok_config)
        self.tok = tok
        self.special_tokens = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        # When the file's post-processor does not add the BOS, honour add_bos_token from the config
        # (as transformers' fast tokenizers do); never add it twice.
        probe = tok.encode("a", add_special_tokens=True).ids
        bare = tok.encode("a", add_special_tokens=False).ids
        self._post_adds_bos = len(probe) > len(bare) and self.bos_id is not None and probe[0] == self.bos_id
        want = tok_config.get("add_bos_token") if add_bos is None else add_bos
        self.add_bos = self._post_adds_bos or bool(want)
        self.add_eos = bool(tok_config.get("add_eos_token", False))

    def token_to_id(self, token: str) -> Optional[int]:
        return self.tok.token_to_id(token)

    def id_to_token(self, idx: int) -> Optional[str]:
        return self.tok.id_to_token(idx)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens:
            if self.add_bos and not self._post_adds_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _gpt2_bpe(vocab: Path, merges: Path) -> Any:
    """GPT-2's byte-level BPE from its two files (what transformers' GPT2Tokenizer builds)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    try:
        tok = Tokenizer(BPE.from_file(str(vocab), str(merges)))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exceptions for bad files
        raise UserError(f"cannot read the GPT-2 tokenizer files in '{vocab.parent}': {exc}") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def load_tokenizer(folder: Path) -> TextTokenizer:
    """The tokenizer of a model folder (see the module doc for the order of preference)."""
    folder = Path(folder)
    if folder.is_file():
        folder = folder.parent
    tok_config = read_json(folder / "tokenizer_config.json")
    for key, value in read_json(folder / "special_tokens_map.json").items():
        tok_config.setdefault(key, value)
    tokenizer: TextTokenizer
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"cannot read '{folder / 'tokenizer.json'}': {str(exc).splitlines()[0]}") from None
        tokenizer = HFTokenizer(tok, folder, tok_config)
    elif (folder / "tokenizer.model").is_file():
        tokenizer = SentencePieceTokenizer(folder / "tokenizer.model", tok_config)
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        tok = _gpt2_bpe(folder / "vocab.json", folder / "merges.txt")
        for key in ("bos_token", "eos_token", "unk_token"):
            tok_config.setdefault(key, "<|endoftext|>")
        specials = sorted(
            {t for t in (_token_text(tok_config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")) if t and tok.token_to_id(t) is not None}
        )
        if specials:
            tok.add_special_tokens(specials)
        tokenizer = HFTokenizer(tok, folder, tok_config, add_bos=bool(tok_config.get("add_bos_token", False)))
    else:
        raise UserError(f"no tokenizer in '{folder}': expected {TOKENIZER_FILES}")
    tokenizer.chat_template = _chat_template(folder, tok_config)
    return tokenizer


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> Optional[str]:
    """The checkpoint's default chat template: ``chat_template.jinja``, ``chat_template.json`` or the
    ``chat_template`` entry of tokenizer_config.json (a string, or a list of named templates)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template: Any = read_json(folder / "chat_template.json").get("chat_template") or tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template.strip() else None
