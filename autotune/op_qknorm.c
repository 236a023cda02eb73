/* op_qknorm.c - tuning adapter of templates/qknorm_rope.lua: buckets by token
 * count (decode batches 1..64, prefill chunks up to 8192), rotating input
 * sets, restore of the in-place q/k rows and of the caches, verification with
 * the GPU test's tolerance (<= 2 bf16 ulp or 1e-5 absolute, <= 1 e4m3 step). */
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "runtime/check.h"
#include "runtime/harness.h"
#include "runtime/ops.h"

#define MAXSETS 32
#define ROT_BYTES (256u << 20) /* > 4x the H200's 60 MB L2 */

typedef struct {
  m3_rt *rt;
  m3_qkr_args a;
  int sets;
  int64_t max_pos;
  size_t row, qkv_b, kv_b, ix_b, qo_b, iqo_b;
  void *pristine;             /* [N,row] bf16, the input of every set */
  void *qkv[MAXSETS], *kv[MAXSETS], *ix[MAXSETS], *qo[MAXSETS], *iqo[MAXSETS];
  void *w, *tab, *pos, *slot;
  m3_bf16 *ref_q, *ref_qkv;   /* reference of set 0 */
  uint8_t *ref_kv, *ref_ix, *ref_iqo;
} qk_state;

static int buckets(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  static const int64_t tokens[] = {1, 4, 16, 64, 256, 1024, 8192};
  (void)c; (void)v;
  int n = 0;
  for (size_t i = 0; i < sizeof tokens / sizeof *tokens && n < max; i++) {
    memset(&out[n], 0, sizeof out[n]);
    m3_bucket_add(&out[n], "tokens", tokens[i], NULL);
    n++;
  }
  return n;
}

static m3_status args_of(const m3_variant *v, int n, m3_qkr_args *a, m3_err *e) {
  const char *attn = m3_variant_axis(v, "attn"), *kv = m3_variant_axis(v, "kv"), *ix = m3_variant_axis(v, "idxk");
  if (!attn || !kv || !ix) return m3_errf(e, M3_KEY, "not a qknorm_rope key");
  memset(a, 0, sizeof *a);
  a->n_tokens = n;
  a->nq = (int)m3_variant_axis_int(v, "nq", 0);
  a->nkv = (int)m3_variant_axis_int(v, "nkv", 0);
  a->niq = (int)m3_variant_axis_int(v, "niq", 0);
  a->head_dim = (int)m3_variant_axis_int(v, "hd", 0);
  a->rotary_dim = (int)m3_variant_axis_int(v, "rot", 0);
  a->block_size = (int)m3_variant_axis_int(v, "bs", 0);
  a->insert = (int)m3_variant_axis_int(v, "insert", 0);
  a->kv_e4m3 = !strcmp(kv, "e4m3");
  a->idx_e4m3 = !strcmp(ix, "e4m3");
  a->eps = 1e-6f;
  return M3_OK;
}

static void teardown(void *p) {
  qk_state *s = p;
  if (!s) return;
  for (int i = 0; i < s->sets; i++) {
    m3_dev_free(s->qkv[i]); m3_dev_free(s->kv[i]); m3_dev_free(s->ix[i]);
    m3_dev_free(s->qo[i]); m3_dev_free(s->iqo[i]);
  }
  m3_dev_free(s->pristine); m3_dev_free(s->w); m3_dev_free(s->tab); m3_dev_free(s->pos); m3_dev_free(s->slot);
  free(s->ref_q); free(s->ref_qkv); free(s->ref_kv); free(s->ref_ix); free(s->ref_iqo);
  free(s);
}

static m3_status setup(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                      void **out, m3_err *e) {
  (void)cfg; /* the key carries every shape */
  qk_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  int N = (int)m3_bucket_get(b, "tokens");
  M3_TRY(args_of(v, N, &s->a, e));
  const m3_qkr_args *a = &s->a;
  int hd = a->head_dim, bs = a->block_size;
  s->row = (size_t)(a->nq + 2 * a->nkv + (a->niq ? a->niq + 1 : 0)) * hd;
  int64_t pages = (N + bs - 1) / bs;
  s->qkv_b = s->row * N * 2;
  s->kv_b = (size_t)pages * a->nkv * bs * 2 * hd * (a->kv_e4m3 ? 1 : 2);
  s->ix_b = (size_t)pages * bs * hd * (a->idx_e4m3 ? 1 : 2);
  s->qo_b = (size_t)N * a->nq * hd * 2;
  s->iqo_b = (size_t)N * (a->niq ? a->niq : 1) * hd * (a->idx_e4m3 ? 1 : 2);
  size_t per_set = s->qkv_b + s->kv_b + s->ix_b + s->qo_b + s->iqo_b;
  s->sets = (int)((ROT_BYTES + per_set - 1) / per_set);
  if (s->sets > MAXSETS) s->sets = MAXSETS;
  if (s->sets < 1) s->sets = 1;
  s->max_pos = 1 << 16;

  m3_rng r = {seed};
  m3_bf16 *qkv = malloc(s->qkv_b), *tab = malloc((size_t)s->max_pos * a->rotary_dim * 2), w[4 * 128];
  int64_t *pos = malloc(sizeof *pos * N), *slot = malloc(sizeof *slot * N);
  if (!qkv || !tab || !pos || !slot) {
    free(qkv); free(tab); free(pos); free(slot);
    return m3_errf(e, M3_NOMEM, "tune inputs");
  }
  m3_fill_bf16(&r, qkv, s->row * N, 1.0f);
  m3_fill_bf16(&r, w, 4 * 128, 0.2f);
  m3_rope_table(5e6f, a->rotary_dim, s->max_pos, tab);
  for (int t = 0; t < N; t++) pos[t] = (int64_t)(m3_rng_next(&r) % (uint64_t)s->max_pos), slot[t] = t;
  m3_status st = M3_OK;
  if (!st) st = m3_dev_alloc(&s->pristine, s->qkv_b, e);
  if (!st) st = m3_dev_upload(s->pristine, qkv, s->qkv_b, e);
  if (!st) st = m3_dev_alloc(&s->w, sizeof w, e);
  if (!st) st = m3_dev_upload(s->w, w, sizeof w, e);
  if (!st) st = m3_dev_alloc(&s->tab, (size_t)s->max_pos * a->rotary_dim * 2, e);
  if (!st) st = m3_dev_upload(s->tab, tab, (size_t)s->max_pos * a->rotary_dim * 2, e);
  if (!st) st = m3_dev_alloc(&s->pos, sizeof *pos * N, e);
  if (!st) st = m3_dev_upload(s->pos, pos, sizeof *pos * N, e);
  if (!st) st = m3_dev_alloc(&s->slot, sizeof *slot * N, e);
  if (!st) st = m3_dev_upload(s->slot, slot, sizeof *slot * N, e);
  for (int i = 0; i < s->sets && !st; i++) {
    st = m3_dev_alloc(&s->qkv[i], s->qkv_b, e);
    if (!st) st = m3_dev_alloc(&s->kv[i], s->kv_b, e);
    if (!st) st = m3_dev_alloc(&s->ix[i], s->ix_b, e);
    if (!st) st = m3_dev_alloc(&s->qo[i], s->qo_b, e);
    if (!st) st = m3_dev_alloc(&s->iqo[i], s->iqo_b, e);
  }
  if (!st) {
    s->ref_qkv = malloc(s->qkv_b);
    s->ref_q = malloc(s->qo_b);
    s->ref_kv = malloc(s->kv_b);
    s->ref_ix = malloc(s->ix_b);
    s->ref_iqo = malloc(s->iqo_b);
    if (!s->ref_qkv || !s->ref_q || !s->ref_kv || !s->ref_ix || !s->ref_iqo) st = m3_errf(e, M3_NOMEM, "reference");
  }
  if (!st) {
    memcpy(s->ref_qkv, qkv, s->qkv_b);
    memset(s->ref_kv, 0xff, s->kv_b);
    memset(s->ref_ix, 0xff, s->ix_b);
    memset(s->ref_iqo, 0xff, s->iqo_b);
    m3_ref_qknorm_rope(a, s->ref_qkv, w, w + 128, a->niq ? w + 256 : NULL, a->niq ? w + 384 : NULL, tab, pos,
                       a->insert ? slot : NULL, a->insert ? slot : NULL, s->ref_kv, s->ref_ix, s->ref_q,
                       a->niq ? s->ref_iqo : NULL);
    /* The kernel leaves qkv's q and index-q raw when q_out / index_q_out are
     * given (runtime/ops.h): expect the input there. */
    for (int t = 0; t < N; t++) {
      memcpy(s->ref_qkv + (size_t)t * s->row, qkv + (size_t)t * s->row, (size_t)a->nq * hd * 2);
      if (a->niq) {
        size_t off = (size_t)t * s->row + (size_t)(a->nq + 2 * a->nkv) * hd;
        memcpy(s->ref_qkv + off, qkv + off, (size_t)a->niq * hd * 2);
      }
    }
  }
  free(qkv); free(tab); free(pos); free(slot);
  return st;
}

static m3_status prepare(void *p, int rep, m3_err *e) {
  qk_state *s = p;
  int i = rep % s->sets;
  cudaStream_t st = s->rt->stream;
  M3_CUDA(e, cudaMemcpyAsync(s->qkv[i], s->pristine, s->qkv_b, cudaMemcpyDeviceToDevice, st));
  if (rep == 0) {
    M3_CUDA(e, cudaMemsetAsync(s->kv[i], 0xff, s->kv_b, st));
    M3_CUDA(e, cudaMemsetAsync(s->ix[i], 0xff, s->ix_b, st));
    M3_CUDA(e, cudaMemsetAsync(s->qo[i], 0xff, s->qo_b, st));
    M3_CUDA(e, cudaMemsetAsync(s->iqo[i], 0xff, s->iqo_b, st));
  }
  return M3_OK;
}

static m3_status launch(void *p, const m3_kernel *k, int rep, m3_err *e) {
  qk_state *s = p;
  int i = rep % s->sets, hook = m3_tune_test_hook(k);
  m3_qkr_args a = s->a;
  if (hook == 1 && a.n_tokens > 1) a.n_tokens -= 1; /* skips the tail: must be caught */
  m3_bf16 *w = s->w;
  for (int twice = 0; twice < (hook == 2 ? 2 : 1); twice++)
    M3_TRY(m3_launch_qknorm_rope(k, &a, s->qkv[i], w, w + 128, a.niq ? w + 256 : NULL, a.niq ? w + 384 : NULL,
                                 s->tab, s->max_pos, s->pos, a.insert ? s->slot : NULL, a.insert ? s->slot : NULL,
                                 s->kv[i], s->ix[i], s->qo[i], a.niq ? s->iqo[i] : NULL, s->rt->stream, e));
  return M3_OK;
}

static m3_status verify(void *p, char *detail, size_t n, m3_err *e) {
  qk_state *s = p;
  const m3_qkr_args *a = &s->a;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  size_t big = s->qkv_b;
  if (s->kv_b > big) big = s->kv_b;
  if (s->qo_b > big) big = s->qo_b;
  if (s->ix_b > big) big = s->ix_b;
  if (s->iqo_b > big) big = s->iqo_b;
  uint8_t *buf = malloc(big);
  if (!buf) return m3_errf(e, M3_NOMEM, "verify");
  struct { void *dev; const void *ref; size_t bytes; int e4m3; const char *name; int on; } parts[] = {
      {s->qkv[0], s->ref_qkv, s->qkv_b, 0, "qkv", 1},
      {s->qo[0], s->ref_q, s->qo_b, 0, "q_out", 1},
      {s->kv[0], s->ref_kv, s->kv_b, a->kv_e4m3, "kv_cache", a->insert},
      {s->ix[0], s->ref_ix, s->ix_b, a->idx_e4m3, "index_cache", a->insert && a->niq},
      {s->iqo[0], s->ref_iqo, s->iqo_b, a->idx_e4m3, "index_q_out", a->niq > 0},
  };
  m3_status st = M3_OK;
  for (size_t i = 0; i < sizeof parts / sizeof *parts && st == M3_OK; i++) {
    if (!parts[i].on) continue;
    st = m3_dev_download(buf, parts[i].dev, parts[i].bytes, e);
    if (st) break;
    m3_cmp c = parts[i].e4m3 ? m3_cmp_e4m3_steps(buf, parts[i].ref, parts[i].bytes, 1)
                             : m3_cmp_bf16_tol((m3_bf16 *)buf, parts[i].ref, parts[i].bytes / 2, 2.0, 1e-5);
    if (c.bad) {
      char cs[256];
      m3_cmp_str(&c, cs, sizeof cs);
      snprintf(detail, n, "%s: %s", parts[i].name, cs);
      st = M3_MISMATCH;
    }
  }
  free(buf);
  return st;
}

static double work(void *p) {
  qk_state *s = p;
  const m3_qkr_args *a = &s->a;
  double per_tok = (double)s->row * 2                       /* read the row */
                   + (double)a->nq * a->head_dim * 2         /* q_out */
                   + (double)a->nkv * a->head_dim * 2        /* k in place */
                   + (a->niq ? (double)a->head_dim * 2 : 0)  /* index-k in place */
                   + (a->niq ? (double)a->niq * a->head_dim * (a->idx_e4m3 ? 1 : 2) : 0)
                   + 8 + (a->insert ? 16 : 0) + a->rotary_dim * 2;
  if (a->insert) per_tok += (double)a->nkv * a->head_dim * 2 * (a->kv_e4m3 ? 1 : 2) +
                            (a->niq ? (double)a->head_dim * (a->idx_e4m3 ? 1 : 2) : 0);
  return per_tok * a->n_tokens;
}

const m3_tune_op m3_tune_op_qknorm = {"qknorm_rope", "GB/s", buckets, setup, prepare, launch, verify, work, teardown};
