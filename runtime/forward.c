/* forward.c - the GPU forward pass (see forward.h).  Read it top to bottom:
 * the step inputs, then m3_forward_prefill / m3_forward_decode, which run
 * embed -> layers -> final norm -> lm_head -> sample, each layer being
 * dense_layer() or sparse_layer() with the FFN of its kind.  Everything below
 * the layer functions is plumbing: kernels by key, linear layers (GEMV at
 * decode, cuBLAS at prefill), CUDA graphs, timing, the numerics check. */
#include "runtime/forward.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/check.h"
#include "runtime/gemm.h"
#include "runtime/op_attention.h"
#include "runtime/op_ffn.h"
#include "runtime/op_indexer.h"
#include "runtime/op_prefetch.h"
#include "runtime/harness.h"
#include "runtime/log.h"
#include "runtime/ops.h"

#define MAX_OPS 64        /* distinct op names in the timing table */
#define MAX_MEMO 2048     /* kernels resolved by (key, bucket): decode_workspaces alone visits ~400 */
#define MAX_GRAPHS 64     /* decode graphs (batch size x context bucket) */
#define DECODE_ROWS 8     /* at most this many rows use the GEMV (decode) schedules */

typedef m3_fwd_op_time timing_op; /* forward.h: the table's public row */
typedef struct memo { char key[M3_KEY_MAX + 64]; m3_kernel *k; } memo;
/* One forward step: n rows; decode or prefill schedules of attention and
 * indexer (a decode step of any batch size uses the decode ones: the prefill
 * indexer wants one sequence per warp of tokens); GEMVs or cuBLAS for the
 * linear layers (GEMVs up to DECODE_ROWS rows, where they are bandwidth-bound
 * and capturable); the paged batch. */
typedef struct step {
  int n;
  int decode;
  int gemv;
  int64_t max_kv;               /* >= every positions[t] + 1 (decode: the context bucket) */
  m3_seq_batch b;
} step;
/* A captured decode step and the step it was captured for.  The graph is kept
 * alive with its executable (CUDA allows destroying it after instantiation,
 * but the CPU emulator's executable refers to it). */
typedef struct graph { int n; int64_t bucket; step st; cudaGraph_t g; cudaGraphExec_t exec; int n_ar, n_ag; } graph;

struct m3_forward {
  m3_rt *rt;
  const m3_model *m;
  m3_kv_cache *kv;
  m3_fwd_opts o;
  int rows;                     /* max(max_chunk, max_batch): activation rows */
  cudaStream_t s;
  m3_gemm g;
  /* activations, device */
  m3_bf16 *r, *a, *mb, *x;      /* [rows, H]: residual, input norm, post norm, sublayer output */
  float *m32;                   /* [rows, H] fp32 copy of mb for the MoE router GEMM (prefill) */
  m3_bf16 *P;                   /* [rows, qkv_max] fused projection */
  m3_bf16 *q, *ao;              /* [rows, nq*hd] roped q, attention output */
  void *iq;                     /* [rows, niq*idim] bf16 | e4m3 */
  int32_t *sel;                 /* [nkv, rows, topk] */
  float *scores;                /* [niq, max_chunk, pages_per_seq] prefill block scores */
  m3_bf16 *gu, *act;            /* dense MLP [rows, 2F], [rows, F] */
  m3_bf16 *wdq;                 /* bf16 copy of one MXFP8 weight (prefill GEMMs) */
  size_t wdq_elems;
  float *logits;                /* [max_batch, V] */
  int32_t *d_next, *d_err;
  /* step inputs: pinned host staging and their device copies */
  int32_t *h_ids, *h_seq, *d_ids, *d_seq;
  int64_t *h_pos, *h_slot, *d_pos, *d_slot;
  /* workspaces */
  void *attn_ws, *idx_ws;
  size_t attn_ws_bytes, idx_ws_bytes;
  m3_moe_ws moe_ws;
  m3_moe_pending pend;          /* the combine the last MoE layer left to the next add_norm (moe()) */
  m3_moe_weights *moe_w;        /* [L] (MoE layers) */
  void **tabs;                  /* device pointer tables of the MoE layers, one allocation */
  const void **htabs;           /* host copies */
  /* kernels, graphs, timing */
  memo memo[MAX_MEMO];
  int n_memo;
  graph graphs[MAX_GRAPHS];
  int n_graphs;
  int capturing;
  int last_graph;               /* the decode graph the last step replayed (-1: none) */
  const char *only_op;          /* m3_forward_graph_breakdown: capture this op's launches only */
  const char *skip_op;          /* ... or all but this op's */
  const char *seen_ops[MAX_OPS];/* op names in the order the step runs them (filled at capture) */
  int n_seen;
  timing_op ops[MAX_OPS];
  int n_ops;
  cudaEvent_t *ev;              /* event pairs of the current step */
  int n_ev, cap_ev;
  const char **ev_name;
  int check;                    /* numerics check on */
  int32_t *dbg_cap;             /* m3_forward_debug_selection */
  const int32_t *dbg_ovr;
  void *hscan;                  /* host buffer for the check */
  size_t hscan_bytes;
  /* tensor parallelism (o.tp; see forward.h) */
  m3_tp_link *tp;               /* NULL: one GPU (also for a one-rank link) */
  float *lg_part;               /* [max_batch, vocab_n] this rank's lm_head rows */
  float *lg_all;                /* [tp, max_batch * vn_max] gathered slices */
  int64_t vn_max;               /* the largest rank's vocab_n */
  int v0[M3_TP_COMM_MAX], vn[M3_TP_COMM_MAX]; /* every rank's lm_head rows */
  uint64_t n_ar, n_ag;          /* collectives executed */
  uint64_t n_replays;           /* decode steps replayed from a graph */
  /* L2 prefetch branches of a decode step (prefetch(); M3KIT_L2_PREFETCH) */
  int64_t pf_bytes[M3_PF_PHASES]; /* bytes each phase sends toward L2, as M3KIT_L2_PREFETCH says (unset: 0) */
  cudaStream_t s2;              /* the branch's stream (NULL while off) */
  cudaEvent_t pf_fork, pf_join;
  int pf_open;                  /* a branch forked and not yet joined back */
  int pf_auto;                  /* M3KIT_L2_PREFETCH unset: m3_prefetch_default_bytes a step */
};


/* ------------------------------------------------------------------------ */
/* Plumbing declarations (defined at the end)                               */
/* ------------------------------------------------------------------------ */

static m3_status kern(m3_forward *f, const m3_variant *v, int64_t tokens, int64_t ctx, m3_kernel **k, m3_err *e);
static m3_status linear(m3_forward *f, const step *st, const void *x, const m3_dlinear *w, void *y, const char *what,
                        m3_err *e);
static int op_wanted(m3_forward *f, const char *name);
static m3_status op_begin(m3_forward *f, const char *name, m3_err *e);
static m3_status op_end(m3_forward *f, m3_err *e);
static m3_status check_out(m3_forward *f, int layer, const char *op, const void *p, int64_t n, int dtype, m3_err *e);
static m3_status prefetch(m3_forward *f, const step *st, int phase, const void *w, int64_t bytes, m3_err *e);
static m3_status prefetch_join(m3_forward *f, m3_err *e);
enum { DT_BF16, DT_F32 };
#define OP(name, call)                      \
  do {                                      \
    if (op_wanted(f, name)) {               \
      M3_TRY(op_begin(f, name, e));         \
      M3_TRY(call);                         \
      M3_TRY(op_end(f, e));                 \
    }                                       \
  } while (0)

/* ------------------------------------------------------------------------ */
/* The layers                                                               */
/* ------------------------------------------------------------------------ */

/* Tensor parallelism: x [n, H] holds this rank's partial sum of a
 * row-parallel projection (o_proj, the MLP / MoE down projections over the
 * rank's columns); the all-reduce makes it the whole sum on every rank before
 * the residual add.  Nothing without a link. */
static m3_status tp_sum(m3_forward *f, const step *st, int l, m3_err *e) {
  if (!f->tp) return M3_OK;
  const size_t n = (size_t)st->n * (size_t)f->m->cfg.hidden_size;
  if (op_wanted(f, "allreduce")) f->n_ar++;
  OP("allreduce", m3_tp_allreduce_bf16(f->tp, f->x, n, f->s, e));
  return check_out(f, l, "allreduce", f->x, (int64_t)n, DT_BF16, e);
}

/* The lm_head under tensor parallelism: this rank's [nl, vocab_n] slice
 * (lg_part) gathered from every rank as [tp][nl * vn_max] blocks (equal
 * counts, as NCCL wants: a rank's block is padded to the largest slice), then
 * each rank's block placed at its vocab0 columns of the whole [nl, V] rows. */
static m3_status tp_gather_logits(m3_forward *f, int nl, m3_err *e) {
  const size_t blk = (size_t)nl * (size_t)f->vn_max, V = (size_t)f->m->cfg.vocab_size;
  M3_TRY(m3_tp_allgather_f32(f->tp, f->lg_part, f->lg_all, blk, f->s, e));
  for (int r = 0; r < f->tp->n_ranks; r++)
    M3_CUDA(e, cudaMemcpy2DAsync(f->logits + f->v0[r], V * sizeof(float), f->lg_all + (size_t)r * blk,
                                 (size_t)f->vn[r] * sizeof(float), (size_t)f->vn[r] * sizeof(float), (size_t)nl,
                                 cudaMemcpyDeviceToDevice, f->s));
  return M3_OK;
}

/* P = a · W_qkvᵀ; q/k/(iq/ik) normed and roped, K/V and index-K inserted into
 * the caches (the qk-norm kernel does all of it, §4). */
static m3_status qkv_rope_insert(m3_forward *f, const step *st, int l, m3_err *e) {
  const m3_config *c = &f->m->cfg;
  const m3_dlayer *L = &f->m->layers[l];
  OP("qkv_proj", linear(f, st, f->a, &L->qkv, f->P, "qkv_proj", e));
  M3_TRY(prefetch(f, st, M3_PF_OPROJ, L->o.w, (int64_t)m3_dlinear_bytes(&L->o), e));
  M3_TRY(check_out(f, l, "qkv_proj", f->P, (int64_t)st->n * L->qkv.rows, DT_BF16, e));
  m3_qkr_args qa = {.n_tokens = st->n, .nq = c->num_attention_heads, .nkv = c->num_key_value_heads,
                    .niq = L->sparse ? c->sparse_num_index_heads : 0, .head_dim = c->head_dim,
                    .rotary_dim = c->rotary_dim, .block_size = c->sparse_block_size, .eps = (float)c->rms_norm_eps,
                    .insert = 1, .kv_e4m3 = f->kv->plan.kv_e4m3, .idx_e4m3 = L->sparse ? f->kv->plan.idx_e4m3 : 0};
  m3_variant v;
  m3_kernel *k;
  M3_TRY(m3_qknorm_key(&qa, &v, e));
  /* Bucketed by tokens only: its cost does not depend on the context (the
   * tuner's qknorm buckets have no ctx dimension either). */
  M3_TRY(kern(f, &v, st->n, 0, &k, e));
  OP("qknorm_rope", m3_launch_qknorm_rope(k, &qa, f->P, L->q_norm, L->k_norm, L->iq_norm, L->ik_norm, f->m->rope,
                                          c->max_position_embeddings, f->d_pos, f->d_slot, f->d_slot, f->kv->kv[l],
                                          f->kv->ix[l], f->q, L->sparse ? f->iq : NULL, f->s, e));
  return check_out(f, l, "qknorm_rope", f->q, (int64_t)st->n * m3_config_q_width(c), DT_BF16, e);
}

static m3_attn_args attn_args(const m3_forward *f, const step *st) {
  const m3_config *c = &f->m->cfg;
  m3_attn_args aa = {.n_tokens = st->n, .nq = c->num_attention_heads, .nkv = c->num_key_value_heads,
                     .head_dim = c->head_dim, .block_size = c->sparse_block_size, .kv_e4m3 = f->kv->plan.kv_e4m3,
                     .topk = c->sparse_topk_blocks, .scale = 0.0f};
  return aa;
}

static m3_idx_args idx_args(const m3_forward *f, const step *st) {
  const m3_config *c = &f->m->cfg;
  const int64_t bs = c->sparse_block_size;
  m3_idx_args ia = {.n_tokens = st->n, .n_heads = c->sparse_num_index_heads, .head_dim = c->sparse_index_dim,
                    .block_size = (int)bs, .topk = c->sparse_topk_blocks, .init_blocks = c->sparse_init_block,
                    .local_blocks = c->sparse_local_block, .idx_e4m3 = f->kv->plan.idx_e4m3,
                    .max_blocks = (int)((st->max_kv + bs - 1) / bs)};
  return ia;
}

/* o = attention(q) then x = o · W_oᵀ.  sparse: the indexer selects the
 * blocks first (§5), then block-sparse attention (§6.2); dense: causal GQA
 * over the whole history (§6.3). */
static m3_status attention(m3_forward *f, const step *st, int l, int sparse, m3_err *e) {
  const m3_config *c = &f->m->cfg;
  const m3_attn_args aa = attn_args(f, st);
  const m3_attn_mode mode = st->decode ? M3_ATTN_DECODE : M3_ATTN_PREFILL;
  const int sm = f->rt->dev.sm_count;
  m3_variant v;
  m3_kernel *k;
  if (sparse) {
    const m3_idx_args ia = idx_args(f, st);
    const m3_idx_cache ic = {f->kv->ix[l], f->kv->plan.idx_e4m3, f->kv->plan.num_pages};
    if (st->decode) {
      M3_TRY(m3_index_decode_key(&ia, &v, e));
      M3_TRY(kern(f, &v, st->n, st->max_kv, &k, e));
      OP("indexer", m3_launch_index_decode(k, &ia, &st->b, sm, f->iq, &ic, f->sel, f->idx_ws, f->idx_ws_bytes, f->s, e));
    } else {
      m3_kernel *ks, *kt;
      M3_TRY(m3_index_prefill_key(&ia, M3_IDX_SCORE, &v, e));
      M3_TRY(kern(f, &v, st->n, st->max_kv, &ks, e));
      M3_TRY(m3_index_prefill_key(&ia, M3_IDX_TOPK, &v, e));
      M3_TRY(kern(f, &v, st->n, st->max_kv, &kt, e));
      OP("indexer", m3_launch_index_prefill(ks, kt, &ia, &st->b, f->iq, &ic, f->scores, f->sel, f->s, e));
    }
    if (f->dbg_cap || f->dbg_ovr) { /* the test hook: [L][nkv][n][topk] host arrays */
      const size_t per = (size_t)ia.n_heads * (size_t)st->n * (size_t)ia.topk * sizeof(int32_t);
      if (f->dbg_cap) M3_CUDA(e, cudaMemcpyAsync((char *)f->dbg_cap + (size_t)l * per, f->sel, per, cudaMemcpyDeviceToHost, f->s));
      if (f->dbg_ovr)
        M3_CUDA(e, cudaMemcpyAsync(f->sel, (const char *)f->dbg_ovr + (size_t)l * per, per, cudaMemcpyHostToDevice, f->s));
      M3_CUDA(e, cudaStreamSynchronize(f->s));
    }
    M3_TRY(m3_attn_sparse_key(&aa, mode, &v, e));
    M3_TRY(kern(f, &v, st->n, st->max_kv, &k, e));
    OP("attn_sparse", m3_launch_attn_sparse(k, &aa, &st->b, st->max_kv, sm, f->q, f->kv->kv[l], f->sel, f->ao,
                                            st->decode ? f->attn_ws : NULL, st->decode ? f->attn_ws_bytes : 0, f->s, e));
  } else {
    M3_TRY(m3_attn_dense_key(&aa, mode, &v, e));
    M3_TRY(kern(f, &v, st->n, st->max_kv, &k, e));
    OP("attn_dense", m3_launch_attn_dense(k, &aa, &st->b, st->max_kv, sm, f->q, f->kv->kv[l], f->ao,
                                          st->decode ? f->attn_ws : NULL, st->decode ? f->attn_ws_bytes : 0, f->s, e));
  }
  M3_TRY(check_out(f, l, sparse ? "attn_sparse" : "attn_dense", f->ao, (int64_t)st->n * m3_config_q_width(c), DT_BF16, e));
  OP("o_proj", linear(f, st, f->ao, &f->m->layers[l].o, f->x, "o_proj", e));
  if (f->m->layers[l].moe) { /* the shared expert's gate|up: the routed experts are not known yet */
    const m3_moe_weights *w = &f->moe_w[l];
    M3_TRY(prefetch(f, st, M3_PF_FFN, w->shared_gu, 2 * w->shared_inter * w->hidden * (w->e4m3 ? 1 : 2), e));
  } else {
    M3_TRY(prefetch(f, st, M3_PF_FFN, f->m->layers[l].mlp_gu.w, (int64_t)m3_dlinear_bytes(&f->m->layers[l].mlp_gu), e));
  }
  M3_TRY(check_out(f, l, "o_proj", f->x, (int64_t)st->n * c->hidden_size, DT_BF16, e));
  return tp_sum(f, st, l, e);
}

/* r += x; out = RMSNorm(r, w) (the fused add + norm, §2.3, §10.2).  After
 * a MoE layer that left its combine pending (moe(), M3KIT_MOE_FUSE=norm), x
 * is that combine, formed inside the same launch (§12.6; the same r and out
 * bit for bit) and never stored: f->x keeps the previous sublayer's output. */
static m3_status add_norm(m3_forward *f, const step *st, int l, const m3_bf16 *w, m3_bf16 *out, float *out32,
                          const char *what, m3_err *e) {
  const m3_config *c = &f->m->cfg;
  m3_variant v;
  m3_kernel *k;
  const m3_moe_pending p = f->pend;
  f->pend.active = 0; /* consumed here even when a breakdown capture leaves this op out */
  if (p.active) {
    if (out32 || p.n_tokens != st->n)
      return m3_errf(e, M3_INVAL, "forward: layer %d: %s cannot take the MoE combine left pending (%" PRId64
                     " tokens, f32 copy %d)", l, what, p.n_tokens, out32 != NULL);
    M3_TRY(m3_rmsnorm_combine_key(p.topk, 0, c->hidden_size, &v, e));
    M3_TRY(kern(f, &v, st->n, 0, &k, e));
    OP(what, m3_launch_add_rmsnorm_combine(k, st->n, c->hidden_size, p.topk, p.y, p.w, p.shared, f->r, w,
                                           (float)c->rms_norm_eps, out, NULL, f->s, e));
  } else {
    M3_TRY(m3_rmsnorm_key(1, out32 != NULL, c->hidden_size, &v, e));
    M3_TRY(kern(f, &v, st->n, 0, &k, e));
    OP(what, m3_launch_add_rmsnorm(k, st->n, c->hidden_size, f->x, f->r, w, (float)c->rms_norm_eps, out, out32, f->s,
                                   e));
  }
  return check_out(f, l, what, out, (int64_t)st->n * c->hidden_size, DT_BF16, e);
}

/* Dense SwiGLU-OAI MLP (§7.1): x = down(swiglu(mb · [gate; up]ᵀ)). */
static m3_status dense_mlp(m3_forward *f, const step *st, int l, m3_err *e) {
  const m3_config *c = &f->m->cfg;
  const m3_dlayer *L = &f->m->layers[l];
  const int64_t F = c->dense_intermediate_size;
  m3_variant v;
  m3_kernel *k;
  OP("mlp_gate_up", linear(f, st, f->mb, &L->mlp_gu, f->gu, "mlp gate_up", e));
  M3_TRY(m3_swiglu_key(F, (float)c->swiglu_alpha, (float)c->swiglu_limit, (float)c->swiglu_beta, &v, e));
  M3_TRY(kern(f, &v, st->n, 0, &k, e));
  OP("swiglu", m3_launch_swiglu(k, st->n, F, f->gu, f->act, f->s, e));
  M3_TRY(check_out(f, l, "swiglu", f->act, st->n * F, DT_BF16, e));
  OP("mlp_down", linear(f, st, f->act, &L->mlp_down, f->x, "mlp down", e));
  return check_out(f, l, "mlp_down", f->x, (int64_t)st->n * c->hidden_size, DT_BF16, e);
}

/* The MoE op's launches as sub-ops of their own ("moe/route", ...), so that
 * a graph breakdown can time each alone and the step without it. */
static unsigned moe_stages(m3_forward *f) {
  static const char *const sub[] = {"moe/router", "moe/route", "moe/gate_up", "moe/swiglu", "moe/down", "moe/combine"};
  unsigned bits = 0;
  for (unsigned i = 0; i < sizeof sub / sizeof sub[0]; i++)
    if (op_wanted(f, sub[i])) bits |= 1u << i;
  return bits;
}

/* MoE with the shared expert (§7.2): router, top-k, experts, combine.
 * M3KIT_MOE_FUSE=norm (f->moe_ws.fuse): a decode step's layer leaves the
 * combine to the add_norm that follows it ("input_norm": the next layer's
 * input norm or the final norm), one launch a layer fewer; f->x is then not
 * written.  Not where something reads x in between: the numerics check
 * (check_out of "moe"), tensor parallelism (the all-reduce of x, tp_sum), nor
 * in prefill chunks (decode steps only).  Timing tables and the graph
 * breakdown then count the combine under "input_norm", no longer under
 * "moe".  What is pending is planned apart from the layer's launches, so a
 * breakdown capture of "input_norm" alone (the layer left out) still builds
 * the fused launch, over the workspace's rows of the last step - its
 * values are as stale as every other op's inputs in such a capture, its
 * pointers are the real ones. */
static m3_status moe(m3_forward *f, const step *st, int l, m3_err *e) {
  const m3_config *c = &f->m->cfg;
  (void)op_wanted(f, "moe"); /* noted before its sub-ops, for the breakdown's order */
  f->moe_ws.stages = moe_stages(f);
  m3_moe_args ma = {.n_tokens = st->n, .hidden = c->hidden_size, .n_experts = c->num_local_experts,
                    .topk = c->num_experts_per_tok, .renormalize = 1, .routed_scaling = (float)c->routed_scaling_factor,
                    .alpha = (float)c->swiglu_alpha, .limit = (float)c->swiglu_limit, .beta = (float)c->swiglu_beta};
  const int path = st->gemv ? 1 : 2, defer = st->decode && !f->check && !f->tp;
  m3_moe_pending *pend = defer ? &f->pend : NULL;
  memset(&f->pend, 0, sizeof f->pend);
  if (pend) M3_TRY(m3_moe_pending_plan(&ma, &f->moe_w[l], &f->moe_ws, NULL, path, pend, e));
  OP("moe", m3_moe_forward_pending(f->rt, &f->g, &ma, &f->moe_w[l], &f->moe_ws, f->mb, st->gemv ? NULL : f->m32, f->x,
                                   NULL, NULL, path, pend, e));
  if (f->pend.active) return M3_OK; /* x is not written (and f->check is off) */
  return check_out(f, l, "moe", f->x, (int64_t)st->n * c->hidden_size, DT_BF16, e);
}

static m3_status ffn(m3_forward *f, const step *st, int l, m3_err *e) {
  M3_TRY(f->m->layers[l].moe ? moe(f, st, l, e) : dense_mlp(f, st, l, e));
  if (l + 1 < f->m->cfg.num_hidden_layers) {
    const m3_dlinear *q = &f->m->layers[l + 1].qkv;
    M3_TRY(prefetch(f, st, M3_PF_QKV, q->w, (int64_t)m3_dlinear_bytes(q), e));
  } else { /* lm_head: bf16 [vocab_n, hidden] */
    M3_TRY(prefetch(f, st, M3_PF_QKV, f->m->lm_head, (int64_t)f->m->vocab_n * f->m->cfg.hidden_size * 2, e));
  }
  return tp_sum(f, st, l, e);
}

/* The input norm of the next layer, or the final norm after the last one. */
static const m3_bf16 *next_norm(const m3_forward *f, int l) {
  return l + 1 < f->m->cfg.num_hidden_layers ? f->m->layers[l + 1].input_norm : f->m->final_norm;
}

/* Layers 0-2 of M3: dense causal attention, dense MLP (§2.1). */
static m3_status dense_layer(m3_forward *f, const step *st, int l, m3_err *e) {
  M3_TRY(qkv_rope_insert(f, st, l, e));
  M3_TRY(attention(f, st, l, 0, e));
  M3_TRY(add_norm(f, st, l, f->m->layers[l].post_norm, f->mb, f->m->layers[l].moe && !st->gemv ? f->m32 : NULL,
                  "post_norm", e));
  M3_TRY(ffn(f, st, l, e));
  return add_norm(f, st, l, next_norm(f, l), f->a, NULL, "input_norm", e);
}

/* Layers 3-59: lightning indexer + block-sparse attention, MoE (§2.4). */
static m3_status sparse_layer(m3_forward *f, const step *st, int l, m3_err *e) {
  M3_TRY(qkv_rope_insert(f, st, l, e));
  M3_TRY(attention(f, st, l, 1, e));
  M3_TRY(add_norm(f, st, l, f->m->layers[l].post_norm, f->mb, f->m->layers[l].moe && !st->gemv ? f->m32 : NULL,
                  "post_norm", e));
  M3_TRY(ffn(f, st, l, e));
  return add_norm(f, st, l, next_norm(f, l), f->a, NULL, "input_norm", e);
}

/* The whole model on the staged inputs: embed, layers, and lm_head on the
 * rows in [logit_row0, n) (prefill: the last token only; < 0: none, for the
 * chunks before the last). */
static m3_status forward_body(m3_forward *f, const step *st, int logit_row0, m3_err *e) {
  const m3_model *m = f->m;
  const m3_config *c = &m->cfg;
  m3_variant v;
  m3_kernel *k;
  f->pend.active = 0; /* never a combine left over from a step that failed half way */
  M3_TRY(m3_embed_key(c->hidden_size, &v, e));
  M3_TRY(kern(f, &v, st->n, 0, &k, e));
  OP("embed", m3_launch_embed(k, st->n, c->hidden_size, c->vocab_size, f->d_ids, m->embed, f->r, f->d_err, f->s, e));
  M3_TRY(check_out(f, -1, "embed", f->r, (int64_t)st->n * c->hidden_size, DT_BF16, e));
  M3_TRY(m3_rmsnorm_key(0, 0, c->hidden_size, &v, e));
  M3_TRY(kern(f, &v, st->n, 0, &k, e));
  OP("input_norm", m3_launch_rmsnorm(k, st->n, c->hidden_size, f->r, m->layers[0].input_norm, (float)c->rms_norm_eps,
                                     f->a, NULL, f->s, e));
  M3_TRY(check_out(f, 0, "input_norm", f->a, (int64_t)st->n * c->hidden_size, DT_BF16, e));
  for (int l = 0; l < c->num_hidden_layers; l++) {
    if (m->layers[l].sparse) M3_TRY(sparse_layer(f, st, l, e));
    else M3_TRY(dense_layer(f, st, l, e));
  }
  /* lm_head: fp32 logits from the final-normed rows, always a GEMV (at most
   * max_batch rows; a prefill needs only its last token).  Under tensor
   * parallelism the rank's vocab_n rows, then gathered into whole rows. */
  if (logit_row0 < 0) return prefetch_join(f, e);
  const int nl = st->n - logit_row0;
  m3_gemv_args ga = {.n = nl, .rows = m->vocab_n, .cols = c->hidden_size, .wfmt = M3_GEMV_BF16, .out_f32 = 1};
  M3_TRY(m3_gemv_kernel(f->rt, &ga, &k, e));
  OP("lm_head", m3_launch_gemv(k, &ga, f->a + (size_t)logit_row0 * c->hidden_size, m->lm_head, NULL,
                               f->tp ? f->lg_part : f->logits, f->s, e));
  if (f->tp) {
    if (op_wanted(f, "allgather")) f->n_ag++;
    OP("allgather", tp_gather_logits(f, nl, e));
  }
  M3_TRY(prefetch_join(f, e));
  return check_out(f, -1, "lm_head", f->logits, (int64_t)nl * c->vocab_size, DT_F32, e);
}

/* ------------------------------------------------------------------------ */
/* Steps                                                                    */
/* ------------------------------------------------------------------------ */

static m3_seq_batch device_batch(const m3_forward *f) {
  const m3_kv_cache *kv = f->kv;
  m3_seq_batch b = {.n_seqs = kv->plan.max_seqs, .seq_lens = kv->d_seq_lens, .block_table = kv->d_block_table,
                    .bt_stride = kv->plan.pages_per_seq, .num_pages = kv->plan.num_pages, .token_seq = f->d_seq,
                    .positions = f->d_pos};
  return b;
}

/* Copy the staged inputs of n rows and the cache tables to the device. */
static m3_status upload_inputs(m3_forward *f, int n, m3_err *e) {
  M3_CUDA(e, cudaMemcpyAsync(f->d_ids, f->h_ids, sizeof(int32_t) * (size_t)n, cudaMemcpyHostToDevice, f->s));
  M3_CUDA(e, cudaMemcpyAsync(f->d_seq, f->h_seq, sizeof(int32_t) * (size_t)n, cudaMemcpyHostToDevice, f->s));
  M3_CUDA(e, cudaMemcpyAsync(f->d_pos, f->h_pos, sizeof(int64_t) * (size_t)n, cudaMemcpyHostToDevice, f->s));
  M3_CUDA(e, cudaMemcpyAsync(f->d_slot, f->h_slot, sizeof(int64_t) * (size_t)n, cudaMemcpyHostToDevice, f->s));
  return m3_kv_sync(f->kv, f->s, e);
}

/* Sample rows [0, n) of the logits buffer into next (host), and copy the
 * logits out when asked.  Synchronises. */
static m3_status finish(m3_forward *f, int n, const m3_sampling *smp, int32_t *next, float *logits, m3_err *e) {
  const int64_t V = f->m->cfg.vocab_size;
  if (next) {
    m3_sampling greedy = {0, 0, 0, 0};
    if (!smp) smp = &greedy;
    m3_sample_args sa = {.n_rows = n, .vocab = V, .logits_bf16 = 0, .temperature = smp->temperature,
                         .top_p = smp->top_p, .seed = smp->seed, .step = smp->step};
    m3_variant v;
    m3_kernel *k;
    M3_TRY(m3_sample_key(&sa, &v, e));
    M3_TRY(kern(f, &v, n, 0, &k, e));
    OP("sample", m3_launch_sample(k, &sa, f->logits, f->d_next, f->s, e));
    M3_TRY(m3_sample_finish(&sa, f->logits, f->d_next, next, f->s, e));
  }
  if (logits)
    M3_CUDA(e, cudaMemcpyAsync(logits, f->logits, sizeof(float) * (size_t)(n * V), cudaMemcpyDeviceToHost, f->s));
  M3_CUDA(e, cudaStreamSynchronize(f->s));
  return M3_OK;
}

m3_status m3_forward_prefill(m3_forward *f, int seq, int n, const int32_t *ids, const m3_sampling *smp,
                             int32_t *next, float *logits, m3_err *e) {
  const m3_config *c = &f->m->cfg;
  if (n <= 0 || !ids) return m3_errf(e, M3_INVAL, "prefill: %d tokens", n);
  M3_TRY(m3_embed_check_host(n, c->vocab_size, ids, e));
  if (seq < 0 || seq >= f->kv->plan.max_seqs || !f->kv->admitted[seq])
    return m3_errf(e, M3_INVAL, "prefill: sequence %d is not admitted", seq);
  if (f->kv->seq_lens[seq] + (int64_t)n > f->kv->admitted[seq])
    return m3_errf(e, M3_CAPACITY, "prefill: sequence %d holds %d tokens, %d more exceed the %" PRId64
                   " it was admitted with", seq, f->kv->seq_lens[seq], n, f->kv->admitted[seq]);
  for (int t0 = 0; t0 < n; t0 += f->o.max_chunk) {
    const int nt = n - t0 < f->o.max_chunk ? n - t0 : f->o.max_chunk;
    M3_CUDA(e, cudaStreamSynchronize(f->s)); /* the staging buffers are free again */
    memcpy(f->h_ids, ids + t0, sizeof *ids * (size_t)nt);
    for (int i = 0; i < nt; i++) f->h_seq[i] = seq;
    M3_TRY(m3_kv_append(f->kv, seq, nt, f->h_pos, f->h_slot, e));
    step st = {.n = nt, .decode = 0, .gemv = nt <= DECODE_ROWS, .max_kv = f->h_pos[nt - 1] + 1,
               .b = device_batch(f)};
    m3_status s = upload_inputs(f, nt, e);
    if (s == M3_OK) s = forward_body(f, &st, t0 + nt == n ? nt - 1 : -1, e);
    if (s != M3_OK) { /* the chunk is not in the caches: forget it (earlier chunks stay) */
      f->kv->seq_lens[seq] -= nt;
      return m3_err_prefix(e, "prefill of sequence %d, tokens [%d, %d): ", seq, t0, t0 + nt);
    }
  }
  M3_TRY(finish(f, 1, smp, next, logits, e));
  return M3_OK;
}

/* Decode steps replay a graph captured for (batch size, context bucket): the
 * bucket is the power of two >= the longest sequence (>= 2 pages), capped at
 * the cache's context, and is what the attention and indexer plans are sized
 * for, so one graph serves every step until a sequence outgrows it. */
static int64_t ctx_bucket(const m3_forward *f, int64_t len) {
  int64_t b = 2 * (int64_t)f->kv->plan.page_size, cap = f->kv->plan.pages_per_seq * f->kv->plan.page_size;
  while (b < len) b *= 2;
  return b < cap ? b : cap;
}

static m3_status capture(m3_forward *f, const step *st, graph *gr, m3_err *e) {
  cudaGraph_t g = NULL;
  /* Relaxed mode: kernels built on first use load modules while capturing;
   * the eager step before this one has built them all, but a tuning-DB
   * change between the two must not make the capture fail. */
  M3_CUDA(e, cudaStreamSynchronize(f->s));
  M3_CUDA(e, cudaStreamBeginCapture(f->s, cudaStreamCaptureModeRelaxed));
  f->capturing = 1;
  const uint64_t ar = f->n_ar, ag = f->n_ag; /* captured, not executed: counted at each replay */
  m3_status s = forward_body(f, st, 0, e);
  gr->n_ar = (int)(f->n_ar - ar), gr->n_ag = (int)(f->n_ag - ag);
  f->n_ar = ar, f->n_ag = ag;
  f->capturing = 0;
  cudaError_t ce = cudaStreamEndCapture(f->s, &g);
  if (s != M3_OK) {
    if (g) cudaGraphDestroy(g);
    return m3_err_prefix(e, "capturing the decode graph: ");
  }
  if (ce != cudaSuccess) return m3_cuda_fail(e, ce, "cudaStreamEndCapture", __FILE__, __LINE__);
  ce = cudaGraphInstantiate(&gr->exec, g, 0);
  if (ce != cudaSuccess) {
    cudaGraphDestroy(g);
    return m3_cuda_fail(e, ce, "cudaGraphInstantiate", __FILE__, __LINE__);
  }
  gr->g = g;
  return M3_OK;
}

m3_status m3_forward_decode(m3_forward *f, int n, const int *seqs, const int32_t *ids, const m3_sampling *smp,
                            int32_t *next, float *logits, m3_err *e) {
  const m3_config *c = &f->m->cfg;
  if (n <= 0 || n > f->o.max_batch || !seqs || !ids)
    return m3_errf(e, M3_INVAL, "decode: %d sequences (max_batch %d)", n, f->o.max_batch);
  M3_TRY(m3_embed_check_host(n, c->vocab_size, ids, e));
  for (int i = 0; i < n; i++) {
    const int q = seqs[i];
    if (q < 0 || q >= f->kv->plan.max_seqs || !f->kv->admitted[q])
      return m3_errf(e, M3_INVAL, "decode: row %d: sequence %d is not admitted", i, q);
    if (f->kv->seq_lens[q] + 1 > f->kv->admitted[q])
      return m3_errf(e, M3_CAPACITY, "decode: sequence %d already holds the %" PRId64 " tokens it was admitted with",
                     q, f->kv->admitted[q]);
    for (int j = 0; j < i; j++)
      if (seqs[j] == q) return m3_errf(e, M3_INVAL, "decode: sequence %d appears twice in one step", q);
  }
  M3_CUDA(e, cudaStreamSynchronize(f->s));
  int64_t longest = 0;
  for (int i = 0; i < n; i++) {
    f->h_ids[i] = ids[i];
    f->h_seq[i] = seqs[i];
    M3_TRY(m3_kv_append(f->kv, seqs[i], 1, &f->h_pos[i], &f->h_slot[i], e));
    if (f->h_pos[i] + 1 > longest) longest = f->h_pos[i] + 1;
  }
  m3_status s = upload_inputs(f, n, e);
  if (s != M3_OK) goto fail;
  step st = {.n = n, .decode = 1, .gemv = n <= DECODE_ROWS, .max_kv = ctx_bucket(f, longest), .b = device_batch(f)};
  /* Graphs need a step without host round trips: GEMV-sized (the cuBLAS MoE
   * path reads expert counts back), no timing events, no numerics scans. */
  const int graphs = f->o.use_graph && !f->o.timing && !f->check && !f->dbg_cap && !f->dbg_ovr && st.gemv &&
                     (!f->tp || f->tp->capturable);
  graph *gr = NULL;
  for (int i = 0; graphs && i < f->n_graphs && !gr; i++)
    if (f->graphs[i].n == n && f->graphs[i].bucket == st.max_kv) gr = &f->graphs[i];
  if (gr) {
    f->last_graph = (int)(gr - f->graphs);
    f->n_ar += (uint64_t)gr->n_ar, f->n_ag += (uint64_t)gr->n_ag;
    cudaError_t ce = cudaGraphLaunch(gr->exec, f->s);
    if (ce != cudaSuccess) s = m3_cuda_fail(e, ce, "cudaGraphLaunch", __FILE__, __LINE__);
    else f->n_replays++;
  } else {
    s = forward_body(f, &st, 0, e);
    if (s != M3_OK) m3_err_prefix(e, "decode step of %d sequences: ", n);
    /* This step ran eagerly (it also built every kernel it needs); record it
     * as a graph for the next steps of this shape. */
    if (s == M3_OK && graphs && f->n_graphs < MAX_GRAPHS) {
      graph *ng = &f->graphs[f->n_graphs];
      ng->n = n;
      ng->bucket = st.max_kv;
      ng->st = st;
      if ((s = capture(f, &st, ng, e)) == M3_OK) f->last_graph = f->n_graphs++;
    }
  }
  if (s == M3_OK) s = finish(f, n, smp, next, logits, e);
  if (s == M3_OK) return M3_OK;
fail: /* this step's tokens are not (reliably) in the caches: forget them */
  for (int i = 0; i < n; i++) f->kv->seq_lens[seqs[i]]--;
  return s;
}

/* ------------------------------------------------------------------------ */
/* Setup                                                                    */
/* ------------------------------------------------------------------------ */

m3_fwd_opts m3_fwd_defaults(void) {
  m3_fwd_opts o = {.max_batch = 1, .max_chunk = 256, .use_graph = 1, .timing = 0, .check_numerics = -1, .tp = NULL};
  return o;
}

static int64_t max_linear_elems(const m3_model *m) {
  int64_t b = 0;
  for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
    const m3_dlayer *L = &m->layers[l];
    const m3_dlinear *w[] = {&L->qkv, &L->o, &L->mlp_gu, &L->mlp_down, &L->sh_gu, &L->sh_down};
    for (size_t i = 0; i < sizeof w / sizeof *w; i++)
      if (w[i]->mxfp8 && w[i]->rows * w[i]->cols > b) b = w[i]->rows * w[i]->cols;
  }
  return b;
}

uint64_t m3_forward_activation_bytes(const m3_config *c, const m3_fwd_opts *o, int64_t max_ctx) {
  const uint64_t R = (uint64_t)(o->max_chunk > o->max_batch ? o->max_chunk : o->max_batch);
  const uint64_t H = (uint64_t)c->hidden_size, Q = (uint64_t)m3_config_q_width(c);
  const uint64_t bs = (uint64_t)c->sparse_block_size, nb = ((uint64_t)max_ctx + bs - 1) / bs;
  uint64_t qkv = 0;
  for (int l = 0; l < c->num_hidden_layers; l++)
    if ((uint64_t)m3_config_qkv_width(c, l) > qkv) qkv = (uint64_t)m3_config_qkv_width(c, l);
  uint64_t b = R * H * (2 * 4 + 4) + R * qkv * 2 + R * Q * 4 + R * (uint64_t)c->sparse_num_index_heads * 256;
  b += (uint64_t)c->sparse_num_index_heads * (uint64_t)o->max_chunk * nb * 4;
  b += R * (uint64_t)c->dense_intermediate_size * 6;
  b += (uint64_t)o->max_batch * (uint64_t)c->vocab_size * 4;
  /* MoE workspace ~ R*K*(3I + H)*2 + dequant scratch of the largest weight */
  b += R * (uint64_t)c->num_experts_per_tok * (3 * (uint64_t)c->intermediate_size + H) * 2;
  b += 2 * (uint64_t)c->dense_intermediate_size * H * 2 * 2;
  return b;
}

static m3_status dmalloc(void **p, size_t bytes, const char *what, m3_err *e) {
  cudaError_t r = cudaMalloc(p, bytes ? bytes : 16);
  if (r != cudaSuccess) {
    *p = NULL;
    cudaGetLastError();
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    return m3_errf(e, r == cudaErrorMemoryAllocation ? M3_CAPACITY : M3_CUDA,
                   "forward: %s: cudaMalloc(%zu) failed (%zu bytes free): %s", what, bytes, fr, cudaGetErrorString(r));
  }
  /* Zeroed once: tiles that load whole rows or padded batch rows past n read
   * activation memory no op has written yet (their results are discarded,
   * but compute-sanitizer's initcheck rightly flags the reads, and garbage
   * could hold NaN bit patterns). */
  M3_CUDA(e, cudaMemset(*p, 0, bytes ? bytes : 16));
  /* cudaMemset runs on the legacy stream, which does not order against the
   * non-blocking stream that initialises workspaces right after: finish it. */
  M3_CUDA(e, cudaDeviceSynchronize());
  return M3_OK;
}

/* The MoE weight descriptors op_ffn.h wants: device and host pointer tables
 * per layer (E entries; experts that are not resident get NULL, which the
 * -inf routing bias guarantees are never chosen - a bug would fault loudly
 * instead of computing with another expert's weights). */
static m3_status build_moe_tables(m3_forward *f, m3_err *e) {
  const m3_model *m = f->m;
  const m3_config *c = &m->cfg;
  const int L = c->num_hidden_layers, E = c->num_local_experts, nm = m3_config_n_moe_layers(c);
  f->moe_w = calloc((size_t)L, sizeof *f->moe_w);
  f->htabs = calloc((size_t)nm * 4 * (size_t)E + 1, sizeof *f->htabs);
  if (!f->moe_w || !f->htabs) return m3_errf(e, M3_NOMEM, "forward: MoE tables");
  if (!nm) return M3_OK;
  M3_TRY(dmalloc((void **)&f->tabs, sizeof(void *) * (size_t)nm * 4 * (size_t)E, "MoE pointer tables", e));
  int j = 0;
  for (int l = 0; l < L; l++) {
    if (!m->layers[l].moe) continue;
    const m3_dlayer *ly = &m->layers[l];
    const void **h = f->htabs + (size_t)j * 4 * E;
    for (int x = 0; x < E; x++) {
      const int res = x < ly->w13.n_stack;
      h[x] = res ? m3_dlinear_at(&ly->w13, x) : NULL;
      h[E + x] = res ? m3_dlinear_scale_at(&ly->w13, x) : NULL;
      h[2 * E + x] = res ? m3_dlinear_at(&ly->w2, x) : NULL;
      h[3 * E + x] = res ? m3_dlinear_scale_at(&ly->w2, x) : NULL;
    }
    void **d = f->tabs + (size_t)j * 4 * E;
    M3_CUDA(e, cudaMemcpy(d, h, sizeof(void *) * 4 * (size_t)E, cudaMemcpyHostToDevice));
    m3_moe_weights *w = &f->moe_w[l];
    w->n_experts = E;
    w->e4m3 = ly->w13.mxfp8;
    w->hidden = c->hidden_size;
    w->inter = c->intermediate_size;
    w->shared_inter = m3_config_shared_width(c);
    w->wg = ly->router;
    w->bias = ly->bias;
    w->gu_tab = (const void *const *)d;
    w->gu_scale_tab = w->e4m3 ? (const void *const *)(d + E) : NULL;
    w->down_tab = (const void *const *)(d + 2 * E);
    w->down_scale_tab = w->e4m3 ? (const void *const *)(d + 3 * E) : NULL;
    w->h_gu = (const void *const *)h;
    w->h_gu_scale = (const void *const *)(h + E);
    w->h_down = (const void *const *)(h + 2 * E);
    w->h_down_scale = (const void *const *)(h + 3 * E);
    w->shared_gu = ly->sh_gu.w;
    w->shared_gu_scale = ly->sh_gu.scale;
    w->shared_down = ly->sh_down.w;
    w->shared_down_scale = ly->sh_down.scale;
    if (ly->sh_gu.rows && ly->sh_gu.mxfp8 != w->e4m3)
      return m3_errf(e, M3_FORMAT, "forward: layer %d: shared and routed experts differ in format (MXFP8 vs bf16)", l);
    j++;
  }
  return M3_OK;
}

/* Workspaces of the decode attention and indexer kernels.  The tile (hence
 * the split count, hence the workspace) is chosen per (tokens, ctx) bucket
 * from the tuning DB, so every bucket a decode launch can fall in is visited
 * and the largest need of its kernel at that bucket's largest launch kept:
 * no tuned tile can ask for more than was allocated. */
static m3_status decode_workspaces(m3_forward *f, m3_err *e) {
  const m3_config *c = &f->m->cfg;
  const int sm = f->rt->dev.sm_count;
  const int64_t max_kv = f->kv->plan.pages_per_seq * f->kv->plan.page_size;
  const int dense = m3_config_n_sparse_layers(c) < c->num_hidden_layers, sparse = m3_config_n_sparse_layers(c) > 0;
  size_t ws = 0, iws = 0;
  for (int64_t bt = 1; bt / 2 < f->o.max_batch; bt *= 2)
    for (int64_t bc = 1; bc / 2 < max_kv; bc *= 2) {
      step st = {.n = (int)(bt < f->o.max_batch ? bt : f->o.max_batch), .decode = 1,
                 .max_kv = bc < max_kv ? bc : max_kv};
      const m3_attn_args aa = attn_args(f, &st);
      m3_variant v;
      m3_kernel *k;
      if (dense) {
        M3_TRY(m3_attn_dense_key(&aa, M3_ATTN_DECODE, &v, e));
        M3_TRY(kern(f, &v, st.n, st.max_kv, &k, e));
        size_t b = m3_attn_workspace_bytes(k, &aa, st.max_kv, sm);
        if (b > ws) ws = b;
      }
      if (sparse) {
        M3_TRY(m3_attn_sparse_key(&aa, M3_ATTN_DECODE, &v, e));
        M3_TRY(kern(f, &v, st.n, st.max_kv, &k, e));
        size_t b = m3_attn_workspace_bytes(k, &aa, st.max_kv, sm);
        if (b > ws) ws = b;
        const m3_idx_args ia = idx_args(f, &st);
        M3_TRY(m3_index_decode_key(&ia, &v, e));
        M3_TRY(kern(f, &v, st.n, st.max_kv, &k, e));
        b = m3_index_decode_workspace_bytes(k, &ia, sm);
        if (b > iws) iws = b;
      }
    }
  f->idx_ws_bytes = iws;
  if (iws) {
    M3_TRY(dmalloc(&f->idx_ws, iws, "indexer workspace", e));
    M3_TRY(m3_index_workspace_init(f->idx_ws, iws, f->s, e));
  }
  f->attn_ws_bytes = ws;
  if (ws) {
    M3_TRY(dmalloc(&f->attn_ws, ws, "attention workspace", e));
    M3_TRY(m3_attn_workspace_init(f->attn_ws, ws, f->s, e));
  }
  return M3_OK;
}

m3_status m3_forward_create(m3_rt *rt, const m3_model *m, m3_kv_cache *kv, const m3_fwd_opts *o, m3_forward **out,
                            m3_err *e) {
  *out = NULL;
  const m3_config *c = &m->cfg;
  if (o->max_batch < 1 || o->max_batch > kv->plan.max_seqs || o->max_chunk < 0)
    return m3_errf(e, M3_INVAL, "forward: max_batch %d must be in [1, the cache's %d sequences], max_chunk >= 0",
                   o->max_batch, kv->plan.max_seqs);
  if (kv->cfg.num_hidden_layers != c->num_hidden_layers || kv->cfg.sparse_block_size != c->sparse_block_size)
    return m3_errf(e, M3_INVAL, "forward: the KV cache was made for another config");
  /* a rank's model and its link come together (forward.h, tensor parallelism) */
  const int link_n = o->tp ? o->tp->n_ranks : 1, link_r = o->tp ? o->tp->rank : 0, model_tp = m->tp > 1 ? m->tp : 1;
  if (model_tp != link_n || (link_n > 1 && m->rank != link_r))
    return m3_errf(e, M3_INVAL, "forward: the model is rank %d of %d, the tensor-parallel link rank %d of %d", m->rank,
                   model_tp, link_r, link_n);
  if (kv->cfg.num_key_value_heads != c->num_key_value_heads)
    return m3_errf(e, M3_INVAL, "forward: the KV cache holds %d KV heads a layer, the model computes %d (a rank's cache "
                   "is made from its model's config)", kv->cfg.num_key_value_heads, c->num_key_value_heads);
  m3_forward *f = calloc(1, sizeof *f);
  if (f) f->last_graph = -1;
  if (!f) return m3_errf(e, M3_NOMEM, "forward");
  f->rt = rt;
  f->m = m;
  f->kv = kv;
  f->o = *o;
  if (!f->o.max_chunk) f->o.max_chunk = 256;
  f->s = rt->stream;
  {
    /* the branch's stream where any phase may use it: M3KIT_L2_PREFETCH's
     * values, or the default's at its shortest context */
    m3_status ps = m3_prefetch_parse(getenv("M3KIT_L2_PREFETCH"), f->pf_bytes, &f->pf_auto, e);
    int any = 0;
    for (int i = 0; i < M3_PF_PHASES; i++)
      any |= f->pf_auto ? m3_prefetch_default_bytes(10 * rt->dev.cc_major + rt->dev.cc_minor, i, 0) > 0
                        : f->pf_bytes[i] > 0;
    if (ps == M3_OK && any) {
      if (cudaStreamCreateWithFlags(&f->s2, cudaStreamNonBlocking) != cudaSuccess ||
          cudaEventCreateWithFlags(&f->pf_fork, cudaEventDisableTiming) != cudaSuccess ||
          cudaEventCreateWithFlags(&f->pf_join, cudaEventDisableTiming) != cudaSuccess)
        ps = m3_errf(e, M3_CUDA, "forward: the L2 prefetch branch's stream and events");
    }
    if (ps != M3_OK) {
      m3_forward_free(f);
      return ps;
    }
  }
  if (f->o.check_numerics < 0) {
    f->check = m3_env_flag("M3KIT_CHECK_NUMERICS");
  } else {
    f->check = f->o.check_numerics;
  }
  f->rows = f->o.max_chunk > f->o.max_batch ? f->o.max_chunk : f->o.max_batch;
  const size_t R = (size_t)f->rows, H = (size_t)c->hidden_size, Q = (size_t)m3_config_q_width(c);
  size_t qkv = 0;
  for (int l = 0; l < c->num_hidden_layers; l++)
    if ((size_t)m3_config_qkv_width(c, l) > qkv) qkv = (size_t)m3_config_qkv_width(c, l);
  m3_status s = m3_gemm_open(&f->g, f->s, e);
  if (s != M3_OK) {
    free(f);
    return s;
  }
#define ALLOC(ptr, bytes) \
  if (s == M3_OK) s = dmalloc((void **)&(ptr), (bytes), #ptr, e)
  ALLOC(f->r, R * H * 2);
  ALLOC(f->a, R * H * 2);
  ALLOC(f->mb, R * H * 2);
  ALLOC(f->x, R * H * 2);
  ALLOC(f->m32, R * H * 4);
  ALLOC(f->P, R * qkv * 2);
  ALLOC(f->q, R * Q * 2);
  ALLOC(f->ao, R * Q * 2);
  ALLOC(f->iq, R * (size_t)c->sparse_num_index_heads * (size_t)c->sparse_index_dim * 2);
  ALLOC(f->sel, (size_t)c->num_key_value_heads * R * (size_t)c->sparse_topk_blocks * 4);
  ALLOC(f->scores, (size_t)c->sparse_num_index_heads * (size_t)f->o.max_chunk * (size_t)kv->plan.pages_per_seq * 4);
  ALLOC(f->gu, R * 2 * (size_t)c->dense_intermediate_size * 2);
  ALLOC(f->act, R * (size_t)c->dense_intermediate_size * 2);
  f->wdq_elems = (size_t)max_linear_elems(m);
  if (f->wdq_elems) ALLOC(f->wdq, f->wdq_elems * 2);
  ALLOC(f->logits, (size_t)f->o.max_batch * (size_t)c->vocab_size * 4);
  ALLOC(f->d_next, (size_t)f->o.max_batch * 4);
  ALLOC(f->d_err, 4);
  ALLOC(f->d_ids, R * 4);
  ALLOC(f->d_seq, R * 4);
  ALLOC(f->d_pos, R * 8);
  ALLOC(f->d_slot, R * 8);
  if (link_n > 1) { /* tensor parallelism: the logits slices (forward.h) */
    f->tp = o->tp;
    for (int r = 0; r < link_n; r++) {
      m3_tp_vocab_slice(c->vocab_size, link_n, r, &f->v0[r], &f->vn[r]);
      if (f->vn[r] > f->vn_max) f->vn_max = f->vn[r];
    }
    ALLOC(f->lg_part, (size_t)f->o.max_batch * (size_t)f->vn_max * 4);
    ALLOC(f->lg_all, (size_t)link_n * (size_t)f->o.max_batch * (size_t)f->vn_max * 4);
    /* (a block's pad never lands in the logits; dmalloc zeroed it, so it is defined) */
  }
#undef ALLOC
  /* d_err starts at 0: dmalloc zeroes every buffer */
  if (s == M3_OK) {
    void *h;
    if (cudaMallocHost(&h, R * (4 + 4 + 8 + 8)) != cudaSuccess) s = m3_errf(e, M3_CUDA, "forward: cudaMallocHost");
    else {
      f->h_pos = h;
      f->h_slot = f->h_pos + R;
      f->h_ids = (int32_t *)(f->h_slot + R);
      f->h_seq = f->h_ids + R;
    }
  }
  if (s == M3_OK) s = build_moe_tables(f, e);
  if (s == M3_OK && m3_config_n_moe_layers(c)) {
    int l0 = 0;
    while (!m->layers[l0].moe) l0++;
    m3_moe_args ma = {.n_tokens = f->rows, .hidden = c->hidden_size, .n_experts = c->num_local_experts,
                      .topk = c->num_experts_per_tok, .renormalize = 1, .routed_scaling = (float)c->routed_scaling_factor,
                      .alpha = (float)c->swiglu_alpha, .limit = (float)c->swiglu_limit, .beta = (float)c->swiglu_beta};
    s = m3_moe_ws_alloc(&f->moe_ws, &ma, &f->moe_w[l0], f->rows, e);
  }
  if (s == M3_OK) s = decode_workspaces(f, e);
  /* The device, not only f->s: create also issued legacy-stream copies. */
  if (s == M3_OK) s = cudaDeviceSynchronize() == cudaSuccess ? M3_OK : m3_errf(e, M3_CUDA, "forward: setup");
  if (s != M3_OK) {
    m3_forward_free(f);
    return s;
  }
  *out = f;
  return M3_OK;
}

void m3_forward_free(m3_forward *f) {
  if (!f) return;
  for (int i = 0; i < f->n_graphs; i++) {
    cudaGraphExecDestroy(f->graphs[i].exec);
    cudaGraphDestroy(f->graphs[i].g);
  }
  for (int i = 0; i < f->n_ev; i++) cudaEventDestroy(f->ev[i]);
  free(f->ev);
  free(f->ev_name);
  void *d[] = {f->r, f->a, f->mb, f->x, f->m32, f->P, f->q, f->ao, f->iq, f->sel, f->scores, f->gu, f->act, f->wdq,
               f->logits, f->d_next, f->d_err, f->d_ids, f->d_seq, f->d_pos, f->d_slot, f->attn_ws, f->idx_ws, f->tabs,
               f->lg_part, f->lg_all};
  for (size_t i = 0; i < sizeof d / sizeof *d; i++)
    if (d[i]) cudaFree(d[i]);
  if (f->h_pos) cudaFreeHost(f->h_pos);
  if (f->pf_fork) cudaEventDestroy(f->pf_fork);
  if (f->pf_join) cudaEventDestroy(f->pf_join);
  if (f->s2) cudaStreamDestroy(f->s2);
  m3_moe_ws_free(&f->moe_ws);
  m3_gemm_close(&f->g);
  free(f->moe_w);
  free(f->htabs);
  free(f->hscan);
  free(f);
}

/* ------------------------------------------------------------------------ */
/* Plumbing                                                                 */
/* ------------------------------------------------------------------------ */

static int64_t pow2_at_least(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

/* m3_rt_kernel through a per-forward memo keyed by (semantic key, bucket):
 * the tuned tile for the shape bucket comes from the tuning DB on the first
 * call, and later calls cost a string compare instead of a Lua round trip.
 * Buckets: tokens and context rounded up to powers of two. */
static m3_status kern(m3_forward *f, const m3_variant *v, int64_t tokens, int64_t ctx, m3_kernel **k, m3_err *e) {
  const int64_t bt = pow2_at_least(tokens > 0 ? tokens : 1), bc = ctx > 0 ? pow2_at_least(ctx) : 0;
  char key[M3_KEY_MAX + 64];
  size_t n = m3_variant_print(v, key, M3_KEY_MAX);
  snprintf(key + n, sizeof key - n, "#%" PRId64 ",%" PRId64, bt, bc);
  for (int i = 0; i < f->n_memo; i++)
    if (!strcmp(f->memo[i].key, key)) {
      *k = f->memo[i].k;
      return M3_OK;
    }
  m3_bucket b = {0};
  M3_TRY(m3_bucket_add(&b, "tokens", bt, e));
  if (bc) M3_TRY(m3_bucket_add(&b, "ctx", bc, e));
  M3_TRY(m3_rt_kernel(f->rt, v, &b, k, e));
  if (f->n_memo < MAX_MEMO) {
    snprintf(f->memo[f->n_memo].key, sizeof f->memo[f->n_memo].key, "%s", key);
    f->memo[f->n_memo++].k = *k;
  }
  return M3_OK;
}

/* y [n, rows] = x [n, cols] · Wᵀ.  Decode: the GEMV straight from the stored
 * bytes (W8A16 or W16A16).  Prefill: cuBLAS; an MXFP8 weight is first
 * dequantised (exactly, §8) into the bf16 scratch, one weight at a time. */
static m3_status linear(m3_forward *f, const step *st, const void *x, const m3_dlinear *w, void *y, const char *what,
                        m3_err *e) {
  if (st->gemv) {
    m3_gemv_args ga = {.n = st->n, .rows = w->rows, .cols = w->cols, .wfmt = w->mxfp8 ? M3_GEMV_E4M3 : M3_GEMV_BF16};
    m3_kernel *k;
    M3_TRY(m3_gemv_kernel(f->rt, &ga, &k, e));
    M3_TRY(m3_launch_gemv(k, &ga, x, w->w, w->scale, y, f->s, e));
    return M3_OK;
  }
  const void *wb = w->w;
  if (w->mxfp8) {
    if ((size_t)(w->rows * w->cols) > f->wdq_elems)
      return m3_errf(e, M3_INVAL, "forward: %s [%" PRId64 ", %" PRId64 "] exceeds the dequant scratch", what, w->rows,
                     w->cols);
    m3_variant v;
    m3_kernel *k;
    M3_TRY(m3_dequant_key(w->cols, &v, e));
    M3_TRY(kern(f, &v, 1, 0, &k, e));
    M3_TRY(m3_launch_mxfp8_dequant(k, w->rows, w->cols, w->w, w->scale, f->wdq, f->s, e));
    wb = f->wdq;
  }
  return m3_gemm_bf16(&f->g, st->n, w->rows, w->cols, x, 0, wb, 0, y, 0, e);
}

/* ---- timing: an event before and after each op of a step ---------------- */

static timing_op *op_slot(m3_forward *f, const char *name) {
  for (int i = 0; i < f->n_ops; i++)
    if (!strcmp(f->ops[i].name, name)) return &f->ops[i];
  if (f->n_ops == MAX_OPS) return NULL;
  timing_op *t = &f->ops[f->n_ops++];
  memset(t, 0, sizeof *t); /* a slot reused after m3_forward_reset_timing starts from zero */
  snprintf(t->name, sizeof t->name, "%s", name);
  return t;
}

static m3_status ev_next(m3_forward *f, const char *name, m3_err *e) {
  if (f->n_ev == f->cap_ev) {
    int cap = f->cap_ev ? 2 * f->cap_ev : 1024;
    cudaEvent_t *ev = realloc(f->ev, sizeof *ev * (size_t)cap);
    if (!ev) return m3_errf(e, M3_NOMEM, "timing events");
    f->ev = ev;
    const char **nm = realloc(f->ev_name, sizeof *nm * (size_t)cap);
    if (!nm) return m3_errf(e, M3_NOMEM, "timing events");
    f->ev_name = nm;
    for (int i = f->cap_ev; i < cap; i++) M3_CUDA(e, cudaEventCreate(&f->ev[i]));
    f->cap_ev = cap;
  }
  f->ev_name[f->n_ev] = name;
  M3_CUDA(e, cudaEventRecord(f->ev[f->n_ev++], f->s));
  return M3_OK;
}

/* While capturing, notes each op name once (the breakdown's list); false for
 * the ops a breakdown capture leaves out. */
/* a is b or b's parent ("moe" of "moe/route") */
static int op_within(const char *a, const char *b) {
  const size_t n = strlen(a);
  return !strncmp(a, b, n) && (!b[n] || b[n] == '/');
}

static int op_wanted(m3_forward *f, const char *name) {
  if (f->capturing && !f->only_op && !f->skip_op) {
    int i = 0;
    while (i < f->n_seen && strcmp(f->seen_ops[i], name)) i++;
    if (i == f->n_seen && f->n_seen < MAX_OPS) f->seen_ops[f->n_seen++] = name;
  }
  if (f->skip_op) return !op_within(f->skip_op, name); /* a sub-op left out: its parent still runs */
  return !f->only_op || op_within(f->only_op, name) || op_within(name, f->only_op);
}

static m3_status op_begin(m3_forward *f, const char *name, m3_err *e) {
  if (!f->o.timing || f->capturing) return M3_OK;
  return ev_next(f, name, e);
}

/* Close the op; every 512 ops (and at m3_forward_print_timing) the events are
 * read back and summed per op name. */
static m3_status op_end(m3_forward *f, m3_err *e) {
  if (!f->o.timing || f->capturing) return M3_OK;
  M3_TRY(ev_next(f, NULL, e));
  if (f->n_ev < 1000) return M3_OK;
  M3_CUDA(e, cudaStreamSynchronize(f->s));
  for (int i = 0; i + 1 < f->n_ev; i += 2) {
    float ms = 0;
    M3_CUDA(e, cudaEventElapsedTime(&ms, f->ev[i], f->ev[i + 1]));
    timing_op *t = op_slot(f, f->ev_name[i]);
    if (t) t->calls++, t->ms += ms;
  }
  f->n_ev = 0;
  return M3_OK;
}

/* Fold the events still pending into the table.  strict: fail on an event
 * that cannot be read (m3_forward_timing); else skip it (the printer, which
 * has no error to return). */
static m3_status fold_events(m3_forward *f, int strict, m3_err *e) {
  if (!f->n_ev) return M3_OK;
  cudaError_t ce = cudaStreamSynchronize(f->s);
  if (ce != cudaSuccess && strict) return m3_cuda_fail(e, ce, "timing: cudaStreamSynchronize", __FILE__, __LINE__);
  for (int i = 0; i + 1 < f->n_ev; i += 2) {
    float ms = 0;
    ce = cudaEventElapsedTime(&ms, f->ev[i], f->ev[i + 1]);
    if (ce != cudaSuccess) {
      if (strict) return m3_cuda_fail(e, ce, "timing: cudaEventElapsedTime", __FILE__, __LINE__);
      continue;
    }
    timing_op *t = op_slot(f, f->ev_name[i]);
    if (t) t->calls++, t->ms += ms;
  }
  f->n_ev = 0;
  return M3_OK;
}

m3_status m3_forward_timing(m3_forward *f, m3_fwd_op_time *out, int max, int *n, m3_err *e) {
  *n = 0;
  M3_TRY(fold_events(f, 1, e));
  for (int i = 0; i < f->n_ops && i < max; i++) out[(*n)++] = f->ops[i];
  return M3_OK;
}

uint64_t m3_forward_graph_replays(const m3_forward *f) { return f->n_replays; }

void m3_forward_print_timing(const m3_forward *fc, FILE *out) {
  m3_forward *f = (m3_forward *)fc; /* folds pending events into the table */
  m3_err e;
  fold_events(f, 0, &e);
  double total = 0;
  for (int i = 0; i < f->n_ops; i++) total += f->ops[i].ms;
  if (!f->o.timing) {
    fprintf(out, "  (no timing: create the forward with opts.timing = 1, m3kit run --timing)\n");
    return;
  }
  fprintf(out, "  %-14s %8s %12s %7s\n", "op", "calls", "total ms", "share");
  for (int i = 0; i < f->n_ops; i++)
    fprintf(out, "  %-14s %8d %12.3f %6.1f%%\n", f->ops[i].name, f->ops[i].calls, f->ops[i].ms,
            total > 0 ? 100.0 * f->ops[i].ms / total : 0.0);
  fprintf(out, "  %-14s %8s %12.3f\n", "all kernels", "", total);
}

/* ---- graph breakdown: each op's launches replayed as a graph of their own -- */

/* One replay of a captured step, for m3_time_events. */
typedef struct replay_arg { cudaGraphExec_t exec; cudaStream_t s; } replay_arg;
static m3_status replay_once(void *arg, int rep, m3_err *e) {
  (void)rep;
  const replay_arg *r = arg;
  M3_CUDA(e, cudaGraphLaunch(r->exec, r->s));
  return M3_OK;
}

/* Median ms of `reps` event-timed replays of exec (after 3 untimed ones). */
static m3_status replay_ms(m3_forward *f, cudaGraphExec_t exec, int reps, double *ms, m3_err *e) {
  replay_arg a = {exec, f->s};
  m3_timing t;
  M3_TRY(m3_time_events(replay_once, &a, f->s, 3, reps, &t, e));
  *ms = t.median_us / 1e3;
  return M3_OK;
}

/* The last decode graph's step captured with one op alone (only) or without
 * it (skip), replayed: median ms; *nodes (may be NULL) gets the captured
 * graph's node count (0: the op launched nothing, e.g. fused away). */
static m3_status capture_ms(m3_forward *f, const graph *gr, const char *only, const char *skip, int reps, double *ms,
                            size_t *nodes, m3_err *e) {
  cudaGraph_t g = NULL;
  cudaGraphExec_t x = NULL;
  M3_CUDA(e, cudaStreamSynchronize(f->s));
  M3_CUDA(e, cudaStreamBeginCapture(f->s, cudaStreamCaptureModeRelaxed));
  f->capturing = 1;
  f->only_op = only;
  f->skip_op = skip;
  m3_status s = forward_body(f, &gr->st, 0, e);
  f->only_op = f->skip_op = NULL;
  f->capturing = 0;
  f->moe_ws.stages = M3_MOE_STAGE_ALL;
  cudaError_t ce = cudaStreamEndCapture(f->s, &g);
  if (s == M3_OK && ce != cudaSuccess) s = m3_cuda_fail(e, ce, "graph breakdown capture", __FILE__, __LINE__);
  if (s == M3_OK && nodes && (ce = cudaGraphGetNodes(g, NULL, nodes)) != cudaSuccess)
    s = m3_cuda_fail(e, ce, "graph breakdown: cudaGraphGetNodes", __FILE__, __LINE__);
  if (s == M3_OK && (ce = cudaGraphInstantiate(&x, g, 0)) != cudaSuccess)
    s = m3_cuda_fail(e, ce, "graph breakdown instantiate", __FILE__, __LINE__);
  if (s == M3_OK) s = replay_ms(f, x, reps, ms, e);
  if (x) cudaGraphExecDestroy(x);
  if (g) cudaGraphDestroy(g);
  return s;
}

m3_status m3_forward_graph_breakdown(m3_forward *f, int reps, FILE *out, m3_err *e) {
  if (f->tp)
    return m3_errf(e, M3_INVAL, "graph breakdown: not under tensor parallelism (one rank's op replayed alone would "
                   "wait in its collectives for the other ranks)");
  if (f->last_graph < 0 || f->last_graph >= f->n_graphs)
    return m3_errf(e, M3_INVAL, "graph breakdown: no decode step has run as a graph yet (decode with graphs on, "
                   "without --timing, first)");
  if (reps < 1) reps = 1;
  graph *gr = &f->graphs[f->last_graph];
  double full = 0, sum = 0;
  M3_TRY(replay_ms(f, gr->exec, reps, &full, e));
  /* "alone": the op's launches of one step as a graph of their own; "in the
   * step": the whole step less the step without them, what the op adds to the
   * step where it stands (what fusing it away could save at most).  The step
   * without an op reads what that op would have written: times, not values. */
  fprintf(out, "decode graph breakdown (batch %d, context bucket %" PRId64 "; median of %d replays; alone: the op's "
               "launches of one step as a graph of their own; in the step: the whole step less the step without "
               "them; moe/*: the MoE op's launches):\n", gr->n, gr->bucket, reps);
  fprintf(out, "  %-14s %12s %7s %12s\n", "op", "alone ms", "share", "in the step");
  for (int i = 0; i < f->n_seen; i++) {
    const char *op = f->seen_ops[i];
    double ms = 0, without = 0;
    size_t nodes = 0;
    m3_status s = capture_ms(f, gr, op, NULL, reps, &ms, &nodes, e);
    if (s == M3_OK && !nodes) continue; /* launches nothing in this step (a fused-away MoE launch): no row */
    if (s == M3_OK) s = capture_ms(f, gr, NULL, op, reps, &without, NULL, e);
    if (s != M3_OK) return m3_err_prefix(e, "graph breakdown of op %s: ", op);
    const int sub = strchr(op, '/') != NULL;
    if (!sub) sum += ms;
    fprintf(out, "  %s%-*s %12.3f %6.1f%% %12.3f\n", sub ? "  " : "", sub ? 12 : 14, op, ms,
            full > 0 ? 100.0 * ms / full : 0.0, full - without);
  }
  fprintf(out, "  %-14s %12.3f %6.1f%%\n", "sum of ops", sum, full > 0 ? 100.0 * sum / full : 0.0);
  fprintf(out, "  %-14s %12.3f\n", "whole step", full);
  return M3_OK;
}

void m3_forward_debug_selection(m3_forward *f, int32_t *capture, const int32_t *override) {
  f->dbg_cap = capture;
  f->dbg_ovr = override;
}

void m3_forward_tp_counts(const m3_forward *f, uint64_t *allreduces, uint64_t *allgathers) {
  if (allreduces) *allreduces = f->n_ar;
  if (allgathers) *allgathers = f->n_ag;
}

void m3_forward_reset_timing(m3_forward *f) {
  f->n_ops = 0;
  f->n_ev = 0;
}

/* ---- L2 prefetch branches of a decode step --------------------------- */

void m3_forward_l2_prefetch(const m3_forward *f, int64_t ctx, int64_t out[3]) {
  const int64_t l2 = f->rt->dev.l2_bytes > 0 ? f->rt->dev.l2_bytes : INT64_MAX;
  for (int i = 0; i < M3_PF_PHASES; i++) {
    const int64_t asked = !f->s2 ? 0
                          : f->pf_auto ? m3_prefetch_default_bytes(10 * f->rt->dev.cc_major + f->rt->dev.cc_minor, i, ctx)
                                       : f->pf_bytes[i];
    out[i] = asked < l2 ? asked : l2; /* more than L2 holds evicts itself */
  }
}

/* The decode step's L2 prefetch (op_prefetch.h): a branch forked from f->s
 * here, on f->s2, sends `want` bytes of the region w (the next GEMV's
 * weights) toward L2 while the stream runs the latency-bound kernels before
 * that GEMV.  Nothing reads what the branch does, so it joins f->s once, at
 * the end of the step (prefetch_join): a capture ends with every branch
 * joined.  Decode steps only, as m3_forward_l2_prefetch says; the
 * graph breakdown lists it as "l2_prefetch" (its "in the step" column is what
 * the branches save, negative when they help). */
static m3_status prefetch(m3_forward *f, const step *st, int phase, const void *w, int64_t bytes, m3_err *e) {
  int64_t all[M3_PF_PHASES];
  m3_forward_l2_prefetch(f, st->max_kv, all);
  const int64_t want = all[phase];
  if (!st->decode || !want || !f->s2 || !w || bytes <= 0 || !op_wanted(f, "l2_prefetch")) return M3_OK;
  m3_prefetch_plan p;
  M3_TRY(m3_prefetch_plan_for(bytes, want, 64 << 10, &p, e));
  m3_variant v;
  m3_kernel *k;
  M3_TRY(m3_prefetch_key(&v, e));
  M3_TRY(kern(f, &v, st->n, 0, &k, e));
  M3_CUDA(e, cudaEventRecord(f->pf_fork, f->s));
  M3_CUDA(e, cudaStreamWaitEvent(f->s2, f->pf_fork, 0));
  M3_TRY(m3_launch_prefetch(k, w, bytes, &p, f->s2, e));
  f->pf_open = 1;
  return M3_OK;
}

static m3_status prefetch_join(m3_forward *f, m3_err *e) {
  if (!f->pf_open) return M3_OK;
  f->pf_open = 0;
  M3_CUDA(e, cudaEventRecord(f->pf_join, f->s2));
  M3_CUDA(e, cudaStreamWaitEvent(f->s, f->pf_join, 0));
  return M3_OK;
}

/* ---- M3KIT_CHECK_NUMERICS: NaN/Inf scan of an op's output -------------- */

static m3_status check_out(m3_forward *f, int layer, const char *op, const void *p, int64_t n, int dtype, m3_err *e) {
  if (!f->check || f->capturing || n <= 0) return M3_OK;
  const size_t bytes = (size_t)n * (dtype == DT_F32 ? 4 : 2);
  if (bytes > f->hscan_bytes) {
    void *h = realloc(f->hscan, bytes);
    if (!h) return m3_errf(e, M3_NOMEM, "numerics check buffer");
    f->hscan = h;
    f->hscan_bytes = bytes;
  }
  M3_CUDA(e, cudaMemcpyAsync(f->hscan, p, bytes, cudaMemcpyDeviceToHost, f->s));
  M3_CUDA(e, cudaStreamSynchronize(f->s));
  for (int64_t i = 0; i < n; i++) {
    float v = dtype == DT_F32 ? ((const float *)f->hscan)[i] : m3_bf16_to_f32(((const m3_bf16 *)f->hscan)[i]);
    if (!isfinite(v)) {
      if (layer >= 0)
        return m3_errf(e, M3_NUMERICS, "layer %d, op %s: element %" PRId64 " of %" PRId64 " is %s", layer, op, i, n,
                       isnan(v) ? "NaN" : "Inf");
      return m3_errf(e, M3_NUMERICS, "op %s: element %" PRId64 " of %" PRId64 " is %s", op, i, n,
                     isnan(v) ? "NaN" : "Inf");
    }
  }
  return M3_OK;
}
