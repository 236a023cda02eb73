/* emu_driver.c - the emulator as m3kit's CUDA driver and JIT compiler (see
 * emu.h).  Images are shared objects built by g++; a "module" is a dlopen of
 * an image through a memfd; a kernel is its generated <entry>__emu trampoline,
 * which unpacks cuLaunchKernel's void** argument array with the parameter
 * types read from the kernel's own signature. */
#include <ctype.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <xxhash.h>

#include "emu/emu.h"
#include "runtime/cuda_driver.h"
#include "runtime/embedded.h"

#include "emu/emu_headers.inc" /* m3emu_headers[] */

/* -fno-weak: no COMDAT groups, so that the static __shared__ variables of an
 * inline function with external linkage can share the section m3emu_shared
 * with the others (g++: "section type conflict" otherwise); one translation
 * unit per image, so nothing else changes. */
#define EMU_GXX_FLAGS "-std=c++17 -O1 -fPIC -shared -fno-strict-aliasing -fno-weak"
/* The options text enters the cubin-cache key (runtime/jit.c): an image is
 * reused only by a build whose options text is the same.  The installed text
 * also carries a hash of the embedded headers (m3emu_install), so a header
 * change (the ABI an image is built against) never reuses an older image. */
#define EMU_OPTIONS "emu: g++ " EMU_GXX_FLAGS " -include m3emu.h"

/* static_smem: bytes of static __shared__ variables in the image (section
 * m3emu_shared, see m3emu.h). */
typedef struct emu_module { void *dl; size_t static_smem; } emu_module;

static CUresult e_cuInit(unsigned f) { (void)f; return CUDA_SUCCESS; }
static CUresult e_cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }
static CUresult e_cuDeviceGet(CUdevice *d, int o) { *d = o; return o == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE; }
static CUresult e_cuDeviceGetCount(int *n) { *n = 1; return CUDA_SUCCESS; }
static CUresult e_cuDeviceGetName(char *name, int len, CUdevice d) {
  (void)d;
  snprintf(name, (size_t)len, "m3kit CPU emulator");
  return CUDA_SUCCESS;
}
static CUresult e_cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d) {
  (void)d;
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 4; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *v = 1 << 20; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = 227 * 1024; break;
    default: *v = 0;
  }
  return CUDA_SUCCESS;
}
static CUresult e_cuDeviceTotalMem(size_t *b, CUdevice d) { (void)d; *b = (size_t)16 << 30; return CUDA_SUCCESS; }
static CUresult e_cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { (void)d; *c = (CUcontext)(uintptr_t)1; return CUDA_SUCCESS; }
static CUresult e_cuDevicePrimaryCtxRelease(CUdevice d) { (void)d; return CUDA_SUCCESS; }
static CUresult e_cuCtxSetCurrent(CUcontext c) { (void)c; return CUDA_SUCCESS; }
static CUresult e_cuCtxGetCurrent(CUcontext *c) { *c = (CUcontext)(uintptr_t)1; return CUDA_SUCCESS; }

static CUresult e_cuModuleLoadData(CUmodule *m, const void *image) {
  /* The image is a shared object: the first 8 bytes hold its length. */
  uint64_t len;
  memcpy(&len, image, 8);
  /* A fresh path per module: dlopen returns an already-loaded object for a
   * path it has seen, so /proc/self/fd/N (N reused) would alias modules. */
  static unsigned long seqno;
  char path[128];
  snprintf(path, sizeof path, "/tmp/m3emu-mod-%d-%lu.so", (int)getpid(), seqno++);
  FILE *mf = fopen(path, "wb");
  if (!mf) return CUDA_ERROR_OUT_OF_MEMORY;
  size_t wrote = fwrite((const unsigned char *)image + 8, 1, len, mf);
  if (fclose(mf) != 0 || wrote != len) {
    unlink(path);
    return CUDA_ERROR_INVALID_IMAGE;
  }
  void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  unlink(path);
  if (!dl) {
    fprintf(stderr, "m3emu: dlopen: %s\n", dlerror());
    return CUDA_ERROR_INVALID_IMAGE;
  }
  void (*bind)(const m3emu_api *) = (void (*)(const m3emu_api *))dlsym(dl, "m3emu_bind");
  if (!bind) {
    dlclose(dl);
    return CUDA_ERROR_INVALID_IMAGE;
  }
  size_t (*static_smem)(void) = (size_t(*)(void))dlsym(dl, "m3emu_static_smem");
  if (!static_smem) {
    m3emu_set_error("emulator: the image has no m3emu_static_smem (built against an older emulator header)");
    fprintf(stderr, "m3emu: %s\n", m3emu_last_error());
    dlclose(dl);
    return CUDA_ERROR_INVALID_IMAGE;
  }
  bind(m3emu_get_api());
  emu_module *em = malloc(sizeof *em);
  if (!em) {
    dlclose(dl);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  em->dl = dl;
  em->static_smem = static_smem();
  *m = (CUmodule)em;
  return CUDA_SUCCESS;
}
static CUresult e_cuModuleUnload(CUmodule m) {
  emu_module *em = (emu_module *)m;
  if (em) dlclose(em->dl), free(em);
  return CUDA_SUCCESS;
}

/* max_dyn: the dynamic shared memory a launch may ask for (cuFuncSetAttribute
 * MAX_DYNAMIC_SHARED_SIZE_BYTES; 0 = not set); nonportable: cuFuncSetAttribute
 * NON_PORTABLE_CLUSTER_SIZE_ALLOWED (clusters of 9..16 blocks); static_smem:
 * its image's static __shared__ bytes. */
typedef struct emu_func {
  m3emu_entry fn;
  char name[96];
  int nargs;
  const size_t *sizes;
  int max_dyn;
  int nonportable;
  size_t static_smem;
} emu_func;

/* The emulator does not measure a kernel's static __shared__ bytes (only an
 * image's, for cluster launches: emu_module.static_smem); it reports
 * this nominal figure for every kernel and applies the GPU's rule with it
 * (static + dynamic > 48 KiB needs the opt-in attribute), so a launcher that
 * leaves static shared memory out of that rule fails here as on a GPU (the
 * top-p sampler's 48 KiB of dynamic memory once did, on an H200 only). */
#define EMU_STATIC_SMEM 1024
int m3emu_capturing(void);
void m3emu_capture_launch(CUfunction f, const unsigned g[3], const unsigned b[3], unsigned smem, unsigned cluster_x,
                          void **args, int nargs, const size_t *sizes);

static CUresult e_cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  emu_module *em = (emu_module *)m;
  char tramp[128];
  snprintf(tramp, sizeof tramp, "%s__emu", name);
  void *p = dlsym(em->dl, tramp);
  if (!p) return CUDA_ERROR_NOT_FOUND;
  emu_func *ef = calloc(1, sizeof *ef);
  if (!ef) return CUDA_ERROR_OUT_OF_MEMORY;
  ef->fn = (m3emu_entry)p;
  snprintf(ef->name, sizeof ef->name, "%s", name);
  snprintf(tramp, sizeof tramp, "%s__emu_nargs", name);
  const int *na = dlsym(em->dl, tramp);
  snprintf(tramp, sizeof tramp, "%s__emu_sizes", name);
  ef->sizes = dlsym(em->dl, tramp);
  ef->nargs = na ? *na : -1;
  ef->static_smem = em->static_smem;
  *f = (CUfunction)ef;
  return CUDA_SUCCESS;
}
static CUresult e_cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
  emu_func *ef = (emu_func *)f;
  switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
      if (v < 0 || v + EMU_STATIC_SMEM > 227 * 1024) {
        m3emu_set_error("%s: MAX_DYNAMIC_SHARED_SIZE_BYTES %d + %d static bytes exceed 227 KiB", ef->name, v,
                        EMU_STATIC_SMEM);
        return CUDA_ERROR_INVALID_VALUE;
      }
      ef->max_dyn = v;
      break;
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: ef->nonportable = v != 0; break;
    default: break;
  }
  return CUDA_SUCCESS;
}
static CUresult e_cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction f) {
  (void)f;
  *v = a == CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES ? EMU_STATIC_SMEM : a == CU_FUNC_ATTRIBUTE_BINARY_VERSION ? 90 : 0;
  return CUDA_SUCCESS;
}

/* The emulator has no SMs to fill: "unknown", and split rules use their fallback. */
static CUresult e_cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int threads, size_t smem) {
  (void)f; (void)threads; (void)smem;
  *n = 0;
  return CUDA_SUCCESS;
}

/* Every launch: cluster_x (1..16, dividing gx) is checked by the caller. */
static CUresult launch(emu_func *ef, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned smem, unsigned cluster_x, void **args) {
  if (smem > 227 * 1024 || (smem + EMU_STATIC_SMEM > 48 * 1024 && (int)smem > ef->max_dyn)) {
    m3emu_set_error("%s: %u bytes of dynamic shared memory (over 48 KiB with the %d static ones needs "
                    "MAX_DYNAMIC_SHARED_SIZE_BYTES, now %d; 227 KiB at most)",
                    ef->name, smem, EMU_STATIC_SMEM, ef->max_dyn);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (cluster_x > 1 && ef->static_smem) {
    m3emu_set_error("%s: cluster launch (%u blocks) of a kernel with %zu bytes of static __shared__ variables: the "
                    "emulator supports only dynamic shared memory in cluster kernels (its static __shared__ "
                    "variables are one copy per kernel image, and the blocks of a cluster run together)",
                    ef->name, cluster_x, ef->static_smem);
    fprintf(stderr, "m3emu: %s\n", m3emu_last_error());
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (m3emu_capturing()) {
    if (ef->nargs < 0 || !ef->sizes) {
      m3emu_set_error("%s: no parameter sizes to capture the launch with", ef->name);
      return CUDA_ERROR_NOT_SUPPORTED;
    }
    unsigned g[3] = {gx, gy, gz}, b[3] = {bx, by, bz};
    m3emu_capture_launch((CUfunction)ef, g, b, smem, cluster_x, args, ef->nargs, ef->sizes);
    return CUDA_SUCCESS;
  }
  if (m3emu_launch(ef->fn, (m3emu_dim3){gx, gy, gz}, (m3emu_dim3){bx, by, bz}, cluster_x, smem, args, ef->name)) {
    fprintf(stderr, "m3emu: %s\n", m3emu_last_error());
    return CUDA_ERROR_LAUNCH_FAILED;
  }
  return CUDA_SUCCESS;
}

/* The cluster dimension of a launch configuration, checked against the
 * driver's rules on sm_90 (x only in the emulator, 1..16 blocks, above 8 with
 * the non-portable attribute): CUDA_SUCCESS with *cx, or the error code with
 * its message set.  For cuLaunchKernelEx and the cluster occupancy query. */
static CUresult cluster_dim(const emu_func *ef, const CUlaunchConfig *c, unsigned *cx) {
  unsigned x = 1, y = 1, z = 1;
  for (unsigned i = 0; i < c->numAttrs; i++)
    if (c->attrs[i].id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
      x = c->attrs[i].value.clusterDim.x, y = c->attrs[i].value.clusterDim.y, z = c->attrs[i].value.clusterDim.z;
  *cx = x;
  if (x == 0) {
    m3emu_set_error("%s: cluster dimension (%u,%u,%u)", ef->name, x, y, z);
    return CUDA_ERROR_INVALID_CLUSTER_SIZE;
  }
  if (y != 1 || z != 1) {
    m3emu_set_error("%s: cluster dimension (%u,%u,%u): the emulator supports clusters along x only", ef->name, x, y, z);
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (x > 16) {
    m3emu_set_error("%s: cluster of %u blocks (16 at most on sm_90)", ef->name, x);
    return CUDA_ERROR_INVALID_CLUSTER_SIZE;
  }
  if (x > 8 && !ef->nonportable) {
    m3emu_set_error("%s: cluster of %u blocks needs CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (8 is the "
                    "portable limit)",
                    ef->name, x);
    return CUDA_ERROR_INVALID_CLUSTER_SIZE;
  }
  return CUDA_SUCCESS;
}

/* One cluster of any size cluster_dim() accepts is resident at a time, as the
 * emulator runs them; a size it refuses is its error. */
static CUresult e_cuOccupancyMaxActiveClusters(int *n, CUfunction f, const CUlaunchConfig *c) {
  unsigned cx;
  *n = 0;
  CUresult r = cluster_dim((const emu_func *)f, c, &cx);
  if (r == CUDA_SUCCESS) *n = 1;
  return r;
}

static CUresult e_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned smem, CUstream s, void **args, void **extra) {
  (void)s; (void)extra;
  return launch((emu_func *)f, gx, gy, gz, bx, by, bz, smem, 1, args);
}

/* Launch attributes: CLUSTER_DIMENSION (x only) groups blocks into clusters;
 * the others (PDL's programmatic stream serialization) change only when a
 * launch may begin on a GPU, and the emulator runs launches in order. */
static CUresult e_cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **args, void **extra) {
  (void)extra;
  emu_func *ef = (emu_func *)f;
  unsigned cx;
  CUresult r = cluster_dim(ef, c, &cx);
  if (r != CUDA_SUCCESS) return r;
  if (c->gridDimX % cx) {
    m3emu_set_error("%s: cluster of %u blocks does not divide the grid's %u blocks along x", ef->name, cx,
                    c->gridDimX);
    return CUDA_ERROR_INVALID_CLUSTER_SIZE;
  }
  return launch(ef, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
                c->sharedMemBytes, cx, args);
}
static CUresult e_cuGetErrorName(CUresult r, const char **s) {
  switch (r) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_LAUNCH_FAILED: *s = "CUDA_ERROR_LAUNCH_FAILED (emulator)"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE (emulator)"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED (emulator)"; break;
    case CUDA_ERROR_INVALID_CLUSTER_SIZE: *s = "CUDA_ERROR_INVALID_CLUSTER_SIZE (emulator)"; break;
    case CUDA_ERROR_INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE (emulator)"; break;
    default: *s = "CUDA_ERROR (emulator)";
  }
  return CUDA_SUCCESS;
}
static CUresult e_cuGetErrorString(CUresult r, const char **s) {
  *s = r == CUDA_SUCCESS ? "no error" : m3emu_last_error()[0] ? m3emu_last_error() : "emulator error";
  return CUDA_SUCCESS;
}

/* ---- the compiler ---- */

static char hdr_dir[64];
static pid_t hdr_pid;

/* The header folder goes with the process that made it (M3EMU_KEEP keeps it,
 * with the sources and logs it then holds); not with a forked child (check's
 * test processes), whose parent may compile again after it. */
static void remove_hdr_dir(void) {
  if (!hdr_dir[0] || getpid() != hdr_pid || getenv("M3EMU_KEEP")) return;
  DIR *d = opendir(hdr_dir);
  if (d) {
    for (struct dirent *de; (de = readdir(d));) {
      if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
      char p[512];
      snprintf(p, sizeof p, "%s/%s", hdr_dir, de->d_name);
      unlink(p);
    }
    closedir(d);
  }
  rmdir(hdr_dir);
}

static int write_text(const char *path, const char *text, size_t len) {
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  size_t w = fwrite(text, 1, len, f);
  return fclose(f) == 0 && w == len ? 0 : -1;
}

static int ident_char(char c) { return isalnum((unsigned char)c) || c == '_'; }

/* Whether the '{' whose preceding significant character is at src[k] opens a
 * function body (or a block inside one): after ')' or after a trailing
 * const/noexcept/override/final/mutable.  Namespace, extern "C", class and
 * initializer braces are not. */
static int opens_function(const char *src, long k) {
  if (k < 0) return 0;
  if (src[k] == ')') return 1;
  if (!ident_char(src[k])) return 0;
  long b = k;
  while (b > 0 && ident_char(src[b - 1])) b--;
  static const char *const kw[] = {"const", "noexcept", "override", "final", "mutable"};
  for (size_t i = 0; i < sizeof kw / sizeof *kw; i++)
    if ((size_t)(k - b + 1) == strlen(kw[i]) && !strncmp(src + b, kw[i], strlen(kw[i]))) return 1;
  return 0;
}

/* Rewrite `extern __shared__ <type> name[];` (dynamic shared memory) into a
 * pointer at the running block's buffer, m3emu_dyn_smem_buf (m3emu.h), which
 * must be evaluated by the CUDA thread itself: inside a function (every
 * template's case), the local `type *const name = (type *)m3emu_dyn_smem_buf;`;
 * at namespace scope, where an initializer would run at dlopen (before
 * m3emu_bind, outside any CUDA thread), the macro
 * `#define name ((type *)m3emu_dyn_smem_buf)` instead.  Comments, literals
 * and preprocessor lines are left alone (lib/ffn.lua's DYN_SMEM spells the
 * CUDA form in an #ifdef __CUDA_ARCH__ branch).  Returns a malloc'd copy. */
static char *rewrite_dyn_smem(const char *src) {
  static const char kw[] = "extern __shared__";
  const size_t kwl = sizeof kw - 1;
  size_t n = strlen(src), cap = n + 4096, at = 0;
  char *out = malloc(cap);
  if (!out) return NULL;
  enum { CODE, LINE_COMMENT, BLOCK_COMMENT, STRING, CHAR } st = CODE;
  int directive = 0, line_start = 1, depth = 0, fn_depth = 0;
  char fn_brace[1024]; /* per open brace: 1 when it counts as a function body */
  long last_sig = -1;  /* last significant code character */
  for (size_t i = 0; i < n;) {
    const char c = src[i];
    if (st == CODE && !directive && c == 'e' && !strncmp(src + i, kw, kwl) && (i == 0 || !ident_char(src[i - 1])) &&
        !ident_char(src[i + kwl])) {
      const char *semi = strchr(src + i, ';'), *e = semi;
      while (e && e > src + i && isspace((unsigned char)e[-1])) e--;
      if (e && e - (src + i) > (long)kwl + 2 && e[-1] == ']' && e[-2] == '[') {
        const char *t0 = src + i + kwl, *end = e - 2;
        while (end > t0 && isspace((unsigned char)end[-1])) end--;
        const char *nm = end;
        while (nm > t0 && ident_char(nm[-1])) nm--;
        char type[256], name[96], rep[1024];
        snprintf(type, sizeof type, "%.*s", (int)(nm - t0), t0);
        snprintf(name, sizeof name, "%.*s", (int)(end - nm), nm);
        /* drop __align__(n) from the type */
        char *al = strstr(type, "__align__(");
        if (al) {
          char *cl = strchr(al, ')');
          if (cl) memmove(al, cl + 1, strlen(cl + 1) + 1);
        }
        int rl = fn_depth > 0 ? snprintf(rep, sizeof rep, "%s *const %s = (%s *)m3emu_dyn_smem_buf;", type, name, type)
                              : snprintf(rep, sizeof rep, "\n#define %s ((%s *)m3emu_dyn_smem_buf)\n", name, type);
        if (rl < 0 || (size_t)rl >= sizeof rep) rl = 0;
        if (at + (size_t)rl + (n - i) + 1 > cap) {
          cap = (at + (size_t)rl + (n - i) + 1) * 2;
          char *grown = realloc(out, cap);
          if (!grown) return free(out), NULL;
          out = grown;
        }
        memcpy(out + at, rep, (size_t)rl);
        at += (size_t)rl;
        i = (size_t)(semi + 1 - src);
        last_sig = (long)i - 1;
        continue;
      }
    }
    if (at + 3 > cap) {
      cap *= 2;
      char *grown = realloc(out, cap);
      if (!grown) return free(out), NULL;
      out = grown;
    }
    out[at++] = c;
    const char nx = i + 1 < n ? src[i + 1] : 0;
    const size_t i0 = i;
    const int line_start_was = line_start;
    /* a line whose first code (comments aside) is '#' is a directive */
    if (c == '\n') line_start = 1;
    else if (st == CODE && !isspace((unsigned char)c) && !(c == '/' && nx == '*')) line_start = 0;
    switch (st) {
      case CODE:
        if (c == '/' && nx == '*') out[at++] = nx, i++, st = BLOCK_COMMENT;
        else if (c == '/' && nx == '/') out[at++] = nx, i++, st = LINE_COMMENT;
        else if (c == '"') st = STRING;
        else if (c == '\'') st = CHAR;
        else if (c == '#' && line_start_was) directive = 1;
        else if (c == '\\' && nx == '\n') out[at++] = nx, i++; /* a continued line */
        else if (c == '\n') directive = 0;
        else if (!directive && c == '{') {
          int fn = fn_depth > 0 || opens_function(src, last_sig);
          if (depth < (int)sizeof fn_brace) fn_brace[depth] = (char)fn;
          depth++;
          fn_depth += fn;
        } else if (!directive && c == '}' && depth > 0) {
          depth--;
          if (depth < (int)sizeof fn_brace) fn_depth -= fn_brace[depth];
        }
        if (st == CODE && !isspace((unsigned char)c) && c != '\\' && !directive) last_sig = (long)i0;
        break;
      case LINE_COMMENT:
        if (c == '\\' && nx == '\n') out[at++] = nx, i++;
        else if (c == '\n') st = CODE, directive = 0;
        break;
      case BLOCK_COMMENT:
        if (c == '*' && nx == '/') out[at++] = nx, i++, st = CODE;
        break;
      case STRING:
      case CHAR:
        if (c == '\\' && nx) out[at++] = nx, i++;
        else if (c == (st == STRING ? '"' : '\'')) st = CODE;
        else if (c == '\n') st = CODE; /* unterminated: give up on it */
        break;
    }
    i++;
  }
  out[at] = 0;
  return out;
}

/* The trampoline: `extern "C" void <entry>__emu(void **a)` calling the entry
 * with each argument cast from a[i] to the parameter's declared type. */
static int trampoline(const char *src, const char *entry, char *out, size_t n) {
  char pat[128];
  snprintf(pat, sizeof pat, "%s(", entry);
  const char *p = strstr(src, pat);
  while (p && p > src && (isalnum((unsigned char)p[-1]) || p[-1] == '_')) p = strstr(p + 1, pat);
  if (!p) return -1;
  p += strlen(pat);
  /* copy the parameter list without comments */
  char params[8192];
  size_t k = 0;
  int depth = 1;
  while (*p && depth > 0 && k + 1 < sizeof params) {
    if (p[0] == '/' && p[1] == '*') {
      const char *c = strstr(p + 2, "*/");
      if (!c) return -1;
      p = c + 2;
      params[k++] = ' ';
      continue;
    }
    if (p[0] == '/' && p[1] == '/') {
      while (*p && *p != '\n') p++;
      continue;
    }
    if (*p == '(') depth++;
    if (*p == ')' && --depth == 0) break;
    params[k++] = *p++;
  }
  params[k] = 0;
  size_t at = (size_t)snprintf(out, n, "extern \"C\" void %s__emu(void **a) {\n  %s(", entry, entry);
  int idx = 0;
  static char types[64][256];
  char *save = NULL;
  for (char *tok = strtok_r(params, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    while (isspace((unsigned char)*tok)) tok++;
    char *e = tok + strlen(tok);
    while (e > tok && isspace((unsigned char)e[-1])) *--e = 0;
    if (!*tok || !strcmp(tok, "void")) continue;
    char *nm = e;
    while (nm > tok && (isalnum((unsigned char)nm[-1]) || nm[-1] == '_')) nm--;
    char type[256];
    snprintf(type, sizeof type, "%.*s", (int)(nm - tok), tok);
    if (idx >= 64) return -1;
    snprintf(types[idx], sizeof types[idx], "%s", type);
    at += (size_t)snprintf(out + at, at < n ? n - at : 0, "%s*(%s *)a[%d]", idx ? ", " : "", type, idx);
    idx++;
  }
  at += (size_t)snprintf(out + at, at < n ? n - at : 0, ");\n}\n");
  /* Parameter sizes, for graph capture (argument bytes are copied then). */
  at += (size_t)snprintf(out + at, at < n ? n - at : 0, "extern \"C\" const int %s__emu_nargs = %d;\n", entry, idx);
  at += (size_t)snprintf(out + at, at < n ? n - at : 0, "extern \"C\" const size_t %s__emu_sizes[] = {%s", entry, idx ? "" : "0");
  for (int i = 0; i < idx; i++)
    at += (size_t)snprintf(out + at, at < n ? n - at : 0, "%ssizeof(%s)", i ? ", " : "", types[i]);
  at += (size_t)snprintf(out + at, at < n ? n - at : 0, "};\n");
  return at < n ? 0 : -1;
}

static m3_status emu_compile(const char *src, const char *entry, const char *arch, uint8_t **image, size_t *size,
                             char **log, m3_err *e) {
  (void)arch;
  *image = NULL;
  *size = 0;
  if (log) *log = NULL;
  if (!hdr_dir[0]) {
    snprintf(hdr_dir, sizeof hdr_dir, "/tmp/m3emu-%d-XXXXXX", (int)getpid());
    if (!mkdtemp(hdr_dir)) {
      hdr_dir[0] = 0;
      return m3_errf(e, M3_IO, "emulator: mkdtemp: %s", strerror(errno));
    }
    hdr_pid = getpid();
    atexit(remove_hdr_dir);
    for (const m3_embedded *h = m3emu_headers; h->name; h++) {
      char p[256];
      snprintf(p, sizeof p, "%s/%s", hdr_dir, h->name);
      if (write_text(p, h->text, h->len)) return m3_errf(e, M3_IO, "emulator: cannot write %s", p);
    }
  }
  char base[256], cpp[300], so[300], lg[300];
  static int seq;
  snprintf(base, sizeof base, "%s/%s-%d", hdr_dir, entry, seq++);
  snprintf(cpp, sizeof cpp, "%s.cpp", base);
  snprintf(so, sizeof so, "%s.so", base);
  snprintf(lg, sizeof lg, "%s.log", base);
  char *body = rewrite_dyn_smem(src);
  if (!body) return m3_errf(e, M3_IO, "emulator: out of memory");
  char tr[16384];
  if (trampoline(src, entry, tr, sizeof tr)) {
    free(body);
    return m3_errf(e, M3_NVRTC, "emulator: cannot find the parameter list of %s in the generated source", entry);
  }
  size_t bl = strlen(body), tl = strlen(tr);
  /* m3emu_static_smem: the bytes of static __shared__ variables (m3emu.h puts
   * them in the section m3emu_shared; the linker defines __start_/__stop_ of
   * a section whose name is a C identifier, and a weak reference is 0 when
   * the image has no such section). */
  const char *bindtxt =
      "\nextern \"C\" {\n"
      "const m3emu_api *m3emu_api_ptr;\n"
      "void m3emu_bind(const m3emu_api *a) { m3emu_api_ptr = a; }\n"
      "extern char __start_m3emu_shared[] __attribute__((weak, visibility(\"hidden\")));\n"
      "extern char __stop_m3emu_shared[] __attribute__((weak, visibility(\"hidden\")));\n"
      "size_t m3emu_static_smem(void) {\n"
      "  return __start_m3emu_shared ? (size_t)(__stop_m3emu_shared - __start_m3emu_shared) : 0;\n"
      "}\n"
      "}\n";
  char *all = malloc(bl + tl + strlen(bindtxt) + 1);
  memcpy(all, body, bl);
  memcpy(all + bl, bindtxt, strlen(bindtxt));
  memcpy(all + bl + strlen(bindtxt), tr, tl + 1);
  free(body);
  int wr = write_text(cpp, all, strlen(all));
  free(all);
  if (wr) return m3_errf(e, M3_IO, "emulator: cannot write %s", cpp);
  char cmd[1600];
  snprintf(cmd, sizeof cmd,
           "g++ " EMU_GXX_FLAGS " -w -I%s -include m3emu.h -o %s %s > %s 2>&1", hdr_dir,
           so, cpp, lg);
  int rc = system(cmd);
  uint8_t *lgd = NULL;
  FILE *lf = fopen(lg, "r");
  if (lf) {
    fseek(lf, 0, SEEK_END);
    long ln = ftell(lf);
    fseek(lf, 0, SEEK_SET);
    lgd = malloc((size_t)ln + 1);
    size_t got = fread(lgd, 1, (size_t)ln, lf);
    lgd[got] = 0;
    fclose(lf);
  }
  if (rc != 0) {
    m3_status s = m3_errf(e, M3_NVRTC, "emulator: g++ failed for %s (%s):\n%.3000s", entry, cpp, lgd ? (char *)lgd : "");
    free(lgd);
    return s;
  }
  if (!getenv("M3EMU_KEEP")) unlink(cpp), unlink(lg);
  FILE *f = fopen(so, "rb");
  if (!f) {
    free(lgd);
    return m3_errf(e, M3_IO, "emulator: no image %s", so);
  }
  fseek(f, 0, SEEK_END);
  long sz = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *img = malloc((size_t)sz + 8);
  uint64_t l64 = (uint64_t)sz;
  memcpy(img, &l64, 8);
  size_t got = fread(img + 8, 1, (size_t)sz, f);
  fclose(f);
  if (!getenv("M3EMU_KEEP")) unlink(so);
  if (got != (size_t)sz) {
    free(img);
    free(lgd);
    return m3_errf(e, M3_IO, "emulator: short read of %s", so);
  }
  *image = img;
  *size = (size_t)sz + 8;
  if (log) *log = (char *)lgd;
  else free(lgd);
  return M3_OK;
}

__attribute__((constructor)) static void m3emu_install(void) {
  static const m3_driver d = {
      .cuInit = e_cuInit, .cuDriverGetVersion = e_cuDriverGetVersion, .cuDeviceGet = e_cuDeviceGet,
      .cuDeviceGetCount = e_cuDeviceGetCount, .cuDeviceGetName = e_cuDeviceGetName,
      .cuDeviceGetAttribute = e_cuDeviceGetAttribute, .cuDeviceTotalMem = e_cuDeviceTotalMem,
      .cuDevicePrimaryCtxRetain = e_cuDevicePrimaryCtxRetain, .cuDevicePrimaryCtxRelease = e_cuDevicePrimaryCtxRelease,
      .cuCtxSetCurrent = e_cuCtxSetCurrent, .cuCtxGetCurrent = e_cuCtxGetCurrent,
      .cuModuleLoadData = e_cuModuleLoadData, .cuModuleUnload = e_cuModuleUnload,
      .cuModuleGetFunction = e_cuModuleGetFunction, .cuFuncSetAttribute = e_cuFuncSetAttribute,
      .cuFuncGetAttribute = e_cuFuncGetAttribute, .cuLaunchKernel = e_cuLaunchKernel, .cuLaunchKernelEx = e_cuLaunchKernelEx,
      .cuOccupancyMaxActiveBlocksPerMultiprocessor = e_cuOccupancyMaxActiveBlocksPerMultiprocessor,
      .cuOccupancyMaxActiveClusters = e_cuOccupancyMaxActiveClusters,
      .cuGetErrorName = e_cuGetErrorName, .cuGetErrorString = e_cuGetErrorString};
  /* The options text with a hash of the embedded headers (names and texts). */
  static char options[256];
  XXH3_state_t *st = XXH3_createState();
  unsigned long long h = 0;
  if (st && XXH3_64bits_reset(st) == XXH_OK) {
    for (const m3_embedded *e = m3emu_headers; e->name; e++) {
      XXH3_64bits_update(st, e->name, strlen(e->name) + 1);
      XXH3_64bits_update(st, e->text, e->len);
    }
    h = XXH3_64bits_digest(st);
  }
  XXH3_freeState(st);
  snprintf(options, sizeof options, "%s (headers %016llx)", EMU_OPTIONS, h);
  m3_driver_install(&d, "m3kit CPU emulator", emu_compile, options);
}
