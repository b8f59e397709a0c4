"""Weights that decoding streams, held on transparent huge pages (Linux; ``GENCLI_HUGE_PAGES=1``).

A CPU decoding step reads every weight of the model once: its speed is the speed at which memory is
read. Read through 4 KB pages, a 1 GB model crosses 250,000 pages a token, each a TLB entry to walk
to; on 2 MB pages it crosses 500. Measured on the project's 2-core Intel Xeon (AVX-512, AMX): the
fp32 row kernel over 277 MB of weights, medians of 7 rounds, 21.6 -> 23.1 GB/s at 2 threads and
13.6 -> 14.8 at 1 (+7-9%); decoding the 0.95 GB Llama-shaped model (hidden 1024, 16 layers) in
fp32 at 2 threads, the same weights on either kind of page in one process, 4-6% more tokens/s
(``scripts/bench_huge_pages.py``).

Linux gives an anonymous mapping huge pages when the kernel's transparent huge pages are ``always``,
or ``madvise`` (the common default) and the range was advised ``MADV_HUGEPAGE`` before it is
touched. :func:`empty_on_huge_pages` allocates such a tensor (2 MB aligned, a mapping of its own,
unmapped with the tensor's storage) and :func:`on_huge_pages` copies one there; the text loader reads
the weights it keeps as they are straight into them (the checkpoint loader's ``allocate`` hook: a
copy would touch fresh memory twice).

Why opt-in: the first touch of a fresh huge page is cheap on most machines (one fault for 2 MB), but
in a VM that hands freed memory back to its host (free page reporting, as the VM this project is built
on does) it cost 1.4-3 ms a page here, ten times 4 KB pages' cost: loading that 0.95 GB
model took 3.3-3.7 s instead of 1.4-1.6 s, which a run of a few hundred tokens never earns back. A
probe of a few pages cannot tell (it was fast or slow by chance of what the VM had freed), so the
choice is the user's, as torch's own ``THP_MEM_ALLOC_ENABLE`` is. Elsewhere (another OS, huge pages
``never``, tensors under 2 MB) tensors are ordinary; only the speed ever differs, never a value.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn

HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE  # smaller tensors stay ordinary (a huge page would be mostly empty)
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.lru_cache(maxsize=None)
def huge_pages_available() -> bool:
    """Whether weights go on transparent huge pages: ``GENCLI_HUGE_PAGES=1`` asks for them and the
    kernel offers them (``always``, or ``madvise`` as on most distributions). Off by default: see the
    module docstring for what they cost where memory is handed back to a VM's host."""
    if os.environ.get("GENCLI_HUGE_PAGES", "0") != "1" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _advised_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with ``nbytes`` from a 2 MB boundary advised onto huge pages, and that offset."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mapping)
    base = ctypes.addressof(view)
    del view  # (the buffer export ends here; the mapping lives as long as what is made of it)
    offset = -base % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % HUGE_PAGE)  # before any page is touched
    except OSError:
        mapping.close()
        raise
    return mapping, offset


def _worth_it(nbytes: int) -> bool:
    return nbytes >= MIN_BYTES and huge_pages_available()


def empty_on_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor on a mapping advised onto huge pages (``torch.empty``
    where that does not apply: under 2 MB, or no huge pages here)."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    if not _worth_it(nbytes):
        return torch.empty(tuple(shape), dtype=dtype)
    try:
        mapping, offset = _advised_mapping(nbytes)
    except OSError:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(tuple(shape))


def is_on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is contiguous and starts on a 2 MB boundary (where :func:`empty_on_huge_pages`
    puts it; the C allocator aligns large blocks to 64 bytes, not to 2 MB)."""
    return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.data_ptr() % HUGE_PAGE == 0


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values, contiguous, on huge pages: ``tensor`` itself where it is there already or
    where that does not apply (not a CPU tensor, under 2 MB, no huge pages here), else a copy."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or not _worth_it(nbytes) or is_on_huge_pages(tensor):
        return tensor
    return empty_on_huge_pages(tensor.shape, tensor.dtype).copy_(tensor)


def move_buffers_to_huge_pages(model: nn.Module, accept: Callable[[nn.Module], bool], names: Sequence[str] = ("weight",)) -> int:
    """Put the buffers ``names`` of the modules of ``model`` that ``accept`` takes on huge pages, one at
    a time (each old one freed as its copy exists). A buffer whose memory another tensor of the
    model shares (a head tied to the embedding) stays where it is: a copy would untie them. Returns
    the bytes moved (0 where huge pages cannot be had)."""
    if not huge_pages_available():
        return 0
    owners = {}
    everything = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for _, tensor in everything:
        if tensor.device.type == "cpu" and tensor.layout == torch.strided and tensor.numel():
            owners[tensor.untyped_storage().data_ptr()] = owners.get(tensor.untyped_storage().data_ptr(), 0) + 1
    moved = 0
    for module in model.modules():
        if not accept(module):
            continue
        for name in names:
            old = module._buffers.get(name)
            if old is None or old.device.type != "cpu" or owners.get(old.untyped_storage().data_ptr(), 0) > 1:
                continue
            new = on_huge_pages(old)
            if new is not old:
                module._buffers[name] = new
                moved += new.numel() * new.element_size()
            del old, new
    return moved


__all__ = ["HUGE_PAGE", "empty_on_huge_pages", "huge_pages_available", "is_on_huge_pages", "move_buffers_to_huge_pages", "on_huge_pages"]
