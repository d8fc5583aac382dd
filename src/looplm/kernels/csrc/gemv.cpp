// y = x · Wᵀ (+ b) for the few activation rows of a decode step: bf16 with 1-16 rows, fp32 with 3-8
// rows, on CPUs with AVX512-BF16 (and AMX for 2-16 bf16 rows). Built by looplm/layers/gemv.py.
//
// Why this exists: a decode step multiplies a handful of activation rows (the batch) by every weight
// matrix, so its cost is the bytes of W read from memory. torch's bf16 matmul on CPU (oneDNN) is built
// for matrix-matrix products and reads W at 4-15 GB/s at the SmolLM2-135M shapes on a 2-core Xeon whose
// memory streams ~23 GB/s (it also repacks W at every call). These kernels read W in place, once,
// prefetching the next block of rows: one row of x with AVX512-BF16 dot products (13-27 GB/s, 2-4x
// torch), 2-16 rows with AMX tiles (W rows as the A tile, x transposed into the B tile; 1.1-2.6x torch).
// benchmarks/bench_decode.py times the decode step; tests/test_gemv.py checks every path against an
// fp64 reference. The reference path is F.linear, used for every other case (looplm/layers/gemv.py).
//
// An fp32 kernel for 1-8 rows sits at the end (MKL reads W at 8-14 GB/s for 4-8 rows, and for one row of
// weights streamed from memory on an AMD EPYC; the tile here reaches 18-31 GB/s).
//
// Shapes: x [M, K], W [N, K] (nn.Linear's layout), b [N] or absent -> y [M, N], all of one dtype.
// bf16: each output is an fp32 sum of bf16 x bf16 products (vdpbf16ps / tdpbf16ps: pairs of products added
// exactly in fp32), plus the bias in fp32, rounded once to bf16 (round to nearest even), like oneDNN;
// only the order of the fp32 additions differs.
#include "gemv.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

// The kernels need AVX512-BF16 (and AMX for 2-16 bf16 rows): looplm/layers/gemv.py builds this file with
// those instructions on CPUs that have them. The portable build (every other CPU) keeps the ops' names
// and argument checks but has no kernels: kernel_wins is false, linear_rows is at::linear.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LOOPLM_KERNELS 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LOOPLM_KERNELS 0
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace looplm_cpu {
namespace {

#if LOOPLM_KERNELS
constexpr int64_t kRows = 16;  // weight rows per block: 16 accumulators, one zmm of outputs

inline __m512 bf16x16_to_fp32(const uint16_t* p) {  // exact: a bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// y[0..15] = x · W[0..15]ᵀ (+ b[0..15]); x has K entries, W is 16 rows of K. While it reads line (s, r)
// of W (the s-th 64 bytes of row r), it prefetches the same place of the block read next — `pf`, 16 rows
// of pf_K (nullptr: none; for another width the column is scaled, ⌊s · pf_K / K⌋): more loads in flight
// than the hardware prefetcher starts, each a block ahead, and none stop at the end of a matrix.
inline void block16(const uint16_t* x, const uint16_t* w, const uint16_t* b, int64_t K, uint16_t* y, const uint16_t* pf, int64_t pf_K) {
  const int64_t steps = K / 32;
  if (pf == nullptr) pf = w, pf_K = K;  // nothing to fetch: the block's own lines, already on their way
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (int64_t s = 0; s < steps; ++s, k += 32) {
    __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
    const uint16_t* p = pf + s * pf_K / K * 32;  // the target's column: k itself where pf_K == K
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      _mm_prefetch((const char*)(p + r * pf_K), _MM_HINT_T0);
      acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_loadu_si512(w + r * K + k));
    }
  }
  if (k < K) {  // the last K % 32 entries, zero-padded by masked loads
    __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
    __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
    for (int r = 0; r < kRows; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * K + k));
  }
  __m512 out = sum_lanes16(acc);
  if (b != nullptr) out = _mm512_add_ps(out, bf16x16_to_fp32(b));
  _mm256_storeu_si256((__m256i*)y, (__m256i)_mm512_cvtneps_pbh(out));
}

// One output: x · w (+ bias), for the N % 16 rows after the last full block.
inline uint16_t dot1(const uint16_t* x, const uint16_t* w, const uint16_t* b, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
  if (k < K) {
    __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, x + k), (__m512bh)_mm512_maskz_loadu_epi16(m, w + k));
  }
  float s = _mm512_reduce_add_ps(acc);
  if (b != nullptr) s += static_cast<float>(c10::BFloat16(*b, c10::BFloat16::from_bits()));
  return c10::BFloat16(s).x;
}


// ---- 2-16 rows of x: AMX ------------------------------------------------------------------------
// One block of 16 weight rows at a time: for each chunk of 32 entries of K, tdpbf16ps multiplies the
// A tile (the 16 rows of W, loaded in place with the row stride) by the B tile (x transposed, in
// pairs: B[i][2m + j] = x[m][32c + 2i + j], built once per call) into C [16 rows of W x M] (fp32).

struct TileConfig {  // the 64-byte operand of ldtilecfg (palette 1)
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void rows_amx(const uint16_t* xp, const uint16_t* wp, const uint16_t* bp, int64_t M, int64_t K, int64_t N, uint16_t* yp) {
  const int64_t chunks = (K + 31) / 32, full = K / 32;
  // x transposed into B tiles, zero-padded past K: pair p = (x[m][2p], x[m][2p + 1]) goes to row p, column m
  // of the [K/2 pairs, M] matrix of 32-bit pairs that the chunks' B tiles are consecutive slices of (pairs
  // copied whole, no division per entry: [192, 576] at 8 rows 22 -> 18 µs against an entry-by-entry copy)
  std::vector<uint32_t> xt(chunks * 16 * M, 0);
  const int64_t pairs = K / 2;
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = xp + m * K;
    for (int64_t p = 0; p < pairs; ++p) xt[p * M + m] = uint32_t(row[2 * p]) | (uint32_t(row[2 * p + 1]) << 16);
    if (K % 2) xt[pairs * M + m] = row[K - 1];  // the odd last entry, paired with a zero
  }
  const int64_t blocks = N / kRows;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    TileConfig cfg;  // tile state is per thread
    cfg.rows[0] = 16, cfg.colsb[0] = M * 4;  // C: 16 weight rows x M outputs, fp32
    cfg.rows[1] = 16, cfg.colsb[1] = 64;     // A: 16 weight rows x 32 bf16 of K
    cfg.rows[2] = 16, cfg.colsb[2] = M * 4;  // B: 16 pairs of K x M rows of x
    _tile_loadconfig(&cfg);
    alignas(64) float c[16 * 16];
    alignas(64) uint16_t tail[16 * 32];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const uint16_t* w = wp + blk * kRows * K;
      _tile_zero(0);
      for (int64_t ch = 0; ch < full; ++ch) {
        for (int r = 0; r < kRows; ++r) _mm_prefetch((const char*)(w + (kRows + r) * K + 32 * ch), _MM_HINT_T0);
        _tile_loadd(1, w + 32 * ch, K * 2);
        _tile_loadd(2, xt.data() + ch * 16 * M, M * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      if (full < chunks) {  // the last K % 32 entries: a zero-padded copy (a full-width load would read past W)
        std::memset(tail, 0, sizeof(tail));
        for (int r = 0; r < kRows; ++r) std::memcpy(tail + r * 32, w + r * K + full * 32, (K - full * 32) * 2);
        _tile_loadd(1, tail, 64);
        _tile_loadd(2, xt.data() + full * 16 * M, M * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, c, M * 4);  // c[r * M + m] = y[m, 16 blk + r]
      for (int r = 0; r < kRows; ++r) {
        const int64_t n = blk * kRows + r;
        const float bias = bp ? static_cast<float>(c10::BFloat16(bp[n], c10::BFloat16::from_bits())) : 0.f;
        for (int64_t m = 0; m < M; ++m) yp[m * N + n] = c10::BFloat16(c[r * M + m] + bias).x;
      }
    }
    _tile_release();
  });
  for (int64_t n = blocks * kRows; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot1(xp + m * K, wp + n * K, bp ? bp + n : nullptr, K);
}

#endif  // LOOPLM_KERNELS

// The argument checks both ops share (op: its name in messages; dt / dt_name: the one dtype of x, W and
// the bias). Returns the bias's data, or nullptr without a bias.
const void* check_args(const char* op, at::ScalarType dt, const char* dt_name, const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              op, ": x must be [M, K] and weight [N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == dt && w.scalar_type() == dt,
              op, ": x and weight must be ", dt_name, ", got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": a CPU kernel, got tensors on ", x.device());
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), op, ": x and weight must be contiguous");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0) && bias->scalar_type() == dt && bias->is_contiguous(),
              op, ": bias must be a contiguous ", dt_name, " [N] tensor, got ", bias->sizes(), " ", bias->scalar_type());
  return bias->data_ptr();
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool use_amx) {
  const auto* bp = static_cast<const uint16_t*>(check_args("gemv_bf16", at::kBFloat16, "bfloat16", x, w, bias));
#if !LOOPLM_KERNELS
  TORCH_CHECK(false, "gemv_bf16: looplm's CPU kernels were built without AVX512-BF16 (this CPU lacks it)");
  (void)bp, (void)use_amx;
  return x;
#else
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (use_amx && M >= 2 && M <= 16 && amx_ready()) {
    rows_amx(xp, wp, bp, M, K, N, yp);
    return y;
  }
  const int64_t blocks = N / kRows;
  // one row of x, or a few without AMX: threads split the weight rows (each block of W is read from memory once; the M rows of x reuse it
  // from L1); 4 blocks = 64 rows at least per thread, so tiny layers do not pay for waking threads
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk)
      for (int64_t m = 0; m < M; ++m)  // the next block prefetched while the first row of x reads this one
        block16(xp + m * K, wp + blk * kRows * K, bp ? bp + blk * kRows : nullptr, K, yp + m * N + blk * kRows,
                m == 0 && blk + 1 < b1 ? wp + (blk + 1) * kRows * K : nullptr, K);
  });
  for (int64_t n = blocks * kRows; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot1(xp + m * K, wp + n * K, bp ? bp + n : nullptr, K);
  return y;
#endif
}

#if LOOPLM_KERNELS
// ---- one row of x, several weight matrices: one parallel region ---------------------------------
// A decode step's products come in groups that read the same input (q/k/v, gate/up) and run one after
// another (the next group's weights are known). Small matrices pay a start-up each: waking the second
// thread, and the first lines of every thread's share read with nothing in flight ([192, 576] reads at
// 13-17 GB/s, [1536, 576] at 24-28). Here a group's full 16-row blocks form one list split evenly between
// the threads, and each block prefetches the one after it — across the end of a matrix, and at the end of
// a thread's share, into the same thread's share of the next group (run after the attention or the
// norm in between).

int64_t group_blocks(const RowGroup& g) {
  int64_t t = 0;
  for (int i = 0; i < g.n; ++i) t += g.ps[i].N / kRows;
  return t;
}

int64_t group_parts(int64_t blocks) {  // the threads a group's blocks are split between (4 blocks at least each)
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  return std::max<int64_t>(1, std::min<int64_t>(threads, (blocks + 3) / 4));
}

const uint16_t* block_at(const RowGroup& g, int64_t j) {  // the first weight of block j of the list
  for (int i = 0; i < g.n; ++i) {
    const int64_t nb = g.ps[i].N / kRows;
    if (j < nb) return g.ps[i].w + j * kRows * g.K;
    j -= nb;
  }
  return nullptr;
}

#endif  // LOOPLM_KERNELS

// ---- fp32, 1-8 rows of x: AVX-512 FMA ----------------------------------------------------------
// MKL's fp32 GEMM reads W at 8-14 GB/s for 4-8 rows of x; its one-row GEMV, at the bandwidth on the Intel Xeon,
// read weights streamed from memory at 10-14 GB/s on an AMD EPYC (the kernel: 26-31 GB/s). A tile of R weight rows x M rows of x (M R <= 16 accumulators): every
// W vector loaded feeds M fused multiply-adds, x stays in L1 (rows * K <= 6144 floats, checked by the
// caller), the next tile's lines are prefetched; lane (m R + r) of the reduced vector is y[m, n + r].
#if LOOPLM_KERNELS
template <int M, int R>
inline void tile_fp32(const float* x, const float* w, const float* b, int64_t K, float* y, int64_t N) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      _mm_prefetch((const char*)(w + (R + r) * K + k), _MM_HINT_T0);
      wv[r] = _mm512_loadu_ps(w + r * K + k);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_fmadd_ps(xv, wv[r], acc[m * R + r]);
    }
  }
  if (k < K) {  // the last K % 16 entries, zero-padded by masked loads
    const __mmask16 mk = (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(mk, w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mk, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_fmadd_ps(xv, wv[r], acc[m * R + r]);
    }
  }
  alignas(64) float o[16];
  _mm512_store_ps(o, sum_lanes16(acc));
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + r] = o[m * R + r] + (b ? b[r] : 0.f);
}

template <int M, int R>
void rows_fp32(const float* xp, const float* wp, const float* bp, int64_t K, int64_t N, float* yp) {
  const int64_t blocks = N / R;
  at::parallel_for(0, blocks, 64 / R, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) tile_fp32<M, R>(xp, wp + blk * R * K, bp ? bp + blk * R : nullptr, K, yp + blk * R, N);
  });
  for (int64_t n = blocks * R; n < N; ++n)  // the N % R rows after the last tile
    for (int m = 0; m < M; ++m) {
      __m512 acc = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(xp + m * K + k), _mm512_loadu_ps(wp + n * K + k), acc);
      if (k < K) {
        const __mmask16 mk = (__mmask16)((1u << (K - k)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, xp + m * K + k), _mm512_maskz_loadu_ps(mk, wp + n * K + k), acc);
      }
      yp[m * N + n] = _mm512_reduce_add_ps(acc) + (bp ? bp[n] : 0.f);
    }
}

#endif  // LOOPLM_KERNELS

at::Tensor gemv_fp32(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const auto* bp = static_cast<const float*>(check_args("gemv_fp32", at::kFloat, "float32", x, w, bias));
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "gemv_fp32: takes 1-8 rows of x, got ", x.size(0));
#if !LOOPLM_KERNELS
  TORCH_CHECK(false, "gemv_fp32: looplm's CPU kernels were built without AVX-512 (this CPU lacks AVX512-BF16)");
  (void)bp;
  return x;
#else
  const int64_t K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (x.size(0)) {  // R weight rows per tile with M R <= 16 accumulators
    case 1: rows_fp32<1, 16>(xp, wp, bp, K, N, yp); break;
    case 2: rows_fp32<2, 8>(xp, wp, bp, K, N, yp); break;
    case 3: rows_fp32<3, 5>(xp, wp, bp, K, N, yp); break;
    case 4: rows_fp32<4, 4>(xp, wp, bp, K, N, yp); break;
    case 5: rows_fp32<5, 3>(xp, wp, bp, K, N, yp); break;
    case 6: rows_fp32<6, 2>(xp, wp, bp, K, N, yp); break;
    case 7: rows_fp32<7, 2>(xp, wp, bp, K, N, yp); break;
    default: rows_fp32<8, 2>(xp, wp, bp, K, N, yp); break;
  }
  return y;
#endif
}

}  // namespace

bool amx_ready() {  // the CPU has AMX-BF16 / AMX-TILE and Linux lets this process use the tile state
#if LOOPLM_KERNELS
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

bool intel_cpu() {  // cpuid's vendor string is "GenuineIntel" (MKL's fp32 GEMM takes its fast paths there only)
#if LOOPLM_KERNELS
  static const bool intel = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;  // "Genu" "ineI" "ntel"
  }();
  return intel;
#else
  return false;
#endif
}

constexpr int64_t kBf16MaxRowEntries = 4608;  // bf16 without AMX: rows x K the one-row path per row wins at
constexpr int64_t kBf16SmallWeight = 1 << 19;  // bf16 without AMX: N x K of a weight (1 MB) it wins at for <= 8 rows

bool kernel_wins(int64_t rows, int64_t k, at::ScalarType dt, int64_t n) {  // the rule of looplm.layers.gemv.kernel_wins (tested equal)
  if (!LOOPLM_KERNELS) return false;
  // fp32: 1-8 rows while they fit in L1 beside the weight tiles; on CPUs not Intel's (MKL's slow path) 1-8 rows of any K
  if (dt == at::kFloat) return rows >= 1 && rows <= 8 && (rows * k <= kFp32MaxRowEntries || !intel_cpu());
  if (dt != at::kBFloat16) return false;
  if (rows == 1) return true;
  if (rows > kMaxRows) return false;
  // without AMX: each weight block read once for every row (from L1) while the rows and the block fit beside
  // it — up to 8 rows of K x rows <= 4608 entries (a speculative verification's k + 1 tokens, small batches),
  // and up to 8 rows of any K for a weight of <= 1 MB (n: its N; 0 = not known), e.g. a small vocabulary's head
  return amx_ready() || (rows <= 8 && (rows * k <= kBf16MaxRowEntries || (n > 0 && n * k <= kBf16SmallWeight)));
}

void gemv1_group(const RowGroup& g, const RowGroup* next) {
#if !LOOPLM_KERNELS
  TORCH_CHECK(false, "gemv1_group: looplm's CPU kernels were built without AVX512-BF16 (this CPU lacks it)");
  (void)g, (void)next;
#else
  const int64_t K = g.K, total = group_blocks(g), parts = group_parts(total);
  const int64_t next_total = next ? group_blocks(*next) : 0, next_parts = next ? group_parts(next_total) : 1;
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t j0 = p * total / parts, j1 = (p + 1) * total / parts;  // this share: blocks [j0, j1) of the list
      int i = 0;
      int64_t first = 0;  // the list index of product i's first block
      for (int64_t j = j0; j < j1; ++j) {
        while (j - first >= g.ps[i].N / kRows) first += g.ps[i++].N / kRows;
        const RowProduct& pr = g.ps[i];
        const int64_t blk = j - first;
        const uint16_t* pf = nullptr;  // what this block prefetches: the share's next block, else the next group's first
        int64_t pf_K = K;
        if (j + 1 < j1) {
          pf = blk + 1 < pr.N / kRows ? pr.w + (blk + 1) * kRows * K : block_at(g, j + 1);
        } else if (next_total > 0 && p < next_parts) {
          pf = block_at(*next, p * next_total / next_parts);
          pf_K = next->K;
        }
        block16(g.x, pr.w + blk * kRows * K, pr.b ? pr.b + blk * kRows : nullptr, K, pr.y + blk * kRows, pf, pf_K);
      }
    }
  });
  for (int i = 0; i < g.n; ++i) {  // the N % 16 rows after each product's last full block
    const RowProduct& pr = g.ps[i];
    for (int64_t n = pr.N / kRows * kRows; n < pr.N; ++n) pr.y[n] = dot1(g.x, pr.w + n * K, pr.b ? pr.b + n : nullptr, K);
  }
#endif
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  if (kernel_wins(x.size(0), x.size(1), x.scalar_type(), w.size(0)) && w.is_contiguous())
    return x.scalar_type() == at::kBFloat16 ? gemv_bf16(x, w, bias, true) : gemv_fp32(x, w, bias);
  return at::linear(x, w, bias);
}

}  // namespace looplm_cpu

using looplm_cpu::amx_ready;
using looplm_cpu::gemv_bf16;
using looplm_cpu::gemv_fp32;

TORCH_LIBRARY(looplm_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor weight, Tensor? bias=None, bool use_amx=True) -> Tensor");
  m.def("gemv_fp32(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("intel_cpu() -> bool", &looplm_cpu::intel_cpu);
  m.def("kernel_wins(int rows, int k, ScalarType dtype, int n=0) -> bool", &looplm_cpu::kernel_wins);  // for the test that holds it to gemv.py's rule
}
TORCH_LIBRARY_IMPL(looplm_cpu, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_fp32", &gemv_fp32);
}
