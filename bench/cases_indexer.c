/* cases_indexer.c - benchmark cases of the decode indexer (see
 * cases_indexer.h): the anchor contexts and the mixed batch, timed with CUDA
 * events per launch and amortised over a CUDA graph, reported as effective
 * index-K bandwidth against the copy ceiling. */
#include "bench/cases_indexer.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/bench.h"
#include "runtime/check.h"
#include "runtime/harness.h"
#include "runtime/op_indexer.h"

#define HEADS 4
#define HD 128
#define BS 128
#define TOPK 16
#define NLAYERS 57                         /* sparse layers: one index cache each */
#define MAXROT 128                         /* more where 57 small caches fit in L2 twice */
#define POOL_MAX ((size_t)20 << 30)        /* bytes of index-K pages */
#define PATTERN ((size_t)256 << 20)        /* random bytes uploaded once, then replicated */

typedef struct icase {
  m3_rt *rt;
  m3_kernel *k;
  m3_idx_args a;
  m3_seq_batch b[MAXROT];
  int R;
  const void *iq;
  m3_idx_cache cache;
  int32_t *out;
  void *ws;
  size_t ws_bytes;
} icase;

static m3_status launch_one(void *arg, int rep, m3_err *e) {
  icase *c = arg;
  return m3_launch_index_decode(c->k, &c->a, &c->b[rep % c->R], c->rt->dev.sm_count, c->iq, &c->cache, c->out, c->ws,
                                c->ws_bytes, c->rt->stream, e);
}

/* Random bytes that are finite as e4m3 (no 0x7f/0xff) and, read in pairs, as
 * bf16 of magnitude 2^-7..2^1 (high byte: sign + exponent 120..127). */
static void fill_pattern(uint8_t *p, size_t n) {
  m3_rng r = {0x1dea5eedull};
  for (size_t i = 0; i + 1 < n; i += 2) {
    uint64_t v = m3_rng_next(&r);
    uint8_t lo = (uint8_t)v;
    if ((lo & 0x7f) == 0x7f) lo ^= 1;
    p[i] = lo;
    p[i + 1] = (uint8_t)(((v >> 8) & 0x80) | (0x3c + ((v >> 16) & 3)));
  }
}

typedef struct pool {
  uint8_t *d;            /* device pages */
  size_t bytes;
  void *iq;              /* [32, HEADS, HD] queries (either dtype's bytes) */
} pool;

static m3_status pool_make(pool *pl, m3_err *e) {
  size_t free_b = 0, total = 0;
  M3_CUDA(e, cudaMemGetInfo(&free_b, &total));
  pl->bytes = POOL_MAX;
  if (pl->bytes > free_b / 10 * 7) pl->bytes = free_b / 10 * 7;
  pl->bytes &= ~(PATTERN - 1);
  if (pl->bytes < PATTERN) return m3_errf(e, M3_CAPACITY, "indexer bench: %zu bytes of GPU memory free", free_b);
  M3_TRY(m3_dev_alloc((void **)&pl->d, pl->bytes, e));
  uint8_t *h = malloc(PATTERN);
  if (!h) return m3_errf(e, M3_NOMEM, "indexer bench: pattern");
  fill_pattern(h, PATTERN);
  m3_status s = m3_dev_upload(pl->d, h, PATTERN, e);
  for (size_t off = PATTERN; !s && off < pl->bytes; off += PATTERN)
    if (cudaMemcpy(pl->d + off, pl->d, PATTERN, cudaMemcpyDeviceToDevice) != cudaSuccess)
      s = m3_errf(e, M3_CUDA, "indexer bench: replicating the pattern");
  if (!s) s = m3_dev_alloc(&pl->iq, 32 * HEADS * HD * 2, e);
  if (!s) s = m3_dev_upload(pl->iq, h + 12345 * 2, 32 * HEADS * HD * 2, e); /* finite in both dtypes */
  free(h);
  return s;
}

/* One case: n sequences of lengths lens[], one decode query each. */
static m3_status run_case(m3_rt *rt, double copy_gbs, pool *pl, FILE *out, const char *name, const int64_t *lens, int n, int e4m3,
                          m3_err *e) {
  char full[96];
  snprintf(full, sizeof full, "%s %s", name, e4m3 ? "e4m3" : "bf16");
  if (!m3_bench_case_wanted(full)) return M3_OK;
  const size_t esz = e4m3 ? 1 : 2, page_bytes = (size_t)BS * HD * esz;
  int64_t max_nb = 1, pages = 0, tokens = 0;
  for (int i = 0; i < n; i++) {
    int64_t nb = (lens[i] + BS - 1) / BS;
    max_nb = nb > max_nb ? nb : max_nb;
    pages += nb;
    tokens += lens[i];
  }
  const int64_t pool_pages = (int64_t)(pl->bytes / page_bytes);
  /* 57 caches (one per sparse layer), more when that leaves two reads of one
   * page less than 2x L2 apart, fewer when the pool cannot hold them. */
  const double set_bytes = (double)pages * page_bytes, l2 = rt->dev.l2_bytes > 0 ? rt->dev.l2_bytes : 64 << 20;
  int64_t want = NLAYERS;
  while (want < MAXROT && (want - 1) * set_bytes < 2 * l2) want++;
  int R = (int)(pool_pages / pages < want ? pool_pages / pages : want);
  if (R < 2 || (R - 1) * set_bytes < 2 * l2) {
    fprintf(out, "| %s | %s | %" PRId64 " | - | skipped: %zu MB of pool hold %d rotation(s) | | | | | | |\n", name,
            e4m3 ? "e4m3" : "bf16", tokens, pl->bytes >> 20, R);
    return M3_OK;
  }
  icase c = {.rt = rt, .R = R, .iq = pl->iq};
  c.a = (m3_idx_args){.n_tokens = n, .n_heads = HEADS, .head_dim = HD, .block_size = BS, .topk = TOPK,
                      .init_blocks = 0, .local_blocks = 1, .idx_e4m3 = e4m3, .max_blocks = (int)max_nb};
  c.cache = (m3_idx_cache){.data = pl->d, .e4m3 = e4m3, .num_pages = pool_pages};
  m3_variant v;
  M3_TRY(m3_index_decode_key(&c.a, &v, e));
  m3_bucket bk = {0};
  M3_TRY(m3_bucket_add(&bk, "tokens", n, e));
  M3_TRY(m3_bucket_add(&bk, "ctx", max_nb * BS, e));
  M3_TRY(m3_rt_kernel(rt, &v, &bk, &c.k, e));
  m3_idx_decode_plan plan;
  M3_TRY(m3_index_decode_plan(c.k, &c.a, rt->dev.sm_count, &plan, e));

  /* Host tables: rotation r owns pages [r * pages, (r + 1) * pages), each
   * sequence's blocks in a random order of them (a fragmented cache). */
  int32_t *bt = malloc(sizeof *bt * (size_t)(R * n * max_nb)), *lens32 = malloc(sizeof *lens32 * n),
          *tseq = malloc(sizeof *tseq * n);
  int64_t *pos = malloc(sizeof *pos * n), *perm = malloc(sizeof *perm * (size_t)pages);
  void *d_bt = NULL, *d_lens = NULL, *d_seq = NULL, *d_pos = NULL;
  m3_status s = (bt && lens32 && tseq && pos && perm) ? M3_OK : m3_errf(e, M3_NOMEM, "indexer bench tables");
  m3_rng rng = {0xb10c5ull + (uint64_t)tokens};
  for (int r = 0; r < R && !s; r++) {
    for (int64_t i = 0; i < pages; i++) perm[i] = (int64_t)r * pages + i;
    for (int64_t i = pages - 1; i > 0; i--) {
      int64_t j = (int64_t)(m3_rng_next(&rng) % (uint64_t)(i + 1)), x = perm[i];
      perm[i] = perm[j], perm[j] = x;
    }
    int64_t nx = 0;
    for (int q = 0; q < n; q++) {
      int64_t nb = (lens[q] + BS - 1) / BS;
      for (int64_t b2 = 0; b2 < max_nb; b2++)
        bt[((int64_t)r * n + q) * max_nb + b2] = b2 < nb ? (int32_t)perm[nx++] : -1;
    }
  }
  for (int q = 0; q < n; q++) lens32[q] = (int32_t)lens[q], tseq[q] = q, pos[q] = lens[q] - 1;
  size_t bt_bytes = sizeof *bt * (size_t)(R * n * max_nb);
  if (!s) s = m3_dev_alloc(&d_bt, bt_bytes, e);
  if (!s) s = m3_dev_upload(d_bt, bt, bt_bytes, e);
  if (!s) s = m3_dev_alloc(&d_lens, sizeof *lens32 * n, e);
  if (!s) s = m3_dev_upload(d_lens, lens32, sizeof *lens32 * n, e);
  if (!s) s = m3_dev_alloc(&d_seq, sizeof *tseq * n, e);
  if (!s) s = m3_dev_upload(d_seq, tseq, sizeof *tseq * n, e);
  if (!s) s = m3_dev_alloc(&d_pos, sizeof *pos * n, e);
  if (!s) s = m3_dev_upload(d_pos, pos, sizeof *pos * n, e);
  if (!s) s = m3_dev_alloc((void **)&c.out, sizeof(int32_t) * HEADS * n * TOPK, e);
  c.ws_bytes = plan.ws_bytes;
  if (!s && c.ws_bytes) s = m3_dev_alloc(&c.ws, c.ws_bytes, e);
  if (!s) s = m3_index_workspace_init(c.ws, c.ws_bytes, rt->stream, e);
  for (int r = 0; r < R; r++)
    c.b[r] = (m3_seq_batch){.n_seqs = n, .seq_lens = d_lens, .block_table = (int32_t *)d_bt + (int64_t)r * n * max_nb,
                            .bt_stride = max_nb, .num_pages = pool_pages, .token_seq = d_seq, .positions = d_pos};
  m3_timing te = {0}, tg = {0};
  if (!s) s = m3_time_events(launch_one, &c, rt->stream, R, R > 50 ? 2 * R : 100, &te, e);
  if (!s) s = m3_time_graph(launch_one, &c, R, R, rt->stream, 30, &tg, e); /* per launch of R back to back */
  if (!s) {
    const double bytes = (double)tokens * HD * esz, gbs_e = bytes / (te.median_us * 1e3),
                 gbs_g = bytes / (tg.median_us * 1e3);
    char tile[160];
    m3_variant_print_tile(&c.k->key, tile, sizeof tile);
    fprintf(out, "| %s | %s | %" PRId64 " | %d | %s, bpc %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | ",
            name, e4m3 ? "e4m3" : "bf16", tokens, R, tile, plan.bpc, te.median_us, te.p20_us, te.p80_us,
            tg.median_us, gbs_e / 1e3, gbs_g / 1e3);
    fprintf(out, "%.0f%% |\n", 100.0 * gbs_g / copy_gbs);
    fflush(out);
  }
  m3_dev_free(d_bt); m3_dev_free(d_lens); m3_dev_free(d_seq); m3_dev_free(d_pos);
  m3_dev_free(c.out); m3_dev_free(c.ws);
  free(bt); free(lens32); free(tseq); free(pos); free(perm);
  return s;
}

m3_status m3_bench_indexer(m3_rt *rt, double copy_gbs, FILE *out, m3_err *e) {
  pool pl = {0};
  m3_status s = pool_make(&pl, e);
  if (s) {
    m3_dev_free(pl.d);
    return s;
  }
  static const int64_t ctxs[] = {8192, 131072, 393216, 769000, 1048576};
  int64_t mixed[32];
  m3_rng r = {0x32ull};
  int64_t total = 0;
  for (int i = 0; i < 32; i++) mixed[i] = 8192 + (int64_t)(m3_rng_next(&r) % (256000 - 8192)), total += mixed[i];
  fprintf(out, "\n## lightning indexer, decode (index heads 4 x 128, block 128, top-16, local 1)\n\n"
               "Effective TB/s = index-K bytes of the visible tokens / time; %% of this run's %.2f TB/s copy "
               "ceiling uses the graph time. R = rotating caches (distinct pages).\n\n"
               "| case | index-K | tokens | R | tile | median us | p20 | p80 | graph us/launch | TB/s (event) | "
               "TB/s (graph) | %% of copy |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
          copy_gbs / 1e3);
  for (int dt = 0; dt < 2 && !s; dt++) {
    for (size_t i = 0; i < sizeof ctxs / sizeof *ctxs && !s; i++) {
      char name[48];
      snprintf(name, sizeof name, "batch 1, %" PRId64, ctxs[i]);
      s = run_case(rt, copy_gbs, &pl, out, name, &ctxs[i], 1, dt, e);
    }
    if (!s) {
      char name[64];
      snprintf(name, sizeof name, "batch 32 mixed 8K-256K (%.2fM)", total / 1e6);
      s = run_case(rt, copy_gbs, &pl, out, name, mixed, 32, dt, e);
    }
  }
  m3_dev_free(pl.d);
  m3_dev_free(pl.iq);
  return s;
}
