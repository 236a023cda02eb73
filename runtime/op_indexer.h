/* op_indexer.h - keys, workspace and launchers of the lightning indexer (spec
 * §5): per query token and index head, the top-k logical blocks by the max
 * over each block of the fp32 dot products between the index query and the
 * single index key of every visible token, with the forced init/local blocks.
 * Separate from ops.h because the decode kernel needs a workspace and a split
 * plan derived from the SM count, and because the cache it reads carries a
 * dtype tag that the launcher checks (known-faults #16).
 *
 * Two schedules compute the same function, m3_ref_indexer (ref/ref.h):
 *   decode  - templates/index_decode.lua: ONE launch for any batch (mixed
 *             lengths, speculative tokens): scores, forcing, per-split top-k
 *             and the merge by the last split of each token; no score tensor
 *             in memory.  For few query tokens with long histories.
 *   prefill - templates/index_prefill.lua: stage=score writes the raw block
 *             scores [heads, n_tokens, max_blocks] fp32 (= m3_ref_index_scores
 *             on visible blocks), stage=topk forces and selects
 *             (= m3_ref_index_topk).  For a chunk of one sequence.
 *
 * Arguments are the reference's (m3_idx_args, m3_seq_batch) with DEVICE
 * arrays in the batch (its scalars on the host) and device tensors:
 *   iq         [n_tokens, n_heads, head_dim] bf16 | e4m3, contiguous, 16-byte aligned
 *   cache      the index-K cache, [num_pages * block_size, head_dim] (§4.4)
 *   topk_out   [n_heads, n_tokens, topk] int32 logical block ids (§5.4)
 * Numerics: the dot products run on tensor cores (bf16, or e4m3 decoded
 * exactly to fp16) with fp32 accumulation, so only blocks whose reference
 * scores are tied to ~1e-6 relative can be ordered differently; ties that are
 * exact in the data (identical keys) go to the lower block id as in the
 * reference; groups holding NaN/Inf (in the keys or the query) take an exact
 * scalar path that is m3_ref_dot_f32 operation for operation.
 * Inputs the kernels trust: positions[t] < seq_lens[token_seq[t]] (the
 * reference checks it; the kernels do not read seq_lens, which would put a
 * dependent load in front of every other).  What they do not trust, so that
 * no input makes them read outside their arrays: a visible length is clamped
 * to min(positions[t] + 1, bt_stride * block_size, max_blocks * block_size);
 * a token of no valid sequence gets an all -1 row; block-table entries are read only for
 * visible, non-forced blocks (fault 6) and one outside [0, num_pages) makes
 * its block score NaN (never chosen ahead of a finite block).  Cache offsets
 * are 64-bit (fault 15).
 */
#ifndef M3_OP_INDEXER_H
#define M3_OP_INDEXER_H

#include <stddef.h>
#include <stdint.h>

#include "ref/ref.h"
#include "runtime/kernels.h"

/* The index-K cache as the indexer receives it: the dtype tag travels with
 * the pointer, so a cache written as e4m3 can never be read as bf16 or the
 * other way round (the launchers fail instead; known-faults #16b).  There is
 * no scale: index keys are stored unscaled (§4.5), so a checkpoint k_scale
 * has nothing to act on (#16c). */
typedef struct m3_idx_cache {
  const void *data;      /* device [num_pages * block_size, head_dim], 16-byte aligned */
  int e4m3;              /* 0 bf16, 1 e4m3 (float8_e4m3fn) */
  int64_t num_pages;     /* pages allocated */
} m3_idx_cache;

typedef enum m3_idx_stage { M3_IDX_SCORE = 0, M3_IDX_TOPK = 1 } m3_idx_stage;

/* Decode launches with more than one split per token use one arrival counter
 * per token at a fixed place in the workspace. */
#define M3_IDX_MAX_DECODE_TOKENS 65536
/* The most blocks one decode split covers (MAXB in templates/index_decode.lua). */
#define M3_IDX_MAX_SPLIT_BLOCKS 64

/* The semantic keys (no tile, no arch):
 *   index_decode(idxk=,heads=,hd=,bs=,topk=,init=,local=)
 *   index_prefill(stage=,idxk=,heads=,hd=,bs=,topk=,init=,local=)
 * from a->idx_e4m3, n_heads, head_dim, block_size, topk, init_blocks,
 * local_blocks.  Errors: M3_KEY. */
m3_status m3_index_decode_key(const m3_idx_args *a, m3_variant *v, m3_err *e);
m3_status m3_index_prefill_key(const m3_idx_args *a, m3_idx_stage stage, m3_variant *v, m3_err *e);

/* What a decode launch of kernel k derives, without touching the GPU.
 * Splits: bpc = ceil(n_tokens * max_blocks / (tile.waves * R * sm_count))
 * clamped to [1, tile.chunk], R = CTAs of k resident per SM (from its
 * registers and shared memory; 4 when the driver cannot tell): about one
 * resident wave of CTAs for one long sequence (8K: 1 block per split, 128K:
 * 2, 1M: 16 on an H200 with R = 4), bounded splits for big batches so that
 * the CTA dispatch balances mixed lengths; a token with nb visible blocks
 * uses ceil(nb / bpc) of the grid's max_splits CTAs. */
typedef struct m3_idx_decode_plan {
  int bpc;               /* blocks per split */
  int max_splits;        /* ceil(max_blocks / bpc) */
  unsigned grid;         /* n_tokens * max_splits CTAs */
  size_t ws_bytes;       /* workspace needed; 0 when max_splits == 1 */
  size_t off_heads, off_lists; /* byte offsets of the split maxima and lists */
} m3_idx_decode_plan;

/* Errors: M3_INVAL (k is not an index_decode kernel for a, bad a fields,
 * sm_count < 1), M3_RANGE (grid over 2^31-1 CTAs, or more than
 * M3_IDX_MAX_DECODE_TOKENS tokens with several splits). */
m3_status m3_index_decode_plan(const m3_kernel *k, const m3_idx_args *a, int sm_count, m3_idx_decode_plan *p,
                               m3_err *e);

/* Workspace bytes of a decode launch (0 on a bad plan or one split).  A
 * workspace sized for some (n_tokens, max_blocks) fits every launch of the
 * same kernel with smaller ones.  Layout: [M3_IDX_MAX_DECODE_TOKENS] u32
 * arrival counters, then split maxima [n_tokens, n_heads, max_splits] u64,
 * then split lists [n_tokens, max_splits, n_heads, topk] u64 order keys. */
size_t m3_index_decode_workspace_bytes(const m3_kernel *k, const m3_idx_args *a, int sm_count);

/* Zero a freshly allocated workspace (device) on `stream`.  Once: every
 * decode launch leaves its counters zero again, so one workspace serves all
 * later launches on the same stream (not two launches running at once).
 * Errors: M3_CUDA. */
m3_status m3_index_workspace_init(void *ws, size_t bytes, cudaStream_t stream, m3_err *e);

/* The decode indexer with kernel k (from m3_index_decode_key, any tile):
 * topk_out = m3_ref_indexer(a, b, iq, cache) up to near-ties (header).
 * sm_count: m3_rt.dev.sm_count.  ws: m3_index_decode_workspace_bytes bytes,
 * zeroed once (m3_index_workspace_init); may be NULL when that is 0.
 * Errors: M3_INVAL (key/argument mismatch naming the field, a cache whose
 * dtype is not a->idx_e4m3, NULL or misaligned pointers, a workspace too
 * small), M3_RANGE (from the plan), M3_CUDA (launch).
 * A tile with lead=1 reads b's token_seq, positions and block table before
 * its grid wait, i.e. while kernels launched before it on `stream` may still
 * run (programmatic dependent launch): no kernel on `stream` since its last
 * host-ordered point may write them.  The decode step uploads them with host
 * copies before its first kernel. */
m3_status m3_launch_index_decode(const m3_kernel *k, const m3_idx_args *a, const m3_seq_batch *b, int sm_count,
                                 const void *iq, const m3_idx_cache *cache, int32_t *topk_out, void *ws,
                                 size_t ws_bytes, cudaStream_t stream, m3_err *e);

/* Bytes of the prefill score buffer: n_heads * n_tokens * max_blocks fp32. */
size_t m3_index_prefill_scores_bytes(const m3_idx_args *a);

/* Prefill stage 1 with kernel k (m3_index_prefill_key(a, M3_IDX_SCORE)):
 * scores [n_heads, n_tokens, max_blocks] fp32, entry (g, t, b) =
 * S_g(t, b) for every visible b < nb(t) (m3_ref_index_scores; NaN where a
 * block holds a NaN score); entries b >= nb(t) are not written.  All tokens
 * sharing a warp (16 / n_heads consecutive tokens) must belong to one
 * sequence - true for a prefill chunk; rows of another sequence are not
 * written.  Errors: M3_INVAL (as decode), M3_RANGE (more than 65535 token
 * tiles), M3_CUDA. */
m3_status m3_launch_index_prefill_scores(const m3_kernel *k, const m3_idx_args *a, const m3_seq_batch *b,
                                         const void *iq, const m3_idx_cache *cache, float *scores,
                                         cudaStream_t stream, m3_err *e);

/* Prefill stage 2 with kernel k (m3_index_prefill_key(a, M3_IDX_TOPK)):
 * topk_out = m3_ref_index_topk(a, b, scores), exactly (no arithmetic: the
 * forcing constants and an order on fp32 values); entries b >= nb(t) and
 * forced blocks of `scores` are never read.  Errors: M3_INVAL, M3_CUDA. */
m3_status m3_launch_index_prefill_topk(const m3_kernel *k, const m3_idx_args *a, const m3_seq_batch *b,
                                       const float *scores, int32_t *topk_out, cudaStream_t stream, m3_err *e);

/* Both prefill stages; scores is scratch of m3_index_prefill_scores_bytes(a).
 * Errors: those of the two stages. */
m3_status m3_launch_index_prefill(const m3_kernel *k_score, const m3_kernel *k_topk, const m3_idx_args *a,
                                  const m3_seq_batch *b, const void *iq, const m3_idx_cache *cache, float *scores,
                                  int32_t *topk_out, cudaStream_t stream, m3_err *e);

#endif
