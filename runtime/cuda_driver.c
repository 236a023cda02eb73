/* cuda_driver.c - dlopen of libcuda.so.1 (see cuda_driver.h). */
#include "runtime/cuda_driver.h"

#include <dlfcn.h>
#include <pthread.h>

m3_driver m3_drv;
static int loaded;
static pthread_once_t once = PTHREAD_ONCE_INIT;

#define M3_STR(x) #x
#define M3_XSTR(x) M3_STR(x)

static void load(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) return;
  int ok = 1;
#define M3_X_SYM(f) ok &= (*(void **)&m3_drv.f = dlsym(h, M3_XSTR(f))) != NULL;
  M3_DRIVER_FUNCS(M3_X_SYM)
#undef M3_X_SYM
  loaded = ok;
}

static const char *alt_label, *alt_options;
static m3_alt_compile_fn alt_compile;

void m3_driver_install(const m3_driver *d, const char *label, m3_alt_compile_fn compile, const char *options) {
  m3_drv = *d;
  alt_label = label;
  alt_compile = compile;
  alt_options = options;
  loaded = 1;
}

const char *m3_driver_label(void) { return alt_label; }

m3_alt_compile_fn m3_driver_compiler(const char **options) {
  if (options) *options = alt_options;
  return alt_compile;
}

int m3_driver_load(void) {
  if (alt_label) return 1;
  pthread_once(&once, load);
  return loaded;
}
