"""Deterministic data used by training, tests and evaluation: the shapes world, synthetic series, Python source."""
