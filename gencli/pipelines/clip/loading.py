"""Loading CLIP checkpoints, and the text/image encoding both CLIP commands (and the text-to-image
family's conditioning) build on.

``load_clip(path)`` reads a transformers ``CLIPModel`` folder (or its ``model.safetensors``): config,
weights (memory-mapped, straight into the target dtype), BPE tokenizer and ``preprocessor_config.json``.
``load_text_encoder(path)`` loads a text tower alone (``CLIPTextModel`` /
``CLIPTextModelWithProjection`` folders, e.g. a diffusers pipeline's ``text_encoder``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from gencli.backend.device import Placement
from gencli.checkpoints.formats import CheckpointSource, open_source, with_article, wrong_family
from gencli.checkpoints.loader import load_model
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError, UserError
from gencli.models.clip.keymaps import CLIP_MODEL, CLIP_TEXT_TOWER, CLIP_TEXT_WITH_PROJECTION
from gencli.models.clip.model import (
    CLIPConfig,
    CLIPModel,
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTextTransformer,
    l2_normalize,
)
from gencli.tokenizers.clip_bpe import CLIPTokenizer

# Kept in fp32 whatever the compute dtype: the temperature is exponentiated.
KEEP_FP32 = (r"^logit_scale$",)


def _config(src: CheckpointSource) -> dict[str, Any]:
    if not src.config:
        raise UserError(f"'{src.path}' has no config.json next to its weights: a CLIP checkpoint needs one")
    return src.config


def _architecture(cfg: dict[str, Any], keys: set[str]) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        return str(archs[0])
    if cfg.get("model_type") == "clip" or ("text_config" in cfg and "vision_config" in cfg):
        return "CLIPModel"
    if "text_projection.weight" in keys:
        return "CLIPTextModelWithProjection"
    if cfg.get("model_type") == "clip_text_model":
        return "CLIPTextModel"
    return str(cfg.get("model_type") or "unknown")


def _tokenizer_folder(src: CheckpointSource) -> Optional[Path]:
    """Where the tokenizer files are: the model folder, or a ``tokenizer/`` folder beside it (diffusers)."""
    folder = src.folder or src.path.parent
    for cand in (folder, folder.parent / "tokenizer"):
        if (cand / "vocab.json").is_file() or (cand / "tokenizer.json").is_file():
            return cand
    return None


@dataclass
class ClipBundle:
    """A loaded CLIP: model, tokenizer, image preprocessing and where it runs."""

    model: CLIPModel
    tokenizer: CLIPTokenizer
    processor: Any  # gencli.pipelines.vision.images.ImageProcessor
    placement: Placement
    path: Path

    # -- encoding -----------------------------------------------------------------------------
    @property
    def text_context(self) -> int:
        """The token window of the text tower (77 for CLIP), start and end tokens included."""
        return min(self.tokenizer.model_max_length, self.model.config.text_config.max_position_embeddings)

    @torch.inference_mode()
    def encode_texts(self, texts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
        """L2-normalised text embeddings ``(N, projection_dim)`` in fp32 (on the model's device)."""
        out = []
        context = self.text_context
        for start in range(0, len(texts), batch_size):
            ids, mask = self.tokenizer(list(texts[start : start + batch_size]), max_length=context).tensors(self.placement.device)
            out.append(l2_normalize(self.model.get_text_features(ids, mask)))
        if not out:
            return torch.empty(0, self.model.config.projection_dim, device=self.placement.device)
        return torch.cat(out)

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected, unnormalised image embeddings ``(N, projection_dim)`` for preprocessed pixels of one
        size; a size other than the tower's (a processor without center crop) interpolates the
        position embeddings, as transformers' ``interpolate_pos_encoding=True`` does."""
        pixel_values = pixel_values.to(self.placement.device, self.placement.dtype)
        size = self.model.config.vision_config.image_size
        return self.model.get_image_features(pixel_values, interpolate_pos_encoding=tuple(pixel_values.shape[-2:]) != (size, size))

    def encode_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """L2-normalised image embeddings ``(N, projection_dim)`` in fp32 for preprocessed pixels."""
        return l2_normalize(self.image_features(pixel_values))

    def temperature(self) -> float:
        """``exp(logit_scale)``: the multiplier of cosine similarities in the logits."""
        with torch.no_grad():
            return float(self.model.temperature())


def _open(path: str | Path | CheckpointSource, allow_pickle: bool, variant: Optional[str] = None) -> tuple[CheckpointSource, dict[str, Any], TensorReader, str]:
    src = path if isinstance(path, CheckpointSource) else open_source(path, allow_pickle=allow_pickle, variant=variant)
    if src.kind == "diffusers-pipeline":
        raise UserError(f"'{src.path}' is a diffusers pipeline folder: point --model at its text_encoder, or at a CLIP model")
    cfg = _config(src)
    reader = TensorReader(src, allow_pickle=allow_pickle)
    return src, cfg, reader, _architecture(cfg, set(reader.keys()))


def load_clip_model(path: str | Path, placement: Placement, *, allow_pickle: bool = False) -> CLIPModel:
    """The ``CLIPModel`` of a checkpoint folder or file, in ``placement``'s device and dtype
    (``logit_scale`` stays fp32)."""
    src, cfg, reader, arch = _open(path, allow_pickle)
    if arch != "CLIPModel":
        raise wrong_family(src, "an image-text model", "image-text matching needs a CLIPModel (both towers)")
    try:
        config = CLIPConfig.from_dict(cfg)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"'{src.path}': config.json does not describe a CLIP model: {exc}") from None
    with reader:
        return load_model(
            lambda: CLIPModel(config), reader, CLIP_MODEL, device=placement.device, dtype=placement.dtype, keep_fp32=KEEP_FP32, config=cfg
        )


def load_clip(path: str | Path, placement: Placement, *, allow_pickle: bool = False, processor_factory=None) -> ClipBundle:
    """A ``CLIPModel`` with its tokenizer and image preprocessing (``processor_factory(folder, image_size)``)."""
    model = load_clip_model(path, placement, allow_pickle=allow_pickle)
    src = open_source(path, allow_pickle=allow_pickle)
    tok_dir = _tokenizer_folder(src)
    if tok_dir is None:
        raise UserError(f"no tokenizer next to '{src.path}': a CLIP checkpoint needs vocab.json and merges.txt (or tokenizer.json)")
    tokenizer = CLIPTokenizer.from_folder(tok_dir)
    text_cfg = model.config.text_config
    if max(tokenizer.encoder.values()) >= text_cfg.vocab_size:
        raise CheckpointError(
            f"the tokenizer in '{tok_dir}' has ids up to {max(tokenizer.encoder.values())}, the text model only {text_cfg.vocab_size} embeddings"
        )
    processor = processor_factory(src.folder or src.path.parent, model.config.vision_config.image_size) if processor_factory else None
    return ClipBundle(model, tokenizer, processor, placement, src.path)


def load_text_encoder(
    path: str | Path | CheckpointSource,
    placement: Placement,
    *,
    allow_pickle: bool = False,
    variant: Optional[str] = None,
) -> CLIPTextTransformer | CLIPTextModelWithProjection:
    """The text tower alone, from a ``CLIPTextModel``, ``CLIPTextModelWithProjection`` or ``CLIPModel``
    checkpoint (a diffusers ``text_encoder`` folder, for instance; ``variant="fp16"`` reads its
    ``model.fp16.safetensors``).

    Returns a :class:`CLIPTextTransformer` (call it for hidden states and the pooled output), or a
    :class:`CLIPTextModelWithProjection` when the checkpoint has the projection.
    """
    src, cfg, reader, arch = _open(path, allow_pickle, variant)
    dev, dt = placement.device, placement.dtype
    if arch == "CLIPModel":
        full = CLIPConfig.from_dict(cfg)
        text_cfg = full.text_config
        model = load_model(lambda: CLIPTextTransformer(text_cfg), reader, _only_text() + CLIP_TEXT_TOWER, device=dev, dtype=dt, config=cfg)
    elif arch == "CLIPTextModelWithProjection":
        text_cfg = CLIPTextConfig.from_dict(cfg)
        model = load_model(lambda: CLIPTextModelWithProjection(text_cfg), reader, CLIP_TEXT_WITH_PROJECTION, device=dev, dtype=dt, config=cfg)
    elif arch == "CLIPTextModel":
        text_cfg = CLIPTextConfig.from_dict(cfg)
        model = load_model(lambda: CLIPTextTransformer(text_cfg), reader, CLIP_TEXT_TOWER, device=dev, dtype=dt, config=cfg)
    else:
        raise UserError(f"'{src.path}' holds {with_article(arch)}, not a CLIP text encoder")
    reader.close()
    return model


def _only_text():
    from gencli.checkpoints.keymap import Drop, KeyMap

    return KeyMap([Drop(r"^(vision_model\.|visual_projection\.|text_projection\.|logit_scale$)")], "text tower of a CLIPModel")


@torch.inference_mode()
def truncation_notice(tokenizer: CLIPTokenizer, text: str, max_length: int, what: str) -> Optional[str]:
    """A notice line when ``text`` does not fit the ``max_length``-token window (start and end tokens
    included) and is truncated: what the truncation drops; None when it fits."""
    content = tokenizer.tokenize_ids(text)
    room = max_length - 2
    if len(content) <= room:
        return None
    dropped = tokenizer.decode(content[room:], skip_special_tokens=False)
    return f'{what} was truncated to the {max_length}-token window of CLIP; dropped: "{dropped}"'


def encode_layer(
    encoder: CLIPTextTransformer | CLIPTextModelWithProjection,
    input_ids: torch.Tensor,
    *,
    skip: int = 0,
    final_norm: bool = True,
    attention_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token states of one layer of a text encoder, and its pooled output, for token ids ``(B, L)``.

    ``skip`` = 0 takes the last layer, ``skip`` = k the output ``k`` layers earlier
    (``hidden_states[-(k + 1)]``: "clip skip"; SDXL uses the penultimate layer, ``skip=1``, without the
    final norm). ``final_norm`` applies ``final_layer_norm`` to the chosen layer (diffusers does so for
    the last layer and for clip skip in SD 1.x/2.x). ``pooled`` is the projected embedding for a
    ``CLIPTextModelWithProjection``, else the pooled state, always of the full stack.
    """
    tower = encoder.text_model if isinstance(encoder, CLIPTextModelWithProjection) else encoder
    if skip < 0 or skip >= tower.config.num_hidden_layers:
        raise UserError(f"clip skip {skip} is out of range for a text encoder of {tower.config.num_hidden_layers} layers")
    out = tower(input_ids, attention_mask, output_hidden_states=skip > 0 or not final_norm)
    if skip == 0 and final_norm:
        states = out.last_hidden_state
    else:
        states = out.hidden_states[-(skip + 1)]
        if final_norm:
            states = tower.final_layer_norm(states)
    pooled = encoder.text_projection(out.pooler_output) if isinstance(encoder, CLIPTextModelWithProjection) else out.pooler_output
    return states, pooled


def text_conditioning(
    encoder: CLIPTextTransformer | CLIPTextModelWithProjection,
    tokenizer: CLIPTokenizer,
    prompts: Sequence[str],
    *,
    skip: int = 0,
    final_norm: bool = True,
    padding: str = "max_length",
    device: Optional[torch.device] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token text states for conditioning a diffusion model, as diffusers' pipelines compute them.

    Prompts are padded to the full context (77) with the tokenizer's pad token and encoded without an
    attention mask (what Stable Diffusion was trained with); ``skip`` and ``final_norm`` as in
    :func:`encode_layer`. Returns ``(states (B, L, D), pooled)``. (The Stable Diffusion pipelines use
    :class:`gencli.pipelines.diffusion.prompt_encoding.PromptEncoder`, which also reports truncated prompts.)
    """
    tower = encoder.text_model if isinstance(encoder, CLIPTextModelWithProjection) else encoder
    dev = device or tower.final_layer_norm.weight.device
    context = min(tokenizer.model_max_length, tower.config.max_position_embeddings)
    ids, _ = tokenizer(list(prompts), padding=padding, max_length=context).tensors(dev)
    return encode_layer(encoder, ids, skip=skip, final_norm=final_norm)
