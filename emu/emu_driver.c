/* emu_driver.c - the emulator as m3kit's CUDA driver and JIT compiler (see
 * emu.h).  Images are shared objects built by g++; a "module" is a dlopen of
 * an image through a memfd; a kernel is its generated <entry>__emu trampoline,
 * which unpacks cuLaunchKernel's void** argument array with the parameter
 * types read from the kernel's own signature. */
#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "emu/emu.h"
#include "runtime/cuda_driver.h"
#include "runtime/embedded.h"

#include "emu/emu_headers.inc" /* m3emu_headers[] */

#define EMU_OPTIONS "emu: g++ -std=c++17 -O1 -fPIC -shared -fno-strict-aliasing -include m3emu.h"

typedef struct emu_module { void *dl; } emu_module;

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
  bind(m3emu_get_api());
  emu_module *em = malloc(sizeof *em);
  em->dl = dl;
  *m = (CUmodule)em;
  return CUDA_SUCCESS;
}
static CUresult e_cuModuleUnload(CUmodule m) {
  emu_module *em = (emu_module *)m;
  if (em) dlclose(em->dl), free(em);
  return CUDA_SUCCESS;
}

/* max_dyn: the dynamic shared memory a launch may ask for (cuFuncSetAttribute
 * MAX_DYNAMIC_SHARED_SIZE_BYTES; 0 = not set). */
typedef struct emu_func { m3emu_entry fn; char name[96]; int nargs; const size_t *sizes; int max_dyn; } emu_func;

/* The emulator cannot measure a kernel's static __shared__ bytes; it reports
 * this nominal figure for every kernel and applies the GPU's rule with it
 * (static + dynamic > 48 KiB needs the opt-in attribute), so a launcher that
 * leaves static shared memory out of that rule fails here as on a GPU (the
 * top-p sampler's 48 KiB of dynamic memory once did, on an H200 only). */
#define EMU_STATIC_SMEM 1024
int m3emu_capturing(void);
void m3emu_capture_launch(CUfunction f, const unsigned g[3], const unsigned b[3], unsigned smem, void **args, int nargs,
                          const size_t *sizes);

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
  *f = (CUfunction)ef;
  return CUDA_SUCCESS;
}
static CUresult e_cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
  if (v + EMU_STATIC_SMEM > 227 * 1024) return CUDA_ERROR_INVALID_VALUE;
  if (a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) ((emu_func *)f)->max_dyn = v;
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

static CUresult e_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned smem, CUstream s, void **args, void **extra) {
  (void)s; (void)extra;
  if (smem > 227 * 1024) return CUDA_ERROR_INVALID_VALUE;
  emu_func *ef = (emu_func *)f;
  if (smem + EMU_STATIC_SMEM > 48 * 1024 && (int)smem > ef->max_dyn) return CUDA_ERROR_INVALID_VALUE;
  if (m3emu_capturing()) {
    if (ef->nargs < 0 || !ef->sizes) return CUDA_ERROR_NOT_SUPPORTED;
    unsigned g[3] = {gx, gy, gz}, b[3] = {bx, by, bz};
    m3emu_capture_launch(f, g, b, smem, args, ef->nargs, ef->sizes);
    return CUDA_SUCCESS;
  }
  if (m3emu_launch(ef->fn, (m3emu_dim3){gx, gy, gz}, (m3emu_dim3){bx, by, bz}, args, ef->name)) {
    fprintf(stderr, "m3emu: %s\n", m3emu_last_error());
    return CUDA_ERROR_LAUNCH_FAILED;
  }
  return CUDA_SUCCESS;
}

/* Launch attributes (PDL's programmatic stream serialization) change only
 * when a launch may begin on a GPU; the emulator runs launches in order. */
static CUresult e_cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **args, void **extra) {
  return e_cuLaunchKernel(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
                          c->sharedMemBytes, c->hStream, args, extra);
}
static CUresult e_cuGetErrorName(CUresult r, const char **s) {
  *s = r == CUDA_SUCCESS ? "CUDA_SUCCESS" : r == CUDA_ERROR_LAUNCH_FAILED ? "CUDA_ERROR_LAUNCH_FAILED (emulator)" : "CUDA_ERROR (emulator)";
  return CUDA_SUCCESS;
}
static CUresult e_cuGetErrorString(CUresult r, const char **s) {
  *s = r == CUDA_SUCCESS ? "no error" : m3emu_last_error()[0] ? m3emu_last_error() : "emulator error";
  return CUDA_SUCCESS;
}

/* ---- the compiler ---- */

static char hdr_dir[64];

static int write_text(const char *path, const char *text, size_t len) {
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  size_t w = fwrite(text, 1, len, f);
  return fclose(f) == 0 && w == len ? 0 : -1;
}

/* Rewrite `extern __shared__ <type> name[];` (dynamic shared memory) into a
 * pointer at the image's static buffer; returns a malloc'd copy. */
static char *rewrite_dyn_smem(const char *src) {
  size_t n = strlen(src);
  char *out = malloc(n * 2 + 1024), *o = out;
  const char *p = src;
  for (;;) {
    const char *x = strstr(p, "extern __shared__");
    if (!x) break;
    const char *end = strstr(x, "[];");
    if (!end) break;
    memcpy(o, p, (size_t)(x - p));
    o += x - p;
    const char *t0 = x + strlen("extern __shared__");
    const char *nm = end;
    while (nm > t0 && (isalnum((unsigned char)nm[-1]) || nm[-1] == '_')) nm--;
    char type[256], name[96];
    snprintf(type, sizeof type, "%.*s", (int)(nm - t0), t0);
    snprintf(name, sizeof name, "%.*s", (int)(end - nm), nm);
    /* drop __align__(n) from the type */
    char *al = strstr(type, "__align__(");
    if (al) {
      char *cl = strchr(al, ')');
      if (cl) memmove(al, cl + 1, strlen(cl + 1) + 1);
    }
    o += sprintf(o, "%s *const %s = (%s *)m3emu_dyn_smem_buf;", type, name, type);
    p = end + 3;
  }
  strcpy(o, p);
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
    if (!mkdtemp(hdr_dir)) return m3_errf(e, M3_IO, "emulator: mkdtemp: %s", strerror(errno));
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
  char tr[16384];
  if (trampoline(src, entry, tr, sizeof tr)) {
    free(body);
    return m3_errf(e, M3_NVRTC, "emulator: cannot find the parameter list of %s in the generated source", entry);
  }
  size_t bl = strlen(body), tl = strlen(tr);
  const char *bindtxt = "\nextern \"C\" { const m3emu_api *m3emu_api_ptr; void m3emu_bind(const m3emu_api *a) { m3emu_api_ptr = a; } }\n";
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
           "g++ -std=c++17 -O1 -fPIC -shared -fno-strict-aliasing -w -I%s -include m3emu.h -o %s %s > %s 2>&1", hdr_dir,
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
      .cuGetErrorName = e_cuGetErrorName, .cuGetErrorString = e_cuGetErrorString};
  m3_driver_install(&d, "m3kit CPU emulator", emu_compile, EMU_OPTIONS);
}
