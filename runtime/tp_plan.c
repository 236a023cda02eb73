/* tp_plan.c - the tensor-parallel cut of the model (tp_plan.h). */
#include "runtime/tp_plan.h"

#include <string.h>

static m3_status slice(const char *field, int n, int tp, int rank, int align, int *i0, int *w, m3_err *e) {
  if (n == 0) {
    *i0 = *w = 0;
    return M3_OK;
  }
  if (n % (align * tp))
    return m3_errf(e, M3_INVAL, "tensor parallel %d: config %s %d is not a multiple of %d x %d (whole MXFP8 "
                   "blocks and mma steps on every rank)", tp, field, n, align, tp);
  *w = n / tp;
  *i0 = rank * *w;
  return M3_OK;
}

void m3_tp_vocab_slice(int vocab, int tp, int rank, int *v0, int *vn) {
  /* lm_head rows: the first V % tp ranks take one more */
  const int vb = vocab / tp, vr = vocab % tp;
  *vn = vb + (rank < vr);
  *v0 = rank * vb + (rank < vr ? rank : vr);
}

void m3_tp_rank_config(const m3_config *whole, const m3_tp_rank *p, m3_config *out) {
  *out = *whole;
  out->num_attention_heads = p->n_q_heads;
  out->num_key_value_heads = p->n_kv_heads;
  /* index_q heads go with the KV heads (one per KV head, spec §1.2) */
  out->sparse_num_index_heads = p->n_kv_heads;
  out->dense_intermediate_size = p->dense_n;
  out->intermediate_size = p->moe_n;
  if (whole->n_shared_experts) out->shared_intermediate_size = p->shared_n / whole->n_shared_experts;
}

m3_status m3_tp_plan(const m3_config *c, int tp, int rank, m3_tp_rank *o, m3_err *e) {
  memset(o, 0, sizeof *o);
  if (tp < 1 || tp > M3_TP_MAX) return m3_errf(e, M3_INVAL, "tensor parallel: %d ranks (1..%d)", tp, M3_TP_MAX);
  if (rank < 0 || rank >= tp) return m3_errf(e, M3_INVAL, "tensor parallel %d: rank %d outside [0, %d)", tp, rank, tp);
  const int nq = c->num_attention_heads, nkv = c->num_key_value_heads;
  if (nq % tp)
    return m3_errf(e, M3_INVAL, "tensor parallel %d: config num_attention_heads %d is not a multiple of %d", tp, nq, tp);
  if (nkv % tp && tp % nkv)
    return m3_errf(e, M3_INVAL, "tensor parallel %d: config num_key_value_heads %d neither divides nor is a "
                   "multiple of %d (KV heads are split, or replicated when tp > %d)", tp, nkv, tp, nkv);
  if (c->vocab_size < tp) return m3_errf(e, M3_INVAL, "tensor parallel %d: config vocab_size %d", tp, c->vocab_size);
  o->tp = tp;
  o->rank = rank;
  o->n_q_heads = nq / tp;
  o->q_head0 = rank * o->n_q_heads;
  if (tp <= nkv) {
    o->kv_replicas = 1;
    o->n_kv_heads = nkv / tp;
    o->kv_head0 = rank * o->n_kv_heads;
  } else {
    o->kv_replicas = tp / nkv;
    o->n_kv_heads = 1;
    o->kv_head0 = rank / o->kv_replicas;
  }
  M3_TRY(slice("dense_intermediate_size", c->dense_intermediate_size, tp, rank, 32, &o->dense_i0, &o->dense_n, e));
  M3_TRY(slice("intermediate_size", c->intermediate_size, tp, rank, 32, &o->moe_i0, &o->moe_n, e));
  M3_TRY(slice("shared_intermediate_size", m3_config_shared_width(c), tp, rank, 32, &o->shared_i0, &o->shared_n, e));
  m3_tp_vocab_slice(c->vocab_size, tp, rank, &o->vocab0, &o->vocab_n);
  o->allreduce_per_layer = tp > 1 ? 2 : 0;

  /* Storage: linear weights at the checkpoint's format, embedding / lm_head
   * bf16, routers fp32 (spec §8, §9.2), norms bf16. */
  const double lw = strcmp(c->quant_method, "mxfp8") ? 2.0 : 1.0 + 1.0 / 32.0;
  const double H = c->hidden_size, D = c->head_dim, ID = c->sparse_index_dim, E = c->num_local_experts;
  double b = 2.0 * c->vocab_size * H + 2.0 * o->vocab_n * H + 2.0 * H, x = 0;
  for (int l = 0; l < c->num_hidden_layers; l++) {
    b += lw * H * (o->n_q_heads * D + 2.0 * o->n_kv_heads * D) + lw * H * o->n_q_heads * D + 2.0 * (2 * H + 2 * D);
    if (c->is_sparse[l]) b += lw * H * (o->n_kv_heads * ID + ID) + 2.0 * 2 * ID; /* index_q by KV head, index_k whole */
    if (c->is_moe[l]) {
      b += lw * 3.0 * H * (E * o->moe_n + o->shared_n) + 4.0 * E * H + (c->use_routing_bias ? 4.0 * E : 0.0);
      x += lw * 3.0 * H * o->moe_n;
    }
    else
      b += lw * 3.0 * H * o->dense_n;
  }
  o->weight_bytes = (uint64_t)b;
  o->expert_bytes = (uint64_t)x;
  o->kv_bytes_per_token = m3_tp_kv_bytes_per_token(c, tp, 2, 2);
  return M3_OK;
}

uint64_t m3_tp_kv_bytes_per_token(const m3_config *c, int tp, int kv_elem_bytes, int idx_elem_bytes) {
  const int nkv = c->num_key_value_heads;
  if (tp < 1 || nkv < 1 || (nkv % tp && tp % nkv)) return 0;
  const uint64_t local = (uint64_t)(tp <= nkv ? nkv / tp : 1);
  uint64_t b = 0;
  for (int l = 0; l < c->num_hidden_layers; l++) {
    b += 2 * local * (uint64_t)c->head_dim * (uint64_t)kv_elem_bytes;
    if (c->is_sparse[l]) b += (uint64_t)c->sparse_index_dim * (uint64_t)idx_elem_bytes; /* one head, every rank */
  }
  return b;
}
