/* st_dump.c - test driver that writes a random checkpoint with m3_ckpt_write
 * and dumps what m3_st_open reads back, so tests/st_crosscheck.py can compare
 * it with the official Python `safetensors` package.  It stands in for
 * `m3kit make-checkpoint` until the CLI is wired.
 *
 *   st_dump write DIR [--preset NAME] [--shards N] [--mxfp8] [--seed S] [--layers L]
 *   st_dump dump PATH      one line per tensor: name TAB dtype TAB d0,d1,.. TAB nbytes TAB crc32
 *   st_dump                (as an automake test) runs $srcdir/tests/st_crosscheck.py on itself
 *
 * --layers L keeps the first L layers of the preset (the lists are cut to
 * match), for a quick checkpoint with both layer kinds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/ckpt_write.h"
#include "runtime/config.h"
#include "runtime/safetensors.h"

/* zlib's CRC-32 (same as Python's zlib.crc32). */
static uint32_t crc32_bytes(const uint8_t *p, uint64_t n) {
  static uint32_t tab[256];
  if (!tab[1])
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
      tab[i] = c;
    }
  uint32_t c = 0xffffffffu;
  for (uint64_t i = 0; i < n; i++) c = tab[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

static int fail(m3_status s, const m3_err *e) {
  fprintf(stderr, "st_dump: %s: %s\n", m3_status_name(s), e->msg);
  return 1;
}

static int do_write(int argc, char **argv) {
  const char *dir = argv[0], *preset = "tiny";
  int shards = 2, mxfp8 = 0, layers = 0;
  uint64_t seed = 1;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--preset") && i + 1 < argc) preset = argv[++i];
    else if (!strcmp(argv[i], "--shards") && i + 1 < argc) shards = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 0);
    else if (!strcmp(argv[i], "--layers") && i + 1 < argc) layers = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--mxfp8")) mxfp8 = 1;
    else {
      fprintf(stderr, "st_dump write: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  m3_config c;
  m3_err e = {0};
  m3_status s = m3_config_preset(preset, &c, &e);
  if (s != M3_OK) return fail(s, &e);
  if (layers > 0 && layers < c.num_hidden_layers) c.num_hidden_layers = layers;
  s = m3_ckpt_write(&c, dir, shards, mxfp8, seed, &e);
  return s == M3_OK ? 0 : fail(s, &e);
}

static int do_dump(const char *path) {
  m3_st *st;
  m3_err e = {0};
  m3_status s = m3_st_open(path, &st, &e);
  if (s != M3_OK) return fail(s, &e);
  for (size_t i = 0; i < m3_st_count(st); i++) {
    const m3_st_tensor *t = m3_st_at(st, i);
    printf("%s\t%s\t", t->name, m3_dtype_name(t->dtype));
    for (int d = 0; d < t->ndim; d++) printf("%s%lld", d ? "," : "", (long long)t->shape[d]);
    const char *f = strrchr(t->file, '/');
    printf("\t%llu\t%08x\t%s\n", (unsigned long long)t->nbytes, crc32_bytes(t->data, t->nbytes),
           f ? f + 1 : t->file);
  }
  for (size_t i = 0; i < m3_st_n_warnings(st); i++) fprintf(stderr, "warning: %s\n", m3_st_warning(st, i));
  m3_st_close(st);
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 3 && !strcmp(argv[1], "write")) return do_write(argc - 2, argv + 2);
  if (argc == 3 && !strcmp(argv[1], "dump")) return do_dump(argv[2]);
  if (argc == 1) {
    /* Under `make check`: hand over to the Python cross-check (77 = skip when
     * python3 or the safetensors package is missing). */
    const char *srcdir = getenv("srcdir");
    char script[4096];
    snprintf(script, sizeof script, "%s/tests/st_crosscheck.py", srcdir ? srcdir : ".");
    execlp("python3", "python3", script, argv[0], (char *)NULL);
    fprintf(stderr, "st_dump: cannot run python3: skipping the cross-check\n");
    return 77;
  }
  fprintf(stderr, "usage: st_dump write DIR [--preset P] [--shards N] [--mxfp8] [--seed S] [--layers L]\n"
                  "       st_dump dump PATH\n");
  return 2;
}
