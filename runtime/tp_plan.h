/* tp_plan.h - how one MiniMax-M3 model is cut across the ranks (GPUs) of a
 * tensor-parallel group (issue 7; spec §3.2, §9.3): which heads, experts and
 * rows each rank holds, which all-reduces a layer needs, and what a rank
 * stores.  A pure function of the config and the rank count: the loader,
 * the forward pass and `m3kit tp-plan` read the same plan.
 *
 * The cut (the inference engines' choice for this model, spec §3.2):
 *   attention  q heads split evenly (nq / tp per rank); k, v and index_q by
 *              KV head (nkv / tp per rank), each KV head replicated on
 *              tp / nkv ranks when tp > nkv, so a rank's q heads always map
 *              to the KV head(s) it holds (GQA group nq / nkv); the single
 *              index-K head is replicated on every rank (its cache is not
 *              divided, §9.3); o_proj row-parallel over the rank's q columns,
 *              then one all-reduce.
 *   dense MLP  gate/up rows and down columns split by the intermediate size
 *              (dense_intermediate_size / tp), one all-reduce.
 *   MoE        tensor-parallel inside every expert: each rank holds rows
 *              [r·I/tp, (r+1)·I/tp) of every routed expert's gate and up and
 *              the same columns of its down, and the same slice of the shared
 *              expert; the router is replicated, every rank routes
 *              identically, and the routed + shared partial sums meet in one
 *              all-reduce.  Chosen over expert parallelism for batch-1
 *              decode: 4 routed experts a token land on at most 4 ranks under
 *              expert parallelism (the busiest rank streams a whole expert
 *              while others idle), whereas the in-expert split gives every
 *              rank 1/tp of each chosen expert's bytes.  Not yet measured on
 *              several GPUs (no multi-GPU kind has been lent).
 *   embedding  replicated; lm_head split by vocabulary rows (an all-gather of
 *              the logits, or a distributed argmax).
 * Slices of a reduction dimension (o_proj's input, the down projections')
 * must stay whole MXFP8 blocks of 32 and whole 16-wide mma steps, so the
 * intermediate sizes must be multiples of 32·tp.
 */
#ifndef M3_TP_PLAN_H
#define M3_TP_PLAN_H

#include <stdint.h>

#include "runtime/config.h"
#include "runtime/status.h"

#define M3_TP_MAX 64

typedef struct m3_tp_rank {
  int tp, rank;
  int q_head0, n_q_heads;       /* query heads [q_head0, q_head0 + n_q_heads) */
  int kv_head0, n_kv_heads;     /* KV heads held (index_q heads alike); kv_replicas ranks hold each */
  int kv_replicas;              /* 1 when tp <= nkv, else tp / nkv */
  int dense_i0, dense_n;        /* dense MLP intermediate slice [dense_i0, dense_i0 + dense_n) */
  int moe_i0, moe_n;            /* slice of every routed expert's intermediate */
  int shared_i0, shared_n;      /* slice of the shared expert's intermediate (0 wide: none) */
  int vocab0, vocab_n;          /* lm_head rows */
  int allreduce_per_layer;      /* 2: after o_proj, after the MLP / MoE */
  uint64_t weight_bytes;        /* this rank's weights at the config's storage (MXFP8: 1 + 1/32 B, else 2 B),
                                   every routed expert resident */
  uint64_t expert_bytes;        /* this rank's slice of one routed expert (w1, w3, w2) summed over the MoE
                                   layers: a synthetic model with R of E experts resident (m3kit run
                                   --resident-experts R) holds weight_bytes - (E - R) * expert_bytes */
  uint64_t kv_bytes_per_token;  /* KV + index-K cache bytes per token on this rank (bf16 caches) */
} m3_tp_rank;

/* The plan of rank `rank` of `tp` for config c.
 * Errors (M3_INVAL, message naming the config field): tp < 1 or > M3_TP_MAX,
 * rank outside [0, tp); tp not dividing num_attention_heads; tp not a
 * divisor nor a multiple of num_key_value_heads; intermediate_size,
 * shared_intermediate_size or dense_intermediate_size not a multiple of
 * 32·tp; vocab_size smaller than tp. */
m3_status m3_tp_plan(const m3_config *c, int tp, int rank, m3_tp_rank *out, m3_err *e);

/* Rows [*v0, *v0 + *vn) of a vocabulary of `vocab` rows over `tp` ranks:
 * the first vocab % tp ranks take one more (m3_tp_plan's vocab0 / vocab_n;
 * the forward's all-gather of the logits places every rank's slice with it).
 * tp >= 1, 0 <= rank < tp. */
void m3_tp_vocab_slice(int vocab, int tp, int rank, int *v0, int *vn);

/* The config one rank computes with (runtime/model.h, runtime/forward.h): the
 * whole config with num_attention_heads = n_q_heads, num_key_value_heads =
 * sparse_num_index_heads = n_kv_heads, dense_intermediate_size = dense_n,
 * intermediate_size = moe_n and the shared expert's width shared_n.  Every
 * width a kernel key or a buffer is sized by then is the rank's slice, so the
 * single-GPU forward runs a rank unchanged.  vocab_size stays whole: the
 * embedding is replicated and the gathered logits row is whole; the lm_head
 * rows the rank holds are p->vocab0 / vocab_n (m3_model).  Errors: none (p
 * comes from m3_tp_plan of this config). */
void m3_tp_rank_config(const m3_config *whole, const m3_tp_rank *p, m3_config *out);

/* KV + index-K cache bytes one token occupies on one rank of `tp`
 * (kv_elem_bytes, idx_elem_bytes: 2 bf16, 1 e4m3): main KV divided by
 * min(tp, nkv), index-K replicated (spec §9.3: TP=4 bf16 -> 45,312 B).
 * 0 when tp does not fit the config (m3_tp_plan says why). */
uint64_t m3_tp_kv_bytes_per_token(const m3_config *c, int tp, int kv_elem_bytes, int idx_elem_bytes);

#endif
