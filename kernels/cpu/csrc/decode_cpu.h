/*
 * What the decode attention files share (paged_cpu.c the entry, decode_fast_cpu.c the fast path,
 * decode_generic_cpu.c the generic one): the work item's job, the cache element kinds, row loads
 * and stores in the order the fast path keeps head_dim in, the online softmax of one chunk, and
 * the per-kind kernels' tables. Layouts and arithmetic: paged_cpu.c.
 */
#ifndef PAGEDKV_DECODE_CPU_H
#define PAGEDKV_DECODE_CPU_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_cpu.h"
#include "simd_cpu.h"

/* Symbols shared between the library's files, not exported from it. */
#define HIDDEN __attribute__((visibility("hidden")))

#ifdef __AVX512F__
#define MAX_ACC 16 /* accumulator vectors of one work item (of 32 registers) */
#else
#define MAX_ACC 8 /* (of 16 registers) */
#endif
#define CHUNK_TOKENS 256 /* positions per softmax chunk (rounded to whole blocks) */

/* Asks for the cache lines of [p, p + bytes) ahead of their use (a hint: never faults), into L2
 * (prefetcht1): measured faster than into L1 once the context outgrows L2, no slower before. */
ALWAYS_INLINE void prefetch_row(const char *p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 2);
}

typedef struct {
  const void *q, *k, *v;
  void *out;
  const int32_t *tables, *lens;
  const int64_t *seq_index, *q_index;
  int64_t n, hq, hk, d, bs, table_stride, q_stride, out_stride, num_blocks;
  int64_t k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;
  int64_t hc;         /* query heads per pass (a GQA group is covered in passes of hc heads) */
  int64_t chunk_w;    /* score slots per query head in scratch: a chunk's positions, rounded to W */
  float scale;
  int qbf16;          /* query and out: 0 fp32, 1 bf16 */
  int kv;             /* caches: KV_F32, KV_BF16 (the query's dtype) or KV_FP8 */
  const float *k_scale, *v_scale; /* [hk] fp8 scales (KV_FP8 only) */
} job_t;

/* Cache element kinds. */
#define KV_F32 0
#define KV_BF16 1
#define KV_FP8 2

/* Softmax of one chunk for one query head: p[0, cnt) scores in (their max cmax, NaN left out),
 * probabilities e^(s - m) out (p[cnt, round_up(cnt, W)) padded with 0). Updates the running max
 * *m and sum *l; returns the factor alpha by which the head's running output must be rescaled. */
static __attribute__((noinline, unused)) float chunk_softmax(float *p, int64_t cnt, float cmax,
                                                             float *m, float *l) {
  const int64_t cnt_w = (cnt + W - 1) / W * W;
  for (int64_t o = cnt; o < cnt_w; o++) p[o] = -INFINITY; /* exp_v gives 0 there */
  const float mb = cmax > *m ? cmax : *m;
  /* Scores of -inf so far (fp32 overflow): subtract 0 instead, so they weigh 0, not NaN. */
  const float msub = mb == -INFINITY ? 0.0f : mb;
  const float alpha = *m == -INFINITY ? 0.0f : expf(*m - msub);
  const vf mv = splat(msub);
  vf sum = splat(0.0f);
  for (int64_t o = 0; o < cnt_w; o += W) {
    const vf e = exp_v(*(vf *)(p + o) - mv);
    *(vf *)(p + o) = e;
    sum += e;
  }
  *l = *l * alpha + hsum(sum);
  *m = mb;
  return alpha;
}

/* Vector i of head_dim of a row. bf16 rows with an even number of vectors are read W pairs at a
 * time and split into their even and odd elements (a shift and a mask, exact), so vector 2p holds
 * elements 2p*W + 2l and vector 2p+1 elements 2p*W + 2l + 1: dot products do not depend on the
 * order, and the output is interleaved back when stored (store_h). */
ALWAYS_INLINE vf load_h(const char *p, int i, const int NV, const int BF16) {
  if (!BF16) return *(const vf *)((const float *)p + i * W);
  if (NV & 1) return load_v(p, i * W, 1);
  const vu u = *(const vu *)((const uint16_t *)p + (i >> 1) * 2 * W);
  return (i & 1) ? (vf)(u & 0xffff0000u) : (vf)(u << 16);
}

/* Vector i of head_dim of a cache row of kind KV (fp8 times FP8_DECODED_UNIT): load_h's order,
 * natural order for fp8. */
ALWAYS_INLINE vf load_kv(const char *p, int i, const int NV, const int KV) {
  if (KV == KV_FP8) return fp8_v(p + i * W);
  return load_h(p, i, NV, KV == KV_BF16);
}

/* Vector i of a query row (bf16 if QB) in load_kv's order for a cache of kind KV. */
ALWAYS_INLINE vf load_q(const char *p, int i, const int NV, const int QB, const int KV) {
  if (KV == KV_FP8) return load_v(p, i * W, QB);
  return load_h(p, i, NV, QB);
}

/* Elements of a vector, scalar and generic paths: the cache's (fp8 times FP8_DECODED_UNIT). */
ALWAYS_INLINE vf load_kv_v(const void *p, int64_t i, const int KV) {
  if (KV == KV_FP8) return fp8_v((const char *)p + i);
  return load_v(p, i, KV == KV_BF16);
}
ALWAYS_INLINE float load_kv_s(const void *p, int64_t i, const int KV) {
  if (KV == KV_FP8) return fp8_s(p, i);
  return load_s(p, i, KV == KV_BF16);
}

/* Bytes of a cache element of kind KV. */
#define KV_SIZE(KV) ((KV) == KV_F32 ? 4 : (KV) == KV_BF16 ? 2 : 1)

/* Multipliers of one KV head: of the query (its scores) and of the output. 1 unless fp8. */
ALWAYS_INLINE float kv_mul(const float *scales, int64_t h, const int KV) {
  return KV == KV_FP8 ? scales[h] / FP8_DECODED_UNIT : 1.0f;
}

/* bf16 bit patterns (low 16 bits of each lane) of x, round to nearest even, NaN kept. */
ALWAYS_INLINE vu bf16_bits(vf x) {
  const vu u = (vu)x;
  const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vi nan = (vi)((u & 0x7fffffffu) > 0x7f800000u);
  return (vu)(((vi)((u >> 16) | 0x40u) & nan) | ((vi)r & ~nan));
}

/* Stores head_dim vectors a[0, NV) of one head in load_h's order. */
ALWAYS_INLINE void store_h(char *p, const vf *a, const int NV, const int BF16) {
  if (!BF16 || (NV & 1)) {
    #pragma GCC unroll 8
    for (int i = 0; i < NV; i++) store_v(p, i * W, a[i], BF16);
    return;
  }
  #pragma GCC unroll 4
  for (int i = 0; i < NV; i += 2)
    *(vu *)((uint16_t *)p + i * W) = bf16_bits(a[i]) | (bf16_bits(a[i + 1]) << 16);
}

typedef void (*fast_fn)(const job_t *, int64_t, int64_t, int64_t, float *);

/* Kinds of a call (query and out, caches): 0 fp32/fp32, 1 bf16/bf16, 2 fp32/fp8, 3 bf16/fp8. */
#define KIND_QB(K) ((K) & 1)
#define KIND_KV(K) ((K) < 2 ? (K) : KV_FP8)
#define NUM_KINDS 4
typedef void (*generic_fn)(const job_t *, int64_t, int64_t, int64_t, int64_t, float *, float *);

/* Fast path kernels (decode_fast_cpu.c): paged_fast_table[kind][log2 NV][HC], one function per
 * (kind, head_dim vectors NV, query heads per pass HC) instantiated, NULL for the others. */
HIDDEN extern const fast_fn paged_fast_table[NUM_KINDS][4][9];
/* Generic path kernels (decode_generic_cpu.c), one per kind: any head_dim, hc <= 8 heads a pass. */
HIDDEN extern const generic_fn paged_generic_table[NUM_KINDS];

#endif
