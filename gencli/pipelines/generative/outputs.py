"""Writing generated images: grids, PNG files with their settings, animated GIFs of latent walks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import numpy as np


def image_grid(images: np.ndarray, nrow: int, padding: int = 2) -> np.ndarray:
    """uint8 images ``(N, H, W, 3)`` tiled ``nrow`` per row with ``padding`` black pixels between
    and around them (torchvision's ``make_grid`` layout)."""
    n, h, w, c = images.shape
    cols = max(1, min(nrow, n))
    rows = (n + cols - 1) // cols
    grid = np.zeros((rows * (h + padding) + padding, cols * (w + padding) + padding, c), np.uint8)
    for i, im in enumerate(images):
        r, q = divmod(i, cols)
        y, x = padding + r * (h + padding), padding + q * (w + padding)
        grid[y : y + h, x : x + w] = im
    return grid


def write_png(path: Union[str, Path], image: np.ndarray, settings: dict[str, Any], *, force: bool = False) -> Path:
    """An RGB image (PNG, or the type the name asks for) written through the output layer, carrying
    ``settings`` as JSON in a ``gencli`` text chunk."""
    from gencli.pipelines.vision.images import write_image

    return write_image(path, image, {"gencli": json.dumps(settings, sort_keys=True)}, force=force)


def check_gif_name(path: Union[str, Path]) -> Path:
    """An animated GIF's output name: ``.gif`` (or no suffix); ``-``, a pipe or a device take any
    name. A suffix that names another type (``x.png``) is one UserError: a name never lies about
    its bytes."""
    from gencli.errors import UserError
    from gencli.io import is_in_place

    suffix = Path(path).suffix.lower()
    if suffix and suffix != ".gif" and not is_in_place(path):
        raise UserError(f"output '{path}': --gif writes an animated GIF, not a '{suffix}' file: give it the .gif suffix")
    return Path(path)


def write_gif(path: Union[str, Path], frames: np.ndarray, settings: dict[str, Any], *, frame_ms: int = 80, force: bool = False) -> Path:
    """An animated GIF looping forever over ``frames`` and back (a latent walk that returns), with
    ``settings`` as JSON in its comment, written through the output layer (to a name
    :func:`check_gif_name` accepts)."""
    import io

    from PIL import Image

    from gencli.io import write_output

    order = list(frames) + list(frames[-2:0:-1])
    images = [Image.fromarray(f) for f in order]
    check_gif_name(path)
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=frame_ms, loop=0,
                   comment=json.dumps(settings, sort_keys=True).encode())  # fmt: skip
    return write_output(path, buf.getvalue(), force=force)
