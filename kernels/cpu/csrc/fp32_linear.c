/*
 * y = x W^T for the rows of x, fp32, on the build's FMA vectors (AVX2: 8 wide; AVX-512: 16),
 * reading the weight in oneDNN's prepacked layout in place; optionally SwiGLU's silu(gate) * up of
 * a [gate | up] weight. The projection kernel of a CPU without bf16 instructions, where the model
 * runs in fp32 (pagedkv.config.default_dtype): what lets a decode step's layers run in one native
 * call there too (decode_layers.c), and, like the bf16 kernels, streams each weight block once per
 * chunk of rows with a prefetch ahead.
 *
 * Layout: x [M, K] fp32, rows x_s apart, K contiguous; out [M, N] fp32, rows o_s apart. W [N, K] as
 * oneDNN packs an fp32 linear weight: [N / B][K][B], B outputs per block (B = 64 on the AVX-512
 * CPUs measured; any multiple of the vector width up to 64 is read). `kernels.cpu.packed_linear`
 * checks the bytes before using it.
 *
 * Arithmetic: each output is an fp32 sum over K in order, one fused multiply-add per input. A
 * row's result never depends on the other rows of the call, nor on the thread count.
 */
#include <stdint.h>
#include <string.h>

#include "simd_cpu.h"
#include "team_cpu.h"

#define PF_BYTES 1024 /* prefetch distance along a block of the packed weight */
#define MAX_G 4       /* vectors of outputs per group: 16 (AVX-512) or 8 (AVX2) registers of sums */
#define MAX_R (W == 16 ? 4 : 2)

/* acc[r][W g + c] (rows G W floats apart) = rows [0, R) of x times outputs [0, G W) of a block
 * whose rows of K are B floats apart (at wb). R and G are constants at every call site. */
ALWAYS_INLINE void group_rows(const float *x, int64_t xs, const float *wb, int64_t K, int64_t B, const int R,
                              const int G, int prefetch, float *acc) {
  vf c[MAX_R][MAX_G];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) c[r][g] = splat(0.0f);
  for (int64_t k = 0; k < K; k++) {
    const float *wk = wb + k * B;
    if (prefetch) __builtin_prefetch((const char *)wk + PF_BYTES);
    vf w[MAX_G];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) w[g] = *(const vf *)(wk + W * g);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      const vf xv = splat(x[r * xs + k]);
#pragma GCC unroll 4
      for (int g = 0; g < G; g++) c[r][g] += xv * w[g];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) *(vf *)(acc + r * G * W + W * g) = c[r][g];
}

#define ROWS_CASE(R, G)                                      \
  case R:                                                    \
    group_rows(x, xs, wb, K, B, R, G, prefetch, acc);        \
    return;

/* `rows` (1..MAX_R) rows times G (1..MAX_G) vectors of outputs. */
static void chunk(const float *x, int64_t xs, const float *wb, int64_t K, int64_t B, int G, int rows, int prefetch,
                  float *acc) {
#define G_CASE(G)                                                   \
  case G:                                                           \
    switch (rows) { ROWS_CASE(1, G) ROWS_CASE(2, G) ROWS_EXTRA(G) } \
    return;
#if MAX_R == 4
#define ROWS_EXTRA(G) ROWS_CASE(3, G) ROWS_CASE(4, G)
#else
#define ROWS_EXTRA(G)
#endif
  switch (G) { G_CASE(1) G_CASE(2) G_CASE(3) G_CASE(4) }
}

/* Output blocks [nb0, nb1) of every row (silu: blocks of the gate half, each with block
 * nb + up_blocks of the up half; out = silu(gate) * up, exactly fused_cpu.c's silu_mul of the
 * product: the same bits as the product followed by that op). */
static void fp32_blocks(const float *x, const float *w, float *out, int64_t M, int64_t K, int64_t xs, int64_t os,
                        int64_t B, int64_t nb0, int64_t nb1, int silu, int64_t up_blocks) {
  float acc[MAX_R * MAX_G * W] __attribute__((aligned(64)));
  float up[MAX_R * MAX_G * W] __attribute__((aligned(64)));
  const int64_t vecs = B / W;
  for (int64_t nb = nb0; nb < nb1; nb++) {
    const float *wb = w + nb * K * B;
    for (int64_t g0 = 0; g0 < vecs; g0 += MAX_G) {
      const int G = (int)(vecs - g0 < MAX_G ? vecs - g0 : MAX_G);
      for (int64_t m0 = 0; m0 < M; m0 += MAX_R) {
        const int rows = (int)(M - m0 < MAX_R ? M - m0 : MAX_R);
        chunk(x + m0 * xs, xs, wb + g0 * W, K, B, G, rows, m0 == 0, acc);
        if (silu) chunk(x + m0 * xs, xs, wb + up_blocks * K * B + g0 * W, K, B, G, rows, m0 == 0, up);
        for (int r = 0; r < rows; r++)
          for (int g = 0; g < G; g++) {
            float *o = out + (m0 + r) * os + nb * B + (g0 + g) * W;
            const vf a = *(const vf *)(acc + (r * G + g) * W);
            if (silu)
              *(vf *)o = silu_v(a) * *(const vf *)(up + (r * G + g) * W);
            else
              *(vf *)o = a;
          }
      }
    }
  }
}

/* fp32_linear: a = [x, w (packed), out (addresses), M, N, K, x_s, o_s, num_threads, silu, B].
 * silu 0: out [M, N] = x W^T; 1: out [M, N / 2] = silu(gate) * up of the [gate | up] products
 * (N / 2 a multiple of B). Returns 0; -1 when B is not a multiple of the vector width up to 64, N
 * is not a multiple of B (2 B with silu), or M or K < 1 (nothing written). */
int fp32_linear(const int64_t *a) {
  const int64_t M = a[3], N = a[4], K = a[5], B = a[10];
  const int silu = a[9] != 0;
  if (M < 1 || K < 1 || B < W || B > 64 || B % W || N < B || N % (silu ? 2 * B : B)) return -1;
  const int64_t nblocks = N / (silu ? 2 * B : B);
  FOR_EACH_RUN(nblocks, a[8], u0, u1,
               fp32_blocks((const float *)a[0], (const float *)a[1], (float *)a[2], M, K, a[6], a[7], B, u0, u1,
                           silu, nblocks));
  return 0;
}
