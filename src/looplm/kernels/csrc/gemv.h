// What gemv.cpp offers the other kernels of the extension (decode.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace looplm_cpu {

constexpr int64_t kMaxRows = 16;                // the AMX path's limit: one B tile holds 16 rows of x
constexpr int64_t kFp32MaxRowEntries = 6144;    // fp32 kernel: rows x K of x that stay in L1 beside the weight tiles

// The CPU has AMX-BF16 / AMX-TILE and Linux lets this process use the tile state (checked once).
bool amx_ready();

// Where the kernels beat torch's matmul: the rule of looplm.layers.gemv.kernel_wins (a test holds them equal).
// n: the weight's N (output features; 0 = not known).
bool kernel_wins(int64_t rows, int64_t k, at::ScalarType dt, int64_t n = 0);

// Whether cpuid's vendor is GenuineIntel (false in the portable build).
bool intel_cpu();

// y [M, N] = x [M, K] · Wᵀ (+ b): a kernel where kernel_wins says so, else at::linear (torch's matmul).
// x contiguous; W [N, K]; all of one dtype.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// One bf16 row of x times several weight matrices (a decode step at batch 1): y_i [N_i] = x [K] · W_iᵀ (+ b_i),
// bf16 bits, W_i [N_i, K] contiguous.
struct RowProduct {
  const uint16_t* w;  // [N, K]
  const uint16_t* b;  // [N] or nullptr
  int64_t N;
  uint16_t* y;  // [N]
};
struct RowGroup {  // products that read one input x [K]
  const uint16_t* x;
  int64_t K;
  const RowProduct* ps;
  int n;
};

// Every product of g in one parallel region, where kernel_wins(1, K, bf16). next: the group the caller runs
// after this one (its weights prefetched at the end of each thread's share; only w, N and K are read), or nullptr.
void gemv1_group(const RowGroup& g, const RowGroup* next);

}  // namespace looplm_cpu
