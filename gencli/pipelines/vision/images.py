"""Image inputs shared by the image families (``classify``, ``zeroshot``, ``similarity``): reading files, the
reference image preprocessing, and the per-file loop of the image commands.

- :func:`load_image` reads any format PIL reads, applies the EXIF orientation and converts to RGB
  (transparency composited onto white, as transformers' ``convert_to_rgb`` does); an unreadable
  file raises :class:`ImageReadError` (a ``UserError``) naming the file.
- :class:`ImageProcessor` is built from a ``preprocessor_config.json`` and reproduces transformers'
  PIL-based ``ViTImageProcessor`` / ``DeiTImageProcessor`` / ``CLIPImageProcessor`` exactly
  (resize with PIL, center crop with zero padding, rescale in float64 then float32, normalise in
  float32): the ``pixel_values`` are bit-identical.
- :func:`predict_image_files` is the loop the image commands share: inputs from arguments,
  directories (``--recursive``) or ``-`` (paths on stdin, :func:`image_paths`); images read and
  predicted in batches; an unreadable file yields its error while the rest are processed. The
  commands render the results and exit 2 at the end if any input failed
  (:func:`unreadable_inputs_error`: a count after the per-file lines, none for a single input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Optional, Sequence, TypeVar

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from gencli.errors import Reported, UserError
from gencli.io import read_json

IMAGE_EXTENSIONS = (
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".gif", ".bmp", ".dib", ".webp", ".tif", ".tiff",
    ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".ico", ".jp2", ".j2k", ".avif", ".heic", ".qoi",
)  # fmt: skip

R = TypeVar("R")

IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD = (0.229, 0.224, 0.225)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# PIL resampling filters by the integers transformers stores in preprocessor_config.json
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
_RESAMPLE_BY_NAME = {v: k for k, v in RESAMPLE_NAMES.items()} | {"antialias": 1}


class ImageReadError(UserError):
    """An input image that cannot be read; ``reason`` is the message without the path."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"'{path}': {reason}")
        self.path = path
        self.reason = reason


# -- reading -------------------------------------------------------------------------------------
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # integer grey: 16-bit samples (0..65535)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB version of ``image``, the same rule for every mode PIL reads: 16-bit (and 32-bit integer)
    grey scaled to 8 bits (PIL alone clips them to white), palette, CMYK, 1-bit and grey converted,
    and any transparency (RGBA, LA, a palette's or a grey image's transparent colour) composited
    onto white (as transformers' ``convert_to_rgb`` does)."""
    if image.mode == "RGB":
        return image
    if image.mode in SIXTEEN_BIT_MODES:
        grey = np.asarray(image).astype(np.float64)
        image = Image.fromarray(np.clip(np.rint(grey / 257.0), 0, 255).astype(np.uint8), "L")
    elif image.mode == "F":
        grey = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0)
        scale = 255.0 if grey.size and grey.max() <= 1.0 else 1.0  # float images hold 0..1 (TIFF, EXR) or 0..255
        image = Image.fromarray(np.clip(np.rint(grey * scale), 0, 255).astype(np.uint8), "L")
    has_alpha = "A" in image.getbands() or "a" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(path: str | Path) -> Image.Image:
    """Read an image file (``-`` = the image on stdin): decoded now, EXIF orientation applied,
    converted to RGB (:func:`to_rgb`).

    Raises :class:`ImageReadError` (exit code 2 in the CLI) for a missing, unreadable or corrupt file.
    """
    import io

    from gencli.io import input_name, is_stdout, read_input_bytes

    name = input_name(path)
    if is_stdout(path):
        source: Any = io.BytesIO(read_input_bytes(path))
        if not source.getbuffer().nbytes:
            raise ImageReadError(name, "no image on stdin (it was empty)")
    else:
        source = Path(path)
        if not source.exists():
            raise ImageReadError(name, "no such file")
        if source.is_dir():
            raise ImageReadError(name, "is a directory, not an image file")
    try:
        with Image.open(source) as im:
            im.load()
            if getattr(im, "n_frames", 1) > 1:
                im.seek(0)
            image = ImageOps.exif_transpose(im)
            image = to_rgb(image)
            image.load()
    except UnidentifiedImageError:
        raise ImageReadError(name, "not an image file PIL can read") from None
    except PermissionError:
        raise ImageReadError(name, "permission denied") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageReadError(name, f"cannot decode the image ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if image.width < 1 or image.height < 1:
        raise ImageReadError(name, "the image is empty")
    return image


# -- writing -------------------------------------------------------------------------------------
def image_format(path: str | Path) -> str:
    """The PIL format an output image is written in, from its name's suffix (``.png``, ``.jpg``,
    ``.webp``, ...); PNG for ``-``, a device or a name without a suffix. A suffix that is not an
    image type PIL writes is one UserError (a ``.jpg`` never holds PNG bytes)."""
    from gencli.io import is_in_place

    suffix = Path(path).suffix.lower()
    if is_in_place(path) or not suffix:
        return "PNG"
    fmt = Image.registered_extensions().get(suffix)
    if fmt is None or fmt not in Image.SAVE:
        raise UserError(f"output '{path}': '{suffix}' is not an image type gencli writes (use .png, .jpg, .webp, .bmp, .tif or .gif)")
    return fmt


def image_bytes(pixels: Any, path: str | Path, text: Optional[dict[str, str]] = None) -> bytes:
    """uint8 RGB ``pixels (H, W, 3)`` (or a PIL image) encoded in the format ``path`` names
    (:func:`image_format`), deterministic bytes. ``text`` goes into PNG text chunks, the comment of a
    JPEG or GIF, and the EXIF UserComment of a JPEG or WebP (where A1111 writes its parameters)."""
    import io

    fmt = image_format(path)
    image = pixels if isinstance(pixels, Image.Image) else Image.fromarray(np.ascontiguousarray(pixels), "RGB")
    options: dict[str, Any] = {}
    if fmt == "PNG" and text:
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        for key, value in text.items():
            info.add_text(key, value)
        options["pnginfo"] = info
    elif fmt in ("JPEG", "GIF") and text:
        options["comment"] = "\n".join(text.values()).encode()
    if fmt in ("JPEG", "WEBP") and text:  # A1111 and the image sites read JPEG/WebP settings from EXIF's UserComment
        options["exif"] = exif_user_comment("\n".join(text.values()))
    if fmt == "JPEG":
        options["quality"] = 95
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


EXIF_USER_COMMENT = 0x9286  # in the Exif IFD (0x8769)
EXIF_IFD = 0x8769


def exif_user_comment(text: str) -> bytes:
    """EXIF bytes holding ``text`` as the UserComment, in the UNICODE (UTF-16 big-endian) encoding
    piexif's ``UserComment.dump`` writes (what A1111 stores in JPEG and WebP files)."""
    exif = Image.Exif()
    exif.get_ifd(EXIF_IFD)[EXIF_USER_COMMENT] = b"UNICODE\x00" + text.encode("utf-16-be")
    return exif.tobytes()


def read_user_comment(image: Image.Image) -> Optional[str]:
    """The EXIF UserComment of ``image`` as text (UNICODE in either byte order, ASCII, or undefined
    UTF-8), or None."""
    try:
        raw = image.getexif().get_ifd(EXIF_IFD).get(EXIF_USER_COMMENT)
    except Exception:  # a malformed EXIF block: as none
        return None
    if isinstance(raw, str):
        return raw or None
    if not isinstance(raw, bytes) or len(raw) < 8:
        return None
    head, body = raw[:8], raw[8:]
    if head == b"UNICODE\x00":  # big-endian is piexif's; some writers use little-endian: the reading with more ASCII wins
        readings = [body.decode(enc, errors="replace") for enc in ("utf-16-be", "utf-16-le")]
        return max(readings, key=lambda t: sum(ch.isascii() for ch in t)) or None
    try:
        return body.decode("utf-8").rstrip("\x00") or None
    except UnicodeDecodeError:
        return None


def write_image(path: str | Path, pixels: Any, text: Optional[dict[str, str]] = None, *, force: bool = False) -> Path:
    """Write one image through the output layer (:func:`gencli.io.write_output`): atomically to a
    file, in place to ``-``, a pipe or a device, in the format its name asks for."""
    from gencli.io import write_output

    return write_output(path, image_bytes(pixels, path, text), force=force)


# -- preprocessing -------------------------------------------------------------------------------
# class defaults of the reference image processors (what a preprocessor_config.json leaves out)
_PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "ViTImageProcessor": dict(
        do_resize=True, size={"height": 224, "width": 224}, resample=2, do_center_crop=None, crop_size=None,
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=IMAGENET_STANDARD_MEAN,
        image_std=IMAGENET_STANDARD_STD, do_convert_rgb=None, default_to_square=True,
    ),
    "DeiTImageProcessor": dict(
        do_resize=True, size={"height": 256, "width": 256}, resample=3, do_center_crop=True, crop_size={"height": 224, "width": 224},
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=IMAGENET_STANDARD_MEAN,
        image_std=IMAGENET_STANDARD_STD, do_convert_rgb=None, default_to_square=True,
    ),
    "CLIPImageProcessor": dict(
        do_resize=True, size={"shortest_edge": 224}, resample=3, do_center_crop=True, crop_size={"height": 224, "width": 224},
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=OPENAI_CLIP_MEAN,
        image_std=OPENAI_CLIP_STD, do_convert_rgb=True, default_to_square=False,
    ),
}  # fmt: skip
_ALIASES = {
    "ViTFeatureExtractor": "ViTImageProcessor",
    "DeiTFeatureExtractor": "DeiTImageProcessor",
    "CLIPFeatureExtractor": "CLIPImageProcessor",
}
_SIZE_KEYS = ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"}, {"longest_edge"}, {"max_height", "max_width"})


def _processor_kind(name: Optional[str]) -> Optional[str]:
    if not name:
        return None
    for suffix in ("Pil", "Fast"):
        if name.endswith(suffix) and name[: -len(suffix)] in _PROCESSOR_DEFAULTS:
            name = name[: -len(suffix)]
    return _ALIASES.get(name, name)


def _size_dict(value: Any, default_to_square: bool, what: str) -> Optional[dict[str, int]]:
    """transformers' ``get_size_dict``: ints and (h, w) pairs into the dictionary form."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise UserError(f"preprocessor config: '{what}' must be a size, got {value!r}")
    if isinstance(value, int):
        return {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"height": int(value[0]), "width": int(value[1])}
    if isinstance(value, dict) and set(value) in _SIZE_KEYS and all(isinstance(v, int) and v > 0 for v in value.values()):
        return {k: int(v) for k, v in value.items()}
    raise UserError(f"preprocessor config: '{what}' must be an int, [height, width] or a dict with height/width or shortest_edge, got {value!r}")


def _resample(value: Any) -> int:
    if isinstance(value, str) and value.lower() in _RESAMPLE_BY_NAME:
        return _RESAMPLE_BY_NAME[value.lower()]
    if isinstance(value, int) and not isinstance(value, bool) and value in RESAMPLE_NAMES:
        return value
    raise UserError(f"preprocessor config: unknown resample {value!r} (PIL filters 0-5: {', '.join(f'{k} {v}' for k, v in RESAMPLE_NAMES.items())})")


def _triple(value: Any, what: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    if isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value):
        return tuple(float(v) for v in value)
    raise UserError(f"preprocessor config: '{what}' must be a number or three numbers, got {value!r}")


@dataclass
class ImageProcessor:
    """The reference (PIL) image preprocessing of ViT/DeiT/CLIP checkpoints.

    Steps, each as transformers' PIL backend does it: resize with PIL (``size`` as height/width,
    shortest_edge [+ longest_edge], or max_height/max_width), center crop (zero padding when the
    image is smaller), rescale (float64 multiply, then float32), normalise ((x - mean) / std in float32).
    Output: ``(N, 3, H, W)`` float32.
    """

    do_resize: bool = True
    size: Optional[dict[str, int]] = field(default_factory=lambda: {"height": 224, "width": 224})
    resample: int = 2
    do_center_crop: bool = False
    crop_size: Optional[dict[str, int]] = None
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = IMAGENET_STANDARD_MEAN
    image_std: tuple[float, ...] = IMAGENET_STANDARD_STD
    do_convert_rgb: bool = True
    processor_type: str = "ViTImageProcessor"

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, config: dict[str, Any], default_type: str = "ViTImageProcessor") -> "ImageProcessor":
        """From the contents of a ``preprocessor_config.json``; fields left out take the defaults of
        the processor class it names (``image_processor_type``), else of ``default_type``."""
        kind = _processor_kind(config.get("image_processor_type") or config.get("feature_extractor_type")) or default_type
        defaults = dict(_PROCESSOR_DEFAULTS.get(kind) or _PROCESSOR_DEFAULTS[_processor_kind(default_type) or "ViTImageProcessor"])

        def get(key: str) -> Any:
            v = config.get(key)
            return defaults.get(key) if v is None else v

        square = bool(get("default_to_square"))
        size = _size_dict(get("size"), square, "size")
        crop = _size_dict(get("crop_size"), True, "crop_size")
        do_resize, do_crop = bool(get("do_resize")), bool(get("do_center_crop"))
        if do_resize and size is None:
            raise UserError("preprocessor config: do_resize is set but no size is given")
        if do_crop and (crop is None or set(crop) != {"height", "width"}):
            raise UserError("preprocessor config: do_center_crop needs crop_size with height and width")
        factor = get("rescale_factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool):
            raise UserError(f"preprocessor config: rescale_factor must be a number, got {factor!r}")
        std = _triple(get("image_std"), "image_std")
        if any(s == 0 for s in std):
            raise UserError("preprocessor config: image_std must not contain zeros")
        return cls(
            do_resize=do_resize,
            size=size,
            resample=_resample(get("resample")),
            do_center_crop=do_crop,
            crop_size=crop,
            do_rescale=bool(get("do_rescale")),
            rescale_factor=float(factor),
            do_normalize=bool(get("do_normalize")),
            image_mean=_triple(get("image_mean"), "image_mean"),
            image_std=std,
            do_convert_rgb=bool(get("do_convert_rgb")),
            processor_type=kind,
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path, default_type: str = "ViTImageProcessor") -> "ImageProcessor":
        """From ``folder/preprocessor_config.json``."""
        path = Path(folder) / "preprocessor_config.json"
        config = read_json(path, missing_ok=True)
        if config is None:
            raise UserError(f"'{folder}' has no preprocessor_config.json")
        return cls.from_dict(config, default_type)

    def to_dict(self) -> dict[str, Any]:
        """The ``preprocessor_config.json`` contents that rebuild this processor."""
        return {
            "image_processor_type": self.processor_type,
            "do_resize": self.do_resize,
            "size": self.size,
            "resample": self.resample,
            "do_center_crop": self.do_center_crop,
            "crop_size": self.crop_size,
            "do_rescale": self.do_rescale,
            "rescale_factor": self.rescale_factor,
            "do_normalize": self.do_normalize,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "do_convert_rgb": self.do_convert_rgb,
        }

    # -- the steps ------------------------------------------------------------------------------
    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the pixel values for an input of ``height x width``."""
        if self.do_center_crop:
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize:
            return self.resize_to(height, width)
        return height, width

    def resize_to(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the resize step produces (transformers' rules, ints truncated)."""
        s = self.size
        if "shortest_edge" in s and "longest_edge" in s:
            return _size_with_aspect_ratio(height, width, s["shortest_edge"], s["longest_edge"])
        if "shortest_edge" in s:
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = s["shortest_edge"], int(s["shortest_edge"] * long / short)
            return (new_long, new_short) if width <= height else (new_short, new_long)
        if "max_height" in s:
            scale = min(s["max_height"] / height, s["max_width"] / width)
            return max(int(height * scale), 1), max(int(width * scale), 1)
        if "height" in s:
            return s["height"], s["width"]
        raise UserError(f"preprocessor config: size {s} cannot be used for resizing")

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """One image -> ``(3, H, W)`` float32 pixel values."""
        if self.do_convert_rgb or image.mode != "RGB":
            image = to_rgb(image)
        if self.do_resize:
            h, w = self.resize_to(image.height, image.width)
            image = image.resize((w, h), resample=self.resample)
        arr = np.asarray(image)  # (H, W, 3) uint8
        arr = np.ascontiguousarray(arr.transpose(2, 0, 1))
        if self.do_center_crop:
            arr = _center_crop(arr, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            arr = (arr.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            if not np.issubdtype(arr.dtype, np.floating):
                arr = arr.astype(np.float32)
            mean = np.asarray(self.image_mean, dtype=arr.dtype)[:, None, None]
            std = np.asarray(self.image_std, dtype=arr.dtype)[:, None, None]
            arr = (arr - mean) / std
        return arr.astype(np.float32, copy=False)

    def __call__(self, images: Sequence[Image.Image]):
        """A batch of images -> a ``(N, 3, H, W)`` float32 torch tensor (all must come out the same size)."""
        import torch

        arrays = [self.preprocess(im) for im in images]
        shapes = {a.shape for a in arrays}
        if len(shapes) > 1:
            raise ValueError(f"images of different output sizes cannot be batched: {sorted(shapes)} (group them by size first)")
        return torch.from_numpy(np.stack(arrays)) if arrays else torch.empty(0, 3, 0, 0)


def _size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' ``get_size_with_aspect_ratio``: shortest edge ``size``, longest at most ``max_size``."""
    raw = None
    lo, hi = float(min(height, width)), float(max(height, width))
    if hi / lo * size > max_size:
        raw = max_size * lo / hi
        size = int(round(raw))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return (int(raw * height / width) if raw is not None else int(size * height / width)), size
    return size, (int(raw * width / height) if raw is not None else int(size * width / height))


def _center_crop(arr: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """Center crop of a (C, H, W) array; zero padding where the image is smaller than the crop."""
    _, h, w = arr.shape
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0 and top + crop_h <= h and left + crop_w <= w:
        return arr[:, top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    padded = np.zeros((arr.shape[0], new_h, new_w), dtype=arr.dtype)
    pad_top, pad_left = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[:, pad_top : pad_top + h, pad_left : pad_left + w] = arr
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top) : min(new_h, top + crop_h), max(0, left) : min(new_w, left + crop_w)]


# -- the per-file loop of the image commands -----------------------------------------------------
@dataclass
class ImageItem:
    """One input of an image command: its path and either the image or why it could not be read."""

    path: str
    image: Optional[Image.Image] = None
    error: Optional[str] = None


@dataclass
class ImageResult(Generic[R]):
    """What an image command made of one input: its result, or why the file could not be read."""

    path: str
    value: Optional[R] = None
    error: Optional[str] = None


def image_paths(inputs: Sequence[str], *, recursive: bool = False) -> list[str]:
    """Paths from arguments: files as given, directories expanded to their image files (recursively
    with ``recursive``), ``-`` = one path per line from stdin."""
    from gencli.io import expand_inputs

    return expand_inputs(list(inputs), recursive=recursive, extensions=IMAGE_EXTENSIONS)


def iter_image_batches(paths: Sequence[str], batch_size: int) -> Iterator[list[ImageItem]]:
    """Read ``paths`` lazily, ``batch_size`` at a time; unreadable files carry their error instead."""
    if batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    for start in range(0, len(paths), batch_size):
        batch = []
        for path in paths[start : start + batch_size]:
            try:
                batch.append(ImageItem(path, load_image(path)))
            except ImageReadError as exc:
                batch.append(ImageItem(path, error=exc.reason))
        yield batch


def predict_image_files(paths: Sequence[str], predict: Callable[[list[Image.Image]], Sequence[R]], *, batch_size: int = 16) -> Iterator[ImageResult[R]]:
    """The loop of the image commands: read ``paths`` in batches, ``predict`` each batch's readable
    images (one result per image), and yield one :class:`ImageResult` per input, in input order;
    an unreadable file yields its error and the others go on."""
    for batch in iter_image_batches(paths, batch_size):
        good = [it for it in batch if it.image is not None]
        results = iter(predict([it.image for it in good]) if good else [])
        for it in batch:
            yield ImageResult(it.path, error=it.error) if it.error is not None else ImageResult(it.path, next(results))


def result_record(result: ImageResult, key: str = "predictions") -> dict[str, Any]:
    """The JSON line of one image: ``{"image", KEY: value}``, or ``{"image", "error"}``."""
    if result.error is not None:
        return {"image": result.path, "error": result.error}
    return {"image": result.path, key: result.value}


def unreadable_inputs_error(failed: Sequence[str], total: int) -> UserError:
    """The error a command ends with (exit 2) when some of its ``total`` inputs could not be read:
    the count, after the per-file lines. A single input's own line says it all: then the error is
    :class:`~gencli.errors.Reported` (no second line)."""
    message = f"{len(failed)} of {total} input(s) could not be read" + (f" (first: '{failed[0]}')" if len(failed) > 1 else "")
    return Reported(message) if total == 1 else UserError(message)


__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageReadError",
    "load_image",
    "to_rgb",
    "ImageProcessor",
    "ImageItem",
    "ImageResult",
    "image_paths",
    "iter_image_batches",
    "predict_image_files",
    "unreadable_inputs_error",
    "result_record",
]
