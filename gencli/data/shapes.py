"""The shapes world: a seeded procedural renderer of scenes with one or two coloured shapes.

Every scene is fully determined by its seed (and optional constraints); rendering is independent of
the resolution, so ``render(7, 64)`` and ``render(7, 256)`` show the same scene. Each scene comes with
structured labels (per object: shape, colour, size, position; the background) and captions in
several phrasings. The world trains and evaluates the embedded defaults (ViT classifier, CLIP,
VAE/GAN, text-to-image) and gives tests an exact ground truth.

Vocabulary (module constants): ``SHAPES`` (``EXTRA_SHAPES``, drawn only when named, in ``ALL_SHAPES``), ``COLOURS`` (name -> RGB), ``SIZES``, ``POSITIONS``
(a 3x3 grid of named positions), ``BACKGROUNDS`` (name -> RGB).

Rules of the world:
- an object's colour always differs from the background's, and contrasts with it (CIE76 distance of
  at least ``MIN_CONTRAST``), so every object is visible and its colour is well defined;
- the two objects of a two-object scene never overlap and never share both shape and colour; the
  first object (``scene.main``) is the one named first in every caption;
- each object's centre lies inside its named grid cell (a small jitter around the cell centre),
  its diameter is near its size's nominal fraction of the image's shorter side, and it may be
  rotated by a few degrees (never enough to turn a square into a diamond).

Seeds: ``SPLITS`` names disjoint seed ranges (``train``, ``validation``, ``test``); use
``split_seeds(split, n)`` to enumerate them so that training never sees an evaluation scene.

Typical use::

    from gencli.data import shapes
    sample = shapes.render(seed, 64)                 # a random scene (one or two objects)
    sample.image                                     # (64, 64, 3) uint8 array
    sample.scene.caption()                           # 'a small red star at the top left on a blue background'
    shapes.render(seed, 64, n_objects=1, shape="heart", colour="green", object_size="large")
    images, scenes = shapes.render_batch(shapes.split_seeds("test", 512), 64, n_objects=1)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np
from PIL import Image, ImageDraw

WORLD_VERSION = 1  # bump when the scene distribution changes (recorded in the weights trained on it)

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "heart", "cross", "diamond", "crescent")
# shapes drawn only where a scene asks for them by name (``make_scene(seed, shape="hexagon")``), never
# by a random draw: every scene, split and dataset of SHAPES stays as it was, so the defaults trained
# on them know nothing of these (the example LoRAs teach txt2img-shapes one of them)
EXTRA_SHAPES: tuple[str, ...] = ("hexagon", "arrow")
ALL_SHAPES: tuple[str, ...] = SHAPES + EXTRA_SHAPES

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 35, 35),
    "orange": (250, 145, 20),
    "yellow": (250, 225, 40),
    "green": (40, 170, 60),
    "cyan": (50, 210, 230),
    "blue": (30, 70, 230),
    "purple": (145, 40, 170),
    "pink": (250, 140, 210),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}

# backgrounds reuse the object palette's colours (same name, same colour), plus a neutral gray
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    name: COLOURS.get(name, (128, 128, 128)) for name in ("white", "black", "gray", "blue", "green", "red", "yellow", "purple")
}

# nominal diameter as a fraction of the image's shorter side
SIZES: dict[str, float] = {"small": 0.17, "medium": 0.25, "large": 0.34}

_ROWS = ("top", "middle", "bottom")
_COLS = ("left", "center", "right")
_CELL_CENTRES = (0.2, 0.5, 0.8)  # relative coordinate of the cell centres along each axis


def _position_name(row: int, col: int) -> str:
    if row == 1 and col == 1:
        return "center"
    if row == 1:
        return _COLS[col]
    if col == 1:
        return _ROWS[row]
    return f"{_ROWS[row]} {_COLS[col]}"


POSITIONS: tuple[str, ...] = tuple(_position_name(r, c) for r in range(3) for c in range(3))
# ('top left', 'top', 'top right', 'left', 'center', 'right', 'bottom left', 'bottom', 'bottom right')

# where each position sits, as (x, y) relative to the image (y downwards)
POSITION_XY: dict[str, tuple[float, float]] = {
    _position_name(r, c): (_CELL_CENTRES[c], _CELL_CENTRES[r]) for r in range(3) for c in range(3)
}

# prepositional phrase of each position in a caption
POSITION_PHRASES: dict[str, str] = {
    "top left": "at the top left",
    "top": "at the top",
    "top right": "at the top right",
    "left": "on the left",
    "center": "in the center",
    "right": "on the right",
    "bottom left": "at the bottom left",
    "bottom": "at the bottom",
    "bottom right": "at the bottom right",
}

CAPTION_STYLES: tuple[str, ...] = ("full", "list", "background_first", "no_background", "short", "picture")

MIN_CONTRAST = 40.0  # CIE76 distance an object colour keeps from its background
COLOUR_JITTER = 10  # +- per channel, per object and per background
POSITION_JITTER = 0.025  # +- relative to the image side (objects stay inside a square image)
SIZE_JITTER = 0.06  # +- relative to the nominal diameter
ROTATION_JITTER = 10.0  # +- degrees

SPLITS: dict[str, range] = {
    "train": range(0, 1_000_000_000),
    "validation": range(1_000_000_000, 1_001_000_000),
    "test": range(1_001_000_000, 1_002_000_000),
}

Choice = Union[str, Sequence[str], None]


# -- colour science (for the contrast rule) ------------------------------------------------------
def _srgb_to_lab(rgb: Sequence[float]) -> np.ndarray:
    c = np.asarray(rgb, dtype=np.float64) / 255.0
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    m = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = (m @ c) / np.array([0.9505, 1.0, 1.089])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def colour_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """CIE76 distance between two sRGB colours (0-255 per channel)."""
    return float(np.linalg.norm(_srgb_to_lab(a) - _srgb_to_lab(b)))


@lru_cache(maxsize=None)
def allowed_colours(background: str) -> tuple[str, ...]:
    """Object colours that may appear on ``background`` (different name, enough contrast)."""
    bg = BACKGROUNDS[background]
    return tuple(c for c, rgb in COLOURS.items() if c != background and colour_distance(rgb, bg) >= MIN_CONTRAST)


@lru_cache(maxsize=None)
def allowed_backgrounds(colour: str) -> tuple[str, ...]:
    """Backgrounds an object of ``colour`` may appear on."""
    return tuple(b for b in BACKGROUNDS if colour in allowed_colours(b))


def nearest_colour(rgb: Sequence[float], names: Iterable[str] | None = None) -> str:
    """The palette colour name closest (CIE76) to ``rgb`` — for colour checks of generated images."""
    names = list(names) if names is not None else list(COLOURS)
    return min(names, key=lambda n: colour_distance(rgb, COLOURS.get(n, BACKGROUNDS.get(n))))


# -- scenes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShapeObject:
    """One object of a scene: its labels and its exact geometry (relative to the image)."""

    shape: str
    colour: str
    size: str
    position: str
    x: float  # centre, fraction of the width
    y: float  # centre, fraction of the height (downwards)
    diameter: float  # fraction of the image's shorter side
    rotation: float  # degrees, counter-clockwise
    rgb: tuple[int, int, int]  # the exact colour drawn (palette colour + jitter)

    def labels(self) -> dict:
        return {"shape": self.shape, "colour": self.colour, "size": self.size, "position": self.position}

    def phrase(self, *, with_size: bool = True, with_position: bool = True) -> str:
        words = ([self.size] if with_size else []) + [self.colour, self.shape]
        text = f"{_article(words[0])} {' '.join(words)}"
        return f"{text} {POSITION_PHRASES[self.position]}" if with_position else text


@dataclass(frozen=True)
class Scene:
    """A scene: its objects (the first is the main one), its background, and the seed that made it."""

    seed: int
    objects: tuple[ShapeObject, ...]
    background: str
    background_rgb: tuple[int, int, int]

    @property
    def main(self) -> ShapeObject:
        """The main object: the only one, or the first one named in the captions."""
        return self.objects[0]

    def labels(self) -> dict:
        """Structured labels: ``{"objects": [{"shape","colour","size","position"}...], "background"}``."""
        return {"objects": [o.labels() for o in self.objects], "background": self.background}

    def label_ids(self) -> dict:
        """The main object's labels as class indices into the vocabularies (for classifiers)."""
        m = self.main
        return {
            "shape": ALL_SHAPES.index(m.shape),  # the EXTRA_SHAPES after the eight
            "colour": list(COLOURS).index(m.colour),
            "size": list(SIZES).index(m.size),
            "position": POSITIONS.index(m.position),
            "background": list(BACKGROUNDS).index(self.background),
            "n_objects": len(self.objects),
        }

    def to_dict(self) -> dict:
        """Everything about the scene (labels, geometry, colours) as JSON-ready data."""
        return {
            "seed": self.seed,
            "background": self.background,
            "background_rgb": list(self.background_rgb),
            "objects": [{**asdict(o), "rgb": list(o.rgb)} for o in self.objects],
            "caption": self.caption(),
        }

    def caption(self, style: str = "full") -> str:
        """The scene described in one of ``CAPTION_STYLES``:

        - full: "a small red star at the top left on a blue background"
        - list: "red star, small, top left, blue background"
        - background_first: "a blue background with a small red star at the top left"
        - no_background: "a small red star at the top left"
        - short: "a red star"
        - picture: "a picture of a small red star at the top left, on a blue background"
        """
        objs = self.objects
        bg = f"{self.background} background"
        if style == "full":
            return f"{_join(o.phrase() for o in objs)} on {_article(self.background)} {bg}"
        if style == "list":
            items = [f"{o.colour} {o.shape}, {o.size}, {o.position}" for o in objs]
            return f"{items[0]}, {bg}" if len(items) == 1 else "; ".join(items) + f"; {bg}"
        if style == "background_first":
            return f"{_article(self.background)} {bg} with {_join(o.phrase() for o in objs)}"
        if style == "no_background":
            return _join(o.phrase() for o in objs)
        if style == "short":
            return _join(o.phrase(with_size=False, with_position=False) for o in objs)
        if style == "picture":
            return f"a picture of {_join(o.phrase() for o in objs)}, on {_article(self.background)} {bg}"
        raise ValueError(f"unknown caption style '{style}' (known: {', '.join(CAPTION_STYLES)})")

    def captions(self) -> dict[str, str]:
        """Every phrasing of the caption, by style."""
        return {s: self.caption(s) for s in CAPTION_STYLES}

    def random_caption(self, rng: np.random.Generator, styles: Sequence[str] = CAPTION_STYLES) -> str:
        """One phrasing chosen with ``rng`` (for training text-conditioned models)."""
        return self.caption(styles[int(rng.integers(len(styles)))])


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _join(parts: Iterable[str]) -> str:
    parts = list(parts)
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _allowed(value: Choice, vocabulary: Sequence[str], what: str, known: Optional[Sequence[str]] = None) -> tuple[str, ...]:
    """The names ``value`` allows: all of ``vocabulary`` for None, else the names given, each one of
    ``known`` (default: ``vocabulary``)."""
    if value is None:
        return tuple(vocabulary)
    known = vocabulary if known is None else known
    values = (value,) if isinstance(value, str) else tuple(value)
    bad = [v for v in values if v not in known]
    if bad or not values:
        raise ValueError(f"unknown {what} '{bad[0] if bad else ''}' (known: {', '.join(known)})")
    return values


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def split_seeds(split: str, n: int, offset: int = 0) -> range:
    """The first ``n`` seeds of a named split (after skipping ``offset``)."""
    try:
        r = SPLITS[split]
    except KeyError:
        raise ValueError(f"unknown split '{split}' (known: {', '.join(SPLITS)})") from None
    if offset < 0 or n < 0 or offset + n > len(r):
        raise ValueError(f"split '{split}' holds {len(r)} seeds; asked for {n} after {offset}")
    return r[offset : offset + n]


def split_of(seed: int) -> Optional[str]:
    """The split a seed belongs to (None if it lies outside every split)."""
    return next((name for name, r in SPLITS.items() if seed in r), None)


def _rng(seed: int) -> np.random.Generator:
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"a scene seed must be a non-negative integer, got {seed!r}")
    return np.random.default_rng(np.random.SeedSequence([int(seed), WORLD_VERSION, 0x5A4E]))


def make_scene(
    seed: int,
    *,
    n_objects: Optional[int] = None,
    shape: Choice = None,
    colour: Choice = None,
    object_size: Choice = None,
    position: Choice = None,
    background: Choice = None,
    objects: Optional[Sequence[dict]] = None,
) -> Scene:
    """The scene of ``seed``, optionally constrained.

    ``shape/colour/object_size/position`` constrain the main (first) object, each to one name or a
    list of allowed names; ``background`` constrains the background; ``objects`` gives one constraint
    dict per object (keys shape/colour/size/position, as in the labels) and fixes the object count. ``n_objects`` is 1 or 2
    (default: either, one object in half the scenes). Random draws happen in a fixed order, so a
    constraint changes only what it constrains where possible: ``make_scene(s, shape="star")``
    has the layout of ``make_scene(s)`` with the main object as a star.
    """
    rng = _rng(seed)
    per_object: list[dict] = [dict(o) for o in objects] if objects is not None else []
    if objects is not None and not 1 <= len(per_object) <= 2:
        raise ValueError("a scene has one or two objects")
    main_c = {k: v for k, v in dict(shape=shape, colour=colour, size=object_size, position=position).items() if v is not None}
    if main_c:
        if not per_object:
            per_object = [{}]
        per_object[0] = {**per_object[0], **main_c}

    # fixed draw order: count, background, then for each of two object slots its attributes
    draw_n = 1 + int(rng.integers(2))
    if objects is not None:
        n = len(per_object)
    elif n_objects is not None:
        if n_objects not in (1, 2):
            raise ValueError("n_objects must be 1 or 2")
        n = n_objects
    else:
        n = draw_n
    while len(per_object) < n:
        per_object.append({})

    bg_options = _allowed(background, tuple(BACKGROUNDS), "background")
    bg_u = rng.random()
    slots = []
    for _ in range(2):
        slots.append(
            {
                "shape": rng.random(),
                "colour": rng.random(),
                "size": rng.random(),
                "position": rng.random(),
                "jitter": rng.uniform(-1.0, 1.0, size=5),  # dx, dy, size, rotation, spare
                "rgb": rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, size=3),
            }
        )
    bg_jitter = rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, size=3)

    def by_u(u: float, options: Sequence[str]) -> str:
        return options[min(int(u * len(options)), len(options) - 1)]

    constraints = [
        {
            "shape": _allowed(c.get("shape"), SHAPES, "shape", known=ALL_SHAPES),
            "colour": _allowed(c.get("colour"), tuple(COLOURS), "colour"),
            "size": _allowed(c.get("size"), tuple(SIZES), "size"),
            "position": _allowed(c.get("position"), POSITIONS, "position"),
        }
        for c in per_object[:n]
    ]
    unknown = [k for c in per_object for k in c if k not in ("shape", "colour", "size", "position")]
    if unknown:
        raise ValueError(f"unknown object constraint '{unknown[0]}' (use shape, colour, size, position)")

    # background first, among those that suit every object's colour constraint
    bg_fit = [b for b in bg_options if all(set(c["colour"]) & set(allowed_colours(b)) for c in constraints)]
    if not bg_fit:
        raise ValueError("no background fits the colour constraints (an object never has the background's colour)")
    bg = by_u(bg_u, bg_fit)

    chosen: list[ShapeObject] = []
    fallback = np.random.default_rng(np.random.SeedSequence([int(seed), WORLD_VERSION, 0xFA11]))
    for i in range(n):
        c, s = constraints[i], slots[i]
        colours = [x for x in c["colour"] if x in allowed_colours(bg)]
        for attempt in range(200):
            u = s if attempt == 0 else {k: fallback.random() for k in ("shape", "colour", "size", "position")}
            obj = {
                "shape": by_u(u["shape"], c["shape"]),
                "colour": by_u(u["colour"], colours),
                "size": by_u(u["size"], c["size"]),
                "position": by_u(u["position"], c["position"]),
            }
            if chosen and not _compatible(chosen[0], obj):
                continue
            break
        else:
            raise ValueError("the constraints leave no room for a second object (it must not overlap the first)")
        jit = s["jitter"]
        diameter = SIZES[obj["size"]] * (1.0 + SIZE_JITTER * jit[2])
        cx, cy = POSITION_XY[obj["position"]]
        x = cx + POSITION_JITTER * jit[0]
        y = cy + POSITION_JITTER * jit[1]
        rotation = 0.0 if obj["shape"] == "circle" else ROTATION_JITTER * float(jit[3])
        rgb = tuple(int(v) for v in np.clip(np.array(COLOURS[obj["colour"]]) + s["rgb"], 0, 255))
        chosen.append(ShapeObject(obj["shape"], obj["colour"], obj["size"], obj["position"], float(x), float(y), float(diameter), rotation, rgb))
    bg_rgb = tuple(int(v) for v in np.clip(np.array(BACKGROUNDS[bg]) + bg_jitter, 0, 255))
    return Scene(int(seed), tuple(chosen), bg, bg_rgb)


def _compatible(first: ShapeObject, second: dict) -> bool:
    """A second object may join ``first``: not the same shape and colour, and no overlap."""
    if second["shape"] == first.shape and second["colour"] == first.colour:
        return False
    if second["position"] == first.position:
        return False
    (x1, y1), (x2, y2) = POSITION_XY[first.position], POSITION_XY[second["position"]]
    # worst case of the jitters: centres closer by 2*sqrt(2)*POSITION_JITTER, diameters larger
    gap = math.hypot(x1 - x2, y1 - y2) - 2 * math.sqrt(2) * POSITION_JITTER
    reach = (SIZES[first.size] * _EXTENT[first.shape] + SIZES[second["size"]] * _EXTENT[second["shape"]]) * (1 + SIZE_JITTER) / 2
    return gap > reach


# -- geometry of each shape, in units of the object's radius (y up) --------------------------------
def _regular(n: int, radius: float = 1.0, phase: float = 90.0) -> np.ndarray:
    a = np.deg2rad(phase + 360.0 * np.arange(n) / n)
    return np.stack([radius * np.cos(a), radius * np.sin(a)], axis=1)


def _star(points: int = 5, inner: float = 0.45) -> np.ndarray:
    a = np.deg2rad(90.0 + 180.0 * np.arange(2 * points) / points)
    r = np.where(np.arange(2 * points) % 2 == 0, 1.0, inner)
    return np.stack([r * np.cos(a), r * np.sin(a)], axis=1)


def _heart(n: int = 72) -> np.ndarray:
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    x = 16 * np.sin(t) ** 3
    y = 13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t)
    pts = np.stack([x, y], axis=1)
    pts -= (pts.max(0) + pts.min(0)) / 2  # centre the bounding box
    return pts / np.abs(pts).max()


def _cross(arm: float = 0.36) -> np.ndarray:
    a, b = arm, 1.0
    return np.array([[-a, b], [a, b], [a, a], [b, a], [b, -a], [a, -a], [a, -b], [-a, -b], [-a, -a], [-b, -a], [-b, a], [-a, a]])


def _arrow(shaft: float = 0.32, head: float = 0.85, neck: float = 0.0) -> np.ndarray:
    """An arrow pointing right: a shaft of half-height ``shaft`` from the left edge to ``neck``, a head
    from there to the right edge, ``head`` high on each side at its base."""
    return np.array([[-1.0, -shaft], [neck, -shaft], [neck, -head], [1.0, 0.0], [neck, head], [neck, shaft], [-1.0, shaft]])


def _triangle() -> np.ndarray:
    pts = _regular(3)
    pts[:, 1] -= (pts[:, 1].max() + pts[:, 1].min()) / 2  # centre the bounding box, not the centroid
    return pts * 1.08


_POLYGONS: dict[str, np.ndarray] = {
    "square": np.array([[-0.82, -0.82], [0.82, -0.82], [0.82, 0.82], [-0.82, 0.82]]),
    "triangle": _triangle(),
    "star": _star(),
    "heart": _heart(),
    "cross": _cross(),
    "diamond": np.array([[0.0, 1.0], [0.78, 0.0], [0.0, -1.0], [-0.78, 0.0]]),
    "hexagon": _regular(6),  # a regular hexagon, a corner at the top
    "arrow": _arrow(),  # pointing right (the scenes turn objects by a few degrees only)
}
# the largest distance from the centre each shape reaches, in radii (for the no-overlap rule)
_EXTENT: dict[str, float] = {s: max(1.0, float(np.hypot(*_POLYGONS[s].T).max())) if s in _POLYGONS else 1.0 for s in ALL_SHAPES}


def _rotate(pts: np.ndarray, degrees: float) -> np.ndarray:
    a = math.radians(degrees)
    c, s = math.cos(a), math.sin(a)
    return pts @ np.array([[c, s], [-s, c]])


# -- rendering -----------------------------------------------------------------------------------
def _supersampling(short_side: int) -> int:
    return 4 if short_side <= 256 else 2


def _coverage(obj: ShapeObject, width: int, height: int, ss: int) -> tuple[np.ndarray, int, int]:
    """Anti-aliased coverage (0..1) of ``obj`` over its bounding box; returns (alpha, left, top)."""
    short = min(width, height)
    r = obj.diameter * short / 2
    cx, cy = obj.x * width, obj.y * height
    reach = r * _EXTENT[obj.shape] + 2
    left, top = max(0, int(math.floor(cx - reach))), max(0, int(math.floor(cy - reach)))
    right, bottom = min(width, int(math.ceil(cx + reach))), min(height, int(math.ceil(cy + reach)))
    if right <= left or bottom <= top:
        return np.zeros((0, 0), np.float32), left, top
    w, h = right - left, bottom - top
    mask = Image.new("L", (w * ss, h * ss), 0)
    draw = ImageDraw.Draw(mask)
    # centre in supersampled box coordinates (pixel centres at +0.5)
    ox, oy = (cx - left) * ss, (cy - top) * ss
    rs = r * ss

    def poly(unit: np.ndarray, fill: int) -> None:
        p = _rotate(unit, obj.rotation) * rs
        pts = [(float(ox + px - 0.5), float(oy - py - 0.5)) for px, py in p]
        draw.polygon(pts, fill=fill)

    def disc(x: float, y: float, radius: float, fill: int) -> None:
        draw.ellipse([ox + x - radius - 0.5, oy - y - radius - 0.5, ox + x + radius - 0.5, oy - y + radius - 0.5], fill=fill)

    if obj.shape == "circle":
        disc(0.0, 0.0, rs, 255)
    elif obj.shape == "crescent":
        # a disc with a smaller disc cut out, offset towards the (rotated) right
        off = _rotate(np.array([[0.42, 0.12]]), obj.rotation)[0] * rs
        disc(0.0, 0.0, rs, 255)
        disc(float(off[0]), float(off[1]), 0.86 * rs, 0)
    else:
        poly(_POLYGONS[obj.shape], 255)
    small = mask.reduce(ss) if ss > 1 else mask
    return np.asarray(small, dtype=np.float32) / 255.0, left, top


def _size_pair(size: Union[int, Sequence[int]]) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)):
        w = h = int(size)
    else:
        w, h = (int(v) for v in size)
    if w < 8 or h < 8:
        raise ValueError(f"image size must be at least 8x8, got {w}x{h}")
    return w, h


def render_scene(scene: Scene, size: Union[int, Sequence[int]] = 64) -> np.ndarray:
    """Draw ``scene`` at ``size`` (an int for a square image, or (width, height)); (H, W, 3) uint8."""
    width, height = _size_pair(size)
    ss = _supersampling(min(width, height))
    canvas = np.empty((height, width, 3), dtype=np.float32)
    canvas[...] = np.asarray(scene.background_rgb, dtype=np.float32)
    for obj in scene.objects:
        alpha, left, top = _coverage(obj, width, height, ss)
        if alpha.size == 0:
            continue
        h, w = alpha.shape
        region = canvas[top : top + h, left : left + w]
        a = alpha[..., None]
        region *= 1.0 - a
        region += a * np.asarray(obj.rgb, dtype=np.float32)
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)


def shape_coverage(shape: str, x: float, y: float, diameter: float, rotation: float = 0.0, size: Union[int, Sequence[int]] = 64) -> np.ndarray:
    """The anti-aliased coverage (0..1, ``(H, W)`` float32) of one ``shape`` drawn as a scene draws it:
    centre ``(x, y)`` and ``diameter`` relative to the image (as in :class:`ShapeObject`), ``rotation``
    in degrees counter-clockwise. Shape templates for judging generated images against the world's shapes."""
    if shape not in ALL_SHAPES:
        raise ValueError(f"unknown shape '{shape}' (known: {', '.join(ALL_SHAPES)})")
    width, height = _size_pair(size)
    obj = ShapeObject(shape, "white", "medium", "center", float(x), float(y), float(diameter), float(rotation), (255, 255, 255))
    out = np.zeros((height, width), np.float32)
    alpha, left, top = _coverage(obj, width, height, _supersampling(min(width, height)))
    if alpha.size:
        out[top : top + alpha.shape[0], left : left + alpha.shape[1]] = alpha
    return out


@dataclass(frozen=True)
class Sample:
    """A rendered scene: ``image`` (H, W, 3) uint8 and its ``scene``; unpacks as ``image, scene``."""

    image: np.ndarray = field(repr=False)
    scene: Scene

    def pil(self) -> Image.Image:
        return Image.fromarray(self.image, "RGB")

    @property
    def caption(self) -> str:
        return self.scene.caption()

    @property
    def labels(self) -> dict:
        return self.scene.labels()

    def __iter__(self) -> Iterator:
        return iter((self.image, self.scene))


def render(seed: int, size: Union[int, Sequence[int]] = 64, **constraints) -> Sample:
    """Make and draw the scene of ``seed`` (constraints as in :func:`make_scene`)."""
    scene = make_scene(seed, **constraints)
    return Sample(render_scene(scene, size), scene)


def render_batch(seeds: Iterable[int], size: Union[int, Sequence[int]] = 64, **constraints) -> tuple[np.ndarray, list[Scene]]:
    """Draw many scenes: ``(N, H, W, 3)`` uint8 and their scenes."""
    scenes = [make_scene(s, **constraints) for s in seeds]
    width, height = _size_pair(size)
    out = np.empty((len(scenes), height, width, 3), dtype=np.uint8)
    for i, sc in enumerate(scenes):
        out[i] = render_scene(sc, (width, height))
    return out, scenes


# -- segmentation masks -------------------------------------------------------------------------
# the classes of a scene's mask: 0 the background, then the shapes in SHAPES' order
MASK_CLASSES: tuple[str, ...] = ("background", *SHAPES)
# with the EXTRA_SHAPES after them (a hexagon's pixels are class 9 in a scene that asks for one)
ALL_MASK_CLASSES: tuple[str, ...] = ("background", *ALL_SHAPES)


def render_mask(scene: Scene, size: Union[int, Sequence[int]] = 64) -> np.ndarray:
    """The exact class map of ``scene`` at ``size`` (as :func:`render_scene`): ``(H, W)`` uint8 ids
    into :data:`ALL_MASK_CLASSES`, 0 for the background, ``1 + ALL_SHAPES.index(shape)`` where an object covers
    at least half of the pixel (its supersampled coverage, the same geometry the image is drawn from)."""
    width, height = _size_pair(size)
    ss = _supersampling(min(width, height))
    mask = np.zeros((height, width), dtype=np.uint8)
    for obj in scene.objects:
        alpha, left, top = _coverage(obj, width, height, ss)
        if alpha.size == 0:
            continue
        h, w = alpha.shape
        region = mask[top : top + h, left : left + w]
        region[alpha >= 0.5] = 1 + ALL_SHAPES.index(obj.shape)
    return mask


def render_with_mask(seed: int, size: Union[int, Sequence[int]] = 64, **constraints) -> tuple[np.ndarray, np.ndarray, Scene]:
    """The scene of ``seed`` drawn at ``size``, its class map (:func:`render_mask`) and the scene."""
    scene = make_scene(seed, **constraints)
    return render_scene(scene, size), render_mask(scene, size), scene


def with_changes(scene: Scene, **changes) -> Scene:
    """A copy of ``scene`` with top-level fields replaced (e.g. another background)."""
    return replace(scene, **changes)


__all__ = [
    "WORLD_VERSION",
    "SHAPES",
    "EXTRA_SHAPES",
    "ALL_SHAPES",
    "COLOURS",
    "SIZES",
    "POSITIONS",
    "POSITION_XY",
    "POSITION_PHRASES",
    "BACKGROUNDS",
    "CAPTION_STYLES",
    "SPLITS",
    "MIN_CONTRAST",
    "ShapeObject",
    "Scene",
    "Sample",
    "make_scene",
    "render",
    "render_scene",
    "render_batch",
    "shape_coverage",
    "MASK_CLASSES",
    "ALL_MASK_CLASSES",
    "render_mask",
    "render_with_mask",
    "split_seeds",
    "split_of",
    "allowed_colours",
    "allowed_backgrounds",
    "colour_distance",
    "nearest_colour",
]
