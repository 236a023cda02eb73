/* model_dims.c - config -> template dims (see model_dims.h).
 * TEMPORARY: until runtime/config.c lands, the real MiniMax-M3 values. */
#include "runtime/model_dims.h"

#include <string.h>

m3_status m3_model_dims_for(const char *preset, const char *model_dir, m3_dims *d, m3_err *e) {
  memset(d, 0, sizeof *d);
  if (model_dir || strcmp(preset, "minimax-m3")) return m3_errf(e, M3_NOTFOUND, "config loading not wired yet");
  m3_dims_set(d, "nq", 64); m3_dims_set(d, "nkv", 4); m3_dims_set(d, "niq", 4);
  m3_dims_set(d, "hd", 128); m3_dims_set(d, "rot", 64); m3_dims_set(d, "bs", 128);
  m3_dims_set(d, "topk", 16); m3_dims_set(d, "init", 0); m3_dims_set(d, "local", 1);
  m3_dims_set(d, "hidden", 6144); m3_dims_set(d, "vocab", 200064);
  m3_dims_set(d, "experts", 128); m3_dims_set(d, "topk_experts", 4); m3_dims_set(d, "inter", 3072);
  m3_dims_set(d, "dense_inter", 12288); m3_dims_set(d, "shared_inter", 3072);
  m3_dims_set(d, "has_dense", 1); m3_dims_set(d, "has_sparse", 1);
  m3_dims_set(d, "has_moe", 1); m3_dims_set(d, "has_dense_mlp", 1);
  return M3_OK;
}
