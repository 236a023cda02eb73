/* model.c - weights onto the GPU: from a checkpoint (upload, fusing QKV and
 * the gate/up pairs, stacking experts) or synthetic (generated on the GPU by
 * templates/fill.lua), whole or one tensor-parallel rank's slice.  See
 * model.h for the layout, the slices and the restricted routing of partially
 * resident models. */
#include "runtime/model.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref/ref.h"
#include "runtime/check.h"
#include "runtime/ckpt_names.h"
#include "runtime/safetensors.h"

#define INIT_STD 0.02f
/* MXFP8 synthetic: every scale 2^-10 (E8M0 117), values e4m3(0.02 * 2^10 * n)
 * so the dequantised weights have std 0.02 and |q| <= 71 < 448. */
#define SYNTH_SCALE_E8M0 117
#define SYNTH_Q_STD (INIT_STD * 1024.0f)

/* ---- generator (mirrors templates/fill.lua) ------------------------------------ */

static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float m3_synth_value(uint64_t seed_t, int64_t i, float sigma) {
  uint64_t z = mix64(seed_t + ((uint64_t)i + 1ull) * 0x9e3779b97f4a7c15ull);
  unsigned s = (unsigned)(z & 0xffffu) + (unsigned)((z >> 16) & 0xffffu) + (unsigned)((z >> 32) & 0xffffu) +
               (unsigned)(z >> 48);
  float n = (float)((int)s - 131070) * 0x1.bb67aep-16f;
  return sigma * n;
}

uint64_t m3_synth_seed(uint64_t seed, const char *name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *name; name++) h = (h ^ (uint8_t)*name) * 0x100000001b3ull;
  return mix64((seed ^ h) + 0x9e3779b97f4a7c15ull);
}

m3_status m3_fill(m3_rt *rt, void *out, int64_t n, const char *dtype, uint64_t seed_t, float sigma,
                  cudaStream_t stream, m3_err *e) {
  if (n <= 0) return M3_OK;
  char key[64];
  snprintf(key, sizeof key, "fill(dtype=%s)", dtype);
  m3_kernel *k;
  M3_TRY(m3_rt_kernel_text(rt, key, NULL, &k, e));
  return m3_launch_fill(k, out, n, seed_t, sigma, rt->dev.sm_count, stream, e);
}

m3_status m3_launch_fill(const m3_kernel *k, void *out, int64_t n, uint64_t seed_t, float sigma, int sm_count,
                         cudaStream_t stream, m3_err *e) {
  if (n <= 0) return M3_OK;
  long threads = m3_variant_tile_int(&k->key, "threads", 256), vec = m3_variant_tile_int(&k->key, "vec", 4);
  int64_t blocks = (n + threads * vec - 1) / (threads * vec), cap = (int64_t)sm_count * 16;
  unsigned grid = (unsigned)(blocks < cap ? blocks : cap); /* grid-stride beyond that */
  unsigned long long sd = seed_t;
  void *args[] = {&out, &n, &sd, &sigma};
  return m3_launch(&k->mod, grid, 1, 1, (CUstream)stream, args, e);
}

/* ---- small helpers --------------------------------------------------------------- */

size_t m3_dlinear_bytes(const m3_dlinear *w) { return (size_t)(w->rows * w->cols) * (w->mxfp8 ? 1 : 2); }
size_t m3_dlinear_scale_bytes(const m3_dlinear *w) { return w->mxfp8 ? (size_t)(w->rows * (w->cols / 32)) : 0; }
void *m3_dlinear_at(const m3_dlinear *w, int x) { return (char *)w->w + (size_t)x * m3_dlinear_bytes(w); }
uint8_t *m3_dlinear_scale_at(const m3_dlinear *w, int x) {
  return w->scale ? w->scale + (size_t)x * m3_dlinear_scale_bytes(w) : NULL;
}

static m3_status dalloc(m3_model *m, void **p, size_t bytes, const char *what, m3_err *e) {
  *p = NULL;
  if (m->n_allocs == m->cap_allocs) {
    int cap = m->cap_allocs ? 2 * m->cap_allocs : 512;
    void **n = realloc(m->allocs, sizeof *n * (size_t)cap);
    if (!n) return m3_errf(e, M3_NOMEM, "model: allocation table");
    m->allocs = n;
    m->cap_allocs = cap;
  }
  cudaError_t r = cudaMalloc(p, bytes ? bytes : 16);
  if (r == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    return m3_errf(e, M3_CAPACITY, "model: %s: cannot allocate %zu bytes (%zu bytes free of %zu, %zu held by "
                   "weights so far)", what, bytes, fr, tot, m->weight_bytes);
  }
  if (r != cudaSuccess) return m3_cuda_fail(e, r, "cudaMalloc", __FILE__, __LINE__);
  m->allocs[m->n_allocs++] = *p;
  m->weight_bytes += bytes;
  if (m->weight_bytes > m->peak_bytes) m->peak_bytes = m->weight_bytes;
  return M3_OK;
}

/* Give back an allocation of dalloc (a whole tensor once its slice is out). */
static void dfree(m3_model *m, void *p, size_t bytes) {
  if (!p) return;
  for (int i = 0; i < m->n_allocs; i++)
    if (m->allocs[i] == p) {
      m->allocs[i] = m->allocs[--m->n_allocs];
      cudaFree(p);
      m->weight_bytes -= bytes;
      return;
    }
}

void m3_model_free(m3_model *m) {
  if (!m) return;
  for (int i = 0; i < m->n_allocs; i++) cudaFree(m->allocs[i]);
  free(m->allocs);
  free(m->layers);
  free(m);
}

static m3_status alloc_linear(m3_model *m, m3_dlinear *w, int64_t rows, int64_t cols, int n_stack, int mxfp8,
                              const char *what, m3_err *e) {
  memset(w, 0, sizeof *w);
  w->rows = rows;
  w->cols = cols;
  w->n_stack = n_stack;
  w->mxfp8 = mxfp8;
  if (mxfp8 && cols % 32)
    return m3_errf(e, M3_FORMAT, "model: %s: MXFP8 needs the input width %" PRId64 " to be a multiple of 32",
                   what, cols);
  M3_TRY(dalloc(m, &w->w, m3_dlinear_bytes(w) * (size_t)n_stack, what, e));
  if (mxfp8) M3_TRY(dalloc(m, (void **)&w->scale, m3_dlinear_scale_bytes(w) * (size_t)n_stack, what, e));
  return M3_OK;
}

static void free_linear(m3_model *m, m3_dlinear *w) {
  dfree(m, w->w, m3_dlinear_bytes(w) * (size_t)w->n_stack);
  dfree(m, w->scale, m3_dlinear_scale_bytes(w) * (size_t)w->n_stack);
  w->w = NULL;
  w->scale = NULL;
}

/* ---- tensor-parallel slices (model.h, TENSOR PARALLEL) ---------------------------- */

/* What a rank keeps of one [rows, cols] linear, the same for every stacked
 * expert: up to 5 row ranges, concatenated in order, of the column range
 * [c0, c0 + cn).  rows and cols are the whole tensor's. */
typedef struct cut {
  int64_t rows, cols;
  int n;
  int64_t r0[5], rn[5];
  int64_t c0, cn;
} cut;

enum { CUT_QKV, CUT_O, CUT_MLP_GU, CUT_MLP_DOWN, CUT_EXP_GU, CUT_EXP_DOWN, CUT_SH_GU, CUT_SH_DOWN };

static void cut_row(cut *k, int64_t r0, int64_t rn) {
  k->r0[k->n] = r0;
  k->rn[k->n++] = rn;
}

/* The rank's cut of a tensor of kind `kind` in layer l (whole dims from
 * m->whole, slices from m->part; spec §3.2 for the QKV rows). */
static cut cut_of(const m3_model *m, int l, int kind) {
  const m3_config *c = &m->whole;
  const m3_tp_rank *p = &m->part;
  const int64_t H = c->hidden_size, hd = c->head_dim, ID = c->sparse_index_dim, nq = c->num_attention_heads,
                nkv = c->num_key_value_heads, F = c->dense_intermediate_size, I = c->intermediate_size,
                S = m3_config_shared_width(c);
  cut k = {.n = 0, .c0 = 0};
  switch (kind) {
    case CUT_QKV: /* [q | k | v | index_q | index_k] */
      k.rows = m3_config_qkv_width(c, l);
      k.cols = H;
      cut_row(&k, p->q_head0 * hd, p->n_q_heads * hd);
      cut_row(&k, nq * hd + p->kv_head0 * hd, p->n_kv_heads * hd);
      cut_row(&k, (nq + nkv) * hd + p->kv_head0 * hd, p->n_kv_heads * hd);
      if (c->is_sparse[l]) {
        cut_row(&k, (nq + 2 * nkv) * hd + p->kv_head0 * ID, p->n_kv_heads * ID); /* index_q goes with the KV head */
        cut_row(&k, (nq + 2 * nkv) * hd + nkv * ID, ID);                        /* index_k: every rank */
      }
      k.cn = H;
      break;
    case CUT_O:
      k.rows = H, k.cols = nq * hd;
      cut_row(&k, 0, H);
      k.c0 = p->q_head0 * hd, k.cn = p->n_q_heads * hd;
      break;
    case CUT_MLP_GU: case CUT_EXP_GU: case CUT_SH_GU: {
      const int64_t W = kind == CUT_MLP_GU ? F : kind == CUT_EXP_GU ? I : S;
      const int64_t i0 = kind == CUT_MLP_GU ? p->dense_i0 : kind == CUT_EXP_GU ? p->moe_i0 : p->shared_i0;
      const int64_t n = kind == CUT_MLP_GU ? p->dense_n : kind == CUT_EXP_GU ? p->moe_n : p->shared_n;
      k.rows = 2 * W, k.cols = H;
      cut_row(&k, i0, n);     /* gate */
      cut_row(&k, W + i0, n); /* up, the same rows */
      k.cn = H;
      break;
    }
    default: { /* the down projections: the intermediate slice's columns */
      const int64_t W = kind == CUT_MLP_DOWN ? F : kind == CUT_EXP_DOWN ? I : S;
      k.rows = H, k.cols = W;
      cut_row(&k, 0, H);
      k.c0 = kind == CUT_MLP_DOWN ? p->dense_i0 : kind == CUT_EXP_DOWN ? p->moe_i0 : p->shared_i0;
      k.cn = kind == CUT_MLP_DOWN ? p->dense_n : kind == CUT_EXP_DOWN ? p->moe_n : p->shared_n;
      break;
    }
  }
  return k;
}

static m3_status cut_alloc(m3_model *m, const cut *k, int n_stack, int mxfp8, m3_dlinear *out, const char *what,
                           m3_err *e) {
  int64_t rows = 0;
  for (int i = 0; i < k->n; i++) rows += k->rn[i];
  if (mxfp8 && (k->c0 % 32 || k->cn % 32))
    return m3_errf(e, M3_FORMAT, "model: %s: the rank's columns [%" PRId64 ", %" PRId64 ") are not whole MXFP8 "
                   "blocks of 32", what, k->c0, k->c0 + k->cn);
  return alloc_linear(m, out, rows, k->cn, n_stack, mxfp8, what, e);
}

/* out's stacked element xd <- the cut of whole's element xs, on stream s.
 * Pitched copies: a column slice is cn of each row's cols elements; the
 * E8M0 scales are the same copy at 1/32 of the width. */
static m3_status cut_copy(const m3_dlinear *whole, int xs, m3_dlinear *out, int xd, const cut *k, cudaStream_t s,
                          m3_err *e) {
  const size_t el = whole->mxfp8 ? 1 : 2;
  const char *src = m3_dlinear_at(whole, xs);
  char *dst = m3_dlinear_at(out, xd);
  const uint8_t *ss = m3_dlinear_scale_at(whole, xs);
  uint8_t *sd = m3_dlinear_scale_at(out, xd);
  int64_t row = 0;
  for (int i = 0; i < k->n; i++) {
    M3_CUDA(e, cudaMemcpy2DAsync(dst + (size_t)(row * k->cn) * el, (size_t)k->cn * el,
                                 src + (size_t)(k->r0[i] * k->cols + k->c0) * el, (size_t)k->cols * el,
                                 (size_t)k->cn * el, (size_t)k->rn[i], cudaMemcpyDeviceToDevice, s));
    if (whole->mxfp8)
      M3_CUDA(e, cudaMemcpy2DAsync(sd + row * (k->cn / 32), (size_t)(k->cn / 32),
                                   ss + k->r0[i] * (k->cols / 32) + k->c0 / 32, (size_t)(k->cols / 32),
                                   (size_t)(k->cn / 32), (size_t)k->rn[i], cudaMemcpyDeviceToDevice, s));
    row += k->rn[i];
  }
  return M3_OK;
}

/* Replace *w (whole, every stacked element) by its cut, then free the whole. */
static m3_status cut_replace(m3_model *m, m3_dlinear *w, const cut *k, cudaStream_t s, const char *what,
                             m3_err *e) {
  if (w->rows != k->rows || w->cols != k->cols)
    return m3_errf(e, M3_FORMAT, "model: %s is [%" PRId64 ", %" PRId64 "], the config makes it [%" PRId64 ", %" PRId64
                   "]: cannot cut it for tensor parallelism", what, w->rows, w->cols, k->rows, k->cols);
  m3_dlinear whole = *w, part;
  M3_TRY(cut_alloc(m, k, whole.n_stack, whole.mxfp8, &part, what, e));
  for (int x = 0; x < whole.n_stack; x++) M3_TRY(cut_copy(&whole, x, &part, x, k, s, e));
  M3_CUDA(e, cudaStreamSynchronize(s)); /* the copies read the whole tensor: done before it is freed */
  free_linear(m, &whole);
  *w = part;
  return M3_OK;
}

/* The lm_head rows [vocab0, vocab0 + vocab_n) of a whole [V, H] table, as a
 * new allocation; the whole one is freed unless it is the (tied) embedding. */
static m3_status cut_lm_head(m3_model *m, m3_bf16 *whole, int free_whole, cudaStream_t s, m3_err *e) {
  const size_t H = (size_t)m->whole.hidden_size;
  M3_TRY(dalloc(m, (void **)&m->lm_head, (size_t)m->vocab_n * H * 2, "lm_head rows", e));
  M3_CUDA(e, cudaMemcpyAsync(m->lm_head, whole + (size_t)m->vocab0 * H, (size_t)m->vocab_n * H * 2,
                             cudaMemcpyDeviceToDevice, s));
  M3_CUDA(e, cudaStreamSynchronize(s));
  if (free_whole) dfree(m, whole, (size_t)m->whole.vocab_size * H * 2);
  return M3_OK;
}

/* After the whole config is known: the rank's plan and config. */
static m3_status tp_setup(m3_model *m, const m3_model_opts *o, m3_err *e) {
  m->whole = m->cfg;
  m->tp = o->tp > 1 ? o->tp : 1;
  m->rank = o->rank;
  m->vocab0 = 0;
  m->vocab_n = m->cfg.vocab_size;
  if (o->tp < 0 || (m->tp == 1 && o->rank != 0))
    return m3_errf(e, M3_INVAL, "model: tensor-parallel rank %d of %d", o->rank, o->tp);
  if (m->tp == 1) return M3_OK;
  M3_TRY(m3_tp_plan(&m->whole, m->tp, m->rank, &m->part, e));
  m3_tp_rank_config(&m->whole, &m->part, &m->cfg);
  m->vocab0 = m->part.vocab0;
  m->vocab_n = m->part.vocab_n;
  return M3_OK;
}

/* ---- sizes ---------------------------------------------------------------------- */

static uint64_t lin_bytes(uint64_t rows, uint64_t cols, int mxfp8) {
  return mxfp8 ? rows * cols + rows * (cols / 32) : 2 * rows * cols;
}

uint64_t m3_model_bytes(const m3_config *c, int n_res, int mxfp8) {
  const uint64_t H = (uint64_t)c->hidden_size, V = (uint64_t)c->vocab_size, E = (uint64_t)c->num_local_experts;
  const uint64_t I = (uint64_t)c->intermediate_size, S = (uint64_t)m3_config_shared_width(c),
                 F = (uint64_t)c->dense_intermediate_size, Q = (uint64_t)m3_config_q_width(c);
  uint64_t b = 2 * V * H * (c->tie_word_embeddings ? 1 : 2) + 2 * H;
  b += 2 * (uint64_t)c->max_position_embeddings * (uint64_t)c->rotary_dim;
  for (int l = 0; l < c->num_hidden_layers; l++) {
    b += 4 * H + 4 * (uint64_t)c->head_dim + 4 * (uint64_t)c->sparse_index_dim;
    b += lin_bytes((uint64_t)m3_config_qkv_width(c, l), H, mxfp8) + lin_bytes(H, Q, mxfp8);
    if (c->is_moe[l]) {
      b += 4 * E * H + 4 * E;
      b += (uint64_t)n_res * (lin_bytes(2 * I, H, mxfp8) + lin_bytes(H, I, mxfp8));
      if (S) b += lin_bytes(2 * S, H, mxfp8) + lin_bytes(H, S, mxfp8);
    } else {
      b += lin_bytes(2 * F, H, mxfp8) + lin_bytes(H, F, mxfp8);
    }
  }
  return b;
}

/* What a rank of m holds (its config's bytes with its lm_head rows) plus the
 * largest tensor it materialises whole on the way (model.h). */
static uint64_t rank_bytes(const m3_model *m, int n_res, int per_expert, int mxfp8) {
  const m3_config *c = &m->whole;
  const uint64_t H = (uint64_t)c->hidden_size, V = (uint64_t)c->vocab_size;
  uint64_t b = m3_model_bytes(&m->cfg, n_res, mxfp8) - (c->tie_word_embeddings ? 0 : 2 * V * H) +
               2 * (uint64_t)m->vocab_n * H;
  uint64_t big = 2 * V * H;
  const int x = per_expert ? 1 : n_res;
  for (int l = 0; l < c->num_hidden_layers; l++) {
    uint64_t t = lin_bytes((uint64_t)m3_config_qkv_width(c, l), H, mxfp8);
    if (t > big) big = t;
    if (c->is_moe[l]) t = (uint64_t)x * lin_bytes(2 * (uint64_t)c->intermediate_size, H, mxfp8);
    else t = lin_bytes(2 * (uint64_t)c->dense_intermediate_size, H, mxfp8);
    if (t > big) big = t;
  }
  return b + big;
}

static m3_status check_free(uint64_t need, const char *what, m3_err *e) {
  size_t fr = 0, tot = 0;
  M3_CUDA(e, cudaMemGetInfo(&fr, &tot));
  if (need > fr)
    return m3_errf(e, M3_CAPACITY, "model: %s needs %" PRIu64 " bytes of GPU memory, %zu are free (of %zu)",
                   what, need, fr, tot);
  return M3_OK;
}

static m3_status upload_rope(m3_model *m, m3_err *e) {
  const m3_config *c = &m->cfg;
  size_t n = (size_t)c->max_position_embeddings * (size_t)c->rotary_dim;
  m3_bf16 *h = malloc(n * sizeof *h);
  if (!h) return m3_errf(e, M3_NOMEM, "model: RoPE table of %d positions", c->max_position_embeddings);
  m3_rope_table((float)c->rope_theta, c->rotary_dim, c->max_position_embeddings, h);
  m3_status s = dalloc(m, (void **)&m->rope, n * sizeof *h, "RoPE table", e);
  if (s == M3_OK && cudaMemcpy(m->rope, h, n * sizeof *h, cudaMemcpyHostToDevice) != cudaSuccess)
    s = m3_errf(e, M3_CUDA, "model: uploading the RoPE table: %s", cudaGetErrorString(cudaGetLastError()));
  free(h);
  return s;
}

/* ---- synthetic ------------------------------------------------------------------ */

typedef struct {
  m3_rt *rt;
  m3_model *m;
  uint64_t seed;
} synth;

static m3_status syn_vec(synth *g, void **p, int64_t n, const char *dtype, const char *name, m3_err *e) {
  size_t el = !strcmp(dtype, "f32") ? 4 : 2;
  M3_TRY(dalloc(g->m, p, (size_t)n * el, name, e));
  return m3_fill(g->rt, *p, n, dtype, m3_synth_seed(g->seed, name), INIT_STD, g->rt->stream, e);
}

/* A whole [n_stack, rows, cols] linear filled from its name's seed; under
 * tensor parallelism then cut to the rank's slice of kind `kind` (layer l),
 * so a rank's values are the whole model's. */
static m3_status syn_linear(synth *g, m3_dlinear *w, int64_t rows, int64_t cols, int n_stack, const char *name,
                            int l, int kind, m3_err *e) {
  M3_TRY(alloc_linear(g->m, w, rows, cols, n_stack, g->m->mxfp8, name, e));
  int64_t n = rows * cols * n_stack;
  uint64_t sd = m3_synth_seed(g->seed, name);
  if (!w->mxfp8) {
    M3_TRY(m3_fill(g->rt, w->w, n, "bf16", sd, INIT_STD, g->rt->stream, e));
  } else {
    M3_TRY(m3_fill(g->rt, w->w, n, "e4m3", sd, SYNTH_Q_STD, g->rt->stream, e));
    M3_CUDA(e, cudaMemsetAsync(w->scale, SYNTH_SCALE_E8M0, m3_dlinear_scale_bytes(w) * (size_t)n_stack,
                               g->rt->stream));
  }
  if (g->m->tp == 1) return M3_OK;
  const cut k = cut_of(g->m, l, kind);
  return cut_replace(g->m, w, &k, g->rt->stream, name, e);
}

static m3_status synth_layer(synth *g, int l, m3_err *e) {
  m3_model *m = g->m;
  const m3_config *c = &m->whole; /* whole tensors, cut by syn_linear */
  m3_dlayer *L = &m->layers[l];
  const int64_t H = c->hidden_size, hd = c->head_dim, idim = c->sparse_index_dim;
  char nm[96];
#define NAME(s) (snprintf(nm, sizeof nm, "layers.%d.%s", l, s), nm)
  M3_TRY(syn_vec(g, (void **)&L->input_norm, H, "bf16", NAME("input_layernorm"), e));
  M3_TRY(syn_vec(g, (void **)&L->post_norm, H, "bf16", NAME("post_attention_layernorm"), e));
  M3_TRY(syn_vec(g, (void **)&L->q_norm, hd, "bf16", NAME("q_norm"), e));
  M3_TRY(syn_vec(g, (void **)&L->k_norm, hd, "bf16", NAME("k_norm"), e));
  if (L->sparse) {
    M3_TRY(syn_vec(g, (void **)&L->iq_norm, idim, "bf16", NAME("index_q_norm"), e));
    M3_TRY(syn_vec(g, (void **)&L->ik_norm, idim, "bf16", NAME("index_k_norm"), e));
  }
  M3_TRY(syn_linear(g, &L->qkv, m3_config_qkv_width(c, l), H, 1, NAME("qkv_proj"), l, CUT_QKV, e));
  M3_TRY(syn_linear(g, &L->o, H, m3_config_q_width(c), 1, NAME("o_proj"), l, CUT_O, e));
  if (!L->moe) {
    const int64_t F = c->dense_intermediate_size;
    M3_TRY(syn_linear(g, &L->mlp_gu, 2 * F, H, 1, NAME("mlp.gate_up_proj"), l, CUT_MLP_GU, e));
    M3_TRY(syn_linear(g, &L->mlp_down, H, F, 1, NAME("mlp.down_proj"), l, CUT_MLP_DOWN, e));
    return M3_OK;
  }
  const int E = c->num_local_experts;
  const int64_t I = c->intermediate_size, S = m3_config_shared_width(c);
  M3_TRY(syn_vec(g, (void **)&L->router, (int64_t)E * H, "f32", NAME("router"), e));
  /* The bias on the host: resident experts get synthetic values, the others
   * -inf, which is the restricted-routing mask (model.h). */
  float *b = malloc(sizeof *b * (size_t)E);
  if (!b) return m3_errf(e, M3_NOMEM, "model: bias");
  uint64_t bs = m3_synth_seed(g->seed, NAME("e_score_correction_bias"));
  for (int x = 0; x < E; x++)
    b[x] = x >= m->n_resident ? -INFINITY : c->use_routing_bias ? m3_synth_value(bs, x, INIT_STD) : 0.0f;
  m3_status s = dalloc(m, (void **)&L->bias, sizeof *b * (size_t)E, "bias", e);
  if (s == M3_OK && cudaMemcpy(L->bias, b, sizeof *b * (size_t)E, cudaMemcpyHostToDevice) != cudaSuccess)
    s = m3_errf(e, M3_CUDA, "model: uploading layer %d bias", l);
  free(b);
  M3_TRY(s);
  M3_TRY(syn_linear(g, &L->w13, 2 * I, H, m->n_resident, NAME("experts.w13"), l, CUT_EXP_GU, e));
  M3_TRY(syn_linear(g, &L->w2, H, I, m->n_resident, NAME("experts.w2"), l, CUT_EXP_DOWN, e));
  if (S) {
    M3_TRY(syn_linear(g, &L->sh_gu, 2 * S, H, 1, NAME("shared_experts.gate_up_proj"), l, CUT_SH_GU, e));
    M3_TRY(syn_linear(g, &L->sh_down, H, S, 1, NAME("shared_experts.down_proj"), l, CUT_SH_DOWN, e));
  }
#undef NAME
  return M3_OK;
}

static m3_status load_synthetic(m3_rt *rt, m3_model *m, const m3_model_opts *o, m3_err *e) {
  M3_TRY(tp_setup(m, o, e));
  const m3_config *c = &m->whole;
  const int E = c->num_local_experts;
  m->n_resident = o->resident_experts > 0 ? o->resident_experts : (E < 8 ? E : 8);
  if (m->n_resident > E || m->n_resident < c->num_experts_per_tok)
    return m3_errf(e, M3_INVAL, "model: %d resident experts: must be in [num_experts_per_tok %d, "
                   "num_local_experts %d] (routing picks %d of the resident ones)", m->n_resident,
                   c->num_experts_per_tok, E, c->num_experts_per_tok);
  /* auto: MXFP8 for real-sized models (what the released checkpoint is and
   * what makes a decode step read the real bytes), bf16 for small ones */
  m->mxfp8 = o->mxfp8 >= 0 ? o->mxfp8 : c->hidden_size >= 4096;
  uint64_t need = m->tp > 1 ? rank_bytes(m, m->n_resident, 0, m->mxfp8) : m3_model_bytes(c, m->n_resident, m->mxfp8);
  M3_TRY(check_free(need, m->tp > 1 ? "the rank's synthetic weights" : "the synthetic weights", e));
  m->layers = calloc((size_t)c->num_hidden_layers, sizeof *m->layers);
  if (!m->layers) return m3_errf(e, M3_NOMEM, "model: layers");
  synth g = {rt, m, o->seed};
  const int64_t V = c->vocab_size, H = c->hidden_size;
  M3_TRY(syn_vec(&g, (void **)&m->embed, V * H, "bf16", "embed_tokens", e));
  if (c->tie_word_embeddings) m->lm_head = m->embed;
  else M3_TRY(syn_vec(&g, (void **)&m->lm_head, V * H, "bf16", "lm_head", e));
  if (m->tp > 1) M3_TRY(cut_lm_head(m, m->lm_head, !c->tie_word_embeddings, rt->stream, e));
  M3_TRY(syn_vec(&g, (void **)&m->final_norm, H, "bf16", "norm", e));
  for (int l = 0; l < c->num_hidden_layers; l++) {
    m->layers[l].sparse = c->is_sparse[l];
    m->layers[l].moe = c->is_moe[l];
    m3_status s = synth_layer(&g, l, e);
    if (s != M3_OK) return m3_err_prefix(e, "layer %d: ", l);
  }
  M3_TRY(upload_rope(m, e));
  M3_CUDA(e, cudaStreamSynchronize(rt->stream));
  if (m->n_resident < E)
    snprintf(m->source, sizeof m->source, "synthetic, %d of %d experts resident (routing restricted), %s, seed %llu",
             m->n_resident, E, m->mxfp8 ? "MXFP8" : "bf16", (unsigned long long)o->seed);
  else
    snprintf(m->source, sizeof m->source, "synthetic, %s, seed %llu", m->mxfp8 ? "MXFP8" : "bf16",
             (unsigned long long)o->seed);
  return M3_OK;
}

/* ---- checkpoint ----------------------------------------------------------------- */

static m3_status upload_member(m3_model *m, const m3_weight *w, m3_dlinear *dst, int x, int64_t row0,
                               m3_err *e) {
  const m3_st_tensor *t = w->w;
  const int64_t rows = t->shape[0], cols = t->shape[1];
  if (cols != dst->cols)
    return m3_errf(e, M3_FORMAT, "model: %s: %" PRId64 " columns, the fused weight has %" PRId64, t->name, cols,
                   dst->cols);
  const int is_q = t->dtype == M3_DT_F8_E4M3;
  char *base = (char *)m3_dlinear_at(dst, x);
  if (dst->mxfp8) { /* every member is MXFP8 (the caller checked) */
    M3_CUDA(e, cudaMemcpy(base + row0 * cols, t->data, (size_t)t->nbytes, cudaMemcpyHostToDevice));
    if (w->scale->nbytes != (uint64_t)(rows * (cols / 32)))
      return m3_errf(e, M3_FORMAT, "model: %s: scale holds %" PRIu64 " bytes, expected %" PRId64, t->name,
                     w->scale->nbytes, rows * (cols / 32));
    M3_CUDA(e, cudaMemcpy(m3_dlinear_scale_at(dst, x) + row0 * (cols / 32), w->scale->data,
                          (size_t)w->scale->nbytes, cudaMemcpyHostToDevice));
    return M3_OK;
  }
  if (!is_q) {
    M3_CUDA(e, cudaMemcpy(base + row0 * cols * 2, t->data, (size_t)t->nbytes, cudaMemcpyHostToDevice));
    return M3_OK;
  }
  /* An MXFP8 member of a bf16 destination: dequantise on the host (exact). */
  if (cols % 32) return m3_errf(e, M3_FORMAT, "model: %s: MXFP8 width %" PRId64 " not a multiple of 32", t->name, cols);
  m3_bf16 *tmp = malloc((size_t)(rows * cols) * sizeof *tmp);
  if (!tmp) return m3_errf(e, M3_NOMEM, "model: dequantising %s", t->name);
  m3_status s = m3_ref_mxfp8_dequant(rows, cols, t->data, w->scale->data, tmp, e);
  if (s == M3_OK && cudaMemcpy(base + row0 * cols * 2, tmp, (size_t)(rows * cols) * 2, cudaMemcpyHostToDevice) !=
                        cudaSuccess)
    s = m3_errf(e, M3_CUDA, "model: uploading %s", t->name);
  free(tmp);
  return s;
}

static int expert_role(m3_role r) {
  return r == M3_ROLE_EXPERT_W1 || r == M3_ROLE_EXPERT_W3 || r == M3_ROLE_EXPERT_W2;
}

/* Fuse / stack the members into one m3_dlinear: MXFP8 iff every member is.
 * Under tensor parallelism (kind >= 0) each stacked element is fused whole
 * into a one-element scratch, its cut copied out, and the scratch reused for
 * the next: the whole tensor on the device is one expert at most. */
/* Stacked element x of the members, fused row after row into element xd of dst. */
static m3_status fuse_element(m3_model *m, const m3_ckpt *k, int layer, const m3_role *roles, int n_roles, int x,
                              m3_dlinear *dst, int xd, m3_err *e) {
  int64_t row0 = 0;
  for (int i = 0; i < n_roles; i++) {
    const m3_weight *w = m3_ckpt_get(k, layer, roles[i], expert_role(roles[i]) ? x : -1);
    M3_TRY(upload_member(m, w, dst, xd, row0, e));
    row0 += w->w->shape[0];
  }
  return M3_OK;
}

static m3_status ckpt_linear(m3_model *m, const m3_ckpt *k, int layer, const m3_role *roles, int n_roles,
                             int n_stack, int kind, m3_dlinear *dst, const char *what, m3_err *e) {
  int64_t rows = 0, cols = -1;
  int all_q = 1;
  for (int x = 0; x < n_stack; x++) {
    int64_t r = 0;
    for (int i = 0; i < n_roles; i++) {
      const m3_weight *w = m3_ckpt_get(k, layer, roles[i], expert_role(roles[i]) ? x : -1);
      if (!w || !w->w)
        return m3_errf(e, M3_NOTFOUND, "model: layer %d: no %s weight", layer, m3_role_name(roles[i]));
      all_q &= w->w->dtype == M3_DT_F8_E4M3 && w->scale != NULL;
      r += w->w->shape[0];
      cols = w->w->shape[1];
    }
    rows = r;
  }
  if (m->tp == 1 || kind < 0) {
    M3_TRY(alloc_linear(m, dst, rows, cols, n_stack, all_q, what, e));
    for (int x = 0; x < n_stack; x++) M3_TRY(fuse_element(m, k, layer, roles, n_roles, x, dst, x, e));
    return M3_OK;
  }
  const cut ct = cut_of(m, layer, kind);
  if (rows != ct.rows || cols != ct.cols)
    return m3_errf(e, M3_FORMAT, "model: layer %d: %s is [%" PRId64 ", %" PRId64 "] in the checkpoint, the config "
                   "makes it [%" PRId64 ", %" PRId64 "]: cannot cut it for tensor parallelism", layer, what, rows, cols,
                   ct.rows, ct.cols);
  M3_TRY(cut_alloc(m, &ct, n_stack, all_q, dst, what, e));
  m3_dlinear tmp;
  M3_TRY(alloc_linear(m, &tmp, rows, cols, 1, all_q, what, e));
  m3_status s = M3_OK;
  for (int x = 0; x < n_stack && s == M3_OK; x++) {
    s = fuse_element(m, k, layer, roles, n_roles, x, &tmp, 0, e);
    /* the uploads are cudaMemcpy on the legacy stream: the cut goes there
     * too, behind them, and the next upload behind the cut */
    if (s == M3_OK) s = cut_copy(&tmp, 0, dst, x, &ct, 0, e);
  }
  if (s == M3_OK && cudaStreamSynchronize(0) != cudaSuccess)
    s = m3_errf(e, M3_CUDA, "model: cutting %s: %s", what, cudaGetErrorString(cudaGetLastError()));
  free_linear(m, &tmp);
  return s;
}

/* A [n] vector to the device as bf16 (norms) or fp32 (router, bias). */
static m3_status ckpt_vec(m3_model *m, const m3_ckpt *k, int layer, m3_role r, int as_f32, void **out,
                          m3_err *e) {
  const m3_weight *w = m3_ckpt_get(k, layer, r, -1);
  if (!w || !w->w) return m3_errf(e, M3_NOTFOUND, "model: layer %d: no %s weight", layer, m3_role_name(r));
  const m3_st_tensor *t = w->w;
  size_t n = (size_t)t->numel, el = as_f32 ? 4 : 2;
  M3_TRY(dalloc(m, out, n * el, t->name, e));
  if ((as_f32 && t->dtype == M3_DT_F32) || (!as_f32 && t->dtype == M3_DT_BF16)) {
    M3_CUDA(e, cudaMemcpy(*out, t->data, (size_t)t->nbytes, cudaMemcpyHostToDevice));
    return M3_OK;
  }
  float *f = malloc(n * sizeof *f);
  if (!f) return m3_errf(e, M3_NOMEM, "model: %s", t->name);
  m3_status s = m3_st_to_f32(t, f, n, e);
  if (s == M3_OK && !as_f32) /* F32 norm weights are rounded to the model's bf16 once */
    for (size_t i = 0; i < n; i++) ((m3_bf16 *)f)[i] = m3_f32_to_bf16(f[i]);
  if (s == M3_OK && cudaMemcpy(*out, f, n * el, cudaMemcpyHostToDevice) != cudaSuccess)
    s = m3_errf(e, M3_CUDA, "model: uploading %s", t->name);
  free(f);
  return s;
}

static m3_status ckpt_layer(m3_model *m, const m3_ckpt *k, int l, m3_err *e) {
  const m3_config *c = &m->whole;
  m3_dlayer *L = &m->layers[l];
  M3_TRY(ckpt_vec(m, k, l, M3_ROLE_INPUT_NORM, 0, (void **)&L->input_norm, e));
  M3_TRY(ckpt_vec(m, k, l, M3_ROLE_POST_NORM, 0, (void **)&L->post_norm, e));
  M3_TRY(ckpt_vec(m, k, l, M3_ROLE_Q_NORM, 0, (void **)&L->q_norm, e));
  M3_TRY(ckpt_vec(m, k, l, M3_ROLE_K_NORM, 0, (void **)&L->k_norm, e));
  static const m3_role qkv[5] = {M3_ROLE_Q_PROJ, M3_ROLE_K_PROJ, M3_ROLE_V_PROJ, M3_ROLE_INDEX_Q_PROJ,
                                 M3_ROLE_INDEX_K_PROJ};
  M3_TRY(ckpt_linear(m, k, l, qkv, L->sparse ? 5 : 3, 1, CUT_QKV, &L->qkv, "qkv", e));
  if (L->sparse) {
    M3_TRY(ckpt_vec(m, k, l, M3_ROLE_INDEX_Q_NORM, 0, (void **)&L->iq_norm, e));
    M3_TRY(ckpt_vec(m, k, l, M3_ROLE_INDEX_K_NORM, 0, (void **)&L->ik_norm, e));
  }
  static const m3_role o[1] = {M3_ROLE_O_PROJ};
  M3_TRY(ckpt_linear(m, k, l, o, 1, 1, CUT_O, &L->o, "o_proj", e));
  if (!L->moe) {
    static const m3_role gu[2] = {M3_ROLE_MLP_GATE, M3_ROLE_MLP_UP}, dn[1] = {M3_ROLE_MLP_DOWN};
    M3_TRY(ckpt_linear(m, k, l, gu, 2, 1, CUT_MLP_GU, &L->mlp_gu, "mlp gate/up", e));
    return ckpt_linear(m, k, l, dn, 1, 1, CUT_MLP_DOWN, &L->mlp_down, "mlp down", e);
  }
  const int E = c->num_local_experts;
  M3_TRY(ckpt_vec(m, k, l, M3_ROLE_MOE_ROUTER, 1, (void **)&L->router, e));
  if (c->use_routing_bias) {
    M3_TRY(ckpt_vec(m, k, l, M3_ROLE_MOE_BIAS, 1, (void **)&L->bias, e));
  } else { /* zeros: the router kernel always adds a bias (s + 0 == s) */
    M3_TRY(dalloc(m, (void **)&L->bias, sizeof(float) * (size_t)E, "bias", e));
    M3_CUDA(e, cudaMemset(L->bias, 0, sizeof(float) * (size_t)E));
  }
  static const m3_role w13[2] = {M3_ROLE_EXPERT_W1, M3_ROLE_EXPERT_W3}, w2[1] = {M3_ROLE_EXPERT_W2};
  M3_TRY(ckpt_linear(m, k, l, w13, 2, E, CUT_EXP_GU, &L->w13, "experts w1/w3", e));
  M3_TRY(ckpt_linear(m, k, l, w2, 1, E, CUT_EXP_DOWN, &L->w2, "experts w2", e));
  if (c->n_shared_experts) {
    static const m3_role sgu[2] = {M3_ROLE_SHARED_GATE, M3_ROLE_SHARED_UP}, sdn[1] = {M3_ROLE_SHARED_DOWN};
    M3_TRY(ckpt_linear(m, k, l, sgu, 2, 1, CUT_SH_GU, &L->sh_gu, "shared gate/up", e));
    M3_TRY(ckpt_linear(m, k, l, sdn, 1, 1, CUT_SH_DOWN, &L->sh_down, "shared down", e));
  }
  return M3_OK;
}

static m3_status ckpt_embed(m3_model *m, const m3_ckpt *k, m3_role r, m3_bf16 **out, m3_err *e) {
  const m3_weight *w = m3_ckpt_get(k, -1, r, -1);
  if (!w || !w->w) return m3_errf(e, M3_NOTFOUND, "model: no %s weight", m3_role_name(r));
  M3_TRY(dalloc(m, (void **)out, (size_t)w->w->nbytes, w->w->name, e));
  M3_CUDA(e, cudaMemcpy(*out, w->w->data, (size_t)w->w->nbytes, cudaMemcpyHostToDevice));
  return M3_OK;
}

/* Bytes of every bound tensor (an upper bound of what the upload holds, but for
 * mixed-format fusions that dequantise). */
static uint64_t ckpt_bytes(const m3_config *c, const m3_ckpt *k) {
  m3_tensor_spec *sp = NULL;
  size_t n = 0;
  m3_err e;
  uint64_t b = 2 * (uint64_t)c->max_position_embeddings * (uint64_t)c->rotary_dim;
  if (m3_ckpt_expected(c, &sp, &n, &e) != M3_OK) return b;
  for (size_t i = 0; i < n; i++) {
    const m3_weight *w = m3_ckpt_get(k, sp[i].layer, sp[i].role, sp[i].expert);
    if (w && w->w) b += w->w->nbytes + (w->scale ? w->scale->nbytes : 0);
  }
  free(sp);
  return b;
}

static m3_status load_ckpt(m3_model *m, const m3_model_opts *o, m3_err *e) {
  const char *dir = o->dir;
  char p[4200];
  snprintf(p, sizeof p, "%s/config.json", dir);
  M3_TRY(m3_config_load_file(p, &m->cfg, e));
  M3_TRY(tp_setup(m, o, e));
  const m3_config *c = &m->whole;
  m3_st *st = NULL;
  m3_ckpt *k = NULL;
  M3_TRY(m3_st_open(dir, &st, e));
  m3_status s = m3_ckpt_bind(c, st, dir, &k, e);
  if (s == M3_OK && m->tp > 1)
    s = check_free(rank_bytes(m, c->num_local_experts, 1, !strcmp(c->quant_method, "mxfp8")),
                   "the rank's share of the checkpoint's weights", e);
  else if (s == M3_OK)
    s = check_free(ckpt_bytes(c, k), "the checkpoint's weights", e);
  m->layers = calloc((size_t)c->num_hidden_layers, sizeof *m->layers);
  if (s == M3_OK && !m->layers) s = m3_errf(e, M3_NOMEM, "model: layers");
  m->n_resident = c->num_local_experts;
  if (s == M3_OK) s = ckpt_embed(m, k, M3_ROLE_EMBED, &m->embed, e);
  if (s == M3_OK && c->tie_word_embeddings) m->lm_head = m->embed;
  else if (s == M3_OK) s = ckpt_embed(m, k, M3_ROLE_LM_HEAD, &m->lm_head, e);
  if (s == M3_OK && m->tp > 1) s = cut_lm_head(m, m->lm_head, !c->tie_word_embeddings, 0, e);
  if (s == M3_OK) s = ckpt_vec(m, k, -1, M3_ROLE_FINAL_NORM, 0, (void **)&m->final_norm, e);
  for (int l = 0; s == M3_OK && l < c->num_hidden_layers; l++) {
    m->layers[l].sparse = c->is_sparse[l];
    m->layers[l].moe = c->is_moe[l];
    if ((s = ckpt_layer(m, k, l, e)) != M3_OK) m3_err_prefix(e, "layer %d: ", l);
    m->mxfp8 |= m->layers[l].qkv.mxfp8 | m->layers[l].o.mxfp8;
  }
  if (s == M3_OK) s = upload_rope(m, e);
  snprintf(m->source, sizeof m->source, "checkpoint %.120s%s", dir, m->mxfp8 ? " (MXFP8)" : " (bf16)");
  m3_ckpt_free(k);
  m3_st_close(st);
  return s;
}

/* ---- entry ---------------------------------------------------------------------- */

m3_status m3_model_load(m3_rt *rt, const m3_model_opts *o, m3_model **out, m3_err *e) {
  *out = NULL;
  m3_model *m = calloc(1, sizeof *m);
  if (!m) return m3_errf(e, M3_NOMEM, "model");
  m3_status s;
  if (o->dir) {
    s = load_ckpt(m, o, e);
  } else {
    if (o->config) m->cfg = *o->config, s = M3_OK;
    else s = m3_config_preset(o->preset ? o->preset : "tiny", &m->cfg, e);
    if (s == M3_OK) s = load_synthetic(rt, m, o, e);
  }
  if (s == M3_OK && m->tp > 1) {
    size_t l = strlen(m->source);
    snprintf(m->source + l, sizeof m->source - l, ", tp rank %d of %d", m->rank, m->tp);
  }
  if (s != M3_OK) {
    m3_model_free(m);
    return s;
  }
  *out = m;
  return M3_OK;
}

/* See model.h: random cache entries stand in for a prefill. */
m3_status m3_kv_fill_synthetic(m3_rt *rt, m3_kv_cache *kv, const int *seqs, int batch, int n, uint64_t seed,
                               m3_err *e) {
  const m3_config *c = &kv->cfg;
  int64_t *pos = malloc(sizeof *pos * (size_t)n), *slot = malloc(sizeof *slot * (size_t)n);
  if (!pos || !slot) {
    free(pos), free(slot);
    return m3_errf(e, M3_NOMEM, "synthetic cache: slot lists");
  }
  m3_status s = M3_OK;
  for (int b = 0; b < batch && s == M3_OK; b++) s = m3_kv_append(kv, seqs[b], n, pos, slot, e);
  free(pos), free(slot);
  const int64_t tok = kv->plan.num_pages * (int64_t)kv->plan.page_size;
  for (int l = 0; l < c->num_hidden_layers && s == M3_OK; l++) {
    s = m3_fill(rt, kv->kv[l], tok * c->num_key_value_heads * 2 * c->head_dim, kv->plan.kv_e4m3 ? "e4m3" : "bf16",
                seed * 1000003u + (uint64_t)l, 1.0f, rt->stream, e);
    if (s == M3_OK && c->is_sparse[l])
      s = m3_fill(rt, kv->ix[l], tok * c->sparse_index_dim, kv->plan.idx_e4m3 ? "e4m3" : "bf16",
                  seed * 1000003u + 500000u + (uint64_t)l, 1.0f, rt->stream, e);
  }
  if (s == M3_OK) s = m3_kv_sync(kv, rt->stream, e);
  if (s == M3_OK && cudaStreamSynchronize(rt->stream) != cudaSuccess)
    s = m3_errf(e, M3_CUDA, "synthetic cache fill: %s", cudaGetErrorString(cudaGetLastError()));
  return s;
}

