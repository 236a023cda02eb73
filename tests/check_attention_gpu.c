/* check_attention_gpu.c - the paged attention kernels (templates/attn_sparse.lua,
 * templates/attn_dense.lua) against m3_ref_sparse_attention and
 * m3_ref_dense_attention: both KV dtypes, both schedules (decode split-K and
 * prefill) on the same inputs, decode batches mixing short and long
 * sequences (1 ... 5000 tokens), prefill chunks after a context, every valid
 * tile, the decode K/V ring's depths bitwise equal, a GQA group smaller than 16, and
 * the known faults tagged SPA:
 *   #6  sentinel -1 and ids >= the visible block count in the selection, with
 *       0x7FFFFFFF in the 4 KiB before request 0's block-table row;
 *   #8  every block selected (seq <= topk * block) == dense attention;
 *   #15 pages past 2 GiB of cache give bitwise the same output as low pages.
 * Tolerance: ||out - ref|| / ||ref|| <= 1e-2 over the whole output (the GPU
 * rounds P to bf16 before P·V as vLLM does, the reference keeps fp64; that is
 * ~2e-3 relative), and no NaN/Inf anywhere: outputs are poisoned with NaN
 * first, so an element the kernel never writes fails.  Pages and block-table
 * entries the batch does not map hold NaN / 0x7FFFFFFF. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/op_attention.h"
#include "tests/gpu_main.h"

GPU_TEST_GLOBALS

#define HD 128
#define TOL 1e-2

typedef struct cfg {
  int nq, nkv, bs, topk;
} cfg;
static const cfg M3 = {64, 4, 128, 16};
static const cfg TINY = {8, 4, 16, 4}; /* GQA group of 2, small pages */

/* A paged batch on the host and the device.  The reference reads pages
 * rebased to 0 (bt_ref); the device table holds page_base + that, so the
 * same data can sit past 2 GiB (fault 15) without a 2 GiB host copy. */
typedef struct prob {
  cfg c;
  int kv8, n_seqs, n_tokens;
  int32_t *seq_lens, *token_seq;
  int64_t *positions;
  int64_t bt_stride, pages, page_base, max_kv_len;
  int32_t *bt_ref, *bt_dev;
  m3_bf16 *q;
  uint8_t *kv;          /* [pages, nkv, bs, 2*HD] */
  int32_t *sel;         /* [nkv, n_tokens, topk] */
  /* device */
  void *d_q, *d_kv, *d_seq_lens, *d_token_seq, *d_pos, *d_bt_alloc, *d_sel, *d_out;
} prob;

static size_t page_elems(const cfg *c) { return (size_t)c->nkv * c->bs * 2 * HD; }
static size_t kv_bytes(const prob *p) { return p->kv8 ? 1 : 2; }

/* seq_lens: decode = one query per sequence at its last position;
 * prefill (n_seqs == 1, chunk > 0) = positions ctx .. ctx+chunk-1. */
static void prob_make(prob *p, cfg c, int kv8, const int *lens, int n, int ctx, int chunk, int64_t page_base,
                      float qsig, uint64_t salt) {
  memset(p, 0, sizeof *p);
  m3_rng r = {g_seed ^ salt * 0x9e3779b97f4a7c15ULL};
  p->c = c;
  p->kv8 = kv8;
  p->page_base = page_base;
  if (chunk > 0) {
    p->n_seqs = 1;
    p->n_tokens = chunk;
    p->seq_lens = malloc(sizeof(int32_t));
    p->seq_lens[0] = ctx + chunk;
  } else {
    p->n_seqs = n;
    p->n_tokens = n;
    p->seq_lens = malloc(sizeof(int32_t) * n);
    memcpy(p->seq_lens, lens, sizeof(int32_t) * n);
  }
  p->token_seq = malloc(sizeof(int32_t) * p->n_tokens);
  p->positions = malloc(sizeof(int64_t) * p->n_tokens);
  for (int t = 0; t < p->n_tokens; t++) {
    p->token_seq[t] = chunk > 0 ? 0 : t;
    p->positions[t] = chunk > 0 ? ctx + t : lens[t] - 1;
    if (p->positions[t] + 1 > p->max_kv_len) p->max_kv_len = p->positions[t] + 1;
  }
  int64_t maxnb = 0, total = 0;
  for (int s = 0; s < p->n_seqs; s++) {
    int64_t nb = (p->seq_lens[s] + c.bs - 1) / c.bs;
    if (nb > maxnb) maxnb = nb;
    total += nb;
  }
  p->bt_stride = maxnb + 3; /* slack entries hold 0x7FFFFFFF */
  p->pages = total + 2;     /* two pages nobody maps (NaN) */
  p->bt_ref = malloc(sizeof(int32_t) * p->n_seqs * p->bt_stride);
  p->bt_dev = malloc(sizeof(int32_t) * p->n_seqs * p->bt_stride);
  int64_t *perm = malloc(sizeof(int64_t) * p->pages);
  for (int64_t i = 0; i < p->pages; i++) perm[i] = i;
  for (int64_t i = p->pages - 1; i > 0; i--) {
    int64_t j = (int64_t)(m3_rng_next(&r) % (uint64_t)(i + 1)), t = perm[i];
    perm[i] = perm[j], perm[j] = t;
  }
  int64_t used = 0;
  for (int s = 0; s < p->n_seqs; s++) {
    int64_t nb = (p->seq_lens[s] + c.bs - 1) / c.bs;
    for (int64_t b = 0; b < p->bt_stride; b++) {
      int32_t pg = b < nb ? (int32_t)perm[used++] : 0x7FFFFFFF;
      p->bt_ref[s * p->bt_stride + b] = pg;
      p->bt_dev[s * p->bt_stride + b] = b < nb ? (int32_t)(pg + page_base) : 0x7FFFFFFF;
    }
  }
  free(perm);
  p->q = malloc(sizeof(m3_bf16) * p->n_tokens * c.nq * HD);
  m3_fill_bf16(&r, p->q, (size_t)p->n_tokens * c.nq * HD, qsig);
  /* Keys past T in a page and unmapped pages stay NaN: masking must be exact. */
  p->kv = malloc(p->pages * page_elems(&c) * kv_bytes(p));
  memset(p->kv, 0xff, p->pages * page_elems(&c) * kv_bytes(p));
  float row[2 * HD];
  for (int s = 0; s < p->n_seqs; s++)
    for (int64_t j = 0; j < p->seq_lens[s]; j++) {
      int64_t pg = p->bt_ref[s * p->bt_stride + j / c.bs];
      for (int g = 0; g < c.nkv; g++) {
        size_t at = ((pg * c.nkv + g) * c.bs + j % c.bs) * 2 * HD;
        m3_fill_f32(&r, row, 2 * HD, 1.0f);
        if (kv8) {
          m3_ref_e4m3_encode(2 * HD, row, p->kv + at);
        } else {
          m3_bf16 *d = (m3_bf16 *)p->kv + at;
          for (int i = 0; i < 2 * HD; i++) d[i] = m3_f32_to_bf16(row[i]);
        }
      }
    }
  p->sel = malloc(sizeof(int32_t) * c.nkv * p->n_tokens * c.topk);
}

/* Indexer-like selection: the local block first, then distinct others in a
 * random order, -1 padding when nb < topk; all = every visible block (nb <=
 * topk), shuffled. */
static void prob_select(prob *p, int all, uint64_t salt) {
  m3_rng r = {g_seed ^ salt ^ 0x5e1ec7ULL};
  const cfg *c = &p->c;
  int *cand = malloc(sizeof(int) * (p->bt_stride + 1));
  for (int g = 0; g < c->nkv; g++)
    for (int t = 0; t < p->n_tokens; t++) {
      int32_t *row = p->sel + ((int64_t)g * p->n_tokens + t) * c->topk;
      int nb = (int)(p->positions[t] / c->bs) + 1, n = 0;
      for (int b = 0; b < nb; b++) cand[b] = b;
      for (int b = nb - 1; b > 0; b--) {
        int j = (int)(m3_rng_next(&r) % (uint64_t)(b + 1)), x = cand[b];
        cand[b] = cand[j], cand[j] = x;
      }
      if (!all) row[n++] = nb - 1;
      for (int b = 0; b < nb && n < c->topk; b++)
        if (all || cand[b] != nb - 1) row[n++] = cand[b];
      for (; n < c->topk; n++) row[n] = -1;
    }
  free(cand);
}

static void prob_upload(prob *p) {
  const cfg *c = &p->c;
  const size_t nq = (size_t)p->n_tokens * c->nq * HD, bt = sizeof(int32_t) * p->n_seqs * p->bt_stride;
  const size_t pe = page_elems(c) * kv_bytes(p);
  GPU_CHECK(m3_dev_alloc(&p->d_q, nq * 2, &e_));
  GPU_CHECK(m3_dev_alloc(&p->d_out, nq * 2, &e_));
  GPU_CHECK(m3_dev_alloc(&p->d_kv, (size_t)(p->page_base + p->pages) * pe, &e_));
  GPU_CHECK(m3_dev_alloc(&p->d_seq_lens, sizeof(int32_t) * p->n_seqs, &e_));
  GPU_CHECK(m3_dev_alloc(&p->d_token_seq, sizeof(int32_t) * p->n_tokens, &e_));
  GPU_CHECK(m3_dev_alloc(&p->d_pos, sizeof(int64_t) * p->n_tokens, &e_));
  /* Request 0's row starts at byte 4096 of its allocation; the 4 KiB before
   * it hold 0x7FFFFFFF (fault 6: a -1 index must never read them). */
  GPU_CHECK(m3_dev_alloc(&p->d_bt_alloc, 4096 + bt, &e_));
  GPU_CHECK(m3_dev_alloc(&p->d_sel, sizeof(int32_t) * c->nkv * p->n_tokens * c->topk, &e_));
  int32_t guard[1024];
  for (int i = 0; i < 1024; i++) guard[i] = 0x7FFFFFFF;
  GPU_CHECK(m3_dev_upload(p->d_bt_alloc, guard, sizeof guard, &e_));
  GPU_CHECK(m3_dev_upload((char *)p->d_bt_alloc + 4096, p->bt_dev, bt, &e_));
  GPU_CHECK(m3_dev_upload(p->d_q, p->q, nq * 2, &e_));
  if (p->page_base > 0) GPU_CHECK(m3_dev_poison(p->d_kv, (size_t)p->page_base * pe, &e_));
  GPU_CHECK(m3_dev_upload((char *)p->d_kv + (size_t)p->page_base * pe, p->kv, (size_t)p->pages * pe, &e_));
  GPU_CHECK(m3_dev_upload(p->d_seq_lens, p->seq_lens, sizeof(int32_t) * p->n_seqs, &e_));
  GPU_CHECK(m3_dev_upload(p->d_token_seq, p->token_seq, sizeof(int32_t) * p->n_tokens, &e_));
  GPU_CHECK(m3_dev_upload(p->d_pos, p->positions, sizeof(int64_t) * p->n_tokens, &e_));
  GPU_CHECK(m3_dev_upload(p->d_sel, p->sel, sizeof(int32_t) * c->nkv * p->n_tokens * c->topk, &e_));
}

static void prob_free(prob *p) {
  m3_dev_free(p->d_q); m3_dev_free(p->d_out); m3_dev_free(p->d_kv); m3_dev_free(p->d_seq_lens);
  m3_dev_free(p->d_token_seq); m3_dev_free(p->d_pos); m3_dev_free(p->d_bt_alloc); m3_dev_free(p->d_sel);
  free(p->seq_lens); free(p->token_seq); free(p->positions); free(p->bt_ref); free(p->bt_dev);
  free(p->q); free(p->kv); free(p->sel);
}

static m3_attn_args prob_args(const prob *p) {
  m3_attn_args a = {.n_tokens = p->n_tokens, .nq = p->c.nq, .nkv = p->c.nkv, .head_dim = HD,
                    .block_size = p->c.bs, .kv_e4m3 = p->kv8, .topk = p->c.topk, .scale = 0.0f};
  return a;
}

/* out [n_tokens, nq, HD] from the reference (sparse or dense). */
static m3_bf16 *prob_ref(const prob *p, int sparse) {
  m3_attn_args a = prob_args(p);
  m3_seq_batch b = {p->n_seqs, p->seq_lens, p->bt_ref, p->bt_stride, p->pages, p->token_seq, p->positions};
  m3_bf16 *out = malloc(sizeof(m3_bf16) * p->n_tokens * p->c.nq * HD);
  m3_err e;
  m3_status s = sparse ? m3_ref_sparse_attention(&a, &b, p->q, p->kv, p->sel, out, &e)
                       : m3_ref_dense_attention(&a, &b, p->q, p->kv, out, &e);
  ck_assert_msg(s == M3_OK, "reference: %s", e.msg);
  return out;
}

/* One workspace for the whole run, grown on demand: it also proves the
 * counters return to zero between launches of different shapes.  Its
 * partials (not its counters) are poisoned before every decode launch, so
 * that a merge reading another split's partial before that split published
 * it reads NaN, not the identical values an earlier launch of the same plan
 * left there. */
static void *g_ws;
static size_t g_ws_bytes;
/* The SM count the launches plan for (0: the device's): a larger one gives
 * the emulator's 4 SMs the GPU's split plans. */
static int g_sm;
/* Splits per (token, KV head) of the last decode launch (prob_gpu), and its
 * thread-block cluster width (1: none). */
static int g_splits;
static unsigned g_cluster;

/* Runs the GPU kernel; returns the downloaded output (malloc'd). */
static m3_bf16 *prob_gpu(prob *p, int sparse, m3_attn_mode mode, const char *tile, char *ctx, size_t nctx) {
  m3_attn_args a = prob_args(p);
  m3_seq_batch b = {p->n_seqs, p->d_seq_lens, (const int32_t *)((char *)p->d_bt_alloc + 4096), p->bt_stride,
                    p->page_base + p->pages, p->d_token_seq, p->d_pos};
  m3_variant v;
  m3_err e;
  ck_assert_int_eq(sparse ? m3_attn_sparse_key(&a, mode, &v, &e) : m3_attn_dense_key(&a, mode, &v, &e), M3_OK);
  if (tile) ck_assert_int_eq(m3_variant_parse_tile(&v, tile, &e), M3_OK);
  m3_kernel *k;
  GPU_CHECK(m3_rt_kernel(&g_rt, &v, NULL, &k, &e_));
  m3_variant_print(&k->key, ctx, nctx);
  const int sm = g_sm > 0 ? g_sm : g_rt.dev.sm_count;
  size_t need = m3_attn_workspace_bytes(k, &a, p->max_kv_len, sm);
  if (need > g_ws_bytes) {
    m3_dev_free(g_ws);
    GPU_CHECK(m3_dev_alloc(&g_ws, need, &e_));
    GPU_CHECK(m3_attn_workspace_init(g_ws, need, g_rt.stream, &e_));
    g_ws_bytes = need;
  }
  const size_t nout = (size_t)p->n_tokens * p->c.nq * HD;
  GPU_CHECK(m3_dev_poison(p->d_out, nout * 2, &e_));
  g_splits = 0;
  g_cluster = 0;
  if (mode == M3_ATTN_DECODE) {
    m3_attn_call c;
    GPU_CHECK(m3_attn_prepare(k, &a, &b, p->max_kv_len, sm, p->d_q, p->d_kv, sparse ? p->d_sel : NULL, p->d_out,
                              g_ws, g_ws_bytes, &c, &e_));
    g_splits = c.splits;
    g_cluster = c.cluster;
    if (c.splits > 1 && c.part_o) { /* merge=cluster has no partials in memory */
      const size_t part = (size_t)p->n_tokens * p->c.nkv * (size_t)c.splits * (size_t)(p->c.nq / p->c.nkv);
      GPU_CHECK(m3_dev_poison(c.part_o, part * HD * sizeof(float), &e_));
      GPU_CHECK(m3_dev_poison(c.part_ml, part * 2 * sizeof(float), &e_));
    }
  }
  if (sparse)
    GPU_CHECK(m3_launch_attn_sparse(k, &a, &b, p->max_kv_len, sm, p->d_q, p->d_kv, p->d_sel, p->d_out, g_ws,
                                    g_ws_bytes, g_rt.stream, &e_));
  else
    GPU_CHECK(m3_launch_attn_dense(k, &a, &b, p->max_kv_len, sm, p->d_q, p->d_kv, p->d_out, g_ws, g_ws_bytes,
                                   g_rt.stream, &e_));
  ck_assert_msg(cudaStreamSynchronize(g_rt.stream) == cudaSuccess, "%s: kernel failed: %s", ctx,
                cudaGetErrorString(cudaGetLastError()));
  m3_bf16 *out = malloc(nout * 2);
  GPU_CHECK(m3_dev_download(out, p->d_out, nout * 2, &e_));
  /* Decode leaves every arrival counter at zero for the next launch. */
  if (mode == M3_ATTN_DECODE && g_ws_bytes) {
    size_t nc = (size_t)M3_ATTN_MAX_DECODE_TOKENS * p->c.nkv;
    int32_t *cnt = malloc(nc * sizeof *cnt);
    GPU_CHECK(m3_dev_download(cnt, g_ws, nc * sizeof *cnt, &e_));
    for (size_t i = 0; i < nc; i++) ck_assert_msg(cnt[i] == 0, "%s: counter %zu left at %d", ctx, i, cnt[i]);
    free(cnt);
  }
  return out;
}

static void expect_close(const m3_bf16 *out, const m3_bf16 *ref, size_t n, const char *what, const char *ctx) {
  m3_cmp c = m3_cmp_bf16_rel(out, ref, n, TOL);
  char s[256];
  m3_cmp_str(&c, s, sizeof s);
  ck_assert_msg(c.bad == 0, "%s: %s (seed %llu): %s", ctx, what, (unsigned long long)g_seed, s);
}

/* Checks both schedules of one kernel family against one reference. */
static void check_modes(prob *p, int sparse, const m3_bf16 *ref, const char *what) {
  for (int m = 0; m < 2; m++) {
    char ctx[M3_KEY_MAX];
    m3_bf16 *out = prob_gpu(p, sparse, m ? M3_ATTN_PREFILL : M3_ATTN_DECODE, NULL, ctx, sizeof ctx);
    expect_close(out, ref, (size_t)p->n_tokens * p->c.nq * HD, what, ctx);
    free(out);
  }
}

static const int MIXED[] = {1, 127, 128, 129, 300, 2047, 2048, 2049, 5000};
#define NMIXED ((int)(sizeof MIXED / sizeof *MIXED))

/* _i: bit 0 sparse, bit 1 e4m3, bit 2 sharper logits (q sigma 3). */
START_TEST(decode_mixed_lengths) {
  if (m3_test_emulated()) return; /* M3-sized: GPU only (the emulator covers the tiny shapes and the faults) */
  const int sparse = _i & 1, kv8 = (_i >> 1) & 1;
  const float qsig = (_i & 4) ? 3.0f : 1.0f;
  prob p;
  prob_make(&p, M3, kv8, MIXED, NMIXED, 0, 0, 0, qsig, 100 + _i);
  prob_select(&p, 0, 100 + _i);
  prob_upload(&p);
  m3_bf16 *ref = prob_ref(&p, sparse);
  check_modes(&p, sparse, ref, "decode batch of lengths 1..5000");
  free(ref);
  prob_free(&p);
}
END_TEST

/* known-faults #6: batch 2, seq_len [300, 5000]; request 0's selection
 * [2, 0, 1, -1 x 13], then one containing 3 (>= ceil(300/128)), then one with
 * more junk (7, INT32_MAX, -5, a repeat).  Request 0 must equal dense causal
 * attention over its 300 tokens; request 1 (16 valid blocks) its sparse ref. */
START_TEST(fault6_sentinels_and_beyond_causal) {
  const int kv8 = _i;
  const int lens[2] = {300, 5000};
  static const int32_t cases[3][16] = {
      {2, 0, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
      {3, 2, 0, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
      {2, 7, 0, 0x7FFFFFFF, -5, 1, 0, 3, -1, 2, -1, -1, -1, -1, -1, -1}};
  for (int cs = 0; cs < 3; cs++) {
    prob p;
    prob_make(&p, M3, kv8, lens, 2, 0, 0, 0, 1.0f, 200 + cs);
    prob_select(&p, 0, 200 + cs);
    for (int g = 0; g < M3.nkv; g++) memcpy(p.sel + (int64_t)g * p.n_tokens * M3.topk, cases[cs], sizeof cases[cs]);
    prob_upload(&p);
    m3_bf16 *ref = prob_ref(&p, 1), *dense = prob_ref(&p, 0);
    const size_t row = (size_t)M3.nq * HD;
    expect_close(ref, dense, row, "reference: request 0 sparse == dense", "fault 6");
    for (int m = 0; m < 2; m++) {
      char ctx[M3_KEY_MAX];
      m3_bf16 *out = prob_gpu(&p, 1, m ? M3_ATTN_PREFILL : M3_ATTN_DECODE, NULL, ctx, sizeof ctx);
      expect_close(out, dense, row, "request 0 vs dense causal over its 300 tokens", ctx);
      expect_close(out + row, ref + row, row, "request 1 (16 valid blocks)", ctx);
      free(out);
    }
    free(ref);
    free(dense);
    prob_free(&p);
  }
}
END_TEST

/* known-faults #8: seq_len <= topk * block: every visible block selected (in
 * a shuffled order, -1 padded) gives dense causal attention. */
START_TEST(fault8_all_blocks_equal_dense) {
  const int kv8 = _i;
  const int lens[] = {1, 127, 128, 129, 2047, 2048};
  prob p;
  prob_make(&p, M3, kv8, lens, 6, 0, 0, 0, 1.0f, 300 + _i);
  prob_select(&p, 1, 300 + _i);
  prob_upload(&p);
  m3_bf16 *dense = prob_ref(&p, 0);
  check_modes(&p, 1, dense, "sparse with every block selected vs dense reference");
  char ctx[M3_KEY_MAX];
  m3_bf16 *sp = prob_gpu(&p, 1, M3_ATTN_DECODE, NULL, ctx, sizeof ctx);
  m3_bf16 *dn = prob_gpu(&p, 0, M3_ATTN_DECODE, NULL, ctx, sizeof ctx);
  expect_close(sp, dn, (size_t)p.n_tokens * M3.nq * HD, "GPU sparse vs GPU dense", ctx);
  free(sp);
  free(dn);
  free(dense);
  prob_free(&p);
}
END_TEST

/* known-faults #15: the same batch with its pages moved past 2 GiB of cache
 * (page_base 17000: 4.4 GB bf16, 2.2 GB e4m3) gives bitwise the same output. */
START_TEST(fault15_pages_past_2GiB) {
  if (m3_test_emulated()) return; /* 4.4 GB of host memory: GPU only */
  const int sparse = _i & 1, kv8 = (_i >> 1) & 1;
  const int lens[] = {129, 2049, 3000};
  prob lo, hi;
  prob_make(&lo, M3, kv8, lens, 3, 0, 0, 0, 1.0f, 400 + _i);
  prob_make(&hi, M3, kv8, lens, 3, 0, 0, 17000, 1.0f, 400 + _i);
  ck_assert((hi.page_base * page_elems(&M3) * kv_bytes(&hi)) > ((size_t)1 << 31));
  prob_select(&lo, 0, 400 + _i);
  prob_select(&hi, 0, 400 + _i);
  prob_upload(&lo);
  prob_upload(&hi);
  m3_bf16 *ref = prob_ref(&lo, sparse);
  for (int m = 0; m < 2; m++) {
    char ctx[M3_KEY_MAX];
    m3_attn_mode mode = m ? M3_ATTN_PREFILL : M3_ATTN_DECODE;
    m3_bf16 *a = prob_gpu(&lo, sparse, mode, NULL, ctx, sizeof ctx), *b = prob_gpu(&hi, sparse, mode, NULL, ctx, sizeof ctx);
    const size_t n = (size_t)lo.n_tokens * M3.nq * HD;
    expect_close(b, ref, n, "pages past 2 GiB vs reference", ctx);
    ck_assert_msg(!memcmp(a, b, n * 2), "%s: output differs between low pages and pages past 2 GiB", ctx);
    free(a);
    free(b);
  }
  free(ref);
  prob_free(&lo);
  prob_free(&hi);
}
END_TEST

/* Prefill chunks after a context: dense ctx 1000 + 257 tokens; sparse ctx
 * 3000 + 130 tokens (24-25 visible blocks per token, so the selection is a
 * real subset). */
START_TEST(prefill_chunk_with_context) {
  if (m3_test_emulated()) return; /* M3-sized: GPU only (the emulator covers the tiny shapes and the faults) */
  const int sparse = _i & 1, kv8 = (_i >> 1) & 1;
  prob p;
  prob_make(&p, M3, kv8, NULL, 0, sparse ? 3000 : 1000, sparse ? 130 : 257, 0, 1.0f, 500 + _i);
  prob_select(&p, 0, 500 + _i);
  prob_upload(&p);
  m3_bf16 *ref = prob_ref(&p, sparse);
  check_modes(&p, sparse, ref, "prefill chunk after a context");
  free(ref);
  prob_free(&p);
}
END_TEST

/* GQA group of 2 with 16-token pages and topk 4 (the tiny preset's shape):
 * rows 2..15 of the mma are padding. */
START_TEST(small_gqa_group) {
  const int sparse = _i & 1, kv8 = (_i >> 1) & 1;
  const int lens[] = {1, 15, 16, 17, 63, 64, 65, 300};
  prob p;
  prob_make(&p, TINY, kv8, lens, 8, 0, 0, 0, 1.0f, 600 + _i);
  prob_select(&p, 0, 600 + _i);
  prob_upload(&p);
  m3_bf16 *ref = prob_ref(&p, sparse);
  check_modes(&p, sparse, ref, "nq 8 / nkv 4, block 16, topk 4");
  free(ref);
  prob_free(&p);
}
END_TEST

/* The decode schedule's K/V ring (tile depth, lib/attn_mma.lua attend): the
 * same tiles in the same order with the same arithmetic for every depth, so
 * depth 2 is bitwise depth 1, for warps that get 0, 1, 2 or many 16-key tiles
 * (the ring's first empty slot ends it), and both match the reference; a
 * tile of depth 2 with a bf16 cache is invalid (its ring would spill).  The
 * e4m3 conversion (tile cvt) is exact both ways: cvt=hw is bitwise cvt=alu,
 * at either depth; the dense decode's lead-in (lead=1) changes no result; and
 * the split hand-over (merge=acqrel: one acq_rel ticket) sums the same
 * partials in the same order as merge=fence, so it is bitwise too (on the
 * emulator's 4 SMs these 9 tokens plan one split: decode_split_merges_agree
 * carries the merge there). */
START_TEST(decode_ring_depths_and_cvt_agree) {
  const int sparse = _i & 1, kv8 = 1; /* depth 2 is for the e4m3 cache (valid()) */
  const int lens[] = {1, 15, 16, 17, 33, 64, 65, 300, 1000};
  prob p;
  prob_make(&p, TINY, kv8, lens, 9, 0, 0, 0, 1.0f, 650 + _i);
  prob_select(&p, 0, 650 + _i);
  prob_upload(&p);
  m3_bf16 *ref = prob_ref(&p, sparse);
  const size_t n = (size_t)p.n_tokens * TINY.nq * HD;
  const int warps[] = {1, 2, 8};
  const char *lead0 = sparse ? "" : ",lead=0"; /* attn_sparse has no lead-in */
  for (int w = 0; w < 3; w++) {
    char t1[96], c1[M3_KEY_MAX];
    snprintf(t1, sizeof t1, "warps=%d,ctas=1,depth=1,cvt=alu%s,merge=fence", warps[w], lead0);
    m3_bf16 *a = prob_gpu(&p, sparse, M3_ATTN_DECODE, t1, c1, sizeof c1);
    expect_close(a, ref, n, "depth 1", c1);
    static const char *const other[] = {"depth=2,cvt=alu", "depth=1,cvt=hw", "depth=2,cvt=hw"};
    static const char *const acqrel[] = {"depth=1,cvt=alu", "depth=2,cvt=hw", "depth=1,cvt=hw"};
    for (int o = 0; o < 3 + 3 + !sparse; o++) { /* dense: the lead-in too (its reads before the wait change nothing) */
      char t2[96], c2[M3_KEY_MAX];
      if (o < 3) snprintf(t2, sizeof t2, "warps=%d,ctas=1,%s%s,merge=fence", warps[w], other[o], lead0);
      else if (o < 6) snprintf(t2, sizeof t2, "warps=%d,ctas=1,%s%s,merge=acqrel", warps[w], acqrel[o - 3], lead0);
      else snprintf(t2, sizeof t2, "warps=%d,ctas=1,depth=2,cvt=hw,lead=1,merge=acqrel", warps[w]);
      m3_bf16 *b = prob_gpu(&p, sparse, M3_ATTN_DECODE, t2, c2, sizeof c2);
      ck_assert_msg(!memcmp(a, b, n * 2), "%s: differs from %s", c2, c1);
      free(b);
    }
    free(a);
  }
  { /* the prefill schedule's conversion too */
    char c1[M3_KEY_MAX], c2[M3_KEY_MAX];
    char t1[64], t2[64];
    snprintf(t1, sizeof t1, "warps=4,ctas=1,depth=1,cvt=alu%s,merge=fence", lead0);
    snprintf(t2, sizeof t2, "warps=4,ctas=1,depth=1,cvt=hw%s,merge=fence", lead0);
    m3_bf16 *a = prob_gpu(&p, sparse, M3_ATTN_PREFILL, t1, c1, sizeof c1);
    m3_bf16 *b = prob_gpu(&p, sparse, M3_ATTN_PREFILL, t2, c2, sizeof c2);
    expect_close(a, ref, n, "prefill", c1);
    ck_assert_msg(!memcmp(a, b, n * 2), "%s: differs from %s", c2, c1);
    free(a);
    free(b);
  }
  m3_attn_args a = prob_args(&p);
  m3_variant v;
  m3_err e;
  a.kv_e4m3 = 0;
  ck_assert_int_eq(sparse ? m3_attn_sparse_key(&a, M3_ATTN_DECODE, &v, &e) : m3_attn_dense_key(&a, M3_ATTN_DECODE, &v, &e),
                   M3_OK);
  snprintf(v.arch, sizeof v.arch, "%s", g_rt.dev.arch);
  ck_assert_int_eq(m3_variant_parse_tile(&v, sparse ? "warps=8,ctas=1,depth=2,cvt=alu,merge=fence" : "warps=8,ctas=1,depth=2,cvt=alu,lead=0,merge=fence",
                                         &e), M3_OK);
  ck_assert_int_eq(m3_render_valid(g_rt.jit.lua, &v, NULL, 0, &e), M3_TILE);
  free(ref);
  prob_free(&p);
}
END_TEST

/* The split hand-over (tile merge) over many splits, on the emulator too:
 * planned for 132 SMs at ctas=4, dense decode cuts the 1000-token sequence
 * into 63 splits with 1 warp (three of the merging CTA's batches of loads,
 * MERGE_U = 16, and more than the 32 lanes of its (m, l) pass) and 32 with
 * 2 (one batch, MERGE_U = 32); sparse into 4 and 2.  The
 * partials are poisoned before each launch (prob_gpu), so a merge that reads
 * a split before it published reads NaN.  Both hand-overs give the same
 * bits, and the reference's answer.  merge=cluster (sm_90) caps the splits at
 * 16, one thread-block cluster per (token, KV head), and merges through
 * distributed shared memory: the reference's answer, not the same bits (its
 * sum over the splits runs in another order).  The emulator runs a cluster's
 * CTAs together with poisoned shared memory, so a read of a split that has
 * not reached the cluster barrier reads the poison there. */
START_TEST(decode_split_merges_agree) {
  const int sparse = _i & 1, kv8 = (_i >> 1) & 1;
  const int lens[] = {1000, 70};
  prob p;
  prob_make(&p, TINY, kv8, lens, 2, 0, 0, 0, 1.0f, 680 + _i);
  prob_select(&p, 0, 680 + _i);
  prob_upload(&p);
  m3_bf16 *ref = prob_ref(&p, sparse);
  const size_t n = (size_t)p.n_tokens * TINY.nq * HD;
  const char *lead = sparse ? "" : ",lead=0";
  g_sm = 132;
  for (int w = 1; w <= 2; w++) {
    char t1[96], t2[96], c1[M3_KEY_MAX], c2[M3_KEY_MAX];
    snprintf(t1, sizeof t1, "warps=%d,ctas=4,depth=1,cvt=alu%s,merge=fence", w, lead);
    snprintf(t2, sizeof t2, "warps=%d,ctas=4,depth=1,cvt=alu%s,merge=acqrel", w, lead);
    m3_bf16 *a = prob_gpu(&p, sparse, M3_ATTN_DECODE, t1, c1, sizeof c1);
    m3_bf16 *b = prob_gpu(&p, sparse, M3_ATTN_DECODE, t2, c2, sizeof c2);
    ck_assert_msg(g_splits >= (sparse ? 2 : 32), "%s: %d splits planned, too few to test the merge", c2, g_splits);
    expect_close(a, ref, n, "merge=fence", c1);
    expect_close(b, ref, n, "merge=acqrel", c2);
    ck_assert_msg(!memcmp(a, b, n * 2), "%s: differs from %s", c2, c1);
    free(a);
    free(b);
    if (g_rt.dev.cc_major >= 9) {
      snprintf(t1, sizeof t1, "warps=%d,ctas=4,depth=1,cvt=alu%s,merge=cluster", w, lead);
      a = prob_gpu(&p, sparse, M3_ATTN_DECODE, t1, c1, sizeof c1);
      ck_assert_msg(g_splits == (sparse ? (w == 1 ? 4 : 2) : 16) && g_cluster == (unsigned)g_splits,
                    "%s: %d splits in clusters of %u planned, expected %d in one cluster", c1, g_splits, g_cluster,
                    sparse ? (w == 1 ? 4 : 2) : 16);
      expect_close(a, ref, n, "merge=cluster", c1);
      free(a);
    }
  }
  g_sm = 0;
  free(ref);
  prob_free(&p);
}
END_TEST

/* Every valid tile of every variant the model needs gives the reference's
 * answer (the results-vs-speed contract). */
START_TEST(every_valid_tile_same_answer) {
  if (m3_test_emulated()) return; /* M3-sized: GPU only (the emulator covers the tiny shapes and the faults) */
  const int sparse = _i & 1, kv8 = (_i >> 1) & 1;
  const m3_attn_mode mode = (_i >> 2) & 1 ? M3_ATTN_PREFILL : M3_ATTN_DECODE;
  const int lens[] = {1, 129, 700, 2049};
  prob p;
  prob_make(&p, M3, kv8, lens, 4, 0, 0, 0, 1.0f, 700 + _i);
  prob_select(&p, 0, 700 + _i);
  prob_upload(&p);
  m3_bf16 *ref = prob_ref(&p, sparse);
  m3_attn_args a = prob_args(&p);
  m3_variant v;
  m3_err e;
  ck_assert_int_eq(sparse ? m3_attn_sparse_key(&a, mode, &v, &e) : m3_attn_dense_key(&a, mode, &v, &e), M3_OK);
  char (*valid)[256];
  const int ran = gpu_valid_tiles(&v, &valid);
  gpu_prewarm_tiles(&v, valid, ran);
  for (int i = 0; i < ran; i++) {
    char ctx[M3_KEY_MAX];
    m3_bf16 *out = prob_gpu(&p, sparse, mode, valid[i], ctx, sizeof ctx);
    expect_close(out, ref, (size_t)p.n_tokens * M3.nq * HD, "tile", ctx);
    free(out);
  }
  ck_assert_int_gt(ran, 1);
  free(valid);
  free(ref);
  prob_free(&p);
}
END_TEST

/* Launch-time argument checks: a key/argument mismatch and a missing
 * workspace are errors, never a silent wrong launch. */
/* One bf16 sequence of 5000 tokens, uploaded, for the launch-side cases:
 * its arguments and its device batch. */
static void prob_5000(prob *p, uint64_t seed, m3_attn_args *a, m3_seq_batch *b) {
  const int lens[] = {5000};
  prob_make(p, M3, 0, lens, 1, 0, 0, 0, 1.0f, seed);
  prob_select(p, 0, seed);
  prob_upload(p);
  *a = prob_args(p);
  *b = (m3_seq_batch){p->n_seqs, p->d_seq_lens, (const int32_t *)((char *)p->d_bt_alloc + 4096), p->bt_stride,
                      p->pages, p->d_token_seq, p->d_pos};
}

/* merge=cluster's plan: a (token, KV head)'s splits are one cluster, as wide
 * as the part can place (k->mod.max_cluster, from the driver's cluster
 * occupancy; the emulator and an H100 SXM place 16), with no workspace.  A
 * part that places fewer (a GPC with fewer free SMs, a MIG slice) gets fewer,
 * wider splits instead of a launch that fails, and one whose driver cannot
 * tell gets the portable 8. */
START_TEST(cluster_plan_fits_the_part) {
  if (g_rt.dev.cc_major < 9) return; /* thread-block clusters are sm_90+ */
  prob p;
  m3_attn_args a;
  m3_seq_batch b;
  prob_5000(&p, 810, &a, &b);
  m3_variant v;
  m3_err e;
  m3_kernel *k;
  ck_assert_int_eq(m3_attn_dense_key(&a, M3_ATTN_DECODE, &v, &e), M3_OK);
  ck_assert_int_eq(m3_variant_parse_tile(&v, "warps=8,ctas=1,depth=1,cvt=alu,lead=0,merge=cluster", &e), M3_OK);
  GPU_CHECK(m3_rt_kernel(&g_rt, &v, NULL, &k, &e_));
  const int mc = k->mod.max_cluster;
  ck_assert_msg(mc == 0 || mc == 1 || mc == 2 || mc == 4 || mc == 8 || mc == 16, "max_cluster %d", mc);
  if (m3_test_emulated()) ck_assert_int_eq(mc, 16);
  ck_assert_uint_eq(m3_attn_workspace_bytes(k, &a, p.max_kv_len, 132), 0);
  m3_attn_call c;
  GPU_CHECK(m3_attn_prepare(k, &a, &b, p.max_kv_len, 132, p.d_q, p.d_kv, NULL, p.d_out, NULL, 0, &c, &e_));
  ck_assert_int_eq(c.splits, mc == 0 ? 8 : mc); /* 0: the driver could not tell, the portable 8 */
  ck_assert_uint_eq(c.cluster, c.splits > 1 ? (unsigned)c.splits : 1u);
  m3_kernel narrow = *k; /* as on a part that places 4 */
  narrow.mod.max_cluster = 4;
  GPU_CHECK(m3_attn_prepare(&narrow, &a, &b, p.max_kv_len, 132, p.d_q, p.d_kv, NULL, p.d_out, NULL, 0, &c, &e_));
  ck_assert_int_eq(c.splits, 4);
  ck_assert_uint_eq(c.cluster, 4);
  ck_assert_int_ge((int64_t)c.chunk * c.splits, 5000);
  narrow.mod.max_cluster = 0; /* the driver could not tell */
  GPU_CHECK(m3_attn_prepare(&narrow, &a, &b, p.max_kv_len, 132, p.d_q, p.d_kv, NULL, p.d_out, NULL, 0, &c, &e_));
  ck_assert_int_eq(c.splits, 8);
  ck_assert_uint_eq(c.cluster, 8);
  /* Cluster widths the launch refuses before the driver sees them. */
  ck_assert_int_eq(m3_launch_cluster(&k->mod, 10, 1, 1, 4, (CUstream)g_rt.stream, NULL, &e), M3_INVAL);
  ck_assert_int_eq(m3_launch_cluster(&k->mod, 17, 1, 1, 17, (CUstream)g_rt.stream, NULL, &e), M3_INVAL);
  ck_assert_int_eq(m3_launch_cluster(&k->mod, 16, 1, 1, 0, (CUstream)g_rt.stream, NULL, &e), M3_INVAL);
  narrow.mod.max_cluster = 1; /* none fits: one CTA a (token, KV head), no cluster */
  GPU_CHECK(m3_attn_prepare(&narrow, &a, &b, p.max_kv_len, 132, p.d_q, p.d_kv, NULL, p.d_out, NULL, 0, &c, &e_));
  ck_assert_int_eq(c.splits, 1);
  ck_assert_uint_eq(c.cluster, 1);
  prob_free(&p);
}
END_TEST

START_TEST(launch_rejects_bad_arguments) {
  prob p;
  m3_attn_args a;
  m3_seq_batch b;
  prob_5000(&p, 800, &a, &b);
  /* Plan as on the H200 (132 SMs) so decode splits and needs a workspace,
   * also on the emulator's 4 SMs. */
  const int sms = 132;
  m3_variant v;
  m3_err e;
  m3_kernel *k;
  ck_assert_int_eq(m3_attn_dense_key(&a, M3_ATTN_DECODE, &v, &e), M3_OK);
  GPU_CHECK(m3_rt_kernel(&g_rt, &v, NULL, &k, &e_));
  ck_assert_uint_gt(m3_attn_workspace_bytes(k, &a, p.max_kv_len, sms), 0);
  ck_assert_int_eq(m3_launch_attn_dense(k, &a, &b, p.max_kv_len, sms, p.d_q, p.d_kv, p.d_out, NULL, 0,
                                        g_rt.stream, &e), M3_INVAL);
  m3_attn_args bad = a;
  bad.kv_e4m3 = 1;
  ck_assert_int_eq(m3_launch_attn_dense(k, &bad, &b, p.max_kv_len, sms, p.d_q, p.d_kv, p.d_out, g_ws,
                                        g_ws_bytes, g_rt.stream, &e), M3_INVAL);
  ck_assert_int_eq(m3_launch_attn_sparse(k, &a, &b, p.max_kv_len, sms, p.d_q, p.d_kv, p.d_sel, p.d_out,
                                         g_ws, g_ws_bytes, g_rt.stream, &e), M3_INVAL);
  prob_free(&p);
}
END_TEST

static Suite *make(void) {
  Suite *s = suite_create("attention_gpu");
  TCase *tc = tcase_create("kernel");
  tcase_set_timeout(tc, 3600);
  tcase_add_loop_test(tc, decode_mixed_lengths, 0, 8);
  tcase_add_loop_test(tc, fault6_sentinels_and_beyond_causal, 0, 2);
  tcase_add_loop_test(tc, fault8_all_blocks_equal_dense, 0, 2);
  tcase_add_loop_test(tc, fault15_pages_past_2GiB, 0, 4);
  tcase_add_loop_test(tc, prefill_chunk_with_context, 0, 4);
  tcase_add_loop_test(tc, small_gqa_group, 0, 4);
  tcase_add_loop_test(tc, decode_ring_depths_and_cvt_agree, 0, 2);
  tcase_add_test(tc, launch_rejects_bad_arguments);
  tcase_add_test(tc, cluster_plan_fits_the_part);
  suite_add_tcase(s, tc);
  /* Every valid tile (CK_RUN_CASE=tiles): most of the suite's time on a GPU. */
  TCase *tiles = tcase_create("tiles");
  tcase_set_timeout(tiles, 3600);
  tcase_add_loop_test(tiles, every_valid_tile_same_answer, 0, 8);
  suite_add_tcase(s, tiles);
  /* A case of its own, so that compute-sanitizer's racecheck can take the
   * split hand-over alone (CK_RUN_CASE=merge): the whole suite under it
   * outlasts a device call. */
  TCase *merge = tcase_create("merge");
  tcase_set_timeout(merge, 3600);
  tcase_add_loop_test(merge, decode_split_merges_agree, 0, 4);
  suite_add_tcase(s, merge);
  return s;
}

int main(void) { return gpu_test_main("check_attention_gpu", make); }
