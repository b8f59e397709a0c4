"""Read and validate a safetensors header without torch.

The format: 8 bytes little-endian header length N, N bytes of JSON ``{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}``, then the tensor data. Validating it here
(every tensor inside the file, sizes consistent with dtype and shape) turns a truncated or corrupt
file into one clear error that names the file and the tensor, before torch sees it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from math import prod
from pathlib import Path

from gencli.errors import CheckpointError

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8,
}  # fmt: skip

# names the way users know them (torch names)
DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
}  # fmt: skip

MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code, e.g. "F32"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return prod(self.shape) if self.shape else 1

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES.get(self.dtype, self.dtype.lower())


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    file_size: int
    data_start: int = 0  # byte offset of the data section in the file (8 + header length)


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file; raise CheckpointError naming what is wrong."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"'{p}' is not a safetensors file: only {size} bytes long")
            n = int.from_bytes(raw_len, "little")
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointError(f"'{p}' is not a valid safetensors file: header length {n} exceeds the file size {size} (truncated or not safetensors)")
            raw = fh.read(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read '{p}': {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"'{p}' is not a valid safetensors file: its header is not valid JSON (corrupt or not safetensors)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"'{p}' is not a valid safetensors file: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"'{p}' is corrupt: malformed header entry for tensor '{name}'") from None
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(f"'{p}': tensor '{name}' has unsupported dtype '{dtype}'")
        info = TensorInfo(name, dtype, shape, begin, end)
        if end < begin or end - begin != info.numel * DTYPE_SIZES[dtype]:
            raise CheckpointError(f"'{p}' is corrupt: tensor '{name}' ({dtype}, shape {list(shape)}) has a byte range of {end - begin} bytes")
        if end > data_size:
            raise CheckpointError(
                f"'{p}' is truncated: tensor '{name}' ends at byte {end} of the data section but the file holds only {data_size} bytes of data"
            )
        tensors[name] = info
    return SafetensorsHeader(p, tensors, {str(k): str(v) for k, v in metadata.items()}, size, 8 + n)
