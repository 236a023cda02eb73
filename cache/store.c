/* store.c - atomic publish, locking and cache-root resolution (see store.h).
 * Kept apart from the cubin cache and the tuning DB so both inherit one audited
 * implementation of temp+fsync+rename and flock. */
#include "cache/store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

m3_status m3_cache_root(char *buf, size_t n, m3_err *e) {
  const char *d = getenv("M3KIT_CACHE_DIR");
  if (d && *d) {
    snprintf(buf, n, "%s", d);
    return M3_OK;
  }
  d = getenv("XDG_CACHE_HOME");
  if (d && *d) {
    snprintf(buf, n, "%s/m3kit", d);
    return M3_OK;
  }
  d = getenv("HOME");
  if (d && *d) {
    snprintf(buf, n, "%s/.cache/m3kit", d);
    return M3_OK;
  }
  return m3_errf(e, M3_INVAL, "no cache directory: set M3KIT_CACHE_DIR, XDG_CACHE_HOME or HOME");
}

m3_status m3_mkdirs(const char *path, m3_err *e) {
  char tmp[4096];
  size_t len = strlen(path);
  if (len == 0 || len >= sizeof tmp) return m3_errf(e, M3_INVAL, "bad directory path '%s'", path);
  memcpy(tmp, path, len + 1);
  for (char *p = tmp + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
      return m3_errf(e, M3_IO, "%s: cannot create directory: %s", tmp, strerror(errno));
    *p = '/';
  }
  if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
    return m3_errf(e, M3_IO, "%s: cannot create directory: %s", tmp, strerror(errno));
  struct stat st;
  if (stat(tmp, &st) != 0 || !S_ISDIR(st.st_mode))
    return m3_errf(e, M3_IO, "%s: not a directory", tmp);
  return M3_OK;
}

m3_status m3_read_file(const char *path, uint8_t **data, size_t *len, m3_err *e) {
  *data = NULL;
  *len = 0;
  /* O_NONBLOCK: a FIFO is refused below instead of blocking the open on a
   * writer; on a regular file the flag changes nothing. */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    return m3_errf(e, errno == ENOENT ? M3_NOTFOUND : M3_IO, "%s: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return m3_errf(e, M3_IO, "%s: stat: %s", path, strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return m3_errf(e, M3_IO, "%s: %s", path, S_ISDIR(st.st_mode) ? "is a directory, not a file" : "not a regular file");
  }
  size_t n = (size_t)st.st_size;
  uint8_t *buf = malloc(n + 1);
  if (!buf) {
    close(fd);
    return m3_errf(e, M3_NOMEM, "%s: cannot allocate %zu bytes", path, n);
  }
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  if (got != n) {
    free(buf);
    return m3_errf(e, M3_IO, "%s: short read (%zu of %zu bytes)", path, got, n);
  }
  buf[n] = 0;
  *data = buf;
  *len = n;
  return M3_OK;
}

static m3_status write_all(int fd, const void *data, size_t len, const char *path, m3_err *e) {
  const uint8_t *p = data;
  while (len) {
    ssize_t w = write(fd, p, len);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return m3_errf(e, M3_IO, "%s: write: %s", path, strerror(errno));
    p += w;
    len -= (size_t)w;
  }
  return M3_OK;
}

/* A symlinked file is written and locked at its target: renaming over the
 * link would replace the link by a file and leave the target stale, and two
 * writers naming the link and the target would lock two different files.
 * buf receives the path to use (the link's target, or path itself). */
static m3_status follow(const char *path, char *buf, size_t n, m3_err *e) {
  struct stat st;
  if (lstat(path, &st) != 0 || !S_ISLNK(st.st_mode)) {
    snprintf(buf, n, "%s", path);
    return M3_OK;
  }
  char *real = realpath(path, NULL);
  if (!real) return m3_errf(e, M3_IO, "%s: a symlink whose target cannot be resolved: %s", path, strerror(errno));
  snprintf(buf, n, "%s", real);
  free(real);
  return M3_OK;
}

m3_status m3_write_atomic(const char *link, const void *data, size_t len, m3_err *e) {
  static unsigned counter;
  char path[4200];
  M3_TRY(follow(link, path, sizeof path, e));
  char tmp[4300];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%u", path, (long)getpid(),
           __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED));
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return m3_errf(e, M3_IO, "%s: cannot create temp file: %s", tmp, strerror(errno));
  m3_status s = M3_OK;
  /* A replaced file keeps its mode (a user's 0600 tuning DB stays private);
   * a new one gets 0644 less the umask. */
  struct stat old;
  if (stat(path, &old) == 0 && fchmod(fd, old.st_mode & 07777) != 0)
    s = m3_errf(e, M3_IO, "%s: fchmod: %s", tmp, strerror(errno));
  if (s == M3_OK) s = write_all(fd, data, len, tmp, e);
  if (s == M3_OK && fsync(fd) != 0) s = m3_errf(e, M3_IO, "%s: fsync: %s", tmp, strerror(errno));
  if (close(fd) != 0 && s == M3_OK) s = m3_errf(e, M3_IO, "%s: close: %s", tmp, strerror(errno));
  if (s == M3_OK && rename(tmp, path) != 0)
    s = m3_errf(e, M3_IO, "%s: rename into place: %s", path, strerror(errno));
  if (s != M3_OK) {
    unlink(tmp);
    return s;
  }
  /* Make the rename itself durable. */
  char dir[4200];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash) {
    *slash = 0;
    int dfd = open(*dir ? dir : "/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      fsync(dfd);
      close(dfd);
    }
  }
  return M3_OK;
}

m3_status m3_write_atomic_check(const char *link, m3_err *e) {
  char path[4200];
  M3_TRY(follow(link, path, sizeof path, e));
  if (access(path, F_OK) == 0 && access(path, W_OK) != 0)
    return m3_errf(e, M3_IO, "%s: %s", path, strerror(errno));
  char dir[4200];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash) snprintf(dir, sizeof dir, ".");
  else if (slash == dir) dir[1] = 0;
  else *slash = 0;
  if (access(dir, W_OK | X_OK) != 0)
    return m3_errf(e, M3_IO, "%s: its directory %s: %s (the file is written there as a temp file, then renamed)",
                   path, dir, strerror(errno));
  return M3_OK;
}

m3_status m3_lock(const char *link, int *fd, m3_err *e) {
  char path[4200], lk[4300];
  M3_TRY(follow(link, path, sizeof path, e));
  snprintf(lk, sizeof lk, "%s.lock", path);
  int f = open(lk, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (f < 0) return m3_errf(e, M3_IO, "%s: cannot open lock file: %s", lk, strerror(errno));
  while (flock(f, LOCK_EX) != 0) {
    if (errno == EINTR) continue;
    int err = errno;
    close(f);
    return m3_errf(e, M3_IO, "%s: flock: %s", lk, strerror(err));
  }
  *fd = f;
  return M3_OK;
}

void m3_unlock(int fd) {
  if (fd >= 0) {
    flock(fd, LOCK_UN);
    close(fd);
  }
}

int m3_store_sweep_tmp(const char *dir, int age_s) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  int removed = 0;
  time_t now = time(NULL);
  struct dirent *de;
  while ((de = readdir(d))) {
    if (!strstr(de->d_name, ".tmp.")) continue;
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
    struct stat st;
    if (stat(p, &st) == 0 && now - st.st_mtime >= age_s && unlink(p) == 0) removed++;
  }
  closedir(d);
  return removed;
}
