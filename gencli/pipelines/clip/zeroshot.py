"""Zero-shot image classification and image-text similarity with a CLIP checkpoint.

- :class:`ZeroShotClassifier`: the label embeddings are computed once (prompt ensembling: each label
  is written into every template, the normalised text embeddings are averaged over templates and
  renormalised); each image is then scored against them: softmax over ``logit_scale * cosine``.
- :func:`similarity_matrix`: cosine similarities between images and texts.

Images go through the checkpoint's own ``preprocessor_config.json`` (transformers' CLIPImageProcessor,
reproduced exactly by :mod:`gencli.pipelines.vision.images`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from PIL import Image

from gencli.backend.device import choose_placement
from gencli.checkpoints.formats import open_source
from gencli.errors import UserError
from gencli.io import read_json
from gencli.pipelines.clip.loading import ClipBundle, load_clip, truncation_notice
from gencli.pipelines.vision.images import ImageProcessor

DEFAULT_MODEL = "clip-shapes"
DEFAULT_TEMPLATE = "a photo of a {}."
PLACEHOLDER = "{}"


def make_processor(folder: Path, image_size: int, warn: Optional[Callable[[str], None]] = None) -> ImageProcessor:
    """The checkpoint's image preprocessing; CLIP's defaults at the model's resolution when the folder
    has no ``preprocessor_config.json``."""
    if (folder / "preprocessor_config.json").is_file():
        proc = ImageProcessor.from_pretrained(folder, default_type="CLIPImageProcessor")
    else:
        if warn:
            warn(f"no preprocessor_config.json in '{folder}': using CLIP's preprocessing at {image_size}x{image_size}")
        proc = ImageProcessor.from_dict(
            {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": image_size}, "crop_size": {"height": image_size, "width": image_size}}
        )
    if proc.do_center_crop and (proc.crop_size["height"], proc.crop_size["width"]) != (image_size, image_size):
        raise UserError(
            f"'{folder}': preprocessor_config.json crops to {proc.crop_size['height']}x{proc.crop_size['width']}, the model takes {image_size}x{image_size}"
        )
    return proc


def load(
    path: str | Path,
    *,
    device: str = "auto",
    dtype: str = "auto",
    threads: Optional[int] = None,
    allow_pickle: bool = False,
    warn: Optional[Callable[[str], None]] = None,
) -> ClipBundle:
    """A CLIP checkpoint ready for zero-shot use (model, tokenizer, image preprocessing), placed by
    the user's ``--device/--dtype/--threads``."""
    n_params = open_source(path, allow_pickle=allow_pickle).num_parameters()
    placement = choose_placement(device, dtype, "transformer", threads, n_params=n_params)
    return load_clip(path, placement, allow_pickle=allow_pickle, processor_factory=lambda folder, size: make_processor(Path(folder), size, warn))


# -- inputs ------------------------------------------------------------------------------------------
def read_lines(path: str, option: str) -> list[str]:
    """The stripped, non-empty lines of a UTF-8 text file given to ``option`` (``-`` = stdin)."""
    from gencli.io import read_lines as read

    return [line.strip() for line in read(path, what=option)[0] if line.strip()]


def parse_labels(labels: Optional[str], labels_file: Optional[str]) -> list[str]:
    """Labels from ``--labels "a,b,c"`` or ``--labels-file`` (one per line; ``-`` = stdin), in order,
    without blanks; a repeated label is an error (its score would be split in two)."""
    out: list[str] = []
    if labels and labels_file:
        raise UserError("give either --labels or --labels-file, not both")
    if labels:
        from gencli.io import check_text

        out.extend(part.strip() for part in check_text(labels, "--labels").split(","))
    if labels_file:
        out.extend(read_lines(labels_file, "--labels-file"))
    out = [label for label in out if label]
    if not out:
        raise UserError("no labels: give --labels \"cat,dog,bird\" or --labels-file FILE (one label per line)")
    seen: set[str] = set()
    for label in out:
        if label in seen:
            raise UserError(f"label '{label}' is given twice")
        seen.add(label)
    return out


TEMPLATES_FILE = "zeroshot_templates.json"


def model_templates(path: Path) -> Optional[list[str]]:
    """The prompt templates a model folder recommends for zero-shot use (``zeroshot_templates.json``:
    a JSON list of strings with ``{}``, like the per-model template lists of open_clip), or None."""
    folder = path if path.is_dir() else path.parent
    f = folder / TEMPLATES_FILE
    data = read_json(f, expect=list, missing_ok=True)
    if data is None:
        return None
    if not data or not all(isinstance(t, str) for t in data):
        raise UserError(f"'{f}' must be a JSON list of prompt templates such as [\"a photo of a {PLACEHOLDER}.\"]")
    try:
        return check_templates(data)
    except UserError as e:
        raise UserError(f"'{f}': {e}") from None


def default_templates(path: Path) -> list[str]:
    """The templates used when none are given: the model's :data:`TEMPLATES_FILE`, else CLIP's."""
    return model_templates(path) or [DEFAULT_TEMPLATE]


def check_templates(templates: Optional[Sequence[str]]) -> list[str]:
    """The prompt templates (default: CLIP's "a photo of a {}."); each must contain ``{}``."""
    from gencli.io import check_text

    templates = [check_text(t, "--template") for t in templates or [DEFAULT_TEMPLATE]]
    for t in templates:
        if PLACEHOLDER not in t:
            raise UserError(f"template {t!r} has no {PLACEHOLDER} where the label goes (e.g. \"a photo of a {PLACEHOLDER}.\")")
    if len(set(templates)) != len(templates):
        raise UserError("a template is given twice")
    return templates


def fill(template: str, label: str) -> str:
    return template.replace(PLACEHOLDER, label)


# -- the two tasks -----------------------------------------------------------------------------------
def encode_images(bundle: ClipBundle, images: Sequence[Image.Image]) -> torch.Tensor:
    """Normalised image embeddings ``(N, D)`` (fp32) through the checkpoint's preprocessing."""
    if not images:
        return torch.empty(0, bundle.model.config.projection_dim)
    arrays = [bundle.processor.preprocess(im) for im in images]
    if len({a.shape for a in arrays}) == 1:
        return bundle.encode_pixels(torch.from_numpy(np.stack(arrays)))
    # no center crop and different aspect ratios: one at a time, positions interpolated to each size
    return torch.cat([bundle.encode_pixels(torch.from_numpy(a)[None]) for a in arrays])


class ZeroShotClassifier:
    """Scores images against a fixed label set; the label embeddings are computed once, at construction."""

    def __init__(
        self, bundle: ClipBundle, labels: Sequence[str], templates: Sequence[str] = (DEFAULT_TEMPLATE,), warn: Optional[Callable[[str], None]] = None
    ):
        """``warn`` gets a notice per label whose prompt does not fit the text tower's window (it is truncated)."""
        self.bundle = bundle
        self.labels = list(labels)
        self.templates = list(templates)
        prompts = [fill(t, label) for t in self.templates for label in self.labels]
        if warn is not None:
            for i in range(len(self.labels)):
                notice = truncation_notice(bundle.tokenizer, max(prompts[i :: len(self.labels)], key=len), bundle.text_context, f"label {i + 1}")
                if notice:
                    warn(notice)
        emb = bundle.encode_texts(prompts).view(len(self.templates), len(self.labels), -1)
        # prompt ensembling: average the normalised embeddings over templates, then renormalise
        mean = emb.mean(dim=0)
        self.label_embeddings = mean / mean.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        self.scale = bundle.temperature()

    def scores(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """``(N, labels)`` probabilities: softmax over ``logit_scale * cosine``."""
        emb = encode_images(self.bundle, images)
        logits = self.scale * emb @ self.label_embeddings.t()
        return logits.softmax(dim=-1).cpu()

    def predict(self, images: Sequence[Image.Image], top_k: Optional[int] = None) -> list[list[dict[str, Any]]]:
        """Per image, the ``top_k`` labels (all by default) as ``{"label", "score"}`` sorted by score."""
        probs = self.scores(images)
        k = len(self.labels) if top_k is None else max(1, min(top_k, len(self.labels)))
        values, indices = probs.topk(k, dim=-1)
        return [
            [{"label": self.labels[i], "score": round(float(v), 6)} for v, i in zip(vals.tolist(), idx.tolist())]
            for vals, idx in zip(values, indices)
        ]


def similarity_matrix(bundle: ClipBundle, images: Sequence[Image.Image], text_embeddings: torch.Tensor) -> torch.Tensor:
    """Cosine similarities ``(images, texts)`` against precomputed normalised text embeddings."""
    return (encode_images(bundle, images) @ text_embeddings.t()).cpu()


__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_TEMPLATE",
    "ZeroShotClassifier",
    "check_templates",
    "default_templates",
    "encode_images",
    "fill",
    "load",
    "make_processor",
    "parse_labels",
    "read_lines",
    "similarity_matrix",
]
