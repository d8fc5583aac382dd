// One decode step (one new token per sequence) of looplm's pre-norm blocks as fused ops — the attention
// branch, the SwiGLU branch and the Mamba-2 branch — for bf16 and fp32 on CPU. Built with gemv.cpp by
// looplm/layers/gemv.py (with AVX-512 where the CPU has AVX512-BF16, else portably: plain loops, AVX2
// where available); used by looplm/layers/decode.py (DecodeBlock) inside generate().
//
// Why this exists: after the products moved onto gemv.cpp's kernels, a batch-1 decode step of the
// SmolLM2-135M shape spent as long again outside them: ~330 µs per block of eager PyTorch (RMSNorm's
// composite, RoPE's eight ops per head set, views, the KV writes, SDPA, the residual adds), and a compiled
// block still ~270 µs (guard evaluation, the generated wrapper). Here everything between the products is a
// few loops over a few hundred numbers, and the products are linear_rows (gemv.cpp's kernels where they
// win, torch's matmul elsewhere).
//
// The reference is looplm.blocks.Block.forward; tests/test_decode_block.py holds the two together. The
// rounding of every intermediate follows the reference's: each value the reference stores in a tensor of
// the model's dtype is rounded to that dtype here at the same point (RMSNorm: x·rsqrt(mean x² + eps)·w in
// fp32, rounded once, as torch 2.13's rms_norm; RoPE: x·cos and rotate_half(x)·sin rounded, then their sum;
// the attention weights rounded for the product with V, their sum not, as torch's CPU flash kernel; SiLU
// rounded, then its product with up; each residual sum rounded). What differs is the order of the fp32
// additions inside the reductions (RMSNorm's mean, the attention's dot products and weighted sum, the
// SSM's S·C), fused multiply-adds, and exp to an ulp or two.
//
// Shapes (B rows, one new token each; H query heads, G key/value heads of hd channels; d model width):
//   x [B, 1, d]; caches [B, G, capacity, hd] with `pos` tokens written (the new one goes to `pos`);
//   cos, sin [B, 1, rot] fp32 (rot ≤ hd, even; RoPE on the first rot channels, half-split pairs);
//   attn_mask: absent (every cached token is visible) or bool [B, 1, 1, pos + 1] (left padding).
// The Mamba-2 op's shapes are with it, below.
#include "gemv.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace looplm_cpu {
namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// ---- the AVX-512 build (the one with gemv.cpp's kernels) ------------------------------------------

// Σ a_i b_i over n entries, in fp32.
template <typename T>
float dot(const T* a, const T* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(load16(a + i, first(n - i)), load16(b + i, first(n - i)), acc);
  return _mm512_reduce_add_ps(acc);
}

// out[0..n) += p · v[0..n) (out fp32).
template <typename T>
void axpy(float p, const T* v, float* out, int64_t n) {
  const __m512 pv = _mm512_set1_ps(p);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(pv, load16(v + i, m), _mm512_maskz_loadu_ps(m, out + i)));
  }
}

// s[j] ← e^(s[j] − mx) rounded to T (the weights the product with V uses); returns the sum of the
// unrounded values (the softmax denominator). As torch's CPU flash kernel rounds and sums them.
template <typename T>
float exp_weights(float* s, int64_t L, float mx) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; j += 16) {
    const __mmask16 m = first(L - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(mx)));  // e^-inf = 0: masked keys
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
    _mm512_mask_storeu_ps(s + j, m, round16(e, (const T*)nullptr));
  }
  return _mm512_reduce_add_ps(total);
}

// g[i] ← silu(g[i]) ⊙ up[i], each rounded as the reference stores it.
template <typename T>
void silu_mul(T* g, const T* up, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    const __m512 a = load16(g + i, m);
    const __m512 silu = round16(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), a)))), g);
    store16(g + i, _mm512_mul_ps(silu, load16(up + i, m)), m);
  }
}

// v[i] ← silu(v[i]) = v / (1 + e^-v), fp32 in place.
inline void silu_f32(float* v, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    const __m512 a = _mm512_maskz_loadu_ps(m, v + i);
    _mm512_mask_storeu_ps(v + i, m, _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
  }
}

#else
// ---- the portable build (any CPU torch runs on): plain loops; 16 partial sums let the compiler
// vectorise the dot products without reassociating them (no -ffast-math) ---------------------------

template <typename T>
float dot(const T* a, const T* b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += widen(a[i + l]) * widen(b[i + l]);
  for (int l = 0; i + l < n; ++l) acc[l] += widen(a[i + l]) * widen(b[i + l]);
  float sum = 0.f;
  for (float v : acc) sum += v;
  return sum;
}

template <typename T>
void axpy(float p, const T* v, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] += p * widen(v[i]);
}

template <typename T>
float exp_weights(float* s, int64_t L, float mx) {
  float sum = 0.f;
  for (int64_t j = 0; j < L; ++j) {
    const float e = std::exp(s[j] - mx);  // e^-inf = 0: masked keys
    sum += e;
    s[j] = rnd<T>(e);
  }
  return sum;
}

template <typename T>
void silu_mul(T* g, const T* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = widen(g[i]);
    g[i] = T(rnd<T>(a / (1.0f + std::exp(-a))) * widen(up[i]));
  }
}
inline void silu_f32(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] / (1.0f + std::exp(-v[i]));
}
#endif

// y = RMSNorm(x) · w over n channels (torch 2.13: x · rsqrt(mean(x²) + eps) · w in fp32, rounded once).
template <typename T>
void rms_norm(const T* x, const T* w, float eps, int64_t n, T* y) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) y[j] = T(widen(x[j]) * r * widen(w[j]));
}

// RoPE on the first rot channels of one head, in place (apply_rotary: x·cos + rotate_half(x)·sin, each
// product and the sum rounded to T; cos and sin rounded to T first, as the reference casts them).
template <typename T>
void rotary(T* x, const float* cos, const float* sin, int64_t rot) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = widen(x[i]), b = widen(x[i + half]);
    const float c0 = rnd<T>(cos[i]), s0 = rnd<T>(sin[i]), c1 = rnd<T>(cos[i + half]), s1 = rnd<T>(sin[i + half]);
    x[i] = T(rnd<T>(a * c0) + rnd<T>(-b * s0));
    x[i + half] = T(rnd<T>(b * c1) + rnd<T>(a * s1));
  }
}

// softmax(q·kⱼ/√hd over the visible j) · V for one query head: q [hd] (T), K and V [L, hd] rows of one
// cache head, visible: bool [L] or null (all), y [hd] rounded to T. fp32 throughout; s: L floats of scratch.
template <typename T>
void attend(const T* q, const T* K, const T* V, const bool* visible, int64_t L, int64_t hd, float* s, T* y) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < L; ++j) {
    s[j] = visible != nullptr && !visible[j] ? -std::numeric_limits<float>::infinity() : dot(q, K + j * hd, hd) * scale;
    mx = std::max(mx, s[j]);
  }
  const float sum = exp_weights<T>(s, L, mx);
  const float inv = sum > 0.f ? 1.0f / sum : 0.f;  // no visible key (never from looplm's masks): zeros
  float out[256] = {};
  for (int64_t j = 0; j < L; ++j)
    if (s[j] != 0.f) axpy(s[j], V + j * hd, out, hd);
  for (int64_t i = 0; i < hd; ++i) y[i] = T(out[i] * inv);
}

const char* dtype_name(at::ScalarType t) { return t == at::kBFloat16 ? "bfloat16" : t == at::kFloat ? "float32" : "other"; }

void check_weight(const char* op, const char* name, const at::Tensor& w, at::ScalarType dt, int64_t rows, int64_t cols) {
  TORCH_CHECK(w.scalar_type() == dt && w.device().is_cpu() && w.is_contiguous(),
              op, ": ", name, " must be a contiguous CPU ", dtype_name(dt), " tensor like x, got ", w.scalar_type(), " on ", w.device());
  if (cols < 0) {
    TORCH_CHECK(w.dim() == 1 && w.size(0) == rows, op, ": ", name, " must be [", rows, "], got ", w.sizes());
  } else {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols, op, ": ", name, " must be [", rows, ", ", cols, "], got ", w.sizes());
  }
}

// The checks every op makes of x; returns its dtype (the dtype of every weight and cache).
at::ScalarType check_x(const char* op, const at::Tensor& x) {
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, op, ": x must be bfloat16 or float32, got ", dt);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.is_contiguous() && x.device().is_cpu(),
              op, ": x must be a contiguous CPU [B, 1, d] tensor (one new token per row), got ", x.sizes());
  return dt;
}

void check_bias(const char* op, const char* name, const std::optional<at::Tensor>& b, at::ScalarType dt, int64_t n) {
  if (b.has_value() && b->defined()) check_weight(op, name, *b, dt, n, -1);
}

const bf16* as_bf16(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }

template <typename T>
const T* data(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>) return as_bf16(t);
  else return t.data_ptr<float>();
}
template <typename T>
T* mdata(at::Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>) return reinterpret_cast<bf16*>(t.data_ptr());
  else return t.data_ptr<float>();
}

// out [B, 1, d] = x + y, rounded to T (the residual add).
template <typename T>
at::Tensor residual(const at::Tensor& x, const at::Tensor& y) {
  at::Tensor out = at::empty_like(x);
  const T* a = data<T>(x);
  const T* b = data<T>(y);
  T* o = mdata<T>(out);
  for (int64_t i = 0, n = x.numel(); i < n; ++i) o[i] = T(widen(a[i]) + widen(b[i]));
  return out;
}

template <typename T>
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& w, double eps, int64_t B, int64_t d) {
  at::Tensor u = at::empty({B, d}, x.options());
  for (int64_t b = 0; b < B; ++b) rms_norm(data<T>(x) + b * d, data<T>(w), static_cast<float>(eps), d, mdata<T>(u) + b * d);
  return u;
}

template <typename T>
at::Tensor attention_impl(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wq,
                          const std::optional<at::Tensor>& bq, const at::Tensor& wk, const std::optional<at::Tensor>& bk,
                          const at::Tensor& wv, const std::optional<at::Tensor>& bv, const at::Tensor& wo,
                          const std::optional<at::Tensor>& bo, const std::optional<at::Tensor>& q_norm_w,
                          const std::optional<at::Tensor>& k_norm_w, double qk_eps, const std::optional<at::Tensor>& cos,
                          const std::optional<at::Tensor>& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos,
                          const std::optional<at::Tensor>& attn_mask, int64_t H) {
  const int64_t B = x.size(0), d = x.size(2), G = k_cache.size(1), cap = k_cache.size(2), hd = k_cache.size(3);
  const int64_t L = pos + 1;  // keys after writing the new token
  at::Tensor u = norm_rows<T>(x, norm_w, eps, B, d);  // [B, d]
  at::Tensor q = linear_rows(u, wq, bq);              // [B, H hd]
  at::Tensor k = linear_rows(u, wk, bk);              // [B, G hd]
  at::Tensor v = linear_rows(u, wv, bv);              // [B, G hd]
  T* qp = mdata<T>(q);
  T* kp = mdata<T>(k);
  const T* vp = data<T>(v);
  const bool qk_norm = q_norm_w.has_value() && q_norm_w->defined();
  const int64_t rot = cos.has_value() && cos->defined() ? cos->size(-1) : 0;
  std::vector<T> tmp(hd);
  for (int64_t b = 0; b < B; ++b) {
    const float* cb = rot ? cos->data_ptr<float>() + b * rot : nullptr;
    const float* sb = rot ? sin->data_ptr<float>() + b * rot : nullptr;
    for (int64_t h = 0; h < H + G; ++h) {  // the H query heads, then the G key heads
      T* head = h < H ? qp + (b * H + h) * hd : kp + (b * G + h - H) * hd;
      if (qk_norm) {
        rms_norm(head, data<T>(h < H ? *q_norm_w : *k_norm_w), static_cast<float>(qk_eps), hd, tmp.data());
        std::memcpy(head, tmp.data(), hd * sizeof(T));
      }
      if (rot) rotary(head, cb, sb, rot);
    }
    for (int64_t g = 0; g < G; ++g) {  // the new token's key and value into the caches at `pos`
      std::memcpy(mdata<T>(k_cache) + ((b * G + g) * cap + pos) * hd, kp + (b * G + g) * hd, hd * sizeof(T));
      std::memcpy(mdata<T>(v_cache) + ((b * G + g) * cap + pos) * hd, vp + (b * G + g) * hd, hd * sizeof(T));
    }
  }
  at::Tensor y = at::empty({B, H * hd}, x.options());  // [B, H hd]: heads side by side, as o_proj reads them
  const bool* mask = attn_mask.has_value() && attn_mask->defined() ? attn_mask->data_ptr<bool>() : nullptr;
  const T* kc = data<T>(k_cache);
  const T* vc = data<T>(v_cache);
  T* yp = mdata<T>(y);
  // one (row, head) per task; threads only when there is enough work to pay for waking them
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, L * hd));
  at::parallel_for(0, B * H, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(L);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H, g = h / (H / G);
      const int64_t off = (b * G + g) * cap * hd;
      attend(qp + t * hd, kc + off, vc + off, mask ? mask + b * L : nullptr, L, hd, s.data(), yp + t * hd);
    }
  });
  at::Tensor o = linear_rows(y, wo, bo);  // [B, d]
  return residual<T>(x, o);
}

at::Tensor decode_attention(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wq,
                            const std::optional<at::Tensor>& bq, const at::Tensor& wk, const std::optional<at::Tensor>& bk,
                            const at::Tensor& wv, const std::optional<at::Tensor>& bv, const at::Tensor& wo,
                            const std::optional<at::Tensor>& bo, const std::optional<at::Tensor>& q_norm_w,
                            const std::optional<at::Tensor>& k_norm_w, double qk_eps, const std::optional<at::Tensor>& cos,
                            const std::optional<at::Tensor>& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos,
                            const std::optional<at::Tensor>& attn_mask, int64_t n_heads) {
  const char* op = "decode_attention";
  const at::ScalarType dt = check_x(op, x);
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.size(0) == x.size(0),
              op, ": k_cache and v_cache must be [B, G, capacity, hd] with B = ", x.size(0), ", got ", k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t B = x.size(0), d = x.size(2), H = n_heads, G = k_cache.size(1), cap = k_cache.size(2), hd = k_cache.size(3);
  TORCH_CHECK(H >= G && G >= 1 && H % G == 0, op, ": n_heads ", H, " must be a multiple of the caches' ", G, " key/value heads");
  TORCH_CHECK(hd >= 1 && hd <= 256, op, ": head dim ", hd, " outside 1-256");
  TORCH_CHECK(0 <= pos && pos < cap, op, ": position ", pos, " does not fit the caches' capacity ", cap);
  TORCH_CHECK(k_cache.scalar_type() == dt && v_cache.scalar_type() == dt && k_cache.is_contiguous() && v_cache.is_contiguous(),
              op, ": the caches must be contiguous ", dtype_name(dt), " tensors like x");
  check_weight(op, "norm_weight", norm_w, dt, d, -1);
  check_weight(op, "wq", wq, dt, H * hd, d);
  check_weight(op, "wk", wk, dt, G * hd, d);
  check_weight(op, "wv", wv, dt, G * hd, d);
  check_weight(op, "wo", wo, dt, d, H * hd);
  check_bias(op, "bq", bq, dt, H * hd);
  check_bias(op, "bk", bk, dt, G * hd);
  check_bias(op, "bv", bv, dt, G * hd);
  check_bias(op, "bo", bo, dt, d);
  const bool qn = q_norm_w.has_value() && q_norm_w->defined(), kn = k_norm_w.has_value() && k_norm_w->defined();
  TORCH_CHECK(qn == kn, op, ": give both q_norm_weight and k_norm_weight or neither");
  if (qn) {
    check_weight(op, "q_norm_weight", *q_norm_w, dt, hd, -1);
    check_weight(op, "k_norm_weight", *k_norm_w, dt, hd, -1);
  }
  const bool has_cos = cos.has_value() && cos->defined(), has_sin = sin.has_value() && sin->defined();
  TORCH_CHECK(has_cos == has_sin, op, ": give both cos and sin or neither");
  if (has_cos) {
    const int64_t rot = cos->size(-1);
    TORCH_CHECK(cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat && cos->is_contiguous() && sin->is_contiguous()
                    && cos->numel() == B * rot && sin->sizes() == cos->sizes() && rot % 2 == 0 && rot <= hd,
                op, ": cos and sin must be contiguous float32 [B, 1, rot] tables with an even rot <= head dim ", hd, ", got ", cos->sizes(),
                " ", cos->scalar_type());
  }
  if (attn_mask.has_value() && attn_mask->defined()) {
    TORCH_CHECK(attn_mask->scalar_type() == at::kBool && attn_mask->is_contiguous() && attn_mask->numel() == B * (pos + 1),
                op, ": attn_mask must be a contiguous bool [B, 1, 1, pos + 1] = [", B, ", 1, 1, ", pos + 1, "] tensor, got ", attn_mask->sizes());
  }
  if (dt == at::kBFloat16)
    return attention_impl<bf16>(x, norm_w, eps, wq, bq, wk, bk, wv, bv, wo, bo, q_norm_w, k_norm_w, qk_eps, cos, sin, k_cache, v_cache, pos,
                                attn_mask, H);
  return attention_impl<float>(x, norm_w, eps, wq, bq, wk, bk, wv, bv, wo, bo, q_norm_w, k_norm_w, qk_eps, cos, sin, k_cache, v_cache, pos,
                               attn_mask, H);
}

template <typename T>
at::Tensor swiglu_impl(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wg, const std::optional<at::Tensor>& bg,
                       const at::Tensor& wu, const std::optional<at::Tensor>& bu, const at::Tensor& wd, const std::optional<at::Tensor>& bd) {
  const int64_t B = x.size(0), d = x.size(2), F = wg.size(0);
  at::Tensor u = norm_rows<T>(x, norm_w, eps, B, d);  // [B, d]
  at::Tensor g = linear_rows(u, wg, bg);              // [B, F]
  at::Tensor up = linear_rows(u, wu, bu);             // [B, F]
  T* gp = mdata<T>(g);
  const T* upp = data<T>(up);
  silu_mul(gp, upp, B * F);  // silu(gate) ⊙ up, into g
  at::Tensor o = linear_rows(g, wd, bd);  // [B, d]
  return residual<T>(x, o);
}

at::Tensor decode_swiglu(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wg, const std::optional<at::Tensor>& bg,
                         const at::Tensor& wu, const std::optional<at::Tensor>& bu, const at::Tensor& wd, const std::optional<at::Tensor>& bd) {
  const char* op = "decode_swiglu";
  const at::ScalarType dt = check_x(op, x);
  const int64_t d = x.size(2), F = wg.size(0);
  check_weight(op, "norm_weight", norm_w, dt, d, -1);
  check_weight(op, "w_gate", wg, dt, F, d);
  check_weight(op, "w_up", wu, dt, F, d);
  check_weight(op, "w_down", wd, dt, d, F);
  check_bias(op, "b_gate", bg, dt, F);
  check_bias(op, "b_up", bu, dt, F);
  check_bias(op, "b_down", bd, dt, d);
  if (dt == at::kBFloat16) return swiglu_impl<bf16>(x, norm_w, eps, wg, bg, wu, bu, wd, bd);
  return swiglu_impl<float>(x, norm_w, eps, wg, bg, wu, bu, wd, bd);
}

// ---- Mamba-2 ------------------------------------------------------------------------------------
// One token of looplm.layers.mamba2.Mamba2Mixer._step inside its block: x + out_proj(gated_norm(ssd_step(
// conv(in_proj(RMSNorm(x)))))), the conv window and the SSM state updated in place. Shapes (one row b):
// in_proj output [z (d_inner) | xBC (conv_dim) | dt (H)], xBC = [x (H·P) | B (G·N) | C (G·N)];
// conv_state [B, conv_dim, d_conv] (dtype T, oldest first), ssm_state [B, H, P, N] (fp32).
//   conv:  xBC ← silu(Σ_k window[k]·w[k] + b) in fp32, rounded to T (the window shifted by the new input)
//   SSM:   dt = softplus(dt_raw + dt_bias), decay = exp(−dt·exp(A_log)), S ← decay·S + (dt·x) ⊗ B (eq. of
//          ssd_step), y = S·C + D·x, rounded to T
//   norm:  RMSNormGated: v = y·silu(z) in fp32, v·rsqrt(mean_group(v²) + eps)·w, rounded once
// A padding row (pad_mask false) enters the conv as zeros and gets dt = 0 (its state does not move).

inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }  // F.softplus, threshold 20

// S[0..N) ← decay·S + dx·Bv; returns Σ S·Cv (fp32; 16 partial sums the compiler vectorises).
inline float ssm_row(float* S, float decay, float dx, const float* Bv, const float* Cv, int64_t N) {
  float acc[16] = {};
  int64_t n = 0;
  for (; n + 16 <= N; n += 16)
    for (int l = 0; l < 16; ++l) {
      S[n + l] = S[n + l] * decay + dx * Bv[n + l];
      acc[l] += S[n + l] * Cv[n + l];
    }
  for (int l = 0; n + l < N; ++l) {
    S[n + l] = S[n + l] * decay + dx * Bv[n + l];
    acc[l] += S[n + l] * Cv[n + l];
  }
  float y = 0.f;
  for (float v : acc) y += v;
  return y;
}

template <typename T>
at::Tensor mamba2_impl(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& w_in,
                       const std::optional<at::Tensor>& b_in, const at::Tensor& conv_w, const std::optional<at::Tensor>& conv_b,
                       const at::Tensor& dt_bias, const at::Tensor& A_log, const at::Tensor& Dp, const at::Tensor& gnorm_w,
                       double gnorm_eps, const at::Tensor& w_out, const std::optional<at::Tensor>& b_out, at::Tensor& conv_state,
                       at::Tensor& ssm_state, const std::optional<at::Tensor>& pad_mask) {
  const int64_t Bn = x.size(0), d = x.size(2), d_inner = gnorm_w.size(0), conv_dim = conv_state.size(1), K = conv_state.size(2);
  const int64_t H = ssm_state.size(1), P = ssm_state.size(2), N = ssm_state.size(3), G = (conv_dim - d_inner) / (2 * N);
  const int64_t E = d_inner + conv_dim + H;
  at::Tensor u = norm_rows<T>(x, norm_w, eps, Bn, d);  // [B, d]
  at::Tensor zx = linear_rows(u, w_in, b_in);        // [B, E]
  const T* zp = data<T>(zx);
  const T* cw = data<T>(conv_w);
  const T* cb = conv_b.has_value() && conv_b->defined() ? data<T>(*conv_b) : nullptr;
  const bool* keep = pad_mask.has_value() && pad_mask->defined() ? pad_mask->data_ptr<bool>() : nullptr;
  T* cs = mdata<T>(conv_state);
  float* S = ssm_state.data_ptr<float>();
  std::vector<float> xbc(Bn * conv_dim), dt(Bn * H), y(Bn * d_inner), A(H);
  for (int64_t h = 0; h < H; ++h) A[h] = -std::exp(widen(data<T>(A_log)[h]));
  for (int64_t b = 0; b < Bn; ++b) {
    const bool real = keep == nullptr || keep[b];
    const T* in = zp + b * E + d_inner;  // xBC, then dt
    float* out = xbc.data() + b * conv_dim;
    for (int64_t c = 0; c < conv_dim; ++c) {  // slide the window, append the new input, the depthwise conv
      T* win = cs + (b * conv_dim + c) * K;
      for (int64_t k = 0; k + 1 < K; ++k) win[k] = win[k + 1];
      win[K - 1] = real ? in[c] : T(0.f);
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += widen(win[k]) * widen(cw[c * K + k]);
      out[c] = cb ? acc + widen(cb[c]) : acc;
    }
    silu_f32(out, conv_dim);
    for (int64_t c = 0; c < conv_dim; ++c) out[c] = real ? rnd<T>(out[c]) : 0.f;
    for (int64_t h = 0; h < H; ++h) dt[b * H + h] = real ? softplus(widen(in[conv_dim + h]) + widen(data<T>(dt_bias)[h])) : 0.f;
  }
  const T* Dv = data<T>(Dp);
  at::parallel_for(0, Bn * H, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, P * N)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H, g = h / (H / G);
      const float* xs = xbc.data() + b * conv_dim + h * P;
      const float* Bv = xbc.data() + b * conv_dim + d_inner + g * N;
      const float* Cv = xbc.data() + b * conv_dim + d_inner + G * N + g * N;
      const float decay = std::exp(dt[t] * A[h]);
      for (int64_t p = 0; p < P; ++p) {
        const float yp = ssm_row(S + (t * P + p) * N, decay, dt[t] * xs[p], Bv, Cv, N);
        y[b * d_inner + h * P + p] = rnd<T>(yp + xs[p] * widen(Dv[h]));
      }
    }
  });
  at::Tensor yg = at::empty({Bn, d_inner}, x.options());  // RMSNormGated(y, z)
  T* ygp = mdata<T>(yg);
  const T* gw = data<T>(gnorm_w);
  const int64_t gs = d_inner / G;
  std::vector<float> v(d_inner);
  for (int64_t b = 0; b < Bn; ++b) {
    const T* z = zp + b * E;
    for (int64_t i = 0; i < d_inner; ++i) v[i] = widen(z[i]);
    silu_f32(v.data(), d_inner);
    for (int64_t i = 0; i < d_inner; ++i) v[i] *= y[b * d_inner + i];
    for (int64_t g0 = 0; g0 < d_inner; g0 += gs) {
      const float r = 1.0f / std::sqrt(dot(v.data() + g0, v.data() + g0, gs) / static_cast<float>(gs) + static_cast<float>(gnorm_eps));
      for (int64_t i = g0; i < g0 + gs; ++i) ygp[b * d_inner + i] = T(v[i] * r * widen(gw[i]));
    }
  }
  at::Tensor o = linear_rows(yg, w_out, b_out);  // [B, d]
  return residual<T>(x, o);
}

at::Tensor decode_mamba2(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& w_in,
                         const std::optional<at::Tensor>& b_in, const at::Tensor& conv_w, const std::optional<at::Tensor>& conv_b,
                         const at::Tensor& dt_bias, const at::Tensor& A_log, const at::Tensor& Dp, const at::Tensor& gnorm_w,
                         double gnorm_eps, const at::Tensor& w_out, const std::optional<at::Tensor>& b_out, at::Tensor& conv_state,
                         at::Tensor& ssm_state, const std::optional<at::Tensor>& pad_mask) {
  const char* op = "decode_mamba2";
  const at::ScalarType dt = check_x(op, x);
  const int64_t Bn = x.size(0), d = x.size(2);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(0) == Bn && conv_state.scalar_type() == dt && conv_state.is_contiguous(),
              op, ": conv_state must be a contiguous ", dtype_name(dt), " [B, conv_dim, d_conv] tensor with B = ", Bn, ", got ",
              conv_state.sizes(), " ", conv_state.scalar_type());
  TORCH_CHECK(ssm_state.dim() == 4 && ssm_state.size(0) == Bn && ssm_state.scalar_type() == at::kFloat && ssm_state.is_contiguous(),
              op, ": ssm_state must be a contiguous float32 [B, nheads, headdim, d_state] tensor with B = ", Bn, ", got ",
              ssm_state.sizes(), " ", ssm_state.scalar_type());
  const int64_t conv_dim = conv_state.size(1), K = conv_state.size(2), H = ssm_state.size(1), P = ssm_state.size(2), N = ssm_state.size(3);
  const int64_t d_inner = H * P, rest = conv_dim - d_inner;
  TORCH_CHECK(rest > 0 && rest % (2 * N) == 0 && H % (rest / (2 * N)) == 0,
              op, ": conv_dim ", conv_dim, " must be nheads·headdim + 2·ngroups·d_state with ngroups dividing nheads");
  const int64_t G = rest / (2 * N);
  check_weight(op, "norm_weight", norm_w, dt, d, -1);
  check_weight(op, "w_in", w_in, dt, d_inner + conv_dim + H, d);
  check_bias(op, "b_in", b_in, dt, d_inner + conv_dim + H);
  TORCH_CHECK(conv_w.scalar_type() == dt && conv_w.is_contiguous() && conv_w.numel() == conv_dim * K,
              op, ": conv_weight must be a contiguous ", dtype_name(dt), " [conv_dim, 1, d_conv] tensor, got ", conv_w.sizes());
  check_bias(op, "conv_bias", conv_b, dt, conv_dim);
  check_weight(op, "dt_bias", dt_bias, dt, H, -1);
  check_weight(op, "A_log", A_log, dt, H, -1);
  check_weight(op, "D", Dp, dt, H, -1);
  check_weight(op, "gate_norm_weight", gnorm_w, dt, d_inner, -1);
  TORCH_CHECK(d_inner % G == 0, op, ": d_inner ", d_inner, " must be a multiple of ngroups ", G);
  check_weight(op, "w_out", w_out, dt, d, d_inner);
  check_bias(op, "b_out", b_out, dt, d);
  if (pad_mask.has_value() && pad_mask->defined()) {
    TORCH_CHECK(pad_mask->scalar_type() == at::kBool && pad_mask->is_contiguous() && pad_mask->numel() == Bn,
                op, ": pad_mask must be a contiguous bool [B, 1] tensor, got ", pad_mask->sizes());
  }
  if (dt == at::kBFloat16)
    return mamba2_impl<bf16>(x, norm_w, eps, w_in, b_in, conv_w, conv_b, dt_bias, A_log, Dp, gnorm_w, gnorm_eps, w_out, b_out, conv_state,
                             ssm_state, pad_mask);
  return mamba2_impl<float>(x, norm_w, eps, w_in, b_in, conv_w, conv_b, dt_bias, A_log, Dp, gnorm_w, gnorm_eps, w_out, b_out, conv_state,
                            ssm_state, pad_mask);
}

// ---- StateLoop's state update and state read (looplm/recurrence/stateloop.py), one token per row ----------------
// update: U = RMSNorm_h(h) (eq. 2), P = U W_uᵀ (eq. 5), Δ = softplus(U W_Δᵀ + b_Δ), g = exp(Δ·(−exp(A_log))),
//         S̃ = lerp(P, S, g) = g⊙S + (1 − g)⊙P (eq. 6; torch's two-sided lerp formula), every value rounded to T
//         where SelectiveUpdate stores it (U, P, the product with its bias, Δ, exp(A_log), Δ·(−λ), g, S̃).
// read:   h + RMSNorm_s(S) Wᵀ (eqs. 4, 10): the norm, the product and the sum rounded.
// h [B, 1, d], S [B, 1, d_s], both of the weights' dtype.

template <typename T>
at::Tensor stateloop_update_impl(const at::Tensor& h, const at::Tensor& S, const at::Tensor& norm_w, double eps, const at::Tensor& w_u,
                                 const at::Tensor& w_delta, const at::Tensor& b_delta, const at::Tensor& a_log) {
  const int64_t B = h.size(0), d = h.size(2), ds = S.size(2);
  at::Tensor u = norm_rows<T>(h, norm_w, eps, B, d);   // [B, d]  U
  at::Tensor p = linear_rows(u, w_u, std::nullopt);     // [B, ds] P
  at::Tensor z = linear_rows(u, w_delta, b_delta);      // [B, ds] U W_Δᵀ + b_Δ
  at::Tensor out = at::empty_like(S);
  const T *P = data<T>(p), *Z = data<T>(z), *Sp = data<T>(S), *A = data<T>(a_log);
  T* O = mdata<T>(out);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < ds; ++c) {
      const int64_t i = b * ds + c;
      const float delta = rnd<T>(softplus(widen(Z[i])));
      const float lam = rnd<T>(std::exp(widen(A[c])));
      const float g = rnd<T>(std::exp(rnd<T>(delta * -lam)));
      const float start = widen(P[i]), end = widen(Sp[i]);
      O[i] = T(std::abs(g) < 0.5f ? start + g * (end - start) : end - (end - start) * (1.0f - g));
    }
  return out;
}

at::Tensor decode_stateloop_update(const at::Tensor& h, const at::Tensor& S, const at::Tensor& norm_w, double eps, const at::Tensor& w_u,
                                   const at::Tensor& w_delta, const at::Tensor& b_delta, const at::Tensor& a_log) {
  const char* op = "decode_stateloop_update";
  const at::ScalarType dt = check_x(op, h);
  TORCH_CHECK(check_x(op, S) == dt && S.size(0) == h.size(0), op, ": S must be a [B, 1, d_s] tensor of h's dtype and batch, got ", S.sizes(),
              " ", S.scalar_type());
  const int64_t d = h.size(2), ds = S.size(2);
  check_weight(op, "norm_weight", norm_w, dt, d, -1);
  check_weight(op, "w_u", w_u, dt, ds, d);
  check_weight(op, "w_delta", w_delta, dt, ds, d);
  check_weight(op, "b_delta", b_delta, dt, ds, -1);
  check_weight(op, "A_log", a_log, dt, ds, -1);
  if (dt == at::kBFloat16) return stateloop_update_impl<bf16>(h, S, norm_w, eps, w_u, w_delta, b_delta, a_log);
  return stateloop_update_impl<float>(h, S, norm_w, eps, w_u, w_delta, b_delta, a_log);
}

at::Tensor decode_stateloop_read(const at::Tensor& h, const at::Tensor& S, const at::Tensor& norm_w, double eps, const at::Tensor& w) {
  const char* op = "decode_stateloop_read";
  const at::ScalarType dt = check_x(op, h);
  TORCH_CHECK(check_x(op, S) == dt && S.size(0) == h.size(0), op, ": S must be a [B, 1, d_s] tensor of h's dtype and batch, got ", S.sizes(),
              " ", S.scalar_type());
  const int64_t B = h.size(0), d = h.size(2), ds = S.size(2);
  check_weight(op, "norm_weight", norm_w, dt, ds, -1);
  check_weight(op, "w", w, dt, d, ds);
  if (dt == at::kBFloat16) return residual<bf16>(h, linear_rows(norm_rows<bf16>(S, norm_w, eps, B, ds), w, std::nullopt));
  return residual<float>(h, linear_rows(norm_rows<float>(S, norm_w, eps, B, ds), w, std::nullopt));
}

}  // namespace
}  // namespace looplm_cpu

TORCH_LIBRARY_FRAGMENT(looplm_cpu, m) {
  m.def(
      "decode_attention(Tensor x, Tensor norm_weight, float eps, Tensor wq, Tensor? bq, Tensor wk, Tensor? bk, Tensor wv, "
      "Tensor? bv, Tensor wo, Tensor? bo, Tensor? q_norm_weight, Tensor? k_norm_weight, float qk_eps, Tensor? cos, Tensor? sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, Tensor? attn_mask, int n_heads) -> Tensor");
  m.def(
      "decode_swiglu(Tensor x, Tensor norm_weight, float eps, Tensor w_gate, Tensor? b_gate, Tensor w_up, Tensor? b_up, "
      "Tensor w_down, Tensor? b_down) -> Tensor");
  m.def(
      "decode_mamba2(Tensor x, Tensor norm_weight, float eps, Tensor w_in, Tensor? b_in, Tensor conv_weight, Tensor? conv_bias, "
      "Tensor dt_bias, Tensor A_log, Tensor D, Tensor gate_norm_weight, float gate_norm_eps, Tensor w_out, Tensor? b_out, "
      "Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor? pad_mask) -> Tensor");
  m.def(
      "decode_stateloop_update(Tensor h, Tensor S, Tensor norm_weight, float eps, Tensor w_u, Tensor w_delta, Tensor b_delta, "
      "Tensor A_log) -> Tensor");
  m.def("decode_stateloop_read(Tensor h, Tensor S, Tensor norm_weight, float eps, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(looplm_cpu, CPU, m) {
  m.impl("decode_attention", &looplm_cpu::decode_attention);
  m.impl("decode_swiglu", &looplm_cpu::decode_swiglu);
  m.impl("decode_mamba2", &looplm_cpu::decode_mamba2);
  m.impl("decode_stateloop_update", &looplm_cpu::decode_stateloop_update);
  m.impl("decode_stateloop_read", &looplm_cpu::decode_stateloop_read);
}
