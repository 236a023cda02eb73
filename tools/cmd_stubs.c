/* cmd_stubs.c - subcommands not built yet say so plainly. */
#include <stdio.h>

#include "tools/cli.h"

#define NOT_YET(fn, name)                                                      \
  int fn(int argc, char **argv) {                                              \
    (void)argc; (void)argv;                                                    \
    fprintf(stderr, "m3kit " name ": not implemented in this build\n");        \
    return 2;                                                                  \
  }
NOT_YET(cmd_run, "run")
NOT_YET(cmd_make_checkpoint, "make-checkpoint")
