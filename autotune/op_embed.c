/* op_embed.c - tuning adapter of templates/embed.lua, a gather of table rows.
 * The runtime looks it up by the rows of the launch rounded up to a power of
 * two: the token embedding at every step (runtime/forward.c forward_body:
 * tokens = 1, 8, 256, 4096) and, on the MoE layers' prefill path, the gather
 * of each (token, expert) pair's activation row (runtime/op_ffn.c
 * m3_moe_forward: top-k x the step's tokens, M3: 1024, 16384).  Those are the
 * buckets; a key of another row length than the hidden size: none.
 * Inputs: a table with n * sets distinct random bf16 rows, and per rotating
 * set n ids choosing rows no other set reads (a random permutation), so that
 * every set's gather streams from HBM as the embedding of a 200k-row
 * vocabulary does; output poisoned, error word cleared once.  Verification
 * (tests/check_ffn_gpu.c): every row a bit copy of m3_ref_embed's, the error
 * word still clear. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/op_util.h"
#include "runtime/check.h"
#include "runtime/op_ffn.h"

typedef struct {
  m3_rt *rt;
  int H, sets;
  int64_t n, table_rows;
  size_t out_b;             /* one set */
  void *d_table, *d_out;
  int32_t *d_ids, *d_err;   /* ids [sets][n] */
  m3_bf16 *ref;
} em_state;

static int buckets(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  if (m3_variant_axis_int(v, "hidden", 0) != c->hidden_size) return 0;
  int64_t rows[2 * M3_TUNE_N_STEPS];
  int n = 0;
  for (int i = 0; i < M3_TUNE_N_STEPS; i++) {
    const int64_t T = m3_tune_steps[i];
    rows[n++] = T;
    if (m3_config_n_moe_layers(c) && T > M3_TUNE_DECODE_ROWS) rows[n++] = T * c->num_experts_per_tok;
  }
  return m3_tune_rows_buckets(rows, n, out, max);
}

static void teardown(void *x) {
  em_state *s = x;
  if (!s) return;
  m3_dev_free(s->d_table); m3_dev_free(s->d_out); m3_dev_free(s->d_ids); m3_dev_free(s->d_err);
  free(s->ref);
  free(s);
}

static m3_status setup(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                      void **out, m3_err *e) {
  (void)cfg; /* the key carries the row length; the table size is the adapter's */
  em_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  s->H = (int)m3_variant_axis_int(v, "hidden", 0);
  s->n = m3_bucket_get(b, "tokens");
  if (s->H < 1 || s->n < 1 || s->n > (1 << 24)) return m3_errf(e, M3_KEY, "not an embed key/bucket");
  const size_t n = (size_t)s->n, H = (size_t)s->H;
  s->out_b = m3_tune_up256(n * H * 2);
  s->sets = m3_tune_sets(2 * n * H * 2 + n * 4); /* rows read, rows written, ids */
  s->table_rows = (int64_t)n * s->sets;
  const size_t T = (size_t)s->table_rows;
  m3_bf16 *table = malloc(T * H * 2);
  int32_t *ids = malloc(T * 4);
  s->ref = malloc(n * H * 2);
  m3_status st = table && ids && s->ref ? M3_OK : m3_errf(e, M3_NOMEM, "tune: embed inputs");
  if (!st) {
    m3_rng r = {seed};
    m3_fill_bf16(&r, table, T * H, 1.0f);
    for (size_t i = 0; i < T; i++) ids[i] = (int32_t)i;
    for (size_t i = T - 1; i > 0; i--) {
      const size_t j = m3_rng_next(&r) % (i + 1);
      const int32_t t = ids[i];
      ids[i] = ids[j], ids[j] = t;
    }
    st = m3_ref_embed(s->n, s->H, s->table_rows, ids, table, s->ref, e);
  }
  if (!st) st = m3_dev_alloc(&s->d_table, T * H * 2, e);
  if (!st) st = m3_dev_upload(s->d_table, table, T * H * 2, e);
  if (!st) st = m3_dev_alloc((void **)&s->d_ids, T * 4, e);
  if (!st) st = m3_dev_upload(s->d_ids, ids, T * 4, e);
  if (!st) st = m3_dev_alloc(&s->d_out, s->out_b * s->sets, e);
  if (!st) st = m3_dev_alloc((void **)&s->d_err, sizeof *s->d_err, e);
  if (!st) M3_CUDA(e, cudaMemsetAsync(s->d_err, 0, sizeof *s->d_err, rt->stream));
  free(table);
  free(ids);
  return st;
}

static m3_status prepare(void *x, int rep, m3_err *e) {
  em_state *s = x;
  if (rep == 0) {
    M3_CUDA(e, cudaMemsetAsync(s->d_out, 0xff, s->out_b, s->rt->stream));
    /* Per candidate: one bad tile's error word must not fail the next ones. */
    M3_CUDA(e, cudaMemsetAsync(s->d_err, 0, sizeof *s->d_err, s->rt->stream));
  }
  return m3_tune_flush_if_small(s->sets, 2 * s->out_b, s->rt->stream, e);
}

static m3_status launch(void *x, const m3_kernel *k, int rep, m3_err *e) {
  em_state *s = x;
  const int set = rep % s->sets, hook = m3_tune_test_hook(k);
  const int64_t n = hook == 1 ? s->n - 1 : s->n; /* broken: the last row's CTA left out */
  for (int twice = 0; twice < (hook == 2 ? 2 : 1); twice++)
    M3_TRY(m3_launch_embed(k, n, s->H, s->table_rows, s->d_ids + (size_t)set * s->n, s->d_table,
                           (char *)s->d_out + (size_t)set * s->out_b, s->d_err, s->rt->stream, e));
  return M3_OK;
}

static m3_status verify(void *x, char *detail, size_t n, m3_err *e) {
  em_state *s = x;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  M3_TRY(m3_tune_expect_same(s->d_out, s->ref, (size_t)s->n * s->H * 2, 2, "rows", detail, n, e));
  int32_t err = 0;
  M3_TRY(m3_dev_download(&err, s->d_err, sizeof err, e));
  if (err) {
    snprintf(detail, n, "error word %d set on valid ids", err);
    return M3_MISMATCH;
  }
  return M3_OK;
}

static double work(void *x) {
  em_state *s = x;
  return (double)s->n * s->H * 4 + (double)s->n * 4;
}

const m3_tune_op m3_tune_op_embed = {"embed", "GB/s", buckets, setup, prepare, launch, verify, work, teardown, NULL};
