/* variant.h - variant keys: the one canonical text name of a kernel instance.
 *
 *   op(axis=value,...)[tile=value,...]@sm_XX
 *
 * The part in parentheses holds only semantic axes (what is computed: dense or
 * sparse, insert fused or not, dtypes, head counts); the bracketed tile part
 * holds only scheduling choices (how it is computed), and the arch suffix the
 * SM target.  By contract a tile may change speed, never the result beyond
 * tolerance.  Fields appear in the order the template declares them, values are
 * normalised (decimal integers, 0/1 booleans, canonical dtype names), so that
 * parse(print(k)) == k byte for byte.  Everything else derives from the key:
 * the kernel symbol, the source header, the cubin-cache key, the test id.
 *
 * This file knows only the syntax; which axes exist and which values they take
 * comes from the template (gen/render.h checks a parsed key against it).
 */
#ifndef M3_VARIANT_H
#define M3_VARIANT_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/status.h"

#define M3_VAR_MAX_FIELDS 24
#define M3_VAR_NAME 32
#define M3_VAR_VALUE 48
#define M3_KEY_MAX 1024

typedef struct m3_field {
  char name[M3_VAR_NAME];
  char value[M3_VAR_VALUE];
} m3_field;

typedef struct m3_variant {
  char op[M3_VAR_NAME];                /* template name, e.g. "qknorm_rope" */
  int n_axes;
  m3_field axes[M3_VAR_MAX_FIELDS];    /* semantic axes, template order */
  int n_tile;                          /* 0: no tile part (use default / tuned) */
  m3_field tile[M3_VAR_MAX_FIELDS];
  char arch[16];                       /* "sm_90", "sm_90a", ... or "" */
} m3_variant;

/* Parse the syntax of a key (any of the tile and arch parts may be absent).
 * Names must be [a-z_][a-z0-9_]*, values [A-Za-z0-9_.+-]+, no duplicates.
 * Errors: M3_KEY with the offending column. */
m3_status m3_variant_parse(const char *text, m3_variant *v, m3_err *e);

/* 1 when a is spelled as an SM arch: "sm_XX", "sm_XXa" or "sm_XXf" (two or
 * three digits); else 0.  Whether a template supports it is its valid()'s
 * call (all need sm_80+). */
int m3_arch_valid(const char *a);

/* Print the key: full (axes + tile + arch), or only its semantic part.
 * Returns the length written (truncation is reported as M3_KEY by callers
 * that check len >= n). */
size_t m3_variant_print(const m3_variant *v, char *buf, size_t n);
size_t m3_variant_print_axes(const m3_variant *v, char *buf, size_t n); /* op(...) */
size_t m3_variant_print_tile(const m3_variant *v, char *buf, size_t n); /* a=1,b=2 */

/* Field access; NULL / fallback when absent. */
const char *m3_variant_axis(const m3_variant *v, const char *name);
const char *m3_variant_tilev(const m3_variant *v, const char *name);
long m3_variant_axis_int(const m3_variant *v, const char *name, long fallback);
long m3_variant_tile_int(const m3_variant *v, const char *name, long fallback);

/* Set (append or replace) a field; Errors: M3_KEY when full or too long. */
m3_status m3_variant_set_axis(m3_variant *v, const char *name, const char *value, m3_err *e);
m3_status m3_variant_set_tile(m3_variant *v, const char *name, const char *value, m3_err *e);
/* Parse "a=1,b=2" into the tile part (replacing it). */
m3_status m3_variant_parse_tile(m3_variant *v, const char *tile_text, m3_err *e);

/* A C identifier derived from the key's semantic part and tile (op name plus a
 * 64-bit hash), used as the extern "C" kernel symbol prefix. */
void m3_variant_symbol(const m3_variant *v, char *buf, size_t n);

#endif
