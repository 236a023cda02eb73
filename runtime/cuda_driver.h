/* cuda_driver.h - the CUDA driver API, loaded at run time.
 *
 * m3kit does not link libcuda: the same binary must run on a machine with no
 * driver (offline rendering and compiling, tests that skip) and on the GPU
 * machine.  m3_driver_load() dlopen()s libcuda.so.1 once and fills m3_drv with
 * the entry points below; without a driver it fails and every GPU path reports
 * M3_NOGPU.  Versioned names (cuDeviceTotalMem -> cuDeviceTotalMem_v2) follow
 * cuda.h's own macros, so m3_drv.cuX(...) calls the symbol cuda.h means.
 */
#ifndef M3_CUDA_DRIVER_H
#define M3_CUDA_DRIVER_H

#include <cuda.h>

#define M3_DRIVER_FUNCS(X)                                                     \
  X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount)           \
  X(cuDeviceGetName) X(cuDeviceGetAttribute) X(cuDeviceTotalMem)               \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent)  \
  X(cuCtxGetCurrent) X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction) \
  X(cuFuncSetAttribute) X(cuFuncGetAttribute) X(cuLaunchKernel) X(cuLaunchKernelEx) \
  X(cuOccupancyMaxActiveBlocksPerMultiprocessor) X(cuOccupancyMaxActiveClusters) X(cuGetErrorName) X(cuGetErrorString)

typedef struct m3_driver {
#define M3_X_FIELD(f) __typeof__(&f) f;
  M3_DRIVER_FUNCS(M3_X_FIELD)
#undef M3_X_FIELD
} m3_driver;

extern m3_driver m3_drv;

/* 1 when libcuda.so.1 was found and every entry point resolved (idempotent,
 * thread-safe), or an alternate driver was installed. */
int m3_driver_load(void);

/* An alternate driver: the CPU emulator (emu/emu.h) installs itself from a
 * constructor in the test programs that link it.  `compile` then replaces
 * NVRTC in the JIT (its `options` text enters the cubin-cache key instead of
 * NVRTC's, so emulator images never mix with cubins). */
#include <stddef.h>
#include <stdint.h>
#include "runtime/status.h"
typedef m3_status (*m3_alt_compile_fn)(const char *src, const char *entry, const char *arch, uint8_t **image,
                                       size_t *size, char **log, m3_err *e);
void m3_driver_install(const m3_driver *d, const char *label, m3_alt_compile_fn compile, const char *options);
/* NULL with the real driver; else the installed driver's label. */
const char *m3_driver_label(void);
m3_alt_compile_fn m3_driver_compiler(const char **options);

#endif
