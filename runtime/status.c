/* status.c - names, messages and formatting for m3_status (see status.h). */
#include "runtime/status.h"

#include <stdio.h>
#include <string.h>

static const char *const names[] = {
#define M3_X_NAME(name, msg) "M3_" #name,
    M3_STATUS_MAP(M3_X_NAME)
#undef M3_X_NAME
};
static const char *const msgs[] = {
#define M3_X_MSG(name, msg) msg,
    M3_STATUS_MAP(M3_X_MSG)
#undef M3_X_MSG
};
_Static_assert(sizeof names / sizeof *names == M3_STATUS_COUNT, "status table");

const char *m3_status_name(m3_status s) {
  return (unsigned)s < M3_STATUS_COUNT ? names[s] : "M3_UNKNOWN";
}

const char *m3_strerror(m3_status s) {
  return (unsigned)s < M3_STATUS_COUNT ? msgs[s] : "unknown status";
}

m3_status m3_verrf(m3_err *e, m3_status code, const char *fmt, va_list ap) {
  if (e) {
    e->code = code;
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  }
  return code;
}

m3_status m3_errf(m3_err *e, m3_status code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  m3_verrf(e, code, fmt, ap);
  va_end(ap);
  return code;
}

m3_status m3_err_prefix(m3_err *e, const char *fmt, ...) {
  if (!e) return M3_OK;
  char head[1024], old[sizeof e->msg];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(head, sizeof head, fmt, ap);
  va_end(ap);
  memcpy(old, e->msg, sizeof old);
  /* head, then as much of the old message as fits (truncation is expected) */
  const size_t hl = strnlen(head, sizeof e->msg - 1), ol = strnlen(old, sizeof e->msg - 1 - hl);
  memcpy(e->msg, head, hl);
  memcpy(e->msg + hl, old, ol);
  e->msg[hl + ol] = 0;
  return e->code;
}

void m3_err_clear(m3_err *e) {
  if (e) {
    e->code = M3_OK;
    e->msg[0] = 0;
  }
}
