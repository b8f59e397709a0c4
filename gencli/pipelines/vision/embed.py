"""Image embeddings (``gencli embed --images``): one vector per image from a CLIP, ViT/DeiT or SimCLR checkpoint.

What each family gives:

- **CLIP** (a transformers ``CLIPModel`` folder): the image tower's projected embedding,
  L2-normalised (transformers' ``get_image_features``, then divided by its norm): texts embedded by
  the same model's text tower (:func:`clip_text_embeddings`) compare with it by dot product.
- **ViT / DeiT** (``ViTForImageClassification``, ``DeiTForImageClassification...`` or a bare
  ``ViTModel`` folder): the [CLS] token's final hidden state after the last LayerNorm, i.e.
  transformers' ``last_hidden_state[:, 0]`` (the vector the classification head reads). A bare
  ``ViTModel``'s tanh ``pooler`` is *not* applied (classification checkpoints do not carry it).
- **SimCLR** (gencli's own ``model_type: simclr`` folder, :mod:`gencli.models.simclr`): the encoder's
  globally average-pooled representation ``h`` (the projection head is not part of a checkpoint).

ViT and SimCLR vectors are returned as the model gives them unless ``normalize`` asks for unit
length; CLIP's are normalised unless ``normalize=False``. :func:`nearest` ranks a collection by cosine
similarity to query vectors (the ``--query`` listing).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from PIL import Image

from gencli.backend.device import Placement, choose_placement
from gencli.checkpoints.formats import CheckpointSource, command_for, detect_architecture, open_source, with_article, wrong_family
from gencli.errors import CheckpointError, UserError
from gencli.models.clip.model import l2_normalize
from gencli.pipelines.vision.images import ImageProcessor

DEFAULT_MODEL = "simclr-shapes"
WANTED = "an image encoder"
SUPPORTED = "embed --images runs CLIP (the image tower), ViT/DeiT ([CLS] feature) and SimCLR checkpoints"
VIT_TYPES = ("vit", "deit")


def checkpoint_family(src: CheckpointSource) -> Optional[str]:
    """``"clip"``, ``"vit"`` or ``"simclr"`` for a checkpoint ``embed --images`` runs, else None."""
    if src.kind == "diffusers-pipeline":
        return None
    cfg = src.config or {}
    model_type = cfg.get("model_type")
    if model_type == "simclr":
        return "simclr"
    if model_type in VIT_TYPES:
        return "vit"
    arch = detect_architecture(src) or ""
    if arch == "CLIPModel" or model_type == "clip":
        return "clip"
    return None


def is_clip_checkpoint(path: str | Path, allow_pickle: bool = False) -> bool:
    """Whether ``path`` holds a CLIPModel (both towers): ``embed TEXT...`` then runs its text tower."""
    return checkpoint_family(open_source(path, allow_pickle=allow_pickle)) == "clip"


@dataclass
class ImageEmbedder:
    """A loaded image encoder: ``embed(images) -> (N, D)`` float32 on the CPU."""

    family: str
    encode: Callable[[torch.Tensor], torch.Tensor]  # preprocessed pixels -> (N, D) features
    processor: ImageProcessor
    placement: Placement
    path: Path
    normalize: bool
    clip: Any = None  # the ClipBundle, for CLIP checkpoints

    def describe(self) -> str:
        what = {"clip": "CLIP image tower (projected)", "vit": "ViT [CLS] feature", "simclr": "SimCLR encoder representation"}[self.family]
        return f"{what}, {'L2-normalised' if self.normalize else 'unnormalised'}; {self.placement.describe()}"

    @torch.inference_mode()
    def embed(self, images: Sequence[Image.Image]) -> torch.Tensor:
        if not images:
            return torch.empty(0, 0)
        arrays = [self.processor.preprocess(im) for im in images]
        out: list[Optional[torch.Tensor]] = [None] * len(arrays)
        groups: dict[tuple, list[int]] = {}  # images of different preprocessed sizes run apart
        for i, a in enumerate(arrays):
            groups.setdefault(a.shape, []).append(i)
        for idx in groups.values():
            px = torch.from_numpy(np.stack([arrays[i] for i in idx])).to(self.placement.device, self.placement.dtype)
            feats = self.encode(px).float()
            if self.normalize:
                feats = l2_normalize(feats)
            feats = feats.cpu()
            for row, i in enumerate(idx):
                out[i] = feats[row]
        return torch.stack(out)  # type: ignore[arg-type]


def _processor(folder: Path, size: tuple[int, int], warn: Callable[[str], None], default_type: str = "ViTImageProcessor") -> ImageProcessor:
    if (folder / "preprocessor_config.json").is_file():
        return ImageProcessor.from_pretrained(folder, default_type=default_type)
    h, w = size
    warn(f"'{folder}' has no preprocessor_config.json: resizing to {h}x{w} (bilinear) and normalising with mean 0.5, std 0.5")
    return ImageProcessor.from_dict({"size": {"height": h, "width": w}})


def _load_vit(src: CheckpointSource, placement: Placement, allow_pickle: bool, warn: Callable[[str], None]):
    from gencli.checkpoints.keymap import Drop, KeyMap, Rename
    from gencli.checkpoints.loader import load_model
    from gencli.checkpoints.reader import open_reader
    from gencli.models.vit import ViTConfig, ViTModel, keymap_for

    reader = open_reader(src, allow_pickle=allow_pickle)
    keys = set(reader.keys())
    try:
        config = ViTConfig.from_dict(src.config or {}, distillation_head=False)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"'{src.path}': config.json is not a usable ViT config: {exc}") from None
    bare = KeyMap([Rename(r"^(embeddings|encoder|layernorm)\.", r"vit.\1."), Drop(r"^pooler\.")], "bare-vit")
    heads = KeyMap([Drop(r"^(classifier|distillation_classifier)\.")], "drop-heads")
    keymap = bare + keymap_for(keys) + heads
    model = load_model(lambda: torch.nn.ModuleDict({"vit": ViTModel(config)}), reader, keymap, device=placement.device, dtype=placement.dtype)
    model.requires_grad_(False)
    processor = _processor(src.folder or src.path.parent, config.image_size, warn, "DeiTImageProcessor" if config.model_type == "deit" else "ViTImageProcessor")
    return (lambda px: model["vit"](px)[:, 0]), processor


def _load_simclr(src: CheckpointSource, placement: Placement, allow_pickle: bool, warn: Callable[[str], None]):
    from gencli.checkpoints.loader import load_model
    from gencli.checkpoints.reader import open_reader
    from gencli.models.simclr import SimCLRConfig, SimCLREncoder

    try:
        config = SimCLRConfig.from_dict(src.config or {})
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"'{src.path}': config.json is not a usable SimCLR config: {exc}") from None
    reader = open_reader(src, allow_pickle=allow_pickle)
    model = load_model(lambda: SimCLREncoder(config), reader, device=placement.device, dtype=placement.dtype)
    model.requires_grad_(False)
    processor = _processor(src.folder or src.path.parent, (config.image_size, config.image_size), warn)
    return model, processor


def load_image_embedder(
    path: str | Path,
    *,
    normalize: Optional[bool] = None,
    device: str = "auto",
    dtype: str = "auto",
    threads: Optional[int] = None,
    allow_pickle: bool = False,
    warn: Callable[[str], None] = lambda _m: None,
) -> ImageEmbedder:
    """The image encoder of a CLIP, ViT/DeiT or SimCLR checkpoint; another family is one error naming
    the command that runs it (a text-only encoder: ``embed`` without ``--images``)."""
    src = open_source(path, allow_pickle=allow_pickle)
    family = checkpoint_family(src)
    if family is None:
        arch = detect_architecture(src) or ""
        if "gencli embed" in (command_for(arch) or ("", ""))[1] or arch.startswith("CLIPText"):  # a text encoder
            raise UserError(f"'{src.path}' holds {with_article(arch)}, a text-only model: {SUPPORTED}; embed texts with it without --images")
        raise wrong_family(src, WANTED, SUPPORTED)
    if family == "clip":
        from gencli.pipelines.clip import zeroshot as zs

        bundle = zs.load(path, device=device, dtype=dtype, threads=threads, allow_pickle=allow_pickle, warn=warn)
        return ImageEmbedder(
            "clip", bundle.image_features, bundle.processor, bundle.placement, Path(path), True if normalize is None else normalize, clip=bundle
        )
    placement = choose_placement(device, dtype, "transformer" if family == "vit" else "float", threads, n_params=src.num_parameters())
    load = _load_vit if family == "vit" else _load_simclr
    encode, processor = load(src, placement, allow_pickle, warn)
    return ImageEmbedder(family, encode, processor, placement, Path(path), bool(normalize))


def clip_text_embeddings(
    path: str | Path,
    texts: Sequence[str],
    *,
    normalize: Optional[bool] = None,
    batch_size: int = 256,
    device: str = "auto",
    dtype: str = "auto",
    threads: Optional[int] = None,
    allow_pickle: bool = False,
    warn: Callable[[str], None] = lambda _m: None,
) -> torch.Tensor:
    """A CLIP checkpoint's text-tower embeddings ``(N, projection_dim)`` (``get_text_features``),
    L2-normalised unless ``normalize=False``; float32 on the CPU, rows in input order. Texts longer
    than the 77-token window are truncated with a warning."""
    from gencli.pipelines.clip import zeroshot as zs
    from gencli.pipelines.clip.loading import truncation_notice

    if any(not t.strip() for t in texts):
        raise UserError("an empty text cannot be embedded")
    bundle = zs.load(path, device=device, dtype=dtype, threads=threads, allow_pickle=allow_pickle, warn=warn)
    for t in texts:
        notice = truncation_notice(bundle.tokenizer, t, bundle.text_context, "text")
        if notice:
            warn(notice)
    if normalize is False:
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                ids, mask = bundle.tokenizer(list(texts[start : start + batch_size]), max_length=bundle.text_context).tensors(bundle.placement.device)
                out.append(bundle.model.get_text_features(ids, mask).float())
        return torch.cat(out).cpu()
    return bundle.encode_texts(list(texts), batch_size=batch_size).float().cpu()


def nearest(queries: torch.Tensor, vectors: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """For each query row, the ``k`` rows of ``vectors`` most cosine-similar to it, best first:
    ``[(row, cosine), ...]`` (ties keep the input order)."""
    if k < 1:
        raise UserError("-k must be at least 1")
    sims = l2_normalize(queries.float()) @ l2_normalize(vectors.float()).t()
    k = min(k, vectors.shape[0])
    values, order = torch.sort(sims, dim=1, descending=True, stable=True)  # stable: ties keep the input order
    return [[(int(j), round(float(v), 6)) for j, v in zip(idx[:k].tolist(), vals[:k].tolist())] for idx, vals in zip(order, values)]


__all__ = ["DEFAULT_MODEL", "ImageEmbedder", "checkpoint_family", "is_clip_checkpoint", "load_image_embedder", "clip_text_embeddings", "nearest"]
