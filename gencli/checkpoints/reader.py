"""Lazy tensor access over the weight files of a CheckpointSource.

safetensors files are memory-mapped (``safe_open``): a tensor is read only when asked for, so loading
a model reads each weight once, straight into its target dtype and device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open

from gencli.checkpoints.formats import PICKLE_REFUSAL, CheckpointSource, open_source
from gencli.errors import CheckpointError


class TensorReader:
    """name -> tensor over one checkpoint (single file, shards, or an opted-in pickle)."""

    def __init__(self, source: CheckpointSource, *, allow_pickle: bool = False):
        self.source = source
        self._handles: dict[Path, Any] = {}
        self._files: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        self._state: Optional[dict[str, torch.Tensor]] = None
        if source.kind == "diffusers-pipeline":
            raise CheckpointError(f"'{source.path}' is a diffusers pipeline: open one of its components")
        if source.is_pickle:
            if not allow_pickle:
                raise CheckpointError(PICKLE_REFUSAL.format(path=source.path))
            self._state = {}
            for f in source.weight_files:
                self._state.update(_load_pickle(f))
            return
        for name in source.tensor_infos():
            self._where[name] = next(h.path for h in source.headers() if name in h.tensors)

    # -- queries --------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._state) if self._state is not None else list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in (self._state if self._state is not None else self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        if self._state is not None:
            return tuple(self._state[name].shape)
        info = next(h.tensors[name] for h in self.source.headers() if name in h.tensors)
        return info.shape

    def dtype(self, name: str) -> Optional[torch.dtype]:
        """The tensor's dtype as stored (from the header; None where torch has no such dtype)."""
        if self._state is not None:
            return self._state[name].dtype if name in self._state else None
        info = next((h.tensors[name] for h in self.source.headers() if name in h.tensors), None)
        return _TORCH_DTYPES.get(info.dtype) if info is not None else None

    def get(self, name: str, *, private: bool = False, allocate: Optional[Callable[[tuple[int, ...], torch.dtype], torch.Tensor]] = None) -> torch.Tensor:
        """Read one tensor (a CPU tensor in the checkpoint's dtype).

        By default a safetensors tensor is a view of the memory-mapped file: no copy, and its pages
        are read (and counted in the process's resident memory, as long as any tensor of the file
        is alive) when first touched. ``private=True`` reads the bytes with ordinary file reads into
        a new tensor instead, leaving the mapping untouched: for tensors that are converted or
        repacked anyway, this keeps the file's pages out of the process's memory. ``allocate(shape,
        dtype)`` gives the tensor a private read goes into (``torch.empty`` by default; the backend's
        huge-page memory for weights that are kept as they are read).
        """
        if private and self._state is None and name in self._where:
            return self._read_private(name, allocate or _empty)
        if self._state is not None:
            try:
                return self._state[name]
            except KeyError:
                raise CheckpointError(f"tensor '{name}' is not in '{self.source.path}'") from None
        try:
            path = self._where[name]
        except KeyError:
            raise CheckpointError(f"tensor '{name}' is not in '{self.source.path}'") from None
        handle = self._handles.get(path)
        try:
            if handle is None:
                handle = self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
            return handle.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"cannot read tensor '{name}' from '{path}': {exc}") from None

    def _read_private(self, name: str, allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> torch.Tensor:
        header = next(h for h in self.source.headers() if name in h.tensors)
        info = header.tensors[name]
        dtype = _TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            return self.get(name)
        out = allocate(tuple(info.shape), dtype)
        view = out.reshape(-1).view(torch.uint8).numpy()
        fh = self._files.get(header.path)
        try:
            if fh is None:
                fh = self._files[header.path] = open(header.path, "rb")  # closed in close()
            fh.seek(header.data_start + info.begin)
            got = fh.readinto(memoryview(view))
        except OSError as exc:
            raise CheckpointError(f"cannot read tensor '{name}' from '{header.path}': {exc.strerror or exc}") from None
        if got != info.end - info.begin:
            raise CheckpointError(f"cannot read tensor '{name}' from '{header.path}': the file ends early")
        return out

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()
        self._handles.clear()
        self._state = None if self._state is None else {}

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    **{code: getattr(torch, name) for code, name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")) if hasattr(torch, name)},
}  # fmt: skip


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """Only reached with --allow-pickle; ``weights_only=True`` refuses anything but tensors and containers."""
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any failure here is a bad file
        raise CheckpointError(f"cannot load '{path}' with torch.load(weights_only=True): {exc}".splitlines()[0]) from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]  # Lightning / original SD .ckpt
    if not isinstance(obj, dict):
        raise CheckpointError(f"'{path}' does not hold a state dict")
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def open_reader(path_or_source: str | Path | CheckpointSource, *, allow_pickle: bool = False) -> TensorReader:
    src = path_or_source if isinstance(path_or_source, CheckpointSource) else open_source(path_or_source, allow_pickle=allow_pickle)
    return TensorReader(src, allow_pickle=allow_pickle)
