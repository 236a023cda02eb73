/* ops_table.c - the tuner's registry of kernel-family adapters, one per
 * template: qknorm_rope, index_decode, index_prefill, attn_sparse,
 * attn_dense, swiglu, mxfp8 (the decode GEMVs), rmsnorm, moe_route,
 * moe_combine, embed, sample, kv_insert and fill.  An adapter's buckets()
 * says which variants are tuned at which shapes; kv_insert and fill (never
 * launched by a forward step), the fused routing stage (no caller), the
 * mxfp8 dequant (looked up without a shape) and the bf16/fp32 GEMVs (one
 * launch a step) have none and keep their default tiles.  l2_prefetch has no
 * adapter at all: it writes nothing a tuner could verify, and its worth is
 * the whole step's time (runtime/forward.c prefetch()), not its own. */
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"

extern const m3_tune_op m3_tune_op_qknorm, m3_tune_op_index_decode, m3_tune_op_index_prefill, m3_tune_op_attn_sparse,
    m3_tune_op_attn_dense, m3_tune_op_swiglu, m3_tune_op_gemv, m3_tune_op_rmsnorm, m3_tune_op_route,
    m3_tune_op_combine, m3_tune_op_embed, m3_tune_op_sample, m3_tune_op_kv_insert, m3_tune_op_fill;

const m3_tune_op *const m3_tune_ops[] = {&m3_tune_op_qknorm,      &m3_tune_op_index_decode, &m3_tune_op_index_prefill,
                                         &m3_tune_op_attn_sparse, &m3_tune_op_attn_dense,   &m3_tune_op_swiglu,
                                         &m3_tune_op_gemv,        &m3_tune_op_rmsnorm,      &m3_tune_op_route,
                                         &m3_tune_op_combine,     &m3_tune_op_embed,        &m3_tune_op_sample,
                                         &m3_tune_op_kv_insert,   &m3_tune_op_fill,         NULL};

const m3_tune_op *m3_tune_op_find(const char *name) {
  for (int i = 0; m3_tune_ops[i]; i++)
    if (!strcmp(m3_tune_ops[i]->template_name, name)) return m3_tune_ops[i];
  return NULL;
}

int m3_tune_test_hook(const m3_kernel *k) {
  const char *h = getenv("M3KIT_TUNE_TEST_HOOK");
  if (!h || !*h) return 0;
  char tile[512];
  m3_variant_print_tile(&k->key, tile, sizeof tile);
  int kind = 0;
  if (!strncmp(h, "broken=", 7)) kind = 1, h += 7;
  else if (!strncmp(h, "slow=", 5)) kind = 2, h += 5;
  return kind && !strcmp(h, tile) ? kind : 0;
}
