/* cubin_cache.h - the content-addressed on-disk cubin cache.
 *
 * Identity.  An entry's key text lists every input that decides the bytes of
 * the cubin, one "name=value" line each: the cache format version, the full
 * variant key, the SM arch, the NVRTC version, the driver version, the
 * canonical NVRTC options and a 128-bit hash plus the length of the complete
 * generated source.  The file name is XXH3-128 of the key text.  Nothing is
 * derived from compiler output, which is not deterministic (known-faults #26).
 *
 * File <root>/cubin/<arch>/<hash>.cubin:
 *   "M3KCUBIN"            8-byte magic
 *   u32 format version    (M3_CUBIN_FORMAT), little endian
 *   u32 header length H
 *   H bytes of header text: the key text, then metadata lines produced at
 *     compile time (entry=, threads=, smem=), so a hit restores everything a
 *     launch needs (known-faults #30)
 *   u64 cubin size S, S bytes of cubin
 *   u64 XXH64 of every byte before it (whole-file checksum)
 * Loading verifies magic, version, size, checksum, and that the stored key text
 * equals the expected one (collision or corruption -> M3_CORRUPT).
 */
#ifndef M3_CUBIN_CACHE_H
#define M3_CUBIN_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/status.h"

#define M3_CUBIN_FORMAT 1

typedef struct m3_cubin_meta {
  char entry[96];
  int threads;
  int smem;
} m3_cubin_meta;

/* Build the key text (malloc'd into *keytext) and its file-name hash (32 hex
 * digits + NUL into hex).  driver_version 0 means "no driver" (offline). */
m3_status m3_cubin_key(const char *variant_key, const char *source, const char *arch,
                       const char *options, int nvrtc_version, int driver_version, char **keytext,
                       char hex[33], m3_err *e);

/* Path of an entry: <root>/cubin/<arch>/<hex>.cubin */
void m3_cubin_path(const char *root, const char *arch, const char *hex, char *buf, size_t n);

/* Load and verify.  Errors: M3_NOTFOUND (no file), M3_CORRUPT (truncated,
 * checksum, key mismatch, bad metadata: message names the file and the check
 * that failed), M3_IO. */
m3_status m3_cubin_load(const char *path, const char *keytext, uint8_t **cubin, size_t *size,
                        m3_cubin_meta *meta, m3_err *e);

/* Publish atomically (temp + fsync + rename).  Errors: M3_IO. */
m3_status m3_cubin_store(const char *path, const char *keytext, const uint8_t *cubin, size_t size,
                         const m3_cubin_meta *meta, m3_err *e);

#endif
