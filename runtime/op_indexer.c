/* op_indexer.c - keys, split plan, workspace and launchers of the lightning
 * indexer (see op_indexer.h).  The kernels trust the arguments checked here
 * (shapes against the kernel's key, dtype tags, alignment, workspace size)
 * and clamp what only the device knows (positions, block-table entries). */
#include "runtime/op_indexer.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "runtime/cuda_driver.h"
#include "runtime/gpu.h"

m3_status m3_index_decode_key(const m3_idx_args *a, m3_variant *v, m3_err *e) {
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "index_decode(idxk=%s,heads=%d,hd=%d,bs=%d,topk=%d,init=%d,local=%d)",
           a->idx_e4m3 ? "e4m3" : "bf16", a->n_heads, a->head_dim, a->block_size, a->topk, a->init_blocks,
           a->local_blocks);
  return m3_variant_parse(k, v, e);
}

m3_status m3_index_prefill_key(const m3_idx_args *a, m3_idx_stage stage, m3_variant *v, m3_err *e) {
  char k[M3_KEY_MAX];
  snprintf(k, sizeof k, "index_prefill(stage=%s,idxk=%s,heads=%d,hd=%d,bs=%d,topk=%d,init=%d,local=%d)",
           stage == M3_IDX_TOPK ? "topk" : "score", a->idx_e4m3 ? "e4m3" : "bf16", a->n_heads, a->head_dim,
           a->block_size, a->topk, a->init_blocks, a->local_blocks);
  return m3_variant_parse(k, v, e);
}

/* k must have been built for exactly these arguments: the kernel bakes them in. */
static m3_status check_key(const m3_kernel *k, const char *op, const char *stage, const m3_idx_args *a,
                           m3_err *e) {
  if (!k || !a) return m3_errf(e, M3_INVAL, "indexer: NULL kernel or arguments");
  if (strcmp(k->key.op, op))
    return m3_errf(e, M3_INVAL, "indexer: kernel %s is not an %s kernel", k->key.op, op);
  const char *st = m3_variant_axis(&k->key, "stage");
  if (stage && (!st || strcmp(st, stage)))
    return m3_errf(e, M3_INVAL, "indexer: kernel is stage=%s, the call needs stage=%s", st ? st : "?", stage);
  const char *ix = m3_variant_axis(&k->key, "idxk"), *want = a->idx_e4m3 ? "e4m3" : "bf16";
  if (!ix || strcmp(ix, want))
    return m3_errf(e, M3_INVAL, "indexer: kernel built for idxk=%s, arguments say idxk=%s", ix ? ix : "?", want);
  static const char *const names[] = {"heads", "hd", "bs", "topk", "init", "local"};
  const int vals[] = {a->n_heads, a->head_dim, a->block_size, a->topk, a->init_blocks, a->local_blocks};
  for (int i = 0; i < 6; i++) {
    long kv = m3_variant_axis_int(&k->key, names[i], -1);
    if (kv != vals[i])
      return m3_errf(e, M3_INVAL, "indexer: kernel built for %s=%ld, arguments say %d", names[i], kv, vals[i]);
  }
  if (a->n_tokens < 0 || a->max_blocks <= 0)
    return m3_errf(e, M3_INVAL, "indexer: n_tokens %d must be >= 0 and max_blocks %d > 0", a->n_tokens,
                   a->max_blocks);
  return M3_OK;
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* What both kernels read; fault #16b: the cache's dtype tag must be the call's. */
static m3_status check_inputs(const m3_idx_args *a, const m3_seq_batch *b, const void *iq,
                              const m3_idx_cache *cache, m3_err *e) {
  if (!b || !b->block_table || !b->token_seq || !b->positions || b->n_seqs <= 0 || b->bt_stride <= 0)
    return m3_errf(e, M3_INVAL, "indexer: paged batch with missing arrays, n_seqs <= 0 or bt_stride <= 0");
  if (!cache || !cache->data) return m3_errf(e, M3_INVAL, "indexer: no index-K cache");
  if (cache->e4m3 != a->idx_e4m3)
    return m3_errf(e, M3_INVAL, "indexer: the index-K cache holds %s but the %s indexer was asked for: a cache "
                   "is only ever read in the dtype it was written in (known-faults #16)",
                   cache->e4m3 ? "e4m3" : "bf16", a->idx_e4m3 ? "e4m3" : "bf16");
  if (b->num_pages > cache->num_pages)
    return m3_errf(e, M3_INVAL, "indexer: the batch addresses %" PRId64 " pages, the cache holds %" PRId64,
                   b->num_pages, cache->num_pages);
  if (!iq || !aligned16(iq) || !aligned16(cache->data))
    return m3_errf(e, M3_INVAL, "indexer: iq and the cache must be non-NULL and 16-byte aligned");
  return M3_OK;
}

m3_status m3_index_decode_plan(const m3_kernel *k, const m3_idx_args *a, int sm_count, m3_idx_decode_plan *p,
                               m3_err *e) {
  memset(p, 0, sizeof *p);
  M3_TRY(check_key(k, "index_decode", NULL, a, e));
  if (sm_count < 1) return m3_errf(e, M3_INVAL, "indexer: sm_count %d < 1", sm_count);
  const long waves = m3_variant_tile_int(&k->key, "waves", 1);
  long chunk = m3_variant_tile_int(&k->key, "chunk", 16);
  if (chunk < 1 || chunk > M3_IDX_MAX_SPLIT_BLOCKS) chunk = M3_IDX_MAX_SPLIT_BLOCKS;
  int resident = k->resident;
  if (resident < 1) resident = 4;
  /* `waves` resident waves of CTAs for the work there is (one wave: every
   * CTA of one long sequence streams at once, none waits for a tail), but
   * never longer splits than `chunk`: in a big batch short CTAs let the
   * dispatcher even out mixed lengths and keep the tail short. */
  const int64_t slots = (int64_t)(waves > 0 ? waves : 1) * resident * sm_count;
  const int64_t est = (int64_t)a->n_tokens * a->max_blocks;
  int64_t bpc = (est + slots - 1) / slots;
  if (bpc < 1) bpc = 1;
  if (bpc > chunk) bpc = chunk;
  p->bpc = (int)bpc;
  p->max_splits = (int)((a->max_blocks + bpc - 1) / bpc);
  const int64_t grid = (int64_t)a->n_tokens * p->max_splits;
  if (grid > 0x7fffffff)
    return m3_errf(e, M3_RANGE, "indexer: %d tokens x %d splits is more than 2^31-1 CTAs", a->n_tokens,
                   p->max_splits);
  p->grid = (unsigned)grid;
  if (p->max_splits > 1) {
    if (a->n_tokens > M3_IDX_MAX_DECODE_TOKENS)
      return m3_errf(e, M3_RANGE, "indexer: %d decode tokens with split top-k, at most %d", a->n_tokens,
                     M3_IDX_MAX_DECODE_TOKENS);
    const size_t n = (size_t)a->n_tokens * (size_t)a->n_heads * (size_t)p->max_splits;
    p->off_heads = (size_t)M3_IDX_MAX_DECODE_TOKENS * 4;
    p->off_lists = p->off_heads + n * 8;
    p->ws_bytes = p->off_lists + n * (size_t)a->topk * 8;
  }
  return M3_OK;
}

size_t m3_index_decode_workspace_bytes(const m3_kernel *k, const m3_idx_args *a, int sm_count) {
  m3_idx_decode_plan p;
  return m3_index_decode_plan(k, a, sm_count, &p, NULL) == M3_OK ? p.ws_bytes : 0;
}

m3_status m3_index_workspace_init(void *ws, size_t bytes, cudaStream_t stream, m3_err *e) {
  if (!ws || !bytes) return M3_OK;
  cudaError_t r = cudaMemsetAsync(ws, 0, bytes, stream);
  if (r != cudaSuccess) return m3_errf(e, M3_CUDA, "indexer workspace: cudaMemsetAsync: %s", cudaGetErrorString(r));
  return M3_OK;
}

m3_status m3_launch_index_decode(const m3_kernel *k, const m3_idx_args *a, const m3_seq_batch *b, int sm_count,
                                 const void *iq, const m3_idx_cache *cache, int32_t *topk_out, void *ws,
                                 size_t ws_bytes, cudaStream_t stream, m3_err *e) {
  m3_idx_decode_plan p;
  M3_TRY(m3_index_decode_plan(k, a, sm_count, &p, e));
  M3_TRY(check_inputs(a, b, iq, cache, e));
  if (!topk_out) return m3_errf(e, M3_INVAL, "indexer: no output");
  if (p.ws_bytes && (!ws || ws_bytes < p.ws_bytes || !aligned16(ws)))
    return m3_errf(e, M3_INVAL, "indexer: decode with %d splits of %d blocks needs a 16-byte aligned workspace "
                   "of %zu bytes, got %zu", p.max_splits, p.bpc, p.ws_bytes, ws ? ws_bytes : 0);
  if (a->n_tokens == 0) return M3_OK;
  unsigned char *w = ws;
  const void *data = cache->data;
  int64_t num_pages = b->num_pages, bt_stride = b->bt_stride;
  int n_seqs = b->n_seqs, n_tokens = a->n_tokens, max_splits = p.max_splits, bpc = p.bpc,
      max_blocks = a->max_blocks;
  void *counters = p.ws_bytes ? w : NULL, *heads = p.ws_bytes ? w + p.off_heads : NULL,
       *lists = p.ws_bytes ? w + p.off_lists : NULL;
  void *args[] = {(void *)&iq, (void *)&data, &num_pages, (void *)&b->block_table, &bt_stride, &n_seqs,
                  (void *)&b->token_seq, (void *)&b->positions, &topk_out, &counters,
                  &heads, &lists, &n_tokens, &max_splits, &bpc, &max_blocks};
  return m3_launch(&k->mod, p.grid, 1, 1, (CUstream)stream, args, e);
}

size_t m3_index_prefill_scores_bytes(const m3_idx_args *a) {
  if (!a || a->n_tokens <= 0 || a->n_heads <= 0 || a->max_blocks <= 0) return 0;
  return (size_t)a->n_heads * (size_t)a->n_tokens * (size_t)a->max_blocks * sizeof(float);
}

m3_status m3_launch_index_prefill_scores(const m3_kernel *k, const m3_idx_args *a, const m3_seq_batch *b,
                                         const void *iq, const m3_idx_cache *cache, float *scores,
                                         cudaStream_t stream, m3_err *e) {
  M3_TRY(check_key(k, "index_prefill", "score", a, e));
  M3_TRY(check_inputs(a, b, iq, cache, e));
  if (!scores) return m3_errf(e, M3_INVAL, "indexer: no score buffer");
  if (16 % a->n_heads) return m3_errf(e, M3_INVAL, "indexer: %d heads do not divide 16 mma rows", a->n_heads);
  if (a->n_tokens == 0) return M3_OK;
  const long warps = m3_variant_tile_int(&k->key, "warps", 4);
  const int64_t per_cta = warps * (16 / a->n_heads);
  const int64_t gy = (a->n_tokens + per_cta - 1) / per_cta;
  if (gy > 65535)
    return m3_errf(e, M3_RANGE, "indexer: %d prefill tokens need %" PRId64 " token tiles, at most 65535",
                   a->n_tokens, gy);
  const void *data = cache->data;
  int64_t num_pages = b->num_pages, bt_stride = b->bt_stride;
  int n_seqs = b->n_seqs, n_tokens = a->n_tokens, max_blocks = a->max_blocks;
  void *args[] = {(void *)&iq, (void *)&data, &num_pages, (void *)&b->block_table, &bt_stride, &n_seqs,
                  (void *)&b->token_seq, (void *)&b->positions, &scores, &n_tokens,
                  &max_blocks};
  return m3_launch(&k->mod, (unsigned)a->max_blocks, (unsigned)gy, 1, (CUstream)stream, args, e);
}

m3_status m3_launch_index_prefill_topk(const m3_kernel *k, const m3_idx_args *a, const m3_seq_batch *b,
                                       const float *scores, int32_t *topk_out, cudaStream_t stream, m3_err *e) {
  M3_TRY(check_key(k, "index_prefill", "topk", a, e));
  if (!b || !b->token_seq || !b->positions || b->n_seqs <= 0 || b->bt_stride <= 0)
    return m3_errf(e, M3_INVAL, "indexer: paged batch with missing arrays, n_seqs <= 0 or bt_stride <= 0");
  if (!scores || !topk_out) return m3_errf(e, M3_INVAL, "indexer: no score buffer or output");
  if (a->n_tokens == 0) return M3_OK;
  const long warps = m3_variant_tile_int(&k->key, "warps", 4);
  const int64_t rows = (int64_t)a->n_heads * a->n_tokens, grid = (rows + warps - 1) / warps;
  if (grid > 0x7fffffff) return m3_errf(e, M3_RANGE, "indexer: %" PRId64 " top-k rows", rows);
  int64_t bt_stride = b->bt_stride;
  int n_seqs = b->n_seqs, n_tokens = a->n_tokens, max_blocks = a->max_blocks;
  void *args[] = {(void *)&scores, &bt_stride, &n_seqs, (void *)&b->token_seq, (void *)&b->positions, &topk_out,
                  &n_tokens, &max_blocks};
  return m3_launch(&k->mod, (unsigned)grid, 1, 1, (CUstream)stream, args, e);
}

m3_status m3_launch_index_prefill(const m3_kernel *k_score, const m3_kernel *k_topk, const m3_idx_args *a,
                                  const m3_seq_batch *b, const void *iq, const m3_idx_cache *cache, float *scores,
                                  int32_t *topk_out, cudaStream_t stream, m3_err *e) {
  M3_TRY(m3_launch_index_prefill_scores(k_score, a, b, iq, cache, scores, stream, e));
  return m3_launch_index_prefill_topk(k_topk, a, b, scores, topk_out, stream, e);
}
