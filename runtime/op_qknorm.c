/* op_qknorm.c - key and launcher of the fused qk-norm + RoPE (+ insert)
 * kernel (see ops.h).  The grid follows the template's work decomposition:
 * a group of tile.lph lanes per (token, head slot), 32/lph groups a warp,
 * tile.hpw slots per group, tile.warps warps per CTA.  Also the unfused insert kv_insert (one warp per cache row). */
#include <stdio.h>

#include "runtime/ops.h"

m3_status m3_qknorm_key(const m3_qkr_args *a, m3_variant *v, m3_err *e) {
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "qknorm_rope(attn=%s,insert=%d,kv=%s,idxk=%s,nq=%d,nkv=%d,niq=%d,hd=%d,rot=%d,bs=%d)",
           a->niq ? "sparse" : "dense", a->insert, a->kv_e4m3 ? "e4m3" : "bf16", a->idx_e4m3 ? "e4m3" : "bf16",
           a->nq, a->nkv, a->niq, a->head_dim, a->rotary_dim, a->block_size);
  return m3_variant_parse(k, v, e);
}

m3_status m3_launch_qknorm_rope(const m3_kernel *k, const m3_qkr_args *a, void *qkv, const void *q_w,
                                const void *k_w, const void *iq_w, const void *ik_w, const void *cos_sin,
                                int64_t max_pos, const int64_t *positions, const int64_t *slot_mapping,
                                const int64_t *index_slot_mapping, void *kv_cache, void *index_cache,
                                void *q_out, void *index_q_out, cudaStream_t stream, m3_err *e) {
  long warps = m3_variant_tile_int(&k->key, "warps", 4), hpw = m3_variant_tile_int(&k->key, "hpw", 1);
  long slots = a->nq + a->nkv + (a->insert ? a->nkv : 0) + (a->niq ? a->niq + 1 : 0);
  long lph = m3_variant_tile_int(&k->key, "lph", 32);
  if (lph < 1 || lph > 32 || 32 % lph) return m3_errf(e, M3_INVAL, "qknorm_rope: tile lph=%ld must divide 32", lph);
  long items = (long)a->n_tokens * slots, per_cta = warps * hpw * (32 / lph);
  /* The kernel's head-slot index is 32-bit: a 64-bit division by the slot
   * count is a dozen instructions a head in a kernel that is issue-bound at
   * prefill sizes (templates/qknorm_rope.lua). */
  if (a->n_tokens < 0 || items >= (1L << 31))
    return m3_errf(e, M3_INVAL, "qknorm_rope: n_tokens %d x %ld head slots is outside [0, 2^31) for one launch",
                   a->n_tokens, slots);
  unsigned grid = (unsigned)((items + per_cta - 1) / per_cta);
  int n = a->n_tokens;
  float eps = a->eps;
  void *args[] = {&qkv, &q_w, &k_w, &iq_w, &ik_w, &cos_sin, &positions, &slot_mapping, &index_slot_mapping,
                  &kv_cache, &index_cache, &q_out, &index_q_out, &n, &max_pos, &eps};
  return m3_launch(&k->mod, grid, 1, 1, (CUstream)stream, args, e);
}

m3_status m3_kv_insert_key(const m3_qkr_args *a, m3_variant *v, m3_err *e) {
  if (a->niq) return m3_errf(e, M3_INVAL, "kv_insert: dense layers only (niq %d)", a->niq);
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "kv_insert(kv=%s,nq=%d,nkv=%d,hd=%d,bs=%d)", a->kv_e4m3 ? "e4m3" : "bf16", a->nq, a->nkv,
           a->head_dim, a->block_size);
  return m3_variant_parse(k, v, e);
}

m3_status m3_launch_kv_insert(const m3_kernel *k, const m3_qkr_args *a, const void *qkv,
                              const int64_t *slot_mapping, void *kv_cache, cudaStream_t stream, m3_err *e) {
  if (a->niq) return m3_errf(e, M3_INVAL, "kv_insert: dense layers only (niq %d)", a->niq);
  long warps = m3_variant_tile_int(&k->key, "warps", 4), items = (long)a->n_tokens * a->nkv * 2;
  unsigned grid = (unsigned)((items + warps - 1) / warps);
  int n = a->n_tokens;
  void *args[] = {&qkv, &slot_mapping, &kv_cache, &n};
  return m3_launch(&k->mod, grid, 1, 1, (CUstream)stream, args, e);
}
