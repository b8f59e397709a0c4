// Weight-only quantized matrix-vector products on a CPU, for decoding (a few activation rows).
//
// out[m, n] = sum_k x[m, k] * w[n, k] with w stored as gencli.backend.quantize stores it (kernels.h).
// Two kinds of kernels, both reading the stored codes in place (nothing is repacked):
// - integer (int8_activations, gemv_q8.inc): x is quantized per call to int8 in blocks of 32 columns
//   with one fp32 scale each (llama.cpp's Q8_0 activations) and multiplied by the codes with integer dot
//   products (AVX-512 VNNI vpdpbusd, 64 bytes at a time, or AVX2 maddubs + madd), converted to fp32 once
//   per vector of int32 sums and scaled by the block's and the weight's scales; the int4 zero points
//   multiply the exact fp32 group sums of x;
// - float (gemv_f32.inc): the codes are converted to fp32 in registers and multiplied with the fp32
//   activations (FMA), exact to fp32 rounding.
// The int4 kernels multiply the low nibbles by the even columns of x and the high ones by the odd
// columns (x is de-interleaved once per call). The instruction set is the one cpu_features.h makes
// active; rows of the weight are spread over torch's intra-op threads (inline OpenMP: the extension is
// built with -fopenmp). The tensor-level entry points (ops.h) are at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "cpu_features.h"
#include "kernels.h"
#include "ops.h"
#include "team.h"

namespace gencli {

namespace {

constexpr int kMaxRows = 4;         // activation rows handled together (each weight row is read once per tile)
constexpr int kInt4RowsAtOnce = 2;  // integer int4: weight rows multiplied together (on Intel 2 measured best of 1, 2, 4; ProductTuning::int4_rows: this or 1)
constexpr int kRowsAtOnce = 4;      // int8: weight rows multiplied together (each load of x serves them all; ProductTuning::int8_rows: this or 1)

// how far ahead each stream of weights is prefetched, and the bytes a task: ProductTuning (cpu_features.h),
// chosen per CPU (cpu_features.cpp says what was measured)
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// int4: how far ahead (bf16 values) a row's scales and zero points are prefetched: as many rows as the
// codes' lead, at least one (0: none; scale_prefetch off)
int64_t int4_scale_lead(int64_t K, int64_t groups) {
  const ProductTuning& t = product_tuning();
  return t.scale_prefetch ? std::max<int64_t>(1, t.int4_ahead / std::max<int64_t>(1, K / 2)) * groups : 0;
}

// every line of one row's scales and zero points (groups bf16 values each, 32 a line; a row of long
// rows spans several: 192 bytes at K 3072, G 32), from lead values on
inline void prefetch_int4_scales(const uint16_t* s, const uint16_t* z, int64_t groups, int64_t lead) {
  for (int64_t b = 0; b < groups; b += 32) {
    prefetch(s + lead + b);
    prefetch(z + lead + b);
  }
}

}  // namespace


// The kernel bodies (gemv_f32.inc, gemv_q8.inc), compiled for each instruction set on its vocabulary
GENCLI_TARGET_AVX512
namespace avx512 {
#include "simd_avx512.inc"
#include "gemv_f32.inc"
#include "act_quant.inc"

// int8 codes de-interleaved per chunk of 128: the chunk's 64 even columns, then its 64 odd ones (the
// int4 integer kernels' order on AVX-512)
inline void deinterleave_chunks(const int8_t* q, int64_t chunks, int8_t* out) {
  const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  for (int64_t c = 0; c < chunks; ++c) {
    for (int h = 0; h < 2; ++h) {  // columns 64 h .. 64 h + 63: their 32 even ones, then their 32 odd ones
      const __m512i v = _mm512_permutexvar_epi64(order, _mm512_shuffle_epi8(_mm512_loadu_si512(q + c * 128 + h * 64), pairs));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c * 128 + h * 32), _mm512_castsi512_si256(v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c * 128 + 64 + h * 32), _mm512_extracti64x4_epi64(v, 1));
    }
  }
}
}  // namespace avx512
GENCLI_TARGET_END

// the integer kernels on AVX-512 with VNNI (Cascade Lake and later)
GENCLI_TARGET_AVX512VNNI
namespace avx512vnni {
#include "simd_avx512.inc"
#include "simd_avx512vnni.inc"
#include "gemv_q8.inc"
}  // namespace avx512vnni
GENCLI_TARGET_END

// both kinds on AVX2 (the integer ones: on AVX-512 CPUs without VNNI too)
GENCLI_TARGET_AVX2
namespace avx2 {
#include "simd_avx2.inc"
#include "simd_avx2_int.inc"
#include "gemv_f32.inc"
#include "gemv_q8.inc"
#include "act_quant.inc"

// the same per chunk of 64 (32 even columns, then 32 odd ones: the AVX2 integer kernels' order)
inline void deinterleave_chunks(const int8_t* q, int64_t chunks, int8_t* out) {
  const __m256i pairs = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11,
                                         13, 15);
  for (int64_t c = 0; c < chunks; ++c) {
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 64 + h * 32)), pairs),
                                                 0xD8);  // 64-bit quarters 0, 2, 1, 3
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c * 64 + h * 16), _mm256_castsi256_si128(v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c * 64 + 32 + h * 16), _mm256_extracti128_si256(v, 1));
    }
  }
}
}  // namespace avx2
GENCLI_TARGET_END

namespace {

// rows per task: enough work (task_bytes of weights) that a thread's share outweighs the scheduling
int64_t grain(int64_t K) { return std::max<int64_t>(1, product_tuning().task_bytes / std::max<int64_t>(K, 1)); }

// Runs tile<MT>(row pointer offset m0, ...) over the activation rows in tiles of at most kMaxRows.
template <typename F>
void by_row_tiles(int64_t M, F&& tile) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, M - m0)) {
      case 1: tile(std::integral_constant<int, 1>{}, m0); break;
      case 2: tile(std::integral_constant<int, 2>{}, m0); break;
      case 3: tile(std::integral_constant<int, 3>{}, m0); break;
      default: tile(std::integral_constant<int, 4>{}, m0); break;
    }
  }
}

// the threads a product's tasks are spread over: the step's team inside a step, else torch's
int64_t product_threads() {
  const TeamSeat& seat = team_seat();
  return seat.team ? seat.team->size() : at::get_num_threads();
}

// fn(c) for c in [0, count): inside a decoding step by its team (team.h), else the chunks taken in turn
// by torch's threads from a shared counter rather than split in equal shares (at::parallel_for): on a
// shared machine one thread is often held up, and with equal shares every product then waits for it.
template <typename F>
void parallel_chunks(int64_t count, F&& fn) {
  TeamSeat& seat = team_seat();
  if (seat.team) {  // inside a decoding step: every thread of the team is here, with the same tasks
    seat.team->run(seat.me, seat.pass++, count, fn);
    return;
  }
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < count; ++c) fn(c);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(threads))
  for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < count; c = next.fetch_add(1, std::memory_order_relaxed)) fn(c);
}

// tile(i, MT, m0, n0, n1) for every weight i of ws[0, count), tile of activation rows [m0, m0 + MT) and
// range of weight rows [n0, n1): each weight's rows cut into chunks of about task_bytes of codes (a
// multiple of 4 rows), all the weights' chunks in one parallel pass, each chunk read once per tile of up
// to kMaxRows activation rows; the weight's bias then added to the chunk's results in outs[i] (M, N_i)
// (on the thread that computed them)
template <typename F>
void for_tiles(int64_t M, const QuantWeight* ws, float* const* outs, int64_t count, int64_t row_bytes, F&& tile) {
  int64_t total = 0, rows = grain(row_bytes);
  for (int64_t i = 0; i < count; ++i) total += ws[i].N;
  // at least tasks_per_thread tasks a thread where the rows allow (large tasks must not leave a thread idle)
  const int64_t per_thread = product_tuning().tasks_per_thread;
  if (per_thread > 0) rows = std::min(rows, std::max<int64_t>(1, total / (per_thread * std::max<int64_t>(1, product_threads()))));
  // each weight cut into as many tasks as rows allows, of equal size (a multiple of 4 rows): q, k and v of
  // 1024 rows in tasks of up to 768 are 6 of 512, not 768 and 256 each (a team's own ranges, split by the
  // count of tasks, would differ by a third)
  thread_local std::vector<std::array<int64_t, 3>> chunks;  // (weight, first row, end row)
  chunks.clear();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t N = ws[i].N, pieces = (N + rows - 1) / rows, size = ((N + pieces - 1) / pieces + 3) / 4 * 4;
    for (int64_t n0 = 0; n0 < N; n0 += size) chunks.push_back({i, n0, std::min(N, n0 + size)});
  }
  const auto* cp = chunks.data();
  parallel_chunks(static_cast<int64_t>(chunks.size()), [&](int64_t c) {
    const int64_t i = cp[c][0], N = ws[i].N, n0 = cp[c][1], n1 = cp[c][2];
    by_row_tiles(M, [&](auto mt, int64_t m0) { tile(i, mt, m0, n0, n1); });
    if (const float* b = ws[i].bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) outs[i][m * N + n] += b[n];
  });
}

// The products on raw pointers (decoder_step.cpp calls them too): x (M, K) float32 contiguous, each
// weight's result written to outs[i] (M, N_i). The f32 kernels: one weight a pass.
void int8_product_f32(const float* xp, int64_t M, int64_t K, const QuantWeight& w, float* op) {
  const int64_t N = w.N;
  const int8_t* wp = static_cast<const int8_t*>(w.codes);
  const uint16_t* sp = w.scale;
  const bool wide = active_isa() == Isa::avx512;
  for_tiles(M, &w, &op, 1, K, [&](int64_t, auto mt, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int MT = decltype(mt)::value;
    if (wide)
      avx512::weight_tile<MT>(xp + m0 * K, K, wp, sp, op + m0 * N, N, n0, n1);
    else
      avx2::weight_tile<MT>(xp + m0 * K, K, wp, sp, op + m0 * N, N, n0, n1);
  });
}

// x (M, K) de-interleaved per block of 2W columns (the block's even columns, then its odd ones; the
// columns past the last whole block as they are), in the calling thread's scratch: what the int4 and
// the bf16 kernels multiply a column pair at a time with
const float* deinterleaved(const float* xp, int64_t M, int64_t K) {
  const int64_t W = vector_lanes(), KB = K - K % (2 * W);
  thread_local AlignedVector<float> xd_buf;
  float* xdp = scratch(xd_buf, M * K, false);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    float* dr = xdp + m * K;
    for (int64_t c = 0; c < KB; c += 2 * W)
      for (int64_t j = 0; j < W; ++j) {
        dr[c + j] = xr[c + 2 * j];
        dr[c + W + j] = xr[c + 2 * j + 1];
      }
    std::copy(xr + KB, xr + K, dr + KB);
  }
  return xdp;
}

// Dense weights (fp32, or bf16 values widened to fp32 in registers) times fp32 x, exact to fp32 rounding:
// every weight's rows in one parallel pass (a layer's q/k/v or gate/up projections share x), each row
// read once per tile of activation rows. The weights of one call are all f32 or all bf16.
void dense_products(const float* xp, int64_t M, int64_t K, const QuantWeight* ws, int64_t count, float* const* outs) {
  const bool wide = active_isa() == Isa::avx512, f32 = ws[0].kind == WeightKind::f32;
  const float* xdp = f32 ? nullptr : deinterleaved(xp, M, K);  // bf16: read a column pair at a time
  std::vector<int64_t> Ns;
  for (int64_t i = 0; i < count; ++i) Ns.push_back(ws[i].N);
  for_tiles(M, ws, outs, count, K * (f32 ? 4 : 2), [&](int64_t i, auto mt, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int MT = decltype(mt)::value;
    const float* x = xp + m0 * K;
    float* op = outs[i] + m0 * Ns[i];
    if (f32) {
      const float* wp = static_cast<const float*>(ws[i].codes);
      if (wide)
        avx512::weight_tile<MT>(x, K, wp, nullptr, op, Ns[i], n0, n1);
      else
        avx2::weight_tile<MT>(x, K, wp, nullptr, op, Ns[i], n0, n1);
    } else {
      const uint16_t* wp = static_cast<const uint16_t*>(ws[i].codes);
      if (wide)
        avx512::bf16_pair_tile<MT>(xdp + m0 * K, x, K, wp, op, Ns[i], n0, n1);
      else
        avx2::bf16_pair_tile<MT>(xdp + m0 * K, x, K, wp, op, Ns[i], n0, n1);
    }
  });
}

}  // namespace

void dense_rows(const float* x, int64_t K, const QuantWeight& w, const int64_t* rows, int64_t n, float* out) {
  thread_local AlignedVector<float> row_buf;
  float* op = scratch(row_buf, w.N);  // (the tile functions write row r's result at op[r])
  const bool wide = active_isa() == Isa::avx512;
  const float* xd = w.kind == WeightKind::bf16 ? deinterleaved(x, 1, K) : nullptr;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = rows[j];
    if (w.kind == WeightKind::f32) {
      const float* wp = static_cast<const float*>(w.codes);
      if (wide)
        avx512::weight_tile<1>(x, K, wp, nullptr, op, w.N, r, r + 1);
      else
        avx2::weight_tile<1>(x, K, wp, nullptr, op, w.N, r, r + 1);
    } else {
      const uint16_t* wp = static_cast<const uint16_t*>(w.codes);
      if (wide)
        avx512::bf16_pair_tile<1>(xd, x, K, wp, op, w.N, r, r + 1);
      else
        avx2::bf16_pair_tile<1>(xd, x, K, wp, op, w.N, r, r + 1);
    }
    out[j] = op[r] + (w.bias ? w.bias[r] : 0.f);
  }
}

namespace {

// w = (q - 8) * scale + zero with q packed (N, K/2), groups of G; xsp the group sums of x (M, gs)
void int4_product_f32(const float* xp, int64_t M, int64_t K, const QuantWeight& w, const float* xsp, int64_t gs, float* op) {
  const int64_t N = w.N, G = w.G;
  const float* xdp = deinterleaved(xp, M, K);  // the nibbles' order: each block's even columns, then its odd ones
  const uint8_t* wp = static_cast<const uint8_t*>(w.codes);
  const uint16_t* sp = w.scale;
  const uint16_t* zp = w.zero;
  const bool wide = active_isa() == Isa::avx512;
  for_tiles(M, &w, &op, 1, K, [&](int64_t, auto mt, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int MT = decltype(mt)::value;
    if (wide)
      avx512::int4_tile_g<MT>(G, xdp + m0 * K, xsp + m0 * gs, gs, K, wp, sp, zp, op + m0 * N, N, n0, n1);
    else
      avx2::int4_tile_g<MT>(G, xdp + m0 * K, xsp + m0 * gs, gs, K, wp, sp, zp, op + m0 * N, N, n0, n1);
  });
}

// x quantized for the integer kernels: the codes in rows of KP (zeros past K), de-interleaved per chunk
// of 2 * chunk_bytes columns when chunk_bytes > 0 (int4: as the nibbles are stored, the chunk's even
// columns then its odd ones), and each int32 lane's block scale (per_lane columns a lane: 4 for int8
// codes, 8 for packed int4 codes)
struct IntActivations {
  const int8_t* codes;       // (M, KP)
  const float* lane_scales;  // (M, KP / per_lane)
};

IntActivations int_activations(const float* x, int64_t M, int64_t K, int64_t KP, int64_t per_lane, int64_t chunk_bytes) {
  thread_local AlignedVector<int8_t> q_buf, codes_buf;
  thread_local AlignedVector<float> sx_buf, lanes_buf;
  const int64_t blocks = K / kActBlock;
  int8_t* qp = scratch(q_buf, M * K, false);
  float* sxp = scratch(sx_buf, M * blocks, false);
  int8_t* cp = scratch(codes_buf, M * KP, true);
  float* lp = scratch(lanes_buf, M * (KP / per_lane), true);
  quantize_activations(x, M, K, qp, sxp);
  const int64_t BW = chunk_bytes, CC = 2 * chunk_bytes;
  for (int64_t m = 0; m < M; ++m) {
    if (BW == 0) {
      std::memcpy(cp + m * KP, qp + m * K, K);
    } else {
      // the whole chunks by vector shuffles (BW 64: the VNNI kernels, so AVX-512 is there), the rest here
      const int64_t whole = active_isa() == Isa::none ? 0 : K / CC;
      if (whole > 0 && BW == 64)
        avx512::deinterleave_chunks(qp + m * K, whole, cp + m * KP);
      else if (whole > 0)
        avx2::deinterleave_chunks(qp + m * K, whole, cp + m * KP);
      for (int64_t c = whole * CC; c < K; c += CC)
        for (int64_t j = 0; j < BW && c + 2 * j < K; ++j) {
          cp[m * KP + c + j] = qp[m * K + c + 2 * j];
          cp[m * KP + c + BW + j] = qp[m * K + c + 2 * j + 1];
        }
    }
    for (int64_t i = 0; i < K / per_lane; ++i) lp[m * (KP / per_lane) + i] = sxp[m * blocks + i / (kActBlock / per_lane)];
  }
  return {cp, lp};
}

// the same with x quantized to int8 (blocks of kActBlock) and integer dot products, for several weights
// multiplying the same x (a layer's query/key/value or gate/up projections): x quantized once, every
// weight's rows in one parallel pass
void int8_products_q8(const float* x, int64_t M, int64_t K, const QuantWeight* ws, int64_t count, float* const* outs) {
  const bool vnni = use_vnni();
  const int64_t BW = vnni ? 64 : 32, KP = (K + BW - 1) / BW * BW;  // bytes per integer vector
  const IntActivations a = int_activations(x, M, K, KP, 4, 0);
  const int8_t* xpp = a.codes;
  const float* xlp = a.lane_scales;
  std::vector<int64_t> Ns;
  for (int64_t i = 0; i < count; ++i) Ns.push_back(ws[i].N);
  for_tiles(M, ws, outs, count, K, [&](int64_t i, auto mt, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int MT = decltype(mt)::value;
    const int8_t* wp = static_cast<const int8_t*>(ws[i].codes);
    const uint16_t* sp = ws[i].scale;
    float* op = outs[i] + m0 * Ns[i];
    if (vnni)
      avx512vnni::q8_int8_tile<MT>(xpp + m0 * KP, xlp + m0 * (KP / 4), KP, K, wp, sp, op, Ns[i], n0, n1);
    else
      avx2::q8_int8_tile<MT>(xpp + m0 * KP, xlp + m0 * (KP / 4), KP, K, wp, sp, op, Ns[i], n0, n1);
  });
}

void int4_products_q8(const float* x, int64_t M, int64_t K, const QuantWeight* ws, int64_t count, const float* xsp, int64_t gs,
                      float* const* outs) {
  const bool vnni = use_vnni();
  const int64_t BW = vnni ? 64 : 32, CC = 2 * BW, G = ws[0].G;
  const int64_t KP = (K + CC - 1) / CC * CC;
  const IntActivations a = int_activations(x, M, K, KP, 8, BW);
  const int8_t* xdp = a.codes;
  const float* xlp = a.lane_scales;
  std::vector<int64_t> Ns;
  for (int64_t i = 0; i < count; ++i) Ns.push_back(ws[i].N);
  for_tiles(M, ws, outs, count, K / 2, [&](int64_t i, auto mt, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int MT = decltype(mt)::value;
    const uint8_t* wp = static_cast<const uint8_t*>(ws[i].codes);
    const uint16_t* sp = ws[i].scale;
    const uint16_t* zp = ws[i].zero;
    float* op = outs[i] + m0 * Ns[i];
    if (vnni)
      avx512vnni::q8_int4_tile_g<MT>(G, xdp + m0 * KP, xlp + m0 * (KP / 8), KP, xsp + m0 * gs, gs, K, wp, sp, zp, op, Ns[i], n0, n1);
    else
      avx2::q8_int4_tile_g<MT>(G, xdp + m0 * KP, xlp + m0 * (KP / 8), KP, xsp + m0 * gs, gs, K, wp, sp, zp, op, Ns[i], n0, n1);
  });
}

// x's group sums (M, gs), gs the groups rounded up to 16 (padded with zeros): the zero points multiply them
const float* group_sums(const float* xp, int64_t M, int64_t K, int64_t G, int64_t gs) {
  thread_local AlignedVector<float> xs_buf;
  float* xsp = scratch(xs_buf, M * gs, true);
  const Isa isa = active_isa();
  if (isa == Isa::avx512 && G % 16 == 0) {
    for (int64_t m = 0; m < M; ++m) avx512::group_sums_row(xp + m * K, K / G, G, xsp + m * gs);
    return xsp;
  }
  if (isa == Isa::avx2 && G % 8 == 0) {
    for (int64_t m = 0; m < M; ++m) avx2::group_sums_row(xp + m * K, K / G, G, xsp + m * gs);
    return xsp;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / G; ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < G; ++j) s += xp[m * K + g * G + j];
      xsp[m * gs + g] = s;
    }
  return xsp;
}

}  // namespace

void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* q, float* sx) {
  const Isa isa = active_isa();
  if (isa == Isa::avx512) return avx512::quantize_blocks(x, M * (K / kActBlock), q, sx);
  if (isa == Isa::avx2) return avx2::quantize_blocks(x, M * (K / kActBlock), q, sx);
  quantize_activations_reference(x, M, K, q, sx);
}

void quantize_activations_reference(const float* x, int64_t M, int64_t K, int8_t* q, float* sx) {
  const int64_t blocks = K / kActBlock;
  for (int64_t i = 0; i < M * blocks; ++i) {
    const float* xb = x + i * kActBlock;
    float amax = 0.f;
    for (int64_t j = 0; j < kActBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;
    sx[i] = amax / 127.0f;
    // round half to even by the 1.5 * 2^23 trick (exact for |y| <= 127, and vectorised: no libm call)
    for (int64_t j = 0; j < kActBlock; ++j) {
      const float y = std::max(-127.f, std::min(127.f, xb[j] * inv));
      q[i * kActBlock + j] = static_cast<int8_t>((y + 12582912.0f) - 12582912.0f);
    }
  }
}

bool int8_activations_apply(const QuantWeight& w, bool asked) {
  if (w.dense()) return false;
  return asked && (w.int4() ? w.G >= kActBlock && w.G <= 256 : w.K % kActBlock == 0);
}

void quantized_products(const float* x, int64_t M, int64_t K, const QuantWeight* ws, float* const* outs, int64_t count, bool int8_act) {
  if (count <= 0) return;
  const bool int4 = ws[0].int4();
  bool same = true;
  for (int64_t i = 1; i < count; ++i) same = same && ws[i].kind == ws[0].kind && (!int4 || ws[i].G == ws[0].G);
  if (!same) {  // (not made by gencli's layers: one mode, one group size a model)
    for (int64_t i = 0; i < count; ++i) quantized_products(x, M, K, ws + i, outs + i, 1, int8_act);
    return;
  }
  const bool q8 = int8_activations_apply(ws[0], int8_act);
  if (ws[0].dense()) {
    dense_products(x, M, K, ws, count, outs);
  } else if (!int4) {
    if (q8) {
      int8_products_q8(x, M, K, ws, count, outs);
    } else {
      for (int64_t i = 0; i < count; ++i) int8_product_f32(x, M, K, ws[i], outs[i]);
    }
  } else {
    const int64_t G = ws[0].G, gs = (K / G + 15) / 16 * 16;
    const float* xsp = group_sums(x, M, K, G, gs);
    if (q8) {
      int4_products_q8(x, M, K, ws, count, xsp, gs, outs);
    } else {
      for (int64_t i = 0; i < count; ++i) int4_product_f32(x, M, K, ws[i], xsp, gs, outs[i]);
    }
  }
}

// The entry points on tensors (ops.h): x (..., K) float32, any layout (a decoding step's (B, n, K)
// activations as they come); the result (..., N). The scales and the bias are taken in any floating dtype
// (converted here, a no-op when they are bf16 / fp32 already): the Python side passes the layer's tensors
// as they are, one call a layer.
namespace {

std::string check_quant_weight(const QuantWeight& w) {
  if (w.N <= 0 || w.K <= 0) return "empty weight";
  if (!w.int4()) return "";
  const int64_t W = vector_lanes(), G = w.G;
  if (!(G > 0 && G % (2 * W) == 0 && G <= 32 * W && (G & (G - 1)) == 0 && w.K % G == 0))
    return "the group size must be a power of two, a multiple of " + std::to_string(2 * W) + " dividing K";
  return "";
}

at::Tensor as_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "quant_gemv: x must be float32 (..., K)");
  return x.reshape({-1, x.size(-1)}).contiguous();
}

at::Tensor shaped_like(const at::Tensor& out, const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out.size(1);
  return out.view(shape);
}

// x (..., K) times each weight: the list of (..., N_i) results
std::vector<at::Tensor> products(const at::Tensor& x_in, std::vector<QuantWeight>& ws, bool int8_act, bool reference) {
  const at::Tensor x = as_rows(x_in);
  TORCH_CHECK(x.device().is_cpu(), "quant_gemv: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> outs;
  std::vector<float*> ptrs;
  for (const auto& w : ws) {
    TORCH_CHECK(w.K == K, "quant_gemv: shapes do not match");
    outs.push_back(at::empty({M, w.N}, x.options()));
    ptrs.push_back(outs.back().data_ptr<float>());
  }
  const int64_t count = static_cast<int64_t>(ws.size());
  if (reference)
    quantized_products_reference(x.data_ptr<float>(), M, K, ws.data(), ptrs.data(), count, int8_act);
  else
    quantized_products(x.data_ptr<float>(), M, K, ws.data(), ptrs.data(), count, int8_act);
  for (auto& out : outs) out = shaped_like(out, x_in);
  return outs;
}

at::Tensor or_undefined(const OptionalTensor& t) { return t.has_value() ? *t : at::Tensor(); }

}  // namespace

QuantWeight quant_weight(bool int4, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero, int64_t G,
                         const at::Tensor& bias, std::vector<at::Tensor>& keep) {
  TORCH_CHECK(active_isa() != Isa::none, "quant_gemv: this CPU has neither AVX-512 nor AVX2");
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 2 && codes.is_contiguous(), "quant_gemv: the codes must be contiguous CPU (N, K or K/2)");
  TORCH_CHECK(codes.scalar_type() == (int4 ? at::kByte : at::kChar), int4 ? "quant_gemv: packed uint8 int4 codes expected" : "quant_gemv: int8 codes expected");
  QuantWeight w{};
  w.kind = int4 ? WeightKind::int4 : WeightKind::int8;
  w.N = codes.size(0);
  w.K = int4 ? 2 * codes.size(1) : codes.size(1);
  w.G = int4 ? G : -1;
  w.codes = codes.data_ptr();
  const std::string problem = check_quant_weight(w);
  TORCH_CHECK(problem.empty(), "quant_gemv: ", problem);
  const int64_t per_row = int4 ? (G > 0 ? w.K / G : 0) : 1;
  keep.push_back(scale.to(at::kBFloat16).contiguous());
  TORCH_CHECK(keep.back().numel() == w.N * per_row && (!int4 || (keep.back().dim() == 2 && keep.back().size(0) == w.N)),
              "quant_gemv: shapes do not match");
  w.scale = reinterpret_cast<const uint16_t*>(keep.back().data_ptr<at::BFloat16>());
  if (int4) {
    keep.push_back(zero.to(at::kBFloat16).contiguous());
    TORCH_CHECK(keep.back().sizes() == keep[keep.size() - 2].sizes(), "quant_gemv: shapes do not match");
    w.zero = reinterpret_cast<const uint16_t*>(keep.back().data_ptr<at::BFloat16>());
  }
  if (bias.defined()) {
    keep.push_back(bias.to(at::kFloat).contiguous());
    TORCH_CHECK(keep.back().numel() == w.N, "quant_gemv: the bias must have N values");
    w.bias = keep.back().data_ptr<float>();
  }
  return w;
}

QuantWeight dense_weight(const at::Tensor& values, const at::Tensor& bias, std::vector<at::Tensor>& keep) {
  TORCH_CHECK(active_isa() != Isa::none, "quant_gemv: this CPU has neither AVX-512 nor AVX2");
  TORCH_CHECK(values.device().is_cpu() && values.dim() == 2 && values.is_contiguous() && values.numel() > 0,
              "dense_gemv: the weight must be a contiguous CPU (N, K) tensor");
  TORCH_CHECK(values.scalar_type() == at::kFloat || values.scalar_type() == at::kBFloat16, "dense_gemv: float32 or bfloat16 weights expected");
  QuantWeight w{};
  w.kind = values.scalar_type() == at::kFloat ? WeightKind::f32 : WeightKind::bf16;
  w.N = values.size(0);
  w.K = values.size(1);
  w.codes = values.data_ptr();
  if (bias.defined()) {
    keep.push_back(bias.to(at::kFloat).contiguous());
    TORCH_CHECK(keep.back().numel() == w.N, "dense_gemv: the bias must have N values");
    w.bias = keep.back().data_ptr<float>();
  }
  return w;
}

std::vector<at::Tensor> dense_gemv_many(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<OptionalTensor>& biases,
                                        bool reference) {
  const size_t count = weights.size();
  TORCH_CHECK(count > 0 && biases.size() == count, "dense_gemv: one bias (or None) a weight");
  std::vector<at::Tensor> keep;
  std::vector<QuantWeight> ws;
  for (size_t i = 0; i < count; ++i) {
    ws.push_back(dense_weight(weights[i], or_undefined(biases[i]), keep));
    TORCH_CHECK(ws.back().kind == ws[0].kind, "dense_gemv: the weights of one call share a dtype");
  }
  return products(x, ws, false, reference);
}

std::vector<at::Tensor> int8_gemv_many(const at::Tensor& x, const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& scales,
                                       bool int8_activations, const std::vector<OptionalTensor>& biases, bool reference) {
  const size_t count = qs.size();
  TORCH_CHECK(count > 0 && scales.size() == count && biases.size() == count, "quant_gemv: one scale and one bias (or None) a weight");
  std::vector<at::Tensor> keep;
  std::vector<QuantWeight> ws;
  for (size_t i = 0; i < count; ++i) ws.push_back(quant_weight(false, qs[i], scales[i], at::Tensor(), -1, or_undefined(biases[i]), keep));
  return products(x, ws, int8_activations, reference);
}

std::vector<at::Tensor> int4_gemv_many(const at::Tensor& x, const std::vector<at::Tensor>& packed, const std::vector<at::Tensor>& scales,
                                       const std::vector<at::Tensor>& zeros, int64_t G, bool int8_activations,
                                       const std::vector<OptionalTensor>& biases, bool reference) {
  const size_t count = packed.size();
  TORCH_CHECK(count > 0 && scales.size() == count && zeros.size() == count && biases.size() == count,
              "quant_gemv: one scale, one zero point and one bias (or None) a weight");
  std::vector<at::Tensor> keep;
  std::vector<QuantWeight> ws;
  for (size_t i = 0; i < count; ++i) ws.push_back(quant_weight(true, packed[i], scales[i], zeros[i], G, or_undefined(biases[i]), keep));
  return products(x, ws, int8_activations, reference);
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, bool int8_activations, const OptionalTensor& bias,
                     bool reference) {
  return int8_gemv_many(x, {q}, {scale}, int8_activations, {bias}, reference)[0];
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero, int64_t G,
                     bool int8_activations, const OptionalTensor& bias, bool reference) {
  return int4_gemv_many(x, {packed}, {scale}, {zero}, G, int8_activations, {bias}, reference)[0];
}

std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x, bool reference) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % kActBlock == 0,
              "quant_gemv: x must be contiguous float32 (M, K), K a multiple of ", kActBlock);
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar)), sx = at::empty({x.size(0), x.size(1) / kActBlock}, x.options());
  if (reference)
    quantize_activations_reference(x.data_ptr<float>(), x.size(0), x.size(1), q.data_ptr<int8_t>(), sx.data_ptr<float>());
  else
    quantize_activations(x.data_ptr<float>(), x.size(0), x.size(1), q.data_ptr<int8_t>(), sx.data_ptr<float>());
  return std::make_tuple(q, sx);
}

}  // namespace gencli
