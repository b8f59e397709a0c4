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

bool cpu_is_amd() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

// Measured on two 2-core machines, decoding GPT-2-124M and Llama shapes at 1 and 2 threads, each choice
// against the others (docs/benchmarks.md).
// - The defaults, on an Intel Xeon (AVX-512 with AMX; 2 MB L2 a core). The quantized codes 4 KB ahead into L1
//   (a one-thread product over weights in memory: 0.6-0.9x the time without, at 256-4096 bytes on
//   layers of 3072x768, 768x3072). Dense weights further ahead, into L2 (one thread streaming 60 layers
//   of 3072x768, GB/s fp32 / bf16: 4096 bytes into L1 12.1 / 10.8, 16384 into L2 13.6 / 12.5, none 11.9
//   / 9.0; 1, 2 or 8 fp32 rows at once instead of 4 within 0.5 GB/s); fp32 rows 8192 bytes ahead decode
//   1-5% more tokens/s than 16384, 32768 3-9% fewer; the bf16 column-pair kernel keeps 16384 (8192 was
//   within the noise at 2 threads, slower at 1). Tasks of 64 kB.
// - An AMD EPYC (Zen 5, 1 MB L2 a core, 32 MB L3), each value against the others in one process
//   (tokens/s): its hardware prefetchers follow one fp32 stream a thread best, with no software prefetch
//   (1.1-1.2x four prefetched rows at once, GPT-2 and Llama shapes), and so do the quantized products:
//   int8 one row at a time with its codes 16 KB ahead (1.18-1.30x four rows 8 KB ahead at 1 and 2 threads,
//   GPT-2 and Llama; one row 8 KB ahead lost 0.8x on Llama at 2 threads; the fp32-activation int8 kernel,
//   four rows, 1.28x 8 KB ahead at 1 thread, 0.99x at 2), int4 one row at a time 8 KB ahead
//   (1.02-1.15x two rows; 16 KB 0.95x); int4's scales and zero points a prefetch of their own, every
//   line of them, as far ahead as the codes (1.8x none; 1.06-1.16x the first line of each row only, which
//   left rows of 3072 columns at 55% of the speed of rows of 768); bf16 8 KB ahead into L1 (1.11-1.12x
//   4 KB into L2 at one thread, GPT-2 and Llama; 0.99x and 1.08x at two; 16 KB 0.96-0.98x); tasks of
//   1 MB (fp32 1.05-1.08x 64 kB tasks; int4 unchanged), at least 2 a thread: with 4, two threads took
//   twice as many chunks from the shared counter, whose cache line then crosses between the cores each
//   time (int4 Llama shape at two threads 1.04-1.06x with 2, in both of the VM's bandwidth states; int8
//   and bf16 1.01-1.04x; 1 a thread 0.97x 2 in the slower state).
// - Both vendors: the decoding step in one parallel region of a team (step_team 1). On the AMD EPYC, each
//   against a region for each product and attention in one process, Llama shape at 2 threads: int4 1.06x,
//   int8 1.03x, bf16 and fp32 1.01x in the VM's slower memory state; int4 1.13x, int8 1.15x, bf16 1.04x,
//   fp32 1.03x in its faster one (where a region's fork and join and its threads' cold start cost most);
//   GPT-2 shape 1.00-1.05x. Tasks of 64 kB in the team 0.95-0.97x 1 MB; each thread prefetching the start
//   of its next rows after a barrier 0.97-1.02x (not kept). Not measured on the Intel Xeon.
ProductTuning product_tuning_for(bool amd) {
  ProductTuning t;
  if (amd) {
    t.int8_ahead = 16384;
    t.int4_ahead = 8192;
    t.dense_ahead = 0;
    t.bf16_ahead = 8192;
    t.bf16_level = 1;
    t.task_bytes = 1 << 20;
    t.tasks_per_thread = 2;
    t.dense_rows = 1;
    t.scale_prefetch = 1;
    t.int8_rows = 1;
    t.int4_rows = 1;
  }
  return t;
}

ProductTuning& product_tuning() {
  static ProductTuning tuning = product_tuning_for(cpu_is_amd());
  return tuning;
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
