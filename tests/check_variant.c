/* check_variant.c - variant keys: canonical print/parse round trips, rejected
 * keys with their reasons, tile verdicts, and the Lua sandbox. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cache/tunedb.h"
#include "gen/code_hash.h"
#include "gen/render.h"
#include "m3config.h"
#include "runtime/tuning_lookup.h"

static m3_lua *L;
static void setup(void) { m3_err e; ck_assert_int_eq(m3_lua_open(&L, &e), M3_OK); }
static void teardown(void) { m3_lua_close(L); }

#define QK "qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=e4m3,nq=64,nkv=4,niq=4,hd=128,rot=64,bs=128)"

START_TEST(round_trip) {
  const char *keys[] = {QK, QK "[warps=4,hpw=1,lph=32,rope=pair]", QK "[warps=8,hpw=2,lph=16,rope=pair]@sm_90a", QK "@sm_120"};
  for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
    m3_variant v;
    m3_err e;
    ck_assert_msg(m3_render_parse_key(L, keys[i], &v, &e) == M3_OK, "%s", e.msg);
    char out[M3_KEY_MAX];
    m3_variant_print(&v, out, sizeof out);
    ck_assert_str_eq(out, keys[i]);
    m3_variant w;
    ck_assert_int_eq(m3_render_parse_key(L, out, &w, &e), M3_OK);
    char out2[M3_KEY_MAX];
    m3_variant_print(&w, out2, sizeof out2);
    ck_assert_str_eq(out2, out);
  }
}
END_TEST

START_TEST(canonicalises) {
  m3_variant v;
  m3_err e;
  /* Out of order, leading zeros: printed back in declared order, normalised. */
  ck_assert_int_eq(m3_render_parse_key(L, "qknorm_rope(nq=064,attn=sparse,insert=01,kv=bf16,idxk=e4m3,nkv=4,niq=4,hd=128,rot=64,bs=128)", &v, &e), M3_OK);
  char out[M3_KEY_MAX];
  m3_variant_print(&v, out, sizeof out);
  ck_assert_str_eq(out, QK);
}
END_TEST

static void expect_reject(const char *key, m3_status code, const char *needle) {
  m3_variant v;
  m3_err e = {0};
  m3_status s = m3_render_parse_key(L, key, &v, &e);
  ck_assert_msg(s == code, "%s: got %s (%s)", key, m3_status_name(s), e.msg);
  ck_assert_msg(strstr(e.msg, needle) != NULL, "%s: message '%s' lacks '%s'", key, e.msg, needle);
}

START_TEST(rejects_with_reasons) {
  expect_reject("qknorm_rope(attn=sparse)", M3_KEY, "missing axis 'insert'");
  expect_reject("qknorm_rope(attn=sparse,insert=1,kv=fp4,idxk=e4m3,nq=64,nkv=4,niq=4,hd=128,rot=64,bs=128)", M3_KEY, "kv=fp4 is not one of bf16|e4m3");
  expect_reject("qknorm_rope(attn=sparse,insert=2,kv=bf16,idxk=e4m3,nq=64,nkv=4,niq=4,hd=128,rot=64,bs=128)", M3_KEY, "insert=2 is not one of 0|1");
  expect_reject(QK "[warps=3,hpw=1,lph=32,rope=pair]", M3_KEY, "warps=3 is not one of");
  expect_reject("qknorm_rope(attn=sparse,colour=red,insert=1,kv=bf16,idxk=e4m3,nq=64,nkv=4,niq=4,hd=128,rot=64,bs=128)", M3_KEY, "unknown axis 'colour'");
  expect_reject("qknorm_rope(attn=sparse,attn=dense)", M3_KEY, "duplicate");
  expect_reject("qknorm_rope(attn=sparse", M3_KEY, "column");
  expect_reject("QK(attn=sparse)", M3_KEY, "lower-case");
  expect_reject(QK "@gfx90a", M3_KEY, "arch");
  expect_reject("no_such_template(a=1)", M3_NOTFOUND, "no_such_template");
  expect_reject("qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=e4m3,nq=six,nkv=4,niq=4,hd=128,rot=64,bs=128)", M3_KEY, "not an integer");
  expect_reject("embed(hidden=99999999999999999999)", M3_KEY, "out of range");
  expect_reject("embed(hidden=4294967296)", M3_KEY, "out of range");
}
END_TEST

static void expect_invalid(const char *key, const char *needle) {
  m3_variant v;
  m3_err e = {0};
  ck_assert_msg(m3_render_parse_key(L, key, &v, &e) == M3_OK, "%s", e.msg);
  char why[512];
  ck_assert_int_eq(m3_render_valid(L, &v, why, sizeof why, &e), M3_TILE);
  ck_assert_msg(strstr(why, needle) != NULL, "%s: reason '%s' lacks '%s'", key, why, needle);
  ck_assert(strstr(e.msg, "INVALID") != NULL);
}

START_TEST(invalid_combinations_have_reasons) {
  expect_invalid("qknorm_rope(attn=dense,insert=1,kv=bf16,idxk=e4m3,nq=64,nkv=4,niq=0,hd=128,rot=64,bs=128)[warps=4,hpw=1,lph=32,rope=pair]@sm_90", "idxk must be bf16");
  expect_invalid("qknorm_rope(attn=dense,insert=0,kv=e4m3,idxk=bf16,nq=64,nkv=4,niq=0,hd=128,rot=64,bs=128)[warps=4,hpw=1,lph=32,rope=pair]@sm_90", "insert=1");
  expect_invalid("qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=bf16,nq=64,nkv=4,niq=4,hd=64,rot=64,bs=128)[warps=4,hpw=1,lph=32,rope=pair]@sm_90", "head_dim must be 128");
  expect_invalid("qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=bf16,nq=64,nkv=4,niq=4,hd=128,rot=60,bs=128)[warps=4,hpw=1,lph=32,rope=pair]@sm_90", "multiple of 8");
  expect_invalid("qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=bf16,nq=64,nkv=3,niq=4,hd=128,rot=64,bs=128)[warps=4,hpw=1,lph=32,rope=pair]@sm_90", "divide");
  expect_invalid("attn_dense(mode=decode,kv=bf16,nq=0,nkv=4,hd=128,bs=128)[warps=8,ctas=1,depth=1,cvt=alu,lead=0,merge=fence]@sm_90", "positive");
  expect_invalid("attn_dense(mode=decode,kv=bf16,nq=64,nkv=4,hd=128,bs=128)[warps=8,ctas=1,depth=2,cvt=alu,lead=0,merge=fence]@sm_90", "e4m3");
  expect_invalid("attn_sparse(mode=decode,kv=bf16,nq=64,nkv=4,hd=128,bs=128,topk=16)[warps=8,ctas=1,depth=1,cvt=hw,merge=fence]@sm_90", "e4m3 only");
  expect_invalid("attn_dense(mode=decode,kv=e4m3,nq=64,nkv=4,hd=128,bs=128)[warps=8,ctas=1,depth=1,cvt=hw,lead=0,merge=fence]@sm_80", "sm_89");
  expect_invalid("attn_dense(mode=prefill,kv=bf16,nq=64,nkv=4,hd=128,bs=128)[warps=4,ctas=1,depth=1,cvt=alu,lead=1,merge=fence]@sm_90", "decode");
  expect_invalid("attn_sparse(mode=prefill,kv=bf16,nq=64,nkv=4,hd=128,bs=128,topk=16)[warps=4,ctas=1,depth=1,cvt=alu,merge=acqrel]@sm_90",
                 "decode only");
  expect_invalid("index_decode(idxk=bf16,heads=4,hd=128,bs=128,topk=16,init=0,local=1)[warps=4,depth=2,waves=1,chunk=16,cvt=alu,lead=1,merge=fence,nf=scan]@sm_80", "sm_90");
  expect_invalid(QK "[warps=4,hpw=1,lph=32,rope=pair]@sm_75", "sm_80");
}
END_TEST

START_TEST(default_tile_and_tile_space) {
  m3_variant v, *t;
  m3_err e;
  int n;
  ck_assert_int_eq(m3_render_parse_key(L, QK "@sm_90", &v, &e), M3_OK);
  ck_assert_int_eq(m3_render_default_tile(L, &v, &e), M3_OK);
  ck_assert_int_eq(m3_render_valid(L, &v, NULL, 0, &e), M3_OK);
  ck_assert_int_eq(m3_render_tiles(L, &v, &t, &n, &e), M3_OK);
  ck_assert_int_eq(n, 4 * 3 * 3 * 2); /* warps x hpw x lph x rope */
  char a[M3_KEY_MAX], b[M3_KEY_MAX];
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++) {
      m3_variant_print(&t[i], a, sizeof a);
      m3_variant_print(&t[j], b, sizeof b);
      ck_assert_str_ne(a, b);
    }
  free(t);
}
END_TEST

/* A template's hash covers its own text and the lib/ files it includes,
 * transitively, and no others: a lib edit stales the tuning records of the
 * templates that emit it, not every record (gen/lua_host.c). */
static void put(const char *dir, const char *file, const char *text) {
  char p[256];
  snprintf(p, sizeof p, "%s/%s", dir, file);
  FILE *f = fopen(p, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}
static uint64_t hash_of(const char *name) {
  m3_lua *H;
  m3_err e;
  ck_assert_int_eq(m3_lua_open(&H, &e), M3_OK);
  m3_schema s;
  ck_assert_msg(m3_render_schema(H, name, &s, &e) == M3_OK, "%s", e.msg);
  m3_lua_close(H);
  return s.hash;
}
#define TPL(lib) "local L = m3.include(\"" lib "\")\nreturn {axes = {{'a', {1}}}, tiles = {{'t', {1}}},\n" \
  "  valid = function() return true end, default_tile = function() return {t = 1} end,\n" \
  "  render = function() return {source = L.s, threads = 32, smem = 0} end}\n"
START_TEST(template_hash_covers_its_includes_only) {
  char dir[] = "/tmp/m3tplXXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  char lib[300];
  snprintf(lib, sizeof lib, "%s/lib", dir);
  ck_assert_int_eq(mkdir(lib, 0700), 0);
  put(dir, "lib/a.lua", "local C = m3.include(\"lib/c\")\nreturn {s = C.s}\n");
  put(dir, "lib/b.lua", "return {s = 'b'}\n");
  put(dir, "lib/c.lua", "return {s = 'c'}\n");
  put(dir, "t1.lua", TPL("lib/a"));
  put(dir, "t2.lua", TPL("lib/b"));
  setenv("M3KIT_TEMPLATE_DIR", dir, 1);
  uint64_t t1 = hash_of("t1"), t2 = hash_of("t2");
  put(dir, "lib/b.lua", "return {s = 'b2'}\n");
  ck_assert(hash_of("t1") == t1);
  ck_assert(hash_of("t2") != t2);
  put(dir, "lib/c.lua", "return {s = 'c2'}\n"); /* reached through lib/a only */
  ck_assert(hash_of("t1") != t1);
  unsetenv("M3KIT_TEMPLATE_DIR");
}
END_TEST

/* The sandbox (gen/lua_host.c): in one state, a template that loops without
 * end, allocates without end, loads bytecode, sets a global or changes a
 * library fails with a message saying so (the loop in about a second), and
 * the next template still sees the libraries whole. */
START_TEST(sandbox_limits_and_isolation) {
  char dir[] = "/tmp/m3sbXXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  static const struct {
    const char *name, *code, *want;
  } bad[] = {
      {"loop", "while true do end", "endless loop"},
      {"mem", "local t = {} for i = 1, 1e9 do t[i] = string.rep('x', 4096) .. i end", "not enough memory"},
      {"load", "local f = load('return 1')", "global 'load'"},
      {"dump", "local d = string.dump(function() return 1 end)", "field 'dump'"},
      {"global", "helper = 1", "templates are pure"},
      {"strlib", "string.upper = nil", "templates are pure"},
      {"strmeta", "getmetatable('').__index.upper = nil", "a boolean value"},
      {"genv", "_G.string = nil", "templates are pure"},
      {"rawset", "rawset(string, 'upper', nil)", "global 'rawset'"},
      {"setmeta", "setmetatable(_ENV, nil)", "global 'setmetatable'"},
      {"pcall", "local n = 0 while n >= 0 do pcall(function() while true do end end) n = n + 1 end", "global 'pcall'"},
      {"looppos", "local n = 0\nwhile true do\n  n = n + 1\nend", "looppos.lua:3"},
  };
  const char *tail = "\nreturn {axes = {{'a', {1}}}, tiles = {{'t', {1}}},\n"
                     "  valid = function() return true end, default_tile = function() return {t = 1} end,\n"
                     "  render = function() return {source = 'x', threads = 32, smem = 0} end}\n";
  char text[1024];
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    char file[64];
    snprintf(file, sizeof file, "%s.lua", bad[i].name);
    snprintf(text, sizeof text, "%s%s", bad[i].code, tail);
    put(dir, file, text);
  }
  snprintf(text, sizeof text, "assert(('a'):upper() == 'A' and string.upper('b') == 'B' and string.dump == nil)\n"
                              "assert(getmetatable('') == false and type(math.floor) == 'function')%s",
           tail);
  put(dir, "ok.lua", text);
  setenv("M3KIT_TEMPLATE_DIR", dir, 1);
  m3_lua *H;
  m3_err e;
  ck_assert_int_eq(m3_lua_open(&H, &e), M3_OK);
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    m3_schema sc;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ck_assert_int_eq(m3_render_schema(H, bad[i].name, &sc, &e), M3_TEMPLATE);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ck_assert_msg(strstr(e.msg, bad[i].want), "%s: '%s' not in: %s", bad[i].name, bad[i].want, e.msg);
    char file[64];
    snprintf(file, sizeof file, "%s.lua", bad[i].name);
    ck_assert_msg(strstr(e.msg, file), "%s: the error does not name the file: %s", bad[i].name, e.msg);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    ck_assert_msg(s < 30, "%s took %.1f s to fail", bad[i].name, s);
  }
  m3_schema sc;
  ck_assert_msg(m3_render_schema(H, "ok", &sc, &e) == M3_OK, "after the bad templates: %s", e.msg);
  m3_lua_close(H);
  unsetenv("M3KIT_TEMPLATE_DIR");
}
END_TEST

/* What the compiler ignores does not move the code hash; anything else does. */
START_TEST(code_hash_ignores_comments_and_blanks) {
  const char *base = "#define N 4\n__global__ void k(float *x) {\n  x[0] = N; /* one */\n  asm(\"mov.u32 %0,  1;\");\n}\n";
  const char *same[] = {
      "// a header comment\n#define N 4\n\n__global__  void\tk(float *x) {  \n x[0] = N;\n  asm(\"mov.u32 %0,  1;\"); // done\n}",
      "#define N 4\n/* a block\n   comment */__global__ void k(float *x) {\nx[0] = N;   \n  asm(\"mov.u32 %0,  1;\");\n}\n\n\n",
  };
  const char *differ[] = {
      "#define N 5\n__global__ void k(float *x) {\n  x[0] = N;\n  asm(\"mov.u32 %0,  1;\");\n}\n",   /* code */
      "#define N 4 __global__ void k(float *x) {\n  x[0] = N;\n  asm(\"mov.u32 %0,  1;\");\n}\n",   /* a line break in a directive */
      "#define N 4\n__global__ void k(float *x) {\n  x[0] = N;\n  asm(\"mov.u32 %0, 1;\");\n}\n",    /* inside a literal: kept as is */
      "#define N 4\n__global__ void k(float *x) {\n  x[0] = N;\n  asm(\"mov.u32 %0,  1; // x\");\n}\n", /* '//' inside a literal is no comment */
      "#define N 4\n__global__ void k(float *x) {\n  x[0]=N;\n  asm(\"mov.u32 %0,  1;\");\n}\n",     /* blanks removed, not collapsed */
  };
  const uint64_t h = m3_code_hash(base, strlen(base), NULL, 128, 0);
  for (size_t i = 0; i < sizeof same / sizeof *same; i++)
    ck_assert_msg(m3_code_hash(same[i], strlen(same[i]), NULL, 128, 0) == h, "same[%zu]", i);
  for (size_t i = 0; i < sizeof differ / sizeof *differ; i++)
    ck_assert_msg(m3_code_hash(differ[i], strlen(differ[i]), NULL, 128, 0) != h, "differ[%zu]", i);
  ck_assert(m3_code_hash(base, strlen(base), NULL, 256, 0) != h); /* the launch too */
  ck_assert(m3_code_hash(base, strlen(base), NULL, 128, 16) != h);
  size_t n;
  char *t = m3_code_normalise(same[1], strlen(same[1]), NULL, &n);
  ck_assert_str_eq(t, "#define N 4\n__global__ void k(float *x) {\nx[0] = N;\nasm(\"mov.u32 %0,  1;\");\n}\n");
  free(t);
  /* Translation phases 1-3: splices, // comments they continue, digit
   * separators, raw strings; and a source with no blanks to drop (its output
   * is one byte longer than its input: the closing line break). */
  static const struct { const char *a, *b; int same; } pairs[] = {
      {"foo \\\n   bar;", "foo bar;", 1},
      {"foo\\\n    bar;", "foo\\\nbar;", 0},            /* two tokens, one token */
      {"a\\\n/* */b;", "a\\\nb;", 0},
      {"// c \\\nx = 1;\n", "// c\nx = 1;\n", 0},         /* the splice comments x = 1 out */
      {"int a = 1'0 + ' ';", "int a = 1'0 + '\t';", 0},      /* ' in 1'0 opens no literal */
      {"int a = 1'0;  int b;", "int a = 1'0; int b;", 1},
      {"auto s = R\"x(a\" // b)x\";", "auto s = R\"x(a\" // c)x\";", 0},
      {"auto s = R\"(a  b)\";", "auto s = R\"(a b)\";", 0},
      {"L'x' + u8\"y  z\"", "L'x' + u8\"y z\"", 0},
  };
  for (size_t i = 0; i < sizeof pairs / sizeof *pairs; i++) {
    const uint64_t ha = m3_code_hash(pairs[i].a, strlen(pairs[i].a), NULL, 32, 0);
    const uint64_t hb = m3_code_hash(pairs[i].b, strlen(pairs[i].b), NULL, 32, 0);
    ck_assert_msg((ha == hb) == pairs[i].same, "pair %zu: '%s' vs '%s'", i, pairs[i].a, pairs[i].b);
  }
  t = m3_code_normalise("a b", 3, NULL, &n);
  ck_assert_str_eq(t, "a b\n");
  free(t);
  /* The kernel's name (derived from the full key) is not code: renamed as an
   * identifier only, never inside a longer one. */
  const char *k1 = "__global__ void m3k_a_01(int *x) { m3k_a_01x(x); }\n";
  const char *k2 = "__global__ void m3k_a_02(int *x) { m3k_a_01x(x); }\n";
  ck_assert(m3_code_hash(k1, strlen(k1), "m3k_a_01", 32, 0) == m3_code_hash(k2, strlen(k2), "m3k_a_02", 32, 0));
  ck_assert(m3_code_hash(k1, strlen(k1), NULL, 32, 0) != m3_code_hash(k2, strlen(k2), NULL, 32, 0));
  t = m3_code_normalise(k1, strlen(k1), "m3k_a_01", &n);
  ck_assert_str_eq(t, "__global__ void __m3_entry__(int *x) { m3k_a_01x(x); }\n");
  free(t);
}
END_TEST

/* A template edit stales exactly the tiles whose rendered code it changes:
 * a Lua comment, a comment or blank in the CUDA text, or code emitted only
 * for another tile leave a tile's code hash alone (tuning records keep it,
 * docs/tuning-db.md), while its template hash changes every time. */
#define TPL2(extra) "-- a template\nreturn {axes = {{'a', {1}}}, tiles = {{'t', {1, 2}}},\n" \
  "  valid = function() return true end, default_tile = function() return {t = 1} end,\n" \
  "  render = function(k, t, arch, sym) local s = 'extern \"C\" __global__ void ' .. sym .. '() {}\\n'\n" \
  "    if t.t == 2 then s = s .. '" extra "' end\n" \
  "    return {source = s, threads = 32, smem = 0} end}\n"
static uint64_t code_of(const char *key) {
  m3_lua *H;
  m3_err e;
  ck_assert_int_eq(m3_lua_open(&H, &e), M3_OK);
  m3_variant v;
  uint64_t c = 0;
  ck_assert_msg(m3_render_parse_key(H, key, &v, &e) == M3_OK && m3_render_code_hash(H, &v, &c, &e) == M3_OK, "%s",
                e.msg);
  m3_lua_close(H);
  return c;
}
START_TEST(code_hash_stales_only_changed_tiles) {
  char dir[] = "/tmp/m3tplXXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  setenv("M3KIT_TEMPLATE_DIR", dir, 1);
  put(dir, "t.lua", TPL2("/* two */ __device__ int two;"));
  const uint64_t th = hash_of("t"), c1 = code_of("t(a=1)[t=1]@sm_90"), c2 = code_of("t(a=1)[t=2]@sm_90");
  ck_assert(c1 != c2);
  put(dir, "t.lua", "-- edited\n" TPL2("/* 2 */  __device__  int two;"));
  ck_assert(hash_of("t") != th);
  ck_assert(code_of("t(a=1)[t=1]@sm_90") == c1);
  ck_assert(code_of("t(a=1)[t=2]@sm_90") == c2);
  put(dir, "t.lua", TPL2("__device__ int two, three;"));
  ck_assert(code_of("t(a=1)[t=1]@sm_90") == c1);
  ck_assert(code_of("t(a=1)[t=2]@sm_90") != c2);
  unsetenv("M3KIT_TEMPLATE_DIR");
}
END_TEST

START_TEST(template_errors_name_file_and_line) {
  char dir[] = "/tmp/m3tplXXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  char p[256];
  snprintf(p, sizeof p, "%s/broken.lua", dir);
  FILE *f = fopen(p, "w");
  fputs("return {\n  axes = {{'a', {1, 2}}},\n  tiles = {{'t', {1}}},\n  valid = function() return true end,\n"
        "  default_tile = function() return {t = 1} end,\n  render = function(k) local x = nil; return x.y end,\n}\n", f);
  fclose(f);
  snprintf(p, sizeof p, "%s/sandbox.lua", dir);
  f = fopen(p, "w");
  fputs("local h = io.open('/etc/passwd')\nreturn {}\n", f);
  fclose(f);
  setenv("M3KIT_TEMPLATE_DIR", dir, 1);
  m3_lua *H;
  m3_err e;
  ck_assert_int_eq(m3_lua_open(&H, &e), M3_OK);
  m3_variant v;
  ck_assert_int_eq(m3_render_parse_key(H, "broken(a=1)[t=1]@sm_90", &v, &e), M3_OK);
  m3_source src;
  ck_assert_int_eq(m3_render_source(H, &v, &src, &e), M3_TEMPLATE);
  char at[300];
  snprintf(at, sizeof at, "%s/broken.lua:6:", dir); /* the file read, not the embedded copy's name */
  ck_assert_msg(strstr(e.msg, at) != NULL, "%s", e.msg);
  /* The sandbox has no io library. */
  ck_assert_int_eq(m3_render_parse_key(H, "sandbox(a=1)", &v, &e), M3_TEMPLATE);
  snprintf(at, sizeof at, "%s/sandbox.lua:1:", dir);
  ck_assert_msg(strstr(e.msg, at) != NULL && strstr(e.msg, "io"), "%s", e.msg);
  m3_lua_close(H);
  unsetenv("M3KIT_TEMPLATE_DIR");
}
END_TEST

/* The committed seed DB must match the templates it ships with: a template
 * (or lib/) edit stales its records, and a stale seed record is silently
 * skipped at run time, so the kernel would run its default tile.  The remedy
 * is a re-tune on the GPU and tools/seed_merge.py (bench/README.md). */
START_TEST(seed_db_matches_the_templates) {
  char path[4200];
  snprintf(path, sizeof path, "%s/sm_90.json", M3_SRC_SEED_DIR);
  m3_tunedb *db = m3_tunedb_new();
  ck_assert_ptr_nonnull(db);
  m3_tuning_hash_ctx hc = {.lua = L};
  m3_tunedb_filter f;
  m3_tuning_filter_init(&f, &hc, "sm_90", NULL);
  m3_tunedb_report rep;
  memset(&rep, 0, sizeof rep);
  m3_err e;
  /* Loaded as the user DB so that nothing is exempt from the checks. */
  ck_assert_msg(m3_tunedb_load(db, path, NULL, &f, &rep, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(rep.stale_template == 0 && rep.invalid == 0, "%s: %s", path, rep.summary);
  /* Its tiles name every tile axis (else each start completes them again: m3kit tune --rehash --db it). */
  ck_assert_msg(rep.completed == 0, "%s: %s", path, rep.summary);
  ck_assert_int_gt(rep.loaded, 100);
  /* Every seed record names the code it timed, and it is the code its tile
   * renders to now (a load takes a current template hash on trust, without
   * rendering: this is where the two are checked against each other), so
   * that template edits which leave that code alone do not stale it. */
  m3_tuning_hash_ctx cc = {.lua = L};
  for (size_t i = 0; i < m3_tunedb_count(db); i++) {
    const m3_tune_record *r = m3_tunedb_get(db, i);
    ck_assert_msg(r->prov.code_hash && !strncmp(r->prov.code_hash, M3_CODE_HASH_SCHEME, strlen(M3_CODE_HASH_SCHEME)),
                  "%s: record %s [%s] has no code_hash of scheme %s (m3kit tune --rehash --db %s)", path, r->key,
                  r->tile, M3_CODE_HASH_SCHEME, path);
    const char *now = m3_tuning_code_hash(&cc, r->key, r->tile, r->arch);
    ck_assert_msg(now && !strcmp(now, r->prov.code_hash), "%s: record %s [%s]: code hash %s, its tile renders to %s",
                  path, r->key, r->tile, r->prov.code_hash, now ? now : "nothing");
  }
  m3_tunedb_free(db);
}
END_TEST

/* A tile axis added after a tune (rmsnorm's `cluster`, session 36) whose
 * first value renders the code as it was: the records tuned before it, whose
 * tiles lack it, are kept on load with their tiles completed, and --rehash
 * writes the completion; a record whose completed tile renders other code
 * stays stale, as does a tile naming a field the template never had. */
START_TEST(added_tile_axis_completes_old_records) {
  m3_tuning_hash_ctx hc = {.lua = L};
  const char *key = "rmsnorm(add=0,f32copy=0,combine=0,n=6144)";
  const char *t = m3_tuning_complete_tile(&hc, key, "threads=768");
  ck_assert_ptr_nonnull(t);
  ck_assert_str_eq(t, "threads=768,cluster=1");
  ck_assert_ptr_null(m3_tuning_complete_tile(&hc, key, "threads=768,cluster=2"));  /* lacks nothing */
  ck_assert_ptr_null(m3_tuning_complete_tile(&hc, key, "threads=768,rows=2"));     /* not rmsnorm's */
  ck_assert_ptr_null(m3_tuning_complete_tile(&hc, "no_such_op(a=1)", "threads=768"));
  char c768[64], c512[64];
  snprintf(c768, sizeof c768, "%s", m3_tuning_code_hash(&hc, key, "threads=768,cluster=1", "sm_90"));
  snprintf(c512, sizeof c512, "%s", m3_tuning_code_hash(&hc, key, "threads=512,cluster=1", "sm_90"));
  ck_assert_str_ne(c768, c512);

  char dir[] = "/tmp/m3tdbXXXXXX", path[300], doc[4000];
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
#define OLDREC(bucket, code) OLDREC_T(bucket, "threads=768", code)
#define OLDREC_T(bucket, tile, code)                                                                             \
  "{\"key\": \"%s\", \"bucket\": \"" bucket "\", \"arch\": \"sm_90\", \"tile\": \"" tile "\", "                \
  "\"default_tile\": \"threads=256\", \"candidates\": [{\"tile\": \"threads=256\", \"disposition\": \"PASSED\"}, " \
  "{\"tile\": \"threads=768\", \"disposition\": \"PASSED\"}], \"provenance\": {\"template_hash\": "             \
  "\"0000000000000000\", \"code_hash\": \"%s\"}}"
  snprintf(doc, sizeof doc,
           "{\"format\": \"m3kit-tunedb\", \"version\": 1, \"records\": [" OLDREC("tokens=1", "%s") ", "
           OLDREC("tokens=8", "%s") ", " OLDREC_T("tokens=32", "threads=768,cluster=1", "%s") "]}\n",
           key, c768, key, c512, key, c768); /* tokens=8: its code is another tile's; tokens=32: hand-edited, its
                                                default and candidates lack the axis its tile names */
#undef OLDREC
#undef OLDREC_T
  put(dir, "sm_90.json", doc);
  m3_tunedb_filter f;
  m3_tuning_filter_init(&f, &hc, "sm_90", NULL);
  m3_tunedb_report rep;
  m3_err e;
  for (int pass = 0; pass < 2; pass++) { /* before and after --rehash */
    m3_tunedb *db = m3_tunedb_new();
    ck_assert_msg(m3_tunedb_load(db, path, NULL, &f, &rep, &e) == M3_OK, "%s", e.msg);
    ck_assert_int_eq(rep.loaded, 2);
    ck_assert_int_eq(rep.stale_template, 1);
    ck_assert_int_eq(rep.completed, pass == 0 ? 2 : 0); /* written by --rehash: nothing left to complete */
    for (int i = 0; i < 2; i++) {
      const m3_tune_record *r = m3_tunedb_get(db, (size_t)i);
      ck_assert_str_eq(r->tile, "threads=768,cluster=1");
      ck_assert_str_eq(r->default_tile, "threads=256,cluster=1");
      ck_assert_uint_eq(r->n_candidates, 2);
      ck_assert_str_eq(r->candidates[0].tile, "threads=256,cluster=1");
      ck_assert_str_eq(r->candidates[1].tile, "threads=768,cluster=1");
      ck_assert_str_eq(r->prov.code_hash, c768);
    }
    m3_tunedb_free(db);
    if (pass == 1) break;
    m3_rehash_report rr;
    ck_assert_msg(m3_tunedb_add_code_hashes(path, &f, &rr, &e) == M3_OK, "%s", e.msg);
    ck_assert_int_eq(rr.completed, 2);
    ck_assert_int_eq(rr.refreshed, 2);
    ck_assert_int_eq(rr.left, 1);
  }
  /* Without the completion (an older reader) the record is stale. */
  f.complete_tile = NULL;
  put(dir, "sm_90.json", doc);
  m3_tunedb *db = m3_tunedb_new();
  ck_assert_int_eq(m3_tunedb_load(db, path, NULL, &f, &rep, &e), M3_OK);
  ck_assert_int_eq(rep.loaded, 1); /* tokens=32, whose own tile renders its code */
  m3_tunedb_free(db);
  remove(path);
  snprintf(path, sizeof path, "%s/sm_90.json.lock", dir); /* --rehash's */
  remove(path);
  ck_assert_int_eq(rmdir(dir), 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("variant");
  TCase *tc = tcase_create("keys");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, round_trip);
  tcase_add_test(tc, canonicalises);
  tcase_add_test(tc, rejects_with_reasons);
  tcase_add_test(tc, invalid_combinations_have_reasons);
  tcase_add_test(tc, default_tile_and_tile_space);
  tcase_add_test(tc, template_errors_name_file_and_line);
  tcase_add_test(tc, template_hash_covers_its_includes_only);
  tcase_add_test(tc, code_hash_ignores_comments_and_blanks);
  tcase_add_test(tc, code_hash_stales_only_changed_tiles);
  tcase_add_test(tc, seed_db_matches_the_templates);
  tcase_add_test(tc, added_tile_axis_completes_old_records);
  suite_add_tcase(s, tc);
  /* two endless loops run to the instruction budget (about a second each,
   * several under the sanitizers) */
  TCase *sb = tcase_create("sandbox");
  tcase_set_timeout(sb, 120);
  tcase_add_test(sb, sandbox_limits_and_isolation);
  suite_add_tcase(s, sb);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
