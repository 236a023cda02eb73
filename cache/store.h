/* store.h - the on-disk primitive under every persisted m3kit file.
 *
 * Everything m3kit persists (cubin cache entries, the tuning DB) goes through
 * these calls so that the crash-safety rules live in one place:
 *   - a file is published by writing "<path>.tmp.<pid>.<n>" in the same
 *     directory, fsync()ing it and rename()ing it over <path>: readers see the
 *     old file or the new one, never a partial one, and a killed writer leaves
 *     only a stray temp file (swept by m3_store_sweep_tmp);
 *   - writers of one logical object serialise on an flock(2) lock file
 *     ("<path>.lock"); locks die with their process, so a SIGKILL never leaves
 *     a stale lock behind.
 * Cache directory resolution: $M3KIT_CACHE_DIR, else $XDG_CACHE_HOME/m3kit,
 * else $HOME/.cache/m3kit.
 */
#ifndef M3_STORE_H
#define M3_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/status.h"

/* Resolve the cache root into buf (no trailing slash).  Errors: M3_INVAL when
 * no variable gives a location. */
m3_status m3_cache_root(char *buf, size_t n, m3_err *e);

/* mkdir -p.  Errors: M3_IO naming the component that failed. */
m3_status m3_mkdirs(const char *path, m3_err *e);

/* Read the whole file into a malloc'd buffer (NUL-terminated one byte past
 * *len for text convenience).  Errors: M3_NOTFOUND if absent; M3_IO
 * otherwise, and for anything but a regular file (a directory, a FIFO: refused
 * without blocking), naming the path. */
m3_status m3_read_file(const char *path, uint8_t **data, size_t *len, m3_err *e);

/* Atomically replace `path` with `len` bytes (temp file + fsync + rename, then
 * fsync of the directory).  A symlink is followed: its target is replaced and
 * the link stays.  A replaced file keeps its permission bits; a new one is
 * created 0644 less the umask.  Errors: M3_IO (ENOSPC, EROFS, a dangling symlink, ...)
 * naming the path; on error `path` is untouched and the temp file is removed. */
m3_status m3_write_atomic(const char *path, const void *data, size_t len, m3_err *e);
/* Whether m3_write_atomic(path) could run now, creating and changing
 * nothing: the symlink resolves, an existing file is writable, and its
 * directory takes the temp file.  For a check before long work whose result
 * it writes.  Errors: M3_IO naming the path and what fails. */
m3_status m3_write_atomic_check(const char *path, m3_err *e);

/* An exclusive advisory lock on "<path>.lock" (path's symlink target's, for a
 * symlink), blocking.  *fd receives the lock descriptor for m3_unlock.
 * Errors: M3_IO. */
m3_status m3_lock(const char *path, int *fd, m3_err *e);
void m3_unlock(int fd);

/* Remove "<dir>/<name>.tmp.<pid>.<n>" files older than `age_s` seconds (left by killed
 * writers).  Best effort; returns the number removed. */
int m3_store_sweep_tmp(const char *dir, int age_s);

#endif
