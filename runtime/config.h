/* config.h - the MiniMax-M3 text-backbone configuration (spec §1).
 *
 * One struct, m3_config, holds every `text_config` field the forward pass
 * depends on, already validated: a loaded config is one the runtime can run, so
 * kernels and loaders never re-check it.  The parser (jansson) accepts either
 *   - the VL wrapper of the released checkpoints:
 *       { "model_type": "minimax_m3_vl", "text_config": { ... }, ... }
 *   - or a bare text config: { "model_type": "minimax_m3_vl_text", ... }.
 * Accepted model_type values: wrapper "minimax_m3_vl"; text "minimax_m3_vl_text"
 * (the release), "minimax_m3", "minimax_m3_text" (bare exports); anything else
 * is an error.  An optional quantization_config (top level or inside
 * text_config) must be {"quant_method": "mxfp8", "weight_block_size": [1, 32]}.
 * Unknown keys (vision tower, token ids we do not use) are ignored; known keys
 * with values this implementation does not support are rejected with an error
 * naming the file and the field, never silently replaced by a default.
 *
 * Defaults for keys absent from the file (each one documented at its field):
 * swiglu_beta 1.0 (spec §1.1, §12.4), attention_output_gate false,
 * qk_norm_type "per_head", num_mtp_modules 0, torch_dtype "bfloat16",
 * partial_rotary_factor = rotary_dim / head_dim (and rotary_dim from
 * partial_rotary_factor when only that is given), sparse_disable_index_value =
 * sparse_attention_freq, quantization_config none.  Everything else is required.
 *
 * Presets are JSON files under runtime/presets/, compiled into the library by
 * tools/embed.sh (runtime/presets.inc): "minimax-m3" (the released config.json)
 * and "tiny" (the real 60-layer structure at small widths: the embedded default
 * model).
 */
#ifndef M3_CONFIG_H
#define M3_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/status.h"

/* Upper bound on num_hidden_layers (the real model has 60). */
#define M3_MAX_LAYERS 256

typedef struct m3_config {
  /* --- where it came from (round-trips through m3_config_to_json) --- */
  int is_vl;                   /* 1: VL wrapper form (text_config inside) */
  char model_type[48];         /* text model_type, e.g. "minimax_m3_vl_text" */
  int64_t image_token_index;   /* VL wrapper only; -1 when absent */
  int64_t video_token_index;   /* VL wrapper only; -1 when absent */
  char torch_dtype[16];        /* "bfloat16" (default when absent) */
  char quant_method[16];       /* "" (none) or "mxfp8" (quantization_config, §8) */

  /* --- sizes (spec §1.1) --- */
  int hidden_size;             /* H = 6144 */
  int num_hidden_layers;       /* L = 60, <= M3_MAX_LAYERS */
  int num_attention_heads;     /* nq = 64 */
  int num_key_value_heads;     /* nkv = 4; divides nq (GQA group nq/nkv) */
  int head_dim;                /* D = 128 (the only supported value) */
  int vocab_size;              /* 200064 */
  int intermediate_size;       /* per routed expert, 3072 */
  int dense_intermediate_size; /* dense MLP of non-MoE layers, 12288 */
  int shared_intermediate_size;/* shared expert, 3072 (must equal intermediate_size, §11) */
  int n_shared_experts;        /* 0 or 1 */
  int num_local_experts;       /* E = 128 */
  int num_experts_per_tok;     /* top-k = 4, <= E */
  int max_position_embeddings; /* 1048576 */
  int num_mtp_modules;         /* 1 in the release; MTP is not run (default 0) */

  /* --- routing and activation (spec §7) --- */
  char scoring_func[16];       /* "sigmoid" (the only supported value) */
  int use_routing_bias;        /* e_score_correction_bias present and used for choice */
  double routed_scaling_factor;/* 2.0 */
  char hidden_act[16];         /* "swigluoai" (the only supported value) */
  double swiglu_alpha;         /* 1.702 */
  double swiglu_limit;         /* 7.0 */
  double swiglu_beta;          /* +beta on up; 1.0 when absent (HF hard-codes +1.0) */
  int swiglu_beta_given;       /* 1 if the file had swiglu_beta (for round trip) */

  /* --- norms, RoPE (spec §2.2, §3.3, §3.4) --- */
  double rms_norm_eps;         /* 1e-6, > 0 */
  int use_gemma_norm;          /* must be 1: y = x̂·(1+w) */
  int use_qk_norm;             /* must be 1 */
  char qk_norm_type[16];       /* "per_head" (the only supported value) */
  int attention_output_gate;   /* must be 0 */
  double rope_theta;           /* 5e6 */
  int rotary_dim;              /* 64; even, 0 < rotary_dim <= head_dim */
  double partial_rotary_factor;/* rotary_dim / head_dim */
  int tie_word_embeddings;     /* 0: separate lm_head */

  /* --- sparse attention (spec §1.2, §5, §6) --- */
  int use_sparse_attention;
  int sparse_index_dim;        /* 128 (the only supported value) */
  int sparse_num_index_heads;  /* niq = 4; must equal num_key_value_heads */
  int sparse_block_size;       /* B = 128 tokens per block / KV page */
  int sparse_topk_blocks;      /* 16 blocks per (token, kv head) */
  int sparse_init_block;       /* 0 forced leading blocks */
  int sparse_local_block;      /* 1 forced local block; init + local <= topk */
  char sparse_score_type[8];   /* "max" (the only supported value) */

  /* --- per-layer kinds, [num_hidden_layers] valid entries, each 0 or 1 --- */
  uint8_t is_sparse[M3_MAX_LAYERS];        /* sparse_attention_freq[l] != 0 */
  uint8_t is_moe[M3_MAX_LAYERS];           /* moe_layer_freq[l] != 0 */
  uint8_t disable_index_value[M3_MAX_LAYERS]; /* sparse_disable_index_value[l] */
} m3_config;

/* Parse and validate a config.json.  `path` is used in error messages as given.
 * Errors: M3_NOTFOUND / M3_IO (file), M3_FORMAT (not JSON, wrong JSON type),
 * M3_CONFIG (missing field, value out of range or unsupported), each message
 * "PATH: text_config.FIELD: ...". */
m3_status m3_config_load_file(const char *path, m3_config *c, m3_err *e);

/* Same from NUL-terminated text; `name_for_errors` prefixes every message. */
m3_status m3_config_load_json_text(const char *text, const char *name_for_errors,
                                   m3_config *c, m3_err *e);

/* Load an embedded preset by name ("minimax-m3", "tiny").
 * Errors: M3_NOTFOUND naming the preset and listing the known ones. */
m3_status m3_config_preset(const char *name, m3_config *c, m3_err *e);

/* A checkpoint directory's DIR/config.json when model_dir is given, else the
 * preset `preset`.  Errors: those of m3_config_load_file / m3_config_preset. */
m3_status m3_config_for(const char *preset, const char *model_dir, m3_config *c, m3_err *e);

/* NULL-terminated list of preset names, in build order. */
const char *const *m3_config_preset_names(void);

/* Serialise to JSON text (malloc'd, caller frees; NULL on allocation failure).
 * Writes the wrapper form when c->is_vl, else the bare form; keys the parser
 * defaulted are written only when they were given (swiglu_beta), so
 * load(to_json(c)) reproduces c field for field. */
char *m3_config_to_json(const m3_config *c);

/* Same, but always in the VL wrapper form (what a checkpoint's config.json
 * looks like); used by the checkpoint writer. */
char *m3_config_to_json_vl(const m3_config *c);

/* --- derived sizes (spec §3.2, §9.3) --------------------------------------- */

/* Row width of the fused projection output for layer l, in elements:
 * dense (nq + 2·nkv)·D (9216), sparse (nq + 2·nkv)·D + (niq + 1)·index_dim (9856). */
int m3_config_qkv_width(const m3_config *c, int layer);
/* nq·D (8192): width of the attention output / o_proj input. */
int m3_config_q_width(const m3_config *c);
/* nkv·D (512). */
int m3_config_kv_width(const m3_config *c);
/* FFN width of layer l: dense_intermediate_size for dense-MLP layers, else
 * intermediate_size (one routed expert). */
int m3_config_ffn_width(const m3_config *c, int layer);
/* Shared expert width: shared_intermediate_size · n_shared_experts (0 if none). */
int m3_config_shared_width(const m3_config *c);
/* Cache bytes one token occupies in layer l: main K+V 2·nkv·D·kv_elem_bytes,
 * plus index_dim·idx_elem_bytes on sparse layers (bf16: 2048 / 2304). */
uint64_t m3_config_kv_bytes_per_token(const m3_config *c, int layer, int kv_elem_bytes,
                                      int idx_elem_bytes);
/* Sum over all layers (bf16/bf16: 137472 B for the real model). */
uint64_t m3_config_kv_bytes_per_token_model(const m3_config *c, int kv_elem_bytes,
                                            int idx_elem_bytes);
/* Layer counts by kind. */
int m3_config_n_sparse_layers(const m3_config *c);
int m3_config_n_moe_layers(const m3_config *c);
/* Text-backbone parameter count (spec §1.4): all weights including embedding,
 * lm_head (unless tied), norms, router and bias; and the per-token active count
 * (attention + indexer + dense MLPs + shared + top-k routed + router, no
 * embedding, no lm_head, no norms/bias).  Either pointer may be NULL. */
void m3_config_n_params(const m3_config *c, uint64_t *total, uint64_t *active);

#endif
