/*
 * The fast path of paged decode attention, kinds 2 and 3 (fp32 or bf16 query over an fp8 cache):
 * decode_fast_cpu.h's code, instantiated apart from kinds 0 and 1 (decode_fast_cpu.c, which holds
 * paged_fast_table) so that both halves compile at once.
 */
#include "decode_fast_cpu.h"

FAST_KIND(2, FAST_DEF) FAST_KIND(3, FAST_DEF)
