"""Deterministic data used by training, tests and evaluations."""
