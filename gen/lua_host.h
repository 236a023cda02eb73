/* lua_host.h - one sandboxed Lua 5.4 state per render session.
 *
 * Templates are pure functions of their key: the state opens only the base,
 * string, table and math libraries (no io, os, package, debug; dofile,
 * loadfile, load, string.dump, rawset, pcall, xpcall, setmetatable and
 * collectgarbage removed, so no bytecode, which Lua does not verify, can run
 * and no error can be caught), loads chunks as text only
 * with the path read as chunk name so every error reads "templates/x.lua:41:
 * ..." (or $M3KIT_TEMPLATE_DIR/x.lua), and runs every call through lua_pcall
 * with a traceback handler.  Lua errors never unwind through C frames that own
 * memory: all C work happens before or after the protected call.
 *
 * Limits: a call that runs past 128 Mi VM instructions (about a second; the
 * largest real call runs under 0.2 Mi) fails as an endless loop, and the state
 * cannot grow past 256 MiB ("not enough memory").  Time spent inside one C
 * function is not counted: a pathological string pattern (string.find with
 * many ".-") can still run for minutes; templates use none.  Isolation: each chunk has
 * an _ENV of its own that refuses new globals, and the libraries (string,
 * table, math, m3, _G) are read-only views, the string metatable hidden, so
 * one template cannot change what the next sees.  The tables lib/ modules
 * return (m3.include, memoised per state) are shared: templates must not
 * write to them.
 *
 * Template text comes from the copy embedded at build time (gen/templates.inc),
 * or from $M3KIT_TEMPLATE_DIR when set (fast iteration without rebuilding).
 */
#ifndef M3_LUA_HOST_H
#define M3_LUA_HOST_H

#include <stdint.h>

#include "runtime/status.h"

typedef struct lua_State lua_State;
typedef struct m3_lua m3_lua;

m3_status m3_lua_open(m3_lua **out, m3_err *e);
void m3_lua_close(m3_lua *L);
lua_State *m3_lua_state(m3_lua *L);

/* Text of a template file ("qknorm_rope.lua", "lib/prelude.lua").  Errors:
 * M3_NOTFOUND naming the file and where it was looked for. */
m3_status m3_lua_source(const char *file, const char **text, size_t *len, char **owned, m3_err *e);

/* Names of the embedded top-level templates (without ".lua"), NULL-terminated. */
const char *const *m3_lua_template_names(void);

/* Push the table a template returns (loaded once per state, then memoised in
 * the registry).  *hash receives the template hash (template text plus the
 * lib/ files it includes, transitively; XXH64).  Errors: M3_NOTFOUND, M3_TEMPLATE with file:line. */
m3_status m3_lua_push_template(m3_lua *L, const char *name, uint64_t *hash, m3_err *e);

/* lua_pcall with the traceback handler; on failure pops the error, records it
 * as M3_TEMPLATE (prefixed by `what`) and returns that. */
m3_status m3_lua_call(m3_lua *L, int nargs, int nresults, const char *what, m3_err *e);

#endif
