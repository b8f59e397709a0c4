"""Key mappings from CLIP checkpoint layouts onto :mod:`gencli.models.clip`'s modules.

- transformers ``CLIPModel`` / ``CLIPTextModelWithProjection``: identity, except the ``position_ids``
  buffers older checkpoints saved (they are recomputed, never read);
- transformers ``CLIPTextModel`` / ``CLIPVisionModel`` on their own (a Stable Diffusion ``text_encoder``
  folder): the tower's weights, stored with the ``text_model.``/``vision_model.`` prefix by
  transformers 4 and without it by transformers 5; both load into the bare tower.
"""

from __future__ import annotations

from gencli.checkpoints.keymap import Drop, KeyMap, Rename

_BUFFERS = Drop(r"(^|\.)position_ids$")

CLIP_MODEL = KeyMap([_BUFFERS], "transformers CLIPModel")
CLIP_TEXT_WITH_PROJECTION = KeyMap([_BUFFERS], "transformers CLIPTextModelWithProjection")
CLIP_TEXT_TOWER = KeyMap([_BUFFERS, Rename(r"^text_model\.", "")], "transformers CLIPTextModel")
CLIP_VISION_TOWER = KeyMap([_BUFFERS, Rename(r"^vision_model\.", "")], "transformers CLIPVisionModel")
