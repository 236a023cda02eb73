/* op_fill.c - tuning adapter of templates/fill.lua, the synthetic-weight
 * generator.  No buckets: m3_fill (runtime/model.c) resolves its kernel
 * without a bucket, once per tensor while a synthetic model or cache is
 * built (a one-time cost at creation, not part of any forward step), so no
 * record could ever be read.  An explicit bucket
 * elems=N (tests/check_tune_gpu.c drives the adapter directly) times a fill
 * of N elements.
 * Inputs: none (a seed and sigma 0.02, the weights' std), rotating output
 * sets, set 0 poisoned.  Verification (tests/check_forward_gpu.c's
 * contract): every element bit-exact against the host generator
 * m3_synth_value rounded to the dtype (saturating RNE for e4m3). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/op_util.h"
#include "runtime/check.h"
#include "runtime/model.h"

#define SIGMA 0.02f

typedef struct {
  m3_rt *rt;
  int eb, sets;             /* element bytes */
  int64_t n;
  uint64_t seed;
  size_t ob;                /* one set */
  void *d_o, *ref;
} fl_state;

static int buckets(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  (void)c; (void)v; (void)out; (void)max;
  return 0; /* never looked up by bucket: see the header comment */
}

static void teardown(void *x) {
  fl_state *s = x;
  if (!s) return;
  m3_dev_free(s->d_o);
  free(s->ref);
  free(s);
}

static m3_status setup(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                      void **out, m3_err *e) {
  (void)cfg;
  fl_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  s->seed = seed;
  const char *dt = m3_variant_axis(v, "dtype");
  s->n = m3_bucket_get(b, "elems");
  s->eb = !dt ? 0 : !strcmp(dt, "bf16") ? 2 : !strcmp(dt, "e4m3") ? 1 : !strcmp(dt, "f32") ? 4 : 0;
  if (!s->eb || s->n < 1) return m3_errf(e, M3_KEY, "not a fill key / elems bucket");
  s->ob = m3_tune_up256((size_t)s->n * s->eb);
  s->sets = m3_tune_sets(s->ob);
  s->ref = malloc((size_t)s->n * s->eb);
  if (!s->ref) return m3_errf(e, M3_NOMEM, "tune: fill reference");
  for (int64_t i = 0; i < s->n; i++) {
    const float x = m3_synth_value(seed, i, SIGMA);
    if (s->eb == 2) ((m3_bf16 *)s->ref)[i] = m3_f32_to_bf16(x);
    else if (s->eb == 1) ((m3_e4m3 *)s->ref)[i] = m3_f32_to_e4m3(x);
    else ((float *)s->ref)[i] = x;
  }
  return m3_dev_alloc(&s->d_o, s->ob * s->sets, e);
}

static m3_status prepare(void *x, int rep, m3_err *e) {
  fl_state *s = x;
  if (rep == 0) M3_CUDA(e, cudaMemsetAsync(s->d_o, 0xff, s->ob, s->rt->stream));
  return m3_tune_flush_if_small(s->sets, s->ob, s->rt->stream, e);
}

static m3_status launch(void *x, const m3_kernel *k, int rep, m3_err *e) {
  fl_state *s = x;
  const int set = rep % s->sets, hook = m3_tune_test_hook(k);
  const int64_t n = hook == 1 ? s->n - 1 : s->n; /* broken: the last element left unwritten */
  for (int twice = 0; twice < (hook == 2 ? 2 : 1); twice++)
    M3_TRY(m3_launch_fill(k, (char *)s->d_o + (size_t)set * s->ob, n, s->seed, SIGMA, s->rt->dev.sm_count,
                          s->rt->stream, e));
  return M3_OK;
}

static m3_status verify(void *x, char *detail, size_t n, m3_err *e) {
  fl_state *s = x;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  return m3_tune_expect_same(s->d_o, s->ref, (size_t)s->n * s->eb, (size_t)s->eb, "values", detail, n, e);
}

static double work(void *x) {
  fl_state *s = x;
  return (double)s->n * s->eb;
}

const m3_tune_op m3_tune_op_fill = {"fill", "GB/s", buckets, setup, prepare, launch, verify, work, teardown, NULL};
