/*
 * The fast path of paged decode attention, kinds 0 and 1 (fp32 or bf16 query over a cache of the
 * same dtype), and paged_fast_table over every kind: the code is decode_fast_cpu.h's; the fp8
 * kinds are instantiated in decode_fast_fp8_cpu.c, compiled at the same time.
 */
#include "decode_fast_cpu.h"

FAST_KIND(0, FAST_DEF) FAST_KIND(1, FAST_DEF)
FAST_KIND(2, FAST_DECL) FAST_KIND(3, FAST_DECL)
/* paged_fast_table[kind][log2 NV][HC]; NULL where not instantiated. Kinds 2 and 3 are the fp8
 * variants (fp32 or bf16 query over fp8 caches). */
HIDDEN const fast_fn paged_fast_table[NUM_KINDS][4][9] = {
    {ROW1(0), ROW2(0), ROW4(0), ROW8(0)},
    {ROW1(1), ROW2(1), ROW4(1), ROW8(1)},
    {ROW1(2), ROW2(2), ROW4(2), ROW8(2)},
    {ROW1(3), ROW2(3), ROW4(3), ROW8(3)},
};
