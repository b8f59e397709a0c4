"""What ``gencli segment`` makes of a class map: palette PNG masks, overlays with a legend, and the
per-class pixel counts.

- :func:`mask_image`: an 8-bit palette ("P") image whose pixel values are the class ids, so
  ``numpy.asarray(Image.open(mask))`` gives the ids back and an image viewer shows colours
  (:func:`palette`: PASCAL VOC's fixed palette, 256 distinct colours, class 0 black). More than 256
  classes do not fit a palette: such a map is a 16-bit grayscale PNG of the ids.
- :func:`overlay_image`: the image with each class's colour blended over its pixels (a class named
  "background" is left as it is) and a legend of the classes present.
- :func:`label_counts`: ``[{"id", "label", "pixels", "fraction"}]`` for the classes present, the
  largest first.
- :func:`write_image`: a PNG through gencli's output layer (never half-written, no silent overwrite;
  ``-``, a pipe or a device written in place).
"""

from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

BACKGROUND_NAMES = ("background", "bg", "__background__")


@functools.lru_cache(maxsize=1)
def palette() -> tuple[tuple[int, int, int], ...]:
    """256 distinct colours, PASCAL VOC's (the bits of the class id spread over R, G and B; 0 is black)."""
    out = []
    for i in range(256):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        out.append((r, g, b))
    return tuple(out)


def mask_image(ids: np.ndarray, num_labels: int = 0) -> Image.Image:
    """The class map ``(H, W)`` as a palette image (values = class ids), or 16-bit grayscale for a
    model of more than 256 classes (``num_labels``; every mask of a run in the same format) or ids above 255."""
    if num_labels > 256 or (ids.size and int(ids.max()) > 255):
        if ids.size and int(ids.max()) > 65535:
            raise ValueError("class ids above 65535 do not fit a PNG")
        # Pillow 13 no longer takes a mode with fromarray: a uint16 array makes an "I;16" image
        return Image.fromarray(np.ascontiguousarray(ids.astype(np.uint16)))
    img = Image.fromarray(ids.astype(np.uint8), "P")
    img.putpalette([v for rgb in palette() for v in rgb])
    return img


def label_counts(ids: np.ndarray, labels: dict[int, str]) -> list[dict[str, Any]]:
    """The classes present in ``ids``: ``{"id", "label", "pixels", "fraction"}``, most pixels first (then by id)."""
    counts = np.bincount(ids.ravel().astype(np.int64), minlength=len(labels))
    total = int(ids.size) or 1
    present = [int(i) for i in np.nonzero(counts)[0]]
    present.sort(key=lambda i: (-int(counts[i]), i))
    return [{"id": i, "label": labels.get(i, f"LABEL_{i}"), "pixels": int(counts[i]), "fraction": round(int(counts[i]) / total, 6)} for i in present]


def _is_background(name: str) -> bool:
    return name.strip().lower() in BACKGROUND_NAMES


def overlay_image(image: Image.Image, ids: np.ndarray, labels: dict[int, str], alpha: float = 0.5) -> Image.Image:
    """``image`` with each class's palette colour blended over its pixels (``alpha``; a class named
    background is not tinted) and, on the right, a legend of the classes present (colour and name)."""
    base = np.asarray(image.convert("RGB"), dtype=np.float32)
    pal = np.asarray(palette(), dtype=np.float32)
    ids_i = ids.astype(np.int64) % 256
    colours = pal[ids_i]
    weight = np.full(ids.shape, alpha, dtype=np.float32)
    for i, name in labels.items():
        if _is_background(name):
            weight[ids == i] = 0.0
    blended = base * (1 - weight[..., None]) + colours * weight[..., None]
    picture = Image.fromarray(np.clip(np.rint(blended), 0, 255).astype(np.uint8), "RGB")
    present = label_counts(ids, labels)
    font = ImageFont.load_default()
    probe = ImageDraw.Draw(picture)
    line = max(12, int(probe.textbbox((0, 0), "Ag", font=font)[3]) + 4)
    swatch = line - 4
    texts = [f"{r['id']} {r['label']} ({100 * r['fraction']:.1f}%)" for r in present]
    text_w = max((int(probe.textbbox((0, 0), t, font=font)[2]) for t in texts), default=0)
    legend_w = 8 + swatch + 6 + text_w + 8
    height = max(picture.height, 8 + line * len(present))
    canvas = Image.new("RGB", (picture.width + legend_w, height), (255, 255, 255))
    canvas.paste(picture, (0, 0))
    draw = ImageDraw.Draw(canvas)
    x0 = picture.width + 8
    for k, (r, t) in enumerate(zip(present, texts)):
        y = 4 + k * line
        draw.rectangle([x0, y, x0 + swatch, y + swatch], fill=palette()[r["id"] % 256], outline=(0, 0, 0))
        draw.text((x0 + swatch + 6, y), t, fill=(0, 0, 0), font=font)
    return canvas


def png_bytes(image: Image.Image) -> bytes:
    """``image`` encoded as a PNG, in memory (PIL's PNG writer seeks: a pipe cannot take it directly)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def write_image(path: str | Path, image: Image.Image, force: bool = False) -> Path:
    """Write ``image`` as a PNG through the output layer: a file atomically (refusing an existing
    one without ``force``), ``-``, a pipe or a device in place, never a terminal."""
    from gencli.io import write_output

    return write_output(path, png_bytes(image), force)


__all__ = ["palette", "mask_image", "label_counts", "overlay_image", "png_bytes", "write_image"]
