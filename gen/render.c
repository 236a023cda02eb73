/* render.c - schema reading, key canonicalisation and the calls into a
 * template's functions (see render.h).  All Lua work happens under lua_pcall;
 * C buffers are filled only after the protected call returned. */
#include "gen/render.h"

#include "gen/code_hash.h"

#include <errno.h>
#include <lauxlib.h>
#include <lua.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void m3_dims_set(m3_dims *d, const char *name, long value) {
  for (int i = 0; i < d->n; i++)
    if (!strcmp(d->kv[i].name, name)) {
      d->kv[i].value = value;
      return;
    }
  if (d->n < 64) {
    d->kv[d->n].name = name;
    d->kv[d->n].value = value;
    d->n++;
  }
}

void m3_source_free(m3_source *s) {
  if (s) {
    free(s->text);
    s->text = NULL;
  }
}

/* Read a list of {name, values|"int"} declarations at the table on top. */
static m3_status read_decls(lua_State *L, const char *op, const char *field, m3_axis_decl *d, int *n,
                            m3_err *e) {
  *n = 0;
  lua_getfield(L, -1, field);
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    return M3_OK;
  }
  if (!lua_istable(L, -1)) {
    lua_pop(L, 1);
    return m3_errf(e, M3_TEMPLATE, "templates/%s.lua: '%s' must be a list", op, field);
  }
  int len = (int)luaL_len(L, -1);
  for (int i = 1; i <= len; i++) {
    if (*n >= M3_VAR_MAX_FIELDS) {
      lua_pop(L, 1);
      return m3_errf(e, M3_TEMPLATE, "templates/%s.lua: too many %s", op, field);
    }
    m3_axis_decl *a = &d[*n];
    memset(a, 0, sizeof *a);
    lua_geti(L, -1, i);
    lua_geti(L, -1, 1);
    lua_geti(L, -2, 2);
    const char *nm = lua_tostring(L, -2);
    if (!nm || strlen(nm) >= sizeof a->name) {
      lua_pop(L, 4);
      return m3_errf(e, M3_TEMPLATE, "templates/%s.lua: %s[%d] needs a name", op, field, i);
    }
    snprintf(a->name, sizeof a->name, "%s", nm);
    if (lua_type(L, -1) == LUA_TSTRING && !strcmp(lua_tostring(L, -1), "int")) {
      a->is_int = 1;
    } else if (lua_istable(L, -1)) {
      int nv = (int)luaL_len(L, -1);
      a->numeric = 1;
      for (int j = 1; j <= nv && j <= M3_MAX_VALUES; j++) {
        lua_geti(L, -1, j);
        if (lua_type(L, -1) != LUA_TNUMBER) a->numeric = 0;
        const char *sv = lua_tostring(L, -1);
        snprintf(a->values[a->n_values++], M3_VAR_VALUE, "%s", sv ? sv : "?");
        lua_pop(L, 1);
      }
    } else {
      lua_pop(L, 4);
      return m3_errf(e, M3_TEMPLATE, "templates/%s.lua: %s '%s' needs a value list or \"int\"", op,
                     field, a->name);
    }
    lua_pop(L, 3);
    (*n)++;
  }
  lua_pop(L, 1);
  return M3_OK;
}

m3_status m3_render_schema(m3_lua *H, const char *op, m3_schema *s, m3_err *e) {
  lua_State *L = m3_lua_state(H);
  memset(s, 0, sizeof *s);
  snprintf(s->op, sizeof s->op, "%s", op);
  M3_TRY(m3_lua_push_template(H, op, &s->hash, e));
  m3_status st = read_decls(L, op, "axes", s->axes, &s->n_axes, e);
  if (st == M3_OK) st = read_decls(L, op, "tiles", s->tiles, &s->n_tiles, e);
  lua_pop(L, 1);
  return st;
}

/* Normalise one value against its declaration. */
static m3_status canon_value(const char *keytext, const m3_axis_decl *a, const char *in, char *out,
                             m3_err *e) {
  if (a->is_int || a->numeric) {
    char *end;
    errno = 0;
    long x = strtol(in, &end, 10);
    if (*end || end == in)
      return m3_errf(e, M3_KEY, "key '%s': %s=%s is not an integer", keytext, a->name, in);
    if (errno == ERANGE || x > INT32_MAX || x < INT32_MIN) /* every integer axis is an int in C and in the kernels */
      return m3_errf(e, M3_KEY, "key '%s': %s=%s is out of range (a 32-bit integer)", keytext, a->name, in);
    snprintf(out, M3_VAR_VALUE, "%ld", x);
  } else {
    snprintf(out, M3_VAR_VALUE, "%s", in);
  }
  if (a->is_int) return M3_OK;
  for (int i = 0; i < a->n_values; i++)
    if (!strcmp(a->values[i], out)) return M3_OK;
  char allowed[512] = "";
  for (int i = 0; i < a->n_values; i++) {
    strncat(allowed, i ? "|" : "", sizeof allowed - strlen(allowed) - 1);
    strncat(allowed, a->values[i], sizeof allowed - strlen(allowed) - 1);
  }
  return m3_errf(e, M3_KEY, "key '%s': %s=%s is not one of %s", keytext, a->name, in, allowed);
}

static m3_status canon_fields(const char *keytext, const m3_axis_decl *d, int nd, m3_field *f, int *nf,
                              int require_all, const char *what, m3_err *e) {
  m3_field out[M3_VAR_MAX_FIELDS];
  int no = 0;
  for (int i = 0; i < *nf; i++) {
    int found = 0;
    for (int j = 0; j < nd; j++) found |= !strcmp(d[j].name, f[i].name);
    if (!found) return m3_errf(e, M3_KEY, "key '%s': unknown %s '%s'", keytext, what, f[i].name);
  }
  for (int j = 0; j < nd; j++) {
    const char *val = NULL;
    for (int i = 0; i < *nf; i++)
      if (!strcmp(d[j].name, f[i].name)) val = f[i].value;
    if (!val) {
      if (require_all) return m3_errf(e, M3_KEY, "key '%s': missing %s '%s'", keytext, what, d[j].name);
      continue;
    }
    snprintf(out[no].name, M3_VAR_NAME, "%s", d[j].name);
    M3_TRY(canon_value(keytext, &d[j], val, out[no].value, e));
    no++;
  }
  memcpy(f, out, sizeof(m3_field) * (size_t)no);
  *nf = no;
  return M3_OK;
}

m3_status m3_render_canon(m3_lua *H, m3_variant *v, m3_err *e) {
  m3_schema s;
  M3_TRY(m3_render_schema(H, v->op, &s, e));
  char text[M3_KEY_MAX];
  m3_variant_print(v, text, sizeof text);
  M3_TRY(canon_fields(text, s.axes, s.n_axes, v->axes, &v->n_axes, 1, "axis", e));
  if (v->n_tile) M3_TRY(canon_fields(text, s.tiles, s.n_tiles, v->tile, &v->n_tile, 1, "tile field", e));
  return M3_OK;
}

m3_status m3_render_parse_key(m3_lua *H, const char *text, m3_variant *v, m3_err *e) {
  M3_TRY(m3_variant_parse(text, v, e));
  return m3_render_canon(H, v, e);
}

static void push_fields(lua_State *L, const m3_axis_decl *d, int nd, const m3_field *f, int nf) {
  lua_createtable(L, 0, nf);
  for (int i = 0; i < nf; i++) {
    int numeric = 0;
    for (int j = 0; j < nd; j++)
      if (!strcmp(d[j].name, f[i].name)) numeric = d[j].is_int || d[j].numeric;
    if (numeric) lua_pushinteger(L, strtol(f[i].value, NULL, 10));
    else lua_pushstring(L, f[i].value);
    lua_setfield(L, -2, f[i].name);
  }
}

/* Push template function `fn`, then key and tile tables and the arch. */
static m3_status push_call(m3_lua *H, const m3_variant *v, m3_schema *s, const char *fn, m3_err *e) {
  lua_State *L = m3_lua_state(H);
  M3_TRY(m3_render_schema(H, v->op, s, e));
  M3_TRY(m3_lua_push_template(H, v->op, NULL, e));
  lua_getfield(L, -1, fn);
  lua_remove(L, -2);
  if (!lua_isfunction(L, -1)) {
    lua_pop(L, 1);
    return m3_errf(e, M3_TEMPLATE, "templates/%s.lua: missing function '%s'", v->op, fn);
  }
  push_fields(L, s->axes, s->n_axes, v->axes, v->n_axes);
  push_fields(L, s->tiles, s->n_tiles, v->tile, v->n_tile);
  lua_pushstring(L, v->arch[0] ? v->arch : "sm_90");
  return M3_OK;
}

/* Read a {field = value} table on top of the stack into v's tile part. */
static m3_status tile_from_table(lua_State *L, const m3_schema *s, m3_variant *v, m3_err *e) {
  v->n_tile = 0;
  for (int j = 0; j < s->n_tiles; j++) {
    lua_getfield(L, -1, s->tiles[j].name);
    const char *val = lua_tostring(L, -1);
    if (!val) {
      lua_pop(L, 1);
      return m3_errf(e, M3_TEMPLATE, "templates/%s.lua: default_tile lacks '%s'", s->op, s->tiles[j].name);
    }
    char buf[M3_VAR_VALUE];
    snprintf(buf, sizeof buf, "%s", val);
    lua_pop(L, 1);
    M3_TRY(m3_variant_set_tile(v, s->tiles[j].name, buf, e));
  }
  return M3_OK;
}

m3_status m3_render_default_tile(m3_lua *H, m3_variant *v, m3_err *e) {
  m3_schema s;
  lua_State *L = m3_lua_state(H);
  M3_TRY(push_call(H, v, &s, "default_tile", e));
  lua_remove(L, -2); /* default_tile(key, arch): drop the tile table */
  char what[128];
  snprintf(what, sizeof what, "%s.default_tile", v->op);
  M3_TRY(m3_lua_call(H, 2, 1, what, e));
  m3_status st = lua_istable(L, -1) ? tile_from_table(L, &s, v, e)
                                    : m3_errf(e, M3_TEMPLATE, "%s must return a table", what);
  lua_pop(L, 1);
  if (st == M3_OK) {
    char text[M3_KEY_MAX];
    m3_variant_print(v, text, sizeof text);
    st = canon_fields(text, s.tiles, s.n_tiles, v->tile, &v->n_tile, 1, "tile field", e);
  }
  return st;
}

m3_status m3_render_valid(m3_lua *H, const m3_variant *v, char *reason, size_t n, m3_err *e) {
  m3_schema s;
  lua_State *L = m3_lua_state(H);
  if (reason && n) reason[0] = 0;
  M3_TRY(push_call(H, v, &s, "valid", e));
  char what[128];
  snprintf(what, sizeof what, "%s.valid", v->op);
  M3_TRY(m3_lua_call(H, 3, 2, what, e));
  int ok = lua_toboolean(L, -2);
  const char *why = lua_tostring(L, -1);
  char buf[512];
  snprintf(buf, sizeof buf, "%s", why ? why : "rejected (no reason given)");
  lua_pop(L, 2);
  if (ok) return M3_OK;
  if (reason) snprintf(reason, n, "%s", buf);
  char key[M3_KEY_MAX];
  m3_variant_print(v, key, sizeof key);
  return m3_errf(e, M3_TILE, "%s: INVALID: %s", key, buf);
}

m3_status m3_render_tiles(m3_lua *H, const m3_variant *v, m3_variant **out, int *n, m3_err *e) {
  m3_schema s;
  M3_TRY(m3_render_schema(H, v->op, &s, e));
  long total = 1;
  for (int j = 0; j < s.n_tiles; j++) {
    if (s.tiles[j].is_int || s.tiles[j].n_values == 0)
      return m3_errf(e, M3_TEMPLATE, "templates/%s.lua: tile '%s' needs a candidate list", s.op, s.tiles[j].name);
    total *= s.tiles[j].n_values;
  }
  if (total > 100000) return m3_errf(e, M3_TEMPLATE, "templates/%s.lua: tile space too large (%ld)", s.op, total);
  m3_variant *r = calloc((size_t)total, sizeof *r);
  if (!r) return m3_errf(e, M3_NOMEM, "tile space");
  for (long c = 0; c < total; c++) {
    r[c] = *v;
    r[c].n_tile = 0;
    long rem = c;
    for (int j = s.n_tiles - 1; j >= 0; j--) {
      int nv = s.tiles[j].n_values;
      r[c].tile[j] = (m3_field){{0}, {0}};
      snprintf(r[c].tile[j].name, M3_VAR_NAME, "%s", s.tiles[j].name);
      snprintf(r[c].tile[j].value, M3_VAR_VALUE, "%s", s.tiles[j].values[rem % nv]);
      rem /= nv;
    }
    r[c].n_tile = s.n_tiles;
  }
  *out = r;
  *n = (int)total;
  return M3_OK;
}

m3_status m3_render_variants(m3_lua *H, const char *op, const m3_dims *dims, m3_variant **out, int *n,
                             m3_err *e) {
  lua_State *L = m3_lua_state(H);
  m3_schema s;
  *out = NULL;
  *n = 0;
  M3_TRY(m3_render_schema(H, op, &s, e));
  M3_TRY(m3_lua_push_template(H, op, NULL, e));
  lua_getfield(L, -1, "variants");
  lua_remove(L, -2);
  if (!lua_isfunction(L, -1)) {
    lua_pop(L, 1);
    return M3_OK; /* a template nothing in the model needs */
  }
  lua_createtable(L, 0, dims->n);
  for (int i = 0; i < dims->n; i++) {
    lua_pushinteger(L, dims->kv[i].value);
    lua_setfield(L, -2, dims->kv[i].name);
  }
  char what[128];
  snprintf(what, sizeof what, "%s.variants", op);
  M3_TRY(m3_lua_call(H, 1, 1, what, e));
  if (!lua_istable(L, -1)) {
    lua_pop(L, 1);
    return m3_errf(e, M3_TEMPLATE, "%s must return a list of keys", what);
  }
  int len = (int)luaL_len(L, -1);
  m3_variant *r = calloc((size_t)(len ? len : 1), sizeof *r);
  if (!r) {
    lua_pop(L, 1);
    return m3_errf(e, M3_NOMEM, "variants");
  }
  m3_status st = M3_OK;
  for (int i = 1; i <= len && st == M3_OK; i++) {
    lua_geti(L, -1, i);
    m3_variant *v = &r[i - 1];
    memset(v, 0, sizeof *v);
    snprintf(v->op, sizeof v->op, "%s", op);
    for (int j = 0; j < s.n_axes && st == M3_OK; j++) {
      lua_getfield(L, -1, s.axes[j].name);
      const char *val = lua_tostring(L, -1);
      char buf[M3_VAR_VALUE];
      snprintf(buf, sizeof buf, "%s", val ? val : "");
      lua_pop(L, 1);
      if (!val) st = m3_errf(e, M3_TEMPLATE, "%s: key %d lacks axis '%s'", what, i, s.axes[j].name);
      else st = m3_variant_set_axis(v, s.axes[j].name, buf, e);
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  for (int i = 0; i < len && st == M3_OK; i++) st = m3_render_canon(H, &r[i], e);
  if (st != M3_OK) {
    free(r);
    return st;
  }
  *out = r;
  *n = len;
  return M3_OK;
}

m3_status m3_render_source(m3_lua *H, const m3_variant *v, m3_source *out, m3_err *e) {
  lua_State *L = m3_lua_state(H);
  memset(out, 0, sizeof *out);
  if (!v->arch[0]) return m3_errf(e, M3_KEY, "render: key has no @sm_XX arch");
  char reason[512];
  M3_TRY(m3_render_valid(H, v, reason, sizeof reason, e));
  m3_schema s;
  char sym[96];
  m3_variant_symbol(v, sym, sizeof sym);
  M3_TRY(push_call(H, v, &s, "render", e));
  lua_pushstring(L, sym);
  char what[128];
  snprintf(what, sizeof what, "%s.render", v->op);
  M3_TRY(m3_lua_call(H, 4, 1, what, e));
  if (!lua_istable(L, -1)) {
    lua_pop(L, 1);
    return m3_errf(e, M3_TEMPLATE, "%s must return {source=, threads=, smem=}", what);
  }
  lua_getfield(L, -1, "source");
  lua_getfield(L, -2, "threads");
  lua_getfield(L, -3, "smem");
  size_t len = 0;
  const char *src = lua_tolstring(L, -3, &len);
  int threads = (int)lua_tointeger(L, -2);
  int smem = (int)lua_tointeger(L, -1);
  m3_status st = M3_OK;
  if (!src || threads <= 0 || threads > 1024 || smem < 0)
    st = m3_errf(e, M3_TEMPLATE, "%s returned no source or a bad threads/smem (%d/%d)", what, threads, smem);
  char key[M3_KEY_MAX];
  m3_variant_print(v, key, sizeof key);
  char head[2048];
  int hl = snprintf(head, sizeof head,
                    "// generated by m3kit from templates/%s.lua (template hash %016llx)\n"
                    "// key: %s\n// entry: %s  threads: %d  dynamic smem: %d\n",
                    v->op, (unsigned long long)s.hash, key, sym, threads, smem);
  if (st == M3_OK) {
    out->text = malloc((size_t)hl + len + 1);
    if (!out->text) st = m3_errf(e, M3_NOMEM, "source");
    else {
      memcpy(out->text, head, (size_t)hl);
      memcpy(out->text + hl, src, len + 1);
    }
  }
  lua_pop(L, 4);
  if (st != M3_OK) return st;
  snprintf(out->entry, sizeof out->entry, "%s", sym);
  out->threads = threads;
  out->smem = smem;
  out->template_hash = s.hash;
  snprintf(out->key, sizeof out->key, "%s", key);
  return M3_OK;
}

/* The header is comments only, so the code hash of the whole text is the
 * code hash of the template's output. */
uint64_t m3_source_code_hash(const m3_source *s) {
  return m3_code_hash(s->text, strlen(s->text), s->entry, s->threads, s->smem);
}

m3_status m3_render_code_hash(m3_lua *H, const m3_variant *v, uint64_t *out, m3_err *e) {
  m3_source src;
  M3_TRY(m3_render_source(H, v, &src, e));
  *out = m3_source_code_hash(&src);
  m3_source_free(&src);
  return M3_OK;
}
