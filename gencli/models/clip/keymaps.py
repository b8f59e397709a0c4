"""Key mappings from CLIP checkpoint layouts onto :mod:`gencli.models.clip.model`'s modules.

- transformers ``CLIPModel`` / ``CLIPTextModelWithProjection``: identity, except the ``position_ids``
  buffers older checkpoints saved (they are recomputed, never read);
- transformers ``CLIPTextModel`` / ``CLIPVisionModel`` on their own (a Stable Diffusion ``text_encoder``
  folder): the tower's weights, stored with the ``text_model.``/``vision_model.`` prefix by
  transformers 4 and without it by transformers 5; both load into the bare tower;
- original-layout (single-file) Stable Diffusion checkpoints: OpenAI CLIP ViT-L/14 in transformers'
  naming under a prefix (:func:`original_clip_keymap`), OpenCLIP ViT-H/14 and ViT-bigG/14 in OpenCLIP's
  naming (:func:`open_clip_keymap`: ``in_proj`` split into q/k/v, ``text_projection`` transposed).
"""

from __future__ import annotations

import re
from typing import Optional

from gencli.checkpoints.keymap import Drop, KeyMap, Rename, Split, Transpose

_BUFFERS = Drop(r"(^|\.)position_ids$")

CLIP_MODEL = KeyMap([_BUFFERS], "transformers CLIPModel")
CLIP_TEXT_WITH_PROJECTION = KeyMap([_BUFFERS], "transformers CLIPTextModelWithProjection")
CLIP_TEXT_TOWER = KeyMap([_BUFFERS, Rename(r"^text_model\.", "")], "transformers CLIPTextModel")
CLIP_VISION_TOWER = KeyMap([_BUFFERS, Rename(r"^vision_model\.", "")], "transformers CLIPVisionModel")


# -- original-layout (single-file) Stable Diffusion checkpoints -------------------------------------
# Where each text encoder lives in a single-file checkpoint. OpenAI's CLIP ViT-L/14 is stored with
# transformers' naming under a prefix; OpenCLIP towers (ViT-H/14 in SD 2.x, ViT-bigG/14 in SDXL) with
# OpenCLIP's own naming.
SD1_CLIP_PREFIX = "cond_stage_model.transformer."
SD2_OPEN_CLIP_PREFIX = "cond_stage_model.model."
SDXL_CLIP_PREFIX = "conditioner.embedders.0.transformer."
SDXL_OPEN_CLIP_PREFIX = "conditioner.embedders.1.model."
SDXL_REFINER_OPEN_CLIP_PREFIX = "conditioner.embedders.0.model."  # the refiner has only the bigG tower

# OpenCLIP's text-tower names -> transformers' (after the prefix is removed).
_OPEN_CLIP_RENAMES = [
    Rename(r"^token_embedding\.weight$", "embeddings.token_embedding.weight"),
    Rename(r"^positional_embedding$", "embeddings.position_embedding.weight"),
    Rename(r"^ln_final\.", "final_layer_norm."),
    Rename(r"^transformer\.resblocks\.(\d+)\.", r"encoder.layers.\1."),
    Rename(r"\.ln_1\.", ".layer_norm1."),
    Rename(r"\.ln_2\.", ".layer_norm2."),
    Rename(r"\.mlp\.c_fc\.", ".mlp.fc1."),
    Rename(r"\.mlp\.c_proj\.", ".mlp.fc2."),
    Rename(r"\.attn\.out_proj\.", ".self_attn.out_proj."),
    # nn.MultiheadAttention's packed projection: rows are q, then k, then v
    Split(r"\.attn\.in_proj_(weight|bias)$", [r".self_attn.q_proj.\1", r".self_attn.k_proj.\1", r".self_attn.v_proj.\1"], dim=0),
    # OpenCLIP applies x @ text_projection: the Linear weight is its transpose
    Transpose(r"^text_projection$"),
    Rename(r"^text_projection$", "text_projection.weight"),
]


def _only_under(prefix: str) -> list:
    """Drop what is not under ``prefix`` (the UNet, the VAE, other encoders), then remove the prefix."""
    return [Drop(rf"^(?!{re.escape(prefix)})"), Rename(rf"^{re.escape(prefix)}", "")]


def original_clip_keymap(prefix: str) -> KeyMap:
    """OpenAI CLIP's text tower stored with transformers' naming under ``prefix`` (SD 1.x
    ``cond_stage_model.transformer.``, SDXL ``conditioner.embedders.0.transformer.``) onto a bare
    :class:`~gencli.models.clip.model.CLIPTextTransformer`. Both the ``text_model.``-nested and the flat
    naming occur."""
    return KeyMap([*_only_under(prefix), _BUFFERS, Rename(r"^text_model\.", "")], f"text encoder under {prefix}")


def open_clip_keymap(prefix: str, *, with_projection: bool, num_layers: Optional[int] = None) -> KeyMap:
    """An OpenCLIP text tower under ``prefix`` onto gencli's CLIP text modules.

    ``with_projection``: the target is a :class:`~gencli.models.clip.model.CLIPTextModelWithProjection`
    (SDXL's ``text_encoder_2``: tower under ``text_model.``, plus ``text_projection``); otherwise a
    bare tower and the projection is not used (SD 2.x). ``num_layers``: keep only the first residual
    blocks (SD 2.x conditions on the penultimate layer, so diffusers' text encoder has 23 of 24).
    The logit scale and OpenCLIP's rebuilt ``attn_mask`` buffer are not weights of the text encoder.
    """
    rules = [*_only_under(prefix), Drop(r"^(logit_scale|attn_mask)$")]
    if num_layers is not None:
        rules.append(Drop(rf"^transformer\.resblocks\.(?!({'|'.join(str(i) for i in range(num_layers))})\.)\d+\."))
    if not with_projection:
        rules.append(Drop(r"^text_projection$"))
    rules += _OPEN_CLIP_RENAMES
    if with_projection:
        rules.append(Rename(r"^(embeddings|encoder|final_layer_norm)\.", r"text_model.\1."))
    name = f"OpenCLIP text encoder under {prefix}" + (f" (first {num_layers} layers)" if num_layers is not None else "")
    return KeyMap(rules, name)
