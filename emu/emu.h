/* emu.h - libm3emu: a CPU emulator of the CUDA runtime, driver and cuBLAS
 * subset m3kit uses, so the GPU tests run in CI, where there is never a GPU.
 *
 * It is linked INSTEAD of cudart and cuBLAS into the tests/emu_* programs; a
 * constructor installs it as m3kit's driver (runtime/cuda_driver.h) and as the
 * JIT's compiler, so those programs see one "GPU" (sm_90, 4 SMs): kernels are
 * compiled by g++ from the exact source NVRTC compiles (inline PTX has C
 * fallbacks under #ifndef __CUDA_ARCH__), loaded with dlopen, and run block by
 * block with the threads of a block as fibers that switch at __syncthreads and
 * at warp exchanges.  Barrier deadlocks (divergent __syncthreads or shuffles)
 * and reads of exited lanes are reported as launch errors.  Timings mean
 * nothing here; results are bit-for-bit those of the C code, which is what the
 * tests compare.  Not usable under AddressSanitizer (fiber stacks). */
#ifndef M3_EMU_H
#define M3_EMU_H

#include <stddef.h>
#include <stdint.h>

#include "emu/emu_api.h"

typedef void (*m3emu_entry)(void **args);

/* Run a kernel: grid x block threads, one block at a time.  Returns 0, or -1
 * with a message in m3emu_last_error(). */
int m3emu_launch(m3emu_entry fn, m3emu_dim3 grid, m3emu_dim3 block, void **args, const char *name);
const char *m3emu_last_error(void);
const m3emu_api *m3emu_get_api(void);

#endif
