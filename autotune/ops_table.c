/* ops_table.c - the tuner's registry of kernel-family adapters, one per
 * template: qknorm_rope, index_decode, index_prefill, attn_sparse,
 * attn_dense, swiglu, mxfp8 (the decode GEMVs), rmsnorm, moe_route,
 * moe_combine, embed and sample.  An adapter's buckets() says which
 * variants are tuned at which shapes; a family without an adapter here is
 * not tuned: the runtime uses its default tile. */
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"

extern const m3_tune_op m3_tune_op_qknorm, m3_tune_op_index_decode, m3_tune_op_index_prefill, m3_tune_op_attn_sparse,
    m3_tune_op_attn_dense, m3_tune_op_swiglu, m3_tune_op_gemv, m3_tune_op_rmsnorm, m3_tune_op_route,
    m3_tune_op_combine, m3_tune_op_embed, m3_tune_op_sample;

const m3_tune_op *const m3_tune_ops[] = {&m3_tune_op_qknorm,      &m3_tune_op_index_decode, &m3_tune_op_index_prefill,
                                         &m3_tune_op_attn_sparse, &m3_tune_op_attn_dense,   &m3_tune_op_swiglu,
                                         &m3_tune_op_gemv,        &m3_tune_op_rmsnorm,      &m3_tune_op_route,
                                         &m3_tune_op_combine,     &m3_tune_op_embed,        &m3_tune_op_sample,
                                         NULL};

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
