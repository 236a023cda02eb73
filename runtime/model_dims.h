/* model_dims.h - the model dimensions handed to templates' variants(cfg):
 * the bridge between a config (runtime/config.h) and gen/, which knows no
 * config.  Fields: nq nkv niq hd rot bs topk init local hidden vocab experts
 * topk_experts inter dense_inter shared_inter has_dense has_sparse has_moe
 * has_dense_mlp swiglu_{alpha,limit,beta}_e6, and moe_fuse (the
 * M3_MOE_FUSE_* bits of the environment's M3KIT_MOE_FUSE, m3_moe_fuse_env). */
#ifndef M3_MODEL_DIMS_H
#define M3_MODEL_DIMS_H

#include "gen/render.h"

struct m3_config;
void m3_model_dims(const struct m3_config *c, m3_dims *d);

/* dims of a preset (model == NULL) or of DIR/config.json.  Errors: those of
 * the config loader (M3_CONFIG naming file and field, M3_NOTFOUND). */
m3_status m3_model_dims_for(const char *preset, const char *model_dir, m3_dims *d, m3_err *e);

#endif
