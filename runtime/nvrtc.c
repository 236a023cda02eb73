/* nvrtc.c - NVRTC wrapper (see nvrtc.h).  Every NVRTC call is checked; the
 * program is always destroyed, also on the error paths. */
#include "runtime/nvrtc.h"

#include <nvrtc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gen/variant.h" /* m3_arch_valid: the one spelling check of an SM arch */

static long compile_count;

long m3_nvrtc_compile_count(void) { return __atomic_load_n(&compile_count, __ATOMIC_RELAXED); }

int m3_nvrtc_version(void) {
  int ma = 0, mi = 0;
  if (nvrtcVersion(&ma, &mi) != NVRTC_SUCCESS) return 0;
  return ma * 1000 + mi * 10;
}

void m3_nvrtc_options(const char *arch, char *buf, size_t n) {
  /* --fmad=true is NVRTC's default; spelled out so the key states it. */
  snprintf(buf, n, "--gpu-architecture=%s -std=c++17 -default-device --fmad=true -lineinfo", arch);
}

m3_status m3_nvrtc_arch_check(const char *arch, m3_err *e) {
  if (!m3_arch_valid(arch)) return m3_errf(e, M3_INVAL, "bad SM arch '%s' (want sm_XX, sm_XXa or sm_XXf)", arch);
  const int want = atoi(arch + 3);
  const char sfx = arch[strlen(arch) - 1];
  /* arch-specific (a) targets exist from sm_90, family (f) ones from sm_100 */
  if ((sfx == 'a' && want < 90) || (sfx == 'f' && want < 100))
    return m3_errf(e, M3_INVAL, "SM arch %s: there is no '%c' target below sm_%d (sm_90a, sm_100a, sm_100f, ...)",
                   arch, sfx, sfx == 'a' ? 90 : 100);
  int n = 0;
  nvrtcResult r = nvrtcGetNumSupportedArchs(&n);
  if (r != NVRTC_SUCCESS) return m3_errf(e, M3_NVRTC, "nvrtcGetNumSupportedArchs: %s", nvrtcGetErrorString(r));
  int *v = calloc(n > 0 ? (size_t)n : 1, sizeof *v);
  if (!v) return m3_errf(e, M3_NOMEM, "NVRTC's supported archs");
  if ((r = nvrtcGetSupportedArchs(v)) != NVRTC_SUCCESS) {
    free(v);
    return m3_errf(e, M3_NVRTC, "nvrtcGetSupportedArchs: %s", nvrtcGetErrorString(r));
  }
  int found = 0;
  for (int i = 0; i < n; i++) found |= v[i] == want;
  const int lo = n > 0 ? v[0] : 0, hi = n > 0 ? v[n - 1] : 0;
  free(v);
  if (found) return M3_OK;
  const int ver = m3_nvrtc_version();
  return m3_errf(e, M3_INVAL, "SM arch %s: NVRTC %d.%d does not compile for it (it knows sm_%d ... sm_%d)", arch,
                 ver / 1000, ver % 1000 / 10, lo, hi);
}

m3_status m3_nvrtc_compile(const char *src, const char *name, const char *arch, const char *extra,
                           uint8_t **cubin, size_t *size, char **log, m3_err *e) {
  *cubin = NULL;
  *size = 0;
  if (log) *log = NULL;
  if (!m3_arch_valid(arch)) return m3_errf(e, M3_INVAL, "bad SM arch '%s' (want sm_XX, sm_XXa or sm_XXf)", arch);
  char opts[512];
  m3_nvrtc_options(arch, opts, sizeof opts);
  if (extra && *extra) {
    size_t l = strlen(opts);
    snprintf(opts + l, sizeof opts - l, " %s", extra);
  }
  /* Split into argv (options contain no quoted spaces). */
  char copy[512];
  snprintf(copy, sizeof copy, "%s", opts);
  const char *argv[16];
  int argc = 0;
  for (char *tok = strtok(copy, " "); tok && argc < 16; tok = strtok(NULL, " ")) argv[argc++] = tok;

  nvrtcProgram prog;
  nvrtcResult r = nvrtcCreateProgram(&prog, src, name, 0, NULL, NULL);
  if (r != NVRTC_SUCCESS)
    return m3_errf(e, M3_NVRTC, "nvrtcCreateProgram(%s): %s", name, nvrtcGetErrorString(r));
  __atomic_fetch_add(&compile_count, 1, __ATOMIC_RELAXED);
  nvrtcResult cr = nvrtcCompileProgram(prog, argc, argv);
  size_t ls = 0;
  char *lg = NULL;
  if (nvrtcGetProgramLogSize(prog, &ls) == NVRTC_SUCCESS && ls > 1) {
    lg = malloc(ls);
    if (lg && nvrtcGetProgramLog(prog, lg) != NVRTC_SUCCESS) lg[0] = 0;
  }
  m3_status st = M3_OK;
  if (cr != NVRTC_SUCCESS) {
    st = m3_errf(e, M3_NVRTC, "NVRTC failed to compile %s for %s: %s\n%s", name, arch,
                 nvrtcGetErrorString(cr), lg ? lg : "(no log)");
  } else {
    size_t n = 0;
    r = nvrtcGetCUBINSize(prog, &n);
    if (r != NVRTC_SUCCESS || n == 0) {
      st = m3_errf(e, M3_NVRTC, "nvrtcGetCUBINSize(%s, %s): %s (size %zu)", name, arch,
                   nvrtcGetErrorString(r), n);
    } else {
      uint8_t *buf = malloc(n);
      if (!buf) st = m3_errf(e, M3_NOMEM, "cubin of %zu bytes", n);
      else if ((r = nvrtcGetCUBIN(prog, (char *)buf)) != NVRTC_SUCCESS) {
        free(buf);
        st = m3_errf(e, M3_NVRTC, "nvrtcGetCUBIN(%s): %s", name, nvrtcGetErrorString(r));
      } else {
        *cubin = buf;
        *size = n;
      }
    }
  }
  nvrtcDestroyProgram(&prog);
  if (log) *log = lg;
  else free(lg);
  return st;
}
