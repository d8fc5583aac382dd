// The softmax cross-entropy of one chunk of logits and its gradient, in place, on CPU: the inner loop of
// looplm/layers/loss.py's chunked head + loss (linear_cross_entropy). Built with the other kernels by
// looplm/layers/gemv.py.
//
// Why this exists: at the SmolLM2-135M training shape (1024 tokens × a 49,152-word vocabulary per step) the
// PyTorch form of this loop — blocks of 16 rows: cast to fp32, max, subtract, exp, sum, scale, cast back,
// scatter the target's entry — took ~80 ms of a ~1.3 s step on a 2-core Xeon, mostly passes over memory
// and per-op overhead. Here each row is read twice and written once.
//
// For row i with logits zᵢ [V] (the matmul dtype T), target yᵢ (−100: ignored) and weight rᵢ (`weight`, the
// 1 / number of counted rows of the whole batch; 0 for an ignored row), in fp32:
//   mᵢ = max_j zᵢⱼ,  sᵢ = Σⱼ exp(zᵢⱼ − mᵢ),  lossᵢ = mᵢ + log sᵢ − zᵢ,yᵢ   (0 for an ignored row)
//   zᵢⱼ ← T(exp(zᵢⱼ − mᵢ) · (rᵢ / sᵢ)),  zᵢ,yᵢ ← T((exp(zᵢ,yᵢ − mᵢ) / sᵢ − 1) · rᵢ)   (d mean loss / d zᵢⱼ)
// as the PyTorch form computes them (loss.py keeps it as the reference and the path without the extension).
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace looplm_cpu {
namespace {

template <typename T>
float row_max(const T* z, int64_t V) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 k = first(V - j);
    m = _mm512_mask_max_ps(m, k, m, load16(z + j, k));
  }
  return _mm512_reduce_max_ps(m);
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < V; ++j) m = std::max(m, widen(z[j]));
  return m;
#endif
}

// e[j] = exp(z[j] − m) (fp32); returns Σ e.
template <typename T>
float exp_row(const T* z, int64_t V, float m, float* e) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  __m512 s = _mm512_setzero_ps();
  const __m512 vm = _mm512_set1_ps(m);
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 k = first(V - j);
    const __m512 x = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(load16(z + j, k), vm)));
    _mm512_mask_storeu_ps(e + j, k, x);
    s = _mm512_add_ps(s, x);
  }
  return _mm512_reduce_add_ps(s);
#else
  float s = 0.f;
  for (int64_t j = 0; j < V; ++j) s += (e[j] = std::exp(widen(z[j]) - m));
  return s;
#endif
}

// z[j] = T(e[j] · c).
template <typename T>
void scale_row(const float* e, float c, int64_t V, T* z) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const __m512 vc = _mm512_set1_ps(c);
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 k = first(V - j);
    store16(z + j, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, e + j), vc), k);
  }
#else
  for (int64_t j = 0; j < V; ++j) z[j] = T(e[j] * c);
#endif
}

template <typename T>
at::Tensor impl(at::Tensor& z, const at::Tensor& targets, float weight, bool grad) {
  const int64_t N = z.size(0), V = z.size(1);
  at::Tensor loss = at::empty({N}, z.options().dtype(at::kFloat));
  T* Z = reinterpret_cast<T*>(z.data_ptr());
  const int64_t* Y = targets.data_ptr<int64_t>();
  float* L = loss.data_ptr<float>();
  const float r = weight;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(V);
    for (int64_t i = begin; i < end; ++i) {
      T* zi = Z + i * V;
      const int64_t y = Y[i];
      const bool counted = y != -100;
      const float m = row_max(zi, V);
      const float s = exp_row(zi, V, m, e.data());
      L[i] = counted ? m + std::log(s) - widen(zi[y]) : 0.f;
      if (!grad) continue;
      const float ri = counted ? r : 0.f;
      scale_row(e.data(), ri / s, V, zi);
      if (counted) zi[y] = T((e[y] / s - 1.0f) * ri);
    }
  });
  return loss;
}

at::Tensor cross_entropy_rows_(at::Tensor z, const at::Tensor& targets, const at::Tensor& weight, bool grad) {
  const at::ScalarType dt = z.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, "cross_entropy_rows_: logits must be bfloat16 or float32, got ", dt);
  TORCH_CHECK(z.dim() == 2 && z.is_contiguous() && z.device().is_cpu(), "cross_entropy_rows_: logits must be a contiguous CPU [N, V] tensor, got ",
              z.sizes(), " on ", z.device());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == z.size(0) && targets.scalar_type() == at::kLong && targets.is_contiguous(),
              "cross_entropy_rows_: targets must be a contiguous int64 [N] tensor with N = ", z.size(0), ", got ", targets.scalar_type(), " ",
              targets.sizes());
  TORCH_CHECK(weight.numel() == 1 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "cross_entropy_rows_: weight must be one float32 CPU value, got ", weight.scalar_type(), " ", weight.sizes());
  const float w = weight.item<float>();
  const int64_t V = z.size(1);
  const int64_t* Y = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < targets.size(0); ++i)
    TORCH_CHECK(Y[i] == -100 || (Y[i] >= 0 && Y[i] < V), "cross_entropy_rows_: target ", Y[i], " at row ", i, " is outside [0, ", V,
                ") and not the ignore index -100");
  if (dt == at::kBFloat16) return impl<bf16>(z, targets, w, grad);
  return impl<float>(z, targets, w, grad);
}

}  // namespace
}  // namespace looplm_cpu

TORCH_LIBRARY_FRAGMENT(looplm_cpu, m) {
  m.def("cross_entropy_rows_(Tensor(a!) z, Tensor targets, Tensor weight, bool grad) -> Tensor");
}
TORCH_LIBRARY_IMPL(looplm_cpu, CPU, m) { m.impl("cross_entropy_rows_", &looplm_cpu::cross_entropy_rows_); }
