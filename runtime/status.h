/* status.h - m3kit's error model: one status enum plus a message buffer.
 *
 * Library code never aborts and never prints: every fallible function returns
 * an m3_status and, on failure, leaves a human-readable message in the caller's
 * m3_err (file, field, API call, file:line).  Only tools/m3kit.c turns a status
 * into an exit code.  The enum, the names and the default messages all come from
 * one X-macro so that adding a code cannot leave a table behind (libuv style).
 */
#ifndef M3_STATUS_H
#define M3_STATUS_H

#include <stdarg.h>
#include <stddef.h>

#define M3_STATUS_MAP(X)                                                        \
  X(OK,         "success")                                                     \
  X(INVAL,      "invalid argument")                                            \
  X(NOMEM,      "out of host memory")                                          \
  X(IO,         "file I/O error")                                              \
  X(FORMAT,     "malformed file or record")                                    \
  X(CONFIG,     "invalid model configuration")                                 \
  X(KEY,        "invalid variant key")                                         \
  X(TEMPLATE,   "template error")                                              \
  X(TILE,       "tile rejected by the template's valid()")                     \
  X(NVRTC,      "NVRTC compilation failed")                                    \
  X(CUDA,       "CUDA driver/runtime error")                                   \
  X(CUBLAS,     "cuBLAS error")                                                \
  X(NOGPU,      "no CUDA GPU present")                                         \
  X(NOJIT,      "cubin cache miss with M3KIT_NO_JIT=1")                         \
  X(CORRUPT,    "corrupt cache entry")                                         \
  X(STALE,      "record belongs to another arch/driver/template")              \
  X(NOTFOUND,   "not found")                                                   \
  X(RANGE,      "value out of range")                                          \
  X(CAPACITY,   "does not fit in GPU memory")                                  \
  X(NUMERICS,   "NaN/Inf detected")                                            \
  X(MISMATCH,   "result disagrees with the reference")                         \
  X(UNSUPPORTED,"not supported on this device")                                \
  X(TIMEOUT,    "timed out")

typedef enum {
#define M3_X_ENUM(name, msg) M3_##name,
  M3_STATUS_MAP(M3_X_ENUM)
#undef M3_X_ENUM
  M3_STATUS_COUNT
} m3_status;

/* The message a failing call leaves behind.  Messages chain: a caller may
 * prefix context ("loading layer 3: ") with m3_err_prefix. */
typedef struct m3_err {
  m3_status code;
  char msg[4096];
} m3_err;

/* "M3_INVAL" etc. */
const char *m3_status_name(m3_status s);
/* The default one-line description of a status. */
const char *m3_strerror(m3_status s);

/* Record `code` and a printf-formatted message in `e` (may be NULL); returns
 * `code` so callers can write `return m3_errf(e, M3_FORMAT, "...")`. */
m3_status m3_errf(m3_err *e, m3_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
m3_status m3_verrf(m3_err *e, m3_status code, const char *fmt, va_list ap);
/* Prepend context to an existing message; returns e->code. */
m3_status m3_err_prefix(m3_err *e, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void m3_err_clear(m3_err *e);

/* Propagate a failing status unchanged (the message is already set). */
#define M3_TRY(expr)                                                           \
  do {                                                                         \
    m3_status m3_try_s_ = (expr);                                              \
    if (m3_try_s_ != M3_OK) return m3_try_s_;                                  \
  } while (0)

#endif
