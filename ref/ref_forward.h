/* ref_forward.h - the whole-model CPU reference forward (small models only):
 * the oracle of the whole-model GPU test (tests/check_forward_gpu.c).
 *
 * It is nothing but the per-kernel references of ref/ref.h called in the
 * order of spec §2.3/§2.4, over paged caches laid out exactly as the GPU's
 * (§4.3, §4.4), so that a disagreement between the GPU forward and this one
 * is a bug in the GPU forward's plumbing or in a kernel, never a second
 * opinion about the model:
 *
 *   r = embed(ids)                               m3_ref_embed
 *   a = rmsnorm(r, input_norm[0])                m3_ref_rmsnorm
 *   per layer l:
 *     P = a · W_qkvᵀ                             m3_ref_linear, W_qkv = [q;k;v(;iq;ik)] fused at load (§3.2)
 *     q, iq = qknorm_rope(P) + insert K/V/ik    m3_ref_qknorm_rope (insert=1)
 *     dense:  o = dense_attention(q)             m3_ref_dense_attention
 *     sparse: sel = indexer(iq); o = sparse_attention(q, sel)
 *     x = o · W_oᵀ                               m3_ref_linear
 *     r += x; m = rmsnorm(r, post_norm)          m3_ref_add_rmsnorm
 *     f = mlp(m) or moe(m) (+ shared expert)     m3_ref_mlp / m3_ref_moe
 *     r += f; a = rmsnorm(r, next input_norm, or the final norm after the last layer)
 *   logits = a · lm_headᵀ                        fp32 dots (m3_ref_dot_f32), NOT rounded
 *
 * Rounding: the residual stream is bf16 and each add+norm follows
 * m3_ref_add_rmsnorm's contract (the norm reads the rounded residual, §12.10).
 * Logits are returned in fp32 without a bf16 rounding (vLLM rounds the
 * lm_head output to bf16; keeping fp32 makes greedy ties rarer and costs the
 * GPU test nothing: its tolerance is normwise).
 *
 * Every op works row by row (GEMMs are per-row dots in a fixed order, the MoE
 * groups tokens but combines per token), so the logits of a token do not depend
 * on how the prompt was chunked or on which other sequences share the step:
 * chunked prefill, unchunked prefill and prefill-then-decode agree bit for bit
 * (tests/check_forward_ref.c checks it).
 *
 * Layering: this file depends on runtime/config.h and runtime/ckpt_names.h
 * (host-only code) to read a checkpoint; nothing in it touches a GPU.
 */
#ifndef M3_REF_FORWARD_H
#define M3_REF_FORWARD_H

#include <stdint.h>

#include "ref/ref.h"
#include "runtime/ckpt_names.h"
#include "runtime/config.h"

/* One decoder layer's weights, host copies (aligned, owned by the model). */
typedef struct m3_ref_layer {
  int sparse, moe;                  /* config is_sparse[l], is_moe[l] */
  m3_bf16 *input_norm, *post_norm;  /* [H] bf16 Gemma offsets */
  m3_bf16 *q_norm, *k_norm;         /* [hd] */
  m3_bf16 *iq_norm, *ik_norm;       /* [index_dim] (sparse only, else NULL) */
  m3_ref_weight qkv;                /* [row, H], row = m3_config_qkv_width (§3.2) */
  m3_ref_weight o;                  /* [H, nq*hd] */
  m3_ref_weight gate, up, down;     /* dense MLP: [F, H], [F, H], [H, F] */
  float *router;                    /* MoE: [E, H] fp32 */
  float *bias;                      /* MoE: [E] fp32 e_score_correction_bias, NULL if unused */
  m3_ref_weight *w1, *w3, *w2;      /* MoE: [E] each; [I, H], [I, H], [H, I] */
  m3_ref_weight sh_gate, sh_up, sh_down; /* shared expert (rows 0 when absent) */
} m3_ref_layer;

typedef struct m3_ref_model {
  m3_config cfg;
  m3_bf16 *embed;          /* [V, H] */
  m3_bf16 *final_norm;     /* [H] */
  m3_bf16 *lm_head;        /* [V, H] (== embed when tied) */
  m3_ref_layer *layers;    /* [L] */
  m3_bf16 *rope;           /* [max_position_embeddings, rotary_dim] bf16 (m3_rope_table) */
  int mxfp8;               /* some linear weights are MXFP8 */
  void **owned;            /* every allocation, freed by m3_ref_model_free */
  int n_owned, cap_owned;
} m3_ref_model;

/* Copy every weight of a bound checkpoint into host memory and fuse the QKV
 * projections.  BF16 linears stay bf16; MXFP8 linears stay MXFP8 (the
 * references run them as W8A16), except that a fused QKV whose parts mix
 * formats is dequantised to bf16 (lossless, §8).  F32 norm weights are
 * rounded to bf16 (the model's norms are bf16, §3.1); routers and the bias are
 * kept fp32.  The RoPE table covers max_position_embeddings positions
 * (128 B per position: fine for small test configs, 128 MiB for the real one).
 * Errors: M3_NOMEM, M3_FORMAT (a tensor the references cannot take: MXFP8
 * with a width not a multiple of 32), M3_NOTFOUND (a role the config needs is
 * missing from the binding). */
m3_status m3_ref_model_load(const m3_config *c, const m3_ckpt *k, m3_ref_model **out, m3_err *e);
void m3_ref_model_free(m3_ref_model *m);

/* Paged caches and sequences.  Page size = sparse_block_size (one sparse
 * block is one page, §4.2).  Each sequence owns max_ctx/bs pages, assigned
 * through the block table in a scrambled order (physical != logical) so that
 * block-table bugs cannot hide behind an identity mapping. */
typedef struct m3_ref_state {
  const m3_ref_model *m;
  int kv_e4m3, idx_e4m3;   /* main KV and index-K cache dtypes */
  int n_seqs;
  int64_t max_ctx;         /* tokens per sequence the state can hold */
  int64_t bt_stride;       /* blocks per sequence = ceil(max_ctx / bs) */
  int64_t num_pages;       /* n_seqs * bt_stride */
  void **kv;               /* [L] -> [num_pages, nkv, bs, 2*hd] bf16|e4m3 */
  void **ix;               /* [L] -> [num_pages*bs, index_dim] bf16|e4m3 (sparse layers; NULL otherwise) */
  int32_t *block_table;    /* [n_seqs, bt_stride] logical block -> page */
  int32_t *seq_lens;       /* [n_seqs] tokens cached */
  int force_dense;         /* debug: sparse layers run dense attention (still insert index-K) */
  int32_t *sel_out;        /* debug, may be NULL: receives every sparse layer's selection of the
                              next step, [L][nkv][n_tokens][topk] int32 (dense layers' slices
                              untouched) - the GPU test compares the GPU indexer with it */
  /* Selection statistics of the last step, summed over sparse layers, tokens
   * and KV heads: visible blocks, and blocks the top-k left out. */
  int64_t stat_visible_blocks, stat_dropped_blocks;
} m3_ref_state;

/* Errors: M3_INVAL (n_seqs <= 0, max_ctx <= 0), M3_NOMEM.  The caches start
 * zeroed; nothing reads a slot before it is written. */
m3_status m3_ref_state_create(const m3_ref_model *m, int n_seqs, int64_t max_ctx, int kv_e4m3,
                              int idx_e4m3, m3_ref_state **out, m3_err *e);
void m3_ref_state_free(m3_ref_state *s);
/* Forget every sequence's tokens (caches are simply overwritten later). */
void m3_ref_state_reset(m3_ref_state *s);

/* One forward step over n_tokens tokens: token t belongs to sequence seq[t]
 * and is appended to it, in order (a prefill chunk is n tokens of one
 * sequence; a batched decode step is one token for each of several
 * sequences; any mix works).  Token t gets position seq_len[seq[t]] + (number
 * of earlier tokens of the same sequence in this step), its K/V/index-K are
 * inserted before any attention of the step runs, and it attends causally.
 * ids [n_tokens] int32; logits [n_tokens, vocab] fp32 (may be NULL).
 * On success every sequence's length grows by its token count; on error no
 * length changes (the caches may hold partial writes past the old lengths,
 * which later steps overwrite).
 * Errors: M3_INVAL (n_tokens <= 0, NULL arrays, sequence out of range),
 * M3_RANGE (a token id outside [0, vocab), naming it; a position >=
 * max_position_embeddings), M3_CAPACITY (a sequence would exceed max_ctx),
 * M3_NOMEM, and whatever the references return. */
m3_status m3_ref_step(m3_ref_state *s, int n_tokens, const int32_t *seq, const int32_t *ids,
                      float *logits, m3_err *e);

/* Prefill n tokens of sequence `seq` in chunks of `chunk` tokens (<= 0: one
 * chunk), i.e. ceil(n/chunk) calls of m3_ref_step.  last_logits [vocab] fp32
 * receives the logits of the final token (may be NULL); all_logits
 * [n, vocab] those of every token (may be NULL).  Errors: as m3_ref_step. */
m3_status m3_ref_prefill(m3_ref_state *s, int seq, int n, const int32_t *ids, int chunk,
                         float *last_logits, float *all_logits, m3_err *e);

#endif
