/* ckpt_names.h - the M3 text model's tensor inventory (spec §3.1, §8): which
 * tensors a checkpoint must hold for a given m3_config, with what shapes and
 * dtypes, and the binding of an open checkpoint to (layer, role[, expert]).
 *
 * One table (M3_ROLE_MAP) drives three users so they cannot drift apart: the
 * inventory check at load (m3_ckpt_bind), the random-checkpoint writer
 * (ckpt_write.c) and the runtime's weight lookup (m3_ckpt_get).
 *
 * Names are the on-disk names of the released checkpoints, e.g.
 *   language_model.model.layers.3.block_sparse_moe.e_score_correction_bias
 * The "language_model." prefix (VL layout) is optional; m3_ckpt_bind detects
 * which layout a checkpoint uses.  Shapes are PyTorch [out, in].
 *
 * Dtypes accepted per kind:
 *   EMBED   (embed_tokens, lm_head)        BF16
 *   NORM    (all RMSNorm weights)          BF16 or F32
 *   LINEAR  (every projection/expert)      BF16, or MXFP8: F8_E4M3 `weight` plus
 *                                          U8 `weight_scale_inv` [out, ceil(in/32)]
 *                                          (E8M0: W = q · 2^(s−127), spec §8)
 *   ROUTER  (block_sparse_moe.gate)        F32 or BF16
 *   BIAS    (e_score_correction_bias)      F32 or BF16
 * A BF16 linear with a stray `weight_scale_inv` is an error (a half-converted
 * checkpoint); so is an F8_E4M3 weight without its scale.
 *
 * Skipped with a note (never an error): vision-tower tensors (`vision_tower.`,
 * `multi_modal_projector.`, `patch_merge_mlp.`, with or without a leading
 * `model.`) and MTP tensors (`model.mtp.`, spec §2.5).  Anything else the model
 * does not use is listed as a note ("extra tensor ... ignored").
 */
#ifndef M3_CKPT_NAMES_H
#define M3_CKPT_NAMES_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/config.h"
#include "runtime/safetensors.h"
#include "runtime/status.h"

typedef enum { M3_WK_EMBED, M3_WK_NORM, M3_WK_LINEAR, M3_WK_ROUTER, M3_WK_BIAS } m3_wkind;

/* X(ID, name suffix after "model.layers.N." (or the full name for globals),
 *   scope: G global / L per layer / E per expert, kind) */
#define M3_ROLE_MAP(X)                                                              \
  X(EMBED, "model.embed_tokens.weight", G, EMBED)                                   \
  X(FINAL_NORM, "model.norm.weight", G, NORM)                                       \
  X(LM_HEAD, "lm_head.weight", G, EMBED)                                            \
  X(INPUT_NORM, "input_layernorm.weight", L, NORM)                                  \
  X(Q_PROJ, "self_attn.q_proj.weight", L, LINEAR)                                   \
  X(K_PROJ, "self_attn.k_proj.weight", L, LINEAR)                                   \
  X(V_PROJ, "self_attn.v_proj.weight", L, LINEAR)                                   \
  X(Q_NORM, "self_attn.q_norm.weight", L, NORM)                                     \
  X(K_NORM, "self_attn.k_norm.weight", L, NORM)                                     \
  X(INDEX_Q_PROJ, "self_attn.index_q_proj.weight", L, LINEAR)                       \
  X(INDEX_K_PROJ, "self_attn.index_k_proj.weight", L, LINEAR)                       \
  X(INDEX_Q_NORM, "self_attn.index_q_norm.weight", L, NORM)                         \
  X(INDEX_K_NORM, "self_attn.index_k_norm.weight", L, NORM)                         \
  X(O_PROJ, "self_attn.o_proj.weight", L, LINEAR)                                   \
  X(POST_NORM, "post_attention_layernorm.weight", L, NORM)                          \
  X(MLP_GATE, "mlp.gate_proj.weight", L, LINEAR)                                    \
  X(MLP_UP, "mlp.up_proj.weight", L, LINEAR)                                        \
  X(MLP_DOWN, "mlp.down_proj.weight", L, LINEAR)                                    \
  X(MOE_ROUTER, "block_sparse_moe.gate.weight", L, ROUTER)                          \
  X(MOE_BIAS, "block_sparse_moe.e_score_correction_bias", L, BIAS)                  \
  X(EXPERT_W1, "block_sparse_moe.experts.%d.w1.weight", E, LINEAR)                  \
  X(EXPERT_W3, "block_sparse_moe.experts.%d.w3.weight", E, LINEAR)                  \
  X(EXPERT_W2, "block_sparse_moe.experts.%d.w2.weight", E, LINEAR)                  \
  X(SHARED_GATE, "block_sparse_moe.shared_experts.gate_proj.weight", L, LINEAR)     \
  X(SHARED_UP, "block_sparse_moe.shared_experts.up_proj.weight", L, LINEAR)         \
  X(SHARED_DOWN, "block_sparse_moe.shared_experts.down_proj.weight", L, LINEAR)

typedef enum {
#define M3_X_ROLE(id, name, scope, kind) M3_ROLE_##id,
  M3_ROLE_MAP(M3_X_ROLE)
#undef M3_X_ROLE
  M3_ROLE_COUNT
} m3_role;

/* "q_proj"-style short name of a role, for messages ("EMBED" -> "embed"). */
const char *m3_role_name(m3_role r);

/* One tensor the model needs (without the optional "language_model." prefix). */
typedef struct m3_tensor_spec {
  char name[128];     /* e.g. "model.layers.3.self_attn.q_proj.weight" */
  m3_role role;
  m3_wkind kind;
  int layer;          /* -1 for globals */
  int expert;         /* -1 unless a routed-expert tensor */
  int ndim;           /* 1 or 2 */
  int64_t shape[2];   /* [out, in] or [n] */
} m3_tensor_spec;

/* Every tensor the text model needs for config c, in forward order (embedding,
 * then layer by layer with experts in index order, then final norm, lm_head).
 * lm_head is omitted when tie_word_embeddings.  *specs is malloc'd.
 * Errors: M3_NOMEM. */
m3_status m3_ckpt_expected(const m3_config *c, m3_tensor_spec **specs, size_t *n, m3_err *e);

/* Quantisation found in a bound checkpoint. */
typedef enum { M3_QUANT_BF16, M3_QUANT_MXFP8, M3_QUANT_MIXED } m3_quant;

/* A bound weight.  Data pointers are into the checkpoint mapping: unaligned,
 * see safetensors.h. */
typedef struct m3_weight {
  const m3_tensor_spec *spec;  /* expected name/shape */
  const m3_st_tensor *w;       /* the weight: [out, in] BF16 / F8_E4M3, [n] BF16/F32 ... */
  const m3_st_tensor *scale;   /* MXFP8 only: [out, ceil(in/32)] U8 E8M0; else NULL */
} m3_weight;

typedef struct m3_ckpt m3_ckpt;

/* Check that `st` holds every tensor config c needs, with the right shape and
 * an accepted dtype, and bind them.  `name_for_errors` (e.g. the checkpoint
 * directory) prefixes messages.  The first problem found is the error; its
 * message names the full tensor name and says how many other problems there
 * were.  Extra/skipped tensors become notes.
 * Errors: M3_NOTFOUND (missing tensor, e.g. "... tensor
 * 'language_model.model.layers.3.block_sparse_moe.e_score_correction_bias'
 * (layer 3, moe_bias) is missing"), M3_FORMAT (wrong shape or dtype, stray or
 * missing scale), M3_NOMEM.  `st` must outlive the binding. */
m3_status m3_ckpt_bind(const m3_config *c, const m3_st *st, const char *name_for_errors,
                       m3_ckpt **out, m3_err *e);
void m3_ckpt_free(m3_ckpt *k);

/* The weight for (layer, role, expert).  layer is ignored (pass -1) for global
 * roles; expert is ignored (pass -1) except for EXPERT_W*.  Returns NULL for a
 * role the layer does not have (e.g. INDEX_Q_PROJ on a dense layer, MLP_* on a
 * MoE layer) or an index out of range.  LM_HEAD returns the embedding when
 * tie_word_embeddings. */
const m3_weight *m3_ckpt_get(const m3_ckpt *k, int layer, m3_role role, int expert);

/* "" or "language_model." */
const char *m3_ckpt_prefix(const m3_ckpt *k);
m3_quant m3_ckpt_quant(const m3_ckpt *k);
size_t m3_ckpt_n_notes(const m3_ckpt *k);
const char *m3_ckpt_note(const m3_ckpt *k, size_t i);

#endif
