/*
 * The KV cache write on CPU (vLLM's reshape_and_cache): each new token's key and value rows copied
 * into its slot of the paged cache, any element size (fp32 or bf16; an fp8 cache is written by
 * the torch path, kernels.reshape_and_cache). Built into the library of paged_cpu.c.
 */
#include <stdint.h>
#include <string.h>

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
