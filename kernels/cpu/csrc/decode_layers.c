/*
 * A decode step's decoder layers in one native call: bf16 or fp32, the projections on the kernel
 * the CPU's flags chose (packed_linear.c: AMX, AVX-512 BF16 or fp32 FMA), every op the per-op path
 * runs (compute_service/model/llama.py), in the same order on the same buffers, so the result is
 * bit-identical to it. What it saves is the Python between the ops: ~10 op calls per layer, each
 * with its checks, packing and a ctypes crossing (~3-4 ms a step on a 2-core CPU, against a
 * 15-35 ms step), which on a GPU a CUDA graph would save.
 *
 * Layer i, T tokens (one new token per sequence), hidden D, Hq query / Hkv KV heads of dh:
 *   h = rms_norm(res)             (i = 0: res holds the embeddings)
 *   h = add_rms_norm(x, res)      (i > 0: res += x, the residual stream, then its norm)
 *   qkv = h Wqkv^T                [T, (Hq + 2 Hkv) dh]  (packed_linear.c)
 *   rope(qkv queries and keys)    in place              (fused_cpu.c)
 *   cache[slots] = k, v           layer i's caches      (paged_cpu.c reshape_and_cache)
 *   attn = paged_decode(q)        [T, Hq dh]            (paged_cpu.c)
 *   o = attn Wo^T; h = add_rms_norm(o, res)
 *   x = (silu(h Wg^T) * (h Wu^T)) Wdown^T                (packed_linear.c, SwiGLU fused)
 * Leaves the last layer's x and res for the caller's final norm.
 *
 * Built into one library with the projection kernels, fused_cpu.c and paged_cpu.c
 * (kernels/cpu/packed_linear.py).
 */
#include <stdint.h>
#include <time.h>

int rms_norm_packed(const int64_t *a, float eps);
int rope_packed(const int64_t *a);
int reshape_and_cache_packed(const int64_t *a);
int paged_decode_packed(const int64_t *a, float scale);
int packed_linear(const int64_t *a);

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The projection kernel, its weights' block width and the dtype (bf16 1, fp32 0) of a step. */
typedef struct {
  int64_t kernel, block, bf16;
} path_t;

/* y [T, N] = x [T, K] W^T (silu: [T, N / 2], SwiGLU of [gate | up]); rows dense. */
static int project(const path_t *p, int64_t x, int64_t w, int64_t y, int64_t t, int64_t n, int64_t k, int64_t nt,
                   int silu) {
  const int64_t a[12] = {x, w, y, t, n, k, k, silu ? n / 2 : n, nt, silu, p->block, p->kernel};
  return packed_linear(a);
}

static void norm(const path_t *p, int64_t x, int64_t res, int64_t w, int64_t out, int64_t t, int64_t d, int add,
                 float eps, int64_t nt) {
  const int64_t a[12] = {add ? x : res, res, w, out, t, d, d, d, d, add, p->bf16, nt};
  rms_norm_packed(a, eps);
}

/* decode_layers: s = [res, x, h, qkv, attn, o, g (scratch addresses: [T, D] x 4 of them,
 *   [T, (Hq + 2 Hkv) dh], [T, Hq dh], [T, I]), T, D, Hq, Hkv, dh, I, cos, sin (addresses, rows of dh
 *   c_s and s_s apart), c_s, s_s, slots, tables, lens, seq_index, q_index (the step's metadata, as
 *   paged_decode and reshape_and_cache take them), table_stride, num_blocks, block_size, the
 *   caches' strides s0, s1, s2 (elements; the same for every layer's K and V), num_threads, kernel,
 *   block (packed_linear.c's), bf16 (1: every tensor bf16; 0: fp32)];
 * l = per layer [attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down, k_cache, v_cache] (addresses:
 *   norm weights [D], packed weights, the layer's caches); n layers.
 * *attn_seconds: wall seconds in the cache writes and attention, all layers.
 * Returns 0; else the first nonzero code of a kernel, the layers before it done: -1 a projection's
 * shapes, 2 a slot or block outside the cache, 3 a seq_len past its table row, 4 no kernel. */
int decode_layers(const int64_t *s, const int64_t *l, int64_t n, float eps, float scale,
                       double *attn_seconds) {
  const int64_t res = s[0], x = s[1], h = s[2], qkv = s[3], attn = s[4], o = s[5], g = s[6];
  const int64_t t = s[7], d = s[8], hq = s[9], hk = s[10], dh = s[11], inter = s[12];
  const int64_t s0 = s[25], s1 = s[26], s2 = s[27], nt = s[28], width = (hq + 2 * hk) * dh;
  const path_t p = {s[29], s[30], s[31] != 0};
  const int64_t es = p.bf16 ? 2 : 4; /* bytes per element */
  double spent = 0.0;
  int rc = 0;
  for (int64_t i = 0; i < n && rc == 0; i++) {
    const int64_t *w = l + 8 * i;
    norm(&p, x, res, w[0], h, t, d, i > 0, eps, nt);
    if ((rc = project(&p, h, w[1], qkv, t, width, d, nt, 0))) break;
    const int64_t rope[12] = {qkv, s[13], s[14], t, hq + hk, dh, width, dh, s[15], s[16], p.bf16, nt};
    rope_packed(rope);
    const double t0 = now();
    const int64_t cache[17] = {qkv + hq * dh * es, qkv + (hq + hk) * dh * es, w[6], w[7], s[17], t, hk, dh,
                               s[24], s[23], width, width, s0, s1, s0, s1, es};
    rc = reshape_and_cache_packed(cache);
    if (rc == 0) {
      const int64_t dec[28] = {qkv, w[6], w[7], attn, s[18], s[19], s[20], s[21], t, hq, hk, dh, s[24],
                               s[22], width, hq * dh, s[23], s0, s1, s2, s0, s1, s2, nt, p.bf16, p.bf16, 0, 0};
      rc = paged_decode_packed(dec, scale);
    }
    spent += now() - t0;
    if (rc) break;
    if ((rc = project(&p, attn, w[2], o, t, d, hq * dh, nt, 0))) break;
    norm(&p, o, res, w[3], h, t, d, 1, eps, nt);
    if ((rc = project(&p, h, w[4], g, t, 2 * inter, d, nt, 1))) break;
    rc = project(&p, g, w[5], x, t, d, inter, nt, 0);
  }
  *attn_seconds = spent;
  return rc;
}
