/* op_attention.c - tuning adapters of templates/attn_sparse.lua and
 * templates/attn_dense.lua, both modes.  Buckets are (tokens, ctx) as the
 * forward pass looks them up (powers of two of the query tokens and of the
 * longest visible length, runtime/forward.c kern()):
 *   sparse decode   batch 1 at 8K, 128K, 1M; batch 8 at 32K; batch 32 at 128K
 *   dense decode    batch 1 at 1K, 8K, 32K, 128K; batch 8 at 32K
 *   sparse prefill  a 256-token chunk as the first chunk (ctx 256) and ending
 *                   at 32K / 128K; 4096 tokens ending at 128K
 *   dense prefill   256 tokens at ctx 256 and 8K; 2048 tokens ending at 32K
 * Inputs: random K/V (finite as bf16 and e4m3) on distinct pages in a random
 * order, one page range per rotating set; sparse decode reads only its 16
 * selected blocks, so each sequence owns 64 pages that its blocks map onto
 * (block b -> page b mod 64) and the selections (local block + 15 random) use
 * distinct residues: no page is read twice in a launch.  Selections are
 * indexer-like: the local block first, then distinct random visible blocks,
 * -1 padding while fewer than topk blocks are visible.
 * Verification, as tests/check_attention_gpu.c: ||out - ref|| / ||ref|| <=
 * 1e-2 against m3_ref_sparse_attention / m3_ref_dense_attention on a sample
 * of the query tokens (the reference costs ~1e9 multiply-adds at most), and
 * no NaN/Inf: outputs are poisoned with NaN first. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/op_util.h"
#include "runtime/check.h"
#include "runtime/op_attention.h"

#define TOL 1e-2
#define DECODE_PAGES 64 /* pages a sparse-decode sequence owns (>= nkv * topk) */

typedef struct {
  m3_rt *rt;
  int sparse, decode, sets;
  m3_attn_args a;
  m3_tune_batch p;
  size_t kv_set, q_bytes, out_bytes, sel_bytes, per_set;
  m3_bf16 *q;                 /* host */
  uint8_t *kv;                /* host, set 0 */
  int32_t *sel;               /* host [nkv, N, topk] */
  void *d_q, *d_kv, *d_sel, *d_out, *ws;
  size_t ws_bytes;
  m3_tune_sample smp;
  m3_bf16 *ref;               /* [smp.n, nq, hd] */
  double keys;                /* keys attended, all heads groups */
} at_state;

static const char *const NAMES[2] = {"tokens", "ctx"};

static int is_decode(const m3_variant *v) {
  const char *m = m3_variant_axis(v, "mode");
  return m && !strcmp(m, "decode");
}

static int buckets_sparse(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  static const int64_t dec[][2] = {{1, 8192}, {1, 131072}, {1, 1048576}, {8, 32768}, {32, 131072}};
  static const int64_t pre[][2] = {{256, 256}, {256, 32768}, {256, 131072}, {4096, 131072}};
  (void)c;
  return is_decode(v) ? m3_tune_bucket_list(NAMES, dec, 5, out, max) : m3_tune_bucket_list(NAMES, pre, 4, out, max);
}

static int buckets_dense(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  static const int64_t dec[][2] = {{1, 1024}, {1, 8192}, {1, 32768}, {1, 131072}, {8, 32768}};
  static const int64_t pre[][2] = {{256, 256}, {256, 8192}, {2048, 32768}};
  (void)c;
  return is_decode(v) ? m3_tune_bucket_list(NAMES, dec, 5, out, max) : m3_tune_bucket_list(NAMES, pre, 3, out, max);
}

static void teardown(void *x) {
  at_state *s = x;
  if (!s) return;
  m3_tune_batch_free(&s->p);
  m3_tune_sample_free(&s->smp);
  m3_dev_free(s->d_q); m3_dev_free(s->d_kv); m3_dev_free(s->d_sel); m3_dev_free(s->d_out); m3_dev_free(s->ws);
  free(s->q); free(s->kv); free(s->sel); free(s->ref);
  free(s);
}

/* Indexer-like selections; in decode the blocks of one token (all KV heads)
 * have distinct residues mod DECODE_PAGES, so they sit on distinct pages. */
static m3_status make_sel(at_state *s, m3_rng *r, m3_err *e) {
  const m3_attn_args *a = &s->a;
  const int K = a->topk, N = a->n_tokens;
  const int64_t span = s->decode ? DECODE_PAGES : s->p.max_blocks;
  uint8_t *used = malloc((size_t)span + 1);
  s->sel = malloc(s->sel_bytes);
  if (!used || !s->sel) {
    free(used);
    return m3_errf(e, M3_NOMEM, "tune: selections");
  }
  s->keys = 0;
  for (int t = 0; t < N; t++) {
    const int64_t nb = s->p.pos[t] / a->block_size + 1, last = s->p.pos[t] - (nb - 1) * a->block_size + 1;
    /* Distinct residues across the heads when there are enough of them. */
    const int cross = s->decode && nb - 1 >= (int64_t)a->nkv * (K - 1) && span >= 1 + (int64_t)a->nkv * (K - 1);
    if (cross) memset(used, 0, (size_t)span);
    for (int g = 0; g < a->nkv; g++) {
      int32_t *row = s->sel + ((int64_t)g * N + t) * K;
      int k = 0;
      if (!cross) memset(used, 0, (size_t)span);
      if (nb <= K) {
        for (; k < nb; k++) row[k] = (int32_t)(nb - 1 - k);
      } else {
        row[k++] = (int32_t)(nb - 1);
        used[(nb - 1) % span] = 1;
        while (k < K) {
          const int32_t b = (int32_t)(m3_rng_next(r) % (uint64_t)(nb - 1));
          if (!used[b % span]) used[b % span] = 1, row[k++] = b;
        }
      }
      for (int j = 0; j < k; j++) s->keys += row[j] == nb - 1 ? (double)last : a->block_size;
      for (; k < K; k++) row[k] = -1;
    }
  }
  free(used);
  return M3_OK;
}

static m3_status setup(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                      void **out, m3_err *e) {
  (void)cfg; /* the key carries every shape */
  at_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  s->sparse = !strcmp(v->op, "attn_sparse");
  s->decode = is_decode(v);
  const char *kv = m3_variant_axis(v, "kv");
  const int64_t N = m3_bucket_get(b, "tokens"), ctx = m3_bucket_get(b, "ctx");
  m3_attn_args *a = &s->a;
  *a = (m3_attn_args){.n_tokens = (int)N, .nq = (int)m3_variant_axis_int(v, "nq", 0),
                      .nkv = (int)m3_variant_axis_int(v, "nkv", 0), .head_dim = (int)m3_variant_axis_int(v, "hd", 0),
                      .block_size = (int)m3_variant_axis_int(v, "bs", 0), .kv_e4m3 = kv && !strcmp(kv, "e4m3"),
                      .topk = s->sparse ? (int)m3_variant_axis_int(v, "topk", 0) : 0};
  if (!kv || a->nq < 1 || a->nkv < 1 || a->head_dim < 1 || a->block_size < 1 || (s->sparse && a->topk < 1))
    return m3_errf(e, M3_KEY, "not an attention key");
  const int hd = a->head_dim, bs = a->block_size;
  const size_t esz = a->kv_e4m3 ? 1 : 2, page = (size_t)a->nkv * bs * 2 * hd * esz;
  const int n_seqs = s->decode ? (int)N : 1;
  int64_t *lens = malloc(sizeof *lens * (size_t)n_seqs);
  if (!lens) return m3_errf(e, M3_NOMEM, "tune: lengths");
  for (int i = 0; i < n_seqs; i++) lens[i] = ctx;
  const int qlen = (int)N;
  const int64_t cap = s->sparse && s->decode ? DECODE_PAGES : 0;
  int64_t pages = 0;
  for (int i = 0; i < n_seqs; i++) {
    const int64_t nb = (ctx + bs - 1) / bs;
    pages += cap && nb > cap ? cap : nb;
  }
  s->kv_set = (size_t)pages * page;
  s->q_bytes = (size_t)N * a->nq * hd * 2;
  s->out_bytes = s->q_bytes;
  s->sel_bytes = sizeof(int32_t) * (size_t)a->nkv * N * (a->topk ? a->topk : 1);
  s->per_set = s->kv_set + s->q_bytes;
  s->sets = m3_tune_sets(s->per_set);
  m3_rng r = {seed};
  m3_status st = m3_tune_batch_make(&s->p, n_seqs, lens, s->decode ? NULL : &qlen, bs, cap, s->sets, &r, e);
  free(lens);
  M3_TRY(st);
  s->q = malloc(s->q_bytes);
  s->kv = malloc(s->kv_set);
  if (!s->q || !s->kv) return m3_errf(e, M3_NOMEM, "tune: attention inputs");
  /* q: bf16 of magnitude 2^-7..2; K/V finite in either dtype. */
  m3_tune_fill_finite(&r, s->q, s->q_bytes);
  m3_tune_fill_finite(&r, s->kv, s->kv_set);
  if (s->sparse) M3_TRY(make_sel(s, &r, e));
  else s->keys = (double)s->p.visible * a->nkv;
  M3_TRY(m3_tune_upload_sets(&s->d_q, s->q, s->q_bytes, s->sets, rt->stream, e));
  M3_TRY(m3_tune_upload_sets(&s->d_kv, s->kv, s->kv_set, s->sets, rt->stream, e));
  /* One head row of slack: the broken hook writes one head late. */
  M3_TRY(m3_dev_alloc(&s->d_out, s->out_bytes + (size_t)hd * 2, e));
  if (s->sparse) {
    M3_TRY(m3_dev_alloc(&s->d_sel, s->sel_bytes, e));
    M3_TRY(m3_dev_upload(s->d_sel, s->sel, s->sel_bytes, e));
  }
  /* The reference on a sample of ~1e9 multiply-adds. */
  const double per_tok = (double)a->nq * 2 * hd * (s->sparse ? (double)a->topk * bs : (double)ctx);
  const int want = (int)(1e9 / per_tok);
  M3_TRY(m3_tune_sample_make(&s->smp, &s->p, want < 1 ? 1 : want > 32 ? 32 : want, e));
  const int n = s->smp.n;
  m3_bf16 *sq = malloc((size_t)n * a->nq * hd * 2);
  int32_t *ssel = s->sparse ? malloc(sizeof *ssel * (size_t)a->nkv * n * a->topk) : NULL;
  s->ref = malloc((size_t)n * a->nq * hd * 2);
  if (!sq || !s->ref || (s->sparse && !ssel)) {
    free(sq); free(ssel);
    return m3_errf(e, M3_NOMEM, "tune: attention reference");
  }
  m3_tune_sample_rows(&s->smp, s->q, (size_t)a->nq * hd * 2, sq);
  for (int g = 0; s->sparse && g < a->nkv; g++)
    for (int i = 0; i < n; i++)
      memcpy(ssel + ((size_t)g * n + i) * a->topk, s->sel + ((size_t)g * N + s->smp.tok[i]) * a->topk,
             sizeof *ssel * a->topk);
  m3_attn_args sa = *a;
  sa.n_tokens = n;
  const m3_seq_batch sb = m3_tune_sample_batch(&s->smp, &s->p);
  st = s->sparse ? m3_ref_sparse_attention(&sa, &sb, sq, s->kv, ssel, s->ref, e)
                 : m3_ref_dense_attention(&sa, &sb, sq, s->kv, s->ref, e);
  free(sq);
  free(ssel);
  return st;
}

static m3_status prepare(void *x, int rep, m3_err *e) {
  at_state *s = x;
  if (rep == 0) M3_CUDA(e, cudaMemsetAsync(s->d_out, 0xff, s->out_bytes + (size_t)s->a.head_dim * 2, s->rt->stream));
  return m3_tune_flush_if_small(s->sets, s->per_set, s->rt->stream, e);
}

static m3_status launch(void *x, const m3_kernel *k, int rep, m3_err *e) {
  at_state *s = x;
  const int set = rep % s->sets, hook = m3_tune_test_hook(k), sm = s->rt->dev.sm_count;
  const m3_seq_batch db = m3_tune_batch_dev(&s->p, set);
  const void *q = (const char *)s->d_q + (size_t)set * s->q_bytes;
  /* The broken hook writes every row one head late (head 0 of token 0 keeps its poison). */
  void *out = (char *)s->d_out + (hook == 1 ? (size_t)s->a.head_dim * 2 : 0);
  if (s->decode) {
    const size_t need = m3_attn_workspace_bytes(k, &s->a, s->p.max_kv, sm);
    if (need > s->ws_bytes) { /* once per kernel, on its untimed first launch */
      m3_dev_free(s->ws);
      s->ws = NULL, s->ws_bytes = 0;
      M3_TRY(m3_dev_alloc(&s->ws, need, e));
      M3_TRY(m3_attn_workspace_init(s->ws, need, s->rt->stream, e));
      s->ws_bytes = need;
    }
  }
  for (int twice = 0; twice < (hook == 2 ? 2 : 1); twice++) {
    if (s->sparse)
      M3_TRY(m3_launch_attn_sparse(k, &s->a, &db, s->p.max_kv, sm, q, s->d_kv, s->d_sel, out, s->ws, s->ws_bytes,
                                   s->rt->stream, e));
    else
      M3_TRY(m3_launch_attn_dense(k, &s->a, &db, s->p.max_kv, sm, q, s->d_kv, out, s->ws, s->ws_bytes, s->rt->stream, e));
  }
  return M3_OK;
}

static m3_status verify(void *x, char *detail, size_t n, m3_err *e) {
  at_state *s = x;
  const size_t row = (size_t)s->a.nq * s->a.head_dim;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  m3_bf16 *g = malloc(s->out_bytes), *sg = malloc(sizeof *sg * row * s->smp.n);
  m3_status st = g && sg ? m3_dev_download(g, s->d_out, s->out_bytes, e) : m3_errf(e, M3_NOMEM, "verify");
  if (!st) {
    /* No element of the whole output may be NaN/Inf (a row never written
     * keeps its poison); the sample is compared with the reference. */
    m3_cmp all = m3_cmp_bf16_rel(g, g, s->out_bytes / 2, 1.0);
    m3_tune_sample_rows(&s->smp, g, row * 2, sg);
    m3_cmp c = m3_cmp_bf16_rel(sg, s->ref, row * s->smp.n, TOL);
    if (all.nonfinite || c.bad) {
      char cs[256];
      m3_cmp_str(all.nonfinite ? &all : &c, cs, sizeof cs);
      snprintf(detail, n, "%s (%d sampled tokens, tolerance rel. L2 %.0e)", cs, s->smp.n, TOL);
      st = M3_MISMATCH;
    }
  }
  free(g);
  free(sg);
  return st;
}

/* Decode: bytes of K/V read (+ q, out); prefill: FLOPs of QK^T + P.V over
 * the keys attended (4 hd per query head per key, as the benchmark). */
static double work(void *x) {
  at_state *s = x;
  const m3_attn_args *a = &s->a;
  const double kv_row = 2.0 * a->head_dim * (a->kv_e4m3 ? 1 : 2);
  if (s->decode) return s->keys * kv_row + (double)s->q_bytes + (double)s->out_bytes;
  return s->keys * (a->nq / a->nkv) * 4.0 * a->head_dim;
}

static const char *unit_of(void *x) { return ((at_state *)x)->decode ? "GB/s" : "TFLOP/s"; }

const m3_tune_op m3_tune_op_attn_sparse = {"attn_sparse", "GB/s", buckets_sparse, setup, prepare, launch, verify, work,
                                           teardown, unit_of};
const m3_tune_op m3_tune_op_attn_dense = {"attn_dense", "GB/s", buckets_dense, setup, prepare, launch, verify, work,
                                          teardown, unit_of};
