/* cases_attention.c - benchmark cases of the attention kernels (see
 * cases_attention.h): the model's decode and prefill shapes, timed with CUDA
 * events, reported against the bandwidth / tensor-core ceilings. */
#include "bench/cases_attention.h"

#include <stdlib.h>
#include <string.h>

#include "runtime/bench.h"
#include "runtime/check.h"
#include "runtime/harness.h"
#include "runtime/op_attention.h"

#define NQ 64
#define NKV 4
#define HD 128
#define BS 128
#define TOPK 16
#define MAXROT 32
/* Reuse distance of a KV page across decode reps: over twice the H200 L2 (50-60 MB). */
#define ROTATE_BYTES ((int64_t)128 << 20)

typedef struct bench_ctx {
  m3_rt *rt;
  double copy_gbs;      /* this run's ceilings (tools/cmd_bench.c): copy > 0, */
  double gemm_tflops;   /* GEMM 0 when its measurement failed */
  void *pool;           /* KV pages, constant pattern */
  size_t pool_bytes;
  void *q, *out;        /* [64K, nq, hd] bf16 each */
  void *ws;
  size_t ws_bytes;
} bench_ctx;

typedef struct bcase {
  bench_ctx *bc;
  m3_kernel *k;
  int sparse, R;
  m3_attn_args a;
  m3_seq_batch b[MAXROT];
  const int32_t *sel[MAXROT];
  int64_t max_kv_len;
} bcase;

static m3_status timed(void *arg, int rep, m3_err *e) {
  bcase *c = arg;
  const int r = rep % c->R;
  bench_ctx *bc = c->bc;
  if (c->sparse)
    return m3_launch_attn_sparse(c->k, &c->a, &c->b[r], c->max_kv_len, bc->rt->dev.sm_count, bc->q, bc->pool,
                                 c->sel[r], bc->out, bc->ws, bc->ws_bytes, bc->rt->stream, e);
  return m3_launch_attn_dense(c->k, &c->a, &c->b[r], c->max_kv_len, bc->rt->dev.sm_count, bc->q, bc->pool, bc->out,
                              bc->ws, bc->ws_bytes, bc->rt->stream, e);
}

/* Device copies of host arrays, freed together. */
typedef struct dev_list { void *p[4 * MAXROT + 8]; int n; } dev_list;
static m3_status up(dev_list *d, const void *src, size_t bytes, void **out, m3_err *e) {
  M3_TRY(m3_dev_alloc(out, bytes, e));
  d->p[d->n++] = *out;
  return m3_dev_upload(*out, src, bytes, e);
}
static void dev_list_free(dev_list *d) {
  for (int i = 0; i < d->n; i++) m3_dev_free(d->p[i]);
  d->n = 0;
}

static m3_status get_kernel(bench_ctx *bc, int sparse, m3_attn_mode mode, const m3_attn_args *a, int64_t ctx,
                            m3_kernel **k, m3_err *e) {
  m3_variant v;
  M3_TRY(sparse ? m3_attn_sparse_key(a, mode, &v, e) : m3_attn_dense_key(a, mode, &v, e));
  m3_bucket bk = {0};
  m3_bucket_add(&bk, "tokens", a->n_tokens, NULL);
  m3_bucket_add(&bk, "ctx", ctx, NULL);
  return m3_rt_kernel(bc->rt, &v, &bk, k, e);
}

static m3_status ensure_ws(bench_ctx *bc, bcase *c, m3_err *e) {
  size_t need = m3_attn_workspace_bytes(c->k, &c->a, c->max_kv_len, bc->rt->dev.sm_count);
  if (need <= bc->ws_bytes) return M3_OK;
  m3_dev_free(bc->ws);
  bc->ws = NULL;
  bc->ws_bytes = 0;
  M3_TRY(m3_dev_alloc(&bc->ws, need, e));
  M3_TRY(m3_attn_workspace_init(bc->ws, need, bc->rt->stream, e));
  bc->ws_bytes = need;
  return M3_OK;
}

/* One markdown row: case, key, tile, median/p20/p80 us, and for decode the
 * per-launch time in a graph (tg), the bytes, the rate and the fraction of
 * this run's copy ceiling from the graph time; for prefill the FLOPs,
 * TFLOP/s from the event time and the fraction of this run's cuBLAS GEMM. */
static void report(FILE *out, const bcase *c, const char *what, const m3_timing *t, const m3_timing *tg,
                   double bytes, double flops) {
  char key[M3_KEY_MAX], tile[128];
  m3_variant_print_axes(&c->k->key, key, sizeof key);
  m3_variant_print_tile(&c->k->key, tile, sizeof tile);
  fprintf(out, "| %s | `%s` | %s | %.1f | %.1f | %.1f | ", what, key, tile, t->median_us, t->p20_us, t->p80_us);
  if (bytes > 0) {
    const double gbs = bytes / (tg->median_us * 1e3);
    fprintf(out, "%.1f | %.3g B | %.0f GB/s | %.1f%% |\n", tg->median_us, bytes, gbs, 100.0 * gbs / c->bc->copy_gbs);
  } else {
    const double tf = flops / (t->median_us * 1e6);
    fprintf(out, " | %.3g FLOP | %.1f TFLOP/s | ", flops, tf);
    if (c->bc->gemm_tflops > 0) fprintf(out, "%.1f%% |\n", 100.0 * tf / c->bc->gemm_tflops);
    else fprintf(out, "- |\n");
  }
  fflush(out);
}

/* Event-timed launches one by one (t), and for decode (tg non-NULL) the
 * per-launch time of a graph of the R rotations: the decode step runs as a
 * graph, so tg is the time a layer costs there (no per-launch CPU overhead). */
static m3_status run_case(bench_ctx *bc, bcase *c, int warmup, int reps, m3_timing *t, m3_timing *tg, m3_err *e) {
  M3_TRY(ensure_ws(bc, c, e));
  M3_TRY(m3_time_events(timed, c, bc->rt->stream, warmup, reps, t, e));
  if (tg) M3_TRY(m3_time_graph(timed, c, c->R, c->R, bc->rt->stream, 30, tg, e));
  return M3_OK;
}

/* Sparse decode: `batch` sequences of ctx tokens, one query each at its last
 * position; rotation r selects the local block plus blocks [15r, 15r+15). */
static m3_status sparse_decode(bench_ctx *bc, FILE *out, int kv8, int batch, int ctx, m3_err *e) {
  char nm[96];
  snprintf(nm, sizeof nm, "sparse decode %s batch %d (16 x 128 x 4)", kv8 ? "e4m3" : "bf16", batch);
  if (!m3_bench_case_wanted(nm)) return M3_OK;
  const int64_t nb = ctx / BS, page_bytes = (int64_t)NKV * BS * 2 * HD * (kv8 ? 1 : 2);
  const int64_t set_bytes = (int64_t)batch * NKV * TOPK * BS * 2 * HD * (kv8 ? 1 : 2);
  int R = (int)((ROTATE_BYTES + set_bytes - 1) / set_bytes);
  if (R > MAXROT) R = MAXROT;
  if (R > (nb - 1) / (TOPK - 1)) R = (int)((nb - 1) / (TOPK - 1));
  if ((int64_t)batch * nb * page_bytes > (int64_t)bc->pool_bytes)
    return m3_errf(e, M3_CAPACITY, "bench: sparse decode batch %d x %d tokens exceeds the KV pool", batch, ctx);
  bcase c = {.bc = bc, .sparse = 1, .R = R, .max_kv_len = ctx};
  c.a = (m3_attn_args){.n_tokens = batch, .nq = NQ, .nkv = NKV, .head_dim = HD, .block_size = BS, .kv_e4m3 = kv8,
                       .topk = TOPK};
  M3_TRY(get_kernel(bc, 1, M3_ATTN_DECODE, &c.a, ctx, &c.k, e));
  int32_t *lens = malloc(sizeof *lens * batch), *ts = malloc(sizeof *ts * batch), *bt = malloc(sizeof *bt * batch * nb);
  int64_t *pos = malloc(sizeof *pos * batch);
  int32_t *sel = malloc(sizeof *sel * NKV * batch * TOPK);
  dev_list d = {0};
  m3_status s = (lens && ts && bt && pos && sel) ? M3_OK : m3_errf(e, M3_NOMEM, "bench: sparse decode tables");
  for (int i = 0; s == M3_OK && i < batch; i++) {
    lens[i] = ctx, ts[i] = i, pos[i] = ctx - 1;
    for (int64_t b = 0; b < nb; b++) bt[i * nb + b] = (int32_t)(i * nb + b);
  }
  void *d_lens = 0, *d_ts = 0, *d_pos = 0, *d_bt = 0;
  if (s == M3_OK) s = up(&d, lens, sizeof *lens * batch, &d_lens, e);
  if (s == M3_OK) s = up(&d, ts, sizeof *ts * batch, &d_ts, e);
  if (s == M3_OK) s = up(&d, pos, sizeof *pos * batch, &d_pos, e);
  if (s == M3_OK) s = up(&d, bt, sizeof *bt * batch * nb, &d_bt, e);
  for (int r = 0; s == M3_OK && r < R; r++) {
    for (int g = 0; g < NKV; g++)
      for (int t = 0; t < batch; t++) {
        int32_t *row = sel + ((int64_t)g * batch + t) * TOPK;
        row[0] = (int32_t)(nb - 1);
        for (int k = 1; k < TOPK; k++) row[k] = (int32_t)((r * (TOPK - 1) + k - 1 + g * 7) % (nb - 1));
      }
    void *d_sel;
    s = up(&d, sel, sizeof *sel * NKV * batch * TOPK, &d_sel, e);
    c.sel[r] = d_sel;
    c.b[r] = (m3_seq_batch){batch, d_lens, d_bt, nb, (int64_t)(bc->pool_bytes / page_bytes), d_ts, d_pos};
  }
  m3_timing t, tg;
  if (s == M3_OK) s = run_case(bc, &c, 5, 50, &t, &tg, e);
  if (s == M3_OK) {
    char what[96];
    snprintf(what, sizeof what, "sparse decode %s batch %d (16 x 128 x 4)", kv8 ? "e4m3" : "bf16", batch);
    report(out, &c, what, &t, &tg, (double)set_bytes, 0);
  }
  dev_list_free(&d);
  free(lens), free(ts), free(bt), free(pos), free(sel);
  return s;
}

/* Dense decode: one sequence of ctx tokens; rotation r maps the sequence to
 * its own page range (R sequences, token_seq = r). */
static m3_status dense_decode(bench_ctx *bc, FILE *out, int kv8, int64_t ctx, m3_err *e) {
  char nm[96];
  snprintf(nm, sizeof nm, "dense decode %s ctx %lld", kv8 ? "e4m3" : "bf16", (long long)ctx);
  if (!m3_bench_case_wanted(nm)) return M3_OK;
  const int64_t nb = (ctx + BS - 1) / BS, page_bytes = (int64_t)NKV * BS * 2 * HD * (kv8 ? 1 : 2);
  const int64_t set_bytes = ctx * NKV * 2 * HD * (kv8 ? 1 : 2), pool_pages = (int64_t)bc->pool_bytes / page_bytes;
  int R = (int)((ROTATE_BYTES + set_bytes - 1) / set_bytes);
  if (R > MAXROT) R = MAXROT;
  if (R > pool_pages / nb) R = (int)(pool_pages / nb);
  if (R < 1) return m3_errf(e, M3_CAPACITY, "bench: dense decode at %lld tokens exceeds the KV pool", (long long)ctx);
  bcase c = {.bc = bc, .sparse = 0, .R = R, .max_kv_len = ctx};
  c.a = (m3_attn_args){.n_tokens = 1, .nq = NQ, .nkv = NKV, .head_dim = HD, .block_size = BS, .kv_e4m3 = kv8};
  M3_TRY(get_kernel(bc, 0, M3_ATTN_DECODE, &c.a, ctx, &c.k, e));
  int32_t *lens = malloc(sizeof *lens * R), *bt = malloc(sizeof *bt * R * nb);
  dev_list d = {0};
  m3_status s = (lens && bt) ? M3_OK : m3_errf(e, M3_NOMEM, "bench: dense decode tables");
  for (int r = 0; s == M3_OK && r < R; r++) {
    lens[r] = (int32_t)ctx;
    for (int64_t b = 0; b < nb; b++) bt[r * nb + b] = (int32_t)(r * nb + b);
  }
  void *d_lens = 0, *d_bt = 0, *d_pos = 0;
  int64_t pos = ctx - 1;
  if (s == M3_OK) s = up(&d, lens, sizeof *lens * R, &d_lens, e);
  if (s == M3_OK) s = up(&d, bt, sizeof *bt * R * nb, &d_bt, e);
  if (s == M3_OK) s = up(&d, &pos, sizeof pos, &d_pos, e);
  for (int r = 0; s == M3_OK && r < R; r++) {
    int32_t seq = r;
    void *d_ts;
    s = up(&d, &seq, sizeof seq, &d_ts, e);
    c.b[r] = (m3_seq_batch){R, d_lens, d_bt, nb, pool_pages, d_ts, d_pos};
  }
  m3_timing t, tg;
  if (s == M3_OK) s = run_case(bc, &c, 3, ctx >= (1 << 20) ? 20 : 50, &t, &tg, e);
  if (s == M3_OK) {
    char what[96];
    snprintf(what, sizeof what, "dense decode %s ctx %lld", kv8 ? "e4m3" : "bf16", (long long)ctx);
    report(out, &c, what, &t, &tg, (double)set_bytes, 0);
  }
  dev_list_free(&d);
  free(lens), free(bt);
  return s;
}

/* Prefill of one chunk of n tokens from position 0; sparse selections are
 * indexer-like (local block + 15 pseudo-random distinct others, or every
 * block while nb <= 16).  FLOPs count the keys actually attended. */
static m3_status prefill(bench_ctx *bc, FILE *out, int sparse, int kv8, int n, m3_err *e) {
  char nm[96];
  snprintf(nm, sizeof nm, "%s prefill %s chunk %d", sparse ? "sparse" : "dense", kv8 ? "e4m3" : "bf16", n);
  if (!m3_bench_case_wanted(nm)) return M3_OK;
  const int64_t nb = (n + BS - 1) / BS, page_bytes = (int64_t)NKV * BS * 2 * HD * (kv8 ? 1 : 2);
  if (nb * page_bytes > (int64_t)bc->pool_bytes)
    return m3_errf(e, M3_CAPACITY, "bench: prefill of %d tokens exceeds the KV pool", n);
  bcase c = {.bc = bc, .sparse = sparse, .R = 1, .max_kv_len = n};
  c.a = (m3_attn_args){.n_tokens = n, .nq = NQ, .nkv = NKV, .head_dim = HD, .block_size = BS, .kv_e4m3 = kv8,
                       .topk = TOPK};
  M3_TRY(get_kernel(bc, sparse, M3_ATTN_PREFILL, &c.a, n, &c.k, e));
  int32_t *ts = calloc((size_t)n, sizeof *ts), *bt = malloc(sizeof *bt * nb), len = n;
  int64_t *pos = malloc(sizeof *pos * n);
  int32_t *sel = sparse ? malloc(sizeof *sel * NKV * (size_t)n * TOPK) : NULL;
  uint8_t *used = sparse ? malloc((size_t)nb) : NULL;
  dev_list d = {0};
  m3_status s = (ts && bt && pos && (!sparse || (sel && used))) ? M3_OK : m3_errf(e, M3_NOMEM, "bench: prefill tables");
  double keys = 0;
  m3_rng rng = {0x5eed};
  for (int64_t b = 0; s == M3_OK && b < nb; b++) bt[b] = (int32_t)b;
  for (int t = 0; s == M3_OK && t < n; t++) {
    pos[t] = t;
    if (!sparse) {
      keys += (double)(t + 1) * NKV;
      continue;
    }
    const int64_t tb = t / BS + 1;
    for (int g = 0; g < NKV; g++) {
      int32_t *row = sel + ((int64_t)g * n + t) * TOPK;
      int k = 0;
      if (tb <= TOPK) {
        for (; k < tb; k++) row[k] = k;
      } else {
        memset(used, 0, (size_t)tb);
        row[k++] = (int32_t)(tb - 1);
        used[tb - 1] = 1;
        while (k < TOPK) {
          int32_t b = (int32_t)(m3_rng_next(&rng) % (uint64_t)(tb - 1));
          if (!used[b]) used[b] = 1, row[k++] = b;
        }
      }
      for (int j = 0; j < k; j++) keys += row[j] == tb - 1 ? (double)(t - (tb - 1) * BS + 1) : BS;
      for (; k < TOPK; k++) row[k] = -1;
    }
  }
  void *d_ts = 0, *d_bt = 0, *d_pos = 0, *d_len = 0, *d_sel = 0;
  if (s == M3_OK) s = up(&d, ts, sizeof *ts * n, &d_ts, e);
  if (s == M3_OK) s = up(&d, bt, sizeof *bt * nb, &d_bt, e);
  if (s == M3_OK) s = up(&d, pos, sizeof *pos * n, &d_pos, e);
  if (s == M3_OK) s = up(&d, &len, sizeof len, &d_len, e);
  if (s == M3_OK && sparse) s = up(&d, sel, sizeof *sel * NKV * (size_t)n * TOPK, &d_sel, e);
  c.sel[0] = d_sel;
  c.b[0] = (m3_seq_batch){1, d_len, d_bt, nb, (int64_t)bc->pool_bytes / page_bytes, d_ts, d_pos};
  m3_timing t;
  if (s == M3_OK) s = run_case(bc, &c, 1, n >= 32768 ? 3 : 5, &t, NULL, e);
  if (s == M3_OK) {
    char what[96];
    snprintf(what, sizeof what, "%s prefill %s chunk %d", sparse ? "sparse" : "dense", kv8 ? "e4m3" : "bf16", n);
    report(out, &c, what, &t, NULL, 0, keys * (NQ / NKV) * 4.0 * HD);
  }
  dev_list_free(&d);
  free(ts), free(bt), free(pos), free(sel), free(used);
  return s;
}

m3_status m3_bench_attention(m3_rt *rt, double copy_gbs, double gemm_tflops, FILE *out, m3_err *e) {
  bench_ctx bc = {.rt = rt, .copy_gbs = copy_gbs, .gemm_tflops = gemm_tflops};
  /* 2 GiB + 1 page: one bf16 layer of a 1M-token sequence. */
  bc.pool_bytes = ((size_t)2 << 30) + (size_t)NKV * BS * 2 * HD * 2;
  const size_t qbytes = (size_t)65536 * NQ * HD * 2;
  m3_status s = m3_dev_alloc(&bc.pool, bc.pool_bytes, e);
  if (s == M3_OK) s = m3_dev_alloc(&bc.q, qbytes, e);
  if (s == M3_OK) s = m3_dev_alloc(&bc.out, qbytes, e);
  /* 0x3C: bf16 0x3C3C = 0.0115, e4m3 0x3C = 1.5 - finite in both dtypes. */
  if (s == M3_OK && cudaMemset(bc.pool, 0x3c, bc.pool_bytes) != cudaSuccess) s = m3_errf(e, M3_CUDA, "bench: memset");
  if (s == M3_OK && cudaMemset(bc.q, 0x3c, qbytes) != cudaSuccess) s = m3_errf(e, M3_CUDA, "bench: memset");
  if (s == M3_OK && cudaDeviceSynchronize() != cudaSuccess) s = m3_errf(e, M3_CUDA, "bench: memset");
  char gemm[48] = "(unmeasured)";
  if (gemm_tflops > 0) snprintf(gemm, sizeof gemm, "%.0f TFLOP/s", gemm_tflops);
  if (s == M3_OK)
    fprintf(out, "\n## attention over the paged KV cache (%s, %d SMs)\n\nDecode: KV bytes read, %% of this run's "
            "%.0f GB/s copy ceiling, both from the per-launch time in a CUDA graph of the rotations (graph us: how "
            "the decode step runs them); prefill: FLOPs of QK^T + P·V over the keys attended, from the event "
            "median, %% of this run's cuBLAS bf16 GEMM %s.\n\n"
            "| case | variant | tile | median us | p20 | p80 | graph us/launch | work | rate | %% of ceiling |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n", rt->dev.name, rt->dev.sm_count, copy_gbs, gemm);
  static const int64_t ctxs[] = {8192, 32768, 131072, 393216, 1048576};
  static const int chunks[] = {8192, 16384, 32768, 65536};
  for (int kv8 = 0; kv8 < 2 && s == M3_OK; kv8++) {
    if (s == M3_OK) s = sparse_decode(&bc, out, kv8, 1, 65536, e);
    if (s == M3_OK) s = sparse_decode(&bc, out, kv8, 32, 16384, e);
    for (int i = 0; i < 5 && s == M3_OK; i++) s = dense_decode(&bc, out, kv8, ctxs[i], e);
    for (int sp = 0; sp < 2; sp++)
      for (int i = 0; i < 4 && s == M3_OK; i++) s = prefill(&bc, out, sp, kv8, chunks[i], e);
  }
  m3_dev_free(bc.pool);
  m3_dev_free(bc.q);
  m3_dev_free(bc.out);
  m3_dev_free(bc.ws);
  return s;
}
