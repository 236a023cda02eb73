/* lua_host.c - the sandboxed Lua state, template loading and the `m3` helper
 * module exposed to templates (see lua_host.h). */
#include "gen/lua_host.h"

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "cache/store.h"
#include "runtime/embedded.h"

#include "gen/templates.inc" /* m3_templates[] */

struct m3_lua {
  lua_State *L;
  m3_err *cur_err; /* for the m3.include loader */
};

lua_State *m3_lua_state(m3_lua *L) { return L->L; }

const char *const *m3_lua_template_names(void) {
  static const char *names[64];
  static int done;
  if (!done) {
    int n = 0;
    for (const m3_embedded *t = m3_templates; t->name && n < 63; t++) {
      if (!strncmp(t->name, "lib/", 4)) continue;
      static char buf[64][64];
      snprintf(buf[n], sizeof buf[n], "%s", t->name);
      char *dot = strstr(buf[n], ".lua");
      if (dot) *dot = 0;
      names[n] = buf[n];
      n++;
    }
    names[n] = NULL;
    done = 1;
  }
  return names;
}

m3_status m3_lua_source(const char *file, const char **text, size_t *len, char **owned, m3_err *e) {
  *owned = NULL;
  const char *dir = getenv("M3KIT_TEMPLATE_DIR");
  if (dir && *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    uint8_t *data;
    size_t n;
    m3_status s = m3_read_file(path, &data, &n, e);
    if (s != M3_OK) return m3_err_prefix(e, "M3KIT_TEMPLATE_DIR: ");
    *owned = (char *)data;
    *text = *owned;
    *len = n;
    return M3_OK;
  }
  for (const m3_embedded *t = m3_templates; t->name; t++)
    if (!strcmp(t->name, file)) {
      *text = t->text;
      *len = t->len;
      return M3_OK;
    }
  return m3_errf(e, M3_NOTFOUND, "template '%s' is not embedded in this build (set M3KIT_TEMPLATE_DIR to read templates from disk)", file);
}

static int msghandler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (!msg) msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  luaL_traceback(L, L, msg, 1);
  return 1;
}

m3_status m3_lua_call(m3_lua *H, int nargs, int nresults, const char *what, m3_err *e) {
  lua_State *L = H->L;
  int base = lua_gettop(L) - nargs;
  lua_pushcfunction(L, msghandler);
  lua_insert(L, base);
  int rc = lua_pcall(L, nargs, nresults, base);
  lua_remove(L, base);
  if (rc != LUA_OK) {
    m3_errf(e, M3_TEMPLATE, "%s: %s", what, lua_tostring(L, -1));
    lua_pop(L, 1);
    return M3_TEMPLATE;
  }
  return M3_OK;
}

/* Load a file as a text chunk named after its path; pushes the chunk. */
static m3_status load_chunk(m3_lua *H, const char *file, m3_err *e) {
  const char *text;
  size_t len;
  char *owned;
  M3_TRY(m3_lua_source(file, &text, &len, &owned, e));
  char chunk[300];
  snprintf(chunk, sizeof chunk, "@templates/%s", file);
  int rc = luaL_loadbufferx(H->L, text, len, chunk, "t");
  free(owned);
  if (rc != LUA_OK) {
    m3_errf(e, M3_TEMPLATE, "%s", lua_tostring(H->L, -1));
    lua_pop(H->L, 1);
    return M3_TEMPLATE;
  }
  return M3_OK;
}

/* m3.include("lib/prelude") -> the value that lib file returns (memoised). */
static int l_include(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  if (strncmp(name, "lib/", 4) || strstr(name, ".."))
    return luaL_argerror(L, 1, "only lib/<name> modules can be included");
  lua_getfield(L, LUA_REGISTRYINDEX, "m3.libs");
  lua_getfield(L, -1, name);
  if (!lua_isnil(L, -1)) return 1;
  lua_pop(L, 1);
  char file[128];
  snprintf(file, sizeof file, "%s.lua", name);
  m3_lua *H = *(m3_lua **)lua_getextraspace(L);
  m3_err e;
  if (load_chunk(H, file, &e) != M3_OK) return luaL_error(L, "%s", e.msg);
  lua_call(L, 0, 1);
  lua_pushvalue(L, -1);
  lua_setfield(L, -3, name);
  return 1;
}

/* m3.dtype(name) -> { name=, bytes=, ctype= }: the storage facts of a dtype,
 * checked so that a typo in a template reads as a bad-argument error. */
static int l_dtype(lua_State *L) {
  static const char *const names[] = {"bf16", "e4m3", "f32", "i32", "i64", "u8", NULL};
  static const int bytes[] = {2, 1, 4, 4, 8, 1};
  static const char *const ctype[] = {"unsigned short", "unsigned char", "float", "int", "long long",
                                      "unsigned char"};
  int i = luaL_checkoption(L, 1, NULL, names);
  lua_createtable(L, 0, 3);
  lua_pushstring(L, names[i]);
  lua_setfield(L, -2, "name");
  lua_pushinteger(L, bytes[i]);
  lua_setfield(L, -2, "bytes");
  lua_pushstring(L, ctype[i]);
  lua_setfield(L, -2, "ctype");
  return 1;
}

/* m3.sm(arch) -> integer SM number (sm_90a -> 90) for capability checks. */
static int l_sm(lua_State *L) {
  const char *a = luaL_checkstring(L, 1);
  int v = 0;
  if (sscanf(a, "sm_%d", &v) != 1) return luaL_argerror(L, 1, "expected sm_XX");
  lua_pushinteger(L, v);
  return 1;
}

static const luaL_Reg m3lib[] = {
    {"include", l_include}, {"dtype", l_dtype}, {"sm", l_sm}, {NULL, NULL}};

m3_status m3_lua_open(m3_lua **out, m3_err *e) {
  m3_lua *H = calloc(1, sizeof *H);
  if (!H) return m3_errf(e, M3_NOMEM, "lua host");
  lua_State *L = luaL_newstate();
  if (!L) {
    free(H);
    return m3_errf(e, M3_NOMEM, "luaL_newstate failed");
  }
  H->L = L;
  *(m3_lua **)lua_getextraspace(L) = H;
  luaL_requiref(L, LUA_GNAME, luaopen_base, 1);
  luaL_requiref(L, LUA_STRLIBNAME, luaopen_string, 1);
  luaL_requiref(L, LUA_TABLIBNAME, luaopen_table, 1);
  luaL_requiref(L, LUA_MATHLIBNAME, luaopen_math, 1);
  lua_pop(L, 4);
  /* No file access from templates. */
  lua_pushnil(L);
  lua_setglobal(L, "dofile");
  lua_pushnil(L);
  lua_setglobal(L, "loadfile");
  luaL_newlib(L, m3lib);
  lua_setglobal(L, "m3");
  lua_newtable(L);
  lua_setfield(L, LUA_REGISTRYINDEX, "m3.libs");
  lua_newtable(L);
  lua_setfield(L, LUA_REGISTRYINDEX, "m3.templates");
  *out = H;
  return M3_OK;
}

void m3_lua_close(m3_lua *H) {
  if (!H) return;
  lua_close(H->L);
  free(H);
}

/* Template hash: the template's text plus the text of every lib/ file it
 * includes, transitively, so that a change to a shared block stales the
 * tuning records of exactly the templates that emit it (a record tuned for
 * attention stays valid when lib/indexer.lua changes).  Includes are found by
 * scanning for m3.include("lib/...") literals, the form every template and
 * lib uses (a computed name would escape the hash: don't). */
#define M3_MAX_DEPS 16
static void scan_includes(const char *text, size_t len, char deps[][64], int *n) {
  static const char pat[] = "m3.include(\"";
  for (const char *p = text; (p = memmem(p, len - (size_t)(p - text), pat, sizeof pat - 1)); ) {
    p += sizeof pat - 1;
    const char *q = memchr(p, '"', len - (size_t)(p - text));
    if (!q || q - p >= 60) continue;
    char name[64];
    snprintf(name, sizeof name, "%.*s.lua", (int)(q - p), p);
    int seen = 0;
    for (int i = 0; i < *n; i++) seen |= !strcmp(deps[i], name);
    if (seen || *n >= M3_MAX_DEPS) continue;
    snprintf(deps[(*n)++], 64, "%s", name);
    const char *t;
    size_t l;
    char *owned;
    m3_err e;
    if (m3_lua_source(name, &t, &l, &owned, &e) == M3_OK) {
      scan_includes(t, l, deps, n);
      free(owned);
    }
  }
}

static int cmp_name(const void *a, const void *b) { return strcmp(a, b); }

static uint64_t template_hash(const char *file) {
  XXH64_state_t *st = XXH64_createState();
  XXH64_reset(st, 0x6d336b6974ULL);
  const char *text;
  size_t len;
  char *owned;
  m3_err e;
  char deps[M3_MAX_DEPS][64];
  int n = 0;
  if (m3_lua_source(file, &text, &len, &owned, &e) == M3_OK) {
    XXH64_update(st, text, len);
    scan_includes(text, len, deps, &n);
    free(owned);
  }
  qsort(deps, (size_t)n, sizeof deps[0], cmp_name);
  for (int i = 0; i < n; i++)
    if (m3_lua_source(deps[i], &text, &len, &owned, &e) == M3_OK) {
      XXH64_update(st, deps[i], strlen(deps[i]));
      XXH64_update(st, text, len);
      free(owned);
    }
  uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

m3_status m3_lua_push_template(m3_lua *H, const char *name, uint64_t *hash, m3_err *e) {
  lua_State *L = H->L;
  for (const char *c = name; *c; c++)
    if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_'))
      return m3_errf(e, M3_NOTFOUND, "bad template name '%s'", name);
  char file[128];
  snprintf(file, sizeof file, "%s.lua", name);
  lua_getfield(L, LUA_REGISTRYINDEX, "m3.templates");
  lua_getfield(L, -1, name);
  if (lua_istable(L, -1)) {
    lua_getfield(L, -1, "__hash");
    if (hash) *hash = (uint64_t)lua_tointeger(L, -1);
    lua_pop(L, 1);
    lua_remove(L, -2);
    return M3_OK;
  }
  lua_pop(L, 1);
  m3_status s = load_chunk(H, file, e);
  if (s != M3_OK) {
    lua_pop(L, 1);
    return s;
  }
  s = m3_lua_call(H, 0, 1, file, e);
  if (s != M3_OK) {
    lua_pop(L, 1);
    return s;
  }
  if (!lua_istable(L, -1)) {
    lua_pop(L, 2);
    return m3_errf(e, M3_TEMPLATE, "templates/%s: must return a table", file);
  }
  uint64_t h = template_hash(file);
  lua_pushinteger(L, (lua_Integer)h);
  lua_setfield(L, -2, "__hash");
  lua_pushvalue(L, -1);
  lua_setfield(L, -3, name);
  lua_remove(L, -2);
  if (hash) *hash = h;
  return M3_OK;
}
