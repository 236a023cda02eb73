/* cases_indexer.h - the lightning-indexer benchmark cases (bench/cases_indexer.c),
 * run by `m3kit bench`. */
#ifndef M3_BENCH_CASES_INDEXER_H
#define M3_BENCH_CASES_INDEXER_H

#include <stdio.h>

#include "runtime/kernels.h"

/* Times the decode indexer (templates/index_decode.lua, tuned or default
 * tile) at the model's shapes (4 index heads x 128 dims, block 128, top-16,
 * local 1), bf16 and e4m3 index-K:
 *   batch 1 at 8192, 131072, 393216, 769000 and 1048576 tokens;
 *   batch 32 of fixed pseudo-random lengths in [8192, 256000) (~3.8M tokens,
 *   the anchor's mixed batch).
 * Each case rotates over R index caches (distinct pages of one pool, block
 * tables permuted within a cache): R = 57 (one per sparse layer), raised up
 * to 128 until two reads of a page are 2x the L2 size apart (small
 * contexts), lowered to what the pool holds (the mixed batch: ~20); a case
 * that cannot keep reads 2x L2 apart is reported as skipped, so L2 never
 * serves a repeat.  Cache bytes are
 * random finite values valid as both bf16 and e4m3 (the kernel's speed does
 * not depend on them, its merge does on their order).  One line per case:
 * median, p20, p80 us of event-timed single launches, the median per launch
 * of a CUDA graph replaying the R launches back to back (the anchors' vLLM
 * numbers are graph-timed), and effective TB/s = index-K bytes of the
 * visible tokens / time against copy_gbs (GB/s > 0, the device-to-device
 * copy ceiling measured in the same run).
 * Needs ~20 GB of GPU memory (less: fewer rotations).  Errors: M3_CUDA,
 * M3_NOMEM, M3_CAPACITY, the JIT's. */
m3_status m3_bench_indexer(m3_rt *rt, double copy_gbs, FILE *out, m3_err *e);

#endif
