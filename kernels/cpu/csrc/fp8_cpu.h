/*
 * float8_e4m3fn cache elements read as fp32 by the decode kernels (paged_cpu.c): W bytes at once
 * (fp8_v) or one (fp8_s), each widened exactly, times FP8_DECODED_UNIT. The kernels fold that
 * unit and a KV head's scale into its scaled query and its output, not into each element (vLLM's
 * fp8 KV cache read as fp8 * scale).
 */
#ifndef PAGEDKV_FP8_CPU_H
#define PAGEDKV_FP8_CPU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_cpu.h"
#if W == 16 || defined(__F16C__)
#include <immintrin.h>
#endif

/* fp8_v / fp8_s return e4m3 values times this: 2^-8 (7, e4m3's exponent bias, less fp16's 15). */
#define FP8_DECODED_UNIT 0x1p-8f

/* W float8_e4m3fn bytes at p, times FP8_DECODED_UNIT, exactly; NaN (0x7F, 0xFF) stays NaN.
 * Shifted left by 7, a byte's sign lands on fp16's sign bit and its 4-bit exponent and 3-bit
 * mantissa on the low fp16 exponent and high mantissa bits: an fp16 of the same significand whose
 * exponent bias is 15 instead of 7, subnormals included, converted exactly by vcvtph2ps (F16C,
 * AVX-512F): e4m3 value x becomes the fp16 x * 2^-8, never an fp32 subnormal. Without F16C the
 * same is done with integer arithmetic. */
ALWAYS_INLINE vf fp8_v(const char *p) {
#if W == 16
  const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); /* sign-extended */
  __m256i h = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16((short)0xBF80));
  /* 0x3F80 (|byte| 0x7F, NaN): fp16 exponent all ones (0x7C00) makes it NaN */
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3F80)),
                                         _mm256_set1_epi16(0x3F80));
  h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7C00)));
  return (vf)_mm512_cvtph_ps(h);
#elif defined(__F16C__)
  const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
  __m128i h = _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16((short)0xBF80));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x3F80)),
                                      _mm_set1_epi16(0x3F80));
  h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7C00)));
  return (vf)_mm256_cvtph_ps(h);
#else
  typedef uint8_t vb __attribute__((vector_size(W), aligned(1), may_alias));
  const vu b = __builtin_convertvector(*(const vb *)p, vu), mag = b & 0x7Fu;
  /* normal (exponent field >= 1): rebias 7 -> 127 - 8; subnormal: mantissa * 2^-9 * 2^-8 */
  const vf normal = (vf)((mag << 20) + (112u << 23));
  const vf sub = __builtin_convertvector((vi)mag, vf) * 0x1p-17f;
  vf f = select_v((vi)(mag < 8u), sub, normal);
  f = select_v((vi)(mag == 0x7Fu), splat(NAN), f);
  return (vf)((vu)f | ((b & 0x80u) << 24));
#endif
}

/* Element i of a float8_e4m3fn row, times FP8_DECODED_UNIT (fp8_v's arithmetic, one byte). */
ALWAYS_INLINE float fp8_s(const void *p, int64_t i) {
  const uint32_t b = ((const uint8_t *)p)[i], mag = b & 0x7Fu;
  float f = (float)mag * 0x1p-17f;
  if (mag >= 8u) {
    const uint32_t u = (mag << 20) + (112u << 23);
    memcpy(&f, &u, 4);
  }
  if (mag == 0x7Fu) f = NAN;
  return b & 0x80u ? -f : f;
}

#endif
