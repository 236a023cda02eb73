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

/* Limits of one state: its memory, and the VM instructions of one
 * m3_lua_call, in ticks of M3_LUA_TICK (below): 128 Mi instructions, about a
 * second.  Measured (session 29): no call of gen --all for minimax-m3 or of
 * --tiles over a 53,760-tile GEMV key ran past 2 ticks or held over 0.6 MB. */
#define M3_LUA_MEM_MAX (256L << 20)
#define M3_LUA_BUDGET_TICKS 2048L

struct m3_lua {
  lua_State *L;
  m3_err *cur_err;   /* for the m3.include loader */
  size_t mem, mem_max; /* bytes the state holds, and its cap */
  long ticks;          /* count-hook ticks left to the current m3_lua_call */
};

/* The state's allocator: lua_Alloc over realloc, refusing to grow past
 * mem_max, which Lua raises as "not enough memory" inside the protected call
 * (a template that allocates without end fails instead of taking the host's
 * memory). */
static void *alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  m3_lua *H = ud;
  const size_t old = ptr ? osize : 0;
  if (nsize == 0) {
    free(ptr);
    H->mem -= old;
    return NULL;
  }
  if (nsize > old && H->mem - old + nsize > H->mem_max) return NULL;
  void *p = realloc(ptr, nsize);
  if (p) H->mem = H->mem - old + nsize;
  return p;
}

/* Every M3_LUA_TICK VM instructions: a call that runs past its budget is an
 * error (an endless loop in a template fails gen instead of hanging it). */
#define M3_LUA_TICK (1 << 16)
static void count_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  m3_lua *H = *(m3_lua **)lua_getextraspace(L);
  if (--H->ticks < 0) { /* and at every tick after, until the call returns (m3_lua_call resets it) */
    luaL_where(L, 0);     /* the loop's line, not its caller's */
    lua_pushfstring(L, "ran more than %d million Lua instructions (an endless loop?)",
                    (int)((long)M3_LUA_BUDGET_TICKS * M3_LUA_TICK / 1000000));
    lua_concat(L, 2);
    lua_error(L);
  }
}

static int panic(lua_State *L) {
  const char *msg = lua_tostring(L, -1);
  fprintf(stderr, "m3kit: unprotected Lua error: %s\n", msg ? msg : "(not a string)");
  return 0; /* Lua aborts: every call into the state is protected, so this is a bug */
}

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
  H->ticks = M3_LUA_BUDGET_TICKS;
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

/* Load a file as a text chunk named after the path it was read from
 * (templates/x.lua, or $M3KIT_TEMPLATE_DIR/x.lua); pushes the chunk.  Its
 * _ENV is a table of its own that reads through to the globals and refuses
 * new ones, so that a template cannot change what the next one sees. */
static m3_status load_chunk(m3_lua *H, const char *file, m3_err *e) {
  const char *text;
  size_t len;
  char *owned;
  M3_TRY(m3_lua_source(file, &text, &len, &owned, e));
  char chunk[4200];
  const char *dir = getenv("M3KIT_TEMPLATE_DIR");
  snprintf(chunk, sizeof chunk, "@%s/%s", dir && *dir ? dir : "templates", file);
  int rc = luaL_loadbufferx(H->L, text, len, chunk, "t");
  free(owned);
  if (rc != LUA_OK) {
    m3_errf(e, M3_TEMPLATE, "%s", lua_tostring(H->L, -1));
    lua_pop(H->L, 1);
    return M3_TEMPLATE;
  }
  lua_newtable(H->L);
  lua_getfield(H->L, LUA_REGISTRYINDEX, "m3.envmeta");
  lua_setmetatable(H->L, -2);
  if (!lua_setupvalue(H->L, -2, 1)) lua_pop(H->L, 1); /* a chunk's first upvalue is _ENV */
  return M3_OK;
}

static int ro_newindex(lua_State *L) {
  const char *k = lua_tostring(L, 2);
  return luaL_error(L, "assignment to global or library field '%s': templates are pure (use a local)",
                    k ? k : "?");
}

/* Pushes a read-only view of the table at idx (reads go through __index;
 * writes, and getmetatable, are refused). */
static void push_ro_view(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  lua_newtable(L);
  lua_createtable(L, 0, 3);
  lua_pushvalue(L, idx);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, ro_newindex);
  lua_setfield(L, -2, "__newindex");
  lua_pushboolean(L, 0);
  lua_setfield(L, -2, "__metatable");
  lua_setmetatable(L, -2);
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
  H->mem_max = (size_t)M3_LUA_MEM_MAX;
  lua_State *L = lua_newstate(alloc, H);
  if (!L) {
    free(H);
    return m3_errf(e, M3_NOMEM, "lua_newstate failed");
  }
  lua_atpanic(L, panic);
  H->L = L;
  *(m3_lua **)lua_getextraspace(L) = H;
  H->ticks = M3_LUA_BUDGET_TICKS;
  lua_sethook(L, count_hook, LUA_MASKCOUNT, M3_LUA_TICK);
  luaL_requiref(L, LUA_GNAME, luaopen_base, 1);
  luaL_requiref(L, LUA_STRLIBNAME, luaopen_string, 1);
  luaL_requiref(L, LUA_TABLIBNAME, luaopen_table, 1);
  luaL_requiref(L, LUA_MATHLIBNAME, luaopen_math, 1);
  lua_pop(L, 4);
  /* No file access, no code but the template files' text (load could run a
   * binary chunk, which Lua does not verify), no writes around the read-only
   * views below. */
  /* pcall, xpcall and setmetatable (__gc finalizers) could catch or outlive
   * the instruction budget's error. */
  static const char *const removed[] = {"dofile",  "loadfile", "load",        "rawset",
                                        "pcall",   "xpcall",   "setmetatable", "collectgarbage"};
  for (size_t i = 0; i < sizeof removed / sizeof *removed; i++) {
    lua_pushnil(L);
    lua_setglobal(L, removed[i]);
  }
  lua_getglobal(L, LUA_STRLIBNAME);
  lua_pushnil(L);
  lua_setfield(L, -2, "dump");
  lua_pop(L, 1);
  luaL_newlib(L, m3lib);
  lua_setglobal(L, "m3");
  /* The libraries as read-only views; the string metatable (whose __index is
   * the real string table) hidden from getmetatable. */
  static const char *const libs[] = {LUA_STRLIBNAME, LUA_TABLIBNAME, LUA_MATHLIBNAME, "m3"};
  for (size_t i = 0; i < sizeof libs / sizeof *libs; i++) {
    lua_getglobal(L, libs[i]);
    push_ro_view(L, -1);
    lua_setglobal(L, libs[i]);
    lua_pop(L, 1);
  }
  lua_pushglobaltable(L);
  push_ro_view(L, -1);
  lua_setglobal(L, "_G");
  lua_pop(L, 1);
  lua_pushliteral(L, "");
  lua_getmetatable(L, -1);
  lua_pushboolean(L, 0);
  lua_setfield(L, -2, "__metatable");
  lua_pop(L, 2);
  /* Every chunk's _ENV: reads the globals, refuses new ones (load_chunk). */
  lua_createtable(L, 0, 3);
  lua_pushglobaltable(L);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, ro_newindex);
  lua_setfield(L, -2, "__newindex");
  lua_pushboolean(L, 0);
  lua_setfield(L, -2, "__metatable");
  lua_setfield(L, LUA_REGISTRYINDEX, "m3.envmeta");
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
