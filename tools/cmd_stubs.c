/* cmd_stubs.c - subcommands not built yet say so plainly (NOT_YET(cmd_x, "x")).
 * run and make-checkpoint live in cmd_run.c and cmd_make_checkpoint.c. */
#include <stdio.h>

#include "tools/cli.h"

#define NOT_YET(fn, name)                                                      \
  int fn(int argc, char **argv) {                                              \
    (void)argc; (void)argv;                                                    \
    fprintf(stderr, "m3kit " name ": not implemented in this build\n");        \
    return 2;                                                                  \
  }
