/* log.h - the library's one channel for warnings and progress that are not
 * errors (a corrupt cache entry rebuilt, stale tuning records ignored).  The
 * CLI may install its own sink; the default writes "m3kit: ..." to stderr.
 * m3_warn_once suppresses repeats of the same message text in this process. */
#ifndef M3_LOG_H
#define M3_LOG_H

typedef void (*m3_log_fn)(int level, const char *msg, void *user);
enum { M3_LOG_INFO = 0, M3_LOG_WARN = 1 };

void m3_log_set(m3_log_fn fn, void *user);
void m3_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void m3_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void m3_warn_once(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Once per `kind` in this process, whatever the text: for a warning that
 * names the file it failed on, which m3_warn_once would repeat per file. */
void m3_warn_once_as(const char *kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Verbosity for m3_info: 0 quiet (default), 1 verbose (M3KIT_VERBOSE=1). */
int m3_log_verbose(void);
/* An on/off environment variable (M3KIT_VERBOSE, M3KIT_NO_JIT, ...): on when
 * set to anything but the empty string or "0", so that VAR= and VAR=0 both
 * mean off, the same for every flag. */
int m3_env_flag(const char *name);

#endif
