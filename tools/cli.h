/* cli.h - shared pieces of the m3kit subcommands. */
#ifndef M3_CLI_H
#define M3_CLI_H

#include "runtime/status.h"

int cmd_gen(int argc, char **argv);
int cmd_run(int argc, char **argv);
int cmd_tune(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_make_checkpoint(int argc, char **argv);

/* Print "m3kit: error: <M3_NAME>: <message>" and return the exit code for s. */
int cli_fail(const char *cmd, m3_status s, const m3_err *e);

#endif
