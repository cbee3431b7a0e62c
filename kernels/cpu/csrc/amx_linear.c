/*
 * y = x W^T for the rows of x, bf16, on Intel AMX tiles, reading the weight in oneDNN's
 * prepacked layout in place; optionally SwiGLU's silu(gate) * up of a [gate | up] weight.
 *
 * Why: a decode step's projections read every weight once and multiply it by a few rows, so they
 * are bound by how fast the weights stream in from memory. oneDNN's AMX matmul (brgemm) loads each
 * weight tile from memory right before it uses it; on a small batch the tile loads wait on memory
 * and the multiplies wait on the loads (measured on a 2-core Sapphire-Rapids-class VM: ~8 GB/s at
 * 32 rows, against ~14 GB/s a plain stream reaches). This kernel walks the same packed weight in
 * the order it lies in memory and prefetches PF_BYTES ahead of its tile loads, so the loads hit
 * cache (~15-20 GB/s at 1-32 rows). On a prefill step (hundreds of rows, compute-bound) it is as
 * fast as oneDNN on the model's square and down projections' shapes or faster (K = 576, 1536;
 * docs/benchmarks.md), and with the SwiGLU epilogue the [M, 2I] gate/up result is never written
 * out and read back by a separate pass.
 *
 * Layout: x [M, K] bf16, rows x_s apart, K contiguous; out [M, N] bf16, rows o_s apart. The
 * weight W [N, K] is in oneDNN's AB16b32a2b blocking, the layout torch.ops.mkldnn's
 * `_reorder_linear_weight` gives a bf16 linear weight on AMX hosts (`kernels.cpu.amx` checks the
 * bytes before using it): blocks of 32 outputs x 32 inputs, output block-major, each block
 * [16 input pairs][32 outputs][2] -- two AMX B tiles side by side (outputs 0-15 and 16-31,
 * 64 bytes each, rows 128 bytes apart). N and K must be multiples of 32.
 *
 * Arithmetic: bf16 products summed in fp32 inside the tiles, K in order of 32-wide blocks, one
 * rounding to bf16 (nearest even) at the end; up to 32 rows this is bit-identical to oneDNN's
 * result on the same packed weight (asserted in tests/kernels/test_amx_linear.py), and a row's result
 * never depends on the other rows of the call.
 *
 * Tiles: C00 C01 C10 C11 (rows 0-15 / 16-31 of a 32-row chunk x outputs 0-15 / 16-31 of a
 * block), A0 A1 (the two row halves), B0 B1 (the two output halves). Output blocks are split
 * evenly over an OpenMP team; each thread configures its tiles and releases them when done.
 * Requires Linux's permission for the AMX state (arch_prctl ARCH_REQ_XCOMP_PERM, `amx_request`).
 */
#include <stdint.h>
#include <string.h>

#include "simd_cpu.h"
#include "team_cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && W == 16
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PF_BYTES 4096 /* prefetch distance along the packed weight: two 32x32 blocks */
#define BLOCK_BYTES 2048 /* one 32 x 32 bf16 block of the packed weight */

typedef struct {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* Ask Linux for the AMX tile state of this process. Returns 0 when granted. */
int amx_request(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512bw")))

AMX_TARGET static void configure(int r0, int r1) {
  tile_config c;
  memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int t = 0; t < 8; t++) c.colsb[t] = 64;
  c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)r0;              /* C00 C01 A0 */
  c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)(r1 ? r1 : 1);   /* C10 C11 A1 (unused when r1 = 0) */
  c.rows[6] = c.rows[7] = 16;                                   /* B0 B1 */
  _tile_loadconfig(&c);
}

/* acc [32][32] fp32 = rows [0, r0 + r1) of x (at xa, rows xs elements apart) times the packed
 * block column wb of the weight (outputs of one 32-wide block, all K): C00 C01 for rows 0-15, C10
 * C11 for rows 16-31 (r1 = 0: none). With `prefetch`, asks for the weight PF_BYTES ahead of its
 * tile loads (the first row chunk of a block; later chunks find it in cache). */
AMX_TARGET static inline void block_product(const char *xa, const char *wb, int64_t kblocks, int64_t xs,
                                            int r1, int prefetch, float *acc) {
  _tile_zero(0);
  _tile_zero(1);
  if (r1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < kblocks; kb++) {
    const char *blk = wb + kb * BLOCK_BYTES;
    if (prefetch)
      for (int l = 0; l < BLOCK_BYTES; l += 64) _mm_prefetch(blk + PF_BYTES + l, _MM_HINT_T0);
    _tile_loadd(6, blk, 128);
    _tile_loadd(7, blk + 64, 128);
    _tile_loadd(4, xa + kb * 64, xs * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (r1) {
      _tile_loadd(5, xa + 16 * xs * 2 + kb * 64, xs * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16, 128);
  if (r1) {
    _tile_stored(2, acc + 16 * 32, 128);
    _tile_stored(3, acc + 16 * 32 + 16, 128);
  }
}

/* 16 fp32 rounded to bf16 (nearest even, as oneDNN rounds its result) and widened back, exactly. */
AMX_TARGET static inline vf bf16_rounded(const float *p) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p));
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}

/* Output blocks [nb0, nb1) of every row of x: out = x W^T (silu = 0), or, for a weight whose
 * rows are [gate | up] (N = 2 I, out [M, I]), out = silu(x W_gate^T) * (x W_up^T) (silu = 1;
 * blocks of the gate half, each with block nb + I/32 of the up half). The fused epilogue rounds
 * gate and up to bf16 first, then computes exactly as fused_cpu.c's silu_mul over them: the
 * same bits as this product followed by that op. */
AMX_TARGET static void amx_blocks(const uint16_t *x, const char *w, uint16_t *out, int64_t M, int64_t K,
                                  int64_t xs, int64_t os, int64_t nb0, int64_t nb1, int silu, int64_t up_blocks) {
  const int64_t kblocks = K / 32;
  float acc[32 * 32] __attribute__((aligned(64)));
  float up[32 * 32] __attribute__((aligned(64)));
  int cur0 = -1, cur1 = -1;
  for (int64_t nb = nb0; nb < nb1; nb++) {
    const char *wb = w + nb * kblocks * BLOCK_BYTES;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int64_t left = M - m0;
      const int r0 = (int)(left < 16 ? left : 16);
      const int r1 = (int)(left <= 16 ? 0 : (left - 16 < 16 ? left - 16 : 16));
      if (r0 != cur0 || r1 != cur1) {
        configure(r0, r1);
        cur0 = r0, cur1 = r1;
      }
      const char *xa = (const char *)(x + m0 * xs);
      block_product(xa, wb, kblocks, xs, r1, m0 == 0, acc);
      if (!silu) {
        for (int m = 0; m < r0 + r1; m++) { /* fp32 -> bf16, nearest even */
          const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(acc + m * 32 + 16), _mm512_load_ps(acc + m * 32));
          _mm512_storeu_si512((void *)(out + (m0 + m) * os + nb * 32), (__m512i)v);
        }
        continue;
      }
      block_product(xa, wb + up_blocks * kblocks * BLOCK_BYTES, kblocks, xs, r1, m0 == 0, up);
      for (int m = 0; m < r0 + r1; m++)
        for (int c = 0; c < 32; c += 16)
          store_v(out + (m0 + m) * os + nb * 32, c,
                  silu_v(bf16_rounded(acc + m * 32 + c)) * bf16_rounded(up + m * 32 + c), 1);
    }
  }
  _tile_release();
}

/* amx_linear_bf16: a = [x, w (packed), out (addresses), M, N, K, x_s, o_s, num_threads, silu].
 * silu 0: out [M, N] = x W^T; 1: out [M, N / 2] = silu(gate) * up of the [gate | up] products
 * (N / 2 a multiple of 32). Returns 0; -1 when N or K is not a multiple of 32 (64 with silu) or
 * M < 1 (nothing written). */
int amx_linear_bf16(const int64_t *a) {
  const int64_t M = a[3], N = a[4], K = a[5];
  const int silu = a[9] != 0;
  if (M < 1 || N % (silu ? 64 : 32) || K % 32 || N < 32 || K < 32) return -1;
  const int64_t nblocks = N / (silu ? 64 : 32);
  FOR_EACH_RUN(nblocks, a[8], u0, u1,
               amx_blocks((const uint16_t *)a[0], (const char *)a[1], (uint16_t *)a[2], M, K, a[6], a[7], u0, u1,
                          silu, nblocks));
  return 0;
}

#else /* not x86-64: no AMX */
int amx_request(void) { return -1; }
int amx_linear_bf16(const int64_t *a) {
  (void)a;
  return -1;
}
#endif
