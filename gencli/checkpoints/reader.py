"""Lazy tensor access over the weight files of a CheckpointSource.

safetensors files are memory-mapped (``safe_open``): a tensor is read only when asked for, so loading
a model reads each weight once, straight into its target dtype and device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open

from gencli.checkpoints.formats import PICKLE_REFUSAL, CheckpointSource, open_source
from gencli.errors import CheckpointError


class TensorReader:
    """name -> tensor over one checkpoint (single file, shards, or an opted-in pickle)."""

    def __init__(self, source: CheckpointSource, *, allow_pickle: bool = False):
        self.source = source
        self._handles: dict[Path, Any] = {}
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

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (a CPU tensor in the checkpoint's dtype)."""
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

    def close(self) -> None:
        self._handles.clear()
        self._state = None if self._state is None else {}

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
