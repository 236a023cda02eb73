/* op.h - what the tuner (and the benchmarks) need to know about one kernel
 * family, beyond its template: the shape buckets the runtime launches, how to
 * build inputs for a bucket, launch a candidate, restore what the kernel
 * mutates, check the result against the C reference, and count the work.
 * One adapter per template; autotune/ops_table.c lists them all. */
#ifndef M3_TUNE_OP_H
#define M3_TUNE_OP_H

#include "runtime/config.h"
#include "runtime/kernels.h"

typedef struct m3_tune_op {
  const char *template_name;
  const char *unit;          /* "GB/s" (bandwidth-bound) or "TFLOP/s" */
  /* The buckets the runtime launches variant v at, for config c (<= max). */
  int (*buckets)(const m3_config *c, const m3_variant *v, m3_bucket *out, int max);
  /* Inputs for (v, b) of config c from `seed`, several rotating sets so that
   * timed runs stream from HBM, not L2; the reference output of set 0.  *st
   * owned by the adapter until teardown.  Errors: M3_CUDA, M3_NOMEM,
   * M3_CAPACITY. */
  m3_status (*setup)(m3_rt *rt, const m3_config *c, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                     void **st, m3_err *e);
  /* Untimed, before each launch: restore mutated inputs of set `rep`, poison
   * its outputs.  Errors: M3_CUDA. */
  m3_status (*prepare)(void *st, int rep, m3_err *e);
  /* The timed part: launch kernel k on set `rep` on the rt stream. */
  m3_status (*launch)(void *st, const m3_kernel *k, int rep, m3_err *e);
  /* After a launch on set 0: M3_OK, or M3_MISMATCH with the comparison in
   * `detail`.  NaN never passes. */
  m3_status (*verify)(void *st, char *detail, size_t n, m3_err *e);
  /* Bytes (GB/s ops) or FLOPs (TFLOP/s ops) one launch must move / do. */
  double (*work)(void *st);
  void (*teardown)(void *st);
  /* Optional: the unit of this state's work() when it differs by variant
   * (attention: GB/s decode, TFLOP/s prefill); NULL: `unit`. */
  const char *(*unit_of)(void *st);
} m3_tune_op;

/* NULL-terminated registry (autotune/ops_table.c). */
extern const m3_tune_op *const m3_tune_ops[];
const m3_tune_op *m3_tune_op_find(const char *template_name);

/* Test hook (known-faults #32, #34): M3KIT_TUNE_TEST_HOOK="broken=TILE" makes
 * adapters launch that tile one CTA short (a wrong candidate the correctness
 * gate must reject); "slow=TILE" launches it twice (a slower candidate that
 * must never win).  Returns 0 normal, 1 broken, 2 slow for kernel k. */
int m3_tune_test_hook(const m3_kernel *k);

#endif
