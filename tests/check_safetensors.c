/* check_safetensors.c - the safetensors reader, the tensor inventory and the
 * checkpoint writer (runtime/safetensors.h, ckpt_names.h, ckpt_write.h):
 * known faults 36 (missing shard / tensor), 37 (malformed headers, a-h),
 * 38 (dtype coverage, empty tensor, unaligned data), plus sharding rules and a
 * make-checkpoint -> open -> inventory round trip of the tiny preset.  Every
 * malformed file is generated here, in a mkdtemp directory.  CPU only. */
#include <check.h>
#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ref/numerics.h"
#include "runtime/ckpt_names.h"
#include "runtime/ckpt_write.h"
#include "runtime/config.h"
#include "runtime/safetensors.h"

/* ---- scratch directories ---- */

static char tmp[256];

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *f) {
  return remove(p);
}
static void setup(void) {
  snprintf(tmp, sizeof tmp, "%s/m3stXXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  ck_assert_ptr_nonnull(mkdtemp(tmp));
}
static void teardown(void) { nftw(tmp, rm_one, 16, FTW_DEPTH | FTW_PHYS); }

static const char *P(const char *name) {
  static char buf[4][512];
  static int k;
  k = (k + 1) % 4;
  snprintf(buf[k], sizeof buf[k], "%s/%s", tmp, name);
  return buf[k];
}

/* ---- file builders ---- */

/* Raw file: 8-byte length field (len_field, or the real header length when
 * len_field == UINT64_MAX), header bytes, data bytes. */
static void write_raw(const char *path, const char *hdr, size_t hlen, uint64_t len_field,
                      const void *data, size_t dlen) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  uint64_t n = len_field == UINT64_MAX ? hlen : len_field;
  uint8_t le[8];
  for (int i = 0; i < 8; i++) le[i] = (uint8_t)(n >> (8 * i));
  fwrite(le, 1, 8, f);
  fwrite(hdr, 1, hlen, f);
  if (dlen) fwrite(data, 1, dlen, f);
  fclose(f);
}

static void write_hdr(const char *path, const char *hdr, const void *data, size_t dlen) {
  write_raw(path, hdr, strlen(hdr), UINT64_MAX, data, dlen);
}

typedef struct {
  const char *name;
  const char *dtype;
  int ndim;
  int64_t shape[8];
  const void *data;
  size_t nbytes;
} ent;

/* A well-formed file from ents (packed in order); the header is padded with
 * spaces so the data section starts at an offset ≡ data_mod8 (mod 8). */
static void write_st(const char *path, const ent *v, size_t n, int data_mod8) {
  json_t *h = json_object();
  size_t off = 0;
  for (size_t i = 0; i < n; i++) {
    json_t *o = json_object(), *sh = json_array(), *of = json_array();
    json_object_set_new(o, "dtype", json_string(v[i].dtype));
    for (int d = 0; d < v[i].ndim; d++) json_array_append_new(sh, json_integer(v[i].shape[d]));
    json_object_set_new(o, "shape", sh);
    json_array_append_new(of, json_integer((json_int_t)off));
    json_array_append_new(of, json_integer((json_int_t)(off + v[i].nbytes)));
    json_object_set_new(o, "data_offsets", of);
    json_object_set_new(h, v[i].name, o);
    off += v[i].nbytes;
  }
  char *hs = json_dumps(h, JSON_COMPACT);
  json_decref(h);
  size_t hl = strlen(hs);
  while ((8 + hl) % 8 != (size_t)data_mod8) hl++;
  char *hp = malloc(hl);
  memset(hp, ' ', hl);
  memcpy(hp, hs, strlen(hs));
  free(hs);
  uint8_t *data = malloc(off ? off : 1);
  off = 0;
  for (size_t i = 0; i < n; i++) {
    if (v[i].nbytes) memcpy(data + off, v[i].data, v[i].nbytes);
    off += v[i].nbytes;
  }
  write_raw(path, hp, hl, UINT64_MAX, data, off);
  free(hp);
  free(data);
}

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}

/* Expect m3_st_open(path) to fail with `code` and a message holding every
 * non-NULL needle; returns the message (static) for distinctness checks. */
static const char *expect_open_fail(const char *path, m3_status code, const char *n1,
                                    const char *n2) {
  static char msg[4096];
  m3_st *st = (m3_st *)0x1;
  m3_err e = {0};
  m3_status s = m3_st_open(path, &st, &e);
  ck_assert_msg(s == code, "%s: expected %s, got %s (%s)", path, m3_status_name(code),
                m3_status_name(s), e.msg);
  ck_assert_msg(st == NULL, "a failed open returned a handle");
  ck_assert_msg(!n1 || strstr(e.msg, n1), "message '%s' lacks '%s'", e.msg, n1);
  ck_assert_msg(!n2 || strstr(e.msg, n2), "message '%s' lacks '%s'", e.msg, n2);
  snprintf(msg, sizeof msg, "%s", e.msg);
  return msg;
}

static m3_st *open_ok(const char *path) {
  m3_st *st = NULL;
  m3_err e = {0};
  ck_assert_msg(m3_st_open(path, &st, &e) == M3_OK, "%s: %s", path, e.msg);
  return st;
}

/* ---- fault 37: malformed headers, one file per case ---- */

START_TEST(fault37_each_case_distinct) {
  float f4[6] = {1, 2, 3, 4, 5, 6};
  char msgs[9][4096];
  int k = 0;
  const char *one = "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}";

  /* (a) truncated by one byte. */
  write_hdr(P("a.safetensors"), one, f4, 15);
  snprintf(msgs[k++], 4096, "%s", expect_open_fail(P("a.safetensors"), M3_FORMAT, "a.safetensors", "tensor 'w'"));
  ck_assert_ptr_nonnull(strstr(msgs[k - 1], "file truncated"));

  /* (b) data_offsets [8, 4]. */
  write_hdr(P("b.safetensors"), "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", f4, 16);
  snprintf(msgs[k++], 4096, "%s", expect_open_fail(P("b.safetensors"), M3_FORMAT, "tensor 'w'", "[8, 4] has begin > end"));

  /* (c) [1000, 1000] F32 backed by 4 bytes. */
  write_hdr(P("c.safetensors"), "{\"big\":{\"dtype\":\"F32\",\"shape\":[1000,1000],\"data_offsets\":[0,4]}}", f4, 4);
  snprintf(msgs[k++], 4096, "%s", expect_open_fail(P("c.safetensors"), M3_FORMAT, "tensor 'big'",
                                           "shape [1000, 1000] x F32 (4 B) needs 4000000 bytes but data_offsets [0, 4] span 4"));

  /* (d) overlapping ranges. */
  write_hdr(P("d.safetensors"),
            "{\"x\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
            "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", f4, 20);
  snprintf(msgs[k++], 4096, "%s", expect_open_fail(P("d.safetensors"), M3_FORMAT, "'x' [0, 16) and 'y' [12, 20) overlap", NULL));

  /* (e) header length 2^63, and exactly one past the file. */
  write_raw(P("e.safetensors"), one, strlen(one), 1ull << 63, f4, 16);
  snprintf(msgs[k++], 4096, "%s", expect_open_fail(P("e.safetensors"), M3_FORMAT, "header length 9223372036854775808 exceeds the file", NULL));
  write_raw(P("e2.safetensors"), one, strlen(one), strlen(one) + 17, f4, 16);
  expect_open_fail(P("e2.safetensors"), M3_FORMAT, "exceeds the file", NULL);

  /* (f) a negative offset. */
  write_hdr(P("f.safetensors"), "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", f4, 16);
  snprintf(msgs[k++], 4096, "%s", expect_open_fail(P("f.safetensors"), M3_FORMAT, "tensor 'w'", "data_offsets[0] = -4 is negative"));

  /* (g) not UTF-8 JSON: an invalid UTF-8 byte inside a key; and plain garbage. */
  write_hdr(P("g.safetensors"), "{\"w\xff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", f4, 4);
  snprintf(msgs[k++], 4096, "%s", expect_open_fail(P("g.safetensors"), M3_FORMAT, "g.safetensors: header is not valid UTF-8 JSON", NULL));
  write_hdr(P("g2.safetensors"), "not json at all", f4, 4);
  expect_open_fail(P("g2.safetensors"), M3_FORMAT, "header is not valid UTF-8 JSON", NULL);
  write_hdr(P("g3.safetensors"), "[1,2,3]", f4, 4);
  expect_open_fail(P("g3.safetensors"), M3_FORMAT, "header is JSON but not an object", NULL);

  /* Each of (a)-(g) is a different message. */
  for (int i = 0; i < k; i++)
    for (int j = i + 1; j < k; j++) ck_assert_str_ne(msgs[i], msgs[j]);

  /* (h) bytes covered by no tensor: policy = warning, the file loads. */
  write_hdr(P("h.safetensors"),
            "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
            "\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}", f4, 24);
  m3_st *st = open_ok(P("h.safetensors"));
  ck_assert_uint_eq(m3_st_n_warnings(st), 2);
  ck_assert_ptr_nonnull(strstr(m3_st_warning(st, 0), "h.safetensors: data bytes [4, 12) are covered by no tensor"));
  ck_assert_ptr_nonnull(strstr(m3_st_warning(st, 1), "data bytes [16, 24) are covered by no tensor"));
  float y;
  ck_assert_int_eq(m3_st_copy(m3_st_find(st, "y"), &y, sizeof y, NULL), M3_OK);
  ck_assert(y == 4.0f);
  m3_st_close(st);
}
END_TEST

/* Further header checks, each with its own message. */
START_TEST(header_field_checks) {
  float f4[4] = {0};
  write_raw(P("short.safetensors"), "", 0, 0, NULL, 0);
  FILE *f = fopen(P("short.safetensors"), "wb");
  fwrite("\x02\0\0", 1, 3, f);
  fclose(f);
  expect_open_fail(P("short.safetensors"), M3_FORMAT, "shorter than the 8-byte header length", NULL);
  write_hdr(P("dup.safetensors"),
            "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
            "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", f4, 8);
  expect_open_fail(P("dup.safetensors"), M3_FORMAT, "duplicate", NULL);
  write_hdr(P("shape.safetensors"), "{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", f4, 4);
  expect_open_fail(P("shape.safetensors"), M3_FORMAT, "tensor 'w': shape[0] is negative", NULL);
  write_hdr(P("nodt.safetensors"), "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", f4, 4);
  expect_open_fail(P("nodt.safetensors"), M3_FORMAT, "tensor 'w': dtype missing", NULL);
  write_hdr(P("offs.safetensors"), "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", f4, 4);
  expect_open_fail(P("offs.safetensors"), M3_FORMAT, "tensor 'w': data_offsets missing or not [begin, end]", NULL);
  write_hdr(P("dims.safetensors"), "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", f4, 4);
  expect_open_fail(P("dims.safetensors"), M3_FORMAT, "shape has 9 dims", NULL);
  write_hdr(P("ovf.safetensors"),
            "{\"w\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", f4, 4);
  expect_open_fail(P("ovf.safetensors"), M3_FORMAT, "overflows 64 bits", NULL);
  write_hdr(P("meta.safetensors"), "{\"__metadata__\":{\"format\":1}}", NULL, 0);
  expect_open_fail(P("meta.safetensors"), M3_FORMAT, "__metadata__.format is not a string", NULL);
  char big[64];
  snprintf(big, sizeof big, "{}");
  write_raw(P("huge.safetensors"), big, 2, (100u << 20) + 1, NULL, 0);
  /* Length beyond the limit but also beyond the file: the file check fires. */
  expect_open_fail(P("huge.safetensors"), M3_FORMAT, "exceeds the file", NULL);
  expect_open_fail(P("absent.safetensors"), M3_NOTFOUND, "absent.safetensors", NULL);
  expect_open_fail(tmp, M3_NOTFOUND, "no model.safetensors.index.json or model.safetensors", NULL);

  /* Metadata-only and header-padded files are fine. */
  write_hdr(P("model.safetensors"), "{\"__metadata__\":{\"format\":\"pt\"}}      ", NULL, 0);
  m3_st *st = open_ok(tmp); /* directory -> model.safetensors */
  ck_assert_uint_eq(m3_st_count(st), 0);
  ck_assert_str_eq(m3_st_metadata(st, "format"), "pt");
  ck_assert_ptr_null(m3_st_index_path(st));
  m3_st_close(st);
}
END_TEST

/* ---- fault 38: every dtype, an empty tensor, data section at 2 mod 8 ---- */

START_TEST(fault38_dtypes_empty_unaligned) {
  static const char *names[] = {"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "I8", "I16",
                                "I32", "I64", "U8", "U16", "U32", "U64", "BOOL"};
  enum { NDT = sizeof names / sizeof *names, N = 7 };
  uint8_t bytes[NDT][N * 8];
  ent v[NDT + 1];
  for (int i = 0; i < NDT; i++) {
    m3_dtype d;
    ck_assert_int_eq(m3_dtype_parse(names[i], &d), 0);
    size_t es = m3_dtype_size(d);
    for (size_t j = 0; j < N * es; j++) bytes[i][j] = (uint8_t)(17 * i + 31 * j + 1); /* every bit pattern class */
    if (d == M3_DT_BOOL)
      for (size_t j = 0; j < N; j++) bytes[i][j] = j & 1;
    v[i] = (ent){names[i], names[i], 1, {N}, bytes[i], N * es};
  }
  /* Known values for the float conversions. */
  uint16_t bf[N] = {0x3f80, 0xbf80, 0x0000, 0x8000, 0x7f80, 0x0001, 0x4049}; /* 1,-1,0,-0,inf,denorm,3.14 */
  memcpy(bytes[0], bf, sizeof bf);
  uint16_t hf[N] = {0x3c00, 0xc000, 0x0001, 0x7bff, 0xfc00, 0x3555, 0x0000}; /* 1,-2,2^-24,65504,-inf,~.333,0 */
  memcpy(bytes[1], hf, sizeof hf);
  uint8_t e4[N] = {0x38, 0xb8, 0x01, 0x7e, 0x08, 0x00, 0x80}; /* 1,-1,2^-9,448,2^-6,0,-0 */
  memcpy(bytes[4], e4, sizeof e4);
  v[NDT] = (ent){"empty", "F32", 1, {0}, NULL, 0};
  write_st(P("all.safetensors"), v, NDT + 1, 2);

  m3_st *st = open_ok(P("all.safetensors"));
  ck_assert_uint_eq(m3_st_count(st), NDT + 1);
  ck_assert_uint_eq(m3_st_n_warnings(st), 0);
  for (int i = 0; i < NDT; i++) {
    const m3_st_tensor *t = m3_st_find(st, names[i]);
    ck_assert_ptr_nonnull(t);
    ck_assert_str_eq(m3_dtype_name(t->dtype), names[i]);
    ck_assert_int_eq(t->ndim, 1);
    ck_assert_int_eq(t->shape[0], N);
    ck_assert_uint_eq(t->numel, N);
    uint8_t back[N * 8];
    ck_assert_int_eq(m3_st_copy(t, back, sizeof back, NULL), M3_OK);
    ck_assert(memcmp(back, bytes[i], t->nbytes) == 0);
  }
  /* The data section starts at 2 mod 8, so multi-byte tensors are misaligned;
   * the mapping is page-aligned, so file offsets are address offsets. */
  const m3_st_tensor *t32 = m3_st_find(st, "F32");
  ck_assert_uint_eq(m3_st_find(st, "BF16")->file_offset % 8, 2);
  ck_assert_uint_eq((uintptr_t)m3_st_find(st, "BF16")->data % 8, 2);
  ck_assert_uint_ne((uintptr_t)t32->data % 4, 0);
  float fv[N];
  ck_assert_int_eq(m3_st_to_f32(m3_st_find(st, "BF16"), fv, N, NULL), M3_OK);
  ck_assert(fv[0] == 1 && fv[1] == -1 && fv[2] == 0 && signbit(fv[3]) && isinf(fv[4]) &&
            fv[5] > 0 && fabsf(fv[6] - 3.140625f) == 0);
  ck_assert_int_eq(m3_st_to_f32(m3_st_find(st, "F16"), fv, N, NULL), M3_OK);
  ck_assert(fv[0] == 1 && fv[1] == -2 && fv[2] == ldexpf(1, -24) && fv[3] == 65504 &&
            isinf(fv[4]) && fv[4] < 0 && fabsf(fv[5] - 0.33325195f) < 1e-7f && fv[6] == 0);
  ck_assert_int_eq(m3_st_to_f32(m3_st_find(st, "F8_E4M3"), fv, N, NULL), M3_OK);
  ck_assert(fv[0] == 1 && fv[1] == -1 && fv[2] == ldexpf(1, -9) && fv[3] == 448 &&
            fv[4] == ldexpf(1, -6) && fv[5] == 0 && signbit(fv[6]));
  ck_assert_int_eq(m3_st_to_f32(t32, fv, N, NULL), M3_OK);
  for (int j = 0; j < N; j++) {
    float w;
    memcpy(&w, bytes[2] + 4 * j, 4);
    ck_assert(memcmp(&w, &fv[j], 4) == 0);
  }
  m3_err e = {0};
  ck_assert_int_eq(m3_st_to_f32(m3_st_find(st, "I32"), fv, N, &e), M3_UNSUPPORTED);
  ck_assert_int_eq(m3_st_to_f32(t32, fv, N - 1, &e), M3_RANGE);
  ck_assert_int_eq(m3_st_copy(t32, fv, 3, &e), M3_RANGE);
  ck_assert_ptr_nonnull(strstr(e.msg, "tensor 'F32'"));
  const m3_st_tensor *z = m3_st_find(st, "empty");
  ck_assert_ptr_nonnull(z);
  ck_assert_int_eq(z->ndim, 1);
  ck_assert_int_eq(z->shape[0], 0);
  ck_assert_uint_eq(z->numel, 0);
  ck_assert_uint_eq(z->nbytes, 0);
  ck_assert_int_eq(m3_st_copy(z, fv, 0, NULL), M3_OK);
  /* Iteration is by name. */
  for (size_t i = 1; i < m3_st_count(st); i++)
    ck_assert(strcmp(m3_st_at(st, i - 1)->name, m3_st_at(st, i)->name) < 0);
  ck_assert_ptr_null(m3_st_find(st, "nope"));
  m3_st_close(st);

  /* An empty tensor inside another's range, and a scalar. */
  write_hdr(P("e0.safetensors"),
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]},"
            "\"z\":{\"dtype\":\"BF16\",\"shape\":[3,0],\"data_offsets\":[4,4]},"
            "\"s\":{\"dtype\":\"I16\",\"shape\":[],\"data_offsets\":[8,10]}}", "abcdefghij", 10);
  st = open_ok(P("e0.safetensors"));
  ck_assert_uint_eq(m3_st_find(st, "z")->numel, 0);
  ck_assert_uint_eq(m3_st_find(st, "s")->numel, 1);
  ck_assert_int_eq(m3_st_find(st, "s")->ndim, 0);
  ck_assert_uint_eq(m3_st_n_warnings(st), 0);
  m3_st_close(st);

  /* Unknown dtype "X": an error naming the tensor and the dtype, never skipped. */
  write_hdr(P("x.safetensors"),
            "{\"ok\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
            "\"weird\":{\"dtype\":\"X\",\"shape\":[1],\"data_offsets\":[1,2]}}", "ab", 2);
  expect_open_fail(P("x.safetensors"), M3_FORMAT, "x.safetensors: tensor 'weird': unknown dtype \"X\"", NULL);
}
END_TEST

/* ---- sharding ---- */

static void write_index(const char *dir_file, const char *const *pairs /* name, shard, ..., NULL */) {
  json_t *idx = json_object(), *wm = json_object();
  for (; *pairs; pairs += 2) json_object_set_new(wm, pairs[0], json_string(pairs[1]));
  json_object_set_new(idx, "metadata", json_object());
  json_object_set_new(idx, "weight_map", wm);
  char *t = json_dumps(idx, JSON_INDENT(1));
  write_text(dir_file, t);
  free(t);
  json_decref(idx);
}

START_TEST(sharding_rules) {
  uint8_t b[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  ent s1[] = {{"a", "U8", 1, {4}, b, 4}, {"b", "U8", 1, {4}, b + 4, 4}};
  ent s2[] = {{"c", "U8", 1, {8}, b + 8, 8}};
  write_st(P("s-1.safetensors"), s1, 2, 0);
  write_st(P("s-2.safetensors"), s2, 1, 0);
  const char *idx = P("model.safetensors.index.json");

  write_index(idx, (const char *[]){"a", "s-1.safetensors", "b", "s-1.safetensors", "c", "s-2.safetensors", NULL});
  m3_st *st = open_ok(tmp);
  ck_assert_uint_eq(m3_st_count(st), 3);
  ck_assert_uint_eq(m3_st_n_files(st), 2);
  ck_assert_ptr_nonnull(strstr(m3_st_file(st, 1), "s-2.safetensors"));
  ck_assert_ptr_nonnull(strstr(m3_st_find(st, "c")->file, "s-2.safetensors"));
  ck_assert_int_eq(((const uint8_t *)m3_st_find(st, "c")->data)[0], 9);
  m3_st_close(st);
  st = open_ok(idx); /* the index path itself works too */
  m3_st_close(st);

  /* Index names a tensor its shard lacks. */
  write_index(idx, (const char *[]){"a", "s-1.safetensors", "b", "s-1.safetensors", "c", "s-2.safetensors",
                                    "d", "s-2.safetensors", NULL});
  expect_open_fail(tmp, M3_NOTFOUND, "tensor 'd' is listed for shard 's-2.safetensors' but no shard has it", NULL);
  /* Index puts a tensor in the wrong shard. */
  write_index(idx, (const char *[]){"a", "s-1.safetensors", "b", "s-2.safetensors", "c", "s-2.safetensors", NULL});
  expect_open_fail(tmp, M3_FORMAT, "tensor 'b' is listed for shard 's-2.safetensors' but found in", "s-1.safetensors");
  /* A shard holds a tensor the index does not list (policy: error). */
  write_index(idx, (const char *[]){"a", "s-1.safetensors", "c", "s-2.safetensors", NULL});
  expect_open_fail(tmp, M3_FORMAT, "tensor 'b' is not listed in the index", "s-1.safetensors");
  /* Shard names must be plain file names. */
  write_index(idx, (const char *[]){"a", "../s-1.safetensors", NULL});
  expect_open_fail(tmp, M3_FORMAT, "shard name '../s-1.safetensors' is not a plain file name", NULL);
  write_text(idx, "{\"metadata\": {}}");
  expect_open_fail(tmp, M3_FORMAT, "weight_map missing", NULL);
  write_text(idx, "{\"weight_map\": {\"a\": ");
  expect_open_fail(tmp, M3_FORMAT, "model.safetensors.index.json:1:", "invalid JSON");

  /* Duplicate tensor name across shards. */
  ent s3[] = {{"c", "U8", 1, {8}, b, 8}};
  write_st(P("s-3.safetensors"), s3, 1, 0);
  write_index(idx, (const char *[]){"a", "s-1.safetensors", "b", "s-1.safetensors", "c", "s-2.safetensors",
                                    "x", "s-3.safetensors", NULL});
  expect_open_fail(tmp, M3_FORMAT, "tensor 'c' appears in two shards", "s-3.safetensors");

  /* A malformed shard fails the whole open, naming that shard. */
  write_hdr(P("s-2.safetensors"), "{\"c\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}", b, 7);
  write_index(idx, (const char *[]){"a", "s-1.safetensors", "b", "s-1.safetensors", "c", "s-2.safetensors", NULL});
  expect_open_fail(tmp, M3_FORMAT, "s-2.safetensors: tensor 'c'", "file truncated");
}
END_TEST

/* ---- a small model built from the tiny preset ---- */

static void small_config(m3_config *c) {
  m3_err e = {0};
  ck_assert_int_eq(m3_config_preset("tiny", c, &e), M3_OK);
  c->num_hidden_layers = 5; /* 3 dense + 2 sparse/MoE */
  c->vocab_size = 512;
  c->num_local_experts = 4;
  c->num_experts_per_tok = 2;
}

/* Copy every tensor of `st` (optionally skipping one and renaming by prefix
 * replacement) plus `extra` into a single file. */
static void rewrite_single(const m3_st *st, const char *out, const char *skip, const char *from_prefix,
                           const char *to_prefix, const ent *extra, size_t nextra) {
  size_t n = m3_st_count(st);
  ent *v = calloc(n + nextra, sizeof *v);
  char **names = calloc(n, sizeof *names);
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    const m3_st_tensor *t = m3_st_at(st, i);
    if (skip && strcmp(t->name, skip) == 0) continue;
    const char *nm = t->name;
    if (from_prefix && strncmp(nm, from_prefix, strlen(from_prefix)) == 0) {
      names[i] = malloc(strlen(nm) + 64);
      sprintf(names[i], "%s%s", to_prefix, nm + strlen(from_prefix));
      nm = names[i];
    }
    v[k] = (ent){nm, m3_dtype_name(t->dtype), t->ndim, {0}, t->data, t->nbytes};
    memcpy(v[k].shape, t->shape, sizeof t->shape);
    k++;
  }
  for (size_t i = 0; i < nextra; i++) v[k++] = extra[i];
  write_st(out, v, k, 0);
  for (size_t i = 0; i < n; i++) free(names[i]);
  free(names);
  free(v);
}

static m3_status bind_dir(const m3_config *c, const char *dir, m3_st **st, m3_ckpt **k, m3_err *e) {
  *k = NULL;
  *st = NULL;
  m3_status s = m3_st_open(dir, st, e);
  if (s != M3_OK) return s;
  return m3_ckpt_bind(c, *st, dir, k, e);
}

/* Fault 36a: the index lists 3 shards and the second is deleted. */
START_TEST(fault36a_missing_shard) {
  m3_config c;
  small_config(&c);
  m3_err e = {0};
  ck_assert_msg(m3_ckpt_write(&c, tmp, 3, 0, 5, &e) == M3_OK, "%s", e.msg);
  m3_st *st = open_ok(tmp);
  ck_assert_uint_eq(m3_st_n_files(st), 3);
  m3_st_close(st);
  ck_assert_int_eq(unlink(P("model-00002-of-00003.safetensors")), 0);
  expect_open_fail(tmp, M3_NOTFOUND, "shard 'model-00002-of-00003.safetensors' named in weight_map does not exist",
                   "model.safetensors.index.json");
}
END_TEST

/* Fault 36b: a required tensor (layer 3's routing bias) is in no shard; in
 * MXFP8, a weight's scale is missing.  Both are errors naming the tensor. */
START_TEST(fault36b_missing_tensor) {
  for (int mx = 0; mx < 2; mx++) {
    m3_config c;
    small_config(&c);
    m3_err e = {0};
    char src[512], dst[512];
    snprintf(src, sizeof src, "%s/src%d", tmp, mx);
    snprintf(dst, sizeof dst, "%s/dst%d", tmp, mx);
    ck_assert_msg(m3_ckpt_write(&c, src, 2, mx, 9, &e) == M3_OK, "%s", e.msg);
    m3_st *st = open_ok(src);
    const char *gone = mx ? "language_model.model.layers.4.block_sparse_moe.experts.2.w3.weight_scale_inv"
                          : "language_model.model.layers.3.block_sparse_moe.e_score_correction_bias";
    ck_assert_ptr_nonnull(m3_st_find(st, gone));
    mkdir(dst, 0755);
    char out[600];
    snprintf(out, sizeof out, "%s/model.safetensors", dst);
    rewrite_single(st, out, gone, NULL, NULL, NULL, 0);
    m3_st_close(st);

    m3_ckpt *k = (m3_ckpt *)0x1;
    m3_status s = bind_dir(&c, dst, &st, &k, &e);
    ck_assert_int_eq(s, M3_NOTFOUND);
    ck_assert_ptr_null(k);
    char want[256];
    snprintf(want, sizeof want, "tensor '%s' (", gone);
    ck_assert_msg(strstr(e.msg, want) && strstr(e.msg, "is missing"), "%s", e.msg);
    if (!mx) ck_assert_ptr_nonnull(strstr(e.msg, "(layer 3, moe_bias)"));
    m3_st_close(st);
  }
}
END_TEST

START_TEST(inventory_checks) {
  m3_config c;
  small_config(&c);
  m3_err e = {0};
  ck_assert_int_eq(m3_ckpt_write(&c, P("src"), 1, 0, 3, &e), M3_OK);
  m3_st *src = open_ok(P("src"));
  mkdir(P("d"), 0755);
  char out[512];
  snprintf(out, sizeof out, "%s", P("d/model.safetensors"));
  m3_st *st;
  m3_ckpt *k;
  uint8_t zeros[4096] = {0};

  /* Wrong shape: layer 1's k_norm as [64]. */
  const char *kn = "language_model.model.layers.1.self_attn.k_norm.weight";
  ent bad_shape = {kn, "BF16", 1, {64}, zeros, 128};
  rewrite_single(src, out, kn, NULL, NULL, &bad_shape, 1);
  ck_assert_int_eq(bind_dir(&c, P("d"), &st, &k, &e), M3_FORMAT);
  ck_assert_msg(strstr(e.msg, kn) && strstr(e.msg, "shape [64], expected [128]"), "%s", e.msg);
  m3_st_close(st);

  /* Wrong dtype: the final norm as F16. */
  const char *fn = "language_model.model.norm.weight";
  ent bad_dt = {fn, "F16", 1, {256}, zeros, 512};
  rewrite_single(src, out, fn, NULL, NULL, &bad_dt, 1);
  ck_assert_int_eq(bind_dir(&c, P("d"), &st, &k, &e), M3_FORMAT);
  ck_assert_msg(strstr(e.msg, fn) && strstr(e.msg, "dtype F16, expected BF16 or F32"), "%s", e.msg);
  m3_st_close(st);

  /* A stray scale beside a bf16 weight. */
  const char *qs = "language_model.model.layers.0.self_attn.q_proj.weight_scale_inv";
  ent stray = {qs, "U8", 2, {1024, 16}, calloc(1024, 16), 1024 * 16};
  rewrite_single(src, out, NULL, NULL, NULL, &stray, 1);
  ck_assert_int_eq(bind_dir(&c, P("d"), &st, &k, &e), M3_FORMAT);
  ck_assert_msg(strstr(e.msg, qs) && strstr(e.msg, "BF16, not F8_E4M3"), "%s", e.msg);
  free((void *)stray.data);
  m3_st_close(st);

  /* Vision, MTP and unknown extras are notes; the bind succeeds. */
  ent extras[] = {{"vision_tower.blocks.0.attn.qkv.weight", "BF16", 1, {8}, zeros, 16},
                  {"model.vision_tower.x", "BF16", 1, {8}, zeros, 16},
                  {"multi_modal_projector.linear_1.weight", "BF16", 1, {8}, zeros, 16},
                  {"patch_merge_mlp.0.weight", "BF16", 1, {8}, zeros, 16},
                  {"language_model.model.mtp.layers.0.eh_proj.weight", "BF16", 1, {8}, zeros, 16},
                  {"language_model.model.mtp.layers.0.enorm.weight", "BF16", 1, {8}, zeros, 16},
                  {"language_model.model.layers.0.self_attn.rotary_emb.inv_freq", "F32", 1, {32}, zeros, 128}};
  rewrite_single(src, out, NULL, NULL, NULL, extras, 7);
  ck_assert_msg(bind_dir(&c, P("d"), &st, &k, &e) == M3_OK, "%s", e.msg);
  ck_assert_uint_eq(m3_ckpt_n_notes(k), 3);
  int saw_extra = 0, saw_vision = 0, saw_mtp = 0;
  for (size_t i = 0; i < m3_ckpt_n_notes(k); i++) {
    const char *n = m3_ckpt_note(k, i);
    saw_extra |= strstr(n, "extra tensor 'language_model.model.layers.0.self_attn.rotary_emb.inv_freq'") != NULL;
    saw_vision |= strstr(n, "skipped 4 vision-tower tensors") != NULL;
    saw_mtp |= strstr(n, "skipped 2 MTP tensors") != NULL;
  }
  ck_assert(saw_extra && saw_vision && saw_mtp);
  m3_ckpt_free(k);
  m3_st_close(st);

  /* The bare (non-VL) layout binds with prefix "". */
  rewrite_single(src, out, NULL, "language_model.", "", NULL, 0);
  ck_assert_msg(bind_dir(&c, P("d"), &st, &k, &e) == M3_OK, "%s", e.msg);
  ck_assert_str_eq(m3_ckpt_prefix(k), "");
  ck_assert_ptr_nonnull(m3_ckpt_get(k, 3, M3_ROLE_INDEX_K_PROJ, -1));
  m3_ckpt_free(k);
  m3_st_close(st);

  /* Missing several: the first is named and the rest counted. */
  const char *emb = "language_model.model.embed_tokens.weight";
  rewrite_single(src, out, emb, "language_model.model.layers.4.", "language_model.model.layers.9.", NULL, 0);
  ck_assert_int_eq(bind_dir(&c, P("d"), &st, &k, &e), M3_NOTFOUND);
  ck_assert_msg(strstr(e.msg, "tensor 'language_model.model.embed_tokens.weight' (global, embed) is missing") &&
                    strstr(e.msg, "more problems)"), "%s", e.msg);
  m3_st_close(st);
  m3_st_close(src);
}
END_TEST

/* ---- make-checkpoint -> open -> inventory round trip (tiny preset) ---- */

static void round_trip(int mxfp8) {
  m3_config c;
  m3_err e = {0};
  ck_assert_int_eq(m3_config_preset("tiny", &c, &e), M3_OK);
  const uint64_t seed = 42;
  ck_assert_msg(m3_ckpt_write(&c, tmp, 3, mxfp8, seed, &e) == M3_OK, "%s", e.msg);

  /* config.json: VL form, same model, quant_method recorded. */
  m3_config back;
  ck_assert_msg(m3_config_load_file(P("config.json"), &back, &e) == M3_OK, "%s", e.msg);
  ck_assert_str_eq(back.quant_method, mxfp8 ? "mxfp8" : "");
  back.quant_method[0] = 0;
  memset(back.quant_method, 0, sizeof back.quant_method);
  ck_assert_int_eq(back.is_vl, 1);
  ck_assert(memcmp(&back, &c, sizeof c) == 0);
  for (int i = 1; i <= 3; i++) {
    char f[64];
    snprintf(f, sizeof f, "model-%05d-of-00003.safetensors", i);
    ck_assert_int_eq(access(P(f), R_OK), 0);
  }

  m3_st *st;
  m3_ckpt *k;
  ck_assert_msg(bind_dir(&back, tmp, &st, &k, &e) == M3_OK, "%s", e.msg);
  ck_assert_uint_eq(m3_st_n_files(st), 3);
  ck_assert_uint_eq(m3_st_n_warnings(st), 0);
  ck_assert_str_eq(m3_ckpt_prefix(k), "language_model.");
  ck_assert_int_eq(m3_ckpt_quant(k), mxfp8 ? M3_QUANT_MXFP8 : M3_QUANT_BF16);
  ck_assert_uint_eq(m3_ckpt_n_notes(k), 0);
  ck_assert_str_eq(m3_st_metadata(st, "format"), "pt");

  m3_tensor_spec *specs;
  size_t n;
  ck_assert_int_eq(m3_ckpt_expected(&c, &specs, &n, &e), M3_OK);
  size_t n_linear = 0;
  for (size_t i = 0; i < n; i++) n_linear += specs[i].kind == M3_WK_LINEAR;
  ck_assert_uint_eq(m3_st_count(st), n + (mxfp8 ? n_linear : 0));
  /* 3 globals; dense layers 8 + 3 MLP; sparse MoE layers 8 + 4 index + router,
   * bias + 3·16 experts + 3 shared. */
  ck_assert_uint_eq(n, 3 + 3 * (8 + 3) + 57 * (12 + 2 + 3 * 8 + 3));
  free(specs);

  /* Role lookup covers the layer kinds. */
  ck_assert_ptr_nonnull(m3_ckpt_get(k, -1, M3_ROLE_EMBED, -1));
  ck_assert_ptr_nonnull(m3_ckpt_get(k, -1, M3_ROLE_LM_HEAD, -1));
  ck_assert_ptr_null(m3_ckpt_get(k, 0, M3_ROLE_INDEX_Q_PROJ, -1));
  ck_assert_ptr_null(m3_ckpt_get(k, 3, M3_ROLE_MLP_GATE, -1));
  ck_assert_ptr_null(m3_ckpt_get(k, 60, M3_ROLE_Q_PROJ, -1));
  ck_assert_ptr_null(m3_ckpt_get(k, 3, M3_ROLE_EXPERT_W1, 8));
  const m3_weight *w = m3_ckpt_get(k, 0, M3_ROLE_MLP_DOWN, -1);
  ck_assert_ptr_nonnull(w);
  ck_assert_int_eq(w->w->shape[0], 256);
  ck_assert_int_eq(w->w->shape[1], 256);
  w = m3_ckpt_get(k, 59, M3_ROLE_EXPERT_W2, 7);
  ck_assert_str_eq(w->w->name, "language_model.model.layers.59.block_sparse_moe.experts.7.w2.weight");
  ck_assert_int_eq(w->w->shape[0], 256);
  ck_assert_int_eq(w->w->shape[1], 64);
  const m3_weight *bias = m3_ckpt_get(k, 3, M3_ROLE_MOE_BIAS, -1);
  ck_assert_int_eq(bias->w->dtype, M3_DT_F32);
  ck_assert_int_eq(m3_ckpt_get(k, 3, M3_ROLE_MOE_ROUTER, -1)->w->dtype, M3_DT_F32);
  ck_assert_int_eq(m3_ckpt_get(k, 3, M3_ROLE_INDEX_K_PROJ, -1)->w->shape[0], 128);
  ck_assert_int_eq(m3_ckpt_get(k, 3, M3_ROLE_INDEX_Q_PROJ, -1)->w->shape[0], 512);

  /* Values: regenerate and compare.  bf16: bit-exact.  mxfp8: the scale rule
   * of ckpt_write.h, the writer's fast e4m3 encoder equal to the reference
   * m3_f32_to_e4m3, and dequant within e4m3 rounding of the value. */
  const m3_weight *q = m3_ckpt_get(k, 3, M3_ROLE_Q_PROJ, -1);
  size_t rows = 1024, cols = 256, nel = rows * cols; /* tiny: 8 heads x 128, hidden 256 */
  float *v = malloc(nel * sizeof *v);
  m3_ckpt_random_values(seed, q->w->name, 0.02f, v, nel);
  double sum2 = 0;
  for (size_t i = 0; i < nel; i++) sum2 += (double)v[i] * v[i];
  ck_assert_msg(fabs(sqrt(sum2 / nel) - 0.02) < 0.0005, "std %g", sqrt(sum2 / nel));
  uint8_t *bytes = malloc(q->w->nbytes);
  ck_assert_int_eq(m3_st_copy(q->w, bytes, q->w->nbytes, NULL), M3_OK);
  if (!mxfp8) {
    ck_assert_ptr_null(q->scale);
    for (size_t i = 0; i < nel; i++) {
      uint16_t h = (uint16_t)(bytes[2 * i] | bytes[2 * i + 1] << 8);
      ck_assert_uint_eq(h, m3_f32_to_bf16(v[i]));
    }
  } else {
    ck_assert_ptr_nonnull(q->scale);
    ck_assert_int_eq(q->w->dtype, M3_DT_F8_E4M3);
    ck_assert_int_eq(q->scale->dtype, M3_DT_U8);
    ck_assert_int_eq(q->scale->shape[1], (int64_t)(cols / 32));
    uint8_t *sc = malloc(q->scale->nbytes);
    ck_assert_int_eq(m3_st_copy(q->scale, sc, q->scale->nbytes, NULL), M3_OK);
    for (size_t r = 0; r < rows; r++)
      for (size_t b = 0; b < cols / 32; b++) {
        float amax = 0;
        for (size_t j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[r * cols + b * 32 + j]));
        int kexp = (int)sc[r * (cols / 32) + b] - 127;
        float m = ldexpf(amax, -kexp);
        ck_assert_msg(m <= 448.0f && m > 224.0f, "block amax/2^k = %g", m);
        for (size_t j = 0; j < 32; j++) {
          size_t i = r * cols + b * 32 + j;
          ck_assert_uint_eq(bytes[i], m3_f32_to_e4m3(ldexpf(v[i], -kexp)));
          float d = m3_e4m3_to_f32(bytes[i]) * m3_e8m0_to_f32(sc[r * (cols / 32) + b]);
          float tol = fmaxf(fabsf(v[i]) / 16.0f, ldexpf(1.0f, kexp - 10));
          ck_assert_msg(fabsf(d - v[i]) <= tol, "w %g dequant %g", v[i], d);
        }
      }
    free(sc);
  }
  free(bytes);
  free(v);
  m3_ckpt_free(k);
  m3_st_close(st);
}

START_TEST(tiny_round_trip_bf16) { round_trip(0); }
END_TEST
START_TEST(tiny_round_trip_mxfp8) { round_trip(1); }
END_TEST

START_TEST(writer_args_and_quant_rule) {
  m3_config c;
  small_config(&c);
  m3_err e = {0};
  ck_assert_int_eq(m3_ckpt_write(&c, P("w"), 0, 0, 1, &e), M3_INVAL);
  ck_assert_ptr_nonnull(strstr(e.msg, "n_shards 0"));
  ck_assert_int_eq(m3_ckpt_write(&c, P("w"), 100000, 0, 1, &e), M3_INVAL);
  ck_assert_int_eq(m3_ckpt_write(&c, "/proc/m3kit-nope/x", 1, 0, 1, &e), M3_IO);
  /* Deterministic and independent of the shard count. */
  ck_assert_int_eq(m3_ckpt_write(&c, P("one"), 1, 1, 77, &e), M3_OK);
  ck_assert_int_eq(m3_ckpt_write(&c, P("many"), 7, 1, 77, &e), M3_OK);
  m3_st *a = open_ok(P("one")), *b = open_ok(P("many"));
  ck_assert_uint_eq(m3_st_count(a), m3_st_count(b));
  ck_assert_uint_eq(m3_st_n_files(b), 7);
  for (size_t i = 0; i < m3_st_count(a); i++) {
    const m3_st_tensor *x = m3_st_at(a, i), *y = m3_st_at(b, i);
    ck_assert_str_eq(x->name, y->name);
    ck_assert_uint_eq(x->nbytes, y->nbytes);
    ck_assert(memcmp(x->data, y->data, x->nbytes) == 0);
  }
  m3_st_close(a);
  m3_st_close(b);
  /* The rule's edge cases: zero block, a block at exactly 448·2^k, tail block. */
  float x[40] = {0};
  uint8_t qq[40], ss[2];
  m3_mxfp8_quantize_row(x, 32, qq, ss);
  ck_assert_uint_eq(ss[0], 127);
  ck_assert_uint_eq(qq[5], 0);
  x[0] = 448.0f;
  x[1] = -1.0f;
  x[35] = 480.0f; /* would saturate under floor(log2 amax) - 8 */
  m3_mxfp8_quantize_row(x, 40, qq, ss);
  ck_assert_uint_eq(ss[0], 127);
  ck_assert_uint_eq(qq[0], 0x7e);
  ck_assert_uint_eq(ss[1], 128);
  ck_assert(m3_e4m3_to_f32(qq[35]) * 2.0f == 480.0f);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("safetensors");
  TCase *tc = tcase_create("reader");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, fault37_each_case_distinct);
  tcase_add_test(tc, header_field_checks);
  tcase_add_test(tc, fault38_dtypes_empty_unaligned);
  tcase_add_test(tc, sharding_rules);
  tcase_add_test(tc, fault36a_missing_shard);
  tcase_add_test(tc, fault36b_missing_tensor);
  tcase_add_test(tc, inventory_checks);
  tcase_add_test(tc, writer_args_and_quant_rule);
  suite_add_tcase(s, tc);
  TCase *rt = tcase_create("round_trip");
  tcase_add_checked_fixture(rt, setup, teardown);
  tcase_set_timeout(rt, 300); /* ~1 GB (bf16) / 0.5 GB (mxfp8) written and read back */
  tcase_add_test(rt, tiny_round_trip_bf16);
  tcase_add_test(rt, tiny_round_trip_mxfp8);
  suite_add_tcase(s, rt);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
