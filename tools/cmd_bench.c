/* cmd_bench.c - `m3kit bench`: every kernel against the ceilings measured in
 * the same run (device-to-device copy; cuBLAS bf16 GEMM), written as a
 * markdown report (standard output, or --out FILE) with, per row, the command,
 * the shape, median/p20/p80, the bytes or FLOPs counted and the fraction of
 * the ceiling.  Kernel families contribute through bench functions that share
 * the tests' case tables and the tuner's adapters. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/tune.h"
#include "cache/tunedb.h"
#include "runtime/bench.h"
#include "runtime/harness.h"
#include "tools/cli.h"
#include "bench/cases_attention.h"
#include "runtime/config.h"
#include "bench/cases_ffn.h"
#include "bench/cases_indexer.h"
#include "bench/cases_insert.h"

static void help(void) {
  printf("usage: m3kit bench [--out FILE] [--only LIST] [--preset NAME]\n\n"
         "Measures the copy ceiling (and, for the attention family, the cuBLAS bf16 GEMM ceiling),\n"
         "then every kernel family's benchmark cases (median/p20/p80 of event-timed launches over\n"
         "rotating buffers larger than L2), and writes a markdown report with each row's share of\n"
         "the ceiling.  The copy ceiling counts read + write; a kernel that mostly reads can pass 100%%.\n"
         "Tiles come from the tuning DB (m3kit tune), else the seed DB, else the defaults.\n"
         "  --out FILE     report path (default: standard output)\n"
         "  --only LIST    families, comma separated: qknorm_rope, insert, indexer, attention, ffn\n"
         "                 (the bench's own grouping; m3kit tune --help lists the kernel families)\n"
         "  --preset NAME  the config whose qknorm_rope variants are measured (default minimax-m3);\n"
         "                 the other families' cases are minimax-m3's shapes (bench/cases_*.c)\n"
         "Environment: M3KIT_BENCH_CASE=TEXT runs only the cases whose name contains TEXT (for a\n"
         "profiler; TEXT$ must end the name: \"tokens=1$\" leaves tokens=16 out); one that matches no\n"
         "case is an error (exit 1).  Case names: qknorm_rope\n"
         "\"AXES tokens=N\" (as in its table), insert \"insert bf16|e4m3 tokens=N\", indexer \"batch 1,\n"
         "131072 bf16\", attention and ffn the row's case text.\n");
}

/* qk-norm + RoPE (+ insert): every variant of the preset at the tuner's
 * token buckets, default (or tuned) tile. */
static m3_status bench_qknorm(m3_rt *rt, const m3_bench_ctx *bc, FILE *out, m3_err *e) {
  const m3_tune_op *op = m3_tune_op_find("qknorm_rope");
  m3_config cfg;
  M3_TRY(m3_config_preset(bc->preset, &cfg, e));
  m3_dims d;
  m3_model_dims(&cfg, &d);
  m3_variant *vs;
  int nv;
  M3_TRY(m3_render_variants(rt->jit.lua, "qknorm_rope", &d, &vs, &nv, e));
  fprintf(out, "\n## qk-norm + RoPE (+ KV / index-K insert)\n\nEvent-timed single launches, and per launch of a CUDA "
               "graph of 57 launches over the rotating sets (a decode step runs as a graph).\n\n"
               "| variant | tokens | tile | median us | p20 | p80 | graph us/launch | bytes | GB/s (graph) | %% of copy |\n"
               "|---|---|---|---|---|---|---|---|---|---|\n");
  m3_status s = M3_OK;
  for (int i = 0; i < nv && !s; i++) {
    snprintf(vs[i].arch, sizeof vs[i].arch, "%s", rt->dev.arch);
    m3_bucket bs[16];
    int nb = op->buckets(&cfg, &vs[i], bs, 16);
    char axes[M3_KEY_MAX];
    m3_variant_print_axes(&vs[i], axes, sizeof axes);
    for (int b = 0; b < nb && !s; b++) {
      char nm[M3_KEY_MAX + 32];   /* M3KIT_BENCH_CASE matches "AXES tokens=N" */
      snprintf(nm, sizeof nm, "%s tokens=%lld", axes, (long long)m3_bucket_get(&bs[b], "tokens"));
      if (!m3_bench_case_wanted(nm)) continue;
      void *st;
      m3_kernel *k;
      if ((s = op->setup(rt, &cfg, &vs[i], &bs[b], 1, &st, e))) break;
      s = m3_rt_kernel(rt, &vs[i], &bs[b], &k, e);
      m3_tune_candidate c = {0};
      if (!s) s = m3_tune_time_kernel(rt, op, st, k, 5, 50, 0, NULL, &c, NULL, e);
      m3_timing g = {0};
      if (!s) s = m3_tune_graph_time(op, st, k, rt->stream, 57, 20, &g, e);
      if (!s) {
        double bytes = op->work(st), gbs = bytes / (g.median_us * 1e-6) / 1e9;
        char tile[128];
        m3_variant_print_tile(&k->key, tile, sizeof tile);
        fprintf(out, "| `%s` | %lld | %s | %.2f | %.2f | %.2f | %.2f | %.3g | %.0f | %.1f%% |\n", axes,
                (long long)m3_bucket_get(&bs[b], "tokens"), tile, c.median_us, c.p20_us, c.p80_us, g.median_us, bytes, gbs,
                100 * gbs / bc->copy_gbs);
        fflush(out);
      }
      op->teardown(st);
    }
  }
  free(vs);
  return s;
}

/* Every family reports against the ceilings measured in this run (bc). */
/* The indexer and attention cases print their own section headings. */
static m3_status bench_indexer(m3_rt *rt, const m3_bench_ctx *bc, FILE *out, m3_err *e) {
  return m3_bench_indexer(rt, bc->copy_gbs, out, e);
}
static m3_status bench_attention(m3_rt *rt, const m3_bench_ctx *bc, FILE *out, m3_err *e) {
  return m3_bench_attention(rt, bc->copy_gbs, bc->gemm_tflops, out, e);
}
/* The ffn cases write aligned text lines (which bench/gemv_ablate.sh parses),
 * so they go in a code block: markdown would join them into one paragraph. */
static m3_status bench_ffn(m3_rt *rt, const m3_bench_ctx *bc, FILE *out, m3_err *e) {
  fprintf(out, "\n## Norms, MoE, MXFP8 and bf16 GEMV\n\n```\n");
  m3_status s = m3_bench_ffn(rt, bc->copy_gbs, out, e);
  fprintf(out, "```\n");
  return s;
}

static m3_status bench_insert(m3_rt *rt, const m3_bench_ctx *bc, FILE *out, m3_err *e) {
  return m3_bench_insert(rt, bc->copy_gbs, out, e);
}

static const m3_bench_entry entries[] = {
    {"qknorm_rope", bench_qknorm},
    {"insert", bench_insert},
    {"indexer", bench_indexer},
    {"attention", bench_attention},
    {"ffn", bench_ffn},
};

int cmd_bench(int argc, char **argv) {
  static const struct option opts[] = {{"out", required_argument, 0, 'o'}, {"only", required_argument, 0, 'n'},
                                       {"preset", required_argument, 0, 'p'}, {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  const char *outp = NULL, *only = NULL, *preset = "minimax-m3";
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    if (c == 'o') outp = optarg;
    else if (c == 'n') only = optarg;
    else if (c == 'p') preset = optarg;
    else if (c == 'h') { help(); return 0; }
    else { help(); return 2; }
  }
  if (optind < argc) {
    fprintf(stderr, "m3kit bench: unexpected argument '%s' (m3kit bench --help)\n", argv[optind]);
    return 2;
  }
  {
    m3_config pc;
    m3_err pe;
    if (m3_config_preset(preset, &pc, &pe) != M3_OK) return cli_fail("bench", pe.code, &pe);
  }
  for (const char *p = only; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL) {
    size_t n = strcspn(p, ","), i = 0;
    while (i < sizeof entries / sizeof *entries && (strlen(entries[i].name) != n || strncmp(entries[i].name, p, n))) i++;
    if (i == sizeof entries / sizeof *entries) {
      fprintf(stderr, "m3kit bench: --only: no family '%.*s' (qknorm_rope, insert, indexer, attention, ffn)\n", (int)n, p);
      return 2;
    }
  }
  if (m3_gpu_count() == 0) {
    fprintf(stderr, "m3kit bench: no CUDA GPU on this machine: nothing was measured.\n");
    return 3;
  }
  m3_rt rt;
  m3_err e;
  m3_status s = m3_rt_open(&rt, 0, &e);
  if (s) return cli_fail("bench", s, &e);
  m3_bench_ctx bc = {.preset = preset};
  fprintf(stderr, "m3kit bench: measuring the copy ceiling (2 GiB device-to-device)...\n");
  if ((s = m3_measure_copy_gbs(&rt, &bc.copy_gbs, &e))) return cli_fail("bench", s, &e);
  bc.gemm_tflops = 0; /* only the attention's prefill rows are put against it */
  char gemm[160] = "not measured (no attention rows)";
  if (!only || m3_tune_name_in_list(only, "attention")) {
    fprintf(stderr, "m3kit bench: measuring the cuBLAS bf16 GEMM ceiling (8192^3)...\n");
    m3_err ge;
    if (m3_bench_gemm_ceiling(&rt, &bc.gemm_tflops, &ge) != M3_OK) {
      bc.gemm_tflops = 0; /* the prefill rows then print no share of it */
      snprintf(gemm, sizeof gemm, "failed (%.120s)", ge.msg);
      fprintf(stderr, "m3kit bench: the GEMM ceiling failed: %s\n", ge.msg);
    }
  }
  FILE *out = stdout;
  if (outp && !(out = fopen(outp, "w"))) {
    fprintf(stderr, "m3kit bench: cannot write %s\n", outp);
    return 1;
  }
  char cmd[1024];
  cli_cmdline(argc, argv, cmd, sizeof cmd);
  char date[40];
  m3_tunedb_now_iso(date, sizeof date);
  if (bc.gemm_tflops > 0) snprintf(gemm, sizeof gemm, "%.0f TFLOP/s", bc.gemm_tflops);
  fprintf(out, "# m3kit bench on %s (%s, %d SMs), %s\n\nCommand: `%s`\n\nCeilings measured in this run: "
               "device-to-device copy %.0f GB/s (read + write: a kernel that mostly reads can pass 100%%); "
               "cuBLAS bf16 GEMM 8192^3 %s.\n"
               "Times are CUDA-event medians (p20, p80) over rotating input sets larger than L2.\n",
          rt.dev.name, rt.dev.arch, rt.dev.sm_count, date, cmd, bc.copy_gbs, gemm);
  int rc = 0;
  for (size_t i = 0; i < sizeof entries / sizeof *entries; i++) {
    if (!entries[i].name || (only && !m3_tune_name_in_list(only, entries[i].name))) continue;
    fprintf(stderr, "m3kit bench: %s...\n", entries[i].name);
    if ((s = entries[i].fn(&rt, &bc, out, &e))) {
      fprintf(out, "\n**%s failed: %s**\n", entries[i].name, e.msg);
      rc = cli_fail("bench", s, &e);
    }
  }
  const char *filt = getenv("M3KIT_BENCH_CASE");
  if (filt && *filt && m3_bench_cases_matched() == 0) {
    fprintf(out, "\n**M3KIT_BENCH_CASE=\"%s\" matched no case: nothing was measured.**\n", filt);
    fprintf(stderr, "m3kit bench: M3KIT_BENCH_CASE=\"%s\" matched no case of %s: nothing was measured (m3kit bench --help)\n",
            filt, only ? only : "any family");
    if (!rc) rc = 1;
  }
  if (out != stdout) fclose(out);
  m3_rt_close(&rt);
  return rc;
}
