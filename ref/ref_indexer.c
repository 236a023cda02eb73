/* ref_indexer.c - the lightning indexer (§5): token scores, block scores
 * (max over the causally visible tokens of each block), the forced
 * init/local constants and the top-k block selection.  It also owns the paged
 * batch validation shared with the attention reference, because both walk the
 * same block table the same way.
 *
 * The scoring loops go key by key and dot each decoded index key with every
 * index head's query, so a decode over 64K cached tokens is a few tens of
 * millions of MACs: well under a second on one core. */
#include "ref/ref.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#define IDX_MAX_HD 1024

m3_status m3_ref_batch_check(const m3_seq_batch *b, int64_t n_tokens,
                             int block_size, int64_t max_blocks, m3_err *e) {
  if (!b || block_size <= 0 || b->n_seqs <= 0 || b->bt_stride <= 0 ||
      !b->seq_lens || !b->block_table || !b->token_seq || !b->positions)
    return m3_errf(e, M3_INVAL, "paged batch: missing arrays, n_seqs <= 0, "
                   "bt_stride <= 0 or block_size %d <= 0", block_size);
  for (int64_t t = 0; t < n_tokens; t++) {
    int32_t s = b->token_seq[t];
    if (s < 0 || s >= b->n_seqs)
      return m3_errf(e, M3_RANGE, "paged batch: token %" PRId64 " belongs to "
                     "sequence %" PRId32 ", outside [0, %d)", t, s, b->n_seqs);
    int64_t pos = b->positions[t], T = b->seq_lens[s];
    if (pos < 0 || pos >= T)
      return m3_errf(e, M3_RANGE, "paged batch: token %" PRId64 " (sequence %"
                     PRId32 ") has position %" PRId64 ", outside [0, seq_len %"
                     PRId64 ")", t, s, pos, T);
    int64_t nb = pos / block_size + 1;
    if (nb > b->bt_stride || nb > max_blocks)
      return m3_errf(e, M3_RANGE, "paged batch: token %" PRId64 " at position %"
                     PRId64 " sees %" PRId64 " blocks, more than the block-table "
                     "stride %" PRId64 " or max_blocks %" PRId64, t, pos, nb,
                     b->bt_stride, max_blocks);
    const int32_t *row = b->block_table + (int64_t)s * b->bt_stride;
    for (int64_t lb = 0; lb < nb; lb++)
      if (row[lb] < 0 || row[lb] >= b->num_pages)
        return m3_errf(e, M3_RANGE, "paged batch: sequence %" PRId32 " logical "
                       "block %" PRId64 " maps to page %" PRId32 ", outside [0, "
                       "%" PRId64 ")", s, lb, row[lb], b->num_pages);
  }
  return M3_OK;
}

static m3_status check_args(const m3_idx_args *a, const m3_seq_batch *b,
                            m3_err *e) {
  if (!a || a->n_tokens < 0 || a->n_heads <= 0 || a->head_dim <= 0 ||
      a->head_dim > IDX_MAX_HD || a->block_size <= 0 || a->topk <= 0 ||
      a->init_blocks < 0 || a->local_blocks < 0 || a->max_blocks <= 0)
    return m3_errf(e, M3_INVAL, "indexer: bad arguments (n_tokens, n_heads, "
                   "head_dim <= %d, block_size, topk, init/local blocks, "
                   "max_blocks must be positive)", IDX_MAX_HD);
  return m3_ref_batch_check(b, a->n_tokens, a->block_size, a->max_blocks, e);
}

static void decode(int e4m3, const void *src, int64_t off, int n, float *x) {
  if (e4m3) {
    const m3_e4m3 *p = (const m3_e4m3 *)src + off;
    for (int d = 0; d < n; d++) x[d] = m3_e4m3_to_f32(p[d]);
  } else {
    const m3_bf16 *p = (const m3_bf16 *)src + off;
    for (int d = 0; d < n; d++) x[d] = m3_bf16_to_f32(p[d]);
  }
}

/* Visits every visible key of token t: calls fn(j, s[g] for all heads). */
typedef void (*key_fn)(void *ctx, int64_t j, const float *s);

static void for_each_key(const m3_idx_args *a, const m3_seq_batch *b, int64_t t,
                         const void *iq, const void *cache, float *qf,
                         key_fn fn, void *ctx) {
  const int hd = a->head_dim, H = a->n_heads;
  const int64_t bs = a->block_size;
  float kf[IDX_MAX_HD], s[64];
  decode(a->idx_e4m3, iq, t * H * (int64_t)hd, H * hd, qf);
  const int32_t *row = b->block_table + (int64_t)b->token_seq[t] * b->bt_stride;
  int64_t L = b->positions[t] + 1;
  for (int64_t j = 0; j < L; j++) {
    int64_t slot = (int64_t)row[j / bs] * bs + j % bs;
    decode(a->idx_e4m3, cache, slot * hd, hd, kf);
    for (int g = 0; g < H && g < 64; g++)
      s[g] = m3_ref_dot_f32(qf + (int64_t)g * hd, kf, hd);
    fn(ctx, j, s);
  }
}

struct tok_ctx { float *s; int64_t hstride; int H; };
static void tok_fn(void *c, int64_t j, const float *s) {
  struct tok_ctx *x = c;
  for (int g = 0; g < x->H; g++) x->s[g * x->hstride + j] = s[g];
}

struct blk_ctx { float *sc; int64_t hstride; int H; int64_t bs; };
static void blk_fn(void *c, int64_t j, const float *s) {
  struct blk_ctx *x = c;
  int64_t blk = j / x->bs;
  for (int g = 0; g < x->H; g++) {
    float *cur = &x->sc[g * x->hstride + blk];
    /* NaN poisons the block: once NaN, "s > NaN" is false forever. */
    if (isnan(s[g]) || s[g] > *cur) *cur = s[g];
  }
}

m3_status m3_ref_index_token_scores(const m3_idx_args *a, const m3_seq_batch *b,
                                    const void *iq, const void *index_cache,
                                    float *s, int64_t ld, m3_err *e) {
  M3_TRY(check_args(a, b, e));
  if (a->n_heads > 64) return m3_errf(e, M3_INVAL, "indexer: n_heads %d > 64", a->n_heads);
  float *qf = malloc((size_t)a->n_heads * a->head_dim * sizeof *qf);
  if (!qf) return m3_errf(e, M3_NOMEM, "indexer: query scratch");
  for (int64_t t = 0; t < a->n_tokens; t++) {
    int64_t L = b->positions[t] + 1;
    if (L > ld) {
      free(qf);
      return m3_errf(e, M3_INVAL, "indexer: token %" PRId64 " sees %" PRId64
                     " keys, more than ld %" PRId64, t, L, ld);
    }
    float *st = s + t * ld;
    int64_t hstride = (int64_t)a->n_tokens * ld;
    for (int g = 0; g < a->n_heads; g++)
      for (int64_t j = 0; j < ld; j++) st[g * hstride + j] = -INFINITY;
    struct tok_ctx c = {st, hstride, a->n_heads};
    for_each_key(a, b, t, iq, index_cache, qf, tok_fn, &c);
  }
  free(qf);
  return M3_OK;
}

/* Raw block scores of token t into sc[g * hstride + b], b < max_blocks. */
static void token_block_scores(const m3_idx_args *a, const m3_seq_batch *b,
                               int64_t t, const void *iq, const void *cache,
                               float *qf, float *sc, int64_t hstride) {
  for (int g = 0; g < a->n_heads; g++)
    for (int64_t k = 0; k < a->max_blocks; k++) sc[g * hstride + k] = -INFINITY;
  struct blk_ctx c = {sc, hstride, a->n_heads, a->block_size};
  for_each_key(a, b, t, iq, cache, qf, blk_fn, &c);
}

m3_status m3_ref_index_scores(const m3_idx_args *a, const m3_seq_batch *b,
                              const void *iq, const void *index_cache,
                              float *scores, m3_err *e) {
  M3_TRY(check_args(a, b, e));
  if (a->n_heads > 64) return m3_errf(e, M3_INVAL, "indexer: n_heads %d > 64", a->n_heads);
  float *qf = malloc((size_t)a->n_heads * a->head_dim * sizeof *qf);
  if (!qf) return m3_errf(e, M3_NOMEM, "indexer: query scratch");
  int64_t hstride = (int64_t)a->n_tokens * a->max_blocks;
  for (int64_t t = 0; t < a->n_tokens; t++)
    token_block_scores(a, b, t, iq, index_cache, qf, scores + t * a->max_blocks,
                       hstride);
  free(qf);
  return M3_OK;
}

/* §5.3 forcing of one visible block: init first, local overrides it. */
static float forced(const m3_idx_args *a, int64_t nb, int64_t blk, float v) {
  if (isnan(v)) v = -1e30f;
  if (blk < a->init_blocks) v = 1e30f;
  if (blk >= nb - a->local_blocks) v = 1e29f;
  return v;
}

m3_status m3_ref_index_force(const m3_idx_args *a, const m3_seq_batch *b,
                             float *scores, m3_err *e) {
  M3_TRY(check_args(a, b, e));
  for (int g = 0; g < a->n_heads; g++)
    for (int64_t t = 0; t < a->n_tokens; t++) {
      float *row = scores + ((int64_t)g * a->n_tokens + t) * a->max_blocks;
      int64_t nb = b->positions[t] / a->block_size + 1;
      for (int64_t k = 0; k < nb; k++) row[k] = forced(a, nb, k, row[k]);
    }
  return M3_OK;
}

/* Top-k of one (g, t) row: insertion into a list kept sorted by (score desc,
 * id asc).  Scanning ids upward means a later id never wins a tie. */
static void topk_row(const m3_idx_args *a, int64_t nb, const float *row,
                     int32_t *out) {
  const int K = a->topk;
  int kk = nb < K ? (int)nb : K, n = 0;
  float val[1024];
  float *v = K <= 1024 ? val : NULL;
  if (!v) return; /* topk <= 1024 is checked by the callers */
  for (int64_t blk = 0; blk < nb; blk++) {
    float f = forced(a, nb, blk, row[blk]);
    int pos;
    if (n < kk) pos = n++;
    else if (f > v[kk - 1]) pos = kk - 1;
    else continue;
    while (pos > 0 && f > v[pos - 1]) {
      v[pos] = v[pos - 1];
      out[pos] = out[pos - 1];
      pos--;
    }
    v[pos] = f;
    out[pos] = (int32_t)blk;
  }
  for (int k = kk; k < K; k++) out[k] = -1;
}

m3_status m3_ref_index_topk(const m3_idx_args *a, const m3_seq_batch *b,
                            const float *scores, int32_t *topk_out, m3_err *e) {
  M3_TRY(check_args(a, b, e));
  if (a->topk > 1024) return m3_errf(e, M3_INVAL, "indexer: topk %d > 1024", a->topk);
  for (int g = 0; g < a->n_heads; g++)
    for (int64_t t = 0; t < a->n_tokens; t++) {
      int64_t r = (int64_t)g * a->n_tokens + t;
      topk_row(a, b->positions[t] / a->block_size + 1,
               scores + r * a->max_blocks, topk_out + r * a->topk);
    }
  return M3_OK;
}

m3_status m3_ref_indexer(const m3_idx_args *a, const m3_seq_batch *b,
                         const void *iq, const void *index_cache,
                         int32_t *topk_out, m3_err *e) {
  M3_TRY(check_args(a, b, e));
  if (a->n_heads > 64 || a->topk > 1024)
    return m3_errf(e, M3_INVAL, "indexer: n_heads %d > 64 or topk %d > 1024",
                   a->n_heads, a->topk);
  size_t nq = (size_t)a->n_heads * a->head_dim;
  float *qf = malloc((nq + (size_t)a->n_heads * a->max_blocks) * sizeof *qf);
  if (!qf) return m3_errf(e, M3_NOMEM, "indexer: scratch for %d blocks", a->max_blocks);
  float *sc = qf + nq;
  for (int64_t t = 0; t < a->n_tokens; t++) {
    token_block_scores(a, b, t, iq, index_cache, qf, sc, a->max_blocks);
    int64_t nb = b->positions[t] / a->block_size + 1;
    for (int g = 0; g < a->n_heads; g++)
      topk_row(a, nb, sc + (int64_t)g * a->max_blocks,
               topk_out + ((int64_t)g * a->n_tokens + t) * a->topk);
  }
  free(qf);
  return M3_OK;
}
