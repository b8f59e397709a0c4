// The extension's one CPU-feature detector: the vector instruction sets this CPU runs, the one the
// kernels use (the best by default; the tests force a lower one), and the compiler target of the code
// written for each (the features the detector requires for it).
#pragma once

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

// "avx512", "avx2", "" for none; and back (anything else: none)
std::string isa_name(Isa isa);
Isa isa_named(const std::string& name);

}  // namespace gencli
