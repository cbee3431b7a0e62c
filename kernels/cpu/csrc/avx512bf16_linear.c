/*
 * y = x W^T for the rows of x, bf16, on AVX-512 BF16's dot products (vdpbf16ps), reading the
 * weight in oneDNN's prepacked layout in place; optionally SwiGLU's silu(gate) * up of a
 * [gate | up] weight. The projection kernel of a CPU with AVX-512 BF16 and no AMX (AMD Zen 4/5,
 * Intel Cooper Lake), where oneDNN's matmul is what the AMX kernel (amx_linear.c) replaces on an
 * AMX CPU.
 *
 * Why: a decode step multiplies every weight by a few rows, so it is bound by how fast the weights
 * stream from memory. This kernel walks each block of the packed weight once, in the order it lies
 * in memory, with a prefetch PF_BYTES ahead, and multiplies it into every row of a chunk of up to
 * 4-8 rows held in registers; it is also what lets a decode step's layers run in one native call
 * (decode_layers.c) on such a CPU.
 *
 * Layout: x [M, K] bf16, rows x_s apart, K contiguous; out [M, N] bf16, rows o_s apart. W [N, K]
 * as oneDNN packs a bf16 linear weight: [N / B][K / 2][B][2], B outputs per block, each block all
 * of K in pairs (AB16b64a2b, B = 64, on the AVX-512 BF16 CPUs measured; AB16b32a2b, B = 32, on
 * AMX hosts; B = 16 also read). `kernels.cpu.packed_linear` checks the bytes before using it. One
 * pair row of a block is B / 16 vectors of 16 outputs x 2 inputs: the operand vdpbf16ps takes
 * beside a broadcast pair of x.
 *
 * Arithmetic: each output is an fp32 sum over the pairs of K in order (vdpbf16ps: both products of
 * a pair added to the sum), one rounding to bf16 (nearest even, vcvtneps2bf16) at the end. A row's
 * result never depends on the other rows of the call, nor on the thread count.
 */
#include <stdint.h>
#include <string.h>

#include "simd_cpu.h"
#include "team_cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && W == 16
#include <immintrin.h>

#define BF16_TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
#define PF_BYTES 1024 /* prefetch distance along a block of the packed weight */
#define MAX_J 4       /* vectors of 16 outputs in a block: B <= 64 */

/* acc[r][16 j + c] (fp32, rows 16 J floats apart) = rows [0, R) of x (at x, rows xs elements apart)
 * times J vectors of 16 outputs of a block (at wv; `stride` elements from one pair row of the block
 * to the next, `pairs` pair rows). R and J are constants at every call site, so the R x J sums stay
 * in registers. */
BF16_TARGET static inline __attribute__((always_inline)) void block_rows(const uint16_t *x, int64_t xs,
                                                                         const uint16_t *wv, int64_t pairs,
                                                                         int64_t stride, const int R, const int J,
                                                                         int prefetch, float *acc) {
  __m512 c[8][MAX_J];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) c[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p++) {
    const uint16_t *wp = wv + p * stride;
    if (prefetch)
#pragma GCC unroll 4
      for (int j = 0; j < J; j++) _mm_prefetch((const char *)(wp + 32 * j) + PF_BYTES, _MM_HINT_T0);
    __m512bh w[MAX_J];
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) w[j] = (__m512bh)_mm512_loadu_si512((const void *)(wp + 32 * j));
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      int32_t pair;
      memcpy(&pair, x + r * xs + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < J; j++) c[r][j] = _mm512_dpbf16_ps(c[r][j], xb, w[j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) _mm512_store_ps(acc + r * 16 * J + 16 * j, c[r][j]);
}

/* The most rows a chunk holds for J vectors of outputs: R x J sums in 16-24 of the 32 registers. */
static inline int chunk_rows(int J) { return J == 4 ? 4 : J == 3 ? 6 : 8; }

#define ROWS_CASE(R, J)                                                \
  case R:                                                              \
    block_rows(x, xs, wv, pairs, stride, R, J, prefetch, acc);         \
    return;
#define ROWS_4(J) ROWS_CASE(1, J) ROWS_CASE(2, J) ROWS_CASE(3, J) ROWS_CASE(4, J)

BF16_TARGET static void chunk(const uint16_t *x, int64_t xs, const uint16_t *wv, int64_t pairs, int64_t stride,
                              int J, int rows, int prefetch, float *acc) {
  switch (J) {
    case 4:
      switch (rows) { ROWS_4(4) }
      return;
    case 3:
      switch (rows) { ROWS_4(3) ROWS_CASE(5, 3) ROWS_CASE(6, 3) }
      return;
    case 2:
      switch (rows) { ROWS_4(2) ROWS_CASE(5, 2) ROWS_CASE(6, 2) ROWS_CASE(7, 2) ROWS_CASE(8, 2) }
      return;
    default:
      switch (rows) { ROWS_4(1) ROWS_CASE(5, 1) ROWS_CASE(6, 1) ROWS_CASE(7, 1) ROWS_CASE(8, 1) }
      return;
  }
}

/* 16 fp32 rounded to bf16 (nearest even, as the product's result rounds) and widened back, exactly. */
BF16_TARGET static inline vf bf16_rounded(const float *p) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p));
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}

/* Output vectors [u0, u1) (16 outputs each, numbered across the blocks) of every row of x:
 * out = x W^T (silu = 0), or, for a weight whose rows are [gate | up] (N = 2 I, out [M, I]),
 * out = silu(x W_gate^T) * (x W_up^T) (silu = 1; vectors of the gate half, each with the same
 * vector of block nb + up_blocks of the up half), gate and up rounded to bf16 first, then exactly
 * fused_cpu.c's silu_mul over them: the same bits as this product followed by that op. A thread's
 * share is a run of vectors, so the threads' shares differ by one vector at most. */
BF16_TARGET static void bf16_vectors(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t K,
                                     int64_t xs, int64_t os, int64_t B, int64_t u0, int64_t u1, int silu,
                                     int64_t up_blocks) {
  const int64_t J = B / 16, pairs = K / 2, block = K * B; /* vectors per block; elements of one block */
  float acc[8 * 64] __attribute__((aligned(64))); /* R x g x 16 floats: at most 6 x 3 x 16 */
  float up[8 * 64] __attribute__((aligned(64)));
  for (int64_t nb = u0 / J; nb * J < u1; nb++) {
    const int64_t j0 = u0 > nb * J ? u0 - nb * J : 0, j1 = u1 < (nb + 1) * J ? u1 - nb * J : J;
    const int g = (int)(j1 - j0), R = chunk_rows(g);
    const uint16_t *wv = w + nb * block + 32 * j0;
    for (int64_t m0 = 0; m0 < M; m0 += R) {
      const int rows = (int)(M - m0 < R ? M - m0 : R);
      const uint16_t *xa = x + m0 * xs;
      uint16_t *o = out + m0 * os + nb * B + 16 * j0;
      chunk(xa, xs, wv, pairs, 32 * J, g, rows, m0 == 0, acc);
      if (!silu) {
        for (int r = 0; r < rows; r++)
          for (int j = 0; j < g; j++)
            _mm256_storeu_si256((__m256i *)(o + r * os + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + (r * g + j) * 16)));
        continue;
      }
      chunk(xa, xs, wv + up_blocks * block, pairs, 32 * J, g, rows, m0 == 0, up);
      for (int r = 0; r < rows; r++)
        for (int j = 0; j < g; j++)
          store_v(o + r * os, 16 * j,
                  silu_v(bf16_rounded(acc + (r * g + j) * 16)) * bf16_rounded(up + (r * g + j) * 16), 1);
    }
  }
}

/* avx512bf16_linear: a = [x, w (packed), out (addresses), M, N, K, x_s, o_s, num_threads, silu, B].
 * silu 0: out [M, N] = x W^T; 1: out [M, N / 2] = silu(gate) * up of the [gate | up] products
 * (N / 2 a multiple of B). Returns 0; -1 when B is not 16, 32 or 64, N is not a multiple of B
 * (2 B with silu), K is odd, or M < 1 (nothing written). */
int avx512bf16_linear(const int64_t *a) {
  const int64_t M = a[3], N = a[4], K = a[5], B = a[10];
  const int silu = a[9] != 0;
  if (M < 1 || (B != 16 && B != 32 && B != 64) || N < B || N % (silu ? 2 * B : B) || K < 2 || K % 2) return -1;
  const int64_t nblocks = N / (silu ? 2 * B : B);
  FOR_EACH_RUN(nblocks * (B / 16), a[8], u0, u1,
               bf16_vectors((const uint16_t *)a[0], (const uint16_t *)a[1], (uint16_t *)a[2], M, K, a[6], a[7], B,
                            u0, u1, silu, nblocks));
  return 0;
}

#else /* no AVX-512 in this build */
int avx512bf16_linear(const int64_t *a) {
  (void)a;
  return -1;
}
#endif
