/* log.c - warning/progress sink (see log.h). */
#include "runtime/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static m3_log_fn sink;
static void *sink_user;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long seen[256];
static int n_seen;

void m3_log_set(m3_log_fn fn, void *user) {
  sink = fn;
  sink_user = user;
}

int m3_env_flag(const char *name) {
  const char *v = getenv(name);
  return v && *v && strcmp(v, "0");
}

int m3_log_verbose(void) { return m3_env_flag("M3KIT_VERBOSE"); }

static void emit(int level, const char *msg) {
  if (sink) sink(level, msg, sink_user);
  else if (level >= M3_LOG_WARN || m3_log_verbose()) fprintf(stderr, "m3kit: %s%s\n", level ? "warning: " : "", msg);
}

static void vemit(int level, const char *fmt, va_list ap) {
  char buf[4096];
  vsnprintf(buf, sizeof buf, fmt, ap);
  emit(level, buf);
}

void m3_info(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vemit(M3_LOG_INFO, fmt, ap);
  va_end(ap);
}

void m3_warn(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vemit(M3_LOG_WARN, fmt, ap);
  va_end(ap);
}

/* 1 the first time this process sees `text` (by its hash), else 0. */
static int first_seen(const char *text) {
  unsigned long long h = XXH3_64bits(text, strlen(text));
  pthread_mutex_lock(&mu);
  for (int i = 0; i < n_seen; i++)
    if (seen[i] == h) {
      pthread_mutex_unlock(&mu);
      return 0;
    }
  if (n_seen < 256) seen[n_seen++] = h;
  pthread_mutex_unlock(&mu);
  return 1;
}

void m3_warn_once(const char *fmt, ...) {
  char buf[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (first_seen(buf)) emit(M3_LOG_WARN, buf);
}

void m3_warn_once_as(const char *kind, const char *fmt, ...) {
  char key[256];
  snprintf(key, sizeof key, "\x01kind:%s", kind);   /* apart from any message text */
  if (!first_seen(key)) return;
  va_list ap;
  va_start(ap, fmt);
  vemit(M3_LOG_WARN, fmt, ap);
  va_end(ap);
}
