/* op_attention.c - keys, split plan, workspace and launchers of the attention
 * kernels (see op_attention.h).  The split plan lives here, on the host, so
 * that the workspace query and the launch agree by construction and the
 * kernel only reads `chunk` and its grid. */
#include "runtime/op_attention.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "runtime/check.h"

/* 16 keys per warp step (two 8-key mma n-tiles, one 16-deep P·V k-step). */
#define TILE_KEYS 16
/* The merging CTA stages a factor and a partial sum per (split, row) in its
 * NW*16*hd-float shared-memory area, hence at most NW*hd/2 splits (hd 128). */
#define SPLITS_PER_WARP 64
/* merge=cluster: a (token, KV head)'s splits are one thread-block cluster,
 * at most 16 CTAs (the non-portable maximum on sm_90). */
#define CLUSTER_MAX 16

static int is_cluster(const m3_kernel *k) {
  const char *m = m3_variant_tilev(&k->key, "merge");
  return m && !strcmp(m, "cluster");
}

static int is_sparse(const m3_kernel *k) { return !strcmp(k->key.op, "attn_sparse"); }

static m3_status make_key(const char *op, const m3_attn_args *a, m3_attn_mode mode, int with_topk, m3_variant *v,
                          m3_err *e) {
  char k[M3_KEY_MAX];
  int n = snprintf(k, sizeof k, "%s(mode=%s,kv=%s,nq=%d,nkv=%d,hd=%d,bs=%d", op,
                   mode == M3_ATTN_DECODE ? "decode" : "prefill", a->kv_e4m3 ? "e4m3" : "bf16", a->nq, a->nkv,
                   a->head_dim, a->block_size);
  if (with_topk) n += snprintf(k + n, sizeof k - (size_t)n, ",topk=%d", a->topk);
  snprintf(k + n, sizeof k - (size_t)n, ")");
  return m3_variant_parse(k, v, e);
}

m3_status m3_attn_sparse_key(const m3_attn_args *a, m3_attn_mode mode, m3_variant *v, m3_err *e) {
  return make_key("attn_sparse", a, mode, 1, v, e);
}

m3_status m3_attn_dense_key(const m3_attn_args *a, m3_attn_mode mode, m3_variant *v, m3_err *e) {
  return make_key("attn_dense", a, mode, 0, v, e);
}

static int is_decode(const m3_kernel *k) {
  const char *m = m3_variant_axis(&k->key, "mode");
  return m && !strcmp(m, "decode");
}

/* The decode split plan.  Keys (dense: the longest history; sparse: the
 * topk*bs selected-key slots) are cut into 16-key tiles; aim for
 * sm_count * ctas CTAs over all (token, KV head) pairs, but give every warp
 * at least one tile and stay within the merge's factor capacity.  Splits are
 * whole tiles, so a tile never straddles two splits. */
static void plan(const m3_kernel *k, const m3_attn_args *a, int64_t max_kv_len, int sm_count, int *splits,
                 int *chunk) {
  const long W = m3_variant_tile_int(&k->key, "warps", 4), C = m3_variant_tile_int(&k->key, "ctas", 1);
  const int64_t keys = is_sparse(k) ? (int64_t)a->topk * a->block_size : (max_kv_len > 0 ? max_kv_len : 1);
  const int64_t tiles = (keys + TILE_KEYS - 1) / TILE_KEYS;
  const int64_t pairs = (int64_t)(a->n_tokens > 0 ? a->n_tokens : 1) * a->nkv;
  const int64_t target = (int64_t)(sm_count > 0 ? sm_count : 1) * C;
  int64_t s = (target + pairs - 1) / pairs;
  /* A cluster is as wide as the part can place at this tile's size (a GPC's
   * free SMs: 16 on an H100 SXM); the portable 8 when the driver cannot tell. */
  const int64_t ccap = k->mod.max_cluster > 0 ? k->mod.max_cluster : 8;
  const int64_t by_tiles = (tiles + W - 1) / W, cap = is_cluster(k) ? ccap : W * SPLITS_PER_WARP;
  if (s > by_tiles) s = by_tiles;
  if (s > cap) s = cap;
  if (s < 1) s = 1;
  const int64_t per = (tiles + s - 1) / s;
  *splits = (int)((tiles + per - 1) / per);
  *chunk = (int)(per * TILE_KEYS);
}

static void layout(const m3_attn_args *a, int splits, size_t *counters_bytes, size_t *o_bytes, size_t *ml_bytes) {
  const size_t G = (size_t)(a->nq / a->nkv), pairs = (size_t)(a->n_tokens > 0 ? a->n_tokens : 0) * a->nkv;
  *counters_bytes = ((size_t)M3_ATTN_MAX_DECODE_TOKENS * a->nkv * sizeof(int32_t) + 255) & ~(size_t)255;
  *o_bytes = ((pairs * splits * G * a->head_dim * sizeof(float)) + 255) & ~(size_t)255;
  *ml_bytes = pairs * splits * G * 2 * sizeof(float);
}

size_t m3_attn_workspace_bytes(const m3_kernel *k, const m3_attn_args *a, int64_t max_kv_len, int sm_count) {
  if (!k || !a || !is_decode(k) || a->nkv <= 0 || a->nq % a->nkv) return 0;
  int splits, chunk;
  plan(k, a, max_kv_len, sm_count, &splits, &chunk);
  if (splits <= 1 || is_cluster(k)) return 0; /* a cluster merges in distributed shared memory */
  size_t cb, ob, mb;
  layout(a, splits, &cb, &ob, &mb);
  return cb + ob + mb;
}

m3_status m3_attn_workspace_init(void *ws, size_t bytes, cudaStream_t stream, m3_err *e) {
  if (!ws || !bytes) return M3_OK;
  M3_CUDA(e, cudaMemsetAsync(ws, 0, bytes, stream));
  return M3_OK;
}

static m3_status check_key(const m3_kernel *k, const m3_attn_args *a, m3_err *e) {
  const m3_variant *v = &k->key;
  const char *kv = m3_variant_axis(v, "kv");
  const int sparse = is_sparse(k);
  if (!sparse && strcmp(v->op, "attn_dense"))
    return m3_errf(e, M3_INVAL, "attention launch: kernel %s is not an attention kernel", v->op);
  if (m3_variant_axis_int(v, "nq", -1) != a->nq || m3_variant_axis_int(v, "nkv", -1) != a->nkv ||
      m3_variant_axis_int(v, "hd", -1) != a->head_dim || m3_variant_axis_int(v, "bs", -1) != a->block_size ||
      (sparse && m3_variant_axis_int(v, "topk", -1) != a->topk) || !kv ||
      strcmp(kv, a->kv_e4m3 ? "e4m3" : "bf16"))
    return m3_errf(e, M3_INVAL, "attention launch: arguments (nq %d, nkv %d, hd %d, bs %d, topk %d, kv %s) do "
                   "not match kernel key %s(...)", a->nq, a->nkv, a->head_dim, a->block_size, a->topk,
                   a->kv_e4m3 ? "e4m3" : "bf16", v->op);
  return M3_OK;
}

m3_status m3_attn_prepare(const m3_kernel *k, const m3_attn_args *a, const m3_seq_batch *b,
                          int64_t max_kv_len, int sm_count, const void *q, const void *kv_cache,
                          const int32_t *sel, void *out, void *ws, size_t ws_bytes, m3_attn_call *c,
                          m3_err *e) {
  memset(c, 0, sizeof *c);
  if (!k || !a || !b) return m3_errf(e, M3_INVAL, "attention launch: missing kernel, arguments or batch");
  M3_TRY(check_key(k, a, e));
  const int sparse = is_sparse(k), decode = is_decode(k);
  if (a->n_tokens < 0 || a->nkv <= 0 || a->nq % a->nkv)
    return m3_errf(e, M3_INVAL, "attention launch: n_tokens %d < 0 or nkv %d does not divide nq %d", a->n_tokens,
                   a->nkv, a->nq);
  if (a->n_tokens > 0 && (!q || !kv_cache || !out || !b->seq_lens || !b->block_table || !b->token_seq ||
                          !b->positions || (sparse && !sel)))
    return m3_errf(e, M3_INVAL, "attention launch: a NULL device pointer among q, kv_cache, out, seq_lens, "
                   "block_table, token_seq, positions%s", sparse ? ", sel" : "");
  if (a->n_tokens > 0 && (b->n_seqs <= 0 || b->bt_stride <= 0 || b->num_pages <= 0))
    return m3_errf(e, M3_INVAL, "attention launch: n_seqs %d, bt_stride %lld, num_pages %lld must be positive",
                   b->n_seqs, (long long)b->bt_stride, (long long)b->num_pages);
  const float scale = a->scale != 0.0f ? a->scale : 1.0f / sqrtf((float)a->head_dim);
  c->q = q;
  c->kv = kv_cache;
  c->block_table = b->block_table;
  c->bt_stride = b->bt_stride;
  c->num_pages = b->num_pages;
  c->n_seqs = b->n_seqs;
  c->seq_lens = b->seq_lens;
  c->token_seq = b->token_seq;
  c->positions = b->positions;
  c->sel = sparse ? sel : NULL;
  c->out = out;
  c->n_tokens = a->n_tokens;
  c->scale2 = (float)((double)scale * 1.4426950408889634);
  const long W = m3_variant_tile_int(&k->key, "warps", 4);
  if (!decode) {
    c->grid[0] = (unsigned)(((int64_t)a->n_tokens + W - 1) / W);
    c->grid[1] = (unsigned)a->nkv;
    c->grid[2] = 1;
    return M3_OK;
  }
  if (a->n_tokens > M3_ATTN_MAX_DECODE_TOKENS)
    return m3_errf(e, M3_INVAL, "attention decode launch: %d tokens, more than %d (use the prefill mode)",
                   a->n_tokens, M3_ATTN_MAX_DECODE_TOKENS);
  if (!sparse && max_kv_len < 1)
    return m3_errf(e, M3_INVAL, "dense attention decode launch: max_kv_len %lld must bound every visible length",
                   (long long)max_kv_len);
  int splits, chunk;
  plan(k, a, max_kv_len, sm_count, &splits, &chunk);
  c->splits = splits;
  c->chunk = chunk;
  c->grid[0] = (unsigned)splits;
  c->grid[1] = (unsigned)a->nkv;
  c->grid[2] = (unsigned)a->n_tokens;
  c->cluster = 1;
  if (splits > 1 && is_cluster(k)) {
    c->cluster = (unsigned)splits;
  } else if (splits > 1) {
    size_t cb, ob, mb;
    layout(a, splits, &cb, &ob, &mb);
    if (!ws || ws_bytes < cb + ob + mb)
      return m3_errf(e, M3_INVAL, "attention decode launch: %d splits need a %zu-byte workspace, got %zu (%s)",
                     splits, cb + ob + mb, ws ? ws_bytes : 0, "m3_attn_workspace_bytes");
    c->counters = (int32_t *)ws;
    c->part_o = (float *)((char *)ws + cb);
    c->part_ml = (float *)((char *)ws + cb + ob);
  }
  return M3_OK;
}

static m3_status launch(const m3_kernel *k, const m3_attn_call *c, cudaStream_t stream, m3_err *e) {
  if (c->n_tokens == 0) return M3_OK;
  void *args[] = {(void *)&c->q,         (void *)&c->kv,        (void *)&c->block_table, (void *)&c->bt_stride,
                  (void *)&c->num_pages, (void *)&c->n_seqs,    (void *)&c->seq_lens,    (void *)&c->token_seq,
                  (void *)&c->positions, (void *)&c->sel,       (void *)&c->out,         (void *)&c->counters,
                  (void *)&c->part_o,    (void *)&c->part_ml,   (void *)&c->chunk,       (void *)&c->n_tokens,
                  (void *)&c->scale2};
  return m3_launch_cluster(&k->mod, c->grid[0], c->grid[1], c->grid[2], c->cluster ? c->cluster : 1, (CUstream)stream,
                           args, e);
}

m3_status m3_launch_attn_sparse(const m3_kernel *k, const m3_attn_args *a, const m3_seq_batch *b,
                                int64_t max_kv_len, int sm_count, const void *q, const void *kv_cache,
                                const int32_t *sel, void *out, void *ws, size_t ws_bytes, cudaStream_t stream,
                                m3_err *e) {
  if (k && !is_sparse(k)) return m3_errf(e, M3_INVAL, "m3_launch_attn_sparse: kernel %s is not attn_sparse", k->key.op);
  m3_attn_call c;
  M3_TRY(m3_attn_prepare(k, a, b, max_kv_len, sm_count, q, kv_cache, sel, out, ws, ws_bytes, &c, e));
  return launch(k, &c, stream, e);
}

m3_status m3_launch_attn_dense(const m3_kernel *k, const m3_attn_args *a, const m3_seq_batch *b,
                               int64_t max_kv_len, int sm_count, const void *q, const void *kv_cache, void *out,
                               void *ws, size_t ws_bytes, cudaStream_t stream, m3_err *e) {
  if (k && is_sparse(k)) return m3_errf(e, M3_INVAL, "m3_launch_attn_dense: kernel %s is not attn_dense", k->key.op);
  m3_attn_call c;
  M3_TRY(m3_attn_prepare(k, a, b, max_kv_len, sm_count, q, kv_cache, NULL, out, ws, ws_bytes, &c, e));
  return launch(k, &c, stream, e);
}
