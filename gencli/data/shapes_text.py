"""Text tasks on shapes-world captions, for the encoder's task heads (``scripts/train_encoder_heads.py``).

Every caption phrasing of a scene (``Scene.caption(style)``) is labelled word by word: colour, shape,
size and position words of the objects, and the background's colour. From those labels:

- ``ner_example``: the caption with character spans ``(start, end, type)`` of the COLOUR, SHAPE,
  SIZE, POSITION ("top left" is one span) and BACKGROUND (the background's colour word) entities;
- ``classify_example``: the caption and the main (first) object's shape, one of ``SHAPES``;
- ``qa_examples``: questions about the caption ("what colour is the star?", "where is the red
  star?", "what shape is the blue object?", "how big is the heart?", "what colour is the
  background?") with the character span of their answer; questions whose subject is ambiguous (two
  stars) are not asked.

Scenes come from ``shapes.SPLITS``: train on ``train`` seeds, score on ``validation`` seeds.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from gencli.data import shapes

ENTITY_TYPES = ("COLOUR", "SHAPE", "SIZE", "POSITION", "BACKGROUND")
NER_LABELS = ("O",) + tuple(f"{bi}-{t}" for t in ENTITY_TYPES for bi in ("B", "I"))
_POSITION_WORDS = {"top", "bottom", "left", "right", "center"}


def words(text: str) -> list[tuple[str, int, int]]:
    return [(m.group(), m.start(), m.end()) for m in re.finditer(r"[A-Za-z]+|[^\sA-Za-z]", text)]


def labelled_caption(scene: shapes.Scene, style: str) -> tuple[str, list[dict]]:
    """The caption and its entities ``{"type", "start", "end", "object"}`` (``object``: the index of
    the object the attribute belongs to; None for the background), in text order."""
    text = scene.caption(style)
    ws = words(text)
    entities: list[dict] = []
    seen = {"COLOUR": 0, "SHAPE": 0, "SIZE": 0, "POSITION": 0}
    i = 0
    while i < len(ws):
        w, s, e = ws[i]
        nxt = ws[i + 1][0] if i + 1 < len(ws) else ""
        kind = None
        if (w in shapes.COLOURS or w in shapes.BACKGROUNDS) and nxt == "background":
            entities.append({"type": "BACKGROUND", "start": s, "end": e, "object": None})
        elif w in shapes.COLOURS:
            kind = "COLOUR"
        elif w in shapes.SHAPES:
            kind = "SHAPE"
        elif w in shapes.SIZES:
            kind = "SIZE"
        elif w in _POSITION_WORDS:
            if w in ("top", "bottom") and nxt in ("left", "right"):
                e = ws[i + 1][2]
                i += 1
            kind = "POSITION"
        if kind is not None:
            entities.append({"type": kind, "start": s, "end": e, "object": seen[kind]})
            seen[kind] += 1
        i += 1
    return text, entities


def ner_example(scene: shapes.Scene, style: str) -> tuple[str, list[tuple[int, int, str]]]:
    text, entities = labelled_caption(scene, style)
    return text, [(x["start"], x["end"], x["type"]) for x in entities]


def classify_example(scene: shapes.Scene, style: str) -> tuple[str, str]:
    return scene.caption(style), scene.main.shape


def qa_examples(scene: shapes.Scene, style: str) -> list[tuple[str, str, int, int]]:
    """``(question, caption, answer start, answer end)`` for every unambiguous question the caption answers."""
    text, entities = labelled_caption(scene, style)
    objs = scene.objects
    by: dict[tuple[str, Optional[int]], tuple[int, int]] = {(x["type"], x["object"]): (x["start"], x["end"]) for x in entities}
    out = []
    shapes_named = [o.shape for o in objs]
    colours_named = [o.colour for o in objs]
    for k, o in enumerate(objs):
        unique_shape = shapes_named.count(o.shape) == 1
        unique_colour = colours_named.count(o.colour) == 1
        if unique_shape and ("COLOUR", k) in by:
            out.append((f"what colour is the {o.shape}?", text, *by[("COLOUR", k)]))
        if unique_colour and ("SHAPE", k) in by:
            out.append((f"what shape is the {o.colour} object?", text, *by[("SHAPE", k)]))
        if unique_shape and ("SIZE", k) in by:
            out.append((f"how big is the {o.shape}?", text, *by[("SIZE", k)]))
        if ("POSITION", k) in by and (unique_shape or unique_colour):
            subject = f"{o.colour} {o.shape}" if not unique_shape else o.shape
            out.append((f"where is the {subject}?", text, *by[("POSITION", k)]))
    if ("BACKGROUND", None) in by:
        out.append(("what colour is the background?", text, *by[("BACKGROUND", None)]))
    return out


def scenes(split: str, n: int, offset: int = 0) -> list[shapes.Scene]:
    return [shapes.make_scene(s) for s in shapes.split_seeds(split, n, offset)]


def styled(split: str, n: int, seed: int = 0) -> list[tuple[shapes.Scene, str]]:
    """``n`` scenes of ``split``, each with one caption style drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    return [(sc, shapes.CAPTION_STYLES[int(rng.integers(len(shapes.CAPTION_STYLES)))]) for sc in scenes(split, n)]
