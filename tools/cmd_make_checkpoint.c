/* cmd_make_checkpoint.c - `m3kit make-checkpoint`: write a random,
 * deterministic checkpoint in the released layout (m3_ckpt_write), so every
 * loader path and `m3kit run --model DIR` can be exercised without the real
 * 444 GB download.  Needs no GPU. */
#include <dirent.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "runtime/ckpt_names.h"
#include "runtime/ckpt_write.h"
#include "runtime/config.h"
#include "tools/cli.h"

static void help(void) {
  printf(
      "usage: m3kit make-checkpoint (--preset NAME | --config FILE) --out DIR [options]\n\n"
      "Write a random M3 checkpoint: DIR/config.json (VL wrapper form), N safetensors shards and\n"
      "model.safetensors.index.json, tensor names and shapes exactly as the released checkpoints.\n"
      "Weights ~ N(0, 0.02), deterministic in (seed, tensor name): a bf16 and an --mxfp8 checkpoint of\n"
      "one seed hold the same weights up to quantisation.\n\n"
      "  --preset NAME     embedded config (");
  for (const char *const *p = m3_config_preset_names(); *p; p++) printf("%s%s", p == m3_config_preset_names() ? "" : ", ", *p);
  printf(
      ")\n"
      "  --config FILE     a config.json (VL wrapper or bare text config)\n"
      "  --out DIR         output directory (created)\n"
      "  --shards N        number of safetensors files (default 1; one shard is built in memory at a time,\n"
      "                    so choose N so that size/N fits in host memory)\n"
      "  --mxfp8           MXFP8 linears (e4m3 + E8M0 per 32 inputs, spec §8) instead of bf16\n"
      "  --seed S          generator seed (default 0)\n"
      "  --help\n");
}

int cmd_make_checkpoint(int argc, char **argv) {
  static const struct option opts[] = {{"preset", required_argument, 0, 'p'}, {"config", required_argument, 0, 'c'},
                                       {"out", required_argument, 0, 'o'},    {"shards", required_argument, 0, 'n'},
                                       {"mxfp8", no_argument, 0, 'q'},        {"seed", required_argument, 0, 's'},
                                       {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
  const char *preset = NULL, *config = NULL, *out = NULL;
  int shards = 1, mxfp8 = 0, c;
  uint64_t seed = 0;
  optind = 1;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
      case 'p': preset = optarg; break;
      case 'c': config = optarg; break;
      case 'o': out = optarg; break;
      case 'n': {
        int64_t v;
        if (cli_int("make-checkpoint", "shards", optarg, 1, 100000, &v)) return 2;
        shards = (int)v;
        break;
      }
      case 'q': mxfp8 = 1; break;
      case 's': if (cli_u64("make-checkpoint", "seed", optarg, &seed)) return 2; break;
      case 'h': help(); return 0;
      default: help(); return 2;
    }
  }
  if (!out || (!preset) == (!config) || optind < argc) {
    fprintf(stderr, "m3kit make-checkpoint: give --out DIR and exactly one of --preset / --config%s%s\n",
            optind < argc ? "; unexpected argument " : "", optind < argc ? argv[optind] : "");
    return 2;
  }
  struct stat ost;
  if (!*out || (stat(out, &ost) == 0 && !S_ISDIR(ost.st_mode))) {
    fprintf(stderr, "m3kit make-checkpoint: --out '%s': %s\n", out,
            *out ? "exists and is not a directory" : "an empty path");
    return 2;
  }
  /* Shards of an earlier checkpoint left beside a new index would be read as
   * stray files (or, worse, as this one): refuse a directory that has any.
   * A config.json there is refused too: it would be replaced, and it may be
   * the user's only copy (even the --config given). */
  DIR *d = opendir(out);
  if (d) {
    struct dirent *de;
    const char *old = NULL;
    while ((de = readdir(d)) && !old) {
      size_t n = strlen(de->d_name);
      if ((n > 12 && !strcmp(de->d_name + n - 12, ".safetensors")) || !strcmp(de->d_name, "model.safetensors.index.json") ||
          !strcmp(de->d_name, "config.json"))
        old = de->d_name;
    }
    if (old) {
      fprintf(stderr, "m3kit make-checkpoint: %s already holds %s (%s), which this would replace: choose a new --out\n",
              out, strcmp(old, "config.json") ? "a checkpoint" : "a model config", old);
      closedir(d);
      return 2;
    }
    closedir(d);
  }
  m3_err e = {0};
  m3_config cfg;
  m3_status s = config ? m3_config_load_file(config, &cfg, &e) : m3_config_preset(preset, &cfg, &e);
  if (s != M3_OK) return cli_fail("make-checkpoint", s, &e);
  m3_tensor_spec *specs;   /* a shard holds at least one weight: check --shards before "writing" */
  size_t nspec;
  if ((s = m3_ckpt_expected(&cfg, &specs, &nspec, &e)) != M3_OK) return cli_fail("make-checkpoint", s, &e);
  free(specs);
  if ((size_t)shards > nspec) {
    fprintf(stderr, "m3kit make-checkpoint: --shards %d: this model has %zu weights, so at most %zu shards\n", shards,
            nspec, nspec);
    return 2;
  }
  uint64_t total = 0;
  m3_config_n_params(&cfg, &total, NULL);
  double gb = (double)total * (mxfp8 ? 1.0 + 1.0 / 32 : 2.0) / 1e9;
  printf("writing %s: %d layers, %" PRIu64 " parameters (~%.2f GB %s) in %d shard%s, seed %" PRIu64 "\n", out,
         cfg.num_hidden_layers, total, gb, mxfp8 ? "MXFP8" : "bf16", shards, shards == 1 ? "" : "s", seed);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  s = m3_ckpt_write(&cfg, out, shards, mxfp8, seed, &e);
  if (s != M3_OK) return cli_fail("make-checkpoint", s, &e);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("done in %.1f s\n", (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
  return 0;
}
