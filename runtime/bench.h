/* bench.h - the shape of a benchmark entry of `m3kit bench`.  Each kernel
 * family provides one function (bench/cases_*.c) that writes markdown rows
 * with the shape, median/p20/p80 µs, the bytes or FLOPs it counted and the
 * fraction of the ceilings measured in the same run (bc). */
#ifndef M3_BENCH_H
#define M3_BENCH_H

#include <stdio.h>

#include "runtime/kernels.h"
#include "runtime/model_dims.h"
#include "runtime/config.h"

typedef struct m3_bench_ctx {
  const char *preset;
  double copy_gbs;     /* device-to-device copy, read + write, this run */
  double gemm_tflops;  /* cuBLAS bf16 GEMM 8192^3, this run (0 if unmeasured) */
} m3_bench_ctx;

typedef m3_status (*m3_bench_fn)(m3_rt *rt, const m3_bench_ctx *bc, FILE *out, m3_err *e);
typedef struct m3_bench_entry { const char *name; m3_bench_fn fn; } m3_bench_entry;

/* 1 when the case named `name` should run: M3KIT_BENCH_CASE unset or empty,
 * or a substring of `name` (so a profiler such as ncu sees one case only);
 * TEXT$ must end the name ("tokens=1$" leaves tokens=16 out). */
int m3_bench_case_wanted(const char *name);
/* How many m3_bench_case_wanted calls so far matched a set M3KIT_BENCH_CASE
 * (0 while it is unset): a filter that selected nothing is an error. */
int m3_bench_cases_matched(void);

/* cuBLAS bf16 GEMM 8192^3 TFLOP/s (runtime/gemm.c when present). */
m3_status m3_bench_gemm_ceiling(m3_rt *rt, double *tflops, m3_err *e);


#endif
