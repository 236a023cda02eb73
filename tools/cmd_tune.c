/* cmd_tune.c - `m3kit tune`: tune once per GPU, show the DB, plot it. */
#include <errno.h>
#include <ctype.h>
#include <getopt.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "m3config.h"
#include "autotune/op.h"
#include "autotune/tune.h"
#include "cache/store.h"
#include "runtime/tuning_lookup.h"
#include "cache/tunedb.h"
#include "runtime/gpu.h"
#include "gen/render.h"
#include "tools/cli.h"

static void help(void) {
  printf("usage: m3kit tune [options]\n\n"
         "Search every kernel's tile space on this GPU for every variant the model needs, at the\n"
         "shapes the runtime launches; check each candidate against the C reference; record the\n"
         "winners with every candidate's timings in <cache>/tuning/<arch>.json.  A record the seed\n"
         "pins (a whole decode-step A/B chose its tile: docs/tuning-db.md) keeps its tile while it\n"
         "times within 3%% of the tuner's own pick.\n\n"
         "  --preset NAME      model config preset (default minimax-m3)\n"
         "  --model DIR        use DIR/config.json\n"
         "  --only KERNELS     tune these kernel families only (below; comma separated; not with\n"
         "                     --show, --plot, --rehash, which work on the whole DB)\n"
         "  --shapes SPEC      restrict buckets, e.g. 'tokens=1,64'\n"
         "  --budget SECONDS   stop starting new shapes after this long\n"
         "  --tiles LIST       time only these tiles: whole tile strings, ';'-separated, as --show\n"
         "                     prints them (e.g. with --only, a tile axis A/B), and each shape's current tile\n"
         "                     (the --db file's, else the runtime's), so that a record never gets a tile slower\n"
         "                     than the one it had; a shape none fits is left out, an entry that fits none is\n"
         "                     named in a warning\n"
         "  --reps N           timed launches per candidate (default 20, minimum 20)\n"
         "  --db FILE          the DB file to write (tuning), read (--show, --plot) or rewrite in place\n"
         "                     (--rehash) instead of the cache's\n"
         "  --show             print the tuning DB of this GPU's arch (or --arch) and exit\n"
         "  --plot DIR         write PNG plots (gnuplot) of time against tile and exit (untuned: the seed's)\n"
         "  --arch SM          arch for --show/--plot/--rehash without a GPU (default: the GPU's, else sm_90):\n"
         "                     picks the cache's <arch>.json (--rehash renders each record for its own arch)\n"
         "  --rehash           give every record of the DB (or --db FILE) whose template is unchanged the\n"
         "                     code hash of its tile, so that later template edits that leave that code\n"
         "                     alone keep it valid, and records kept that way the current template hash\n"
         "                     (a load then renders nothing), their tiles completed with any tile axis added\n"
         "                     since their tune (at its first value, where that renders their code); no GPU.\n"
         "                     A DB is written under FILE.lock (an flock; the empty file stays, as every\n"
         "                     writer of FILE uses it)\n");
  printf("\nkernel families (one adapter each, autotune/ops_table.c; kv_insert and fill are never\n"
         "looked up by shape at run time, so they have no shapes to tune):\n ");
  int col = 1;
  for (int i = 0; m3_tune_ops[i]; i++) {
    const int w = (int)strlen(m3_tune_ops[i]->template_name) + 1;
    if (col + w > 100) printf("\n "), col = 1;
    col += printf(" %s", m3_tune_ops[i]->template_name);
  }
  printf("\n");
}

extern char **environ;

/* Render <dir>/all.gp (every plot's script) with gnuplot: the configured one,
 * else the first on PATH.  Without gnuplot the data and scripts stay. */
static int run_gnuplot(const char *dir, int n) {
  char script[4200];
  snprintf(script, sizeof script, "%s/all.gp", dir);
  const char *gp = M3_GNUPLOT[0] ? M3_GNUPLOT : "gnuplot";
  char *argv[] = {(char *)gp, script, NULL};
  pid_t pid;
  int st = 0;
  if (posix_spawnp(&pid, gp, NULL, NULL, argv, environ) != 0 || waitpid(pid, &st, 0) < 0) {
    printf("wrote %d plot scripts and data under %s; gnuplot not found: run `gnuplot %s` for the PNGs\n", n, dir,
           script);
    return 0;
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "m3kit tune: %s %s failed (status %d): the .dat and .gp files are under %s\n", gp, script,
            WIFEXITED(st) ? WEXITSTATUS(st) : -1, dir);
    return 1;
  }
  printf("wrote %d PNG plot(s) under %s (gnuplot %s)\n", n, dir, script);
  return 0;
}

/* NULL when spec is NAME=N[,N...] groups joined by ';' (the syntax the
 * tuner's bucket filter reads), NAME one of the dims the tuned ops' buckets
 * have (autotune/op_*.c: a name no bucket has would select every shape),
 * else what is wrong with it. */
static const char *shapes_error(const char *spec) {
  const char *p = spec;
  if (!*p) return "empty";
  for (;;) {
    const char *n0 = p;
    while ((*p >= 'a' && *p <= 'z') || (p > n0 && ((*p >= '0' && *p <= '9') || *p == '_'))) p++;
    if (p == n0 || *p != '=') return "a group is not NAME=N[,N...]";
    if (!((p - n0 == 6 && !strncmp(n0, "tokens", 6)) || (p - n0 == 3 && !strncmp(n0, "ctx", 3))))
      return "a shape dim is not one of the buckets' (tokens, ctx)";
    p++;
    for (;;) {
      if (*p < '0' || *p > '9') return "a value is not a non-negative integer";
      while (*p >= '0' && *p <= '9') p++;
      if (*p != ',') break;
      p++;
    }
    if (!*p) return NULL;
    if (*p != ';') return "unexpected text after a value";
    p++;
  }
}

/* The DB file --show, --plot and --rehash work on: --db FILE (which must be
 * readable), else the cache's for arch.  Nonzero (reported) on failure. */
static int db_file(const char *arch, const char *db_path, char *path, size_t n) {
  m3_err e;
  if (db_path) {
    struct stat st;
    if (stat(db_path, &st) != 0 || access(db_path, R_OK) != 0) {
      fprintf(stderr, "m3kit tune: --db %s: cannot read it: %s\n", db_path, strerror(errno));
      return 1;
    }
    if (!S_ISREG(st.st_mode)) {
      fprintf(stderr, "m3kit tune: --db %s: not a regular file (a tuning DB is one JSON file, e.g. "
                      "~/.cache/m3kit/tuning/sm_90.json)\n", db_path);
      return 1;
    }
    snprintf(path, n, "%s", db_path);
    return 0;
  }
  return m3_tunedb_path(arch, path, n, &e) != M3_OK ? cli_fail("tune", e.code, &e) : 0;
}

/* --rehash: the records whose template hash is current get the code hash of
 * their tile (which that template text renders, so it is the code they were
 * timed with), those kept through a template edit by their code hash the
 * current template hash (m3_tunedb_add_code_hashes). */
static int rehash(const char *arch, const char *db_path) {
  char path[4200];
  if (db_file(arch, db_path, path, sizeof path)) return 1;
  struct stat st;
  if (stat(path, &st) != 0 && errno == ENOENT) {   /* (--db FILE was checked by db_file) */
    fprintf(stderr, "m3kit tune --rehash: no tuning DB at %s, nothing to rehash ('m3kit tune' writes it)\n", path);
    return 1;
  }
  m3_lua *L;
  m3_err e;
  if (m3_lua_open(&L, &e) != M3_OK) return cli_fail("tune", e.code, &e);
  m3_tuning_hash_ctx th = {.lua = L};
  m3_tunedb_filter f;
  m3_tuning_filter_init(&f, &th, NULL, NULL);
  m3_rehash_report r;
  m3_status s = m3_tunedb_add_code_hashes(path, &f, &r, &e);
  m3_lua_close(L);
  if (s != M3_OK) return cli_fail("tune", s, &e);
  char completed[160] = "";
  if (r.completed)
    snprintf(completed, sizeof completed, ", %d of them with their tiles completed by a tile axis added since", r.completed);
  printf("%s: %d records given the code hash of their tile; %d given the current template hash (their template "
         "changed, their code did not%s); %d current already; %d stale (their code changed or their tile no longer "
         "renders: re-run 'm3kit tune', or, after an upgrade that added a key axis, tools/rekey.py), left as they were",
         path, r.given, r.refreshed, completed, r.had, r.left);
  if (r.malformed) printf("; %d malformed, left as they were (first: record %d)", r.malformed, r.first_malformed);
  printf("; %s\n", r.given + r.refreshed ? "file rewritten" : "file not rewritten");
  return 0;
}

/* "this m3kit would use K of them": the runtime's filter (template and code
 * hashes, arch; the driver not checked) over the DB at path. */
static void print_usable(const char *path, const char *arch, const char *said) {
  m3_lua *L;
  m3_err le;
  if (m3_lua_open(&L, &le) != M3_OK) return;
  m3_tuning_hash_ctx hc = {.lua = L};
  m3_tunedb_filter f;
  m3_tuning_filter_init(&f, &hc, arch, NULL);
  m3_tunedb *fdb = m3_tunedb_new();
  m3_tunedb_report frep;
  memset(&frep, 0, sizeof frep);
  if (fdb && m3_tunedb_load(fdb, path, NULL, &f, &frep, &le) == M3_OK) {
    /* The runtime also re-checks each tile against its key (valid(), the
     * lookup's check): a record whose tile fails it is never used. */
    int bad = 0;
    char first[600] = "";
    for (size_t i = 0; i < m3_tunedb_count(fdb); i++) {
      const m3_tune_record *r = m3_tunedb_get(fdb, i);
      m3_variant v;
      char why[512] = "";
      int ok = m3_render_parse_key(L, r->key, &v, &le) == M3_OK;
      if (!ok) snprintf(why, sizeof why, "%.500s", le.msg);
      else snprintf(v.arch, sizeof v.arch, "%s", r->arch), ok = m3_tuning_tile_ok(L, &v, r->tile, why, sizeof why);
      if (!ok && bad++ == 0) snprintf(first, sizeof first, "%.200s [%.100s]: %.250s", r->key, r->tile, why);
    }
    const int again = said && !strcmp(said, frep.summary); /* the caller printed this load's summary */
    printf("  this m3kit would use %d of them for %s%s%s\n", frep.loaded - bad, arch,
           frep.summary[0] && !again ? "; " : "", again ? "" : frep.summary);
    if (bad) printf("  %d more have a key or tile this m3kit refuses, never used (first: %s)\n", bad, first);
  }
  m3_tunedb_free(fdb);
  m3_lua_close(L);
}

static int show_or_plot(const char *arch, const char *plot_dir, const char *db_path) {
  m3_err e;
  char path[4200];
  if (db_file(arch, db_path, path, sizeof path)) return 1;
  m3_tunedb *db = m3_tunedb_new();
  m3_tunedb_report rep;
  memset(&rep, 0, sizeof rep);
  m3_status s = m3_tunedb_load(db, path, NULL, NULL, &rep, &e);
  if (s != M3_OK && (s != M3_NOTFOUND || db_path)) { /* a DB named by --db must exist */
    m3_tunedb_free(db);
    return cli_fail("tune", s, &e);
  }
  /* A user who never tuned: one line for the empty DB, then the seed's
   * records (what the runtime uses), not an empty table. */
  const int none = !db_path && m3_tunedb_count(db) == 0 && !rep.summary[0];
  if (none)
    printf("tuning DB %s: %s (m3kit tune writes it)\n", path, access(path, F_OK) ? "not there yet" : "no records");
  else
    printf("tuning DB %s: %zu records\n", path, m3_tunedb_count(db));
  if (rep.summary[0]) printf("  %s\n", rep.summary); /* what the load skipped or ignored, and why */
  if (s == M3_OK && !none) print_usable(path, arch, rep.summary);
  int rc = 0;
  if (plot_dir && !db_path && m3_tunedb_count(db) == 0) { /* untuned: plot what the runtime uses, the seed */
    char spb[4200];
    const char *sp = m3_tuning_seed_path(arch, spb, sizeof spb);
    m3_tunedb_report sr;
    memset(&sr, 0, sizeof sr);
    if (sp && access(sp, R_OK) == 0 && m3_tunedb_load(db, sp, NULL, NULL, &sr, &e) == M3_OK)
      printf("plotting the seed DB %s instead: %zu records, what the runtime uses until you tune\n", sp,
             m3_tunedb_count(db));
  }
  if (plot_dir) {
    int n = 0;
    if ((s = m3_mkdirs(plot_dir, &e)) || (s = m3_tunedb_write_plot_data(db, plot_dir, NULL, &n, &e))) {
      rc = cli_fail("tune", s, &e);
    } else if (n > 0) {
      rc = run_gnuplot(plot_dir, n);
    } else {
      printf("no records: nothing to plot\n");
    }
  } else if (!none) {
    m3_tunedb_print(db, stdout);
  }
  m3_tunedb_free(db);
  if (!db_path && !plot_dir) { /* where the runtime looks when this DB has no record */
    char spb[4200];
    const char *sp = m3_tuning_seed_path(arch, spb, sizeof spb);
    if (sp) {
      m3_tunedb *sd = m3_tunedb_new();
      m3_tunedb_report sr;
      memset(&sr, 0, sizeof sr);
      m3_err se;
      m3_status ss = access(sp, R_OK) == 0 ? m3_tunedb_load(sd, NULL, sp, NULL, &sr, &se) /* as the seed: src "seed" */
                                            : m3_errf(&se, M3_NOTFOUND, "cannot read it");
      if (ss != M3_OK) {
        printf("seed DB %s: unreadable (%s)\n", sp, se.msg);
      } else if (none) {
        printf("seed DB %s: %zu records, what the runtime uses until you tune\n", sp, m3_tunedb_count(sd));
        print_usable(sp, arch, NULL);
        m3_tunedb_print(sd, stdout);
      } else {
        printf("seed DB %s: %zu records, used where the DB above has none (m3kit tune --show --db %s lists them)\n",
               sp, m3_tunedb_count(sd), sp);
      }
      m3_tunedb_free(sd);
    } else {
      printf("no seed DB for %s: untuned kernels use their templates' default tiles\n", arch);
    }
  }
  return rc;
}

int cmd_tune(int argc, char **argv) {
  static const struct option opts[] = {{"preset", required_argument, 0, 'p'}, {"model", required_argument, 0, 'm'},
                                       {"only", required_argument, 0, 'o'},   {"shapes", required_argument, 0, 's'},
                                       {"budget", required_argument, 0, 'b'}, {"reps", required_argument, 0, 'r'},
                                       {"db", required_argument, 0, 'd'},     {"show", no_argument, 0, 'S'},
                                       {"plot", required_argument, 0, 'P'},   {"arch", required_argument, 0, 'a'},
                                       {"rehash", no_argument, 0, 'R'},       {"tiles", required_argument, 0, 't'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  m3_tune_opts o = {.preset = "minimax-m3", .progress = stderr};
  int show = 0, do_rehash = 0, model_given = 0, c;
  const char *plot = NULL, *arch = NULL;
  char cmdline[1024];
  cli_cmdline(argc, argv, cmdline, sizeof cmdline);
  o.command = cmdline;
  optind = 1;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
      case 'p': o.preset = optarg, model_given = 1; break;
      case 'm':
        if (cli_path("tune", "model", optarg)) return 2;
        o.model_dir = optarg, model_given = 1;
        break;
      case 'o': o.only = optarg; break;
      case 's': o.shapes = optarg; break;
      case 't': {
        /* tiles as m3kit gen --tiles prints them ("[warps=4,...]") or with spaces after ';' are
         * the same tiles: no tile string has brackets or blanks */
        static char tl[4096];
        size_t n = 0;
        for (const char *p = optarg; *p && n + 1 < sizeof tl; p++)
          if (*p != '[' && *p != ']' && !isspace((unsigned char)*p)) tl[n++] = *p;
        tl[n] = 0;
        if (strlen(optarg) >= sizeof tl) {
          fprintf(stderr, "m3kit tune: --tiles: list longer than %zu characters\n", sizeof tl - 1);
          return 2;
        }
        if (!n) {
          fprintf(stderr, "m3kit tune: --tiles: empty list\n");
          return 2;
        }
        o.tiles = tl;
        break;
      }
      case 'b': {
        double v;
        if (cli_float("tune", "budget", optarg, 0, 1e9, &v)) return 2;
        o.budget_s = v;
        break;
      }
      case 'r': {
        int64_t v;
        if (cli_int("tune", "reps", optarg, 20, 100000, &v)) return 2;
        o.reps = (int)v;
        break;
      }
      case 'd': o.db_path = optarg; break;
      case 'S': show = 1; break;
      case 'R': do_rehash = 1; break;
      case 'P': plot = optarg; break;
      case 'a':
        if (!m3_arch_valid(optarg)) {
          fprintf(stderr, "m3kit tune: --arch wants an SM arch such as sm_90 or sm_90a, got '%s'\n", optarg);
          return 2;
        }
        arch = optarg;
        break;
      case 'h': help(); return 0;
      default: help(); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "m3kit tune: unexpected argument '%s' (m3kit tune --help)\n", argv[optind]);
    return 2;
  }
  if (o.only && !*o.only) {
    fprintf(stderr, "m3kit tune: --only is empty (give kernel families, e.g. --only qknorm_rope,attn_dense)\n");
    return 2;
  }
  const char *bad = o.shapes ? shapes_error(o.shapes) : NULL;
  if (bad) {
    fprintf(stderr, "m3kit tune: --shapes '%s': %s (want NAME=N[,N...][;NAME=N...], e.g. 'tokens=1,64')\n", o.shapes,
            bad);
    return 2;
  }
  for (const char *p = o.only; p && *p;) {
    const char *c = strchr(p, ',');
    char name[64];
    snprintf(name, sizeof name, "%.*s", c ? (int)(c - p) : (int)strlen(p), p);
    if (!m3_tune_op_find(name)) {
      fprintf(stderr, "m3kit tune: --only %s: no such kernel family '%s' (m3kit tune --help lists them)\n", o.only,
              name);
      return 2;
    }
    p = c ? c + 1 : p + strlen(p);
  }
  if (show + !!plot + do_rehash > 1) {
    fprintf(stderr, "m3kit tune: give one of --show, --plot, --rehash\n");
    return 2;
  }
  if ((show || plot || do_rehash) && (o.only || o.shapes || o.tiles || model_given)) {
    fprintf(stderr, "m3kit tune: --only, --shapes, --tiles, --preset and --model select what to tune; --show, --plot and "
                    "--rehash work on the whole DB\n");
    return 2;
  }
  if (show || plot || do_rehash) {
    m3_device d;
    m3_err e;
    if (!arch && m3_gpu_count() > 0 && m3_device_open(0, &d, &e) == M3_OK) arch = d.arch;
    if (do_rehash) return rehash(arch ? arch : "sm_90", o.db_path);
    return show_or_plot(arch ? arch : "sm_90", plot, o.db_path);
  }
  if (m3_gpu_count() == 0) {
    fprintf(stderr, "m3kit tune: no CUDA GPU on this machine: tuning measures kernels on the GPU, nothing was tuned.\n"
                    "            (m3kit gen --all compiles every variant without a GPU.)\n");
    return 3;
  }
  m3_rt rt;
  m3_err e;
  m3_status s = m3_rt_open(&rt, 0, &e);
  if (s) return cli_fail("tune", s, &e);
  m3_tune_result res;
  s = m3_tune_run(&rt, &o, &res, &e);
  printf("\n%-12s %-58s %-14s %10s %10s %7s %12s %6s %7s  %s\n", "kernel", "variant", "shape", "default_us", "tuned_us",
         "speedup", "achieved", "%ceil", "wall_s", "tile (candidates passed/incorrect/failed)");
  int n_recorded = 0;
  for (int i = 0; i < res.n_rows; i++) {
    m3_tune_row *r = &res.rows[i];
    const char *k = strchr(r->key, '(');
    char def[16] = "-", spd[16] = "-";
    if (isfinite(r->default_us)) snprintf(def, sizeof def, "%.2f", r->default_us);
    if (isfinite(r->default_us) && r->tuned_us > 0) snprintf(spd, sizeof spd, "%.2fx", r->default_us / r->tuned_us);
    n_recorded += r->recorded;
    if (!r->recorded && !r->tile[0]) {
      printf("%-12s %-58.58s %-14s %10s %10s %7s %12s %6s %7.1f  - (%d/%d/%d of %d): no candidate passed, nothing "
             "recorded\n", r->op, k ? k : r->key, r->bucket, def, "-", "-", "-", "-", r->seconds, r->n_passed,
             r->n_incorrect, r->n_failed, r->n_candidates);
      continue;
    }
    printf("%-12s %-58.58s %-14s %10s %10.2f %7s %7.0f %s %5.1f%% %7.1f  %s (%d/%d/%d of %d)%s\n", r->op,
           k ? k : r->key, r->bucket, def, r->tuned_us, spd, r->achieved, r->unit, r->pct, r->seconds, r->tile,
           r->n_passed, r->n_incorrect, r->n_failed, r->n_candidates,
           r->recorded ? "" : ": not recorded (the warning above says why)");
  }
  /* Where a tune's time goes, per family (the 10-minute budget of a full tune). */
  for (int i = 0; i < res.n_rows; i++) {
    int first = 1;
    for (int q = 0; q < i && first; q++) first = strcmp(res.rows[q].op, res.rows[i].op) != 0;
    if (!first) continue;
    double sum = 0;
    int n = 0;
    for (int q = i; q < res.n_rows; q++)
      if (!strcmp(res.rows[q].op, res.rows[i].op)) sum += res.rows[q].seconds, n++;
    printf("%s%s %.1f s (%d shapes)", i ? ", " : "time per family: ", res.rows[i].op, sum, n);
  }
  if (res.n_rows) printf("\n");
  if (!s && !res.n_rows)
    printf("nothing to tune: no variant of this model has a shape the runtime looks it up at%s\n",
           o.shapes || o.only ? " (among the --only/--shapes selection)" : "");
  printf("copy ceiling %.0f GB/s; %d shapes in %.1f s, %d recorded\n", res.copy_gbs, res.n_rows, res.seconds,
         n_recorded);
  const int none = !s && res.n_rows > 0 && n_recorded == 0;
  if (none) fprintf(stderr, "m3kit tune: no shape got a record (no candidate passed, or pinned records were "
                            "left as they were)\n");
  m3_tune_result_free(&res);
  m3_rt_close(&rt);
  return s ? cli_fail("tune", s, &e) : none ? 1 : 0;
}
