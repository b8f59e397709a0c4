// The extension's one CPU-feature detector: the vector instruction sets this CPU runs, the one the
// kernels use (the best by default; the tests force a lower one), and the compiler target of the code
// written for each (the features the detector requires for it).
#pragma once

#include <cstdint>
#include <string>

// A region of code compiled for one instruction set: GENCLI_TARGET_... before, GENCLI_TARGET_END after.
#define GENCLI_TARGET_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma\")")
#define GENCLI_TARGET_AVX512 _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512dq,avx512vl,fma\")")
#define GENCLI_TARGET_AVX512VNNI _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma\")")
#define GENCLI_TARGET_END _Pragma("GCC pop_options")

namespace gencli {

// avx2: AVX2 and FMA; avx512: AVX-512 F, BW, DQ and VL (with FMA)
enum class Isa { none, avx2, avx512 };

struct CpuFeatures {
  bool avx2 = false;
  bool avx512 = false;
  bool avx512vnni = false;  // AVX-512 VNNI, on a CPU with avx512
};

// what this CPU has, read once
const CpuFeatures& cpu_features();
bool isa_supported(Isa isa);
Isa best_isa();

// the instruction set of the products and the decoder step's activations (the best one unless set)
Isa active_isa();
// use `isa` from now on: false, and no change, where the CPU lacks it
bool set_active_isa(Isa isa);
// the integer (int8-activation) products run on AVX-512 VNNI where AVX-512 is active and the CPU has it,
// else on AVX2
bool use_vnni();
// the float lanes of the active instruction set (16: AVX-512, 8: AVX2, 0: neither)
int vector_lanes();

// The decoding products' choices that differ between CPUs (cpu_features.cpp says what was measured):
// how far ahead each kind of weight stream is prefetched, how many fp32, int8 and int4 rows are read at
// once, whether int4's scales get a prefetch of their own and how many bytes of weight rows a task takes. Chosen at run time from the CPU's vendor (product_tuning_for),
// settable (the benches and the tests); only the speed depends on them, never a value.
struct ProductTuning {
  int64_t int8_ahead = 4096;    // int8 codes: bytes ahead, prefetched into L1 (0: no software prefetch)
  int64_t int4_ahead = 4096;    // int4 codes: bytes ahead, into L1 (0: none)
  int64_t dense_ahead = 8192;   // fp32 rows: bytes ahead, into L2 (0: none)
  int64_t bf16_ahead = 16384;   // bf16 rows: bytes ahead (0: none) ...
  int64_t bf16_level = 2;       // ... prefetched into L1 (1) or L2 (2)
  int64_t task_bytes = 65536;   // bytes of weight rows a task of the parallel products (rounded to 4 rows)
  int64_t tasks_per_thread = 0; // ... but at least this many tasks a thread where a call's rows allow (0: no bound)
  int64_t dense_rows = 4;       // fp32 rows multiplied together: 4 (weight_rows) or 1 (f32_row_tile: one stream, four sums)
  int64_t scale_prefetch = 0;   // int4: prefetch the scales and zero points of the rows the codes' prefetch reaches (1) or not (0)
  int64_t int8_rows = 4;        // int8 rows multiplied together (int8 activations): 4 or 1
  int64_t int4_rows = 2;        // int4 rows multiplied together (int8 activations): 2 or 1
  int64_t step_team = 1;        // the decoding step in one parallel region of a team of threads (1, team.h), or one a product (0)
};
bool cpu_is_amd();
ProductTuning product_tuning_for(bool amd);
// the tuning in use (product_tuning_for this CPU unless changed)
ProductTuning& product_tuning();

// "avx512", "avx2", "" for none; and back (anything else: none)
std::string isa_name(Isa isa);
Isa isa_named(const std::string& name);

}  // namespace gencli
