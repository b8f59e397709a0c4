"""Image-caption pairs of the shapes world for CLIP, and the zero-shot evaluation that goes with them.

Training pairs (:func:`training_pairs`): scenes of the ``train`` split, each with one of the world's
caption phrasings, sometimes wrapped in a generic framing ("a photo of ...", "an image of ..."), so
the text tower also reads the prompts people write. Two things are kept out of training on purpose:

- **compositional pairs** (:data:`HELD_OUT_PAIRS`): eight colour+shape combinations that never appear,
  neither in an image nor in a caption (every shape and eight of the colours occur in exactly one of
  them), so zero-shot accuracy on them measures composition, not memory;
- the **short** caption style ("a red star"): the evaluation's label prompts ("a photo of a red
  star.", "a photo of a star.") are therefore never a training caption verbatim.

The evaluation (:func:`evaluate`) classifies single-object scenes of a held-out seed range against
label sets built from the vocabularies: shape-only, colour-only and colour+shape (all 80
combinations), on ordinary scenes and on scenes of the held-out combinations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from gencli.data import shapes

HELD_OUT_PAIRS: tuple[tuple[str, str], ...] = (
    ("purple", "heart"),
    ("green", "star"),
    ("red", "triangle"),
    ("blue", "crescent"),
    ("yellow", "cross"),
    ("orange", "diamond"),
    ("pink", "circle"),
    ("cyan", "square"),
)

TRAIN_STYLES: tuple[str, ...] = tuple(s for s in shapes.CAPTION_STYLES if s != "short")

# generic framings of a caption (the caption replaces {}); the plain caption is the most frequent
FRAMINGS: tuple[str, ...] = (
    "{}", "{}", "{}", "{}", "{}.", "a photo of {}.", "a photo of {}", "an image of {}.", "a rendering of {}.",
    "a drawing of {}.", "a photo showing {}.", "an illustration of {}.", "a picture showing {}",
)  # fmt: skip

# the evaluation's label sets: (name, labels, template). Each template was chosen on the validation
# split among a fixed list of candidates (none of them a training caption; see the weights README):
# "a photo of a {}.", "{}", "a {}", "a {} in the picture", "a picture of a {}.", "an image of a {}.",
# "a {} on a plain background" for shapes and colour+shape pairs; "a photo of a {} shape.", "a {} shape",
# "a {} object in the picture", "something {}", "a photo of something {}." for colours.
SHAPE_TEMPLATE = "a {} on a plain background"
COLOUR_TEMPLATE = "a photo of a {} shape."
COMBO_TEMPLATE = "a {} on a plain background"


def is_held_out(scene: shapes.Scene) -> bool:
    return any((o.colour, o.shape) in HELD_OUT_PAIRS for o in scene.objects)


def caption_for(scene: shapes.Scene, rng: np.random.Generator) -> str:
    """A training caption for ``scene``: a random phrasing (not the short one) in a random framing."""
    text = scene.caption(TRAIN_STYLES[int(rng.integers(len(TRAIN_STYLES)))])
    return FRAMINGS[int(rng.integers(len(FRAMINGS)))].format(text)


def training_pairs(start_seed: int = 0) -> Iterator[tuple[int, shapes.Scene, str]]:
    """``(seed, scene, caption)`` for the ``train`` split from ``start_seed`` on, skipping scenes with a
    held-out pair. Deterministic: the caption of a seed depends on the seed only."""
    for seed in shapes.SPLITS["train"][start_seed:]:
        scene = shapes.make_scene(seed)
        if is_held_out(scene):
            continue
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0xC11F]))
        yield seed, scene, caption_for(scene, rng)


# Partial captions: the main object described by its shape or by its colour only, always with at least
# one more attribute (size, position or background), and colour-only ones naming an "object"/"thing",
# never a "shape", so that none can be an evaluation prompt verbatim.
_SHAPE_ONLY = ("{a} {shape} {where}", "{a} {size} {shape}", "{a} {shape} on {a_bg} {bg} background", "{a} {size} {shape} {where} on {a_bg} {bg} background")
_COLOUR_ONLY = ("something {colour} {where}", "{a} {colour} object on {a_bg} {bg} background", "{a} {size} {colour} object", "{a} {colour} thing {where}")


def partial_caption(scene: shapes.Scene, rng: np.random.Generator) -> tuple[str, dict[str, str]]:
    """A caption naming the main object's shape but not its colour, or its colour but not its shape,
    in a random framing, and the attributes it states (``shape``/``colour`` and some of ``size``,
    ``position``, ``background``): the scenes it is true of are those that match them all
    (:func:`caption_matches`). They teach the text tower that a description without a colour (or
    without a shape) covers every colour (every shape), which shape-only and colour-only prompts need."""
    m = scene.main
    by_shape = bool(rng.integers(2))
    template = (_SHAPE_ONLY if by_shape else _COLOUR_ONLY)[int(rng.integers(4))]
    first = (m.size if "{a} {size}" in template else m.shape if by_shape else m.colour)
    text = template.format(a=shapes._article(first), shape=m.shape, colour=m.colour, size=m.size, where=shapes.POSITION_PHRASES[m.position],
                           a_bg=shapes._article(scene.background), bg=scene.background)  # fmt: skip
    attrs = {"shape": m.shape} if by_shape else {"colour": m.colour}
    for key, marker in (("size", "{size}"), ("position", "{where}"), ("background", "{bg}")):
        if marker in template:
            attrs[key] = scene.background if key == "background" else getattr(m, key)
    return FRAMINGS[int(rng.integers(len(FRAMINGS)))].format(text), attrs


def caption_matches(attrs: dict[str, str], scene: shapes.Scene) -> bool:
    """Whether a partial caption's attributes hold for ``scene``'s main object and background."""
    return all((scene.background if k == "background" else getattr(scene.main, k)) == v for k, v in attrs.items())


GROUP_SIZE = 4


def _variant(seed: int, base: shapes.Scene, rng: np.random.Generator, *, new_shape: bool, new_colour: bool) -> Optional[shapes.Scene]:
    """``base`` with its main object's shape and/or colour replaced (layout, sizes and background kept),
    avoiding the held-out pairs; None when no such scene exists."""
    main = base.main
    shapes_ok = [s for s in shapes.SHAPES if s != main.shape] if new_shape else [main.shape]
    colours_ok = [c for c in shapes.allowed_colours(base.background) if c != main.colour] if new_colour else [main.colour]
    options = [(s, c) for s in shapes_ok for c in colours_ok if (c, s) not in HELD_OUT_PAIRS]
    for i in rng.permutation(len(options))[:4]:
        shape, colour = options[int(i)]
        try:
            scene = shapes.make_scene(seed, n_objects=len(base.objects), shape=shape, colour=colour, background=base.background)
        except ValueError:
            continue
        if not is_held_out(scene):
            return scene
    return None


def contrastive_group(seed: int, base: shapes.Scene) -> list[tuple[shapes.Scene, str]]:
    """``GROUP_SIZE`` scenes built on one layout, for hard negatives in a contrastive batch: the scene
    itself, its main object with another shape, with another colour, and with both changed. Without
    them, a batch is told apart by colour, background and position alone, and shape is never needed."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x6A0B]))
    scenes = [base]
    for new_shape, new_colour in ((True, False), (False, True), (True, True)):
        v = _variant(seed, base, rng, new_shape=new_shape, new_colour=new_colour)
        scenes.append(v if v is not None else base)
    return [(sc, caption_for(sc, rng)) for sc in scenes]


def caption_corpus(n_scenes: int = 20_000) -> list[str]:
    """Text for learning the BPE vocabulary: every phrasing and framing of training scenes."""
    out: list[str] = []
    for _seed, scene, _ in _take(training_pairs(0), n_scenes):
        for style in TRAIN_STYLES:
            out.append(scene.caption(style))
    out.extend(f.format("") for f in FRAMINGS)
    return out


def _take(it, n):
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


# -- evaluation ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LabelSet:
    name: str
    labels: tuple[str, ...]
    template: str
    truth: Callable[[shapes.ShapeObject], str]


def label_sets(shape_template: str = SHAPE_TEMPLATE, colour_template: str = COLOUR_TEMPLATE, combo_template: str = COMBO_TEMPLATE) -> list[LabelSet]:
    combos = tuple(f"{c} {s}" for c in shapes.COLOURS for s in shapes.SHAPES)
    return [
        LabelSet("shape", tuple(shapes.SHAPES), shape_template, lambda o: o.shape),
        LabelSet("colour", tuple(shapes.COLOURS), colour_template, lambda o: o.colour),
        LabelSet("colour+shape", combos, combo_template, lambda o: f"{o.colour} {o.shape}"),
    ]


def eval_scenes(split: str, n: int, *, held_out: bool = False, offset: int = 0) -> list[shapes.Scene]:
    """``n`` single-object scenes of ``split``; with ``held_out`` only the held-out combinations
    (cycling through them), else ordinary scenes without them."""
    seeds = shapes.SPLITS[split][offset:]
    out: list[shapes.Scene] = []
    it = iter(seeds)
    while len(out) < n:
        seed = next(it)
        if held_out:
            colour, shape = HELD_OUT_PAIRS[len(out) % len(HELD_OUT_PAIRS)]
            out.append(shapes.make_scene(seed, n_objects=1, shape=shape, colour=colour))
        else:
            scene = shapes.make_scene(seed, n_objects=1)
            if not is_held_out(scene):
                out.append(scene)
    return out


def evaluate(
    encode_images: Callable[[np.ndarray], "np.ndarray"],
    encode_texts: Callable[[Sequence[str]], "np.ndarray"],
    scenes: Sequence[shapes.Scene],
    sets: Sequence[LabelSet],
    *,
    size: int = 64,
    batch_size: int = 128,
) -> dict[str, float]:
    """Top-1 accuracy of every label set on ``scenes``.

    ``encode_images(uint8 (N, H, W, 3)) -> (N, D)`` and ``encode_texts(prompts) -> (M, D)`` return
    L2-normalised embeddings (numpy or torch); each image takes the label of highest cosine.
    """
    import torch

    texts = {s.name: torch.as_tensor(encode_texts([s.template.format(label) for label in s.labels])).float() for s in sets}
    correct = {s.name: 0 for s in sets}
    for start in range(0, len(scenes), batch_size):
        chunk = scenes[start : start + batch_size]
        images = np.stack([shapes.render_scene(sc, size) for sc in chunk])
        emb = torch.as_tensor(encode_images(images)).float()
        for s in sets:
            pred = (emb @ texts[s.name].t()).argmax(dim=-1).tolist()
            correct[s.name] += sum(s.labels[p] == s.truth(sc.main) for p, sc in zip(pred, chunk))
    return {name: c / max(len(scenes), 1) for name, c in correct.items()}


__all__ = [
    "HELD_OUT_PAIRS",
    "TRAIN_STYLES",
    "FRAMINGS",
    "LabelSet",
    "GROUP_SIZE",
    "caption_corpus",
    "caption_matches",
    "partial_caption",
    "contrastive_group",
    "caption_for",
    "eval_scenes",
    "evaluate",
    "is_held_out",
    "label_sets",
    "training_pairs",
]
