/* m3kit.c - the CLI entry: the subcommand table, --help, and the only place
 * where an m3_status becomes an exit code (cli_fail). */
#include <stdio.h>
#include <string.h>

#include "runtime/op_ffn.h"
#include "runtime/op_prefetch.h"
#include "include/m3kit.h"
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include "tools/cli.h"

typedef struct {
  const char *name;
  int (*fn)(int, char **);
  const char *help;
} command;

static const command commands[] = {
    {"gen", cmd_gen, "list, emit, compile and inspect kernel variants (no GPU needed)"},
    {"run", cmd_run, "JIT-compile the kernels and run the model (default: embedded tiny M3)"},
    {"tune", cmd_tune, "autotune every kernel on this GPU into the tuning DB (once per GPU)"},
    {"bench", cmd_bench, "roofline benchmarks of every kernel against measured ceilings"},
    {"make-checkpoint", cmd_make_checkpoint, "write a random safetensors checkpoint for a config"},
    {"tp-plan", cmd_tp_plan, "how the model is cut across N GPUs (heads, experts, memory per rank)"},
};

int cli_fail(const char *cmd, m3_status s, const m3_err *e) {
  fprintf(stderr, "m3kit %s: error: %s: %s\n", cmd, m3_status_name(s),
          e && e->msg[0] ? e->msg : m3_strerror(s));
  return s == M3_NOGPU ? 3 : 1;
}

static void usage(FILE *f) {
  fprintf(f,
          "m3kit " M3KIT_VERSION " - generate, JIT-compile, autotune and run MiniMax-M3 CUDA kernels\n\n"
          "usage: m3kit <command> [options]     (m3kit <command> --help for its options)\n\n"
          "commands:\n");
  for (size_t i = 0; i < sizeof commands / sizeof *commands; i++)
    fprintf(f, "  %-16s %s\n", commands[i].name, commands[i].help);
  fprintf(f,
          "\nenvironment:\n"
          "  M3KIT_CACHE_DIR      cubin cache + tuning DB root (default $XDG_CACHE_HOME/m3kit or ~/.cache/m3kit)\n"
          "  M3KIT_NO_JIT=1       a cubin-cache miss is an error naming the key\n"
          "  M3KIT_TEMPLATE_DIR   read templates from this directory instead of the embedded copies\n"
          "  M3KIT_DUMP_DIR       write every source compiled (a cache miss), its options and NVRTC log here\n"
          "  M3KIT_VERBOSE=1      progress and cache messages\n"
          "  M3KIT_SEED_DB        seed tuning DB read under the user's (default: the installed cache/seed/<arch>.json)\n"
          "  M3KIT_PDL=0          launch without programmatic dependent launch (on by default on sm_90+)\n"
          "  M3KIT_CHECK_NUMERICS=1  scan every op's output for NaN/Inf, naming the first layer and op\n"
          "  M3KIT_MOE_FUSE       comma list of combine, act, route, norm (all = combine,act; none): MoE decode fusions;\n"
          "                       norm: the combine inside the next add+norm, not with combine (default none)\n"
          "  M3KIT_L2_PREFETCH    MiB of the next GEMV's weights a decode step's branch sends toward L2: three\n"
          "                       values o_proj,ffn,qkv (or one for all three), each 0-256, at every context; 0 = off;\n"
          "                       unset: on sm_90+ o_proj 24 up to 320K tokens of context, ffn 16, qkv 0; else off\n"
          "  M3KIT_TUNE_PIN_SLACK how much slower than its own pick `m3kit tune` keeps a pinned tile (default 0.03)\n"
          "  M3KIT_NCCL_LIB       the NCCL library --tp loads (tried first; then libnccl.so.2, then the toolkit's)\n"
          "(README.md lists the ones for tests: M3KIT_SEED, M3KIT_SMALL)\n"
          "\nexit status: 0 done, 1 error, 2 bad option or argument, 3 no CUDA GPU for what needs one (tune, bench;\n"
          "run without a GPU compiles the kernels instead and exits 0)\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
    usage(stdout);
    return 0;
  }
  if (!strcmp(argv[1], "--version")) {
    printf("m3kit %s\n", M3KIT_VERSION);
    return 0;
  }
  /* The fusions change which kernels the model needs (gen --list, tune):
   * a bad M3KIT_MOE_FUSE stops every command, not only run. */
  unsigned fuse;
  m3_err fe;
  if (m3_moe_fuse_env(&fuse, &fe) != M3_OK) {
    fprintf(stderr, "m3kit: %s\n", fe.msg);
    return 2;
  }
  /* Read when a forward is created, after the model has loaded: a typo
   * should not cost the load, nor pass unseen where no GPU runs it. */
  int64_t pf[M3_PF_PHASES];
  int pf_dflt;
  if (m3_prefetch_parse(getenv("M3KIT_L2_PREFETCH"), pf, &pf_dflt, &fe) != M3_OK) {
    fprintf(stderr, "m3kit: %s\n", fe.msg);
    return 2;
  }
  for (size_t i = 0; i < sizeof commands / sizeof *commands; i++)
    if (!strcmp(argv[1], commands[i].name)) {
      /* getopt names argv[0] in its errors: "m3kit tune: unrecognized option". */
      static char prog[64];
      snprintf(prog, sizeof prog, "m3kit %s", commands[i].name);
      argv[1] = prog;
      return commands[i].fn(argc - 1, argv + 1);
    }
  fprintf(stderr, "m3kit: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}

void cli_cmdline(int argc, char **argv, char *buf, size_t n) {
  size_t l = 0;
  buf[0] = 0;
  for (int i = 0; i < argc && l < n; i++) l += (size_t)snprintf(buf + l, n - l, "%s%s", i ? " " : "", argv[i]);
}

int cli_path(const char *cmd, const char *opt, const char *text) {
  if (*text) return 0;
  fprintf(stderr, "m3kit %s: --%s: an empty path\n", cmd, opt);
  return -1;
}

int cli_int(const char *cmd, const char *opt, const char *text, int64_t lo, int64_t hi, int64_t *out) {
  char *end;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (!*text || *end || errno == ERANGE || v < lo || v > hi) {
    fprintf(stderr, "m3kit %s: --%s wants an integer in [%" PRId64 ", %" PRId64 "], got '%s'\n", cmd, opt, lo, hi,
            text);
    return -1;
  }
  *out = v;
  return 0;
}

int cli_u64(const char *cmd, const char *opt, const char *text, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(text, &end, 0);
  if (!*text || *end || errno == ERANGE || text[0] == '-') {
    fprintf(stderr, "m3kit %s: --%s wants a non-negative integer (decimal or 0x hex), got '%s'\n", cmd, opt, text);
    return -1;
  }
  *out = v;
  return 0;
}

int cli_float(const char *cmd, const char *opt, const char *text, double lo, double hi, double *out) {
  char *end;
  errno = 0;
  double v = strtod(text, &end);
  if (!*text || *end || errno == ERANGE || !isfinite(v) || v < lo || v > hi) {
    fprintf(stderr, "m3kit %s: --%s wants a number in [%g, %g], got '%s'\n", cmd, opt, lo, hi, text);
    return -1;
  }
  *out = v;
  return 0;
}
