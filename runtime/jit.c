/* jit.c - the get-or-build policy of the cubin cache (see jit.h). */
#include "runtime/jit.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cache/store.h"
#include "runtime/cuda_driver.h"
#include "runtime/gpu.h"
#include "runtime/log.h"
#include "runtime/nvrtc.h"

m3_status m3_jit_open(m3_jit *j, m3_err *e) {
  memset(j, 0, sizeof *j);
  M3_TRY(m3_cache_root(j->cache_root, sizeof j->cache_root, e));
  j->nvrtc_version = m3_nvrtc_version();
  j->driver_version = m3_driver_version();
  return m3_lua_open(&j->lua, e);
}

void m3_jit_close(m3_jit *j) {
  if (j->lua) m3_lua_close(j->lua);
  j->lua = NULL;
}

void m3_cubin_free(m3_cubin *c) {
  if (c) {
    free(c->data);
    c->data = NULL;
  }
}

static pthread_mutex_t ms_mu = PTHREAD_MUTEX_INITIALIZER;

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* Append, for every "(N):" location in the NVRTC log, line N of the source so
 * a failing template can be read without dumping the file. */
static void excerpt(const char *log, const char *src, char *out, size_t n) {
  size_t at = 0;
  out[0] = 0;
  int shown = 0;
  for (const char *p = log; p && (p = strchr(p, '(')) && shown < 8; p++) {
    char *end;
    long line = strtol(p + 1, &end, 10);
    if (end == p + 1 || *end != ')' || end[1] != ':' || line <= 0) continue;
    const char *s = src;
    for (long l = 1; l < line && s; l++) {
      s = strchr(s, '\n');
      if (s) s++;
    }
    if (!s) continue;
    int len = (int)strcspn(s, "\n");
    at += (size_t)snprintf(out + at, at < n ? n - at : 0, "  %5ld | %.*s\n", line, len > 200 ? 200 : len, s);
    if (at >= n) break;
    shown++;
  }
}

/* $M3KIT_DUMP_DIR/<entry>.<arch>.cu and .log (the entry symbol is the same
 * for every arch: the arch keeps one arch's dump from replacing another's).
 * A debugging aid: a failure is warned about once and never fails the build. */
static void dump(const char *sym, const char *arch, const char *src, const char *opts, const char *log) {
  const char *dir = getenv("M3KIT_DUMP_DIR");
  if (!dir || !*dir) return;
  m3_err e;
  if (m3_mkdirs(dir, &e) != M3_OK) {
    m3_warn_once_as("dump", "M3KIT_DUMP_DIR: %s; nothing dumped", e.msg);
    return;
  }
  char p[4200];
  snprintf(p, sizeof p, "%s/%s.%s.cu", dir, sym, arch);
  m3_status s = m3_write_atomic(p, src, strlen(src), &e);
  snprintf(p, sizeof p, "%s/%s.%s.log", dir, sym, arch);
  char head[600];
  snprintf(head, sizeof head, "options: %s\n", opts);
  size_t ll = log ? strlen(log) : 0;
  char *all = malloc(strlen(head) + ll + 1);
  if (all && s == M3_OK) {
    strcpy(all, head);
    if (log) strcat(all, log);
    s = m3_write_atomic(p, all, strlen(all), &e);
  }
  free(all);
  if (s != M3_OK) m3_warn_once_as("dump", "M3KIT_DUMP_DIR: %s; dumps are incomplete", e.msg);
}

static m3_status compile(m3_jit *j, const m3_source *src, const char *arch, const char *opts,
                         m3_cubin *out, m3_err *e) {
  char *log = NULL;
  double t0 = now_ms();
  m3_alt_compile_fn alt = m3_driver_compiler(NULL);
  m3_status s = alt ? alt(src->text, src->entry, arch, &out->data, &out->size, &log, e)
                    : m3_nvrtc_compile(src->text, src->entry, arch, NULL, &out->data, &out->size, &log, e);
  double dt = now_ms() - t0;
  pthread_mutex_lock(&ms_mu);
  j->compile_ms += dt;
  pthread_mutex_unlock(&ms_mu);
  dump(src->entry, arch, src->text, opts, log);
  if (s == M3_NVRTC && log) {
    char ex[4096];
    excerpt(log, src->text, ex, sizeof ex);
    if (ex[0]) {
      size_t l = strlen(e->msg);
      snprintf(e->msg + l, sizeof e->msg - l, "\ngenerated source lines:\n%s", ex);
    }
    m3_err_prefix(e, "%s: ", src->key);
  }
  free(log);
  snprintf(out->meta.entry, sizeof out->meta.entry, "%s", src->entry);
  out->meta.threads = src->threads;
  out->meta.smem = src->smem;
  return s;
}

m3_status m3_jit_build(m3_jit *j, const m3_variant *v, m3_cubin *out, m3_err *e) {
  memset(out, 0, sizeof *out);
  if (!v->arch[0] || !v->n_tile) return m3_errf(e, M3_KEY, "m3_jit_build needs a key with a tile and an @sm_XX arch");
  m3_source src;
  M3_TRY(m3_render_source(j->lua, v, &src, e));
  m3_status s = m3_jit_build_rendered(j, v, &src, out, e);
  m3_source_free(&src);
  return s;
}

m3_status m3_jit_build_rendered(m3_jit *j, const m3_variant *v, const m3_source *srcp, m3_cubin *out, m3_err *e) {
  memset(out, 0, sizeof *out);
  const m3_source src = *srcp;
  char opts[512];
  const char *alt_opts = NULL;
  if (m3_driver_compiler(&alt_opts)) snprintf(opts, sizeof opts, "%s", alt_opts);
  else m3_nvrtc_options(v->arch, opts, sizeof opts);
  char *keytext = NULL, hex[33];
  m3_status s = m3_cubin_key(src.key, src.text, v->arch, opts, j->nvrtc_version, j->driver_version,
                             &keytext, hex, e);
  if (s != M3_OK) return s;
  char path[4400], dir[4300];
  m3_cubin_path(j->cache_root, v->arch, hex, path, sizeof path);
  snprintf(dir, sizeof dir, "%s/cubin/%s", j->cache_root, v->arch);

  m3_err le;
  s = m3_cubin_load(path, keytext, &out->data, &out->size, &out->meta, &le);
  if (s == M3_OK) {
    out->hit = 1;
    __atomic_fetch_add(&j->hits, 1, __ATOMIC_RELAXED);
    goto done;
  }
  if (s == M3_CORRUPT) {
    m3_warn_once("%s; rebuilding it", le.msg);
    __atomic_fetch_add(&j->corrupt, 1, __ATOMIC_RELAXED);
    unlink(path);
  }
  if (m3_env_flag("M3KIT_NO_JIT")) {
    s = m3_errf(e, M3_NOJIT, "M3KIT_NO_JIT is set and no cached cubin for %s (cache entry %s)", src.key, path);
    goto done;
  }
  /* An arch NVRTC cannot build for fails here, before its cache folder exists. */
  if ((s = m3_nvrtc_arch_check(v->arch, e)) != M3_OK) goto done;
  int lockfd = -1;
  if (m3_mkdirs(dir, &le) != M3_OK || m3_lock(path, &lockfd, &le) != M3_OK) {
    m3_warn_once_as("cubin-lock", "cubin cache at %s is not usable (%s); continuing uncached", j->cache_root, le.msg);
    __atomic_fetch_add(&j->uncached, 1, __ATOMIC_RELAXED);
    s = compile(j, &src, v->arch, opts, out, e);
    goto done;
  }
  /* Someone else may have published it while we waited for the lock. */
  if (m3_cubin_load(path, keytext, &out->data, &out->size, &out->meta, &le) == M3_OK) {
    out->hit = 1;
    __atomic_fetch_add(&j->hits, 1, __ATOMIC_RELAXED);
    m3_unlock(lockfd);
    s = M3_OK;
    goto done;
  }
  s = compile(j, &src, v->arch, opts, out, e);
  if (s == M3_OK) {
    __atomic_fetch_add(&j->builds, 1, __ATOMIC_RELAXED);
    if (m3_cubin_store(path, keytext, out->data, out->size, &out->meta, &le) != M3_OK) {
      m3_warn_once_as("cubin-write", "cannot write the cubin cache (%s); continuing uncached", le.msg);
      __atomic_fetch_add(&j->uncached, 1, __ATOMIC_RELAXED);
    }
  }
  m3_unlock(lockfd);
done:
  free(keytext);
  if (s != M3_OK) m3_cubin_free(out);
  return s;
}
