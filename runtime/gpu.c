/* gpu.c - device, module load, launch, and the check-macro failure paths. */
#include "runtime/gpu.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/check.h"
#include "runtime/cuda_driver.h"

m3_status m3_cu_fail(m3_err *e, CUresult r, const char *call, const char *file, int line) {
  const char *name = NULL, *str = NULL;
  if (m3_driver_load()) {
    m3_drv.cuGetErrorName(r, &name);
    m3_drv.cuGetErrorString(r, &str);
  }
  return m3_errf(e, M3_CUDA, "%s:%d: %s failed: %s (%s)", file, line, call, name ? name : "?",
                 str ? str : "?");
}

m3_status m3_cuda_fail(m3_err *e, cudaError_t r, const char *call, const char *file, int line) {
  return m3_errf(e, M3_CUDA, "%s:%d: %s failed: %s (%s)", file, line, call, cudaGetErrorName(r),
                 cudaGetErrorString(r));
}

m3_status m3_cublas_fail(m3_err *e, cublasStatus_t r, const char *call, const char *file, int line) {
  return m3_errf(e, M3_CUBLAS, "%s:%d: %s failed: %s", file, line, call, cublasGetStatusString(r));
}

int m3_gpu_count(void) {
  if (!m3_driver_load()) return 0;
  if (m3_drv.cuInit(0) != CUDA_SUCCESS) return 0;
  int n = 0;
  if (m3_drv.cuDeviceGetCount(&n) != CUDA_SUCCESS) return 0;
  return n;
}

int m3_driver_version(void) {
  int v = 0;
  if (!m3_driver_load()) return 0;
  if (m3_drv.cuDriverGetVersion(&v) != CUDA_SUCCESS) return 0;
  /* The stub library answers without a driver; only trust it with a device. */
  return m3_gpu_count() > 0 ? v : 0;
}

m3_status m3_device_open(int ordinal, m3_device *d, m3_err *e) {
  memset(d, 0, sizeof *d);
  int n = m3_gpu_count();
  if (n == 0) return m3_errf(e, M3_NOGPU, "no CUDA GPU (cuInit/cuDeviceGetCount found none)");
  if (ordinal < 0 || ordinal >= n) return m3_errf(e, M3_INVAL, "GPU %d requested, %d present", ordinal, n);
  d->ordinal = ordinal;
  M3_CU(e, m3_drv.cuDeviceGet(&d->dev, ordinal));
  M3_CU(e, m3_drv.cuDevicePrimaryCtxRetain(&d->ctx, d->dev));
  M3_CU(e, m3_drv.cuCtxSetCurrent(d->ctx));
  M3_CUDA(e, cudaSetDevice(ordinal));
  M3_CU(e, m3_drv.cuDeviceGetName(d->name, sizeof d->name, d->dev));
  M3_CU(e, m3_drv.cuDeviceGetAttribute(&d->cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d->dev));
  M3_CU(e, m3_drv.cuDeviceGetAttribute(&d->cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d->dev));
  M3_CU(e, m3_drv.cuDeviceGetAttribute(&d->sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d->dev));
  M3_CU(e, m3_drv.cuDeviceGetAttribute(&d->l2_bytes, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, d->dev));
  M3_CU(e, m3_drv.cuDeviceGetAttribute(&d->smem_optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, d->dev));
  M3_CU(e, m3_drv.cuDeviceTotalMem(&d->total_mem, d->dev));
  M3_CU(e, m3_drv.cuDriverGetVersion(&d->driver_version));
  snprintf(d->arch, sizeof d->arch, "sm_%d%d", d->cc_major, d->cc_minor);
  return M3_OK;
}

void m3_device_close(m3_device *d) {
  if (d && d->ctx) {
    m3_drv.cuDevicePrimaryCtxRelease(d->dev);
    d->ctx = NULL;
  }
}

m3_status m3_module_load(const uint8_t *cubin, size_t size, const m3_cubin_meta *meta, m3_module *out,
                         m3_err *e) {
  (void)size;
  memset(out, 0, sizeof *out);
  CUresult r = m3_drv.cuModuleLoadData(&out->mod, cubin);
  if (r != CUDA_SUCCESS) {
    m3_cu_fail(e, r, "cuModuleLoadData", __FILE__, __LINE__);
    return m3_err_prefix(e, "loading %s: ", meta->entry);
  }
  r = m3_drv.cuModuleGetFunction(&out->fn, out->mod, meta->entry);
  if (r != CUDA_SUCCESS) {
    m3_drv.cuModuleUnload(out->mod);
    m3_cu_fail(e, r, "cuModuleGetFunction", __FILE__, __LINE__);
    return m3_err_prefix(e, "entry %s: ", meta->entry);
  }
  /* Beyond 48 KiB per block, static plus dynamic, a launch needs the opt-in
   * attribute (top-p sampling: 48 KiB dynamic + a few hundred bytes static). */
  int static_smem = 0;
  if (meta->smem > 0 &&
      m3_drv.cuFuncGetAttribute(&static_smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, out->fn) != CUDA_SUCCESS)
    static_smem = 0;
  if (meta->smem > 0 && meta->smem + static_smem > 48 * 1024) {
    r = m3_drv.cuFuncSetAttribute(out->fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, meta->smem);
    if (r != CUDA_SUCCESS) {
      m3_drv.cuModuleUnload(out->mod);
      m3_cu_fail(e, r, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", __FILE__, __LINE__);
      return m3_err_prefix(e, "%s wants %d bytes of shared memory: ", meta->entry, meta->smem);
    }
  }
  out->threads = meta->threads;
  out->smem = meta->smem;
  /* PDL (on unless M3KIT_PDL=0) only where the image can wait for its
   * predecessor (griddepcontrol is sm_90+; every template's kernels open with
   * M3_GRID_WAIT, lib/prelude.lua).  Device run 24: TPOT 3.1-4.8% lower with
   * it; every GPU test runs under it. */
  int bin = 0;
  const char *pdl = getenv("M3KIT_PDL"); /* on unless "0": unset means the default, on */
  out->pdl = !(pdl && !strcmp(pdl, "0")) &&
             m3_drv.cuFuncGetAttribute(&bin, CU_FUNC_ATTRIBUTE_BINARY_VERSION, out->fn) == CUDA_SUCCESS && bin >= 90;
  snprintf(out->entry, sizeof out->entry, "%s", meta->entry);
  return M3_OK;
}

void m3_module_unload(m3_module *m) {
  if (m && m->mod) {
    m3_drv.cuModuleUnload(m->mod);
    m->mod = NULL;
  }
}

m3_status m3_launch(const m3_module *m, unsigned gx, unsigned gy, unsigned gz, CUstream stream,
                    void **args, m3_err *e) {
  return m3_launch_cluster(m, gx, gy, gz, 1, stream, args, e);
}

m3_status m3_launch_cluster(const m3_module *m, unsigned gx, unsigned gy, unsigned gz, unsigned cluster_x,
                            CUstream stream, void **args, m3_err *e) {
  if (cluster_x < 1 || cluster_x > 16 || gx % (cluster_x ? cluster_x : 1))
    return m3_errf(e, M3_INVAL, "%s: cluster of %u CTAs for a grid of %u along x (1..16, dividing the grid)",
                   m->entry, cluster_x, gx);
  if (gx == 0 || gy == 0 || gz == 0) return M3_OK; /* empty problem */
  CUresult r;
  const char *call = "cuLaunchKernel";
  if (cluster_x > 8 && !m->nonportable) { /* a module m3_module_max_cluster never saw */
    r = m3_drv.cuFuncSetAttribute(m->fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1);
    if (r != CUDA_SUCCESS) {
      m3_cu_fail(e, r, "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)", __FILE__, __LINE__);
      return m3_err_prefix(e, "%s, cluster of %u: ", m->entry, cluster_x);
    }
  }
  if (m->pdl || cluster_x > 1) {
    /* PDL: the launch may begin while the stream's previous kernel drains;
     * the kernel's first statement waits for it (lib/prelude.lua
     * M3_GRID_WAIT).  Captured into a graph, this becomes a programmatic
     * edge. */
    CUlaunchAttribute at[2];
    memset(at, 0, sizeof at);
    unsigned na = 0;
    if (m->pdl) {
      at[na].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      at[na++].value.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster_x > 1) {
      at[na].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
      at[na].value.clusterDim.x = cluster_x, at[na].value.clusterDim.y = 1, at[na].value.clusterDim.z = 1;
      na++;
    }
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = gx, cfg.gridDimY = gy, cfg.gridDimZ = gz;
    cfg.blockDimX = (unsigned)m->threads, cfg.blockDimY = 1, cfg.blockDimZ = 1;
    cfg.sharedMemBytes = (unsigned)m->smem;
    cfg.hStream = stream;
    cfg.attrs = at;
    cfg.numAttrs = na;
    call = "cuLaunchKernelEx";
    r = m3_drv.cuLaunchKernelEx(&cfg, m->fn, args, NULL);
  } else {
    r = m3_drv.cuLaunchKernel(m->fn, gx, gy, gz, (unsigned)m->threads, 1, 1, (unsigned)m->smem, stream, args, NULL);
  }
  if (r != CUDA_SUCCESS) {
    m3_cu_fail(e, r, call, __FILE__, __LINE__);
    char cl[32] = "";
    if (cluster_x > 1) snprintf(cl, sizeof cl, " cluster %u", cluster_x);
    return m3_err_prefix(e, "%s grid (%u,%u,%u)%s block %d smem %d: ", m->entry, gx, gy, gz, cl, m->threads,
                         m->smem);
  }
  return M3_OK;
}

int m3_module_resident_ctas(const m3_module *m) {
  int n = 0;
  if (!m->fn || m3_drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(&n, m->fn, m->threads > 0 ? m->threads : 128,
                                                                   (size_t)(m->smem > 0 ? m->smem : 0)) != CUDA_SUCCESS)
    return 0;
  return n > 0 ? n : 0;
}

int m3_module_max_cluster(m3_module *m) {
  if (!m->fn) return 0;
  /* Without the non-portable sizes only 8 and below are asked. */
  m->nonportable =
      m3_drv.cuFuncSetAttribute(m->fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1) == CUDA_SUCCESS;
  const unsigned top = m->nonportable ? 16 : 8;
  int answered = 0;
  for (unsigned c = top; c >= 2; c /= 2) {
    CUlaunchAttribute at;
    memset(&at, 0, sizeof at);
    at.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    at.value.clusterDim.x = c, at.value.clusterDim.y = 1, at.value.clusterDim.z = 1;
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = c, cfg.gridDimY = 1, cfg.gridDimZ = 1;
    cfg.blockDimX = (unsigned)(m->threads > 0 ? m->threads : 128), cfg.blockDimY = 1, cfg.blockDimZ = 1;
    cfg.sharedMemBytes = (unsigned)(m->smem > 0 ? m->smem : 0);
    cfg.attrs = &at;
    cfg.numAttrs = 1;
    int n = 0;
    if (m3_drv.cuOccupancyMaxActiveClusters(&n, m->fn, &cfg) != CUDA_SUCCESS) continue; /* a size it rejects */
    answered = 1;
    if (n >= 1) return m->max_cluster = (int)c;
  }
  return m->max_cluster = answered ? 1 : 0;
}
