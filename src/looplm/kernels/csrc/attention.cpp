// The backward pass of causal (or full) softmax attention on CPU, for training: dQ, dK, dV from dO, Q, K,
// V, the forward output O and its log-sum-exp L (what torch's CPU flash forward returns). Built with
// gemv.cpp and decode.cpp by looplm/layers/gemv.py; used by looplm/layers/attention.py (CPUAttention).
//
// Why this exists: at the SmolLM2-135M training shape (4 × 256 tokens, 9 query / 3 key-value heads of 64)
// torch 2.13's CPU flash-attention backward takes ~8.4 ms per layer in bf16 — nine times its forward
// (~0.95 ms) and a sixth of the whole training step. Its inner products are many small per-head GEMMs.
// Here each (batch row, key/value head) is one task, and each product of a query block is one call of
// the MKL GEMM that torch itself links (cblas_gemm_bf16bf16f32: AMX / AVX512-BF16 with fp32 results, as
// torch's flash kernel computes its scores; sgemm_ for fp32), with transposes as GEMM flags and strided
// rows as leading dimensions, so nothing is copied. The symbols are looked up weakly: a torch built
// without MKL leaves them null, gemm_ready() says so, and looplm/layers/attention.py keeps SDPA there.
// The reference is the autograd of F.scaled_dot_product_attention; tests/test_training_kernels.py holds
// the two together.
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
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace looplm_cpu {
namespace {

constexpr int64_t kQueryBlock = 64;  // query rows per block: the [64, S] fp32 scores of one block stay in L2

}  // namespace
}  // namespace looplm_cpu

// MKL's GEMMs as libtorch_cpu exports them (x86-64 wheels link MKL statically); weak: null without MKL.
extern "C" {
__attribute__((weak)) void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                                  const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                                                  int ldc);
__attribute__((weak)) void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
                                  const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                                  const int* ldc);
}

namespace looplm_cpu {
namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS_LAYOUT / CBLAS_TRANSPOSE

// C [M, N] = op(A) · op(B) (+ C when accumulate), row-major, fp32 C; op(X) = Xᵀ when its flag is set
// (A is then stored [K, M], B [N, K]). lda / ldb / ldc: row strides of the stored matrices.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float* C, int64_t ldc,
          bool accumulate) {
  cblas_gemm_bf16bf16f32(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, (int)M, (int)N, (int)K, 1.0f,
                         reinterpret_cast<const uint16_t*>(A), (int)lda, reinterpret_cast<const uint16_t*>(B), (int)ldb,
                         accumulate ? 1.0f : 0.0f, C, (int)ldc);
}
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
          bool accumulate) {
  // column-major BLAS: the row-major C is the column-major Cᵀ = op(B)ᵀ · op(A)ᵀ
  const char fa = ta ? 'T' : 'N', fb = tb ? 'T' : 'N';
  const int m = (int)N, n = (int)M, k = (int)K, la = (int)lda, lb = (int)ldb, lc = (int)ldc;
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  sgemm_(&fb, &fa, &m, &n, &k, &one, B, &lb, A, &la, &beta, C, &lc);
}

bool gemm_ready() { return cblas_gemm_bf16bf16f32 != nullptr && sgemm_ != nullptr; }

// Σ a_i b_i (fp32) over n entries.
template <typename T>
float dot(const T* a, const T* b, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(load16(a + i, first(n - i)), load16(b + i, first(n - i)), acc);
  return _mm512_reduce_add_ps(acc);
#else
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += widen(a[i]) * widen(b[i]);
  return acc;
#endif
}

// y[0..n) = T(x[0..n)).
template <typename T>
void store_row(const float* x, int64_t n, T* y) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  for (int64_t i = 0; i < n; i += 16) store16(y + i, _mm512_maskz_loadu_ps(first(n - i), x + i), first(n - i));
#else
  for (int64_t i = 0; i < n; ++i) y[i] = T(x[i]);
#endif
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

// One row of a forward block: P = exp(s·S − m) over the `visible` first keys (0 past them), rounded to T
// for the product with V, with m the row's maximum of s·S; returns (m, Σ P unrounded) — the rounding and
// the unrounded sum torch's CPU flash kernel uses.
template <typename T>
std::pair<float, float> softmax_row(const float* S, int64_t n, int64_t visible, float scale, T* P) {
  float m = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  __m512 vm = _mm512_set1_ps(m);
  for (int64_t j = 0; j < visible; j += 16) vm = _mm512_mask_max_ps(vm, first(visible - j), vm, _mm512_maskz_loadu_ps(first(visible - j), S + j));
  m = _mm512_reduce_max_ps(vm) * scale;
  const __m512 vs = _mm512_set1_ps(scale), vmax = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = first(n - j);
    const __mmask16 vis = j >= visible ? (__mmask16)0 : first(visible - j);
    const __m512 e = _mm512_maskz_mov_ps(vis, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, S + j), vs, vmax)));
    total = _mm512_add_ps(total, e);
    store16(P + j, e, k);
  }
  return {m, _mm512_reduce_add_ps(total)};
#else
  for (int64_t j = 0; j < visible; ++j) m = std::max(m, S[j]);
  m *= scale;
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float e = j < visible ? std::exp(S[j] * scale - m) : 0.f;
    total += e;
    P[j] = T(e);
  }
  return {m, total};
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
    std::vector<float> dK(S * hd), dV(S * hd);                    // [S, hd] fp32 accumulators of the group
    std::vector<float> Sc(kQueryBlock * S), dP(kQueryBlock * S);  // [rows, keys] fp32
    std::vector<T> P(kQueryBlock * S), dS(kQueryBlock * S);       // the same, rounded to T
    std::vector<float> dQb(kQueryBlock * hd), delta(T_);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, g = task % Hkv;
      const T* Kg = K + b * kb + g * kh;  // [S, hd], row stride kt
      const T* Vg = V + b * vb + g * vh;
      std::fill(dK.begin(), dK.end(), 0.f);
      std::fill(dV.begin(), dV.end(), 0.f);
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = g * G + hh;
        const T* Qh = Q + b * qb + h * qh;
        const T* Oh = O + b * ob + h * oh;
        const T* dOh = DO + b * gb + h * gh;
        const float* Lh = Lse + b * lb + h * lh;
        T* dQh = DQ + (b * H + h) * T_ * hd;
        for (int64_t i = 0; i < T_; ++i) delta[i] = dot(dOh + i * gt, Oh + i * ot, hd);  // Δᵢ = dOᵢ·Oᵢ
        for (int64_t i0 = 0; i0 < T_; i0 += kQueryBlock) {
          const int64_t nb = std::min(kQueryBlock, T_ - i0);
          const int64_t kend = causal ? i0 + nb : S;  // keys any row of the block sees
          const T* Qb = Qh + i0 * qt;
          const T* dOb = dOh + i0 * gt;
          gemm(false, true, nb, kend, hd, Qb, qt, Kg, kt, Sc.data(), S, false);   // S = Q·Kᵀ
          gemm(false, true, nb, kend, hd, dOb, gt, Vg, vt, dP.data(), S, false);  // dP = dO·Vᵀ
          for (int64_t r = 0; r < nb; ++r) {
            const int64_t i = i0 + r;
            softmax_grad_row<T>(Sc.data() + r * S, dP.data() + r * S, kend, causal ? i + 1 : kend, scale, Lh[i * lt], delta[i],
                                P.data() + r * S, dS.data() + r * S);
          }
          gemm(false, false, nb, hd, kend, dS.data(), S, Kg, kt, dQb.data(), hd, false);  // dQ = dS·K
          for (int64_t r = 0; r < nb; ++r) store_row(dQb.data() + r * hd, hd, dQh + (i0 + r) * hd);
          gemm(true, false, kend, hd, nb, dS.data(), S, Qb, qt, dK.data(), hd, true);  // dK += dSᵀ·Q
          gemm(true, false, kend, hd, nb, P.data(), S, dOb, gt, dV.data(), hd, true);  // dV += Pᵀ·dO
        }
      }
      T* dKg = DK + (b * Hkv + g) * S * hd;
      T* dVg = DV + (b * Hkv + g) * S * hd;
      store_row(dK.data(), S * hd, dKg);
      store_row(dV.data(), S * hd, dVg);
    }
  });
  return {dq, dk, dv};
}

// out = softmax(s·Q Kᵀ + causal mask) V and L = its row log-sum-exp, for each query block in one pass
// over its keys (the scores of a 64-row block are at most 64 × S floats): S = Q·Kᵀ (fp32), P = exp(s·S − m)
// rounded to T, O = P·V / ΣP. Returns out [B, H, T, hd] laid out as [B, T, H, hd] (as torch's flash kernel
// returns it: the o_proj input is then a free view) and L [B, H, T] fp32.
template <typename T>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale_d, bool causal) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), hd = q.size(3), Hkv = k.size(1), S = k.size(2);
  const int64_t G = H / Hkv;
  const float scale = static_cast<float>(scale_d);
  at::Tensor out = at::empty({B, T_, H, hd}, q.options()).transpose(1, 2);  // [B, H, T, hd] view
  at::Tensor lse = at::empty({B, H, T_}, q.options().dtype(at::kFloat));
  const T *Q = cdata<T>(q), *K = cdata<T>(k), *V = cdata<T>(v);
  T* Out = mdata<T>(out);
  float* L = lse.data_ptr<float>();
  const int64_t qb = q.stride(0), qh = q.stride(1), qt = q.stride(2);
  const int64_t kb = k.stride(0), kh = k.stride(1), kt = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vt = v.stride(2);
  const int64_t ob = out.stride(0), oh = out.stride(1), ot = out.stride(2);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Sc(kQueryBlock * S), Ob(kQueryBlock * hd), inv(kQueryBlock);
    std::vector<T> P(kQueryBlock * S);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, g = task % Hkv;
      const T* Kg = K + b * kb + g * kh;
      const T* Vg = V + b * vb + g * vh;
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = g * G + hh;
        const T* Qh = Q + b * qb + h * qh;
        T* Oh = Out + b * ob + h * oh;
        float* Lh = L + (b * H + h) * T_;
        for (int64_t i0 = 0; i0 < T_; i0 += kQueryBlock) {
          const int64_t nb = std::min(kQueryBlock, T_ - i0);
          const int64_t kend = causal ? i0 + nb : S;
          gemm(false, true, nb, kend, hd, Qh + i0 * qt, qt, Kg, kt, Sc.data(), S, false);  // S = Q·Kᵀ
          for (int64_t r = 0; r < nb; ++r) {
            const auto [m, total] = softmax_row<T>(Sc.data() + r * S, kend, causal ? i0 + r + 1 : kend, scale, P.data() + r * S);
            Lh[i0 + r] = m + std::log(total);
            inv[r] = 1.0f / total;
          }
          gemm(false, false, nb, hd, kend, P.data(), S, Vg, vt, Ob.data(), hd, false);  // O = P·V
          for (int64_t r = 0; r < nb; ++r) {
            float* o = Ob.data() + r * hd;
            for (int64_t d = 0; d < hd; ++d) o[d] *= inv[r];
            store_row(o, hd, Oh + (i0 + r) * ot);
          }
        }
      }
    }
  });
  return {out, lse};
}

void check4(const char* op, const char* name, const at::Tensor& t, at::ScalarType dt) {
  TORCH_CHECK(t.dim() == 4 && t.device().is_cpu() && t.scalar_type() == dt && t.stride(3) == 1,
              op, ": ", name, " must be a 4-d CPU ", dt, " tensor with a contiguous last dimension, got ", t.scalar_type(),
              " ", t.sizes(), " strides ", t.strides(), " on ", t.device());
}

// The checks both attention ops make of q, k, v; returns their dtype.
at::ScalarType check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal) {
  const at::ScalarType dt = q.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, op, ": q must be bfloat16 or float32, got ", dt);
  check4(op, "q", q, dt);
  check4(op, "k", k, dt);
  check4(op, "v", v, dt);
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), hd = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == hd && v.sizes() == k.sizes() && Hkv > 0 && H % Hkv == 0,
              op, ": k and v must be [B, Hkv, S, hd] with Hkv dividing q's ", H, " heads; got q ", q.sizes(), ", k ", k.sizes(), ", v ",
              v.sizes());
  TORCH_CHECK(!is_causal || S == T_, op, ": causal attention needs as many keys as queries, got ", T_, " queries and ", S, " keys");
  TORCH_CHECK(gemm_ready(), op, ": this torch was built without MKL (no cblas_gemm_bf16bf16f32 / sgemm_ in libtorch_cpu); "
              "use F.scaled_dot_product_attention");
  TORCH_CHECK(std::max({T_, S, hd, H * T_ * hd}) < (int64_t(1) << 31), op, ": sizes beyond 32-bit BLAS indices");
  return dt;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                                                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                                  double scale, bool is_causal) {
  const at::ScalarType dt = check_qkv("attention_backward", q, k, v, is_causal);
  check4("attention_backward", "out", out, dt);
  check4("attention_backward", "grad_out", grad_out, dt);
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2);
  TORCH_CHECK(out.sizes() == q.sizes() && grad_out.sizes() == q.sizes(), "attention_backward: out and grad_out must have q's shape ",
              q.sizes(), ", got ", out.sizes(), " and ", grad_out.sizes());
  TORCH_CHECK(lse.dim() == 3 && lse.scalar_type() == at::kFloat && lse.size(0) == B && lse.size(1) == H && lse.size(2) == T_,
              "attention_backward: lse must be float32 [B, H, T] = [", B, ", ", H, ", ", T_, "], got ", lse.scalar_type(), " ",
              lse.sizes());
  if (dt == at::kBFloat16) return backward_impl<bf16>(grad_out, q, k, v, out, lse, scale, is_causal);
  return backward_impl<float>(grad_out, q, k, v, out, lse, scale, is_causal);
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                                     bool is_causal) {
  const at::ScalarType dt = check_qkv("attention_forward", q, k, v, is_causal);
  TORCH_CHECK(k.size(2) > 0, "attention_forward: no keys");
  if (dt == at::kBFloat16) return forward_impl<bf16>(q, k, v, scale, is_causal);
  return forward_impl<float>(q, k, v, scale, is_causal);
}

// t as a BLAS operand: rows with a leading dimension (trans = false), a transposed view of such rows
// (trans = true), or else a contiguous copy.
at::Tensor blas_operand(const at::Tensor& t, bool& trans, int64_t& ld) {
  if (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(t.size(1), 1)) {
    trans = false, ld = t.stride(0);
    return t;
  }
  if (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(t.size(0), 1)) {
    trans = true, ld = t.stride(1);
    return t;
  }
  trans = false, ld = std::max<int64_t>(t.size(1), 1);
  return t.contiguous();
}

// C [M, N] fp32 = a [M, K] · b [K, N] for bf16 a, b (each row-major or a transposed view: the transpose
// is a GEMM flag): the weight gradient dyᵀ·x of a bf16 linear layer straight in fp32, for its fp32 master
// weight (looplm/layers/cpu_gemm.py). MKL's bf16 GEMM with fp32 results, 2.1-2.5 TFLOP/s on a 2-core AMX
// Xeon at the SmolLM2-135M shapes, where torch's bf16 matmul and a cast to fp32 ran at 0.9-1.5.
at::Tensor mm_f32(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(gemm_ready(), "mm_f32: this torch was built without MKL (no cblas_gemm_bf16bf16f32 in libtorch_cpu)");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) && a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 &&
                  a.device().is_cpu() && b.device().is_cpu(),
              "mm_f32: a [M, K] and b [K, N] must be 2-d bf16 CPU tensors, got ", a.scalar_type(), " ", a.sizes(), " and ", b.scalar_type(), " ",
              b.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  bool ta = false, tb = false;
  int64_t lda = 0, ldb = 0;
  const at::Tensor A = blas_operand(a, ta, lda), Bm = blas_operand(b, tb, ldb);
  at::Tensor c = at::empty({M, N}, a.options().dtype(at::kFloat));
  TORCH_CHECK(std::max({M, N, K, lda, ldb}) < (int64_t(1) << 31), "mm_f32: sizes beyond 32-bit BLAS indices");
  if (M == 0 || N == 0) return c;
  if (K == 0) return c.zero_();
  gemm(ta, tb, M, N, K, reinterpret_cast<const bf16*>(A.data_ptr()), lda, reinterpret_cast<const bf16*>(Bm.data_ptr()), ldb,
       c.data_ptr<float>(), N, false);
  return c;
}

}  // namespace
}  // namespace looplm_cpu

TORCH_LIBRARY_FRAGMENT(looplm_cpu, m) {
  m.def("mm_f32(Tensor a, Tensor b) -> Tensor");
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, float scale, bool is_causal) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, bool is_causal) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("attention_backward_ready() -> bool", &looplm_cpu::gemm_ready);
}
TORCH_LIBRARY_IMPL(looplm_cpu, CPU, m) {
  m.impl("attention_backward", &looplm_cpu::attention_backward);
  m.impl("mm_f32", &looplm_cpu::mm_f32);
  m.impl("attention_forward", &looplm_cpu::attention_forward);
}
