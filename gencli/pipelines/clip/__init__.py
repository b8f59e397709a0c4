"""CLIP: loading, zero-shot classification, image-text similarity."""
