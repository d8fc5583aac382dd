// The backward pass of causal (or full) softmax attention on CPU, for training: dQ, dK, dV from dO, Q, K,
// V, the forward output O and its log-sum-exp L (what torch's CPU flash forward returns). Built with
// gemv.cpp and decode.cpp by looplm/layers/gemv.py; used by looplm/layers/attention.py (CPUAttention).
//
// Why this exists: at the SmolLM2-135M training shape (4 × 256 tokens, 9 query / 3 key-value heads of 64)
// torch 2.13's CPU flash-attention backward takes ~8.4 ms per layer in bf16 — nine times its forward
// (~0.95 ms) and a sixth of the whole training step. Its inner products are many small per-head GEMMs.
// Here the products are few and larger: for each (batch row, key/value head) the G query heads that share
// it reuse one transposed copy of K and V, and every product goes through torch's batch-reduce GEMM
// (at::native::cpublas::brgemm: oneDNN's AMX / AVX-512 micro-kernel) with fp32 results, as torch's flash
// kernel computes its scores. The reference is the autograd of F.scaled_dot_product_attention;
// tests/test_training_kernels.py holds the two together.
//
// For one query block (rows i of one head, keys j < kend) with s = 1/√hd (eq. of any attention backward):
//   Sᵢⱼ = Qᵢ·Kⱼ (fp32)          Pᵢⱼ = exp(s·Sᵢⱼ − Lᵢ), 0 where j > i (causal)
//   dPᵢⱼ = dOᵢ·Vⱼ (fp32)        Δᵢ = dOᵢ·Oᵢ (fp32)        dSᵢⱼ = s · Pᵢⱼ · (dPᵢⱼ − Δᵢ)
//   dQᵢ = Σⱼ dSᵢⱼ Kⱼ            dKⱼ += Σᵢ dSᵢⱼ Qᵢ          dVⱼ += Σᵢ Pᵢⱼ dOᵢ
// P and dS are rounded to the inputs' dtype for the last three products (as torch's flash kernel does);
// dK and dV accumulate in fp32 over query blocks and over the G heads of a group, and are rounded once.
//
// Shapes: q, dO, O [B, H, T, hd]; k, v [B, Hkv, S, hd] (H a multiple of Hkv; causal needs S = T); L [B, H, T]
// fp32. Any strides with the last dimension contiguous. Returns dq [B, H, T, hd], dk, dv [B, Hkv, S, hd].
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace looplm_cpu {
namespace {

constexpr int64_t kQueryBlock = 64;  // query rows per block: the [64, S] fp32 scores of one block stay in L2
constexpr int64_t kColBlock = 256;   // output columns per brgemm call

// C [M, N] (+)= A [M, K] · B [K, N], all row-major with leading dimensions lda, ldb, ldc; fp32 C.
template <typename T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += kColBlock) {
    const int64_t nb = std::min(kColBlock, N - n0);
    at::native::cpublas::brgemm(M, nb, K, lda, ldb, ldc, accumulate, A, B + n0, C + n0, /*is_vnni=*/false);
  }
}

// One row of the block: P and dS from the scores S and dP (fp32, n keys), row i's L and Δ; keys past
// `visible` get P = 0. P and dS are written as T.
template <typename T>
void softmax_grad_row(const float* S, const float* dP, int64_t n, int64_t visible, float scale, float lse, float delta, T* P, T* dS) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const __m512 vs = _mm512_set1_ps(scale), vl = _mm512_set1_ps(lse), vd = _mm512_set1_ps(delta);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first(n - j);
    const __mmask16 vis = j >= visible ? (__mmask16)0 : first(visible - j);
    const __m512 p = _mm512_maskz_mov_ps(vis, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, S + j), vs, vl)));
    const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(_mm512_maskz_loadu_ps(m, dP + j), vd)), vs);
    store16(P + j, p, m);
    store16(dS + j, ds, m);
  }
#else
  for (int64_t j = 0; j < n; ++j) {
    const float p = j < visible ? std::exp(S[j] * scale - lse) : 0.f;
    P[j] = T(p);
    dS[j] = T(p * (dP[j] - delta) * scale);
  }
#endif
}

template <typename T>
const T* cdata(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <typename T>
T* mdata(at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(const at::Tensor& dO, const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                                                             double scale_d, bool causal) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), hd = q.size(3), Hkv = k.size(1), S = k.size(2);
  const int64_t G = H / Hkv;
  const float scale = static_cast<float>(scale_d);
  at::Tensor dq = at::empty({B, H, T_, hd}, q.options());
  at::Tensor dk = at::empty({B, Hkv, S, hd}, k.options());
  at::Tensor dv = at::empty({B, Hkv, S, hd}, v.options());
  const T *Q = cdata<T>(q), *K = cdata<T>(k), *V = cdata<T>(v), *O = cdata<T>(o), *DO = cdata<T>(dO);
  const float* Lse = lse.data_ptr<float>();
  T *DQ = mdata<T>(dq), *DK = mdata<T>(dk), *DV = mdata<T>(dv);
  // element strides of [B, H, T, hd] views (last dim contiguous, checked by the caller)
  const int64_t qb = q.stride(0), qh = q.stride(1), qt = q.stride(2);
  const int64_t kb = k.stride(0), kh = k.stride(1), kt = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vt = v.stride(2);
  const int64_t ob = o.stride(0), oh = o.stride(1), ot = o.stride(2);
  const int64_t gb = dO.stride(0), gh = dO.stride(1), gt = dO.stride(2);
  const int64_t lb = lse.stride(0), lh = lse.stride(1), lt = lse.stride(2);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> Kt(hd * S), Vt(hd * S);                                 // Kᵀ, Vᵀ [hd, S] of this group
    std::vector<float> dKt(hd * S), dVt(hd * S);                           // dKᵀ, dVᵀ [hd, S] accumulators
    std::vector<float> Sc(kQueryBlock * S), dP(kQueryBlock * S);           // [rows, keys] fp32
    std::vector<T> P(kQueryBlock * S), dS(kQueryBlock * S);                // the same, rounded to T
    std::vector<T> Qt(hd * kQueryBlock), dOt(hd * kQueryBlock);            // Qᵀ, dOᵀ [hd, rows] of the block
    std::vector<float> dQb(kQueryBlock * hd), delta(T_);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, g = task % Hkv;
      const T* Kg = K + b * kb + g * kh;
      const T* Vg = V + b * vb + g * vh;
      for (int64_t j = 0; j < S; ++j)
        for (int64_t d = 0; d < hd; ++d) {
          Kt[d * S + j] = Kg[j * kt + d];
          Vt[d * S + j] = Vg[j * vt + d];
        }
      std::fill(dKt.begin(), dKt.end(), 0.f);
      std::fill(dVt.begin(), dVt.end(), 0.f);
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = g * G + hh;
        const T* Qh = Q + b * qb + h * qh;
        const T* Oh = O + b * ob + h * oh;
        const T* dOh = DO + b * gb + h * gh;
        const float* Lh = Lse + b * lb + h * lh;
        T* dQh = DQ + (b * H + h) * T_ * hd;
        for (int64_t i = 0; i < T_; ++i) {  // Δᵢ = dOᵢ·Oᵢ
          float acc = 0.f;
          for (int64_t d = 0; d < hd; ++d) acc += widen(dOh[i * gt + d]) * widen(Oh[i * ot + d]);
          delta[i] = acc;
        }
        for (int64_t i0 = 0; i0 < T_; i0 += kQueryBlock) {
          const int64_t nb = std::min(kQueryBlock, T_ - i0);
          const int64_t kend = causal ? i0 + nb : S;  // keys any row of the block sees
          gemm<T>(nb, kend, hd, Qh + i0 * qt, qt, Kt.data(), S, Sc.data(), S, false);   // S = Q·Kᵀ
          gemm<T>(nb, kend, hd, dOh + i0 * gt, gt, Vt.data(), S, dP.data(), S, false);  // dP = dO·Vᵀ
          for (int64_t r = 0; r < nb; ++r) {
            const int64_t i = i0 + r;
            softmax_grad_row<T>(Sc.data() + r * S, dP.data() + r * S, kend, causal ? i + 1 : kend, scale, Lh[i * lt], delta[i],
                                P.data() + r * S, dS.data() + r * S);
          }
          gemm<T>(nb, hd, kend, dS.data(), S, Kg, kt, dQb.data(), hd, false);  // dQ = dS·K
          for (int64_t r = 0; r < nb; ++r)
            for (int64_t d = 0; d < hd; ++d) dQh[(i0 + r) * hd + d] = T(dQb[r * hd + d]);
          for (int64_t r = 0; r < nb; ++r)
            for (int64_t d = 0; d < hd; ++d) {
              Qt[d * nb + r] = Qh[(i0 + r) * qt + d];
              dOt[d * nb + r] = dOh[(i0 + r) * gt + d];
            }
          gemm<T>(hd, kend, nb, Qt.data(), nb, dS.data(), S, dKt.data(), S, true);  // dKᵀ += Qᵀ·dS
          gemm<T>(hd, kend, nb, dOt.data(), nb, P.data(), S, dVt.data(), S, true);  // dVᵀ += dOᵀ·P
        }
      }
      T* dKg = DK + (b * Hkv + g) * S * hd;
      T* dVg = DV + (b * Hkv + g) * S * hd;
      for (int64_t j = 0; j < S; ++j)
        for (int64_t d = 0; d < hd; ++d) {
          dKg[j * hd + d] = T(dKt[d * S + j]);
          dVg[j * hd + d] = T(dVt[d * S + j]);
        }
    }
    at::native::cpublas::brgemm_release(/*is_vnni=*/false);
  });
  return {dq, dk, dv};
}

void check4(const char* name, const at::Tensor& t, at::ScalarType dt) {
  TORCH_CHECK(t.dim() == 4 && t.device().is_cpu() && t.scalar_type() == dt && t.stride(3) == 1,
              "attention_backward: ", name, " must be a 4-d CPU ", dt, " tensor with a contiguous last dimension, got ", t.scalar_type(),
              " ", t.sizes(), " strides ", t.strides(), " on ", t.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                                                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                                  double scale, bool is_causal) {
  const at::ScalarType dt = q.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, "attention_backward: q must be bfloat16 or float32, got ", dt);
  check4("q", q, dt);
  check4("k", k, dt);
  check4("v", v, dt);
  check4("out", out, dt);
  check4("grad_out", grad_out, dt);
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), hd = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == hd && v.sizes() == k.sizes() && Hkv > 0 && H % Hkv == 0,
              "attention_backward: k and v must be [B, Hkv, S, hd] with Hkv dividing q's ", H, " heads; got q ", q.sizes(), ", k ",
              k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(out.sizes() == q.sizes() && grad_out.sizes() == q.sizes(), "attention_backward: out and grad_out must have q's shape ",
              q.sizes(), ", got ", out.sizes(), " and ", grad_out.sizes());
  TORCH_CHECK(lse.dim() == 3 && lse.scalar_type() == at::kFloat && lse.size(0) == B && lse.size(1) == H && lse.size(2) == T_,
              "attention_backward: lse must be float32 [B, H, T] = [", B, ", ", H, ", ", T_, "], got ", lse.scalar_type(), " ",
              lse.sizes());
  TORCH_CHECK(!is_causal || S == T_, "attention_backward: causal attention needs as many keys as queries, got ", T_, " queries and ",
              S, " keys");
  if (dt == at::kBFloat16) return backward_impl<bf16>(grad_out, q, k, v, out, lse, scale, is_causal);
  return backward_impl<float>(grad_out, q, k, v, out, lse, scale, is_causal);
}

}  // namespace
}  // namespace looplm_cpu

TORCH_LIBRARY_FRAGMENT(looplm_cpu, m) {
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, bool is_causal) "
        "-> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(looplm_cpu, CPU, m) { m.impl("attention_backward", &looplm_cpu::attention_backward); }
