/* cases_ffn.c - FFN-side benchmarks (cases_ffn.h).  Decode is weight
 * streaming: what matters is how close each GEMV gets to the HBM copy
 * ceiling, measured on weights that cannot be in L2 (every rep of a case
 * reads distinct weights, and the pool is far larger than L2).  Weight
 * contents are a constant byte pattern: the kernels' speed does not depend
 * on the values (no data-dependent branches). */
#include "bench/cases_ffn.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/bench.h"
#include "runtime/check.h"
#include "runtime/harness.h"
#include "runtime/op_ffn.h"

#define LAYERS 57            /* MoE layers of M3: one decode step streams 57 x 4 experts */

typedef struct pool {
  int n;                     /* experts */
  void **gu, **gus, **dn, **dns;   /* device weights (host arrays of device pointers) */
  void *tab[4];              /* device pointer tables: gu, gu scales, down, down scales */
  int32_t *ids;              /* device [reps, 4] expert ids, rotating */
} pool;

static void pool_free(pool *p) {
  for (int i = 0; i < p->n; i++) {
    if (p->gu) cudaFree(p->gu[i]);
    if (p->gus) cudaFree(p->gus[i]);
    if (p->dn) cudaFree(p->dn[i]);
    if (p->dns) cudaFree(p->dns[i]);
  }
  for (int i = 0; i < 4; i++) cudaFree(p->tab[i]);
  cudaFree(p->ids);
  free(p->gu); free(p->gus); free(p->dn); free(p->dns);
  memset(p, 0, sizeof *p);
}

/* n experts of gate|up [2I, H] and down [H, I], e4m3 (+ scales) or bf16. */
static m3_status pool_make(pool *p, int n, int e4m3, int64_t H, int64_t I, int reps, m3_err *e) {
  memset(p, 0, sizeof *p);
  const size_t es = e4m3 ? 1 : 2, gub = (size_t)2 * I * H * es, dnb = (size_t)H * I * es;
  p->gu = calloc((size_t)n, sizeof *p->gu);
  p->gus = calloc((size_t)n, sizeof *p->gus);
  p->dn = calloc((size_t)n, sizeof *p->dn);
  p->dns = calloc((size_t)n, sizeof *p->dns);
  if (!p->gu || !p->gus || !p->dn || !p->dns) return m3_errf(e, M3_NOMEM, "bench pool");
  for (int i = 0; i < n; i++, p->n++) {
    M3_CUDA(e, cudaMalloc(&p->gu[i], gub));
    M3_CUDA(e, cudaMalloc(&p->dn[i], dnb));
    M3_CUDA(e, cudaMemset(p->gu[i], e4m3 ? 0x30 : 0x3c, gub));
    M3_CUDA(e, cudaMemset(p->dn[i], e4m3 ? 0x30 : 0x3c, dnb));
    if (e4m3) {
      M3_CUDA(e, cudaMalloc(&p->gus[i], gub / 32));
      M3_CUDA(e, cudaMalloc(&p->dns[i], dnb / 32));
      M3_CUDA(e, cudaMemset(p->gus[i], 119, gub / 32));
      M3_CUDA(e, cudaMemset(p->dns[i], 119, dnb / 32));
    }
  }
  void **src[4] = {p->gu, p->gus, p->dn, p->dns};
  for (int t = 0; t < 4; t++) {
    M3_CUDA(e, cudaMalloc(&p->tab[t], sizeof(void *) * (size_t)n));
    M3_CUDA(e, cudaMemcpy(p->tab[t], src[t], sizeof(void *) * (size_t)n, cudaMemcpyHostToDevice));
  }
  int32_t *ids = malloc(sizeof *ids * (size_t)reps * 4);
  if (!ids) return m3_errf(e, M3_NOMEM, "bench ids");
  for (int r = 0; r < reps * 4; r++) ids[r] = r % n;
  cudaError_t ce = cudaMalloc((void **)&p->ids, sizeof *ids * (size_t)reps * 4);
  if (ce == cudaSuccess) ce = cudaMemcpy(p->ids, ids, sizeof *ids * (size_t)reps * 4, cudaMemcpyHostToDevice);
  free(ids);
  if (ce != cudaSuccess) return m3_cuda_fail(e, ce, "bench ids upload", __FILE__, __LINE__);
  return M3_OK;
}

typedef struct moe_case {
  pool *p;
  m3_kernel *k;
  m3_gemv_args a;
  const void *x;
  void *y;
  int down;                  /* 0 gate|up, 1 down (2: gate|up + SwiGLU, 3: down + combine) */
  const m3_gemv_epilogue *ep; /* 2, 3 */
  cudaStream_t s;
} moe_case;

/* The decode step's launch (runtime/op_ffn.c): 4 routed pairs + the shared
 * expert's, one grid.  The shared expert is a pool expert half the pool away
 * from this rep's routed ones, so it is as cold as they are. */
static m3_status moe_rep(void *arg, int rep, m3_err *e) {
  moe_case *c = arg;
  const int reps = c->p->n / 4, r = rep % reps, sh = (r * 4 + c->p->n / 2) % c->p->n;
  const int32_t *ids = c->p->ids + (size_t)r * 4;
  const int dn = c->down & 1;
  return m3_launch_gemv_moe_fused(c->k, &c->a, c->x, (const void *const *)c->p->tab[dn ? 2 : 0],
                                  (const void *const *)c->p->tab[dn ? 3 : 1], ids, dn ? c->p->dn[sh] : c->p->gu[sh],
                                  dn ? c->p->dns[sh] : c->p->gus[sh], 1, c->y, c->ep, c->s, e);
}

/* copy_gbs: this run's device-to-device copy ceiling (GB/s > 0).  t: event
 * medians of launches one by one; tg: the per-launch time of the same
 * launches replayed back to back as a CUDA graph, which is how the decode step
 * runs them (no per-launch CPU cost, PDL overlap with the previous kernel), so
 * the fraction of the ceiling is the graph's, as in the indexer and attention
 * families; the event rate stays beside it. */
static void report(FILE *out, double copy_gbs, const char *what, const m3_timing *t, const m3_timing *tg,
                   double bytes) {
  double gbs = bytes / (t->median_us * 1e3), ggbs = bytes / (tg->median_us * 1e3);
  fprintf(out,
          "ffn  %-58s median %9.2f us (p20 %.2f, p80 %.2f)  %7.0f GB/s | graph %9.2f us/launch (p20 %.2f, p80 %.2f)  "
          "%7.0f GB/s  %5.1f%% of %.2f TB/s\n",
          what, t->median_us, t->p20_us, t->p80_us, gbs, tg->median_us, tg->p20_us, tg->p80_us, ggbs,
          100.0 * ggbs / copy_gbs, copy_gbs / 1000);
}

static m3_status bench_moe(m3_rt *rt, double copy_gbs, FILE *out, int e4m3, m3_err *e) {
  const int64_t H = 6144, I = 3072;
  const char *fmt = e4m3 ? "W8A16" : "W16A16";
  char nm[4][64];
  /* 2, 3: the decode step's launches with their epilogues (MXFP8 only) */
  static const char *const what[4] = {"gate|up", "down", "gate|up+swiglu", "down+combine"};
  const int nd = e4m3 ? 4 : 2;
  int any = 0;
  for (int d = 0; d < nd; d++) {
    snprintf(nm[d], sizeof nm[d], "%s moe %s", fmt, what[d]);
    any |= m3_bench_case_wanted(nm[d]);
  }
  if (!any) return M3_OK;
  const size_t es = e4m3 ? 1 : 2;
  const double per_expert = (double)(3 * I * H) * es * (e4m3 ? 33.0 / 32.0 : 1.0);
  size_t free_b = 0, total_b = 0;
  M3_CUDA(e, cudaMemGetInfo(&free_b, &total_b));
  int n = LAYERS * 4;
  while (n > 4 && per_expert * n > 0.8 * (double)free_b) n -= 4;
  if (per_expert * n < 4.0 * rt->dev.l2_bytes)
    return m3_errf(e, M3_CAPACITY, "bench moe: %d experts (%.1f GB) do not exceed 4x L2", n, per_expert * n / 1e9);
  pool p;
  m3_status st = pool_make(&p, n, e4m3, H, I, n / 4, e);
  void *x = NULL, *gu = NULL, *act = NULL, *y = NULL, *cw = NULL, *out1 = NULL, *cnt = NULL;
  const float w4[4] = {0.5f, 0.5f, 0.5f, 0.5f};
  const size_t ncnt = (size_t)5 * I / 16 + H / 16 + 1; /* the larger of the two epilogues' */
  if (st == M3_OK && (cudaMalloc(&cw, sizeof w4) != cudaSuccess || cudaMalloc(&out1, sizeof(uint16_t) * H) != cudaSuccess ||
                      cudaMalloc(&cnt, sizeof(uint32_t) * ncnt) != cudaSuccess))
    st = m3_errf(e, M3_CUDA, "bench epilogue buffers");
  if (st == M3_OK && (cudaMemcpy(cw, w4, sizeof w4, cudaMemcpyHostToDevice) != cudaSuccess ||
                      cudaMemset(cnt, 0, sizeof(uint32_t) * ncnt) != cudaSuccess))
    st = m3_errf(e, M3_CUDA, "bench epilogue setup");

  if (st == M3_OK && cudaMalloc(&x, sizeof(uint16_t) * H) != cudaSuccess) st = m3_errf(e, M3_CUDA, "bench x");
  if (st == M3_OK && cudaMalloc(&gu, sizeof(uint16_t) * 5 * 2 * I) != cudaSuccess) st = m3_errf(e, M3_CUDA, "bench gu");
  if (st == M3_OK && cudaMalloc(&act, sizeof(uint16_t) * 5 * I) != cudaSuccess) st = m3_errf(e, M3_CUDA, "bench act");
  if (st == M3_OK && cudaMalloc(&y, sizeof(uint16_t) * 5 * H) != cudaSuccess) st = m3_errf(e, M3_CUDA, "bench y");
  if (st == M3_OK) st = cudaMemset(x, 0x3c, sizeof(uint16_t) * H) == cudaSuccess ? M3_OK : m3_errf(e, M3_CUDA, "memset");
  if (st == M3_OK) st = cudaMemset(act, 0x3c, sizeof(uint16_t) * 5 * I) == cudaSuccess ? M3_OK : m3_errf(e, M3_CUDA, "memset");
  /* memsets run on the legacy stream; the timed kernels on rt->stream */
  if (st == M3_OK && cudaDeviceSynchronize() != cudaSuccess) st = m3_errf(e, M3_CUDA, "bench moe setup");
  const m3_gemv_epilogue ep_act = {.act = act, .tile_count = cnt}, ep_comb = {.w = cw, .out = out1, .tile_count = cnt};
  for (int d = 0; d < nd && st == M3_OK; d++) {
    if (!m3_bench_case_wanted(nm[d])) continue;
    const int dn = d & 1;
    moe_case c = {.p = &p, .down = d, .s = rt->stream, .ep = d == 2 ? &ep_act : d == 3 ? &ep_comb : NULL};
    c.a = (m3_gemv_args){.n = 4, .rows = dn ? H : 2 * I, .cols = dn ? I : H,
                         .wfmt = e4m3 ? M3_GEMV_E4M3 : M3_GEMV_BF16, .moe = 1, .xdiv = dn ? 1 : 4, .n_experts = n,
                         .act = d == 2, .alpha = 1.702f, .limit = 7.0f, .beta = 1.0f, .combine = d == 3,
                         .ids_settled = dn}; /* the step's down key (its ids a host upload here: settled) */
    c.x = dn ? act : x;
    c.y = dn ? y : gu;
    st = m3_gemv_kernel(rt, &c.a, &c.k, e);
    m3_timing t, tg;
    if (st == M3_OK) st = m3_time_events(moe_rep, &c, rt->stream, 3, n / 4, &t, e);
    if (st == M3_OK) st = m3_time_graph(moe_rep, &c, n / 4, n / 4, rt->stream, 30, &tg, e);
    if (st == M3_OK) {
      char what[160], key[M3_KEY_MAX];
      m3_variant_print(&c.k->key, key, sizeof key);
      snprintf(what, sizeof what, "%s, 4 experts + shared %lldx%lld, %d rotating", nm[d], (long long)c.a.rows,
               (long long)c.a.cols, n);
      report(out, copy_gbs, what, &t, &tg, 5.0 * (double)c.a.rows * c.a.cols * es * (e4m3 ? 33.0 / 32.0 : 1.0));
      fprintf(out, "     kernel %s\n", key);
    }
  }
  cudaFree(x); cudaFree(gu); cudaFree(act); cudaFree(y); cudaFree(cw); cudaFree(out1); cudaFree(cnt);
  pool_free(&p);
  return st;
}

typedef struct dense_case {
  m3_kernel *k;
  m3_gemv_args a;
  void **w, **s;             /* rotating copies */
  int copies;
  const void *x;
  void *y;
  cudaStream_t st;
} dense_case;

static m3_status dense_rep(void *arg, int rep, m3_err *e) {
  dense_case *c = arg;
  int i = rep % c->copies;
  return m3_launch_gemv(c->k, &c->a, c->x, c->w[i], c->s ? c->s[i] : NULL, c->y, c->st, e);
}

static m3_status bench_dense(m3_rt *rt, double copy_gbs, FILE *out, int wfmt, int64_t rows, int64_t cols, int64_t n, m3_err *e) {
  char nm[64];
  const int f32 = wfmt == M3_GEMV_F32; /* the router: fp32 weights and logits */
  snprintf(nm, sizeof nm, "%s gemv %lldx%lld, n=%lld", wfmt == M3_GEMV_E4M3 ? "W8A16" : f32 ? "fp32 router" : "W16A16",
           (long long)rows, (long long)cols, (long long)n);
  if (!m3_bench_case_wanted(nm)) return M3_OK;
  const size_t es = wfmt == M3_GEMV_E4M3 ? 1 : f32 ? 4 : 2, wb = (size_t)rows * cols * es;
  int copies = 1;
  while ((double)copies * wb < 4.0 * rt->dev.l2_bytes && copies < 64) copies++;
  dense_case c = {.a = {.n = n, .rows = rows, .cols = cols, .wfmt = wfmt, .out_f32 = f32}, .copies = copies,
                  .st = rt->stream};
  c.w = calloc((size_t)copies, sizeof *c.w);
  c.s = wfmt == M3_GEMV_E4M3 ? calloc((size_t)copies, sizeof *c.s) : NULL;
  void *x = NULL, *y = NULL;
  m3_status st = c.w && (wfmt != M3_GEMV_E4M3 || c.s) ? M3_OK : m3_errf(e, M3_NOMEM, "bench dense");
  for (int i = 0; i < copies && st == M3_OK; i++) {
    if (cudaMalloc(&c.w[i], wb) != cudaSuccess || cudaMemset(c.w[i], es == 1 ? 0x30 : es == 2 ? 0x3c : 0x3b, wb) != cudaSuccess)
      st = m3_errf(e, M3_CUDA, "bench dense weights");
    if (st == M3_OK && c.s &&
        (cudaMalloc(&c.s[i], wb / 32) != cudaSuccess || cudaMemset(c.s[i], 119, wb / 32) != cudaSuccess))
      st = m3_errf(e, M3_CUDA, "bench dense scales");
  }
  if (st == M3_OK && (cudaMalloc(&x, sizeof(uint16_t) * (size_t)n * cols) != cudaSuccess ||
                      cudaMemset(x, 0x3c, sizeof(uint16_t) * (size_t)n * cols) != cudaSuccess ||
                      cudaMalloc(&y, (f32 ? 4 : 2) * (size_t)n * rows) != cudaSuccess))
    st = m3_errf(e, M3_CUDA, "bench dense activations");
  c.x = x;
  c.y = y;
  if (st == M3_OK && cudaDeviceSynchronize() != cudaSuccess) st = m3_errf(e, M3_CUDA, "bench dense setup");
  if (st == M3_OK) st = m3_gemv_kernel(rt, &c.a, &c.k, e);
  m3_timing t, tg;
  if (st == M3_OK) st = m3_time_events(dense_rep, &c, rt->stream, 3, copies < 20 ? 20 : copies, &t, e);
  if (st == M3_OK) st = m3_time_graph(dense_rep, &c, copies < 20 ? 20 : copies, copies < 20 ? 20 : copies, rt->stream, 30, &tg, e);
  if (st == M3_OK) {
    char what[160];
    snprintf(what, sizeof what, "%s, %d rotating", nm, copies);
    report(out, copy_gbs, what, &t, &tg, (double)wb * (wfmt == M3_GEMV_E4M3 ? 33.0 / 32.0 : 1.0));
  }
  for (int i = 0; i < copies; i++) {
    if (c.w) cudaFree(c.w[i]);
    if (c.s) cudaFree(c.s[i]);
  }
  free(c.w);
  free(c.s);
  cudaFree(x);
  cudaFree(y);
  return st;
}

typedef struct norm_case {
  m3_kernel *k;
  int64_t rows;
  void *x, *res, *w, *y;
  float *y32;
  cudaStream_t s;
} norm_case;

static m3_status norm_rep(void *arg, int rep, m3_err *e) {
  norm_case *c = arg;
  return m3_launch_add_rmsnorm(c->k, c->rows, 6144, c->x, c->res, c->w, 1e-6f, c->y, c->y32, c->s, e);
}

static m3_status bench_norm(m3_rt *rt, double copy_gbs, FILE *out, int64_t rows, m3_err *e) {
  const int64_t H = 6144;
  char nm[64];
  snprintf(nm, sizeof nm, "add+rmsnorm+f32copy %lld x %lld", (long long)rows, (long long)H);
  if (!m3_bench_case_wanted(nm)) return M3_OK;
  norm_case c = {.rows = rows, .s = rt->stream};
  m3_variant v;
  M3_TRY(m3_rmsnorm_key(1, 1, (int)H, &v, e));
  M3_TRY(m3_rt_kernel(rt, &v, NULL, &c.k, e));
  const size_t b = sizeof(uint16_t) * (size_t)rows * H;
  m3_status st = M3_OK;
  if (cudaMalloc(&c.x, b) != cudaSuccess || cudaMalloc(&c.res, b) != cudaSuccess || cudaMalloc(&c.y, b) != cudaSuccess ||
      cudaMalloc((void **)&c.y32, 2 * b) != cudaSuccess || cudaMalloc(&c.w, sizeof(uint16_t) * H) != cudaSuccess)
    st = m3_errf(e, M3_CUDA, "bench norm buffers");
  if (st == M3_OK && (cudaMemset(c.x, 0x3c, b) != cudaSuccess || cudaMemset(c.res, 0x3c, b) != cudaSuccess ||
                      cudaMemset(c.w, 0, sizeof(uint16_t) * H) != cudaSuccess))
    st = m3_errf(e, M3_CUDA, "bench norm fill");
  if (st == M3_OK && cudaDeviceSynchronize() != cudaSuccess) st = m3_errf(e, M3_CUDA, "bench norm setup");
  m3_timing t, tg;
  if (st == M3_OK) st = m3_time_events(norm_rep, &c, rt->stream, 5, 50, &t, e);
  if (st == M3_OK) st = m3_time_graph(norm_rep, &c, 20, 20, rt->stream, 30, &tg, e);
  if (st == M3_OK) {
    report(out, copy_gbs, nm, &t, &tg, (double)b * 6); /* read x, res; write res, y; write y32 (2x) */
  }
  cudaFree(c.x); cudaFree(c.res); cudaFree(c.y); cudaFree(c.y32); cudaFree(c.w);
  return st;
}

m3_status m3_bench_ffn(m3_rt *rt, double copy_gbs, FILE *out, m3_err *e) {
  fprintf(out, "ffn  %s, %d SMs, L2 %d MiB; GB/s of weight bytes read (scales included)\n", rt->dev.name,
          rt->dev.sm_count, rt->dev.l2_bytes >> 20);
  M3_TRY(bench_moe(rt, copy_gbs, out, 1, e));
  M3_TRY(bench_moe(rt, copy_gbs, out, 0, e));
  static const int64_t shapes[2][2] = {{9856, 6144}, {6144, 8192}};
  for (int s = 0; s < 2; s++)
    for (int64_t n = 1; n <= 8; n += 7) M3_TRY(bench_dense(rt, copy_gbs, out, M3_GEMV_E4M3, shapes[s][0], shapes[s][1], n, e));
  M3_TRY(bench_dense(rt, copy_gbs, out, M3_GEMV_BF16, 200064, 6144, 1, e));
  M3_TRY(bench_dense(rt, copy_gbs, out, M3_GEMV_F32, 128, 6144, 1, e)); /* a MoE layer's router (57 a step) */
  M3_TRY(bench_dense(rt, copy_gbs, out, M3_GEMV_E4M3, 3072, 6144, 1, e));
  M3_TRY(bench_dense(rt, copy_gbs, out, M3_GEMV_E4M3, 6144, 3072, 1, e));
  M3_TRY(bench_norm(rt, copy_gbs, out, 1, e));
  M3_TRY(bench_norm(rt, copy_gbs, out, 4096, e));
  return M3_OK;
}
