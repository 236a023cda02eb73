/* op_attention.h - keys, split-K workspace and launchers of the attention
 * kernels over the paged KV cache (spec §6): block-sparse GQA for the sparse
 * layers (templates/attn_sparse.lua) and dense causal GQA for the dense layers
 * (templates/attn_dense.lua).  Separate from ops.h because attention alone
 * needs a workspace and host-side bounds (the longest visible length) to size
 * its grid.
 *
 * Both kernels take the reference's arguments (m3_attn_args, m3_seq_batch,
 * ref/ref.h) with DEVICE pointers in the batch and tensors, and compute the
 * function m3_ref_sparse_attention / m3_ref_dense_attention define, to a
 * relative tolerance: P is rounded to bf16 before P·V, as vLLM does, where
 * the reference keeps fp64.  The `mode` axis picks a schedule, not a result:
 *   M3_ATTN_DECODE  - split-K: grid (splits, nkv, tokens); each CTA covers a
 *                     slice of one token's keys (dense: its history, sparse:
 *                     its selected blocks), the last CTA of a (token, KV head)
 *                     merges the slices' fp32 partials by log-sum-exp.  For
 *                     few tokens with many keys: decode, speculative verify.
 *   M3_ATTN_PREFILL - one warp per query token, walking all its keys; grid
 *                     (token groups, nkv).  For many tokens: prefill chunks.
 * Either mode accepts any batch; tests run both on the same inputs.
 *
 * Inputs the kernels trust (the reference checks them: m3_ref_batch_check):
 * token_seq in [0, n_seqs) and positions[t] < seq_lens[seq].  What they do
 * not trust, so that no input can make them read outside their arrays: a
 * visible length is clamped to min(positions[t] + 1, seq_len, bt_stride *
 * block_size); a block-table entry outside [0, num_pages) reads nothing; a
 * selection entry < 0, >= the token's visible block count, or repeating an
 * earlier entry contributes nothing and never indexes the block table (known
 * faults #6, #8).  Cache offsets are 64-bit (fault #15).
 */
#ifndef M3_OP_ATTENTION_H
#define M3_OP_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "ref/ref.h"
#include "runtime/kernels.h"

typedef enum m3_attn_mode { M3_ATTN_DECODE = 0, M3_ATTN_PREFILL = 1 } m3_attn_mode;

/* Decode launches put one CTA row per query token in grid z (CUDA's limit);
 * the workspace's arrival counters are sized for this many tokens. */
#define M3_ATTN_MAX_DECODE_TOKENS 65535

/* The semantic keys (no tile, no arch):
 *   attn_sparse(mode=,kv=,nq=,nkv=,hd=,bs=,topk=)  from a->topk
 *   attn_dense(mode=,kv=,nq=,nkv=,hd=,bs=)
 * kv is e4m3 when a->kv_e4m3.  Errors: M3_KEY. */
m3_status m3_attn_sparse_key(const m3_attn_args *a, m3_attn_mode mode, m3_variant *v, m3_err *e);
m3_status m3_attn_dense_key(const m3_attn_args *a, m3_attn_mode mode, m3_variant *v, m3_err *e);

/* Bytes of split-K workspace a decode launch of kernel k needs for a->n_tokens
 * tokens whose visible lengths are all <= max_kv_len, filling sm_count SMs
 * (m3_rt.dev.sm_count).  0 when one split suffices, always 0 for prefill, and
 * 0 for a merge=cluster tile (its splits, at most 16, are one thread-block
 * cluster and merge through distributed shared memory).
 * The split plan depends only on these inputs, k's tile and (merge=cluster)
 * the cluster width k's part places (k->mod.max_cluster), so a workspace
 * sized here fits every launch with the same or smaller arguments.
 * Layout: [M3_ATTN_MAX_DECODE_TOKENS * nkv] int32 arrival counters (256-byte
 * padded), partial outputs [tokens, nkv, splits, nq/nkv, hd] fp32, partial
 * (max, sum) [tokens, nkv, splits, nq/nkv, 2] fp32. */
size_t m3_attn_workspace_bytes(const m3_kernel *k, const m3_attn_args *a, int64_t max_kv_len, int sm_count);

/* Zero a freshly allocated workspace (device pointer) on `stream`.  Needed
 * once: every decode launch leaves the counters at zero again, so one
 * workspace serves every later launch of any shape on the same stream - but
 * not two launches running at once on different streams.  Errors: M3_CUDA. */
m3_status m3_attn_workspace_init(void *ws, size_t bytes, cudaStream_t stream, m3_err *e);

/* Everything a launch derives, without touching the GPU: the grid, the
 * decode split plan and the kernel's argument values, in the kernel's order.
 * The launchers fill it and hand its fields to cuLaunchKernel; tests and the
 * tuner may inspect it. */
typedef struct m3_attn_call {
  unsigned grid[3];
  int splits;                 /* decode: CTAs per (token, KV head) = grid[0]; prefill: 0 */
  unsigned cluster;           /* CTAs per thread-block cluster along x: splits with merge=cluster, else 1 */
  /* kernel arguments */
  const void *q, *kv;
  const int32_t *block_table;
  int64_t bt_stride, num_pages;
  int n_seqs;
  const int32_t *seq_lens, *token_seq;
  const int64_t *positions;
  const int32_t *sel;
  void *out;
  int32_t *counters;
  float *part_o, *part_ml;
  int chunk;                  /* decode: keys (dense) or selected-key slots (sparse) per split */
  int n_tokens;
  float scale2;               /* softmax scale * log2(e) */
} m3_attn_call;

/* Plan a launch of kernel k (built from m3_attn_sparse_key / _dense_key, any
 * tile): checks that a agrees with k's key, that every pointer the kernel
 * reads is given (sel only for sparse), and, for decode with more than one
 * split, that ws_bytes >= m3_attn_workspace_bytes(k, a, max_kv_len,
 * sm_count).  max_kv_len bounds every positions[t] + 1 (dense decode sizes
 * its splits by it; a longer token is still complete, its last split just
 * covers the rest).  Errors: M3_INVAL (naming the field). */
m3_status m3_attn_prepare(const m3_kernel *k, const m3_attn_args *a, const m3_seq_batch *b,
                          int64_t max_kv_len, int sm_count, const void *q, const void *kv_cache,
                          const int32_t *sel, void *out, void *ws, size_t ws_bytes, m3_attn_call *c,
                          m3_err *e);

/* Block-sparse GQA (§6.2) with kernel k from m3_attn_sparse_key: the device
 * counterpart of m3_ref_sparse_attention.
 *   q        [n_tokens, nq, hd] bf16 (contiguous, the qk-norm kernel's q_out)
 *   kv_cache [num_pages, nkv, block_size, 2*hd] bf16 | e4m3: K at [0,hd), V at [hd,2hd)
 *   sel      [nkv, n_tokens, topk] int32 logical block ids (§5.4)
 *   out      [n_tokens, nq, hd] bf16
 *   b        the paged batch with device arrays (host scalars)
 *   ws       decode split-K workspace (m3_attn_workspace_bytes; NULL if 0)
 * Errors: those of m3_attn_prepare, M3_CUDA (launch). */
m3_status m3_launch_attn_sparse(const m3_kernel *k, const m3_attn_args *a, const m3_seq_batch *b,
                                int64_t max_kv_len, int sm_count, const void *q, const void *kv_cache,
                                const int32_t *sel, void *out, void *ws, size_t ws_bytes, cudaStream_t stream,
                                m3_err *e);

/* Dense causal GQA (§6.3) with kernel k from m3_attn_dense_key: the device
 * counterpart of m3_ref_dense_attention.  Arguments as above, without sel.
 * A decode tile with lead=1 reads b's token_seq, positions, seq_lens and
 * block table before its grid wait, while kernels launched before it on
 * `stream` may still run (programmatic dependent launch, templates/lib/
 * lead.lua): no kernel on `stream` since its last host-ordered point may
 * write them.  The decode step uploads them with host copies before its
 * first kernel.  Errors: those of m3_attn_prepare, M3_CUDA. */
m3_status m3_launch_attn_dense(const m3_kernel *k, const m3_attn_args *a, const m3_seq_batch *b,
                               int64_t max_kv_len, int sm_count, const void *q, const void *kv_cache, void *out,
                               void *ws, size_t ws_bytes, cudaStream_t stream, m3_err *e);

#endif
