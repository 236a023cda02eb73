/* model.h - m3_model: a config plus every weight resident on the GPU, laid
 * out the way the forward pass (runtime/forward.h) consumes it.
 *
 * Three sources:
 *   (a) a checkpoint directory (DIR/config.json + safetensors, BF16 or MXFP8,
 *       through m3_ckpt_bind): every routed expert resident;
 *   (b) a preset with deterministic synthetic weights generated ON THE GPU
 *       (templates/fill.lua; the embedded default is "tiny": 3 dense + 57
 *       sparse layers at small widths);
 *   (c) "minimax-m3" synthetic: the real dimensions for all 60 layers but only
 *       N routed experts resident per MoE layer (--resident-experts, default
 *       8), so that a batch-1 decode step reads exactly the bytes the real
 *       MXFP8 model reads (attention, indexer, dense MLPs, router, shared
 *       expert, 4 routed experts, lm_head) in ~40 GB instead of 444 GB.
 *
 * RESTRICTED ROUTING (c only): routing runs over the resident experts, i.e.
 * experts >= N are masked out before top-k.  The mask lives in the routing
 * bias: e_score_correction_bias[e] = -inf for e >= N.  The router kernel adds
 * the bias to sigmoid(logit) BEFORE its top-k, so those experts' selection
 * scores are -inf and never chosen, while the weights of the chosen experts
 * still come from their unbiased sigmoid (spec §7.2).  (Masking the router
 * LOGITS to -inf would not suffice: sigmoid(-inf) = 0, and 0 + bias can beat a
 * resident expert.)  The router GEMV still reads all E rows, as the real
 * model does.  Requires num_experts_per_tok <= N.
 *
 * Layout (every pointer is device memory, one cudaMalloc each):
 *   - fused QKV per layer (§3.2): [q; k; v] or [q; k; v; index_q; index_k],
 *     [row, H] with row = m3_config_qkv_width;
 *   - dense MLP and shared expert: [gate; up] fused, [2F, H], then down [H, F];
 *   - routed experts stacked: w13 [n_res, 2I, H] (per expert gate = w1 rows
 *     [0, I), up = w3 rows [I, 2I): the uninterleaved SwiGLU-OAI order, §7.2),
 *     w2 [n_res, H, I];
 *   - MXFP8 linears keep e4m3 values + E8M0 scales [rows, cols/32] (W8A16 at
 *     decode; for prefill GEMMs the forward dequantises one weight at a time
 *     into a bf16 scratch buffer just before cuBLAS runs, so the resident
 *     footprint stays the MXFP8 one);
 *   - router fp32 [E, H], bias fp32 [E] (always present: zeros when the config
 *     has no routing bias);
 *   - the bf16 RoPE table [max_position_embeddings, rotary_dim] computed on the
 *     host by m3_rope_table (bit-identical to the reference's).
 * TENSOR PARALLEL (issue 7; opts.tp > 1): the model of one rank, the cut of
 * runtime/tp_plan.h.  cfg is then the rank's config (m3_tp_rank_config: its
 * q heads, KV heads, intermediate slices), so the forward, the KV cache
 * (the rank's KV heads only; the index-K cache stays whole) and every kernel
 * key see the rank's widths; whole is the model's config.  What a rank holds:
 *   - fused QKV: the 5 row ranges of spec §3.2 concatenated in order: its q
 *     heads, its k and v heads (KV head kv_head0.., replicated when tp >
 *     nkv), its index_q heads (by KV head), and the single index_k head;
 *   - o_proj and the down projections (dense MLP, every routed expert, the
 *     shared expert): the input columns of its q heads / intermediate slice;
 *   - gate|up (dense, experts, shared): rows [i0, i0+n) of gate and the same
 *     rows of up, fused as [2n, H] in the same gate-then-up order;
 *   - lm_head: rows [vocab0, vocab0 + vocab_n) (a copy even when tied);
 *   - embedding, norms, router, routing bias, RoPE table: whole.
 * Every sliced tensor is first materialised whole on the device as on one
 * GPU (checkpoint upload, fused and dequantised as usual, or synthetic fill,
 * so a rank's values are exactly the single-GPU model's), then its slice is
 * copied out (cudaMemcpy2DAsync; MXFP8 scale columns sliced by /32) and the
 * whole tensor freed.  Peak memory: the rank's weights plus one whole tensor
 * (a checkpoint's routed experts one expert at a time; a synthetic stack of
 * resident experts whole, since the generator fills a tensor in one launch);
 * peak_bytes records it.
 *
 * Synthetic values: linears, embeddings, router, bias and norm offsets
 * ~ 0.02 * n(seed_t, i) (templates/fill.lua), seed_t = m3_synth_seed(seed,
 * tensor name).  MXFP8 synthetic linears store e4m3(20.48 * n) with every
 * scale byte 117 (2^-10): std 0.02 and real MXFP8 bytes.
 */
#ifndef M3_MODEL_H
#define M3_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "ref/numerics.h"
#include "runtime/config.h"
#include "runtime/kernels.h"
#include "runtime/kv_cache.h"
#include "runtime/tp_plan.h"

/* A linear weight [rows, cols] (PyTorch [out, in]); for a stack of experts,
 * rows covers one expert and n_stack experts follow each other. */
typedef struct m3_dlinear {
  int64_t rows, cols;
  int n_stack;         /* 1, or the number of stacked experts */
  int mxfp8;           /* 1: w is e4m3 with scale; 0: w is bf16 */
  void *w;             /* [n_stack, rows, cols] bf16 | e4m3 */
  uint8_t *scale;      /* [n_stack, rows, cols/32] E8M0 (mxfp8 only) */
} m3_dlinear;

/* Bytes of one stacked element's weight (rows*cols*elem) and of its scales. */
size_t m3_dlinear_bytes(const m3_dlinear *w);
size_t m3_dlinear_scale_bytes(const m3_dlinear *w);
/* Device pointer to expert x's weight / scale rows. */
void *m3_dlinear_at(const m3_dlinear *w, int x);
uint8_t *m3_dlinear_scale_at(const m3_dlinear *w, int x);

typedef struct m3_dlayer {
  int sparse, moe;
  m3_bf16 *input_norm, *post_norm;        /* [H] */
  m3_bf16 *q_norm, *k_norm;               /* [hd] */
  m3_bf16 *iq_norm, *ik_norm;             /* [index_dim] sparse only, else NULL */
  m3_dlinear qkv;                         /* [row, H] */
  m3_dlinear o;                           /* [H, nq*hd] */
  m3_dlinear mlp_gu, mlp_down;            /* dense MLP: [2F, H], [H, F] */
  float *router;                          /* MoE: [E, H] fp32 */
  float *bias;                            /* MoE: [E] fp32 */
  m3_dlinear w13, w2;                     /* MoE: n_stack = n_resident */
  m3_dlinear sh_gu, sh_down;              /* shared expert (rows 0 if none) */
} m3_dlayer;

typedef struct m3_model {
  m3_config cfg;           /* what this device computes: the rank's config under tensor parallelism */
  m3_config whole;         /* the model's config (== cfg when tp == 1) */
  int tp, rank;            /* rank `rank` of a tensor-parallel group of tp (1, 0: the whole model) */
  m3_tp_rank part;         /* the rank's cut (tp > 1; zeroed otherwise) */
  int64_t vocab0, vocab_n; /* lm_head rows held: [vocab0, vocab0 + vocab_n) (0, V when tp == 1) */
  int n_resident;          /* routed experts resident per MoE layer */
  int mxfp8;               /* some linears are MXFP8 */
  m3_bf16 *embed;          /* [V, H] */
  m3_bf16 *lm_head;        /* [vocab_n, H] (== embed when tied and tp == 1) */
  m3_bf16 *final_norm;     /* [H] */
  m3_bf16 *rope;           /* [max_position_embeddings, rotary_dim] */
  m3_dlayer *layers;       /* [L] host array of device pointers */
  size_t weight_bytes;     /* device bytes held (weights + RoPE table) */
  size_t peak_bytes;       /* most bytes held at once while loading (tp > 1: + one whole tensor) */
  char source[160];        /* "checkpoint DIR" / "synthetic minimax-m3 (8 experts resident), seed S" */
  void **allocs;
  int n_allocs, cap_allocs;
} m3_model;

typedef struct m3_model_opts {
  const char *dir;           /* checkpoint directory (a), or NULL */
  const char *preset;        /* preset for synthetic weights (b, c); NULL = "tiny" */
  const m3_config *config;   /* synthetic from this config instead of a preset (tests) */
  int resident_experts;      /* synthetic: experts per MoE layer; 0 = min(8, E) */
  int mxfp8;                 /* synthetic: -1 auto (MXFP8 for a config with hidden >= 4096,
                                i.e. minimax-m3, bf16 otherwise), 0 bf16, 1 MXFP8 */
  uint64_t seed;             /* synthetic seed */
  int tp, rank;              /* tensor parallel: load rank `rank` of tp (tp 0 or 1: the whole model) */
} m3_model_opts;

/* Device bytes the weights of a synthetic model take (what m3_model_load
 * checks against cudaMemGetInfo before allocating).  n_resident as above.
 * For a rank's config (m3_tp_rank_config) it counts the embedding and an
 * lm_head of vocab_size rows: m3_model_load adjusts for the rank's rows. */
uint64_t m3_model_bytes(const m3_config *c, int n_resident, int mxfp8);

/* Load or generate the model on rt's device (with opts.tp > 1: rank
 * opts.rank's slice, see TENSOR PARALLEL above).  Builds the fill kernels
 * through m3_rt_kernel for synthetic weights.
 * Errors: M3_CONFIG / M3_NOTFOUND / M3_FORMAT from the config and checkpoint
 * loaders (naming file and tensor; M3_FORMAT also for a checkpoint tensor
 * whose shape is not the config's when it is sliced), M3_INVAL
 * (resident_experts outside [num_experts_per_tok, E]; tp < 0, a rank outside
 * [0, tp), or a config tp does not cut, m3_tp_plan's message naming the
 * field), M3_CAPACITY (weights larger than free GPU memory: names both byte
 * counts), M3_CUDA, M3_NOMEM, and the JIT's errors. */
m3_status m3_model_load(m3_rt *rt, const m3_model_opts *o, m3_model **out, m3_err *e);
void m3_model_free(m3_model *m);

/* The synthetic generator on the host, bit-identical to templates/fill.lua:
 * element i of a tensor seeded seed_t, before the dtype rounding. */
float m3_synth_value(uint64_t seed_t, int64_t i, float sigma);
/* Per-tensor seed: splitmix64(seed ^ fnv1a(name)). */
uint64_t m3_synth_seed(uint64_t seed, const char *name);

/* Launch the fill kernel: out[i] = round(sigma * n(seed_t, i)), i < n, dtype
 * "bf16", "e4m3" or "f32".  Errors: M3_CUDA, the JIT's. */
m3_status m3_fill(m3_rt *rt, void *out, int64_t n, const char *dtype, uint64_t seed_t, float sigma,
                  cudaStream_t stream, m3_err *e);
/* The same with kernel k (a fill key of the tensor's dtype, any tile), on a
 * GPU of sm_count SMs (the grid is capped there, grid-stride beyond): what
 * m3_fill launches, for the tuner.  Errors: M3_CUDA. */
m3_status m3_launch_fill(const m3_kernel *k, void *out, int64_t n, uint64_t seed_t, float sigma, int sm_count,
                         cudaStream_t stream, m3_err *e);

/* `m3kit run --synthetic-cache`: append n tokens to each of the batch
 * sequences seqs[] of kv without computing them, and fill every page of every
 * layer's KV and index-K caches with random unit-scale values (normed K and V
 * are unit-RMS) of the caches' dtypes.  A decode step's cost depends on the
 * cache bytes it reads, not their values, so TPOT at a 1M-token context can
 * be measured without the minutes its prefill takes.  Errors: those of
 * m3_kv_append (M3_CAPACITY beyond the admitted length), M3_CUDA, M3_NOMEM. */
m3_status m3_kv_fill_synthetic(m3_rt *rt, m3_kv_cache *kv, const int *seqs, int batch, int n, uint64_t seed,
                               m3_err *e);

#endif
