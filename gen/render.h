/* render.h - from a variant key to self-contained CUDA source, through the
 * template's declared configuration space.
 *
 * A template (templates/<op>.lua) returns a table:
 *   axes      = { {"attn", {"dense","sparse"}}, {"nq", "int"}, ... }  semantic axes, in key order
 *   tiles     = { {"warps", {1,2,4,8}}, ... }                          tile axes and candidates
 *   valid(key, tile, arch)   -> true | false, "reason"                 (checked before NVRTC)
 *   default_tile(key, arch)  -> { warps = 4, ... }
 *   variants(cfg)            -> { key, key, ... }  keys a model config needs
 *   render(key, tile, arch, sym) -> { source = "...", threads = n, smem = bytes }
 * `key` and `tile` reach Lua as tables of their fields (numbers for integer
 * axes and numeric candidates, strings otherwise).  Everything the tuner, the
 * tests and `m3kit gen --list` enumerate comes from these tables alone.
 */
#ifndef M3_RENDER_H
#define M3_RENDER_H

#include <stdint.h>

#include "gen/lua_host.h"
#include "gen/variant.h"

#define M3_MAX_VALUES 16

typedef struct m3_axis_decl {
  char name[M3_VAR_NAME];
  int is_int;                      /* free integer axis ("int") */
  int numeric;                     /* enumerated numbers (passed to Lua as integers) */
  int n_values;
  char values[M3_MAX_VALUES][M3_VAR_VALUE];
} m3_axis_decl;

typedef struct m3_schema {
  char op[M3_VAR_NAME];
  int n_axes;
  m3_axis_decl axes[M3_VAR_MAX_FIELDS];
  int n_tiles;
  m3_axis_decl tiles[M3_VAR_MAX_FIELDS];
  uint64_t hash;                   /* template hash (its text + the lib/ files it includes) */
} m3_schema;

/* Model dimensions handed to a template's variants(cfg) as a table. */
typedef struct m3_dims {
  int n;
  struct { const char *name; long value; } kv[64];
} m3_dims;
void m3_dims_set(m3_dims *d, const char *name, long value);

typedef struct m3_source {
  char *text;                      /* malloc'd, NUL-terminated CUDA C++ */
  char entry[96];                  /* extern "C" kernel symbol */
  int threads;                     /* block size (x) */
  int smem;                        /* dynamic shared memory bytes */
  uint64_t template_hash;
  char key[M3_KEY_MAX];            /* full canonical key it was rendered for */
} m3_source;
void m3_source_free(m3_source *s);

/* Errors for all: M3_NOTFOUND (no such template), M3_TEMPLATE (Lua error, with
 * templates/<file>:<line>), M3_KEY (key does not fit the schema). */
m3_status m3_render_schema(m3_lua *L, const char *op, m3_schema *out, m3_err *e);

/* Check a parsed key against its template's schema and rewrite it canonically:
 * axes (and tile fields, if any) in declared order, values normalised.  Unknown
 * or missing axes, values outside an enumerated axis: M3_KEY naming the field
 * and listing the allowed values. */
m3_status m3_render_canon(m3_lua *L, m3_variant *v, m3_err *e);

/* Parse + canonicalise in one step. */
m3_status m3_render_parse_key(m3_lua *L, const char *text, m3_variant *v, m3_err *e);

/* Replace v's tile by the template's default_tile(key, arch). */
m3_status m3_render_default_tile(m3_lua *L, m3_variant *v, m3_err *e);

/* valid(key, tile, arch): M3_OK, or M3_TILE with the template's reason in
 * `reason` (and in e).  An arch is required. */
m3_status m3_render_valid(m3_lua *L, const m3_variant *v, char *reason, size_t n, m3_err *e);

/* Every combination of the declared tile candidates for v (not yet filtered by
 * valid()), as malloc'd array of variants (free with free()). */
m3_status m3_render_tiles(m3_lua *L, const m3_variant *v, m3_variant **out, int *n, m3_err *e);

/* The keys (semantic part only, canonical) that `dims` needs from template `op`. */
m3_status m3_render_variants(m3_lua *L, const char *op, const m3_dims *dims, m3_variant **out,
                             int *n, m3_err *e);

/* Render source for a key with a tile and an arch; validity is checked first
 * (M3_TILE with the reason).  The source opens with a header comment naming the
 * key, template and template hash. */
m3_status m3_render_source(m3_lua *L, const m3_variant *v, m3_source *out, m3_err *e);

/* The code hash of a full key (axes, tile, arch): m3_code_hash (code_hash.h)
 * of its rendered source and launch, the identity a tuning record keeps of the
 * code it timed.  Not part of m3_render_source: the JIT renders every kernel
 * it resolves, and only tuning records need this.  Errors: those of
 * m3_render_source (M3_TILE when the tile is not valid for the key any more,
 * M3_NOTFOUND, M3_TEMPLATE, M3_KEY). */
m3_status m3_render_code_hash(m3_lua *L, const m3_variant *v, uint64_t *out, m3_err *e);
/* The same for a source already rendered. */
uint64_t m3_source_code_hash(const m3_source *s);

#endif
