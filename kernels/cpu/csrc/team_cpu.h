/*
 * The thread split the projection kernels share (amx_linear.c, avx512bf16_linear.c, fp32_linear.c):
 * `units` pieces of work (output blocks or vectors) in runs, one run a thread, the runs' lengths
 * differing by one at most, on a team of at most `threads` OpenMP threads (torch's, when torch's
 * runtime is the one loaded); one thread without OpenMP.
 */
#ifndef PAGEDKV_TEAM_CPU_H
#define PAGEDKV_TEAM_CPU_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#define TEAM_THREAD() omp_get_thread_num()
#define TEAM_SIZE() omp_get_num_threads()
#else
#define TEAM_THREAD() 0
#define TEAM_SIZE() 1
#endif

/* Runs the statements after the first four arguments once a thread, with u0 and u1 (int64_t) the
 * bounds of that thread's run of [0, units). */
#define FOR_EACH_RUN(units, threads, u0, u1, ...)                                  \
  do {                                                                             \
    const int64_t units_ = (units);                                                \
    int nt_ = (int)((threads) < 1 ? 1 : (threads));                                \
    if (nt_ > units_) nt_ = (int)units_;                                           \
    _Pragma("omp parallel num_threads(nt_) if (nt_ > 1)") {                        \
      const int64_t t_ = TEAM_THREAD(), n_ = TEAM_SIZE();                          \
      const int64_t u0 = units_ * t_ / n_, u1 = units_ * (t_ + 1) / n_;            \
      __VA_ARGS__;                                                                 \
    }                                                                              \
  } while (0)

#endif /* PAGEDKV_TEAM_CPU_H */
