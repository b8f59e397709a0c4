"""Image classification with ViT / DeiT checkpoints: load -> preprocess -> run -> top-k.

A model folder is a transformers image-classification checkpoint: ``config.json`` (``model_type``
vit or deit, ``id2label``), ``model.safetensors`` (or shards, or an opted-in pickle) and
``preprocessor_config.json`` (resize / crop / rescale / normalise, honoured exactly). Scores are the
softmax of the logits (sigmoid for ``problem_type: multi_label_classification`` or a single
label), as transformers' image-classification pipeline computes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from PIL import Image

from gencli.backend.device import Placement, choose_placement
from gencli.checkpoints.formats import CheckpointSource, open_source, wrong_family
from gencli.checkpoints.loader import load_model
from gencli.checkpoints.reader import open_reader
from gencli.errors import CheckpointError, UserError
from gencli.models.vit import ViTConfig, ViTForImageClassification, keymap_for
from gencli.pipelines.vision.images import ImageProcessor

DEFAULT_MODEL = "vit-shapes"
SUPPORTED_TYPES = ("vit", "deit")


def _config_of(src: CheckpointSource) -> dict[str, Any]:
    if not src.config:
        raise UserError(f"'{src.path}' has no config.json next to its weights: a ViT checkpoint needs it (model_type, image_size, id2label ...)")
    return src.config


@dataclass
class ImageClassifier:
    """A loaded image classifier: model, preprocessing and labels."""

    model: ViTForImageClassification
    processor: ImageProcessor
    config: ViTConfig
    placement: Placement
    path: Path

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
    ) -> "ImageClassifier":
        """Load a ViT/DeiT classifier folder, placed by the user's ``--device/--dtype/--threads``."""
        src = open_source(path, allow_pickle=allow_pickle)
        placement = choose_placement(device, dtype, "transformer", threads, n_params=src.num_parameters())
        if src.kind == "diffusers-pipeline":
            raise wrong_family(src, "an image classifier")
        raw = _config_of(src)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise wrong_family(src, "an image classifier", "classify runs ViT and DeiT image classifiers (model_type vit or deit)")
        reader = open_reader(src, allow_pickle=allow_pickle)
        keys = set(reader.keys())
        if not any(k.endswith("classifier.weight") for k in keys):
            raise CheckpointError(f"'{path}' has no classification head (classifier.weight): it is a backbone, not an image classifier")
        try:
            config = ViTConfig.from_dict(raw, distillation_head="distillation_classifier.weight" in keys)
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"'{src.path}': config.json is not a usable ViT config: {exc}") from None
        model = load_model(
            lambda: ViTForImageClassification(config), reader, keymap_for(keys), device=placement.device, dtype=placement.dtype
        )
        model.requires_grad_(False)
        folder = src.folder or Path(path).parent
        if (folder / "preprocessor_config.json").is_file():
            processor = ImageProcessor.from_pretrained(folder, default_type="DeiTImageProcessor" if model_type == "deit" else "ViTImageProcessor")
        else:
            h, w = config.image_size
            processor = ImageProcessor.from_dict({"size": {"height": h, "width": w}})
            warn(f"'{folder}' has no preprocessor_config.json: resizing to {h}x{w} (bilinear) and normalising with mean 0.5, std 0.5")
        return cls(model, processor, config, placement, Path(path))

    @property
    def labels(self) -> dict[int, str]:
        return self.config.id2label

    @torch.inference_mode()
    def logits(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, labels)`` in float32 for preprocessed pixel values."""
        px = pixel_values.to(device=self.placement.device, dtype=self.placement.dtype)
        return self.model(px).float()

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type == "multi_label_classification" or self.config.num_labels == 1:
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)

    def predict(self, images: list[Image.Image], top_k: int = 5) -> list[list[dict[str, Any]]]:
        """Top-k ``{"label", "id", "score"}`` per image, best first."""
        if top_k < 1:
            raise UserError("--top-k must be at least 1")
        if not images:
            return []
        arrays = [self.processor.preprocess(im) for im in images]
        out: list[Optional[list[dict[str, Any]]]] = [None] * len(images)
        # images whose pixel values differ in size (no center crop) run in separate groups
        groups: dict[tuple, list[int]] = {}
        for i, a in enumerate(arrays):
            groups.setdefault(a.shape, []).append(i)
        k = min(top_k, self.config.num_labels)
        for idx in groups.values():
            px = torch.from_numpy(np.stack([arrays[i] for i in idx]))
            probs = self.scores(self.logits(px)).cpu()
            values, ids = probs.topk(k, dim=-1)
            for row, i in enumerate(idx):
                out[i] = [
                    {"label": self.labels[int(c)], "id": int(c), "score": round(float(s), 6)} for s, c in zip(values[row], ids[row])
                ]
        return out  # type: ignore[return-value]


__all__ = ["ImageClassifier", "DEFAULT_MODEL"]
