/* op_ffn.c - keys and launchers of the FFN-side kernels (op_ffn.h), and the
 * MoE layer assembled from them.  Every launcher re-reads the kernel's own
 * key to check it was built for the arguments it is handed: a kernel's
 * compile-time shape can never silently disagree with the call (the kind of
 * fault where a constant is lost between config and kernel, faults 21, 22). */
#include "runtime/op_ffn.h"

#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/check.h"

/* ------------------------------------------------------------------------ */
/* Shared helpers                                                           */
/* ------------------------------------------------------------------------ */

static int misaligned(const void *p) { return ((uintptr_t)p & 15u) != 0; }

static m3_status want_axis(const m3_kernel *k, const char *axis, long value, const char *what, m3_err *e) {
  long got = m3_variant_axis_int(&k->key, axis, LONG_MIN);
  if (got != value)
    return m3_errf(e, M3_INVAL, "%s: kernel %s was built for %s=%ld, called with %ld", what, k->key.op, axis, got,
                   value);
  return M3_OK;
}

static m3_status want_str(const m3_kernel *k, const char *axis, const char *value, const char *what, m3_err *e) {
  const char *got = m3_variant_axis(&k->key, axis);
  if (!got || strcmp(got, value))
    return m3_errf(e, M3_INVAL, "%s: kernel %s was built for %s=%s, called with %s", what, k->key.op, axis,
                   got ? got : "(none)", value);
  return M3_OK;
}

/* gx x gy CTAs, in thread-block clusters of cx along x (1: none; cx divides gx). */
static m3_status launch_cluster(const m3_kernel *k, uint64_t gx, unsigned gy, unsigned cx, cudaStream_t s, void **args,
                                m3_err *e) {
  if (gx == 0) return M3_OK;
  if (gx > 0x7fffffffu) return m3_errf(e, M3_INVAL, "%s: grid of %" PRIu64 " CTAs is too large", k->key.op, gx);
  return m3_launch_cluster(&k->mod, (unsigned)gx, gy, 1, cx, (CUstream)s, args, e);
}

static m3_status launch(const m3_kernel *k, uint64_t gx, unsigned gy, cudaStream_t s, void **args, m3_err *e) {
  return launch_cluster(k, gx, gy, 1, s, args, e);
}

m3_status m3_err_word_take(int32_t *err_word, cudaStream_t stream, int64_t *first_bad, m3_err *e) {
  int32_t v = 0;
  *first_bad = -1;
  M3_CUDA(e, cudaMemcpyAsync(&v, err_word, sizeof v, cudaMemcpyDeviceToHost, stream));
  M3_CUDA(e, cudaStreamSynchronize(stream));
  if (v) {
    *first_bad = (int64_t)(INT32_MAX - v);
    M3_CUDA(e, cudaMemsetAsync(err_word, 0, sizeof v, stream));
  }
  return M3_OK;
}

/* ------------------------------------------------------------------------ */
/* RMSNorm                                                                  */
/* ------------------------------------------------------------------------ */

static m3_status norm_key(int add, int f32copy, int combine, int n, m3_variant *v, m3_err *e) {
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "rmsnorm(add=%d,f32copy=%d,combine=%d,n=%d)", add ? 1 : 0, f32copy ? 1 : 0, combine, n);
  return m3_variant_parse(k, v, e);
}

m3_status m3_rmsnorm_key(int add, int f32copy, int n, m3_variant *v, m3_err *e) {
  return norm_key(add, f32copy, 0, n, v, e);
}

m3_status m3_rmsnorm_combine_key(int topk, int f32copy, int n, m3_variant *v, m3_err *e) {
  return norm_key(1, f32copy, topk, n, v, e);
}

/* The three launchers' checks and launch.  combine = 0: x as it is;
 * combine = K: ey/ew/esh instead of x, the combine kernel's 3 parameters
 * after the plain kernel's 7 (templates/rmsnorm.lua).  One argument array
 * serves both: a launch reads as many as the kernel declares (CUDA, and the
 * emulator from the kernel's signature). */
static m3_status norm_common(const m3_kernel *k, int add, int combine, int64_t n_rows, int n, const void *x,
                             void *residual, const void *w, float eps, void *y, float *y32, const void *ey,
                             const float *ew, const void *esh, cudaStream_t s, m3_err *e) {
  const char *what = combine ? "add_rmsnorm_combine" : add ? "add_rmsnorm" : "rmsnorm";
  M3_TRY(want_axis(k, "add", add, what, e));
  M3_TRY(want_axis(k, "combine", combine, what, e));
  M3_TRY(want_axis(k, "n", n, what, e));
  M3_TRY(want_axis(k, "f32copy", y32 != NULL, what, e));
  if (n_rows < 0 || n_rows > INT32_MAX) return m3_errf(e, M3_INVAL, "%s: %" PRId64 " rows", what, n_rows);
  if (n % 8 == 0 && ((!combine && misaligned(x)) || misaligned(y) || misaligned(w) || (add && misaligned(residual)) ||
                     (y32 && misaligned(y32)) || (combine && (misaligned(ey) || misaligned(esh)))))
    return m3_errf(e, M3_INVAL, "%s: pointers must be 16-byte aligned (vector path)", what);
  long long rows = n_rows;
  void *args[] = {&x, &residual, &w, &y, &y32, &rows, &eps, &ey, &ew, &esh};
  /* Tile cluster=C: a row is C CTAs, one thread-block cluster (templates/rmsnorm.lua). */
  const long cl = m3_variant_tile_int(&k->key, "cluster", 1);
  if (cl < 1 || cl > 8) return m3_errf(e, M3_INVAL, "%s: tile cluster=%ld (1..8)", what, cl);
  return launch_cluster(k, (uint64_t)n_rows * (uint64_t)cl, 1, (unsigned)cl, s, args, e);
}

m3_status m3_launch_rmsnorm(const m3_kernel *k, int64_t n_rows, int n, const void *x, const void *w, float eps,
                            void *y, float *y32, cudaStream_t stream, m3_err *e) {
  return norm_common(k, 0, 0, n_rows, n, x, NULL, w, eps, y, y32, NULL, NULL, NULL, stream, e);
}

m3_status m3_launch_add_rmsnorm(const m3_kernel *k, int64_t n_rows, int n, const void *x, void *residual,
                                const void *w, float eps, void *y, float *y32, cudaStream_t stream, m3_err *e) {
  if (residual == y) return m3_errf(e, M3_INVAL, "add_rmsnorm: y must not alias residual");
  return norm_common(k, 1, 0, n_rows, n, x, residual, w, eps, y, y32, NULL, NULL, NULL, stream, e);
}

/* [p, p + bytes) and [q, q + bytes2) overlap */
static int overlaps(const void *p, size_t bytes, const void *q, size_t bytes2) {
  const uintptr_t a = (uintptr_t)p, b = (uintptr_t)q;
  return a < b + bytes2 && b < a + bytes;
}

m3_status m3_launch_add_rmsnorm_combine(const m3_kernel *k, int64_t n_rows, int n, int topk, const void *ey,
                                        const float *ew, const void *esh, void *residual, const void *w, float eps,
                                        void *y, float *y32, cudaStream_t stream, m3_err *e) {
  if (topk < 1) return m3_errf(e, M3_INVAL, "add_rmsnorm_combine: top-k %d", topk);
  if (!ey || !ew || !esh || !residual)
    return m3_errf(e, M3_INVAL, "add_rmsnorm_combine: expert outputs, weights, shared output and residual are required");
  if (((uintptr_t)ew & 3u) != 0) return m3_errf(e, M3_INVAL, "add_rmsnorm_combine: weights must be 4-byte aligned");
  /* every CTA reads other rows of ey than the one of y it writes */
  const size_t row = (size_t)(n > 0 ? n : 0) * 2, rows = n_rows > 0 ? (size_t)n_rows : 0;
  if (overlaps(y, rows * row, ey, rows * (size_t)topk * row) || overlaps(y, rows * row, esh, rows * row) ||
      overlaps(y, rows * row, residual, rows * row))
    return m3_errf(e, M3_INVAL, "add_rmsnorm_combine: y must not overlap the expert outputs, shared output or residual");
  /* ... nor may the residual it rewrites, nor the fp32 copy */
  if (overlaps(residual, rows * row, ey, rows * (size_t)topk * row) || overlaps(residual, rows * row, esh, rows * row) ||
      (y32 && (overlaps(y32, rows * row * 2, ey, rows * (size_t)topk * row) ||
               overlaps(y32, rows * row * 2, esh, rows * row) || overlaps(y32, rows * row * 2, residual, rows * row) ||
               overlaps(y32, rows * row * 2, y, rows * row))))
    return m3_errf(e, M3_INVAL, "add_rmsnorm_combine: the residual and the fp32 copy must not overlap the expert "
                   "outputs, the shared output or each other");
  return norm_common(k, 1, topk, n_rows, n, NULL, residual, w, eps, y, y32, ey, ew, esh, stream, e);
}

/* ------------------------------------------------------------------------ */
/* Embedding                                                                */
/* ------------------------------------------------------------------------ */

m3_status m3_embed_key(int hidden, m3_variant *v, m3_err *e) {
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "embed(hidden=%d)", hidden);
  return m3_variant_parse(k, v, e);
}

static m3_status embed_range(int64_t t, int32_t id, int64_t vocab, m3_err *e) {
  return m3_errf(e, M3_RANGE, "embed: token %" PRId64 " has id %" PRId32 ", outside the vocabulary [0, %" PRId64 ")",
                 t, id, vocab);
}

m3_status m3_embed_check_host(int64_t n_tokens, int64_t vocab, const int32_t *ids, m3_err *e) {
  for (int64_t t = 0; t < n_tokens; t++)
    if (ids[t] < 0 || ids[t] >= vocab) return embed_range(t, ids[t], vocab, e);
  return M3_OK;
}

m3_status m3_launch_embed(const m3_kernel *k, int64_t n_tokens, int hidden, int64_t vocab, const int32_t *ids,
                          const void *table, void *out, int32_t *err_word, cudaStream_t stream, m3_err *e) {
  M3_TRY(want_axis(k, "hidden", hidden, "embed", e));
  if (n_tokens < 0 || n_tokens > INT32_MAX - 1 || vocab <= 0)
    return m3_errf(e, M3_INVAL, "embed: %" PRId64 " tokens, vocab %" PRId64, n_tokens, vocab);
  if (!err_word) return m3_errf(e, M3_INVAL, "embed: an error word is required (ids may be out of range)");
  if (hidden % 8 == 0 && (misaligned(table) || misaligned(out)))
    return m3_errf(e, M3_INVAL, "embed: table and out must be 16-byte aligned");
  long long n = n_tokens, vv = vocab;
  void *args[] = {&ids, &table, &out, &err_word, &n, &vv};
  return launch(k, (uint64_t)n_tokens, 1, stream, args, e);
}

m3_status m3_embed_finish(int32_t *err_word, const int32_t *ids, int64_t vocab, cudaStream_t stream, m3_err *e) {
  int64_t bad;
  M3_TRY(m3_err_word_take(err_word, stream, &bad, e));
  if (bad < 0) return M3_OK;
  int32_t id = 0;
  M3_CUDA(e, cudaMemcpy(&id, ids + bad, sizeof id, cudaMemcpyDeviceToHost));
  return embed_range(bad, id, vocab, e);
}

/* ------------------------------------------------------------------------ */
/* Routing and grouping                                                     */
/* ------------------------------------------------------------------------ */

m3_status m3_route_key(const m3_route_args *a, const char *stage, m3_variant *v, m3_err *e) {
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "moe_route(stage=%s,logits=%s,experts=%d,topk=%d,renorm=%d)", stage,
           a->logits_bf16 ? "bf16" : "f32", a->n_experts, a->topk, a->renormalize ? 1 : 0);
  return m3_variant_parse(k, v, e);
}

m3_status m3_moe_group_key(int topk, int n_experts, m3_variant *v, m3_err *e) {
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "moe_route(stage=group,logits=f32,experts=%d,topk=%d,renorm=0)", n_experts, topk);
  return m3_variant_parse(k, v, e);
}

static m3_status route_check(const m3_kernel *k, const m3_route_args *a, const char *stage, const char *what,
                             m3_err *e) {
  M3_TRY(want_str(k, "stage", stage, what, e));
  M3_TRY(want_str(k, "logits", a->logits_bf16 ? "bf16" : "f32", what, e));
  M3_TRY(want_axis(k, "experts", a->n_experts, what, e));
  M3_TRY(want_axis(k, "topk", a->topk, what, e));
  M3_TRY(want_axis(k, "renorm", a->renormalize ? 1 : 0, what, e));
  if (a->n_tokens < 0) return m3_errf(e, M3_INVAL, "%s: %d tokens", what, a->n_tokens);
  return M3_OK;
}

m3_status m3_launch_route(const m3_kernel *k, const m3_route_args *a, const void *logits, const float *bias,
                          int32_t *ids, float *w, cudaStream_t stream, m3_err *e) {
  M3_TRY(route_check(k, a, "route", "route", e));
  long warps = m3_variant_tile_int(&k->key, "warps", 4);
  void *none = NULL;
  long long n = a->n_tokens;
  float scaling = a->routed_scaling;
  void *args[] = {&logits, &bias, &ids, &w, &none, &none, &none, &none, &none, &none, &n, &scaling};
  return launch(k, (uint64_t)((n + warps - 1) / warps), 1, stream, args, e);
}

m3_status m3_launch_moe_group(const m3_kernel *k, int64_t n_tokens, int topk, int n_experts, const int32_t *ids,
                              int32_t *counts, int32_t *offsets, int32_t *perm, int32_t *inv, int32_t *tok,
                              int32_t *err_word, cudaStream_t stream, m3_err *e) {
  M3_TRY(want_str(k, "stage", "group", "moe group", e));
  M3_TRY(want_axis(k, "experts", n_experts, "moe group", e));
  M3_TRY(want_axis(k, "topk", topk, "moe group", e));
  if (n_tokens < 0 || n_tokens * topk > INT32_MAX)
    return m3_errf(e, M3_INVAL, "moe group: %" PRId64 " tokens x top-%d pairs", n_tokens, topk);
  void *none = NULL;
  long long n = n_tokens;
  float scaling = 0.0f;
  void *args[] = {&none, &none, &ids, &none, &counts, &offsets, &perm, &inv, &tok, &err_word, &n, &scaling};
  return launch(k, 1, 1, stream, args, e);
}

m3_status m3_launch_route_group(const m3_kernel *k, const m3_route_args *a, const void *logits, const float *bias,
                                int32_t *ids, float *w, int32_t *counts, int32_t *offsets, int32_t *perm,
                                int32_t *inv, int32_t *tok, int32_t *err_word, cudaStream_t stream, m3_err *e) {
  M3_TRY(route_check(k, a, "fused", "route+group", e));
  if ((int64_t)a->n_tokens * a->topk > INT32_MAX) return m3_errf(e, M3_INVAL, "route+group: too many pairs");
  long long n = a->n_tokens;
  float scaling = a->routed_scaling;
  void *args[] = {&logits, &bias, &ids, &w, &counts, &offsets, &perm, &inv, &tok, &err_word, &n, &scaling};
  return launch(k, 1, 1, stream, args, e);
}

/* ------------------------------------------------------------------------ */
/* SwiGLU-OAI                                                               */
/* ------------------------------------------------------------------------ */

/* f in millionths, exactly as the template will emit it; M3_INVAL when the
 * decimal text does not round back to f (host and device would differ). */
static m3_status to_e6(const char *name, float f, long long *u, m3_err *e) {
  if (!isfinite(f) || fabs((double)f) > 1e12)
    return m3_errf(e, M3_INVAL, "swiglu: %s %g cannot be carried by a key", name, (double)f);
  long long q = llround((double)f * 1e6);
  char txt[64];
  long long a = q < 0 ? -q : q;
  snprintf(txt, sizeof txt, "%s%lld.%06lld", q < 0 ? "-" : "", a / 1000000, a % 1000000);
  if (strtof(txt, NULL) != f)
    return m3_errf(e, M3_INVAL,
                   "swiglu: %s %.9g is not the float of a multiple of 1e-6 (nearest %s); the key carries the "
                   "constants in millionths",
                   name, (double)f, txt);
  *u = q;
  return M3_OK;
}

m3_status m3_swiglu_key(int64_t inter, float alpha, float limit, float beta, m3_variant *v, m3_err *e) {
  long long a, l, b;
  M3_TRY(to_e6("alpha", alpha, &a, e));
  M3_TRY(to_e6("limit", limit, &l, e));
  M3_TRY(to_e6("beta", beta, &b, e));
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "swiglu(inter=%" PRId64 ",alpha_e6=%lld,limit_e6=%lld,beta_e6=%lld)", inter, a, l, b);
  return m3_variant_parse(k, v, e);
}

m3_status m3_launch_swiglu(const m3_kernel *k, int64_t n_rows, int64_t inter, const void *gu, void *out,
                           cudaStream_t stream, m3_err *e) {
  M3_TRY(want_axis(k, "inter", (long)inter, "swiglu", e));
  if (n_rows < 0) return m3_errf(e, M3_INVAL, "swiglu: %" PRId64 " rows", n_rows);
  if (inter % 8 == 0 && (misaligned(gu) || misaligned(out)))
    return m3_errf(e, M3_INVAL, "swiglu: gu and out must be 16-byte aligned");
  long threads = m3_variant_tile_int(&k->key, "threads", 256);
  int64_t vecs = n_rows * (inter % 8 == 0 ? inter / 8 : inter);
  long long n = n_rows;
  void *args[] = {&gu, &out, &n};
  return launch(k, (uint64_t)((vecs + threads - 1) / threads), 1, stream, args, e);
}

/* ------------------------------------------------------------------------ */
/* Combine                                                                  */
/* ------------------------------------------------------------------------ */

m3_status m3_combine_key(int hidden, int topk, int has_shared, int rowmap, m3_variant *v, m3_err *e) {
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "moe_combine(hidden=%d,topk=%d,shared=%d,rowmap=%d)", hidden, topk, has_shared ? 1 : 0,
           rowmap ? 1 : 0);
  return m3_variant_parse(k, v, e);
}

m3_status m3_launch_moe_combine(const m3_kernel *k, int64_t n_tokens, int hidden, int topk, const void *y,
                                const int32_t *rowof, const float *w, const void *shared, void *out,
                                cudaStream_t stream, m3_err *e) {
  M3_TRY(want_axis(k, "hidden", hidden, "moe combine", e));
  M3_TRY(want_axis(k, "topk", topk, "moe combine", e));
  M3_TRY(want_axis(k, "shared", shared != NULL, "moe combine", e));
  M3_TRY(want_axis(k, "rowmap", rowof != NULL, "moe combine", e));
  if (n_tokens < 0 || n_tokens > INT32_MAX) return m3_errf(e, M3_INVAL, "moe combine: %" PRId64 " tokens", n_tokens);
  if (hidden % 8 == 0 && (misaligned(y) || misaligned(out) || (shared && misaligned(shared))))
    return m3_errf(e, M3_INVAL, "moe combine: y, shared, out must be 16-byte aligned");
  long long n = n_tokens;
  void *args[] = {&y, &rowof, &w, &shared, &out, &n};
  return launch(k, (uint64_t)n_tokens, 1, stream, args, e);
}

/* ------------------------------------------------------------------------ */
/* MXFP8 dequant and the GEMVs                                              */
/* ------------------------------------------------------------------------ */

m3_status m3_dequant_key(int64_t cols, m3_variant *v, m3_err *e) {
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "mxfp8(op=dequant,w=e4m3,out=bf16,cols=%" PRId64 ",nmax=1,moe=0,act=none,alpha_e6=0,limit_e6=0,"
           "beta_e6=0,combine=0,settled=0,route_e=0,route_k=0,route_renorm=0)", cols);
  return m3_variant_parse(k, v, e);
}

m3_status m3_launch_mxfp8_dequant(const m3_kernel *k, int64_t rows, int64_t cols, const void *q,
                                  const void *scale, void *out, cudaStream_t stream, m3_err *e) {
  M3_TRY(want_str(k, "op", "dequant", "mxfp8 dequant", e));
  M3_TRY(want_axis(k, "cols", (long)cols, "mxfp8 dequant", e));
  if (rows < 0) return m3_errf(e, M3_INVAL, "mxfp8 dequant: %" PRId64 " rows", rows);
  if (misaligned(q) || misaligned(out)) return m3_errf(e, M3_INVAL, "mxfp8 dequant: q and out must be 16-byte aligned");
  long threads = m3_variant_tile_int(&k->key, "warps", 8) * 32;
  int64_t chunks = rows * (cols / 16);
  long long r = rows;
  void *args[] = {&q, &scale, &out, &r};
  return launch(k, (uint64_t)((chunks + threads - 1) / threads), 1, stream, args, e);
}

static const char *wname(int wfmt) { return wfmt == M3_GEMV_E4M3 ? "e4m3" : wfmt == M3_GEMV_BF16 ? "bf16" : "f32"; }

/* The SwiGLU epilogue's constants as the key carries them (0 without act). */
static m3_status act_e6(const m3_gemv_args *a, long long *al, long long *li, long long *be, m3_err *e) {
  *al = *li = *be = 0;
  if (!a->act) return M3_OK;
  M3_TRY(to_e6("alpha", a->alpha, al, e));
  M3_TRY(to_e6("limit", a->limit, li, e));
  return to_e6("beta", a->beta, be, e);
}

m3_status m3_gemv_key(const m3_gemv_args *a, int nmax, m3_variant *v, m3_err *e) {
  long long al, li, be;
  M3_TRY(act_e6(a, &al, &li, &be, e));
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k,
           "mxfp8(op=gemv,w=%s,out=%s,cols=%" PRId64 ",nmax=%d,moe=%d,act=%s,alpha_e6=%lld,limit_e6=%lld,beta_e6=%lld,"
           "combine=%d,settled=%d,route_e=%d,route_k=%d,route_renorm=%d)",
           wname(a->wfmt), a->out_f32 ? "f32" : "bf16", a->cols, nmax, a->moe ? 1 : 0, a->act ? "swiglu" : "none", al,
           li, be, a->combine ? 1 : 0, a->moe && a->ids_settled ? 1 : 0, a->route_e, a->route_k,
           a->route_renorm ? 1 : 0);
  return m3_variant_parse(k, v, e);
}

m3_status m3_gemv_kernel(m3_rt *rt, const m3_gemv_args *a, m3_kernel **k, m3_err *e) {
  int want = 1;
  if (!a->moe)
    while (want < 8 && want < a->n) want <<= 1;
  for (int nmax = want; nmax >= 1; nmax >>= 1) {
    m3_variant v;
    M3_TRY(m3_gemv_key(a, nmax, &v, e));
    M3_TRY(m3_render_canon(rt->jit.lua, &v, e));
    snprintf(v.arch, sizeof v.arch, "%s", rt->dev.arch);
    M3_TRY(m3_render_default_tile(rt->jit.lua, &v, e));
    char reason[256];
    m3_err ve;
    if (m3_render_valid(rt->jit.lua, &v, reason, sizeof reason, &ve) != M3_OK) continue;
    v.n_tile = 0; /* let the tuning DB choose the tile for this key */
    m3_bucket b = {0};
    M3_TRY(m3_bucket_add(&b, "tokens", a->n, e));
    return m3_rt_kernel(rt, &v, &b, k, e);
  }
  return m3_errf(e, M3_UNSUPPORTED, "gemv: no nmax fits cols %" PRId64 " on %s", a->cols, rt->dev.arch);
}

static m3_status gemv_check(const m3_kernel *k, const m3_gemv_args *a, int moe, m3_err *e) {
  M3_TRY(want_str(k, "op", "gemv", "gemv", e));
  M3_TRY(want_str(k, "w", wname(a->wfmt), "gemv", e));
  M3_TRY(want_str(k, "out", a->out_f32 ? "f32" : "bf16", "gemv", e));
  M3_TRY(want_axis(k, "cols", (long)a->cols, "gemv", e));
  M3_TRY(want_axis(k, "moe", moe, "gemv", e));
  M3_TRY(want_str(k, "act", a->act ? "swiglu" : "none", "gemv", e));
  M3_TRY(want_axis(k, "combine", a->combine ? 1 : 0, "gemv", e));
  /* settled=1 kernels may read ids before the grid wait: only where the caller vouches for them */
  M3_TRY(want_axis(k, "settled", moe && a->ids_settled ? 1 : 0, "gemv", e));
  M3_TRY(want_axis(k, "route_e", a->route_e, "gemv", e));
  M3_TRY(want_axis(k, "route_k", a->route_k, "gemv", e));
  M3_TRY(want_axis(k, "route_renorm", a->route_renorm ? 1 : 0, "gemv", e));
  if (a->n < 0 || a->rows < 1 || a->rows > INT32_MAX)
    return m3_errf(e, M3_INVAL, "gemv: n %" PRId64 ", rows %" PRId64, a->n, a->rows);
  return M3_OK;
}

/* grid.x of a GEMV over `pairs` row sets (MoE pairs, else 1); *gy gets
 * grid.y.  Rows per CTA: warps / ksplit x rpw rows (bf16, fp32: ksplit warps
 * share a row's columns), or tpc x rpw 16-row mma tiles for the W8A16 GEMV,
 * whose warps split the columns.  W8A16 tile tpc=0
 * (balanced, templates/mxfp8.lua): a 1-D grid of one wave, the CTAs the SMs
 * hold at once (k->sm_count x k->resident, found when it was loaded), at
 * least one per pair (so a CTA spans at most two) and at most one per
 * 16 x rpw-row tile. */
static uint64_t gemv_grid(const m3_kernel *k, const m3_gemv_args *a, int64_t pairs, unsigned *gy) {
  const int64_t rows = a->rows;
  long per = m3_variant_tile_int(&k->key, "warps", 8) / m3_variant_tile_int(&k->key, "ksplit", 1) *
             m3_variant_tile_int(&k->key, "rpw", 2);
  *gy = (unsigned)pairs;
  if (a->wfmt == M3_GEMV_E4M3) {
    const long tile = 16 * m3_variant_tile_int(&k->key, "rpw", 1), tpc = m3_variant_tile_int(&k->key, "tpc", 1);
    if (tpc == 0) {
      const int64_t tiles = pairs * ((rows + tile - 1) / tile);
      int64_t g = (int64_t)(k->sm_count > 0 ? k->sm_count : 1) * (k->resident > 0 ? k->resident : 2);
      if (g < pairs) g = pairs;
      if (g > tiles) g = tiles;
      *gy = 1;
      return (uint64_t)g;
    }
    per = tile * tpc;
  }
  return (uint64_t)((rows + per - 1) / per);
}

m3_status m3_launch_gemv(const m3_kernel *k, const m3_gemv_args *a, const void *x, const void *w,
                         const void *scale, void *y, cudaStream_t stream, m3_err *e) {
  M3_TRY(gemv_check(k, a, 0, e));
  if (a->route_e) return m3_errf(e, M3_INVAL, "gemv: a route epilogue kernel runs through m3_launch_gemv_route");
  if (misaligned(x) || misaligned(w)) return m3_errf(e, M3_INVAL, "gemv: x and w must be 16-byte aligned");
  if (a->wfmt == M3_GEMV_E4M3 && !scale) return m3_errf(e, M3_INVAL, "gemv: MXFP8 weights need their scales");
  if (a->wfmt == M3_GEMV_E4M3 && ((uintptr_t)scale & 3u))
    return m3_errf(e, M3_INVAL, "gemv: MXFP8 scales must be 4-byte aligned");
  const int nmax = (int)m3_variant_axis_int(&k->key, "nmax", 1);
  const size_t ysz = a->out_f32 ? 4 : 2;
  const void *none = NULL;
  int zero = 0, one = 1, rows = (int)a->rows;
  for (int64_t t0 = 0; t0 < a->n; t0 += nmax) {
    int n = (int)(a->n - t0 < nmax ? a->n - t0 : nmax);
    const void *xc = (const uint16_t *)x + t0 * a->cols;
    void *yc = (char *)y + (size_t)t0 * (size_t)a->rows * ysz;
    void *args[] = {&xc, &w, &scale, &none, &none, &none, &zero, &one, &yc, &n, &rows, &one};
    unsigned gy;
    const uint64_t gx = gemv_grid(k, a, 1, &gy);
    M3_TRY(launch(k, gx, gy, stream, args, e));
  }
  return M3_OK;
}

m3_status m3_launch_gemv_route(const m3_kernel *k, const m3_gemv_args *a, const m3_route_args *ra, const void *x,
                               const void *w, float *logits, const float *bias, int32_t *ids, float *wts,
                               uint32_t *counter, cudaStream_t stream, m3_err *e) {
  M3_TRY(gemv_check(k, a, 0, e));
  const int nmax = (int)m3_variant_axis_int(&k->key, "nmax", 1);
  if (a->wfmt != M3_GEMV_F32 || !a->out_f32 || a->route_e < 1 || a->rows != a->route_e ||
      ra->n_experts != a->route_e || ra->topk != a->route_k || !ra->renormalize != !a->route_renorm ||
      ra->logits_bf16 || ra->n_tokens != a->n)
    return m3_errf(e, M3_INVAL, "gemv route: the route arguments (experts %d, top-k %d, renorm %d, bf16 logits %d, "
                   "%d tokens) disagree with the GEMV's (rows %" PRId64 ", route_e %d, route_k %d, route_renorm %d, "
                   "%" PRId64 " tokens, fp32 weights and logits)", ra->n_experts, ra->topk, ra->renormalize,
                   ra->logits_bf16, ra->n_tokens, a->rows, a->route_e, a->route_k, a->route_renorm, a->n);
  if (a->n < 1 || a->n > nmax)
    return m3_errf(e, M3_INVAL, "gemv route: %" PRId64 " tokens in one launch, the kernel holds nmax %d", a->n, nmax);
  if (!logits || !ids || !wts || !counter) return m3_errf(e, M3_INVAL, "gemv route: logits, ids, wts and counter are needed");
  if (misaligned(x) || misaligned(w)) return m3_errf(e, M3_INVAL, "gemv route: x and w must be 16-byte aligned");
  const void *none = NULL;
  int zero = 0, one = 1, rows = (int)a->rows, n = (int)a->n;
  float scaling = ra->routed_scaling;
  void *y = logits;
  void *args[] = {&x, &w, &none, &none, &none, &none, &zero, &one, &y, &n, &rows, &one,
                  &bias, &ids, &wts, &counter, &scaling};
  unsigned gy;
  const uint64_t gx = gemv_grid(k, a, 1, &gy);
  return launch(k, gx, gy, stream, args, e);
}

m3_status m3_launch_linear_gemv(const m3_kernel *k, int64_t n, const void *x, const m3_ref_weight *w, void *y,
                                cudaStream_t stream, m3_err *e) {
  if (!w || !w->bf16 == !w->q) return m3_errf(e, M3_INVAL, "linear gemv: the weight must be exactly one of bf16 or MXFP8");
  m3_gemv_args a = {.n = n, .rows = w->rows, .cols = w->cols, .wfmt = w->q ? M3_GEMV_E4M3 : M3_GEMV_BF16};
  return m3_launch_gemv(k, &a, x, w->q ? (const void *)w->q : (const void *)w->bf16, w->scale, y, stream, e);
}

m3_status m3_launch_gemv_moe_shared(const m3_kernel *k, const m3_gemv_args *a, const void *x,
                                    const void *const *w_tab, const void *const *s_tab, const int32_t *ids,
                                    const void *sw, const void *ss, int64_t n_shared, void *y, cudaStream_t stream,
                                    m3_err *e) {
  return m3_launch_gemv_moe_fused(k, a, x, w_tab, s_tab, ids, sw, ss, n_shared, y, NULL, stream, e);
}

m3_status m3_launch_gemv_moe_fused(const m3_kernel *k, const m3_gemv_args *a, const void *x,
                                   const void *const *w_tab, const void *const *s_tab, const int32_t *ids,
                                   const void *sw, const void *ss, int64_t n_shared, void *y,
                                   const m3_gemv_epilogue *ep, cudaStream_t stream, m3_err *e) {
  M3_TRY(gemv_check(k, a, 1, e));
  if (a->act && a->combine) return m3_errf(e, M3_INVAL, "gemv moe: act and combine are two launches' epilogues");
  if (!(a->act || a->combine) != !ep)
    return m3_errf(e, M3_INVAL, "gemv moe: %s epilogue in the arguments, %s", a->act ? "an act" : a->combine ?
                   "a combine" : "no", ep ? "epilogue buffers given" : "no epilogue buffers given");
  if (a->combine && (n_shared < 1 || a->n % n_shared || !ep->w || !ep->out || !ep->tile_count))
    return m3_errf(e, M3_INVAL, "gemv moe: the combine needs the shared expert's pairs (%" PRId64 ", dividing the %"
                   PRId64 " routed), routing weights, out and the tile counts", n_shared, a->n);
  /* act: gate and up tiles must not straddle I, so I is a multiple of the tile's 16 rpw rows */
  const long tile_rows = 16 * m3_variant_tile_int(&k->key, "rpw", 1);
  if (a->act && (a->rows % (2 * tile_rows) || !ep->act || !ep->tile_count))
    return m3_errf(e, M3_INVAL, "gemv moe: the SwiGLU epilogue needs rows = 2I with I a multiple of %ld (rows %" PRId64
                   "), act and the tile counts", tile_rows, a->rows);
  if (ep && (ep->act == y || ep->out == y)) return m3_errf(e, M3_INVAL, "gemv moe: the epilogue's output aliases y");
  if (a->act) { /* the constants the kernel was built with are the caller's (fault 22) */
    long long al, li, be;
    M3_TRY(act_e6(a, &al, &li, &be, e));
    M3_TRY(want_axis(k, "alpha_e6", (long)al, "gemv moe", e));
    M3_TRY(want_axis(k, "limit_e6", (long)li, "gemv moe", e));
    M3_TRY(want_axis(k, "beta_e6", (long)be, "gemv moe", e));
  }
  if (n_shared < 0 || a->n + n_shared > 65535)
    return m3_errf(e, M3_INVAL, "gemv moe: %" PRId64 " + %" PRId64 " shared pairs > 65535 (grid.y)", a->n, n_shared);
  if (a->xdiv < 1 || a->n_experts < 1) return m3_errf(e, M3_INVAL, "gemv moe: xdiv %d, n_experts %d", a->xdiv, a->n_experts);
  if (a->wfmt == M3_GEMV_E4M3 && !s_tab) return m3_errf(e, M3_INVAL, "gemv moe: MXFP8 experts need a scale table");
  if (n_shared && (!sw || (a->wfmt == M3_GEMV_E4M3 && (!ss || ((uintptr_t)ss & 3u))) || misaligned(sw)))
    return m3_errf(e, M3_INVAL, "gemv moe: %" PRId64 " shared pairs need the shared expert's weight (16-byte "
                   "aligned)%s", n_shared, a->wfmt == M3_GEMV_E4M3 ? " and scales (4-byte aligned)" : "");
  if (misaligned(x)) return m3_errf(e, M3_INVAL, "gemv moe: x must be 16-byte aligned");
  if (!a->n && !n_shared) return M3_OK;
  int n_tab = a->n_experts, xdiv = a->xdiv, routed = (int)a->n, rows = (int)a->rows, pairs = (int)(a->n + n_shared);
  /* the epilogue's parameters follow npairs: (act, cnt) or (w, out, cnt) */
  const void *e0 = !ep ? NULL : a->act ? ep->act : (const void *)ep->w, *e1 = !ep ? NULL : a->act ? (void *)ep->tile_count : ep->out;
  const void *e2 = ep ? ep->tile_count : NULL;
  void *args[] = {&x, &sw, &ss, &w_tab, &s_tab, &ids, &n_tab, &xdiv, &y, &routed, &rows, &pairs, &e0, &e1, &e2};
  unsigned gy;
  const uint64_t gx = gemv_grid(k, a, pairs, &gy);
  return launch(k, gx, gy, stream, args, e);
}

m3_status m3_launch_gemv_moe(const m3_kernel *k, const m3_gemv_args *a, const void *x, const void *const *w_tab,
                             const void *const *s_tab, const int32_t *ids, void *y, cudaStream_t stream, m3_err *e) {
  return m3_launch_gemv_moe_shared(k, a, x, w_tab, s_tab, ids, NULL, NULL, 0, y, stream, e);
}

/* ------------------------------------------------------------------------ */
/* Sampling                                                                 */
/* ------------------------------------------------------------------------ */

m3_status m3_sample_key(const m3_sample_args *a, m3_variant *v, m3_err *e) {
  char k[M3_KEY_MAX];
  int topp = a->temperature > 0.0f && a->top_p > 0.0f;
  snprintf(k, sizeof k, "sample(mode=%s,logits=%s,vocab=%" PRId64 ")", topp ? "top_p" : "greedy",
           a->logits_bf16 ? "bf16" : "f32", a->vocab);
  return m3_variant_parse(k, v, e);
}

m3_status m3_launch_sample(const m3_kernel *k, const m3_sample_args *a, const void *logits, int32_t *d_out,
                           cudaStream_t stream, m3_err *e) {
  M3_TRY(want_axis(k, "vocab", (long)a->vocab, "sample", e));
  M3_TRY(want_str(k, "logits", a->logits_bf16 ? "bf16" : "f32", "sample", e));
  int topp = a->temperature > 0.0f && a->top_p > 0.0f;
  if (topp) M3_TRY(want_str(k, "mode", "top_p", "sample", e));
  if (a->n_rows < 0 || a->n_rows > INT32_MAX) return m3_errf(e, M3_INVAL, "sample: %" PRId64 " rows", a->n_rows);
  long long n = a->n_rows;
  float temp = a->temperature, top_p = a->top_p;
  unsigned long long seed = a->seed, step = a->step;
  void *args[] = {&logits, &d_out, &n, &temp, &top_p, &seed, &step};
  return launch(k, (uint64_t)a->n_rows, 1, stream, args, e);
}

/* splitmix64's finaliser and its inverse: a row's draw m3_rng_u64(seed,
 * step, r) equals m3_rng_u64(0, step', 0) for step' below, so one row can be
 * handed to the reference on its own with its own generator key. */
static uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static uint64_t inv_odd(uint64_t a) { /* a^-1 mod 2^64 by Newton (a odd) */
  uint64_t x = a;
  for (int i = 0; i < 6; i++) x *= 2 - a * x;
  return x;
}
static uint64_t unxorshift(uint64_t y, int s) {
  uint64_t x = y;
  for (int i = 0; i < 64 / s + 1; i++) x = y ^ (x >> s);
  return x;
}
static uint64_t unmix(uint64_t y) {
  y = unxorshift(y, 31);
  y *= inv_odd(0x94D049BB133111EBull);
  y = unxorshift(y, 27);
  y *= inv_odd(0xBF58476D1CE4E5B9ull);
  y = unxorshift(y, 30);
  return y - 0x9E3779B97F4A7C15ull;
}

m3_status m3_sample_finish(const m3_sample_args *a, const void *logits, const int32_t *d_out, int32_t *host_out,
                           cudaStream_t stream, m3_err *e) {
  M3_CUDA(e, cudaStreamSynchronize(stream));
  M3_CUDA(e, cudaMemcpy(host_out, d_out, sizeof *host_out * (size_t)a->n_rows, cudaMemcpyDeviceToHost));
  const size_t rowb = (size_t)a->vocab * (a->logits_bf16 ? 2 : 4);
  void *row = NULL;
  m3_status st = M3_OK;
  for (int64_t r = 0; r < a->n_rows && st == M3_OK; r++) {
    if (host_out[r] == -1) {
      st = m3_errf(e, M3_NUMERICS, "sample: row %" PRId64 " is all NaN", r);
    } else if (host_out[r] == -2) {
      if (!row && !(row = malloc(rowb))) {
        st = m3_errf(e, M3_NOMEM, "sample: host copy of a %zu-byte logits row", rowb);
        break;
      }
      cudaError_t ce = cudaMemcpy(row, (const char *)logits + (size_t)r * rowb, rowb, cudaMemcpyDeviceToHost);
      if (ce != cudaSuccess) {
        st = m3_cuda_fail(e, ce, "cudaMemcpy(logits row)", __FILE__, __LINE__);
        break;
      }
      m3_sample_args one = *a;
      one.n_rows = 1;
      one.seed = 0;
      one.step = unmix(mix(mix(a->seed) ^ a->step) ^ (uint64_t)r) ^ mix(0);
      if (m3_rng_u64(one.seed, one.step, 0) != m3_rng_u64(a->seed, a->step, (uint64_t)r)) {
        st = m3_errf(e, M3_INVAL, "sample: internal: generator re-keying failed for row %" PRId64, r);
        break;
      }
      st = m3_ref_sample_top_p(&one, row, &host_out[r], e);
    }
  }
  free(row);
  return st;
}

/* ------------------------------------------------------------------------ */
/* The MoE layer                                                            */
/* ------------------------------------------------------------------------ */

/* Workspace carve-up (256-byte aligned pieces of one allocation), for T
 * tokens and P = T*K pairs. */
typedef struct moe_bufs {
  float *logits;                  /* [T, E] */
  int32_t *ids, *counts, *offsets, *perm, *inv, *tok, *err;
  float *wts;                     /* [P] */
  uint16_t *xs, *gu, *act, *y;    /* [P, H], [P, 2I], [P, I], [P, H] */
  uint16_t *sgu, *sact, *sy;      /* [T, 2Is], [T, Is], [T, H] */
  uint16_t *dq;                   /* [2 max(I, Is), H] dequantised weight (prefill) */
  uint32_t *tiles, *act_tiles;    /* [ceil(H / 16)], [(P + T) I / 16]: the epilogues' tile counts (zero between launches) */
  uint32_t *route_cnt;            /* [1] the router GEMV's route epilogue count (zero between launches) */
} moe_bufs;

static size_t carve(moe_bufs *b, char *base, const m3_moe_args *a, const m3_moe_weights *w, int64_t T) {
  const int64_t E = a->n_experts, K = a->topk, P = T * K, H = a->hidden, I = w->inter, Is = w->shared_inter;
  const int64_t D = 2 * (I > Is ? I : Is) * H;
  size_t off = 0;
#define PIECE(field, type, count)                                                \
  do {                                                                           \
    b->field = base ? (type *)(base + off) : NULL;                               \
    off += ((size_t)(count) * sizeof(type) + 255) & ~(size_t)255;                \
  } while (0)
  PIECE(logits, float, T * E);
  PIECE(ids, int32_t, P);
  PIECE(wts, float, P);
  PIECE(counts, int32_t, E);
  PIECE(offsets, int32_t, E + 1);
  PIECE(perm, int32_t, P);
  PIECE(inv, int32_t, P);
  PIECE(tok, int32_t, P);
  PIECE(err, int32_t, 1);
  PIECE(xs, uint16_t, P * H);
  /* decode with a shared expert as wide as the routed ones runs it as T more
   * pairs (rows P .. P + T - 1) of the MoE GEMVs */
  PIECE(gu, uint16_t, (P + T) * 2 * I);
  PIECE(act, uint16_t, (P + T) * I);
  PIECE(y, uint16_t, (P + T) * H);
  PIECE(sgu, uint16_t, T * 2 * (Is ? Is : 1));
  PIECE(sact, uint16_t, T * (Is ? Is : 1));
  PIECE(sy, uint16_t, T * H);
  PIECE(dq, uint16_t, w->e4m3 ? D : 1);
  PIECE(tiles, uint32_t, (H + 15) / 16);
  PIECE(act_tiles, uint32_t, (P + T) * ((I + 15) / 16));
  PIECE(route_cnt, uint32_t, 1);
#undef PIECE
  return off;
}

static m3_status moe_shape_check(const m3_moe_args *a, const m3_moe_weights *w, m3_err *e) {
  if (!a || !w || a->n_experts != w->n_experts || a->hidden != w->hidden || a->topk < 1 ||
      a->topk > a->n_experts || w->inter < 1 || w->shared_inter < 0)
    return m3_errf(e, M3_INVAL, "moe: arguments and weights disagree (experts, hidden, topk, inter)");
  return M3_OK;
}

m3_status m3_moe_ws_alloc(m3_moe_ws *ws, const m3_moe_args *a, const m3_moe_weights *w, int64_t max_tokens,
                          m3_err *e) {
  memset(ws, 0, sizeof *ws);
  M3_TRY(moe_shape_check(a, w, e));
  M3_TRY(m3_moe_fuse_env(&ws->fuse, e)); /* once, not at every layer's call */
  if (max_tokens < 1) return m3_errf(e, M3_INVAL, "moe workspace: max_tokens %" PRId64, max_tokens);
  moe_bufs b;
  ws->bytes = carve(&b, NULL, a, w, max_tokens);
  M3_CUDA(e, cudaMalloc(&ws->mem, ws->bytes));
  M3_CUDA(e, cudaMemset(ws->mem, 0, ws->bytes)); /* error word starts clear */
  /* cudaMemset runs on the legacy stream, which does not order against the
   * non-blocking stream the layer runs on: finish it here. */
  M3_CUDA(e, cudaDeviceSynchronize());
  ws->max_tokens = max_tokens;
  ws->stages = M3_MOE_STAGE_ALL;
  return M3_OK;
}

void m3_moe_ws_free(m3_moe_ws *ws) {
  if (ws->mem) cudaFree(ws->mem);
  memset(ws, 0, sizeof *ws);
}

/* x [n, cols] · W [rows, cols]ᵀ on the GPU with the GEMV kernels. */
static m3_status gemv_run(m3_rt *rt, cudaStream_t s, int64_t n, int64_t rows, int64_t cols, int wfmt, int out_f32,
                          const void *x, const void *w, const void *scale, void *y, m3_err *e) {
  m3_gemv_args ga = {.n = n, .rows = rows, .cols = cols, .wfmt = wfmt, .out_f32 = out_f32};
  m3_kernel *k;
  M3_TRY(m3_gemv_kernel(rt, &ga, &k, e));
  return m3_launch_gemv(k, &ga, x, w, scale, y, s, e);
}

/* Prefill: y [n, rows] = x · Wᵀ through cuBLAS, dequantising MXFP8 first. */
static m3_status gemm_run(m3_rt *rt, m3_gemm *g, moe_bufs *b, int64_t n, int64_t rows, int64_t cols, int e4m3,
                          const void *x, const void *w, const void *scale, void *y, m3_err *e) {
  const void *wb = w;
  if (e4m3) {
    m3_variant v;
    m3_kernel *k;
    M3_TRY(m3_dequant_key(cols, &v, e));
    M3_TRY(m3_rt_kernel(rt, &v, NULL, &k, e));
    M3_TRY(m3_launch_mxfp8_dequant(k, rows, cols, w, scale, b->dq, g->stream, e));
    wb = b->dq;
  }
  return m3_gemm_bf16(g, n, rows, cols, x, 0, wb, 0, y, 0, e);
}

/* The layer's kernels by the rows of their launch, rounded up to a power of
 * two (bucket "tokens", as forward.c buckets its own): the shapes their tuner
 * adapters time (autotune/op_*.c), so a tuned tile applies here; without a
 * record, the default. */
static m3_status kernel_at(m3_rt *rt, const m3_variant *v, int64_t rows, m3_kernel **k, m3_err *e) {
  int64_t p = 1;
  while (p < rows) p *= 2;
  m3_bucket b = {0};
  M3_TRY(m3_bucket_add(&b, "tokens", p, e));
  return m3_rt_kernel(rt, v, &b, k, e);
}

m3_status m3_moe_fuse_env(unsigned *fuse, m3_err *e) {
  static const struct {
    const char *name;
    unsigned bits;
  } names[] = {{"0", 0},
               {"none", 0},
               {"combine", M3_MOE_FUSE_COMBINE},
               {"act", M3_MOE_FUSE_ACT},
               {"norm", M3_MOE_FUSE_NORM},
               {"route", M3_MOE_FUSE_ROUTE},
               {"all", M3_MOE_FUSE_COMBINE | M3_MOE_FUSE_ACT}};
  const char *v = getenv("M3KIT_MOE_FUSE");
  *fuse = M3_MOE_FUSE_DEFAULT;
  if (!v || !*v) return M3_OK;
  unsigned bits = 0;
  for (const char *p = v; *p;) {
    const size_t len = strcspn(p, ",");
    size_t i = 0;
    while (i < sizeof names / sizeof names[0] && (strlen(names[i].name) != len || strncmp(p, names[i].name, len))) i++;
    if (i == sizeof names / sizeof names[0] || (p[len] == ',' && !p[len + 1]))
      return m3_errf(e, M3_INVAL,
                     "M3KIT_MOE_FUSE=%s: expected a comma-separated list of combine, act, route, norm (or all, none)", v);
    bits |= names[i].bits;
    p += len;
    if (*p == ',') p++;
  }
  /* Both move the same combine, into the down GEMV or into the next norm:
   * asked for together, one would silently lose. */
  if ((bits & M3_MOE_FUSE_COMBINE) && (bits & M3_MOE_FUSE_NORM))
    return m3_errf(e, M3_INVAL,
                   "M3KIT_MOE_FUSE=%s: combine (in the down GEMV) and norm (in the next add+norm) both do the MoE "
                   "combine; name one of them (all includes combine)",
                   v);
  *fuse = bits;
  return M3_OK;
}

/* The decode path's choices, one place for m3_moe_forward_pending and
 * m3_moe_pending_plan.  ns: tokens of a shared expert riding along as more
 * pairs of the routed GEMVs (as wide as the routed ones; rows P .. P+n-1 of
 * their outputs), else 0.  fused: the down GEMV's combine epilogue (MXFP8
 * only).  defer: the combine left to the caller's next add + norm
 * (M3_MOE_FUSE_NORM, only where the caller can take it: pend). */
typedef struct moe_plan { int decode; int64_t ns; int fused, fuse_act, defer; } moe_plan;

static m3_status moe_plan_of(const m3_moe_args *a, const m3_moe_weights *w, const m3_moe_ws *ws, int path,
                             int can_defer, moe_plan *p, m3_err *e) {
  M3_TRY(moe_shape_check(a, w, e));
  const int64_t n = a->n_tokens, I = w->inter, Is = w->shared_inter;
  if (n < 0 || n > ws->max_tokens)
    return m3_errf(e, M3_INVAL, "moe: %" PRId64 " tokens, workspace holds %" PRId64, n, ws->max_tokens);
  p->decode = path == 1 || (path == 0 && n <= 8);
  /* Decode: a shared expert as wide as the routed ones rides along as n
   * more pairs of the routed GEMVs and SwiGLU (below); otherwise it has a
   * SwiGLU launch of its own, n rows. */
  p->ns = p->decode && Is && Is == I ? n : 0;
  /* ... and with MXFP8 experts, on request (M3KIT_MOE_FUSE), the down GEMV
   * then ends with the combine (templates/mxfp8.lua combine=1; "combine" or
   * "all") and the gate|up GEMV with SwiGLU (act=swiglu; "all"): one launch a
   * layer fewer each.  Off by default: on the H200 the combine epilogue left
   * TPOT at 8K 0.05 ms higher (device run 47: 10.05-10.09 against
   * 10.01-10.04 ms), on an H100 0.07-0.12 ms lower (runs 45, 46); the SwiGLU
   * epilogue cost 0.1-0.16 ms a step on the H100 (its 1920 CTAs' fences). */
  p->fused = p->ns && w->e4m3 && (ws->fuse & M3_MOE_FUSE_COMBINE);
  p->fuse_act = p->ns && w->e4m3 && I % 64 == 0 && (ws->fuse & M3_MOE_FUSE_ACT);
  /* "norm": the combine moves into the caller's next add + RMSNorm instead
   * (templates/rmsnorm.lua combine=K), which reads y in the decode GEMV's
   * pair order with the shared rows after them - the layout ns gives, for
   * bf16 experts as well.  Off by default: on an H100 the step at 8K took
   * 0.06 ms longer with it (device run 59: 11.875 against 11.814 ms; the
   * norm's one CTA a row now reads six rows, input_norm 0.11 -> 0.20 ms a
   * step, more than the combine launch it saves, 0.10). */
  p->defer = can_defer && p->ns && !p->fused && (ws->fuse & M3_MOE_FUSE_NORM);
  return M3_OK;
}

static void pending_of(const moe_plan *p, const m3_moe_args *a, const moe_bufs *b, const float *wts,
                       m3_moe_pending *pend) {
  memset(pend, 0, sizeof *pend);
  if (!p->defer) return;
  const int64_t P = (int64_t)a->n_tokens * a->topk;
  pend->active = 1;
  pend->topk = a->topk;
  pend->n_tokens = a->n_tokens;
  pend->y = b->y;
  pend->w = wts ? wts : b->wts;
  pend->shared = b->y + P * a->hidden;
}

m3_status m3_moe_pending_plan(const m3_moe_args *a, const m3_moe_weights *w, const m3_moe_ws *ws, float *wts,
                              int path, m3_moe_pending *pend, m3_err *e) {
  memset(pend, 0, sizeof *pend);
  moe_plan p;
  M3_TRY(moe_plan_of(a, w, ws, path, 1, &p, e));
  if (!a->n_tokens) return M3_OK; /* nothing runs, nothing pending */
  moe_bufs b;
  carve(&b, ws->mem, a, w, ws->max_tokens);
  pending_of(&p, a, &b, wts, pend);
  return M3_OK;
}

m3_status m3_moe_forward(m3_rt *rt, m3_gemm *g, const m3_moe_args *a, const m3_moe_weights *w, m3_moe_ws *ws,
                         const void *m, const float *m32, void *out, int32_t *ids, float *wts, int path,
                         m3_err *e) {
  return m3_moe_forward_pending(rt, g, a, w, ws, m, m32, out, ids, wts, path, NULL, e);
}

m3_status m3_moe_forward_pending(m3_rt *rt, m3_gemm *g, const m3_moe_args *a, const m3_moe_weights *w,
                                 m3_moe_ws *ws, const void *m, const float *m32, void *out, int32_t *ids, float *wts,
                                 int path, m3_moe_pending *pend, m3_err *e) {
  if (pend) memset(pend, 0, sizeof *pend);
  moe_plan pl;
  M3_TRY(moe_plan_of(a, w, ws, path, pend != NULL, &pl, e));
  const int64_t n = a->n_tokens, E = a->n_experts, K = a->topk, H = a->hidden, I = w->inter, Is = w->shared_inter;
  const int64_t P = n * K;
  if (!n) return M3_OK;
  const int decode = pl.decode;
  cudaStream_t s = g->stream;
  const int wf = w->e4m3 ? M3_GEMV_E4M3 : M3_GEMV_BF16;
  moe_bufs b;
  carve(&b, ws->mem, a, w, ws->max_tokens);
  if (!ids) ids = b.ids;
  if (!wts) wts = b.wts;
  m3_variant v;
  m3_kernel *k;

  /* Router logits, fp32 weights and accumulation: cuBLAS on float(m) when the
   * caller has it (the post-attention norm's f32copy), else the fp32-weight
   * GEMV, which stages float(m) itself. */
  /* The stages a breakdown capture leaves out (m3_moe_ws.stages): decode only. */
  const unsigned stg = decode ? ws->stages : M3_MOE_STAGE_ALL;
#define STAGE(bit, call) \
  do {                   \
    if (stg & (bit)) M3_TRY(call); \
  } while (0)
  m3_route_args ra = {.n_tokens = (int)n, .n_experts = (int)E, .topk = (int)K, .renormalize = a->renormalize,
                      .routed_scaling = a->routed_scaling, .logits_bf16 = 0};
  /* Decode with M3KIT_MOE_FUSE=route: the router GEMV's last CTA selects the
   * experts (its route epilogue), where one launch holds the tokens.  Off by
   * default: on an H100 it saved nothing (device runs 58-59: the fused router
   * 0.45 ms a step against router 0.18 + route 0.25; the whole step 11.808
   * against 11.814 ms): its last CTA's count and one-warp top-k cost what the
   * route launch did; with the count as one acq_rel ticket (device run 65)
   * -0.06 ms at 8K on the means, nothing at 128K, within the spread. */
  m3_kernel *kr = NULL;
  if (decode && (ws->fuse & M3_MOE_FUSE_ROUTE)) {
    m3_gemv_args gr = {.n = n, .rows = E, .cols = H, .wfmt = M3_GEMV_F32, .out_f32 = 1, .route_e = (int)E,
                       .route_k = (int)K, .route_renorm = a->renormalize ? 1 : 0};
    M3_TRY(m3_gemv_kernel(rt, &gr, &kr, e));
    if (m3_variant_axis_int(&kr->key, "nmax", 1) < n) kr = NULL; /* x does not fit one launch: route of its own */
    else STAGE(M3_MOE_STAGE_ROUTER, m3_launch_gemv_route(kr, &gr, &ra, m, w->wg, b.logits, w->bias, ids, wts,
                                                         b.route_cnt, s, e));
  }
  if (!kr) {
    if (m32 && !decode) M3_TRY(m3_gemm_f32(g, n, E, H, m32, 0, w->wg, 0, b.logits, 0, e));
    else STAGE(M3_MOE_STAGE_ROUTER, gemv_run(rt, s, n, E, H, M3_GEMV_F32, 1, m, w->wg, NULL, b.logits, e));
    M3_TRY(m3_route_key(&ra, "route", &v, e));
    M3_TRY(kernel_at(rt, &v, n, &k, e));
    STAGE(M3_MOE_STAGE_ROUTE, m3_launch_route(k, &ra, b.logits, w->bias, ids, wts, s, e));
  }

  const int64_t ns = pl.ns;
  const int fused = pl.fused, fuse_act = pl.fuse_act;
  m3_kernel *sw = NULL, *swsh = NULL;
  M3_TRY(m3_swiglu_key(I, a->alpha, a->limit, a->beta, &v, e));
  if (!fuse_act) M3_TRY(kernel_at(rt, &v, P + ns, &sw, e));
  if (Is && !ns) {
    M3_TRY(m3_swiglu_key(Is, a->alpha, a->limit, a->beta, &v, e));
    M3_TRY(kernel_at(rt, &v, n, &swsh, e));
  }

  const int32_t *rowof = NULL;
  const uint16_t *shared_y = Is ? b.sy : NULL;
  if (decode) {
    /* Routed experts: one MoE GEMV for every pair's gate|up, one for down.
     * A shared expert as wide as the routed ones rides along as n more pairs
     * (its weights stream in the same grid: one launch each instead of two
     * GEMVs and a SwiGLU of their own); outputs land in rows P .. P + n - 1. */
    m3_gemv_args ga = {.n = P, .rows = 2 * I, .cols = H, .wfmt = wf, .moe = 1, .xdiv = (int)K, .n_experts = (int)E,
                       .act = fuse_act, .alpha = a->alpha, .limit = a->limit, .beta = a->beta};
    M3_TRY(m3_gemv_kernel(rt, &ga, &k, e));
    const m3_gemv_epilogue ea = {.act = b.act, .tile_count = b.act_tiles};
    STAGE(M3_MOE_STAGE_GATE_UP, m3_launch_gemv_moe_fused(k, &ga, m, w->gu_tab, w->gu_scale_tab, ids, w->shared_gu,
                                                         w->shared_gu_scale, ns, b.gu, fuse_act ? &ea : NULL, s, e));
    if (!fuse_act) STAGE(M3_MOE_STAGE_SWIGLU, m3_launch_swiglu(sw, P + ns, I, b.gu, b.act, s, e));
    /* ids were written by the route launch, two or more launches back: settled (lead=1 tiles) */
    m3_gemv_args gd = {.n = P, .rows = H, .cols = I, .wfmt = wf, .moe = 1, .xdiv = 1, .n_experts = (int)E,
                       .combine = fused, .ids_settled = 1};
    M3_TRY(m3_gemv_kernel(rt, &gd, &k, e));
    const m3_gemv_epilogue ec = {.w = wts, .out = out, .tile_count = b.tiles};
    STAGE(M3_MOE_STAGE_DOWN, m3_launch_gemv_moe_fused(k, &gd, b.act, w->down_tab, w->down_scale_tab, ids,
                                                      w->shared_down, w->shared_down_scale, ns, b.y,
                                                      fused ? &ec : NULL, s, e));
    if (fused) return M3_OK;
    if (pl.defer) { /* out is the caller's next norm's business (pend) */
      pending_of(&pl, a, &b, wts, pend);
      return M3_OK;
    }
    if (ns) {
      shared_y = b.y + P * H;
    } else if (Is) {
      STAGE(M3_MOE_STAGE_DOWN, gemv_run(rt, s, n, 2 * Is, H, wf, 0, m, w->shared_gu, w->shared_gu_scale, b.sgu, e));
      STAGE(M3_MOE_STAGE_DOWN, m3_launch_swiglu(swsh, n, Is, b.sgu, b.sact, s, e));
      STAGE(M3_MOE_STAGE_DOWN, gemv_run(rt, s, n, H, Is, wf, 0, b.sact, w->shared_down, w->shared_down_scale, b.sy, e));
    }
  } else {
    /* Group the pairs by expert (stable), gather their rows, run one cuBLAS
     * GEMM per expert on its contiguous block. */
    M3_TRY(m3_moe_group_key((int)K, (int)E, &v, e));
    M3_TRY(kernel_at(rt, &v, n, &k, e)); /* bucketed by tokens: it groups their n * K pairs */
    M3_TRY(m3_launch_moe_group(k, n, (int)K, (int)E, ids, b.counts, b.offsets, b.perm, b.inv, b.tok, b.err, s, e));
    M3_TRY(m3_embed_key((int)H, &v, e));
    M3_TRY(kernel_at(rt, &v, P, &k, e));
    M3_TRY(m3_launch_embed(k, P, (int)H, n, b.tok, m, b.xs, b.err, s, e));
    int32_t *cnt = malloc(sizeof *cnt * (size_t)E);
    if (!cnt) return m3_errf(e, M3_NOMEM, "moe: expert counts");
    m3_status st = M3_OK;
    cudaError_t ce = cudaMemcpyAsync(cnt, b.counts, sizeof *cnt * (size_t)E, cudaMemcpyDeviceToHost, s);
    int64_t bad = -1;
    if (ce != cudaSuccess) st = m3_cuda_fail(e, ce, "cudaMemcpyAsync(expert counts)", __FILE__, __LINE__);
    if (st == M3_OK) st = m3_err_word_take(b.err, s, &bad, e); /* synchronises: counts are on the host */
    if (st == M3_OK && bad >= 0)
      st = m3_errf(e, M3_RANGE, "moe: pair %" PRId64 " has an expert id outside [0, %" PRId64 ")", bad, E);
    int64_t off = 0;
    for (int64_t x = 0; x < E && st == M3_OK; x++) {
      const int64_t c = cnt[x];
      if (!c) continue;
      st = gemm_run(rt, g, &b, c, 2 * I, H, w->e4m3, b.xs + off * H, w->h_gu[x], w->e4m3 ? w->h_gu_scale[x] : NULL,
                    b.gu + off * 2 * I, e);
      off += c;
    }
    if (st == M3_OK) st = m3_launch_swiglu(sw, P, I, b.gu, b.act, s, e);
    off = 0;
    for (int64_t x = 0; x < E && st == M3_OK; x++) {
      const int64_t c = cnt[x];
      if (!c) continue;
      st = gemm_run(rt, g, &b, c, H, I, w->e4m3, b.act + off * I, w->h_down[x],
                    w->e4m3 ? w->h_down_scale[x] : NULL, b.y + off * H, e);
      off += c;
    }
    free(cnt);
    M3_TRY(st);
    if (Is) {
      M3_TRY(gemm_run(rt, g, &b, n, 2 * Is, H, w->e4m3, m, w->shared_gu, w->shared_gu_scale, b.sgu, e));
      M3_TRY(m3_launch_swiglu(swsh, n, Is, b.sgu, b.sact, s, e));
      M3_TRY(gemm_run(rt, g, &b, n, H, Is, w->e4m3, b.sact, w->shared_down, w->shared_down_scale, b.sy, e));
    }
    rowof = b.inv;
  }
  M3_TRY(m3_combine_key((int)H, (int)K, Is > 0, rowof != NULL, &v, e));
  M3_TRY(kernel_at(rt, &v, n, &k, e));
  STAGE(M3_MOE_STAGE_COMBINE, m3_launch_moe_combine(k, n, (int)H, (int)K, b.y, rowof, wts, shared_y, out, s, e));
  return M3_OK;
#undef STAGE
}
