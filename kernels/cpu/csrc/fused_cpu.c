/*
 * The elementwise ops of a Llama decoder block on CPU, fp32 or bf16, each one pass over its rows:
 *   rms_norm      out = x / sqrt(mean(x^2) + eps) * weight                    (Zhang & Sennrich 2019)
 *   add_rms_norm  residual += x (in place, rounded to the dtype), then out = rms_norm(residual)
 *                 (vLLM's `fused_add_rms_norm`: the residual stream and the next norm in one pass)
 *   silu_mul      out = silu(gate) * up for gate_up = [gate | up] rows (SwiGLU, Shazeer 2020)
 *   rope          x = x * cos + rotate_half(x) * sin, in place (RoFormer, Su et al. 2021; the
 *                 rotate-half layout of transformers' Llama), sin with its first half negated
 * In torch each of these is several ops, each a pass over memory with a temporary, and bf16 ones
 * convert to fp32 and back at every op; here one loop reads each element once and writes once.
 *
 * Layout (strides in elements; the last axis contiguous; every tensor of a call has one dtype):
 *   rms:   x, residual, out [rows, d] (row strides x_s, r_s, o_s); weight [d]
 *   silu:  gate_up [rows, 2 * inter] (row stride g_s), out [rows, inter] (row stride o_s)
 *   rope:  x [rows, heads, dh] (row stride x_s, head stride h_s); cos, sin [rows, dh] (row
 *          strides c_s, s_s), each frequency twice as in transformers' rotary embedding
 * Arithmetic is fp32 (bf16 -> fp32 is exact; fp32 -> bf16 rounds to nearest even, NaN stays NaN),
 * one rounding per output element; add_rms_norm rounds the new residual first (as torch's add in
 * the dtype does) and normalizes the rounded values. Rows are split over an OpenMP team only when
 * a call's elements reach PARALLEL_WORK (a batch-1 call costs a thread wake-up otherwise).
 *
 * Built with paged_cpu.c into one library by kernels/cpu/native.py; vectors use GCC/Clang vector
 * extensions, 16 floats wide with AVX-512 (-mavx512f), else 8 (helpers shared in simd_cpu.h).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_cpu.h"

#define PARALLEL_WORK 65536 /* elements of a call from which rows go to several threads */

/* silu_v (simd_cpu.h) on one element. */
ALWAYS_INLINE float silu_s(float g) {
  const float e = expf(-fabsf(g));
  return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

/* One row of (add_)rms_norm. ADD: res += x rounded to the dtype, then the norm of res; else the
 * norm of x (res unused). Sums of squares in two vector accumulators (a shorter chain). */
ALWAYS_INLINE void rms_row(const void *x, void *res, const void *w, void *out, int64_t d, float eps,
                           const int ADD, const int BF16) {
  const int64_t d2 = d / (2 * W) * (2 * W), d1 = d / W * W;
  const void *src = ADD ? res : x;
  vf s0 = splat(0.0f), s1 = splat(0.0f);
  float st = 0.0f;
  int64_t i = 0;
  for (; i < d2; i += 2 * W) {
    vf a = load_v(x, i, BF16), b = load_v(x, i + W, BF16);
    if (ADD) {
      a = round_v(a + load_v(res, i, BF16), BF16);
      b = round_v(b + load_v(res, i + W, BF16), BF16);
      store_v(res, i, a, BF16); /* exact: already rounded */
      store_v(res, i + W, b, BF16);
    }
    s0 += a * a;
    s1 += b * b;
  }
  for (; i < d1; i += W) {
    vf a = load_v(x, i, BF16);
    if (ADD) {
      a = round_v(a + load_v(res, i, BF16), BF16);
      store_v(res, i, a, BF16);
    }
    s0 += a * a;
  }
  for (; i < d; i++) {
    float a = load_s(x, i, BF16);
    if (ADD) {
      a = round_s(a + load_s(res, i, BF16), BF16);
      store_s(res, i, a, BF16);
    }
    st += a * a;
  }
  const float inv = 1.0f / sqrtf((hsum(s0 + s1) + st) / (float)d + eps);
  const vf iv = splat(inv);
  for (i = 0; i < d1; i += W) store_v(out, i, load_v(src, i, BF16) * iv * load_v(w, i, BF16), BF16);
  for (; i < d; i++) store_s(out, i, load_s(src, i, BF16) * inv * load_s(w, i, BF16), BF16);
}

ALWAYS_INLINE void silu_row(const void *gu, void *out, int64_t inter, const int BF16) {
  const int64_t d1 = inter / W * W;
  int64_t i = 0;
  for (; i < d1; i += W)
    store_v(out, i, silu_v(load_v(gu, i, BF16)) * load_v(gu, inter + i, BF16), BF16);
  for (; i < inter; i++) store_s(out, i, silu_s(load_s(gu, i, BF16)) * load_s(gu, inter + i, BF16), BF16);
}

/* One token of rope: heads [0, heads) of x, head stride hs, rotated in place. */
ALWAYS_INLINE void rope_row(void *x, const void *cos, const void *sin, int64_t heads, int64_t hs,
                            int64_t dh, const int BF16) {
  const int64_t half = dh / 2, h1 = half / W * W;
  const int64_t esz = BF16 ? 2 : 4;
  for (int64_t h = 0; h < heads; h++) {
    char *xh = (char *)x + h * hs * esz;
    int64_t i = 0;
    for (; i < h1; i += W) {
      const vf a = load_v(xh, i, BF16), b = load_v(xh, half + i, BF16);
      store_v(xh, i, a * load_v(cos, i, BF16) + b * load_v(sin, i, BF16), BF16);
      store_v(xh, half + i, b * load_v(cos, half + i, BF16) + a * load_v(sin, half + i, BF16), BF16);
    }
    for (; i < half; i++) {
      const float a = load_s(xh, i, BF16), b = load_s(xh, half + i, BF16);
      store_s(xh, i, a * load_s(cos, i, BF16) + b * load_s(sin, i, BF16), BF16);
      store_s(xh, half + i, b * load_s(cos, half + i, BF16) + a * load_s(sin, half + i, BF16), BF16);
    }
  }
}

static int team(int64_t elements, int64_t rows, int64_t num_threads) {
  if (num_threads < 1 || elements < PARALLEL_WORK) return 1;
  return (int)(num_threads < rows ? num_threads : rows);
}

#define RMS(NAME, ADD, BF16)                                                                      \
  static void NAME(const char *x, char *res, const void *w, char *out, int64_t rows, int64_t d,     \
                   int64_t x_s, int64_t r_s, int64_t o_s, float eps, int nt) {                    \
    const int64_t esz = BF16 ? 2 : 4;                                                             \
    _Pragma("omp parallel for num_threads(nt) if (nt > 1) schedule(static)")                     \
    for (int64_t t = 0; t < rows; t++)                                                            \
      rms_row(x + t * x_s * esz, res + t * r_s * esz, w, out + t * o_s * esz, d, eps, ADD, BF16); \
  }
RMS(rms_f32, 0, 0)
RMS(rms_bf16, 0, 1)
RMS(add_rms_f32, 1, 0)
RMS(add_rms_bf16, 1, 1)

/* rms_norm_packed: a = [x, residual, weight, out (addresses), rows, d, x_s, r_s, o_s, add, bf16,
 * num_threads]; add 0: out = rms_norm(x) (residual unused), 1: residual += x, out =
 * rms_norm(residual). Returns 0. */
int rms_norm_packed(const int64_t *a, float eps) {
  const int nt = team(a[4] * a[5], a[4], a[11]);
  static void (*const fns[2][2])(const char *, char *, const void *, char *, int64_t, int64_t,
                                 int64_t, int64_t, int64_t, float, int) = {
      {rms_f32, rms_bf16}, {add_rms_f32, add_rms_bf16}};
  fns[a[9] != 0][a[10] != 0]((const char *)a[0], (char *)a[1], (const void *)a[2], (char *)a[3],
                             a[4], a[5], a[6], a[7], a[8], eps, nt);
  return 0;
}

#define SILU(NAME, BF16)                                                                         \
  static void NAME(const char *gu, char *out, int64_t rows, int64_t inter, int64_t g_s,          \
                   int64_t o_s, int nt) {                                                        \
    const int64_t esz = BF16 ? 2 : 4;                                                            \
    _Pragma("omp parallel for num_threads(nt) if (nt > 1) schedule(static)")                    \
    for (int64_t t = 0; t < rows; t++) silu_row(gu + t * g_s * esz, out + t * o_s * esz, inter, BF16); \
  }
SILU(silu_f32, 0)
SILU(silu_bf16, 1)

/* silu_mul_packed: a = [gate_up, out (addresses), rows, inter, g_s, o_s, bf16, num_threads].
 * Returns 0. */
int silu_mul_packed(const int64_t *a) {
  const int nt = team(a[2] * a[3] * 4, a[2], a[7]); /* an exp per element: weighs like ~4 */
  (a[6] ? silu_bf16 : silu_f32)((const char *)a[0], (char *)a[1], a[2], a[3], a[4], a[5], nt);
  return 0;
}

#define ROPE(NAME, BF16)                                                                         \
  static void NAME(char *x, const char *cos, const char *sin, int64_t rows, int64_t heads,       \
                   int64_t dh, int64_t x_s, int64_t h_s, int64_t c_s, int64_t s_s, int nt) {     \
    const int64_t esz = BF16 ? 2 : 4;                                                            \
    _Pragma("omp parallel for num_threads(nt) if (nt > 1) schedule(static)")                    \
    for (int64_t t = 0; t < rows; t++)                                                           \
      rope_row(x + t * x_s * esz, cos + t * c_s * esz, sin + t * s_s * esz, heads, h_s, dh, BF16); \
  }
ROPE(rope_f32, 0)
ROPE(rope_bf16, 1)

/* rope_packed: a = [x, cos, sin (addresses), rows, heads, dh, x_s, h_s, c_s, s_s, bf16,
 * num_threads]; x rotated in place. Returns 0. */
int rope_packed(const int64_t *a) {
  const int nt = team(a[3] * a[4] * a[5], a[3], a[11]);
  (a[10] ? rope_bf16 : rope_f32)((char *)a[0], (const char *)a[1], (const char *)a[2], a[3], a[4],
                                 a[5], a[6], a[7], a[8], a[9], nt);
  return 0;
}
