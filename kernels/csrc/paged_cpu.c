/*
 * Paged decode attention on CPU, fp32: one new query token per sequence attends over its
 * sequence's keys and values, read in place through its block table (PagedAttention, Kwon et
 * al., SOSP 2023, §4.1). Nothing is gathered: each (sequence, KV head) reads its blocks once
 * for the scores and once for the weighted sum of values, with every query head of its GQA
 * group at the same time, which is what makes it cheaper than gathering the context into a
 * dense buffer and running a dense attention on that copy.
 *
 * Layout (strides in elements, head_dim contiguous):
 *   query, out     [rows, num_q_heads, head_dim], row strides q_stride and out_stride
 *   key, value     [num_blocks, block_size, num_kv_heads, head_dim], strides (s0, s1, s2, 1)
 *   block_tables   [num_seqs, table_stride] int32
 *   seq_lens       [num_seqs] int32, tokens in cache including the new one
 *   seq_index      [n] int64 sequence of each work row; q_index [n] int64 its query row
 * Softmax is online (running max and sum per query head, rescaled block by block), in fp32.
 * Work items (row, KV head) are handed out dynamically to the threads of an OpenMP team; loaded
 * into a process that already runs torch, the team comes from torch's own OpenMP runtime.
 *
 * Built by kernels/cpu_native.py with the host's C compiler. Vectors use GCC/Clang vector
 * extensions, so the same source builds with or without AVX2 (the compiler splits the vectors).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W 8
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4), may_alias));

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

static inline v8f select8(v8i mask, v8f a, v8f b) {  /* mask ? a : b, lane-wise */
  return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* e^x for x <= 0 (Cephes expf: e^x = 2^n e^r, |r| <= ln2 / 2; error <= 2 ulp); 0 below -87.3. */
static inline v8f exp8(v8f x) {
  const v8f lo = splat(-87.33654f);
  v8i under = x < lo;
  x = select8(under, lo, x);
  v8f fx = x * 1.44269504088896341f + 0.5f;
  v8i n = __builtin_convertvector(fx, v8i);             /* truncates toward zero */
  n += (v8i)(__builtin_convertvector(n, v8f) > fx);     /* -1 where that rounded up: floor */
  v8f nf = __builtin_convertvector(n, v8f);
  v8f r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v8f y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  y = y * (v8f)((n + 127) << 23);
  return select8(under, splat(0.0f), y);
}

static inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline float dot(const float *a, const float *b, int64_t d) {
  v8f acc = splat(0.0f);
  int64_t i = 0;
  for (; i + W <= d; i += W) acc += *(const v8f *)(a + i) * *(const v8f *)(b + i);
  float s = hsum(acc);
  for (; i < d; i++) s += a[i] * b[i];
  return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t d) {
  v8f av = splat(a);
  int64_t i = 0;
  for (; i + W <= d; i += W) *(v8f *)(y + i) += av * *(const v8f *)(x + i);
  for (; i < d; i++) y[i] += a * x[i];
}

typedef struct {
  const float *q, *k, *v;
  float *out;
  const int32_t *tables, *lens;
  const int64_t *seq_index, *q_index;
  int64_t n, hq, hk, d, bs, table_stride, q_stride, out_stride, num_blocks;
  int64_t k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;
  int64_t heads_per_item;  /* KV heads of one work item: all of them, or 1 for small batches */
  float scale;
} job_t;

/* One work item: a row's KV heads [h0, h0 + heads_per_item) with their query-head groups, over
 * the sequence's context, block by block in one pass (flash-decoding's online softmax: a block's
 * scores raise the running max, the accumulator is rescaled, then the block's values are added).
 * A block's keys and values for one layer sit next to each other in the block-major pool, so the
 * pass streams each block's bytes front to back.
 * scratch: [heads * round_up(block_size, W)] scores, then probabilities; m, l: [heads] (query heads).
 * Returns 0; 2 when the block table names a block outside the cache, 3 when the sequence is
 * longer than its table row (nothing is read then). block_tables rows are table_stride wide. */
static int attend(const job_t *j, int64_t item, float *scratch, float *m, float *l) {
  const int64_t items_per_row = j->hk / j->heads_per_item;
  const int64_t row = item / items_per_row, h0 = item % items_per_row * j->heads_per_item;
  const int64_t group = j->hq / j->hk, heads = j->heads_per_item * group, d = j->d, bs = j->bs;
  const int64_t s = j->seq_index[row], len = j->lens[s];
  const int32_t *table = j->tables + s * j->table_stride;
  const float *q = j->q + j->q_index[row] * j->q_stride + h0 * group * d;  /* [heads, d] */
  float *out = j->out + j->q_index[row] * j->out_stride + h0 * group * d;  /* [heads, d] */
  const int64_t num_table_blocks = (len + bs - 1) / bs;
  const int64_t bs_w = (bs + W - 1) / W * W;
  if (num_table_blocks > j->table_stride) return 3;
  for (int64_t b = 0; b < num_table_blocks; b++)
    if (table[b] < 0 || table[b] >= j->num_blocks) return 2;

  for (int64_t x = 0; x < heads; x++) {
    m[x] = -INFINITY;
    l[x] = 0.0f;
    memset(out + x * d, 0, (size_t)d * sizeof(float));
  }
  for (int64_t b = 0, p0 = 0; b < num_table_blocks; b++, p0 += bs) {
    const float *kb = j->k + (int64_t)table[b] * j->k_s0 + h0 * j->k_s2;
    const float *vb = j->v + (int64_t)table[b] * j->v_s0 + h0 * j->v_s2;
    if (b + 1 < num_table_blocks) {
      __builtin_prefetch(j->k + (int64_t)table[b + 1] * j->k_s0);
      __builtin_prefetch(j->v + (int64_t)table[b + 1] * j->v_s0);
    }
    const int64_t end = len - p0 < bs ? len - p0 : bs;
    for (int64_t o = 0; o < end; o++)
      for (int64_t x = 0; x < heads; x++)  /* query head x reads KV head h0 + x / group */
        scratch[x * bs_w + o] = dot(q + x * d, kb + o * j->k_s1 + (x / group) * j->k_s2, d) * j->scale;
    for (int64_t x = 0; x < heads; x++) {
      float *p = scratch + x * bs_w;
      for (int64_t o = end; o < bs_w; o++) p[o] = -INFINITY;  /* exp8 gives 0 there */
      float mb = m[x];
      for (int64_t o = 0; o < end; o++) mb = p[o] > mb ? p[o] : mb;
      /* Scores of -inf so far (fp32 overflow): subtract 0 instead, so they weigh 0, not NaN. */
      const float msub = mb == -INFINITY ? 0.0f : mb;
      const float alpha = m[x] == -INFINITY ? 0.0f : expf(m[x] - msub);
      const v8f mv = splat(msub);
      v8f sum = splat(0.0f);
      for (int64_t o = 0; o < bs_w; o += W) {
        const v8f e = exp8(*(v8f *)(p + o) - mv);
        *(v8f *)(p + o) = e;
        sum += e;
      }
      l[x] = l[x] * alpha + hsum(sum);
      m[x] = mb;
      if (alpha != 1.0f)
        for (int64_t i = 0; i < d; i++) out[x * d + i] *= alpha;
    }
    for (int64_t o = 0; o < end; o++)
      for (int64_t x = 0; x < heads; x++)
        axpy(out + x * d, scratch[x * bs_w + o], vb + o * j->v_s1 + (x / group) * j->v_s2, d);
  }
  for (int64_t x = 0; x < heads; x++) {
    const float inv = l[x] > 0.0f ? 1.0f / l[x] : 0.0f;  /* every score -inf: 0, as the torch path */
    for (int64_t i = 0; i < d; i++) out[x * d + i] *= inv;
  }
  return 0;
}

/* Returns 0; 1 when a thread could not allocate its scratch; 2 when a block table names a
 * block outside [0, num_blocks); 3 when a seq_len needs more blocks than a table row holds. On an
 * error some rows of out are left unwritten. */
int paged_decode_f32(const float *q, const float *k, const float *v, float *out,
                     const int32_t *tables, const int32_t *lens, const int64_t *seq_index,
                     const int64_t *q_index, int64_t n, int64_t hq, int64_t hk, int64_t d,
                     int64_t bs, int64_t table_stride, int64_t q_stride, int64_t out_stride,
                     int64_t num_blocks,
                     int64_t k_s0, int64_t k_s1, int64_t k_s2, int64_t v_s0, int64_t v_s1,
                     int64_t v_s2, float scale, int num_threads) {
  if (num_threads < 1) num_threads = 1;
  /* Whole rows per item when there are enough of them to keep every thread busy. */
  const int64_t heads_per_item = n >= 2 * (int64_t)num_threads ? hk : 1;
  const job_t job = {q, k, v, out, tables, lens, seq_index, q_index, n, hq, hk, d, bs,
                     table_stride, q_stride, out_stride, num_blocks, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
                     heads_per_item, scale};
  const int64_t items = n * (hk / heads_per_item), heads = heads_per_item * (hq / hk);
  const int64_t bs_w = (bs + W - 1) / W * W;
  int64_t next = 0;
  int failed = 0;
  if (items == 0) return 0;
  if (num_threads > items) num_threads = (int)items;
#pragma omp parallel num_threads(num_threads)
  {
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(heads * (bs_w + 2)));
    if (scratch == NULL) {
      __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
    } else {
      float *m = scratch + heads * bs_w, *l = m + heads;
      for (;;) {
        const int64_t item = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
        if (item >= items) break;
        const int rc = attend(&job, item, scratch, m, l);
        if (rc) __atomic_store_n(&failed, rc, __ATOMIC_RELAXED);
      }
      free(scratch);
    }
  }
  return failed;
}

/* reshape_and_cache for fp32: token t's key and value rows [num_kv_heads, head_dim] go to slot
 * slots[t] = block * block_size + offset (vLLM paper §4.1). key/value rows may be strided (row
 * strides k_stride, v_stride; heads dense). Returns 0, or 2 when a slot is outside
 * [0, num_blocks * block_size) (checked for every token before anything is written). */
int reshape_and_cache_f32(const float *key, const float *value, float *k_cache, float *v_cache,
                          const int64_t *slots, int64_t n, int64_t hk, int64_t d, int64_t bs,
                          int64_t num_blocks, int64_t k_stride, int64_t v_stride, int64_t kc_s0,
                          int64_t kc_s1, int64_t vc_s0, int64_t vc_s1) {
  const int64_t row = hk * d;
  for (int64_t t = 0; t < n; t++)
    if (slots[t] < 0 || slots[t] >= num_blocks * bs) return 2;
  for (int64_t t = 0; t < n; t++) {
    const int64_t b = slots[t] / bs, o = slots[t] % bs;
    memcpy(k_cache + b * kc_s0 + o * kc_s1, key + t * k_stride, (size_t)row * sizeof(float));
    memcpy(v_cache + b * vc_s0 + o * vc_s1, value + t * v_stride, (size_t)row * sizeof(float));
  }
  return 0;
}
