"""Textual-inversion embeddings: new words whose token embeddings were learned for a concept.

``--embedding FILE[:TOKEN]`` (repeatable) and ``--embeddings-dir DIR`` (every ``.safetensors`` file
there whose stem the prompts use as a word, ``<lora:...>`` tags aside). The token is the file's stem unless given. Formats:

- A1111's: ``emb_params`` ``(n, D)`` in a ``.safetensors`` file; the older ``.pt`` files
  (``string_to_param: {"*": (n, D)}``) only under ``--allow-pickle``, read with
  ``torch.load(weights_only=True)``;
- diffusers' (``learned_embeds.safetensors``): one key, the token it was trained as, ``(D,)`` or
  ``(n, D)``; the token is the stem all the same unless ``FILE:TOKEN`` says otherwise;
- SDXL's: ``clip_l`` ``(n, 768)`` for ``text_encoder`` and ``clip_g`` ``(n, 1280)`` for ``text_encoder_2``.

Loading is diffusers' ``load_textual_inversion``: each of the ``n`` vectors becomes a new token of
the tokenizer (``TOKEN``, ``TOKEN_1``, ..., ``TOKEN_{n-1}``, matched in the raw text before the BPE as
special tokens are), the text encoder's token embedding grows by those rows, and a prompt's ``TOKEN``
is written out as ``TOKEN TOKEN_1 ... TOKEN_{n-1}`` before it is tokenized (:func:`expand_prompt`).
An embedding of another width than the encoder's (another base), a token the tokenizer already has,
or a file that is not an embedding is a one-line error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from gencli.errors import CheckpointError, UserError

if TYPE_CHECKING:
    import torch

    from gencli.pipelines.diffusion.prompt_encoding import PromptEncoder, TextEncoderPart

PICKLE_SUFFIXES = (".pt", ".bin")


@dataclass(frozen=True)
class EmbeddingSpec:
    path: Path
    token: str


def parse_embedding_option(text: str) -> EmbeddingSpec:
    """``FILE`` or ``FILE:TOKEN`` (``--embedding``)."""
    path = Path(text).expanduser()
    token = None
    if not path.exists() and ":" in text:
        head, tail = text.rsplit(":", 1)
        path, token = Path(head).expanduser(), tail.strip()
    if not path.is_file():
        raise UserError(f"--embedding '{path}' does not exist")
    token = token or path.stem
    if not token or any(c.isspace() for c in token):
        raise UserError(f"--embedding {text!r}: the token {token!r} must be one word")
    return EmbeddingSpec(path, token)


def run_embeddings(
    flags: Sequence[str], directory: Optional[str | Path], prompts: Iterable[Optional[str]], *, allow_pickle: bool = False
) -> list[EmbeddingSpec]:
    """``--embedding`` values, and the files of ``--embeddings-dir`` whose stem a prompt uses."""
    specs = [parse_embedding_option(t) for t in flags]
    if directory is not None:
        folder = Path(directory).expanduser()
        if not folder.is_dir():
            raise UserError(f"--embeddings-dir '{folder}' is not a folder")
        from gencli.pipelines.diffusion.lora import strip_lora_tags

        text = "\n".join(strip_lora_tags(p) for p in prompts if p)
        taken = {s.token for s in specs}
        suffixes = (".safetensors",) + (PICKLE_SUFFIXES if allow_pickle else ())
        for f in sorted(p for p in folder.rglob("*") if p.suffix in suffixes and p.is_file()):
            if f.stem not in taken and re.search(rf"(?<!\w){re.escape(f.stem)}(?!\w)", text):
                specs.append(EmbeddingSpec(f, f.stem))
                taken.add(f.stem)
    return specs


def read_embedding(path: Path, *, allow_pickle: bool = False) -> dict[str, "torch.Tensor"]:
    """``{"": (n, D)}`` for one encoder, or SDXL's ``{"clip_l": ..., "clip_g": ...}``."""
    import torch

    if path.suffix in PICKLE_SUFFIXES or path.suffix == ".ckpt":
        if not allow_pickle:
            raise CheckpointError(f"embedding '{path}' is a pickle file: refused (pass --allow-pickle to load it with torch.load(weights_only=True))")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
            raise CheckpointError(f"embedding '{path}' cannot be read: {str(exc).splitlines()[0]}") from None
    else:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"embedding '{path}' is not a readable safetensors file (truncated or damaged?): {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"embedding '{path}' does not hold a dict of tensors")
    if "clip_l" in state or "clip_g" in state:
        vectors = {k: state[k] for k in ("clip_l", "clip_g") if k in state}
    elif "emb_params" in state:
        vectors = {"": state["emb_params"]}
    elif isinstance(state.get("string_to_param"), dict) and "*" in state["string_to_param"]:
        vectors = {"": state["string_to_param"]["*"]}
    elif len(state) == 1:
        vectors = {"": next(iter(state.values()))}
    else:
        keys = ", ".join(list(state)[:3])
        raise CheckpointError(f"'{path}' is not a textual-inversion embedding (no emb_params, string_to_param, clip_l/clip_g or single token; keys: {keys})")
    out = {}
    for k, v in vectors.items():
        if not isinstance(v, torch.Tensor) or v.ndim not in (1, 2) or v.numel() == 0:
            raise CheckpointError(f"embedding '{path}': '{k or 'the vectors'}' is not a (vectors, width) tensor")
        out[k] = v.reshape(1, -1) if v.ndim == 1 else v
    return out


@dataclass
class LoadedEmbedding:
    spec: EmbeddingSpec
    vectors: int

    @property
    def hash(self) -> str:
        """A1111's short hash of an embedding (its ``TI hashes``): SHA-256 of the file, 12 hex digits."""
        from gencli.pipelines.diffusion.png_parameters import files_hash

        return files_hash([self.spec.path], length=12)

    @property
    def tokens(self) -> list[str]:
        return [self.spec.token] + [f"{self.spec.token}_{i}" for i in range(1, self.vectors)]


def _add_tokens(part: "TextEncoderPart", tokens: list[str], vectors: "torch.Tensor", path: Path) -> None:
    import torch

    tok, tower = part.tokenizer, part.tower
    emb = tower.embeddings.token_embedding
    width = emb.weight.shape[1]
    if vectors.shape[1] != width:
        raise CheckpointError(f"embedding '{path}' has {vectors.shape[1]}-wide vectors, {part.name} takes {width} (an embedding for another base model?)")
    for t in tokens:
        if t in tok.encoder:
            raise UserError(f"embedding '{path}': the token '{t}' is already in the tokenizer's vocabulary: name another with --embedding FILE:TOKEN")
    start = emb.weight.shape[0]
    grown = torch.nn.Embedding(start + len(tokens), width, device=emb.weight.device, dtype=emb.weight.dtype)
    with torch.no_grad():
        grown.weight[:start] = emb.weight
        grown.weight[start:] = vectors.to(emb.weight.device, emb.weight.dtype)
    tower.embeddings.token_embedding = grown
    for i, t in enumerate(tokens):
        tok.encoder[t] = start + i
        tok.decoder[start + i] = t
    tok.specials = sorted({*tok.specials, *tokens}, key=len, reverse=True)
    tok._cache.clear()
    try:
        tower.config.vocab_size = start + len(tokens)
    except AttributeError:  # a frozen config: the embedding's size is what counts
        pass


def apply_embeddings(encoder: "PromptEncoder", specs: Sequence[EmbeddingSpec], *, allow_pickle: bool = False) -> list[LoadedEmbedding]:
    """Add each embedding's tokens to the tokenizer(s) and text encoder(s) (see the module doc)."""
    loaded = []
    seen: set[str] = set()
    for spec in specs:
        if spec.token in seen:
            raise UserError(f"two embeddings use the token '{spec.token}'")
        seen.add(spec.token)
        vectors = read_embedding(spec.path, allow_pickle=allow_pickle)
        if encoder.is_sdxl:
            if set(vectors) != {"clip_l", "clip_g"} or encoder.text_encoder is None:
                raise CheckpointError(f"embedding '{spec.path}' is not an SDXL embedding (clip_l and clip_g), this model is SDXL")
            if vectors["clip_l"].shape[0] != vectors["clip_g"].shape[0]:
                raise CheckpointError(f"embedding '{spec.path}': clip_l and clip_g have different numbers of vectors")
            targets = [(encoder.text_encoder, vectors["clip_l"]), (encoder.text_encoder_2, vectors["clip_g"])]
        else:
            if "" not in vectors:
                raise CheckpointError(f"embedding '{spec.path}' is an SDXL embedding (clip_l/clip_g), this model is not SDXL")
            targets = [(encoder.text_encoder, vectors[""])]
        n = targets[0][1].shape[0]
        item = LoadedEmbedding(spec, n)
        for part, v in targets:
            _add_tokens(part, item.tokens, v.float(), spec.path)
        loaded.append(item)
    return loaded


def ti_hashes_text(embeddings: Sequence[LoadedEmbedding]) -> str:
    """A1111's ``TI hashes`` value: ``token: hash, ...``."""
    return ", ".join(f"{e.spec.token.replace(':', '').replace(',', '')}: {e.hash}" for e in embeddings)


def expand_prompt(prompt: str, embeddings: Sequence[LoadedEmbedding]) -> str:
    """A multi-vector embedding's token written out as its ``n`` tokens (diffusers' ``maybe_convert_prompt``)."""
    for e in embeddings:
        if e.vectors > 1 and e.spec.token in prompt:
            prompt = prompt.replace(e.spec.token, " ".join(e.tokens))
    return prompt


__all__ = [
    "EmbeddingSpec",
    "LoadedEmbedding",
    "parse_embedding_option",
    "run_embeddings",
    "read_embedding",
    "apply_embeddings",
    "expand_prompt",
    "ti_hashes_text",
]
