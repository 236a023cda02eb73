/* op_route.c - tuning adapter of templates/moe_route.lua.  The MoE layer
 * (runtime/op_ffn.c m3_moe_forward) looks its kernels up by the step's token
 * count rounded up to a power of two: stage=route at every step, so tokens =
 * 1, 8, 256, 4096; stage=group only on the prefill path (> 8 rows; the decode
 * path's GEMVs read the pairs ungrouped), so 256, 4096 (it groups those
 * tokens' top-k pairs in one CTA).  stage=fused has no caller in the runtime
 * (the decode path routes without grouping): no buckets, and setup refuses
 * it.  Keys for another expert count or top-k than the config's: none.
 * Inputs: route: fp32 logits N(0, 2^2) and an e_score_correction_bias
 * N(0, 0.1^2), as the GPU tests; group: expert ids uniform in [0, E); both in
 * rotating sets, outputs poisoned.  Verification (tests/check_ffn_gpu.c):
 * bit-exact against m3_ref_route (ids and weights) / m3_ref_moe_group
 * (counts, offsets, the stable perm), plus inv[perm[i]] = i, tok[i] =
 * perm[i] / K and a clear error word. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/op_util.h"
#include "runtime/check.h"
#include "runtime/op_ffn.h"

typedef struct {
  m3_rt *rt;
  int group, sets;
  m3_route_args a;
  int64_t P;                 /* pairs: tokens x top-k */
  size_t in_b, out_b;        /* one set: logits | ids in, every output */
  void *d_in, *d_out, *d_bias;
  int32_t *d_err;
  /* output offsets inside one set's d_out */
  size_t o_ids, o_w, o_cnt, o_off, o_perm, o_inv, o_tok;
  int32_t *ref_ids, *ref_cnt, *ref_off, *ref_perm;
  float *ref_w;
} rt_state;

static int buckets(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  const char *stage = m3_variant_axis(v, "stage");
  if (!stage || m3_variant_axis_int(v, "experts", 0) != c->num_local_experts ||
      m3_variant_axis_int(v, "topk", 0) != c->num_experts_per_tok || !m3_config_n_moe_layers(c))
    return 0;
  const int group = !strcmp(stage, "group");
  if (!group && strcmp(stage, "route")) return 0; /* fused: no runtime caller */
  int64_t rows[M3_TUNE_N_STEPS];
  int n = 0;
  for (int i = 0; i < M3_TUNE_N_STEPS; i++)
    if (!group || m3_tune_steps[i] > M3_TUNE_DECODE_ROWS) rows[n++] = m3_tune_steps[i];
  return m3_tune_rows_buckets(rows, n, out, max);
}

static void teardown(void *x) {
  rt_state *s = x;
  if (!s) return;
  m3_dev_free(s->d_in); m3_dev_free(s->d_out); m3_dev_free(s->d_bias); m3_dev_free(s->d_err);
  free(s->ref_ids); free(s->ref_cnt); free(s->ref_off); free(s->ref_perm); free(s->ref_w);
  free(s);
}

static m3_status setup(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                      void **out, m3_err *e) {
  rt_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  const char *stage = m3_variant_axis(v, "stage"), *lg = m3_variant_axis(v, "logits");
  const int64_t n = m3_bucket_get(b, "tokens");
  if (!stage || !lg || n < 1 || n > (1 << 24)) return m3_errf(e, M3_KEY, "not a moe_route key/bucket");
  if (!strcmp(stage, "fused"))
    return m3_errf(e, M3_KEY, "moe_route stage=fused is not tuned: the runtime never launches it");
  s->group = !strcmp(stage, "group");
  s->a = (m3_route_args){.n_tokens = (int)n, .n_experts = (int)m3_variant_axis_int(v, "experts", 0),
                         .topk = (int)m3_variant_axis_int(v, "topk", 0),
                         .renormalize = (int)m3_variant_axis_int(v, "renorm", 0),
                         .routed_scaling = (float)cfg->routed_scaling_factor, .logits_bf16 = !strcmp(lg, "bf16")};
  const int64_t E = s->a.n_experts, K = s->a.topk;
  if (E < 1 || K < 1 || K > E) return m3_errf(e, M3_KEY, "moe_route: experts %lld, topk %lld", (long long)E, (long long)K);
  s->P = n * K;
  const size_t P = (size_t)s->P;
  s->in_b = m3_tune_up256(s->group ? P * 4 : (size_t)(n * E) * (s->a.logits_bf16 ? 2 : 4));
  if (s->group) {
    s->o_cnt = 0;
    s->o_off = s->o_cnt + m3_tune_up256((size_t)E * 4);
    s->o_perm = s->o_off + m3_tune_up256((size_t)(E + 1) * 4);
    s->o_inv = s->o_perm + m3_tune_up256(P * 4);
    s->o_tok = s->o_inv + m3_tune_up256(P * 4);
    s->out_b = s->o_tok + m3_tune_up256(P * 4);
  } else {
    s->o_ids = 0;
    s->o_w = m3_tune_up256(P * 4);
    s->out_b = s->o_w + m3_tune_up256(P * 4);
  }
  s->sets = m3_tune_sets(s->in_b + s->out_b);
  m3_rng r = {seed};
  void *in = malloc(s->in_b);
  float *bias = malloc(sizeof *bias * (size_t)E);
  s->ref_ids = malloc(P * 4);
  s->ref_w = malloc(P * 4);
  s->ref_cnt = malloc((size_t)E * 4);
  s->ref_off = malloc((size_t)(E + 1) * 4);
  s->ref_perm = malloc(P * 4);
  m3_status st = in && bias && s->ref_ids && s->ref_w && s->ref_cnt && s->ref_off && s->ref_perm
                     ? M3_OK
                     : m3_errf(e, M3_NOMEM, "tune: moe_route inputs");
  if (!st && s->group) {
    int32_t *ids = in;
    for (size_t p = 0; p < P; p++) ids[p] = (int32_t)(m3_rng_next(&r) % (uint64_t)E);
    st = m3_ref_moe_group(n, (int)K, (int)E, ids, s->ref_cnt, s->ref_off, s->ref_perm, e);
  } else if (!st) {
    const size_t cnt = (size_t)(n * E);
    if (s->a.logits_bf16) m3_fill_bf16(&r, in, cnt, 2.0f);
    else m3_fill_f32(&r, in, cnt, 2.0f);
    m3_fill_f32(&r, bias, (size_t)E, 0.1f);
    st = m3_ref_route(&s->a, in, bias, s->ref_ids, s->ref_w, e);
  }
  if (!st) st = m3_tune_upload_sets(&s->d_in, in, s->in_b, s->sets, rt->stream, e);
  if (!st) st = m3_dev_alloc(&s->d_out, s->out_b * s->sets, e);
  if (!st) st = m3_dev_alloc(&s->d_bias, sizeof *bias * (size_t)E, e);
  if (!st) st = m3_dev_upload(s->d_bias, bias, sizeof *bias * (size_t)E, e);
  if (!st) st = m3_dev_alloc((void **)&s->d_err, sizeof *s->d_err, e);
  if (!st) M3_CUDA(e, cudaMemsetAsync(s->d_err, 0, sizeof *s->d_err, rt->stream));
  free(in);
  free(bias);
  return st;
}

static m3_status prepare(void *x, int rep, m3_err *e) {
  rt_state *s = x;
  if (rep == 0) {
    M3_CUDA(e, cudaMemsetAsync(s->d_out, 0xff, s->out_b, s->rt->stream));
    /* Per candidate: one bad tile's error word must not fail the next ones. */
    if (s->d_err) M3_CUDA(e, cudaMemsetAsync(s->d_err, 0, sizeof *s->d_err, s->rt->stream));
  }
  return m3_tune_flush_if_small(s->sets, s->in_b + s->out_b, s->rt->stream, e);
}

static m3_status launch(void *x, const m3_kernel *k, int rep, m3_err *e) {
  rt_state *s = x;
  const int set = rep % s->sets, hook = m3_tune_test_hook(k);
  const char *in = (const char *)s->d_in + (size_t)set * s->in_b;
  char *o = (char *)s->d_out + (size_t)set * s->out_b;
  m3_route_args a = s->a;
  if (hook == 1) a.n_tokens -= 1; /* broken: the last token (the last warp's) left out */
  for (int twice = 0; twice < (hook == 2 ? 2 : 1); twice++) {
    if (s->group)
      M3_TRY(m3_launch_moe_group(k, a.n_tokens, a.topk, a.n_experts, (const int32_t *)in, (int32_t *)(o + s->o_cnt),
                                 (int32_t *)(o + s->o_off), (int32_t *)(o + s->o_perm), (int32_t *)(o + s->o_inv),
                                 (int32_t *)(o + s->o_tok), s->d_err, s->rt->stream, e));
    else
      M3_TRY(m3_launch_route(k, &a, in, s->d_bias, (int32_t *)(o + s->o_ids), (float *)(o + s->o_w), s->rt->stream,
                             e));
  }
  return M3_OK;
}

static m3_status verify(void *x, char *detail, size_t n, m3_err *e) {
  rt_state *s = x;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  const size_t P = (size_t)s->P, E = (size_t)s->a.n_experts;
  const char *o = s->d_out;
  if (!s->group) {
    M3_TRY(m3_tune_expect_same(o + s->o_ids, s->ref_ids, P * 4, 4, "ids", detail, n, e));
    return m3_tune_expect_same(o + s->o_w, s->ref_w, P * 4, 4, "weights", detail, n, e);
  }
  M3_TRY(m3_tune_expect_same(o + s->o_cnt, s->ref_cnt, E * 4, 4, "counts", detail, n, e));
  M3_TRY(m3_tune_expect_same(o + s->o_off, s->ref_off, (E + 1) * 4, 4, "offsets", detail, n, e));
  M3_TRY(m3_tune_expect_same(o + s->o_perm, s->ref_perm, P * 4, 4, "perm (stable)", detail, n, e));
  int32_t *g = malloc(2 * P * 4), err = 0;
  if (!g) return m3_errf(e, M3_NOMEM, "verify");
  m3_status st = m3_dev_download(g, o + s->o_inv, P * 4, e);
  if (!st) st = m3_dev_download(g + P, o + s->o_tok, P * 4, e);
  if (!st) st = m3_dev_download(&err, s->d_err, sizeof err, e);
  for (size_t i = 0; !st && i < P; i++) {
    const int32_t p = s->ref_perm[i];
    if (g[p] != (int32_t)i || g[P + i] != p / s->a.topk) {
      snprintf(detail, n, "grouped row %zu (pair %d): inv %d, tok %d", i, p, g[p], g[P + i]);
      st = M3_MISMATCH;
    }
  }
  if (!st && err) snprintf(detail, n, "error word %d set on valid ids", err), st = M3_MISMATCH;
  free(g);
  return st;
}

static double work(void *x) {
  rt_state *s = x;
  const double P = (double)s->P, E = s->a.n_experts;
  if (s->group) return P * 4 + E * 8 + 4 + P * 12; /* ids in; counts, offsets, perm, inv, tok out */
  return (double)s->a.n_tokens * E * (s->a.logits_bf16 ? 2 : 4) + E * 4 + P * 8;
}

const m3_tune_op m3_tune_op_route = {"moe_route", "GB/s", buckets, setup, prepare, launch, verify, work, teardown,
                                     NULL};
