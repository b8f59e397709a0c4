"""Benchmark cases for scripts/bench.py: one module per case (see bench.py for the interface)."""
