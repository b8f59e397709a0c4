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
from typing import Any, Callable, Iterable, Optional, TypeVar

import torch
import torch.nn as nn

from gencli.checkpoints.keymap import IDENTITY, KeyMap
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError

M = TypeVar("M", bound=nn.Module)


def _more(items: list[str]) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


_INIT_FUNCTIONS = ("normal_", "uniform_", "trunc_normal_", "kaiming_normal_", "kaiming_uniform_", "xavier_normal_", "xavier_uniform_",
                   "zeros_", "ones_", "constant_", "orthogonal_")  # fmt: skip


def build_on_meta(factory: Callable[[], M]) -> M:
    """Construct a module without allocating its weights, and without running their random
    initialisation (a no-op on meta tensors, but its first call imports torch's reference ops,
    several seconds of start-up)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}
    try:
        for name in saved:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            return factory()
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


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
    replace: Optional[dict[str, Callable[[nn.Module, dict[str, torch.Tensor]], nn.Module]]] = None,
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

    ``replace`` maps submodule names to builders ``(meta_module, tensors) -> module``: such a
    module's tensors are read as private copies (in the target dtype, on the target device) and, as
    soon as its last one is read, handed to its builder, whose module takes its place; the tensors
    are then dropped. This is how a model is quantized while it loads: only one layer's dense
    weights exist at a time, and the file's pages stay out of the process's memory. Modules with a
    tied parameter are loaded as usual. A builder with an ``allocate(shape, dtype)`` attribute has
    the reads that need no conversion made into the tensors it gives (it keeps them as they are read).
    """
    device = torch.device(device)
    where = f"'{reader.source.path}' does not fit {what or type(model).__name__}"
    try:
        plan = keymap.plan(reader.keys(), config)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    ties = _Ties(model, plan)
    targets = model.state_dict(keep_vars=True)
    needed = [k for k in targets if k not in ties.alias_of]
    _check_names(needed, targets, plan, [re.compile(p) for p in optional], where)
    fp32_rx = [re.compile(p) for p in keep_fp32]
    col_rx = [re.compile(p) for p in column_major]
    state: dict[str, torch.Tensor] = {}
    replacing = _replaced(model, replace or {}, needed, plan, ties)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name in needed:
        if name not in plan:
            continue
        owner, _, attr = name.rpartition(".")
        target = targets[name]
        source_dtype = reader.dtype(plan[name].sources[0]) if len(plan[name].sources) == 1 else None
        want = target.dtype
        if target.is_floating_point() and (source_dtype is None or source_dtype.is_floating_point):
            want = torch.float32 if any(r.search(name) for r in fp32_rx) else (dtype or target.dtype)
        # a read that is converted anyway, or that the caller will modify in place, is a private copy
        private_read = device.type != "cpu" or (source_dtype is not None and source_dtype != want) or bool(private and private(name, target))
        private_read = private_read or owner in replacing
        # a replaced module's builder may say where the reads it keeps as they are should go
        allocate = getattr(replace[owner], "allocate", None) if owner in replacing and device.type == "cpu" and source_dtype == want else None
        tensor = _read(plan, name, _PrivateReads(reader, allocate) if private_read else reader, target, where)
        if not tensor.is_floating_point():
            want = target.dtype
        if owner in replacing:
            got = pending.setdefault(owner, {})
            got[attr] = tensor.to(device=device, dtype=want)
            del tensor
            if len(got) == replacing[owner]:
                module = model.get_submodule(owner)
                _set_attr(model, owner, replace[owner](module, pending.pop(owner)))  # type: ignore[index]
            continue
        column = any(r.search(n) for r in col_rx for n in ties.names_of.get(name, [name]))
        state[name] = _place(tensor, device, want, column_major=column)
        del tensor
    model.load_state_dict(state, strict=False, assign=True)
    del state

    ties.retie(model)
    for module in model.modules():
        hook = getattr(module, "init_buffers", None)
        if callable(hook):
            hook(device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"{where}: tensor '{left[0]}' was not loaded{_more(left)}")
    return model.eval()


def _replaced(model: nn.Module, replace: dict, needed: list[str], plan: dict, ties: "_Ties") -> dict[str, int]:
    """The modules of ``replace`` that are replaced while loading, each with the number of its tensors
    read from the checkpoint (all of them: a module missing one, or with a tied one, loads as usual)."""
    counts: dict[str, int] = {}
    for owner in replace:
        if not owner:
            raise ValueError("replace names submodules, not the model itself")
        module = model.get_submodule(owner)
        names = [f"{owner}.{n}" for n, _ in module.named_parameters(recurse=False)]
        names += [f"{owner}.{n}" for n, _ in module.named_buffers(recurse=False)]
        children = any(True for _ in module.children())
        if children or not names or any(n not in plan or n not in needed or len(ties.names_of.get(n, [n])) > 1 for n in names):
            continue
        counts[owner] = len(names)
    return counts


class _PrivateReads:
    """A reader whose every read is a private copy (see :meth:`TensorReader.get`)."""

    def __init__(self, reader: TensorReader, allocate: Optional[Callable[[tuple[int, ...], torch.dtype], torch.Tensor]] = None):
        self.reader, self.allocate = reader, allocate
        self.source = reader.source

    def get(self, name: str) -> torch.Tensor:
        return self.reader.get(name, private=True, allocate=self.allocate)


class _Ties:
    """Tied parameters appear under several names: one is loaded, the others re-tied to it afterwards."""

    def __init__(self, model: nn.Module, plan: dict):
        by_id: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), []).append(name)
        self.alias_of: dict[str, str] = {}  # alias -> the name that is loaded
        self.names_of: dict[str, list[str]] = {}  # name -> every name of the same parameter
        for names in by_id.values():
            for n in names:
                self.names_of[n] = names
            if len(names) > 1:
                present = [n for n in names if n in plan] or names[:1]
                for n in names:
                    if n != present[0]:
                        self.alias_of[n] = present[0]

    def retie(self, model: nn.Module) -> None:
        for alias, canonical in self.alias_of.items():
            _set_attr(model, alias, model.get_parameter(canonical))


def _check_names(needed: list[str], targets: dict, plan: dict, optional: list[re.Pattern], where: str) -> None:
    """Every tensor the model needs is in the checkpoint (unless optional), and nothing else is."""
    missing = [k for k in needed if k not in plan and not any(r.search(k) for r in optional)]
    if missing:
        raise CheckpointError(f"{where}: missing tensor '{missing[0]}'{_more(missing)}")
    unexpected = [k for k in plan if k not in targets]
    if unexpected:
        src = plan[unexpected[0]].describe()
        shown = f"'{unexpected[0]}'" + (f" (from '{src}')" if src != unexpected[0] else "")
        raise CheckpointError(f"{where}: unexpected tensor {shown}{_more(unexpected)}")


def _read(plan: dict, name: str, reader: TensorReader, target: torch.Tensor, where: str) -> torch.Tensor:
    """The checkpoint tensor for ``name``, checked against the shape the model expects."""
    try:
        tensor = plan[name](reader)
    except ValueError as exc:
        raise CheckpointError(f"'{reader.source.path}': {exc}") from None
    if tuple(tensor.shape) != tuple(target.shape):
        source = plan[name].describe()
        raise CheckpointError(
            f"{where}: tensor '{name}' has shape {list(tensor.shape)} in the checkpoint"
            f"{'' if source == name else ' (from ' + repr(source) + ')'}, "
            f"the model expects {list(target.shape)} (does config.json match the weights?)"
        )
    return tensor


def _place(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, *, column_major: bool) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype``; a converted 2-D weight column-major when asked (see load_state)."""
    converting = tensor.dtype != dtype or tensor.device != device  # a copy is made anyway
    if converting and column_major and tensor.dim() == 2 and tensor.is_floating_point():
        placed = torch.empty_strided(tuple(tensor.shape), (1, tensor.shape[0]), dtype=dtype, device=device)
        return placed.copy_(tensor)
    return tensor.to(device=device, dtype=dtype)


def _set_attr(model: nn.Module, dotted: str, value: nn.Module | nn.Parameter) -> None:
    """Set a submodule or parameter by its dotted name."""
    module_name, _, attr = dotted.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    setattr(module, attr, value)


def load_model(factory: Callable[[], M], reader: TensorReader, keymap: KeyMap = IDENTITY, **options: Any) -> M:
    """Build ``factory()`` on the meta device and load it from ``reader``; ``options`` are
    :func:`load_state`'s (``device``, ``dtype``, ``keep_fp32``, ``optional``, ``config``, ``what``,
    ``column_major``, ``private``, ``replace``)."""
    return load_state(build_on_meta(factory), reader, keymap, **options)


def save_model(
    model: nn.Module, path, *, dtype: Optional[torch.dtype] = None, metadata: Optional[dict[str, str]] = None, keep_dtype: Iterable[str] = ()
) -> None:
    """Write a module's state dict as safetensors (tied tensors stored once, contiguous, optional cast
    of the floating-point tensors except those whose name matches a ``keep_dtype`` pattern).

    Used by the training scripts that produce ``weights/`` and by ``gencli quantize``; the write is atomic.
    """
    from safetensors.torch import save_file

    from gencli.io import atomic_path

    keep_rx = [re.compile(p) for p in keep_dtype]
    state: dict[str, torch.Tensor] = {}
    stored: set[tuple] = set()
    for name, t in model.state_dict().items():
        ident = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() and ident in stored:
            continue  # a tied alias: stored once, under its first name
        stored.add(ident)
        t = t.detach()
        if dtype is not None and t.is_floating_point() and not any(r.search(name) for r in keep_rx):
            t = t.to(dtype)
        state[name] = t.contiguous().cpu()
    with atomic_path(path, force=True) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt", **(metadata or {})})
