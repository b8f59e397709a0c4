"""Loading a segmentation model and running it: image -> per-pixel class ids at the image's size.

Two kinds of checkpoint:

- transformers ``SegformerForSemanticSegmentation`` folders as downloaded (``config.json`` with
  ``model_type: segformer``, ``model.safetensors``, ``preprocessor_config.json``; the
  ``SegformerImageProcessor`` defaults fill what the file leaves out: resize to 512x512 bilinear,
  rescale 1/255, ImageNet mean/std);
- gencli's :class:`~gencli.models.unet_segmenter.UNetSegmenter` (``config.json`` with
  ``"architecture": "UNetSegmenter"``, ``model.safetensors``, optionally a ``preprocessor_config.json``;
  without one the image runs at its own size, rescaled to [-1, 1]; with ``"only_shrink": true`` in it,
  its resize applies only to images larger than the size it names).

The logits are resized to the input image's size (bilinear, ``align_corners=False``) and the class
of a pixel is their argmax, as transformers' ``post_process_semantic_segmentation`` computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from gencli.backend.device import Placement, choose_placement
from gencli.checkpoints.formats import CheckpointSource, open_source, wrong_family
from gencli.checkpoints.keymap import IDENTITY
from gencli.checkpoints.loader import load_model
from gencli.checkpoints.reader import open_reader
from gencli.errors import CheckpointError, UserError
from gencli.pipelines.vision.images import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, ImageProcessor

DEFAULT_MODEL: Optional[str] = "unet-shapes"  # the embedded default (weights/unet-shapes)
WANTED = "a segmentation model"
SUPPORTED = "segment runs SegformerForSemanticSegmentation checkpoints and gencli's UNetSegmenter"

# SegformerImageProcessor's class defaults (what a preprocessor_config.json may leave out)
SEGFORMER_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_resize": True,
    "size": {"height": 512, "width": 512},
    "resample": 2,
    "do_center_crop": False,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": list(IMAGENET_DEFAULT_MEAN),
    "image_std": list(IMAGENET_DEFAULT_STD),
    "do_convert_rgb": True,
}
# the U-Net's default: the image at its own size, in [-1, 1]
UNET_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_resize": False,
    "do_center_crop": False,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}
# the class maps of this many logits at most are built at once (float32: 256 MB)
_ARGMAX_CHUNK = 64 << 20


def model_kind(src: CheckpointSource) -> Optional[str]:
    """The kind of segmentation model a checkpoint holds: "segformer", "unet", or None (another family)."""
    cfg = src.config or {}
    if cfg.get("architecture") == "UNetSegmenter":
        return "unet"
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") == "segformer" and (not archs or "SegformerForSemanticSegmentation" in archs):
        return "segformer"
    return None


def _processor(folder: Path, defaults: dict[str, Any]) -> ImageProcessor:
    from gencli.io import read_json

    raw = read_json(folder / "preprocessor_config.json", missing_ok=True) or {}
    merged = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    merged.pop("only_shrink", None)
    kind = merged.pop("image_processor_type", None) or merged.pop("feature_extractor_type", None)
    proc = ImageProcessor.from_dict(merged, default_type="ViTImageProcessor")
    if kind:
        proc.processor_type = str(kind)
    return proc


@dataclass
class Segmenter:
    """A loaded segmentation model, its preprocessing and its class names."""

    model: nn.Module
    processor: ImageProcessor
    labels: dict[int, str]
    kind: str  # "segformer" | "unet"
    placement: Placement
    path: Path
    # gencli's U-Net folders may set "only_shrink": the resize applies to images larger than its size
    # only (smaller ones run at their own size)
    only_shrink: bool = False

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        threads: Optional[int] = None,
        allow_pickle: bool = False,
        warn: Callable[[str], None] = lambda _m: None,
    ) -> "Segmenter":
        """Load a SegFormer or U-Net segmentation checkpoint, placed by ``--device/--dtype/--threads``;
        a checkpoint of another family is a UserError naming the command that runs it."""
        src = open_source(path, allow_pickle=allow_pickle)
        if src.kind == "diffusers-pipeline":
            raise wrong_family(src, WANTED, SUPPORTED)
        kind = model_kind(src)
        if kind is None:
            if not src.config:
                raise UserError(f"'{src.path}' has no config.json next to its weights: a segmentation model needs it (its architecture and id2label)")
            raise wrong_family(src, WANTED, SUPPORTED)
        folder = src.folder or Path(path).parent
        reader = open_reader(src, allow_pickle=allow_pickle)
        keys = set(reader.keys())
        if kind == "segformer":
            from gencli.models.segformer import SegformerConfig, SegformerForSemanticSegmentation, keymap_for

            try:
                config = SegformerConfig.from_dict(src.config)
            except (ValueError, TypeError) as exc:
                raise CheckpointError(f"'{src.path}': config.json is not a usable SegFormer config: {exc}") from None
            if not any(k.startswith("decode_head.") for k in keys):
                raise CheckpointError(f"'{path}' has no decode head (decode_head.*): it is a SegFormer backbone, not a segmentation model")
            placement = choose_placement(device, dtype, "transformer", threads, n_params=src.num_parameters())
            model = load_model(lambda: SegformerForSemanticSegmentation(config), reader, keymap_for(keys), device=placement.device, dtype=placement.dtype)
            labels = config.id2label
            if not (folder / "preprocessor_config.json").is_file():
                warn(f"'{folder}' has no preprocessor_config.json: resizing to 512x512 (bilinear) and normalising with ImageNet's mean and std")
            processor = _processor(folder, SEGFORMER_PROCESSOR_DEFAULTS)
        else:
            from gencli.models.unet_segmenter import UNetSegmenter, UNetSegmenterConfig

            try:
                uconfig = UNetSegmenterConfig.from_dict(src.config)
            except (ValueError, TypeError) as exc:
                raise CheckpointError(f"'{src.path}': config.json is not a usable UNetSegmenter config: {exc}") from None
            placement = choose_placement(device, dtype, "float", threads, n_params=src.num_parameters())
            model = load_model(lambda: UNetSegmenter(uconfig), reader, IDENTITY, device=placement.device, dtype=placement.dtype)
            labels = uconfig.id2label
            processor = _processor(folder, UNET_PROCESSOR_DEFAULTS)
            from gencli.io import read_json

            raw = read_json(folder / "preprocessor_config.json", missing_ok=True) or {}
            only_shrink = bool(raw.get("only_shrink"))
        model.requires_grad_(False)
        if kind == "segformer" and placement.device.type == "cpu":
            model.prepack_convolutions()  # oneDNN's weight layout, packed on the first call
        return cls(model, processor, labels, kind, placement, Path(path), only_shrink if kind == "unet" else False)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def min_size(self) -> int:
        """The smallest side the model's input may have."""
        if self.kind == "unet":
            return 2 ** (len(self.model.down) - 1)
        return 1

    @torch.inference_mode()
    def logits(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The model's logits ``(B, labels, h, w)`` for preprocessed pixel values (model resolution)."""
        px = pixel_values.to(device=self.placement.device, dtype=self.placement.dtype)
        return self.model(px)

    def preprocess(self, image: Image.Image) -> np.ndarray:
        proc = self.processor
        if self.only_shrink and proc.do_resize:
            h, w = proc.resize_to(image.height, image.width)
            if h >= image.height and w >= image.width:
                proc = replace(proc, do_resize=False)
        arr = proc.preprocess(image)
        if min(arr.shape[1:]) < self.min_size:
            raise UserError(f"an image of {arr.shape[2]}x{arr.shape[1]} pixels is too small for this model (at least {self.min_size} per side)")
        return arr

    def segment(self, images: list[Image.Image]) -> list[np.ndarray]:
        """The class map of each image: ``(H, W)`` integer ids at the image's own size."""
        arrays = [self.preprocess(im) for im in images]
        out: list[Optional[np.ndarray]] = [None] * len(images)
        groups: dict[tuple, list[int]] = {}
        for i, a in enumerate(arrays):
            groups.setdefault(a.shape, []).append(i)
        for idx in groups.values():
            logits = self.logits(torch.from_numpy(np.stack([arrays[i] for i in idx])))
            for row, i in enumerate(idx):
                out[i] = class_map(logits[row], (images[i].height, images[i].width))
        return out  # type: ignore[return-value]


@torch.inference_mode()
def class_map(logits: torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    """Argmax over the labels of ``logits`` ``(labels, h, w)`` resized to ``size`` (H, W) bilinearly
    (align_corners=False), in float32; ``(H, W)`` uint8 (int32 above 256 labels).

    Large maps are built a band of labels at a time (a running maximum; ties keep the lower id, as
    ``argmax`` does), so memory stays bounded for many classes at a large size."""
    n = logits.shape[0]
    h, w = size
    x = logits.float()[None]
    same = tuple(x.shape[2:]) == (h, w)
    chunk = max(1, _ARGMAX_CHUNK // max(1, h * w))
    best_val: Optional[torch.Tensor] = None
    best_idx: Optional[torch.Tensor] = None
    for start in range(0, n, chunk):
        part = x[:, start : start + chunk]
        up = part if same else F.interpolate(part, size=(h, w), mode="bilinear", align_corners=False)
        idx = up[0].argmax(dim=0)
        val = up[0].gather(0, idx[None])[0]
        idx = idx + start
        if best_val is None:
            best_val, best_idx = val, idx
        else:
            better = val > best_val
            best_val = torch.where(better, val, best_val)
            best_idx = torch.where(better, idx, best_idx)
    ids = best_idx.cpu().numpy()  # type: ignore[union-attr]
    return ids.astype(np.uint8 if n <= 256 else np.int32)


__all__ = ["Segmenter", "class_map", "model_kind", "DEFAULT_MODEL", "SEGFORMER_PROCESSOR_DEFAULTS"]
