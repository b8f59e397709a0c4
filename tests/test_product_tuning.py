"""The decoding products' per-CPU choices (csrc/cpu_features.{h,cpp}: ProductTuning): prefetch
distances and the cache level bf16 rows are prefetched into, one stream a thread or several rows at
once (fp32, int8, int4), int4's scale prefetch, the bytes a task, the decoding step in one parallel
region or one a product.
They change the speed only: every product (fp32, bf16, int8 and int4, fp32 or int8 activations)
under each CPU's choices and under extreme ones equals the plain reference, at 1 and 2 threads and
on every instruction set this CPU has. The choice in use is the one made for this CPU's vendor."""

from __future__ import annotations

import pytest
import torch

from gencli.backend import quant_kernels
from gencli.backend.quantize import quantize_int4, quantize_int8

needs_kernels = pytest.mark.usefixtures("quant_kernels_built")

INTEL = {"int8_ahead": 4096, "int4_ahead": 4096, "dense_ahead": 8192, "bf16_ahead": 16384, "task_bytes": 65536, "tasks_per_thread": 0,
         "dense_rows": 4, "scale_prefetch": 0, "int8_rows": 4, "int4_rows": 2, "bf16_level": 2, "step_team": 1}
AMD = {"int8_ahead": 16384, "int4_ahead": 8192, "dense_ahead": 0, "bf16_ahead": 8192, "task_bytes": 1 << 20, "tasks_per_thread": 2,
       "dense_rows": 1, "scale_prefetch": 1, "int8_rows": 1, "int4_rows": 1, "bf16_level": 1, "step_team": 1}
# extremes: no prefetch at all; far prefetch with tiny tasks (every task a few rows, past every row's end)
EXTREMES = [
    {"int8_ahead": 0, "int4_ahead": 0, "dense_ahead": 0, "bf16_ahead": 0, "task_bytes": 1, "tasks_per_thread": 0, "dense_rows": 4,
     "scale_prefetch": 1, "int8_rows": 4, "int4_rows": 2, "bf16_level": 2, "step_team": 0},
    {"int8_ahead": 65536, "int4_ahead": 65536, "dense_ahead": 65536, "bf16_ahead": 65536, "task_bytes": 512, "tasks_per_thread": 64,
     "dense_rows": 1, "scale_prefetch": 1, "int8_rows": 1, "int4_rows": 1, "bf16_level": 1, "step_team": 1},
]


@pytest.fixture
def kernels():
    k = quant_kernels.cpu_kernels()
    if k is None:
        pytest.skip("no kernels")
    saved, threads = k.tuning(), torch.get_num_threads()
    yield k
    k.set_tuning(saved)
    torch.set_num_threads(threads)


@needs_kernels
def test_the_choice_in_use_is_this_cpus_and_each_vendor_has_its_own(kernels):
    assert kernels.default_tuning(False) == INTEL
    assert kernels.default_tuning(True) == AMD
    assert kernels.tuning() == kernels.default_tuning(kernels.cpu_vendor_amd())


@needs_kernels
def test_a_bad_choice_is_refused_and_changes_nothing(kernels):
    before = kernels.tuning()
    with pytest.raises(RuntimeError, match="unknown key 'prefetch'"):
        kernels.set_tuning({"int8_ahead": 0, "prefetch": 1})
    with pytest.raises(RuntimeError, match="must be >= 0"):
        kernels.set_tuning({"dense_ahead": -1})
    with pytest.raises(RuntimeError, match="dense_rows must be 1 or 4"):
        kernels.set_tuning({"dense_rows": 2})
    with pytest.raises(RuntimeError, match="scale_prefetch must be 0 or 1"):
        kernels.set_tuning({"scale_prefetch": 3})
    with pytest.raises(RuntimeError, match="int8_rows must be 1 or 4"):
        kernels.set_tuning({"int8_rows": 2})
    with pytest.raises(RuntimeError, match="int4_rows must be 1 or 2"):
        kernels.set_tuning({"int4_rows": 4})
    with pytest.raises(RuntimeError, match="bf16_level must be 1 or 2"):
        kernels.set_tuning({"bf16_level": 3})
    with pytest.raises(RuntimeError, match="step_team must be 0 or 1"):
        kernels.set_tuning({"step_team": 2})
    assert kernels.tuning() == before
    kernels.set_tuning({"task_bytes": 0})  # at least one byte: one row a task
    assert kernels.tuning()["task_bytes"] == 1


@needs_kernels
def test_the_kernels_scratch_starts_on_a_cache_line(kernels):
    # activations' copies, their int8 codes and the decoder step's buffers; a vector load from a
    # 16-byte aligned block would span two lines (bf16 products at 0.5-0.6x the speed on an AMD EPYC)
    sizes = [1, 3, 17, 768, 769, 3072, 3104, 11008, 5, 100003]
    assert kernels.scratch_misalignment(sizes) == [0] * (2 * len(sizes))


def _products(k, x, dense, bf16, q8, q4):
    out = list(k.dense_gemv_many(x, dense, [None] * len(dense)))
    out += list(k.dense_gemv_many(x, bf16, [None] * len(bf16)))
    for act in (False, True):
        out += list(k.int8_gemv_many(x, [q[0] for q in q8], [q[1] for q in q8], act, [None] * len(q8)))
        out += list(k.int4_gemv_many(x, [q[0] for q in q4], [q[1] for q in q4], [q[2] for q in q4], 32, act, [None] * len(q4)))
    return out


def _references(k, x, dense, bf16, q8, q4):
    out = [k.dense_gemv_reference(x, w, None) for w in dense + bf16]
    for act in (False, True):
        out += [k.int8_gemv_reference(x, q[0], q[1], act) for q in q8]
        out += [k.int4_gemv_reference(x, q[0], q[1], q[2], 32, act) for q in q4]
    return out


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("choice", ["intel", "amd", "extreme0", "extreme1"])
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_every_choice_computes_the_same_products(kernels, isa, threads, choice, rows):
    kernels.set_tuning({"intel": INTEL, "amd": AMD, "extreme0": EXTREMES[0], "extreme1": EXTREMES[1]}[choice])
    torch.set_num_threads(threads)
    torch.manual_seed(rows)
    K = 32 * 23  # 736: not a whole number of 64-float steps, vectors or int4 chunks
    shapes = (300, 96, 45)  # rows not a multiple of 4, several weights in one call
    ws = [torch.randn(n, K) * 0.05 for n in shapes]
    x = torch.randn(rows, K)
    dense, bf16 = ws, [w.bfloat16() for w in ws]
    q8, q4 = [quantize_int8(w) for w in ws], [quantize_int4(w, 32) for w in ws]
    got, want = _products(kernels, x, dense, bf16, q8, q4), _references(kernels, x, dense, bf16, q8, q4)
    for g, r in zip(got, want):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("choice", ["intel", "amd"])
def test_int4_rows_whose_scales_span_several_lines(kernels, isa, threads, choice):
    """Every line of a long row's scales and zero points is prefetched (3104 columns in groups of 32:
    97 scales, 194 bytes a row): the products are those of the reference, each row on its own or two
    at a time, with a lead of less than one row or of several."""
    kernels.set_tuning({"intel": INTEL, "amd": AMD}[choice])
    torch.set_num_threads(threads)
    torch.manual_seed(threads)
    K = 32 * 97
    w, x = torch.randn(37, K) * 0.05, torch.randn(2, K)
    q = quantize_int4(w, 32)
    for ahead in (1024, 8192, 65536):
        kernels.set_tuning({"int4_ahead": ahead})
        for act in (False, True):
            got = kernels.int4_gemv(x, q[0], q[1], q[2], 32, act)
            torch.testing.assert_close(got, kernels.int4_gemv_reference(x, q[0], q[1], q[2], 32, act), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_the_fp32_row_kernel_handles_rows_shorter_than_a_step(kernels, isa):
    """One fp32 stream a thread reads 4 vectors a step: rows of fewer columns, and tails, go by vector
    and by value."""
    kernels.set_tuning({"dense_rows": 1, "dense_ahead": 256})
    torch.manual_seed(0)
    for K in (1, 7, 16, 63, 65, 130):
        w, x = torch.randn(9, K), torch.randn(2, K)
        torch.testing.assert_close(kernels.dense_gemv(x, w), kernels.dense_gemv_reference(x, w, None), rtol=1e-5, atol=1e-6)


@needs_kernels
def test_the_bench_names_the_choices_and_the_cpu_generation(kernels, monkeypatch):
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    sys.modules.pop("bench_cases._machine", None)
    from bench_cases._machine import cpu_info, kernel_tuning

    kernels.set_tuning({"int4_ahead": 1234})
    line = kernel_tuning()
    assert "int4_ahead=1234" in line and f"task_bytes={kernels.tuning()['task_bytes']}" in line
    if Path("/proc/cpuinfo").exists() and "cpu family" in Path("/proc/cpuinfo").read_text():
        assert "(family " in cpu_info()["cpu"]
