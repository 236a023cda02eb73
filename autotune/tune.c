/* tune.c - the tuner's driver (see tune.h): enumerate, compile in parallel,
 * verify, time, choose, record. */
#include "autotune/tune.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "m3config.h"
#include "autotune/op.h"
#include "cache/store.h"
#include "cache/tunedb.h"
#include "gen/code_hash.h"
#include "runtime/check.h"
#include "runtime/harness.h"
#include "runtime/log.h"
#include "runtime/model_dims.h"
#include "runtime/nvrtc.h"
#include "runtime/tuning_lookup.h"

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

m3_status m3_measure_copy_gbs(m3_rt *rt, double *gbs, m3_err *e) {
  const size_t bytes = (size_t)2 << 30;
  void *a = NULL, *b = NULL;
  cudaEvent_t t0 = NULL, t1 = NULL;
  float best = 1e30f;
  m3_status s = m3_dev_alloc(&a, bytes, e);
  if (!s) s = m3_dev_alloc(&b, bytes, e);
  /* Initialised source: copying never-written memory makes initcheck check
   * (and report) all 2 GiB of it on every copy. */
  if (!s && cudaMemsetAsync(a, 0, bytes, rt->stream) != cudaSuccess) s = m3_errf(e, M3_CUDA, "copy ceiling: memset");
  if (!s && (cudaEventCreate(&t0) != cudaSuccess || cudaEventCreate(&t1) != cudaSuccess))
    s = m3_errf(e, M3_CUDA, "copy ceiling: cudaEventCreate");
  for (int i = 0; i < 6 && !s; i++) {
    float ms = 0;
    if (cudaEventRecord(t0, rt->stream) != cudaSuccess ||
        cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, rt->stream) != cudaSuccess ||
        cudaEventRecord(t1, rt->stream) != cudaSuccess || cudaEventSynchronize(t1) != cudaSuccess ||
        cudaEventElapsedTime(&ms, t0, t1) != cudaSuccess)
      s = m3_errf(e, M3_CUDA, "copy ceiling: %s", cudaGetErrorString(cudaGetLastError()));
    else if (i > 0 && ms < best)
      best = ms; /* first is warm-up */
  }
  if (!s) *gbs = 2.0 * bytes / (best * 1e-3) / 1e9;
  if (t0) cudaEventDestroy(t0);
  if (t1) cudaEventDestroy(t1);
  m3_dev_free(a);
  m3_dev_free(b);
  return s;
}

/* ---- timing ---- */

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Event-timed median under which a graph re-times the candidate: 30 us, or
 * $M3KIT_TUNE_GRAPH_US (tests set it high to take this path on the CPU
 * emulator, where every launch takes milliseconds; a capture failure is then
 * an error instead of a quiet fallback). */
static double graph_below_us(int *forced) {
  const char *v = getenv("M3KIT_TUNE_GRAPH_US");
  *forced = v && *v;
  return *forced ? atof(v) : 30.0;
}
#define GRAPH_LAUNCHES 16

/* How much slower than the tuner's choice a pinned tile may time and still
 * be kept (cache/tunedb.h `pinned`): 0.03 (3%), or $M3KIT_TUNE_PIN_SLACK, a
 * fraction (tests set it to keep or drop a pin whatever the timings). */
static double pin_slack(void) {
  const char *v = getenv("M3KIT_TUNE_PIN_SLACK");
  char *end = NULL;
  const double x = v && *v ? strtod(v, &end) : 0.03;
  if (v && *v && (*end || !isfinite(x))) {
    m3_warn_once("M3KIT_TUNE_PIN_SLACK=%s is not a number: using 0.03", v);
    return 0.03;
  }
  return x;
}

/* The pinned record of a shape: the one the runtime reads (the user's DB
 * over the seed) if pinned, else the seed's own (a pin the seed ships then
 * reaches a user who tuned that shape before it existed); NULL if neither. */
static const m3_tune_record *pin_of(const m3_tunedb *db, const m3_tunedb *seed, const char *key, const m3_bucket *b,
                                    const char *arch) {
  const m3_tunedb *in[2] = {db, seed};
  for (int i = 0; i < 2; i++) {
    const m3_tune_record *r = in[i] ? m3_tunedb_find(in[i], key, b, arch) : NULL;
    if (r && r->pinned && *r->pinned) return r;
  }
  return NULL;
}

/* Candidates a and b re-timed back to back (a, b, a, b), each keeping its
 * faster pass, into cs[a] and cs[b], on the clock the sweep used for the
 * shape (graph: 1 graph-timed, 0 event-timed; never the threshold, which a
 * re-timing can cross one way for a and the other for b).  1, or 0 with e
 * (cs untouched). */
static int retime_pair(m3_rt *rt, const m3_tune_op *op, void *st, m3_kernel **kq, int warmup, int reps, int graph,
                       m3_tune_candidate *cs, int a, int b, m3_err *e) {
  m3_tune_candidate again[2][2];
  const int who[2] = {a, b};
  for (int round = 0; round < 2; round++)
    for (int w = 0; w < 2; w++) {
      int g = graph ? 1 : -1;
      if (m3_tune_time_kernel(rt, op, st, kq[who[w]], warmup, reps, 0, &g, &again[round][w], NULL, e) != M3_OK ||
          again[round][w].disposition != M3_DISP_PASSED) {
        if (again[round][w].disposition != M3_DISP_PASSED) m3_errf(e, M3_MISMATCH, "a re-timed candidate did not pass");
        return 0;
      }
    }
  for (int w = 0; w < 2; w++) {
    const m3_tune_candidate *f = again[0][w].median_us <= again[1][w].median_us ? &again[0][w] : &again[1][w];
    m3_tune_candidate *c = &cs[who[w]];
    c->median_us = f->median_us, c->p20_us = f->p20_us, c->p80_us = f->p80_us, c->n_runs = f->n_runs;
    c->disposition = M3_DISP_PASSED;
  }
  return 1;
}

typedef struct graph_arg {
  const m3_tune_op *op;
  void *st;
  const m3_kernel *k;
} graph_arg;
static m3_status graph_launch(void *p, int rep, m3_err *e) {
  graph_arg *g = p;
  return g->op->launch(g->st, g->k, rep + 1, e);
}

m3_status m3_tune_graph_time(const m3_tune_op *op, void *st, const m3_kernel *k, cudaStream_t stream, int launches,
                             int reps, m3_timing *t, m3_err *e) {
  graph_arg ga = {op, st, k};
  return m3_time_graph(graph_launch, &ga, launches, launches, stream, reps, t, e);
}

/* Time one candidate: prepare (untimed) then an event-timed launch, per rep;
 * short kernels then again as a CUDA graph (below). */
m3_status m3_tune_time_kernel(m3_rt *rt, const m3_tune_op *op, void *st, const m3_kernel *k, int warmup, int reps,
                                double best_so_far, int *graph, m3_tune_candidate *c, double *event_us, m3_err *e) {
  for (int i = 0; i < warmup; i++) {
    M3_TRY(op->prepare(st, i + 1, e));
    M3_TRY(op->launch(st, k, i + 1, e));
  }
  cudaEvent_t *ev = calloc((size_t)reps * 2, sizeof *ev);
  double *us = calloc((size_t)reps, sizeof *us);
  if (!ev || !us) {
    free(ev);
    free(us);
    return m3_errf(e, M3_NOMEM, "timing");
  }
  m3_status s = M3_OK;
  int made = 0, done = 0;
  for (; made < 2 * reps && !s; made++)
    if (cudaEventCreate(&ev[made]) != cudaSuccess) s = m3_errf(e, M3_CUDA, "cudaEventCreate");
  /* Early stop: after a first batch, a candidate 3x slower than the best so
   * far cannot win; skip the rest of its runs. */
  int batch = reps < 5 ? reps : 5;
  for (int r = 0; r < reps && !s; r++) {
    if (!s) s = op->prepare(st, warmup + 1 + r, e);
    if (!s && cudaEventRecord(ev[2 * r], rt->stream)) s = m3_errf(e, M3_CUDA, "cudaEventRecord");
    if (!s) s = op->launch(st, k, warmup + 1 + r, e);
    if (!s && cudaEventRecord(ev[2 * r + 1], rt->stream)) s = m3_errf(e, M3_CUDA, "cudaEventRecord");
    done = r + 1;
    if (!s && done == batch && best_so_far > 0) {
      if (cudaStreamSynchronize(rt->stream)) {
        s = m3_errf(e, M3_CUDA, "%s", cudaGetErrorString(cudaGetLastError()));
        break;
      }
      double tmp[8];
      for (int i = 0; i < batch && !s; i++) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]) != cudaSuccess)
          s = m3_errf(e, M3_CUDA, "cudaEventElapsedTime: %s", cudaGetErrorString(cudaGetLastError()));
        tmp[i] = ms * 1e3;
      }
      if (s) break;
      qsort(tmp, (size_t)batch, sizeof *tmp, cmpd);
      if (tmp[batch / 2] > 3 * best_so_far) break;
    }
  }
  if (!s && cudaStreamSynchronize(rt->stream)) s = m3_errf(e, M3_CUDA, "%s", cudaGetErrorString(cudaGetLastError()));
  for (int i = 0; i < done && !s; i++) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]) != cudaSuccess)
      s = m3_errf(e, M3_CUDA, "cudaEventElapsedTime: %s", cudaGetErrorString(cudaGetLastError()));
    us[i] = ms * 1e3;
  }
  if (!s) {
    qsort(us, (size_t)done, sizeof *us, cmpd);
    c->median_us = us[done / 2];
    c->p20_us = us[done * 2 / 10];
    c->p80_us = us[(done * 8 / 10) < done ? done * 8 / 10 : done - 1];
    c->n_runs = done;
    c->disposition = done < reps ? M3_DISP_SKIPPED_SLOWER : M3_DISP_PASSED;
    if (event_us) *event_us = c->median_us;
  }
  for (int i = 0; i < made; i++) cudaEventDestroy(ev[i]);
  free(ev);
  free(us);
  /* A short kernel's event-timed launch is mostly launch overhead and its
   * jitter (two tunes of the qk-norm buckets of 1-64 tokens, 4-7 us each,
   * chose the same tile for 8 of 14 records): re-time it as the decode step
   * runs it, a CUDA graph of GRAPH_LAUNCHES back-to-back launches over the
   * rotating sets, per launch.  If the launch cannot be captured the event
   * times stand.  *graph (in): 1 graph-time it whatever its event time, -1
   * never, 0 by the threshold - the tuner fixes a shape's clock once one of
   * its candidates was graph-timed (a threshold on a noisy event time would
   * otherwise put candidates of one shape on two clocks: device run 79 kept a
   * tile event-timed at 31 us over one graph-timed at 8.8); (out): whether
   * it was. */
  int forced;
  const double below = graph_below_us(&forced);
  const int want = graph ? *graph : 0;
  if (graph) *graph = 0;
  if (!s && c->disposition == M3_DISP_PASSED && want >= 0 && (want > 0 || c->median_us < below)) {
    m3_timing t;
    m3_err ge;
    if (m3_tune_graph_time(op, st, k, rt->stream, GRAPH_LAUNCHES, reps, &t, &ge) == M3_OK) {
      c->median_us = t.median_us, c->p20_us = t.p20_us, c->p80_us = t.p80_us, c->n_runs = t.reps;
      if (graph) *graph = 1;
    } else if (forced) {
      return m3_errf(e, M3_CUDA, "tune: %s: graph timing: %s", k->key.op, ge.msg);
    } else {
      (void)cudaGetLastError(); /* a failed capture leaves a (non-sticky) error behind: clear it */
      m3_info("tune: %s: graph timing unavailable (%s); event times kept", k->key.op, ge.msg);
    }
  }
  return s;
}

/* ---- the driver ---- */

typedef struct {
  const m3_tune_op *op;
  m3_variant key;    /* semantic part + arch */
  m3_bucket bucket;
  int first_cand, n_cand;
} tjob;

static void progress(FILE *f, int done, int total, double t0, double *last_line) {
  if (!f || total == 0) return;
  double el = now_s() - t0, eta = done ? el / done * (total - done) : 0;
  /* Not a terminal (a log file, CI): one line every 10 s instead of a
   * carriage-return redraw per candidate (megabytes of log per tune). */
  if (!isatty(fileno(f))) {
    if (done != total && el - *last_line < 10.0) return;
    *last_line = el;
    fprintf(f, "  %d/%d candidates  %4.0fs elapsed  ETA %4.0fs\n", done, total, el, eta);
    fflush(f);
    return;
  }
  int w = 30, fill = total ? done * w / total : 0;
  fprintf(f, "\r  [%.*s%*s] %d/%d candidates  %4.0fs elapsed  ETA %4.0fs ", fill, "##############################",
          w - fill, "", done, total, el, eta);
  if (done == total) fputc('\n', f);
  fflush(f);
}

static int bucket_selected(const char *shapes, const m3_bucket *b) {
  if (!shapes || !*shapes) return 1;
  /* "tokens=1,64;ctx=8192": every named dim of b must be listed */
  for (int d = 0; d < b->ndims; d++) {
    const char *p = strstr(shapes, b->dims[d].name);
    if (!p || p[strlen(b->dims[d].name)] != '=') continue;
    p += strlen(b->dims[d].name) + 1;
    int hit = 0;
    while (*p && *p != ';') {
      long long v = strtoll(p, (char **)&p, 10);
      if (v == b->dims[d].value) hit = 1;
      if (*p == ',') p++;
      else if (*p && *p != ';') break;
    }
    if (!hit) return 0;
  }
  return 1;
}

static int tile_selected(const char *list, const m3_variant *v) {
  if (!list || !*list) return 1;
  char t[512];
  m3_variant_print_tile(v, t, sizeof t);
  const size_t n = strlen(t);
  for (const char *p = list; p && *p; p = strchr(p, ';') ? strchr(p, ';') + 1 : NULL)
    if (!strncmp(p, t, n) && (p[n] == ';' || p[n] == 0)) return 1;
  return 0;
}


int m3_tune_name_in_list(const char *list, const char *name) {
  const size_t n = strlen(name);
  for (const char *p = list; *p;) {
    const char *c = strchr(p, ',');
    const size_t len = c ? (size_t)(c - p) : strlen(p);
    if (len == n && !strncmp(p, name, n)) return 1;
    if (!c) break;
    p = c + 1;
  }
  return 0;
}

m3_status m3_tune_run(m3_rt *rt, const m3_tune_opts *o, m3_tune_result *res, m3_err *e) {
  memset(res, 0, sizeof *res);
  double t_start = now_s();
  m3_config cfg;
  M3_TRY(m3_config_for(o->preset ? o->preset : "minimax-m3", o->model_dir, &cfg, e));
  m3_dims dims;
  m3_model_dims(&cfg, &dims);
  int reps = o->reps >= 20 ? o->reps : 20, warmup = o->warmup >= 2 ? o->warmup : 3;

  /* 1. Enumerate (variant, bucket) jobs and their candidate tiles. */
  int nj = 0, capj = 64, nc = 0, capc = 256, nj_shapes = 0, n_named = 0;
  /* --tiles: where each shape's current record is - the DB this run writes
   * when it is not the cache's (--db), else the runtime's (cache over seed). */
  m3_tunedb *incdb = NULL;
  if (o->tiles && o->db_path && access(o->db_path, F_OK) == 0) {
    m3_err le;
    incdb = m3_tunedb_new();
    if (incdb && m3_tunedb_load(incdb, o->db_path, NULL, NULL, NULL, &le) != M3_OK) {
      m3_warn("tune: %s not read (%s): the shapes' current tiles are not among the candidates", o->db_path, le.msg);
      m3_tunedb_free(incdb);
      incdb = NULL;
    }
  }
  const m3_tunedb *cur_db = o->db_path ? incdb : rt->db;
  tjob *jobs = malloc(sizeof *jobs * (size_t)capj);
  m3_jit_job *cands = calloc((size_t)capc, sizeof *cands);
  m3_status s = jobs && cands ? M3_OK : m3_errf(e, M3_NOMEM, "tuner");
  for (int t = 0; m3_tune_ops[t] && !s; t++) {
    const m3_tune_op *op = m3_tune_ops[t];
    if (o->only && !m3_tune_name_in_list(o->only, op->template_name)) continue;
    m3_variant *vs = NULL;
    int nv = 0;
    if ((s = m3_render_variants(rt->jit.lua, op->template_name, &dims, &vs, &nv, e))) break;
    for (int i = 0; i < nv && !s; i++) {
      snprintf(vs[i].arch, sizeof vs[i].arch, "%s", rt->dev.arch);
      if (o->variant) {
        char kt[M3_KEY_MAX];
        m3_variant_print_axes(&vs[i], kt, sizeof kt);
        if (!strstr(kt, o->variant)) continue;
      }
      m3_bucket bs[32];
      int nb = op->buckets(&cfg, &vs[i], bs, 32);
      m3_variant *tiles = NULL;
      int nt = 0;
      if ((s = m3_render_tiles(rt->jit.lua, &vs[i], &tiles, &nt, e))) break;
      for (int b = 0; b < nb && !s; b++) {
        if (!bucket_selected(o->shapes, &bs[b])) continue;
        if (nj == capj) jobs = realloc(jobs, sizeof *jobs * (size_t)(capj *= 2));
        tjob *j = &jobs[nj++];
        j->op = op;
        j->key = vs[i];
        j->bucket = bs[b];
        j->first_cand = nc;
        j->n_cand = 0;
        nj_shapes++;
        /* With --tiles, the tile the runtime now takes for this shape is timed
         * too: a narrower run never leaves a record slower than the one it
         * replaces (as this run times them). */
        char inc[512] = "";
        if (o->tiles && cur_db) {
          char kt[M3_KEY_MAX];
          m3_variant_print_axes(&vs[i], kt, sizeof kt);
          const m3_tune_record *r = m3_tunedb_find(cur_db, kt, &bs[b], rt->dev.arch);
          if (r && r->tile) snprintf(inc, sizeof inc, "%s", r->tile);
        }
        for (int q = 0; q < nt; q++) {
          m3_err ve;
          char why[512];
          const int named = o->tiles && tile_selected(o->tiles, &tiles[q]);
          if (o->tiles && !named && !(inc[0] && tile_selected(inc, &tiles[q]))) continue;
          n_named += named;
          if (nc == capc) {
            cands = realloc(cands, sizeof *cands * (size_t)(capc * 2));
            memset(cands + capc, 0, sizeof *cands * (size_t)capc);
            capc *= 2;
          }
          m3_jit_job *c = &cands[nc];
          c->v = tiles[q];
          if (m3_render_valid(rt->jit.lua, &tiles[q], why, sizeof why, &ve) != M3_OK) {
            c->status = M3_TILE;
            snprintf(c->reason, sizeof c->reason, "%s", why);
          } else if (m3_render_source(rt->jit.lua, &tiles[q], &c->src, &ve) != M3_OK) {
            c->status = ve.code;
            snprintf(c->reason, sizeof c->reason, "%.*s", (int)sizeof c->reason - 1, ve.msg);
          } else {
            c->rendered = 1;
          }
          nc++;
          j->n_cand++;
        }
        if (j->n_cand == 0) nj--; /* none of o->tiles is a tile of this variant */
      }
      free(tiles);
    }
    free(vs);
  }
  m3_tunedb_free(incdb);
  if (s) goto out;
  if (o->tiles) /* an entry that names no candidate: a typo, another family's tile, a space */
    for (const char *p = o->tiles; p && *p; p = strchr(p, ';') ? strchr(p, ';') + 1 : NULL) {
      const size_t n = strchr(p, ';') ? (size_t)(strchr(p, ';') - p) : strlen(p);
      int hit = n == 0;
      for (int q = 0; q < nc && !hit; q++) {
        char t[512];
        m3_variant_print_tile(&cands[q].v, t, sizeof t);
        hit = strlen(t) == n && !strncmp(t, p, n);
      }
      if (!hit) m3_warn("tune: --tiles: '%.*s' is not a tile of any selected kernel and shape: not timed", (int)n, p);
    }
  if (o->tiles && n_named == 0 && nj_shapes > 0) {
    s = m3_errf(e, M3_INVAL, "tune: none of the tiles '%.200s' is a tile of a selected kernel (whole tile strings, "
                "every axis, ';'-separated, as 'm3kit gen --tiles KEY' lists them)", o->tiles);
    goto out;
  }

  /* 2. Compile every candidate in parallel, before any timing (#34). */
  if (o->progress) fprintf(o->progress, "m3kit tune: %d shapes, %d candidates on %s (%s); compiling...\n", nj, nc,
                           rt->dev.name, rt->dev.arch);
  double tc = now_s();
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  /* A variant tuned at several buckets has the same candidates at each:
   * compile each distinct kernel once, then share its outcome. */
  int *dup = malloc(sizeof *dup * (size_t)(nc ? nc : 1));
  char (*ktxt)[M3_KEY_MAX] = malloc(sizeof *ktxt * (size_t)(nc ? nc : 1));
  if (!dup || !ktxt) {
    free(dup);
    free(ktxt);
    s = m3_errf(e, M3_NOMEM, "tuner");
    goto out;
  }
  for (int i = 0; i < nc; i++) {
    dup[i] = -1;
    m3_variant_print(&cands[i].v, ktxt[i], sizeof ktxt[i]);
    for (int q = 0; q < i && cands[i].rendered; q++)
      if (cands[q].rendered && !strcmp(ktxt[q], ktxt[i])) {
        dup[i] = q;
        cands[i].rendered = 0;
      }
  }
  m3_jit_build_many(&rt->jit, cands, nc, o->jobs > 0 ? o->jobs : (int)(ncpu > 0 ? ncpu : 2),
              o->compile_timeout_s > 0 ? o->compile_timeout_s : 60);
  for (int i = 0; i < nc; i++)
    if (dup[i] >= 0) {
      const m3_jit_job *f = &cands[dup[i]];
      cands[i].rendered = 1;
      cands[i].status = f->status;
      cands[i].hit = f->hit;
      cands[i].size = f->size;
      memcpy(cands[i].reason, f->reason, sizeof cands[i].reason);
    }
  free(dup);
  free(ktxt);
  if (o->progress) fprintf(o->progress, "  compiled in %.1f s\n", now_s() - tc);

  if ((s = m3_measure_copy_gbs(rt, &res->copy_gbs, e))) goto out;
  if (o->progress) fprintf(o->progress, "  copy ceiling (read + write): %.0f GB/s\n", res->copy_gbs);

  char dbp[4200];
  if (o->db_path) snprintf(dbp, sizeof dbp, "%s", o->db_path);
  else snprintf(dbp, sizeof dbp, "%s/tuning/%s.json", rt->jit.cache_root, rt->dev.arch);
  {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s", dbp);
    char *sl = strrchr(dir, '/');
    if (sl) *sl = 0, m3_mkdirs(dir, e);
  }
  m3_tunedb *db = m3_tunedb_new();
  /* The seed's records on their own, for its pins (pin_of), checked as the
   * runtime checks them. */
  m3_tunedb *seed_pins = m3_tunedb_new();
  if (seed_pins) {
    char seedp[4200], sdrv[32];
    snprintf(sdrv, sizeof sdrv, "%d", rt->dev.driver_version);
    m3_tuning_hash_ctx hc = {.lua = rt->jit.lua};
    m3_tunedb_filter sf;
    m3_tuning_filter_init(&sf, &hc, rt->dev.arch, sdrv);
    const char *sp = m3_tuning_seed_path(rt->dev.arch, seedp, sizeof seedp);
    m3_err le;
    if (sp && m3_tunedb_load(seed_pins, NULL, sp, &sf, NULL, &le) != M3_OK)
      m3_warn("tune: the seed's pins not read: %s", le.msg);
  }
  const double slack = pin_slack();
  res->rows = calloc((size_t)(nj ? nj : 1), sizeof *res->rows);
  if (!db || !res->rows) {
    s = m3_errf(e, M3_NOMEM, "tuner DB");
    m3_tunedb_free(db);
    m3_tunedb_free(seed_pins);
    goto out;
  }
  char drv[32], nvv[32], cbv[32], date[40];
  snprintf(drv, sizeof drv, "%d", rt->dev.driver_version);
  snprintf(nvv, sizeof nvv, "%d.%d", m3_nvrtc_version() / 1000, (m3_nvrtc_version() % 1000) / 10);
  snprintf(cbv, sizeof cbv, "%d", (int)cublasGetCudartVersion());
  m3_tunedb_now_iso(date, sizeof date);

  /* 3. Per shape: verify then time each candidate; choose; record. */
  int done = 0;
  double t0 = now_s(), last_line = -1e9; /* the progress line's last print (per run) */
  for (int ji = 0; ji < nj && !s; ji++) {
    tjob *j = &jobs[ji];
    if (o->budget_s > 0 && now_s() - t_start > o->budget_s) {
      m3_warn("tune: budget of %.0f s reached; %d of %d shapes tuned", o->budget_s, ji, nj);
      break;
    }
    const double t_shape = now_s();
    void *st = NULL;
    m3_err se;
    m3_status ss = j->op->setup(rt, &cfg, &j->key, &j->bucket, 0x6d336b6974ULL + (uint64_t)ji, &st, &se);
    m3_tune_candidate *cs = calloc((size_t)j->n_cand, sizeof *cs);
    char (*tiles)[128] = calloc((size_t)j->n_cand, sizeof *tiles);
    char (*reasons)[512] = calloc((size_t)j->n_cand, sizeof *reasons);
    m3_variant defv = j->key;
    m3_err de;
    char deftile[128] = "";
    if (m3_render_default_tile(rt->jit.lua, &defv, &de) == M3_OK) m3_variant_print_tile(&defv, deftile, sizeof deftile);
    /* best: the chosen time (graph-timed for short kernels); best_ev: the
     * best event-timed median, the only fair yardstick for the early stop,
     * which sees event times (a 2 us kernel graph-timed shows ~8 us under
     * events: comparing the two skipped every later candidate). */
    double best = 0, best_ev = 0;
    int best_i = -1, def_i = -1;
    /* Once one candidate of the shape is graph-timed (a short kernel), all
     * are: graphed[q] says which were, and those event-timed before the
     * first short one are re-timed after the sweep. */
    int shape_graph = 0;
    unsigned char *graphed = calloc((size_t)j->n_cand, 1);
    /* An earlier record of this shape pinned by a whole decode-step
     * measurement (tools/seed_pin.py): its tile is timed in full (no early
     * stop), to be weighed against this tune's pick below. */
    m3_tune_row *row = &res->rows[res->n_rows];
    m3_variant_print_axes(&j->key, row->key, sizeof row->key);
    m3_bucket_format(&j->bucket, row->bucket, sizeof row->bucket);
    const m3_tune_record *prev = pin_of(rt->db, seed_pins, row->key, &j->bucket, rt->dev.arch);
    m3_kernel **kq = calloc((size_t)j->n_cand, sizeof *kq);
    for (int q = 0; q < j->n_cand; q++) {
      m3_jit_job *cj = &cands[j->first_cand + q];
      m3_tune_candidate *c = &cs[q];
      m3_variant_print_tile(&cj->v, tiles[q], sizeof tiles[q]);
      c->tile = tiles[q];
      c->median_us = c->p20_us = c->p80_us = NAN;
      c->reason = NULL;
      if (!strcmp(tiles[q], deftile)) def_i = q;
      if (ss != M3_OK) {
        c->disposition = M3_DISP_LAUNCH_ERROR;
        snprintf(reasons[q], sizeof reasons[q], "setup failed: %.400s", se.msg);
        c->reason = reasons[q];
      } else if (cj->status == M3_TILE) {
        c->disposition = M3_DISP_NOT_SUPPORTED;
      } else if (cj->status == M3_TIMEOUT) {
        c->disposition = M3_DISP_COMPILE_TIMEOUT;
      } else if (cj->status != M3_OK) {
        c->disposition = M3_DISP_COMPILE_ERROR;
      } else {
        m3_kernel *k;
        m3_err ke;
        char detail[512] = "";
        m3_status ks = m3_rt_kernel(rt, &cj->v, &j->bucket, &k, &ke);
        if (!ks) ks = j->op->prepare(st, 0, &ke);
        if (!ks) ks = j->op->launch(st, k, 0, &ke);
        if (!ks) ks = j->op->verify(st, detail, sizeof detail, &ke);
        if (ks == M3_MISMATCH) {
          c->disposition = M3_DISP_INCORRECT;
          snprintf(reasons[q], sizeof reasons[q], "%s", detail);
        } else if (ks != M3_OK) {
          c->disposition = M3_DISP_LAUNCH_ERROR;
          snprintf(reasons[q], sizeof reasons[q], "%.*s", (int)sizeof reasons[q] - 1, ke.msg);
          cudaGetLastError(); /* clear a sticky launch error if it is not fatal */
        } else {
          double ev = 0;
          const double stop_ev = prev && !strcmp(tiles[q], prev->tile) ? 0 : best_ev;
          int g = shape_graph;
          if ((ks = m3_tune_time_kernel(rt, j->op, st, k, warmup, reps, stop_ev, &g, c, &ev, &ke)) != M3_OK) {
            c->disposition = M3_DISP_LAUNCH_ERROR;
            snprintf(reasons[q], sizeof reasons[q], "%.*s", (int)sizeof reasons[q] - 1, ke.msg);
          } else {
            if (kq) kq[q] = k;
            if (graphed) graphed[q] = (unsigned char)g;
            shape_graph |= g;
            if (c->disposition == M3_DISP_PASSED && (best_ev <= 0 || ev < best_ev)) best_ev = ev;
            if (c->disposition == M3_DISP_PASSED && (best_i < 0 || c->median_us < best)) {
              best = c->median_us;
              best_i = q;
            }
          }
        }
        if (reasons[q][0]) c->reason = reasons[q];
      }
      if (!c->reason && cj->reason[0]) c->reason = cj->reason;
      progress(o->progress, ++done, nc, t0, &last_line);
    }
    if (shape_graph && graphed && kq) {
      for (int q = 0; q < j->n_cand; q++) {
        if (graphed[q] || !kq[q] || cs[q].disposition != M3_DISP_PASSED) continue;
        m3_timing t;
        m3_err ke;
        if (m3_tune_graph_time(j->op, st, kq[q], rt->stream, GRAPH_LAUNCHES, reps, &t, &ke) != M3_OK) {
          (void)cudaGetLastError();
          m3_warn("tune: %s %s: tile %s could not be re-timed as a graph like the shape's other candidates: "
                  "left out of the choice", row->key, row->bucket, tiles[q]);
          cs[q].disposition = M3_DISP_LAUNCH_ERROR;
          snprintf(reasons[q], sizeof reasons[q], "graph re-timing failed: %.400s", ke.msg);
          cs[q].reason = reasons[q];
          continue;
        }
        cs[q].median_us = t.median_us, cs[q].p20_us = t.p20_us, cs[q].p80_us = t.p80_us, cs[q].n_runs = t.reps;
      }
      best_i = -1;
      for (int q = 0; q < j->n_cand; q++)
        if (cs[q].disposition == M3_DISP_PASSED && (best_i < 0 || cs[q].median_us < best)) best = cs[q].median_us, best_i = q;
    }
    free(graphed);
    /* The default against the winner, re-timed back to back (default,
     * winner, default, winner; each keeps its faster pass): the sweep timed
     * them minutes apart, in an order that favours neither, and clocks and
     * L2 state drift in between.  Both the 2% rule and the reported speedup
     * use these times.  A default skipped as 3x slower gets its full timing
     * here too. */
    if (kq && def_i >= 0 && best_i >= 0 && def_i != best_i && kq[def_i] && kq[best_i] &&
        (cs[def_i].disposition == M3_DISP_PASSED || cs[def_i].disposition == M3_DISP_SKIPPED_SLOWER)) {
      m3_err ke;
      if (retime_pair(rt, j->op, st, kq, warmup, reps, shape_graph, cs, def_i, best_i, &ke))
        best = cs[best_i].median_us;
      else
        m3_warn("tune: %s %s: re-timing the default against the winner failed: %s", j->op->template_name,
                j->key.op, ke.msg);
    }
    /* The default stays unless a candidate is >= 2% faster. */
    int choose = best_i;
    if (def_i >= 0 && cs[def_i].disposition == M3_DISP_PASSED && best_i >= 0 &&
        cs[best_i].median_us > 0.98 * cs[def_i].median_us)
      choose = def_i;
    /* A pinned record of this shape (tools/seed_pin.py: a whole decode-step
     * A/B chose its tile) keeps its tile while it times within the slack
     * (pin_slack) of the choice above, the two re-timed back to back: the tuner times a
     * kernel alone, the step between others, and the two disagreed by more
     * than the tuner's differences (device runs 40-43: MoE down candidates
     * within 2% here, 6% apart in the step).  A pin that could not be timed
     * this time (not among --tiles, a compile timeout, a launch error) leaves
     * the shape's record as it was; one that now fails verification, is
     * refused by valid() or does not compile, or times slower, gives way to
     * the choice, with a warning. */
    const char *pin_why = NULL;
    int skip_record = 0;
    if (prev && choose >= 0) {
      int q = 0;
      while (q < j->n_cand && strcmp(tiles[q], prev->tile)) q++;
      const m3_disposition d = q < j->n_cand ? cs[q].disposition : M3_DISP_COUNT;
      const char *lost = NULL;
      char why[160] = "";
      if (q == j->n_cand || d == M3_DISP_COMPILE_TIMEOUT || d == M3_DISP_LAUNCH_ERROR) {
        skip_record = 1;
        m3_warn("tune: %s %s: the pinned tile %s %s: the record of this shape is left as it was (pinned because: %s)",
                row->key, row->bucket, prev->tile,
                q == j->n_cand ? "was not among this run's candidates" : "could not be timed", prev->pinned);
      } else if (d != M3_DISP_PASSED) {
        snprintf(why, sizeof why, "failed: %s", m3_disposition_name(d));
        lost = why;
      } else {
        m3_err ke;
        if (q != choose && kq && kq[q] && kq[choose] && !retime_pair(rt, j->op, st, kq, warmup, reps, shape_graph, cs, q, choose, &ke))
          m3_warn("tune: %s %s: re-timing the pinned tile against the choice failed: %s", row->key,
                  row->bucket, ke.msg);
        if (cs[q].median_us <= (1.0 + slack) * cs[choose].median_us) {
          if (q != choose && o->progress)
            fprintf(o->progress, "  %s %s: kept the pinned tile %s (%.2f us; the tuner's choice %s %.2f us): %s\n",
                    row->key, row->bucket, tiles[q], cs[q].median_us, tiles[choose],
                    cs[choose].median_us, prev->pinned);
          choose = q;
          pin_why = prev->pinned;
        } else {
          snprintf(why, sizeof why, "timed %.2f us against %.2f (more than %.1f%% slower)", cs[q].median_us,
                   cs[choose].median_us, 100.0 * slack);
          lost = why;
        }
      }
      if (lost)
        m3_warn("tune: %s %s: the pinned tile %s %s; the record takes the tuner's choice %s (pinned because: %s)",
                row->key, row->bucket, prev->tile, lost, tiles[choose], prev->pinned);
    }
    free(kq);
    double work = (ss == M3_OK && j->op->work) ? j->op->work(st) : 0;
    const char *unit = (ss == M3_OK && j->op->unit_of) ? j->op->unit_of(st) : j->op->unit;
    if (st) j->op->teardown(st); /* a failed setup leaves a partial state */
    const double shape_s = now_s() - t_shape;
    snprintf(row->op, sizeof row->op, "%s", j->op->template_name);
    snprintf(row->default_tile, sizeof row->default_tile, "%s", deftile);
    snprintf(row->unit, sizeof row->unit, "%s", unit);
    row->n_candidates = j->n_cand;
    row->seconds = shape_s;
    for (int q = 0; q < j->n_cand; q++) {
      row->n_passed += cs[q].disposition == M3_DISP_PASSED;
      row->n_incorrect += cs[q].disposition == M3_DISP_INCORRECT;
      row->n_failed += cs[q].disposition == M3_DISP_COMPILE_ERROR || cs[q].disposition == M3_DISP_LAUNCH_ERROR ||
                       cs[q].disposition == M3_DISP_COMPILE_TIMEOUT;
    }
    row->default_us = def_i >= 0 ? cs[def_i].median_us : NAN;
    if (choose >= 0) {
      snprintf(row->tile, sizeof row->tile, "%s", tiles[choose]);
      row->tuned_us = cs[choose].median_us;
      row->ceiling = !strcmp(unit, "GB/s") ? res->copy_gbs : 800.0;
      row->achieved = !strcmp(unit, "GB/s") ? work / (row->tuned_us * 1e-6) / 1e9 : work / (row->tuned_us * 1e-6) / 1e12;
      row->pct = 100.0 * row->achieved / row->ceiling;
      char th[32];
      m3_schema sc;
      m3_err he;
      if (m3_render_schema(rt->jit.lua, j->op->template_name, &sc, &he) == M3_OK)
        snprintf(th, sizeof th, "%016llx", (unsigned long long)sc.hash);
      else
        snprintf(th, sizeof th, "unknown");
      m3_tune_record r = m3_tune_record_empty();
      r.key = row->key;
      r.bucket = j->bucket;
      r.arch = rt->dev.arch;
      r.tile = tiles[choose];
      r.pinned = pin_why;
      r.default_tile = deftile;
      r.default_us = row->default_us;
      r.tuned_us = row->tuned_us;
      r.prov = (m3_tune_provenance){rt->dev.name, rt->dev.sm_count, drv, nvv, cbv, th, PACKAGE_VERSION, date,
                                    o->command ? o->command : "m3kit tune"};
      /* The code the chosen tile ran: the record outlives template edits
       * that leave it unchanged (gen/code_hash.h). */
      char ch[M3_CODE_HASH_TEXT] = "";
      const m3_jit_job *won = &cands[j->first_cand + choose];
      uint64_t code;
      m3_err ce;
      if (won->src.text) { /* rendered for its compile: no second rendering */
        m3_code_hash_text(m3_source_code_hash(&won->src), ch, sizeof ch);
        r.prov.code_hash = ch;
      } else if (m3_render_code_hash(rt->jit.lua, &won->v, &code, &ce) == M3_OK) {
        m3_code_hash_text(code, ch, sizeof ch);
        r.prov.code_hash = ch;
      }
      r.metric = (m3_tune_metric){unit, row->achieved, row->ceiling, row->pct};
      r.n_candidates = (size_t)j->n_cand;
      r.candidates = cs;
      m3_err pe;
      if (!skip_record && m3_tunedb_put(db, &r, &pe) != M3_OK) m3_warn("tune: record for %s %s not kept: %s", row->key, row->bucket, pe.msg);
      else if (!skip_record) row->recorded = 1;
    }
    res->n_rows++;
    free(cs);
    free(tiles);
    free(reasons);
    /* Publish after every shape: a killed tuner keeps what it measured. */
    m3_tunedb_report rep;
    m3_err we;
    if (m3_tunedb_save_merge(dbp, db, &rep, &we) != M3_OK) {
      s = m3_errf(e, we.code, "%s", we.msg);
      break;
    }
  }
  if (db) m3_tunedb_free(db);
  if (seed_pins) m3_tunedb_free(seed_pins);
out:;
  /* A timed-out compile may still be running on a detached thread that reads
   * its job: leave the jobs allocated then (the process ends soon after). */
  int timed_out = 0;
  for (int i = 0; i < nc; i++) timed_out |= cands[i].status == M3_TIMEOUT;
  if (!timed_out) {
    for (int i = 0; i < nc; i++) m3_source_free(&cands[i].src);
    free(cands);
  }
  free(jobs);
  res->seconds = now_s() - t_start;
  return s;
}

void m3_tune_result_free(m3_tune_result *r) {
  free(r->rows);
  r->rows = NULL;
  r->n_rows = 0;
}
