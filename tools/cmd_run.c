/* cmd_run.c - `m3kit run`: load a model (checkpoint, or synthetic weights
 * for a preset), prefill a prompt, decode, and report TTFT, TPOT, tokens/s
 * and peak GPU memory; with --tp N the same over N tensor-parallel ranks
 * (runtime/tp_forward.h).  Without a GPU it says so and does the part that
 * needs none: renders and compiles every kernel the model needs, the tuning
 * DB's tiles included - proof that each one builds for the arch.  (Its
 * cubins do not warm a GPU's cache: a cubin's key holds the CUDA driver
 * version (known-faults #26), which a machine without a GPU does not have.) */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cache/store.h"
#include "cache/tunedb.h"
#include "runtime/config.h"
#include "runtime/forward.h"
#include "runtime/harness.h"
#include "runtime/jit.h"
#include "runtime/kv_cache.h"
#include "runtime/log.h"
#include "runtime/model.h"
#include "runtime/model_dims.h"
#include "runtime/tp_forward.h"
#include "runtime/tp_plan.h"
#include "runtime/tuning_lookup.h"
#include "tools/cli.h"

static void help(void) {
  printf(
      "usage: m3kit run [options]\n\n"
      "Run the MiniMax-M3 text model: prefill a prompt, then generate.\n\n"
      "model (default: --preset tiny, the embedded small M3-shaped model):\n"
      "  --model DIR              checkpoint directory (config.json + safetensors, bf16 or MXFP8)\n"
      "  --preset NAME            synthetic weights for an embedded config (tiny, minimax-m3), generated on\n"
      "                           the GPU from --seed\n"
      "  --resident-experts N     synthetic: routed experts resident per MoE layer (default min(8, E)); routing\n"
      "                           is restricted to them (the others' selection scores are -inf), so a batch-1\n"
      "                           decode step of --preset minimax-m3 reads exactly the real model's bytes\n"
      "  --weights bf16|mxfp8     synthetic linear weights (default: mxfp8 for minimax-m3, bf16 otherwise)\n"
      "prompt:\n"
      "  --prompt-ids 1,2,3       token ids of the prompt\n"
      "  --context N              or a random prompt of N ids (from --seed; default 32)\n"
      "  --batch B                sequences decoded together (default 1); each gets the prompt (--prompt-ids)\n"
      "                           or its own random one (--context)\n"
      "generation:\n"
      "  --max-new-tokens N       tokens to generate per sequence (default 16)\n"
      "  --temperature T          sampling temperature (default 0: greedy)\n"
      "  --top-p P                nucleus sampling mass (default 1)\n"
      "  --seed S                 seed for weights, random prompts and sampling (default 0; every token\n"
      "                           of every sequence draws its own uniform, keyed (seed, step, row))\n"
      "caches and schedule:\n"
      "  --kv-dtype bf16|e4m3     main KV cache dtype (default bf16)\n"
      "  --index-dtype bf16|e4m3  index-K cache and index-q dtype (default bf16)\n"
      "  --chunk N                prefill chunk in tokens (default 256)\n"
      "  --synthetic-cache        fill the cache of all prompt tokens but the last with random values instead\n"
      "                           of prefilling them (decode cost depends on the bytes read, not their\n"
      "                           values: measures TPOT at long contexts without the prefill; TTFT is then\n"
      "                           the last token's)\n"
      "  --no-graph               launch decode kernels one by one instead of replaying a CUDA graph\n"
      "tensor parallelism (spec §3.2; m3kit tp-plan --tp N shows the cut):\n"
      "  --tp N                   N ranks (1..8), one thread each: q heads, KV heads, every expert's and the\n"
      "                           dense MLP's intermediate and the lm_head's rows split, 2 all-reduces a layer\n"
      "                           and a logits all-gather a step; prints each rank's weight bytes and the\n"
      "                           collectives run.  --synthetic-cache fills every rank's cache (its KV heads,\n"
      "                           the whole index-K cache); --timing prints rank 0's per-op table and each\n"
      "                           collective's max over the ranks; not with --graph-breakdown (a rank's\n"
      "                           collective replayed alone would wait for the others)\n"
      "  --tp-backend nccl|local  nccl (default when N GPUs exist): rank r on GPU r, NCCL collectives, decode\n"
      "                           graphs on; local: the ranks share the GPUs there are and take turns, meeting\n"
      "                           in host memory (graphs off): checks the path on one GPU, no speedup\n"
      "output:\n"
      "  --dump-logits FILE.npy   float32 [steps, batch, vocab]: step 0 = the prompt's last token, then\n"
      "                           one row per generated token\n"
      "  --timing                 per-kernel time breakdown (CUDA events; decode then runs without graphs)\n"
      "  --graph-breakdown        after the last step, each op's share of the graph-replayed decode step:\n"
      "                           its launches captured and replayed alone (sums to about the step), and\n"
      "                           its cost in the step (the step less the step without it); moe/*: the\n"
      "                           MoE op's launches\n"
      "  --arch SM                without a GPU: the arch to compile for (default sm_90)\n"
      "  --help\n\n"
      "Prints the generated ids, TTFT (prefill of the whole batch), TPOT (mean decode step after the first, which\n"
      "captures the CUDA graph and is printed apart), decode tokens/s,\n"
      "peak GPU memory in use, and the start-up: GPU open and the kernels (from the cubin cache or compiled, time\n"
      "to build and to load; with --tp, each rank's weight bytes and collectives instead).  Without a GPU no kernel runs: every kernel variant the model needs is\n"
      "rendered and compiled instead, at its default tile and at every tile the tuning DB (yours + the seed) holds\n"
      "for --arch: proof that each builds (cubins are keyed by the CUDA driver version too, so a GPU machine\n"
      "compiles its own once).  Exit status: 0 done (without a GPU: every kernel compiled), 1 error, 2 bad option,\n"
      "3 no GPU for what was asked (--dump-logits: its file cannot be written).\n"
      "Environment: M3KIT_CHECK_NUMERICS=1 scans every op's output for NaN/Inf (names layer and op).\n");
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

/* An existing path that is not a regular file (a pipe, /dev/stdout): written
 * as it is, since it cannot be replaced by a rename. */
static int is_stream(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && !S_ISREG(st.st_mode);
}

/* .npy version 1.0: magic, header length (u16 LE), a Python dict literal
 * padded with spaces to a multiple of 64 bytes and ending in '\n', then raw
 * little-endian float32 in C order. */
static int write_npy(const char *path, const float *x, const int64_t *shape, int ndim) {
  char dict[256];
  int n = snprintf(dict, sizeof dict, "{'descr': '<f4', 'fortran_order': False, 'shape': (");
  uint64_t count = 1;
  for (int i = 0; i < ndim; i++) {
    n += snprintf(dict + n, sizeof dict - (size_t)n, "%" PRId64 ", ", shape[i]);
    count *= (uint64_t)shape[i];
  }
  n += snprintf(dict + n, sizeof dict - (size_t)n, "), }");
  int total = 10 + n + 1, pad = (64 - total % 64) % 64;
  unsigned hl = (unsigned)(n + pad + 1);
  const size_t hbytes = 10 + hl, bytes = hbytes + sizeof *x * count;
  unsigned char *buf = malloc(bytes);
  if (!buf) return -1;
  unsigned char head[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(hl & 0xff), (unsigned char)(hl >> 8)};
  memcpy(buf, head, 10);
  memcpy(buf + 10, dict, (size_t)n);
  memset(buf + 10 + n, ' ', (size_t)pad);
  buf[hbytes - 1] = '\n';
  memcpy(buf + hbytes, x, sizeof *x * count);
  int rc;
  if (is_stream(path)) {
    FILE *f = fopen(path, "wb");
    rc = f && fwrite(buf, 1, bytes, f) == bytes ? 0 : -1;
    if (f && fclose(f) != 0) rc = -1;
    if (rc) fprintf(stderr, "m3kit run: %s: %s\n", path, strerror(errno));
  } else { /* whole or not at all: an earlier file stays until the new one is complete */
    m3_err e;
    rc = m3_write_atomic(path, buf, bytes, &e) == M3_OK ? 0 : -1;
    if (rc) fprintf(stderr, "m3kit run: %s\n", e.msg);
  }
  free(buf);
  return rc;
}

/* Whether --dump-logits can be written at the end of the run, checked before
 * it without creating or truncating anything: a file that is not regular (a
 * pipe) must be writable; else m3_write_atomic's own check.  0 or -1 with the
 * reason in why. */
static int dump_writable(const char *path, char *why, size_t n) {
  if (is_stream(path)) {
    if (access(path, W_OK) == 0) return 0;
    snprintf(why, n, "%s", strerror(errno));
    return -1;
  }
  m3_err e;
  if (m3_write_atomic_check(path, &e) == M3_OK) return 0;
  snprintf(why, n, "%s", e.msg);
  return -1;
}

static int parse_ids(const char *s, int32_t **ids, int *n) {
  int cap = 16;
  *n = 0;
  *ids = malloc(sizeof **ids * (size_t)cap);
  while (*ids && *s) {
    char *end;
    if (*s < '0' || *s > '9') return -1; /* bare digits: strtol would skip blanks and take a sign */
    long v = strtol(s, &end, 10);
    if (end == s || v < 0 || v > INT32_MAX) return -1;
    if (*n == cap) *ids = realloc(*ids, sizeof **ids * (size_t)(cap *= 2));
    if (!*ids) return -1;
    (*ids)[(*n)++] = (int32_t)v;
    if (*end && *end != ',') return -1;
    if (*end == ',' && !end[1]) return -1; /* a trailing comma: a token missing */
    s = *end == ',' ? end + 1 : end;
  }
  return *ids && *n > 0 ? 0 : -1;
}

/* One kernel: build (or find in the cubin cache) v, counting it. */
static m3_status build_one(m3_jit *j, m3_variant *v, int *built, int *hits, m3_err *e) {
  m3_cubin cb;
  M3_TRY(m3_jit_build(j, v, &cb, e));
  (*built)++;
  *hits += cb.hit;
  if (m3_log_verbose()) {
    char k[M3_KEY_MAX];
    m3_variant_print(v, k, sizeof k);
    printf("  %s %s\n", cb.hit ? "cached" : "built ", k);
  }
  m3_cubin_free(&cb);
  return M3_OK;
}

/* The tuned tiles of variant v (axes and arch set) that the tuning DB (user
 * records + seed) holds and the template still accepts: on a GPU of this
 * arch the runtime takes its tile from these, so each must build too.  Each
 * canonical tile once (records of several buckets may spell one differently). */
static m3_status build_tuned(m3_jit *j, struct m3_tunedb *db, const m3_variant *v, int *built, int *hits, int *tuned,
                             m3_err *e) {
  const size_t n = db ? m3_tunedb_count(db) : 0;
  char axes[M3_KEY_MAX], (*done)[M3_KEY_MAX] = calloc(n + 1, sizeof *done);   /* done[0]: the default, built */
  if (!done) return m3_errf(e, M3_NOMEM, "tuned tiles of a variant");
  m3_variant_print_axes(v, axes, sizeof axes);
  m3_variant_print_tile(v, done[0], sizeof done[0]);
  size_t nd = 1;
  m3_status s = M3_OK;
  for (size_t i = 0; i < n && s == M3_OK; i++) {
    const m3_tune_record *r = m3_tunedb_get(db, i);
    char why[256];
    if (strcmp(r->key, axes) || strcmp(r->arch, v->arch) || !m3_tuning_tile_ok(j->lua, v, r->tile, why, sizeof why))
      continue;
    m3_variant t = *v;
    if ((s = m3_variant_parse_tile(&t, r->tile, e)) != M3_OK || (s = m3_render_canon(j->lua, &t, e)) != M3_OK) break;
    m3_variant_print_tile(&t, done[nd], sizeof done[nd]);
    size_t q = 0;
    while (q < nd && strcmp(done[q], done[nd])) q++;
    if (q < nd) continue;
    nd++;
    if ((s = build_one(j, &t, built, hits, e)) == M3_OK) (*tuned)++;
  }
  free(done);
  return s;
}

/* No GPU: render + compile every variant the model needs for `arch`, at its
 * default tile and at every tile the tuning DB holds for it. */
static int compile_only(const char *preset, const char *model, const char *arch) {
  if (!m3_arch_valid(arch)) {
    fprintf(stderr, "m3kit run: bad SM arch '%s' in --arch (want sm_XX, sm_XXa or sm_XXf, e.g. sm_90)\n", arch);
    return 2;
  }
  m3_err e = {0};
  m3_dims d;
  m3_status s = m3_model_dims_for(preset, model, &d, &e);
  if (s != M3_OK) return cli_fail("run", s, &e);
  printf("m3kit run: no CUDA GPU on this machine: no kernel was run.\n"
         "Rendering and compiling every kernel variant the model needs for %s instead (cubin cache).\n%s", arch,
         model ? "(Without a GPU only the checkpoint's config.json is read, not its weights.)\n" : "");
  fflush(stdout);
  m3_jit j;
  if ((s = m3_jit_open(&j, &e)) != M3_OK) return cli_fail("run", s, &e);
  double t0 = now_s();
  int built = 0, hits = 0, tuned = 0, rc = 0;
  struct m3_tunedb *db = m3_tuning_open_arch(j.cache_root, arch, j.lua);
  for (const char *const *t = m3_lua_template_names(); *t && !rc; t++) {
    m3_variant *vs = NULL;
    int n = 0;
    if ((s = m3_render_variants(j.lua, *t, &d, &vs, &n, &e)) != M3_OK) { rc = cli_fail("run", s, &e); break; }
    for (int i = 0; i < n && !rc; i++) {
      snprintf(vs[i].arch, sizeof vs[i].arch, "%s", arch);
      if ((s = m3_render_default_tile(j.lua, &vs[i], &e)) != M3_OK ||
          (s = build_one(&j, &vs[i], &built, &hits, &e)) != M3_OK ||
          (s = build_tuned(&j, db, &vs[i], &built, &hits, &tuned, &e)) != M3_OK) {
        rc = cli_fail("run", s, &e);
        break;
      }
    }
    free(vs);
  }
  if (!rc)
    printf("%d kernels for %s (%s: every variant at its default tile, and %d tuned tiles from the tuning DB) build: "
           "%d compiled, %d from the cubin cache (%s/cubin), %.1f s\n",
           built, arch, model ? model : preset, tuned, built - hits, hits, j.cache_root, now_s() - t0);
  if (!rc && j.uncached)   /* the warning came once, at the first: the count is the whole story */
    printf("%ld of them not kept: the cubin cache at %s is not usable\n",
           (long)j.uncached, j.cache_root);
  m3_tuning_close(db);
  m3_jit_close(&j);
  return rc;
}

typedef struct {
  size_t total, min_free;
} mem_watch;
static void watch(mem_watch *w) {
  size_t fr = 0, tot = 0;
  if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) {
    w->total = tot;
    if (!w->min_free || fr < w->min_free) w->min_free = fr;
  }
}

/* ---- what a run and a --tp run share ---------------------------------------- */

/* prompts [batch, plen]: the --prompt-ids row for every sequence, else
 * random ids from the run's seed (the same for one GPU and for --tp). */
static void fill_prompts(int32_t *prompts, int batch, int plen, const int32_t *prompt1, int V, uint64_t seed) {
  m3_rng r = {seed ^ 0x5eedull};
  for (int b = 0; b < batch; b++)
    for (int i = 0; i < plen; i++)
      prompts[(size_t)b * plen + i] = prompt1 ? prompt1[i] : (int32_t)(m3_rng_next(&r) % (uint64_t)V);
}

/* The tokens, TTFT and TPOT lines (bench/tpot_curve.sh and bench/tp_tpot.sh
 * read them).  pre: prompt tokens from the synthetic cache; tdec covers the
 * decode steps after the first when there are two or more (t_first the
 * first, `first_what` what it did). */
static void report_run(const int32_t *gen, int batch, int plen, int max_new, int pre, const char *same, double ttft,
                       double tdec, double t_first, const char *first_what) {
  for (int b = 0; b < batch; b++) {
    printf("sequence %d: ", b);
    for (int i = 0; i < max_new; i++) printf("%s%d", i ? "," : "", gen[(size_t)b * max_new + i]);
    printf("\n");
  }
  const int steps = max_new - 1, timed = steps >= 2 ? steps - 1 : steps;
  printf("prompt %d tokens x %d sequences, %d new tokens each%s\n", plen, batch, max_new, same);
  printf("TTFT %.2f ms (prefill of %d x %d tokens, %.3g tokens/s)%s\n", ttft * 1e3, batch, plen - pre,
         batch * (plen - pre) / (ttft > 0 ? ttft : 1e-9), pre ? " after the synthetic cache" : "");
  if (steps > 0)
    printf("TPOT %.3f ms (mean of %d decode step%s at batch %d%s), %.3g tokens/s\n", tdec * 1e3 / timed, timed,
           timed == 1 ? "" : "s", batch,
           steps >= 2 ? ", after the first" : "; the only one, its graph capture included: --max-new-tokens 3 or more "
                                              "times the steps after it",
           (double)timed * batch / (tdec > 0 ? tdec : 1e-9));
  if (steps >= 2) printf("first decode step %.2f ms (%s)\n", t_first * 1e3, first_what);
  fflush(stdout); /* kept if a long report that follows (--graph-breakdown) is cut off */
}

/* --dump-logits: [max_new, batch, V] float32.  0, or 1 when it cannot be written. */
static int dump_logits(const char *path, const float *logits, int max_new, int batch, int V) {
  int64_t shape[3] = {max_new, batch, V};
  if (write_npy(path, logits, shape, 3) != 0) {
    fprintf(stderr, "m3kit run: cannot write %s\n", path);
    return 1;
  }
  printf("logits [%d, %d, %d] float32 -> %s\n", max_new, batch, V, path);
  return 0;
}

#define FIRST_STEP_GRAPH "eager launches + CUDA graph capture, once per batch size and context bucket"
#define FIRST_STEP_EAGER "kernel builds on first use"

/* ---- --tp: the same run through the tensor-parallel driver --------------- */

typedef struct run_args {
  const char *model, *preset, *dump;
  const int32_t *prompt1;
  int plen, max_new, batch, kv8, ix8, resident, chunk, graph, weights, tp, backend, timing, synth_cache;
  uint64_t seed;
  float temperature, top_p;
} run_args;

#define TP_OPS 64 /* rows of a rank's timing table (forward.c's MAX_OPS) */

static double op_ms(const m3_fwd_op_time *t, int n, const char *name, int *calls) {
  for (int i = 0; i < n; i++)
    if (!strcmp(t[i].name, name)) {
      if (calls) *calls = t[i].calls;
      return t[i].ms;
    }
  if (calls) *calls = 0;
  return 0;
}

/* --timing under --tp: rank 0's per-op table (ms per step over `steps`
 * forward calls), then the collectives on every rank.  A collective's event
 * time on a rank includes its wait for the slowest rank, so the ranks differ
 * and the max over them is what bounds a step; its share is of that rank's
 * summed kernel time.  The "allreduce:", "allgather:" and "collectives:"
 * lines are what bench/tp_tpot.sh reads. */
static m3_status print_tp_timing(m3_tp_group *g, int tp, int steps, const char *what, m3_err *e) {
  m3_fwd_op_time *t = malloc(sizeof *t * TP_OPS * (size_t)tp);
  int n[M3_TP_COMM_MAX] = {0};
  if (!t) return m3_errf(e, M3_NOMEM, "timing tables");
  m3_status s = m3_tp_timing(g, t, TP_OPS, n, e);
  if (s != M3_OK) {
    free(t);
    return s;
  }
  double tot[M3_TP_COMM_MAX] = {0};
  for (int r = 0; r < tp; r++)
    for (int i = 0; i < n[r]; i++) tot[r] += t[(size_t)r * TP_OPS + i].ms;
  const double ps = steps > 0 ? steps : 1;
  const int pre = !strcmp(what, "prefill"); /* its "steps" are prefill calls, one a sequence */
  printf("\n%s breakdown, rank 0 of %d (CUDA events around every op, no graphs; ms/step over %d %s%s):\n", what, tp,
         steps, pre ? "prefill call" : "decode step", steps == 1 ? "" : "s");
  printf("  %-14s %8s %12s %10s %7s\n", "op", "calls", "total ms", "ms/step", "share");
  for (int i = 0; i < n[0]; i++)
    printf("  %-14s %8d %12.3f %10.4f %6.1f%%\n", t[i].name, t[i].calls, t[i].ms, t[i].ms / ps,
           tot[0] > 0 ? 100.0 * t[i].ms / tot[0] : 0.0);
  printf("  %-14s %8s %12.3f %10.4f\n", "all kernels", "", tot[0], tot[0] / ps);
  if (tp > 1) {
    printf("collectives over the %d ranks (a rank's event time includes waiting for the slowest rank):\n", tp);
    double worst_sum = 0, worst_share = 0;
    int worst_rank = 0;
    for (int r = 0; r < tp; r++) {
      const m3_fwd_op_time *tr = t + (size_t)r * TP_OPS;
      const double c = op_ms(tr, n[r], "allreduce", NULL) + op_ms(tr, n[r], "allgather", NULL);
      if (c > worst_sum) worst_sum = c, worst_rank = r, worst_share = tot[r] > 0 ? 100.0 * c / tot[r] : 0;
    }
    static const char *const names[2] = {"allreduce", "allgather"};
    for (int k = 0; k < 2; k++) {
      double mx = -1, r0 = 0, mn = 0;
      int at = 0, calls = 0;
      for (int r = 0; r < tp; r++) {
        int cr = 0;
        const double ms = op_ms(t + (size_t)r * TP_OPS, n[r], names[k], &cr);
        if (r == 0) r0 = ms, mn = ms, calls = cr;
        if (ms < mn) mn = ms;
        if (ms > mx) mx = ms, at = r;
      }
      printf("  %s: max over ranks %.4f ms/step (rank %d), %.1f%% of the step; rank 0 %.4f, min %.4f ms/step; "
             "%d calls a rank\n", names[k], mx / ps, at, tot[at] > 0 ? 100.0 * mx / tot[at] : 0.0, r0 / ps, mn / ps,
             calls);
    }
    printf("  collectives: max over ranks %.4f ms/step (rank %d), %.1f%% of the step\n", worst_sum / ps, worst_rank,
           worst_share);
  }
  free(t);
  return M3_OK;
}

/* The sampling step of sequence b's first token.  Each sequence is
 * prefilled on its own and its one logits row sampled as row 0, so keyed
 * (seed, 0, 0) alike every sequence of a batch would draw the same uniform:
 * sequence 0 keeps step 0, sequence b > 0 takes 2^63 + b, never a decode
 * step (decode keys row b at steps 1, 2, ...). */
static uint64_t prefill_step(int b) { return b ? (UINT64_C(1) << 63) + (uint64_t)b : 0; }

static int run_tp(const run_args *a) {
  m3_err e = {0};
  m3_status s;
  m3_tp_group *g = NULL;
  int32_t *prompts = NULL, *gen = NULL, *next = NULL, *in = NULL;
  float *logits = NULL;
  int *seqs = NULL, rc = 0;
  const int64_t total = (int64_t)a->plen + a->max_new;
  m3_tp_opts o = {.tp = a->tp, .backend = (m3_tp_backend)a->backend,
                  .model = {.dir = a->model, .preset = a->preset, .resident_experts = a->resident, .mxfp8 = a->weights,
                            .seed = a->seed},
                  .fwd = m3_fwd_defaults()};
  o.fwd.max_batch = a->batch;
  o.fwd.max_chunk = a->chunk;
  o.fwd.use_graph = a->graph;
  o.fwd.timing = a->timing;
  {
    m3_config cc;
    if ((s = m3_config_for(a->preset, a->model, &cc, &e)) != M3_OK) return cli_fail("run", s, &e);
    /* the whole model's activations bound every rank's (a rank's widths are slices) */
    o.kv = (m3_kv_opts){.kv_e4m3 = a->kv8, .idx_e4m3 = a->ix8, .max_seqs = a->batch, .max_ctx = total,
                        .reserve_bytes = m3_forward_activation_bytes(&cc, &o.fwd, total) + (512ull << 20)};
  }
  double t_load = now_s();
  if ((s = m3_tp_open(&o, &g, &e)) != M3_OK) return cli_fail("run", s, &e);
  t_load = now_s() - t_load;
  const m3_config *cfg = m3_tp_config(g);
  const int V = cfg->vocab_size;
  printf("tensor parallel: %d rank%s, %s backend%s, loaded in %.1f s\n", a->tp, a->tp > 1 ? "s" : "",
         a->backend == M3_TP_NCCL && a->tp > 1 ? "NCCL" : "local", /* one rank never opens NCCL (tp_forward.c) */
         a->tp == 1 ? " (one rank: no collectives)" : "", t_load);
  for (int r = 0; r < a->tp; r++) {
    m3_tp_rank_info ri;
    if ((s = m3_tp_info(g, r, &ri, &e)) != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
    printf("  rank %d on GPU %d: %s; %.3f GB of weights (peak %.3f GB while loading), KV cache %.3f GB (%llu B/token, "
           "KV %s, index-K %s)\n", r, ri.device, ri.source, ri.weight_bytes / 1e9, ri.peak_bytes / 1e9,
           ri.kv_bytes / 1e9, (unsigned long long)ri.kv_bytes_per_token, a->kv8 ? "e4m3" : "bf16",
           a->ix8 ? "e4m3" : "bf16");
  }
  prompts = malloc(sizeof *prompts * (size_t)a->batch * (size_t)a->plen);
  gen = malloc(sizeof *gen * (size_t)a->batch * (size_t)a->max_new);
  next = malloc(sizeof *next * (size_t)a->batch);
  in = malloc(sizeof *in * (size_t)a->batch);
  seqs = malloc(sizeof *seqs * (size_t)a->batch);
  if (a->dump) logits = malloc(sizeof *logits * (size_t)a->max_new * (size_t)a->batch * (size_t)V);
  if (!prompts || !gen || !next || !in || !seqs || (a->dump && !logits)) {
    rc = cli_fail("run", m3_errf(&e, M3_NOMEM, "buffers"), &e);
    goto out;
  }
  fill_prompts(prompts, a->batch, a->plen, a->prompt1, V, a->seed);
  for (int b = 0; b < a->batch; b++)
    if ((s = m3_tp_admit(g, total, &seqs[b], &e)) != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
  m3_sampling smp = {a->temperature, a->top_p, a->seed, 0};
  int pre = 0; /* prompt tokens whose cache entries are synthetic (not computed), as the single-GPU run */
  if (a->synth_cache && a->plen > 1) {
    if ((s = m3_tp_fill_synthetic(g, seqs, a->batch, a->plen - 1, a->seed, &e)) != M3_OK) {
      rc = cli_fail("run", s, &e);
      goto out;
    }
    pre = a->plen - 1;
    printf("synthetic cache: %d tokens per sequence filled with random values on every rank (its KV heads, the whole "
           "index-K cache; no prefill computed for them)\n", pre);
  }
  double t0 = now_s();
  for (int b = 0; b < a->batch; b++) {
    smp.step = prefill_step(b);
    s = m3_tp_prefill(g, seqs[b], a->plen - pre, prompts + (size_t)b * a->plen + pre, &smp, &next[b],
                      logits ? logits + (size_t)b * V : NULL, &e);
    if (s != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
    gen[(size_t)b * a->max_new] = next[b];
  }
  const double ttft = now_s() - t0;
  if (a->timing) {
    if ((s = print_tp_timing(g, a->tp, a->batch, "prefill", &e)) != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
    m3_tp_reset_timing(g);
  }
  double t1 = now_s(), t_first = 0;
  for (int step = 1; step < a->max_new; step++) {
    /* The first decode step of a shape runs eagerly and captures its graph
     * (one-time work): timed apart from TPOT, as the single-GPU run. */
    if (step == 2) t_first = now_s() - t1, t1 = now_s();
    smp.step = (uint64_t)step;
    memcpy(in, next, sizeof *in * (size_t)a->batch);
    s = m3_tp_decode(g, a->batch, seqs, in, &smp, next, logits ? logits + (size_t)step * a->batch * V : NULL, &e);
    if (s != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
    for (int b = 0; b < a->batch; b++) gen[(size_t)b * a->max_new + step] = next[b];
  }
  const double tdec = now_s() - t1;
  const int steps = a->max_new - 1;
  m3_tp_rank_info ri0 = {0};
  if ((s = m3_tp_info(g, 0, &ri0, &e)) != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
  report_run(gen, a->batch, a->plen, a->max_new, pre, "; every rank chose the same tokens", ttft, tdec, t_first,
             ri0.graph_replays ? FIRST_STEP_GRAPH : FIRST_STEP_EAGER);
  printf("collectives per rank: %llu all-reduces (2 a layer a forward step), %llu logits all-gathers (1 a step); "
         "%llu decode steps replayed from CUDA graphs\n", (unsigned long long)ri0.allreduces,
         (unsigned long long)ri0.allgathers, (unsigned long long)ri0.graph_replays);
  if (a->timing && (s = print_tp_timing(g, a->tp, steps, "decode", &e)) != M3_OK) {
    rc = cli_fail("run", s, &e);
    goto out;
  }
  if (a->dump) rc = dump_logits(a->dump, logits, a->max_new, a->batch, V);
out:
  m3_tp_close(g);
  free(prompts);
  free(gen);
  free(next);
  free(in);
  free(seqs);
  free(logits);
  return rc;
}

int cmd_run(int argc, char **argv) {
  static const struct option opts[] = {
      {"model", required_argument, 0, 'm'},          {"preset", required_argument, 0, 'p'},
      {"prompt-ids", required_argument, 0, 'i'},     {"context", required_argument, 0, 'c'},
      {"max-new-tokens", required_argument, 0, 'n'}, {"batch", required_argument, 0, 'b'},
      {"kv-dtype", required_argument, 0, 'k'},       {"index-dtype", required_argument, 0, 'x'},
      {"resident-experts", required_argument, 0, 'r'}, {"dump-logits", required_argument, 0, 'd'},
      {"seed", required_argument, 0, 's'},           {"temperature", required_argument, 0, 'T'},
      {"top-p", required_argument, 0, 'P'},          {"chunk", required_argument, 0, 'C'},
      {"no-graph", no_argument, 0, 'G'},             {"timing", no_argument, 0, 't'},
      {"weights", required_argument, 0, 'w'},        {"arch", required_argument, 0, 'A'},
      {"synthetic-cache", no_argument, 0, 'S'},      {"graph-breakdown", no_argument, 0, 'B'},
      {"tp", required_argument, 0, 'X'},             {"tp-backend", required_argument, 0, 'Y'},
      {"help", no_argument, 0, 'h'},                 {0, 0, 0, 0}};
  const char *model = NULL, *preset = NULL, *ids_text = NULL, *dump = NULL, *arch = "sm_90";
  int64_t context = 32;
  int max_new = 16, batch = 1, kv8 = 0, ix8 = 0, resident = 0, chunk = 256, graph = 1, timing = 0, weights = -1, c;
  int synth_cache = 0, breakdown = 0, context_set = 0, tp = 0, tp_backend = -1;
  uint64_t seed = 0;
  float temperature = 0.0f, top_p = 1.0f;
  int64_t iv;
  double fv;
  optind = 1;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
      case 'm':
        if (cli_path("run", "model", optarg)) return 2;
        model = optarg;
        break;
      case 'p': preset = optarg; break;
      case 'i': ids_text = optarg; break;
      case 'c': if (cli_int("run", "context", optarg, 1, 1 << 20, &iv)) return 2; context = iv; context_set = 1; break;
      case 'n': if (cli_int("run", "max-new-tokens", optarg, 1, 1 << 20, &iv)) return 2; max_new = (int)iv; break;
      case 'b': if (cli_int("run", "batch", optarg, 1, 4096, &iv)) return 2; batch = (int)iv; break;
      case 'k': case 'x': {
        int v = !strcmp(optarg, "e4m3") ? 1 : !strcmp(optarg, "bf16") ? 0 : -1;
        if (v < 0) { fprintf(stderr, "m3kit run: --%s takes bf16 or e4m3\n", c == 'k' ? "kv-dtype" : "index-dtype"); return 2; }
        if (c == 'k') kv8 = v; else ix8 = v;
        break;
      }
      case 'w':
        weights = !strcmp(optarg, "mxfp8") ? 1 : !strcmp(optarg, "bf16") ? 0 : -2;
        if (weights == -2) { fprintf(stderr, "m3kit run: --weights takes bf16 or mxfp8\n"); return 2; }
        break;
      case 'r': if (cli_int("run", "resident-experts", optarg, 1, 1 << 16, &iv)) return 2; resident = (int)iv; break;
      case 'd': dump = optarg; break;
      case 's': if (cli_u64("run", "seed", optarg, &seed)) return 2; break;
      case 'T': if (cli_float("run", "temperature", optarg, 0, 1e4, &fv)) return 2; temperature = (float)fv; break;
      case 'P': if (cli_float("run", "top-p", optarg, 1e-6, 1, &fv)) return 2; top_p = (float)fv; break;
      case 'C': if (cli_int("run", "chunk", optarg, 1, 1 << 20, &iv)) return 2; chunk = (int)iv; break;
      case 'G': graph = 0; break;
      case 't': timing = 1; break;
      case 'A': arch = optarg; break;
      case 'S': synth_cache = 1; break;
      case 'B': breakdown = 1; break;
      case 'X': if (cli_int("run", "tp", optarg, 1, M3_TP_COMM_MAX, &iv)) return 2; tp = (int)iv; break;
      case 'Y':
        tp_backend = !strcmp(optarg, "nccl") ? M3_TP_NCCL : !strcmp(optarg, "local") ? M3_TP_LOCAL : -2;
        if (tp_backend == -2) { fprintf(stderr, "m3kit run: --tp-backend takes nccl or local\n"); return 2; }
        break;
      case 'h': help(); return 0;
      default: help(); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "m3kit run: unexpected argument '%s' (m3kit run --help)\n", argv[optind]);
    return 2;
  }
  if (model && preset) { fprintf(stderr, "m3kit run: give --model or --preset, not both\n"); return 2; }
  if (ids_text && context_set) {
    fprintf(stderr, "m3kit run: give --prompt-ids or --context, not both (the prompt's length is its context)\n");
    return 2;
  }
  if (model && (resident || weights >= 0)) {
    fprintf(stderr, "m3kit run: --resident-experts and --weights shape the synthetic weights of a --preset; a "
                    "--model checkpoint brings its own\n");
    return 2;
  }
  if (breakdown && (timing || !graph || max_new < 2)) {
    fprintf(stderr, "m3kit run: --graph-breakdown needs graph-replayed decode steps: not with --timing or --no-graph, "
                    "and --max-new-tokens >= 2\n");
    return 2;
  }
  if (tp_backend >= 0 && !tp) { fprintf(stderr, "m3kit run: --tp-backend goes with --tp N\n"); return 2; }
  if (tp && breakdown) {
    /* It replays each op's launches of a step alone; a rank's collective
     * replayed alone waits for the other ranks, which would all have to
     * replay the same op together (not implemented). */
    fprintf(stderr, "m3kit run: --graph-breakdown is not available with --tp: it replays each op's launches alone, and "
                    "one rank's all-reduce replayed alone waits for the other ranks (they would have to replay the "
                    "same op together); --timing gives every rank's per-op event times instead\n");
    return 2;
  }
  if (!model && !preset) preset = "tiny";
  if (max_new < 1 || batch < 1 || context < 1 || chunk < 1) {
    fprintf(stderr, "m3kit run: --max-new-tokens, --batch, --context and --chunk must be >= 1\n");
    return 2;
  }
  /* Every option is checked before the no-GPU branch, so a typo is an error
   * on every machine. */
  int32_t *prompt1 = NULL;
  int plen = (int)context;
  if (ids_text && parse_ids(ids_text, &prompt1, &plen) != 0) {
    fprintf(stderr, "m3kit run: --prompt-ids wants comma-separated integers, got '%s'\n", ids_text);
    return 2;
  }
  {
    /* What the config bounds (ids, context, resident experts), checked here
     * too so that a machine without a GPU reports the same mistakes. */
    m3_config cc;
    m3_err ce = {0};
    m3_status cs = m3_config_for(preset, model, &cc, &ce);
    if (cs != M3_OK) {
      free(prompt1);
      return cli_fail("run", cs, &ce);
    }
    for (int i = 0; prompt1 && i < plen; i++)
      if (prompt1[i] < 0 || prompt1[i] >= cc.vocab_size) {
        fprintf(stderr, "m3kit run: --prompt-ids: token %d (position %d) is outside the vocabulary [0, %d)\n",
                prompt1[i], i, cc.vocab_size);
        free(prompt1);
        return 2;
      }
    if ((int64_t)plen + max_new > cc.max_position_embeddings) {
      fprintf(stderr, "m3kit run: a prompt of %d tokens + %d new ones exceeds max_position_embeddings %d\n", plen,
              max_new, cc.max_position_embeddings);
      free(prompt1);
      return 2;
    }
    if (resident && (resident > cc.num_local_experts || resident < cc.num_experts_per_tok)) {
      fprintf(stderr, "m3kit run: --resident-experts %d: must be in [num_experts_per_tok %d, num_local_experts %d] "
                    "(a token routes to top-k resident experts)\n", resident, cc.num_experts_per_tok,
              cc.num_local_experts);
      free(prompt1);
      return 2;
    }
    m3_tp_rank r0;
    if (tp && (cs = m3_tp_plan(&cc, tp, 0, &r0, &ce)) != M3_OK) { /* the cut names the config field */
      free(prompt1);
      fprintf(stderr, "m3kit run: --tp %d: %s\n", tp, ce.msg);
      return 2; /* a bad option for this model, as every other option check */
    }
  }
  char why[4400];
  if (dump && dump_writable(dump, why, sizeof why) != 0) { /* before the run, not after it; nothing touched */
    fprintf(stderr, "m3kit run: --dump-logits %s: cannot write it: %s\n", dump, why);
    free(prompt1);
    return 2;
  }
  if (m3_gpu_count() == 0) {
    free(prompt1);
    if (tp > 1) printf("m3kit run --tp %d: the ranks' kernel variants (their head counts and slices) are built when "
                       "they first run; the whole model's are compiled here.\n", tp);
    const int rc = compile_only(preset, model, arch);
    if (rc || !dump) return rc;
    /* The output asked for does not exist: a script must not read on as if it did. */
    fprintf(stderr, "m3kit run: no GPU, no logits: --dump-logits %s not written (exit status 3)\n", dump);
    return 3;
  }
  if (tp) {
    if (tp_backend < 0) { /* default: NCCL over distinct GPUs, which needs N of them */
      if (tp > 1 && m3_gpu_count() < tp) {
        fprintf(stderr, "m3kit run: --tp %d: NCCL puts each rank on its own GPU and this machine has %d; "
                        "--tp-backend local runs the %d ranks on the GPUs there are, taking turns (a check of the "
                        "tensor-parallel path, not a speedup)\n", tp, m3_gpu_count(), tp);
        free(prompt1);
        return 2;
      }
      tp_backend = M3_TP_NCCL;
    }
    run_args ra = {.model = model, .preset = preset, .prompt1 = prompt1, .plen = plen, .max_new = max_new,
                   .batch = batch, .kv8 = kv8, .ix8 = ix8, .resident = resident, .chunk = chunk, .graph = graph,
                   .weights = weights, .seed = seed, .temperature = temperature, .top_p = top_p, .dump = dump,
                   .tp = tp, .backend = tp_backend, .timing = timing, .synth_cache = synth_cache};
    int rc = run_tp(&ra);
    free(prompt1);
    return rc;
  }

  m3_err e = {0};
  m3_status s;
  m3_rt rt;
  if ((s = m3_rt_open(&rt, 0, &e)) != M3_OK) return cli_fail("run", s, &e);
  mem_watch mw = {0};
  watch(&mw);
  size_t free0 = mw.min_free;
  m3_model *m = NULL;
  m3_forward *f = NULL;
  m3_kv_cache kv = {0};
  int32_t *prompts = NULL, *gen = NULL, *next = NULL;
  float *logits = NULL;
  int *seqs = NULL, rc = 0;
  double t_load = now_s();
  m3_model_opts mo = {.dir = model, .preset = preset, .resident_experts = resident, .mxfp8 = weights, .seed = seed};
  if ((s = m3_model_load(&rt, &mo, &m, &e)) != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
  t_load = now_s() - t_load;
  watch(&mw);
  const m3_config *cfg = &m->cfg;
  const int V = cfg->vocab_size;
  printf("model: %s, %d layers (%d sparse), hidden %d, %.2f GB of weights, loaded in %.1f s\n", m->source,
         cfg->num_hidden_layers, m3_config_n_sparse_layers(cfg), cfg->hidden_size, m->weight_bytes / 1e9, t_load);

  prompts = malloc(sizeof *prompts * (size_t)batch * (size_t)plen);
  gen = malloc(sizeof *gen * (size_t)batch * (size_t)max_new);
  next = malloc(sizeof *next * (size_t)batch);
  seqs = malloc(sizeof *seqs * (size_t)batch);
  if (!prompts || !gen || !next || !seqs) { rc = cli_fail("run", m3_errf(&e, M3_NOMEM, "buffers"), &e); goto out; }
  fill_prompts(prompts, batch, plen, prompt1, V, seed);

  /* What fits beside these weights (issue "Performance" 8): one sequence,
   * the caches of each dtype pair and this run's activation reserve. */
  {
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    m3_fwd_opts f1 = m3_fwd_defaults();
    f1.max_chunk = chunk;
    printf("largest context that fits beside the weights (batch 1):");
    for (int d = 0; d < 2; d++) {
      m3_kv_opts k1 = {.kv_e4m3 = d, .idx_e4m3 = d, .max_seqs = 1, .max_ctx = 1, .host_only = 1};
      m3_kv_plan pl = {0};
      m3_err e1;
      int64_t fit = 0;
      if (m3_kv_plan_make(cfg, &k1, UINT64_MAX, &pl, &e1) == M3_OK && pl.bytes_per_token) {
        uint64_t res = m3_forward_activation_bytes(cfg, &f1, cfg->max_position_embeddings) + (512ull << 20);
        fit = fr > res ? (int64_t)((fr - res) / pl.bytes_per_token) : 0;
        fit = fit / pl.page_size * pl.page_size;
      }
      const int capped = fit > cfg->max_position_embeddings; /* the model's limit, not memory's */
      if (capped) fit = cfg->max_position_embeddings;
      printf("%s %" PRId64 " tokens%s with %s caches (%" PRIu64 " B/token)", d ? ";" : "", fit,
             capped ? " (max_position_embeddings)" : "", d ? "e4m3" : "bf16", pl.bytes_per_token);
    }
    printf("%s\n", "");
  }

  m3_fwd_opts fo = m3_fwd_defaults();
  fo.max_batch = batch;
  fo.max_chunk = chunk;
  fo.use_graph = graph;
  fo.timing = timing;
  const int64_t total = (int64_t)plen + max_new;
  m3_kv_opts ko = {.kv_e4m3 = kv8, .idx_e4m3 = ix8, .max_seqs = batch, .max_ctx = total,
                   .reserve_bytes = m3_forward_activation_bytes(cfg, &fo, total) + (512ull << 20)};
  if ((s = m3_kv_init(&kv, cfg, &ko, &e)) != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
  printf("KV cache: %" PRId64 " pages of %d tokens, %.2f GB (%" PRIu64 " B/token, KV %s, index-K %s)\n",
         kv.plan.num_pages, kv.plan.page_size, kv.plan.bytes / 1e9, kv.plan.bytes_per_token, kv8 ? "e4m3" : "bf16",
         ix8 ? "e4m3" : "bf16");
  if ((s = m3_forward_create(&rt, m, &kv, &fo, &f, &e)) != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
  {
    int64_t pf[3];
    const char *pv = getenv("M3KIT_L2_PREFETCH");
    m3_forward_l2_prefetch(f, total, pf);
    if (pf[0] || pf[1] || pf[2])
      printf("L2 prefetch in decode steps at this context: o_proj %.0f, ffn %.0f, qkv %.0f MiB (%s)\n", pf[0] / 1048576.0,
             pf[1] / 1048576.0, pf[2] / 1048576.0, pv && *pv ? "M3KIT_L2_PREFETCH" : "the default; M3KIT_L2_PREFETCH sets it");
    else
      printf("L2 prefetch in decode steps: off%s\n", pv && *pv ? " (M3KIT_L2_PREFETCH)" : " (the default on this SM)");
  }
  for (int b = 0; b < batch; b++)
    if ((s = m3_kv_admit(&kv, total, &seqs[b], &e)) != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
  if (dump && !(logits = malloc(sizeof *logits * (size_t)max_new * (size_t)batch * (size_t)V))) {
    rc = cli_fail("run", m3_errf(&e, M3_NOMEM, "logits for --dump-logits"), &e);
    goto out;
  }
  watch(&mw);

  m3_sampling smp = {temperature, top_p, seed, 0};
  double t0 = now_s();
  int pre = 0; /* prompt tokens whose cache entries are synthetic (not computed) */
  if (synth_cache && plen > 1) {
    if ((s = m3_kv_fill_synthetic(&rt, &kv, seqs, batch, plen - 1, seed, &e)) != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
    pre = plen - 1;
    printf("synthetic cache: %d tokens per sequence filled with random values (no prefill computed for them)\n", pre);
    t0 = now_s();
  }
  for (int b = 0; b < batch; b++) {
    smp.step = prefill_step(b);
    s = m3_forward_prefill(f, seqs[b], plen - pre, prompts + (size_t)b * plen + pre, &smp, &next[b],
                           logits ? logits + (size_t)b * V : NULL, &e);
    if (s != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
  }
  double ttft = now_s() - t0;
  for (int b = 0; b < batch; b++) gen[(size_t)b * max_new] = next[b];
  if (timing) {
    printf("\nprefill breakdown:\n");
    m3_forward_print_timing(f, stdout);
    m3_forward_reset_timing(f);
  }
  double t1 = now_s(), t_first = 0;
  for (int step = 1; step < max_new; step++) {
    /* The first decode step of a shape runs eagerly and captures its graph
     * (one-time work, tens of ms at 60 layers): timed apart from TPOT. */
    if (step == 2) t_first = now_s() - t1, t1 = now_s();
    smp.step = (uint64_t)step;
    int32_t in[batch];
    for (int b = 0; b < batch; b++) in[b] = next[b];
    s = m3_forward_decode(f, batch, seqs, in, &smp, next, logits ? logits + (size_t)step * batch * V : NULL, &e);
    if (s != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
    for (int b = 0; b < batch; b++) gen[(size_t)b * max_new + step] = next[b];
  }
  double tdec = now_s() - t1;
  watch(&mw);

  report_run(gen, batch, plen, max_new, pre, "", ttft, tdec, t_first,
             graph && !timing ? FIRST_STEP_GRAPH : FIRST_STEP_EAGER);
  printf("peak GPU memory in use %.2f GB (of %.2f GB; %.2f GB before loading)\n", (mw.total - mw.min_free) / 1e9,
         mw.total / 1e9, (mw.total - free0) / 1e9);
  printf("start-up: GPU open %.0f ms (driver, context, JIT, tuning DB); %d kernels, %d from the cubin cache and %d "
         "compiled, %.0f ms to build and %.0f ms to load\n",
         1e3 * rt.stats.open_s, rt.stats.cached + rt.stats.compiled, rt.stats.cached, rt.stats.compiled,
         1e3 * rt.stats.build_s, 1e3 * rt.stats.load_s);
  if (timing) {
    printf("\ndecode breakdown:\n");
    m3_forward_print_timing(f, stdout);
  }
  if (breakdown) {
    printf("\n");
    s = m3_forward_graph_breakdown(f, 20, stdout, &e);
    if (s != M3_OK) { rc = cli_fail("run", s, &e); goto out; }
  }
  if (dump) rc = dump_logits(dump, logits, max_new, batch, V);
out:
  m3_forward_free(f);
  m3_kv_free(&kv);
  m3_model_free(m);
  m3_rt_close(&rt);
  free(prompt1);
  free(prompts);
  free(gen);
  free(next);
  free(seqs);
  free(logits);
  return rc;
}
