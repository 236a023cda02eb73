/* safetensors.c - mmap'd, fully validated safetensors reader (see
 * safetensors.h for the format, the checks and the policies).  Separate from
 * the model inventory (ckpt_names.c): this file knows bytes and names, not
 * what an M3 layer needs. */
#include "runtime/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/store.h"
#include "ref/numerics.h"

/* ---- dtypes ------------------------------------------------------------------ */

static const char *const dt_names[] = {
#define M3_X_DT(id, name, size) name,
    M3_DTYPE_MAP(M3_X_DT)
#undef M3_X_DT
};
static const size_t dt_sizes[] = {
#define M3_X_DT(id, name, size) size,
    M3_DTYPE_MAP(M3_X_DT)
#undef M3_X_DT
};
_Static_assert(sizeof dt_names / sizeof *dt_names == M3_DT_COUNT, "dtype table");

const char *m3_dtype_name(m3_dtype d) { return (unsigned)d < M3_DT_COUNT ? dt_names[d] : "?"; }
size_t m3_dtype_size(m3_dtype d) { return (unsigned)d < M3_DT_COUNT ? dt_sizes[d] : 0; }

int m3_dtype_parse(const char *name, m3_dtype *d) {
  for (int i = 0; i < M3_DT_COUNT; i++)
    if (strcmp(name, dt_names[i]) == 0) {
      *d = (m3_dtype)i;
      return 0;
    }
  return -1;
}

/* ---- the handle ---------------------------------------------------------------- */

typedef struct st_file {
  char *path;
  uint8_t *base;     /* mmap of the whole file */
  size_t size;
  json_t *meta;      /* "__metadata__" object or NULL */
} st_file;

struct m3_st {
  st_file *files;
  size_t nfiles, cap_files;
  m3_st_tensor *t;
  size_t nt, cap_t;
  char **warn;
  size_t nwarn, cap_warn;
  char *index_path;
};

void m3_st_close(m3_st *st) {
  if (!st) return;
  for (size_t i = 0; i < st->nfiles; i++) {
    if (st->files[i].base) munmap(st->files[i].base, st->files[i].size);
    json_decref(st->files[i].meta);
    free(st->files[i].path);
  }
  for (size_t i = 0; i < st->nt; i++) free((char *)st->t[i].name);
  for (size_t i = 0; i < st->nwarn; i++) free(st->warn[i]);
  free(st->files);
  free(st->t);
  free(st->warn);
  free(st->index_path);
  free(st);
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t n = *cap ? *cap * 2 : 16;
  while (n < need) n *= 2;
  void *q = realloc(*p, n * elem);
  if (!q) return -1;
  *p = q;
  *cap = n;
  return 0;
}

static m3_status add_warning(m3_st *st, m3_err *e, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static m3_status add_warning(m3_st *st, m3_err *e, const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  char *s = strdup(buf);
  if (!s || grow((void **)&st->warn, &st->cap_warn, st->nwarn + 1, sizeof *st->warn)) {
    free(s);
    return m3_errf(e, M3_NOMEM, "out of memory recording a warning");
  }
  st->warn[st->nwarn++] = s;
  return M3_OK;
}

/* ---- one file -------------------------------------------------------------------- */

/* Read a JSON integer that must be >= 0. */
static int get_u64(const json_t *v, uint64_t *out) {
  if (!json_is_integer(v)) return -1;
  json_int_t x = json_integer_value(v);
  if (x < 0) return -2;
  *out = (uint64_t)x;
  return 0;
}

typedef struct {
  uint64_t begin, end;
  size_t idx; /* into st->t */
} span;

static int span_cmp(const void *a, const void *b) {
  const span *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

/* Parse one tensor entry into *t (name already set).  `p` is the file path. */
static m3_status parse_entry(const char *p, const char *name, const json_t *v, uint64_t data_len,
                             m3_st_tensor *t, uint64_t *begin, m3_err *e) {
  if (!json_is_object(v))
    return m3_errf(e, M3_FORMAT, "%s: tensor '%s': entry is not a JSON object", p, name);
  const json_t *dt = json_object_get(v, "dtype");
  const json_t *sh = json_object_get(v, "shape");
  const json_t *of = json_object_get(v, "data_offsets");
  if (!json_is_string(dt))
    return m3_errf(e, M3_FORMAT, "%s: tensor '%s': dtype missing or not a string", p, name);
  if (m3_dtype_parse(json_string_value(dt), &t->dtype) != 0)
    return m3_errf(e, M3_FORMAT, "%s: tensor '%s': unknown dtype \"%s\"", p, name,
                   json_string_value(dt));
  if (!json_is_array(sh))
    return m3_errf(e, M3_FORMAT, "%s: tensor '%s': shape missing or not an array", p, name);
  if (json_array_size(sh) > M3_ST_MAX_DIMS)
    return m3_errf(e, M3_FORMAT, "%s: tensor '%s': shape has %zu dims (at most %d supported)", p,
                   name, json_array_size(sh), M3_ST_MAX_DIMS);
  t->ndim = (int)json_array_size(sh);
  uint64_t numel = 1;
  int overflow = 0;
  for (int i = 0; i < t->ndim; i++) {
    uint64_t d;
    int r = get_u64(json_array_get(sh, (size_t)i), &d);
    if (r != 0)
      return m3_errf(e, M3_FORMAT, "%s: tensor '%s': shape[%d] is %s", p, name, i,
                     r == -2 ? "negative" : "not an integer");
    t->shape[i] = (int64_t)d;
    overflow |= __builtin_mul_overflow(numel, d, &numel);
  }
  size_t es = m3_dtype_size(t->dtype);
  uint64_t nbytes;
  overflow |= __builtin_mul_overflow(numel, (uint64_t)es, &nbytes);
  if (overflow)
    return m3_errf(e, M3_FORMAT, "%s: tensor '%s': shape x dtype size overflows 64 bits", p, name);
  t->numel = numel;
  if (!json_is_array(of) || json_array_size(of) != 2)
    return m3_errf(e, M3_FORMAT, "%s: tensor '%s': data_offsets missing or not [begin, end]", p,
                   name);
  uint64_t b = 0, en = 0;
  for (int i = 0; i < 2; i++) {
    uint64_t x;
    int r = get_u64(json_array_get(of, (size_t)i), &x);
    if (r == -2)
      return m3_errf(e, M3_FORMAT, "%s: tensor '%s': data_offsets[%d] = %lld is negative", p, name,
                     i, (long long)json_integer_value(json_array_get(of, (size_t)i)));
    if (r != 0)
      return m3_errf(e, M3_FORMAT, "%s: tensor '%s': data_offsets[%d] is not an integer", p, name,
                     i);
    if (i == 0) b = x;
    else en = x;
  }
  if (b > en)
    return m3_errf(e, M3_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] has begin > end", p,
                   name, (unsigned long long)b, (unsigned long long)en);
  /* Order matters for the messages: a truncated file shows up as an end past
   * the data section (37a) before the span-vs-shape check (37c) is reached. */
  if (en > data_len)
    return m3_errf(e, M3_FORMAT,
                   "%s: tensor '%s': data_offsets end %llu lies past the data section (%llu "
                   "bytes): file truncated",
                   p, name, (unsigned long long)en, (unsigned long long)data_len);
  if (en - b != nbytes) {
    char shp[160] = "";
    for (int i = 0; i < t->ndim; i++)
      snprintf(shp + strlen(shp), sizeof shp - strlen(shp), "%s%lld", i ? ", " : "",
               (long long)t->shape[i]);
    return m3_errf(e, M3_FORMAT,
                   "%s: tensor '%s': shape [%s] x %s (%zu B) needs %llu bytes but data_offsets "
                   "[%llu, %llu] span %llu",
                   p, name, shp, m3_dtype_name(t->dtype), es, (unsigned long long)nbytes,
                   (unsigned long long)b, (unsigned long long)en, (unsigned long long)(en - b));
  }
  t->nbytes = nbytes;
  *begin = b;
  return M3_OK;
}

/* Map `path`, validate it and append its tensors to st. */
static m3_status open_file(m3_st *st, const char *path, m3_err *e) {
  if (grow((void **)&st->files, &st->cap_files, st->nfiles + 1, sizeof *st->files))
    return m3_errf(e, M3_NOMEM, "%s: out of memory", path);
  st_file *f = &st->files[st->nfiles];
  memset(f, 0, sizeof *f);
  if (!(f->path = strdup(path))) return m3_errf(e, M3_NOMEM, "%s: out of memory", path);
  st->nfiles++; /* from here on m3_st_close cleans up f */

  /* O_NONBLOCK: a FIFO is refused below instead of blocking the open on a
   * writer; on a regular file the flag changes nothing. */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    return m3_errf(e, errno == ENOENT ? M3_NOTFOUND : M3_IO, "%s: %s", path, strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    close(fd);
    return m3_errf(e, M3_IO, "%s: not a regular file", path);
  }
  uint64_t size = (uint64_t)sb.st_size;
  if (size < 8) {
    close(fd);
    return m3_errf(e, M3_FORMAT, "%s: file is %llu bytes, shorter than the 8-byte header length",
                   path, (unsigned long long)size);
  }
  /* Map, don't read: checkpoints are up to ~5 GB per shard and the runtime
   * uploads straight from the page cache.  PROT_READ makes any accidental
   * write through a tensor pointer a fault instead of silent corruption. */
  void *m = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd); /* the mapping keeps the file alive */
  if (m == MAP_FAILED) return m3_errf(e, M3_IO, "%s: mmap: %s", path, strerror(errno));
  f->base = m;
  f->size = (size_t)size;

  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | f->base[i]; /* little-endian, any host */
  /* Against the file first: a huge length (2^63, fault 37e) is most often a
   * truncated or non-safetensors file, and that is the more useful message. */
  if (n > size - 8)
    return m3_errf(e, M3_FORMAT, "%s: header length %llu exceeds the file (%llu bytes after the "
                   "length field)", path, (unsigned long long)n, (unsigned long long)(size - 8));
  if (n > M3_ST_MAX_HEADER)
    return m3_errf(e, M3_FORMAT, "%s: header length %llu exceeds the %u-byte limit", path,
                   (unsigned long long)n, M3_ST_MAX_HEADER);
  /* jansson rejects invalid UTF-8 and trailing garbage (but allows the
   * writer's space padding).  Duplicate keys are rejected because a repeated
   * tensor name would let one entry silently shadow the other. */
  json_error_t je;
  json_t *h = json_loadb((const char *)f->base + 8, (size_t)n, JSON_REJECT_DUPLICATES, &je);
  if (!h)
    return m3_errf(e, M3_FORMAT, "%s: header is not valid UTF-8 JSON: %s (header byte %d)", path,
                   je.text, je.position);
  m3_status s = M3_OK;
  uint64_t data_off = 8 + n, data_len = size - 8 - n;
  span *spans = NULL;
  size_t nspan = 0;
  size_t first = st->nt;
  if (!json_is_object(h)) {
    s = m3_errf(e, M3_FORMAT, "%s: header is JSON but not an object", path);
    goto done;
  }
  size_t nkeys = json_object_size(h);
  if (grow((void **)&st->t, &st->cap_t, st->nt + nkeys, sizeof *st->t) ||
      !(spans = malloc((nkeys ? nkeys : 1) * sizeof *spans))) {
    s = m3_errf(e, M3_NOMEM, "%s: out of memory for %zu tensors", path, nkeys);
    goto done;
  }
  const char *key;
  json_t *v;
  json_object_foreach(h, key, v) {
    if (strcmp(key, "__metadata__") == 0) {
      if (!json_is_object(v)) {
        s = m3_errf(e, M3_FORMAT, "%s: __metadata__ is not an object", path);
        goto done;
      }
      const char *mk;
      json_t *mv;
      json_object_foreach(v, mk, mv) if (!json_is_string(mv)) {
        s = m3_errf(e, M3_FORMAT, "%s: __metadata__.%s is not a string", path, mk);
        goto done;
      }
      f->meta = json_incref(v);
      continue;
    }
    if (!*key) {
      s = m3_errf(e, M3_FORMAT, "%s: a tensor has an empty name", path);
      goto done;
    }
    m3_st_tensor *t = &st->t[st->nt];
    memset(t, 0, sizeof *t);
    uint64_t begin = 0;
    if ((s = parse_entry(path, key, v, data_len, t, &begin, e)) != M3_OK) goto done;
    if (!(t->name = strdup(key))) {
      s = m3_errf(e, M3_NOMEM, "%s: out of memory", path);
      goto done;
    }
    t->file = f->path;
    t->file_offset = data_off + begin;
    t->data = f->base + data_off + begin;
    spans[nspan++] = (span){begin, begin + t->nbytes, st->nt};
    st->nt++;
  }
  /* Overlaps and coverage: sort the non-empty ranges by begin.  An empty tensor
   * occupies no bytes and may sit anywhere in [0, data_len].  Two weights can
   * never legitimately share bytes, so an overlap means a corrupt or crafted
   * header (fault 37d); uncovered bytes are only wasted space (policy in the
   * header: a warning). */
  qsort(spans, nspan, sizeof *spans, span_cmp);
  uint64_t covered = 0;   /* end of the union of ranges seen so far */
  size_t covered_by = 0;  /* the tensor reaching `covered` */
  for (size_t i = 0; i < nspan; i++) {
    if (spans[i].begin == spans[i].end) continue;
    if (spans[i].begin < covered) {
      const m3_st_tensor *a = &st->t[covered_by], *b = &st->t[spans[i].idx];
      s = m3_errf(e, M3_FORMAT,
                  "%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", path, a->name,
                  (unsigned long long)(a->file_offset - data_off),
                  (unsigned long long)(a->file_offset - data_off + a->nbytes), b->name,
                  (unsigned long long)spans[i].begin, (unsigned long long)spans[i].end);
      goto done;
    }
    if (spans[i].begin > covered &&
        (s = add_warning(st, e, "%s: data bytes [%llu, %llu) are covered by no tensor", path,
                         (unsigned long long)covered, (unsigned long long)spans[i].begin)) != M3_OK)
      goto done;
    covered = spans[i].end;
    covered_by = spans[i].idx;
  }
  if (covered < data_len &&
      (s = add_warning(st, e, "%s: data bytes [%llu, %llu) are covered by no tensor", path,
                       (unsigned long long)covered, (unsigned long long)data_len)) != M3_OK)
    goto done;
  (void)first;
done:
  free(spans);
  json_decref(h);
  return s;
}

/* ---- checkpoint (single or sharded) ------------------------------------------------ */

static int name_cmp(const void *a, const void *b) {
  return strcmp(((const m3_st_tensor *)a)->name, ((const m3_st_tensor *)b)->name);
}

static int is_dir(const char *p) {
  struct stat sb;
  return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}
static int exists(const char *p) {
  struct stat sb;
  return stat(p, &sb) == 0;
}

static int ends_with(const char *s, const char *suf) {
  size_t a = strlen(s), b = strlen(suf);
  return a >= b && strcmp(s + a - b, suf) == 0;
}

static m3_status open_sharded(m3_st *st, const char *index_path, m3_err *e) {
  if (!(st->index_path = strdup(index_path))) return m3_errf(e, M3_NOMEM, "out of memory");
  char dir[4096];
  snprintf(dir, sizeof dir, "%s", index_path);
  char *slash = strrchr(dir, '/');
  if (slash) *slash = 0;
  else snprintf(dir, sizeof dir, ".");

  uint8_t *buf;
  size_t len;
  M3_TRY(m3_read_file(index_path, &buf, &len, e));
  json_error_t je;
  json_t *idx = json_loadb((const char *)buf, len, JSON_REJECT_DUPLICATES, &je);
  free(buf);
  if (!idx)
    return m3_errf(e, M3_FORMAT, "%s:%d:%d: invalid JSON: %s", index_path, je.line, je.column,
                   je.text);
  m3_status s = M3_OK;
  const char **shards = NULL;
  size_t nshards = 0;
  json_t *wm = json_object_get(idx, "weight_map");
  if (!json_is_object(wm)) {
    s = m3_errf(e, M3_FORMAT, "%s: weight_map missing or not an object", index_path);
    goto done;
  }
  shards = malloc((json_object_size(wm) + 1) * sizeof *shards);
  if (!shards) {
    s = m3_errf(e, M3_NOMEM, "out of memory");
    goto done;
  }
  /* Distinct shard names in order of first appearance. */
  const char *key;
  json_t *v;
  json_object_foreach(wm, key, v) {
    if (!json_is_string(v)) {
      s = m3_errf(e, M3_FORMAT, "%s: weight_map['%s'] is not a string", index_path, key);
      goto done;
    }
    const char *fn = json_string_value(v);
    if (!*fn || strchr(fn, '/') || strcmp(fn, ".") == 0 || strcmp(fn, "..") == 0) {
      s = m3_errf(e, M3_FORMAT, "%s: weight_map['%s']: shard name '%s' is not a plain file name",
                  index_path, key, fn);
      goto done;
    }
    size_t i = nshards;
    while (i > 0 && strcmp(shards[i - 1], fn) != 0) i--; /* usually the last one */
    if (i == 0) shards[nshards++] = fn;
  }
  if (nshards == 0) {
    s = m3_errf(e, M3_FORMAT, "%s: weight_map is empty", index_path);
    goto done;
  }
  /* Check every shard exists before parsing any, so the message is about the
   * missing file and not about whatever else might also be wrong (fault 36a). */
  char path[8192];
  for (size_t i = 0; i < nshards; i++) {
    snprintf(path, sizeof path, "%s/%s", dir, shards[i]);
    if (!exists(path)) {
      s = m3_errf(e, M3_NOTFOUND, "%s: shard '%s' named in weight_map does not exist (%s)",
                  index_path, shards[i], path);
      goto done;
    }
  }
  for (size_t i = 0; i < nshards; i++) {
    snprintf(path, sizeof path, "%s/%s", dir, shards[i]);
    if ((s = open_file(st, path, e)) != M3_OK) goto done;
  }
  qsort(st->t, st->nt, sizeof *st->t, name_cmp);
  for (size_t i = 1; i < st->nt; i++)
    if (strcmp(st->t[i - 1].name, st->t[i].name) == 0) {
      s = m3_errf(e, M3_FORMAT, "tensor '%s' appears in two shards: %s and %s", st->t[i].name,
                  st->t[i - 1].file, st->t[i].file);
      goto done;
    }
  /* Index -> shards: each listed tensor is where the index says. */
  json_object_foreach(wm, key, v) {
    const m3_st_tensor *t = m3_st_find(st, key);
    const char *fn = json_string_value(v);
    if (!t) {
      s = m3_errf(e, M3_NOTFOUND, "%s: tensor '%s' is listed for shard '%s' but no shard has it",
                  index_path, key, fn);
      goto done;
    }
    const char *base = strrchr(t->file, '/');
    base = base ? base + 1 : t->file;
    if (strcmp(base, fn) != 0) {
      s = m3_errf(e, M3_FORMAT, "%s: tensor '%s' is listed for shard '%s' but found in %s",
                  index_path, key, fn, t->file);
      goto done;
    }
  }
  /* Shards -> index: nothing unlisted (policy: error, see safetensors.h). */
  for (size_t i = 0; i < st->nt; i++)
    if (!json_object_get(wm, st->t[i].name)) {
      s = m3_errf(e, M3_FORMAT, "%s: tensor '%s' is not listed in the index %s (stale index?)",
                  st->t[i].file, st->t[i].name, index_path);
      goto done;
    }
done:
  free(shards);
  json_decref(idx);
  return s;
}

m3_status m3_st_open(const char *path, m3_st **out, m3_err *e) {
  *out = NULL;
  m3_st *st = calloc(1, sizeof *st);
  if (!st) return m3_errf(e, M3_NOMEM, "out of memory");
  m3_status s;
  char buf[8192];
  if (is_dir(path)) {
    snprintf(buf, sizeof buf, "%s/model.safetensors.index.json", path);
    if (exists(buf)) {
      s = open_sharded(st, buf, e);
    } else {
      snprintf(buf, sizeof buf, "%s/model.safetensors", path);
      if (exists(buf)) s = open_file(st, buf, e);
      else
        s = m3_errf(e, M3_NOTFOUND,
                    "%s: no model.safetensors.index.json or model.safetensors in this directory",
                    path);
    }
  } else if (ends_with(path, ".json")) {
    s = open_sharded(st, path, e);
  } else {
    s = open_file(st, path, e);
  }
  /* Sorted by name for m3_st_find's binary search and a stable iteration
   * order (sharded opens sort in open_sharded, before the duplicate check). */
  if (s == M3_OK && !st->index_path) {
    qsort(st->t, st->nt, sizeof *st->t, name_cmp); /* names unique: JSON_REJECT_DUPLICATES */
  }
  if (s != M3_OK) {
    m3_st_close(st);
    return s;
  }
  *out = st;
  return M3_OK;
}

/* ---- queries ---------------------------------------------------------------------- */

const m3_st_tensor *m3_st_find(const m3_st *st, const char *name) {
  size_t lo = 0, hi = st->nt;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(name, st->t[mid].name);
    if (c == 0) return &st->t[mid];
    if (c < 0) hi = mid;
    else lo = mid + 1;
  }
  return NULL;
}

size_t m3_st_count(const m3_st *st) { return st->nt; }
const m3_st_tensor *m3_st_at(const m3_st *st, size_t i) { return i < st->nt ? &st->t[i] : NULL; }
size_t m3_st_n_files(const m3_st *st) { return st->nfiles; }
const char *m3_st_file(const m3_st *st, size_t i) { return i < st->nfiles ? st->files[i].path : NULL; }
const char *m3_st_index_path(const m3_st *st) { return st->index_path; }
size_t m3_st_n_warnings(const m3_st *st) { return st->nwarn; }
const char *m3_st_warning(const m3_st *st, size_t i) { return i < st->nwarn ? st->warn[i] : NULL; }

const char *m3_st_metadata(const m3_st *st, const char *key) {
  for (size_t i = 0; i < st->nfiles; i++) {
    const json_t *v = st->files[i].meta ? json_object_get(st->files[i].meta, key) : NULL;
    if (v) return json_string_value(v);
  }
  return NULL;
}

m3_status m3_st_copy(const m3_st_tensor *t, void *dst, size_t dst_bytes, m3_err *e) {
  if (dst_bytes < t->nbytes)
    return m3_errf(e, M3_RANGE, "tensor '%s': destination has %zu bytes, tensor needs %llu",
                   t->name, dst_bytes, (unsigned long long)t->nbytes);
  if (t->nbytes) memcpy(dst, t->data, (size_t)t->nbytes);
  return M3_OK;
}

/* IEEE binary16 -> f32, exact (subnormals, inf, NaN included). */
static float f16_to_f32(uint16_t h) {
  int s = h >> 15, ex = (h >> 10) & 31, m = h & 1023;
  float v;
  if (ex == 31) v = m ? NAN : INFINITY;
  else if (ex == 0) v = ldexpf((float)m, -24);
  else v = ldexpf((float)(m | 1024), ex - 25);
  return s ? -v : v;
}

m3_status m3_st_to_f32(const m3_st_tensor *t, float *dst, size_t n, m3_err *e) {
  if (n < t->numel)
    return m3_errf(e, M3_RANGE, "tensor '%s': destination holds %zu floats, tensor has %llu",
                   t->name, n, (unsigned long long)t->numel);
  const uint8_t *p = t->data; /* byte loads + memcpy only: data may be unaligned */
  for (uint64_t i = 0; i < t->numel; i++) {
    switch (t->dtype) {
    case M3_DT_BF16: {
      uint16_t h;
      memcpy(&h, p + 2 * i, 2);
      dst[i] = m3_bf16_to_f32(h);
      break;
    }
    case M3_DT_F16: {
      uint16_t h;
      memcpy(&h, p + 2 * i, 2);
      dst[i] = f16_to_f32(h);
      break;
    }
    case M3_DT_F32: memcpy(&dst[i], p + 4 * i, 4); break;
    case M3_DT_F64: {
      double d;
      memcpy(&d, p + 8 * i, 8);
      dst[i] = (float)d;
      break;
    }
    case M3_DT_F8_E4M3: dst[i] = m3_e4m3_to_f32(p[i]); break;
    default:
      return m3_errf(e, M3_UNSUPPORTED, "%s: tensor '%s': dtype %s has no f32 conversion",
                     t->file, t->name, m3_dtype_name(t->dtype));
    }
  }
  return M3_OK;
}
