/* st_check.h - the promises of an opened checkpoint (runtime/safetensors.h),
 * checked on every input the reader accepts: both safetensors harnesses use
 * it.  Every byte of every tensor is read, so an offset that escapes its file
 * faults (or trips ASan) here instead of in a weight upload days later. */
#ifndef M3_FUZZ_ST_CHECK_H
#define M3_FUZZ_ST_CHECK_H

#include <sys/stat.h>

#include "fuzz/fuzz.h"
#include "runtime/safetensors.h"

static inline int fuzz_span_cmp(const void *a, const void *b) {
  const m3_st_tensor *x = *(const m3_st_tensor *const *)a, *y = *(const m3_st_tensor *const *)b;
  if (x->file != y->file) return strcmp(x->file, y->file);
  return x->file_offset < y->file_offset ? -1 : x->file_offset > y->file_offset;
}

static inline void fuzz_check_st(const m3_st *st) {
  size_t n = m3_st_count(st);
  const m3_st_tensor **byoff = malloc((n ? n : 1) * sizeof *byoff);
  if (!byoff) abort();
  volatile uint8_t sink = 0;
  for (size_t i = 0; i < n; i++) {
    const m3_st_tensor *t = m3_st_at(st, i);
    FUZZ_CHECK(t && t->name && t->file, "tensor %zu", i);
    FUZZ_CHECK(m3_st_find(st, t->name) == t, "find('%s')", t->name);
    if (i) FUZZ_CHECK(strcmp(m3_st_at(st, i - 1)->name, t->name) < 0, "sorted, unique names");
    FUZZ_CHECK(t->ndim >= 0 && t->ndim <= M3_ST_MAX_DIMS, "ndim %d", t->ndim);
    uint64_t numel = 1;
    for (int d = 0; d < t->ndim; d++) {
      FUZZ_CHECK(t->shape[d] >= 0, "shape[%d]", d);
      numel *= (uint64_t)t->shape[d]; /* no overflow: the reader rejected that */
    }
    FUZZ_CHECK(numel == t->numel, "numel of '%s'", t->name);
    FUZZ_CHECK(t->nbytes == t->numel * m3_dtype_size(t->dtype), "nbytes of '%s'", t->name);
    struct stat sb;
    FUZZ_CHECK(stat(t->file, &sb) == 0, "file of '%s'", t->name);
    FUZZ_CHECK(t->file_offset >= 8 && t->file_offset + t->nbytes <= (uint64_t)sb.st_size,
               "'%s' [%llu, +%llu) inside %lld bytes", t->name, (unsigned long long)t->file_offset,
               (unsigned long long)t->nbytes, (long long)sb.st_size);
    const uint8_t *p = t->data;
    for (uint64_t b = 0; b < t->nbytes; b++) sink ^= p[b];
    /* The conversion path reads with byte loads only (unaligned data); UBSan's
     * alignment check would flag a typed load here. */
    if (t->numel <= (1u << 20)) {
      float *f = malloc((size_t)(t->numel ? t->numel : 1) * sizeof *f);
      if (!f) abort();
      m3_err e;
      m3_status s = m3_st_to_f32(t, f, (size_t)t->numel, &e);
      FUZZ_CHECK(s == M3_OK || s == M3_UNSUPPORTED, "to_f32 of '%s': %s", t->name, e.msg);
      uint8_t small[16];
      s = m3_st_copy(t, small, sizeof small, &e);
      FUZZ_CHECK((s == M3_OK) == (t->nbytes <= sizeof small), "copy of '%s'", t->name);
      free(f);
    }
    byoff[i] = t;
  }
  /* No two non-empty tensors of one file share a byte. */
  qsort(byoff, n, sizeof *byoff, fuzz_span_cmp);
  for (size_t i = 1; i < n; i++) {
    const m3_st_tensor *a = byoff[i - 1], *b = byoff[i];
    if (a->file == b->file && a->nbytes && b->nbytes)
      FUZZ_CHECK(a->file_offset + a->nbytes <= b->file_offset, "'%s' overlaps '%s'", a->name, b->name);
  }
  free(byoff);
  for (size_t i = 0; i < m3_st_n_warnings(st); i++) FUZZ_CHECK(m3_st_warning(st, i) != NULL, "warning %zu", i);
  FUZZ_CHECK(m3_st_n_files(st) >= 1 && m3_st_file(st, 0), "files");
  (void)m3_st_metadata(st, "format");
  (void)sink;
}

#endif
