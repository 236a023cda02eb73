/* op_indexer.c - tuning adapters of templates/index_decode.lua and
 * templates/index_prefill.lua (both stages).  Buckets are (tokens, ctx) as
 * the forward pass looks them up (runtime/forward.c kern(): powers of two of
 * the query tokens and of the longest visible length):
 *   decode   batch 1 at 8K, 128K, 1M; batch 8 at 32K; batch 32 at 128K;
 *   prefill  a chunk of 256 (the default chunk) as the first chunk (ctx 256)
 *            and after 32K / 128K of history; 4096 tokens ending at 128K.
 * Inputs: random index-K pages (finite as bf16 and e4m3) on distinct pages in
 * a random order, one page range per rotating set (m3_tune_batch).  The top-k
 * stage reads random block scores instead of the score stage's output: it is
 * pure ordering, so it is checked exactly.
 * Verification, as tests/check_indexer_gpu.c: top-k lists equal to
 * m3_ref_index_topk's except near-tie swaps (forced reference scores within
 * 1e-5 relative, never an exact tie, at most 2 + 1% of the rows); prefill
 * block scores within 1e-5 * ||q|| * max ||k|| of m3_ref_index_scores on a
 * sample of the chunk's tokens (the reference of a whole 4096-token chunk
 * over 128K keys would take a minute).  NaN never passes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/op_util.h"
#include "runtime/check.h"
#include "runtime/op_indexer.h"

enum { DECODE, SCORE, TOPK };

typedef struct {
  m3_rt *rt;
  int kind;
  m3_idx_args a;
  m3_tune_batch p;
  size_t esz, page_bytes, iq_bytes, per_set, out_bytes, sc_bytes;
  uint8_t *iq, *cache;        /* host, set 0 */
  void *d_iq, *d_cache, *d_out, *d_sc, *ws;
  size_t ws_bytes;
  float *h_sc;                /* TOPK: the scores of every set */
  int32_t *ref_topk;          /* [H, N, K]: DECODE, TOPK */
  float *forced;              /* [H, N, max_blocks]: DECODE, TOPK */
  m3_tune_sample smp;         /* SCORE: tokens checked */
  float *ref_raw;             /* SCORE: [H, smp.n, max_blocks] */
  double *knorm;              /* SCORE: ||k|| per cache row of set 0 */
} ix_state;

static int buckets_decode(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  static const int64_t tc[][2] = {{1, 8192}, {1, 131072}, {1, 1048576}, {8, 32768}, {32, 131072}};
  static const char *const names[2] = {"tokens", "ctx"};
  (void)c; (void)v;
  return m3_tune_bucket_list(names, tc, (int)(sizeof tc / sizeof *tc), out, max);
}

static int buckets_prefill(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  static const int64_t tc[][2] = {{256, 256}, {256, 32768}, {256, 131072}, {4096, 131072}};
  static const char *const names[2] = {"tokens", "ctx"};
  (void)c; (void)v;
  return m3_tune_bucket_list(names, tc, (int)(sizeof tc / sizeof *tc), out, max);
}

static void teardown(void *q) {
  ix_state *s = q;
  if (!s) return;
  m3_tune_batch_free(&s->p);
  m3_tune_sample_free(&s->smp);
  m3_dev_free(s->d_iq); m3_dev_free(s->d_cache); m3_dev_free(s->d_out); m3_dev_free(s->d_sc); m3_dev_free(s->ws);
  free(s->iq); free(s->cache); free(s->h_sc); free(s->ref_topk); free(s->forced); free(s->ref_raw); free(s->knorm);
  free(s);
}

static m3_status args_of(const m3_variant *v, int n, int64_t max_blocks, m3_idx_args *a, m3_err *e) {
  const char *ix = m3_variant_axis(v, "idxk");
  if (!ix) return m3_errf(e, M3_KEY, "not an indexer key");
  *a = (m3_idx_args){.n_tokens = n, .n_heads = (int)m3_variant_axis_int(v, "heads", 0),
                     .head_dim = (int)m3_variant_axis_int(v, "hd", 0), .block_size = (int)m3_variant_axis_int(v, "bs", 0),
                     .topk = (int)m3_variant_axis_int(v, "topk", 0), .init_blocks = (int)m3_variant_axis_int(v, "init", 0),
                     .local_blocks = (int)m3_variant_axis_int(v, "local", 0), .idx_e4m3 = !strcmp(ix, "e4m3"),
                     .max_blocks = (int)max_blocks};
  if (a->n_heads < 1 || a->head_dim < 1 || a->block_size < 1 || a->topk < 1) return m3_errf(e, M3_KEY, "indexer key axes");
  return M3_OK;
}

/* The reference of the DECODE / TOPK output: top-k and forced scores from raw scores. */
static m3_status ref_lists(ix_state *s, const float *raw, m3_err *e) {
  const m3_seq_batch hb = m3_tune_batch_host(&s->p);
  const size_t nsc = (size_t)s->a.n_heads * s->a.n_tokens * s->a.max_blocks;
  s->ref_topk = malloc(s->out_bytes);
  s->forced = malloc(sizeof *s->forced * nsc);
  if (!s->ref_topk || !s->forced) return m3_errf(e, M3_NOMEM, "tune: indexer reference");
  memcpy(s->forced, raw, sizeof *s->forced * nsc);
  M3_TRY(m3_ref_index_topk(&s->a, &hb, raw, s->ref_topk, e));
  return m3_ref_index_force(&s->a, &hb, s->forced, e);
}

static m3_status setup_kind(m3_rt *rt, const m3_variant *v, const m3_bucket *b, uint64_t seed, int kind, void **out,
                            m3_err *e) {
  ix_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  s->kind = kind;
  const int64_t N = m3_bucket_get(b, "tokens"), ctx = m3_bucket_get(b, "ctx");
  M3_TRY(args_of(v, (int)N, 1, &s->a, e));
  m3_idx_args *a = &s->a;
  const int bs = a->block_size, H = a->n_heads, hd = a->head_dim;
  s->esz = a->idx_e4m3 ? 1 : 2;
  s->page_bytes = (size_t)bs * hd * s->esz;
  /* Decode: N sequences of ctx tokens; prefill: one chunk of N at its end. */
  const int n_seqs = kind == DECODE ? (int)N : 1;
  int64_t *lens = malloc(sizeof *lens * (size_t)n_seqs);
  if (!lens) return m3_errf(e, M3_NOMEM, "tune: lengths");
  for (int i = 0; i < n_seqs; i++) lens[i] = ctx;
  const int qlen = (int)N;
  const int64_t nb = (ctx + bs - 1) / bs;
  s->iq_bytes = (size_t)N * H * hd * s->esz;
  s->out_bytes = sizeof(int32_t) * (size_t)H * N * a->topk;
  s->sc_bytes = sizeof(float) * (size_t)H * N * nb;
  const size_t cache_set = (size_t)n_seqs * nb * s->page_bytes;
  s->per_set = kind == TOPK ? s->sc_bytes : cache_set + s->iq_bytes;
  const int sets = m3_tune_sets(s->per_set);
  m3_rng r = {seed};
  m3_status st = m3_tune_batch_make(&s->p, n_seqs, lens, kind == DECODE ? NULL : &qlen, bs, 0, kind == TOPK ? 1 : sets,
                                    &r, e);
  free(lens);
  M3_TRY(st);
  a->max_blocks = (int)s->p.max_blocks;
  M3_TRY(m3_dev_alloc(&s->d_out, s->out_bytes, e));
  if (kind == TOPK) {
    const size_t nsc = s->sc_bytes / sizeof(float);
    s->h_sc = malloc(s->sc_bytes);
    if (!s->h_sc) return m3_errf(e, M3_NOMEM, "tune: scores");
    /* Distinct random scores in [-8, 8), some blocks exactly tied (ties go to
     * the lower id in the kernel and the reference alike). */
    for (size_t i = 0; i < nsc; i++) s->h_sc[i] = (i % 97 == 5) ? 1.5f : 16.0f * m3_rng_unif(&r) - 8.0f;
    M3_TRY(m3_tune_upload_sets(&s->d_sc, s->h_sc, s->sc_bytes, sets, rt->stream, e));
    return ref_lists(s, s->h_sc, e); /* TOPK rotates the score buffers, not pages */
  }
  s->iq = malloc(s->iq_bytes);
  s->cache = malloc(cache_set);
  if (!s->iq || !s->cache) return m3_errf(e, M3_NOMEM, "tune: indexer inputs");
  m3_tune_fill_finite(&r, s->iq, s->iq_bytes);
  m3_tune_fill_finite(&r, s->cache, cache_set);
  M3_TRY(m3_dev_alloc(&s->d_iq, s->iq_bytes, e));
  M3_TRY(m3_dev_upload(s->d_iq, s->iq, s->iq_bytes, e));
  M3_TRY(m3_tune_upload_sets(&s->d_cache, s->cache, cache_set, sets, rt->stream, e));
  const m3_seq_batch hb = m3_tune_batch_host(&s->p);
  if (kind == DECODE) {
    float *raw = malloc(s->sc_bytes);
    if (!raw) return m3_errf(e, M3_NOMEM, "tune: scores");
    st = m3_ref_index_scores(a, &hb, s->iq, s->cache, raw, e);
    if (!st) st = ref_lists(s, raw, e);
    free(raw);
    return st;
  }
  M3_TRY(m3_dev_alloc(&s->d_sc, s->sc_bytes, e));
  /* SCORE: the reference on a sample of about 1e9 multiply-adds. */
  int want = (int)(1e9 / ((double)ctx * H * hd));
  M3_TRY(m3_tune_sample_make(&s->smp, &s->p, want < 4 ? 4 : want > 32 ? 32 : want, e));
  m3_idx_args sa = *a;
  sa.n_tokens = s->smp.n;
  const m3_seq_batch sb = m3_tune_sample_batch(&s->smp, &s->p);
  uint8_t *siq = malloc((size_t)s->smp.n * H * hd * s->esz);
  s->ref_raw = malloc(sizeof(float) * (size_t)H * s->smp.n * a->max_blocks);
  s->knorm = malloc(sizeof(double) * (size_t)s->p.pages * bs);
  if (!siq || !s->ref_raw || !s->knorm) {
    free(siq);
    return m3_errf(e, M3_NOMEM, "tune: score reference");
  }
  m3_tune_sample_rows(&s->smp, s->iq, (size_t)H * hd * s->esz, siq);
  st = m3_ref_index_scores(&sa, &sb, siq, s->cache, s->ref_raw, e);
  free(siq);
  for (int64_t row = 0; row < s->p.pages * bs; row++) {
    double k2 = 0;
    for (int d = 0; d < hd; d++) {
      const size_t at = (size_t)row * hd + d;
      const double x = a->idx_e4m3 ? m3_e4m3_to_f32(s->cache[at]) : m3_bf16_to_f32(((m3_bf16 *)s->cache)[at]);
      k2 += x * x;
    }
    s->knorm[row] = sqrt(k2);
  }
  return st;
}

static m3_status setup_decode(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b,
                               uint64_t seed, void **st, m3_err *e) {
  (void)cfg;
  return setup_kind(rt, v, b, seed, DECODE, st, e);
}

static m3_status setup_prefill(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b,
                               uint64_t seed, void **st, m3_err *e) {
  (void)cfg;
  const char *stage = m3_variant_axis(v, "stage");
  return setup_kind(rt, v, b, seed, stage && !strcmp(stage, "topk") ? TOPK : SCORE, st, e);
}

static m3_status prepare(void *q, int rep, m3_err *e) {
  ix_state *s = q;
  if (rep == 0) {
    M3_TRY(m3_tune_poison_ids(s->d_out, s->out_bytes, s->rt->stream, e));
    if (s->kind == SCORE) M3_CUDA(e, cudaMemsetAsync(s->d_sc, 0xff, s->sc_bytes, s->rt->stream));
  }
  return m3_tune_flush_if_small(m3_tune_sets(s->per_set), s->per_set, s->rt->stream, e);
}

static m3_status launch(void *q, const m3_kernel *k, int rep, m3_err *e) {
  ix_state *s = q;
  const int sets = m3_tune_sets(s->per_set), set = rep % sets, hook = m3_tune_test_hook(k);
  m3_idx_args a = s->a;
  /* The broken hook: one token short, or (a single token) one block short. */
  if (hook == 1 && a.n_tokens > 1) a.n_tokens -= 1;
  else if (hook == 1 && a.max_blocks > 1) a.max_blocks -= 1;
  const m3_seq_batch db = m3_tune_batch_dev(&s->p, s->kind == TOPK ? 0 : set);
  const m3_idx_cache c = {.data = s->d_cache, .e4m3 = a.idx_e4m3, .num_pages = db.num_pages};
  cudaStream_t st = s->rt->stream;
  for (int twice = 0; twice < (hook == 2 ? 2 : 1); twice++) {
    if (s->kind == DECODE) {
      const size_t need = m3_index_decode_workspace_bytes(k, &a, s->rt->dev.sm_count);
      if (need > s->ws_bytes) { /* once per kernel, on its untimed first launch */
        m3_dev_free(s->ws);
        s->ws = NULL, s->ws_bytes = 0;
        M3_TRY(m3_dev_alloc(&s->ws, need, e));
        M3_TRY(m3_index_workspace_init(s->ws, need, st, e));
        s->ws_bytes = need;
      }
      M3_TRY(m3_launch_index_decode(k, &a, &db, s->rt->dev.sm_count, s->d_iq, &c, s->d_out, s->ws, s->ws_bytes, st, e));
    } else if (s->kind == SCORE) {
      M3_TRY(m3_launch_index_prefill_scores(k, &a, &db, s->d_iq, &c, s->d_sc, st, e));
    } else {
      const float *sc = (const float *)((const char *)s->d_sc + (size_t)set * s->sc_bytes);
      M3_TRY(m3_launch_index_prefill_topk(k, &a, &db, sc, s->d_out, st, e));
    }
  }
  return M3_OK;
}

static m3_status verify_lists(ix_state *s, char *detail, size_t n, m3_err *e) {
  const m3_idx_args *a = &s->a;
  int32_t *g = malloc(s->out_bytes);
  if (!g) return m3_errf(e, M3_NOMEM, "verify");
  m3_status st = m3_dev_download(g, s->d_out, s->out_bytes, e);
  int swaps = 0, rows = a->n_heads * a->n_tokens;
  for (int h = 0; h < a->n_heads && !st; h++)
    for (int t = 0; t < a->n_tokens && !st; t++) {
      const int64_t row = (int64_t)h * a->n_tokens + t, nb = s->p.pos[t] / a->block_size + 1;
      char why[200];
      if (!m3_tune_topk_row_ok(g + row * a->topk, s->ref_topk + row * a->topk, s->forced + row * a->max_blocks,
                               a->topk, nb, &swaps, why, sizeof why)) {
        snprintf(detail, n, "top-k head %d token %d: %s", h, t, why);
        st = M3_MISMATCH;
      }
    }
  if (!st && swaps > 2 + rows / 100) {
    snprintf(detail, n, "%d near-tie swaps in %d rows: too many to be rounding", swaps, rows);
    st = M3_MISMATCH;
  }
  if (!st && s->kind == TOPK && swaps) {
    snprintf(detail, n, "top-k of fixed scores differs from the reference in %d places", swaps);
    st = M3_MISMATCH;
  }
  free(g);
  return st;
}

static m3_status verify_scores(ix_state *s, char *detail, size_t n, m3_err *e) {
  const m3_idx_args *a = &s->a;
  const int H = a->n_heads, hd = a->head_dim, bs = a->block_size, mb = a->max_blocks;
  float *g = malloc(s->sc_bytes);
  if (!g) return m3_errf(e, M3_NOMEM, "verify");
  m3_status st = m3_dev_download(g, s->d_sc, s->sc_bytes, e);
  for (int i = 0; i < s->smp.n && !st; i++) {
    const int t = s->smp.tok[i];
    const int64_t pos = s->p.pos[t], nb = pos / bs + 1;
    for (int h = 0; h < H && !st; h++) {
      double qn = 0;
      for (int d = 0; d < hd; d++) {
        const size_t at = ((size_t)t * H + h) * hd + d;
        const double x = a->idx_e4m3 ? m3_e4m3_to_f32(s->iq[at]) : m3_bf16_to_f32(((m3_bf16 *)s->iq)[at]);
        qn += x * x;
      }
      for (int64_t b = 0; b < nb && !st; b++) {
        const float gv = g[((size_t)h * a->n_tokens + t) * mb + b], rv = s->ref_raw[((size_t)h * s->smp.n + i) * mb + b];
        double kmax = 0;
        const int32_t pg = s->p.bt[(int64_t)s->p.token_seq[t] * s->p.bt_stride + b];
        for (int j = 0; j < bs && b * bs + j <= pos; j++)
          if (s->knorm[(size_t)pg * bs + j] > kmax) kmax = s->knorm[(size_t)pg * bs + j];
        const double tol = 1e-5 * sqrt(qn) * kmax + 1e-30;
        if (!(fabs((double)gv - rv) <= tol)) { /* NaN fails here */
          snprintf(detail, n, "block score head %d token %d block %lld: %.9g, reference %.9g (tol %.3g)", h, t,
                   (long long)b, gv, rv, tol);
          st = M3_MISMATCH;
        }
      }
    }
  }
  free(g);
  return st;
}

static m3_status verify(void *q, char *detail, size_t n, m3_err *e) {
  ix_state *s = q;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  return s->kind == SCORE ? verify_scores(s, detail, n, e) : verify_lists(s, detail, n, e);
}

/* Bytes: the index keys of the visible tokens and the queries (decode,
 * score; a prefill chunk reads each page once per warp of tokens, counted
 * once), or the visible scores (top-k), plus the lists written. */
static double work(void *q) {
  ix_state *s = q;
  const m3_idx_args *a = &s->a;
  if (s->kind == TOPK) {
    double blocks = 0;
    for (int t = 0; t < a->n_tokens; t++) blocks += (double)(s->p.pos[t] / a->block_size + 1);
    return blocks * a->n_heads * 4 + (double)s->out_bytes;
  }
  const double keys = s->kind == DECODE ? (double)s->p.visible : (double)s->p.max_kv;
  return keys * a->head_dim * s->esz + (double)s->iq_bytes + (double)(s->kind == SCORE ? s->sc_bytes : s->out_bytes);
}

const m3_tune_op m3_tune_op_index_decode = {"index_decode", "GB/s", buckets_decode, setup_decode, prepare,
                                            launch, verify, work, teardown};
const m3_tune_op m3_tune_op_index_prefill = {"index_prefill", "GB/s", buckets_prefill, setup_prefill, prepare,
                                             launch, verify, work, teardown};
