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
  }
  if (*p == '@') {
    p++;
    const char *a0 = p;
    while (*p && (isalnum((unsigned char)*p) || *p == '_')) p++;
    size_t al = (size_t)(p - a0);
    if (al < 4 || al >= sizeof v->arch || strncmp(a0, "sm_", 3))
      return m3_errf(e, M3_KEY, "key '%s': bad arch suffix at column %d (want @sm_XX)", text,
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
  return set(v->axes, &v->n_axes, name, value, e);
}
m3_status m3_variant_set_tile(m3_variant *v, const char *name, const char *value, m3_err *e) {
  return set(v->tile, &v->n_tile, name, value, e);
}

m3_status m3_variant_parse_tile(m3_variant *v, const char *tile_text, m3_err *e) {
  char buf[M3_KEY_MAX];
  int n = snprintf(buf, sizeof buf, "t(%s)", tile_text);
  if (n < 0 || (size_t)n >= sizeof buf) return m3_errf(e, M3_KEY, "tile text too long");
  m3_variant t;
  M3_TRY(m3_variant_parse(buf, &t, e));
  v->n_tile = t.n_axes;
  memcpy(v->tile, t.axes, sizeof t.axes);
  return M3_OK;
}

void m3_variant_symbol(const m3_variant *v, char *buf, size_t n) {
  char k[M3_KEY_MAX];
  m3_variant tmp = *v;
  tmp.arch[0] = 0; /* the symbol names the function, not the target */
  m3_variant_print(&tmp, k, sizeof k);
  snprintf(buf, n, "m3k_%s_%016llx", v->op, (unsigned long long)XXH3_64bits(k, strlen(k)));
}
