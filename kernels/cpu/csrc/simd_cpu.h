/*
 * Vector helpers shared by the native CPU kernels (paged_cpu.c, fused_cpu.c): GCC/Clang vector
 * extensions W floats wide (16 where the build has AVX-512, -mavx512f; else 8: AVX2, or split by
 * the compiler into what the target has), loads and stores of fp32 or bf16 (bf16 widened exactly,
 * narrowed with round to nearest even, NaN kept NaN), a lane sum, e^x and SiLU.
 */
#ifndef PAGEDKV_SIMD_CPU_H
#define PAGEDKV_SIMD_CPU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#define W 16
#else
#define W 8
#endif

typedef float vf __attribute__((vector_size(4 * W), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(4 * W), aligned(4), may_alias));
typedef uint32_t vu __attribute__((vector_size(4 * W), aligned(4), may_alias));
typedef uint16_t vh __attribute__((vector_size(2 * W), aligned(2), may_alias));

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* A broadcast: x - 0 is x for every x (x + 0 is not: -0 + 0 = +0), so no arithmetic is left. */
ALWAYS_INLINE vf splat(float x) { return x - (vf){0}; }

ALWAYS_INLINE vf select_v(vi mask, vf a, vf b) { /* mask ? a : b, lane-wise */
  return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* Loads of W elements (fp32, or bf16 widened: exact) and of one element. */
ALWAYS_INLINE vf load_v(const void *p, int64_t i, const int bf16) {
  if (!bf16) return *(const vf *)((const float *)p + i);
  const vu u = __builtin_convertvector(*(const vh *)((const uint16_t *)p + i), vu);
  return (vf)(u << 16);
}

ALWAYS_INLINE float load_s(const void *p, int64_t i, const int bf16) {
  if (!bf16) return ((const float *)p)[i];
  const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* fp32 -> bf16, round to nearest even; NaN stays NaN (quieted). */
ALWAYS_INLINE uint16_t bf16_s(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* fp32 bit patterns -> their bf16 patterns in the high half, round to nearest even; NaN quieted. */
ALWAYS_INLINE vu bf16_bits_v(vf x) {
  const vu u = (vu)x;
  const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vi nan = (vi)((u & 0x7fffffffu) > 0x7f800000u);
  return (vu)(((vi)((u >> 16) | 0x40u) & nan) | ((vi)r & ~nan));
}

/* x as the dtype holds it: rounded to bf16 (and back, exactly) for bf16, unchanged for fp32. */
ALWAYS_INLINE vf round_v(vf x, const int bf16) { return bf16 ? (vf)(bf16_bits_v(x) << 16) : x; }

ALWAYS_INLINE float round_s(float x, const int bf16) {
  if (!bf16) return x;
  const uint32_t u = (uint32_t)bf16_s(x) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

ALWAYS_INLINE void store_v(void *p, int64_t i, vf x, const int bf16) {
  if (bf16)
    *(vh *)((uint16_t *)p + i) = __builtin_convertvector(bf16_bits_v(x), vh);
  else
    *(vf *)((float *)p + i) = x;
}

ALWAYS_INLINE void store_s(void *p, int64_t i, float x, const int bf16) {
  if (bf16)
    ((uint16_t *)p)[i] = bf16_s(x);
  else
    ((float *)p)[i] = x;
}

typedef float vf8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef float vf4 __attribute__((vector_size(16), aligned(4), may_alias));

/* Sum of the lanes, as a tree (halves added), not a serial chain. */
ALWAYS_INLINE float hsum(vf v) {
#if W == 16
  const vf8 s8 = *(const vf8 *)&v + *((const vf8 *)&v + 1);
#else
  const vf8 s8 = v;
#endif
  const vf4 s4 = *(const vf4 *)&s8 + *((const vf4 *)&s8 + 1);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* e^x for x <= 0 (Cephes expf: e^x = 2^n e^r, |r| <= ln2 / 2; error <= 2 ulp); 0 below -87.3. */
ALWAYS_INLINE vf exp_v(vf x) {
  const vf lo = splat(-87.33654f);
  const vi under = x < lo;
  x = select_v(under, lo, x);
  const vf fx = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(fx, vi);              /* truncates toward zero */
  n += (vi)(__builtin_convertvector(n, vf) > fx);      /* -1 where that rounded up: floor */
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  y = y * (vf)((n + 127) << 23);
  return select_v(under, splat(0.0f), y);
}

/* silu(g) = g * sigmoid(g) with e = e^-|g| <= 1 (no overflow): sigmoid = 1 / (1 + e) for g >= 0,
 * e / (1 + e) below. NaN in, NaN out. */
ALWAYS_INLINE vf silu_v(vf g) {
  const vf e = exp_v((vf)((vu)g | 0x80000000u)); /* -|g| */
  const vf num = select_v(g >= 0.0f, splat(1.0f), e);
  return g * (num / (1.0f + e));
}

#endif /* PAGEDKV_SIMD_CPU_H */
