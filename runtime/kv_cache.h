/* kv_cache.h - the paged KV cache and index-K cache of every layer, and the
 * sequences that own their pages (spec §4.2-§4.4, §9.3).
 *
 * Layout, per layer l (one cudaMalloc each; 64-bit offsets everywhere,
 * known-faults #15):
 *   kv[l]  [num_pages, nkv, page, 2*hd]  bf16 | e4m3: K in [0, hd), V in [hd, 2hd)
 *   ix[l]  [num_pages * page, index_dim] bf16 | e4m3   (sparse layers only)
 * The dtypes are chosen at run time (kv_e4m3, idx_e4m3) and carried here, so
 * no kernel is ever handed a cache of the other dtype (known-faults #16).
 *
 * Pages: page size == sparse_block_size, always: one sparse block is one page,
 * so a top-k block id maps through the block table to exactly one page.  Init
 * fails with both numbers named when asked for another page size
 * (known-faults #10).
 *
 * Sequences: a sequence is admitted with its final length (prompt + tokens
 * to generate); admission reserves all its pages at once, so a running
 * sequence can never run out of pages in the middle of a decode step, and
 * fails when the total exceeds max_position_embeddings (the RoPE table's
 * length, known-faults #24) or the cache.  Pages are handed out from a free
 * list; the block table row of a sequence maps logical block b (positions
 * [b*page, (b+1)*page)) to its page; unused entries hold -1.  Slot of
 * position p = block_table[seq][p / page] * page + p % page.
 *
 * Capacity: by default the cache is sized for max_seqs sequences of max_ctx
 * tokens; m3_kv_plan_make checks that against the free GPU memory
 * (cudaMemGetInfo at m3_kv_init) minus a reserve for activations and fails
 * with M3_CAPACITY naming the requested context, the bytes per token and the
 * free bytes.
 */
#ifndef M3_KV_CACHE_H
#define M3_KV_CACHE_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "runtime/config.h"
#include "runtime/status.h"

typedef struct m3_kv_opts {
  int kv_e4m3;             /* main KV cache dtype: 0 bf16, 1 e4m3 (identity scale, §4.5) */
  int idx_e4m3;            /* index-K cache dtype */
  int page_size;           /* tokens per page; 0 = sparse_block_size; anything else must equal it */
  int max_seqs;            /* sequences held at once (>= 1) */
  int64_t max_ctx;         /* tokens per sequence (prompt + generated), <= max_position_embeddings */
  int64_t num_pages;       /* 0: max_seqs * ceil(max_ctx / page); else a shared pool of this many */
  uint64_t reserve_bytes;  /* GPU memory to leave free (activations, cuBLAS workspace) */
  int host_only;           /* plan + host tables only, no device memory (tests, dry runs) */
} m3_kv_opts;

typedef struct m3_kv_plan {
  int kv_e4m3, idx_e4m3;
  int page_size;
  int max_seqs;
  int64_t max_ctx;
  int64_t pages_per_seq;      /* block-table row length: ceil(max_ctx / page) */
  int64_t num_pages;
  uint64_t bytes_per_token;   /* whole model (§9.3: 137,472 for bf16/bf16 on the real config) */
  uint64_t bytes;             /* all caches */
} m3_kv_plan;

/* Size the caches for config c and check them against free_bytes.
 * Errors: M3_CONFIG (page size != sparse_block_size, naming both),
 * M3_INVAL (max_seqs < 1, max_ctx < 1, num_pages < 0), M3_RANGE (max_ctx >
 * max_position_embeddings, naming both), M3_CAPACITY (bytes > free_bytes -
 * reserve: names the context, sequences, bytes per token, bytes needed, free
 * bytes and the reserve). */
m3_status m3_kv_plan_make(const m3_config *c, const m3_kv_opts *o, uint64_t free_bytes, m3_kv_plan *p,
                          m3_err *e);

typedef struct m3_kv_cache {
  m3_config cfg;
  m3_kv_plan plan;
  void **kv;               /* [L] device pointers (NULL with host_only) */
  void **ix;               /* [L] device pointers, NULL for dense layers */
  int32_t *block_table;    /* host [max_seqs, pages_per_seq], -1 = unmapped */
  int32_t *seq_lens;       /* host [max_seqs]: tokens cached */
  int64_t *admitted;       /* host [max_seqs]: final length admitted, 0 = slot free */
  int32_t *d_block_table;  /* device copies (m3_kv_sync) */
  int32_t *d_seq_lens;
  int32_t *free_list;      /* [num_pages] free page ids, n_free of them */
  int64_t n_free;
  int bt_dirty;            /* block table changed since the last sync */
} m3_kv_cache;

/* Plan with the device's free memory (cudaMemGetInfo), allocate the caches
 * (zeroed), the host tables and their device copies.
 * Errors: those of m3_kv_plan_make, M3_CUDA, M3_NOMEM. */
m3_status m3_kv_init(m3_kv_cache *kv, const m3_config *c, const m3_kv_opts *o, m3_err *e);
/* Same with a given free-memory figure and no device allocation when
 * o->host_only (the admission logic is then testable without a GPU). */
m3_status m3_kv_init_with(m3_kv_cache *kv, const m3_config *c, const m3_kv_opts *o, uint64_t free_bytes,
                          m3_err *e);
void m3_kv_free(m3_kv_cache *kv);

/* Admit a sequence that will hold total_tokens tokens; reserves its pages.
 * Errors: M3_RANGE (total_tokens > max_position_embeddings, known-faults
 * #24; or < 1), M3_CAPACITY (total > max_ctx, no free sequence slot, or not
 * enough free pages: each names the numbers). */
m3_status m3_kv_admit(m3_kv_cache *kv, int64_t total_tokens, int *seq, m3_err *e);
/* Return a sequence's pages to the free list. */
void m3_kv_release(m3_kv_cache *kv, int seq);

/* Append n tokens to sequence seq: positions [n] and slots [n] (int64) of the
 * new tokens, in order; the host length grows by n.
 * Errors: M3_INVAL (seq not admitted), M3_CAPACITY (beyond its admitted
 * length). */
m3_status m3_kv_append(m3_kv_cache *kv, int seq, int n, int64_t *positions, int64_t *slots, m3_err *e);

/* Copy the block table (when changed) and the lengths to the device, async on
 * `stream`.  Errors: M3_CUDA. */
m3_status m3_kv_sync(m3_kv_cache *kv, cudaStream_t stream, m3_err *e);

/* Bytes of one layer's caches per token (bf16: 2048 dense / 2304 sparse). */
uint64_t m3_kv_layer_bytes_per_token(const m3_kv_cache *kv, int layer);

#endif
