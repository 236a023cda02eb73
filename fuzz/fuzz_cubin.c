/* fuzz_cubin.c - a cubin cache entry file through m3_cubin_load
 * (cache/cubin_cache.c): magic, version, header length, cubin size, checksum,
 * key text, launch metadata.  Every input is tried twice: as given, and with
 * its trailing XXH64 recomputed - otherwise almost every mutation dies at the
 * checksum and the parsing behind it (key match, metadata) is never reached.
 * On success: the cubin is non-empty and lies inside the file, the metadata
 * is in range, and store + load reproduces cubin and metadata exactly. */
#include <xxhash.h>

#include "cache/cubin_cache.h"
#include "fuzz/fuzz.h"

static char *keytext;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  char hex[33];
  m3_err e;
  if (m3_cubin_key(FUZZ_CUBIN_VARIANT, FUZZ_CUBIN_SOURCE, "sm_90", FUZZ_CUBIN_OPTIONS, FUZZ_CUBIN_NVRTC,
                   FUZZ_CUBIN_DRIVER, &keytext, hex, &e) != M3_OK)
    abort();
  return 0;
}

static void one(const uint8_t *data, size_t size) {
  char path[600], again[600];
  fuzz_write("entry.cubin", data, size, path, sizeof path);
  uint8_t *cubin = NULL;
  size_t n = 0;
  m3_cubin_meta meta;
  m3_err e = {0};
  m3_status s = m3_cubin_load(path, keytext, &cubin, &n, &meta, &e);
  fuzz_note("cubin", s, e.msg);
  if (s != M3_OK) {
    FUZZ_CHECK(s == M3_CORRUPT, "status %s: %s", m3_status_name(s), e.msg);
    FUZZ_CHECK(cubin == NULL && n == 0 && e.msg[0], "failed load left output or no message");
    return;
  }
  FUZZ_CHECK(cubin && n > 0 && n < size, "cubin of %zu bytes from a %zu-byte file", n, size);
  FUZZ_CHECK(meta.threads > 0 && meta.threads <= 1024 && meta.smem >= 0, "metadata %d/%d", meta.threads, meta.smem);
  FUZZ_CHECK(memchr(meta.entry, 0, sizeof meta.entry) && !strchr(meta.entry, '\n'), "entry name");
  FUZZ_CHECK(memmem(data, size, cubin, n) != NULL, "cubin bytes are not from the file");
  /* The numbers are the text's numbers: "threads=128junk" or a value that
   * wraps around int must not load as some other launch configuration. */
  uint32_t hl = 0;
  for (int i = 0; i < 4; i++) hl |= (uint32_t)data[12 + i] << (8 * i);
  char *hdr = malloc((size_t)hl + 2);
  if (!hdr) abort();
  hdr[0] = '\n';
  memcpy(hdr + 1, data + 16, hl);
  hdr[hl + 1] = 0;
  static const char *const fields[] = {"\nthreads=", "\nsmem="};
  int vals[] = {meta.threads, meta.smem};
  for (int f = 0; f < 2; f++) {
    const char *v = strstr(hdr, fields[f]);
    FUZZ_CHECK(v, "%s missing from an accepted entry", fields[f] + 1);
    v += strlen(fields[f]);
    /* Digits only (leading zeros are the same number), equal in value. */
    size_t len = strcspn(v, "\n");
    char *end;
    long x = strtol(v, &end, 10);
    FUZZ_CHECK(len > 0 && strspn(v, "0123456789") == len && end == v + len && x == vals[f],
               "%s'%.*s' loaded as %d", fields[f] + 1, (int)len, v, vals[f]);
  }
  free(hdr);
  snprintf(again, sizeof again, "%s/again.cubin", fuzz_dir());
  s = m3_cubin_store(again, keytext, cubin, n, &meta, &e);
  FUZZ_CHECK(s == M3_OK, "store: %s", e.msg);
  uint8_t *c2;
  size_t n2;
  m3_cubin_meta m2;
  s = m3_cubin_load(again, keytext, &c2, &n2, &m2, &e);
  FUZZ_CHECK(s == M3_OK, "load of our own entry: %s", e.msg);
  FUZZ_CHECK(n2 == n && !memcmp(c2, cubin, n), "cubin changed through store + load");
  FUZZ_CHECK(!strcmp(m2.entry, meta.entry) && m2.threads == meta.threads && m2.smem == meta.smem,
             "metadata changed through store + load: %s/%d/%d vs %s/%d/%d", meta.entry, meta.threads, meta.smem,
             m2.entry, m2.threads, m2.smem);
  free(c2);
  free(cubin);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  one(data, size);
  if (size >= 8) {
    uint8_t *fixed = malloc(size);
    if (!fixed) abort();
    memcpy(fixed, data, size);
    uint64_t h = XXH64(fixed, size - 8, 0);
    for (int i = 0; i < 8; i++) fixed[size - 8 + i] = (uint8_t)(h >> (8 * i));
    one(fixed, size);
    free(fixed);
  }
  return 0;
}
