/*
 * Paged decode attention and the KV cache write on CPU, fp32 or bf16 (and fp8 e4m3 caches read by
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
 * Built by kernels/cpu_native.py with the host's C compiler. Vectors use GCC/Clang vector
 * extensions: 16 floats wide where the build has AVX-512 (-mavx512f), else 8 (AVX2, or split by
 * the compiler into what the target has); the helpers are shared with fused_cpu.c (simd_cpu.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_cpu.h"
#if W == 16 || defined(__F16C__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define MAX_ACC 16 /* accumulator vectors of one work item (of 32 registers) */
#else
#define MAX_ACC 8 /* (of 16 registers) */
#endif
#define CHUNK_TOKENS 256 /* positions per softmax chunk (rounded to whole blocks) */
/* Below this many (position x query head) a call runs on one thread: measured on 2 cores, a
 * second thread already pays off at 1 sequence x 64 positions x 9 query heads (and at 32 breaks
 * even), torch's OpenMP team being warm between the model's ops. */
#define SERIAL_WORK 256
/* Rows per thread from which a work item is a whole row (all KV heads), not one KV head of it. */
#define ROWS_PER_THREAD 4

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
/* fp8_v / fp8_s return e4m3 values times this: 2^-8 (7, e4m3's exponent bias, less fp16's 15). */
#define FP8_DECODED_UNIT 0x1p-8f

/* Softmax of one chunk for one query head: p[0, cnt) scores in (their max cmax, NaN left out),
 * probabilities e^(s - m) out (p[cnt, round_up(cnt, W)) padded with 0). Updates the running max
 * *m and sum *l; returns the factor alpha by which the head's running output must be rescaled. */
static __attribute__((noinline)) float chunk_softmax(float *p, int64_t cnt, float cmax, float *m,
                                                     float *l) {
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

/* Lane shuffles of two vectors (indices into their concatenation; constants). */
#ifdef __clang__
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* One level of the transpose-add tree that turns W vectors into one vector of their lane sums:
 * with s lanes a half, lanes whose bit s is 0 hold a's pair sums (lane i and i + s), the others
 * b's. Levels s = W/2 .. 1 applied to vectors fed in bit-reversed order (TREE_SLOT) leave the sum
 * of vector i in lane i. */
#if W == 16
#define LV1(a, b) (SHUF(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +         \
                   SHUF(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define LV2(a, b) (SHUF(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +        \
                   SHUF(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
#define LV3(a, b) (SHUF(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +        \
                   SHUF(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
#define LV4(a, b) (SHUF(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +       \
                   SHUF(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
static const int TREE_SLOT[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#else
#define LV1(a, b) (SHUF(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(a, b, 4, 5, 6, 7, 12, 13, 14, 15))
#define LV2(a, b) (SHUF(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
#define LV3(a, b) (SHUF(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
static const int TREE_SLOT[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#endif

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

/* Addresses of the rows of positions [p0, p0 + cnt), 1 <= cnt <= W, of one head (element offset
 * off in a row) through the block table; slots cnt.. repeat the last row. Their cache lines (line
 * bytes each) are asked for now: a tile's rows are found one tile ahead of their use. */
ALWAYS_INLINE void tile_rows(const char *base, const int32_t *table, int64_t p0, int64_t cnt,
                             int64_t bs, int64_t s0, int64_t s1, int64_t off, int64_t esz,
                             int64_t bytes, const char **rows) {
  int64_t b = p0 / bs, o = p0 - b * bs;
  const char *blk = base + ((int64_t)table[b] * s0 + off) * esz;
  for (int64_t t = 0; t < cnt; t++) {
    rows[t] = blk + o * s1 * esz;
    prefetch_row(rows[t], bytes);
    if (++o == bs && t + 1 < cnt) {
      o = 0;
      blk = base + ((int64_t)table[++b] * s0 + off) * esz;
    }
  }
  for (int64_t t = cnt; t < W; t++) rows[t] = rows[cnt - 1];
}

/* Scores of the W keys rows[TREE_SLOT[i]] (lane i) for query heads qs[x * NV ..] (scaled, in
 * load_h's order) into res[x]: products summed lane-wise over head_dim, then the lanes of the W
 * sums added by the transpose-add tree as pairs of keys complete (few registers live). */
ALWAYS_INLINE void score_tile(const char *const *rows, const vf *qs, vf *res, const int HC,
                              const int NV, const int KV) {
  vf st[8][5]; /* [head][tree level]: a level's pending left operand */
  #pragma GCC unroll 8
  for (int m = 0; m < W / 2; m++) {
    vf t[2][8];
    #pragma GCC unroll 2
    for (int u = 0; u < 2; u++) {
      const char *kr = rows[TREE_SLOT[2 * m + u]];
      vf kv[8];
      #pragma GCC unroll 8
      for (int i = 0; i < NV; i++) kv[i] = load_kv(kr, i, NV, KV);
      #pragma GCC unroll 8
      for (int x = 0; x < HC; x++) {
        vf a = qs[x * NV] * kv[0];
        #pragma GCC unroll 8
        for (int i = 1; i < NV; i++) a += qs[x * NV + i] * kv[i];
        t[u][x] = a;
      }
    }
    #pragma GCC unroll 8
    for (int x = 0; x < HC; x++) {
      vf v = LV1(t[0][x], t[1][x]);
      if (m & 1) {
        v = LV2(st[x][1], v);
        if (m & 2) {
          v = LV3(st[x][2], v);
#if W == 16
          if (m & 4) {
            res[x] = LV4(st[x][3], v);
          } else {
            st[x][3] = v;
          }
#else
          res[x] = v;
#endif
        } else {
          st[x][2] = v;
        }
      } else {
        st[x][1] = v;
      }
    }
  }
}

/* Fast path: query heads [x0, x0 + HC) of row `row` (all reading KV head h) over the whole
 * context, head_dim = NV vectors; HC, NV, QB (bf16 query and out) and KV (cache kind) are
 * constants after inlining. An fp8 head's k scale multiplies the scaled query, its v scale the
 * output (exact fp8 values in between, times FP8_DECODED_UNIT). Positions go in
 * tiles of W (any block size), chunks of cw positions (a multiple of W) for the online softmax:
 * a chunk's scores a tile at a time (score_tile), its softmax on whole vectors, then its values
 * with each weight broadcast. sc: [HC][cw] scores / probabilities, then the scaled queries and the
 * output accumulators [HC * NV] vectors each. */
ALWAYS_INLINE void attend_fast(const job_t *j, int64_t row, int64_t h, int64_t x0, float *sc,
                               const int HC, const int NV, const int QB, const int KV) {
  const int64_t d = j->d, bs = j->bs, cw = j->chunk_w;
  const int64_t s = j->seq_index[row], len = j->lens[s];
  const int32_t *table = j->tables + s * j->table_stride;
  const int64_t esz = KV_SIZE(KV), qsz = QB ? 2 : 4, bytes = NV * W * esz;
  const char *q = (const char *)j->q + (j->q_index[row] * j->q_stride + x0 * d) * qsz;
  char *out = (char *)j->out + (j->q_index[row] * j->out_stride + x0 * d) * qsz;
  const float qmul = j->scale * kv_mul(j->k_scale, h, KV);
  const char *kbase = (const char *)j->k, *vbase = (const char *)j->v;
  const int64_t ko = h * j->k_s2, vo = h * j->v_s2;
  vf *qs = (vf *)(sc + HC * cw), *accm = qs + HC * NV;
  float m[8], l[8];
  #pragma GCC unroll 8
  for (int x = 0; x < HC; x++) {
    m[x] = -INFINITY;
    l[x] = 0.0f;
    #pragma GCC unroll 8
    for (int i = 0; i < NV; i++) {
      qs[x * NV + i] = load_q(q + x * d * qsz, i, NV, QB, KV) * qmul;
      accm[x * NV + i] = splat(0.0f);
    }
  }
  vi lane;
  for (int i = 0; i < W; i++) lane[i] = i;
  const char *ra[W], *rb[W], **cur = ra, **nxt = rb, **tmp;
  tile_rows(kbase, table, 0, len < W ? len : W, bs, j->k_s0, j->k_s1, ko, esz, bytes, cur);
  for (int64_t c0 = 0; c0 < len; c0 += cw) {
    const int64_t c1 = c0 + cw < len ? c0 + cw : len;
    vf qv[8 * 8], mx[8];
    #pragma GCC unroll 8
    for (int i = 0; i < HC * NV; i++) qv[i] = qs[i];
    #pragma GCC unroll 8
    for (int x = 0; x < HC; x++) mx[x] = splat(-INFINITY);
    for (int64_t p = c0; p < c1; p += W) { /* scores */
      if (p + W < c1)
        tile_rows(kbase, table, p + W, c1 - p - W < W ? c1 - p - W : W, bs, j->k_s0, j->k_s1, ko,
                  esz, bytes, nxt);
      else
        tile_rows(vbase, table, c0, c1 - c0 < W ? c1 - c0 : W, bs, j->v_s0, j->v_s1, vo, esz,
                  bytes, nxt);
      vf res[8];
      score_tile(cur, qv, res, HC, NV, KV);
      const vi valid = lane < (vi){0} + (int32_t)(c1 - p);
      #pragma GCC unroll 8
      for (int x = 0; x < HC; x++) {
        const vf r = select_v(valid, res[x], splat(-INFINITY));
        *(vf *)(sc + x * cw + (p - c0)) = r;
        mx[x] = select_v(r > mx[x], r, mx[x]); /* a NaN score stays out of the max (exp gives NaN) */
      }
      tmp = cur, cur = nxt, nxt = tmp;
    }
    float alpha[8];
    #pragma GCC unroll 8
    for (int x = 0; x < HC; x++) {
      float cmax = mx[x][0];
      for (int i = 1; i < W; i++) cmax = cmax > mx[x][i] ? cmax : mx[x][i];
      alpha[x] = chunk_softmax(sc + x * cw, c1 - c0, cmax, &m[x], &l[x]);
    }
    vf acc[8 * 8];
    #pragma GCC unroll 8
    for (int x = 0; x < HC; x++)
      #pragma GCC unroll 8
      for (int i = 0; i < NV; i++) acc[x * NV + i] = accm[x * NV + i] * alpha[x];
    for (int64_t p = c0; p < c1; p += W) { /* values */
      const int64_t n = c1 - p < W ? c1 - p : W;
      if (p + W < c1)
        tile_rows(vbase, table, p + W, c1 - p - W < W ? c1 - p - W : W, bs, j->v_s0, j->v_s1, vo,
                  esz, bytes, nxt);
      else if (c1 < len)
        tile_rows(kbase, table, c1, len - c1 < W ? len - c1 : W, bs, j->k_s0, j->k_s1, ko, esz,
                  bytes, nxt);
      const float *pw = sc + (p - c0);
      for (int64_t o = 0; o < n; o++) {
        vf vv[8];
        #pragma GCC unroll 8
        for (int i = 0; i < NV; i++) vv[i] = load_kv(cur[o], i, NV, KV);
        #pragma GCC unroll 8
        for (int x = 0; x < HC; x++) {
          const vf px = splat(pw[x * cw + o]);
          #pragma GCC unroll 8
          for (int i = 0; i < NV; i++) acc[x * NV + i] += px * vv[i];
        }
      }
      tmp = cur, cur = nxt, nxt = tmp;
    }
    #pragma GCC unroll 8
    for (int i = 0; i < HC * NV; i++) accm[i] = acc[i];
  }
  const float vmul = kv_mul(j->v_scale, h, KV);
  #pragma GCC unroll 8
  for (int x = 0; x < HC; x++) {
    /* every score -inf: 0, as the torch path */
    const float inv = (l[x] > 0.0f ? 1.0f / l[x] : 0.0f) * vmul;
    vf a[8];
    #pragma GCC unroll 8
    for (int i = 0; i < NV; i++) a[i] = accm[x * NV + i] * inv;
    if (KV == KV_FP8) { /* natural order */
      #pragma GCC unroll 8
      for (int i = 0; i < NV; i++) store_v(out + x * d * qsz, i * W, a[i], QB);
    } else {
      store_h(out + x * d * qsz, a, NV, QB);
    }
  }
}

/* Generic path (any head_dim): query heads [x0, x0 + hc) of KV head h, accumulators in
 * acc [hc * d] (scratch); vectors over head_dim with a scalar tail. */
ALWAYS_INLINE void attend_generic(const job_t *j, int64_t row, int64_t h, int64_t x0, int64_t hc,
                                  float *sc, float *acc, const int QB, const int KV) {
  const int64_t d = j->d, bs = j->bs, cw = j->chunk_w, dw = d / W * W;
  const int64_t s = j->seq_index[row], len = j->lens[s];
  const int32_t *table = j->tables + s * j->table_stride;
  const int64_t esz = KV_SIZE(KV), qsz = QB ? 2 : 4;
  const char *q = (const char *)j->q + (j->q_index[row] * j->q_stride + x0 * d) * qsz;
  char *out = (char *)j->out + (j->q_index[row] * j->out_stride + x0 * d) * qsz;
  const float qk = j->scale * kv_mul(j->k_scale, h, KV), vmul = kv_mul(j->v_scale, h, KV);
  const int64_t nb = (len + bs - 1) / bs, chunk_blocks = cw / bs;
  float m[8], l[8];
  for (int64_t x = 0; x < hc; x++) {
    m[x] = -INFINITY;
    l[x] = 0.0f;
    memset(acc + x * d, 0, (size_t)d * sizeof(float));
  }
  for (int64_t b0 = 0; b0 < nb; b0 += chunk_blocks) {
    const int64_t b1 = b0 + chunk_blocks < nb ? b0 + chunk_blocks : nb;
    const int64_t cnt = (b1 * bs < len ? b1 * bs : len) - b0 * bs;
    for (int64_t b = b0; b < b1; b++) {
      const char *kb = (const char *)j->k + ((int64_t)table[b] * j->k_s0 + h * j->k_s2) * esz;
      const int64_t end = len - b * bs < bs ? len - b * bs : bs;
      for (int64_t o = 0; o < end; o++) {
        const char *kr = kb + o * j->k_s1 * esz;
        for (int64_t x = 0; x < hc; x++) {
          vf t = splat(0.0f);
          int64_t i = 0;
          for (; i < dw; i += W) t += load_v(q, x * d + i, QB) * load_kv_v(kr, i, KV);
          float dot = hsum(t);
          for (; i < d; i++) dot += load_s(q, x * d + i, QB) * load_kv_s(kr, i, KV);
          sc[x * cw + (b - b0) * bs + o] = dot * qk;
        }
      }
    }
    for (int64_t x = 0; x < hc; x++) {
      float cmax = -INFINITY;
      for (int64_t o = 0; o < cnt; o++) cmax = sc[x * cw + o] > cmax ? sc[x * cw + o] : cmax;
      const float alpha = chunk_softmax(sc + x * cw, cnt, cmax, &m[x], &l[x]);
      if (alpha != 1.0f)
        for (int64_t i = 0; i < d; i++) acc[x * d + i] *= alpha;
    }
    for (int64_t b = b0; b < b1; b++) {
      const char *vb = (const char *)j->v + ((int64_t)table[b] * j->v_s0 + h * j->v_s2) * esz;
      const int64_t end = len - b * bs < bs ? len - b * bs : bs;
      for (int64_t o = 0; o < end; o++) {
        const char *vr = vb + o * j->v_s1 * esz;
        for (int64_t x = 0; x < hc; x++) {
          const float px = sc[x * cw + (b - b0) * bs + o];
          float *a = acc + x * d;
          int64_t i = 0;
          for (; i < dw; i += W) *(vf *)(a + i) += px * load_kv_v(vr, i, KV);
          for (; i < d; i++) a[i] += px * load_kv_s(vr, i, KV);
        }
      }
    }
  }
  for (int64_t x = 0; x < hc; x++) {
    const float inv = (l[x] > 0.0f ? 1.0f / l[x] : 0.0f) * vmul;
    for (int64_t i = 0; i < d; i++) store_s(out, x * d + i, acc[x * d + i] * inv, QB);
  }
}

typedef void (*fast_fn)(const job_t *, int64_t, int64_t, int64_t, float *);

/* Kinds of a call (query and out, caches): 0 fp32/fp32, 1 bf16/bf16, 2 fp32/fp8, 3 bf16/fp8. */
#define KIND_QB(K) ((K) & 1)
#define KIND_KV(K) ((K) < 2 ? (K) : KV_FP8)
#define NUM_KINDS 4

#define FAST(K, NV, HC)                                                                         \
  static void fast_##K##_##NV##_##HC(const job_t *j, int64_t r, int64_t h, int64_t x0,          \
                                     float *sc) {                                               \
    attend_fast(j, r, h, x0, sc, HC, NV, KIND_QB(K), KIND_KV(K));                               \
  }
#define FAST_HC(K, NV) FAST(K, NV, 1) FAST(K, NV, 2) FAST(K, NV, 3) FAST(K, NV, 4)               \
  FAST(K, NV, 5) FAST(K, NV, 6) FAST(K, NV, 7) FAST(K, NV, 8)
#define ROW1(K) {NULL, fast_##K##_1_1, fast_##K##_1_2, fast_##K##_1_3, fast_##K##_1_4,           \
  fast_##K##_1_5, fast_##K##_1_6, fast_##K##_1_7, fast_##K##_1_8}
/* Instantiated for (head_dim vectors NV, heads per pass HC) with HC * NV <= MAX_ACC. */
#if W == 16
#define FAST_KIND(K) FAST_HC(K, 1) FAST_HC(K, 2) FAST(K, 4, 1) FAST(K, 4, 2) FAST(K, 4, 3)         \
  FAST(K, 4, 4) FAST(K, 8, 1) FAST(K, 8, 2)
#define ROW2(K) {NULL, fast_##K##_2_1, fast_##K##_2_2, fast_##K##_2_3, fast_##K##_2_4,           \
  fast_##K##_2_5, fast_##K##_2_6, fast_##K##_2_7, fast_##K##_2_8}
#define ROW4(K) {NULL, fast_##K##_4_1, fast_##K##_4_2, fast_##K##_4_3, fast_##K##_4_4}
#define ROW8(K) {NULL, fast_##K##_8_1, fast_##K##_8_2}
#else
#define FAST_KIND(K) FAST_HC(K, 1) FAST(K, 2, 1) FAST(K, 2, 2) FAST(K, 2, 3) FAST(K, 2, 4)         \
  FAST(K, 4, 1) FAST(K, 4, 2) FAST(K, 8, 1)
#define ROW2(K) {NULL, fast_##K##_2_1, fast_##K##_2_2, fast_##K##_2_3, fast_##K##_2_4}
#define ROW4(K) {NULL, fast_##K##_4_1, fast_##K##_4_2}
#define ROW8(K) {NULL, fast_##K##_8_1}
#endif
FAST_KIND(0) FAST_KIND(1) FAST_KIND(2) FAST_KIND(3)
/* fast_table[kind][log2 NV][HC]; NULL where not instantiated. */
static const fast_fn fast_table[NUM_KINDS][4][9] = {
    {ROW1(0), ROW2(0), ROW4(0), ROW8(0)},
    {ROW1(1), ROW2(1), ROW4(1), ROW8(1)},
    {ROW1(2), ROW2(2), ROW4(2), ROW8(2)},
    {ROW1(3), ROW2(3), ROW4(3), ROW8(3)},
};

#define GENERIC(K)                                                                              \
  static void generic_##K(const job_t *j, int64_t r, int64_t h, int64_t x0, int64_t hc,         \
                          float *sc, float *acc) {                                              \
    attend_generic(j, r, h, x0, hc, sc, acc, KIND_QB(K), KIND_KV(K));                           \
  }
GENERIC(0) GENERIC(1) GENERIC(2) GENERIC(3)

/* The fast kernel of a kind for head_dim d and hc heads per pass, or NULL. */
static fast_fn pick_fast(int64_t d, int64_t hc, int kind) {
  const int64_t nv = d / W;
  if (d % W || hc < 1 || hc > 8 || hc * nv > MAX_ACC) return NULL;
  const int lg = nv == 1 ? 0 : nv == 2 ? 1 : nv == 4 ? 2 : nv == 8 ? 3 : -1;
  return lg < 0 ? NULL : fast_table[kind][lg][hc];
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
        for (int64_t h = h0; h < h0 + heads_per_item; h++)
        for (int64_t x0 = h * group; x0 < (h + 1) * group; x0 += hc) {
          const int64_t c = (h + 1) * group - x0 < hc ? (h + 1) * group - x0 : hc;
          const fast_fn f = c == hc ? fast : pick_fast(d, c, kind);
          if (f)
            f(&job, row, h, x0, scratch);
          else if (kind == 0) /* direct calls: the compiler may inline them, as it does */
            generic_0(&job, row, h, x0, c, scratch, acc);
          else if (kind == 1)
            generic_1(&job, row, h, x0, c, scratch, acc);
          else if (kind == 2)
            generic_2(&job, row, h, x0, c, scratch, acc);
          else
            generic_3(&job, row, h, x0, c, scratch, acc);
        }
      }
      free(scratch);
    }
  }
  return failed;
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

/* reshape_and_cache: token t's key and value rows [num_kv_heads, head_dim] go to slot
 * slots[t] = block * block_size + offset (vLLM paper §4.1); a copy of elem_size-byte elements
 * (any dtype). key/value rows may be strided (row strides k_stride, v_stride; heads dense).
 * Returns 0, or 2 when a slot is outside [0, num_blocks * block_size) (checked for every token
 * before anything is written). */
int reshape_and_cache(const void *key, const void *value, void *k_cache, void *v_cache,
                      const int64_t *slots, int64_t n, int64_t hk, int64_t d, int64_t bs,
                      int64_t num_blocks, int64_t k_stride, int64_t v_stride, int64_t kc_s0,
                      int64_t kc_s1, int64_t vc_s0, int64_t vc_s1, int64_t elem_size) {
  const size_t row = (size_t)(hk * d * elem_size);
  for (int64_t t = 0; t < n; t++)
    if (slots[t] < 0 || slots[t] >= num_blocks * bs) return 2;
  for (int64_t t = 0; t < n; t++) {
    const int64_t b = slots[t] / bs, o = slots[t] % bs;
    memcpy((char *)k_cache + (b * kc_s0 + o * kc_s1) * elem_size,
           (const char *)key + t * k_stride * elem_size, row);
    memcpy((char *)v_cache + (b * vc_s0 + o * vc_s1) * elem_size,
           (const char *)value + t * v_stride * elem_size, row);
  }
  return 0;
}

/* reshape_and_cache with its arguments packed, in order, as int64 (addresses first). */
int reshape_and_cache_packed(const int64_t *a) {
  return reshape_and_cache((const void *)a[0], (const void *)a[1], (void *)a[2], (void *)a[3],
                           (const int64_t *)a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                           a[13], a[14], a[15], a[16]);
}
