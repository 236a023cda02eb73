/* cases_insert.h - fused against unfused KV insert on dense layers
 * (bench/cases_insert.c), run by `m3kit bench --only insert`. */
#ifndef M3_BENCH_CASES_INSERT_H
#define M3_BENCH_CASES_INSERT_H

#include <stdio.h>

#include "runtime/kernels.h"

/* For the preset's dense-layer shapes (64 q / 4 kv heads x 128, block 128),
 * KV bf16 and e4m3, tokens 1, 4, 16, 64, 256, 1024, 8192: the per-layer time
 * of qknorm_rope(insert=1) against qknorm_rope(insert=0) followed by
 * kv_insert, each timed as a CUDA graph over R rotating layer buffers (R =
 * 57, or fewer when R sets would not fit 1 GB: then still > 2x L2), which is
 * how the decode step runs.  Prints a markdown table and what the difference
 * is worth per decode step (3 dense layers of minimax-m3; and if all 60
 * layers' K/V inserts were unfused).  `copy_gbs` is the copy ceiling of this
 * run.  Errors: M3_CUDA, M3_NOMEM, the JIT's. */
m3_status m3_bench_insert(m3_rt *rt, double copy_gbs, FILE *out, m3_err *e);

#endif
