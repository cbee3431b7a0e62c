/*
 * The fast path of paged decode attention (paged_cpu.c): one work item's query heads and output
 * accumulators stay in vector registers for the whole context, for head_dim 1, 2, 4 or 8 vectors
 * wide; instantiated per (kind: query and cache dtypes, head_dim vectors, heads per pass) into
 * paged_fast_table. Keys are scored a tile of W positions at a time, the W dot products summed
 * by a transpose-add tree; a chunk's values are summed with each weight broadcast.
 *
 * This header holds the code; two translation units instantiate it, so the two halves compile at
 * once: decode_fast_cpu.c (kinds 0 and 1, and the table) and decode_fast_fp8_cpu.c (kinds 2 and
 * 3, the fp8 caches). FAST_KIND(K, F) applies F(K, NV, HC) to every instantiated (NV, HC).
 */
#ifndef DECODE_FAST_CPU_H
#define DECODE_FAST_CPU_H
#include "decode_cpu.h"

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

/* The start of query heads [0, HC) of a work item at q (a query row, heads d elements apart):
 * their queries times qmul (the softmax scale, and an fp8 head's k scale) in qs [HC * NV] vectors,
 * in load_kv's order for a cache of kind KV; zero accumulators accm [HC * NV]; an empty online
 * softmax (running max m = -inf, sum l = 0). */
ALWAYS_INLINE void start_heads(const char *q, vf *qs, vf *accm, float *m, float *l, float qmul,
                               int64_t d, const int HC, const int NV, const int QB, const int KV) {
  const int64_t qsz = QB ? 2 : 4;
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
}

/* The online softmax of one chunk of cnt positions for query heads [0, HC): head x's scores
 * sc[x * cw ..] (lane maxima mx[x]) become probabilities, its running max m[x] and sum l[x] are
 * updated, and alpha[x] is the factor its running output must be rescaled by (chunk_softmax). */
ALWAYS_INLINE void chunk_softmax_heads(float *sc, int64_t cw, int64_t cnt, const vf *mx, float *m,
                                       float *l, float *alpha, const int HC) {
  #pragma GCC unroll 8
  for (int x = 0; x < HC; x++) {
    float cmax = mx[x][0];
    for (int i = 1; i < W; i++) cmax = cmax > mx[x][i] ? cmax : mx[x][i];
    alpha[x] = chunk_softmax(sc + x * cw, cnt, cmax, &m[x], &l[x]);
  }
}

/* The output of query heads [0, HC) at out (an output row, heads d elements apart): accumulators
 * accm [HC * NV] over their softmax sums l, times vmul (an fp8 head's v scale), in the query's
 * dtype and load_kv's order undone. */
ALWAYS_INLINE void store_heads(char *out, const vf *accm, const float *l, float vmul, int64_t d,
                               const int HC, const int NV, const int QB, const int KV) {
  const int64_t qsz = QB ? 2 : 4;
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
  start_heads(q, qs, accm, m, l, qmul, d, HC, NV, QB, KV);
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
    chunk_softmax_heads(sc, cw, c1 - c0, mx, m, l, alpha, HC);
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
  store_heads(out, accm, l, kv_mul(j->v_scale, h, KV), d, HC, NV, QB, KV);
}

/* One instantiation: a hidden (library-internal) function, so the other unit's table can name it. */
#define FAST_DEF(K, NV, HC)                                                                     \
  HIDDEN void fast_##K##_##NV##_##HC(const job_t *j, int64_t r, int64_t h, int64_t x0,          \
                                     float *sc) {                                               \
    attend_fast(j, r, h, x0, sc, HC, NV, KIND_QB(K), KIND_KV(K));                               \
  }
#define FAST_DECL(K, NV, HC)                                                                    \
  HIDDEN void fast_##K##_##NV##_##HC(const job_t *j, int64_t r, int64_t h, int64_t x0, float *sc);
#define FAST_HC(K, NV, F) F(K, NV, 1) F(K, NV, 2) F(K, NV, 3) F(K, NV, 4) F(K, NV, 5) F(K, NV, 6)   \
  F(K, NV, 7) F(K, NV, 8)
#define ROW1(K) {NULL, fast_##K##_1_1, fast_##K##_1_2, fast_##K##_1_3, fast_##K##_1_4,           \
  fast_##K##_1_5, fast_##K##_1_6, fast_##K##_1_7, fast_##K##_1_8}
/* Instantiated for (head_dim vectors NV, heads per pass HC) with HC * NV <= MAX_ACC. */
#if W == 16
#define FAST_KIND(K, F) FAST_HC(K, 1, F) FAST_HC(K, 2, F) F(K, 4, 1) F(K, 4, 2) F(K, 4, 3)         \
  F(K, 4, 4) F(K, 8, 1) F(K, 8, 2)
#define ROW2(K) {NULL, fast_##K##_2_1, fast_##K##_2_2, fast_##K##_2_3, fast_##K##_2_4,           \
  fast_##K##_2_5, fast_##K##_2_6, fast_##K##_2_7, fast_##K##_2_8}
#define ROW4(K) {NULL, fast_##K##_4_1, fast_##K##_4_2, fast_##K##_4_3, fast_##K##_4_4}
#define ROW8(K) {NULL, fast_##K##_8_1, fast_##K##_8_2}
#else
#define FAST_KIND(K, F) FAST_HC(K, 1, F) F(K, 2, 1) F(K, 2, 2) F(K, 2, 3) F(K, 2, 4)               \
  F(K, 4, 1) F(K, 4, 2) F(K, 8, 1)
#define ROW2(K) {NULL, fast_##K##_2_1, fast_##K##_2_2, fast_##K##_2_3, fast_##K##_2_4}
#define ROW4(K) {NULL, fast_##K##_4_1, fast_##K##_4_2}
#define ROW8(K) {NULL, fast_##K##_8_1}
#endif
#endif /* DECODE_FAST_CPU_H */
