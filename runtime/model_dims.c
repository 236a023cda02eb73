/* model_dims.c - config -> template dims (see model_dims.h). */
#include "runtime/model_dims.h"

#include <stdio.h>
#include <string.h>

#include "runtime/config.h"
#include "runtime/op_ffn.h"

void m3_model_dims(const m3_config *c, m3_dims *d) {
  memset(d, 0, sizeof *d);
  int dense = 0, sparse = 0, moe = 0, mlp = 0;
  for (int l = 0; l < c->num_hidden_layers; l++) {
    sparse |= c->is_sparse[l];
    dense |= !c->is_sparse[l];
    moe |= c->is_moe[l];
    mlp |= !c->is_moe[l];
  }
  m3_dims_set(d, "nq", c->num_attention_heads);
  m3_dims_set(d, "nkv", c->num_key_value_heads);
  m3_dims_set(d, "niq", c->sparse_num_index_heads);
  m3_dims_set(d, "hd", c->head_dim);
  m3_dims_set(d, "rot", c->rotary_dim);
  m3_dims_set(d, "bs", c->sparse_block_size);
  m3_dims_set(d, "topk", c->sparse_topk_blocks);
  m3_dims_set(d, "init", c->sparse_init_block);
  m3_dims_set(d, "local", c->sparse_local_block);
  m3_dims_set(d, "hidden", c->hidden_size);
  m3_dims_set(d, "vocab", c->vocab_size);
  m3_dims_set(d, "experts", c->num_local_experts);
  m3_dims_set(d, "topk_experts", c->num_experts_per_tok);
  m3_dims_set(d, "inter", c->intermediate_size);
  m3_dims_set(d, "dense_inter", c->dense_intermediate_size);
  m3_dims_set(d, "shared_inter", c->shared_intermediate_size);
  m3_dims_set(d, "has_dense", dense);
  m3_dims_set(d, "has_sparse", sparse);
  m3_dims_set(d, "has_moe", moe);
  m3_dims_set(d, "has_dense_mlp", mlp);
  /* SwiGLU-OAI constants travel in keys in millionths (templates/swiglu.lua). */
  m3_dims_set(d, "swiglu_alpha_e6", (long)(c->swiglu_alpha * 1e6 + 0.5));
  m3_dims_set(d, "swiglu_limit_e6", (long)(c->swiglu_limit * 1e6 + 0.5));
  m3_dims_set(d, "swiglu_beta_e6", (long)(c->swiglu_beta * 1e6 + 0.5));
  /* The opt-in MoE epilogues the decode step will launch (M3KIT_MOE_FUSE,
   * runtime/op_ffn.c): their keys join the variant list, so that a cache
   * warmed by `m3kit gen --all` still serves an M3KIT_NO_JIT=1 run with them.
   * A bad value counts as none here; m3_moe_forward reports it. */
  unsigned fuse = 0;
  m3_err e;
  if (m3_moe_fuse_env(&fuse, &e) != M3_OK) fuse = M3_MOE_FUSE_DEFAULT;
  m3_dims_set(d, "moe_fuse", (long)fuse);
}

m3_status m3_model_dims_for(const char *preset, const char *model_dir, m3_dims *d, m3_err *e) {
  m3_config c;
  if (model_dir) {
    char p[4200];
    snprintf(p, sizeof p, "%s/config.json", model_dir);
    M3_TRY(m3_config_load_file(p, &c, e));
  } else {
    M3_TRY(m3_config_preset(preset, &c, e));
  }
  m3_model_dims(&c, d);
  return M3_OK;
}
