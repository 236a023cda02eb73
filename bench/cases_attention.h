/* cases_attention.h - the attention benchmark cases (bench/cases_attention.c),
 * run by `m3kit bench`. */
#ifndef M3_BENCH_CASES_ATTENTION_H
#define M3_BENCH_CASES_ATTENTION_H

#include <stdio.h>

#include "runtime/kernels.h"

/* Times the attention kernels at the model's shapes (nq 64, nkv 4, hd 128,
 * block 128, topk 16) with each variant's tuned or default tile:
 *   sparse decode  16 blocks x 128 tokens x 4 KV heads, batch 1 and 32;
 *   dense decode   one sequence at 8K, 32K, 128K, 384K, 1M tokens;
 *   prefill        dense and sparse chunks of 8K, 16K, 32K, 64K tokens;
 * each in bf16 and e4m3.  Writes one line per case to `out`: microseconds
 * (median, p20, p80 over the reps, CUDA events) and the rate - GB/s of KV
 * bytes read for decode, as a fraction of copy_gbs (GB/s > 0, the
 * device-to-device copy ceiling measured in the same run), TFLOP/s of QKᵀ +
 * P·V (4·hd FLOPs per query head per key) for prefill, as a fraction of
 * gemm_tflops (cuBLAS bf16 GEMM, same run; <= 0, unmeasured, prints "-").  Decode reps
 * rotate over copies of the KV working set so that >= 128 MiB (over twice
 * the 50-60 MB L2) separate two reads of a page: L2 never serves a repeat.
 * Cache contents are a constant bf16/e4m3 pattern: the kernels' time does not
 * depend on values.
 * Needs ~4.3 GB of GPU memory.  Errors: M3_CUDA, M3_NOMEM, the JIT's. */
m3_status m3_bench_attention(m3_rt *rt, double copy_gbs, double gemm_tflops, FILE *out, m3_err *e);

#endif
