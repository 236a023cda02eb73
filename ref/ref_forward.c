/* ref_forward.c - whole-model CPU reference forward (see ref_forward.h).
 * Loading copies every tensor out of the checkpoint mapping (whose data may
 * be unaligned, safetensors.h) into aligned host buffers once; a step then
 * only calls the per-kernel references of ref/ref.h in spec order. */
#include "ref/ref_forward.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

/* ---- ownership ---------------------------------------------------------------- */

static void *own(m3_ref_model *m, size_t bytes) {
  if (m->n_owned == m->cap_owned) {
    int cap = m->cap_owned ? 2 * m->cap_owned : 256;
    void **n = realloc(m->owned, sizeof *n * (size_t)cap);
    if (!n) return NULL;
    m->owned = n;
    m->cap_owned = cap;
  }
  void *p = calloc(1, bytes ? bytes : 1);
  if (p) m->owned[m->n_owned++] = p;
  return p;
}

void m3_ref_model_free(m3_ref_model *m) {
  if (!m) return;
  for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
  free(m->owned);
  free(m->layers);
  free(m);
}

/* ---- tensor copies -------------------------------------------------------------- */

static m3_status need(const m3_weight *w, int layer, m3_role r, m3_err *e) {
  if (!w || !w->w)
    return m3_errf(e, M3_NOTFOUND, "reference model: layer %d has no %s weight", layer, m3_role_name(r));
  return M3_OK;
}

/* A [n] vector as bf16 (BF16 copied, F32 rounded once). */
static m3_status load_vec_bf16(m3_ref_model *m, const m3_ckpt *k, int layer, m3_role r, m3_bf16 **out,
                               m3_err *e) {
  const m3_weight *w = m3_ckpt_get(k, layer, r, -1);
  M3_TRY(need(w, layer, r, e));
  const m3_st_tensor *t = w->w;
  m3_bf16 *v = own(m, (size_t)t->numel * sizeof *v);
  if (!v) return m3_errf(e, M3_NOMEM, "reference model: %s", t->name);
  if (t->dtype == M3_DT_BF16) {
    M3_TRY(m3_st_copy(t, v, (size_t)t->numel * sizeof *v, e));
  } else {
    float *f = malloc((size_t)t->numel * sizeof *f);
    if (!f) return m3_errf(e, M3_NOMEM, "reference model: %s", t->name);
    m3_status s = m3_st_to_f32(t, f, (size_t)t->numel, e);
    for (uint64_t i = 0; s == M3_OK && i < t->numel; i++) v[i] = m3_f32_to_bf16(f[i]);
    free(f);
    M3_TRY(s);
  }
  *out = v;
  return M3_OK;
}

static m3_status load_f32(m3_ref_model *m, const m3_ckpt *k, int layer, m3_role r, float **out, m3_err *e) {
  const m3_weight *w = m3_ckpt_get(k, layer, r, -1);
  M3_TRY(need(w, layer, r, e));
  float *v = own(m, (size_t)w->w->numel * sizeof *v);
  if (!v) return m3_errf(e, M3_NOMEM, "reference model: %s", w->w->name);
  M3_TRY(m3_st_to_f32(w->w, v, (size_t)w->w->numel, e));
  *out = v;
  return M3_OK;
}

/* A linear weight, in its stored format. */
static m3_status load_linear(m3_ref_model *m, const m3_ckpt *k, int layer, m3_role r, int expert,
                             m3_ref_weight *out, m3_err *e) {
  const m3_weight *w = m3_ckpt_get(k, layer, r, expert);
  M3_TRY(need(w, layer, r, e));
  const m3_st_tensor *t = w->w;
  memset(out, 0, sizeof *out);
  out->rows = t->shape[0];
  out->cols = t->shape[1];
  if (t->dtype == M3_DT_F8_E4M3) {
    if (out->cols % 32)
      return m3_errf(e, M3_FORMAT, "reference model: %s: MXFP8 width %" PRId64
                     " is not a multiple of 32", t->name, out->cols);
    m3_e4m3 *q = own(m, (size_t)t->nbytes);
    uint8_t *s = own(m, (size_t)w->scale->nbytes);
    if (!q || !s) return m3_errf(e, M3_NOMEM, "reference model: %s", t->name);
    M3_TRY(m3_st_copy(t, q, (size_t)t->nbytes, e));
    M3_TRY(m3_st_copy(w->scale, s, (size_t)w->scale->nbytes, e));
    out->q = q;
    out->scale = s;
    m->mxfp8 = 1;
  } else {
    m3_bf16 *b = own(m, (size_t)t->nbytes);
    if (!b) return m3_errf(e, M3_NOMEM, "reference model: %s", t->name);
    M3_TRY(m3_st_copy(t, b, (size_t)t->nbytes, e));
    out->bf16 = b;
  }
  return M3_OK;
}

/* Row-concatenate parts into one weight (§3.2).  All MXFP8 -> MXFP8 (values
 * and scales concatenate row-wise); otherwise bf16, dequantising the MXFP8
 * parts (exact). */
static m3_status fuse_rows(m3_ref_model *m, const m3_ref_weight *p, int n, m3_ref_weight *out, m3_err *e) {
  int all_q = 1;
  int64_t rows = 0, cols = p[0].cols;
  for (int i = 0; i < n; i++) {
    all_q &= p[i].q != NULL;
    rows += p[i].rows;
    if (p[i].cols != cols) return m3_errf(e, M3_FORMAT, "reference model: fused QKV parts differ in width");
  }
  memset(out, 0, sizeof *out);
  out->rows = rows;
  out->cols = cols;
  if (all_q) {
    m3_e4m3 *q = own(m, (size_t)(rows * cols));
    uint8_t *s = own(m, (size_t)(rows * (cols / 32)));
    if (!q || !s) return m3_errf(e, M3_NOMEM, "reference model: fused QKV");
    int64_t r0 = 0;
    for (int i = 0; i < n; i++) {
      memcpy(q + r0 * cols, p[i].q, (size_t)(p[i].rows * cols));
      memcpy(s + r0 * (cols / 32), p[i].scale, (size_t)(p[i].rows * (cols / 32)));
      r0 += p[i].rows;
    }
    out->q = q;
    out->scale = s;
    return M3_OK;
  }
  m3_bf16 *b = own(m, (size_t)(rows * cols) * sizeof *b);
  if (!b) return m3_errf(e, M3_NOMEM, "reference model: fused QKV");
  int64_t r0 = 0;
  for (int i = 0; i < n; i++) {
    if (p[i].q) M3_TRY(m3_ref_mxfp8_dequant(p[i].rows, cols, p[i].q, p[i].scale, b + r0 * cols, e));
    else memcpy(b + r0 * cols, p[i].bf16, (size_t)(p[i].rows * cols) * sizeof *b);
    r0 += p[i].rows;
  }
  out->bf16 = b;
  return M3_OK;
}

static m3_status load_layer(m3_ref_model *m, const m3_ckpt *k, int l, m3_err *e) {
  const m3_config *c = &m->cfg;
  m3_ref_layer *L = &m->layers[l];
  L->sparse = c->is_sparse[l];
  L->moe = c->is_moe[l];
  M3_TRY(load_vec_bf16(m, k, l, M3_ROLE_INPUT_NORM, &L->input_norm, e));
  M3_TRY(load_vec_bf16(m, k, l, M3_ROLE_POST_NORM, &L->post_norm, e));
  M3_TRY(load_vec_bf16(m, k, l, M3_ROLE_Q_NORM, &L->q_norm, e));
  M3_TRY(load_vec_bf16(m, k, l, M3_ROLE_K_NORM, &L->k_norm, e));
  m3_ref_weight parts[5];
  static const m3_role qkv_roles[5] = {M3_ROLE_Q_PROJ, M3_ROLE_K_PROJ, M3_ROLE_V_PROJ, M3_ROLE_INDEX_Q_PROJ,
                                       M3_ROLE_INDEX_K_PROJ};
  int np = L->sparse ? 5 : 3;
  for (int i = 0; i < np; i++) M3_TRY(load_linear(m, k, l, qkv_roles[i], -1, &parts[i], e));
  M3_TRY(fuse_rows(m, parts, np, &L->qkv, e));
  if (L->sparse) {
    M3_TRY(load_vec_bf16(m, k, l, M3_ROLE_INDEX_Q_NORM, &L->iq_norm, e));
    M3_TRY(load_vec_bf16(m, k, l, M3_ROLE_INDEX_K_NORM, &L->ik_norm, e));
  }
  M3_TRY(load_linear(m, k, l, M3_ROLE_O_PROJ, -1, &L->o, e));
  if (!L->moe) {
    M3_TRY(load_linear(m, k, l, M3_ROLE_MLP_GATE, -1, &L->gate, e));
    M3_TRY(load_linear(m, k, l, M3_ROLE_MLP_UP, -1, &L->up, e));
    M3_TRY(load_linear(m, k, l, M3_ROLE_MLP_DOWN, -1, &L->down, e));
    return M3_OK;
  }
  const int E = c->num_local_experts;
  M3_TRY(load_f32(m, k, l, M3_ROLE_MOE_ROUTER, &L->router, e));
  if (c->use_routing_bias) M3_TRY(load_f32(m, k, l, M3_ROLE_MOE_BIAS, &L->bias, e));
  L->w1 = own(m, sizeof *L->w1 * (size_t)E);
  L->w3 = own(m, sizeof *L->w3 * (size_t)E);
  L->w2 = own(m, sizeof *L->w2 * (size_t)E);
  if (!L->w1 || !L->w3 || !L->w2) return m3_errf(e, M3_NOMEM, "reference model: expert table");
  for (int x = 0; x < E; x++) {
    M3_TRY(load_linear(m, k, l, M3_ROLE_EXPERT_W1, x, &L->w1[x], e));
    M3_TRY(load_linear(m, k, l, M3_ROLE_EXPERT_W3, x, &L->w3[x], e));
    M3_TRY(load_linear(m, k, l, M3_ROLE_EXPERT_W2, x, &L->w2[x], e));
  }
  if (c->n_shared_experts) {
    M3_TRY(load_linear(m, k, l, M3_ROLE_SHARED_GATE, -1, &L->sh_gate, e));
    M3_TRY(load_linear(m, k, l, M3_ROLE_SHARED_UP, -1, &L->sh_up, e));
    M3_TRY(load_linear(m, k, l, M3_ROLE_SHARED_DOWN, -1, &L->sh_down, e));
  }
  return M3_OK;
}

static m3_status load_embed(m3_ref_model *m, const m3_ckpt *k, m3_role r, m3_bf16 **out, m3_err *e) {
  const m3_weight *w = m3_ckpt_get(k, -1, r, -1);
  M3_TRY(need(w, -1, r, e));
  m3_bf16 *v = own(m, (size_t)w->w->nbytes);
  if (!v) return m3_errf(e, M3_NOMEM, "reference model: %s", w->w->name);
  M3_TRY(m3_st_copy(w->w, v, (size_t)w->w->nbytes, e));
  *out = v;
  return M3_OK;
}

m3_status m3_ref_model_load(const m3_config *c, const m3_ckpt *k, m3_ref_model **out, m3_err *e) {
  *out = NULL;
  m3_ref_model *m = calloc(1, sizeof *m);
  if (!m) return m3_errf(e, M3_NOMEM, "reference model");
  m->cfg = *c;
  m->layers = calloc((size_t)c->num_hidden_layers, sizeof *m->layers);
  m3_status s = m->layers ? M3_OK : m3_errf(e, M3_NOMEM, "reference model: layers");
  if (s == M3_OK) s = load_embed(m, k, M3_ROLE_EMBED, &m->embed, e);
  if (s == M3_OK && c->tie_word_embeddings) m->lm_head = m->embed;
  else if (s == M3_OK) s = load_embed(m, k, M3_ROLE_LM_HEAD, &m->lm_head, e);
  if (s == M3_OK) s = load_vec_bf16(m, k, -1, M3_ROLE_FINAL_NORM, &m->final_norm, e);
  for (int l = 0; s == M3_OK && l < c->num_hidden_layers; l++) {
    s = load_layer(m, k, l, e);
    if (s != M3_OK) m3_err_prefix(e, "layer %d: ", l);
  }
  if (s == M3_OK) {
    m->rope = own(m, (size_t)c->max_position_embeddings * (size_t)c->rotary_dim * sizeof *m->rope);
    if (!m->rope) s = m3_errf(e, M3_NOMEM, "reference model: RoPE table of %d positions",
                              c->max_position_embeddings);
    else m3_rope_table((float)c->rope_theta, c->rotary_dim, c->max_position_embeddings, m->rope);
  }
  if (s != M3_OK) {
    m3_ref_model_free(m);
    return s;
  }
  *out = m;
  return M3_OK;
}

/* ---- state ---------------------------------------------------------------------- */

void m3_ref_state_free(m3_ref_state *s) {
  if (!s) return;
  int L = s->m->cfg.num_hidden_layers;
  for (int l = 0; l < L; l++) {
    if (s->kv) free(s->kv[l]);
    if (s->ix) free(s->ix[l]);
  }
  free(s->kv);
  free(s->ix);
  free(s->block_table);
  free(s->seq_lens);
  free(s);
}

void m3_ref_state_reset(m3_ref_state *s) { memset(s->seq_lens, 0, sizeof *s->seq_lens * (size_t)s->n_seqs); }

m3_status m3_ref_state_create(const m3_ref_model *m, int n_seqs, int64_t max_ctx, int kv_e4m3,
                              int idx_e4m3, m3_ref_state **out, m3_err *e) {
  *out = NULL;
  const m3_config *c = &m->cfg;
  if (n_seqs <= 0 || max_ctx <= 0)
    return m3_errf(e, M3_INVAL, "reference state: %d sequences of %" PRId64 " tokens", n_seqs, max_ctx);
  const int64_t bs = c->sparse_block_size, hd = c->head_dim, nkv = c->num_key_value_heads;
  m3_ref_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "reference state");
  s->m = m;
  s->kv_e4m3 = kv_e4m3;
  s->idx_e4m3 = idx_e4m3;
  s->n_seqs = n_seqs;
  s->max_ctx = max_ctx;
  s->bt_stride = (max_ctx + bs - 1) / bs;
  s->num_pages = (int64_t)n_seqs * s->bt_stride;
  const int L = c->num_hidden_layers;
  s->kv = calloc((size_t)L, sizeof *s->kv);
  s->ix = calloc((size_t)L, sizeof *s->ix);
  s->block_table = malloc(sizeof *s->block_table * (size_t)s->num_pages);
  s->seq_lens = calloc((size_t)n_seqs, sizeof *s->seq_lens);
  int ok = s->kv && s->ix && s->block_table && s->seq_lens;
  const size_t kvb = kv_e4m3 ? 1 : 2, ixb = idx_e4m3 ? 1 : 2;
  for (int l = 0; ok && l < L; l++) {
    s->kv[l] = calloc((size_t)(s->num_pages * nkv * bs * 2 * hd), kvb);
    ok = s->kv[l] != NULL;
    if (ok && c->is_sparse[l]) {
      s->ix[l] = calloc((size_t)(s->num_pages * bs * c->sparse_index_dim), ixb);
      ok = s->ix[l] != NULL;
    }
  }
  if (!ok) {
    m3_ref_state_free(s);
    return m3_errf(e, M3_NOMEM, "reference state: caches for %d x %" PRId64 " tokens", n_seqs, max_ctx);
  }
  /* Scrambled pages: entry i of the flat table gets page (i * a) mod P with a
   * odd and coprime to P, a bijection that is far from the identity. */
  int64_t P = s->num_pages, a = 7;
  while (1) {
    int64_t x = a, y = P; /* gcd(a, P) == 1 */
    while (y) { int64_t t = x % y; x = y; y = t; }
    if (x == 1) break;
    a += 2;
  }
  for (int64_t i = 0; i < P; i++) s->block_table[i] = (int32_t)((i * a + 3) % P);
  *out = s;
  return M3_OK;
}

/* ---- one step ------------------------------------------------------------------- */

typedef struct {
  m3_bf16 *r, *a, *m, *x, *P, *q, *o;   /* residual, normed input, normed post, sublayer out, qkv, q, attn out */
  void *iq;                             /* [N, niq, idim] bf16|e4m3 */
  int32_t *sel;                         /* [nkv, N, topk] */
  int64_t *pos, *slot;                  /* [N] */
  int32_t *new_len;                     /* [n_seqs] */
} scratch;

static m3_status attention_layer(m3_ref_state *st, int l, int N, const int32_t *seq, scratch *w,
                                 const m3_seq_batch *b, m3_err *e) {
  const m3_ref_model *m = st->m;
  const m3_config *c = &m->cfg;
  const m3_ref_layer *L = &m->layers[l];
  const int sparse = L->sparse;
  M3_TRY(m3_ref_linear(N, w->a, &L->qkv, w->P, e));
  m3_qkr_args qa = {.n_tokens = N, .nq = c->num_attention_heads, .nkv = c->num_key_value_heads,
                    .niq = sparse ? c->sparse_num_index_heads : 0, .head_dim = c->head_dim,
                    .rotary_dim = c->rotary_dim, .block_size = c->sparse_block_size,
                    .eps = (float)c->rms_norm_eps, .insert = 1, .kv_e4m3 = st->kv_e4m3,
                    .idx_e4m3 = sparse ? st->idx_e4m3 : 0};
  m3_ref_qknorm_rope(&qa, w->P, L->q_norm, L->k_norm, L->iq_norm, L->ik_norm, m->rope, w->pos, w->slot,
                     w->slot, st->kv[l], st->ix[l], w->q, sparse ? w->iq : NULL);
  m3_attn_args aa = {.n_tokens = N, .nq = c->num_attention_heads, .nkv = c->num_key_value_heads,
                     .head_dim = c->head_dim, .block_size = c->sparse_block_size,
                     .kv_e4m3 = st->kv_e4m3, .topk = c->sparse_topk_blocks, .scale = 0.0f};
  if (!sparse || st->force_dense) {
    M3_TRY(m3_ref_dense_attention(&aa, b, w->q, st->kv[l], w->o, e));
  } else {
    m3_idx_args ia = {.n_tokens = N, .n_heads = c->sparse_num_index_heads, .head_dim = c->sparse_index_dim,
                      .block_size = c->sparse_block_size, .topk = c->sparse_topk_blocks,
                      .init_blocks = c->sparse_init_block, .local_blocks = c->sparse_local_block,
                      .idx_e4m3 = st->idx_e4m3, .max_blocks = (int)st->bt_stride};
    M3_TRY(m3_ref_indexer(&ia, b, w->iq, st->ix[l], w->sel, e));
    if (st->sel_out) {
      const size_t per = (size_t)ia.n_heads * (size_t)N * (size_t)ia.topk;
      memcpy(st->sel_out + (size_t)l * per, w->sel, per * sizeof *w->sel);
    }
    for (int g = 0; g < ia.n_heads; g++)
      for (int t = 0; t < N; t++) {
        int64_t nb = w->pos[t] / c->sparse_block_size + 1, kept = 0;
        for (int k = 0; k < ia.topk; k++) kept += w->sel[((int64_t)g * N + t) * ia.topk + k] >= 0;
        st->stat_visible_blocks += nb;
        st->stat_dropped_blocks += nb - kept;
      }
    M3_TRY(m3_ref_sparse_attention(&aa, b, w->q, st->kv[l], w->sel, w->o, e));
  }
  (void)seq;
  return m3_ref_linear(N, w->o, &L->o, w->x, e);
}

static m3_status ffn_layer(const m3_ref_model *m, int l, int N, scratch *w, m3_err *e) {
  const m3_config *c = &m->cfg;
  const m3_ref_layer *L = &m->layers[l];
  const float alpha = (float)c->swiglu_alpha, limit = (float)c->swiglu_limit, beta = (float)c->swiglu_beta;
  if (!L->moe) return m3_ref_mlp(N, w->m, &L->gate, &L->up, &L->down, alpha, limit, beta, w->x, e);
  m3_moe_args ma = {.n_tokens = N, .hidden = c->hidden_size, .n_experts = c->num_local_experts,
                    .topk = c->num_experts_per_tok, .renormalize = 1,
                    .routed_scaling = (float)c->routed_scaling_factor, .alpha = alpha, .limit = limit,
                    .beta = beta};
  const int shared = c->n_shared_experts > 0;
  return m3_ref_moe(&ma, w->m, L->router, L->bias, L->w1, L->w3, L->w2, shared ? &L->sh_gate : NULL,
                    shared ? &L->sh_up : NULL, shared ? &L->sh_down : NULL, w->x, NULL, NULL, e);
}

static void scratch_free(scratch *w) {
  free(w->r); free(w->a); free(w->m); free(w->x); free(w->P); free(w->q); free(w->o);
  free(w->iq); free(w->sel); free(w->pos); free(w->slot); free(w->new_len);
}

m3_status m3_ref_step(m3_ref_state *st, int N, const int32_t *seq, const int32_t *ids, float *logits,
                      m3_err *e) {
  const m3_ref_model *m = st->m;
  const m3_config *c = &m->cfg;
  if (N <= 0 || !seq || !ids) return m3_errf(e, M3_INVAL, "reference step: %d tokens, or NULL arrays", N);
  const int64_t H = c->hidden_size, V = c->vocab_size, bs = c->sparse_block_size;
  int qkv_max = 0;
  for (int l = 0; l < c->num_hidden_layers; l++)
    if (m3_config_qkv_width(c, l) > qkv_max) qkv_max = m3_config_qkv_width(c, l);
  scratch w = {0};
  w.r = malloc(sizeof *w.r * (size_t)(N * H));
  w.a = malloc(sizeof *w.a * (size_t)(N * H));
  w.m = malloc(sizeof *w.m * (size_t)(N * H));
  w.x = malloc(sizeof *w.x * (size_t)(N * H));
  w.P = malloc(sizeof *w.P * (size_t)N * (size_t)qkv_max);
  w.q = malloc(sizeof *w.q * (size_t)N * (size_t)m3_config_q_width(c));
  w.o = malloc(sizeof *w.o * (size_t)N * (size_t)m3_config_q_width(c));
  w.iq = malloc(2 * (size_t)N * (size_t)c->sparse_num_index_heads * (size_t)c->sparse_index_dim);
  w.sel = malloc(sizeof *w.sel * (size_t)N * (size_t)c->num_key_value_heads * (size_t)c->sparse_topk_blocks);
  w.pos = malloc(sizeof *w.pos * (size_t)N);
  w.slot = malloc(sizeof *w.slot * (size_t)N);
  w.new_len = malloc(sizeof *w.new_len * (size_t)st->n_seqs);
  if (!w.r || !w.a || !w.m || !w.x || !w.P || !w.q || !w.o || !w.iq || !w.sel || !w.pos || !w.slot ||
      !w.new_len) {
    scratch_free(&w);
    return m3_errf(e, M3_NOMEM, "reference step: scratch for %d tokens", N);
  }
  m3_status s = M3_OK;
  /* Positions, slots and admission checks, before anything is written. */
  memcpy(w.new_len, st->seq_lens, sizeof *w.new_len * (size_t)st->n_seqs);
  for (int t = 0; t < N && s == M3_OK; t++) {
    int32_t q = seq[t];
    if (q < 0 || q >= st->n_seqs) {
      s = m3_errf(e, M3_INVAL, "reference step: token %d belongs to sequence %d, outside [0, %d)", t, q,
                  st->n_seqs);
      break;
    }
    int64_t p = w.new_len[q]++;
    if (p >= c->max_position_embeddings)
      s = m3_errf(e, M3_RANGE, "reference step: sequence %d would reach position %" PRId64
                  ", beyond max_position_embeddings %d", q, p, c->max_position_embeddings);
    else if (p >= st->max_ctx)
      s = m3_errf(e, M3_CAPACITY, "reference step: sequence %d would hold %" PRId64
                  " tokens, more than the %" PRId64 " the state was created for", q, p + 1, st->max_ctx);
    w.pos[t] = p;
    w.slot[t] = (int64_t)st->block_table[(int64_t)q * st->bt_stride + p / bs] * bs + p % bs;
  }
  if (s == M3_OK) s = m3_ref_embed(N, (int)H, V, ids, m->embed, w.r, e);
  if (s != M3_OK) {
    scratch_free(&w);
    return s;
  }
  m3_seq_batch b = {.n_seqs = st->n_seqs, .seq_lens = w.new_len, .block_table = st->block_table,
                    .bt_stride = st->bt_stride, .num_pages = st->num_pages, .token_seq = seq,
                    .positions = w.pos};
  st->stat_visible_blocks = st->stat_dropped_blocks = 0;
  const float eps = (float)c->rms_norm_eps;
  m3_ref_rmsnorm(N, (int)H, w.r, m->layers[0].input_norm, eps, w.a);
  for (int l = 0; l < c->num_hidden_layers && s == M3_OK; l++) {
    s = attention_layer(st, l, N, seq, &w, &b, e);
    if (s != M3_OK) break;
    m3_ref_add_rmsnorm(N, (int)H, w.x, w.r, m->layers[l].post_norm, eps, w.m);
    s = ffn_layer(m, l, N, &w, e);
    if (s != M3_OK) break;
    const m3_bf16 *next = l + 1 < c->num_hidden_layers ? m->layers[l + 1].input_norm : m->final_norm;
    m3_ref_add_rmsnorm(N, (int)H, w.x, w.r, next, eps, w.a);
  }
  if (s != M3_OK) {
    m3_err_prefix(e, "reference step: ");
    scratch_free(&w);
    return s;
  }
  if (logits) {
    float *yf = malloc(sizeof *yf * (size_t)(N * H)), *wf = malloc(sizeof *wf * (size_t)H);
    if (!yf || !wf) s = m3_errf(e, M3_NOMEM, "reference step: lm_head scratch");
    for (int64_t i = 0; s == M3_OK && i < N * H; i++) yf[i] = m3_bf16_to_f32(w.a[i]);
    for (int64_t v = 0; s == M3_OK && v < V; v++) {
      for (int64_t i = 0; i < H; i++) wf[i] = m3_bf16_to_f32(m->lm_head[v * H + i]);
      for (int t = 0; t < N; t++) logits[(int64_t)t * V + v] = m3_ref_dot_f32(yf + t * H, wf, H);
    }
    free(yf);
    free(wf);
  }
  if (s == M3_OK) memcpy(st->seq_lens, w.new_len, sizeof *w.new_len * (size_t)st->n_seqs);
  scratch_free(&w);
  return s;
}

m3_status m3_ref_prefill(m3_ref_state *s, int seq, int n, const int32_t *ids, int chunk, float *last_logits,
                         float *all_logits, m3_err *e) {
  if (n <= 0 || !ids) return m3_errf(e, M3_INVAL, "reference prefill: %d tokens", n);
  if (chunk <= 0 || chunk > n) chunk = n;
  const int64_t V = s->m->cfg.vocab_size;
  int32_t *sq = malloc(sizeof *sq * (size_t)chunk);
  float *lg = malloc(sizeof *lg * (size_t)chunk * (size_t)V);
  if (!sq || !lg) {
    free(sq);
    free(lg);
    return m3_errf(e, M3_NOMEM, "reference prefill: chunk of %d", chunk);
  }
  for (int i = 0; i < chunk; i++) sq[i] = seq;
  m3_status st = M3_OK;
  for (int t0 = 0; t0 < n && st == M3_OK; t0 += chunk) {
    int nt = n - t0 < chunk ? n - t0 : chunk;
    int want = all_logits || (last_logits && t0 + nt == n);
    st = m3_ref_step(s, nt, sq, ids + t0, want ? lg : NULL, e);
    if (st != M3_OK) break;
    if (all_logits) memcpy(all_logits + (int64_t)t0 * V, lg, sizeof *lg * (size_t)(nt * V));
    if (last_logits && t0 + nt == n) memcpy(last_logits, lg + (int64_t)(nt - 1) * V, sizeof *lg * (size_t)V);
  }
  free(sq);
  free(lg);
  return st;
}
