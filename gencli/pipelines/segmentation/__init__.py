"""Semantic segmentation (``gencli segment``): SegFormer checkpoints and gencli's U-Net, class maps,
palette PNG masks, overlays and per-class pixel counts."""
