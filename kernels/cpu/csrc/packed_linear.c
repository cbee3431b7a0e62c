/*
 * One entry for the projection kernels over oneDNN's prepacked weights (kernels/cpu/packed_linear.py
 * chooses one at start from the CPU's flags): the Python caller and decode_layers.c call this.
 *
 * packed_linear: a = [x, w (packed), out (addresses), M, N, K, x_s, o_s, num_threads, silu, B,
 * kernel]; kernel 0: AMX, bf16, B = 32 (amx_linear.c); 1: AVX-512 BF16, bf16, B = 16, 32 or 64
 * (avx512bf16_linear.c); 2: FMA vectors, fp32 (fp32_linear.c). Returns the kernel's code: 0, or -1
 * when it refused the shapes (nothing written) or is not in this build.
 */
#include <stdint.h>

int amx_linear_bf16(const int64_t *a);
int avx512bf16_linear(const int64_t *a);
int fp32_linear(const int64_t *a);

int packed_linear(const int64_t *a) {
  switch (a[11]) {
    case 0:
      return a[10] == 32 ? amx_linear_bf16(a) : -1;
    case 1:
      return avx512bf16_linear(a);
    case 2:
      return fp32_linear(a);
    default:
      return -1;
  }
}
