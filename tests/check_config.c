/* check_config.c - config.json parsing (runtime/config.h): the released config
 * in both forms, every validation error naming its field, presets, to_json
 * round trips and the derived sizes of spec §1.4 / §9.3.  CPU only. */
#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/config.h"
#include "runtime/embedded.h"
#include "runtime/presets.inc" /* the exact bytes of the released config.json */

static const char *real_text(void) {
  for (const m3_embedded *p = m3_presets; p->name; p++)
    if (strcmp(p->name, "minimax-m3.json") == 0) return p->text;
  return NULL;
}

static json_t *real_json(void) {
  json_error_t je;
  json_t *j = json_loads(real_text(), 0, &je);
  ck_assert_ptr_nonnull(j);
  return j;
}

static void check_real_values(const m3_config *c) {
  ck_assert_int_eq(c->hidden_size, 6144);
  ck_assert_int_eq(c->num_hidden_layers, 60);
  ck_assert_int_eq(c->num_attention_heads, 64);
  ck_assert_int_eq(c->num_key_value_heads, 4);
  ck_assert_int_eq(c->head_dim, 128);
  ck_assert_int_eq(c->vocab_size, 200064);
  ck_assert_int_eq(c->intermediate_size, 3072);
  ck_assert_int_eq(c->dense_intermediate_size, 12288);
  ck_assert_int_eq(c->shared_intermediate_size, 3072);
  ck_assert_int_eq(c->n_shared_experts, 1);
  ck_assert_int_eq(c->num_local_experts, 128);
  ck_assert_int_eq(c->num_experts_per_tok, 4);
  ck_assert_str_eq(c->scoring_func, "sigmoid");
  ck_assert_int_eq(c->use_routing_bias, 1);
  ck_assert_double_eq(c->routed_scaling_factor, 2.0);
  ck_assert_str_eq(c->hidden_act, "swigluoai");
  ck_assert_double_eq(c->swiglu_alpha, 1.702);
  ck_assert_double_eq(c->swiglu_limit, 7.0);
  ck_assert_double_eq(c->swiglu_beta, 1.0); /* absent from the file: the documented default */
  ck_assert_int_eq(c->swiglu_beta_given, 0);
  ck_assert_double_eq(c->rms_norm_eps, 1e-6);
  ck_assert_int_eq(c->use_gemma_norm, 1);
  ck_assert_int_eq(c->use_qk_norm, 1);
  ck_assert_str_eq(c->qk_norm_type, "per_head");
  ck_assert_int_eq(c->attention_output_gate, 0);
  ck_assert_double_eq(c->rope_theta, 5e6);
  ck_assert_int_eq(c->rotary_dim, 64);
  ck_assert_double_eq(c->partial_rotary_factor, 0.5);
  ck_assert_int_eq(c->max_position_embeddings, 1048576);
  ck_assert_int_eq(c->tie_word_embeddings, 0);
  ck_assert_int_eq(c->num_mtp_modules, 1);
  ck_assert_str_eq(c->torch_dtype, "bfloat16");
  ck_assert_int_eq(c->use_sparse_attention, 1);
  ck_assert_int_eq(c->sparse_index_dim, 128);
  ck_assert_int_eq(c->sparse_num_index_heads, 4);
  ck_assert_int_eq(c->sparse_block_size, 128);
  ck_assert_int_eq(c->sparse_topk_blocks, 16);
  ck_assert_int_eq(c->sparse_init_block, 0);
  ck_assert_int_eq(c->sparse_local_block, 1);
  ck_assert_str_eq(c->sparse_score_type, "max");
  for (int l = 0; l < 60; l++) {
    ck_assert_int_eq(c->is_sparse[l], l >= 3);
    ck_assert_int_eq(c->is_moe[l], l >= 3);
    ck_assert_int_eq(c->disable_index_value[l], l >= 3);
  }
  ck_assert_str_eq(c->quant_method, "");
}

START_TEST(real_config_wrapper) {
  char dir[] = "/tmp/m3cfgXXXXXX", path[256];
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/config.json", dir);
  FILE *f = fopen(path, "w");
  fputs(real_text(), f);
  fclose(f);
  m3_config c;
  m3_err e = {0};
  ck_assert_msg(m3_config_load_file(path, &c, &e) == M3_OK, "%s", e.msg);
  check_real_values(&c);
  ck_assert_int_eq(c.is_vl, 1);
  ck_assert_str_eq(c.model_type, "minimax_m3_vl_text");
  ck_assert_int_eq(c.image_token_index, 200025);
  ck_assert_int_eq(c.video_token_index, 200026);
  unlink(path);
  rmdir(dir);

  /* Derived sizes: spec §3.2, §9.3, §1.4. */
  ck_assert_int_eq(m3_config_qkv_width(&c, 0), 9216);
  ck_assert_int_eq(m3_config_qkv_width(&c, 3), 9856);
  ck_assert_int_eq(m3_config_q_width(&c), 8192);
  ck_assert_int_eq(m3_config_kv_width(&c), 512);
  ck_assert_int_eq(m3_config_ffn_width(&c, 0), 12288);
  ck_assert_int_eq(m3_config_ffn_width(&c, 59), 3072);
  ck_assert_int_eq(m3_config_shared_width(&c), 3072);
  ck_assert_uint_eq(m3_config_kv_bytes_per_token(&c, 0, 2, 2), 2048);
  ck_assert_uint_eq(m3_config_kv_bytes_per_token(&c, 3, 2, 2), 2304);
  ck_assert_uint_eq(m3_config_kv_bytes_per_token_model(&c, 2, 2), 137472);
  ck_assert_uint_eq(m3_config_kv_bytes_per_token_model(&c, 1, 1), 68736);
  ck_assert_int_eq(m3_config_n_sparse_layers(&c), 57);
  ck_assert_int_eq(m3_config_n_moe_layers(&c), 57);
  uint64_t total, active;
  m3_config_n_params(&c, &total, &active);
  ck_assert_uint_eq(total, 426174572928ull);          /* spec §1.4, exact */
  ck_assert_msg(active > 23495000000ull && active < 23505000000ull, "active %llu",
                (unsigned long long)active);          /* "23.50 B" */
}
END_TEST

START_TEST(real_config_bare) {
  json_t *j = real_json();
  char *txt = json_dumps(json_object_get(j, "text_config"), 0);
  m3_config c, w;
  m3_err e = {0};
  ck_assert_msg(m3_config_load_json_text(txt, "text.json", &c, &e) == M3_OK, "%s", e.msg);
  check_real_values(&c);
  ck_assert_int_eq(c.is_vl, 0);
  ck_assert_int_eq(c.image_token_index, -1);
  ck_assert_int_eq(m3_config_load_json_text(real_text(), "config.json", &w, &e), M3_OK);
  /* The text fields are identical; only the wrapper's fields differ. */
  w.is_vl = 0;
  w.image_token_index = w.video_token_index = -1;
  ck_assert(memcmp(&c, &w, sizeof c) == 0);
  free(txt);
  json_decref(j);
}
END_TEST

/* ---- every validation error names the file and the field ---- */

typedef struct {
  const char *path;  /* "text_config.x" or "text_config.sparse_attention_config.x", "model_type" */
  const char *json;  /* new value as JSON text; NULL = delete the key */
  m3_status code;
  const char *want;  /* substring of the message after "config.json: " */
} bad_case;

static const bad_case bad[] = {
    {"text_config.num_key_value_heads", "3", M3_CONFIG,
     "text_config.num_key_value_heads: 3 does not divide num_attention_heads 64"},
    {"text_config.scoring_func", "\"softmax\"", M3_CONFIG, "text_config.scoring_func: \"softmax\" is not supported"},
    {"text_config.hidden_act", "\"silu\"", M3_CONFIG, "text_config.hidden_act: \"silu\" is not supported"},
    {"text_config.sparse_attention_config.sparse_score_type", "\"mean\"", M3_CONFIG,
     "text_config.sparse_attention_config.sparse_score_type: \"mean\" is not supported"},
    {"text_config.sparse_attention_config.sparse_num_index_heads", "2", M3_CONFIG,
     "text_config.sparse_attention_config.sparse_num_index_heads: 2 must equal num_key_value_heads 4"},
    {"text_config.model_type", "\"llama\"", M3_CONFIG, "text_config.model_type: \"llama\" is not supported"},
    {"model_type", "\"qwen2_vl\"", M3_CONFIG, "model_type: \"qwen2_vl\" is not supported"},
    {"model_type", NULL, M3_CONFIG, "model_type: required field missing"},
    {"text_config.head_dim", "64", M3_CONFIG, "text_config.head_dim: 64 is not supported"},
    {"text_config.sparse_attention_config.sparse_index_dim", "64", M3_CONFIG,
     "text_config.sparse_attention_config.sparse_index_dim: 64 is not supported"},
    {"text_config.rotary_dim", "63", M3_CONFIG, "text_config.rotary_dim: 63 must be even"},
    {"text_config.rotary_dim", "256", M3_CONFIG, "text_config.rotary_dim: 256 must be even and in (0, head_dim 128]"},
    {"text_config.partial_rotary_factor", "0.25", M3_CONFIG,
     "text_config.partial_rotary_factor: 0.25 disagrees with rotary_dim 64"},
    {"text_config.moe_layer_freq", "[0,0,1]", M3_CONFIG,
     "text_config.moe_layer_freq: has 3 entries, expected num_hidden_layers = 60"},
    {"text_config.sparse_attention_config.sparse_attention_freq", "[1]", M3_CONFIG,
     "text_config.sparse_attention_config.sparse_attention_freq: has 1 entries"},
    {"text_config.num_hidden_layers", "61", M3_CONFIG, "text_config.moe_layer_freq: has 60 entries, expected num_hidden_layers = 61"},
    {"text_config.hidden_size", NULL, M3_CONFIG, "text_config.hidden_size: required field missing"},
    {"text_config.hidden_size", "\"6144\"", M3_FORMAT, "text_config.hidden_size: expected an integer, got a string"},
    {"text_config.hidden_size", "0", M3_CONFIG, "text_config.hidden_size: 0 is out of range"},
    {"text_config.vocab_size", "6.5", M3_CONFIG, "text_config.vocab_size: 6.5 is not an integer"},
    {"text_config.num_experts_per_tok", "200", M3_CONFIG,
     "text_config.num_experts_per_tok: 200 exceeds num_local_experts 128"},
    {"text_config.use_gemma_norm", "false", M3_CONFIG, "text_config.use_gemma_norm: false is not supported"},
    {"text_config.use_gemma_norm", "1", M3_FORMAT, "text_config.use_gemma_norm: expected true or false"},
    {"text_config.use_qk_norm", "false", M3_CONFIG, "text_config.use_qk_norm: false is not supported"},
    {"text_config.qk_norm_type", "\"global\"", M3_CONFIG, "text_config.qk_norm_type: \"global\" is not supported"},
    {"text_config.attention_output_gate", "true", M3_CONFIG, "text_config.attention_output_gate: true is not supported"},
    {"text_config.shared_intermediate_size", "2048", M3_CONFIG,
     "text_config.shared_intermediate_size: 2048 differs from intermediate_size 3072"},
    {"text_config.n_shared_experts", "2", M3_CONFIG, "text_config.n_shared_experts: 2 is out of range [0, 1]"},
    {"text_config.rope_scaling", "{\"rope_type\":\"yarn\"}", M3_CONFIG, "text_config.rope_scaling: RoPE scaling is not supported"},
    {"text_config.rms_norm_eps", "0", M3_CONFIG, "text_config.rms_norm_eps: 0 must be > 0"},
    {"text_config.routed_scaling_factor", "\"2\"", M3_FORMAT, "text_config.routed_scaling_factor: expected a number"},
    {"text_config.torch_dtype", "\"float16\"", M3_CONFIG, "text_config.torch_dtype: \"float16\" is not supported"},
    {"text_config.sparse_attention_config", NULL, M3_CONFIG, "text_config.sparse_attention_config: required field missing"},
    {"text_config.sparse_attention_config.sparse_topk_blocks", "0", M3_CONFIG,
     "text_config.sparse_attention_config.sparse_topk_blocks: 0 is out of range"},
    {"text_config.sparse_attention_config.sparse_init_block", "16", M3_CONFIG,
     "text_config.sparse_attention_config.sparse_topk_blocks: 16 is smaller than sparse_init_block 16 + sparse_local_block 1"},
    {"text_config.sparse_attention_config.use_sparse_attention", "false", M3_CONFIG,
     "text_config.sparse_attention_config.use_sparse_attention: false, but sparse_attention_freq marks 57 layers sparse"},
    {"text_config.quantization_config", "{\"quant_method\":\"fp8\"}", M3_CONFIG,
     "text_config.quantization_config.quant_method: \"fp8\" is not supported"},
    {"quantization_config", "{\"quant_method\":\"mxfp8\",\"weight_block_size\":[128,128]}", M3_CONFIG,
     "quantization_config.weight_block_size: must be [1, 32]"},
    {"text_config", "[]", M3_FORMAT, "text_config: expected an object, got an array"},
    {"text_config", NULL, M3_FORMAT, "text_config: missing (model_type \"minimax_m3_vl\" keeps"},
    {"text_config.sparse_attention_config.sparse_block_size", "17", M3_CONFIG,
     "text_config.sparse_attention_config.sparse_block_size: 17 is not supported"},
    {"text_config.sparse_attention_config.sparse_topk_blocks", "100", M3_CONFIG,
     "text_config.sparse_attention_config.sparse_topk_blocks: 100 is not supported"},
    {"text_config.hidden_size", "6100", M3_CONFIG, "text_config.hidden_size: 6100 is not supported"},
};

/* Set (or delete) the value at a dotted path. */
static void set_path(json_t *root, const char *path, const char *value) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", path);
  json_t *o = root;
  char *key = buf, *dot;
  while ((dot = strchr(key, '.'))) {
    *dot = 0;
    o = json_object_get(o, key);
    ck_assert_ptr_nonnull(o);
    key = dot + 1;
  }
  if (!value) {
    json_object_del(o, key);
    return;
  }
  json_error_t je;
  json_t *v = json_loads(value, JSON_DECODE_ANY, &je);
  ck_assert_msg(v != NULL, "bad test value %s", value);
  json_object_set_new(o, key, v);
}

START_TEST(validation_names_field) {
  const bad_case *b = &bad[_i];
  json_t *j = real_json();
  set_path(j, b->path, b->json);
  char *txt = json_dumps(j, 0);
  m3_config c;
  m3_err e = {0};
  m3_status s = m3_config_load_json_text(txt, "config.json", &c, &e);
  ck_assert_msg(s == b->code, "%s=%s: got %s (%s)", b->path, b->json ? b->json : "(deleted)",
                m3_status_name(s), e.msg);
  ck_assert_msg(strncmp(e.msg, "config.json: ", 13) == 0, "no file name: %s", e.msg);
  ck_assert_msg(strstr(e.msg, b->want) != NULL, "message '%s' lacks '%s'", e.msg, b->want);
  free(txt);
  json_decref(j);
}
END_TEST

START_TEST(layer_list_entry_and_disable_value) {
  json_t *j = real_json();
  json_t *moe = json_object_get(json_object_get(j, "text_config"), "moe_layer_freq");
  json_array_set_new(moe, 7, json_integer(2));
  char *txt = json_dumps(j, 0);
  m3_config c;
  m3_err e = {0};
  ck_assert_int_eq(m3_config_load_json_text(txt, "config.json", &c, &e), M3_CONFIG);
  ck_assert_msg(strstr(e.msg, "config.json: text_config.moe_layer_freq: entry 7: 2 (expected 0 or 1)"),
                "%s", e.msg);
  free(txt);
  json_decref(j);

  j = real_json();
  json_t *dv = json_object_get(json_object_get(json_object_get(j, "text_config"),
                                               "sparse_attention_config"), "sparse_disable_index_value");
  json_array_set_new(dv, 5, json_integer(0));
  txt = json_dumps(j, 0);
  ck_assert_int_eq(m3_config_load_json_text(txt, "config.json", &c, &e), M3_CONFIG);
  ck_assert_msg(strstr(e.msg, "text_config.sparse_attention_config.sparse_disable_index_value: entry 5"),
                "%s", e.msg);
  free(txt);
  json_decref(j);
}
END_TEST

START_TEST(not_json_and_missing_file) {
  m3_config c;
  m3_err e = {0};
  ck_assert_int_eq(m3_config_load_json_text("{\"model_type\": ", "config.json", &c, &e), M3_FORMAT);
  ck_assert_msg(strstr(e.msg, "config.json:1:") && strstr(e.msg, "invalid JSON"), "%s", e.msg);
  ck_assert_int_eq(m3_config_load_json_text("[1, 2]", "config.json", &c, &e), M3_FORMAT);
  ck_assert_msg(strstr(e.msg, "config.json: expected a JSON object"), "%s", e.msg);
  ck_assert_int_eq(m3_config_load_json_text("{\"a\":1,\"a\":2}", "config.json", &c, &e), M3_FORMAT);
  ck_assert_int_eq(m3_config_load_file("/nonexistent/m3/config.json", &c, &e), M3_NOTFOUND);
  ck_assert_msg(strstr(e.msg, "/nonexistent/m3/config.json"), "%s", e.msg);
}
END_TEST

START_TEST(swiglu_beta_given) {
  json_t *j = real_json();
  set_path(j, "text_config.swiglu_beta", "0.5");
  char *txt = json_dumps(j, 0);
  m3_config c, d;
  m3_err e = {0};
  ck_assert_int_eq(m3_config_load_json_text(txt, "config.json", &c, &e), M3_OK);
  ck_assert_double_eq(c.swiglu_beta, 0.5);
  ck_assert_int_eq(c.swiglu_beta_given, 1);
  char *out = m3_config_to_json(&c);
  ck_assert_ptr_nonnull(strstr(out, "\"swiglu_beta\": 0.5"));
  ck_assert_int_eq(m3_config_load_json_text(out, "roundtrip", &d, &e), M3_OK);
  ck_assert(memcmp(&c, &d, sizeof c) == 0);
  free(out);
  free(txt);
  json_decref(j);
}
END_TEST

START_TEST(rotary_from_partial_factor) {
  json_t *j = real_json();
  set_path(j, "text_config.rotary_dim", NULL);
  char *txt = json_dumps(j, 0);
  m3_config c;
  m3_err e = {0};
  ck_assert_msg(m3_config_load_json_text(txt, "config.json", &c, &e) == M3_OK, "%s", e.msg);
  ck_assert_int_eq(c.rotary_dim, 64);
  free(txt);
  set_path(j, "text_config.partial_rotary_factor", NULL);
  txt = json_dumps(j, 0);
  ck_assert_int_eq(m3_config_load_json_text(txt, "config.json", &c, &e), M3_CONFIG);
  ck_assert_msg(strstr(e.msg, "text_config.rotary_dim: required field missing"), "%s", e.msg);
  free(txt);
  json_decref(j);
}
END_TEST

START_TEST(presets) {
  const char *const *names = m3_config_preset_names();
  int have_real = 0, have_tiny = 0;
  for (size_t i = 0; names[i]; i++) {
    have_real |= strcmp(names[i], "minimax-m3") == 0;
    have_tiny |= strcmp(names[i], "tiny") == 0;
    m3_config c;
    m3_err e = {0};
    ck_assert_msg(m3_config_preset(names[i], &c, &e) == M3_OK, "%s: %s", names[i], e.msg);
  }
  ck_assert(have_real && have_tiny);

  m3_config c;
  m3_err e = {0};
  ck_assert_int_eq(m3_config_preset("minimax-m3", &c, &e), M3_OK);
  check_real_values(&c);

  ck_assert_int_eq(m3_config_preset("tiny", &c, &e), M3_OK);
  ck_assert_int_eq(c.hidden_size, 256);
  ck_assert_int_eq(c.num_hidden_layers, 60);
  ck_assert_int_eq(c.num_attention_heads, 8);
  ck_assert_int_eq(c.num_key_value_heads, 4);
  ck_assert_int_eq(c.head_dim, 128);
  ck_assert_int_eq(c.rotary_dim, 64);
  ck_assert_int_eq(c.sparse_index_dim, 128);
  ck_assert_int_eq(c.sparse_num_index_heads, 4);
  ck_assert_int_eq(c.vocab_size, 2048);
  ck_assert_int_eq(c.num_local_experts, 8);
  ck_assert_int_eq(c.num_experts_per_tok, 4);
  ck_assert_int_eq(c.intermediate_size, 64);
  ck_assert_int_eq(c.dense_intermediate_size, 256);
  ck_assert_int_eq(c.shared_intermediate_size, 64);
  ck_assert_int_eq(c.n_shared_experts, 1);
  ck_assert_int_eq(c.sparse_block_size, 16);
  ck_assert_int_eq(c.sparse_topk_blocks, 4);
  ck_assert_int_eq(c.max_position_embeddings, 65536);
  ck_assert_double_eq(c.rope_theta, 5e6);
  ck_assert_double_eq(c.rms_norm_eps, 1e-6);
  ck_assert_double_eq(c.routed_scaling_factor, 2.0);
  for (int l = 0; l < 60; l++) {
    ck_assert_int_eq(c.is_sparse[l], l >= 3);
    ck_assert_int_eq(c.is_moe[l], l >= 3);
  }
  ck_assert_int_eq(m3_config_qkv_width(&c, 3), (8 + 8 + 5) * 128);

  ck_assert_int_eq(m3_config_preset("huge", &c, &e), M3_NOTFOUND);
  ck_assert_msg(strstr(e.msg, "'huge'") && strstr(e.msg, "minimax-m3") && strstr(e.msg, "tiny"),
                "%s", e.msg);
}
END_TEST

/* load(to_json(c)) == c, field for field, for every preset in both forms;
 * and to_json is a fixed point after one round. */
START_TEST(to_json_round_trip) {
  const char *const *names = m3_config_preset_names();
  for (size_t i = 0; names[i]; i++) {
    for (int vl = 0; vl < 2; vl++) {
      m3_config a, b;
      m3_err e = {0};
      ck_assert_int_eq(m3_config_preset(names[i], &a, &e), M3_OK);
      a.is_vl = vl;
      if (!vl) a.image_token_index = a.video_token_index = -1;
      if (vl && i == 0) snprintf(a.quant_method, sizeof a.quant_method, "mxfp8");
      char *t1 = m3_config_to_json(&a);
      ck_assert_ptr_nonnull(t1);
      ck_assert_msg(m3_config_load_json_text(t1, "roundtrip", &b, &e) == M3_OK, "%s\n%s", e.msg, t1);
      ck_assert_msg(memcmp(&a, &b, sizeof a) == 0, "%s (vl=%d) does not round-trip", names[i], vl);
      char *t2 = m3_config_to_json(&b);
      ck_assert_str_eq(t1, t2);
      free(t1);
      free(t2);
    }
  }
  /* The VL form of the real config parses back to the same values. */
  m3_config a, b;
  m3_err e = {0};
  ck_assert_int_eq(m3_config_preset("minimax-m3", &a, &e), M3_OK);
  a.is_vl = 0;
  char *t = m3_config_to_json_vl(&a);
  ck_assert_int_eq(m3_config_load_json_text(t, "vl", &b, &e), M3_OK);
  ck_assert_int_eq(b.is_vl, 1);
  check_real_values(&b);
  free(t);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("config");
  TCase *tc = tcase_create("config");
  tcase_add_test(tc, real_config_wrapper);
  tcase_add_test(tc, real_config_bare);
  tcase_add_loop_test(tc, validation_names_field, 0, (int)(sizeof bad / sizeof *bad));
  tcase_add_test(tc, layer_list_entry_and_disable_value);
  tcase_add_test(tc, not_json_and_missing_file);
  tcase_add_test(tc, swiglu_beta_given);
  tcase_add_test(tc, rotary_from_partial_factor);
  tcase_add_test(tc, presets);
  tcase_add_test(tc, to_json_round_trip);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
