/* standalone_main.c - replay files through a fuzz harness without libFuzzer
 * (LLVM's StandaloneFuzzTargetMain idea), so that any compiler - gcc in CI -
 * runs the committed corpus and every regression input in `make check`.
 *
 *   replay_NAME [FILE|DIR]...   each file is one input; a directory means its
 *                               regular files, in name order
 *   replay_NAME                 (as an automake test) $srcdir/fuzz/corpus/NAME
 *
 * A crash or a broken invariant aborts the program, which fails the test; an
 * empty corpus fails too, so a lost directory is not a silent pass. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz/fuzz.h"

#ifndef FUZZ_NAME
#error "build with -DFUZZ_NAME=\"harness\" (the corpus directory name)"
#endif

/* Optional in a harness, as in libFuzzer. */
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    perror(path);
    return -1;
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  /* An exactly sized heap copy, as libFuzzer passes it: ASan then flags any
   * read one byte past the input. */
  uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
  if (!buf || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
    fprintf(stderr, "%s: read failed\n", path);
    fclose(f);
    free(buf);
    return -1;
  }
  fclose(f);
  LLVMFuzzerTestOneInput(buf, (size_t)n);
  free(buf);
  return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int run_path(const char *path, int *count) {
  struct stat st;
  if (stat(path, &st) != 0) {
    perror(path);
    return -1;
  }
  if (!S_ISDIR(st.st_mode)) {
    if (run_file(path)) return -1;
    ++*count;
    return 0;
  }
  DIR *d = opendir(path);
  if (!d) {
    perror(path);
    return -1;
  }
  char **names = NULL;
  size_t n = 0, cap = 0;
  struct dirent *de;
  while ((de = readdir(d))) {
    if (de->d_name[0] == '.') continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 64;
      names = realloc(names, cap * sizeof *names);
      if (!names) abort();
    }
    size_t l = strlen(path) + strlen(de->d_name) + 2;
    names[n] = malloc(l);
    if (!names[n]) abort();
    snprintf(names[n], l, "%s/%s", path, de->d_name);
    n++;
  }
  closedir(d);
  qsort(names, n, sizeof *names, cmp_str);
  int rc = 0;
  for (size_t i = 0; i < n; i++) {
    if (!rc && stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) {
      if (run_file(names[i])) rc = -1;
      else ++*count;
    }
    free(names[i]);
  }
  free(names);
  return rc;
}

int main(int argc, char **argv) {
  if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
  int count = 0, rc = 0;
  if (argc > 1) {
    for (int i = 1; i < argc && !rc; i++) rc = run_path(argv[i], &count);
  } else {
    const char *src = getenv("srcdir");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/fuzz/corpus/%s", src && *src ? src : ".", FUZZ_NAME);
    rc = run_path(dir, &count);
  }
  if (rc) return 1;
  if (count == 0) {
    fprintf(stderr, "replay_%s: no inputs found\n", FUZZ_NAME);
    return 1;
  }
  printf("replay_%s: %d inputs, no crash\n", FUZZ_NAME, count);
  return 0;
}
