"""`gencli similarity`: the image-text cosine similarity matrix of a CLIP model. The text embeddings
are computed once; images are then read and encoded in batches (:func:`gencli.pipelines.vision.images.predict_image_files`),
and the command renders the rows as a table, CSV or JSON lines."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from PIL import Image

from gencli.errors import UserError
from gencli.pipelines.clip.loading import ClipBundle, truncation_notice
from gencli.pipelines.clip.zeroshot import read_lines, similarity_matrix
from gencli.pipelines.vision.images import ImageResult


def parse_texts(texts: Optional[Sequence[str]], texts_file: Optional[str]) -> list[str]:
    """Texts from repeated ``--texts`` and/or ``--texts-file`` (one per line, ``-`` = stdin), blanks dropped."""
    from gencli.io import check_text

    for i, t in enumerate(texts or []):
        if not check_text(t, "--texts").strip():
            raise UserError(f"--texts {i + 1} is empty: every text is a column of the matrix")
    out = [t.strip() for t in texts or []]
    if texts_file:
        out.extend(read_lines(texts_file, "--texts-file"))
    if not out:
        raise UserError('no texts: give --texts "a red star" (repeatable) or --texts-file FILE')
    return out


class SimilarityScorer:
    """Cosine similarities of images to a fixed list of texts (embedded once, at construction)."""

    def __init__(self, bundle: ClipBundle, texts: Sequence[str], warn: Optional[Callable[[str], None]] = None):
        self.bundle = bundle
        self.texts = list(texts)
        if warn is not None:  # a text past the 77-token window is cut: say so, as zeroshot and embed do
            for i, t in enumerate(self.texts):
                notice = truncation_notice(bundle.tokenizer, t, bundle.text_context, "text" if len(self.texts) == 1 else f"text {i + 1}")
                if notice:
                    warn(notice)
        self.text_embeddings = bundle.encode_texts(self.texts)

    def __call__(self, images: Sequence[Image.Image]) -> list[list[float]]:
        """Per image, its cosine similarity to each text (rounded to 6 decimals), texts in order."""
        sims = similarity_matrix(self.bundle, images, self.text_embeddings).tolist()
        return [[round(v, 6) for v in row] for row in sims]


def similarity_record(result: ImageResult, texts: Sequence[str]) -> dict[str, Any]:
    """The JSON line of one image: ``{"image", "similarities": [{"text", "cosine"}]}`` (texts in
    order), or ``{"image", "error"}``."""
    if result.error is not None:
        return {"image": result.path, "error": result.error}
    return {"image": result.path, "similarities": [{"text": t, "cosine": v} for t, v in zip(texts, result.value)]}


__all__ = ["parse_texts", "SimilarityScorer", "similarity_record"]
