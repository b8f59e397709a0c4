"""Build a module on the meta device and fill it from a checkpoint, each tensor read once.

The module is constructed without memory (``torch.device("meta")``); every weight is then read from
the memory-mapped checkpoint, cast to the target dtype, moved to the target device and assigned in
place of its meta placeholder. The model therefore never exists twice in memory (no random
initialisation followed by a copy). Non-persistent buffers (rotary tables, ...) are rebuilt by the
modules' ``init_buffers(device)`` hooks. Tied parameters (e.g. an LM head sharing the embedding)
stay tied.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Optional, TypeVar

import torch
import torch.nn as nn

from gencli.checkpoints.keymap import IDENTITY, KeyMap
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError

M = TypeVar("M", bound=nn.Module)


def _more(items: list[str]) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def build_on_meta(factory: Callable[[], M]) -> M:
    """Construct a module without allocating its weights."""
    with torch.device("meta"):
        return factory()


def load_state(
    model: nn.Module,
    reader: TensorReader,
    keymap: KeyMap = IDENTITY,
    *,
    device: torch.device | str = "cpu",
    dtype: Optional[torch.dtype] = None,
    keep_fp32: Iterable[str] = (),
    optional: Iterable[str] = (),
    config: Optional[dict] = None,
    what: Optional[str] = None,
    column_major: Iterable[str] = (),
    private: Optional[Callable[[str, torch.Tensor], bool]] = None,
) -> M:
    """Fill ``model`` (usually built on meta) from ``reader`` through ``keymap``.

    ``dtype`` applies to floating-point tensors except those whose target name matches a
    ``keep_fp32`` pattern; ``optional`` patterns name targets the checkpoint may lack (they keep
    their construction values, which must then not be on meta). Errors name the tensor:
    missing, unexpected, or shape mismatch.

    2-D weights whose name (or the name of a parameter tied to them) matches a ``column_major``
    pattern, and which are converted on the way (dtype or device), are stored column-major: same
    shape, strides ``(1, rows)``, i.e. the memory of the transposed matrix. ``F.linear`` then runs
    the BLAS product on the contiguous ``(in, out)`` matrix, which streams faster for the
    matrix-vector products of decoding on a CPU (about 9% here); embedding lookups on such a weight
    gather strided rows and stay exact. Tensors that need no conversion stay zero-copy views of the
    memory-mapped file: a column-major copy would keep both in memory.
    """
    device = torch.device(device)
    what = what or type(model).__name__
    origin = reader.source.path
    try:
        plan = keymap.plan(reader.keys(), config)
    except ValueError as exc:
        raise CheckpointError(f"'{origin}' does not fit {what}: {exc}") from None

    # Tied parameters appear under several names: load one, re-tie the others afterwards.
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    alias_of: dict[str, str] = {}
    names_of: dict[str, list[str]] = {}
    for names in by_id.values():
        for n in names:
            names_of[n] = names
        if len(names) > 1:
            present = [n for n in names if n in plan] or names[:1]
            for n in names:
                if n != present[0]:
                    alias_of[n] = present[0]

    targets = model.state_dict(keep_vars=True)
    opt_rx = [re.compile(p) for p in optional]
    fp32_rx = [re.compile(p) for p in keep_fp32]
    col_rx = [re.compile(p) for p in column_major]
    needed = [k for k in targets if k not in alias_of]
    missing = [k for k in needed if k not in plan and not any(r.search(k) for r in opt_rx)]
    if missing:
        raise CheckpointError(f"'{origin}' does not fit {what}: missing tensor '{missing[0]}'{_more(missing)}")
    unexpected = [k for k in plan if k not in targets]
    if unexpected:
        src = plan[unexpected[0]].describe()
        shown = f"'{unexpected[0]}'" + (f" (from '{src}')" if src != unexpected[0] else "")
        raise CheckpointError(f"'{origin}' does not fit {what}: unexpected tensor {shown}{_more(unexpected)}")

    state: dict[str, torch.Tensor] = {}
    for name in needed:
        if name not in plan:
            continue
        target = targets[name]
        source_dtype = reader.dtype(plan[name].sources[0]) if len(plan[name].sources) == 1 else None
        want = target.dtype
        if target.is_floating_point() and (source_dtype is None or source_dtype.is_floating_point):
            want = torch.float32 if any(r.search(name) for r in fp32_rx) else (dtype or target.dtype)
        private_read = device.type != "cpu" or (source_dtype is not None and source_dtype != want) or bool(private and private(name, target))
        try:
            tensor = plan[name](_PrivateReads(reader) if private_read else reader)
        except ValueError as exc:
            raise CheckpointError(f"'{origin}': {exc}") from None
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"'{origin}' does not fit {what}: tensor '{name}' has shape {list(tensor.shape)} in the checkpoint"
                f"{'' if plan[name].describe() == name else ' (from ' + repr(plan[name].describe()) + ')'}, "
                f"the model expects {list(target.shape)} (does config.json match the weights?)"
            )
        if not tensor.is_floating_point():
            want = target.dtype
        converting = tensor.dtype != want or tensor.device != device  # a copy is made anyway
        if converting and tensor.dim() == 2 and tensor.is_floating_point() and any(r.search(n) for r in col_rx for n in names_of.get(name, [name])):
            placed = torch.empty_strided(tuple(tensor.shape), (1, tensor.shape[0]), dtype=want, device=device)
            state[name] = placed.copy_(tensor)
        else:
            state[name] = tensor.to(device=device, dtype=want)
        del tensor
    model.load_state_dict(state, strict=False, assign=True)
    del state

    for alias, canonical in alias_of.items():
        _set_param(model, alias, model.get_parameter(canonical))
    for module in model.modules():
        hook = getattr(module, "init_buffers", None)
        if callable(hook):
            hook(device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"'{origin}' does not fit {what}: tensor '{left[0]}' was not loaded{_more(left)}")
    return model.eval()


class _PrivateReads:
    """A reader whose every read is a private copy (see :meth:`TensorReader.get`)."""

    def __init__(self, reader: TensorReader):
        self.reader = reader

    def get(self, name: str) -> torch.Tensor:
        return self.reader.get(name, private=True)


def _set_param(model: nn.Module, dotted: str, param: nn.Parameter) -> None:
    module_name, _, attr = dotted.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    setattr(module, attr, param)


def load_model(
    factory: Callable[[], M],
    reader: TensorReader,
    keymap: KeyMap = IDENTITY,
    *,
    device: torch.device | str = "cpu",
    dtype: Optional[torch.dtype] = None,
    keep_fp32: Iterable[str] = (),
    optional: Iterable[str] = (),
    config: Optional[dict] = None,
    column_major: Iterable[str] = (),
    private: Optional[Callable[[str, torch.Tensor], bool]] = None,
) -> M:
    """Build ``factory()`` on the meta device and load it from ``reader`` (see :func:`load_state`)."""
    model = build_on_meta(factory)
    return load_state(
        model,
        reader,
        keymap,
        device=device,
        dtype=dtype,
        keep_fp32=keep_fp32,
        optional=optional,
        config=config,
        column_major=column_major,
        private=private,
    )


def save_model(model: nn.Module, path, *, dtype: Optional[torch.dtype] = None, metadata: Optional[dict[str, str]] = None) -> None:
    """Write a module's state dict as safetensors (tied tensors stored once, contiguous, optional cast).

    Used by the training scripts that produce ``weights/``; the write is atomic.
    """
    from safetensors.torch import save_file

    from gencli.io import atomic_path

    state: dict[str, torch.Tensor] = {}
    stored: set[tuple] = set()
    for name, t in model.state_dict().items():
        ident = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() and ident in stored:
            continue  # a tied alias: stored once, under its first name
        stored.add(ident)
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        state[name] = t.contiguous().cpu()
    with atomic_path(path, force=True) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt", **(metadata or {})})
