/* cubin_cache.c - entry encoding and verification (see cubin_cache.h).  The
 * get-or-build policy (locking, NO_JIT, rebuild of corrupt entries) lives in
 * runtime/jit.c; this file only turns entries into bytes and back. */
#include "cache/cubin_cache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "cache/store.h"

static const char magic[8] = {'M', '3', 'K', 'C', 'U', 'B', 'I', 'N'};

m3_status m3_cubin_key(const char *variant_key, const char *source, const char *arch,
                       const char *options, int nvrtc_version, int driver_version, char **keytext,
                       char hex[33], m3_err *e) {
  XXH128_hash_t sh = XXH3_128bits(source, strlen(source));
  char drv[32];
  if (driver_version > 0) snprintf(drv, sizeof drv, "%d", driver_version);
  else snprintf(drv, sizeof drv, "none");
  size_t n = strlen(variant_key) + strlen(options) + 512;
  char *k = malloc(n);
  if (!k) return m3_errf(e, M3_NOMEM, "cubin key");
  snprintf(k, n,
           "format=m3kit-cubin-%d\nkey=%s\narch=%s\nnvrtc=%d\ndriver=%s\noptions=%s\n"
           "source_xxh128=%016llx%016llx\nsource_len=%zu\n",
           M3_CUBIN_FORMAT, variant_key, arch, nvrtc_version, drv, options,
           (unsigned long long)sh.high64, (unsigned long long)sh.low64, strlen(source));
  XXH128_hash_t h = XXH3_128bits(k, strlen(k));
  snprintf(hex, 33, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
  *keytext = k;
  return M3_OK;
}

void m3_cubin_path(const char *root, const char *arch, const char *hex, char *buf, size_t n) {
  snprintf(buf, n, "%s/cubin/%s/%s.cubin", root, arch, hex);
}

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

m3_status m3_cubin_store(const char *path, const char *keytext, const uint8_t *cubin, size_t size,
                         const m3_cubin_meta *meta, m3_err *e) {
  char metatext[256];
  snprintf(metatext, sizeof metatext, "entry=%s\nthreads=%d\nsmem=%d\n", meta->entry, meta->threads,
           meta->smem);
  size_t hl = strlen(keytext) + strlen(metatext);
  size_t total = 8 + 4 + 4 + hl + 8 + size + 8;
  uint8_t *buf = malloc(total), *p = buf;
  if (!buf) return m3_errf(e, M3_NOMEM, "cubin entry of %zu bytes", total);
  memcpy(p, magic, 8);
  p += 8;
  put_u32(p, M3_CUBIN_FORMAT);
  p += 4;
  put_u32(p, (uint32_t)hl);
  p += 4;
  memcpy(p, keytext, strlen(keytext));
  p += strlen(keytext);
  memcpy(p, metatext, strlen(metatext));
  p += strlen(metatext);
  put_u64(p, size);
  p += 8;
  memcpy(p, cubin, size);
  p += size;
  put_u64(p, XXH64(buf, (size_t)(p - buf), 0));
  m3_status s = m3_write_atomic(path, buf, total, e);
  free(buf);
  return s;
}

static int meta_line(const char *text, const char *name, char *out, size_t n) {
  char pat[40];
  snprintf(pat, sizeof pat, "\n%s=", name);
  const char *p = strstr(text, pat);
  if (!p) return 0;
  p += strlen(pat);
  size_t l = strcspn(p, "\n");
  if (l >= n) return 0;
  memcpy(out, p, l);
  out[l] = 0;
  return 1;
}

/* A metadata number: decimal digits only, at most 9 of them (so no int
 * overflow), as m3_cubin_store writes it.  atoi() accepted "128junk" and
 * wrapped "4294967424" to 128, loading an entry under a launch configuration
 * its text does not say.  Found by fuzz/fuzz_cubin.c; regression inputs
 * fuzz/corpus/cubin/regress-threads-*.cubin. */
static int meta_int(const char *s, int *out) {
  size_t n = strlen(s);
  if (n == 0 || n > 9 || strspn(s, "0123456789") != n) return 0;
  *out = (int)strtol(s, NULL, 10);
  return 1;
}

m3_status m3_cubin_load(const char *path, const char *keytext, uint8_t **cubin, size_t *size,
                        m3_cubin_meta *meta, m3_err *e) {
  *cubin = NULL;
  *size = 0;
  uint8_t *d;
  size_t n;
  M3_TRY(m3_read_file(path, &d, &n, e));
  m3_status s = M3_OK;
  const char *why = NULL;
  uint32_t hl = 0;
  uint64_t cs = 0;
  if (n < 8 + 4 + 4 + 8 + 8) why = "shorter than the fixed header (truncated)";
  else if (memcmp(d, magic, 8)) why = "bad magic";
  else if (get_u32(d + 8) != M3_CUBIN_FORMAT) why = "other cache format version";
  else if ((hl = get_u32(d + 12)) > n - 32) why = "header length past end of file (truncated)";
  else if ((cs = get_u64(d + 16 + hl)) > n - 32 - hl) why = "cubin size past end of file (truncated)";
  else if (16 + hl + 8 + cs + 8 != n) why = "file size does not match its header (truncated or appended)";
  else if (get_u64(d + n - 8) != XXH64(d, n - 8, 0)) why = "checksum mismatch";
  else if (cs == 0) why = "empty cubin";
  if (!why) {
    size_t kl = strlen(keytext);
    if (kl > hl || memcmp(d + 16, keytext, kl)) why = "stored key text differs from the requested key (hash collision or foreign entry)";
  }
  if (!why) {
    char *hdr = malloc(hl + 2);
    if (!hdr) {
      free(d);
      return m3_errf(e, M3_NOMEM, "cubin header");
    }
    hdr[0] = '\n';
    memcpy(hdr + 1, d + 16, hl);
    hdr[hl + 1] = 0;
    char th[32], sm[32];
    memset(meta, 0, sizeof *meta);
    if (!meta_line(hdr, "entry", meta->entry, sizeof meta->entry) || !meta_line(hdr, "threads", th, sizeof th) ||
        !meta_line(hdr, "smem", sm, sizeof sm))
      why = "missing launch metadata";
    else if (!meta_int(th, &meta->threads) || !meta_int(sm, &meta->smem) || meta->threads <= 0 ||
             meta->threads > 1024)
      why = "bad launch metadata";
    free(hdr);
  }
  if (why) {
    s = m3_errf(e, M3_CORRUPT, "%s: corrupt cubin cache entry: %s", path, why);
    free(d);
    return s;
  }
  uint8_t *c = malloc(cs);
  if (!c) {
    free(d);
    return m3_errf(e, M3_NOMEM, "cubin of %llu bytes", (unsigned long long)cs);
  }
  memcpy(c, d + 16 + hl + 8, cs);
  free(d);
  *cubin = c;
  *size = cs;
  return M3_OK;
}
