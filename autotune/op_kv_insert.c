/* op_kv_insert.c - tuning adapter of templates/kv_insert.lua, the unfused KV
 * insert of a dense layer.  No buckets: the runtime never launches it (the
 * qk-norm kernel inserts K and V itself, runtime/forward.c qkv_rope_insert);
 * only the fused-vs-unfused benchmark (bench/cases_insert.c) does, with the
 * default tile, so no record could ever be read.  An explicit bucket tokens=N
 * (tests/check_tune_gpu.c drives the adapter directly) times N rows.
 * Inputs: qkv rows [N, (nq + 2 nkv) hd] N(0,1) bf16 whose K part stands for
 * the already normed and rotated K (the kernel copies it), distinct random
 * slots of a cache just big enough, rotating sets (qkv and cache); the cache
 * of set 0 poisoned before the checked launch.  Verification (tests/
 * check_qknorm_gpu.c): the whole cache bit-exact against m3_ref_kv_insert on
 * the same poisoned cache (K and V as bf16, or e4m3 of their float), so rows
 * written off their slot are caught too. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/op_util.h"
#include "runtime/check.h"
#include "runtime/ops.h"

typedef struct {
  m3_rt *rt;
  m3_qkr_args a;
  int sets;
  size_t qkv_b, kv_b;      /* one set */
  void *d_qkv, *d_kv, *d_slot;
  uint8_t *ref_kv;
} ki_state;

static int buckets(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  (void)c; (void)v; (void)out; (void)max;
  return 0; /* never looked up by bucket: see the header comment */
}

static void teardown(void *x) {
  ki_state *s = x;
  if (!s) return;
  m3_dev_free(s->d_qkv); m3_dev_free(s->d_kv); m3_dev_free(s->d_slot);
  free(s->ref_kv);
  free(s);
}

static m3_status setup(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                      void **out, m3_err *e) {
  (void)cfg; /* the key carries every shape */
  ki_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  const char *kv = m3_variant_axis(v, "kv");
  const int64_t N = m3_bucket_get(b, "tokens");
  s->a = (m3_qkr_args){.n_tokens = (int)N, .nq = (int)m3_variant_axis_int(v, "nq", 0),
                       .nkv = (int)m3_variant_axis_int(v, "nkv", 0), .head_dim = (int)m3_variant_axis_int(v, "hd", 0),
                       .block_size = (int)m3_variant_axis_int(v, "bs", 0), .kv_e4m3 = kv && !strcmp(kv, "e4m3")};
  const m3_qkr_args *a = &s->a;
  if (!kv || N < 1 || N > (1 << 24) || a->nq < 1 || a->nkv < 1 || a->head_dim < 1 || a->block_size < 1)
    return m3_errf(e, M3_KEY, "not a kv_insert key/bucket");
  const size_t row = (size_t)(a->nq + 2 * a->nkv) * a->head_dim;
  const int64_t pages = (N + a->block_size - 1) / a->block_size, slots = pages * a->block_size;
  s->qkv_b = m3_tune_up256((size_t)N * row * 2);
  s->kv_b = m3_tune_up256((size_t)slots * a->nkv * 2 * a->head_dim * (a->kv_e4m3 ? 1 : 2));
  s->sets = m3_tune_sets(s->qkv_b + s->kv_b);
  m3_bf16 *qkv = malloc(s->qkv_b);
  int64_t *perm = malloc(sizeof *perm * (size_t)slots);
  s->ref_kv = malloc(s->kv_b);
  m3_status st = qkv && perm && s->ref_kv ? M3_OK : m3_errf(e, M3_NOMEM, "tune: kv_insert inputs");
  if (!st) {
    m3_rng r = {seed};
    m3_fill_bf16(&r, qkv, (size_t)N * row, 1.0f);
    for (int64_t i = 0; i < slots; i++) perm[i] = i;
    for (int64_t i = slots - 1; i > 0; i--) {
      const int64_t j = (int64_t)(m3_rng_next(&r) % (uint64_t)(i + 1)), t = perm[i];
      perm[i] = perm[j], perm[j] = t;
    }
    memset(s->ref_kv, 0xff, s->kv_b);
    m3_ref_kv_insert(a, qkv, perm, s->ref_kv);
  }
  if (!st) st = m3_tune_upload_sets(&s->d_qkv, qkv, s->qkv_b, s->sets, rt->stream, e);
  if (!st) st = m3_dev_alloc(&s->d_kv, s->kv_b * s->sets, e);
  if (!st) st = m3_dev_alloc(&s->d_slot, sizeof *perm * (size_t)N, e);
  if (!st) st = m3_dev_upload(s->d_slot, perm, sizeof *perm * (size_t)N, e);
  free(qkv);
  free(perm);
  return st;
}

static m3_status prepare(void *x, int rep, m3_err *e) {
  ki_state *s = x;
  /* Other sets need no restore: the insert writes the same bytes each time. */
  if (rep == 0) M3_CUDA(e, cudaMemsetAsync(s->d_kv, 0xff, s->kv_b, s->rt->stream));
  return m3_tune_flush_if_small(s->sets, s->qkv_b + s->kv_b, s->rt->stream, e);
}

static m3_status launch(void *x, const m3_kernel *k, int rep, m3_err *e) {
  ki_state *s = x;
  const int set = rep % s->sets, hook = m3_tune_test_hook(k);
  m3_qkr_args a = s->a;
  if (hook == 1) a.n_tokens -= 1; /* broken: the last token's rows left out */
  for (int twice = 0; twice < (hook == 2 ? 2 : 1) && a.n_tokens > 0; twice++) /* an empty grid is a launch error */
    M3_TRY(m3_launch_kv_insert(k, &a, (const char *)s->d_qkv + (size_t)set * s->qkv_b, s->d_slot,
                               (char *)s->d_kv + (size_t)set * s->kv_b, s->rt->stream, e));
  return M3_OK;
}

static m3_status verify(void *x, char *detail, size_t n, m3_err *e) {
  ki_state *s = x;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  return m3_tune_expect_same(s->d_kv, s->ref_kv, s->kv_b, s->a.kv_e4m3 ? 1 : 2, "kv_cache", detail, n, e);
}

static double work(void *x) {
  ki_state *s = x;
  const m3_qkr_args *a = &s->a;
  /* K and V read as bf16, written as the cache's dtype; the slot */
  return (double)a->n_tokens * ((double)a->nkv * 2 * a->head_dim * (2 + (a->kv_e4m3 ? 1 : 2)) + 8);
}

const m3_tune_op m3_tune_op_kv_insert = {"kv_insert", "GB/s", buckets, setup, prepare, launch, verify, work,
                                         teardown, NULL};
