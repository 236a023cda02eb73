/* check_jit.c - the cubin cache and the JIT without a GPU: every variant the
 * model presets need renders and compiles for every supported arch; the cache
 * key changes with each ingredient; corrupt and truncated entries are rebuilt;
 * 8 processes compiling one key at once compile it once; M3KIT_NO_JIT. */
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cache/cubin_cache.h"
#include "runtime/jit.h"
#include "runtime/model_dims.h"
#include "runtime/nvrtc.h"

#define QK "qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=e4m3,nq=64,nkv=4,niq=4,hd=128,rot=64,bs=128)[warps=4,hpw=1,lph=32,rope=pair]@sm_90"

static char dir[64];

static void fresh_cache(void) {
  snprintf(dir, sizeof dir, "/tmp/m3jitXXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dir));
  setenv("M3KIT_CACHE_DIR", dir, 1);
  unsetenv("M3KIT_NO_JIT");
}

static int count_entries(const char *arch) {
  char p[256];
  snprintf(p, sizeof p, "%s/cubin/%s", dir, arch);
  DIR *d = opendir(p);
  if (!d) return 0;
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d)))
    if (strstr(de->d_name, ".cubin") && !strstr(de->d_name, ".lock") && !strstr(de->d_name, ".tmp")) n++;
  closedir(d);
  return n;
}

static const char *archs[] = {"sm_80", "sm_89", "sm_90", "sm_90a", "sm_100a", "sm_120"};

/* Every variant the minimax-m3 and tiny presets need, at its default tile
 * for arch, handed to fn with its template's name; returns how many. */
typedef void (*variant_fn)(m3_jit *j, const char *tmpl, const m3_variant *v, void *ctx);
static int for_each_needed_variant(m3_jit *j, const char *arch, variant_fn fn, void *ctx) {
  const char *presets[] = {"minimax-m3", "tiny"};
  int count = 0;
  m3_err e;
  for (int p = 0; p < 2; p++) {
    m3_dims d;
    if (m3_model_dims_for(presets[p], NULL, &d, &e) != M3_OK) continue;
    for (const char *const *t = m3_lua_template_names(); *t; t++) {
      m3_variant *vs;
      int n;
      ck_assert_msg(m3_render_variants(j->lua, *t, &d, &vs, &n, &e) == M3_OK, "%s", e.msg);
      for (int i = 0; i < n; i++) {
        snprintf(vs[i].arch, sizeof vs[i].arch, "%s", arch);
        ck_assert_msg(m3_render_default_tile(j->lua, &vs[i], &e) == M3_OK, "%s", e.msg);
        fn(j, *t, &vs[i], ctx);
        count++;
      }
      free(vs);
    }
  }
  return count;
}

static void build_default(m3_jit *j, const char *tmpl, const m3_variant *v, void *ctx) {
  (void)tmpl, (void)ctx;
  m3_cubin cb;
  m3_err e;
  ck_assert_msg(m3_jit_build(j, v, &cb, &e) == M3_OK, "%s", e.msg);
  ck_assert_uint_gt(cb.size, 0);
  /* ELF, and e_flags hold the SM number NVRTC targeted. */
  ck_assert(cb.data[0] == 0x7f && cb.data[1] == 'E' && cb.data[2] == 'L' && cb.data[3] == 'F');
  m3_cubin_free(&cb);
}

/* The loop index picks an arch; every template x every needed variant. */
START_TEST(every_variant_compiles_for_arch) {
  fresh_cache();
  m3_jit j;
  m3_err e;
  ck_assert_int_eq(m3_jit_open(&j, &e), M3_OK);
  ck_assert_int_gt(for_each_needed_variant(&j, archs[_i], build_default, NULL), 0);
  m3_jit_close(&j);
}
END_TEST

/* Every __global__ of v's source opens with M3_GRID_WAIT(), or with a
 * declared lead-in (M3_LEAD_IN;, reading launch inputs that no kernel of the
 * step writes: templates/index_decode.lua) that reaches M3_GRID_WAIT() before
 * the next kernel; *(int *)ctx counts them. */
static void check_grid_wait_tile(m3_jit *j, const char *tmpl, const m3_variant *v, void *ctx) {
  m3_source src;
  m3_err e;
  ck_assert_msg(m3_render_source(j->lua, v, &src, &e) == M3_OK, "%s", e.msg);
  for (const char *g = strstr(src.text, "__global__"); g; g = strstr(g + 1, "__global__")) {
    const char *body = strchr(g, '{');
    ck_assert_msg(body != NULL, "%s: a __global__ without a body", tmpl);
    body++;
    while (*body == ' ' || *body == '\n') body++;
    if (!strncmp(body, "M3_LEAD_IN;", 11)) {
      /* a statement of the kernel's own block (two-space indent), not one in a nested block or a comment */
      const char *wait = strstr(body, "\n  M3_GRID_WAIT();"), *next = strstr(body, "__global__");
      ck_assert_msg(wait && (!next || wait < next), "%s: a kernel's lead-in never reaches M3_GRID_WAIT()", tmpl);
    } else {
      ck_assert_msg(!strncmp(body, "M3_GRID_WAIT();", 15),
                    "%s: a kernel's first statement is neither M3_GRID_WAIT() nor M3_LEAD_IN: %.60s", tmpl, body);
    }
    ++*(int *)ctx;
  }
  m3_source_free(&src);
}
/* ... for every valid tile of v (a tile axis may move code across the wait). */
static void check_grid_wait(m3_jit *j, const char *tmpl, const m3_variant *v, void *ctx) {
  m3_variant *tiles;
  int n;
  m3_err e;
  ck_assert_msg(m3_render_tiles(j->lua, v, &tiles, &n, &e) == M3_OK, "%s", e.msg);
  for (int i = 0; i < n; i++)
    if (m3_render_valid(j->lua, &tiles[i], NULL, 0, &e) == M3_OK) check_grid_wait_tile(j, tmpl, &tiles[i], ctx);
  free(tiles);
}

/* Programmatic dependent launch (on unless M3KIT_PDL=0, runtime/gpu.c) lets a kernel
 * start while its predecessor drains: stream order holds only if every
 * kernel's first statement is M3_GRID_WAIT() (lib/prelude.lua).  A template
 * that forgets it races under PDL alone, which no numeric test catches
 * reliably; so check the rendered source of every variant. */
START_TEST(every_kernel_opens_with_the_grid_wait) {
  m3_jit j;
  m3_err e;
  ck_assert_int_eq(m3_jit_open(&j, &e), M3_OK);
  int kernels = 0;
  for_each_needed_variant(&j, "sm_90", check_grid_wait, &kernels);
  ck_assert_int_gt(kernels, 0);
  m3_jit_close(&j);
}
END_TEST

START_TEST(key_changes_with_every_ingredient) {
  char *k0, *k;
  char h0[33], h[33];
  m3_err e;
  ck_assert_int_eq(m3_cubin_key("K", "src", "sm_90", "opts", 13000, 13000, &k0, h0, &e), M3_OK);
  struct { const char *key, *src, *arch, *opts; int nvrtc, drv; } v[] = {
      {"K2", "src", "sm_90", "opts", 13000, 13000}, {"K", "src ", "sm_90", "opts", 13000, 13000},
      {"K", "src", "sm_90a", "opts", 13000, 13000}, {"K", "src", "sm_90", "opts2", 13000, 13000},
      {"K", "src", "sm_90", "opts", 13010, 13000},  {"K", "src", "sm_90", "opts", 13000, 12080},
  };
  for (size_t i = 0; i < sizeof v / sizeof *v; i++) {
    ck_assert_int_eq(m3_cubin_key(v[i].key, v[i].src, v[i].arch, v[i].opts, v[i].nvrtc, v[i].drv, &k, h, &e), M3_OK);
    ck_assert_msg(strcmp(h, h0) != 0, "ingredient %zu did not change the key", i);
    free(k);
  }
  ck_assert_int_eq(m3_cubin_key("K", "src", "sm_90", "opts", 13000, 13000, &k, h, &e), M3_OK);
  ck_assert_str_eq(h, h0); /* deterministic */
  free(k);
  free(k0);
}
END_TEST

static void build_one(const char *key, m3_cubin *cb, m3_jit *j) {
  m3_variant v;
  m3_err e;
  ck_assert_int_eq(m3_render_parse_key(j->lua, key, &v, &e), M3_OK);
  ck_assert_msg(m3_jit_build(j, &v, cb, &e) == M3_OK, "%s", e.msg);
}

START_TEST(hit_after_miss_and_arch_distinct) {
  fresh_cache();
  m3_jit j;
  m3_err e;
  ck_assert_int_eq(m3_jit_open(&j, &e), M3_OK);
  m3_cubin a, b, c;
  build_one(QK, &a, &j);
  ck_assert_int_eq(a.hit, 0);
  build_one(QK, &b, &j);
  ck_assert_int_eq(b.hit, 1);
  ck_assert_uint_eq(a.size, b.size);
  ck_assert(memcmp(a.data, b.data, a.size) == 0);
  ck_assert_str_eq(a.meta.entry, b.meta.entry);
  ck_assert_int_eq(b.meta.threads, 128);
  /* sm_90 and sm_90a are distinct entries (known-faults #28). */
  char k2[M3_KEY_MAX];
  snprintf(k2, sizeof k2, "%.*s@sm_90a", (int)(strlen(QK) - 6), QK);
  build_one(k2, &c, &j);
  ck_assert_int_eq(c.hit, 0);
  ck_assert_int_eq(count_entries("sm_90"), 1);
  ck_assert_int_eq(count_entries("sm_90a"), 1);
  m3_cubin_free(&a);
  m3_cubin_free(&b);
  m3_cubin_free(&c);
  m3_jit_close(&j);
}
END_TEST

static void entry_path(m3_jit *j, const char *key, char *path, size_t n) {
  m3_variant v;
  m3_err e;
  m3_source src;
  ck_assert_int_eq(m3_render_parse_key(j->lua, key, &v, &e), M3_OK);
  ck_assert_int_eq(m3_render_source(j->lua, &v, &src, &e), M3_OK);
  char opts[512], *kt, hex[33];
  m3_nvrtc_options(v.arch, opts, sizeof opts);
  ck_assert_int_eq(m3_cubin_key(src.key, src.text, v.arch, opts, j->nvrtc_version, j->driver_version, &kt, hex, &e), M3_OK);
  m3_cubin_path(j->cache_root, v.arch, hex, path, n);
  free(kt);
  m3_source_free(&src);
}

START_TEST(corrupt_and_truncated_entries_rebuilt) {
  fresh_cache();
  m3_jit j;
  m3_err e;
  ck_assert_int_eq(m3_jit_open(&j, &e), M3_OK);
  m3_cubin a;
  build_one(QK, &a, &j);
  char path[4400];
  entry_path(&j, QK, path, sizeof path);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  for (int mode = 0; mode < 3; mode++) {
    if (mode == 0) ck_assert_int_eq(truncate(path, st.st_size / 2), 0);   /* truncated to half */
    if (mode == 1) {                                                     /* one flipped byte */
      int fd = open(path, O_RDWR);
      ck_assert_int_ge(fd, 0);
      unsigned char b;
      ck_assert_int_eq(pread(fd, &b, 1, st.st_size - 100), 1);
      b ^= 0x40;
      ck_assert_int_eq(pwrite(fd, &b, 1, st.st_size - 100), 1);
      close(fd);
    }
    if (mode == 2) ck_assert_int_eq(truncate(path, 0), 0);               /* empty */
    long corrupt0 = j.corrupt, builds0 = j.builds;
    m3_cubin b;
    build_one(QK, &b, &j);
    ck_assert_int_eq(b.hit, 0);
    ck_assert_int_eq(j.corrupt, corrupt0 + 1);
    ck_assert_int_eq(j.builds, builds0 + 1);
    ck_assert_uint_eq(b.size, a.size);
    ck_assert(memcmp(a.data, b.data, a.size) == 0);
    m3_cubin_free(&b);
    build_one(QK, &b, &j);
    ck_assert_int_eq(b.hit, 1);
    m3_cubin_free(&b);
  }
  m3_cubin_free(&a);
  m3_jit_close(&j);
}
END_TEST

/* Eight fresh processes ask for one key at once: one NVRTC compile in all, one
 * entry on disk, and every process gets the same bytes (known-faults #26). */
START_TEST(eight_concurrent_processes) {
  fresh_cache();
  int pipes[8][2];
  pid_t pids[8];
  for (int i = 0; i < 8; i++) {
    ck_assert_int_eq(pipe(pipes[i]), 0);
    pids[i] = fork();
    ck_assert_int_ge(pids[i], 0);
    if (pids[i] == 0) {
      m3_jit j;
      m3_err e;
      m3_variant v;
      m3_cubin cb;
      long out[3] = {-1, -1, -1};
      /* The counter is per process and a child inherits the parent's: with
       * CK_FORK=no (.ci/run) the earlier tests' compiles are in it, so only
       * this child's own compiles are reported. */
      long c0 = m3_nvrtc_compile_count();
      if (m3_jit_open(&j, &e) == M3_OK && m3_render_parse_key(j.lua, QK, &v, &e) == M3_OK &&
          m3_jit_build(&j, &v, &cb, &e) == M3_OK) {
        out[0] = m3_nvrtc_compile_count() - c0;
        out[1] = (long)cb.size;
        out[2] = cb.hit;
      }
      if (write(pipes[i][1], out, sizeof out) != sizeof out) _exit(2);
      _exit(0);
    }
    close(pipes[i][1]);
  }
  long compiles = 0, size0 = -1, hits = 0;
  for (int i = 0; i < 8; i++) {
    long out[3];
    ck_assert_int_eq(read(pipes[i][0], out, sizeof out), (ssize_t)sizeof out);
    close(pipes[i][0]);
    int status;
    waitpid(pids[i], &status, 0);
    ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    ck_assert_int_ge(out[0], 0);
    compiles += out[0];
    hits += out[2];
    if (size0 < 0) size0 = out[1];
    ck_assert_int_eq(out[1], size0);
  }
  ck_assert_int_eq(compiles, 1);
  ck_assert_int_eq(hits, 7);
  ck_assert_int_eq(count_entries("sm_90"), 1);
}
END_TEST

START_TEST(no_jit_names_the_key) {
  fresh_cache();
  setenv("M3KIT_NO_JIT", "1", 1);
  m3_jit j;
  m3_err e;
  ck_assert_int_eq(m3_jit_open(&j, &e), M3_OK);
  m3_variant v;
  ck_assert_int_eq(m3_render_parse_key(j.lua, QK, &v, &e), M3_OK);
  m3_cubin cb;
  ck_assert_int_eq(m3_jit_build(&j, &v, &cb, &e), M3_NOJIT);
  ck_assert_msg(strstr(e.msg, "qknorm_rope(attn=sparse,insert=1") != NULL, "%s", e.msg);
  unsetenv("M3KIT_NO_JIT");
  ck_assert_int_eq(m3_jit_build(&j, &v, &cb, &e), M3_OK);
  m3_cubin_free(&cb);
  setenv("M3KIT_NO_JIT", "1", 1);
  ck_assert_int_eq(m3_jit_build(&j, &v, &cb, &e), M3_OK); /* warmed: no miss */
  ck_assert_int_eq(cb.hit, 1);
  m3_cubin_free(&cb);
  unsetenv("M3KIT_NO_JIT");
  m3_jit_close(&j);
}
END_TEST

START_TEST(unwritable_cache_continues_uncached) {
  fresh_cache();
  char ro[128];
  snprintf(ro, sizeof ro, "%s/ro", dir);
  ck_assert_int_eq(mkdir(ro, 0555), 0);
  setenv("M3KIT_CACHE_DIR", ro, 1);
  if (geteuid() == 0) { /* root ignores permission bits: use a path under a file */
    char f[160];
    snprintf(f, sizeof f, "%s/file", dir);
    FILE *fp = fopen(f, "w");
    fclose(fp);
    snprintf(ro, sizeof ro, "%s/file/cache", dir);
    setenv("M3KIT_CACHE_DIR", ro, 1);
  }
  m3_jit j;
  m3_err e;
  ck_assert_int_eq(m3_jit_open(&j, &e), M3_OK);
  m3_cubin cb;
  build_one(QK, &cb, &j);
  ck_assert_uint_gt(cb.size, 0);
  ck_assert_int_eq(j.uncached, 1);
  m3_cubin_free(&cb);
  m3_jit_close(&j);
}
END_TEST

START_TEST(compile_error_shows_source_lines) {
  char tdir[] = "/tmp/m3tplXXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(tdir));
  char p[256];
  snprintf(p, sizeof p, "%s/bad.lua", tdir);
  FILE *f = fopen(p, "w");
  fputs("return { axes = {{'a', {1}}}, tiles = {{'t', {1}}}, valid = function() return true end,\n"
        " default_tile = function() return {t = 1} end,\n"
        " render = function(k, t, arch, sym) return {threads = 32, smem = 0, source =\n"
        "  'extern \"C\" __global__ void ' .. sym .. '(int *p) {\\n  *p = undeclared_thing;\\n}\\n'} end }\n", f);
  fclose(f);
  setenv("M3KIT_TEMPLATE_DIR", tdir, 1);
  fresh_cache();
  m3_jit j;
  m3_err e;
  ck_assert_int_eq(m3_jit_open(&j, &e), M3_OK);
  m3_variant v;
  ck_assert_int_eq(m3_render_parse_key(j.lua, "bad(a=1)[t=1]@sm_90", &v, &e), M3_OK);
  m3_cubin cb;
  ck_assert_int_eq(m3_jit_build(&j, &v, &cb, &e), M3_NVRTC);
  ck_assert_msg(strstr(e.msg, "undeclared_thing") && strstr(e.msg, "generated source lines") && strstr(e.msg, "bad(a=1)"),
                "%s", e.msg);
  m3_jit_close(&j);
  unsetenv("M3KIT_TEMPLATE_DIR");
}
END_TEST

int main(void) {
  Suite *s = suite_create("jit");
  TCase *tc = tcase_create("cache");
  tcase_set_timeout(tc, 600);
  tcase_add_loop_test(tc, every_variant_compiles_for_arch, 0, (int)(sizeof archs / sizeof *archs));
  tcase_add_test(tc, every_kernel_opens_with_the_grid_wait);
  tcase_add_test(tc, key_changes_with_every_ingredient);
  tcase_add_test(tc, hit_after_miss_and_arch_distinct);
  tcase_add_test(tc, corrupt_and_truncated_entries_rebuilt);
  tcase_add_test(tc, eight_concurrent_processes);
  tcase_add_test(tc, no_jit_names_the_key);
  tcase_add_test(tc, unwritable_cache_continues_uncached);
  tcase_add_test(tc, compile_error_shows_source_lines);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
