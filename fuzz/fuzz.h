/* fuzz.h - what every fuzz harness shares: a private scratch directory on a
 * RAM file system, writing the input there, and the fixed identities the seed
 * writer (fuzz/make_seeds.c) and the harnesses must agree on.
 *
 * Each harness defines LLVMFuzzerTestOneInput and is linked either with
 * libFuzzer (`./configure CC=clang --enable-fuzz`, `make fuzz`) or with
 * fuzz/standalone_main.c, which replays files (`make check`, any compiler).
 * Harnesses must be deterministic, leak-free and quiet: the parsers report
 * through m3_err, and a harness only abort()s when an invariant the API
 * promises is broken - that abort is the finding.
 *
 * The parsers under test read files, not buffers (mmap for safetensors,
 * m3_read_file for the rest), and the brief is not to restructure them, so
 * the input is written to a file first.  /dev/shm keeps that at memory speed
 * (thousands of executions per second under ASan); $TMPDIR is the fallback.
 */
#ifndef M3_FUZZ_H
#define M3_FUZZ_H

#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/status.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A harness invariant: abort (libFuzzer records the input as a crash) with a
 * message naming the broken promise.  Not assert(): it must survive -DNDEBUG. */
#define FUZZ_CHECK(cond, ...)                                   \
  do {                                                          \
    if (!(cond)) {                                              \
      fprintf(stderr, "fuzz invariant failed: %s: ", #cond);   \
      fprintf(stderr, __VA_ARGS__);                             \
      fputc('\n', stderr);                                      \
      abort();                                                  \
    }                                                           \
  } while (0)

/* The scratch directory of this process, created on first use and removed at
 * exit.  One per process, so libFuzzer's -jobs/-fork workers never share. */
static char fuzz_dir_buf[256];

static inline void fuzz_rm_tree_files(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *de;
  char p[600];
  while ((de = readdir(d))) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    if (snprintf(p, sizeof p, "%s/%s", dir, de->d_name) >= (int)sizeof p) continue;
    struct stat st;
    if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) {
      fuzz_rm_tree_files(p);
      rmdir(p);
    } else {
      unlink(p);
    }
  }
  closedir(d);
}

static inline void fuzz_dir_cleanup(void) {
  if (fuzz_dir_buf[0]) {
    fuzz_rm_tree_files(fuzz_dir_buf);
    rmdir(fuzz_dir_buf);
  }
}

static inline const char *fuzz_dir(void) {
  if (fuzz_dir_buf[0]) return fuzz_dir_buf;
  struct stat st;
  const char *base = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0
                         ? "/dev/shm"
                         : (getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  snprintf(fuzz_dir_buf, sizeof fuzz_dir_buf, "%s/m3fuzz-XXXXXX", base);
  if (!mkdtemp(fuzz_dir_buf)) {
    perror("fuzz: mkdtemp");
    abort();
  }
  atexit(fuzz_dir_cleanup);
  return fuzz_dir_buf;
}

/* Empty the scratch directory between inputs (a previous input's shard must
 * not satisfy this input's index). */
static inline void fuzz_dir_clear(void) { fuzz_rm_tree_files(fuzz_dir()); }

/* Write `n` bytes to <scratch>/<name>; the path goes to buf. */
static inline void fuzz_write(const char *name, const void *data, size_t n, char *buf, size_t bn) {
  snprintf(buf, bn, "%s/%s", fuzz_dir(), name);
  int fd = open(buf, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    perror(buf);
    abort();
  }
  const uint8_t *p = data;
  while (n) {
    ssize_t w = write(fd, p, n);
    if (w <= 0) {
      perror(buf);
      abort();
    }
    p += w;
    n -= (size_t)w;
  }
  close(fd);
}

/* A NUL-terminated copy (the text parsers take C strings; an embedded NUL
 * simply ends the text, as it would for a file read by m3_read_file). */
static inline char *fuzz_strndup(const uint8_t *data, size_t n) {
  char *s = malloc(n + 1);
  if (!s) abort();
  memcpy(s, data, n);
  s[n] = 0;
  return s;
}

/* M3KIT_FUZZ_VERBOSE=1: each harness prints what the parser said, so a
 * replay shows which seeds are accepted and why the others are refused. */
static inline void fuzz_note(const char *what, m3_status s, const char *msg) {
  static int verbose = -1;
  if (verbose < 0) verbose = getenv("M3KIT_FUZZ_VERBOSE") && *getenv("M3KIT_FUZZ_VERBOSE");
  if (verbose) fprintf(stderr, "%s: %s%s%.300s\n", what, m3_status_name(s), s ? ": " : "", s ? msg : "");
}

/* ---- identities shared with fuzz/make_seeds.c ---------------------------- */

/* Multi-file inputs (fuzz_st_index): part 0 is the index text, every later
 * part starts with this marker, then a file name up to '\n', then the file's
 * bytes.  A marker rather than length prefixes, so that the fuzzer's byte
 * insertions inside the JSON keep the rest of the input aligned. */
#define FUZZ_PART_MARK "\n--M3FZ:"

/* The key text of every cubin seed entry and of every load in fuzz_cubin:
 * the harness can only reach past the key check with the key it was given. */
#define FUZZ_CUBIN_VARIANT \
  "qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=e4m3,nq=64,nkv=4,niq=4,hd=128,rot=64,bs=128)[warps=4,hpw=1,lph=32,rope=pair]@sm_90"
#define FUZZ_CUBIN_SOURCE "extern \"C\" __global__ void m3k_fuzz(int *p) { *p = 1; }\n"
#define FUZZ_CUBIN_OPTIONS "--gpu-architecture=sm_90 -default-device -std=c++17"
#define FUZZ_CUBIN_NVRTC 12040
#define FUZZ_CUBIN_DRIVER 0

/* Template hashes the tunedb harness's filter accepts; the seed DB uses them. */
#define FUZZ_TPL_HASH "0123456789abcdef"

#endif
