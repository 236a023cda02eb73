/* fuzz_st_index.c - a sharded checkpoint: model.safetensors.index.json plus
 * its shard files, all from one input (layout: fuzz.h FUZZ_PART_MARK):
 *
 *   <index JSON> ( "\n--M3FZ:" <file name> "\n" <file bytes> )*
 *
 * Exercises weight_map parsing, the shard-name rules (plain names only: a
 * hostile index must not reach outside its directory), missing shards,
 * tensors listed for the wrong shard, unlisted tensors and names in two
 * shards - then the same per-tensor promises as the single-file harness. */
#include "fuzz/st_check.h"

#define MAX_PARTS 16

/* File names the harness will create: plain, short, and never the index's
 * own name (the index is part 0).  Anything else becomes "shardN", which an
 * index can still name - only the spelling is normalised. */
static void part_name(const uint8_t *p, size_t n, int idx, char *out, size_t on) {
  int ok = n > 0 && n < 100;
  for (size_t i = 0; ok && i < n; i++)
    ok = (p[i] >= 'a' && p[i] <= 'z') || (p[i] >= 'A' && p[i] <= 'Z') || (p[i] >= '0' && p[i] <= '9') ||
         p[i] == '.' || p[i] == '_' || p[i] == '-';
  if (ok && (n == 1 && p[0] == '.')) ok = 0;
  if (ok && n == 2 && p[0] == '.' && p[1] == '.') ok = 0;
  if (ok && n == strlen("model.safetensors.index.json") && !memcmp(p, "model.safetensors.index.json", n)) ok = 0;
  if (ok) snprintf(out, on, "%.*s", (int)n, (const char *)p);
  else snprintf(out, on, "shard%d", idx);
}

static const uint8_t *find_mark(const uint8_t *p, const uint8_t *end) {
  size_t ml = strlen(FUZZ_PART_MARK);
  for (; p + ml <= end; p++)
    if (*p == '\n' && !memcmp(p, FUZZ_PART_MARK, ml)) return p;
  return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_dir_clear();
  const uint8_t *end = data + size, *p = data;
  const uint8_t *m = find_mark(p, end);
  char path[600];
  fuzz_write("model.safetensors.index.json", p, (size_t)((m ? m : end) - p), path, sizeof path);
  size_t ml = strlen(FUZZ_PART_MARK);
  for (int idx = 1; m && idx < MAX_PARTS; idx++) {
    const uint8_t *name = m + ml;
    const uint8_t *nl = memchr(name, '\n', (size_t)(end - name));
    const uint8_t *body = nl ? nl + 1 : end;
    const uint8_t *next = find_mark(body, end);
    char fn[128], fp[600];
    part_name(name, (size_t)((nl ? nl : end) - name), idx, fn, sizeof fn);
    fuzz_write(fn, body, (size_t)((next ? next : end) - body), fp, sizeof fp);
    m = next;
  }
  /* Both spellings of a sharded open: the directory and the index path. */
  for (int form = 0; form < 2; form++) {
    m3_st *st = NULL;
    m3_err e = {0};
    m3_status s = m3_st_open(form ? path : fuzz_dir(), &st, &e);
    fuzz_note(form ? "index path" : "directory", s, e.msg);
    if (s == M3_OK) {
      FUZZ_CHECK(st && m3_st_index_path(st), "sharded open without an index path");
      fuzz_check_st(st);
      m3_st_close(st);
    } else {
      FUZZ_CHECK(st == NULL && e.msg[0], "error %s: handle or message", m3_status_name(s));
    }
    if (form == 0 && size > 0 && data[0] & 1) break; /* half the inputs: one form is enough */
  }
  return 0;
}
