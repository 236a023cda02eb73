/* ops.h - launchers: one per kernel family, taking the same arguments as its
 * C reference in ref/ref.h (plus the kernel and a stream), so tests, the tuner
 * and the forward pass call a kernel exactly as they call its reference.
 * Pointers are device pointers unless stated.  Each builds its variant key
 * from the arguments (m3_*_key) so that callers never spell keys by hand. */
#ifndef M3_OPS_H
#define M3_OPS_H

#include "ref/ref.h"
#include "runtime/kernels.h"

/* ---- qk-norm + RoPE (+ insert), spec §4; templates/qknorm_rope.lua ---- */

/* The semantic key of a qk-norm+RoPE call (no tile, no arch). */
m3_status m3_qknorm_key(const m3_qkr_args *a, m3_variant *v, m3_err *e);

/* Launch kernel k (built from m3_qknorm_key(a) with any tile) over a->n_tokens
 * rows.  Differences from m3_ref_qknorm_rope, by design (vLLM's contract):
 * q goes to q_out when q_out != NULL (qkv's q is then left as it was), index-q
 * to index_q_out when given (else in place, bf16 only); with insert, a row
 * whose slot_mapping entry is < 0 is padding and is skipped entirely (nothing
 * read or written for it), and rows whose position is outside [0, max_pos)
 * are skipped too, so no kernel ever reads past the cos/sin table (known
 * faults #5, #24).  Errors: M3_INVAL (n_tokens < 0, a tile lph that does
 * not divide 32, or n_tokens x head slots >= 2^31: the kernel indexes head
 * slots in 32 bits, ~28M tokens a launch at minimax-m3's 77 slots),
 * M3_CUDA (launch). */
m3_status m3_launch_qknorm_rope(const m3_kernel *k, const m3_qkr_args *a, void *qkv, const void *q_w,
                                const void *k_w, const void *iq_w, const void *ik_w, const void *cos_sin,
                                int64_t max_pos, const int64_t *positions, const int64_t *slot_mapping,
                                const int64_t *index_slot_mapping, void *kv_cache, void *index_cache,
                                void *q_out, void *index_q_out, cudaStream_t stream, m3_err *e);

/* ---- the unfused dense-layer KV insert; templates/kv_insert.lua ---- */

/* Key of kv_insert for a (a->niq must be 0: dense layers only). */
m3_status m3_kv_insert_key(const m3_qkr_args *a, m3_variant *v, m3_err *e);

/* K and V of a->n_tokens dense qkv rows into kv_cache, as m3_ref_kv_insert;
 * rows with slot < 0 skipped.  Errors: M3_INVAL (a->niq != 0), M3_CUDA. */
m3_status m3_launch_kv_insert(const m3_kernel *k, const m3_qkr_args *a, const void *qkv,
                              const int64_t *slot_mapping, void *kv_cache, cudaStream_t stream, m3_err *e);

#endif
