/* nvrtc.h - compile one generated source for one SM arch with NVRTC.
 *
 * Options are canonical (a fixed list in a fixed order, see m3_nvrtc_options)
 * because they are part of the cubin-cache key.  Any arch NVRTC knows can be
 * named offline (sm_80 ... sm_120, "a" variants); no GPU is needed to compile.
 */
#ifndef M3_NVRTC_H
#define M3_NVRTC_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/status.h"

/* NVRTC version as major*1000 + minor*10 (13.0 -> 13000). */
int m3_nvrtc_version(void);

/* The canonical option string for an arch (space separated), e.g.
 * "--gpu-architecture=sm_90 -std=c++17 -default-device --fmad=true -lineinfo". */
void m3_nvrtc_options(const char *arch, char *buf, size_t n);

/* M3_OK when `arch` (sm_XX, sm_XXa, sm_XXf) is well formed and one of the
 * archs this NVRTC compiles for (nvrtcGetSupportedArchs); else M3_INVAL naming
 * the arch and the range it knows (M3_NVRTC if NVRTC cannot say). */
m3_status m3_nvrtc_arch_check(const char *arch, m3_err *e);

/* Compile `src` (named `name` in diagnostics) to a cubin for `arch`.
 * `extra` (may be NULL) is appended verbatim after the canonical options (used
 * by `m3kit gen --inspect` for --ptxas-options=-v; never for cached builds).
 * On success *cubin is malloc'd.  *log (malloc'd, may be NULL) gets NVRTC's
 * log either way.  Errors: M3_NVRTC with the log, each line of which refers to
 * `name`(line) of the generated source; M3_INVAL for a malformed arch. */
m3_status m3_nvrtc_compile(const char *src, const char *name, const char *arch, const char *extra,
                           uint8_t **cubin, size_t *size, char **log, m3_err *e);

/* Number of NVRTC compilations this process ran (for cache tests). */
long m3_nvrtc_compile_count(void);

#endif
