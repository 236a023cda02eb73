/* op_gemv.c - tuning adapter of templates/mxfp8.lua's W8A16 decode GEMVs
 * (MXFP8 weights, the bandwidth-bound linear layers of a decode step).  The
 * runtime looks a GEMV kernel up by its key (cols, nmax, moe) and the token
 * count (runtime/op_ffn.c m3_gemv_kernel: bucket "tokens" = rows of x, or
 * (token, expert) pairs for the MoE GEMV), so the buckets are batch-1
 * decode: tokens 1, and 4 pairs for the MoE GEMVs (top-4).  A key does not
 * carry the weight's row count, so each key is timed at the rows of its main
 * use in the configuration being tuned (main_use()): in_features = hidden ->
 * the fused qkv(+index) projection,
 * the o_proj / dense MLP / shared expert inputs -> hidden rows, the MoE
 * gate|up (2 x intermediate rows) and down (hidden rows) with the shared
 * expert as the fifth pair, as the decode step launches them.
 * The fp32 router GEMV (one launch a MoE layer: 57 a step) is timed at its
 * experts x hidden; the bf16 lm_head GEMV (one launch a step) is not tuned,
 * nor are the MoE GEMV's epilogue keys (act=swiglu, combine=1), off by default.
 * Inputs: x N(0,1) bf16; e4m3 weights with no NaN codes and E8M0 scales
 * 2^-9..2^-6 (random), in rotating copies; output poisoned.  Verification:
 * rel. L2 <= 1e-2 against m3_ref_gemm_w8a16 per row of x, no NaN (the GPU
 * tests' contract, tests/check_ffn_gpu.c); the router: fp32 weights
 * U(-0.02, 0.02), rel. 1e-5 against m3_ref_router_logits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/op_util.h"
#include "runtime/check.h"
#include "runtime/op_ffn.h"

#define PAIRS 4          /* MoE bucket: top-4 routed pairs of one token (+ the shared expert's) */
#define EXPERTS 8        /* distinct experts per rotating set */

/* Rows of the main use of a GEMV key in config c, and the MoE GEMV's xdiv
 * (gate|up reads the token's row, down each pair's); 0 rows: not a key the
 * adapter tunes. */
static int64_t main_use(const m3_config *c, const m3_variant *v, int *xdiv) {
  const char *op = m3_variant_axis(v, "op"), *w = m3_variant_axis(v, "w");
  *xdiv = 1;
  if (!op || !w || strcmp(op, "gemv") || m3_variant_axis_int(v, "nmax", 0) != 1) return 0;
  if (!strcmp(w, "f32")) /* the router: experts x hidden (its route epilogue key, opt-in, is not tuned) */
    return !m3_variant_axis_int(v, "moe", 0) && !m3_variant_axis_int(v, "route_e", 0) &&
                   m3_variant_axis_int(v, "cols", 0) == c->hidden_size
               ? c->num_local_experts
               : 0;
  if (strcmp(w, "e4m3")) return 0;
  /* the MoE epilogue keys (act, combine: opt-in, runtime/op_ffn.c) are not tuned: they run their default tile */
  const char *act = m3_variant_axis(v, "act");
  if ((act && strcmp(act, "none")) || m3_variant_axis_int(v, "combine", 0)) return 0;
  const int64_t cols = m3_variant_axis_int(v, "cols", 0), moe = m3_variant_axis_int(v, "moe", 0);
  int sparse = 0;
  for (int l = 0; l < c->num_hidden_layers; l++) sparse |= c->is_sparse[l] ? 1 : 0;
  int first = 0; /* a layer of the most common kind: its qkv width */
  while (first < c->num_hidden_layers - 1 && (c->is_sparse[first] ? 1 : 0) != sparse) first++;
  const int64_t H = c->hidden_size;
  if (moe && cols == H) *xdiv = PAIRS;
  return moe ? (cols == H ? 2 * (int64_t)c->intermediate_size : H) : (cols == H ? m3_config_qkv_width(c, first) : H);
}

typedef struct {
  m3_rt *rt;
  int moe, xdiv, sets, nx, ny; /* x rows, y rows (MoE: pairs + shared) */
  int settled;                 /* the key's settled axis (MoE down) */
  int f32;                     /* the router: fp32 weights (no scales) and logits */
  float *ref32;                /* [rows] its reference */
  int64_t rows, cols;
  size_t wbytes, sbytes;       /* one matrix */
  int nw;                      /* matrices per set (MoE: EXPERTS + 1 shared; else 1) */
  uint8_t *d_w, *d_s;          /* [sets][nw] matrices, scales */
  void **d_tab;                /* [sets] device tables: EXPERTS weight pointers then EXPERTS scale pointers */
  int32_t *d_ids;              /* [PAIRS] */
  void *d_x, *d_y;
  m3_bf16 *ref;                /* [ny, rows] */
  int32_t ids[PAIRS];
} gv_state;

static int buckets(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  int xdiv;
  if (main_use(c, v, &xdiv) < 1) return 0;
  static const char *const names[2] = {"tokens", NULL};
  const int64_t t[1][2] = {{m3_variant_axis_int(v, "moe", 0) ? PAIRS : 1, 0}};
  return m3_tune_bucket_list(names, t, 1, out, max);
}

static void teardown(void *x) {
  gv_state *s = x;
  if (!s) return;
  m3_dev_free(s->d_w); m3_dev_free(s->d_s); m3_dev_free(s->d_ids); m3_dev_free(s->d_x); m3_dev_free(s->d_y);
  if (s->d_tab)
    for (int i = 0; i < s->sets; i++) m3_dev_free(s->d_tab[i]);
  free(s->d_tab);
  free(s->ref);
  free(s->ref32);
  free(s);
}

/* e4m3 bytes without the NaN codes 0x7f / 0xff; E8M0 scales 118..121. */
static void fill_mxfp8(m3_rng *r, uint8_t *q, uint8_t *sc, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint8_t b = (uint8_t)m3_rng_next(r);
    q[i] = (b & 0x7f) == 0x7f ? (uint8_t)(b ^ 1) : b;
  }
  for (size_t i = 0; i < n / 32; i++) sc[i] = (uint8_t)(118 + m3_rng_next(r) % 4);
}

/* The router's inputs: rotating fp32 weight sets, x, the reference of set 0. */
static m3_status setup_router(gv_state *s, uint64_t seed, m3_err *e) {
  s->nx = s->ny = s->nw = 1;
  s->wbytes = (size_t)s->rows * (size_t)s->cols * 4;
  s->sets = m3_tune_sets(s->wbytes);
  m3_rng r = {seed};
  float *w = malloc(s->wbytes);
  m3_bf16 *x = malloc(sizeof *x * (size_t)s->cols);
  s->ref32 = malloc(sizeof *s->ref32 * (size_t)s->rows);
  m3_status st = w && x && s->ref32 ? M3_OK : m3_errf(e, M3_NOMEM, "tune: router inputs");
  if (!st) {
    m3_fill_f32(&r, w, (size_t)s->rows * (size_t)s->cols, 0.02f);
    m3_fill_bf16(&r, x, (size_t)s->cols, 1.0f);
    m3_ref_router_logits(1, (int)s->cols, (int)s->rows, x, w, s->ref32);
    st = m3_tune_upload_sets((void **)&s->d_w, w, s->wbytes, s->sets, s->rt->stream, e);
  }
  if (!st) st = m3_dev_alloc(&s->d_x, sizeof *x * (size_t)s->cols, e);
  if (!st) st = m3_dev_upload(s->d_x, x, sizeof *x * (size_t)s->cols, e);
  if (!st) st = m3_dev_alloc(&s->d_y, sizeof(float) * (size_t)s->rows, e);
  free(w);
  free(x);
  return st;
}

static m3_status setup(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                      void **out, m3_err *e) {
  gv_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  s->cols = m3_variant_axis_int(v, "cols", 0);
  s->moe = (int)m3_variant_axis_int(v, "moe", 0);
  s->settled = (int)m3_variant_axis_int(v, "settled", 0);
  s->rows = main_use(cfg, v, &s->xdiv);
  if (s->rows < 1 || s->cols < 32 || m3_bucket_get(b, "tokens") < 1)
    return m3_errf(e, M3_KEY, "gemv tune: not a W8A16 decode GEMV or router key / bucket");
  const char *wname = m3_variant_axis(v, "w");
  s->f32 = wname && !strcmp(wname, "f32");
  if (s->f32) return setup_router(s, seed, e);
  const int xdiv = s->xdiv; /* gate|up reads the token, down the pairs' activations */
  s->nx = s->moe ? (xdiv == 1 ? PAIRS + 1 : 1) : 1;
  s->ny = s->moe ? PAIRS + 1 : 1;
  s->nw = s->moe ? EXPERTS + 1 : 1;
  s->wbytes = (size_t)s->rows * (size_t)s->cols;
  s->sbytes = s->wbytes / 32;
  s->sets = m3_tune_sets((s->wbytes + s->sbytes) * (s->moe ? PAIRS + 1 : 1));
  m3_rng r = {seed};
  uint8_t *q = malloc(s->wbytes * s->nw), *sc = malloc(s->sbytes * s->nw);
  m3_bf16 *x = malloc(sizeof *x * (size_t)s->nx * s->cols);
  s->ref = malloc(sizeof *s->ref * (size_t)s->ny * s->rows);
  s->d_tab = calloc((size_t)s->sets, sizeof *s->d_tab);
  m3_status st = q && sc && x && s->ref && s->d_tab ? M3_OK : m3_errf(e, M3_NOMEM, "tune: gemv inputs");
  if (!st) {
    for (int i = 0; i < s->nw; i++) fill_mxfp8(&r, q + i * s->wbytes, sc + i * s->sbytes, s->wbytes);
    m3_fill_bf16(&r, x, (size_t)s->nx * s->cols, 1.0f);
    for (int p = 0; p < PAIRS; p++) s->ids[p] = (int32_t)((2 * p + 1) % EXPERTS);
    /* reference of set 0: pair p uses expert ids[p]; the shared expert is matrix EXPERTS */
    for (int p = 0; p < s->ny && !st; p++) {
      const int m = !s->moe ? 0 : p < PAIRS ? s->ids[p] : EXPERTS;
      const int xr = !s->moe ? 0 : xdiv == 1 ? p : 0;
      st = m3_ref_gemm_w8a16(1, s->rows, s->cols, x + (size_t)xr * s->cols, q + (size_t)m * s->wbytes,
                             sc + (size_t)m * s->sbytes, s->ref + (size_t)p * s->rows, e);
    }
  }
  const size_t wset = s->wbytes * s->nw, sset = s->sbytes * s->nw;
  if (!st) st = m3_tune_upload_sets((void **)&s->d_w, q, wset, s->sets, rt->stream, e);
  if (!st) st = m3_tune_upload_sets((void **)&s->d_s, sc, sset, s->sets, rt->stream, e);
  if (!st) st = m3_dev_alloc(&s->d_x, sizeof *x * (size_t)s->nx * s->cols, e);
  if (!st) st = m3_dev_upload(s->d_x, x, sizeof *x * (size_t)s->nx * s->cols, e);
  if (!st) st = m3_dev_alloc(&s->d_y, sizeof(m3_bf16) * (size_t)s->ny * s->rows, e);
  if (!st && s->moe) {
    st = m3_dev_alloc((void **)&s->d_ids, sizeof s->ids, e);
    if (!st) st = m3_dev_upload(s->d_ids, s->ids, sizeof s->ids, e);
    for (int i = 0; i < s->sets && !st; i++) {
      const void *tab[2 * EXPERTS];
      for (int x2 = 0; x2 < EXPERTS; x2++) {
        tab[x2] = s->d_w + (size_t)i * wset + (size_t)x2 * s->wbytes;
        tab[EXPERTS + x2] = s->d_s + (size_t)i * sset + (size_t)x2 * s->sbytes;
      }
      st = m3_dev_alloc(&s->d_tab[i], sizeof tab, e);
      if (!st) st = m3_dev_upload(s->d_tab[i], tab, sizeof tab, e);
    }
  }
  free(q);
  free(sc);
  free(x);
  return st;
}

static m3_status prepare(void *x, int rep, m3_err *e) {
  gv_state *s = x;
  if (rep == 0)
    M3_CUDA(e, cudaMemsetAsync(s->d_y, 0xff, (s->f32 ? 4 : 2) * (size_t)s->ny * s->rows, s->rt->stream));
  return M3_OK;
}

static m3_status launch(void *x, const m3_kernel *k, int rep, m3_err *e) {
  gv_state *s = x;
  const int set = rep % s->sets, hook = m3_tune_test_hook(k);
  const size_t wset = s->wbytes * s->nw, sset = s->sbytes * s->nw;
  const uint8_t *w = s->d_w + (size_t)set * wset, *sc = s->f32 ? NULL : s->d_s + (size_t)set * sset;
  /* broken: one 16-row tile short, so the last rows stay poisoned */
  const int64_t rows = hook == 1 ? s->rows - 16 : s->rows;
  for (int twice = 0; twice < (hook == 2 ? 2 : 1); twice++) {
    if (s->f32) {
      m3_gemv_args a = {.n = 1, .rows = rows, .cols = s->cols, .wfmt = M3_GEMV_F32, .out_f32 = 1};
      M3_TRY(m3_launch_gemv(k, &a, s->d_x, w, NULL, s->d_y, s->rt->stream, e));
    } else if (s->moe) {
      /* the ids are a host upload before the first launch: settled whatever the key says */
      m3_gemv_args a = {.n = PAIRS, .rows = rows, .cols = s->cols, .wfmt = M3_GEMV_E4M3, .moe = 1, .xdiv = s->xdiv,
                        .n_experts = EXPERTS, .ids_settled = s->settled};
      const void *const *tab = (const void *const *)s->d_tab[set];
      M3_TRY(m3_launch_gemv_moe_shared(k, &a, s->d_x, tab, tab + EXPERTS, s->d_ids, w + EXPERTS * s->wbytes,
                                       sc + EXPERTS * s->sbytes, 1, s->d_y, s->rt->stream, e));
    } else {
      m3_gemv_args a = {.n = 1, .rows = rows, .cols = s->cols, .wfmt = M3_GEMV_E4M3};
      M3_TRY(m3_launch_gemv(k, &a, s->d_x, w, sc, s->d_y, s->rt->stream, e));
    }
  }
  return M3_OK;
}

static m3_status verify(void *x, char *detail, size_t n, m3_err *e) {
  gv_state *s = x;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  if (s->f32) {
    float *g = malloc(sizeof *g * (size_t)s->rows);
    if (!g) return m3_errf(e, M3_NOMEM, "verify");
    m3_status st = m3_dev_download(g, s->d_y, sizeof *g * (size_t)s->rows, e);
    m3_cmp c = m3_cmp_f32_rel(g, s->ref32, (size_t)s->rows, 1e-5);
    if (!st && c.bad) {
      char cs[256];
      m3_cmp_str(&c, cs, sizeof cs);
      snprintf(detail, n, "router logits: %s", cs);
      st = M3_MISMATCH;
    }
    free(g);
    return st;
  }
  const size_t cnt = (size_t)s->ny * s->rows;
  m3_bf16 *g = malloc(sizeof *g * cnt);
  if (!g) return m3_errf(e, M3_NOMEM, "verify");
  m3_status st = m3_dev_download(g, s->d_y, sizeof *g * cnt, e);
  for (int p = 0; p < s->ny && !st; p++) {
    m3_cmp c = m3_cmp_bf16_rel(g + (size_t)p * s->rows, s->ref + (size_t)p * s->rows, (size_t)s->rows, 1e-2);
    if (c.bad) {
      char cs[256];
      m3_cmp_str(&c, cs, sizeof cs);
      snprintf(detail, n, "output row %d: %s", p, cs);
      st = M3_MISMATCH;
    }
  }
  free(g);
  return st;
}

static double work(void *x) {
  gv_state *s = x;
  return s->f32 ? (double)s->wbytes : (double)(s->wbytes + s->sbytes) * (s->moe ? PAIRS + 1 : 1);
}

const m3_tune_op m3_tune_op_gemv = {"mxfp8", "GB/s", buckets, setup, prepare, launch, verify, work, teardown, NULL};
