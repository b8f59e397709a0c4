"""Shapes-world text-to-text pairs: a caption read into its structured scene description, and back.

The structure names every object's attributes and the background, in caption order::

    size=small colour=blue shape=crescent position=top-left ; size=medium colour=cyan shape=crescent position=right ; background=black

Two tasks, each with a T5-style prefix: ``parse: CAPTION`` -> structure, and ``describe: STRUCTURE``
-> the ``full`` caption. Captions for training come in the styles of :data:`TRAIN_STYLES`; the
``picture`` style is held out (a phrasing the model never saw), and evaluation scenes come from the
``test`` split of seeds. :func:`augmented_caption` composes varied training phrasings (word order,
joiners, background wording) that keep the held-out ones out. :func:`baseline_parse` is a rule-based
parser written from the caption templates, the baseline a trained model is compared with.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import numpy as np

from gencli.data import shapes

TRAIN_STYLES: tuple[str, ...] = ("full", "list", "background_first")
HELDOUT_STYLES: tuple[str, ...] = ("picture",)
PARSE, DESCRIBE = "parse: ", "describe: "


def structure(scene: shapes.Scene) -> str:
    """The structured description of a scene (see the module doc)."""
    objs = [f"size={o.size} colour={o.colour} shape={o.shape} position={o.position.replace(' ', '-')}" for o in scene.objects]
    return " ; ".join(objs + [f"background={scene.background}"])


def parse_structure(text: str) -> Optional[dict]:
    """A structure string back into ``scene.labels()`` form; None when it is not well formed."""
    parts = [p.strip() for p in text.split(";")]
    if len(parts) < 2 or not parts[-1].startswith("background="):
        return None
    objects = []
    for part in parts[:-1]:
        fields = dict(f.split("=", 1) for f in part.split() if "=" in f)
        if set(fields) != {"size", "colour", "shape", "position"}:
            return None
        fields["position"] = fields["position"].replace("-", " ")
        objects.append({k: fields[k] for k in ("shape", "colour", "size", "position")})
    return {"objects": objects, "background": parts[-1].split("=", 1)[1]}


def pair(seed: int, rng: np.random.Generator, styles: tuple[str, ...] = TRAIN_STYLES, augment: float = 0.0) -> tuple[str, str]:
    """One training pair of the scene of ``seed``: a parse or a describe task (chosen with ``rng``).
    A parse caption is one of ``styles``, or with probability ``augment`` an :func:`augmented_caption`."""
    scene = shapes.make_scene(seed)
    if rng.random() < 0.5:
        caption = augmented_caption(scene, rng) if augment and rng.random() < augment else scene.random_caption(rng, styles)
        return PARSE + caption, structure(scene)
    return DESCRIBE + structure(scene), scene.caption("full")


def _choice(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _position_phrase(position: str, rng: np.random.Generator) -> str:
    options = [shapes.POSITION_PHRASES[position], f"in the {position}", position]
    if " " in position:  # a corner
        options.append(f"in the {position} corner")
    return _choice(rng, options)


def _object_phrase(o: shapes.ShapeObject, rng: np.random.Generator) -> str:
    where = _position_phrase(o.position, rng)
    article = shapes._article(o.size)
    return _choice(rng, [
        f"{article} {o.size} {o.colour} {o.shape} {where}",
        f"{o.size} {o.colour} {o.shape} {where}",
        f"{o.colour} {o.shape}, {o.size}, {o.position}",
        f"{where} {article} {o.size} {o.colour} {o.shape}",
        f"{shapes._article(o.colour)} {o.colour} {o.shape} of {o.size} size {where}",
    ])  # fmt: skip


def augmented_caption(scene: shapes.Scene, rng: np.random.Generator) -> str:
    """A caption composed from varied parts, for training variety: each object's phrase (word order,
    article, position wording), the joiner between objects, the background before or after the
    objects, an optional lead-in. Kept out on purpose, so that evaluation measures phrasings never
    trained on: the ``picture`` style's "a picture of ..., on a ... background", parentheses (the
    ``paren`` paraphrase), "there is" and a leading "on a ... background" (the ``there_is`` one)."""
    objects = _choice(rng, [" and ", ", ", "; ", " with "]).join(_object_phrase(o, rng) for o in scene.objects)
    bg, article = scene.background, shapes._article(scene.background)
    if rng.random() < 0.5:
        lead = _choice(rng, ["", "", "an image of ", "a scene with "])
        return lead + objects + _choice(rng, [f" on {article} {bg} background", f", {bg} background", f"; {bg} background",
                                              f" against {article} {bg} background", f", the background is {bg}"])  # fmt: skip
    return _choice(rng, [f"{article} {bg} background with ", f"{bg} background: ", f"{bg} background, ", f"background {bg}: "]) + objects


_POSITION_RX = "|".join(re.escape(p) for p in sorted(shapes.POSITION_PHRASES.values(), key=len, reverse=True))
_OBJECT_RX = re.compile(
    rf"(?:(?P<size>{'|'.join(shapes.SIZES)}) )?(?P<colour>{'|'.join(shapes.COLOURS)}) (?P<shape>{'|'.join(shapes.SHAPES)})"
    rf"(?:, (?P<lsize>{'|'.join(shapes.SIZES)}), (?P<lpos>{'|'.join(sorted(shapes.POSITIONS, key=len, reverse=True))})| (?P<pos>{_POSITION_RX}))?"
)
_PHRASE_TO_POSITION = {v: k for k, v in shapes.POSITION_PHRASES.items()}


def baseline_parse(caption: str) -> str:
    """The rule-based baseline: objects are "(size) colour shape (position phrase)" or the list
    style's "colour shape, size, position"; the background is the word before "background"."""
    objects = []
    for m in _OBJECT_RX.finditer(caption):
        size = m.group("size") or m.group("lsize") or "?"
        position = m.group("lpos") or _PHRASE_TO_POSITION.get(m.group("pos") or "", "?")
        objects.append(f"size={size} colour={m.group('colour')} shape={m.group('shape')} position={position.replace(' ', '-')}")
    bg = re.search(r"(\w+) background", caption)
    return " ; ".join(objects + [f"background={bg.group(1) if bg else '?'}"])


PARAPHRASES: tuple[str, ...] = ("paren", "there_is")


def paraphrase(scene: shapes.Scene, style: str) -> str:
    """Phrasings no caption template writes (never trained on), for measuring generalisation:

    - paren: "small blue crescent (top left), medium cyan crescent (right), black background"
    - there_is: "on a black background there is a small blue crescent at the top left and ..."
    """
    if style == "paren":
        return ", ".join([f"{o.size} {o.colour} {o.shape} ({o.position})" for o in scene.objects] + [f"{scene.background} background"])
    if style == "there_is":
        return f"on {shapes._article(scene.background)} {scene.background} background there is {shapes._join(o.phrase() for o in scene.objects)}"
    raise ValueError(f"unknown paraphrase style '{style}' (known: {', '.join(PARAPHRASES)})")
