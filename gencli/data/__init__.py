"""Deterministic data generators used by training, tests and evaluation (the shapes world, series)."""
