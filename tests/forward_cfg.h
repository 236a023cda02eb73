/* forward_cfg.h - what the whole-model tests (CPU reference and GPU) share:
 * a very small M3-shaped config, a random checkpoint of it in a scratch
 * directory, and logits comparisons.  Header-only so each test program stays
 * one file plus this. */
#ifndef M3_FORWARD_CFG_H
#define M3_FORWARD_CFG_H

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/ckpt_names.h"
#include "runtime/ckpt_write.h"
#include "runtime/config.h"
#include "runtime/safetensors.h"

/* The "tiny" preset's widths (hidden 256, 8 q heads, 4 kv heads, head_dim 128,
 * vocab 2048, 8 experts top-4, block 16, top-k 4 blocks) with n_layers layers,
 * the first n_dense dense (dense attention + dense MLP), the rest sparse + MoE,
 * max_position_embeddings max_pos, and topk_experts experts per token (0: the
 * preset's 4).  Validated by a JSON round trip, so it is a config the loader
 * would accept. */
static inline m3_status fwd_small_config(m3_config *c, int n_layers, int n_dense, int max_pos, int topk_experts,
                                         m3_err *e) {
  m3_config t;
  M3_TRY(m3_config_preset("tiny", &t, e));
  if (topk_experts > 0) t.num_experts_per_tok = topk_experts;
  t.num_hidden_layers = n_layers;
  for (int l = 0; l < n_layers; l++) t.is_sparse[l] = t.is_moe[l] = t.disable_index_value[l] = l >= n_dense;
  t.max_position_embeddings = max_pos;
  char *j = m3_config_to_json(&t);
  if (!j) return m3_errf(e, M3_NOMEM, "config json");
  m3_status s = m3_config_load_json_text(j, "small test config", c, e);
  free(j);
  return s;
}

/* A bound random checkpoint in a fresh scratch directory. */
typedef struct fwd_ckpt {
  char dir[64];
  m3_st *st;
  m3_ckpt *k;
} fwd_ckpt;

static inline void fwd_ckpt_close(fwd_ckpt *f) {
  m3_ckpt_free(f->k);
  m3_st_close(f->st);
  f->k = NULL;
  f->st = NULL;
  if (f->dir[0]) {
    DIR *d = opendir(f->dir);
    if (d) {
      struct dirent *de;
      char p[400];
      while ((de = readdir(d)))
        if (de->d_name[0] != '.') {
          snprintf(p, sizeof p, "%s/%s", f->dir, de->d_name);
          unlink(p);
        }
      closedir(d);
    }
    rmdir(f->dir);
    f->dir[0] = 0;
  }
}

static inline m3_status fwd_ckpt_make(const m3_config *c, int mxfp8, uint64_t seed, fwd_ckpt *f, m3_err *e) {
  memset(f, 0, sizeof *f);
  snprintf(f->dir, sizeof f->dir, "/tmp/m3fwdXXXXXX");
  if (!mkdtemp(f->dir)) return m3_errf(e, M3_IO, "mkdtemp %s", f->dir);
  m3_status s = m3_ckpt_write(c, f->dir, 2, mxfp8, seed, e);
  if (s == M3_OK) s = m3_st_open(f->dir, &f->st, e);
  if (s == M3_OK) s = m3_ckpt_bind(c, f->st, f->dir, &f->k, e);
  if (s != M3_OK) fwd_ckpt_close(f);
  return s;
}

/* ||a - b|| / ||b|| over n floats (inf if b is all zero but a is not). */
static inline double fwd_rel_l2(const float *a, const float *b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double d = (double)a[i] - b[i];
    num += d * d;
    den += (double)b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : (num > 0 ? INFINITY : 0);
}

static inline double fwd_max_abs(const float *a, const float *b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - b[i]);
    if (!(d <= m)) m = d; /* NaN propagates */
  }
  return m;
}

/* Greedy argmax, ties -> lower id (m3_ref_greedy's rule). */
static inline int fwd_argmax(const float *x, int64_t n) {
  int best = 0;
  for (int64_t i = 1; i < n; i++)
    if (x[i] > x[best]) best = (int)i;
  return best;
}

#endif
