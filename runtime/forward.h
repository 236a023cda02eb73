/* forward.h - the MiniMax-M3 text forward pass on the GPU: chunked prefill
 * and batched decode over the paged caches (spec §2.3, §2.4), readable top
 * to bottom in forward.c like llm.c's gpt2_forward: embed, then per layer
 * dense_layer() or sparse_layer(), then the final norm and lm_head.
 *
 * Numerics follow the whole-model reference (ref/ref_forward.h) op for op:
 * bf16 residual stream with the add+RMSNorm contract of m3_ref_add_rmsnorm,
 * fused QKV (§3.2), qk-norm+RoPE+insert, dense or indexer + sparse attention,
 * o_proj, dense MLP or MoE with the shared expert, fp32 logits.  GEMMs are
 * cuBLAS at prefill (MXFP8 weights dequantised to a bf16 scratch one weight at
 * a time), GEMV launchers at decode (W8A16 directly on the MXFP8 bytes).
 *
 * Decode steps are captured as CUDA graphs (one per batch size, re-captured
 * when a kernel choice changes with the context bucket) and replayed; the
 * per-step inputs (ids, positions, slots, lengths) live at fixed device
 * addresses and are refreshed by copies issued before each replay.
 *
 * Debug hooks: M3KIT_CHECK_NUMERICS=1 (or opts.check_numerics) scans each
 * op's output for NaN/Inf after it runs and fails with M3_NUMERICS naming the
 * layer and the op (synchronises after every op; off by default, then no
 * cost); opts.timing records events around every kernel and
 * m3_forward_print_timing prints a per-op breakdown.  Either one turns the
 * decode graphs off (a replayed graph has no per-op boundaries).
 *
 * Tensor parallelism (issue 7; spec §3.2): a rank's forward is this same pass
 * on the rank's model (runtime/model.h: its heads and intermediate slices in
 * its config, its lm_head rows) with opts.tp, its endpoint in the group
 * (runtime/tp_comm.h).  Three collectives a step, in this order on every
 * rank: the o_proj output and the MLP / MoE output of each layer ([tokens,
 * hidden] bf16 partial sums) are all-reduced before the residual add +
 * RMSNorm (2 a layer), and the lm_head's vocabulary slice of the logits is
 * all-gathered into the whole row before sampling and the logits copy-out,
 * so every rank samples the same token from the same row.  Decode graphs
 * stay on when the link's collectives are capturable (NCCL), off otherwise
 * (the local backend synchronises with the host inside).  Without opts.tp
 * (or with a one-rank link) none of this code runs: the single-GPU pass is
 * unchanged bit for bit.
 *
 * On any error of a prefill chunk or a decode step, the tokens of that chunk
 * or step are taken back out of the sequences' lengths (their cache slots
 * are simply overwritten later), so the caller may retry or release.
 */
#ifndef M3_FORWARD_H
#define M3_FORWARD_H

#include <stdint.h>
#include <stdio.h>

#include "runtime/kernels.h"
#include "runtime/kv_cache.h"
#include "runtime/model.h"
#include "runtime/tp_comm.h"

typedef struct m3_fwd_opts {
  int max_batch;       /* sequences per decode step, >= 1 (<= the cache's max_seqs) */
  int max_chunk;       /* prefill chunk in tokens; 0 = 256 */
  int use_graph;       /* 1: capture decode steps as CUDA graphs and replay them */
  int timing;          /* 1: events around every kernel (m3_forward_print_timing) */
  int check_numerics;  /* -1: from $M3KIT_CHECK_NUMERICS; 0 off; 1 on */
  m3_tp_link *tp;      /* tensor parallel: this rank's endpoint (outlives the forward); NULL: one GPU */
} m3_fwd_opts;

/* Defaults: batch 1, chunk 256, graphs on, timing off, numerics from env,
 * no tensor parallelism. */
m3_fwd_opts m3_fwd_defaults(void);

/* Token choice after a step (m3_ref_sample_top_p's contract): greedy when
 * temperature <= 0 or top_p <= 0; else temperature + top-p with the
 * counter-based generator keyed (seed, step, row). */
typedef struct m3_sampling {
  float temperature, top_p;
  uint64_t seed, step;
} m3_sampling;

typedef struct m3_forward m3_forward;

/* Allocate activations for max_chunk prefill tokens and max_batch decode
 * rows, resolve every kernel the model needs (through m3_rt_kernel: tuned
 * tiles by shape bucket, default otherwise).  m and kv must outlive f.
 * Errors: M3_INVAL (options; a rank's model without a link of its group size
 * and rank, or the reverse), M3_CAPACITY / M3_CUDA (activations), the JIT's. */
m3_status m3_forward_create(m3_rt *rt, const m3_model *m, m3_kv_cache *kv, const m3_fwd_opts *o,
                            m3_forward **out, m3_err *e);
void m3_forward_free(m3_forward *f);

/* Bytes each L2 prefetch phase of a decode step sends toward L2 (o_proj,
 * the FFN's first GEMV, qkv_proj: runtime/op_prefetch.h M3_PF_*) at a
 * context of ctx tokens: M3KIT_L2_PREFETCH's values, or the default's at that
 * context (m3_prefetch_default_bytes), capped at the device's L2 size; all 0
 * when off.  out[3]. */
void m3_forward_l2_prefetch(const m3_forward *f, int64_t ctx, int64_t out[3]);

/* Prefill: append n tokens (host ids [n]) to admitted sequence seq, in chunks
 * of max_chunk; logits of the last token [vocab] fp32 to the host (may be
 * NULL); *next receives the token chosen from them (may be NULL), sampled as
 * row 0 at smp->step: a caller prefilling the sequences of a batch one by one
 * gives each a step of its own, or they all draw the same uniform (m3kit run:
 * step 0 for sequence 0, 2^63 + b for sequence b, never a decode step).
 * Errors: M3_RANGE (an id outside [0, vocab) - checked on the host before any
 * kernel runs, naming the token), M3_CAPACITY (beyond the admitted length),
 * M3_NUMERICS (check on), M3_CUDA, M3_CUBLAS. */
m3_status m3_forward_prefill(m3_forward *f, int seq, int n, const int32_t *ids, const m3_sampling *smp,
                             int32_t *next, float *logits, m3_err *e);

/* One decode step: token ids[i] appended to sequence seqs[i], i < n <=
 * max_batch; logits [n, vocab] fp32 to the host (may be NULL), next [n]
 * (may be NULL).  Errors: as m3_forward_prefill. */
m3_status m3_forward_decode(m3_forward *f, int n, const int *seqs, const int32_t *ids, const m3_sampling *smp,
                            int32_t *next, float *logits, m3_err *e);

/* Test hook for the sparse layers' block selection (§5), for the steps that
 * follow until called again with NULLs.  Both are host arrays laid out
 * [L][nkv][n][topk] int32 for a step of n tokens (dense layers' slices are
 * not touched; L = num_hidden_layers):
 *   capture   receives what the GPU indexer selected;
 *   override  then replaces it before attention runs ("teacher-forced
 *             selection": the whole-model test runs the GPU on the
 *             reference's selection, so that a top-k flip on a near-tie of
 *             quantised index scores cannot hide every other comparison).
 * Either may be NULL.  While either is set, each sparse layer synchronises
 * and decode steps are not captured as graphs.  Errors: none. */
void m3_forward_debug_selection(m3_forward *f, int32_t *capture, const int32_t *override);

/* Collectives this forward has executed under tensor parallelism (graph
 * replays included): all-reduces (2 a layer a step) and logits all-gathers
 * (1 a step).  0 without opts.tp.  Either pointer may be NULL. */
void m3_forward_tp_counts(const m3_forward *f, uint64_t *allreduces, uint64_t *allgathers);

/* Decode steps replayed from a captured CUDA graph so far (0 with graphs
 * off: opts.use_graph = 0, timing, the numerics check, a debug selection, a
 * batch above the GEMV rows, or a link whose collectives are not
 * capturable).  Lets a test assert that graphs really ran. */
uint64_t m3_forward_graph_replays(const m3_forward *f);

/* One row of the per-op timing table (opts.timing): the op's name as in the
 * OP(...) wrappers of forward.c ("qkv_proj", "moe", "allreduce", ...), how
 * many times it ran and its summed event time. */
typedef struct m3_fwd_op_time {
  char name[32];
  int calls;
  double ms;
} m3_fwd_op_time;

/* The timing table, in the order the ops first ran: up to max rows into out,
 * their count into *n (rows beyond max are left out).  Reads back the events
 * still pending first, so it synchronises f's stream; call it from the
 * thread that runs f.  Without opts.timing the table is empty.
 * Errors: M3_CUDA (an event could not be read). */
m3_status m3_forward_timing(m3_forward *f, m3_fwd_op_time *out, int max, int *n, m3_err *e);

/* Per-op time (events, opts.timing): name, calls, total ms, share. */
void m3_forward_print_timing(const m3_forward *f, FILE *out);
/* Zero the timing table (e.g. after the prefill, to time decode alone). */
void m3_forward_reset_timing(m3_forward *f);

/* Where the time of a graph-replayed decode step goes, in the conditions it
 * runs in: the last step's graph is replayed (median of reps), then each op
 * (qkv_proj, indexer, moe, ...) is captured alone — its launches of every
 * layer, nothing else — and replayed the same way; one row per op with ms per
 * step and share of the whole step, and the sum of the rows (issue 6 wants it
 * within 10% of the step); each row also has the op's cost in the step: the
 * whole step less the step captured without that op (what removing or fusing
 * it away could save at most).  The MoE op's launches have rows of their own
 * ("moe/router", "moe/route", "moe/gate_up", "moe/swiglu", "moe/down",
 * "moe/combine"; not in the sum); an op that launches nothing in the step (a
 * launch an M3KIT_MOE_FUSE fusion removed) has no row.  The replays rerun the last step's kernels on
 * whatever the buffers hold, so its cache slots and outputs are overwritten:
 * call it after the last decode step whose results matter.
 * Errors: M3_INVAL (no decode step has run as a graph; tensor parallelism:
 * one rank's op replayed alone would wait for the others), M3_CUDA. */
m3_status m3_forward_graph_breakdown(m3_forward *f, int reps, FILE *out, m3_err *e);

/* Activation bytes m3_forward_create allocates for these options (for
 * sizing the KV cache's reserve). */
uint64_t m3_forward_activation_bytes(const m3_config *c, const m3_fwd_opts *o, int64_t max_ctx);

#endif
