"""The text conditioning of Stable Diffusion pipelines: prompts to the states the denoiser attends to.

One :class:`PromptEncoder` serves every family:

- **SD 1.x / 2.x**: one tokenizer and one ``CLIPTextModel`` (OpenAI CLIP ViT-L/14, or OpenCLIP
  ViT-H/14 less its last layer). The conditioning is the last hidden state after ``final_layer_norm``;
  with ``clip_skip = k`` the output ``k`` layers earlier, ``final_layer_norm`` applied
  (diffusers' ``clip_skip``: 1 = the penultimate layer, what other front ends call "clip skip 2").
- **SDXL**: two tokenizers and encoders, ``text_encoder`` (CLIP ViT-L/14) and ``text_encoder_2``
  (OpenCLIP ViT-bigG/14 with its projection). The conditioning is both encoders' penultimate hidden
  states (``hidden_states[-(2 + clip_skip)]``, no final norm) concatenated on the feature axis
  (768 + 1280 = 2048), plus the pooled, projected output of ``text_encoder_2`` (1280) for the UNet's
  ``text_embeds``. The refiner has only ``text_encoder_2``.

Prompts are padded to the tokenizer's 77 tokens with its pad token (read from the tokenizer files:
``<|endoftext|>`` for SD 1.x and SDXL's first tokenizer, ``"!"`` = id 0 for SD 2.x and SDXL's second)
and encoded without an attention mask, unless the encoder's config sets ``use_attention_mask``. Longer
prompts are truncated, the diffusers way, and each truncation comes back as a notice line for the
pipeline to show.

:meth:`PromptEncoder.encode_prompt` reproduces diffusers' ``StableDiffusionPipeline.encode_prompt`` and
``StableDiffusionXLPipeline.encode_prompt`` tensor for tensor, including two choices of theirs: the
negative prompt is encoded *without* clip skip, and an absent negative prompt of an SDXL pipeline whose
``force_zeros_for_empty_prompt`` is set conditions on zeros.

Loading (:func:`load_prompt_encoder`): a diffusers pipeline folder (``model_index.json``,
``text_encoder/``, ``tokenizer/``, ``text_encoder_2/``, ``tokenizer_2/``, optional ``variant`` weights
such as ``model.fp16.safetensors``) or a single-file original-layout checkpoint, whose text encoders are
found by their key prefixes, configured from their tensor shapes and the standard configs shipped in
:data:`gencli.models.clip.model.SD_TEXT_ENCODER_CONFIGS`, and tokenized with the CLIP vocabulary shipped with
gencli (single files carry no tokenizer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from gencli.backend.device import Placement
from gencli.checkpoints.formats import CheckpointSource, detect_architecture, open_source
from gencli.checkpoints.loader import load_model
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError, UserError
from gencli.models.clip.keymaps import (
    SD1_CLIP_PREFIX,
    SD2_OPEN_CLIP_PREFIX,
    SDXL_CLIP_PREFIX,
    SDXL_OPEN_CLIP_PREFIX,
    SDXL_REFINER_OPEN_CLIP_PREFIX,
    open_clip_keymap,
    original_clip_keymap,
)
from gencli.models.clip.model import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTextTransformer, sd_text_encoder_config
from gencli.pipelines.clip.loading import encode_layer, load_text_encoder, truncation_notice
from gencli.pipelines.diffusion.prompt_weighting import bracket_notice, empty_chunk, encode_chunks, tokenize_chunks
from gencli.tokenizers.clip_bpe import DEFAULT_CONTEXT, EOS, OPENAI_VOCAB_SIZE, CLIPTokenizer

Prompts = str | Sequence[str]


@dataclass
class PromptEmbeddings:
    """What the denoiser is conditioned on, one row per prompt.

    ``hidden_states (B, L, D)``: the cross-attention context (``encoder_hidden_states``), L = 77,
    D = 768 (SD 1.x), 1024 (SD 2.x) or 2048 (SDXL). ``pooled (B, D')``: SDXL's projected pooled output
    of ``text_encoder_2`` (the UNet's ``text_embeds``, D' = 1280); None for SD 1.x/2.x. ``notices``: one
    line per prompt that was truncated to the token window, for the pipeline to show.
    """

    hidden_states: torch.Tensor
    pooled: Optional[torch.Tensor] = None
    notices: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return self.hidden_states.shape[0]

    def repeat_interleave(self, n: int) -> "PromptEmbeddings":
        """Each row ``n`` times in a row (diffusers' ``num_images_per_prompt``)."""
        if n == 1:
            return self
        pooled = None if self.pooled is None else self.pooled.repeat_interleave(n, dim=0)
        return PromptEmbeddings(self.hidden_states.repeat_interleave(n, dim=0), pooled, list(self.notices))

    def zeros_like(self) -> "PromptEmbeddings":
        """All-zero conditioning of the same shapes (SDXL's ``force_zeros_for_empty_prompt``)."""
        pooled = None if self.pooled is None else torch.zeros_like(self.pooled)
        return PromptEmbeddings(torch.zeros_like(self.hidden_states), pooled)


@dataclass
class TextEncoderPart:
    """One tokenizer and its text encoder. ``name`` is the component's name (``text_encoder``,
    ``text_encoder_2``) in messages; ``use_attention_mask`` as the encoder config's field of that name."""

    encoder: CLIPTextTransformer | CLIPTextModelWithProjection
    tokenizer: CLIPTokenizer
    name: str = "text_encoder"
    use_attention_mask: bool = False

    def __post_init__(self) -> None:
        cfg = self.tower.config
        top = max(self.tokenizer.encoder.values())
        if top >= cfg.vocab_size:
            raise CheckpointError(f"{self.name}: its tokenizer has ids up to {top}, the text encoder only {cfg.vocab_size} token embeddings")
        if self.tokenizer.model_max_length > cfg.max_position_embeddings:
            raise CheckpointError(
                f"{self.name}: its tokenizer pads to {self.tokenizer.model_max_length} tokens, "
                f"the text encoder has only {cfg.max_position_embeddings} positions"
            )

    @property
    def tower(self) -> CLIPTextTransformer:
        return self.encoder.text_model if isinstance(self.encoder, CLIPTextModelWithProjection) else self.encoder

    @property
    def max_length(self) -> int:
        return self.tokenizer.model_max_length

    def tokenize(self, prompts: list[str], what: str) -> tuple[torch.Tensor, Optional[torch.Tensor], dict[int, str]]:
        """Ids padded to the full window (truncated with the end token kept), the attention mask if
        the encoder uses one, and a notice per truncated prompt (by index: what the truncation dropped)."""
        tok = self.tokenizer
        device = self.tower.final_layer_norm.weight.device
        ids, mask = tok(prompts, padding="max_length", max_length=self.max_length, truncation=True).tensors(device)
        notices = {}
        for i, text in enumerate(prompts):
            notice = truncation_notice(tok, text, self.max_length, what if len(prompts) == 1 else f"{what} {i + 1}")
            if notice:
                notices[i] = notice
        return ids, (mask if self.use_attention_mask else None), notices


def _as_list(prompts: Prompts) -> list[str]:
    return [prompts] if isinstance(prompts, str) else list(prompts)


class PromptEncoder:
    """The tokenizers and text encoders of a Stable Diffusion pipeline (see the module doc).

    ``text_encoder`` / ``text_encoder_2`` as diffusers names them; SDXL is the case with
    ``text_encoder_2``; an SDXL refiner has only ``text_encoder_2``.
    """

    def __init__(
        self,
        text_encoder: Optional[TextEncoderPart],
        text_encoder_2: Optional[TextEncoderPart] = None,
        *,
        force_zeros_for_empty_prompt: bool = False,
    ):
        self.parts = [p for p in (text_encoder, text_encoder_2) if p is not None]
        if not self.parts:
            raise CheckpointError("a Stable Diffusion pipeline needs a text encoder")
        self.text_encoder, self.text_encoder_2 = text_encoder, text_encoder_2
        self.force_zeros_for_empty_prompt = bool(force_zeros_for_empty_prompt)
        lengths = {p.max_length for p in self.parts}
        if len(lengths) > 1:
            raise CheckpointError(f"the two tokenizers pad to different lengths ({sorted(lengths)}): their states cannot be concatenated")

    # -- what it produces ---------------------------------------------------------------------
    @property
    def is_sdxl(self) -> bool:
        return self.text_encoder_2 is not None

    @property
    def max_length(self) -> int:
        """Tokens per prompt (77)."""
        return self.parts[0].max_length

    @property
    def hidden_size(self) -> int:
        """D of ``hidden_states``: the UNet's ``cross_attention_dim``."""
        return sum(p.tower.config.hidden_size for p in self.parts)

    @property
    def pooled_size(self) -> Optional[int]:
        """D' of ``pooled`` (SDXL's ``text_embeds``), None without ``text_encoder_2``."""
        return self.text_encoder_2.encoder.text_projection.out_features if self.is_sdxl else None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the embeddings (that of the last encoder, as diffusers casts them)."""
        return self.parts[-1].tower.dtype

    @property
    def num_layers(self) -> int:
        return min(p.tower.config.num_hidden_layers for p in self.parts)

    # -- encoding -----------------------------------------------------------------------------
    def chunk_count(self, prompt: str, *, weighting: bool = True) -> int:
        """How many 75-token chunks ``prompt`` takes (:mod:`gencli.pipelines.diffusion.prompt_weighting`)."""
        return max(len(tokenize_chunks(p.tokenizer, prompt, weighting=weighting)) for p in self.parts)

    def encode_prompts(
        self,
        prompts: Prompts,
        *,
        clip_skip: Optional[int] = None,
        prompts_2: Optional[Prompts] = None,
        what: str = "prompt",
        weighting: Optional[bool] = None,
        chunks: int = 0,
    ) -> PromptEmbeddings:
        """Conditioning for ``prompts`` (one row each).

        ``clip_skip`` (None or 0 = none; k >= 1 = k layers before the usual one) follows diffusers.
        SDXL: ``prompts_2`` goes to ``text_encoder_2`` (default: the same prompts). ``what`` names the
        prompts in truncation notices. ``weighting`` None: diffusers' encoding (one 77-token window,
        longer prompts truncated); True / False: A1111's chunked encoding of long prompts with / without
        its bracket weights (:mod:`~gencli.pipelines.diffusion.prompt_weighting`), at least ``chunks``
        chunks per row (shorter rows padded with the empty prompt's chunks).
        """
        texts = _as_list(prompts)
        if not texts:
            raise UserError("no prompts to encode")
        skip = int(clip_skip or 0)
        base = 1 if self.is_sdxl else 0  # SDXL starts from the penultimate layer
        if skip < 0 or base + skip >= self.num_layers:
            raise UserError(f"clip skip {skip} is out of range: the text encoder has {self.num_layers} layers (valid: 0 to {self.num_layers - 1 - base})")
        texts_2 = texts if prompts_2 is None else _as_list(prompts_2)
        if len(texts_2) != len(texts):
            raise UserError(f"{len(texts_2)} second prompts for {len(texts)} prompts")
        states, notices, pooled = [], {}, None
        if weighting is not None:
            return self._encode_chunked(texts, texts_2, skip=base + skip, weighting=weighting, chunks=chunks, what=what)
        # zip as diffusers does: a refiner's only encoder gets the first prompts
        for part, batch in zip(self.parts, (texts, texts_2)):
            ids, mask, cut = part.tokenize(batch, what)
            notices = {**cut, **notices}  # one notice per prompt (SDXL's two tokenizers cut alike)
            h, p = encode_layer(part.encoder, ids, skip=base + skip, final_norm=not self.is_sdxl, attention_mask=mask)
            states.append(h)
            if self.is_sdxl and part is self.text_encoder_2:
                pooled = p
        hidden = states[0] if len(states) == 1 else torch.cat([s.to(states[-1].device) for s in states], dim=-1)
        pooled = None if pooled is None else pooled.to(hidden.device, self.dtype)
        return PromptEmbeddings(hidden.to(self.dtype), pooled, [notices[i] for i in sorted(notices)])

    def _encode_chunked(self, texts: list[str], texts_2: list[str], *, skip: int, weighting: bool, chunks: int, what: str) -> PromptEmbeddings:
        states, pooled, notices = [], None, []
        if weighting:
            notices = [n for t in dict.fromkeys(texts + texts_2) if (n := bracket_notice(t))]
        for part, batch in zip(self.parts, (texts, texts_2)):
            rows = [tokenize_chunks(part.tokenizer, t, weighting=weighting) for t in batch]
            n = max(chunks, *(len(r) for r in rows))
            rows = [r + [empty_chunk(part.tokenizer)] * (n - len(r)) for r in rows]
            h, p = encode_chunks(part, rows, skip=skip, final_norm=not self.is_sdxl)
            states.append(h)
            if self.is_sdxl and part is self.text_encoder_2:
                pooled = p
        hidden = states[0] if len(states) == 1 else torch.cat([s.to(states[-1].device) for s in states], dim=-1)
        pooled = None if pooled is None else pooled.to(hidden.device, self.dtype)
        return PromptEmbeddings(hidden.to(self.dtype), pooled, notices)

    def encode_prompt(
        self,
        prompts: Prompts,
        negative_prompts: Optional[Prompts] = None,
        *,
        do_classifier_free_guidance: bool = True,
        clip_skip: Optional[int] = None,
        prompts_2: Optional[Prompts] = None,
        negative_prompts_2: Optional[Prompts] = None,
        weighting: Optional[bool] = None,
    ) -> tuple[PromptEmbeddings, Optional[PromptEmbeddings]]:
        """``(conditional, unconditional)`` exactly as diffusers' pipelines' ``encode_prompt``.

        The unconditional rows (None without guidance) encode ``negative_prompts`` (a string applies to
        every prompt; None = the empty prompt) without clip skip; an SDXL pipeline with
        ``force_zeros_for_empty_prompt`` conditions on zeros when ``negative_prompts`` is None.
        ``weighting`` (not None): A1111's chunked encoding (see :meth:`encode_prompts`), the
        conditional and unconditional rows padded to the same number of chunks.
        """
        texts = _as_list(prompts)
        texts_2 = texts if prompts_2 is None else _as_list(prompts_2)
        negative = _broadcast(negative_prompts or "", len(texts), "negative prompts")
        negative_2 = negative if not negative_prompts_2 else _broadcast(negative_prompts_2, len(texts), "second negative prompts")
        chunks = 0
        if weighting is not None:
            everything = texts + texts_2 + (negative + negative_2 if do_classifier_free_guidance else [])
            chunks = max(self.chunk_count(t, weighting=weighting) for t in everything)
        cond = self.encode_prompts(texts, clip_skip=clip_skip, prompts_2=prompts_2, weighting=weighting, chunks=chunks)
        if not do_classifier_free_guidance:
            return cond, None
        if negative_prompts is None and self.is_sdxl and self.force_zeros_for_empty_prompt:
            return cond, cond.zeros_like()
        return cond, self.encode_prompts(negative, prompts_2=negative_2, what="negative prompt", weighting=weighting, chunks=chunks)


def _broadcast(prompts: Prompts, n: int, what: str) -> list[str]:
    texts = [prompts] * n if isinstance(prompts, str) else list(prompts)
    if len(texts) != n:
        raise UserError(f"{len(texts)} {what} for {n} prompts")
    return texts


# -- loading ----------------------------------------------------------------------------------
def load_prompt_encoder(path: str | Path, placement: Placement, *, variant: Optional[str] = None, allow_pickle: bool = False) -> PromptEncoder:
    """The prompt encoder of a diffusers pipeline folder or of a single-file checkpoint."""
    src = open_source(path, allow_pickle=allow_pickle)
    if src.kind == "diffusers-pipeline":
        return prompt_encoder_from_pipeline_folder(src, placement, variant=variant)
    with TensorReader(src, allow_pickle=allow_pickle) as reader:
        return prompt_encoder_from_single_file(reader, placement)


def _has_component(index: dict, name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] is not None


def prompt_encoder_from_pipeline_folder(src: CheckpointSource, placement: Placement, *, variant: Optional[str] = None) -> PromptEncoder:
    """``text_encoder``/``tokenizer`` (and ``text_encoder_2``/``tokenizer_2``) of a diffusers pipeline
    folder, as its ``model_index.json`` lists them, with its ``force_zeros_for_empty_prompt``."""
    index = src.config or {}
    parts: dict[str, TextEncoderPart] = {}
    for enc_name, tok_name in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
        if not _has_component(index, enc_name):
            continue
        if not _has_component(index, tok_name):
            raise CheckpointError(f"'{src.path}' lists a {enc_name} but no {tok_name} in model_index.json")
        enc_src = src.sub(enc_name, variant=variant)
        encoder = load_text_encoder(enc_src, placement)
        tok_dir = src.folder / tok_name
        if not tok_dir.is_dir():
            raise CheckpointError(f"'{src.path}' has no '{tok_name}' component folder")
        tokenizer = CLIPTokenizer.from_folder(tok_dir)
        use_mask = bool((enc_src.config or {}).get("use_attention_mask", False))
        parts[enc_name] = TextEncoderPart(encoder, tokenizer, enc_name, use_mask)
    if not parts:
        raise CheckpointError(f"'{src.path}' has no text_encoder component (model_index.json lists none)")
    is_xl = "text_encoder_2" in parts
    return PromptEncoder(
        parts.get("text_encoder"), parts.get("text_encoder_2"), force_zeros_for_empty_prompt=bool(index.get("force_zeros_for_empty_prompt", is_xl))
    )


@dataclass(frozen=True)
class OriginalTextEncoder:
    """Where and what a text encoder is in a single-file checkpoint."""

    prefix: str
    open_clip: bool  # OpenCLIP naming (else transformers' naming, OpenAI CLIP)
    standard: str  # its entry in SD_TEXT_ENCODER_CONFIGS
    pad_token: str  # what its diffusers tokenizer pads with
    with_projection: bool = False  # a CLIPTextModelWithProjection (SDXL's text_encoder_2)
    penultimate: bool = False  # SD 2.x: the last residual block is not used


SD1_TEXT_ENCODER = OriginalTextEncoder(SD1_CLIP_PREFIX, False, "clip-vit-large-patch14", EOS)
SD2_TEXT_ENCODER = OriginalTextEncoder(SD2_OPEN_CLIP_PREFIX, True, "open-clip-vit-h-14-penultimate", "!", penultimate=True)
SDXL_TEXT_ENCODER = OriginalTextEncoder(SDXL_CLIP_PREFIX, False, "clip-vit-large-patch14", EOS)
SDXL_TEXT_ENCODER_2 = OriginalTextEncoder(SDXL_OPEN_CLIP_PREFIX, True, "open-clip-vit-bigg-14", "!", with_projection=True)
SDXL_REFINER_TEXT_ENCODER_2 = OriginalTextEncoder(SDXL_REFINER_OPEN_CLIP_PREFIX, True, "open-clip-vit-bigg-14", "!", with_projection=True)


def original_text_encoders(keys: set[str] | Sequence[str]) -> tuple[Optional[OriginalTextEncoder], Optional[OriginalTextEncoder], bool]:
    """``(text_encoder, text_encoder_2, force_zeros_for_empty_prompt)`` of a single-file checkpoint
    from its key names, or ``(None, None, False)`` when it holds no known text encoder."""

    def has(prefix: str) -> bool:
        return any(k.startswith(prefix) for k in keys)

    if has(SDXL_CLIP_PREFIX) or has(SDXL_OPEN_CLIP_PREFIX):
        for prefix in (SDXL_CLIP_PREFIX, SDXL_OPEN_CLIP_PREFIX):
            if not has(prefix):
                raise CheckpointError(f"an SDXL checkpoint without its {'second' if prefix == SDXL_OPEN_CLIP_PREFIX else 'first'} text encoder ({prefix}*)")
        return SDXL_TEXT_ENCODER, SDXL_TEXT_ENCODER_2, True
    if has(SDXL_REFINER_OPEN_CLIP_PREFIX):
        return None, SDXL_REFINER_TEXT_ENCODER_2, False
    if has(SD2_OPEN_CLIP_PREFIX):
        return SD2_TEXT_ENCODER, None, False
    if has(SD1_CLIP_PREFIX):
        return SD1_TEXT_ENCODER, None, False
    return None, None, False


def _layer_count(keys: list[str], pattern: str, where: str) -> int:
    found = sorted({int(m.group(1)) for k in keys if (m := re.match(pattern, k))})
    if not found or found != list(range(len(found))):
        raise CheckpointError(f"{where}: its layers are not numbered 0..N-1 (found {found[:4]}{'...' if len(found) > 4 else ''})")
    return len(found)


def original_text_encoder_config(reader: TensorReader, spec: OriginalTextEncoder) -> CLIPTextConfig:
    """The :class:`~gencli.models.clip.model.CLIPTextConfig` of a single file's text encoder: widths, depth,
    vocabulary and context from its tensor shapes (64-wide attention heads, as every CLIP text tower),
    the rest from the standard config."""
    where = f"'{reader.source.path}': the text encoder under '{spec.prefix}'"
    keys = [k for k in reader.keys() if k.startswith(spec.prefix)]

    def shape(name: str) -> tuple[int, ...]:
        if name not in reader:
            raise CheckpointError(f"{where} has no '{name}' tensor")
        return tuple(reader.shape(name))

    p = re.escape(spec.prefix)
    if spec.open_clip:
        token, position = shape(spec.prefix + "token_embedding.weight"), shape(spec.prefix + "positional_embedding")
        layers = _layer_count(keys, rf"{p}transformer\.resblocks\.(\d+)\.", where)
        inner = shape(spec.prefix + "transformer.resblocks.0.mlp.c_fc.weight")
        projection = shape(spec.prefix + "text_projection")[-1] if spec.with_projection else None
    else:
        nest = "text_model." if spec.prefix + "text_model.embeddings.token_embedding.weight" in reader else ""
        base = spec.prefix + nest
        token, position = shape(base + "embeddings.token_embedding.weight"), shape(base + "embeddings.position_embedding.weight")
        layers = _layer_count(keys, rf"{re.escape(base)}encoder\.layers\.(\d+)\.", where)
        inner = shape(base + "encoder.layers.0.mlp.fc1.weight")
        projection = None
    if len(token) != 2 or len(position) != 2 or token[1] != position[1]:
        raise CheckpointError(f"{where} has token embeddings {list(token)} and position embeddings {list(position)} of different widths")
    width = token[1]
    if width % 64:
        raise CheckpointError(f"{where} is {width} wide, not a multiple of CLIP's 64-wide attention heads")
    if spec.penultimate:
        if layers < 2:
            raise CheckpointError(f"{where} has {layers} layer; SD 2.x conditions on the penultimate one")
        layers -= 1
    overrides = dict(
        vocab_size=token[0], hidden_size=width, intermediate_size=inner[0], num_hidden_layers=layers,
        num_attention_heads=width // 64, max_position_embeddings=position[0],
    )  # fmt: skip
    if projection is not None:
        overrides["projection_dim"] = projection
    return sd_text_encoder_config(spec.standard, **overrides)


def load_original_text_encoder(
    reader: TensorReader, spec: OriginalTextEncoder, placement: Placement, config: Optional[CLIPTextConfig] = None
) -> CLIPTextTransformer | CLIPTextModelWithProjection:
    """One text encoder of a single-file checkpoint, mapped by :mod:`gencli.models.clip.keymaps`
    (``config``: :func:`original_text_encoder_config`'s, computed when not given)."""
    cfg = config or original_text_encoder_config(reader, spec)
    if spec.open_clip:
        keymap = open_clip_keymap(spec.prefix, with_projection=spec.with_projection, num_layers=cfg.num_hidden_layers if spec.penultimate else None)
    else:
        keymap = original_clip_keymap(spec.prefix)
    factory = (lambda: CLIPTextModelWithProjection(cfg)) if spec.with_projection else (lambda: CLIPTextTransformer(cfg))
    return load_model(factory, reader, keymap, device=placement.device, dtype=placement.dtype)


def prompt_encoder_from_single_file(reader: TensorReader, placement: Placement) -> PromptEncoder:
    """The text encoders of an original-layout SD 1.x / 2.x / SDXL checkpoint, with tokenizers built
    from the CLIP vocabulary shipped with gencli."""
    keys = set(reader.keys())
    path = reader.source.path
    try:
        first, second, force_zeros = original_text_encoders(keys)
    except CheckpointError as exc:
        raise CheckpointError(f"'{path}' is {exc}") from None
    if first is None and second is None:
        looks = detect_architecture(reader.source, keys) if not reader.source.is_pickle else None
        hint = f" (it looks like {looks})" if looks else ""
        raise CheckpointError(
            f"'{path}' holds no Stable Diffusion text encoder{hint}: expected cond_stage_model.* (SD 1.x/2.x) or conditioner.embedders.* (SDXL) tensors"
        )
    parts: list[Optional[TextEncoderPart]] = []
    for spec, name in ((first, "text_encoder"), (second, "text_encoder_2")):
        if spec is None:
            parts.append(None)
            continue
        cfg = original_text_encoder_config(reader, spec)
        if cfg.vocab_size < OPENAI_VOCAB_SIZE:
            raise CheckpointError(
                f"'{path}': the text encoder under '{spec.prefix}' has {cfg.vocab_size} token embeddings, the CLIP vocabulary {OPENAI_VOCAB_SIZE}"
            )
        encoder = load_original_text_encoder(reader, spec, placement, cfg)
        tokenizer = CLIPTokenizer.from_openai_bpe(pad_token=spec.pad_token, model_max_length=min(DEFAULT_CONTEXT, cfg.max_position_embeddings))
        parts.append(TextEncoderPart(encoder, tokenizer, name))
    return PromptEncoder(parts[0], parts[1], force_zeros_for_empty_prompt=force_zeros)


__all__ = [
    "PromptEmbeddings",
    "PromptEncoder",
    "TextEncoderPart",
    "OriginalTextEncoder",
    "load_prompt_encoder",
    "prompt_encoder_from_pipeline_folder",
    "prompt_encoder_from_single_file",
    "original_text_encoders",
    "original_text_encoder_config",
    "load_original_text_encoder",
]
