/* op_ffn.h - launchers of the FFN-side kernels: RMSNorm, embedding gather,
 * MoE routing / grouping / combine, SwiGLU-OAI, MXFP8 dequant and the decode
 * GEMVs, sampling; plus the whole MoE layer on the GPU (spec §2.2, §2.3, §7,
 * §8, §10).
 *
 * As ops.h: each launcher takes the arguments of its C reference in ref/ref.h
 * (same structs, same order, device pointers), plus the kernel and a stream;
 * each key function builds the variant key from those arguments, so callers
 * never spell keys.  A launcher checks that the kernel it is handed was built
 * for those arguments (M3_INVAL otherwise) and that vector-path pointers are
 * 16-byte aligned.  Launches are asynchronous; the functions that must read a
 * result back (error words, sampling) say that they synchronise.
 *
 * Error words: kernels that can meet bad input (embedding ids, expert ids)
 * never fault on it; they record the first bad item in an int32 in device
 * memory that the caller zeroes once (cudaMemset) and reads back with
 * m3_err_word_take: 0 means none, otherwise INT32_MAX - index of the smallest
 * bad item.
 */
#ifndef M3_OP_FFN_H
#define M3_OP_FFN_H

#include <stdint.h>

#include "ref/ref.h"
#include "runtime/gemm.h"
#include "runtime/kernels.h"

/* Read and clear an error word; synchronises `stream`.  *first_bad = -1 when
 * the word was clear.  Errors: M3_CUDA. */
m3_status m3_err_word_take(int32_t *err_word, cudaStream_t stream, int64_t *first_bad, m3_err *e);

/* ---- Gemma RMSNorm, §2.2; templates/rmsnorm.lua ------------------------ */

/* Key rmsnorm(add, f32copy, combine=0, n): x read as it is.  Errors: M3_KEY. */
m3_status m3_rmsnorm_key(int add, int f32copy, int n, m3_variant *v, m3_err *e);
/* Key rmsnorm(add=1, f32copy, combine=topk, n): x formed from the decode MoE
 * layer's expert outputs (m3_launch_add_rmsnorm_combine).  Errors: M3_KEY. */
m3_status m3_rmsnorm_combine_key(int topk, int f32copy, int n, m3_variant *v, m3_err *e);

/* m3_ref_rmsnorm: y = bf16(x * r * (1 + w)) per row, one CTA per row (tile
 * cluster=C > 1, sm_90: C CTAs a row, one thread-block cluster).
 * x [n_rows, n] bf16 (may alias y), w [n] bf16, y [n_rows, n] bf16;
 * y32 [n_rows, n] fp32 = float(y) when the kernel has f32copy=1 (else NULL).
 * Matches the reference within 1 bf16 ulp (fp32 sum-of-squares order).
 * Errors: M3_INVAL (kernel/argument mismatch, n_rows > INT32_MAX,
 * misaligned pointer, a tile cluster outside 1..8, n_rows x cluster CTAs
 * over 2^31-1), M3_CUDA (a cluster the part cannot place among them). */
m3_status m3_launch_rmsnorm(const m3_kernel *k, int64_t n_rows, int n, const void *x, const void *w, float eps,
                            void *y, float *y32, cudaStream_t stream, m3_err *e);

/* m3_ref_add_rmsnorm: residual = bf16(x + residual) (bit-exact), y = the norm
 * of that rounded residual.  residual [n_rows, n] bf16 in/out (must not alias
 * y); the rest as m3_launch_rmsnorm.  Errors: as m3_launch_rmsnorm. */
m3_status m3_launch_add_rmsnorm(const m3_kernel *k, int64_t n_rows, int n, const void *x, void *residual,
                                const void *w, float eps, void *y, float *y32, cudaStream_t stream, m3_err *e);

/* The decode MoE combine (§7.2 / §12.6) and the add + RMSNorm after it
 * (§2.3, §10.2) in one launch, one CTA per row (token; tile cluster=C: C
 * CTAs a row, one thread-block cluster, as m3_launch_rmsnorm): per element
 *   x = bf16(sum_k ew[t,k] * ey[t*K+k] (fp32, top-k order) + esh[t])
 * exactly as m3_launch_moe_combine (shared, no row map) computes it, then
 * m3_launch_add_rmsnorm on that x - residual and y are those two launches'
 * bit for bit (x itself is never stored).  K = topk = the kernel's combine
 * axis (m3_rmsnorm_combine_key).  ey [n_rows * K, n] bf16 (routed pair
 * t*K + k in row t*K + k: the decode GEMV's pair order), ew [n_rows, K] fp32
 * (routed_scaling applied), esh [n_rows, n] bf16 the shared expert's output
 * (m3_moe_forward_pending hands back all three); residual [n_rows, n] bf16
 * in/out, w [n] bf16, y [n_rows, n] bf16 and y32 as m3_launch_add_rmsnorm.
 * y must not overlap ey, esh or residual (other CTAs still read them).
 * ey, esh, residual, w, y (and y32) 16-byte aligned when n % 8 == 0, ew
 * 4-byte.  Errors: M3_INVAL (kernel/argument mismatch, topk < 1, n_rows >
 * INT32_MAX, misaligned or aliased pointers), M3_CUDA. */
m3_status m3_launch_add_rmsnorm_combine(const m3_kernel *k, int64_t n_rows, int n, int topk, const void *ey,
                                        const float *ew, const void *esh, void *residual, const void *w, float eps,
                                        void *y, float *y32, cudaStream_t stream, m3_err *e);

/* ---- Embedding gather, §2.3; templates/embed.lua ----------------------- */

m3_status m3_embed_key(int hidden, m3_variant *v, m3_err *e);

/* Host-side id validation, for ids that come from the host: M3_RANGE naming
 * the first token whose id is outside [0, vocab) (m3_ref_embed's message). */
m3_status m3_embed_check_host(int64_t n_tokens, int64_t vocab, const int32_t *ids, m3_err *e);

/* m3_ref_embed on the device: out[t] = table[ids[t]] (bit copy).  ids [n]
 * int32 device, table [vocab, hidden] bf16, out [n, hidden] bf16.  A token
 * whose id is outside [0, vocab) is not written (its row keeps its previous
 * contents; later tokens ARE written, unlike the reference, which stops) and
 * is recorded in *err_word (device int32, see the header comment).  Call
 * m3_embed_finish to turn it into M3_RANGE.  Errors: M3_INVAL, M3_CUDA. */
m3_status m3_launch_embed(const m3_kernel *k, int64_t n_tokens, int hidden, int64_t vocab, const int32_t *ids,
                          const void *table, void *out, int32_t *err_word, cudaStream_t stream, m3_err *e);

/* Synchronise, read and clear err_word; M3_RANGE "embed: token T has id I,
 * outside the vocabulary [0, V)" when a bad id was met (ids: the device ids
 * of that launch).  Errors: M3_RANGE, M3_CUDA. */
m3_status m3_embed_finish(int32_t *err_word, const int32_t *ids, int64_t vocab, cudaStream_t stream, m3_err *e);

/* ---- MoE routing and grouping, §7.2; templates/moe_route.lua ----------- */

/* Key of a route stage: "route" (one warp per token), "fused" (route + group
 * in one CTA: decode), from m3_route_args (experts, topk, renormalize,
 * logits dtype).  Errors: M3_KEY. */
m3_status m3_route_key(const m3_route_args *a, const char *stage, m3_variant *v, m3_err *e);
/* Key of the group stage for (topk, n_experts). */
m3_status m3_moe_group_key(int topk, int n_experts, m3_variant *v, m3_err *e);

/* m3_ref_route, bit-exact: logits [n, E] fp32|bf16, bias [E] fp32 or NULL,
 * ids [n, K] int32, w [n, K] fp32.  Errors: M3_INVAL, M3_CUDA. */
m3_status m3_launch_route(const m3_kernel *k, const m3_route_args *a, const void *logits, const float *bias,
                          int32_t *ids, float *w, cudaStream_t stream, m3_err *e);

/* m3_ref_moe_group, bit-exact (the kernel is stable): ids [n, K] ->
 * counts [E], offsets [E+1], perm [n*K]; plus (each may be NULL)
 * inv [n*K] (inv[perm[i]] = i: the grouped row of pair p, the combine's row
 * map) and tok [n*K] (tok[i] = perm[i] / K: the token of grouped row i, the
 * gather's ids).  Ids outside [0, E) are left out of every output and
 * recorded in *err_word (may be NULL).  Errors: M3_INVAL, M3_CUDA. */
m3_status m3_launch_moe_group(const m3_kernel *k, int64_t n_tokens, int topk, int n_experts, const int32_t *ids,
                              int32_t *counts, int32_t *offsets, int32_t *perm, int32_t *inv, int32_t *tok,
                              int32_t *err_word, cudaStream_t stream, m3_err *e);

/* Route and group in one launch ("fused" key): the outputs of both. */
m3_status m3_launch_route_group(const m3_kernel *k, const m3_route_args *a, const void *logits, const float *bias,
                                int32_t *ids, float *w, int32_t *counts, int32_t *offsets, int32_t *perm,
                                int32_t *inv, int32_t *tok, int32_t *err_word, cudaStream_t stream, m3_err *e);

/* ---- SwiGLU-OAI, §7.3; templates/swiglu.lua ---------------------------- */

/* Key swiglu(inter, alpha_e6, limit_e6, beta_e6): the constants travel in the
 * key in millionths; a value that is not exactly the float of its decimal
 * millionths (so that host and device would disagree) is M3_INVAL.  There are
 * no defaults: pass the config's alpha, limit, beta (fault 22).
 * Errors: M3_INVAL, M3_KEY. */
m3_status m3_swiglu_key(int64_t inter, float alpha, float limit, float beta, m3_variant *v, m3_err *e);

/* m3_ref_swiglu_oai on the packed GEMM output, bit-exact: gu [n_rows, 2I]
 * bf16 (gate = columns [0, I), up = [I, 2I)), out [n_rows, I] bf16 (must not
 * alias gu).  Errors: M3_INVAL, M3_CUDA. */
m3_status m3_launch_swiglu(const m3_kernel *k, int64_t n_rows, int64_t inter, const void *gu, void *out,
                           cudaStream_t stream, m3_err *e);

/* ---- MoE combine, §7.2 / §12.6; templates/moe_combine.lua -------------- */

m3_status m3_combine_key(int hidden, int topk, int has_shared, int rowmap, m3_variant *v, m3_err *e);

/* out[t] = bf16(sum_k w[t,k] * y[row(t,k)] (fp32, top-k order) + shared[t]),
 * m3_ref_moe's combine bit for bit.  y [rows, hidden] bf16; row(t,k) =
 * rowof[t*K+k] (rowmap=1; e.g. moe_group's inv) or t*K+k; w [n, K] fp32;
 * shared [n, hidden] bf16 (has_shared=1); out [n, hidden] bf16.
 * Errors: M3_INVAL, M3_CUDA. */
m3_status m3_launch_moe_combine(const m3_kernel *k, int64_t n_tokens, int hidden, int topk, const void *y,
                                const int32_t *rowof, const float *w, const void *shared, void *out,
                                cudaStream_t stream, m3_err *e);

/* ---- MXFP8 dequant and the decode GEMVs, §8; templates/mxfp8.lua ------- */

m3_status m3_dequant_key(int64_t cols, m3_variant *v, m3_err *e);

/* m3_ref_mxfp8_dequant, bit-exact (NaN codes and scale 255 give NaN):
 * q [rows, cols] e4m3, scale [rows, cols/32] E8M0, out [rows, cols] bf16.
 * Errors: M3_INVAL, M3_CUDA. */
m3_status m3_launch_mxfp8_dequant(const m3_kernel *k, int64_t rows, int64_t cols, const void *q,
                                  const void *scale, void *out, cudaStream_t stream, m3_err *e);

enum { M3_GEMV_E4M3 = 0, M3_GEMV_BF16 = 1, M3_GEMV_F32 = 2 };

typedef struct m3_gemv_args {
  int64_t n;          /* tokens (any number: the launcher runs chunks of the kernel's nmax), or
                         (token, expert) pairs for moe */
  int64_t rows, cols; /* W [rows, cols] */
  int wfmt;           /* M3_GEMV_E4M3 (MXFP8 + E8M0 scales), _BF16, _F32 (router) */
  int out_f32;        /* y fp32 (F32 weights) instead of bf16 */
  int moe;            /* pair p reads the weight of expert ids[p] from a pointer table */
  int xdiv;           /* moe: pair p reads x row p / xdiv (top-k for gate|up, 1 for down) */
  int n_experts;      /* moe: entries of the pointer tables */
  /* Epilogues of the W8A16 MoE GEMV (m3_launch_gemv_moe_fused), at most one: */
  int act;            /* 1 (gate|up): also writes SwiGLU-OAI(gate, up) (§7.3) */
  float alpha, limit, beta; /* act: SwiGLU-OAI's constants (carried by the key in millionths) */
  int combine;        /* 1 (down): also writes the MoE combine (§12.6) */
  int ids_settled;    /* moe: 1 = ids (and the pointer tables) were written two or more launches back on the
                         stream (the down GEMV: route -> gate|up [-> SwiGLU] -> down), so they are complete when
                         the kernel starts even under programmatic dependent launch; the key's settled axis,
                         which lets a lead=1 tile read them before its grid wait (templates/lib/lead.lua) */
  /* The fp32 router GEMV's route epilogue (m3_launch_gemv_route; 0 elsewhere): */
  int route_e, route_k, route_renorm; /* experts (= rows), top-k, renormalise (the key's axes) */
} m3_gemv_args;

/* Key for an explicit nmax (1, 2, 4, 8).  Errors: M3_KEY. */
m3_status m3_gemv_key(const m3_gemv_args *a, int nmax, m3_variant *v, m3_err *e);

/* The GEMV kernel for a: nmax = the smallest of 1, 2, 4, 8 covering
 * min(n, 8) that the template accepts on rt's GPU (staging x needs
 * nmax * cols * 4 B of shared memory), falling back to smaller nmax (more
 * launches, weights re-read) when it does not fit; moe uses nmax = 1.
 * Errors: M3_UNSUPPORTED (no nmax fits), those of m3_rt_kernel. */
m3_status m3_gemv_kernel(m3_rt *rt, const m3_gemv_args *a, m3_kernel **k, m3_err *e);

/* y [n, rows] = x [n, cols] bf16 · Wᵀ, fp32 accumulation (the contract of
 * m3_ref_gemm_bf16 / m3_ref_gemm_w8a16, up to summation order: tests use
 * rel. L2 <= 1e-2).  w [rows, cols] e4m3|bf16|fp32, scale [rows, cols/32]
 * E8M0 for e4m3 (else NULL); y bf16, or fp32 with out_f32.  x and w 16-byte
 * aligned, scale 4-byte aligned (the W8A16 kernel reads 4 scales at a time).
 * Non-MoE kernels only.  Errors: M3_INVAL, M3_CUDA.
 * A tile with lead=1 (W8A16; bf16 / fp32: the router's default on sm_90)
 * reads w and scale (or sends w toward L2) before its grid wait, i.e.
 * while kernels launched before it on `stream` may still run (programmatic
 * dependent launch): no kernel on `stream` may write them (weights are
 * written by host copies or by kernels of an earlier, synchronised stage). */
m3_status m3_launch_gemv(const m3_kernel *k, const m3_gemv_args *a, const void *x, const void *w,
                         const void *scale, void *y, cudaStream_t stream, m3_err *e);

/* m3_ref_linear's decode form: dispatches on w (device pointers in an
 * m3_ref_weight: bf16, or q + scale).  Errors: as m3_launch_gemv. */
m3_status m3_launch_linear_gemv(const m3_kernel *k, int64_t n, const void *x, const m3_ref_weight *w, void *y,
                                cudaStream_t stream, m3_err *e);

/* The MoE GEMV: for each pair p < a->n, y[p] = x[p / xdiv] · W_{ids[p]}ᵀ with
 * W_e = w_tab[e] (+ s_tab[e] scales for e4m3; s_tab NULL for bf16).  w_tab
 * and s_tab are DEVICE arrays of n_experts device pointers (weights 16-byte,
 * scales 4-byte aligned: not checkable here, the caller's duty).  A pair whose id
 * is outside [0, n_experts) is skipped (its y row is not written).
 * Errors: M3_INVAL (n > 65535 pairs), M3_CUDA. */
m3_status m3_launch_gemv_moe(const m3_kernel *k, const m3_gemv_args *a, const void *x, const void *const *w_tab,
                             const void *const *s_tab, const int32_t *ids, void *y, cudaStream_t stream, m3_err *e);

/* m3_launch_gemv_moe plus n_shared pairs of the shared expert (spec §7.2) in
 * the same launch, so its weights stream with the routed ones: pairs
 * a->n .. a->n + n_shared - 1 read sw (+ ss scales for e4m3; device
 * pointers, same shape as an expert) and x row j (j = 0 .. n_shared - 1) when
 * xdiv > 1 (gate|up: x holds the tokens), x row a->n + j when xdiv == 1
 * (down: x holds every pair's activations), and write y row a->n + j.
 * n_shared = 0 is m3_launch_gemv_moe.  Errors: as m3_launch_gemv_moe. */
m3_status m3_launch_gemv_moe_shared(const m3_kernel *k, const m3_gemv_args *a, const void *x,
                                    const void *const *w_tab, const void *const *s_tab, const int32_t *ids,
                                    const void *sw, const void *ss, int64_t n_shared, void *y, cudaStream_t stream,
                                    m3_err *e);

/* The epilogues of the W8A16 MoE GEMV (templates/mxfp8.lua), one per launch:
 * - act = 1 (the gate|up launch: a->rows = 2I, gate rows [0, I), up rows
 *   [I, 2I); I a multiple of 64): besides y = gu, act [pairs, I] bf16 =
 *   bf16(SwiGLU-OAI(gate, up)) of each pair (§7.3): m3_ref_swiglu_oai of the
 *   bf16 gu rows bit for bit, what m3_launch_swiglu would write.
 *   tile_count: >= pairs * I / 16 words.
 * - combine = 1 (the down launch, with the shared expert riding along as
 *   pairs a->n .. a->n + T - 1: T tokens, K = a->n / T routed pairs each):
 *   besides y, out [T, rows] = bf16(sum_k w[t K + k] y[t K + k] + y[a->n + t])
 *   in fp32, top-k order, one rounding: moe_combine's (m3_ref_moe) exactly,
 *   given the same y.  tile_count: >= ceil(rows / 16) words.
 * tile_count: uint32 device words, zero before the first launch; every launch
 * leaves them zero (the CTA that completes a word re-zeroes it), so one buffer
 * serves every launch of a stream, never two streams at once. */
typedef struct m3_gemv_epilogue {
  void *act;            /* act = 1: [pairs, rows / 2] bf16, device; must not alias y */
  const float *w;       /* combine = 1: [T, K] fp32 routing weights (routed_scaling applied), device */
  void *out;            /* combine = 1: [T, rows] bf16, device; must not alias y */
  uint32_t *tile_count; /* see above */
} m3_gemv_epilogue;

/* m3_launch_gemv_moe_shared with the key's epilogue (a->act or a->combine:
 * ep not NULL, else ep NULL).  A pair with a bad expert id leaves its y rows
 * as they were and the epilogue reads them as they are.  Errors: as
 * m3_launch_gemv_moe_shared; M3_INVAL for an epilogue its shapes do not allow
 * (act: rows not 2I with I a multiple of the tile's 16 rpw rows - 64 covers
 * every tile - or SwiGLU constants other than the kernel's; combine: no
 * shared pairs, or their number not dividing a->n), missing buffers, or an
 * epilogue output that is y.
 * A lead=1 tile reads some inputs before its grid wait, while the kernels
 * launched before it on `stream` may still run (programmatic dependent
 * launch; templates/mxfp8.lua): with settled=1 (a->ids_settled) ids, w_tab,
 * s_tab, sw, ss and the weights - the caller vouches that none of those
 * kernels writes them (ids written two or more launches back); with
 * settled=0, the shared pairs' CTAs only (their grid rows first): sw, ss and
 * the shared expert's weight bytes, which no kernel of the stream may write.
 * x, the epilogue's buffers and (settled=0) ids only after the wait. */
/* The fp32 router GEMV with the route epilogue (a->route_e = a->rows =
 * ra->n_experts, a->route_k = ra->topk, a->route_renorm = ra->renormalize;
 * M3KIT_MOE_FUSE=route): logits [n, E] fp32 = x [n, cols] bf16 · Wᵀ as
 * m3_launch_gemv (W [E, cols] fp32), then the last CTA to finish selects
 * every token's experts from them as m3_launch_route does on the same
 * logits, bit for bit (templates/lib/route.lua, m3_ref_route §7.2): ids
 * [n, K] int32, wts [n, K] fp32; bias [E] fp32 or NULL.  One launch: n <=
 * the key's nmax.  counter: a device word, zero before the first launch;
 * each launch leaves it zero (launches on one counter must not overlap).
 * Reads x after its grid wait, the weights (lead=1 tiles) before it.
 * Errors: M3_INVAL (kernel/argument mismatch, n > nmax, bf16 logits,
 * misaligned pointers), M3_CUDA. */
m3_status m3_launch_gemv_route(const m3_kernel *k, const m3_gemv_args *a, const m3_route_args *ra, const void *x,
                               const void *w, float *logits, const float *bias, int32_t *ids, float *wts,
                               uint32_t *counter, cudaStream_t stream, m3_err *e);

m3_status m3_launch_gemv_moe_fused(const m3_kernel *k, const m3_gemv_args *a, const void *x,
                                   const void *const *w_tab, const void *const *s_tab, const int32_t *ids,
                                   const void *sw, const void *ss, int64_t n_shared, void *y,
                                   const m3_gemv_epilogue *ep, cudaStream_t stream, m3_err *e);

/* ---- Sampling; templates/sample.lua ------------------------------------ */

/* Key from m3_sample_args: greedy when temperature <= 0 or top_p <= 0 (as
 * the reference), else top_p.  Errors: M3_KEY. */
m3_status m3_sample_key(const m3_sample_args *a, m3_variant *v, m3_err *e);

/* One CTA per row; d_out [n_rows] int32 device receives the token, or -1 for
 * an all-NaN row, or -2 for a top-p row with more candidates than the kernel's
 * cap (left to the host).  Errors: M3_INVAL, M3_CUDA. */
m3_status m3_launch_sample(const m3_kernel *k, const m3_sample_args *a, const void *logits, int32_t *d_out,
                           cudaStream_t stream, m3_err *e);

/* Synchronise, copy the tokens to host_out [n_rows] and resolve rows marked
 * -2 with m3_ref_sample_top_p on that row's logits (downloaded), drawing with
 * that row's generator key, so every token equals the reference's.
 * Errors: M3_NUMERICS (an all-NaN row, named), M3_NOMEM, M3_CUDA. */
m3_status m3_sample_finish(const m3_sample_args *a, const void *logits, const int32_t *d_out, int32_t *host_out,
                           cudaStream_t stream, m3_err *e);

/* ---- The MoE layer, §7.2 ------------------------------------------------ */

/* Device weights of one MoE layer.  Routed experts: gate|up packed as one
 * [2*inter, hidden] matrix per expert (w1 rows then w3 rows, the
 * uninterleaved order), down [hidden, inter]; MXFP8 (e4m3 + E8M0) or bf16.
 * The *_tab fields are DEVICE arrays of n_experts device pointers (the decode
 * GEMV reads them); the h_* fields are HOST arrays of the same pointers (the
 * prefill path's per-expert cuBLAS calls).  Scale fields are NULL for bf16. */
typedef struct m3_moe_weights {
  int n_experts, e4m3;
  int64_t hidden, inter, shared_inter;   /* shared_inter 0: no shared expert */
  const float *wg;                       /* [E, hidden] fp32 router */
  const float *bias;                     /* [E] fp32 e_score_correction_bias, or NULL */
  const void *const *gu_tab, *const *gu_scale_tab, *const *down_tab, *const *down_scale_tab;
  const void *const *h_gu, *const *h_gu_scale, *const *h_down, *const *h_down_scale;
  const void *shared_gu, *shared_gu_scale;     /* [2*shared_inter, hidden] */
  const void *shared_down, *shared_down_scale; /* [hidden, shared_inter] */
} m3_moe_weights;

/* Scratch of m3_moe_forward for up to max_tokens tokens (device memory).  The
 * decode path (n <= 8) needs no host round trip; the prefill path reads the
 * per-expert counts back once (one sync) to size its cuBLAS calls. */
typedef struct m3_moe_ws {
  int64_t max_tokens;
  void *mem;
  size_t bytes;
  unsigned fuse; /* M3_MOE_FUSE_* bits: M3KIT_MOE_FUSE when allocated (m3_moe_fuse_env) */
  /* The decode path's launches to make (M3_MOE_STAGE_* bits; all after
   * m3_moe_ws_alloc).  A benchmarking hook (m3_forward_graph_breakdown
   * captures a stage alone, or the step without it): a left-out stage writes
   * nothing, so the layer's output is then wrong. */
  unsigned stages;
} m3_moe_ws;

/* The decode path's launches, in step order (m3_moe_ws.stages). */
enum {
  M3_MOE_STAGE_ROUTER = 1,   /* router GEMV: logits */
  M3_MOE_STAGE_ROUTE = 2,    /* top-k: ids, weights */
  M3_MOE_STAGE_GATE_UP = 4,  /* the experts' gate|up GEMV */
  M3_MOE_STAGE_SWIGLU = 8,   /* SwiGLU launch (none with M3_MOE_FUSE_ACT) */
  M3_MOE_STAGE_DOWN = 16,    /* the experts' down GEMV (and a narrower shared expert's launches) */
  M3_MOE_STAGE_COMBINE = 32, /* combine launch (none with M3_MOE_FUSE_COMBINE) */
  M3_MOE_STAGE_ALL = 63
};
#define M3_MOE_STAGE_NAMES {"router", "route", "gate_up", "swiglu", "down", "combine"}

/* Errors: M3_INVAL (also a bad M3KIT_MOE_FUSE), M3_CUDA (allocation). */
m3_status m3_moe_ws_alloc(m3_moe_ws *ws, const m3_moe_args *a, const m3_moe_weights *w, int64_t max_tokens,
                          m3_err *e);
void m3_moe_ws_free(m3_moe_ws *ws);

/* m3_ref_moe on the GPU, on g's stream: m [n, hidden] bf16 -> out [n, hidden]
 * bf16, with ids [n, K] / wts [n, K] (device, may be NULL) receiving the
 * routing; m32 [n, hidden] fp32 = float(m) (may be NULL; rmsnorm's f32copy)
 * lets the prefill router run as one cuBLAS fp32 GEMM.  path: 0 automatic
 * (decode GEMVs for n <= 8, else prefill), 1 decode, 2 prefill.
 * Decode: router GEMV (fp32 weights), route, one MoE GEMV over all chosen
 * experts' gate|up, SwiGLU, one MoE GEMV for down, shared expert GEMVs,
 * combine in pair order; with MXFP8 experts and a shared expert as wide as
 * the routed ones (M3), ws->fuse (M3KIT_MOE_FUSE when ws was allocated):
 * M3_MOE_FUSE_COMBINE has the down GEMV also write the combine,
 * M3_MOE_FUSE_ACT the gate|up GEMV SwiGLU(gu) (m3_launch_gemv_moe_fused: the
 * same values, a launch fewer each; off by default: not faster on the H200,
 * runtime/op_ffn.c says what was measured); M3_MOE_FUSE_ROUTE (decode, up to
 * 8 tokens: one launch) the router GEMV's last CTA the top-k
 * (m3_launch_gemv_route); M3_MOE_FUSE_NORM acts only through
 * m3_moe_forward_pending (this function always writes out).  Prefill: router GEMM (cuBLAS fp32 with m32, else
 * the GEMV in chunks of 8 tokens), route, stable group, gather, one cuBLAS
 * GEMM per expert on its contiguous rows (MXFP8 experts are dequantised into
 * scratch first), SwiGLU, combine through the inverse permutation; one sync
 * to read the per-expert counts.  Routing and every rounding point match
 * the reference; GEMM summation order does not (tests: rel. L2 <= 1e-2).
 * Route, group, gather, SwiGLU and combine kernels come from m3_rt_kernel
 * with bucket "tokens" = the launch's rows rounded up to a power of two
 * (route, group, combine: n; gather: n*K; SwiGLU: its pairs), the shapes
 * `m3kit tune` records them at.
 * Errors: M3_INVAL (shapes, n > ws->max_tokens), M3_CUDA, M3_CUBLAS,
 * M3_RANGE (a bad expert id, which cannot happen with valid weights). */
/* The decode MoE layer's optional fusions (m3_moe_forward), each the same
 * values in a launch fewer: */
enum {
  M3_MOE_FUSE_COMBINE = 1, /* the down GEMV's epilogue writes the combine (templates/mxfp8.lua combine=1) */
  M3_MOE_FUSE_ACT = 2,     /* the gate|up GEMV's epilogue writes SwiGLU(gu) (act=swiglu) */
  M3_MOE_FUSE_NORM = 8,    /* the combine is left to the next add + RMSNorm (m3_moe_forward_pending,
                              m3_launch_add_rmsnorm_combine; templates/rmsnorm.lua combine=K) */
  M3_MOE_FUSE_ROUTE = 16,  /* the router GEMV's epilogue selects the experts (route_e > 0; decode, <= 8 tokens) */
};
/* The bits that apply when M3KIT_MOE_FUSE is unset: none. */
#define M3_MOE_FUSE_DEFAULT 0u

/* The environment's M3KIT_MOE_FUSE as M3_MOE_FUSE_* bits: a comma-separated
 * list of "combine", "act", "route", "norm"; "all" = combine,act; "0" or "none" = no
 * bits; unset or empty = M3_MOE_FUSE_DEFAULT.  Errors: M3_INVAL naming the
 * variable for an unknown name, and for combine with norm (both would do the
 * combine: one in the down GEMV, one in the next norm). */
m3_status m3_moe_fuse_env(unsigned *fuse, m3_err *e);

m3_status m3_moe_forward(m3_rt *rt, m3_gemm *g, const m3_moe_args *a, const m3_moe_weights *w, m3_moe_ws *ws,
                         const void *m, const float *m32, void *out, int32_t *ids, float *wts, int path,
                         m3_err *e);

/* The combine a decode MoE layer left undone (M3_MOE_FUSE_NORM): the inputs
 * of m3_launch_add_rmsnorm_combine, device pointers into the workspace (and
 * wts), valid until the next m3_moe_forward* call on the same workspace. */
typedef struct m3_moe_pending {
  int active;         /* 1: the combine was not launched and out was not written; 0: nothing pending */
  int topk;           /* K */
  int64_t n_tokens;
  const void *y;      /* [n_tokens * K, hidden] bf16: pair t*K + k's routed expert output in row t*K + k */
  const float *w;     /* [n_tokens, K] fp32 routing weights (the wts argument, or the workspace's) */
  const void *shared; /* [n_tokens, hidden] bf16: the shared expert's output of token t in row t */
} m3_moe_pending;

/* m3_moe_forward, which with pend not NULL, ws->fuse & M3_MOE_FUSE_NORM, the
 * decode path and a shared expert that rides along in the routed GEMVs (as
 * wide as a routed expert; MXFP8 or bf16) and no combine epilogue
 * (M3_MOE_FUSE_COMBINE wins where a caller set both bits in ws->fuse) skips
 * the combine launch: out is not written and *pend describes the combine
 * (active = 1), which the caller then runs inside the add + RMSNorm that
 * follows (m3_launch_add_rmsnorm_combine: the same out values, never
 * stored).  Otherwise out is written as by m3_moe_forward and pend->active =
 * 0.  pend NULL is m3_moe_forward.  Errors: as m3_moe_forward. */
m3_status m3_moe_forward_pending(m3_rt *rt, m3_gemm *g, const m3_moe_args *a, const m3_moe_weights *w,
                                 m3_moe_ws *ws, const void *m, const float *m32, void *out, int32_t *ids, float *wts,
                                 int path, m3_moe_pending *pend, m3_err *e);

/* What m3_moe_forward_pending(..., pend) will leave in *pend for these
 * arguments, without launching anything: for a caller that must know it
 * when the layer itself is not run (forward.c's per-op graph breakdown
 * captures the next norm alone).  Errors: M3_INVAL (shapes, as
 * m3_moe_forward). */
m3_status m3_moe_pending_plan(const m3_moe_args *a, const m3_moe_weights *w, const m3_moe_ws *ws, float *wts,
                              int path, m3_moe_pending *pend, m3_err *e);

#endif
