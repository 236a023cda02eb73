/* check_faults.c - fault injection on everything m3kit persists (CPU only):
 * users share cache directories between processes and machines for days, and
 * processes die at any instruction.  Each test names the protection it checks
 * and how it was verified that the test FAILS without it.
 *
 *   kill_during_jit_publish     SIGKILL while compiling + publishing cubins
 *   kill_during_tunedb_save     SIGKILL inside save_merge loops
 *   readonly_cache              read-only cache directory (EROFS)
 *   full_disk                   ENOSPC while publishing
 *   eight_processes             8 processes building and saving on one cache
 *   foreign_versions_ignored    entries of another NVRTC / driver never load
 *
 * Children report through exit codes and pipes, never through check's
 * assertions: under CK_FORK=no (.ci/run) a failed ck_assert in a forked child
 * would longjmp back into the suite and run the remaining tests twice.
 * Mount-based cases (EROFS, ENOSPC) run inside a private mount namespace of a
 * child, so a failure can never leave a mount behind; where mounting is not
 * permitted they fall back to an emulation (permission bits, RLIMIT_FSIZE) or
 * are skipped with a printed note. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* unshare, CLONE_NEWNS */
#endif
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cache/cubin_cache.h"
#include "cache/store.h"
#include "cache/tunedb.h"
#include "runtime/jit.h"
#include "runtime/log.h"
#include "runtime/nvrtc.h"

/* Four tiles of one variant: four distinct entries, each a real NVRTC build. */
#define QKV "qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=e4m3,nq=64,nkv=4,niq=4,hd=128,rot=64,bs=128)"
static const char *keys[] = {QKV "[warps=4,hpw=1,lph=32,rope=pair]@sm_90", QKV "[warps=2,hpw=1,lph=32,rope=pair]@sm_90", QKV "[warps=8,hpw=1,lph=32,rope=pair]@sm_90",
                             QKV "[warps=4,hpw=2,lph=32,rope=pair]@sm_90"};
#define NKEYS ((int)(sizeof keys / sizeof *keys))
#define TPL_HASH "faults0123456789"

static char dir[128];

static void fresh_cache(void) {
  snprintf(dir, sizeof dir, "/tmp/m3faultXXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dir));
  setenv("M3KIT_CACHE_DIR", dir, 1);
  unsetenv("M3KIT_NO_JIT");
}

static void rm_rf(const char *p) {
  struct stat st;
  if (lstat(p, &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    DIR *d = opendir(p);
    struct dirent *de;
    char q[600];
    while (d && (de = readdir(d)))
      if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
        snprintf(q, sizeof q, "%s/%s", p, de->d_name);
        rm_rf(q);
      }
    if (d) closedir(d);
    rmdir(p);
  } else {
    unlink(p);
  }
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* xorshift64*: a printed seed makes every random kill schedule replayable
 * (M3KIT_TEST_SEED=N). */
static uint64_t rng_state;
static void rng_init(const char *test) {
  const char *s = getenv("M3KIT_TEST_SEED");
  rng_state = s && *s ? strtoull(s, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
  if (!rng_state) rng_state = 1;
  printf("%s: M3KIT_TEST_SEED=%llu\n", test, (unsigned long long)rng_state);
  fflush(stdout);
}
static uint64_t rng(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ull;
}
static double rng_unit(void) { return (double)(rng() >> 11) / 9007199254740992.0; }

/* ---- expected entries ------------------------------------------------------ */

/* The key text and file of every key, for the current NVRTC and driver: what
 * "this cache is readable" is checked against. */
typedef struct {
  char *keytext;
  char path[4400];
} expect;
static expect want[NKEYS];

static void compute_expected(m3_jit *j) {
  for (int i = 0; i < NKEYS; i++) {
    m3_variant v;
    m3_source src;
    m3_err e;
    ck_assert_msg(m3_render_parse_key(j->lua, keys[i], &v, &e) == M3_OK, "%s", e.msg);
    ck_assert_msg(m3_render_source(j->lua, &v, &src, &e) == M3_OK, "%s", e.msg);
    char opts[512], hex[33];
    m3_nvrtc_options(v.arch, opts, sizeof opts);
    free(want[i].keytext);
    ck_assert_int_eq(m3_cubin_key(src.key, src.text, v.arch, opts, j->nvrtc_version, j->driver_version,
                                  &want[i].keytext, hex, &e),
                     M3_OK);
    m3_cubin_path(j->cache_root, v.arch, hex, want[i].path, sizeof want[i].path);
    m3_source_free(&src);
  }
}

static int is_final_cubin(const char *name) {
  size_t l = strlen(name);
  return l > 6 && !strcmp(name + l - 6, ".cubin") && !strstr(name, ".tmp.");
}

/* Every published entry in <dir>/cubin/sm_90 must be one of ours and load
 * cleanly: a reader must never see a partial file under a final name.
 * Returns the number of entries. */
static int check_cubin_dir(void) {
  char p[256];
  snprintf(p, sizeof p, "%s/cubin/sm_90", dir);
  DIR *d = opendir(p);
  if (!d) return 0;
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d))) {
    if (!is_final_cubin(de->d_name)) continue;
    char fp[600];
    snprintf(fp, sizeof fp, "%s/%s", p, de->d_name);
    int k = -1;
    for (int i = 0; i < NKEYS; i++)
      if (!strcmp(want[i].path, fp)) k = i;
    ck_assert_msg(k >= 0, "unexpected entry %s", fp);
    uint8_t *c;
    size_t sz;
    m3_cubin_meta m;
    m3_err e;
    m3_status s = m3_cubin_load(fp, want[k].keytext, &c, &sz, &m, &e);
    ck_assert_msg(s == M3_OK, "published entry unreadable after a kill: %s", e.msg);
    free(c);
    n++;
  }
  closedir(d);
  return n;
}

/* ---- watching how files appear ---------------------------------------------- */

/* A final name must only ever appear by rename (IN_MOVED_TO).  IN_CREATE or
 * IN_MODIFY on it means a writer is filling the published file in place,
 * which a concurrent reader or a kill can observe half-done.  Temp files,
 * lock files and corrupt-copies are exempt. */
static int watch_open(const char *path) {
  int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  ck_assert_msg(inotify_add_watch(fd, path, IN_CREATE | IN_MODIFY | IN_MOVED_TO | IN_CLOSE_WRITE) >= 0, "%s: %s",
                path, strerror(errno));
  return fd;
}

static int exempt(const char *name) {
  size_t l = strlen(name);
  return strstr(name, ".tmp.") || strstr(name, ".corrupt.") || (l > 5 && !strcmp(name + l - 5, ".lock"));
}

typedef struct {
  int creates;         /* files (any name) created */
  int in_place_writes; /* final names created or modified in place */
  char first_bad[256];
} watch_stats;

/* Drain pending events; returns the number of IN_CREATE events seen. */
static int watch_drain(int fd, watch_stats *ws) {
  char buf[8192] __attribute__((aligned(8)));
  int created = 0;
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) break;
    for (char *p = buf; p < buf + n;) {
      struct inotify_event *ev = (struct inotify_event *)p;
      if (ev->len && (ev->mask & IN_CREATE)) created++;
      if (ev->len && (ev->mask & (IN_CREATE | IN_MODIFY)) && !exempt(ev->name)) {
        if (!ws->in_place_writes++) snprintf(ws->first_bad, sizeof ws->first_bad, "%s", ev->name);
      }
      p += sizeof *ev + ev->len;
    }
  }
  ws->creates += created;
  return created;
}

/* Kill `pid` after `delay_ms`, or - when nth_create > 0 - a few microseconds
 * after the nth file creation in the watched directory (the moment a publish
 * begins, which a uniform delay would almost never hit).  Returns 1 when the
 * child was killed, 0 when it had already exited. */
static int kill_child(pid_t pid, int wfd, watch_stats *ws, double delay_ms, int nth_create) {
  double t0 = now_ms();
  int seen = 0, status;
  for (;;) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      watch_drain(wfd, ws);
      return 0;
    }
    double left = delay_ms - (now_ms() - t0);
    if (nth_create <= 0 && left <= 0) break;
    struct pollfd pf = {wfd, POLLIN, 0};
    int to = nth_create > 0 ? 50 : (int)(left < 1 ? 1 : left);
    if (nth_create <= 0 && left < 1) {
      struct timespec ts = {0, (long)(left * 1e6)};
      nanosleep(&ts, NULL);
      break;
    }
    if (poll(&pf, 1, to) > 0) {
      seen += watch_drain(wfd, ws);
      if (nth_create > 0 && seen >= nth_create) {
        for (volatile int spin = (int)(rng() % 20000); spin > 0; spin--) {
        }
        break;
      }
    }
    if (now_ms() - t0 > 120000) break; /* a hung child is killed too; the checks then judge */
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  watch_drain(wfd, ws);
  return 1;
}

/* ---- 1. kill while compiling and publishing cubins -------------------------- */

/* Protection: temp file + fsync + rename (store.c) and flock locks that die
 * with their holder.  Checked: after every kill, every published entry loads
 * (no partial file under a final name), no final name is ever written in
 * place (inotify), and the next run rebuilds what is missing, reuses what is
 * there, never reports a corrupt entry and never blocks on a dead builder's
 * lock.
 * Verified to fail without it: with m3_write_atomic temporarily writing
 * straight to `path` (open O_TRUNC + write, no temp file), the first targeted
 * round fails: "published entry unreadable after a kill: ...: corrupt cubin
 * cache entry: shorter than the fixed header (truncated)" (the inotify check
 * would report the in-place write at the end as well). */
START_TEST(kill_during_jit_publish) {
  rng_init("kill_during_jit_publish");
  fresh_cache();
  m3_jit j;
  m3_err e;
  ck_assert_int_eq(m3_jit_open(&j, &e), M3_OK);
  /* One uncached build times the child's work, to spread the kill delays. */
  m3_variant v;
  m3_cubin cb;
  ck_assert_int_eq(m3_render_parse_key(j.lua, keys[0], &v, &e), M3_OK);
  double t0 = now_ms();
  ck_assert_msg(m3_jit_build(&j, &v, &cb, &e) == M3_OK, "%s", e.msg);
  double t_build = now_ms() - t0;
  m3_cubin_free(&cb);
  m3_jit_close(&j);
  rm_rf(dir);

  const int rounds = 12;
  int killed = 0, targeted = 0, recovered_hits = 0, rebuilt = 0;
  watch_stats ws = {0};
  for (int r = 0; r < rounds; r++) {
    fresh_cache();
    char sub[256];
    snprintf(sub, sizeof sub, "%s/cubin/sm_90", dir);
    m3_err me;
    ck_assert_int_eq(m3_mkdirs(sub, &me), M3_OK); /* so it can be watched from the start */
    int wfd = watch_open(sub);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
      m3_jit cj;
      m3_err ce;
      if (m3_jit_open(&cj, &ce) != M3_OK) _exit(3);
      for (int i = 0; i < NKEYS; i++) {
        m3_variant cv;
        m3_cubin c;
        if (m3_render_parse_key(cj.lua, keys[i], &cv, &ce) != M3_OK || m3_jit_build(&cj, &cv, &c, &ce) != M3_OK)
          _exit(4);
        m3_cubin_free(&c);
      }
      _exit(0);
    }
    /* Odd rounds: a uniform random delay over the child's whole run; even
     * rounds: right after the k-th file creation (entry k's temp file or
     * lock), the publish window itself. */
    int nth = r % 2 == 0 ? 1 + (int)(rng() % (2 * NKEYS)) : 0;
    double delay = rng_unit() * t_build * NKEYS * 1.3;
    int k = kill_child(pid, wfd, &ws, delay, nth);
    killed += k;
    targeted += k && nth > 0;
    close(wfd);

    /* The cache as the kill left it: only complete entries are visible. */
    m3_jit rj;
    ck_assert_int_eq(m3_jit_open(&rj, &e), M3_OK);
    compute_expected(&rj);
    int before = check_cubin_dir();
    /* The next run: everything builds, nothing is corrupt, no lock hangs. */
    for (int i = 0; i < NKEYS; i++) {
      m3_variant rv;
      m3_cubin c;
      ck_assert_int_eq(m3_render_parse_key(rj.lua, keys[i], &rv, &e), M3_OK);
      ck_assert_msg(m3_jit_build(&rj, &rv, &c, &e) == M3_OK, "round %d key %d: %s", r, i, e.msg);
      ck_assert_uint_gt(c.size, 0);
      m3_cubin_free(&c);
    }
    ck_assert_int_eq(rj.corrupt, 0);
    ck_assert_int_eq(rj.hits + rj.builds, NKEYS);
    ck_assert_int_eq(rj.hits, before);
    recovered_hits += (int)rj.hits;
    rebuilt += (int)rj.builds;
    ck_assert_int_eq(check_cubin_dir(), NKEYS);
    /* Stray temp files of the dead builder are swept, entries are not. */
    m3_store_sweep_tmp(sub, 0);
    ck_assert_int_eq(check_cubin_dir(), NKEYS);
    m3_jit_close(&rj);
    rm_rf(dir);
  }
  printf("kill_during_jit_publish: %d rounds, %d kills (%d at a publish), next run reused %d and rebuilt %d entries, "
         "%d file creations watched\n",
         rounds, killed, targeted, recovered_hits, rebuilt, ws.creates);
  ck_assert_msg(ws.in_place_writes == 0, "a final cache name was written in place (%s): publish is not atomic",
                ws.first_bad);
  ck_assert_int_gt(killed, rounds / 2);
}
END_TEST

/* ---- 2. kill while saving the tuning DB ------------------------------------- */

static m3_tune_record rec_for(const char *key, int64_t tokens, char *tile, size_t tn) {
  m3_tune_record r = m3_tune_record_empty();
  r.key = key;
  m3_bucket_add(&r.bucket, "tokens", tokens, NULL);
  r.arch = "sm_90";
  snprintf(tile, tn, "warps=%d,hpw=1,lph=32,rope=pair", 1 << (tokens % 4));
  r.tile = tile;
  r.prov.template_hash = TPL_HASH;
  r.prov.driver_version = "550.54.15";
  r.prov.command = "check_faults";
  r.tuned_us = (double)tokens;
  return r;
}

/* Save records key(id, 0..n-1) one at a time, reporting each completed save
 * on `out` (if >= 0).  Exit 0, or the failing status. */
static int saver(const char *db_path, const char *key, int n, int out) {
  m3_tunedb *db = m3_tunedb_new();
  for (int i = 0; i < n; i++) {
    char tile[64];
    m3_tune_record r = rec_for(key, i, tile, sizeof tile);
    m3_err e;
    if (m3_tunedb_put(db, &r, &e) != M3_OK) return 10;
    m3_status s = m3_tunedb_save_merge(db_path, db, NULL, &e);
    if (s != M3_OK) {
      fprintf(stderr, "saver %s: %s\n", key, e.msg);
      return 11;
    }
    if (out >= 0 && write(out, &i, sizeof i) != sizeof i) return 12;
  }
  m3_tunedb_free(db);
  return 0;
}

static m3_tunedb *load_ok(const char *path) {
  m3_tunedb *db = m3_tunedb_new();
  m3_tunedb_report rep;
  m3_err e;
  m3_status s = m3_tunedb_load(db, path, NULL, NULL, &rep, &e);
  ck_assert_msg(s == M3_OK, "tuning DB unreadable: %s", e.msg);
  ck_assert_msg(rep.invalid == 0, "%s", rep.summary);
  return db;
}

static int has_rec(const m3_tunedb *db, const char *key, int64_t tokens) {
  m3_bucket b = {0};
  m3_bucket_add(&b, "tokens", tokens, NULL);
  return m3_tunedb_find(db, key, &b, "sm_90") != NULL;
}

/* Protection: save_merge publishes with m3_write_atomic under m3_lock and
 * re-reads under the lock.  Checked: after every kill the DB loads with no
 * error and holds every record whose save had returned (this round's and all
 * earlier rounds'), the final name is never written in place, and the next
 * process saves over it.  A crash exactly between fsync and rename (the
 * library's M3KIT_TEST_CRASH_BEFORE_RENAME hook) is one of the rounds.
 * Verified to fail without it: with m3_write_atomic writing in place (open
 * O_TRUNC, no temp file), a kill leaves "tuning DB unreadable: ...sm_90.json:
 * empty file (a truncated write?)" within the first rounds. */
START_TEST(kill_during_tunedb_save) {
  rng_init("kill_during_tunedb_save");
  fresh_cache();
  char tdir[256], path[320];
  snprintf(tdir, sizeof tdir, "%s/tuning", dir);
  snprintf(path, sizeof path, "%s/sm_90.json", tdir);
  m3_err me;
  ck_assert_int_eq(m3_mkdirs(tdir, &me), M3_OK);
  int wfd = watch_open(tdir);
  watch_stats ws = {0};
  const int rounds = 16, per_child = 25;
  int confirmed[16], killed = 0;
  for (int r = 0; r < rounds; r++) {
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
      close(pfd[0]);
      char key[64];
      snprintf(key, sizeof key, "op%d(a=1)", r);
      if (r == rounds - 1) setenv(M3_TUNEDB_CRASH_ENV, "1", 1); /* dies between fsync and rename */
      _exit(saver(path, key, per_child, pfd[1]));
    }
    close(pfd[1]);
    /* Kill after 0..80 ms: a save here takes a few ms (two fsyncs), so the
     * kills land at every stage of the loop, the lock held or not. */
    double delay = rng_unit() * 80.0;
    int k = r == rounds - 1 ? 0 : kill_child(pid, wfd, &ws, delay, r % 4 == 1 ? 1 + (int)(rng() % 6) : 0);
    if (r == rounds - 1) {
      int st;
      waitpid(pid, &st, 0);
      ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "the crash hook did not fire");
      k = 1;
      watch_drain(wfd, &ws);
    }
    killed += k;
    int last = -1, x;
    while (read(pfd[0], &x, sizeof x) == sizeof x) last = x;
    close(pfd[0]);
    confirmed[r] = last; /* records 0..last of round r were saved */
    m3_tunedb *db = load_ok(path);
    for (int q = 0; q <= r; q++) {
      char key[64];
      snprintf(key, sizeof key, "op%d(a=1)", q);
      for (int i = 0; i <= confirmed[q]; i++)
        ck_assert_msg(has_rec(db, key, i), "round %d: record %s tokens=%d was saved, then lost", r, key, i);
    }
    m3_tunedb_free(db);
  }
  /* The next run: the DB still takes new records and keeps the old ones. */
  ck_assert_int_eq(saver(path, "after(a=1)", 3, -1), 0);
  m3_tunedb *db = load_ok(path);
  ck_assert(has_rec(db, "after(a=1)", 2));
  for (int i = 0; i <= confirmed[0]; i++) ck_assert(has_rec(db, "op0(a=1)", i));
  m3_tunedb_free(db);
  ck_assert_int_ge(m3_store_sweep_tmp(tdir, 0), 1); /* the crash hook's temp file at least */
  watch_drain(wfd, &ws);
  close(wfd);
  printf("kill_during_tunedb_save: %d rounds, %d kills, %d file creations watched\n", rounds, killed, ws.creates);
  ck_assert_msg(ws.in_place_writes == 0, "the DB file was written in place (%s): publish is not atomic", ws.first_bad);
  rm_rf(dir);
}
END_TEST

/* ---- helpers for the mount-based cases ------------------------------------ */

/* Results of a child's checks: 0 pass, 77 skip (message on stdout), other
 * codes fail with the message on stderr. */
#define CHILD_CHECK(cond, ...)                             \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "%s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                        \
      fputc('\n', stderr);                                 \
      _exit(1);                                            \
    }                                                      \
  } while (0)

static char logbuf[16384];
static void capture(int level, const char *msg, void *user) {
  (void)level;
  (void)user;
  size_t l = strlen(logbuf);
  snprintf(logbuf + l, sizeof logbuf - l, "%s\n", msg);
}

/* A private mount namespace for this (child) process: mounts made here vanish
 * with it.  Returns 0, or -1 when not permitted. */
static int private_mounts(void) {
  if (unshare(CLONE_NEWNS) != 0) return -1;
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return -1;
  return 0;
}

static int run_child(int (*fn)(void), const char *name) {
  fflush(stdout);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) _exit(fn());
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st), "%s: child died by signal %d", name, WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  if (WEXITSTATUS(st) == 77) printf("%s: SKIPPED (see the note above)\n", name);
  return WEXITSTATUS(st);
}

static int build_key(m3_jit *j, int k, m3_cubin *c, m3_err *e) {
  m3_variant v;
  if (m3_render_parse_key(j->lua, keys[k], &v, e) != M3_OK) return -1;
  return m3_jit_build(j, &v, c, e) == M3_OK ? 0 : -1;
}

static int put_and_save(const char *path, const char *key, int n, m3_err *e) {
  m3_tunedb *db = m3_tunedb_new();
  for (int i = 0; i < n; i++) {
    char tile[64];
    m3_tune_record r = rec_for(key, i, tile, sizeof tile);
    m3_tunedb_put(db, &r, e);
  }
  m3_status s = m3_tunedb_save_merge(path, db, NULL, e);
  m3_tunedb_free(db);
  return s;
}

static int count_tmp(const char *d) {
  DIR *dd = opendir(d);
  int n = 0;
  struct dirent *de;
  while (dd && (de = readdir(dd))) n += strstr(de->d_name, ".tmp.") != NULL;
  if (dd) closedir(dd);
  return n;
}

/* ---- 3. read-only cache ------------------------------------------------------ */

/* A shared cache another user populated, mounted read-only here (EROFS).
 * Protection: jit.c falls back to an uncached compile with one warning when
 * the entry's lock cannot be taken; existing entries are still read; the DB
 * save fails with M3_IO naming the file and errno, and the DB stays readable.
 * Verified to fail without it: with jit.c's fallback replaced by "return the
 * m3_lock error", the child fails at "a new key builds uncached: ....lock:
 * cannot open lock file: Read-only file system". */
static int readonly_child(void) {
  int mounted = private_mounts() == 0 && mount("tmpfs", dir, "tmpfs", 0, "size=16m") == 0, merr = errno;
  if (!mounted && geteuid() == 0) {
    printf("readonly_cache: cannot mount here (%s) and root ignores permission bits: case skipped\n",
           strerror(merr));
    return 77;
  }
  /* Populate: one cubin entry and a DB, as the cache's owner would. */
  m3_jit j;
  m3_err e;
  m3_cubin c;
  char tpath[320];
  snprintf(tpath, sizeof tpath, "%s/tuning/sm_90.json", dir);
  CHILD_CHECK(m3_jit_open(&j, &e) == M3_OK, "%s", e.msg);
  CHILD_CHECK(build_key(&j, 0, &c, &e) == 0, "%s", e.msg);
  m3_cubin_free(&c);
  CHILD_CHECK(put_and_save(tpath, "ro(a=1)", 2, &e) == M3_OK, "%s", e.msg);
  if (mounted) {
    CHILD_CHECK(mount(NULL, dir, NULL, MS_REMOUNT | MS_RDONLY, NULL) == 0, "remount ro: %s", strerror(errno));
  } else { /* emulation for non-root users without mount rights */
    char p[320];
    snprintf(p, sizeof p, "%s/cubin/sm_90", dir);
    chmod(p, 0555);
    snprintf(p, sizeof p, "%s/tuning", dir);
    chmod(p, 0555);
    chmod(dir, 0555);
    printf("readonly_cache: emulated with permission bits (mount not permitted)\n");
  }
  m3_log_set(capture, NULL);
  logbuf[0] = 0;
  /* An existing entry is still a hit. */
  CHILD_CHECK(build_key(&j, 0, &c, &e) == 0 && c.hit, "existing entry not reused: %s", e.msg);
  m3_cubin_free(&c);
  /* A new key compiles uncached, with one clear warning. */
  CHILD_CHECK(build_key(&j, 1, &c, &e) == 0, "a new key builds uncached: %s", e.msg);
  CHILD_CHECK(!c.hit && c.size > 0 && j.uncached == 1, "uncached %ld", j.uncached);
  m3_cubin_free(&c);
  CHILD_CHECK(strstr(logbuf, "not usable") && strstr(logbuf, dir) &&
                  (strstr(logbuf, "Read-only file system") || strstr(logbuf, "Permission denied")),
              "warning: '%s'", logbuf);
  CHILD_CHECK(build_key(&j, 1, &c, &e) == 0 && j.uncached == 2, "second uncached build");
  m3_cubin_free(&c);
  /* Another key's failure names another file: still the one warning a process. */
  CHILD_CHECK(build_key(&j, 2, &c, &e) == 0 && j.uncached == 3, "third uncached build");
  m3_cubin_free(&c);
  const char *w1 = strstr(logbuf, "not usable");
  CHILD_CHECK(w1 && !strstr(w1 + 1, "not usable"), "the cache warning repeated: '%s'", logbuf);
  /* The DB: saving fails with the file and the reason, loading still works. */
  m3_status s = put_and_save(tpath, "ro2(a=1)", 1, &e);
  CHILD_CHECK(s == M3_IO && strstr(e.msg, "tuning") &&
                  (strstr(e.msg, "Read-only file system") || strstr(e.msg, "Permission denied")),
              "save on a read-only cache: %s %s", m3_status_name(s), e.msg);
  m3_tunedb *db = m3_tunedb_new();
  CHILD_CHECK(m3_tunedb_load(db, tpath, NULL, NULL, NULL, &e) == M3_OK && m3_tunedb_count(db) == 2, "%s", e.msg);
  m3_tunedb_free(db);
  m3_jit_close(&j);
  fprintf(stderr, "readonly_cache: warning was: %s", logbuf);
  return 0;
}

START_TEST(readonly_cache) {
  fresh_cache();
  int rc = run_child(readonly_child, "readonly_cache");
  ck_assert_msg(rc == 0 || rc == 77, "readonly_cache child failed (%d)", rc);
  chmod(dir, 0755);
  rm_rf(dir);
}
END_TEST

/* ---- 4. full disk -------------------------------------------------------------- */

/* A 64 KiB tmpfs filled to the last byte (ENOSPC), or - where mounting is not
 * permitted - RLIMIT_FSIZE (EFBIG, the same write failure).
 * Protection: m3_write_atomic removes its temp file on a failed write and
 * leaves the published file untouched; jit.c then continues uncached with a
 * warning; save_merge returns M3_IO and the old DB stays intact; once space
 * is back the cache fills normally.
 * Verified to fail without it, one change at a time: without the unlink(tmp)
 * on error in m3_write_atomic, "a temp file is left in .../cubin/sm_90";
 * renaming whatever was written regardless of the write status, "old DB
 * intact: M3_FORMAT ...: empty file"; with jit.c turning the failed store
 * into an error, "build on a full disk: ...: No space left on device". */
static int fill_fs(const char *path) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return -1;
  char blk[4096];
  memset(blk, 'x', sizeof blk);
  size_t n = sizeof blk;
  for (;;) { /* large blocks, then smaller: every byte of the fs */
    ssize_t w = write(fd, blk, n);
    if (w > 0) continue;
    if (n == 1) break;
    n /= 2;
  }
  close(fd);
  return 0;
}

static int fulldisk_child(void) {
  int mounted = private_mounts() == 0 && mount("tmpfs", dir, "tmpfs", 0, "size=1m") /* room for one cubin (~60 KB) once the filler is gone */ == 0, merr = errno;
  const char *how = "ENOSPC";
  char tpath[320], tdir[300], cdir[300], filler[300];
  snprintf(tdir, sizeof tdir, "%s/tuning", dir);
  snprintf(tpath, sizeof tpath, "%s/sm_90.json", tdir);
  snprintf(cdir, sizeof cdir, "%s/cubin/sm_90", dir);
  snprintf(filler, sizeof filler, "%s/filler", dir);
  m3_err e;
  m3_jit j;
  m3_cubin c;
  CHILD_CHECK(m3_jit_open(&j, &e) == M3_OK, "%s", e.msg);
  CHILD_CHECK(put_and_save(tpath, "full(a=1)", 2, &e) == M3_OK, "%s", e.msg);
  CHILD_CHECK(m3_mkdirs(cdir, &e) == M3_OK, "%s", e.msg);
  if (mounted) {
    CHILD_CHECK(fill_fs(filler) == 0, "fill");
  } else {
    how = "EFBIG (RLIMIT_FSIZE)";
    printf("full_disk: mount not permitted (%s): emulated with RLIMIT_FSIZE\n", strerror(merr));
    signal(SIGXFSZ, SIG_IGN); /* the write then fails with EFBIG instead */
    struct rlimit rl;
    getrlimit(RLIMIT_FSIZE, &rl);
    rl.rlim_cur = 512; /* soft limit only, so it can be lifted again */
    CHILD_CHECK(setrlimit(RLIMIT_FSIZE, &rl) == 0, "setrlimit");
  }
  m3_log_set(capture, NULL);
  logbuf[0] = 0;
  CHILD_CHECK(build_key(&j, 0, &c, &e) == 0 && c.size > 0 && !c.hit, "build on a full disk: %s", e.msg);
  m3_cubin_free(&c);
  CHILD_CHECK(j.uncached == 1 && strstr(logbuf, "continuing uncached") &&
                  (strstr(logbuf, "No space left on device") || strstr(logbuf, "File too large")),
              "%s: warning '%s'", how, logbuf);
  CHILD_CHECK(count_tmp(cdir) == 0, "a temp file is left in %s", cdir);
  m3_status s = put_and_save(tpath, "full2(a=1)", 40, &e);
  CHILD_CHECK(s == M3_IO && strstr(e.msg, "sm_90.json"), "DB save on a full disk: %s %s", m3_status_name(s), e.msg);
  CHILD_CHECK(count_tmp(tdir) == 0, "a temp file is left in %s", tdir);
  m3_tunedb *db = m3_tunedb_new();
  s = m3_tunedb_load(db, tpath, NULL, NULL, NULL, &e);
  CHILD_CHECK(s == M3_OK && m3_tunedb_count(db) == 2, "old DB intact: %s %s", m3_status_name(s), e.msg);
  m3_tunedb_free(db);
  /* Space comes back: the cache works again. */
  if (mounted) unlink(filler);
  else {
    struct rlimit rl;
    getrlimit(RLIMIT_FSIZE, &rl);
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_FSIZE, &rl);
  }
  CHILD_CHECK(build_key(&j, 0, &c, &e) == 0, "%s", e.msg);
  m3_cubin_free(&c);
  CHILD_CHECK(build_key(&j, 0, &c, &e) == 0 && c.hit, "cached once space is back");
  m3_cubin_free(&c);
  m3_jit_close(&j);
  fprintf(stderr, "full_disk (%s): warning was: %s", how, logbuf);
  return 0;
}

START_TEST(full_disk) {
  fresh_cache();
  int rc = run_child(fulldisk_child, "full_disk");
  ck_assert_msg(rc == 0 || rc == 77, "full_disk child failed (%d)", rc);
  rm_rf(dir);
}
END_TEST

/* ---- 5. eight processes at once ------------------------------------------------ */

/* Protection: the per-entry lock with a re-check after taking it (jit.c) and
 * the DB lock with re-read-merge under it (tunedb.c).  Eight processes start
 * together (a pipe releases them), each builds all four keys in its own order
 * and saves ten records one save at a time.  Checked: NVRTC ran exactly once
 * per key in all, every process got identical bytes, four valid entries, and
 * all 80 records are in the DB (no lost update).
 * Verified to fail without it, one change at a time: with m3_lock removed
 * from m3_tunedb_save_merge the DB ended with 59 of the 80 records; with the
 * re-check after the lock removed from m3_jit_build, 11 compiles; with the
 * jit's lock removed, 14 compiles (instead of 4). */
START_TEST(eight_processes) {
  fresh_cache();
  char tpath[320];
  snprintf(tpath, sizeof tpath, "%s/tuning/sm_90.json", dir);
  int go[2];
  ck_assert_int_eq(pipe(go), 0);
  int res[8][2];
  pid_t pids[8];
  for (int p = 0; p < 8; p++) {
    ck_assert_int_eq(pipe(res[p]), 0);
    pids[p] = fork();
    ck_assert_int_ge(pids[p], 0);
    if (pids[p] == 0) {
      close(go[1]);
      char c;
      long out[1 + NKEYS] = {-1};
      m3_jit j;
      m3_err e;
      if (m3_jit_open(&j, &e) != M3_OK) _exit(2);
      if (read(go[0], &c, 1) != 0) _exit(2); /* EOF = everyone go */
      long c0 = m3_nvrtc_compile_count();
      for (int i = 0; i < NKEYS; i++) {
        int k = (i + p) % NKEYS;
        m3_cubin cb;
        if (build_key(&j, k, &cb, &e) != 0) _exit(3);
        out[1 + k] = (long)(cb.size ^ ((size_t)cb.data[cb.size / 2] << 32));
        m3_cubin_free(&cb);
      }
      out[0] = m3_nvrtc_compile_count() - c0;
      char key[32];
      snprintf(key, sizeof key, "proc%d(a=1)", p);
      int rc = saver(tpath, key, 10, -1);
      if (rc) _exit(rc);
      if (write(res[p][1], out, sizeof out) != sizeof out) _exit(4);
      _exit(0);
    }
    close(res[p][1]);
  }
  close(go[0]);
  close(go[1]); /* release all eight at once */
  long compiles = 0, sig[NKEYS];
  for (int p = 0; p < 8; p++) {
    long out[1 + NKEYS];
    ssize_t n = read(res[p][0], out, sizeof out);
    close(res[p][0]);
    int st;
    waitpid(pids[p], &st, 0);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "process %d failed (%d)", p, WEXITSTATUS(st));
    ck_assert_int_eq(n, (ssize_t)sizeof out);
    compiles += out[0];
    for (int k = 0; k < NKEYS; k++) {
      if (p == 0) sig[k] = out[1 + k];
      ck_assert_msg(sig[k] == out[1 + k], "process %d got other bytes for key %d", p, k);
    }
  }
  ck_assert_int_eq(compiles, NKEYS);
  m3_jit j;
  m3_err e;
  ck_assert_int_eq(m3_jit_open(&j, &e), M3_OK);
  compute_expected(&j);
  ck_assert_int_eq(check_cubin_dir(), NKEYS);
  m3_jit_close(&j);
  m3_tunedb *db = load_ok(tpath);
  ck_assert_int_eq(m3_tunedb_count(db), 80);
  for (int p = 0; p < 8; p++) {
    char key[32];
    snprintf(key, sizeof key, "proc%d(a=1)", p);
    for (int i = 0; i < 10; i++) ck_assert_msg(has_rec(db, key, i), "lost update: %s tokens=%d", key, i);
  }
  m3_tunedb_free(db);
  rm_rf(dir);
}
END_TEST

/* ---- 6. entries of another NVRTC or driver ------------------------------------ */

/* Protection: the key text names the NVRTC and driver versions, the file name
 * hashes it, and load compares the stored key text.  Checked at both levels:
 * m3_cubin_key/m3_cubin_load (another version is another file; the foreign
 * entry copied over ours is refused as M3_CORRUPT, never returned), and
 * m3_jit_build (a process with another NVRTC or driver rebuilds instead of
 * hitting, and the entries coexist).
 * Verified to fail without it, one change at a time: with the NVRTC version
 * (or the driver version) left out of the key text in m3_cubin_key, the two
 * hashes are equal ("h_ours == h_nvrtc"); with m3_cubin_load's key-text
 * comparison removed, the foreign entry under our name loads (M3_OK). */
START_TEST(foreign_versions_ignored) {
  fresh_cache();
  m3_err e;
  char *k_ours, *k_nvrtc, *k_drv, h_ours[33], h_nvrtc[33], h_drv[33];
  const char *src = "extern \"C\" __global__ void f() {}\n", *opts = "--gpu-architecture=sm_90";
  ck_assert_int_eq(m3_cubin_key("k(a=1)[t=1]@sm_90", src, "sm_90", opts, 12040, 550, &k_ours, h_ours, &e), M3_OK);
  ck_assert_int_eq(m3_cubin_key("k(a=1)[t=1]@sm_90", src, "sm_90", opts, 12080, 550, &k_nvrtc, h_nvrtc, &e), M3_OK);
  ck_assert_int_eq(m3_cubin_key("k(a=1)[t=1]@sm_90", src, "sm_90", opts, 12040, 560, &k_drv, h_drv, &e), M3_OK);
  ck_assert_str_ne(h_ours, h_nvrtc);
  ck_assert_str_ne(h_ours, h_drv);
  char p_ours[4400], p_nvrtc[4400], p_drv[4400], sub[256];
  snprintf(sub, sizeof sub, "%s/cubin/sm_90", dir);
  ck_assert_int_eq(m3_mkdirs(sub, &e), M3_OK);
  m3_cubin_path(dir, "sm_90", h_ours, p_ours, sizeof p_ours);
  m3_cubin_path(dir, "sm_90", h_nvrtc, p_nvrtc, sizeof p_nvrtc);
  m3_cubin_path(dir, "sm_90", h_drv, p_drv, sizeof p_drv);
  uint8_t fake[64] = {0x7f, 'E', 'L', 'F'};
  m3_cubin_meta m = {"f", 32, 0};
  ck_assert_int_eq(m3_cubin_store(p_nvrtc, k_nvrtc, fake, sizeof fake, &m, &e), M3_OK);
  ck_assert_int_eq(m3_cubin_store(p_drv, k_drv, fake, sizeof fake, &m, &e), M3_OK);
  uint8_t *c;
  size_t n;
  m3_cubin_meta mm;
  /* Our key: no entry of ours exists, the foreign ones are other files. */
  ck_assert_int_eq(m3_cubin_load(p_ours, k_ours, &c, &n, &mm, &e), M3_NOTFOUND);
  /* A foreign entry under our name (copied caches, a collision): refused. */
  for (int f = 0; f < 2; f++) {
    uint8_t *d;
    size_t dn;
    ck_assert_int_eq(m3_read_file(f ? p_drv : p_nvrtc, &d, &dn, &e), M3_OK);
    ck_assert_int_eq(m3_write_atomic(p_ours, d, dn, &e), M3_OK);
    free(d);
    ck_assert_int_eq(m3_cubin_load(p_ours, k_ours, &c, &n, &mm, &e), M3_CORRUPT);
    ck_assert_ptr_null(c);
    ck_assert_msg(strstr(e.msg, "stored key text differs"), "%s", e.msg);
  }
  free(k_ours);
  free(k_nvrtc);
  free(k_drv);

  /* Through the JIT: the same variant under another NVRTC, then another
   * driver, is rebuilt, never taken from the other version's entry. */
  rm_rf(dir);
  fresh_cache();
  m3_jit j;
  ck_assert_int_eq(m3_jit_open(&j, &e), M3_OK);
  m3_cubin cb;
  ck_assert_int_eq(build_key(&j, 0, &cb, &e), 0);
  ck_assert_int_eq(cb.hit, 0);
  m3_cubin_free(&cb);
  int nv = j.nvrtc_version, dv = j.driver_version;
  j.nvrtc_version = nv + 10;
  ck_assert_int_eq(build_key(&j, 0, &cb, &e), 0);
  ck_assert_msg(cb.hit == 0, "an entry of NVRTC %d was loaded by NVRTC %d", nv, nv + 10);
  m3_cubin_free(&cb);
  j.nvrtc_version = nv;
  j.driver_version = dv + 1;
  ck_assert_int_eq(build_key(&j, 0, &cb, &e), 0);
  ck_assert_msg(cb.hit == 0, "an entry of driver %d was loaded by driver %d", dv, dv + 1);
  m3_cubin_free(&cb);
  j.driver_version = dv;
  ck_assert_int_eq(build_key(&j, 0, &cb, &e), 0);
  ck_assert_int_eq(cb.hit, 1); /* our own entry is still there and still ours */
  m3_cubin_free(&cb);
  ck_assert_int_eq(j.corrupt, 0);
  ck_assert_int_eq(j.builds, 3);
  m3_jit_close(&j);
  rm_rf(dir);
}
END_TEST

/* One case per test, so CK_RUN_CASE=kill_during_jit_publish runs just one. */
static void add(Suite *s, const char *name, const TTest *t) {
  TCase *tc = tcase_create(name);
  tcase_set_timeout(tc, 900);
  tcase_add_test(tc, t);
  suite_add_tcase(s, tc);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  Suite *s = suite_create("faults");
  add(s, "foreign_versions_ignored", foreign_versions_ignored);
  add(s, "readonly_cache", readonly_cache);
  add(s, "full_disk", full_disk);
  add(s, "eight_processes", eight_processes);
  add(s, "kill_during_tunedb_save", kill_during_tunedb_save);
  add(s, "kill_during_jit_publish", kill_during_jit_publish);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
