/* emu_api.h - the ABI between the CPU emulator (libm3emu, in the test
 * program) and a kernel compiled for it (a shared object built by g++ from the
 * very source NVRTC would compile, with emu/m3emu.h force-included).  The
 * kernel object reaches the emulator only through this table, bound once by
 * m3emu_bind() after dlopen. */
#ifndef M3_EMU_API_H
#define M3_EMU_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct m3emu_dim3 { unsigned x, y, z; } m3emu_dim3;

typedef struct m3emu_thread {
  m3emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
} m3emu_thread;

typedef struct m3emu_api {
  m3emu_thread *volatile *cur;              /* the running CUDA thread */
  void (*syncthreads)(void);
  void (*syncwarp)(void);
  /* Warp exchange: every live lane contributes v; returns the value of lane
   * src (src outside 0..31 or an exited lane is an error the emulator reports). */
  uint32_t (*shfl)(uint32_t v, int src);
  uint32_t (*ballot)(int pred);
  void (*trap)(const char *what);
  /* The running thread's block's dynamic shared memory (each block its own). */
  void *(*dyn_smem)(void);
  /* barrier.cluster.arrive.release + wait.acquire over every thread of every
   * block of the cluster (exited threads count as arrived); a block barrier
   * when the launch has no cluster. */
  void (*cluster_sync)(void);
  /* DSMEM (PTX mapa): p points into this block's dynamic shared memory; the
   * address at the same offset in block `rank`'s.  Anything else (p outside
   * [buffer, buffer + bytes), rank >= cluster size) is a launch failure; p
   * is returned then. */
  void *(*map_shared)(const void *p, unsigned rank);
  unsigned (*cluster_rank)(void);  /* %cluster_ctarank: blockIdx.x % cluster_x */
  unsigned (*cluster_size)(void);  /* %cluster_nctarank: cluster_x */
} m3emu_api;

#ifdef __cplusplus
}
#endif
#endif
