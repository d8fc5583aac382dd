// One decode step (one new token per sequence) of looplm's pre-norm blocks as fused ops — the attention
// branch, the SwiGLU branch and the Mamba-2 branch — for bf16 and fp32 on CPU. Built with gemv.cpp by
// looplm/kernels/build.py (with AVX-512 where the CPU has AVX512-BF16, else portably: plain loops, AVX2
// where available); used by looplm/kernels/decode.py (the fused decode steps) inside generate().
//
// Why this exists: after the products moved onto gemv.cpp's kernels, a batch-1 decode step of the
// SmolLM2-135M shape spent as long again outside them: ~330 µs per block of eager PyTorch (RMSNorm's
// composite, RoPE's eight ops per head set, views, the KV writes, SDPA, the residual adds), and a compiled
// block still ~270 µs (guard evaluation, the generated wrapper). Here everything between the products is a
// few loops over a few hundred numbers, and the products are gemv.cpp's kernels where they win (project()
// below; linear_rows, torch's matmul, elsewhere).
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
// A few new tokens per row (decode_attention, decode_swiglu, decode_stack; a speculative verification's
// k + 1 drafted tokens, looplm/decode/speculative.py): x [B, T, d], written at columns pos .. pos + T − 1, token t
// attending to columns 0 .. pos + t (causal inside the call: every token's key and value is written before
// any token attends); cos, sin [B, T, rot]; attn_mask bool [B, 1, T, pos + T] (token t reads the first
// pos + t + 1 entries of its row). The products then take B·T rows.
//   rows: absent (row b of x is row b of the caches) or int64 [B]: row b of x reads and writes row rows[b]
//         of caches with more rows, in place — the rows still looping at one iteration under per-token
//         exit (looplm/decode/token_schedule.py); x, cos, sin and attn_mask are the active rows' own.
//   cols: absent (every row's new tokens at columns pos ..) or int64 [B]: row b's new tokens at columns
//         cols[b] .. cols[b] + T − 1, 0 <= cols[b] <= pos, reading the first cols[b] + t + 1 entries of its
//         mask row (the mask stays [B, 1, T, pos + T]) — rows at different tokens in one call: continuous
//         depth batching (looplm/decode/depth_schedule.py), where each row runs its own token at its own loop.
//   fill (decode_stack only): F stand-in rows whose keys and values every block writes beside the step
//         (FillArgs, below; per-token exit's kv='propagate' fills carried into the next core pass).
// The Mamba-2 op's shapes are with it, below.
#include "gemv.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/BFloat16.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
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

// y = RMSNorm(x) · w over n channels (torch 2.13: x · rsqrt(mean(x²) + eps) · w in fp32, rounded once).
template <typename T>
void rms_norm(const T* x, const T* w, float eps, int64_t n, T* y) {
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first(n - j);
    store16(y + j, _mm512_mul_ps(_mm512_mul_ps(load16(x + j, m), r), load16(w + j, m)), m);
  }
}

// RoPE on the first rot channels of one head, in place (apply_rotary: x·cos + rotate_half(x)·sin, each
// product and the sum rounded to T; cos and sin rounded to T first, as the reference casts them).
template <typename T>
void rotary(T* x, const float* cos, const float* sin, int64_t rot) {
  const int64_t half = rot / 2;
  const T* tag = nullptr;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = first(half - i);
    const __m512 a = load16(x + i, m), b = load16(x + i + half, m);
    const __m512 c0 = round16(_mm512_maskz_loadu_ps(m, cos + i), tag), s0 = round16(_mm512_maskz_loadu_ps(m, sin + i), tag);
    const __m512 c1 = round16(_mm512_maskz_loadu_ps(m, cos + i + half), tag), s1 = round16(_mm512_maskz_loadu_ps(m, sin + i + half), tag);
    const __m512 nb = _mm512_sub_ps(_mm512_setzero_ps(), b);  // −b, exact
    store16(x + i, _mm512_add_ps(round16(_mm512_mul_ps(a, c0), tag), round16(_mm512_mul_ps(nb, s0), tag)), m);
    store16(x + i + half, _mm512_add_ps(round16(_mm512_mul_ps(b, c1), tag), round16(_mm512_mul_ps(a, s1), tag)), m);
  }
}

// softmax(q·kⱼ/√hd over the visible j) · V for one query head: q [hd] (T), K and V [L, hd] rows of one
// cache head, visible: bool [L] or null (all), y [hd] rounded to T. fp32 throughout; s: L floats of scratch.
// Scores 16 keys at a time (16 accumulators, reduced together by sum_lanes16: one horizontal sum per 16
// keys, not per key); the weighted sum of V 64 channels at a time in registers, keys in order.
template <typename T>
void attend(const T* q, const T* K, const T* V, const bool* visible, int64_t L, int64_t hd, float* s, T* y) {
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(static_cast<float>(hd)));
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mxv = neg_inf;
  for (int64_t j = 0; j < L; j += 16) {
    const int64_t nk = std::min<int64_t>(16, L - j);
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < hd; c += 16) {
      const __mmask16 m = first(hd - c);
      const __m512 qv = load16(q + c, m);
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r)  // past the last key (a partial block): the last key again, its lanes dropped below
        acc[r] = _mm512_fmadd_ps(qv, load16(K + std::min<int64_t>(j + r, L - 1) * hd + c, m), acc[r]);
    }
    __m512 sc = _mm512_mul_ps(sum_lanes16(acc), scale);  // lane r: key j + r
    __mmask16 vis = first(nk);
    if (visible != nullptr)
      for (int r = 0; r < nk; ++r)
        if (!visible[j + r]) vis &= (__mmask16)~(1u << r);
    sc = _mm512_mask_mov_ps(neg_inf, vis, sc);  // hidden keys: −inf
    _mm512_mask_storeu_ps(s + j, first(nk), sc);
    mxv = _mm512_mask_max_ps(mxv, first(nk), mxv, sc);
  }
  const float sum = exp_weights<T>(s, L, _mm512_reduce_max_ps(mxv));
  const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.0f / sum : 0.f);  // no visible key (never from looplm's masks): zeros
  for (int64_t c = 0; c < hd; c += 64) {  // 64 channels (4 vectors) per pass over the keys
    __m512 o[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int nv = static_cast<int>(std::min<int64_t>(4, (hd - c + 15) / 16));
    for (int64_t j = 0; j < L; ++j) {
      if (s[j] == 0.f) continue;
      const __m512 p = _mm512_set1_ps(s[j]);
      for (int v = 0; v < nv; ++v) o[v] = _mm512_fmadd_ps(p, load16(V + j * hd + c + 16 * v, first(hd - c - 16 * v)), o[v]);
    }
    for (int v = 0; v < nv; ++v) store16(y + c + 16 * v, _mm512_mul_ps(o[v], inv), first(hd - c - 16 * v));
  }
}

// o[i] = a[i] + b[i], rounded to T (a residual sum).
template <typename T>
void add_rows(const T* a, const T* b, T* o, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    store16(o + i, _mm512_add_ps(load16(a + i, m), load16(b + i, m)), m);
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

// o[i] = a[i] + b[i], rounded to T (a residual sum).
template <typename T>
void add_rows(const T* a, const T* b, T* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = T(widen(a[i]) + widen(b[i]));
}
#endif

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

// The ops that take a few new tokens per row (see the top): x [B, T, d] with 1 <= T <= kMaxTokens.
constexpr int64_t kMaxTokens = 64;
at::ScalarType check_x_tokens(const char* op, const at::Tensor& x) {
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, op, ": x must be bfloat16 or float32, got ", dt);
  TORCH_CHECK(x.dim() == 3 && x.size(1) >= 1 && x.size(1) <= kMaxTokens && x.is_contiguous() && x.device().is_cpu(),
              op, ": x must be a contiguous CPU [B, T, d] tensor with 1 <= T <= ", kMaxTokens, " new tokens per row, got ", x.sizes());
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
  add_rows(a, b, o, x.numel());
  return out;
}

// u [B, d] = RMSNorm(x) · w, row by row, into u (norm_rows: into a new tensor).
template <typename T>
void norm_into(const T* x, const at::Tensor& w, double eps, int64_t B, int64_t d, T* u) {
  for (int64_t b = 0; b < B; ++b) rms_norm(x + b * d, data<T>(w), static_cast<float>(eps), d, u + b * d);
}

template <typename T>
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& w, double eps, int64_t B, int64_t d) {
  at::Tensor u = at::empty({B, d}, x.options());
  norm_into(data<T>(x), w, eps, B, d, mdata<T>(u));
  return u;
}

// ---- attention and SwiGLU steps on raw rows --------------------------------------------------------
// The branches below write their intermediates into per-thread scratch memory and their products go
// through project(): at batch 1 in bf16 each group of products that reads one input (q/k/v, gate/up, o,
// down) is one gemv1_group call that prefetches the group after it. A decode step's weight stream evicts
// everything else from the caches, so each allocator call (its state, the TensorImpl) and each op call
// costs microseconds of cache misses: a block step made ~12 allocations; decode_stack runs many blocks
// in one call with none.

// Scratch memory for one op call's intermediates, kept per thread (grown, never shrunk). reserve() once
// per call with the call's total, then take() carves 64-byte aligned pieces.
class Scratch {
 public:
  static Scratch& reserve(size_t bytes) {
    thread_local Scratch s;
    if (s.buf_.size() < bytes) s.buf_.assign(bytes, 0);
    s.used_ = 0;
    return s;
  }
  template <typename T>
  T* take(int64_t n) {
    const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) & ~size_t(63);
    TORCH_INTERNAL_ASSERT(used_ + bytes + 64 <= buf_.size(), "looplm decode scratch too small");
    char* base = buf_.data() + used_;
    char* p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + 63) & ~uintptr_t(63));
    used_ += bytes + static_cast<size_t>(p - base);
    return reinterpret_cast<T*>(p);
  }
  template <typename T>
  static size_t bytes(int64_t n) { return ((static_cast<size_t>(n) * sizeof(T) + 63) & ~size_t(63)) + 64; }
  size_t mark() const { return used_; }
  void release(size_t mark) { used_ = mark; }  // give back everything taken after mark()

 private:
  std::vector<char> buf_;
  size_t used_ = 0;
};

// One product of a group: y = u · Wᵀ (+ b), y of the caller's dtype.
struct Lin {
  const at::Tensor* w;
  const std::optional<at::Tensor>* b;
  void* y;
};

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
const uint16_t* bias_bits(const std::optional<at::Tensor>* b) {
  return b != nullptr && b->has_value() && (*b)->defined() ? bits(**b) : nullptr;
}

// A group's weights for gemv1_group's prefetch hint (x and y unused).
struct Hint {
  RowProduct ps[3];
  RowGroup g;
  Hint() : ps{}, g{nullptr, 0, ps, 0} {}
  Hint(const Hint&) = delete;  // g points into ps
  Hint(std::initializer_list<const at::Tensor*> ws) : ps{}, g{nullptr, ws.size() ? (*ws.begin())->size(1) : 0, ps, 0} {
    TORCH_INTERNAL_ASSERT(ws.size() <= 3, "a prefetch hint holds at most 3 products");
    for (const at::Tensor* w : ws) ps[g.n++] = RowProduct{bits(*w), nullptr, w->size(0), nullptr};
  }
};

// y_i [B, N_i] = u [B, K] · W_iᵀ (+ b_i) for n products that read u. bf16 at batch 1: one gemv1_group call
// (after: the group the caller runs next, prefetched; may be null). Elsewhere each product is linear_rows
// (the kernels where they win, else torch's matmul) copied into y_i.
template <typename T>
void project(const T* u, int64_t B, int64_t K, const Lin* ls, int n, const RowGroup* after) {
  TORCH_INTERNAL_ASSERT(n >= 1 && n <= 3, "project: 1-3 products per group");
  if constexpr (std::is_same_v<T, bf16>) {
    if (B == 1 && kernel_wins(1, K, at::kBFloat16)) {
      RowProduct ps[3];
      for (int i = 0; i < n; ++i) ps[i] = RowProduct{bits(*ls[i].w), bias_bits(ls[i].b), ls[i].w->size(0), static_cast<uint16_t*>(ls[i].y)};
      gemv1_group(RowGroup{reinterpret_cast<const uint16_t*>(u), K, ps, n}, after);
      return;
    }
  }
  const at::ScalarType dt = std::is_same_v<T, bf16> ? at::kBFloat16 : at::kFloat;
  const at::Tensor ut = at::from_blob(const_cast<T*>(u), {B, K}, at::TensorOptions().dtype(dt));
  for (int i = 0; i < n; ++i) {
    const at::Tensor r = linear_rows(ut, *ls[i].w, *ls[i].b);  // [B, N_i]
    std::memcpy(ls[i].y, r.data_ptr(), static_cast<size_t>(r.numel()) * sizeof(T));
  }
}

// decode_attention's parameters (the op's arguments from norm_weight to qk_eps, and n_heads).
struct AttnArgs {
  const at::Tensor& norm_w;
  double eps;
  const at::Tensor& wq;
  const std::optional<at::Tensor>& bq;
  const at::Tensor& wk;
  const std::optional<at::Tensor>& bk;
  const at::Tensor& wv;
  const std::optional<at::Tensor>& bv;
  const at::Tensor& wo;
  const std::optional<at::Tensor>& bo;
  const std::optional<at::Tensor>& q_norm_w;
  const std::optional<at::Tensor>& k_norm_w;
  double qk_eps;
  int64_t H;
};

// decode_swiglu's parameters (the op's arguments after x).
struct MlpArgs {
  const at::Tensor& norm_w;
  double eps;
  const at::Tensor& wg;
  const std::optional<at::Tensor>& bg;
  const at::Tensor& wu;
  const std::optional<at::Tensor>& bu;
  const at::Tensor& wd;
  const std::optional<at::Tensor>& bd;
};

// Rope tables, mask and cache rows of one step, shared by the attention blocks of a stack.
struct StepArgs {
  const std::optional<at::Tensor>& cos;
  const std::optional<at::Tensor>& sin;
  int64_t pos;
  const std::optional<at::Tensor>& attn_mask;
  const std::optional<at::Tensor>& rows;
  int64_t T = 1;  // new tokens per row, at columns pos .. pos + T − 1 (or cols[b] .., below)
  const std::optional<at::Tensor>& cols;
  // the cache row of x's row b
  int64_t row(int64_t b) const { return rows.has_value() && rows->defined() ? rows->data_ptr<int64_t>()[b] : b; }
  // the column of x's row b's first new token
  int64_t col(int64_t b) const { return cols.has_value() && cols->defined() ? cols->data_ptr<int64_t>()[b] : pos; }
};

// cols (see the top): int64 [B], contiguous, each in [0, pos] (pos + T fits the capacity, checked with it).
void check_cols(const char* op, const std::optional<at::Tensor>& cols, int64_t B, int64_t pos) {
  if (!cols.has_value() || !cols->defined()) return;
  TORCH_CHECK(cols->scalar_type() == at::kLong && cols->is_contiguous() && cols->dim() == 1 && cols->numel() == B,
              op, ": cols must be a contiguous int64 [B] tensor with B = ", B, ", got ", cols->sizes(), " ", cols->scalar_type());
  const int64_t* c = cols->data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= c[b] && c[b] <= pos, op, ": cols[", b, "] = ", c[b], " is outside 0..pos = 0..", pos, " (the mask holds pos + T columns)");
}

// rows (see the top): int64 [B], contiguous, each in [0, cache_rows) and distinct.
void check_rows(const char* op, const std::optional<at::Tensor>& rows, int64_t B, int64_t cache_rows) {
  if (!rows.has_value() || !rows->defined()) {
    TORCH_CHECK(cache_rows == B, op, ": the caches hold ", cache_rows, " rows, x has ", B, "; pass rows to map x's rows onto them");
    return;
  }
  TORCH_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->dim() == 1 && rows->numel() == B,
              op, ": rows must be a contiguous int64 [B] tensor with B = ", B, ", got ", rows->sizes(), " ", rows->scalar_type());
  std::vector<bool> seen(cache_rows, false);
  const int64_t* r = rows->data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= r[b] && r[b] < cache_rows, op, ": rows[", b, "] = ", r[b], " is outside the caches' ", cache_rows, " rows");
    TORCH_CHECK(!seen[r[b]], op, ": rows must be distinct (row ", r[b], " twice)");
    seen[r[b]] = true;
  }
}

// Keys and values of extra rows written beside a step, never attended (per-token exit's `propagate` fill
// folded into the next core pass, looplm/decode/kv_fill.py): F stand-in rows z [F, d] go through the block's
// RMSNorm and its k/v products together with the step's own rows (one weight stream), then QK-norm and
// RoPE at their own tables cos, sin [F, rot]; entry e of index [D, 4] = (buffer j, row, column, source
// row) writes source row's key and value into row `row`, column `column` of the block's j-th buffers.
struct FillArgs {
  const at::Tensor* z = nullptr;  // [F, 1, d] or [F, d]
  int64_t F = 0;
  const std::optional<at::Tensor>* cos = nullptr;
  const std::optional<at::Tensor>* sin = nullptr;
  const at::Tensor* k = nullptr;  // this block's nb destination buffers [rows, G, capacity, hd]
  const at::Tensor* v = nullptr;
  int64_t nb = 0;
  const int64_t* index = nullptr;  // [D, 4]
  int64_t D = 0;
};

// The checks of decode_stack's fill arguments (every block's buffers like its cache: G, hd, dtype).
void check_fill(const char* op, at::ScalarType dt, int64_t d, int64_t n_blocks, const std::optional<at::Tensor>& z,
                const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin, at::TensorList fk, at::TensorList fv,
                const std::optional<at::Tensor>& index, at::TensorList k_caches) {
  const bool has_z = z.has_value() && z->defined();
  if (!has_z) {
    TORCH_CHECK(fk.empty() && fv.empty() && !(index.has_value() && index->defined()),
                op, ": fill_k, fill_v and fill_index need fill_z (the stand-in rows)");
    return;
  }
  TORCH_CHECK(z->scalar_type() == dt && z->is_contiguous() && z->device().is_cpu() && z->numel() == z->size(0) * d && z->size(0) >= 1,
              op, ": fill_z must be a contiguous CPU ", dtype_name(dt), " [F, 1, d] tensor with d = ", d, ", got ", z->sizes(), " ", z->scalar_type());
  const int64_t F = z->size(0);
  TORCH_CHECK(n_blocks >= 1, op, ": a fill needs the plan's blocks");
  TORCH_CHECK(!fk.empty() && fk.size() == fv.size() && static_cast<int64_t>(fk.size()) % n_blocks == 0,
              op, ": fill_k and fill_v must hold the same number of buffers for each of the plan's ", n_blocks, " blocks, got ",
              fk.size(), " and ", fv.size());
  const int64_t nb = static_cast<int64_t>(fk.size()) / n_blocks;
  for (size_t i = 0; i < fk.size(); ++i) {
    const at::Tensor& c = k_caches[i / nb];
    TORCH_CHECK(fk[i].dim() == 4 && fk[i].sizes() == fv[i].sizes() && fk[i].size(1) == c.size(1) && fk[i].size(3) == c.size(3)
                    && fk[i].scalar_type() == dt && fv[i].scalar_type() == dt && fk[i].is_contiguous() && fv[i].is_contiguous(),
                op, ": fill buffer ", i, " must be a contiguous ", dtype_name(dt), " [rows, ", c.size(1), ", capacity, ", c.size(3),
                "] pair like block ", i / nb, "'s cache, got ", fk[i].sizes(), " and ", fv[i].sizes());
  }
  TORCH_CHECK(index.has_value() && index->defined() && index->scalar_type() == at::kLong && index->is_contiguous() && index->dim() == 2
                  && index->size(1) == 4,
              op, ": fill_index must be a contiguous int64 [D, 4] tensor of (buffer, row, column, source row)");
  const int64_t* ix = index->data_ptr<int64_t>();
  for (int64_t e = 0; e < index->size(0); ++e) {
    const int64_t j = ix[4 * e], r = ix[4 * e + 1], c = ix[4 * e + 2], s = ix[4 * e + 3];
    TORCH_CHECK(0 <= j && j < nb, op, ": fill_index[", e, "] names buffer ", j, "; each block has ", nb);
    TORCH_CHECK(0 <= r && r < fk[j].size(0) && 0 <= c && c < fk[j].size(2), op, ": fill_index[", e, "] = (", j, ", ", r, ", ", c,
                ") is outside buffer ", j, "'s ", fk[j].size(0), " rows and ", fk[j].size(2), " columns");
    TORCH_CHECK(0 <= s && s < F, op, ": fill_index[", e, "] reads stand-in row ", s, " of ", F);
  }
  const bool hc = cos.has_value() && cos->defined(), hs = sin.has_value() && sin->defined();
  TORCH_CHECK(hc == hs, op, ": give both fill_cos and fill_sin or neither");
  if (hc) {
    TORCH_CHECK(cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat && cos->is_contiguous() && sin->is_contiguous()
                    && cos->numel() % F == 0 && sin->sizes() == cos->sizes(),
                op, ": fill_cos and fill_sin must be contiguous float32 [F, 1, rot] tables, got ", cos->sizes());
  }
}

template <typename T>
size_t attention_scratch(const AttnArgs& a, int64_t B, int64_t d, int64_t G, int64_t hd) {
  return 2 * Scratch::bytes<T>(B * d) + 2 * Scratch::bytes<T>(B * a.H * hd) + 2 * Scratch::bytes<T>(B * G * hd) + Scratch::bytes<T>(hd);
}

// out [B·T, d] = x + attention(RMSNorm(x)) for st.T new tokens per row (x: B·T rows, row b's tokens side by
// side); token t's key and value written into the caches at pos + t before any token attends, token t
// attending to columns 0 .. pos + t. after: the group run next (prefetched during the output product), or null.
template <typename T>
void attention_rows(const AttnArgs& a, const StepArgs& st, const T* x, int64_t B, int64_t d, at::Tensor& k_cache, at::Tensor& v_cache,
                    T* out, Scratch& sc, const RowGroup* after, const FillArgs* fill = nullptr) {
  const int64_t H = a.H, G = k_cache.size(1), cap = k_cache.size(2), hd = k_cache.size(3), pos = st.pos, nt = st.T;
  const int64_t R = B * nt;          // product rows: every new token of every row
  const int64_t F = fill ? fill->F : 0;  // fill rows (keys and values only), after the R rows
  const int64_t stride = pos + nt;   // a mask row's length (keys after writing the new tokens)
  T* u = sc.take<T>((R + F) * d);
  T* qp = sc.take<T>(R * H * hd);
  T* kp = sc.take<T>((R + F) * G * hd);
  T* vp = sc.take<T>((R + F) * G * hd);
  T* yp = sc.take<T>(R * H * hd);  // [R, H hd]: heads side by side, as o_proj reads them
  T* o = sc.take<T>(R * d);
  T* tmp = sc.take<T>(hd);
  norm_into(x, a.norm_w, a.eps, R, d, u);
  const Hint o_hint{&a.wo};
  if (F == 0) {
    const Lin qkv[3] = {{&a.wq, &a.bq, qp}, {&a.wk, &a.bk, kp}, {&a.wv, &a.bv, vp}};
    project(u, R, d, qkv, 3, &o_hint.g);  // q [R, H hd], k and v [R, G hd]
  } else {  // the fill rows' stand-ins through this block's norm, then k and v of all R + F rows in one product each
    norm_into(data<T>(*fill->z), a.norm_w, a.eps, F, d, u + R * d);
    const Lin q[1] = {{&a.wq, &a.bq, qp}};
    const Lin kv[2] = {{&a.wk, &a.bk, kp}, {&a.wv, &a.bv, vp}};
    project(u, R, d, q, 1, nullptr);           // q [R, H hd]
    project(u, R + F, d, kv, 2, &o_hint.g);    // k and v [R + F, G hd]
  }
  const bool qk_norm = a.q_norm_w.has_value() && a.q_norm_w->defined();
  const int64_t rot = st.cos.has_value() && st.cos->defined() ? st.cos->size(-1) : 0;
  T* kc = mdata<T>(k_cache);
  T* vc = mdata<T>(v_cache);
  for (int64_t r = R; r < R + F; ++r) {  // the fill rows' keys: QK-norm, RoPE at their own tables
    const float* cb = rot ? (*fill->cos)->data_ptr<float>() + (r - R) * rot : nullptr;
    const float* sb = rot ? (*fill->sin)->data_ptr<float>() + (r - R) * rot : nullptr;
    for (int64_t g = 0; g < G; ++g) {
      T* head = kp + (r * G + g) * hd;
      if (qk_norm) {
        rms_norm(head, data<T>(*a.k_norm_w), static_cast<float>(a.qk_eps), hd, tmp);
        std::memcpy(head, tmp, hd * sizeof(T));
      }
      if (rot) rotary(head, cb, sb, rot);
    }
  }
  for (int64_t e = 0; e < (fill ? fill->D : 0); ++e) {  // ... and their values, into each entry's buffer row and column
    const int64_t* ix = fill->index + 4 * e;
    at::Tensor& kb = const_cast<at::Tensor&>(fill->k[ix[0]]);
    at::Tensor& vb = const_cast<at::Tensor&>(fill->v[ix[0]]);
    const int64_t bcap = kb.size(2), r = R + ix[3];
    T* kd = mdata<T>(kb);
    T* vd = mdata<T>(vb);
    for (int64_t g = 0; g < G; ++g) {
      std::memcpy(kd + ((ix[1] * G + g) * bcap + ix[2]) * hd, kp + (r * G + g) * hd, hd * sizeof(T));
      std::memcpy(vd + ((ix[1] * G + g) * bcap + ix[2]) * hd, vp + (r * G + g) * hd, hd * sizeof(T));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float* cb = rot ? st.cos->data_ptr<float>() + r * rot : nullptr;
    const float* sb = rot ? st.sin->data_ptr<float>() + r * rot : nullptr;
    const int64_t cr = st.row(r / nt), col = st.col(r / nt) + r % nt;  // the cache row and column of this token
    for (int64_t h = 0; h < H + G; ++h) {  // the H query heads, then the G key heads
      T* head = h < H ? qp + (r * H + h) * hd : kp + (r * G + h - H) * hd;
      if (qk_norm) {
        rms_norm(head, data<T>(h < H ? *a.q_norm_w : *a.k_norm_w), static_cast<float>(a.qk_eps), hd, tmp);
        std::memcpy(head, tmp, hd * sizeof(T));
      }
      if (rot) rotary(head, cb, sb, rot);
    }
    for (int64_t g = 0; g < G; ++g) {  // the token's key and value into the caches at its column
      std::memcpy(kc + ((cr * G + g) * cap + col) * hd, kp + (r * G + g) * hd, hd * sizeof(T));
      std::memcpy(vc + ((cr * G + g) * cap + col) * hd, vp + (r * G + g) * hd, hd * sizeof(T));
    }
  }
  const bool* mask = st.attn_mask.has_value() && st.attn_mask->defined() ? st.attn_mask->data_ptr<bool>() : nullptr;
  // one (token, head) per task; threads only when there is enough work to pay for waking them
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, stride * hd));
  at::parallel_for(0, R * H, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(stride);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / H, h = t % H, g = h / (H / G);
      const int64_t L = st.col(r / nt) + r % nt + 1;  // this token's keys: the cache up to and including itself
      const int64_t off = (st.row(r / nt) * G + g) * cap * hd;
      attend(qp + t * hd, kc + off, vc + off, mask ? mask + r * stride : nullptr, L, hd, s.data(), yp + t * hd);
    }
  });
  const Lin out_proj[1] = {{&a.wo, &a.bo, o}};
  project(yp, R, H * hd, out_proj, 1, after);  // [R, d]
  add_rows(x, o, out, R * d);
}

template <typename T>
size_t swiglu_scratch(int64_t B, int64_t d, int64_t F) {
  return 2 * Scratch::bytes<T>(B * d) + 2 * Scratch::bytes<T>(B * F);
}

// out [B, d] = x + down(silu(gate(u)) ⊙ up(u)), u = RMSNorm(x). after: the group run next, or null.
template <typename T>
void swiglu_rows(const MlpArgs& a, const T* x, int64_t B, int64_t d, T* out, Scratch& sc, const RowGroup* after) {
  const int64_t F = a.wg.size(0);
  T* u = sc.take<T>(B * d);
  T* g = sc.take<T>(B * F);
  T* up = sc.take<T>(B * F);
  T* o = sc.take<T>(B * d);
  norm_into(x, a.norm_w, a.eps, B, d, u);
  const Lin gate_up[2] = {{&a.wg, &a.bg, g}, {&a.wu, &a.bu, up}};
  const Hint down_hint{&a.wd};
  project(u, B, d, gate_up, 2, &down_hint.g);  // [B, F] each
  silu_mul(g, up, B * F);                      // silu(gate) ⊙ up, into g
  const Lin down[1] = {{&a.wd, &a.bd, o}};
  project(g, B, F, down, 1, after);  // [B, d]
  add_rows(x, o, out, B * d);
}

// The checks of decode_attention's arguments (op: the name in messages).
void check_attention(const char* op, at::ScalarType dt, int64_t B, int64_t d, const AttnArgs& a, const StepArgs& st,
                     const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              op, ": k_cache and v_cache must be [B, G, capacity, hd] tensors of one shape, got ", k_cache.sizes(), " and ", v_cache.sizes());
  check_rows(op, st.rows, B, k_cache.size(0));
  check_cols(op, st.cols, B, st.pos);
  const int64_t H = a.H, G = k_cache.size(1), cap = k_cache.size(2), hd = k_cache.size(3), pos = st.pos;
  TORCH_CHECK(H >= G && G >= 1 && H % G == 0, op, ": n_heads ", H, " must be a multiple of the caches' ", G, " key/value heads");
  TORCH_CHECK(hd >= 1 && hd <= 256, op, ": head dim ", hd, " outside 1-256");
  const int64_t nt = st.T;
  TORCH_CHECK(0 <= pos && pos + nt <= cap, op, ": positions ", pos, "..", pos + nt - 1, " do not fit the caches' capacity ", cap);
  TORCH_CHECK(k_cache.scalar_type() == dt && v_cache.scalar_type() == dt && k_cache.is_contiguous() && v_cache.is_contiguous(),
              op, ": the caches must be contiguous ", dtype_name(dt), " tensors like x");
  check_weight(op, "norm_weight", a.norm_w, dt, d, -1);
  check_weight(op, "wq", a.wq, dt, H * hd, d);
  check_weight(op, "wk", a.wk, dt, G * hd, d);
  check_weight(op, "wv", a.wv, dt, G * hd, d);
  check_weight(op, "wo", a.wo, dt, d, H * hd);
  check_bias(op, "bq", a.bq, dt, H * hd);
  check_bias(op, "bk", a.bk, dt, G * hd);
  check_bias(op, "bv", a.bv, dt, G * hd);
  check_bias(op, "bo", a.bo, dt, d);
  const bool qn = a.q_norm_w.has_value() && a.q_norm_w->defined(), kn = a.k_norm_w.has_value() && a.k_norm_w->defined();
  TORCH_CHECK(qn == kn, op, ": give both q_norm_weight and k_norm_weight or neither");
  if (qn) {
    check_weight(op, "q_norm_weight", *a.q_norm_w, dt, hd, -1);
    check_weight(op, "k_norm_weight", *a.k_norm_w, dt, hd, -1);
  }
  const bool has_cos = st.cos.has_value() && st.cos->defined(), has_sin = st.sin.has_value() && st.sin->defined();
  TORCH_CHECK(has_cos == has_sin, op, ": give both cos and sin or neither");
  if (has_cos) {
    const int64_t rot = st.cos->size(-1);
    TORCH_CHECK(st.cos->scalar_type() == at::kFloat && st.sin->scalar_type() == at::kFloat && st.cos->is_contiguous() && st.sin->is_contiguous()
                    && st.cos->numel() == B * nt * rot && st.sin->sizes() == st.cos->sizes() && rot % 2 == 0 && rot <= hd,
                op, ": cos and sin must be contiguous float32 [B, T, rot] tables (T = ", nt, ") with an even rot <= head dim ", hd, ", got ", st.cos->sizes(),
                " ", st.cos->scalar_type());
  }
  if (st.attn_mask.has_value() && st.attn_mask->defined()) {
    TORCH_CHECK(st.attn_mask->scalar_type() == at::kBool && st.attn_mask->is_contiguous() && st.attn_mask->numel() == B * nt * (pos + nt),
                op, ": attn_mask must be a contiguous bool [B, 1, T, pos + T] = [", B, ", 1, ", nt, ", ", pos + nt, "] tensor, got ", st.attn_mask->sizes());
  }
}

void check_swiglu(const char* op, at::ScalarType dt, int64_t d, const MlpArgs& a) {
  const int64_t F = a.wg.size(0);
  check_weight(op, "norm_weight", a.norm_w, dt, d, -1);
  check_weight(op, "w_gate", a.wg, dt, F, d);
  check_weight(op, "w_up", a.wu, dt, F, d);
  check_weight(op, "w_down", a.wd, dt, d, F);
  check_bias(op, "b_gate", a.bg, dt, F);
  check_bias(op, "b_up", a.bu, dt, F);
  check_bias(op, "b_down", a.bd, dt, d);
}

template <typename T>
at::Tensor attention_op(const AttnArgs& a, const StepArgs& st, const at::Tensor& x, at::Tensor& k_cache, at::Tensor& v_cache) {
  const int64_t B = x.size(0), d = x.size(2);
  at::Tensor out = at::empty_like(x);
  Scratch& sc = Scratch::reserve(attention_scratch<T>(a, B * x.size(1), d, k_cache.size(1), k_cache.size(3)));
  attention_rows<T>(a, st, data<T>(x), B, d, k_cache, v_cache, mdata<T>(out), sc, nullptr);
  return out;
}

at::Tensor decode_attention(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wq,
                            const std::optional<at::Tensor>& bq, const at::Tensor& wk, const std::optional<at::Tensor>& bk,
                            const at::Tensor& wv, const std::optional<at::Tensor>& bv, const at::Tensor& wo,
                            const std::optional<at::Tensor>& bo, const std::optional<at::Tensor>& q_norm_w,
                            const std::optional<at::Tensor>& k_norm_w, double qk_eps, const std::optional<at::Tensor>& cos,
                            const std::optional<at::Tensor>& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos,
                            const std::optional<at::Tensor>& attn_mask, int64_t n_heads, const std::optional<at::Tensor>& rows,
                            const std::optional<at::Tensor>& cols) {
  const char* op = "decode_attention";
  const at::ScalarType dt = check_x_tokens(op, x);
  const AttnArgs a{norm_w, eps, wq, bq, wk, bk, wv, bv, wo, bo, q_norm_w, k_norm_w, qk_eps, n_heads};
  const StepArgs st{cos, sin, pos, attn_mask, rows, x.size(1), cols};
  check_attention(op, dt, x.size(0), x.size(2), a, st, k_cache, v_cache);
  return dt == at::kBFloat16 ? attention_op<bf16>(a, st, x, k_cache, v_cache) : attention_op<float>(a, st, x, k_cache, v_cache);
}

template <typename T>
at::Tensor swiglu_op(const MlpArgs& a, const at::Tensor& x) {
  const int64_t B = x.size(0) * x.size(1), d = x.size(2);  // every token is a row
  at::Tensor out = at::empty_like(x);
  Scratch& sc = Scratch::reserve(swiglu_scratch<T>(B, d, a.wg.size(0)));
  swiglu_rows<T>(a, data<T>(x), B, d, mdata<T>(out), sc, nullptr);
  return out;
}

at::Tensor decode_swiglu(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wg, const std::optional<at::Tensor>& bg,
                         const at::Tensor& wu, const std::optional<at::Tensor>& bu, const at::Tensor& wd, const std::optional<at::Tensor>& bd) {
  const char* op = "decode_swiglu";
  const at::ScalarType dt = check_x_tokens(op, x);
  const MlpArgs a{norm_w, eps, wg, bg, wu, bu, wd, bd};
  check_swiglu(op, dt, x.size(2), a);
  return dt == at::kBFloat16 ? swiglu_op<bf16>(a, x) : swiglu_op<float>(a, x);
}

// ---- a run of blocks in one call ---------------------------------------------------------------------
// decode_stack: the one-token steps of a stack of attention (+ SwiGLU) blocks, one after another, for a
// model whose blocks run back to back (looplm.blocks.Stack). Per block it is decode_attention then
// decode_swiglu (the same functions, the same results to the bit); what it saves is a Python op call
// per branch and the allocations, and every block's last product prefetches the next block's first.
// The blocks' weights come as one StackPlan, built once per generate() call (looplm/kernels/decode.py):
// per block, its parameters by their names in the block's state dict (mixer_norm.weight,
// mixer.q_proj.weight, ..., mlp.down_proj.bias; absent = None) and its three epsilons and head count.
// pos, cos, sin and attn_mask are the step's (every block's cache holds pos tokens); x may hold a few
// new tokens per row (see the top). fill_z, fill_cos, fill_sin, fill_k, fill_v, fill_index: stand-in rows
// whose keys and values every block writes beside its step (FillArgs; fill_k / fill_v hold each block's
// buffers in turn, the same number per block).
struct PlanBlock {
  at::Tensor norm_w, wq, wk, wv, wo;
  std::optional<at::Tensor> bq, bk, bv, bo, q_norm_w, k_norm_w;
  double eps, qk_eps;
  int64_t n_heads;
  bool has_mlp;
  at::Tensor mlp_norm_w, wg, wu, wd;
  std::optional<at::Tensor> bg, bu, bd;
  double mlp_eps;

  AttnArgs attn() const { return AttnArgs{norm_w, eps, wq, bq, wk, bk, wv, bv, wo, bo, q_norm_w, k_norm_w, qk_eps, n_heads}; }
  MlpArgs mlp() const { return MlpArgs{mlp_norm_w, mlp_eps, wg, bg, wu, bu, wd, bd}; }
};

struct StackPlan : torch::CustomClassHolder {
  std::vector<PlanBlock> blocks;

  // One block: `weights` maps the block's parameter names to tensors (see above).
  void add_block(const c10::Dict<std::string, at::Tensor>& weights, double eps, double qk_eps, double mlp_eps, int64_t n_heads) {
    auto need = [&](const char* name) {
      TORCH_CHECK(weights.contains(name), "StackPlan.add_block: block ", blocks.size(), " lacks ", name);
      return weights.at(name);
    };
    auto maybe = [&](const char* name) -> std::optional<at::Tensor> {
      return weights.contains(name) ? std::optional<at::Tensor>(weights.at(name)) : std::nullopt;
    };
    PlanBlock b;
    b.norm_w = need("mixer_norm.weight");
    b.wq = need("mixer.q_proj.weight"), b.wk = need("mixer.k_proj.weight"), b.wv = need("mixer.v_proj.weight"), b.wo = need("mixer.o_proj.weight");
    b.bq = maybe("mixer.q_proj.bias"), b.bk = maybe("mixer.k_proj.bias"), b.bv = maybe("mixer.v_proj.bias"), b.bo = maybe("mixer.o_proj.bias");
    b.q_norm_w = maybe("mixer.q_norm.weight"), b.k_norm_w = maybe("mixer.k_norm.weight");
    b.eps = eps, b.qk_eps = qk_eps, b.n_heads = n_heads, b.mlp_eps = mlp_eps;
    b.has_mlp = weights.contains("mlp_norm.weight");
    if (b.has_mlp) {
      b.mlp_norm_w = need("mlp_norm.weight");
      b.wg = need("mlp.gate_proj.weight"), b.wu = need("mlp.up_proj.weight"), b.wd = need("mlp.down_proj.weight");
      b.bg = maybe("mlp.gate_proj.bias"), b.bu = maybe("mlp.up_proj.bias"), b.bd = maybe("mlp.down_proj.bias");
    }
    blocks.push_back(std::move(b));
  }
  int64_t size() const { return static_cast<int64_t>(blocks.size()); }
  int64_t mlp_blocks() const {  // blocks with a SwiGLU branch
    int64_t n = 0;
    for (const PlanBlock& b : blocks) n += b.has_mlp;
    return n;
  }
};

template <typename T>
at::Tensor stack_impl(const at::Tensor& x, const std::vector<AttnArgs>& attn, const std::vector<std::optional<MlpArgs>>& mlp, const StepArgs& st, at::TensorList k_caches, at::TensorList v_caches,
                      const FillArgs& fill) {
  const int64_t B = x.size(0), R = B * st.T, d = x.size(2), n = static_cast<int64_t>(attn.size());  // R: product rows
  size_t need = 0;
  for (int64_t l = 0; l < n; ++l) {
    need = std::max(need, attention_scratch<T>(attn[l], R + fill.F, d, k_caches[l].size(1), k_caches[l].size(3)));
    if (mlp[l]) need = std::max(need, swiglu_scratch<T>(R, d, mlp[l]->wg.size(0)));
  }
  Scratch& sc = Scratch::reserve(need + 2 * Scratch::bytes<T>(R * d));
  T* buf[2] = {sc.take<T>(R * d), sc.take<T>(R * d)};
  const size_t base = sc.mark();
  at::Tensor out = at::empty_like(x);
  const T* h = data<T>(x);
  int next_buf = 0;
  for (int64_t l = 0; l < n; ++l) {
    const bool last = l + 1 == n;
    const Hint next_qkv = last ? Hint{} : Hint{&attn[l + 1].wq, &attn[l + 1].wk, &attn[l + 1].wv};
    const RowGroup* after_block = last ? nullptr : &next_qkv.g;
    // the attention branch; its output product prefetches the SwiGLU's gate/up (or the next block's q/k/v)
    const Hint gate_up = mlp[l] ? Hint{&mlp[l]->wg, &mlp[l]->wu} : Hint{};
    T* mid = last && !mlp[l] ? mdata<T>(out) : buf[next_buf];
    at::Tensor& kc = const_cast<at::Tensor&>(k_caches[l]);
    at::Tensor& vc = const_cast<at::Tensor&>(v_caches[l]);
    FillArgs fl = fill;  // this block's destination buffers
    if (fl.F) fl.k += l * fl.nb, fl.v += l * fl.nb;
    attention_rows<T>(attn[l], st, h, B, d, kc, vc, mid, sc, mlp[l] ? &gate_up.g : after_block, fl.F ? &fl : nullptr);
    sc.release(base);
    h = mid;
    next_buf ^= 1;
    if (mlp[l]) {
      T* o = last ? mdata<T>(out) : buf[next_buf];
      swiglu_rows<T>(*mlp[l], h, R, d, o, sc, after_block);
      sc.release(base);
      h = o;
      next_buf ^= 1;
    }
  }
  if (n == 0) out.copy_(x);
  return out;
}

at::Tensor decode_stack(const at::Tensor& x, const c10::intrusive_ptr<StackPlan>& plan, at::TensorList k_caches, at::TensorList v_caches,
                        int64_t pos, const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                        const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& rows,
                        const std::optional<at::Tensor>& cols, const std::optional<at::Tensor>& fill_z,
                        const std::optional<at::Tensor>& fill_cos, const std::optional<at::Tensor>& fill_sin,
                        std::optional<at::TensorList> fill_k_opt, std::optional<at::TensorList> fill_v_opt,
                        const std::optional<at::Tensor>& fill_index) {
  const at::TensorList fill_k = fill_k_opt.value_or(at::TensorList{}), fill_v = fill_v_opt.value_or(at::TensorList{});
  const char* op = "decode_stack";
  const at::ScalarType dt = check_x_tokens(op, x);
  const int64_t n = plan->size();
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == n && static_cast<int64_t>(v_caches.size()) == n,
              op, ": the plan has ", n, " blocks; give one k and one v cache each, got ", k_caches.size(), " and ", v_caches.size());
  const StepArgs st{cos, sin, pos, attn_mask, rows, x.size(1), cols};
  std::vector<AttnArgs> attn;
  std::vector<std::optional<MlpArgs>> mlp;
  attn.reserve(n);
  mlp.reserve(n);
  for (int64_t l = 0; l < n; ++l) {
    const PlanBlock& b = plan->blocks[l];
    attn.push_back(b.attn());
    check_attention(op, dt, x.size(0), x.size(2), attn.back(), st, k_caches[l], v_caches[l]);
    if (b.has_mlp) {
      mlp.emplace_back(b.mlp());
      check_swiglu(op, dt, x.size(2), *mlp.back());
    } else {
      mlp.emplace_back(std::nullopt);
    }
  }
  check_fill(op, dt, x.size(2), n, fill_z, fill_cos, fill_sin, fill_k, fill_v, fill_index, k_caches);
  FillArgs fill;
  if (fill_z.has_value() && fill_z->defined()) {
    const bool step_rope = cos.has_value() && cos->defined(), fill_rope = fill_cos.has_value() && fill_cos->defined();
    TORCH_CHECK(step_rope == fill_rope && (!step_rope || fill_cos->numel() == fill_z->size(0) * cos->size(-1)), op,
                ": the fill rows need RoPE tables exactly when the step has them, of its rot = ", step_rope ? cos->size(-1) : 0,
                " channels (fill_cos [F, 1, rot])");
    fill = FillArgs{&*fill_z, fill_z->size(0), &fill_cos, &fill_sin, fill_k.data(), fill_v.data(),
                    static_cast<int64_t>(fill_k.size()) / n, fill_index->data_ptr<int64_t>(), fill_index->size(0)};
  }
  return dt == at::kBFloat16 ? stack_impl<bf16>(x, attn, mlp, st, k_caches, v_caches, fill)
                             : stack_impl<float>(x, attn, mlp, st, k_caches, v_caches, fill);
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
                       at::Tensor& ssm_state, const std::optional<at::Tensor>& pad_mask, const std::optional<at::Tensor>& rows) {
  const int64_t Bn = x.size(0), d = x.size(2), d_inner = gnorm_w.size(0), conv_dim = conv_state.size(1), K = conv_state.size(2);
  const int64_t* rix = rows.has_value() && rows->defined() ? rows->data_ptr<int64_t>() : nullptr;
  auto srow = [rix](int64_t b) { return rix ? rix[b] : b; };  // the state row of x's row b
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
      T* win = cs + (srow(b) * conv_dim + c) * K;
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
        const float yp = ssm_row(S + ((srow(b) * H + h) * P + p) * N, decay, dt[t] * xs[p], Bv, Cv, N);
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
                         at::Tensor& ssm_state, const std::optional<at::Tensor>& pad_mask, const std::optional<at::Tensor>& rows) {
  const char* op = "decode_mamba2";
  const at::ScalarType dt = check_x(op, x);
  const int64_t Bn = x.size(0), d = x.size(2);
  const bool by_rows = rows.has_value() && rows->defined();  // x's rows are some rows of the states
  const int64_t Sn = by_rows && conv_state.dim() == 3 ? conv_state.size(0) : Bn;  // the states' rows
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(0) == Sn && conv_state.scalar_type() == dt && conv_state.is_contiguous(),
              op, ": conv_state must be a contiguous ", dtype_name(dt), " [B, conv_dim, d_conv] tensor with B = ", Sn, ", got ",
              conv_state.sizes(), " ", conv_state.scalar_type());
  TORCH_CHECK(ssm_state.dim() == 4 && ssm_state.size(0) == Sn && ssm_state.scalar_type() == at::kFloat && ssm_state.is_contiguous(),
              op, ": ssm_state must be a contiguous float32 [B, nheads, headdim, d_state] tensor with B = ", Sn, ", got ",
              ssm_state.sizes(), " ", ssm_state.scalar_type());
  check_rows(op, rows, Bn, Sn);
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
                             ssm_state, pad_mask, rows);
  return mamba2_impl<float>(x, norm_w, eps, w_in, b_in, conv_w, conv_b, dt_bias, A_log, Dp, gnorm_w, gnorm_eps, w_out, b_out, conv_state,
                            ssm_state, pad_mask, rows);
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

// y [B, 1, d] = RMSNorm(x) · w: a lone norm of one token per row (the final norm before the head, an exit
// criterion's readout), one pass over each row instead of rms_norm's chain of kernels — right after a core
// pass streamed the weights, that chain runs cold (~180 µs at d = 1024 against ~20 µs warm).
at::Tensor decode_norm(const at::Tensor& x, const at::Tensor& norm_w, double eps) {
  const char* op = "decode_norm";
  const at::ScalarType dt = check_x(op, x);
  const int64_t B = x.size(0), d = x.size(2);
  check_weight(op, "norm_weight", norm_w, dt, d, -1);
  if (dt == at::kBFloat16) return norm_rows<bf16>(x, norm_w, eps, B, d).view({B, 1, d});
  return norm_rows<float>(x, norm_w, eps, B, d).view({B, 1, d});
}

// dst[j][rows[i], :, cols[i], :] = src[j][rows[i], :, cols[i], :] for every pair j and row i (cols: [n], or [1] for
// every row): the copy fill of per-token exit (a token's exit-loop keys and values into the slots of the loops
// it skipped), one call for every layer and skipped loop instead of an indexed read and write per pair
// (looplm.layers.attention.copy_kv_columns is the reference; its slots are [B, H_kv, capacity, hd] views).
void copy_kv_columns(at::TensorList src, at::TensorList dst, const at::Tensor& rows, const at::Tensor& cols) {
  const char* op = "copy_kv_columns";
  TORCH_CHECK(src.size() == dst.size(), op, ": src and dst must pair up, got ", src.size(), " and ", dst.size(), " tensors");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.device().is_cpu(), op, ": rows must be a 1-D int64 CPU tensor");
  const int64_t n = rows.size(0);
  TORCH_CHECK(cols.dim() == 1 && cols.scalar_type() == at::kLong && cols.device().is_cpu() && (cols.size(0) == n || cols.size(0) == 1),
              op, ": cols must be a 1-D int64 CPU tensor of one entry per row or one for all, got ", cols.sizes());
  const at::Tensor r = rows.contiguous(), c = cols.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* cp = c.data_ptr<int64_t>();
  const int64_t cstep = c.size(0) == n ? 1 : 0;
  for (size_t j = 0; j < src.size(); ++j) {
    const at::Tensor& a = src[j];
    const at::Tensor& b = dst[j];
    TORCH_CHECK(a.dim() == 4 && b.dim() == 4 && a.scalar_type() == b.scalar_type() && a.device().is_cpu() && b.device().is_cpu(), op,
                ": pair ", j, " must be 4-D CPU tensors of one dtype, got ", a.sizes(), " ", a.scalar_type(), " and ", b.sizes(), " ",
                b.scalar_type());
    TORCH_CHECK(a.size(1) == b.size(1) && a.size(3) == b.size(3) && a.stride(3) == 1 && b.stride(3) == 1, op, ": pair ", j,
                " must agree in heads and head size, rows of unit stride, got ", a.sizes(), " and ", b.sizes());
    const int64_t H = a.size(1), hd = a.size(3), es = a.element_size();
    const char* ap = static_cast<const char*>(a.data_ptr());
    char* bp = static_cast<char*>(b.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = rp[i], col = cp[i * cstep];
      TORCH_CHECK(row >= 0 && row < a.size(0) && row < b.size(0) && col >= 0 && col < a.size(2) && col < b.size(2), op, ": row ", row,
                  ", column ", col, " is outside pair ", j, "'s ", a.sizes(), " / ", b.sizes());
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(bp + (row * b.stride(0) + h * b.stride(1) + col * b.stride(2)) * es,
                    ap + (row * a.stride(0) + h * a.stride(1) + col * a.stride(2)) * es, hd * es);
    }
  }
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
      "Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, Tensor? attn_mask, int n_heads, Tensor? rows=None, Tensor? cols=None) -> Tensor");
  m.def(
      "decode_swiglu(Tensor x, Tensor norm_weight, float eps, Tensor w_gate, Tensor? b_gate, Tensor w_up, Tensor? b_up, "
      "Tensor w_down, Tensor? b_down) -> Tensor");
  m.def(
      "decode_mamba2(Tensor x, Tensor norm_weight, float eps, Tensor w_in, Tensor? b_in, Tensor conv_weight, Tensor? conv_bias, "
      "Tensor dt_bias, Tensor A_log, Tensor D, Tensor gate_norm_weight, float gate_norm_eps, Tensor w_out, Tensor? b_out, "
      "Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor? pad_mask, Tensor? rows=None) -> Tensor");
  m.def(
      "decode_stateloop_update(Tensor h, Tensor S, Tensor norm_weight, float eps, Tensor w_u, Tensor w_delta, Tensor b_delta, "
      "Tensor A_log) -> Tensor");
  m.def("decode_stateloop_read(Tensor h, Tensor S, Tensor norm_weight, float eps, Tensor w) -> Tensor");
  m.def("decode_norm(Tensor x, Tensor norm_weight, float eps) -> Tensor");
  m.def("copy_kv_columns(Tensor[] src, Tensor(a!)[] dst, Tensor rows, Tensor cols) -> ()");
  m.class_<looplm_cpu::StackPlan>("StackPlan")
      .def(torch::init<>())
      .def("add_block", &looplm_cpu::StackPlan::add_block)
      .def("size", &looplm_cpu::StackPlan::size)
      .def("mlp_blocks", &looplm_cpu::StackPlan::mlp_blocks);
  m.def(
      "decode_stack(Tensor x, __torch__.torch.classes.looplm_cpu.StackPlan plan, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int pos, "
      "Tensor? cos, Tensor? sin, Tensor? attn_mask, Tensor? rows=None, Tensor? cols=None, Tensor? fill_z=None, Tensor? fill_cos=None, "
      "Tensor? fill_sin=None, Tensor(c!)[]? fill_k=None, Tensor(d!)[]? fill_v=None, Tensor? fill_index=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(looplm_cpu, CPU, m) {
  m.impl("decode_attention", &looplm_cpu::decode_attention);
  m.impl("decode_swiglu", &looplm_cpu::decode_swiglu);
  m.impl("decode_mamba2", &looplm_cpu::decode_mamba2);
  m.impl("decode_stateloop_update", &looplm_cpu::decode_stateloop_update);
  m.impl("decode_stateloop_read", &looplm_cpu::decode_stateloop_read);
  m.impl("decode_norm", &looplm_cpu::decode_norm);
  m.impl("copy_kv_columns", &looplm_cpu::copy_kv_columns);
  m.impl("decode_stack", &looplm_cpu::decode_stack);
}
