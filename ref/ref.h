/* ref.h - the plain-C references of every m3kit kernel (style practice 1).
 *
 * These functions are the truth: every generated GPU kernel, the autotuner's
 * validation step and the whole-model test compare against them.  They live in
 * libm3kit (not in tests/) so that `m3kit tune` can refuse a candidate that
 * disagrees with its reference.  Each reference takes its arguments in the same
 * order as the matching launcher.
 *
 * Conventions (spec shared/spec/m3-architecture.md, "§" below):
 *   - bf16 is a uint16_t bit pattern (m3_bf16), e4m3 (float8_e4m3fn) a uint8_t
 *     (m3_e4m3), E8M0 a uint8_t biased exponent; conversions in ref/numerics.h.
 *   - All math is fp32 unless a function says it deliberately uses fp64; there
 *     is exactly one rounding at each store, where §10 puts it.
 *   - Shapes are row-major, written `[rows, cols] dtype`; index arithmetic is
 *     64-bit throughout (fault 15).
 *   - Functions whose inputs can be invalid return an m3_status and leave a
 *     message in `e` (may be NULL); none aborts, prints or exits.  The few void
 *     functions document the preconditions their callers must guarantee.
 *   - Scratch memory, where needed, is one bounded malloc per call (never
 *     proportional to the whole problem); failure is M3_NOMEM.
 */
#ifndef M3_REF_H
#define M3_REF_H

#include <stdint.h>

#include "ref/numerics.h"
#include "runtime/status.h"

/* ------------------------------------------------------------------------ */
/* Shared building blocks                                                   */
/* ------------------------------------------------------------------------ */

/* fp32 dot product with a fixed summation order: 8 interleaved partial sums
 * (element k goes to lane k mod 8), combined as ((0+1)+(2+3))+((4+5)+(6+7)),
 * then the tail.  Fixed so every reference is reproducible bit for bit; the
 * 8 lanes let the compiler vectorise without -ffast-math.  Errors: none. */
float m3_ref_dot_f32(const float *a, const float *b, int64_t n);

/* fp32 -> e4m3, n values, identity scale, saturating round-to-nearest-even
 * (the index-K / fp8-KV encode entry point, §4.5, §10.7, fault 17).
 * x [n] fp32, q [n] e4m3.  NaN -> 0x7F; no finite input gives 0x7F/0xFF.
 * Errors: none. */
void m3_ref_e4m3_encode(int64_t n, const float *x, m3_e4m3 *q);

/* ------------------------------------------------------------------------ */
/* RoPE table (§3.4, §10.5)                                                 */
/* ------------------------------------------------------------------------ */

/* inv_freq[m] = 1.0f / powf(theta, (float)(2m) / (float)rotary_dim), m in
 * [0, rotary_dim/2), all fp32.  This mirrors torch's
 * `1.0 / (base ** (arange(0, R, 2, dtype=float) / R))` op by op (fp32 divide,
 * fp32 pow, fp32 reciprocal); the only possible difference is the pow
 * implementation (glibc powf is correctly rounded in practice, CUDA powf is
 * within 2 ulp; spec §12.9).  inv_freq [rotary_dim/2] fp32.
 * Preconditions: theta > 0, rotary_dim even and > 0.  Errors: none. */
void m3_rope_inv_freq(float theta, int rotary_dim, float *inv_freq);

/* The bf16 cos/sin cache: row p = [cos θ[p, 0..R/2) ‖ sin θ[p, 0..R/2)] with
 * θ[p, m] = (float)p * inv_freq[m] (one fp32 multiply), cos/sin in fp32
 * (sincosf, accurate range reduction), each rounded once to bf16.
 * table [max_pos, rotary_dim] bf16.  ~0.5 s for max_pos = 1,048,576.
 * Preconditions as m3_rope_inv_freq, max_pos >= 0.  Errors: none. */
void m3_rope_table(float theta, int rotary_dim, int64_t max_pos, m3_bf16 *table);

/* ------------------------------------------------------------------------ */
/* Gemma RMSNorm (§2.2, §10.2, §10.3)                                       */
/* ------------------------------------------------------------------------ */

/* y = x * r * (1 + w), r = 1 / sqrtf(sumsq / n + eps).  The sum of squares is
 * accumulated in fp64 and rounded once to fp32 (deliberately: the fp32 value
 * nearest the exact sum, so any GPU reduction order is within its own fp32
 * error of it); everything else is fp32 and "1 + w" is formed in fp32
 * (fault 23: w = -0.99609375 must give exactly 0.00390625).
 * x [n] fp32, w [n] bf16 (the stored offset), y [n] fp32 (may alias x).
 * Errors: none. */
void m3_ref_gemma_norm_f32(int n, const float *x, const m3_bf16 *w, float eps,
                           float *y);

/* Row-wise Gemma RMSNorm, one bf16 rounding at the store.
 * x [n_rows, n] bf16, w [n] bf16, y [n_rows, n] bf16 (may alias x).
 * Errors: none (n_rows <= 0 does nothing). */
void m3_ref_rmsnorm(int64_t n_rows, int n, const m3_bf16 *x, const m3_bf16 *w,
                    float eps, m3_bf16 *y);

/* Fused residual add + Gemma RMSNorm (vLLM's gemma_fused_add_rmsnorm):
 *   residual = bf16(float(x) + float(residual))        (the new residual stream)
 *   y        = bf16(gemma_norm(float(residual_rounded)))
 * The norm reads the ROUNDED bf16 residual.  This is m3kit's choice for the open
 * question §12.10 (HF does the same; the residual stream is bf16 in every
 * reference, so the next layer sees exactly what the norm saw).
 * x [n_rows, n] bf16 (the sublayer output), residual [n_rows, n] bf16 in/out,
 * w [n] bf16, y [n_rows, n] bf16 (must not alias residual; may alias x).
 * Errors: none. */
void m3_ref_add_rmsnorm(int64_t n_rows, int n, const m3_bf16 *x,
                        m3_bf16 *residual, const m3_bf16 *w, float eps,
                        m3_bf16 *y);

/* ------------------------------------------------------------------------ */
/* Embedding gather (§2.3)                                                  */
/* ------------------------------------------------------------------------ */

/* out[t] = table[ids[t]] (bit copy, no scaling).
 * ids [n_tokens] int32, table [vocab, hidden] bf16, out [n_tokens, hidden] bf16.
 * Errors: M3_RANGE (names the token index and the id) if an id is < 0 or
 * >= vocab; nothing is written for that token or later ones.
 * M3_INVAL for hidden <= 0 or vocab <= 0. */
m3_status m3_ref_embed(int64_t n_tokens, int hidden, int64_t vocab,
                       const int32_t *ids, const m3_bf16 *table, m3_bf16 *out,
                       m3_err *e);

/* ------------------------------------------------------------------------ */
/* Fused qk-norm + partial NeoX RoPE (+ KV / index-K insert), §4            */
/* ------------------------------------------------------------------------ */

typedef struct m3_qkr_args {
  int n_tokens;            /* N rows of qkv */
  int nq, nkv, niq;        /* q heads, kv heads, index-q heads; niq == 0 means a dense layer (no index parts) */
  int head_dim, rotary_dim;/* 128, 64 */
  int block_size;          /* page size of both caches (tokens) */
  float eps;
  int insert;              /* 1: write K,V into kv_cache and index-K into index_cache */
  int kv_e4m3;             /* main KV cache dtype: 0 bf16, 1 e4m3 (identity scale) */
  int idx_e4m3;            /* index_q_out and index cache dtype: 0 bf16, 1 e4m3 */
} m3_qkr_args;

/* Per head of every row t (the §4.1 slot table):
 *   x  = float(head)                          (bf16 -> fp32)
 *   x  = x * r * (1 + w),  r = 1/sqrtf(sumsq/hd + eps)   (m3_ref_gemma_norm_f32)
 *   x' = NeoX RoPE on dims [0, R): for m < R/2, with c, s the bf16 table values
 *        cos_sin[pos, m], cos_sin[pos, R/2 + m] upcast to fp32:
 *          x'[m]     = x[m]*c - x[m+R/2]*s
 *          x'[m+R/2] = x[m+R/2]*c + x[m]*s
 *        dims [R, hd) pass through.  One rounding at each store below.
 * Stores:
 *   Q head h   -> in place bf16 in qkv, and q_out[t, h] bf16 if q_out != NULL
 *                 (q is always written back in place: the contract of this API;
 *                 vLLM leaves it raw when q_out is given - GPU tests compare
 *                 q_out, and the in-place q only if the kernel writes it);
 *   K head g   -> in place bf16; insert: cache K half = bf16(x'), or with
 *                 kv_e4m3 e4m3(x') on sparse layers (niq > 0, from fp32) but
 *                 e4m3(bf16(x')) on dense layers (niq == 0: vLLM's generic
 *                 reshape_and_cache path rounds twice, §4.5 last bullet);
 *   V head g   -> not normed, not rotated, never written back; insert: cache V
 *                 half = the bf16 value, or e4m3(float(v));
 *   IQ head g  -> (sparse) in place bf16, and index_q_out[t, g] (bf16 or e4m3
 *                 from fp32 per idx_e4m3) if index_q_out != NULL;
 *   IK         -> (sparse) in place bf16; insert: index_cache[slot] = bf16 or
 *                 e4m3 (from fp32) per idx_e4m3.
 * qkv row layout: q [0, nq*hd), k [nq*hd, +nkv*hd), v [.., +nkv*hd), then
 * (sparse) iq [.., +niq*hd), ik [.., +hd); head h at [h*hd, h*hd+hd) of its part.
 * Cache addressing (§4.3, §4.4): page = slot / block_size, off = slot % bs;
 *   kv_cache[page][g][off][0..hd) = K, [hd..2hd) = V;
 *   index_cache[slot][0..hd).
 * A row whose slot is < 0 writes nothing to that cache (padding, §10.11).
 * positions and cos_sin are read for EVERY row 0..N-1, so callers pass
 * N = the number of valid rows (fault 5), and every position must be in
 * [0, max_pos) of the table: this function has no table length to check.
 * slot_mapping may be NULL (no main insert); index_slot_mapping NULL means
 * "same as slot_mapping" (vLLM's default).
 * Preconditions: head_dim <= 1024; rotary_dim even, <= head_dim; iq_w/ik_w
 * non-NULL when niq > 0;
 * caches non-NULL when insert and the matching slots are >= 0.  Errors: none. */
void m3_ref_qknorm_rope(const m3_qkr_args *a,
    m3_bf16 *qkv,              /* [N, row] in/out; row = (nq+2nkv)*hd (+ (niq+1)*hd if sparse) */
    const m3_bf16 *q_w, const m3_bf16 *k_w, const m3_bf16 *iq_w, const m3_bf16 *ik_w, /* [hd] gemma offsets; iq_w/ik_w NULL for dense */
    const m3_bf16 *cos_sin,    /* [max_pos, rotary_dim] from m3_rope_table */
    const int64_t *positions,  /* [N] */
    const int64_t *slot_mapping,       /* [N] main KV slots, <0 = skip (insert only) */
    const int64_t *index_slot_mapping, /* [N] index-K slots, <0 = skip (sparse insert only) */
    void *kv_cache,            /* [num_blocks, nkv, block_size, 2*hd] bf16 or e4m3: K at [0,hd), V at [hd,2hd) */
    void *index_cache,         /* [num_blocks*block_size, hd] bf16 or e4m3 */
    m3_bf16 *q_out,            /* [N, nq*hd] contiguous copy of normed+roped q (may be NULL: then only in place) */
    void *index_q_out);        /* [N, niq*hd] bf16 or e4m3 (sparse only) */

/* The unfused KV insert of a dense layer (templates/kv_insert.lua): for each
 * row t with slot_mapping[t] >= 0, K head g (already normed + rotated in
 * place, i.e. qkv after m3_ref_qknorm_rope with insert = 0) and V head g
 * copied into kv_cache at the §4.3 address, as bf16 or e4m3(float(x)).  With
 * the same a (niq must be 0), qknorm(insert 0) then this gives bit for bit
 * the caches of qknorm(insert 1).  Errors: none. */
void m3_ref_kv_insert(const m3_qkr_args *a,
    const m3_bf16 *qkv,                /* [N, (nq+2nkv)*hd] */
    const int64_t *slot_mapping,       /* [N], < 0 = skip */
    void *kv_cache);                   /* [num_blocks, nkv, block_size, 2*hd] bf16 or e4m3 */

/* ------------------------------------------------------------------------ */
/* The paged batch both the indexer and attention read (§4.2, §5.5, §6)      */
/* ------------------------------------------------------------------------ */

/* One description fits both kernel shapes:
 *   decode  - n_seqs sequences, one (or 1+k speculative) query token each:
 *             token_seq[t] = its sequence, positions[t] = seq_lens[s] - qlen + o;
 *   prefill - one chunk of one sequence: token_seq[t] = 0,
 *             positions[t] = context_len + t, seq_lens[0] = context_len + chunk.
 * Query t sees keys j <= positions[t], j < seq_lens[s]: visible length
 * L(t) = positions[t] + 1 and nb(t) = ceil(L(t) / block_size) visible blocks.
 * Key j of sequence s lives in page block_table[s * bt_stride + j / bs] at
 * offset j % bs.  Only the block-table entries of visible blocks are read
 * (and range-checked), so unused tails may hold anything (fault 6). */
typedef struct m3_seq_batch {
  int n_seqs;
  const int32_t *seq_lens;     /* [n_seqs] T: tokens cached, this step's included */
  const int32_t *block_table;  /* [n_seqs, bt_stride] logical block -> physical page */
  int64_t bt_stride;           /* elements between block-table rows (>= max nb) */
  int64_t num_pages;           /* pages in the caches (range check of the table) */
  const int32_t *token_seq;    /* [n_tokens] sequence of each query token */
  const int64_t *positions;    /* [n_tokens] absolute position i of each query */
} m3_seq_batch;

/* Validates a batch for n_tokens queries and pages of block_size tokens:
 * every token_seq in [0, n_seqs), every position in [0, seq_len), nb(t) <=
 * bt_stride and <= max_blocks (pass INT64_MAX to skip that bound), and every
 * block-table entry of a visible block in [0, num_pages).  The indexer and the
 * attention references call it first; runtime code may call it too.
 * Errors: M3_INVAL (NULL arrays, block_size <= 0), M3_RANGE (names the token,
 * the sequence and the offending value). */
m3_status m3_ref_batch_check(const m3_seq_batch *b, int64_t n_tokens,
                             int block_size, int64_t max_blocks, m3_err *e);

/* ------------------------------------------------------------------------ */
/* Lightning indexer: block scores and top-k block selection (§5)           */
/* ------------------------------------------------------------------------ */

typedef struct m3_idx_args {
  int n_tokens;       /* query tokens of the batch */
  int n_heads;        /* index heads = KV heads (4; no head reduction, §11) */
  int head_dim;       /* 128 */
  int block_size;     /* 128: one sparse block is one KV page */
  int topk;           /* 16 */
  int init_blocks;    /* 0: forced leading blocks */
  int local_blocks;   /* 1: forced trailing blocks (the query's own) */
  int idx_e4m3;       /* iq and index cache dtype: 0 bf16, 1 e4m3 */
  int max_blocks;     /* row stride of score buffers, >= every nb(t) */
} m3_idx_args;

/* Token-level scores s_g(t, j) = Σ_d iq[t, g, d] * ik[j, d] (§5.1): both
 * operands decoded to fp32 (e4m3 and bf16 are exact there), m3_ref_dot_f32;
 * no scale, no ReLU.  For testing layouts (fault 14) and the zero-key case
 * (fault 18).
 * iq [n_tokens, n_heads, head_dim] bf16|e4m3; index_cache [num_pages*bs, hd]
 * bf16|e4m3; s [n_heads, n_tokens, ld] fp32, entries j >= L(t) set to -inf.
 * Errors: M3_INVAL (bad args, ld < a visible length), M3_RANGE (bad sequence
 * id, position outside [0, seq_len), block-table entry outside [0, num_pages)). */
m3_status m3_ref_index_token_scores(const m3_idx_args *a, const m3_seq_batch *b,
                                    const void *iq, const void *index_cache,
                                    float *s, int64_t ld, m3_err *e);

/* Block scores S_g(t, b) = max over visible j in block b of s_g(t, j) (§5.2),
 * raw (no forcing).  A NaN token score poisons its block (the block score is
 * NaN, which top-k turns into -1e30), so a NaN is never chosen ahead of a
 * finite block whatever max the GPU uses.  This is what the prefill score
 * kernel writes.  scores [n_heads, n_tokens, max_blocks] fp32; entries
 * b >= nb(t) are -inf (a GPU kernel may leave them unwritten: compare b < nb(t)).
 * Errors: as m3_ref_index_token_scores. */
m3_status m3_ref_index_scores(const m3_idx_args *a, const m3_seq_batch *b,
                              const void *iq, const void *index_cache,
                              float *scores, m3_err *e);

/* The forcing step (§5.3) in place on visible blocks: init blocks (b < init)
 * -> 1e30, then local blocks (b >= nb - local) -> 1e29 (local wins), NaN
 * -> -1e30.  The decode score kernel folds this into its scores; compare its
 * buffer against raw scores passed through here.  Idempotent.
 * scores [n_heads, n_tokens, max_blocks] fp32.  Errors: as above. */
m3_status m3_ref_index_force(const m3_idx_args *a, const m3_seq_batch *b,
                             float *scores, m3_err *e);

/* Top-k over the visible blocks of each (g, t) after forcing (applied here, so
 * raw or already-forced scores give the same answer): descending score, ties
 * -> lower block id, K' = min(topk, nb(t)) entries, entries [K', topk) = -1.
 * scores [n_heads, n_tokens, max_blocks] fp32 (not modified);
 * topk_out [n_heads, n_tokens, topk] int32 logical block ids (§5.4).
 * Errors: as above. */
m3_status m3_ref_index_topk(const m3_idx_args *a, const m3_seq_batch *b,
                            const float *scores, int32_t *topk_out, m3_err *e);

/* The whole indexer: scores + forcing + top-k, one token at a time (scratch is
 * n_heads * max_blocks floats, so 64K-token prefills need no huge buffer).
 * iq, index_cache as m3_ref_index_scores; topk_out as m3_ref_index_topk.
 * Errors: as above, M3_NOMEM. */
m3_status m3_ref_indexer(const m3_idx_args *a, const m3_seq_batch *b,
                         const void *iq, const void *index_cache,
                         int32_t *topk_out, m3_err *e);

/* ------------------------------------------------------------------------ */
/* Attention over the paged KV cache (§6)                                   */
/* ------------------------------------------------------------------------ */

typedef struct m3_attn_args {
  int n_tokens;     /* query tokens */
  int nq, nkv;      /* query heads, KV heads; GQA group: g = h / (nq / nkv) */
  int head_dim;     /* 128 */
  int block_size;   /* page size = sparse block size */
  int kv_e4m3;      /* KV cache dtype: 0 bf16, 1 e4m3 (dequantised x 1.0) */
  int topk;         /* entries per selection row (sparse only) */
  float scale;      /* softmax scale; 0 means 1/sqrt(head_dim) (§3.5) */
} m3_attn_args;

/* Block-sparse GQA (§6.2).  For query t, head h, g = h / (nq/nkv): keys are
 * the visible tokens (j <= pos, j < T) of the blocks listed in sel[g, t, :];
 * entries < 0 or >= nb(t) contribute nothing (fault 6), all topk entries are
 * read, and a repeated id counts once (set semantics; top-k never repeats).
 * Blocks are visited in list order.  Math: logits z = fp32 dot(q, K) * scale;
 * softmax and the P·V sum in fp64 with an online max (mathematically exact up
 * to fp64 rounding); the output is acc/den rounded fp64 -> fp32 -> bf16 (the
 * double step can differ from a direct rounding only on exact fp32 ties).
 * head_dim <= 1024.  The GPU rounds P to
 * bf16 before P·V, so GPU tests use a relative tolerance (~1e-2).  A query with
 * no key (impossible with a well-formed selection) outputs zeros.
 * q [N, nq, hd] bf16; kv_cache [num_pages, nkv, bs, 2*hd] bf16|e4m3;
 * sel [nkv, N, topk] int32 logical block ids; out [N, nq, hd] bf16.
 * Errors: M3_INVAL (bad args, nq % nkv != 0), M3_RANGE (as the indexer),
 * M3_NOMEM. */
m3_status m3_ref_sparse_attention(const m3_attn_args *a, const m3_seq_batch *b,
                                  const m3_bf16 *q, const void *kv_cache,
                                  const int32_t *sel, m3_bf16 *out, m3_err *e);

/* Dense causal GQA (§6.3): every visible key j < L(t), same math as above,
 * keys in position order.  a->topk is ignored.  Errors: as above. */
m3_status m3_ref_dense_attention(const m3_attn_args *a, const m3_seq_batch *b,
                                 const m3_bf16 *q, const void *kv_cache,
                                 m3_bf16 *out, m3_err *e);

/* ------------------------------------------------------------------------ */
/* Linear layers: bf16 GEMM, MXFP8 dequant and W8A16 (§8, §10.1)            */
/* ------------------------------------------------------------------------ */

/* A weight [rows, cols] as stored: either bf16, or MXFP8 (e4m3 values + one
 * E8M0 scale per 32 consecutive elements of a row).  Exactly one of bf16 / q
 * is non-NULL.  To view rows [r0, r1) of a packed weight (e.g. the gate half
 * of [w1; w3]) offset the pointers by r0 rows. */
typedef struct m3_ref_weight {
  int64_t rows, cols;
  const m3_bf16 *bf16;   /* [rows, cols] bf16, or NULL */
  const m3_e4m3 *q;      /* [rows, cols] e4m3, or NULL */
  const uint8_t *scale;  /* [rows, cols/32] E8M0 (with q) */
} m3_ref_weight;

/* out[r, c] = bf16(float(q[r, c]) * 2^(scale[r, c/32] - 127)), exact when the
 * product is in bf16 range (it always is for real checkpoints); scale 255 (NaN
 * by the OCP MX spec) gives NaN.
 * q [rows, cols] e4m3, scale [rows, cols/32] uint8, out [rows, cols] bf16.
 * Errors: M3_INVAL if cols is not a positive multiple of 32 or rows < 0. */
m3_status m3_ref_mxfp8_dequant(int64_t rows, int64_t cols, const m3_e4m3 *q,
                               const uint8_t *scale, m3_bf16 *out, m3_err *e);

/* y[t, r] = bf16( Σ_c float(x[t, c]) * float(w[r, c]) ), fp32 accumulate in
 * the m3_ref_dot_f32 order.  x [n, cols] bf16, w [rows, cols] bf16,
 * y [n, rows] bf16 (must not alias x).  Errors: M3_INVAL, M3_NOMEM. */
m3_status m3_ref_gemm_bf16(int64_t n, int64_t rows, int64_t cols,
                           const m3_bf16 *x, const m3_bf16 *w, m3_bf16 *y,
                           m3_err *e);

/* W8A16 (Marlin on Hopper, §8): the same contract as m3_ref_gemm_bf16 with
 * w = m3_ref_mxfp8_dequant(q, scale) - "bf16 GEMM with the dequantised weights,
 * fp32 accumulation".  q [rows, cols] e4m3, scale [rows, cols/32].
 * Errors: M3_INVAL (cols % 32), M3_NOMEM. */
m3_status m3_ref_gemm_w8a16(int64_t n, int64_t rows, int64_t cols,
                            const m3_bf16 *x, const m3_e4m3 *q,
                            const uint8_t *scale, m3_bf16 *y, m3_err *e);

/* y [n, w->rows] = x [n, w->cols] · wᵀ, dispatching on the weight's format.
 * Errors: M3_INVAL (no/both formats, shapes), M3_NOMEM. */
m3_status m3_ref_linear(int64_t n, const m3_bf16 *x, const m3_ref_weight *w,
                        m3_bf16 *y, m3_err *e);

/* ------------------------------------------------------------------------ */
/* MoE: router, SwiGLU-OAI, expert MLP, combine, grouping (§7, §10.9)        */
/* ------------------------------------------------------------------------ */

/* out = g' * sigmoid(alpha * g') * (u' + beta), g' = min(g, limit) (upper
 * clamp only), u' = clamp(u, -limit, limit), fp32 (§7.3).  The clamps are
 * comparisons, not fminf, so a NaN input gives NaN (never a silent limit).
 * M3: alpha 1.702, limit 7, beta 1.  Errors: none. */
float m3_swiglu_oai_f32(float gate, float up, float alpha, float limit,
                        float beta);

/* Elementwise on bf16: out[i] = bf16(m3_swiglu_oai_f32(float(gate[i]),
 * float(up[i]), ...)).  gate, up, out [n] bf16 (out may alias either).
 * Errors: none. */
void m3_ref_swiglu_oai(int64_t n, const m3_bf16 *gate, const m3_bf16 *up,
                       float alpha, float limit, float beta, m3_bf16 *out);

typedef struct m3_route_args {
  int n_tokens;
  int n_experts;          /* 128 */
  int topk;               /* 4 */
  int renormalize;        /* 1: w = s / Σ s over the chosen (M3); 0: w = s */
  float routed_scaling;   /* 2.0, applied to the weights in both modes */
  int logits_bf16;        /* logits are bf16 (upcast) instead of fp32 */
} m3_route_args;

/* Router selection (§7.2): s = sigmoid(logit) (fp32), choice = s + bias
 * (bias may be NULL = 0), top-k of choice by a comparison scan (no sentinel
 * value, fault 21; ties -> lower expert id; a NaN choice is never taken ahead
 * of a number), weights from the UNBIASED s kept aside (never (s+b)-b,
 * fault 20), renormalised if asked (fp32 sum in top-k order), times
 * routed_scaling.
 * logits [n_tokens, n_experts] fp32 or bf16; bias [n_experts] fp32;
 * ids [n_tokens, topk] int32 in selection order; w [n_tokens, topk] fp32.
 * Errors: M3_INVAL (topk outside [1, n_experts], ...). */
m3_status m3_ref_route(const m3_route_args *a, const void *logits,
                       const float *bias, int32_t *ids, float *w, m3_err *e);

/* Router logits, all fp32 (§10.1): logits[t, e] = fp32(m[t]) · wg[e].
 * m [n, hidden] bf16, wg [n_experts, hidden] fp32, logits [n, n_experts] fp32.
 * Errors: none. */
void m3_ref_router_logits(int64_t n, int hidden, int n_experts,
                          const m3_bf16 *m, const float *wg, float *logits);

/* One SwiGLU-OAI MLP (a routed expert, the shared expert, or the dense MLP of
 * layers 0-2): gate = bf16(x·gateᵀ), up = bf16(x·upᵀ),
 * act = bf16(swiglu_oai(gate, up)), out = bf16(act·downᵀ)  (§7.1, §10.1).
 * gate/up weights [inter, hidden], down [hidden, inter], bf16 or MXFP8; x
 * [n, hidden] bf16, out [n, hidden] bf16.  Scratch: 3 * 32 * inter bf16 (32-token
 * chunks) plus the GEMM scratch.
 * Errors: M3_INVAL (shapes), M3_NOMEM. */
m3_status m3_ref_mlp(int64_t n, const m3_bf16 *x, const m3_ref_weight *gate,
                     const m3_ref_weight *up, const m3_ref_weight *down,
                     float alpha, float limit, float beta, m3_bf16 *out,
                     m3_err *e);

typedef struct m3_moe_args {
  int n_tokens;
  int hidden;             /* 6144 */
  int n_experts;          /* 128 */
  int topk;               /* 4 */
  int renormalize;        /* 1 */
  float routed_scaling;   /* 2.0 */
  float alpha, limit, beta; /* SwiGLU-OAI: 1.702, 7, 1 */
} m3_moe_args;

/* The MoE layer (§7.2).  Per token: router (m3_ref_router_logits, then
 * m3_ref_route), each chosen expert's bf16 output y_k (m3_ref_mlp), and the
 * combine, m3kit's choice for §12.6:
 *   out = bf16( (Σ_k w_k * float(y_k)  accumulated in fp32 in top-k order)
 *               + float(shared) )
 * with w_k already including routed_scaling and shared the bf16 output of the
 * shared expert (omitted when shared_gate is NULL).  Scaling the weights and
 * vLLM's scaling of the routed sum agree bit for bit: x2.0 is exact in fp32.
 * Experts run per chunk of tokens grouped by expert (weights decoded once per
 * chunk); results do not depend on the chunking.
 * m [N, hidden] bf16; wg [E, hidden] fp32; bias [E] fp32 (may be NULL);
 * w1, w3 [E] expert gate / up weights [inter, hidden]; w2 [E] down
 * [hidden, inter]; shared_* likewise (may all be NULL); out [N, hidden] bf16;
 * ids [N, topk] int32 and w [N, topk] fp32 receive the routing (may be NULL).
 * Errors: M3_INVAL (shapes), M3_NOMEM. */
m3_status m3_ref_moe(const m3_moe_args *a, const m3_bf16 *m, const float *wg,
                     const float *bias, const m3_ref_weight *w1,
                     const m3_ref_weight *w3, const m3_ref_weight *w2,
                     const m3_ref_weight *shared_gate,
                     const m3_ref_weight *shared_up,
                     const m3_ref_weight *shared_down, m3_bf16 *out,
                     int32_t *ids, float *w, m3_err *e);

/* Token -> expert grouping, the contract of the GPU permute kernel.
 * Pairs p = t*topk + k are grouped by expert ids[p]:
 *   counts[e]  = pairs routed to e;  offsets[e] = Σ_{e'<e} counts[e'],
 *   offsets[E] = N*topk;  perm[offsets[e] + r] = the r-th pair of e in
 *   ascending p (stable).  A GPU kernel using atomics may order pairs inside
 *   an expert differently: compare counts/offsets exactly and perm per expert
 *   as a set, unless the kernel claims stability.
 * ids [N, topk] int32; counts [E], offsets [E+1], perm [N*topk] int32.
 * Errors: M3_RANGE (an id outside [0, E), naming the pair). */
m3_status m3_ref_moe_group(int64_t n_tokens, int topk, int n_experts,
                           const int32_t *ids, int32_t *counts,
                           int32_t *offsets, int32_t *perm, m3_err *e);

/* ------------------------------------------------------------------------ */
/* Sampling                                                                 */
/* ------------------------------------------------------------------------ */

/* Greedy: out[r] = argmax over the row, ties -> lower id, NaN never chosen.
 * logits [n_rows, vocab] fp32 or bf16 (logits_bf16); out [n_rows] int32.
 * Errors: M3_NUMERICS if a row is all NaN (names the row), M3_INVAL. */
m3_status m3_ref_greedy(int64_t n_rows, int64_t vocab, const void *logits,
                        int logits_bf16, int32_t *out, m3_err *e);

/* The counter-based generator, keyed so a GPU thread can reproduce any draw
 * without state: with mix(z) the splitmix64 step
 *   z += 0x9E3779B97F4A7C15; z = (z ^ z>>30) * 0xBF58476D1CE4E5B9;
 *   z = (z ^ z>>27) * 0x94D049BB133111EB; z ^= z>>31
 * m3_rng_u64 = mix(mix(mix(seed) ^ step) ^ row), and
 * m3_rng_uniform = (float)(m3_rng_u64 >> 40) * 2^-24, in [0, 1), exact.
 * Errors: none. */
uint64_t m3_rng_u64(uint64_t seed, uint64_t step, uint64_t row);
float m3_rng_uniform(uint64_t seed, uint64_t step, uint64_t row);

typedef struct m3_sample_args {
  int64_t n_rows, vocab;
  int logits_bf16;      /* logits dtype: 0 fp32, 1 bf16 */
  float temperature;    /* <= 0: greedy */
  float top_p;          /* (0, 1]; <= 0: greedy */
  uint64_t seed, step;  /* generator key; row = the row index */
} m3_sample_args;

/* Temperature + top-p, exactly (fp32 throughout):
 *   x_i = float(logit_i) / temperature; NaN logits are excluded (never drawn);
 *   m = max x; e_i = expf(x_i - m) (if m = +inf: e_i = 1 for the +inf
 *   logits, 0 otherwise);
 *   order ids by (x desc, id asc); Z = Σ e_i in that order; p_i = e_i / Z;
 *   c_k = p_0 + ... + p_k in that order; keep the smallest prefix with
 *   c_k >= top_p (all if rounding never gets there);
 *   u = m3_rng_uniform(seed, step, row); r = u * c_last_kept;
 *   pick the first kept k with c_k > r (the last kept one if none).
 * A GPU kernel that uses the same orders reproduces it bit for bit.
 * logits [n_rows, vocab]; out [n_rows] int32.  Scratch: vocab (id, x) pairs.
 * Errors: M3_NUMERICS (all-NaN row), M3_INVAL, M3_NOMEM. */
m3_status m3_ref_sample_top_p(const m3_sample_args *a, const void *logits,
                              int32_t *out, m3_err *e);

#endif
