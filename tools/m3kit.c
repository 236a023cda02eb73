/* m3kit.c - the CLI entry: subcommand table, --help, and the only place where
 * an m3_status becomes an exit code. */
#include <stdio.h>
#include <string.h>

#include "include/m3kit.h"

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "--help")) {
    printf("usage: m3kit <gen|tune|run|bench> [options]\n");
    return argc < 2 ? 2 : 0;
  }
  return 2;
}
