// Numeric helpers shared by the extension's kernels (decode.cpp, attention.cpp): widening and rounding
// as a tensor of dtype T stores a value, and — in the AVX-512 build — 16-lane loads, stores and e^x.
#pragma once

#include <c10/util/BFloat16.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>

namespace looplm_cpu {

using bf16 = c10::BFloat16;

inline float widen(float v) { return v; }
inline float widen(bf16 v) { return static_cast<float>(v); }  // exact

// An fp32 result stored in a tensor of dtype T (bf16: round to nearest even, as torch's kernels do).
template <typename T>
inline float rnd(float v) {
  return widen(T(v));
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)

// 16 entries of a row (fewer under a mask) as fp32.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// e^x for 16 lanes: 2^n · p(r) with n = round(x / ln 2), r = x − n ln 2 (ln 2 in two parts), p the degree-7
// Taylor polynomial (truncation < 5e-9 relative on |r| ≤ ln2/2); scalef gives inf past 88.7 and 0 below
// −104 (x is clamped at −110 so that −inf gives exactly 0, not NaN; NaN stays NaN). Written here because torch's
// vectorised math (ATen/cpu/vec) is an internal, per-CPU-capability header.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);  // max(c, NaN) is NaN: the second operand is returned
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // x − n·ln2 (high part, exact product)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);  // − n·(ln2 − high part)
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 vectors a[0..15] -> one vector whose lane i is the sum of a[i]'s 16 lanes (a transpose-and-add
// tree: 45 instructions for 16 outputs instead of 16 horizontal reductions).
inline __m512 sum_lanes16(const __m512* a) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)  // lanes of each 128-bit quarter: [a, b, a, b]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // each quarter: [a, b, c, d]
    __m512d p = _mm512_castps_pd(s[2 * i]), q = _mm512_castps_pd(s[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  for (int i = 0; i < 2; ++i)  // quarters [0-3, 0-3, 4-7, 4-7] (then [8-11, ...])
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88), _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));  // [0-3, 4-7, 8-11, 12-15]
}

// Round 16 fp32 lanes as a T tensor would store them (bf16: vcvtneps2bf16, round to nearest even), as fp32.
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const bf16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }

#endif

}  // namespace looplm_cpu
