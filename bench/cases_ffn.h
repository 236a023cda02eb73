/* cases_ffn.h - the FFN-side benchmark cases (bench/cases_ffn.c). */
#ifndef M3_BENCH_CASES_FFN_H
#define M3_BENCH_CASES_FFN_H

#include <stdio.h>

#include "runtime/kernels.h"

/* Decode weight streaming through the GEMVs, in GB/s of weight (+ scale)
 * bytes against copy_gbs (GB/s > 0, the device-to-device copy ceiling
 * measured in the same run):
 *   - MoE decode: the MoE GEMV over 4 chosen experts (gate|up 6144x6144, down
 *     6144x3072), MXFP8 and bf16, rotating over 57 layers x 4 distinct experts
 *     (fewer if memory is short, never fewer than 4x L2) so every rep reads
 *     HBM, never L2;
 *   - dense decode projections: qkv+index 9856x6144, o_proj 6144x8192 (MXFP8,
 *     rotating copies), lm_head 200064x6144 bf16, for n = 1 and 8 tokens;
 *   - RMSNorm with the residual add (and the fp32 copy), 1 and 4096 rows.
 * One line per case on `out` (median and p20/p80 over the reps).
 * Errors: M3_CAPACITY (not even 4x L2 of experts fits), M3_CUDA, kernel
 * build errors. */
m3_status m3_bench_ffn(m3_rt *rt, double copy_gbs, FILE *out, m3_err *e);

#endif
