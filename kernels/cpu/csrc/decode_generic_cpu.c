/*
 * The generic path of paged decode attention (paged_cpu.c): any head_dim, the query heads of a
 * pass read from memory at every position, vectors over head_dim with a scalar tail; one
 * instantiation per kind (query and cache dtypes) in paged_generic_table. Taken where the fast
 * path has no instantiation (head_dim not 1, 2, 4 or 8 vectors, or too many heads a pass).
 */
#include "decode_cpu.h"

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

#define GENERIC(K)                                                                              \
  static void generic_##K(const job_t *j, int64_t r, int64_t h, int64_t x0, int64_t hc,         \
                          float *sc, float *acc) {                                              \
    attend_generic(j, r, h, x0, hc, sc, acc, KIND_QB(K), KIND_KV(K));                           \
  }
GENERIC(0) GENERIC(1) GENERIC(2) GENERIC(3)

/* paged_generic_table[kind]; kinds 2 and 3 are the fp8 variants. */
HIDDEN const generic_fn paged_generic_table[NUM_KINDS] = {generic_0, generic_1, generic_2, generic_3};
