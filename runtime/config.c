/* config.c - config.json parsing, validation, presets and serialisation for
 * m3_config (see config.h).  Kept apart from the checkpoint reader so that a
 * model's shape can be known (presets, `m3kit gen`, cost model) without any
 * weights on disk. */
#include "runtime/config.h"

#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store.h"
#include "runtime/embedded.h"
#include "runtime/presets.inc" /* m3_presets[]: runtime/presets/ *.json */

/* ---- field readers ---------------------------------------------------------
 * Every reader names the field by its full dotted path inside the file
 * ("text_config.sparse_attention_config.sparse_block_size"), because that is
 * what a person editing the file searches for. */

typedef struct {
  const char *file; /* name for errors */
  const char *pre;  /* "text_config." or "" */
  m3_err *e;
} parse_ctx;

#define FIELD_FMT "%s: %s%s%s: "
#define FIELD_ARGS(p, sub, key) (p)->file, (p)->pre, (sub), (key)

static m3_status field_err(const parse_ctx *p, const char *sub, const char *key, m3_status code,
                           const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static m3_status field_err(const parse_ctx *p, const char *sub, const char *key, m3_status code,
                           const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return m3_errf(p->e, code, FIELD_FMT "%s", FIELD_ARGS(p, sub, key), msg);
}

static const char *json_type_name(const json_t *v) {
  switch (json_typeof(v)) {
  case JSON_OBJECT: return "an object";
  case JSON_ARRAY: return "an array";
  case JSON_STRING: return "a string";
  case JSON_INTEGER: return "an integer";
  case JSON_REAL: return "a real";
  case JSON_TRUE: case JSON_FALSE: return "a boolean";
  default: return "null";
  }
}

/* Missing -> *found = 0 (caller decides required/default). */
static m3_status get_i64(const parse_ctx *p, const json_t *o, const char *sub, const char *key,
                         int required, int64_t *out, int *found) {
  const json_t *v = json_object_get(o, key);
  if (found) *found = v != NULL;
  if (!v) {
    if (required) return field_err(p, sub, key, M3_CONFIG, "required field missing");
    return M3_OK;
  }
  if (json_is_integer(v)) {
    *out = json_integer_value(v);
    return M3_OK;
  }
  if (json_is_real(v)) { /* tolerate 1e6-style integers written as reals */
    double d = json_real_value(v);
    if (d == floor(d) && fabs(d) < 9.0e15) {
      *out = (int64_t)d;
      return M3_OK;
    }
    return field_err(p, sub, key, M3_CONFIG, "%.17g is not an integer", d);
  }
  return field_err(p, sub, key, M3_FORMAT, "expected an integer, got %s", json_type_name(v));
}

/* An int field in [lo, hi]. */
static m3_status get_int(const parse_ctx *p, const json_t *o, const char *sub, const char *key,
                         int required, int64_t lo, int64_t hi, int *out, int *found) {
  int64_t v = 0;
  int f = 0;
  M3_TRY(get_i64(p, o, sub, key, required, &v, &f));
  if (found) *found = f;
  if (!f) return M3_OK;
  if (v < lo || v > hi)
    return field_err(p, sub, key, M3_CONFIG, "%lld is out of range [%lld, %lld]", (long long)v,
                     (long long)lo, (long long)hi);
  *out = (int)v;
  return M3_OK;
}

static m3_status get_real(const parse_ctx *p, const json_t *o, const char *sub, const char *key,
                          int required, double *out, int *found) {
  const json_t *v = json_object_get(o, key);
  if (found) *found = v != NULL;
  if (!v) {
    if (required) return field_err(p, sub, key, M3_CONFIG, "required field missing");
    return M3_OK;
  }
  if (!json_is_number(v))
    return field_err(p, sub, key, M3_FORMAT, "expected a number, got %s", json_type_name(v));
  *out = json_number_value(v);
  if (!isfinite(*out)) return field_err(p, sub, key, M3_CONFIG, "not finite");
  return M3_OK;
}

static m3_status get_bool(const parse_ctx *p, const json_t *o, const char *sub, const char *key,
                          int required, int *out, int *found) {
  const json_t *v = json_object_get(o, key);
  if (found) *found = v != NULL;
  if (!v) {
    if (required) return field_err(p, sub, key, M3_CONFIG, "required field missing");
    return M3_OK;
  }
  if (!json_is_boolean(v))
    return field_err(p, sub, key, M3_FORMAT, "expected true or false, got %s", json_type_name(v));
  *out = json_is_true(v);
  return M3_OK;
}

static m3_status get_str(const parse_ctx *p, const json_t *o, const char *sub, const char *key,
                         int required, char *out, size_t n, int *found) {
  const json_t *v = json_object_get(o, key);
  if (found) *found = v != NULL;
  if (!v) {
    if (required) return field_err(p, sub, key, M3_CONFIG, "required field missing");
    return M3_OK;
  }
  if (!json_is_string(v))
    return field_err(p, sub, key, M3_FORMAT, "expected a string, got %s", json_type_name(v));
  if (json_string_length(v) >= n)
    return field_err(p, sub, key, M3_CONFIG, "'%.40s...' is too long", json_string_value(v));
  memset(out, 0, n); /* no stale default bytes: configs compare with memcmp */
  snprintf(out, n, "%s", json_string_value(v));
  return M3_OK;
}

/* A required string that must be one of `allowed` (NULL-terminated). */
static m3_status check_choice(const parse_ctx *p, const char *sub, const char *key, const char *v,
                              const char *const *allowed, const char *why) {
  for (const char *const *a = allowed; *a; a++)
    if (strcmp(v, *a) == 0) return M3_OK;
  char list[256] = "";
  for (const char *const *a = allowed; *a; a++)
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s\"%s\"", a == allowed ? "" : ", ",
             *a);
  return field_err(p, sub, key, M3_CONFIG, "\"%s\" is not supported (supported: %s)%s%s", v, list,
                   why ? "; " : "", why ? why : "");
}

/* A per-layer 0/1 list of exactly n entries. */
static m3_status get_layer_list(const parse_ctx *p, const json_t *o, const char *sub,
                                const char *key, int n, int required, uint8_t *out, int *found) {
  const json_t *v = json_object_get(o, key);
  if (found) *found = v != NULL;
  if (!v) {
    if (required) return field_err(p, sub, key, M3_CONFIG, "required field missing");
    return M3_OK;
  }
  if (!json_is_array(v))
    return field_err(p, sub, key, M3_FORMAT, "expected an array, got %s", json_type_name(v));
  if ((int)json_array_size(v) != n)
    return field_err(p, sub, key, M3_CONFIG, "has %zu entries, expected num_hidden_layers = %d",
                     json_array_size(v), n);
  for (int i = 0; i < n; i++) {
    const json_t *x = json_array_get(v, (size_t)i);
    long long k;
    if (json_is_integer(x)) k = json_integer_value(x);
    else if (json_is_boolean(x)) k = json_is_true(x);
    else
      return field_err(p, sub, key, M3_FORMAT, "entry %d: expected 0 or 1, got %s", i,
                       json_type_name(x));
    if (k != 0 && k != 1)
      return field_err(p, sub, key, M3_CONFIG, "entry %d: %lld (expected 0 or 1)", i, k);
    out[i] = (uint8_t)k;
  }
  return M3_OK;
}

/* ---- the text config ------------------------------------------------------- */

static const char *const text_model_types[] = {"minimax_m3_vl_text", "minimax_m3", "minimax_m3_text",
                                               NULL};
static const char *const vl_model_types[] = {"minimax_m3_vl", NULL};

#define INT_MAX32 2147483647LL

static m3_status parse_text(const parse_ctx *p, const json_t *t, m3_config *c) {
  const char *S = "sparse_attention_config.";
  int f;
  M3_TRY(get_str(p, t, "", "model_type", 1, c->model_type, sizeof c->model_type, NULL));
  M3_TRY(check_choice(p, "", "model_type", c->model_type, text_model_types, NULL));

  /* Sizes.  Ranges are sanity bounds; the real constraints follow below. */
  M3_TRY(get_int(p, t, "", "hidden_size", 1, 1, 1 << 20, &c->hidden_size, NULL));
  M3_TRY(get_int(p, t, "", "num_hidden_layers", 1, 1, M3_MAX_LAYERS, &c->num_hidden_layers, NULL));
  M3_TRY(get_int(p, t, "", "num_attention_heads", 1, 1, 4096, &c->num_attention_heads, NULL));
  M3_TRY(get_int(p, t, "", "num_key_value_heads", 1, 1, 4096, &c->num_key_value_heads, NULL));
  M3_TRY(get_int(p, t, "", "head_dim", 1, 1, 4096, &c->head_dim, NULL));
  M3_TRY(get_int(p, t, "", "vocab_size", 1, 1, INT_MAX32, &c->vocab_size, NULL));
  M3_TRY(get_int(p, t, "", "intermediate_size", 1, 1, 1 << 24, &c->intermediate_size, NULL));
  M3_TRY(get_int(p, t, "", "dense_intermediate_size", 1, 1, 1 << 24, &c->dense_intermediate_size,
                 NULL));
  M3_TRY(get_int(p, t, "", "shared_intermediate_size", 1, 0, 1 << 24,
                 &c->shared_intermediate_size, NULL));
  M3_TRY(get_int(p, t, "", "n_shared_experts", 1, 0, 1, &c->n_shared_experts, NULL));
  M3_TRY(get_int(p, t, "", "num_local_experts", 1, 1, 65536, &c->num_local_experts, NULL));
  M3_TRY(get_int(p, t, "", "num_experts_per_tok", 1, 1, 65536, &c->num_experts_per_tok, NULL));
  M3_TRY(get_int(p, t, "", "max_position_embeddings", 1, 1, INT_MAX32,
                 &c->max_position_embeddings, NULL));
  c->num_mtp_modules = 0;
  M3_TRY(get_int(p, t, "", "num_mtp_modules", 0, 0, 64, &c->num_mtp_modules, NULL));
  snprintf(c->torch_dtype, sizeof c->torch_dtype, "bfloat16");
  M3_TRY(get_str(p, t, "", "torch_dtype", 0, c->torch_dtype, sizeof c->torch_dtype, NULL));

  /* Routing and activation. */
  M3_TRY(get_str(p, t, "", "scoring_func", 1, c->scoring_func, sizeof c->scoring_func, NULL));
  M3_TRY(check_choice(p, "", "scoring_func", c->scoring_func, (const char *const[]){"sigmoid", NULL},
                      "the router kernel implements sigmoid scores only (spec §7.2)"));
  M3_TRY(get_bool(p, t, "", "use_routing_bias", 1, &c->use_routing_bias, NULL));
  M3_TRY(get_real(p, t, "", "routed_scaling_factor", 1, &c->routed_scaling_factor, NULL));
  M3_TRY(get_str(p, t, "", "hidden_act", 1, c->hidden_act, sizeof c->hidden_act, NULL));
  M3_TRY(check_choice(p, "", "hidden_act", c->hidden_act, (const char *const[]){"swigluoai", NULL},
                      "only the clamped SwiGLU-OAI of spec §7.3 is implemented"));
  M3_TRY(get_real(p, t, "", "swiglu_alpha", 1, &c->swiglu_alpha, NULL));
  M3_TRY(get_real(p, t, "", "swiglu_limit", 1, &c->swiglu_limit, NULL));
  /* Absent from the released config.json; HF hard-codes +1.0 and vLLM's config
   * default is 1.0 (spec §1.1, §12.4). */
  c->swiglu_beta = 1.0;
  M3_TRY(get_real(p, t, "", "swiglu_beta", 0, &c->swiglu_beta, &c->swiglu_beta_given));

  /* Norms and RoPE. */
  M3_TRY(get_real(p, t, "", "rms_norm_eps", 1, &c->rms_norm_eps, NULL));
  M3_TRY(get_bool(p, t, "", "use_gemma_norm", 1, &c->use_gemma_norm, NULL));
  M3_TRY(get_bool(p, t, "", "use_qk_norm", 1, &c->use_qk_norm, NULL));
  snprintf(c->qk_norm_type, sizeof c->qk_norm_type, "per_head");
  M3_TRY(get_str(p, t, "", "qk_norm_type", 0, c->qk_norm_type, sizeof c->qk_norm_type, NULL));
  M3_TRY(check_choice(p, "", "qk_norm_type", c->qk_norm_type, (const char *const[]){"per_head", NULL},
                      "one shared [head_dim] weight per q/k (spec §3.3)"));
  c->attention_output_gate = 0;
  M3_TRY(get_bool(p, t, "", "attention_output_gate", 0, &c->attention_output_gate, NULL));
  M3_TRY(get_real(p, t, "", "rope_theta", 1, &c->rope_theta, NULL));
  int have_rd = 0, have_prf = 0;
  M3_TRY(get_int(p, t, "", "rotary_dim", 0, 0, 4096, &c->rotary_dim, &have_rd));
  M3_TRY(get_real(p, t, "", "partial_rotary_factor", 0, &c->partial_rotary_factor, &have_prf));
  M3_TRY(get_bool(p, t, "", "tie_word_embeddings", 1, &c->tie_word_embeddings, NULL));
  const json_t *rs = json_object_get(t, "rope_scaling");
  if (rs && !json_is_null(rs))
    return field_err(p, "", "rope_scaling", M3_CONFIG,
                     "RoPE scaling is not supported (the model uses plain NeoX RoPE, spec §3.4)");

  int L = c->num_hidden_layers;
  M3_TRY(get_layer_list(p, t, "", "moe_layer_freq", L, 1, c->is_moe, NULL));

  /* Sparse attention. */
  const json_t *sa = json_object_get(t, "sparse_attention_config");
  if (!sa) return field_err(p, "", "sparse_attention_config", M3_CONFIG, "required field missing");
  if (!json_is_object(sa))
    return field_err(p, "", "sparse_attention_config", M3_FORMAT, "expected an object, got %s",
                     json_type_name(sa));
  M3_TRY(get_bool(p, sa, S, "use_sparse_attention", 1, &c->use_sparse_attention, NULL));
  M3_TRY(get_layer_list(p, sa, S, "sparse_attention_freq", L, 1, c->is_sparse, NULL));
  M3_TRY(get_layer_list(p, sa, S, "sparse_disable_index_value", L, 0, c->disable_index_value, &f));
  if (!f) memcpy(c->disable_index_value, c->is_sparse, (size_t)L);
  M3_TRY(get_int(p, sa, S, "sparse_index_dim", 1, 1, 4096, &c->sparse_index_dim, NULL));
  M3_TRY(get_int(p, sa, S, "sparse_num_index_heads", 1, 1, 4096, &c->sparse_num_index_heads, NULL));
  M3_TRY(get_int(p, sa, S, "sparse_block_size", 1, 1, 1 << 20, &c->sparse_block_size, NULL));
  M3_TRY(get_int(p, sa, S, "sparse_topk_blocks", 1, 1, 1 << 20, &c->sparse_topk_blocks, NULL));
  M3_TRY(get_int(p, sa, S, "sparse_init_block", 1, 0, 1 << 20, &c->sparse_init_block, NULL));
  M3_TRY(get_int(p, sa, S, "sparse_local_block", 1, 0, 1 << 20, &c->sparse_local_block, NULL));
  M3_TRY(get_str(p, sa, S, "sparse_score_type", 1, c->sparse_score_type,
                 sizeof c->sparse_score_type, NULL));
  M3_TRY(check_choice(p, S, "sparse_score_type", c->sparse_score_type,
                      (const char *const[]){"max", NULL},
                      "block score = max over the block's tokens (spec §5)"));

  /* ---- cross-field constraints: what the kernels assume ---- */
  if (c->num_attention_heads % c->num_key_value_heads != 0)
    return field_err(p, "", "num_key_value_heads", M3_CONFIG,
                     "%d does not divide num_attention_heads %d", c->num_key_value_heads,
                     c->num_attention_heads);
  if (c->head_dim != 128)
    return field_err(p, "", "head_dim", M3_CONFIG,
                     "%d is not supported (the attention and qknorm kernels need 128)", c->head_dim);
  if (have_rd) {
    if (c->rotary_dim <= 0 || c->rotary_dim % 2 != 0 || c->rotary_dim > c->head_dim)
      return field_err(p, "", "rotary_dim", M3_CONFIG,
                       "%d must be even and in (0, head_dim %d] (NeoX pairs d with d + rotary_dim/2)",
                       c->rotary_dim, c->head_dim);
    double want = (double)c->rotary_dim / c->head_dim;
    if (have_prf && fabs(c->partial_rotary_factor - want) > 1e-9)
      return field_err(p, "", "partial_rotary_factor", M3_CONFIG,
                       "%g disagrees with rotary_dim %d / head_dim %d = %g",
                       c->partial_rotary_factor, c->rotary_dim, c->head_dim, want);
    if (!have_prf) c->partial_rotary_factor = want;
  } else if (have_prf) {
    double rd = c->partial_rotary_factor * c->head_dim;
    if (rd != floor(rd) || rd <= 0 || rd > c->head_dim || ((int)rd) % 2 != 0)
      return field_err(p, "", "partial_rotary_factor", M3_CONFIG,
                       "%g x head_dim %d does not give an even rotary_dim in (0, head_dim]",
                       c->partial_rotary_factor, c->head_dim);
    c->rotary_dim = (int)rd;
  } else {
    return field_err(p, "", "rotary_dim", M3_CONFIG,
                     "required field missing (and no partial_rotary_factor)");
  }
  if (c->num_experts_per_tok > c->num_local_experts)
    return field_err(p, "", "num_experts_per_tok", M3_CONFIG,
                     "%d exceeds num_local_experts %d", c->num_experts_per_tok,
                     c->num_local_experts);
  if (c->n_shared_experts > 0 && c->shared_intermediate_size != c->intermediate_size)
    return field_err(p, "", "shared_intermediate_size", M3_CONFIG,
                     "%d differs from intermediate_size %d: vLLM sizes the shared expert from "
                     "intermediate_size and HF from shared_intermediate_size (spec §11), so the "
                     "intended width is ambiguous",
                     c->shared_intermediate_size, c->intermediate_size);
  if (c->routed_scaling_factor <= 0)
    return field_err(p, "", "routed_scaling_factor", M3_CONFIG, "%g must be > 0",
                     c->routed_scaling_factor);
  if (c->swiglu_limit <= 0)
    return field_err(p, "", "swiglu_limit", M3_CONFIG, "%g must be > 0", c->swiglu_limit);
  if (c->rms_norm_eps <= 0)
    return field_err(p, "", "rms_norm_eps", M3_CONFIG, "%g must be > 0", c->rms_norm_eps);
  if (c->rope_theta <= 1)
    return field_err(p, "", "rope_theta", M3_CONFIG, "%g must be > 1", c->rope_theta);
  if (!c->use_gemma_norm)
    return field_err(p, "", "use_gemma_norm", M3_CONFIG,
                     "false is not supported (every norm computes x·r·(1+w), spec §2.2)");
  if (!c->use_qk_norm)
    return field_err(p, "", "use_qk_norm", M3_CONFIG,
                     "false is not supported (the qknorm_rope kernel always normalises, spec §3.3)");
  if (c->attention_output_gate)
    return field_err(p, "", "attention_output_gate", M3_CONFIG,
                     "true is not supported (no output gate in M3, spec §10.10)");
  if (strcmp(c->torch_dtype, "bfloat16") != 0)
    return field_err(p, "", "torch_dtype", M3_CONFIG,
                     "\"%s\" is not supported (activations are bf16)", c->torch_dtype);

  int n_sparse = 0;
  for (int l = 0; l < L; l++) n_sparse += c->is_sparse[l];
  if (!c->use_sparse_attention && n_sparse > 0)
    return field_err(p, S, "use_sparse_attention", M3_CONFIG,
                     "false, but sparse_attention_freq marks %d layers sparse", n_sparse);
  for (int l = 0; l < L; l++)
    if (c->is_sparse[l] && !c->disable_index_value[l])
      return field_err(p, S, "sparse_disable_index_value", M3_CONFIG,
                       "entry %d: 0 on a sparse layer is not supported (the indexer is "
                       "selection-only; there are no index_v/index_o weights, spec §1.2)", l);
  if (c->sparse_index_dim != 128)
    return field_err(p, S, "sparse_index_dim", M3_CONFIG,
                     "%d is not supported (the indexer kernels need 128)", c->sparse_index_dim);
  if (c->sparse_num_index_heads != c->num_key_value_heads)
    return field_err(p, S, "sparse_num_index_heads", M3_CONFIG,
                     "%d must equal num_key_value_heads %d (index head g selects blocks for KV "
                     "head g; no top-k index reduce, spec §11)",
                     c->sparse_num_index_heads, c->num_key_value_heads);
  if (c->sparse_init_block + c->sparse_local_block > c->sparse_topk_blocks)
    return field_err(p, S, "sparse_topk_blocks", M3_CONFIG,
                     "%d is smaller than sparse_init_block %d + sparse_local_block %d",
                     c->sparse_topk_blocks, c->sparse_init_block, c->sparse_local_block);
  /* What the kernels can do, said here with the field's name rather than by
   * a template's valid() naming a variant key (templates/index_*.lua,
   * attn_*.lua, mxfp8.lua). */
  if (c->sparse_block_size % 16 != 0)
    return field_err(p, S, "sparse_block_size", M3_CONFIG,
                     "%d is not supported (pages are cut into 16-token mma tiles: a multiple of 16)",
                     c->sparse_block_size);
  if (c->sparse_topk_blocks > 32)
    return field_err(p, S, "sparse_topk_blocks", M3_CONFIG,
                     "%d is not supported (the top-k kernels keep at most 32 blocks)", c->sparse_topk_blocks);
  if (c->hidden_size % 32 != 0)
    return field_err(p, "", "hidden_size", M3_CONFIG,
                     "%d is not supported (a multiple of 32: MXFP8 scales cover 32 inputs, spec §8)",
                     c->hidden_size);
  return M3_OK;
}

static m3_status parse_root(const json_t *root, const char *name, m3_config *c, m3_err *e) {
  memset(c, 0, sizeof *c); /* also zeroes padding: configs compare with memcmp */
  c->image_token_index = c->video_token_index = -1;
  parse_ctx p = {name, "", e};
  if (!json_is_object(root))
    return m3_errf(e, M3_FORMAT, "%s: expected a JSON object at the top level, got %s", name,
                   json_type_name(root));
  const json_t *t = json_object_get(root, "text_config");
  const json_t *q = json_object_get(root, "quantization_config");
  if (t) {
    if (!json_is_object(t))
      return field_err(&p, "", "text_config", M3_FORMAT, "expected an object, got %s",
                       json_type_name(t));
    char mt[48];
    M3_TRY(get_str(&p, root, "", "model_type", 1, mt, sizeof mt, NULL));
    M3_TRY(check_choice(&p, "", "model_type", mt, vl_model_types, NULL));
    c->is_vl = 1;
    int64_t v;
    int f;
    M3_TRY(get_i64(&p, root, "", "image_token_index", 0, &v, &f));
    if (f) c->image_token_index = v;
    M3_TRY(get_i64(&p, root, "", "video_token_index", 0, &v, &f));
    if (f) c->video_token_index = v;
    parse_ctx pt = {name, "text_config.", e};
    M3_TRY(parse_text(&pt, t, c));
    if (!q && (q = json_object_get(t, "quantization_config"))) p.pre = "text_config.";
  } else {
    /* A wrapper's model_type without its text_config: say what is missing,
     * not that the type is unsupported. */
    const json_t *mt = json_object_get(root, "model_type");
    for (int i = 0; json_is_string(mt) && vl_model_types[i]; i++)
      if (!strcmp(json_string_value(mt), vl_model_types[i]))
        return field_err(&p, "", "text_config", M3_FORMAT, "missing (model_type \"%s\" keeps the language model's "
                         "fields in text_config)", vl_model_types[i]);
    M3_TRY(parse_text(&p, root, c));
  }
  if (q && !json_is_null(q)) {
    if (!json_is_object(q))
      return field_err(&p, "", "quantization_config", M3_FORMAT, "expected an object, got %s",
                       json_type_name(q));
    M3_TRY(get_str(&p, q, "quantization_config.", "quant_method", 1, c->quant_method,
                   sizeof c->quant_method, NULL));
    M3_TRY(check_choice(&p, "quantization_config.", "quant_method", c->quant_method,
                        (const char *const[]){"mxfp8", NULL},
                        "MXFP8 (e4m3 + E8M0 per 1x32) or unquantised bf16 only (spec §8)"));
    const json_t *bs = json_object_get(q, "weight_block_size");
    if (bs && !(json_is_array(bs) && json_array_size(bs) == 2 &&
                json_integer_value(json_array_get(bs, 0)) == 1 &&
                json_integer_value(json_array_get(bs, 1)) == 32))
      return field_err(&p, "quantization_config.", "weight_block_size", M3_CONFIG,
                       "must be [1, 32] for mxfp8");
  }
  return M3_OK;
}

m3_status m3_config_load_json_text(const char *text, const char *name_for_errors, m3_config *c,
                                   m3_err *e) {
  const char *name = name_for_errors ? name_for_errors : "config";
  json_error_t je;
  json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &je);
  if (!root)
    return m3_errf(e, M3_FORMAT, "%s:%d:%d: invalid JSON: %s", name, je.line, je.column, je.text);
  m3_status s = parse_root(root, name, c, e);
  json_decref(root);
  return s;
}

m3_status m3_config_load_file(const char *path, m3_config *c, m3_err *e) {
  uint8_t *buf;
  size_t len;
  M3_TRY(m3_read_file(path, &buf, &len, e));
  if (memchr(buf, 0, len)) {
    free(buf);
    return m3_errf(e, M3_FORMAT, "%s: contains a NUL byte (not a JSON text file)", path);
  }
  m3_status s = m3_config_load_json_text((const char *)buf, path, c, e);
  free(buf);
  return s;
}

/* ---- presets ---------------------------------------------------------------- */

#define N_PRESETS (sizeof m3_presets / sizeof *m3_presets - 1)

/* Names are the file names without ".json", built once (pthread_once: the
 * library may be used from several threads) into static storage sized from
 * the embedded table, so no allocation and nothing to free. */
static char preset_name_buf[N_PRESETS][64];
static const char *preset_list[N_PRESETS + 1];
static pthread_once_t preset_once = PTHREAD_ONCE_INIT;

static void preset_names_init(void) {
  for (size_t i = 0; i < N_PRESETS; i++) {
    snprintf(preset_name_buf[i], sizeof preset_name_buf[i], "%s", m3_presets[i].name);
    char *dot = strrchr(preset_name_buf[i], '.');
    if (dot && strcmp(dot, ".json") == 0) *dot = 0;
    preset_list[i] = preset_name_buf[i];
  }
  preset_list[N_PRESETS] = NULL;
}

const char *const *m3_config_preset_names(void) {
  pthread_once(&preset_once, preset_names_init);
  return preset_list;
}

m3_status m3_config_preset(const char *name, m3_config *c, m3_err *e) {
  const char *const *names = m3_config_preset_names();
  for (size_t i = 0; names[i]; i++) {
    if (strcmp(names[i], name) != 0) continue;
    char label[128];
    snprintf(label, sizeof label, "preset %s (runtime/presets/%s)", name, m3_presets[i].name);
    return m3_config_load_json_text(m3_presets[i].text, label, c, e);
  }
  char list[512] = "";
  for (size_t i = 0; names[i]; i++)
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", names[i]);
  return m3_errf(e, M3_NOTFOUND, "unknown preset '%s' (known: %s)", name, list);
}

/* ---- serialisation ------------------------------------------------------------ */

static json_t *layer_list(const uint8_t *v, int n) {
  json_t *a = json_array();
  for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
  return a;
}

/* Key order follows the released config.json so diffs against it stay small. */
static json_t *text_json(const m3_config *c) {
  json_t *t = json_object();
#define SETI(k, v) json_object_set_new(t, k, json_integer(v))
#define SETR(k, v) json_object_set_new(t, k, json_real(v))
#define SETB(k, v) json_object_set_new(t, k, json_boolean(v))
#define SETS(k, v) json_object_set_new(t, k, json_string(v))
  json_t *arch = json_array();
  json_array_append_new(arch, json_string("MiniMaxM3SparseForCausalLM"));
  json_object_set_new(t, "architectures", arch);
  SETS("model_type", c->model_type);
  SETI("hidden_size", c->hidden_size);
  SETI("num_hidden_layers", c->num_hidden_layers);
  SETI("num_attention_heads", c->num_attention_heads);
  SETI("num_key_value_heads", c->num_key_value_heads);
  SETI("head_dim", c->head_dim);
  SETI("vocab_size", c->vocab_size);
  SETI("intermediate_size", c->intermediate_size);
  SETI("dense_intermediate_size", c->dense_intermediate_size);
  SETI("shared_intermediate_size", c->shared_intermediate_size);
  SETI("n_shared_experts", c->n_shared_experts);
  SETI("num_local_experts", c->num_local_experts);
  SETI("num_experts_per_tok", c->num_experts_per_tok);
  SETS("scoring_func", c->scoring_func);
  SETB("use_routing_bias", c->use_routing_bias);
  SETR("routed_scaling_factor", c->routed_scaling_factor);
  SETS("hidden_act", c->hidden_act);
  SETR("swiglu_alpha", c->swiglu_alpha);
  SETR("swiglu_limit", c->swiglu_limit);
  if (c->swiglu_beta_given) SETR("swiglu_beta", c->swiglu_beta);
  SETR("rms_norm_eps", c->rms_norm_eps);
  SETB("use_gemma_norm", c->use_gemma_norm);
  SETB("use_qk_norm", c->use_qk_norm);
  SETS("qk_norm_type", c->qk_norm_type);
  SETB("attention_output_gate", c->attention_output_gate);
  SETR("rope_theta", c->rope_theta);
  SETI("rotary_dim", c->rotary_dim);
  SETR("partial_rotary_factor", c->partial_rotary_factor);
  SETI("max_position_embeddings", c->max_position_embeddings);
  SETB("tie_word_embeddings", c->tie_word_embeddings);
  json_object_set_new(t, "moe_layer_freq", layer_list(c->is_moe, c->num_hidden_layers));
  SETI("num_mtp_modules", c->num_mtp_modules);
  SETS("torch_dtype", c->torch_dtype);
  json_t *sa = json_object();
  json_object_set_new(sa, "use_sparse_attention", json_boolean(c->use_sparse_attention));
  json_object_set_new(sa, "sparse_attention_freq", layer_list(c->is_sparse, c->num_hidden_layers));
  json_object_set_new(sa, "sparse_disable_index_value",
                      layer_list(c->disable_index_value, c->num_hidden_layers));
  json_object_set_new(sa, "sparse_index_dim", json_integer(c->sparse_index_dim));
  json_object_set_new(sa, "sparse_num_index_heads", json_integer(c->sparse_num_index_heads));
  json_object_set_new(sa, "sparse_block_size", json_integer(c->sparse_block_size));
  json_object_set_new(sa, "sparse_topk_blocks", json_integer(c->sparse_topk_blocks));
  json_object_set_new(sa, "sparse_init_block", json_integer(c->sparse_init_block));
  json_object_set_new(sa, "sparse_local_block", json_integer(c->sparse_local_block));
  json_object_set_new(sa, "sparse_score_type", json_string(c->sparse_score_type));
  json_object_set_new(t, "sparse_attention_config", sa);
#undef SETI
#undef SETR
#undef SETB
#undef SETS
  return t;
}

static json_t *quant_json(const m3_config *c) {
  json_t *q = json_object();
  json_object_set_new(q, "quant_method", json_string(c->quant_method));
  json_t *bs = json_array();
  json_array_append_new(bs, json_integer(1));
  json_array_append_new(bs, json_integer(32));
  json_object_set_new(q, "weight_block_size", bs);
  json_object_set_new(q, "activation_scheme", json_string("dynamic"));
  return q;
}

static char *dump(const m3_config *c, int vl) {
  json_t *root;
  if (vl) {
    root = json_object();
    json_t *arch = json_array();
    json_array_append_new(arch, json_string("MiniMaxM3SparseForConditionalGeneration"));
    json_object_set_new(root, "architectures", arch);
    json_object_set_new(root, "model_type", json_string("minimax_m3_vl"));
    if (c->image_token_index >= 0)
      json_object_set_new(root, "image_token_index", json_integer(c->image_token_index));
    if (c->video_token_index >= 0)
      json_object_set_new(root, "video_token_index", json_integer(c->video_token_index));
    json_object_set_new(root, "text_config", text_json(c));
    json_object_set_new(root, "torch_dtype", json_string(c->torch_dtype));
  } else {
    root = text_json(c);
  }
  if (c->quant_method[0]) json_object_set_new(root, "quantization_config", quant_json(c));
  /* jansson prints reals with %.17g: doubles round-trip exactly. */
  char *s = json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
  json_decref(root);
  if (!s) return NULL;
  /* json_dumps allocates with jansson's allocator (malloc by default); hand the
   * caller plain malloc'd text with a trailing newline. */
  size_t n = strlen(s);
  char *out = malloc(n + 2);
  if (out) {
    memcpy(out, s, n);
    out[n] = '\n';
    out[n + 1] = 0;
  }
  free(s);
  return out;
}

char *m3_config_to_json(const m3_config *c) { return dump(c, c->is_vl); }
char *m3_config_to_json_vl(const m3_config *c) { return dump(c, 1); }

m3_status m3_config_for(const char *preset, const char *model_dir, m3_config *c, m3_err *e) {
  if (!model_dir) return m3_config_preset(preset, c, e);
  char path[4200];
  snprintf(path, sizeof path, "%s/config.json", model_dir);
  return m3_config_load_file(path, c, e);
}

/* ---- derived sizes ----------------------------------------------------------- */

int m3_config_q_width(const m3_config *c) { return c->num_attention_heads * c->head_dim; }
int m3_config_kv_width(const m3_config *c) { return c->num_key_value_heads * c->head_dim; }

int m3_config_qkv_width(const m3_config *c, int layer) {
  int w = (c->num_attention_heads + 2 * c->num_key_value_heads) * c->head_dim;
  if (c->is_sparse[layer]) w += (c->sparse_num_index_heads + 1) * c->sparse_index_dim;
  return w;
}

int m3_config_ffn_width(const m3_config *c, int layer) {
  return c->is_moe[layer] ? c->intermediate_size : c->dense_intermediate_size;
}

int m3_config_shared_width(const m3_config *c) {
  return c->shared_intermediate_size * c->n_shared_experts;
}

uint64_t m3_config_kv_bytes_per_token(const m3_config *c, int layer, int kv_elem_bytes,
                                      int idx_elem_bytes) {
  uint64_t b = 2ull * (uint64_t)c->num_key_value_heads * (uint64_t)c->head_dim * (uint64_t)kv_elem_bytes;
  /* One shared index-K head per token (spec §4.4), regardless of niq. */
  if (c->is_sparse[layer]) b += (uint64_t)c->sparse_index_dim * (uint64_t)idx_elem_bytes;
  return b;
}

uint64_t m3_config_kv_bytes_per_token_model(const m3_config *c, int kv_elem_bytes,
                                            int idx_elem_bytes) {
  uint64_t b = 0;
  for (int l = 0; l < c->num_hidden_layers; l++)
    b += m3_config_kv_bytes_per_token(c, l, kv_elem_bytes, idx_elem_bytes);
  return b;
}

int m3_config_n_sparse_layers(const m3_config *c) {
  int n = 0;
  for (int l = 0; l < c->num_hidden_layers; l++) n += c->is_sparse[l];
  return n;
}

int m3_config_n_moe_layers(const m3_config *c) {
  int n = 0;
  for (int l = 0; l < c->num_hidden_layers; l++) n += c->is_moe[l];
  return n;
}

void m3_config_n_params(const m3_config *c, uint64_t *total, uint64_t *active) {
  uint64_t H = (uint64_t)c->hidden_size, qw = (uint64_t)m3_config_q_width(c),
           kvw = (uint64_t)m3_config_kv_width(c), D = (uint64_t)c->head_dim,
           ID = (uint64_t)c->sparse_index_dim, E = (uint64_t)c->num_local_experts;
  uint64_t tot = 0, act = 0;
  uint64_t emb = (uint64_t)c->vocab_size * H;
  tot += emb + (c->tie_word_embeddings ? 0 : emb) + H; /* + final norm */
  for (int l = 0; l < c->num_hidden_layers; l++) {
    uint64_t attn = qw * H + 2 * kvw * H + H * qw;
    tot += attn + 2 * H + 2 * D; /* + layer norms, q/k norm */
    act += attn;
    if (c->is_sparse[l]) {
      uint64_t idx = (uint64_t)c->sparse_num_index_heads * ID * H + ID * H;
      tot += idx + 2 * ID;
      act += idx;
    }
    if (c->is_moe[l]) {
      uint64_t ex = 3 * (uint64_t)c->intermediate_size * H;
      uint64_t sh = 3 * (uint64_t)m3_config_shared_width(c) * H;
      uint64_t router = E * H;
      tot += E * ex + sh + router + (c->use_routing_bias ? E : 0);
      act += (uint64_t)c->num_experts_per_tok * ex + sh + router;
    } else {
      uint64_t mlp = 3 * (uint64_t)c->dense_intermediate_size * H;
      tot += mlp;
      act += mlp;
    }
  }
  if (total) *total = tot;
  if (active) *active = act;
}
