/* jit.h - key -> source -> cubin, through the on-disk cache.
 *
 * m3_jit_build renders a fully specified variant (axes + tile + arch), then
 * returns its cubin from <cache root>/cubin/ or compiles and publishes it:
 *   1. look up the entry; a corrupt one is reported once, deleted and rebuilt;
 *   2. on a miss with M3KIT_NO_JIT=1 fail with M3_NOJIT naming the key;
 *   3. take the entry's lock, look again (another process may have just built
 *      it), compile with NVRTC, publish atomically, unlock.
 * Eight processes asking for one key at once therefore compile it once and
 * never read a partial file.  When the cache directory cannot be created or
 * written (read-only, full disk) the build is reported once and continues
 * uncached.  M3KIT_DUMP_DIR=dir writes each compiled source, its options and
 * its NVRTC log there, as <entry>.<arch>.cu and .log.
 */
#ifndef M3_JIT_H
#define M3_JIT_H

#include <stddef.h>
#include <stdint.h>

#include "cache/cubin_cache.h"
#include "gen/render.h"

typedef struct m3_jit {
  m3_lua *lua;
  char cache_root[4096];
  int nvrtc_version;
  int driver_version;     /* 0 offline */
  long hits, builds, corrupt, uncached;
  double compile_ms;      /* NVRTC time this session */
} m3_jit;

/* Errors: M3_NOMEM, M3_INVAL (no cache location). */
m3_status m3_jit_open(m3_jit *j, m3_err *e);
void m3_jit_close(m3_jit *j);

typedef struct m3_cubin {
  uint8_t *data;
  size_t size;
  m3_cubin_meta meta;
  int hit;                /* came from the disk cache */
} m3_cubin;
void m3_cubin_free(m3_cubin *c);

/* v must carry a tile and an arch.  Errors: M3_KEY, M3_TILE (invalid, with the
 * template's reason), M3_TEMPLATE, M3_NVRTC (log with source line excerpts),
 * M3_NOJIT. */
m3_status m3_jit_build(m3_jit *j, const m3_variant *v, m3_cubin *out, m3_err *e);

/* The same for a source already rendered from v (no Lua involved), so that
 * several threads may compile at once (NVRTC programs are independent; the
 * Lua state is not thread-safe, so render first, compile in parallel). */
m3_status m3_jit_build_rendered(m3_jit *j, const m3_variant *v, const m3_source *src, m3_cubin *out, m3_err *e);

/* One job of m3_jit_build_many: fill v (full key) and src (rendered), set
 * rendered = 1; jobs with rendered = 0 are skipped (status kept). */
typedef struct m3_jit_job {
  m3_variant v;
  m3_source src;
  m3_status status;     /* M3_OK, the build's error, or M3_TIMEOUT */
  char reason[512];     /* the error message when status != M3_OK */
  int rendered, done;
  int hit;              /* came from the cubin cache */
  size_t size;          /* image bytes */
} m3_jit_job;

/* Build every rendered job on `threads` workers through the cubin cache.
 * Jobs still running after about timeout_s per round are marked M3_TIMEOUT
 * and left to finish on detached threads: keep `jobs` allocated then (any job
 * with status M3_TIMEOUT). */
void m3_jit_build_many(m3_jit *j, m3_jit_job *jobs, int n, int threads, int timeout_s);

#endif
