/* op_sample.c - tuning adapter of templates/sample.lua.  The forward pass
 * looks the sampler up by the rows it samples rounded up to a power of two
 * (runtime/forward.c finish: one row after a prefill, the batch after a
 * decode step), so the buckets are tokens = 1 and 8; keys of another vocabulary
 * or bf16 logits (the runtime samples fp32 logits): none.
 * Inputs: LLM-like fp32 logit rows (tests/check_ffn_gpu.c's pattern: an
 * N(0,1) bulk far below 16 peaks at N(20, 2^2)), rotating sets; top_p draws
 * with temperature 1, top-p 0.9 and a seeded generator key; output poisoned.
 * Verification (the GPU tests' contract): the kernel's raw token of every
 * row equals m3_ref_sample_top_p's (greedy rows included), except that a
 * top-p row whose candidate set {expf(x - max) >= 2^-27} exceeds the tile's
 * cap must be marked -2 (left to the host); -1 (all NaN) never passes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/op_util.h"
#include "runtime/check.h"
#include "runtime/op_ffn.h"

#define PEAKS 16

typedef struct {
  m3_rt *rt;
  m3_sample_args a;
  int topp, sets;
  long cap;                 /* the cap tile of the last launch's kernel */
  size_t lb, ob;            /* one set: logits, tokens */
  void *d_l, *d_o;
  int32_t *ref;
  int64_t *cands;           /* per row of set 0: top-p candidates */
} sm_state;

static int buckets(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  const char *lg = m3_variant_axis(v, "logits");
  if (!lg || strcmp(lg, "f32") || m3_variant_axis_int(v, "vocab", 0) != c->vocab_size) return 0;
  int64_t rows[M3_TUNE_N_STEPS];
  int n = 0;
  for (int i = 0; i < M3_TUNE_N_STEPS; i++)
    if (m3_tune_steps[i] <= M3_TUNE_DECODE_ROWS) rows[n++] = m3_tune_steps[i]; /* a prefill samples 1 row */
  return m3_tune_rows_buckets(rows, n, out, max);
}

static void teardown(void *x) {
  sm_state *s = x;
  if (!s) return;
  m3_dev_free(s->d_l); m3_dev_free(s->d_o);
  free(s->ref); free(s->cands);
  free(s);
}

static m3_status setup(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                      void **out, m3_err *e) {
  (void)cfg; /* the key carries the vocabulary */
  sm_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  const char *mode = m3_variant_axis(v, "mode"), *lg = m3_variant_axis(v, "logits");
  const int64_t rows = m3_bucket_get(b, "tokens"), V = m3_variant_axis_int(v, "vocab", 0);
  if (!mode || !lg || strcmp(lg, "f32") || rows < 1 || V < PEAKS)
    return m3_errf(e, M3_KEY, "not a sample key (fp32 logits) / bucket");
  s->topp = !strcmp(mode, "top_p");
  s->a = (m3_sample_args){.n_rows = rows, .vocab = V, .logits_bf16 = 0, .temperature = s->topp ? 1.0f : 0.0f,
                          .top_p = 0.9f, .seed = seed, .step = 1};
  s->lb = m3_tune_up256((size_t)(rows * V) * 4);
  s->ob = m3_tune_up256((size_t)rows * 4);
  s->sets = m3_tune_sets(s->lb + s->ob);
  float *l = malloc(s->lb);
  s->ref = malloc((size_t)rows * 4);
  s->cands = calloc((size_t)rows, sizeof *s->cands);
  m3_status st = l && s->ref && s->cands ? M3_OK : m3_errf(e, M3_NOMEM, "tune: sample inputs");
  if (!st) {
    m3_rng r = {seed};
    for (int64_t t = 0; t < rows; t++) {
      float *row = l + t * V, mx = -INFINITY;
      for (int64_t i = 0; i < V; i++) row[i] = m3_rng_normal(&r);
      for (int j = 0; j < PEAKS; j++) row[m3_rng_next(&r) % (uint64_t)V] = 20.0f + 2.0f * m3_rng_normal(&r);
      for (int64_t i = 0; i < V; i++) mx = row[i] > mx ? row[i] : mx;
      for (int64_t i = 0; i < V; i++) s->cands[t] += expf(row[i] - mx) >= 0x1p-27f; /* temperature 1 */
    }
    st = m3_ref_sample_top_p(&s->a, l, s->ref, e);
  }
  if (!st) st = m3_tune_upload_sets(&s->d_l, l, s->lb, s->sets, rt->stream, e);
  if (!st) st = m3_dev_alloc(&s->d_o, s->ob * s->sets, e);
  free(l);
  return st;
}

static m3_status prepare(void *x, int rep, m3_err *e) {
  sm_state *s = x;
  if (rep == 0) M3_CUDA(e, cudaMemsetAsync(s->d_o, 0xff, s->ob, s->rt->stream));
  return m3_tune_flush_if_small(s->sets, s->lb + s->ob, s->rt->stream, e);
}

static m3_status launch(void *x, const m3_kernel *k, int rep, m3_err *e) {
  sm_state *s = x;
  const int set = rep % s->sets, hook = m3_tune_test_hook(k);
  m3_sample_args a = s->a;
  if (hook == 1) a.n_rows -= 1; /* broken: the last row's CTA left out */
  s->cap = m3_variant_tile_int(&k->key, "cap", 4096);
  for (int twice = 0; twice < (hook == 2 ? 2 : 1); twice++)
    M3_TRY(m3_launch_sample(k, &a, (const char *)s->d_l + (size_t)set * s->lb,
                            (int32_t *)((char *)s->d_o + (size_t)set * s->ob), s->rt->stream, e));
  return M3_OK;
}

static m3_status verify(void *x, char *detail, size_t n, m3_err *e) {
  sm_state *s = x;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  const int64_t rows = s->a.n_rows;
  int32_t *g = malloc((size_t)rows * 4);
  if (!g) return m3_errf(e, M3_NOMEM, "verify");
  m3_status st = m3_dev_download(g, s->d_o, (size_t)rows * 4, e);
  for (int64_t r = 0; !st && r < rows; r++) {
    const int host = s->topp && s->cands[r] > s->cap;
    const int32_t want = host ? -2 : s->ref[r];
    if (g[r] != want) {
      snprintf(detail, n, "row %lld (%lld candidates, cap %ld): token %d, want %d%s", (long long)r,
               (long long)s->cands[r], s->cap, g[r], want, host ? " (the host's path)" : " (the reference's)");
      st = M3_MISMATCH;
    }
  }
  free(g);
  return st;
}

static double work(void *x) {
  sm_state *s = x;
  return (double)s->a.n_rows * ((double)s->a.vocab * 4 + 4);
}

const m3_tune_op m3_tune_op_sample = {"sample", "GB/s", buckets, setup, prepare, launch, verify, work, teardown, NULL};
