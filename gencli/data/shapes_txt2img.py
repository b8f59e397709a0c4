"""Captions and judges of the text-to-image default (``weights/txt2img-shapes``).

- :func:`train_caption`: the captions the default is trained on: every object's colour and shape,
  its size, position and the background each in about half of them, in the generic framings of the
  CLIP default's training; one in ten empty (the unconditional prediction of classifier-free
  guidance).
- :func:`eval_items`: held-out prompts (test seed split, single objects) and the attributes each one
  names, optionally restricted to the colour+shape pairs held out of training.
- :func:`judge_image`: what a generated image shows, read off its pixels independently of the model
  that drew it: the background colour (nearest palette colour of the border), the object's colour
  (nearest palette colour of its pixels), its position on the 3x3 grid (centroid) and its size
  (area against the calibrated area of each shape and size). The shape is judged by the default
  classifier, in the evaluation script (for the hexagon, which the classifier does not know, by
  fitting shape templates: ``scripts/eval_generative.GeometricJudge``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from gencli.data import shapes, shapes_clip

SINGLE_OBJECT_SHARE = 0.75
EMPTY_CAPTION_SHARE = 0.1
ATTRIBUTES = ("shape", "colour", "background", "position", "size")


def train_caption(scene: shapes.Scene, rng: np.random.Generator, *, allow_empty: bool = True) -> str:
    """A caption for ``scene`` naming every object's colour and shape, and some of the rest."""
    if allow_empty and rng.random() < EMPTY_CAPTION_SHARE:
        return ""
    return _caption(scene, rng)[0]


def _caption(scene: shapes.Scene, rng: np.random.Generator) -> tuple[str, tuple[bool, bool, bool]]:
    with_size, with_position, with_background = (bool(rng.random() < p) for p in (0.5, 0.5, 0.6))
    objects = shapes._join(o.phrase(with_size=with_size, with_position=with_position) for o in scene.objects)
    bg = f"{shapes._article(scene.background)} {scene.background} background"
    if with_background and rng.random() < 0.2:
        text = f"{bg} with {objects}"
    else:
        text = f"{objects} on {bg}" if with_background else objects
    return shapes_clip.FRAMINGS[int(rng.integers(len(shapes_clip.FRAMINGS)))].format(text), (with_size, with_position, with_background)


def training_scenes(n: int) -> list[shapes.Scene]:
    """``n`` train-split scenes without a held-out colour+shape pair; three in four single-object."""
    scenes: list[shapes.Scene] = []
    for seed in shapes.SPLITS["train"]:
        if len(scenes) == n:
            break
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x7217]))
        scene = shapes.make_scene(seed, n_objects=1 if rng.random() < SINGLE_OBJECT_SHARE else 2)
        if not shapes_clip.is_held_out(scene):
            scenes.append(scene)
    return scenes


@dataclass(frozen=True)
class EvalItem:
    """One evaluation prompt: the scene it was written from, the prompt, the attributes it names
    (always shape and colour; background, position and size when the prompt names them) and the
    seed of its generated image."""

    scene: shapes.Scene
    prompt: str
    named: dict[str, str]
    seed: int


def eval_items(n: int, *, held_out: bool = False, offset: int = 0, shape: str | None = None) -> list[EvalItem]:
    """``n`` prompts from single-object test-split scenes: with ``held_out`` only the colour+shape
    pairs never trained on (cycled), else only the others. ``shape`` (one of
    ``shapes.EXTRA_SHAPES``, such as ``"hexagon"``) draws every scene's object as that shape instead,
    the same seeds, captions and named attributes otherwise."""
    items: list[EvalItem] = []
    pairs = shapes_clip.HELD_OUT_PAIRS
    for seed in shapes.SPLITS["test"][offset:]:
        if len(items) == n:
            break
        if shape is not None:
            scene = shapes.make_scene(seed, n_objects=1, shape=shape)
        elif held_out:
            pair_colour, pair_shape = pairs[len(items) % len(pairs)]
            try:
                scene = shapes.make_scene(seed, n_objects=1, shape=pair_shape, colour=pair_colour)
            except ValueError:
                continue
        else:
            scene = shapes.make_scene(seed, n_objects=1)
            if shapes_clip.is_held_out(scene):
                continue
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0xE7A1]))
        prompt, (with_size, with_position, with_background) = _caption(scene, rng)
        m = scene.main
        named = {"shape": m.shape, "colour": m.colour}
        if with_background:
            named["background"] = scene.background
        if with_position:
            named["position"] = m.position
        if with_size:
            named["size"] = m.size
        items.append(EvalItem(scene, prompt, named, seed))
    return items


# -- judges ------------------------------------------------------------------------------------
def _lab(pixels: np.ndarray) -> np.ndarray:
    """CIE Lab of sRGB pixels (..., 3) in 0-255 (D65), vectorised."""
    c = pixels.astype(np.float64) / 255.0
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    xyz = c @ np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]).T
    xyz = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 216 / 24389, np.cbrt(xyz), (24389 / 27 * xyz + 16) / 116)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], axis=-1)


OBJECT_THRESHOLD = 20.0  # CIE76 distance from the background above which a pixel belongs to the object


def object_mask(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(mask, background_rgb)``: the pixels that differ from the background (median of the border)."""
    border = np.concatenate([image[:2].reshape(-1, 3), image[-2:].reshape(-1, 3), image[:, :2].reshape(-1, 3), image[:, -2:].reshape(-1, 3)])
    bg = np.median(border, axis=0)
    dist = np.linalg.norm(_lab(image) - _lab(bg), axis=-1)
    return dist > OBJECT_THRESHOLD, bg


def _interior(mask: np.ndarray) -> np.ndarray:
    """``mask`` eroded by one pixel (4-neighbourhood): the object without its anti-aliased edge."""
    m = mask.copy()
    m[1:] &= mask[:-1]
    m[:-1] &= mask[1:]
    m[:, 1:] &= mask[:, :-1]
    m[:, :-1] &= mask[:, 1:]
    return m


@lru_cache(maxsize=None)
def size_calibration(side: int = 64, n: int = 400) -> dict[tuple[str, str], float]:
    """Mean object area (share of the image) of each shape at each size, from rendered train scenes
    (``n`` scenes of the eight shapes; ``n // 8`` more for each of ``shapes.EXTRA_SHAPES``)."""
    areas: dict[tuple[str, str], list[float]] = {}
    for i, seed in enumerate(shapes.split_seeds("train", n, offset=50_000)):
        size = tuple(shapes.SIZES)[i % len(shapes.SIZES)]
        scene = shapes.make_scene(seed, n_objects=1, object_size=size)
        mask, _ = object_mask(shapes.render_scene(scene, side))
        areas.setdefault((scene.main.shape, size), []).append(float(mask.mean()))
    for shape in shapes.EXTRA_SHAPES:
        for i, seed in enumerate(shapes.split_seeds("train", max(len(shapes.SIZES), n // len(shapes.SHAPES)), offset=60_000)):
            size = tuple(shapes.SIZES)[i % len(shapes.SIZES)]
            scene = shapes.make_scene(seed, n_objects=1, shape=shape, object_size=size)
            mask, _ = object_mask(shapes.render_scene(scene, side))
            areas.setdefault((shape, size), []).append(float(mask.mean()))
    return {k: float(np.mean(v)) for k, v in areas.items()}


def judge_image(image: np.ndarray, shape: str) -> dict[str, str | None]:
    """Background, object colour, position and size read off ``image`` (H, W, 3 uint8); ``shape``
    (the classifier's verdict) picks the size calibration. None where no object is found."""
    h, w, _ = image.shape
    mask, bg = object_mask(image)
    out: dict[str, str | None] = {"background": shapes.nearest_colour(bg, shapes.BACKGROUNDS), "colour": None, "position": None, "size": None}
    if mask.sum() < 4:
        return out
    core = _interior(mask)
    pixels = image[core if core.sum() >= 4 else mask]
    out["colour"] = shapes.nearest_colour(np.median(pixels, axis=0), shapes.COLOURS)
    ys, xs = np.nonzero(mask)
    col = min(int(3 * (xs.mean() + 0.5) / w), 2)
    row = min(int(3 * (ys.mean() + 0.5) / h), 2)
    out["position"] = shapes._position_name(row, col)
    cal = size_calibration(min(h, w))
    area = float(mask.mean())
    sizes = [s for s in shapes.SIZES if (shape, s) in cal]
    if sizes:
        out["size"] = min(sizes, key=lambda s: abs(np.log(area) - np.log(cal[(shape, s)])))
    return out


def score(named: dict[str, str], judged: dict[str, str | None]) -> dict[str, bool]:
    """Per named attribute, whether the judged image shows it."""
    return {k: judged.get(k) == v for k, v in named.items()}


def outline(scene: shapes.Scene, side: int = 64) -> np.ndarray:
    """``(side, side)`` uint8: 255 on the outlines of the scene's objects (two pixels wide), 0 elsewhere: the
    conditioning image of the embedded ControlNet (``weights/controlnet-shapes``, ``scripts/train_controlnet.py``)."""
    inside = shapes.render_mask(scene, side) > 0
    edge = inside & ~_interior(inside)
    grown = edge.copy()  # one pixel more, inwards and outwards
    grown[1:] |= edge[:-1]
    grown[:-1] |= edge[1:]
    grown[:, 1:] |= edge[:, :-1]
    grown[:, :-1] |= edge[:, 1:]
    return (grown * 255).astype(np.uint8)
