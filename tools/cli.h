/* cli.h - shared pieces of the m3kit subcommands. */
#ifndef M3_CLI_H
#define M3_CLI_H

#include "runtime/status.h"

int cmd_gen(int argc, char **argv);
int cmd_run(int argc, char **argv);
int cmd_tune(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_make_checkpoint(int argc, char **argv);
int cmd_tp_plan(int argc, char **argv);

#include <stddef.h>
#include <stdint.h>

/* Strict option values: the whole text must be a number in [lo, hi]
 * (integers: decimal; floats: finite).  On failure print
 * "m3kit CMD: --OPT wants ..., got 'TEXT'" to stderr and return -1. */
int cli_int(const char *cmd, const char *opt, const char *text, int64_t lo, int64_t hi, int64_t *out);
int cli_u64(const char *cmd, const char *opt, const char *text, uint64_t *out);
int cli_float(const char *cmd, const char *opt, const char *text, double lo, double hi, double *out);

/* A path option: -1 (after "m3kit CMD: --OPT: an empty path" on stderr) when
 * text is empty, which would otherwise be read as the root directory. */
int cli_path(const char *cmd, const char *opt, const char *text);

/* The command line as typed, "m3kit CMD ARG...", into buf (truncated to n):
 * argv[0] is "m3kit CMD" (m3kit.c names it so for getopt's messages).  For
 * the provenance of a tuning record and the header of a bench report. */
void cli_cmdline(int argc, char **argv, char *buf, size_t n);

/* Print "m3kit: error: <M3_NAME>: <message>" and return the exit code for s. */
int cli_fail(const char *cmd, m3_status s, const m3_err *e);

#endif
