/* variant.c - key syntax: parse, print, field access (see variant.h). */
#include "gen/variant.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static int name_ok(const char *s, size_t n) {
  if (n == 0 || n >= M3_VAR_NAME) return 0;
  if (!(islower((unsigned char)s[0]) || s[0] == '_')) return 0;
  for (size_t i = 1; i < n; i++)
    if (!(islower((unsigned char)s[i]) || isdigit((unsigned char)s[i]) || s[i] == '_')) return 0;
  return 1;
}

static int value_char(int c) {
  return isalnum(c) || c == '_' || c == '.' || c == '+' || c == '-';
}

/* Parse "name=value,name=value" up to the closing character `close`. */
static m3_status parse_fields(const char *text, const char **pp, char close, m3_field *f, int *nf,
                              const char *what, m3_err *e) {
  const char *p = *pp;
  *nf = 0;
  if (*p == close) {
    *pp = p + 1;
    return M3_OK;
  }
  for (;;) {
    const char *n0 = p;
    while (*p && *p != '=' && *p != ',' && *p != close) p++;
    if (*p != '=' || !name_ok(n0, (size_t)(p - n0)))
      return m3_errf(e, M3_KEY, "key '%s': bad %s field name at column %d", text, what,
                     (int)(n0 - text) + 1);
    size_t nl = (size_t)(p - n0);
    p++;
    const char *v0 = p;
    while (*p && value_char((unsigned char)*p)) p++;
    size_t vl = (size_t)(p - v0);
    if (vl == 0 || vl >= M3_VAR_VALUE)
      return m3_errf(e, M3_KEY, "key '%s': bad value for '%.*s' at column %d", text, (int)nl, n0,
                     (int)(v0 - text) + 1);
    if (*nf >= M3_VAR_MAX_FIELDS) return m3_errf(e, M3_KEY, "key '%s': too many %s fields", text, what);
    for (int i = 0; i < *nf; i++)
      if (strlen(f[i].name) == nl && !memcmp(f[i].name, n0, nl))
        return m3_errf(e, M3_KEY, "key '%s': duplicate %s field '%.*s'", text, what, (int)nl, n0);
    memcpy(f[*nf].name, n0, nl);
    f[*nf].name[nl] = 0;
    memcpy(f[*nf].value, v0, vl);
    f[*nf].value[vl] = 0;
    (*nf)++;
    if (*p == ',') {
      p++;
      continue;
    }
    if (*p == close) {
      *pp = p + 1;
      return M3_OK;
    }
    return m3_errf(e, M3_KEY, "key '%s': expected ',' or '%c' at column %d", text, close,
                   (int)(p - text) + 1);
  }
}

m3_status m3_variant_parse(const char *text, m3_variant *v, m3_err *e) {
  memset(v, 0, sizeof *v);
  /* Every consumer prints keys into M3_KEY_MAX buffers (render, the kernel
   * memo, the symbol hash) and would silently truncate a longer one, so two
   * keys differing only after that point would name one kernel.  The field
   * limits alone allow ~4 KB, hence this check.  Found while writing
   * fuzz/fuzz_variant.c; regression input fuzz/corpus/variant/regress-long-key. */
  size_t len = strnlen(text, M3_KEY_MAX);
  if (len >= M3_KEY_MAX)
    return m3_errf(e, M3_KEY, "key '%.60s...' is longer than %d characters", text, M3_KEY_MAX - 1);
  const char *p = text;
  while (*p && *p != '(') p++;
  if (*p != '(' || !name_ok(text, (size_t)(p - text)))
    return m3_errf(e, M3_KEY, "key '%s': expected 'op(' with a lower-case op name", text);
  memcpy(v->op, text, (size_t)(p - text));
  p++;
  M3_TRY(parse_fields(text, &p, ')', v->axes, &v->n_axes, "axis", e));
  if (*p == '[') {
    p++;
    M3_TRY(parse_fields(text, &p, ']', v->tile, &v->n_tile, "tile", e));
    /* An empty tile part "[]" would print back without its brackets
     * (n_tile == 0 means "no tile part"), breaking parse(print(k)) == k and
     * giving one kernel two spellings.  Found by fuzz/fuzz_variant.c;
     * regression input fuzz/corpus/variant/regress-empty-tile. */
    if (v->n_tile == 0)
      return m3_errf(e, M3_KEY, "key '%s': empty tile part '[]' at column %d (omit it for the default tile)", text,
                     (int)(p - text) - 1);
  }
  if (*p == '@') {
    p++;
    const char *a0 = p;
    while (*p && (isalnum((unsigned char)*p) || *p == '_')) p++;
    size_t al = (size_t)(p - a0);
    char a[sizeof v->arch];
    snprintf(a, sizeof a, "%.*s", (int)(al < sizeof a ? al : sizeof a - 1), a0);
    if (al >= sizeof v->arch || !m3_arch_valid(a))
      return m3_errf(e, M3_KEY, "key '%s': bad arch suffix at column %d (want @sm_XX, @sm_XXa or @sm_XXf)", text,
                     (int)(a0 - text) + 1);
    memcpy(v->arch, a0, al);
  }
  if (*p) return m3_errf(e, M3_KEY, "key '%s': trailing text at column %d", text, (int)(p - text) + 1);
  return M3_OK;
}

static size_t put_fields(char *buf, size_t n, size_t at, const m3_field *f, int nf) {
  for (int i = 0; i < nf; i++)
    at += (size_t)snprintf(buf + (at < n ? at : n), at < n ? n - at : 0, "%s%s=%s", i ? "," : "",
                           f[i].name, f[i].value);
  return at;
}

size_t m3_variant_print_axes(const m3_variant *v, char *buf, size_t n) {
  size_t at = (size_t)snprintf(buf, n, "%s(", v->op);
  at = put_fields(buf, n, at, v->axes, v->n_axes);
  at += (size_t)snprintf(buf + (at < n ? at : n), at < n ? n - at : 0, ")");
  return at;
}

size_t m3_variant_print_tile(const m3_variant *v, char *buf, size_t n) {
  if (n) buf[0] = 0;
  return put_fields(buf, n, 0, v->tile, v->n_tile);
}

size_t m3_variant_print(const m3_variant *v, char *buf, size_t n) {
  size_t at = m3_variant_print_axes(v, buf, n);
  if (v->n_tile) {
    at += (size_t)snprintf(buf + (at < n ? at : n), at < n ? n - at : 0, "[");
    at = put_fields(buf, n, at, v->tile, v->n_tile);
    at += (size_t)snprintf(buf + (at < n ? at : n), at < n ? n - at : 0, "]");
  }
  if (v->arch[0]) at += (size_t)snprintf(buf + (at < n ? at : n), at < n ? n - at : 0, "@%s", v->arch);
  return at;
}

static const char *find(const m3_field *f, int nf, const char *name) {
  for (int i = 0; i < nf; i++)
    if (!strcmp(f[i].name, name)) return f[i].value;
  return NULL;
}

const char *m3_variant_axis(const m3_variant *v, const char *name) { return find(v->axes, v->n_axes, name); }
const char *m3_variant_tilev(const m3_variant *v, const char *name) { return find(v->tile, v->n_tile, name); }

static long to_long(const char *s, long fallback) {
  if (!s) return fallback;
  char *end;
  long x = strtol(s, &end, 10);
  return *end ? fallback : x;
}
long m3_variant_axis_int(const m3_variant *v, const char *name, long fb) { return to_long(m3_variant_axis(v, name), fb); }
long m3_variant_tile_int(const m3_variant *v, const char *name, long fb) { return to_long(m3_variant_tilev(v, name), fb); }

static m3_status set(m3_field *f, int *nf, const char *name, const char *value, m3_err *e);

/* The same length bound as m3_variant_parse, for keys built field by field:
 * set on a copy, and keep it only if the printed key still fits. */
static m3_status set_bounded(m3_variant *v, int tile, const char *name, const char *value, m3_err *e) {
  m3_variant t = *v;
  M3_TRY(tile ? set(t.tile, &t.n_tile, name, value, e) : set(t.axes, &t.n_axes, name, value, e));
  char buf[M3_KEY_MAX];
  if (m3_variant_print(&t, buf, sizeof buf) >= sizeof buf)
    return m3_errf(e, M3_KEY, "setting %s=%s makes the key longer than %d characters", name, value, M3_KEY_MAX - 1);
  *v = t;
  return M3_OK;
}

static m3_status set(m3_field *f, int *nf, const char *name, const char *value, m3_err *e) {
  if (!name_ok(name, strlen(name)) || strlen(value) == 0 || strlen(value) >= M3_VAR_VALUE)
    return m3_errf(e, M3_KEY, "bad field %s=%s", name, value);
  for (const char *c = value; *c; c++)
    if (!value_char((unsigned char)*c)) return m3_errf(e, M3_KEY, "bad character in value %s=%s", name, value);
  for (int i = 0; i < *nf; i++)
    if (!strcmp(f[i].name, name)) {
      snprintf(f[i].value, M3_VAR_VALUE, "%s", value);
      return M3_OK;
    }
  if (*nf >= M3_VAR_MAX_FIELDS) return m3_errf(e, M3_KEY, "too many fields adding %s", name);
  snprintf(f[*nf].name, M3_VAR_NAME, "%s", name);
  snprintf(f[*nf].value, M3_VAR_VALUE, "%s", value);
  (*nf)++;
  return M3_OK;
}

m3_status m3_variant_set_axis(m3_variant *v, const char *name, const char *value, m3_err *e) {
  return set_bounded(v, 0, name, value, e);
}
m3_status m3_variant_set_tile(m3_variant *v, const char *name, const char *value, m3_err *e) {
  return set_bounded(v, 1, name, value, e);
}

m3_status m3_variant_parse_tile(m3_variant *v, const char *tile_text, m3_err *e) {
  char buf[M3_KEY_MAX];
  int n = snprintf(buf, sizeof buf, "t(%s)", tile_text);
  if (n < 0 || (size_t)n >= sizeof buf) return m3_errf(e, M3_KEY, "tile text too long");
  m3_variant t;
  M3_TRY(m3_variant_parse(buf, &t, e));
  m3_variant r = *v; /* keep v unchanged unless the whole key still fits */
  r.n_tile = t.n_axes;
  memcpy(r.tile, t.axes, sizeof t.axes);
  if (m3_variant_print(&r, buf, sizeof buf) >= sizeof buf)
    return m3_errf(e, M3_KEY, "tile '%.60s' makes the key longer than %d characters", tile_text, M3_KEY_MAX - 1);
  *v = r;
  return M3_OK;
}

void m3_variant_symbol(const m3_variant *v, char *buf, size_t n) {
  char k[M3_KEY_MAX];
  m3_variant tmp = *v;
  tmp.arch[0] = 0; /* the symbol names the function, not the target */
  m3_variant_print(&tmp, k, sizeof k);
  snprintf(buf, n, "m3k_%s_%016llx", v->op, (unsigned long long)XXH3_64bits(k, strlen(k)));
}

int m3_arch_valid(const char *a) {
  if (!a || strncmp(a, "sm_", 3)) return 0;
  const char *p = a + 3;
  int n = 0, digits = 0;
  while (*p >= '0' && *p <= '9') n = n * 10 + (*p++ - '0'), digits++;
  if (*p == 'a' || *p == 'f') p++;
  (void)n; /* which archs a template supports is its valid()'s call */
  return *p == 0 && digits >= 2 && digits <= 3;
}
