/*
 * Paged decode attention on CPU (the KV cache write: cache_write_cpu.c), fp32 or bf16 (and fp8 e4m3 caches read by
 * fp32 or bf16 queries): one new query token per sequence attends over its sequence's keys and
 * values, read in place through its block table (PagedAttention, Kwon et al., SOSP 2023, §4.1).
 * Nothing is gathered: each (sequence, KV head) reads its blocks once for the scores and once for
 * the weighted sum of values, with the query heads of its GQA group at the same time, which is
 * what makes it cheaper than gathering the context into a dense buffer and running a dense
 * attention on that copy.
 *
 * Layout (strides in elements, head_dim contiguous; query and out have one dtype, the caches
 * that dtype too or fp8):
 *   query, out     [rows, num_q_heads, head_dim], row strides q_stride and out_stride
 *   key, value     [num_blocks, block_size, num_kv_heads, head_dim], strides (s0, s1, s2, 1)
 *   k_scale, v_scale  [num_kv_heads] fp32, fp8 caches only: a cache byte x stands for x * scale
 *   block_tables   [num_seqs, table_stride] int32
 *   seq_lens       [num_seqs] int32, tokens in cache including the new one
 *   seq_index      [n] int64 sequence of each work row; q_index [n] int64 its query row
 * Arithmetic is fp32 (bf16 -> fp32 is exact: a 16-bit shift; fp32 -> bf16 rounds to nearest
 * even, NaN stays NaN; e4m3 -> fp32 is exact too, see fp8_v, and an fp8 KV head's scales multiply
 * its scaled queries and its output, not each element: vLLM's fp8 KV cache read as fp8 * scale).
 * The softmax is online (flash-decoding, Dao et al. 2023) over chunks of CHUNK_TOKENS positions:
 * a chunk's scores for all its positions, its max and sum, a rescale of the running output, then
 * the chunk's values. Query heads and their output accumulators stay in
 * vector registers for the whole context when head_dim is 1, 2, 4 or 8 vectors wide (the fast
 * path, specialized per (dtypes, vectors, heads)); other head dims take a generic loop.
 * Work items (row, KV head) are handed out dynamically to the threads of an OpenMP team, which
 * only small batches skip (a fork costs more than their work); loaded into a process that already
 * runs torch, the team comes from torch's own OpenMP runtime.
 *
 * Built by kernels/cpu/native.py with the host's C compiler, into one library with:
 *   decode_fast_cpu.c     the fast path (tile scoring, the registers-resident kernel per kind);
 *   decode_generic_cpu.c  the generic path (any head_dim);
 *   cache_write_cpu.c     reshape_and_cache, the KV cache write;
 *   decode_cpu.h          what the three decode files share (job, kinds, loads, chunk softmax);
 *   fp8_cpu.h             float8_e4m3fn widening;
 * and fused_cpu.c's elementwise ops. This file is the entry: the dtype kind, the heads per pass,
 * the row checks and the OpenMP team. Vectors use GCC/Clang vector extensions: 16 floats wide
 * where the build has AVX-512 (-mavx512f), else 8 (AVX2, or split by the compiler into what the
 * target has); the helpers are shared with fused_cpu.c (simd_cpu.h).
 */
#include <stdint.h>
#include <stdlib.h>

#include "decode_cpu.h"

/* Below this many (position x query head) a call runs on one thread: measured on 2 cores, a
 * second thread already pays off at 1 sequence x 64 positions x 9 query heads (and at 32 breaks
 * even), torch's OpenMP team being warm between the model's ops. */
#define SERIAL_WORK 256
/* Rows per thread from which a work item is a whole row (all KV heads), not one KV head of it. */
#define ROWS_PER_THREAD 4

/* Checks a row's table: 0; 2 when it names a block outside the cache, 3 when the sequence is
 * longer than its table row (nothing is read then). */
static int check_row(const job_t *j, int64_t row) {
  const int64_t s = j->seq_index[row], len = j->lens[s];
  const int32_t *table = j->tables + s * j->table_stride;
  const int64_t nb = (len + j->bs - 1) / j->bs;
  if (nb > j->table_stride) return 3;
  for (int64_t b = 0; b < nb; b++)
    if (table[b] < 0 || table[b] >= j->num_blocks) return 2;
  return 0;
}

/* The fast kernel of a kind for head_dim d and hc heads per pass, or NULL. */
static fast_fn pick_fast(int64_t d, int64_t hc, int kind) {
  const int64_t nv = d / W;
  if (d % W || hc < 1 || hc > 8 || hc * nv > MAX_ACC) return NULL;
  const int lg = nv == 1 ? 0 : nv == 2 ? 1 : nv == 4 ? 2 : nv == 8 ? 3 : -1;
  return lg < 0 ? NULL : paged_fast_table[kind][lg][hc];
}

/* One work item: the query heads of KV heads [h0, h0 + heads) of row `row`, in passes of at most
 * j->hc heads, each by the fast kernel for its pass's size where there is one (`fast` for a full
 * pass), else the generic one. scratch and acc: the thread's buffers (paged_decode's sizes). */
static void attend_item(const job_t *j, int kind, fast_fn fast, int64_t row, int64_t h0,
                        int64_t heads, float *scratch, float *acc) {
  const int64_t group = j->hq / j->hk, hc = j->hc;
  for (int64_t h = h0; h < h0 + heads; h++)
    for (int64_t x0 = h * group; x0 < (h + 1) * group; x0 += hc) {
      const int64_t c = (h + 1) * group - x0 < hc ? (h + 1) * group - x0 : hc;
      const fast_fn f = c == hc ? fast : pick_fast(j->d, c, kind);
      if (f)
        f(j, row, h, x0, scratch);
      else
        paged_generic_table[kind](j, row, h, x0, c, scratch, acc);
    }
}

/* Hands the `items` work items (a row's heads_per_item KV heads each) out dynamically to a team
 * of num_threads (torch's OpenMP team when loaded into torch); 0, or 1 when a thread could not
 * allocate its scratch (then nothing was written by that thread). */
static int run_items(const job_t *j, int kind, fast_fn fast, int64_t items, int64_t heads_per_item,
                     int num_threads) {
  const int64_t hc = j->hc, chunk_w = j->chunk_w, d = j->d, hk = j->hk;
  int64_t next = 0;
  int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    const size_t floats = (size_t)((hc * chunk_w + 2 * hc * d + 15) / 16 * 16); /* 64-byte multiple */
    float *scratch = (float *)aligned_alloc(64, sizeof(float) * floats);
    if (scratch == NULL) {
      __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
    } else {
      float *acc = scratch + hc * chunk_w;
      for (;;) {
        const int64_t item = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
        if (item >= items) break;
        const int64_t row = item * heads_per_item / hk, h0 = item * heads_per_item % hk;
        attend_item(j, kind, fast, row, h0, heads_per_item, scratch, acc);
      }
      free(scratch);
    }
  }
  return failed;
}


/* paged_decode: attention of rows (seq_index, q_index) over the paged cache into out.
 * qbf16: 0 for an fp32 query and out, 1 for bf16 (uint16 bit patterns). kv: the caches, KV_F32
 * or KV_BF16 (the query's dtype; then k_scale and v_scale are unused) or KV_FP8 (float8_e4m3fn
 * bytes, read as byte * k_scale[h] / v_scale[h] of their KV head h).
 * Returns 0; 1 when a thread could not allocate its scratch; 2 when a block table names a
 * block outside [0, num_blocks); 3 when a seq_len needs more blocks than a table row holds; 4 for
 * a combination of dtypes without a kernel. On an error nothing is written. */
int paged_decode(const void *q, const void *k, const void *v, void *out, const int32_t *tables,
                 const int32_t *lens, const int64_t *seq_index, const int64_t *q_index, int64_t n,
                 int64_t hq, int64_t hk, int64_t d, int64_t bs, int64_t table_stride,
                 int64_t q_stride, int64_t out_stride, int64_t num_blocks, int64_t k_s0,
                 int64_t k_s1, int64_t k_s2, int64_t v_s0, int64_t v_s1, int64_t v_s2, float scale,
                 int num_threads, int qbf16, int kv, const float *k_scale, const float *v_scale) {
  int kind;
  if (kv == KV_FP8 && k_scale != NULL && v_scale != NULL)
    kind = qbf16 ? 3 : 2;
  else if ((kv == KV_F32 && !qbf16) || (kv == KV_BF16 && qbf16))
    kind = kv;
  else
    return 4;
  if (n <= 0 || hk <= 0) return 0;
  const int64_t group = hq / hk;
  /* Heads per pass: the group in as few passes as the registers allow, balanced. */
  const int64_t nv = d / W;
  int64_t max_hc = nv >= 1 && d % W == 0 ? MAX_ACC / nv : 8;
  if (max_hc > 8) max_hc = 8;
  if (max_hc < 1) max_hc = 1;
  const int64_t passes = (group + max_hc - 1) / max_hc, hc = (group + passes - 1) / passes;
  const int64_t chunk_blocks = bs >= CHUNK_TOKENS ? 1 : CHUNK_TOKENS / bs;
  const int64_t chunk_w = (chunk_blocks * bs + W - 1) / W * W;
  const job_t job = {q, k, v, out, tables, lens, seq_index, q_index, n, hq, hk, d, bs,
                     table_stride, q_stride, out_stride, num_blocks, k_s0, k_s1, k_s2, v_s0, v_s1,
                     v_s2, hc, chunk_w, scale, qbf16, kv, k_scale, v_scale};
  const fast_fn fast = pick_fast(d, hc, kind);
  int64_t work = 0;
  for (int64_t r = 0; r < n; r++) {
    const int rc = check_row(&job, r);
    if (rc) return rc;
    work += lens[seq_index[r]];
  }
  /* Work items: (row, KV head) pairs; with enough rows to keep every thread busy, whole rows
   * (every KV head of a row on one thread: the row's blocks stream through one core's cache once,
   * not partly through each core's). */
  if (num_threads < 1 || work * hq < SERIAL_WORK) num_threads = 1;
  const int64_t heads_per_item = n >= ROWS_PER_THREAD * num_threads ? hk : 1;
  const int64_t items = n * hk / heads_per_item;
  if (num_threads > items) num_threads = (int)items;
  return run_items(&job, kind, fast, items, heads_per_item, num_threads);
}

/* paged_decode with its integer arguments packed (the ctypes caller converts one pointer, not
 * 28 arguments): a = [q, k, v, out, tables, lens, seq_index, q_index (addresses), n, hq, hk, d,
 * bs, table_stride, q_stride, out_stride, num_blocks, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
 * num_threads, qbf16, kv, k_scale, v_scale (addresses, 0 unless fp8)]. */
int paged_decode_packed(const int64_t *a, float scale) {
  return paged_decode((const void *)a[0], (const void *)a[1], (const void *)a[2], (void *)a[3],
                      (const int32_t *)a[4], (const int32_t *)a[5], (const int64_t *)a[6],
                      (const int64_t *)a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15],
                      a[16], a[17], a[18], a[19], a[20], a[21], a[22], scale, (int)a[23],
                      (int)a[24], (int)a[25], (const float *)a[26], (const float *)a[27]);
}
