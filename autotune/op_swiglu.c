/* op_swiglu.c - tuning adapter of templates/swiglu.lua.  The runtime looks
 * its kernel up by the rows of the launch rounded up to a power of two
 * (bucket "tokens"): the dense MLP's rows are the step's tokens
 * (runtime/forward.c dense_mlp), the MoE layer's are (token, expert) pairs
 * (runtime/op_ffn.c m3_moe_forward: top-k per token, plus one per token for
 * a shared expert as wide as the routed ones at decode, where it rides in
 * the routed GEMVs; at prefill the shared expert is its own launch of one
 * row per token).  So the buckets are those rows for decode batches 1 and 8
 * and prefill chunks of 256 and 4096 tokens: M3's dense MLP (inter 12288)
 * 1, 8, 256, 4096; its experts (inter 3072, top-4 + a shared expert of the
 * same width) 8, 64 (decode), 256 (shared), 1024, 4096 (shared), 16384.
 * Inputs: the packed gate|up GEMM output [n, 2I], N(0, 4^2) bf16 so that both
 * clamps (limit 7) are hit, rotating sets; output poisoned.  Verification:
 * bit-exact against m3_ref_swiglu_oai row by row (the launcher's contract,
 * tests/check_ffn_gpu.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/op_util.h"
#include "runtime/check.h"
#include "runtime/op_ffn.h"

#define SLACK 16 /* bytes: the broken hook writes 8 elements late */

typedef struct {
  m3_rt *rt;
  int64_t n, inter;
  int sets;
  size_t gu_bytes, out_bytes;
  void *d_gu, *d_out;
  m3_bf16 *ref;
} sw_state;

static int buckets(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  const int64_t inter = m3_variant_axis_int(v, "inter", 0), K = c->num_experts_per_tok;
  const int64_t I = c->intermediate_size, Is = m3_config_shared_width(c);
  const int moe = m3_config_n_moe_layers(c) > 0, dense = m3_config_n_moe_layers(c) < c->num_hidden_layers;
  int64_t rows[3 * M3_TUNE_N_STEPS];
  int n = 0;
  for (int i = 0; i < M3_TUNE_N_STEPS; i++) {
    const int64_t T = m3_tune_steps[i], decode = T <= M3_TUNE_DECODE_ROWS;
    if (dense && inter == c->dense_intermediate_size) rows[n++] = T;
    if (moe && inter == I) rows[n++] = T * K + (decode && Is == I ? T : 0);
    if (moe && Is > 0 && inter == Is && !(decode && Is == I)) rows[n++] = T;
  }
  return m3_tune_rows_buckets(rows, n, out, max);
}

static void teardown(void *x) {
  sw_state *s = x;
  if (!s) return;
  m3_dev_free(s->d_gu); m3_dev_free(s->d_out);
  free(s->ref);
  free(s);
}

static m3_status setup(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                      void **out, m3_err *e) {
  (void)cfg; /* the key carries every shape */
  sw_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  s->n = m3_bucket_get(b, "tokens");
  s->inter = m3_variant_axis_int(v, "inter", 0);
  const float alpha = (float)(m3_variant_axis_int(v, "alpha_e6", 0) / 1e6),
              limit = (float)(m3_variant_axis_int(v, "limit_e6", 0) / 1e6),
              beta = (float)(m3_variant_axis_int(v, "beta_e6", 0) / 1e6);
  if (s->inter < 1 || s->n < 1) return m3_errf(e, M3_KEY, "not a swiglu key/bucket");
  s->gu_bytes = (size_t)s->n * 2 * s->inter * 2;
  s->out_bytes = (size_t)s->n * s->inter * 2;
  s->sets = m3_tune_sets(s->gu_bytes + s->out_bytes);
  m3_bf16 *gu = malloc(s->gu_bytes);
  s->ref = malloc(s->out_bytes);
  if (!gu || !s->ref) {
    free(gu);
    return m3_errf(e, M3_NOMEM, "tune: swiglu inputs");
  }
  m3_rng r = {seed};
  m3_fill_bf16(&r, gu, s->gu_bytes / 2, 4.0f);
  for (int64_t t = 0; t < s->n; t++)
    m3_ref_swiglu_oai(s->inter, gu + t * 2 * s->inter, gu + t * 2 * s->inter + s->inter, alpha, limit, beta,
                      s->ref + t * s->inter);
  m3_status st = m3_tune_upload_sets(&s->d_gu, gu, s->gu_bytes, s->sets, rt->stream, e);
  if (!st) st = m3_dev_alloc(&s->d_out, (s->out_bytes + SLACK) * s->sets, e);
  free(gu);
  return st;
}

static m3_status prepare(void *x, int rep, m3_err *e) {
  sw_state *s = x;
  if (rep == 0) M3_CUDA(e, cudaMemsetAsync(s->d_out, 0xff, s->out_bytes + SLACK, s->rt->stream));
  return m3_tune_flush_if_small(s->sets, s->gu_bytes + s->out_bytes, s->rt->stream, e);
}

static m3_status launch(void *x, const m3_kernel *k, int rep, m3_err *e) {
  sw_state *s = x;
  const int set = rep % s->sets, hook = m3_tune_test_hook(k);
  const void *gu = (const char *)s->d_gu + (size_t)set * s->gu_bytes;
  void *out = (char *)s->d_out + (size_t)set * (s->out_bytes + SLACK) + (hook == 1 ? SLACK : 0);
  for (int twice = 0; twice < (hook == 2 ? 2 : 1); twice++)
    M3_TRY(m3_launch_swiglu(k, s->n, s->inter, gu, out, s->rt->stream, e));
  return M3_OK;
}

static m3_status verify(void *x, char *detail, size_t n, m3_err *e) {
  sw_state *s = x;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  m3_bf16 *g = malloc(s->out_bytes);
  if (!g) return m3_errf(e, M3_NOMEM, "verify");
  m3_status st = m3_dev_download(g, s->d_out, s->out_bytes, e);
  if (!st) {
    m3_cmp c = m3_cmp_bf16_ulp(g, s->ref, s->out_bytes / 2, 0.0);
    if (c.bad) {
      char cs[256];
      m3_cmp_str(&c, cs, sizeof cs);
      snprintf(detail, n, "not bit-exact: %s", cs);
      st = M3_MISMATCH;
    }
  }
  free(g);
  return st;
}

static double work(void *x) {
  sw_state *s = x;
  return (double)(s->gu_bytes + s->out_bytes);
}

const m3_tune_op m3_tune_op_swiglu = {"swiglu", "GB/s", buckets, setup, prepare, launch, verify, work, teardown, NULL};
