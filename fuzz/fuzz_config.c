/* fuzz_config.c - config.json text through m3_config_load_json_text
 * (runtime/config.c).  On success the config is one the runtime promises it
 * can run, so the harness also checks what config.h promises about it:
 *   - load(to_json(c)) reproduces c byte for byte (memcmp, as the tests do),
 *     and so does the VL-wrapper form except for the form flag itself;
 *   - the derived sizes are computable for every layer without overflow
 *     (UBSan watches the int arithmetic). */
#include "fuzz/fuzz.h"
#include "runtime/config.h"

static void reload_same(const m3_config *c, const char *text, int vl_form) {
  m3_config d;
  m3_err e;
  m3_status s = m3_config_load_json_text(text, "round-trip", &d, &e);
  FUZZ_CHECK(s == M3_OK, "reload of to_json%s failed: %s\n%s", vl_form ? "_vl" : "", e.msg, text);
  if (vl_form) { /* the wrapper form may add what the bare form lacked */
    m3_config c2 = *c;
    c2.is_vl = 1;
    d.image_token_index = c2.image_token_index;
    d.video_token_index = c2.video_token_index;
    FUZZ_CHECK(memcmp(&c2, &d, sizeof d) == 0, "to_json_vl round trip differs\n%s", text);
  } else {
    FUZZ_CHECK(memcmp(c, &d, sizeof d) == 0, "to_json round trip differs\n%s", text);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = fuzz_strndup(data, size);
  m3_config c;
  m3_err e = {0};
  m3_status s = m3_config_load_json_text(text, "config.json", &c, &e);
  fuzz_note("config", s, e.msg);
  free(text);
  if (s != M3_OK) {
    FUZZ_CHECK(e.msg[0] != 0, "%s without a message", m3_status_name(s));
    FUZZ_CHECK(s == M3_FORMAT || s == M3_CONFIG, "unexpected status %s: %s", m3_status_name(s), e.msg);
    return 0;
  }
  FUZZ_CHECK(c.num_hidden_layers >= 1 && c.num_hidden_layers <= M3_MAX_LAYERS, "layers %d", c.num_hidden_layers);
  volatile uint64_t sink = 0;
  for (int l = 0; l < c.num_hidden_layers; l++) {
    FUZZ_CHECK(c.is_sparse[l] <= 1 && c.is_moe[l] <= 1, "layer %d kinds", l);
    sink += (uint64_t)m3_config_qkv_width(&c, l) + (uint64_t)m3_config_ffn_width(&c, l) +
            m3_config_kv_bytes_per_token(&c, l, 2, 2);
  }
  uint64_t tot, act;
  m3_config_n_params(&c, &tot, &act);
  sink += tot + act + (uint64_t)m3_config_q_width(&c) + (uint64_t)m3_config_kv_width(&c) +
          (uint64_t)m3_config_shared_width(&c) + m3_config_kv_bytes_per_token_model(&c, 1, 1) +
          (uint64_t)m3_config_n_sparse_layers(&c) + (uint64_t)m3_config_n_moe_layers(&c);
  (void)sink;
  char *j = m3_config_to_json(&c);
  FUZZ_CHECK(j != NULL, "to_json");
  reload_same(&c, j, 0);
  free(j);
  j = m3_config_to_json_vl(&c);
  FUZZ_CHECK(j != NULL, "to_json_vl");
  reload_same(&c, j, 1);
  free(j);
  return 0;
}
