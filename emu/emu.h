/* emu.h - libm3emu: a CPU emulator of the CUDA runtime, driver and cuBLAS
 * subset m3kit uses, so the GPU tests run in CI, where there is never a GPU.
 *
 * It is linked INSTEAD of cudart and cuBLAS into the tests/emu_* programs; a
 * constructor installs it as m3kit's driver (runtime/cuda_driver.h) and as the
 * JIT's compiler, so those programs see one "GPU" (sm_90, 4 SMs): kernels are
 * compiled by g++ from the exact source NVRTC compiles (inline PTX has C
 * fallbacks under #ifndef __CUDA_ARCH__), loaded with dlopen, and run cluster
 * by cluster (a cluster is one block when the launch has none) with the
 * threads of all the cluster's blocks as fibers that switch at __syncthreads,
 * at warp exchanges and at the cluster barrier.  Each block has its own
 * dynamic shared memory (poisoned with 0xA5 bytes when the block starts);
 * blocks of a cluster reach each other's through map_shared (PTX mapa).
 * Barrier deadlocks (divergent __syncthreads, shuffles or cluster barriers)
 * and reads of exited lanes are reported as launch errors.  Timings mean
 * nothing here; results are bit-for-bit those of the C code, which is what the
 * tests compare.  Not usable under AddressSanitizer (fiber stacks).
 *
 * Limits: clusters along x only (1..16 blocks; more than 8 needs the
 * function's NON_PORTABLE_CLUSTER_SIZE_ALLOWED, as on an H100); static
 * __shared__ variables are one copy per kernel image, so a cluster launch
 * (x > 1) of a kernel whose image has any is refused (CUDA_ERROR_NOT_SUPPORTED):
 * cluster kernels keep their shared memory in dynamic shared memory. */
#ifndef M3_EMU_H
#define M3_EMU_H

#include <stddef.h>
#include <stdint.h>

#include "emu/emu_api.h"

typedef void (*m3emu_entry)(void **args);

/* Run a kernel: grid x block threads, one cluster (cluster_x consecutive
 * blockIdx.x at the same y, z; 1..16, dividing grid.x) at a time, each block
 * with smem_bytes of dynamic shared memory.  Returns 0, or -1 with a message
 * in m3emu_last_error(). */
int m3emu_launch(m3emu_entry fn, m3emu_dim3 grid, m3emu_dim3 block, unsigned cluster_x, unsigned smem_bytes,
                 void **args, const char *name);
const char *m3emu_last_error(void);
/* Sets the message m3emu_last_error() returns (the driver's launch checks). */
void m3emu_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const m3emu_api *m3emu_get_api(void);

#endif
