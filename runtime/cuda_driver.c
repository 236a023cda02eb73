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

int m3_driver_load(void) {
  pthread_once(&once, load);
  return loaded;
}
