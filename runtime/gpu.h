/* gpu.h - the device, modules and launches (CUDA driver API).
 *
 * The runtime API (cudart, linked statically) and the driver API share the
 * device's primary context: m3_device_open retains it and makes it current, so
 * cudaMalloc'd buffers, cuBLAS and cuModuleLoadData'd kernels all meet there.
 */
#ifndef M3_GPU_H
#define M3_GPU_H

#include <cuda.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/cubin_cache.h"
#include "runtime/status.h"

typedef struct m3_device {
  int ordinal;
  CUdevice dev;
  CUcontext ctx;
  char name[256];
  int cc_major, cc_minor;
  int sm_count;
  int l2_bytes;
  size_t total_mem;
  int smem_optin;        /* max dynamic shared memory per block after opt-in, bytes */
  int driver_version;    /* cuDriverGetVersion, e.g. 13000 */
  char arch[16];         /* "sm_90" */
} m3_device;

/* Number of usable CUDA GPUs; 0 when there is no driver or no device (never an
 * error: GPU tests use it to exit 77). */
int m3_gpu_count(void);

/* Driver version (cuDriverGetVersion) or 0 without a driver. */
int m3_driver_version(void);

/* Open device `ordinal` (primary context, made current for this thread).
 * Errors: M3_NOGPU, M3_CUDA. */
m3_status m3_device_open(int ordinal, m3_device *d, m3_err *e);
void m3_device_close(m3_device *d);

typedef struct m3_module {
  CUmodule mod;
  CUfunction fn;
  int threads, smem;
  int pdl;             /* 1: launched with programmatic stream serialization (an sm_90+ image, unless M3KIT_PDL=0) */
  int max_cluster;     /* m3_module_max_cluster's answer (0: not asked, or the driver could not tell) */
  int nonportable;     /* clusters above 8 allowed: set by m3_module_max_cluster (else each such launch asks) */
  char entry[96];
} m3_module;

/* Load a cubin and resolve its entry; raises the dynamic shared-memory limit
 * when meta->smem > 48 KiB.  Errors: M3_CUDA (e.g. an image for another arch). */
m3_status m3_module_load(const uint8_t *cubin, size_t size, const m3_cubin_meta *meta, m3_module *out,
                         m3_err *e);
void m3_module_unload(m3_module *m);

/* Launch with the module's block size and dynamic smem.  Checks the launch
 * result (not the kernel's completion).  Errors: M3_CUDA. */
m3_status m3_launch(const m3_module *m, unsigned gx, unsigned gy, unsigned gz, CUstream stream,
                    void **args, m3_err *e);

/* m3_launch with thread-block clusters of cluster_x CTAs along x (sm_90+;
 * 1 = no cluster): the CTAs blockIdx.x = c*cluster_x .. c*cluster_x +
 * cluster_x - 1 run at once on one GPC and share their shared memory
 * (distributed shared memory).  gx must be a multiple of cluster_x; above 8
 * (the portable size, up to 16) the function is allowed the non-portable
 * size first.  Errors: M3_INVAL (cluster_x 0, above 16, or not dividing gx),
 * M3_CUDA (e.g. CUDA_ERROR_INVALID_CLUSTER_SIZE where the cluster's CTAs
 * cannot be resident in one GPC at once at this block size and shared
 * memory). */
m3_status m3_launch_cluster(const m3_module *m, unsigned gx, unsigned gy, unsigned gz, unsigned cluster_x,
                            CUstream stream, void **args, m3_err *e);

/* CTAs of module m one SM holds at once, at its block size and dynamic
 * shared memory: the driver's occupancy calculator
 * (cuOccupancyMaxActiveBlocksPerMultiprocessor), which knows the part's
 * register allocation and its L1/shared split (a hand-made estimate from the
 * occupancy tables over-counted: one wave planned, two run).  0 when the
 * driver cannot tell (the CPU emulator): callers pick their own fallback.
 * For split rules (one wave of CTAs), not correctness. */
int m3_module_resident_ctas(const m3_module *m);

/* The widest thread-block cluster along x, of 16, 8, 4 or 2 CTAs, of which
 * module m (at its block size and dynamic shared memory) can have at least
 * one resident at once (cuOccupancyMaxActiveClusters, after allowing the
 * non-portable sizes): 16 on an H100 SXM, less where a GPC has fewer free
 * SMs (other parts, MIG slices); sizes the driver rejects (the non-portable
 * ones where it refuses them) are skipped.  1: none fits; 0: the driver
 * answered for no size (callers then keep to the portable 8).  Also kept in
 * m->max_cluster, and m->nonportable set, so that launches do not ask again. */
int m3_module_max_cluster(m3_module *m);

#endif
