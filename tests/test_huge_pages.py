"""Weights on transparent huge pages (gencli.backend.huge_pages, ``GENCLI_HUGE_PAGES=1``): off by
default; asked for, tensors come 2 MB aligned on mappings the kernel may back with huge pages, with
the same values; the text loader reads the streamed weights straight into them, quantized codes are
born there, a tied head stays tied, and the tokens are those of the ordinary pages."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _text_fixtures import gpt2_checkpoint, llama_checkpoint

from gencli.backend import huge_pages
from gencli.backend.huge_pages import HUGE_PAGE, empty_on_huge_pages, is_on_huge_pages, move_buffers_to_huge_pages, on_huge_pages
from gencli.backend.quantize import QuantizedLinear
from gencli.backend.streamed_linear import StreamedLinear

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_offered = pytest.mark.skipif(
    not _THP.exists() or "[never]" in _THP.read_text(), reason="this kernel offers no transparent huge pages (tensors stay ordinary there)"
)


@pytest.fixture
def asked(monkeypatch):
    """``GENCLI_HUGE_PAGES=1`` for one test, with tensors of any size going on huge-page mappings."""
    huge_pages.huge_pages_available.cache_clear()
    monkeypatch.setenv("GENCLI_HUGE_PAGES", "1")
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    yield
    huge_pages.huge_pages_available.cache_clear()


def _advised(tensor: torch.Tensor) -> bool:
    """Whether the kernel counts the mapping holding ``tensor`` as eligible for huge pages (advised)."""
    address = tensor.data_ptr()
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return False


def test_off_by_default_tensors_stay_as_they_are(monkeypatch):
    huge_pages.huge_pages_available.cache_clear()
    monkeypatch.delenv("GENCLI_HUGE_PAGES", raising=False)
    try:
        assert not huge_pages.huge_pages_available()
        w = torch.randn(1024, 1024)  # 4 MB
        assert on_huge_pages(w) is w
        assert empty_on_huge_pages((1024, 1024), torch.float32).shape == (1024, 1024)
        model = nn.Sequential(StreamedLinear(w, None))
        assert move_buffers_to_huge_pages(model, lambda m: isinstance(m, StreamedLinear)) == 0 and model[0].weight.data_ptr() == w.data_ptr()
    finally:
        huge_pages.huge_pages_available.cache_clear()


@thp_offered
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_a_copy_on_huge_pages_has_the_values_aligned_and_advised(asked, dtype):
    source = (torch.randn(1500, 1500) * 50).to(dtype)  # 2.25 MB or more: one huge page at least
    copy = on_huge_pages(source)
    assert copy is not source and copy.dtype == dtype and copy.shape == source.shape and copy.is_contiguous()
    assert copy.data_ptr() % HUGE_PAGE == 0 and is_on_huge_pages(copy) and _advised(copy)
    expected = source.clone()
    del source
    gc.collect()
    assert torch.equal(copy, expected)  # the mapping lives as long as the tensor
    assert on_huge_pages(copy) is copy  # there already: no second copy


@thp_offered
def test_a_strided_view_becomes_a_contiguous_copy_and_small_tensors_stay(asked, monkeypatch):
    base = torch.randn(300, 500)
    view = base.t()
    copy = on_huge_pages(view)
    assert copy.is_contiguous() and torch.equal(copy, view) and is_on_huge_pages(copy)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", HUGE_PAGE)
    small = torch.randn(100, 100)
    assert on_huge_pages(small) is small and not is_on_huge_pages(empty_on_huge_pages((100, 100), torch.float32))


@thp_offered
def test_moving_buffers_keeps_a_tied_weight_tied(asked):
    torch.manual_seed(0)
    embedding = nn.Embedding(64, 32)
    model = nn.ModuleDict({"embed": embedding, "head": StreamedLinear(embedding.weight, None), "proj": StreamedLinear(torch.randn(48, 32), None)})
    assert model["head"].weight.data_ptr() == embedding.weight.data_ptr()
    proj = model["proj"].weight.clone()
    moved = move_buffers_to_huge_pages(model, lambda m: isinstance(m, StreamedLinear))
    assert moved == 48 * 32 * 4
    assert model["head"].weight.data_ptr() == embedding.weight.data_ptr()  # tied: not copied
    assert is_on_huge_pages(model["proj"].weight) and torch.equal(model["proj"].weight, proj)


def test_the_reader_reads_a_private_copy_into_what_allocate_gives(tmp_path):
    from safetensors.torch import save_file

    from gencli.checkpoints.reader import open_reader

    w = torch.randn(33, 17)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    given = []

    def allocate(shape, dtype):
        given.append((shape, dtype))
        return torch.full(shape, float("nan"), dtype=dtype)

    with open_reader(tmp_path / "model.safetensors") as reader:
        got = reader.get("w", private=True, allocate=allocate)
        plain = reader.get("w", private=True)
    assert given == [((33, 17), torch.float32)] and torch.equal(got, w) and torch.equal(plain, w)


def _tokens(folder, **kw):
    from gencli.pipelines.text.generate import GenerationSettings, generate
    from gencli.pipelines.text.loading import load_text_model
    from gencli.pipelines.text.sampling import SamplingParams

    tm = load_text_model(folder, device="cpu", **kw)
    settings = GenerationSettings(max_new_tokens=12, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    return [c.token_ids for c in generate(tm, [("", [5, 9, 13]), ("", [8, 3, 11])], settings)], tm.model


def _layers(model):
    return [m for m in model.modules() if isinstance(m, (StreamedLinear, QuantizedLinear))]


@thp_offered
@pytest.mark.usefixtures("quant_kernels_built")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["float32", "bfloat16", "int8", "int4"])
def test_loaded_weights_go_on_huge_pages_and_decode_the_same_tokens(family, mode, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from gencli.pipelines.text import loading

    folder = tmp_path / family
    gpt2_checkpoint(folder) if family == "gpt2" else llama_checkpoint(folder)
    monkeypatch.setattr(loading, "COLUMN_MAJOR_MIN_BYTES", 0)  # fp32 models stream their rows from any size
    kw = {"dtype": mode} if mode in ("float32", "bfloat16") else {"dtype": "float32", "quantize": mode}
    monkeypatch.delenv("GENCLI_HUGE_PAGES", raising=False)
    huge_pages.huge_pages_available.cache_clear()
    want, plain = _tokens(folder, **kw)
    assert _layers(plain) and not any(is_on_huge_pages(m.weight) for m in _layers(plain))
    monkeypatch.setenv("GENCLI_HUGE_PAGES", "1")
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    huge_pages.huge_pages_available.cache_clear()
    try:
        got, model = _tokens(folder, **kw)
    finally:
        huge_pages.huge_pages_available.cache_clear()
    assert got == want
    holders: dict[int, int] = {}
    for _, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        holders[t.untyped_storage().data_ptr()] = holders.get(t.untyped_storage().data_ptr(), 0) + 1
    # every weight on huge pages but one another tensor shares (GPT-2's fp32 head, tied to its embedding)
    left = [m for m in _layers(model) if not is_on_huge_pages(m.weight)]
    assert all(holders[m.weight.untyped_storage().data_ptr()] > 1 for m in left), left
    assert len(left) == (1 if (family, mode) == ("gpt2", "float32") else 0)
