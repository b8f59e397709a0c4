"""How good a generator's samples are, judged by an image classifier (default: the embedded
``vit-shapes``): the share it recognises with confidence, the class distribution of the samples
(mode coverage), and the Frechet distance between samples and real images in its feature space
(the FID of Heusel et al. 2017 with the shapes classifier in place of Inception).

The features are the classifier's class token after the final LayerNorm, the vector its linear
head reads; the scores are the head's softmax. Used by ``scripts/eval_generative.py`` (the figures
in the VAE and GAN weights READMEs) and by the quality-floor tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from gencli.pipelines.vision.classify import ImageClassifier


@dataclass
class Judged:
    """Per image: the classifier's feature vector, its top label and that label's score."""

    features: np.ndarray  # (N, hidden) float64
    labels: list[str]
    scores: np.ndarray  # (N,) top-1 probability


@torch.inference_mode()
def judge_images(clf: ImageClassifier, images: np.ndarray, batch_size: int = 128) -> Judged:
    """Features, top-1 labels and scores of uint8 images ``(N, H, W, 3)`` (all the same size),
    preprocessed as ``gencli classify`` preprocesses an image file."""
    feats, ids, scores = [], [], []
    for start in range(0, len(images), batch_size):
        px = np.stack([clf.processor.preprocess(Image.fromarray(a)) for a in images[start : start + batch_size]])
        px = torch.from_numpy(px).to(clf.placement.device, clf.placement.dtype)
        hidden = clf.model.vit(px)[:, 0]
        probs = clf.scores(clf.model.classifier(hidden).float())
        top, idx = probs.max(dim=-1)
        feats.append(hidden.double().cpu())
        ids.append(idx.cpu())
        scores.append(top.cpu())
    if not feats:
        return Judged(np.empty((0, clf.config.hidden_size)), [], np.empty(0))
    labels = [clf.labels[int(i)] for i in torch.cat(ids)]
    return Judged(torch.cat(feats).numpy(), labels, torch.cat(scores).double().numpy())


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The Frechet distance between Gaussians fitted to feature sets ``a`` and ``b`` ``(N, D)``:
    ``|mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2))``. The trace of the matrix square root is
    the sum of the square roots of the eigenvalues of ``S_a^(1/2) S_b S_a^(1/2)`` (symmetric and
    positive semi-definite, so no complex parts to discard)."""
    a64, b64 = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    mu_a, mu_b = a64.mean(0), b64.mean(0)
    s_a, s_b = torch.cov(a64.T), torch.cov(b64.T)
    w, v = torch.linalg.eigh(s_a)
    root_a = (v * w.clamp(min=0).sqrt()) @ v.T
    middle = torch.linalg.eigvalsh(root_a @ s_b @ root_a).clamp(min=0).sqrt().sum()
    return float((mu_a - mu_b).pow(2).sum() + torch.trace(s_a) + torch.trace(s_b) - 2 * middle)


def class_distribution(labels: Sequence[str], classes: Sequence[str]) -> dict:
    """Each class's share of ``labels``, how many classes occur, the smallest share, and the
    entropy of the distribution relative to the uniform one's (1 = every class equally often)."""
    n = max(1, len(labels))
    shares = {c: sum(1 for lab in labels if lab == c) / n for c in classes}
    entropy = -sum(p * math.log(p) for p in shares.values() if p > 0)
    return {
        "shares": {c: round(p, 4) for c, p in shares.items()},
        "classes_present": sum(1 for p in shares.values() if p > 0),
        "min_share": round(min(shares.values()), 4),
        "entropy_ratio": round(entropy / math.log(len(classes)), 4),
    }


def sample_report(samples: Judged, reference: Judged, classes: Sequence[str], threshold: float = 0.5) -> dict:
    """Recognised share (top-1 score above ``threshold``), the class distribution of the recognised
    samples, and the Frechet distance to ``reference`` (real images)."""
    confident = samples.scores > threshold
    return {
        "n": len(samples.labels),
        "recognised": round(float(confident.mean()), 4) if len(confident) else 0.0,
        "classes": class_distribution([lab for lab, c in zip(samples.labels, confident) if c], classes),
        "frechet_distance": round(frechet_distance(samples.features, reference.features), 4),
    }


__all__ = ["Judged", "judge_images", "frechet_distance", "class_distribution", "sample_report"]
