// The CPU-feature detector (cpu_features.h), from the CPU's flags as GCC reads them.
#include "cpu_features.h"

namespace gencli {

namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 = f.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
  f.avx512vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
#endif
  return f;
}

Isa& active() {
  static Isa isa = best_isa();
  return isa;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::avx512: return cpu_features().avx512;
    case Isa::avx2: return cpu_features().avx2;
    default: return true;
  }
}

Isa best_isa() { return isa_supported(Isa::avx512) ? Isa::avx512 : isa_supported(Isa::avx2) ? Isa::avx2 : Isa::none; }

Isa active_isa() { return active(); }

bool set_active_isa(Isa isa) {
  if (isa == Isa::none || !isa_supported(isa)) return false;
  active() = isa;
  return true;
}

bool use_vnni() { return active_isa() == Isa::avx512 && cpu_features().avx512vnni; }

int vector_lanes() {
  switch (active_isa()) {
    case Isa::avx512: return 16;
    case Isa::avx2: return 8;
    default: return 0;
  }
}

std::string isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "";
  }
}

Isa isa_named(const std::string& name) { return name == "avx512" ? Isa::avx512 : name == "avx2" ? Isa::avx2 : Isa::none; }

}  // namespace gencli
