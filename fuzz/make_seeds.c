/* make_seeds.c - writes the fuzz seed corpora through the project's own
 * writers, so that every seed is a file m3kit itself produces (or a small,
 * named variation of one).  Driven by fuzz/make-corpus.sh; not installed.
 *
 *   make_seeds st CKPT_DIR OUT_ST OUT_INDEX   from a checkpoint written by
 *                                             tests/st_dump (m3_ckpt_write)
 *   make_seeds tunedb OUT                     DBs written by m3_tunedb_save_merge
 *   make_seeds cubin OUT                      entries written by m3_cubin_store
 *   make_seeds config OUT                     presets re-serialised by m3_config_to_json
 *
 * The real checkpoint is megabytes (the embedding alone), far too large for a
 * committed corpus or for fast mutation, so the safetensors seeds keep its
 * real header metadata and a handful of its real small tensors (norm weights,
 * biases), laid out the way ckpt_write.c lays them out. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cache/cubin_cache.h"
#include "cache/store.h"
#include "cache/tunedb.h"
#include "fuzz/fuzz.h"
#include "runtime/config.h"
#include "runtime/safetensors.h"

static void die(const char *what, const m3_err *e) {
  fprintf(stderr, "make_seeds: %s: %s\n", what, e ? e->msg : "failed");
  exit(1);
}

static void put_file(const char *dir, const char *name, const void *data, size_t n) {
  char p[4096];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  m3_err e;
  if (m3_write_atomic(p, data, n, &e) != M3_OK) die(p, &e);
}

/* ---- safetensors ---------------------------------------------------------- */

typedef struct {
  const char *name;
  m3_dtype dtype;
  int ndim;
  int64_t shape[M3_ST_MAX_DIMS];
  const void *data;
  uint64_t nbytes;
} seed_tensor;

/* The safetensors byte layout of ckpt_write.c: u64 header length, the JSON
 * header (with __metadata__ first), space padding so the data section starts
 * 8-byte aligned when `align`, then the tensors packed in order. */
static uint8_t *st_bytes(const seed_tensor *t, int n, json_t *meta, int align, size_t *len) {
  json_t *h = json_object();
  if (meta) json_object_set(h, "__metadata__", meta);
  uint64_t off = 0;
  for (int i = 0; i < n; i++) {
    json_t *o = json_object(), *sh = json_array(), *of = json_array();
    json_object_set_new(o, "dtype", json_string(m3_dtype_name(t[i].dtype)));
    for (int d = 0; d < t[i].ndim; d++) json_array_append_new(sh, json_integer(t[i].shape[d]));
    json_object_set_new(o, "shape", sh);
    json_array_append_new(of, json_integer((json_int_t)off));
    json_array_append_new(of, json_integer((json_int_t)(off + t[i].nbytes)));
    json_object_set_new(o, "data_offsets", of);
    json_object_set_new(h, t[i].name, o);
    off += t[i].nbytes;
  }
  char *js = json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER);
  json_decref(h);
  size_t hl = strlen(js), pad = align ? (8 - (8 + hl) % 8) % 8 : 0;
  /* Unaligned on purpose (known fault 38): data starts at an offset = 2 mod 8. */
  if (!align) pad = (2 + 8 - (8 + hl) % 8) % 8;
  size_t total = 8 + hl + pad + off;
  uint8_t *b = malloc(total);
  uint64_t N = hl + pad;
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)(N >> (8 * i));
  memcpy(b + 8, js, hl);
  memset(b + 8 + hl, ' ', pad);
  uint8_t *p = b + 8 + hl + pad;
  for (int i = 0; i < n; i++) {
    memcpy(p, t[i].data, t[i].nbytes);
    p += t[i].nbytes;
  }
  free(js);
  *len = total;
  return b;
}

static seed_tensor from_st(const m3_st_tensor *s) {
  seed_tensor t = {s->name, s->dtype, s->ndim, {0}, s->data, s->nbytes};
  memcpy(t.shape, s->shape, sizeof t.shape);
  return t;
}

/* Metadata of the checkpoint's first shard (re-read from its header). */
static json_t *shard_metadata(const char *path) {
  uint8_t *d;
  size_t n;
  m3_err e;
  if (m3_read_file(path, &d, &n, &e) != M3_OK) die(path, &e);
  uint64_t hl = 0;
  for (int i = 7; i >= 0; i--) hl = (hl << 8) | d[i];
  json_t *h = json_loadb((const char *)d + 8, hl, 0, NULL);
  free(d);
  json_t *m = h ? json_incref(json_object_get(h, "__metadata__")) : NULL;
  json_decref(h);
  return m;
}

/* Append one part of a multi-file input (fuzz.h FUZZ_PART_MARK). */
static void part(FILE *f, const char *name, const void *d, size_t n) {
  if (name) fprintf(f, "%s%s\n", FUZZ_PART_MARK, name);
  fwrite(d, 1, n, f);
}

static void seeds_st(const char *ckpt, const char *out_st, const char *out_idx) {
  m3_st *st;
  m3_err e;
  if (m3_st_open(ckpt, &st, &e) != M3_OK) die(ckpt, &e);
  json_t *meta = shard_metadata(m3_st_file(st, 0));
  /* The small real tensors, smallest first (norms, q/k norms, biases). */
  seed_tensor small[64];
  int ns = 0;
  for (uint64_t lim = 64; lim <= 1024 && ns < 12; lim *= 2)
    for (size_t i = 0; i < m3_st_count(st) && ns < 12; i++) {
      const m3_st_tensor *t = m3_st_at(st, i);
      if (t->nbytes <= lim && t->nbytes > lim / 2) small[ns++] = from_st(t);
    }
  if (ns < 6) die("too few small tensors in the checkpoint", NULL);
  size_t n;
  uint8_t *b;
  /* 1: real tensors and metadata, aligned like ckpt_write.c. */
  b = st_bytes(small, 4, meta, 1, &n);
  put_file(out_st, "real-small-aligned.safetensors", b, n);
  free(b);
  /* 2: the same layout with the data section at 2 mod 8 (fault 38). */
  b = st_bytes(small + 4, 3, meta, 0, &n);
  put_file(out_st, "real-small-unaligned.safetensors", b, n);
  free(b);
  /* 3: one tensor per dtype the reader converts or carries, one empty tensor,
   * with bytes taken from a real tensor (fault 38's file). */
  const uint8_t *bytes = small[ns - 1].data;
  seed_tensor dt[] = {
      {"bf16", M3_DT_BF16, 1, {4}, bytes, 8},         {"f16", M3_DT_F16, 2, {2, 2}, bytes, 8},
      {"f32", M3_DT_F32, 1, {2}, bytes, 8},           {"f64", M3_DT_F64, 1, {1}, bytes, 8},
      {"e4m3", M3_DT_F8_E4M3, 1, {8}, bytes, 8},     {"i64", M3_DT_I64, 0, {0}, bytes, 8},
      {"u8", M3_DT_U8, 1, {3}, bytes, 3},             {"bool", M3_DT_BOOL, 1, {1}, bytes, 1},
      {"empty", M3_DT_BF16, 2, {0, 7}, bytes, 0},
  };
  b = st_bytes(dt, (int)(sizeof dt / sizeof *dt), NULL, 1, &n);
  put_file(out_st, "dtypes-empty.safetensors", b, n);
  free(b);
  /* 4: the first real shard's header, data cut after 64 bytes (fault 37a). */
  {
    uint8_t *d;
    size_t dn;
    if (m3_read_file(m3_st_file(st, 0), &d, &dn, &e) != M3_OK) die("shard", &e);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | d[i];
    if (8 + hl + 64 < dn && 8 + hl + 64 < 96 * 1024) put_file(out_st, "real-header-truncated.safetensors", d, 8 + hl + 64);
    free(d);
  }
  /* Sharded: two shards of three real tensors each, and the index in
   * ckpt_write.c's form ({"metadata": {"total_size"}, "weight_map"}). */
  const char *names[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  uint8_t *sb[2];
  size_t sn[2];
  json_t *idx = json_object(), *md = json_object(), *wm = json_object();
  uint64_t total = 0;
  for (int s = 0; s < 2; s++) {
    sb[s] = st_bytes(small + 3 * s, 3, meta, 1, &sn[s]);
    for (int i = 0; i < 3; i++) {
      json_object_set_new(wm, small[3 * s + i].name, json_string(names[s]));
      total += small[3 * s + i].nbytes;
    }
  }
  json_object_set_new(md, "total_size", json_integer((json_int_t)total));
  json_object_set_new(idx, "metadata", md);
  json_object_set_new(idx, "weight_map", wm);
  char *it = json_dumps(idx, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
  for (int variant = 0; variant < 3; variant++) {
    char *buf = NULL;
    size_t bl = 0;
    FILE *f = open_memstream(&buf, &bl);
    part(f, NULL, it, strlen(it));
    /* 0: complete; 1: second shard missing (fault 36a); 2: the first shard
     * also under a second name the index does not use. */
    part(f, names[0], sb[0], sn[0]);
    if (variant != 1) part(f, names[1], sb[1], sn[1]);
    if (variant == 2) part(f, "model-00003-of-00002.safetensors", sb[0], sn[0]);
    fclose(f);
    static const char *fn[] = {"two-shards.bin", "missing-shard.bin", "extra-file.bin"};
    put_file(out_idx, fn[variant], buf, bl);
    free(buf);
  }
  /* The real index of the written checkpoint with the first shard's header
   * only: every tensor of shard 2 is then missing. */
  {
    uint8_t *d;
    size_t dn;
    if (m3_read_file(m3_st_index_path(st), &d, &dn, &e) != M3_OK) die("index", &e);
    if (dn < 64 * 1024) {
      char *buf = NULL;
      size_t bl = 0;
      FILE *f = open_memstream(&buf, &bl);
      part(f, NULL, d, dn);
      part(f, names[0], sb[0], sn[0]);
      fclose(f);
      put_file(out_idx, "real-index.bin", buf, bl);
      free(buf);
    }
    free(d);
  }
  free(it);
  json_decref(idx);
  free(sb[0]);
  free(sb[1]);
  json_decref(meta);
  m3_st_close(st);
}

/* ---- tuning DB ------------------------------------------------------------ */

static void seeds_tunedb(const char *out) {
  m3_err e;
  m3_tunedb *db = m3_tunedb_new();
  static const m3_tune_candidate c1[] = {
      {"warps=4,hpw=1", M3_DISP_PASSED, NULL, 12.5, 12.1, 13.0, 20},
      {"warps=8,hpw=2", M3_DISP_PASSED, NULL, 10.25, 10.0, 10.5, 20},
      {"warps=32,hpw=4", M3_DISP_NOT_SUPPORTED, "valid(): 32 warps x 4 heads > 64 heads", NAN, NAN, NAN, 0},
      {"warps=16,hpw=1", M3_DISP_INCORRECT, "max |err| 0.5 > 0.02", NAN, NAN, NAN, 0},
      {"warps=2,hpw=1", M3_DISP_SKIPPED_SLOWER, "2.1x slower after 3 runs", 26.0, 25.0, 27.0, 3},
  };
  const char *keys[] = {"qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=e4m3,nq=64,nkv=4,niq=4,hd=128,rot=64,bs=128)",
                        "qknorm_rope(attn=dense,insert=0,kv=bf16,idxk=bf16,nq=64,nkv=4,niq=0,hd=128,rot=64,bs=128)"};
  int64_t toks[] = {1, 16, 4096};
  for (int k = 0; k < 2; k++)
    for (int t = 0; t < 3; t++) {
      m3_tune_record r = m3_tune_record_empty();
      r.key = keys[k];
      m3_bucket_add(&r.bucket, "tokens", toks[t], NULL);
      if (k == 0) m3_bucket_add(&r.bucket, "ctx", 131072, NULL);
      r.arch = "sm_90";
      r.tile = t == 2 ? "warps=4,hpw=1" : "warps=8,hpw=2";
      r.default_tile = "warps=4,hpw=1";
      r.default_us = 12.5;
      r.tuned_us = t == 2 ? 12.5 : 10.25;
      r.prov = (m3_tune_provenance){"NVIDIA H200", 132, "550.54.15", "12.4", "12.4.5", FUZZ_TPL_HASH, "0.1.0",
                                    "2025-01-31T12:34:56Z", "m3kit tune --preset minimax-m3"};
      r.metric = (m3_tune_metric){"GB/s", 3012.5, 4280.0, 70.38};
      r.n_candidates = k == 0 ? 5 : 2;
      r.candidates = c1;
      if (m3_tunedb_put(db, &r, &e) != M3_OK) die("put", &e);
    }
  char p[4096];
  snprintf(p, sizeof p, "%s/tuned-sm_90.json", out);
  if (m3_tunedb_save_merge(p, db, NULL, &e) != M3_OK) die(p, &e);
  m3_tunedb_free(db);
  /* A second file: one record each of another arch, an unknown template and
   * no driver (stale or filtered on load), plus an unknown field. */
  db = m3_tunedb_new();
  const char *k2[] = {"qknorm_rope(attn=dense)", "unknown_template(a=1)", "qknorm_rope(attn=sparse)"};
  const char *arch[] = {"sm_80", "sm_90", "sm_90"};
  for (int i = 0; i < 3; i++) {
    m3_tune_record r = m3_tune_record_empty();
    r.key = k2[i];
    m3_bucket_add(&r.bucket, "tokens", 0, NULL);
    r.arch = arch[i];
    r.tile = "warps=4";
    r.prov.template_hash = FUZZ_TPL_HASH;
    r.prov.driver_version = i == 2 ? NULL : "550.54.15";
    if (m3_tunedb_put(db, &r, &e) != M3_OK) die("put", &e);
  }
  snprintf(p, sizeof p, "%s/stale-sm_90.json", out);
  if (m3_tunedb_save_merge(p, db, NULL, &e) != M3_OK) die(p, &e);
  m3_tunedb_free(db);
}

/* ---- cubin cache entries ---------------------------------------------------- */

static void seeds_cubin(const char *out) {
  char *kt, hex[33];
  m3_err e;
  if (m3_cubin_key(FUZZ_CUBIN_VARIANT, FUZZ_CUBIN_SOURCE, "sm_90", FUZZ_CUBIN_OPTIONS, FUZZ_CUBIN_NVRTC,
                   FUZZ_CUBIN_DRIVER, &kt, hex, &e) != M3_OK)
    die("key", &e);
  /* A fake cubin: an ELF64 identification and a few bytes (the cache never
   * looks inside; the driver would). */
  uint8_t fake[96] = {0x7f, 'E', 'L', 'F', 2, 1, 1, 0x33, 7};
  for (size_t i = 16; i < sizeof fake; i++) fake[i] = (uint8_t)(i * 37);
  m3_cubin_meta m = {"m3k_qknorm_rope_0123456789abcdef", 128, 0};
  char p[4096];
  snprintf(p, sizeof p, "%s/entry-128t.cubin", out);
  if (m3_cubin_store(p, kt, fake, sizeof fake, &m, &e) != M3_OK) die(p, &e);
  m3_cubin_meta m2 = {"m3k_qknorm_rope_fedcba9876543210", 1024, 49152};
  snprintf(p, sizeof p, "%s/entry-1024t-smem.cubin", out);
  if (m3_cubin_store(p, kt, fake, 17, &m2, &e) != M3_OK) die(p, &e);
  /* Written for another driver: the key text differs, load must refuse it. */
  char *kt2;
  if (m3_cubin_key(FUZZ_CUBIN_VARIANT, FUZZ_CUBIN_SOURCE, "sm_90", FUZZ_CUBIN_OPTIONS, FUZZ_CUBIN_NVRTC, 12080, &kt2,
                   hex, &e) != M3_OK)
    die("key", &e);
  snprintf(p, sizeof p, "%s/entry-other-driver.cubin", out);
  if (m3_cubin_store(p, kt2, fake, sizeof fake, &m, &e) != M3_OK) die(p, &e);
  free(kt2);
  free(kt);
}

/* ---- config.json ------------------------------------------------------------- */

static void seeds_config(const char *out) {
  m3_err e;
  m3_config c;
  if (m3_config_preset("tiny", &c, &e) != M3_OK) die("tiny", &e);
  c.is_vl = 0; /* the bare text form */
  char *j = m3_config_to_json(&c);
  put_file(out, "tiny-bare.json", j, strlen(j));
  free(j);
  if (m3_config_preset("minimax-m3", &c, &e) != M3_OK) die("minimax-m3", &e);
  snprintf(c.quant_method, sizeof c.quant_method, "mxfp8");
  c.swiglu_beta_given = 1;
  j = m3_config_to_json_vl(&c);
  put_file(out, "minimax-m3-mxfp8.json", j, strlen(j));
  free(j);
}

int main(int argc, char **argv) {
  if (argc == 5 && !strcmp(argv[1], "st")) seeds_st(argv[2], argv[3], argv[4]);
  else if (argc == 3 && !strcmp(argv[1], "tunedb")) seeds_tunedb(argv[2]);
  else if (argc == 3 && !strcmp(argv[1], "cubin")) seeds_cubin(argv[2]);
  else if (argc == 3 && !strcmp(argv[1], "config")) seeds_config(argv[2]);
  else {
    fprintf(stderr, "usage: make_seeds st CKPT OUT_ST OUT_INDEX | tunedb OUT | cubin OUT | config OUT\n");
    return 2;
  }
  return 0;
}
