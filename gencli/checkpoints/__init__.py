"""Checkpoint I/O: find the weights (formats), read them lazily (reader), map their names (keymap)
and load them into modules built on the meta device (loader).

``formats`` and ``header`` are torch-free (``gencli info`` uses them); the rest imports torch.
"""

from gencli.checkpoints.formats import CheckpointSource, detect_architecture, open_source, register_detector
from gencli.checkpoints.header import read_header

__all__ = ["CheckpointSource", "detect_architecture", "open_source", "register_detector", "read_header"]
