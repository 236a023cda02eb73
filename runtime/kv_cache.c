/* kv_cache.c - paged caches, admission and page allocation (see kv_cache.h).
 * The planning and the page bookkeeping are plain host code so that the
 * capacity, admission and slot arithmetic are tested without a GPU. */
#include "runtime/kv_cache.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/check.h"

m3_status m3_kv_plan_make(const m3_config *c, const m3_kv_opts *o, uint64_t free_bytes, m3_kv_plan *p,
                          m3_err *e) {
  memset(p, 0, sizeof *p);
  const int bs = c->sparse_block_size;
  if (o->page_size != 0 && o->page_size != bs)
    return m3_errf(e, M3_CONFIG, "KV cache: page size %d differs from the model's sparse_block_size %d; "
                   "one sparse block must be exactly one page (a top-k block id is mapped through the "
                   "block table to one page, known-faults #10)", o->page_size, bs);
  if (o->max_seqs < 1 || o->max_ctx < 1 || o->num_pages < 0)
    return m3_errf(e, M3_INVAL, "KV cache: %d sequences of %" PRId64 " tokens, %" PRId64 " pages", o->max_seqs,
                   o->max_ctx, o->num_pages);
  if (o->max_ctx > c->max_position_embeddings)
    return m3_errf(e, M3_RANGE, "KV cache: context of %" PRId64 " tokens exceeds max_position_embeddings %d "
                   "(the RoPE table ends there, known-faults #24)", o->max_ctx, c->max_position_embeddings);
  p->kv_e4m3 = o->kv_e4m3;
  p->idx_e4m3 = o->idx_e4m3;
  p->page_size = bs;
  p->max_seqs = o->max_seqs;
  p->max_ctx = o->max_ctx;
  p->pages_per_seq = (o->max_ctx + bs - 1) / bs;
  p->num_pages = o->num_pages ? o->num_pages : (int64_t)o->max_seqs * p->pages_per_seq;
  p->bytes_per_token = m3_config_kv_bytes_per_token_model(c, o->kv_e4m3 ? 1 : 2, o->idx_e4m3 ? 1 : 2);
  p->bytes = p->bytes_per_token * (uint64_t)p->num_pages * (uint64_t)bs;
  uint64_t avail = free_bytes > o->reserve_bytes ? free_bytes - o->reserve_bytes : 0;
  if (p->bytes > avail)
    return m3_errf(e, M3_CAPACITY, "KV cache: a context of %" PRId64 " tokens x %d sequences (%" PRId64
                   " pages of %d tokens) needs %" PRIu64 " bytes at %" PRIu64 " bytes per token (%d layers, "
                   "KV %s, index-K %s), but only %" PRIu64 " bytes of GPU memory are free (%" PRIu64
                   " kept in reserve for activations); at most %" PRIu64 " tokens fit",
                   o->max_ctx, o->max_seqs, p->num_pages, bs, p->bytes, p->bytes_per_token,
                   c->num_hidden_layers, o->kv_e4m3 ? "e4m3" : "bf16", o->idx_e4m3 ? "e4m3" : "bf16",
                   free_bytes, (uint64_t)o->reserve_bytes, p->bytes_per_token ? avail / p->bytes_per_token : 0);
  return M3_OK;
}

uint64_t m3_kv_layer_bytes_per_token(const m3_kv_cache *kv, int layer) {
  return m3_config_kv_bytes_per_token(&kv->cfg, layer, kv->plan.kv_e4m3 ? 1 : 2, kv->plan.idx_e4m3 ? 1 : 2);
}

void m3_kv_free(m3_kv_cache *kv) {
  if (!kv) return;
  for (int l = 0; l < kv->cfg.num_hidden_layers; l++) {
    if (kv->kv && kv->kv[l]) cudaFree(kv->kv[l]);
    if (kv->ix && kv->ix[l]) cudaFree(kv->ix[l]);
  }
  if (kv->d_block_table) cudaFree(kv->d_block_table);
  if (kv->d_seq_lens) cudaFree(kv->d_seq_lens);
  free(kv->kv);
  free(kv->ix);
  free(kv->block_table);
  free(kv->seq_lens);
  free(kv->admitted);
  free(kv->free_list);
  memset(kv, 0, sizeof *kv);
}

static m3_status dev_zero(void **p, size_t bytes, const char *what, int layer, m3_err *e) {
  cudaError_t r = cudaMalloc(p, bytes ? bytes : 16);
  if (r != cudaSuccess) {
    *p = NULL;
    cudaGetLastError();
    return m3_errf(e, r == cudaErrorMemoryAllocation ? M3_CAPACITY : M3_CUDA,
                   "KV cache: layer %d %s: cudaMalloc(%zu): %s", layer, what, bytes, cudaGetErrorString(r));
  }
  M3_CUDA(e, cudaMemset(*p, 0, bytes));
  return M3_OK;
}

m3_status m3_kv_init_with(m3_kv_cache *kv, const m3_config *c, const m3_kv_opts *o, uint64_t free_bytes,
                          m3_err *e) {
  memset(kv, 0, sizeof *kv);
  kv->cfg = *c;
  M3_TRY(m3_kv_plan_make(c, o, free_bytes, &kv->plan, e));
  const m3_kv_plan *p = &kv->plan;
  const int L = c->num_hidden_layers;
  const size_t bt = (size_t)p->max_seqs * (size_t)p->pages_per_seq;
  kv->kv = calloc((size_t)L, sizeof *kv->kv);
  kv->ix = calloc((size_t)L, sizeof *kv->ix);
  kv->block_table = malloc(sizeof *kv->block_table * bt);
  kv->seq_lens = calloc((size_t)p->max_seqs, sizeof *kv->seq_lens);
  kv->admitted = calloc((size_t)p->max_seqs, sizeof *kv->admitted);
  kv->free_list = malloc(sizeof *kv->free_list * (size_t)p->num_pages);
  if (!kv->kv || !kv->ix || !kv->block_table || !kv->seq_lens || !kv->admitted || !kv->free_list) {
    m3_kv_free(kv);
    return m3_errf(e, M3_NOMEM, "KV cache: host tables");
  }
  for (size_t i = 0; i < bt; i++) kv->block_table[i] = -1;
  /* Hand out high pages first: a sequence's pages are then not the identity
   * of its logical blocks, and page 0 is used last. */
  for (int64_t i = 0; i < p->num_pages; i++) kv->free_list[i] = (int32_t)i;
  kv->n_free = p->num_pages;
  kv->bt_dirty = 1;
  if (o->host_only) return M3_OK;
  const size_t pb = (size_t)p->page_size;
  m3_status s = M3_OK;
  for (int l = 0; l < L && s == M3_OK; l++) {
    size_t kvb = (size_t)p->num_pages * (size_t)c->num_key_value_heads * pb * 2 * (size_t)c->head_dim *
                 (p->kv_e4m3 ? 1 : 2);
    s = dev_zero(&kv->kv[l], kvb, "KV cache", l, e);
    if (s == M3_OK && c->is_sparse[l])
      s = dev_zero(&kv->ix[l], (size_t)p->num_pages * pb * (size_t)c->sparse_index_dim * (p->idx_e4m3 ? 1 : 2),
                   "index-K cache", l, e);
  }
  if (s == M3_OK) s = dev_zero((void **)&kv->d_block_table, sizeof(int32_t) * bt, "block table", -1, e);
  if (s == M3_OK) s = dev_zero((void **)&kv->d_seq_lens, sizeof(int32_t) * (size_t)p->max_seqs, "lengths", -1, e);
  if (s != M3_OK) m3_kv_free(kv);
  return s;
}

m3_status m3_kv_init(m3_kv_cache *kv, const m3_config *c, const m3_kv_opts *o, m3_err *e) {
  size_t fr = 0, tot = 0;
  if (!o->host_only) M3_CUDA(e, cudaMemGetInfo(&fr, &tot));
  return m3_kv_init_with(kv, c, o, fr, e);
}

m3_status m3_kv_admit(m3_kv_cache *kv, int64_t total, int *seq, m3_err *e) {
  const m3_kv_plan *p = &kv->plan;
  *seq = -1;
  if (total < 1 || total > kv->cfg.max_position_embeddings)
    return m3_errf(e, M3_RANGE, "KV cache: a sequence of %" PRId64 " tokens (prompt + new tokens) is outside "
                   "[1, max_position_embeddings %d] (known-faults #24)", total, kv->cfg.max_position_embeddings);
  if (total > p->max_ctx)
    return m3_errf(e, M3_CAPACITY, "KV cache: a sequence of %" PRId64 " tokens exceeds the cache's context of %"
                   PRId64 " tokens", total, p->max_ctx);
  int s = -1;
  for (int i = 0; i < p->max_seqs && s < 0; i++)
    if (!kv->admitted[i]) s = i;
  if (s < 0) return m3_errf(e, M3_CAPACITY, "KV cache: all %d sequence slots are in use", p->max_seqs);
  int64_t need = (total + p->page_size - 1) / p->page_size;
  if (need > kv->n_free)
    return m3_errf(e, M3_CAPACITY, "KV cache: a sequence of %" PRId64 " tokens needs %" PRId64 " pages, %" PRId64
                   " of %" PRId64 " are free", total, need, kv->n_free, p->num_pages);
  int32_t *row = kv->block_table + (int64_t)s * p->pages_per_seq;
  for (int64_t b = 0; b < need; b++) row[b] = kv->free_list[--kv->n_free];
  kv->admitted[s] = total;
  kv->seq_lens[s] = 0;
  kv->bt_dirty = 1;
  *seq = s;
  return M3_OK;
}

void m3_kv_release(m3_kv_cache *kv, int seq) {
  const m3_kv_plan *p = &kv->plan;
  if (seq < 0 || seq >= p->max_seqs || !kv->admitted[seq]) return;
  int32_t *row = kv->block_table + (int64_t)seq * p->pages_per_seq;
  for (int64_t b = 0; b < p->pages_per_seq; b++)
    if (row[b] >= 0) {
      kv->free_list[kv->n_free++] = row[b];
      row[b] = -1;
    }
  kv->admitted[seq] = 0;
  kv->seq_lens[seq] = 0;
  kv->bt_dirty = 1;
}

m3_status m3_kv_append(m3_kv_cache *kv, int seq, int n, int64_t *positions, int64_t *slots, m3_err *e) {
  const m3_kv_plan *p = &kv->plan;
  if (seq < 0 || seq >= p->max_seqs || !kv->admitted[seq])
    return m3_errf(e, M3_INVAL, "KV cache: sequence %d is not admitted", seq);
  if (n < 0 || kv->seq_lens[seq] + (int64_t)n > kv->admitted[seq])
    return m3_errf(e, M3_CAPACITY, "KV cache: sequence %d holds %d tokens, %d more exceed the %" PRId64
                   " it was admitted with", seq, kv->seq_lens[seq], n, kv->admitted[seq]);
  const int32_t *row = kv->block_table + (int64_t)seq * p->pages_per_seq;
  for (int i = 0; i < n; i++) {
    int64_t pos = (int64_t)kv->seq_lens[seq] + i;
    if (positions) positions[i] = pos;
    if (slots) slots[i] = (int64_t)row[pos / p->page_size] * p->page_size + pos % p->page_size;
  }
  kv->seq_lens[seq] += n;
  return M3_OK;
}

m3_status m3_kv_sync(m3_kv_cache *kv, cudaStream_t stream, m3_err *e) {
  const m3_kv_plan *p = &kv->plan;
  if (!kv->d_seq_lens) return M3_OK;
  if (kv->bt_dirty) {
    M3_CUDA(e, cudaMemcpyAsync(kv->d_block_table, kv->block_table,
                               sizeof(int32_t) * (size_t)p->max_seqs * (size_t)p->pages_per_seq,
                               cudaMemcpyHostToDevice, stream));
    kv->bt_dirty = 0;
  }
  M3_CUDA(e, cudaMemcpyAsync(kv->d_seq_lens, kv->seq_lens, sizeof(int32_t) * (size_t)p->max_seqs,
                             cudaMemcpyHostToDevice, stream));
  return M3_OK;
}
