/* fuzz_variant.c - variant key text through m3_variant_parse (gen/variant.c).
 * Keys arrive from the command line, the tuning DB and cubin cache entries,
 * so the syntax parser sees text nobody checked.  variant.h promises
 *   parse(print(k)) == k byte for byte
 * which the harness asserts for every key the parser accepts: print must
 * return exactly the input, and re-parsing the printed key must give the same
 * struct.  The tile-only parser and the symbol derivation get the same text. */
#include "fuzz/fuzz.h"
#include "gen/variant.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = fuzz_strndup(data, size);
  m3_variant v;
  m3_err e = {0};
  m3_status s = m3_variant_parse(text, &v, &e);
  fuzz_note("variant", s, e.msg);
  if (s != M3_OK) {
    FUZZ_CHECK(s == M3_KEY && e.msg[0], "status %s", m3_status_name(s));
  } else {
    /* Bounded by the struct (24 + 24 fields of 31 + 47 characters): 8 KiB. */
    char buf[8192];
    size_t n = m3_variant_print(&v, buf, sizeof buf);
    FUZZ_CHECK(n < sizeof buf, "printed key of %zu bytes", n);
    /* Consumers hold keys in M3_KEY_MAX buffers: an accepted key must fit. */
    FUZZ_CHECK(n < M3_KEY_MAX, "accepted a key of %zu characters (M3_KEY_MAX %d)", n, M3_KEY_MAX);
    FUZZ_CHECK(n == strlen(buf) && !strcmp(buf, text), "print(parse(k)) != k:\n  in:  '%s'\n  out: '%s'", text, buf);
    m3_variant w;
    FUZZ_CHECK(m3_variant_parse(buf, &w, &e) == M3_OK, "printed key does not parse: %s", e.msg);
    FUZZ_CHECK(!memcmp(&v, &w, sizeof v), "parse(print(v)) != v for '%s'", buf);
    char axes[8192], tile[8192], sym[128];
    size_t na = m3_variant_print_axes(&v, axes, sizeof axes);
    size_t nt = m3_variant_print_tile(&v, tile, sizeof tile);
    FUZZ_CHECK(na < n + 1 && !strncmp(buf, axes, na), "axes part is a prefix");
    FUZZ_CHECK(v.n_tile == 0 || (nt > 0 && strstr(buf, tile)), "tile part inside the key");
    m3_variant_symbol(&v, sym, sizeof sym);
    FUZZ_CHECK(!strncmp(sym, "m3k_", 4), "symbol '%s'", sym);
    for (int i = 0; i < v.n_axes; i++) {
      FUZZ_CHECK(m3_variant_axis(&v, v.axes[i].name) == v.axes[i].value, "axis lookup");
      (void)m3_variant_axis_int(&v, v.axes[i].name, -1);
    }
    for (int i = 0; i < v.n_tile; i++) (void)m3_variant_tile_int(&v, v.tile[i].name, -1);
    /* Setters re-validate: re-setting every field to itself is a no-op. */
    m3_variant x = v;
    for (int i = 0; i < v.n_axes; i++)
      FUZZ_CHECK(m3_variant_set_axis(&x, v.axes[i].name, v.axes[i].value, &e) == M3_OK, "set_axis: %s", e.msg);
    for (int i = 0; i < v.n_tile; i++)
      FUZZ_CHECK(m3_variant_set_tile(&x, v.tile[i].name, v.tile[i].value, &e) == M3_OK, "set_tile: %s", e.msg);
    FUZZ_CHECK(!memcmp(&x, &v, sizeof v), "set to itself changed the key");
    if (v.n_tile) {
      m3_variant y = v;
      FUZZ_CHECK(m3_variant_parse_tile(&y, tile, &e) == M3_OK, "parse_tile('%s'): %s", tile, e.msg);
      FUZZ_CHECK(!memcmp(&y, &v, sizeof v), "parse_tile(print_tile) changed the key");
    }
  }
  /* The same text as a tile part. */
  m3_variant t;
  memset(&t, 0, sizeof t);
  if (m3_variant_parse_tile(&t, text, &e) == M3_OK) {
    char tile[8192];
    m3_variant_print_tile(&t, tile, sizeof tile);
    FUZZ_CHECK(!strcmp(tile, text), "tile print(parse(t)) != t: '%s' vs '%s'", text, tile);
  }
  free(text);
  return 0;
}
