/* ref_attention.c - block-sparse and dense causal GQA over the paged KV cache
 * (§6).  One core serves both: a query walks a list of logical blocks (the
 * top-k selection, or every visible block for dense layers), so "sparse with
 * every block selected == dense" holds by construction up to summation order.
 *
 * Precision: logits are fp32 dots (what the GPU's fp32 MMA accumulators give);
 * the softmax and the P·V sum are fp64 with an online running max, so the
 * reference is the exact softmax up to fp64 rounding.  The GPU's bf16 P tile
 * is the dominant difference, hence relative tolerances in GPU tests. */
#include "ref/ref.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ATT_MAX_HD 1024

/* Per (token, KV group) state: G query heads of head_dim each. */
typedef struct {
  const m3_attn_args *a;
  const void *kv;
  const int32_t *bt_row;   /* this sequence's block-table row */
  int64_t L;               /* visible keys */
  int g, G;
  const float *qf;         /* [G, hd] fp32 queries */
  float *kf, *vf;          /* [hd] decoded K, V */
  double *acc;             /* [G, hd] */
  double *den;             /* [G] */
  float *mx;               /* [G] running max logit */
  float scale;
} group_state;

static void decode_kv(const group_state *st, int64_t off, float *x) {
  const int hd = st->a->head_dim;
  if (st->a->kv_e4m3) {
    const m3_e4m3 *p = (const m3_e4m3 *)st->kv + off;
    for (int d = 0; d < hd; d++) x[d] = m3_e4m3_to_f32(p[d]); /* x k_scale 1.0 */
  } else {
    const m3_bf16 *p = (const m3_bf16 *)st->kv + off;
    for (int d = 0; d < hd; d++) x[d] = m3_bf16_to_f32(p[d]);
  }
}

/* Folds the visible keys of logical block lb into the group's state. */
static void attend_block(group_state *st, int64_t lb) {
  const m3_attn_args *a = st->a;
  const int hd = a->head_dim;
  const int64_t bs = a->block_size, nkv = a->nkv;
  int64_t j0 = lb * bs, j1 = j0 + bs < st->L ? j0 + bs : st->L;
  int64_t page = st->bt_row[lb];
  for (int64_t j = j0; j < j1; j++) {
    int64_t base = ((page * nkv + st->g) * bs + (j - j0)) * 2 * (int64_t)hd;
    decode_kv(st, base, st->kf);
    decode_kv(st, base + hd, st->vf);
    for (int h = 0; h < st->G; h++) {
      float z = m3_ref_dot_f32(st->qf + (int64_t)h * hd, st->kf, hd) * st->scale;
      double *acc = st->acc + (int64_t)h * hd;
      double p;
      if (z > st->mx[h]) {
        double corr = exp((double)st->mx[h] - (double)z); /* 0 on the first key */
        st->den[h] *= corr;
        for (int d = 0; d < hd; d++) acc[d] *= corr;
        st->mx[h] = z;
        p = 1.0;
      } else {
        p = exp((double)z - (double)st->mx[h]);
      }
      st->den[h] += p;
      for (int d = 0; d < hd; d++) acc[d] += p * (double)st->vf[d];
    }
  }
}

static m3_status attention(const m3_attn_args *a, const m3_seq_batch *b,
                           const m3_bf16 *q, const void *kv, const int32_t *sel,
                           m3_bf16 *out, m3_err *e) {
  if (!a || a->n_tokens < 0 || a->nq <= 0 || a->nkv <= 0 || a->nq % a->nkv ||
      a->head_dim <= 0 || a->head_dim > ATT_MAX_HD || a->block_size <= 0 ||
      (sel && a->topk <= 0))
    return m3_errf(e, M3_INVAL, "attention: bad arguments (nq %d must be a "
                   "multiple of nkv %d, head_dim <= %d, block_size > 0, topk > 0)",
                   a ? a->nq : 0, a ? a->nkv : 0, ATT_MAX_HD);
  M3_TRY(m3_ref_batch_check(b, a->n_tokens, a->block_size, INT64_MAX, e));
  const int hd = a->head_dim, G = a->nq / a->nkv;
  size_t nf = (size_t)G * hd + 2 * (size_t)hd + G, nd = (size_t)G * hd + G;
  void *mem = malloc(nd * sizeof(double) + nf * sizeof(float));
  if (!mem) return m3_errf(e, M3_NOMEM, "attention: scratch for %d heads", G);
  group_state st = {.a = a, .kv = kv, .G = G};
  st.acc = mem;
  st.den = st.acc + (size_t)G * hd;
  float *qf = (float *)(st.den + G);
  st.qf = qf;
  st.kf = qf + (size_t)G * hd;
  st.vf = st.kf + hd;
  st.mx = st.vf + hd;
  st.scale = a->scale != 0.0f ? a->scale : 1.0f / sqrtf((float)hd);

  for (int64_t t = 0; t < a->n_tokens; t++) {
    int32_t s = b->token_seq[t];
    st.bt_row = b->block_table + (int64_t)s * b->bt_stride;
    st.L = b->positions[t] + 1;
    int64_t nb = (st.L + a->block_size - 1) / a->block_size;
    for (int g = 0; g < a->nkv; g++) {
      st.g = g;
      const m3_bf16 *qg = q + (t * a->nq + (int64_t)g * G) * hd;
      for (int64_t i = 0; i < (int64_t)G * hd; i++) qf[i] = m3_bf16_to_f32(qg[i]);
      memset(st.acc, 0, ((size_t)G * hd + G) * sizeof(double));
      for (int h = 0; h < G; h++) st.mx[h] = -INFINITY;
      if (sel) {
        const int32_t *r = sel + ((int64_t)g * a->n_tokens + t) * a->topk;
        for (int k = 0; k < a->topk; k++) {
          int32_t lb = r[k];
          if (lb < 0 || lb >= nb) continue; /* sentinel / beyond causal (fault 6) */
          int dup = 0;
          for (int k2 = 0; k2 < k && !dup; k2++) dup = r[k2] == lb;
          if (!dup) attend_block(&st, lb);
        }
      } else {
        for (int64_t lb = 0; lb < nb; lb++) attend_block(&st, lb);
      }
      m3_bf16 *og = out + (t * a->nq + (int64_t)g * G) * hd;
      for (int h = 0; h < G; h++)
        for (int d = 0; d < hd; d++) {
          double den = st.den[h];
          og[(int64_t)h * hd + d] =
              m3_f32_to_bf16(den > 0 ? (float)(st.acc[(int64_t)h * hd + d] / den) : 0.0f);
        }
    }
  }
  free(mem);
  return M3_OK;
}

m3_status m3_ref_sparse_attention(const m3_attn_args *a, const m3_seq_batch *b,
                                  const m3_bf16 *q, const void *kv_cache,
                                  const int32_t *sel, m3_bf16 *out, m3_err *e) {
  if (!sel) return m3_errf(e, M3_INVAL, "sparse attention: no selection");
  return attention(a, b, q, kv_cache, sel, out, e);
}

m3_status m3_ref_dense_attention(const m3_attn_args *a, const m3_seq_batch *b,
                                 const m3_bf16 *q, const void *kv_cache,
                                 m3_bf16 *out, m3_err *e) {
  return attention(a, b, q, kv_cache, NULL, out, e);
}
