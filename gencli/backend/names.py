"""The names users give devices and dtypes (no torch: the command line checks them before torch is
imported; :mod:`gencli.backend.device` turns them into torch objects)."""

from __future__ import annotations

import re

# auto | cpu | mps | cuda | cuda:N (group 3: the CUDA device index)
DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:(\d+))?)$")

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")

__all__ = ["DEVICE_PATTERN", "DTYPE_NAMES"]
