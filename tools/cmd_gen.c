/* cmd_gen.c - `m3kit gen`: list the variants a config needs, print a variant's
 * source, compile for a named arch and report cubin size, registers and spills,
 * list a variant's tiles with the valid() verdicts.  Needs no GPU. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cache/store.h"
#include "gen/code_hash.h"
#include "gen/render.h"
#include "runtime/jit.h"
#include "runtime/log.h"
#include "runtime/model_dims.h"
#include "runtime/nvrtc.h"
#include "tools/cli.h"

static void help(void) {
  printf(
      "usage: m3kit gen [options]\n\n"
      "  --list                 list every variant key the model needs (default action)\n"
      "  --templates            list the embedded templates with their axes and tile spaces\n"
      "  --emit KEY             print the generated CUDA source of KEY (default tile unless KEY has one),\n"
      "                         after a comment line with its code hash (docs/tuning-db.md)\n"
      "  --compile KEY          compile KEY and report its code hash, cubin size, registers, spills\n"
      "  --cubin FILE           with --compile: also write the cubin to FILE (for cuobjdump -sass)\n"
      "  --tiles KEY            list every tile of KEY with its valid() verdict and reason\n"
      "  --valid-only           with --tiles: list the valid tiles only (a GEMV key has ~54,000 tiles, ~1,100 valid)\n"
      "  --all                  render and compile every needed variant (default tiles) for --arch,\n"
      "                         through the cubin cache; with --every-tile, every valid tile too\n"
      "  --arch LIST            SM archs, comma separated (default sm_90), e.g. sm_80,sm_90a,sm_120\n"
      "  --preset NAME          model config preset (default minimax-m3); --model DIR reads DIR/config.json\n"
      "  -j, --jobs N           parallel NVRTC compilations for --all (default: all cores)\n"
      "  --help\n\n"
      "KEY is a variant key, e.g. 'qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=e4m3,nq=64,nkv=4,niq=4,hd=128,rot=64,bs=128)'\n"
      "optionally followed by a tile naming every tile axis, '[warps=4,hpw=1,lph=32,rope=pair]', and an arch '@sm_90'\n"
      "(--tiles KEY lists the tiles; an arch in KEY and --arch must agree).\n");
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

/* Registers/spills from a verbose ptxas pass (not cached: options differ). */
static void inspect(const m3_source *src, const char *arch) {
  uint8_t *cubin;
  size_t size;
  char *log = NULL;
  m3_err e;
  if (m3_nvrtc_compile(src->text, src->entry, arch, "--ptxas-options=-v", &cubin, &size, &log, &e) == M3_OK) {
    free(cubin);
    if (log) {
      for (char *l = strtok(log, "\n"); l; l = strtok(NULL, "\n")) {
        if (!strstr(l, "registers") && !strstr(l, "spill") && !strstr(l, "stack")) continue;
        /* NVRTC's lines start "ptxas info    : " or "ptxas         .     ": one prefix is enough */
        const char *m = l;
        if (!strncmp(m, "ptxas", 5)) {
          m += 5;
          m += strspn(m, " abcdefghijklmnopqrstuvwxyz");
          if (*m == ':' || *m == '.') m += 1 + strspn(m + 1, " ");
          else m = l;
        }
        printf("    ptxas: %s\n", m);
      }
    }
  }
  free(log);
}

/* arch_given: --arch was on the command line (else `arch` is the default). */
static int prepare(m3_jit *j, const char *text, const char *arch, int arch_given, m3_variant *v, m3_err *e,
                   int want_tile) {
  m3_status s = m3_render_parse_key(j->lua, text, v, e);
  if (s != M3_OK) return cli_fail("gen", s, e);
  if (v->arch[0] && arch_given && strcmp(v->arch, arch)) {
    fprintf(stderr, "m3kit gen: the key names @%s and --arch says %s: give the arch once\n", v->arch, arch);
    return 2;
  }
  if (!v->arch[0]) snprintf(v->arch, sizeof v->arch, "%s", arch);
  if (want_tile && !v->n_tile && (s = m3_render_default_tile(j->lua, v, e)) != M3_OK) return cli_fail("gen", s, e);
  return 0;
}

int cmd_gen(int argc, char **argv) {
  static const struct option opts[] = {
      {"list", no_argument, 0, 'l'},        {"templates", no_argument, 0, 'T'},
      {"emit", required_argument, 0, 'e'},  {"compile", required_argument, 0, 'c'},
      {"tiles", required_argument, 0, 't'}, {"all", no_argument, 0, 'a'},
      {"every-tile", no_argument, 0, 'E'},  {"arch", required_argument, 0, 'A'},
      {"valid-only", no_argument, 0, 'V'},
      {"preset", required_argument, 0, 'p'},{"model", required_argument, 0, 'm'},
      {"jobs", required_argument, 0, 'j'},  {"cubin", required_argument, 0, 'C'},
      {"help", no_argument, 0, 'h'},        {0, 0, 0, 0}};
  int action = 'l', chosen = 0, every = 0, valid_only = 0, arch_given = 0, c, jobs_n = (int)sysconf(_SC_NPROCESSORS_ONLN);
  const char *key = NULL, *archs = "sm_90", *preset = "minimax-m3", *model = NULL, *cubin_out = NULL;
  optind = 1;
  while ((c = getopt_long(argc, argv, "hj:", opts, NULL)) != -1) {
    switch (c) {
      case 'l': case 'T': case 'a': case 'e': case 'c': case 't':
        if (chosen && action != c) {
          fprintf(stderr, "m3kit gen: give one of --list, --templates, --emit, --compile, --tiles, --all\n");
          return 2;
        }
        action = c, chosen = 1;
        if (c == 'e' || c == 'c' || c == 't') key = optarg;
        break;
      case 'E': every = 1; break;
      case 'V': valid_only = 1; break;
      case 'C': cubin_out = optarg; break;
      case 'A': archs = optarg, arch_given = 1; break;
      case 'p': preset = optarg; break;
      case 'm':
        if (cli_path("gen", "model", optarg)) return 2;
        model = optarg;
        break;
      case 'j': {
        int64_t v;
        if (cli_int("gen", "jobs", optarg, 1, 256, &v)) return 2;
        jobs_n = (int)v;
        break;
      }
      case 'h': help(); return 0;
      default: help(); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "m3kit gen: unexpected argument '%s' (--help)\n", argv[optind]);
    return 2;
  }
  if (valid_only && action != 't') {
    fprintf(stderr, "m3kit gen: --valid-only goes with --tiles\n");
    return 2;
  }
  if (every && action != 'a') {
    fprintf(stderr, "m3kit gen: --every-tile goes with --all\n");
    return 2;
  }
  if (cubin_out && action != 'c') {
    fprintf(stderr, "m3kit gen: --cubin goes with --compile\n");
    return 2;
  }
  /* Every arch of the list is checked before any template runs. */
  int n_archs = 0;
  for (const char *ap = archs;; n_archs++) {
    char a[16];
    size_t l = strcspn(ap, ",");
    snprintf(a, sizeof a, "%.*s", (int)(l < sizeof a ? l : sizeof a - 1), ap);
    if (l >= sizeof a || !m3_arch_valid(a)) {
      fprintf(stderr, "m3kit gen: bad SM arch '%.*s' in --arch (want sm_XX, sm_XXa or sm_XXf, e.g. sm_90a)\n", (int)l, ap);
      return 2;
    }
    for (const char *q = archs; q < ap; q += strcspn(q, ",") + 1)   /* a repeat would build every kernel twice */
      if (strcspn(q, ",") == l && !strncmp(q, ap, l)) {
        fprintf(stderr, "m3kit gen: --arch names %s twice\n", a);
        return 2;
      }
    if (!ap[l]) break;
    ap += l + 1;
  }
  n_archs++;
  if (n_archs > 1 && (action == 'e' || action == 'c' || action == 't')) {
    fprintf(stderr, "m3kit gen: --emit, --compile and --tiles take one --arch (got %d); --all takes a list\n", n_archs);
    return 2;
  }
  m3_err e = {0};
  m3_jit j;
  m3_status s = m3_jit_open(&j, &e);
  if (s != M3_OK) return cli_fail("gen", s, &e);
  char arch[16];
  snprintf(arch, sizeof arch, "%.*s", (int)strcspn(archs, ","), archs);
  int rc = 0;

  if (action == 'T') {
    for (const char *const *t = m3_lua_template_names(); *t; t++) {
      m3_schema sc;
      if ((s = m3_render_schema(j.lua, *t, &sc, &e)) != M3_OK) { rc = cli_fail("gen", s, &e); break; }
      printf("%s  (template hash %016llx)\n  axes:", *t, (unsigned long long)sc.hash);
      for (int i = 0; i < sc.n_axes; i++) {
        printf(" %s=", sc.axes[i].name);
        if (sc.axes[i].is_int) printf("<int>");
        for (int k = 0; k < sc.axes[i].n_values; k++) printf("%s%s", k ? "|" : "", sc.axes[i].values[k]);
      }
      printf("\n  tiles:");
      for (int i = 0; i < sc.n_tiles; i++) {
        printf(" %s=", sc.tiles[i].name);
        for (int k = 0; k < sc.tiles[i].n_values; k++) printf("%s%s", k ? "|" : "", sc.tiles[i].values[k]);
      }
      printf("\n");
    }
  } else if (action == 'e' || action == 'c') {
    m3_variant v;
    if ((rc = prepare(&j, key, arch, arch_given, &v, &e, 1)) == 0) {
      m3_source src;
      if ((s = m3_render_source(j.lua, &v, &src, &e)) != M3_OK) rc = cli_fail("gen", s, &e);
      else if (action == 'e') { /* the code hash a tuning record of this tile would carry, then the source */
        char ct[M3_CODE_HASH_TEXT];
        m3_code_hash_text(m3_source_code_hash(&src), ct, sizeof ct);
        printf("// code hash %s (m3kit gen --emit; not part of the source)\n", ct);
        fputs(src.text, stdout);
      }
      else {
        double t0 = now_s();
        m3_cubin cb;
        if ((s = m3_jit_build(&j, &v, &cb, &e)) != M3_OK) rc = cli_fail("gen", s, &e);
        else {
          char k[M3_KEY_MAX];
          m3_variant_print(&v, k, sizeof k);
          char ct[M3_CODE_HASH_TEXT];
          m3_code_hash_text(m3_source_code_hash(&src), ct, sizeof ct);
          printf("%s\n  entry %s, %d threads, %d B dynamic smem, code hash %s, cubin %zu bytes (%s, %.2f s)\n", k,
                 cb.meta.entry, cb.meta.threads, cb.meta.smem, ct, cb.size, cb.hit ? "cache hit" : "compiled",
                 now_s() - t0);
          if (cubin_out && (s = m3_write_atomic(cubin_out, cb.data, cb.size, &e)) != M3_OK) rc = cli_fail("gen", s, &e);
          else if (cubin_out) printf("  wrote %s (cuobjdump -sass %s shows the machine code)\n", cubin_out, cubin_out);
          inspect(&src, v.arch);
          m3_cubin_free(&cb);
        }
      }
      m3_source_free(&src);
    }
  } else if (action == 't') {
    m3_variant v, *tiles = NULL;
    int n = 0;
    if ((rc = prepare(&j, key, arch, arch_given, &v, &e, 0)) == 0 && v.n_tile) {
      fprintf(stderr, "m3kit gen: --tiles lists every tile of a key: give KEY without [tile] (--compile KEY[tile] "
                      "checks one)\n");
      rc = 2;
    } else if (rc == 0) {
      if ((s = m3_render_tiles(j.lua, &v, &tiles, &n, &e)) != M3_OK) rc = cli_fail("gen", s, &e);
      m3_variant dv = v; /* the template's default, marked in the list */
      char deft[512] = "";
      m3_err de;
      if (m3_render_default_tile(j.lua, &dv, &de) == M3_OK) m3_variant_print_tile(&dv, deft, sizeof deft);
      /* A key no tile of which is valid for one and the same reason is wrong
       * in itself: say that once (and fail), not once a tile. */
      int nvalid = 0, same = 1;
      char first[512] = "";
      for (int i = 0; i < n && same; i++) {
        char why[512];
        m3_err ve;
        m3_status vs = m3_render_valid(j.lua, &tiles[i], why, sizeof why, &ve);
        if (vs != M3_OK && vs != M3_TILE) { /* valid() itself failed (a template error): not a verdict */
          rc = cli_fail("gen", vs, &ve);
          n = 0;
          break;
        }
        if (vs == M3_OK) nvalid++, same = 0;
        else if (!i) snprintf(first, sizeof first, "%s", why);
        else same = !strcmp(first, why);
      }
      if (n && !nvalid && same) {
        fprintf(stderr, "m3kit gen: %s: no tile of its %d is valid on %s: %s\n", key, n, v.arch, first);
        rc = 1;
        n = 0;
      }
      nvalid = 0;
      for (int i = 0; i < n; i++) {
        char t[512], why[512];
        m3_variant_print_tile(&tiles[i], t, sizeof t);
        m3_err ve;
        s = m3_render_valid(j.lua, &tiles[i], why, sizeof why, &ve);
        if (s != M3_OK && s != M3_TILE) {
          rc = cli_fail("gen", s, &ve);
          break;
        }
        nvalid += s == M3_OK;
        if (valid_only && s != M3_OK) continue;
        printf("  [%s]  %s%s%s%s\n", t, s == M3_OK ? "VALID" : "INVALID", s == M3_OK ? "" : ": ", s == M3_OK ? "" : why,
               strcmp(t, deft) ? "" : "  (default)");
      }
      if (n && !rc) printf("%d of %d tiles valid for %s\n", nvalid, n, v.arch);
      if (n && !rc && !nvalid) {
        fprintf(stderr, "m3kit gen: %s: no valid tile on %s\n", key, v.arch);
        rc = 1;
      }
      free(tiles);
    }
  } else { /* --list / --all */
    m3_dims d;
    if ((s = m3_model_dims_for(preset, model, &d, &e)) != M3_OK) {
      rc = cli_fail("gen", s, &e);
      goto out;
    }
    int total = 0, compiled = 0, hits = 0, invalid = 0, njobs = 0, capjobs = 0;
    m3_jit_job *jobs = NULL;
    double t0 = now_s();
    const char *ap = archs;
    while (*ap) {
      snprintf(arch, sizeof arch, "%.*s", (int)strcspn(ap, ","), ap);
      ap += strcspn(ap, ",");
      if (*ap == ',') ap++;
      for (const char *const *t = m3_lua_template_names(); *t && rc == 0; t++) {
        m3_variant *vs = NULL;
        int n = 0;
        if ((s = m3_render_variants(j.lua, *t, &d, &vs, &n, &e)) != M3_OK) { rc = cli_fail("gen", s, &e); break; }
        for (int i = 0; i < n && rc == 0; i++) {
          char k[M3_KEY_MAX];
          snprintf(vs[i].arch, sizeof vs[i].arch, "%s", arch);
          m3_variant_print_axes(&vs[i], k, sizeof k);
          if (action == 'l') {
            printf("%s\n", k);
            total++;
            continue;
          }
          m3_variant *tl = NULL;
          int nt = 0;
          if (every) {
            if ((s = m3_render_tiles(j.lua, &vs[i], &tl, &nt, &e)) != M3_OK) { rc = cli_fail("gen", s, &e); break; }
          } else {
            tl = malloc(sizeof *tl);
            tl[0] = vs[i];
            nt = 1;
            if ((s = m3_render_default_tile(j.lua, &tl[0], &e)) != M3_OK) { free(tl); rc = cli_fail("gen", s, &e); break; }
          }
          for (int q = 0; q < nt && rc == 0; q++) {
            m3_err ve;
            m3_status vs = m3_render_valid(j.lua, &tl[q], NULL, 0, &ve);
            if (vs == M3_TILE) { invalid++; continue; }
            if (vs != M3_OK) { rc = cli_fail("gen", vs, &ve); break; }
            if (njobs == capjobs) {
              capjobs = capjobs ? capjobs * 2 : 64;
              jobs = realloc(jobs, sizeof *jobs * (size_t)capjobs);
            }
            m3_jit_job *jb = &jobs[njobs];
            memset(jb, 0, sizeof *jb);
            jb->v = tl[q];
            if ((s = m3_render_source(j.lua, &tl[q], &jb->src, &e)) != M3_OK) { rc = cli_fail("gen", s, &e); break; }
            jb->rendered = 1;
            njobs++;
          }
          free(tl);
        }
        free(vs);
      }
    }
    if (rc == 0 && njobs) {
      m3_jit_build_many(&j, jobs, njobs, jobs_n, 120);
      for (int q = 0; q < njobs; q++) {
        char full[M3_KEY_MAX];
        m3_variant_print(&jobs[q].v, full, sizeof full);
        if (jobs[q].status != M3_OK) {
          fprintf(stderr, "m3kit gen: %s: %s\n", full, jobs[q].reason);
          rc = 1;
          continue;
        }
        total++;
        jobs[q].hit ? hits++ : compiled++;
        if (m3_log_verbose() || !every) printf("  ok  %-7s %6zu B  %s\n", jobs[q].hit ? "cached" : "built", jobs[q].size, full);
      }
      int timed_out = 0;
      for (int q = 0; q < njobs; q++) timed_out |= jobs[q].status == M3_TIMEOUT;
      if (!timed_out) {
        for (int q = 0; q < njobs; q++) m3_source_free(&jobs[q].src);
        free(jobs);
      }
    }
    if (rc) ;
    else if (action == 'l') fprintf(stderr, "%d variants\n", total); /* stdout: keys only, a line each */
    else
    {
      printf("%d kernels for %s: %d compiled, %d from the cubin cache, %d tiles rejected by valid(); %.1f s on %d threads\n",
             total, archs, compiled, hits, invalid, now_s() - t0, jobs_n);
      if (total == 0 && invalid > 0) {
        fprintf(stderr, "m3kit gen: no kernel of this model is valid for %s (see --tiles KEY for the reasons)\n", archs);
        rc = 1;
      }
    }
  }
out:
  m3_jit_close(&j);
  return rc;
}
