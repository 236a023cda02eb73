/* check_emu_cluster.c - thread-block clusters (sm_90, x only) and distributed
 * shared memory in the CPU emulator (emu/), which CI runs in place of a GPU:
 * small CUDA-C kernels built by the emulator's compiler (the one the JIT
 * uses) and launched through m3_drv.cuLaunchKernelEx with a
 * CLUSTER_DIMENSION attribute.  Each block's own dynamic shared memory,
 * m3emu_cluster_sync (barrier.cluster), m3emu_map_shared (mapa) across the
 * cluster, the launch checks (non-portable sizes, divisibility, y/z
 * clusters), DSMEM misuse and cluster-barrier deadlocks as launch errors,
 * graph capture + replay of a cluster launch, poisoned fresh shared memory,
 * refusal of static __shared__ in cluster kernels, and launches without a
 * cluster.  The kernels call the m3emu_* helpers directly: they are built only
 * by the emulator.  Global memory is host memory there. */
#include <check.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/cuda_driver.h"

#define POISON 0xA5A5A5A5u

/* ---- the kernels ---- */

/* Every thread writes a value of its rank into its block's dynamic shared
 * memory; after the cluster barrier it sums, with weights, the values of
 * another thread in every other block of the cluster. */
static const char *SRC_SUM =
    "extern \"C\" __global__ void cl_sum(unsigned *out, unsigned salt) {\n"
    "  extern __shared__ unsigned sm[];\n"
    "  const unsigned r = m3emu_cluster_ctarank(), n = m3emu_cluster_nctarank(), t = threadIdx.x;\n"
    "  sm[t] = ((r + 1u) * 2654435761u) ^ (t * 40503u + salt);\n"
    "  m3emu_cluster_sync();\n"
    "  unsigned acc = 0;\n"
    "  for (unsigned q = 0; q < n; q++)\n"
    "    if (q != r) acc += *m3emu_map_shared(&sm[(t + q) % blockDim.x], q) * (q + 1u);\n"
    "  unsigned *o = out + 4 * (((size_t)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + t);\n"
    "  o[0] = acc;\n"
    "  o[1] = r;\n"
    "  o[2] = n;\n"
    "  const unsigned *self = sm;\n"
    "  o[3] = m3emu_map_shared(self, r) == self;\n"
    "  m3emu_cluster_sync(); /* no block leaves while another may still read its memory */\n"
    "}\n";

static unsigned sum_val(unsigned r, unsigned t, unsigned salt) { return ((r + 1u) * 2654435761u) ^ (t * 40503u + salt); }

/* DSMEM misuse, by thread 3 of block 1: mode 1 maps global memory, 2 a rank
 * past the cluster, 3 one past the end of the dynamic shared memory. */
static const char *SRC_BADMAP =
    "extern \"C\" __global__ void cl_badmap(unsigned *out, int mode) {\n"
    "  extern __shared__ unsigned sm[];\n"
    "  sm[threadIdx.x] = threadIdx.x;\n"
    "  m3emu_cluster_sync();\n"
    "  if (blockIdx.x == 1 && threadIdx.x == 3) {\n"
    "    if (mode == 1) out[0] = *m3emu_map_shared(out, 0);\n"
    "    if (mode == 2) out[0] = *m3emu_map_shared(sm, m3emu_cluster_nctarank());\n"
    "    if (mode == 3) out[0] = *m3emu_map_shared(sm + blockDim.x, 0);\n"
    "    if (mode == 0) out[0] = *m3emu_map_shared(sm + blockDim.x - 1, 0);\n"
    "  }\n"
    "  m3emu_cluster_sync();\n"
    "}\n";

/* Warp 0 of rank 1 waits at a __syncthreads the rest of its block skips,
 * which waits at the cluster barrier: a true deadlock. */
static const char *SRC_DEAD =
    "extern \"C\" __global__ void cl_dead(unsigned *out) {\n"
    "  if (m3emu_cluster_ctarank() == 1 && threadIdx.x < 32) __syncthreads();\n"
    "  m3emu_cluster_sync();\n"
    "  out[blockIdx.x] = 1;\n"
    "}\n";

/* Rank 2 returns at once (its threads count as arrived at the cluster
 * barriers); the others read their right neighbour's memory, which for rank
 * 1 is that of the block that has gone: poison in the emulator. */
static const char *SRC_EXIT =
    "extern \"C\" __global__ void cl_exit(unsigned *out) {\n"
    "  extern __shared__ unsigned sm[];\n"
    "  const unsigned r = m3emu_cluster_ctarank(), n = m3emu_cluster_nctarank();\n"
    "  sm[threadIdx.x] = 100u + r;\n"
    "  if (r == 2) return;\n"
    "  m3emu_cluster_sync();\n"
    "  out[blockIdx.x * blockDim.x + threadIdx.x] = *m3emu_map_shared(&sm[threadIdx.x], (r + 1u) % n);\n"
    "  m3emu_cluster_sync();\n"
    "}\n";

/* Reads its shared memory before writing it: fresh memory is poison. */
static const char *SRC_POISON =
    "extern \"C\" __global__ void cl_poison(unsigned *out) {\n"
    "  extern __shared__ __align__(16) unsigned sm[];\n"
    "  const unsigned v = sm[threadIdx.x];\n"
    "  __syncthreads();\n"
    "  sm[threadIdx.x] = 0x12345678u;\n"
    "  out[blockIdx.x * blockDim.x + threadIdx.x] = v;\n"
    "}\n";

/* Static __shared__ (one copy per image in the emulator): in the kernel and
 * in an inline helper.  (One in a function template is not detected: g++
 * ignores the section attribute there; docs/emulator.md.) */
static const char *SRC_STATIC =
    "inline __device__ unsigned flip(unsigned v) { /* external linkage: -fno-weak keeps it in the section */\n"
    "  __shared__ unsigned s_f[32];\n"
    "  s_f[31 - threadIdx.x] = v;\n"
    "  __syncthreads();\n"
    "  return s_f[threadIdx.x];\n"
    "}\n"
    "extern \"C\" __global__ void cl_static(unsigned *out) {\n"
    "  __shared__ unsigned s_v[32];\n"
    "  s_v[threadIdx.x] = blockIdx.x;\n"
    "  __syncthreads();\n"
    "  out[blockIdx.x * 32 + threadIdx.x] = flip(s_v[31 - threadIdx.x]);\n"
    "}\n";

/* Dynamic shared memory declared at file scope (and a DYN_SMEM macro as in
 * templates/lib/ffn.lua, and the CUDA spelling in a comment: extern
 * __shared__ float not_this[];). */
static const char *SRC_FILESCOPE =
    "#ifdef __CUDA_ARCH__\n"
    "#define DYN_SMEM(type, name) extern __shared__ __align__(16) type name[]\n"
    "#else\n"
    "#define DYN_SMEM(type, name) type *name = (type *)m3emu_dyn_smem_buf\n"
    "#endif\n"
    "/* extern __shared__ float not_this[]; */\n"
    "extern __shared__ float fs_buf[];\n"
    "namespace {\n"
    "struct pair { float a, b; };\n"
    "}\n"
    "static __device__ float twice(int i) { return 2.0f * fs_buf[i]; }\n"
    "extern \"C\" __global__ void cl_filescope(float *out) {\n"
    "  fs_buf[threadIdx.x] = (float)(blockIdx.x * 100 + threadIdx.x);\n"
    "  m3emu_cluster_sync();\n"
    "  const float *nb = m3emu_map_shared(fs_buf, (m3emu_cluster_ctarank() + 1) % m3emu_cluster_nctarank());\n"
    "  pair p = {twice(threadIdx.x), nb[threadIdx.x]};\n"
    "  m3emu_cluster_sync();\n"
    "  DYN_SMEM(float, again);\n"
    "  out[blockIdx.x * blockDim.x + threadIdx.x] = p.a + p.b + (again == fs_buf ? 0.5f : 0.0f);\n"
    "}\n";

/* ---- helpers ---- */

static CUfunction build(const char *src, const char *entry) {
  const char *opts = NULL;
  m3_alt_compile_fn cc = m3_driver_compiler(&opts);
  ck_assert_msg(cc != NULL, "the emulator's compiler is not installed");
  uint8_t *img = NULL;
  size_t size = 0;
  char *log = NULL;
  m3_err e;
  m3_status s = cc(src, entry, "sm_90", &img, &size, &log, &e);
  ck_assert_msg(s == M3_OK, "%s: %s", entry, e.msg);
  CUmodule mod;
  ck_assert_int_eq(m3_drv.cuModuleLoadData(&mod, img), CUDA_SUCCESS);
  free(img);
  free(log);
  CUfunction f;
  ck_assert_int_eq(m3_drv.cuModuleGetFunction(&f, mod, entry), CUDA_SUCCESS);
  return f; /* the module stays loaded for the program's life */
}

/* cx 0: no cluster attribute, else (cx, cy, 1); pdl: with PDL's attribute too. */
static CUresult launch_ex(CUfunction f, unsigned gx, unsigned gy, unsigned threads, unsigned smem, unsigned cx,
                          unsigned cy, int pdl, void **args) {
  CUlaunchAttribute at[2];
  memset(at, 0, sizeof at);
  unsigned na = 0;
  if (pdl) {
    at[na].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    at[na++].value.programmaticStreamSerializationAllowed = 1;
  }
  if (cx) {
    at[na].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    at[na].value.clusterDim.x = cx, at[na].value.clusterDim.y = cy, at[na].value.clusterDim.z = 1;
    na++;
  }
  CUlaunchConfig c;
  memset(&c, 0, sizeof c);
  c.gridDimX = gx, c.gridDimY = gy, c.gridDimZ = 1;
  c.blockDimX = threads, c.blockDimY = 1, c.blockDimZ = 1;
  c.sharedMemBytes = smem;
  c.attrs = at;
  c.numAttrs = na;
  return m3_drv.cuLaunchKernelEx(&c, f, args, NULL);
}

/* Always with a CLUSTER_DIMENSION attribute of (x, y, 1), zeros included. */
static CUresult launch_cdim(CUfunction f, unsigned gx, unsigned gy, unsigned threads, unsigned smem, unsigned x,
                            unsigned y, void **args) {
  CUlaunchAttribute at;
  memset(&at, 0, sizeof at);
  at.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  at.value.clusterDim.x = x, at.value.clusterDim.y = y, at.value.clusterDim.z = 1;
  CUlaunchConfig c;
  memset(&c, 0, sizeof c);
  c.gridDimX = gx, c.gridDimY = gy, c.gridDimZ = 1;
  c.blockDimX = threads, c.blockDimY = 1, c.blockDimZ = 1;
  c.sharedMemBytes = smem;
  c.attrs = &at;
  c.numAttrs = 1;
  return m3_drv.cuLaunchKernelEx(&c, f, args, NULL);
}

static const char *err_str(CUresult r) {
  const char *s = NULL;
  m3_drv.cuGetErrorString(r, &s);
  return s ? s : "";
}

#define EXPECT_ERR(call, code, needle)                                                                  \
  do {                                                                                                  \
    CUresult r_ = (call);                                                                               \
    ck_assert_msg(r_ == (code), "%s: %d, expected %d (%s)", #call, (int)r_, (int)(code), err_str(r_)); \
    ck_assert_msg(strstr(err_str(r_), (needle)) != NULL, "%s: message \"%s\" lacks \"%s\"", #call,    \
                  err_str(r_), (needle));                                                               \
  } while (0)

static CUfunction f_sum(void) {
  static CUfunction f;
  if (!f) {
    f = build(SRC_SUM, "cl_sum");
    ck_assert_int_eq(m3_drv.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                     CUDA_SUCCESS);
  }
  return f;
}

/* Checks cl_sum's output for a gx x gy grid of `threads`, clusters of cx. */
static void check_sum(const unsigned *out, unsigned gx, unsigned gy, unsigned threads, unsigned cx, unsigned salt) {
  for (unsigned by = 0; by < gy; by++)
    for (unsigned b = 0; b < gx; b++)
      for (unsigned t = 0; t < threads; t++) {
        const unsigned *o = out + 4 * (((size_t)by * gx + b) * threads + t), r = b % cx;
        unsigned acc = 0;
        for (unsigned q = 0; q < cx; q++)
          if (q != r) acc += sum_val(q, (t + q) % threads, salt) * (q + 1u);
        ck_assert_msg(o[0] == acc && o[1] == r && o[2] == cx && o[3] == 1,
                      "cluster %u, block (%u,%u) thread %u: sum %u rank %u size %u self %u, expected %u %u %u 1", cx,
                      b, by, t, o[0], o[1], o[2], o[3], acc, r, cx);
      }
}

static void run_sum(unsigned gx, unsigned gy, unsigned threads, unsigned cx, unsigned salt) {
  size_t n = (size_t)gx * gy * threads * 4;
  unsigned *out = malloc(n * sizeof *out);
  ck_assert_ptr_nonnull(out);
  memset(out, 0xff, n * sizeof *out);
  void *args[] = {&out, &salt};
  CUresult r = launch_ex(f_sum(), gx, gy, threads, threads * 4, cx, 1, 1, args);
  ck_assert_msg(r == CUDA_SUCCESS, "cluster %u: %d (%s)", cx, (int)r, err_str(r));
  check_sum(out, gx, gy, threads, cx, salt);
  free(out);
}

/* ---- the cases ---- */

/* (a) DSMEM across clusters of 4 (a 2-D grid: clusters at each y) and of 16
 * blocks of 1024 threads (the limits). */
START_TEST(cluster_dsmem) {
  run_sum(8, 2, 64, 4, 11);
  run_sum(32, 1, 1024, 16, 12);
  run_sum(24, 1, 96, 12, 13); /* non-portable, not a power of two */
  run_sum(6, 1, 32, 2, 14);
}
END_TEST

/* (b) more than 8 blocks needs NON_PORTABLE_CLUSTER_SIZE_ALLOWED; 16 at most;
 * clusters along x only. */
START_TEST(cluster_size_limits) {
  CUfunction f = build(SRC_SUM, "cl_sum");
  unsigned *out = calloc((size_t)32 * 64 * 4, sizeof *out), salt = 5;
  ck_assert_ptr_nonnull(out);
  void *args[] = {&out, &salt};
  EXPECT_ERR(launch_ex(f, 16, 1, 64, 256, 16, 1, 0, args), CUDA_ERROR_INVALID_CLUSTER_SIZE, "NON_PORTABLE");
  EXPECT_ERR(launch_ex(f, 9, 1, 64, 256, 9, 1, 0, args), CUDA_ERROR_INVALID_CLUSTER_SIZE, "NON_PORTABLE");
  ck_assert_int_eq(launch_ex(f, 16, 1, 64, 256, 8, 1, 0, args), CUDA_SUCCESS);
  check_sum(out, 16, 1, 64, 8, salt);
  ck_assert_int_eq(m3_drv.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                   CUDA_SUCCESS);
  ck_assert_int_eq(launch_ex(f, 16, 1, 64, 256, 16, 1, 0, args), CUDA_SUCCESS);
  check_sum(out, 16, 1, 64, 16, salt);
  EXPECT_ERR(launch_ex(f, 17, 1, 64, 256, 17, 1, 0, args), CUDA_ERROR_INVALID_CLUSTER_SIZE, "16 at most");
  EXPECT_ERR(launch_ex(f, 32, 1, 64, 256, 32, 1, 0, args), CUDA_ERROR_INVALID_CLUSTER_SIZE, "16 at most");
  EXPECT_ERR(launch_cdim(f, 4, 2, 64, 256, 2, 2, args), CUDA_ERROR_NOT_SUPPORTED, "along x only");
  EXPECT_ERR(launch_cdim(f, 4, 1, 64, 256, 0, 1, args), CUDA_ERROR_INVALID_CLUSTER_SIZE, "cluster dimension");
  /* the 227 KiB check is MAX_DYNAMIC_SHARED_SIZE_BYTES's only */
  ck_assert_int_eq(m3_drv.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 300 * 1024),
                   CUDA_ERROR_INVALID_VALUE);
  ck_assert_int_eq(m3_drv.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100),
                   CUDA_SUCCESS);
  free(out);
}
END_TEST

/* (c) the grid must be a whole number of clusters */
START_TEST(cluster_grid_multiple) {
  unsigned *out = calloc((size_t)8 * 64 * 4, sizeof *out), salt = 5;
  ck_assert_ptr_nonnull(out);
  void *args[] = {&out, &salt};
  EXPECT_ERR(launch_ex(f_sum(), 6, 1, 64, 256, 4, 1, 0, args), CUDA_ERROR_INVALID_CLUSTER_SIZE, "does not divide");
  EXPECT_ERR(launch_ex(f_sum(), 15, 1, 64, 256, 16, 1, 0, args), CUDA_ERROR_INVALID_CLUSTER_SIZE, "does not divide");
  free(out);
}
END_TEST

/* (d) map_shared of memory that is not this block's dynamic shared memory,
 * and to a rank past the cluster, are launch failures naming the kernel and
 * the block. */
START_TEST(cluster_map_errors) {
  CUfunction f = build(SRC_BADMAP, "cl_badmap");
  unsigned *out = calloc(64, sizeof *out);
  ck_assert_ptr_nonnull(out);
  int mode = 0;
  void *args[] = {&out, &mode};
  ck_assert_int_eq(launch_ex(f, 4, 1, 32, 128, 4, 1, 0, args), CUDA_SUCCESS);
  ck_assert_uint_eq(out[0], 31);
  mode = 1;
  EXPECT_ERR(launch_ex(f, 4, 1, 32, 128, 4, 1, 0, args), CUDA_ERROR_LAUNCH_FAILED, "not in this block's dynamic");
  EXPECT_ERR(launch_ex(f, 4, 1, 32, 128, 4, 1, 0, args), CUDA_ERROR_LAUNCH_FAILED, "cl_badmap: map_shared");
  EXPECT_ERR(launch_ex(f, 4, 1, 32, 128, 4, 1, 0, args), CUDA_ERROR_LAUNCH_FAILED, "(block 1,0,0: rank 1");
  mode = 2;
  EXPECT_ERR(launch_ex(f, 4, 1, 32, 128, 4, 1, 0, args), CUDA_ERROR_LAUNCH_FAILED,
             "to cluster rank 4 of a cluster of 4 blocks");
  EXPECT_ERR(launch_ex(f, 4, 1, 32, 128, 0, 1, 0, args), CUDA_ERROR_LAUNCH_FAILED,
             "to cluster rank 1 of a cluster of 1 block (block 1,0,0)");
  mode = 3;
  EXPECT_ERR(launch_ex(f, 4, 1, 32, 128, 4, 1, 0, args), CUDA_ERROR_LAUNCH_FAILED, "+128 bytes");
  /* the launch after a failure starts clean */
  mode = 0;
  ck_assert_int_eq(launch_ex(f, 4, 1, 32, 128, 4, 1, 0, args), CUDA_SUCCESS);
  free(out);
}
END_TEST

/* (e) a cluster barrier some live thread never reaches is reported, not a
 * hang; a block that has exited does not hold the cluster barrier up. */
START_TEST(cluster_deadlock) {
  CUfunction f = build(SRC_DEAD, "cl_dead");
  unsigned *out = calloc(8, sizeof *out);
  ck_assert_ptr_nonnull(out);
  void *args[] = {&out};
  EXPECT_ERR(launch_ex(f, 8, 1, 64, 0, 4, 1, 0, args), CUDA_ERROR_LAUNCH_FAILED, "cannot complete");
  EXPECT_ERR(launch_ex(f, 8, 1, 64, 0, 4, 1, 0, args), CUDA_ERROR_LAUNCH_FAILED,
             "32 at __syncthreads, 0 at warp exchanges, 224 at the cluster barrier (cluster of blocks 0..3,0,0)");
  /* without a cluster, rank 1 never exists: no deadlock */
  ck_assert_int_eq(launch_ex(f, 8, 1, 64, 0, 0, 1, 0, args), CUDA_SUCCESS);

  CUfunction g = build(SRC_EXIT, "cl_exit");
  unsigned *o2 = calloc(8 * 32, sizeof *o2);
  ck_assert_ptr_nonnull(o2);
  void *a2[] = {&o2};
  ck_assert_int_eq(launch_ex(g, 8, 1, 32, 128, 4, 1, 0, a2), CUDA_SUCCESS);
  for (unsigned b = 0; b < 8; b++)
    for (unsigned t = 0; t < 32; t++) {
      const unsigned r = b % 4, v = o2[b * 32 + t];
      if (r == 2) ck_assert_uint_eq(v, 0);                          /* never written */
      else if (r == 1) ck_assert_uint_eq(v, POISON);                /* rank 2 has gone */
      else ck_assert_uint_eq(v, 100u + (r + 1) % 4);
    }
  free(o2);
  free(out);
}
END_TEST

/* (f) graph capture records the cluster size and replays it. */
START_TEST(cluster_graph) {
  const unsigned gx = 8, threads = 64, cx = 4;
  const size_t n = (size_t)gx * threads * 4;
  unsigned *out = malloc(n * sizeof *out), salt = 21;
  ck_assert_ptr_nonnull(out);
  memset(out, 0, n * sizeof *out);
  void *args[] = {&out, &salt};
  cudaStream_t s;
  ck_assert_int_eq(cudaStreamCreate(&s), cudaSuccess);
  ck_assert_int_eq(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  ck_assert_int_eq(launch_ex(f_sum(), gx, 1, threads, threads * 4, cx, 1, 1, args), CUDA_SUCCESS);
  /* the launch checks apply at capture */
  EXPECT_ERR(launch_ex(f_sum(), 6, 1, threads, threads * 4, cx, 1, 1, args), CUDA_ERROR_INVALID_CLUSTER_SIZE,
             "does not divide");
  cudaGraph_t g;
  ck_assert_int_eq(cudaStreamEndCapture(s, &g), cudaSuccess);
  salt = 99; /* the capture copied the arguments */
  for (size_t i = 0; i < n; i++) ck_assert_uint_eq(out[i], 0); /* nothing ran */
  cudaGraphExec_t x;
  ck_assert_int_eq(cudaGraphInstantiate(&x, g, 0), cudaSuccess);
  ck_assert_int_eq(cudaGraphDestroy(g), cudaSuccess);
  for (int rep = 0; rep < 2; rep++) {
    memset(out, 0, n * sizeof *out);
    ck_assert_int_eq(cudaGraphLaunch(x, s), cudaSuccess);
    check_sum(out, gx, 1, threads, cx, 21);
  }
  /* the same as a direct launch */
  unsigned *direct = malloc(n * sizeof *direct);
  ck_assert_ptr_nonnull(direct);
  salt = 21;
  void *a2[] = {&direct, &salt};
  ck_assert_int_eq(launch_ex(f_sum(), gx, 1, threads, threads * 4, cx, 1, 1, a2), CUDA_SUCCESS);
  ck_assert_int_eq(memcmp(out, direct, n * sizeof *out), 0);
  ck_assert_int_eq(cudaGraphExecDestroy(x), cudaSuccess);
  ck_assert_int_eq(cudaStreamDestroy(s), cudaSuccess);
  free(direct);
  free(out);
}
END_TEST

/* (g) launches without a cluster: cuLaunchKernel, and cuLaunchKernelEx with a
 * cluster of 1: rank 0 of 1, the cluster barrier is the block's. */
START_TEST(no_cluster) {
  const unsigned gx = 5, threads = 128;
  const size_t n = (size_t)gx * threads * 4;
  unsigned *out = malloc(n * sizeof *out), salt = 3;
  ck_assert_ptr_nonnull(out);
  void *args[] = {&out, &salt};
  memset(out, 0xff, n * sizeof *out);
  ck_assert_int_eq(m3_drv.cuLaunchKernel(f_sum(), gx, 1, 1, threads, 1, 1, threads * 4, NULL, args, NULL),
                   CUDA_SUCCESS);
  check_sum(out, gx, 1, threads, 1, salt);
  memset(out, 0xff, n * sizeof *out);
  ck_assert_int_eq(launch_ex(f_sum(), gx, 1, threads, threads * 4, 1, 1, 1, args), CUDA_SUCCESS);
  check_sum(out, gx, 1, threads, 1, salt);
  free(out);
}
END_TEST

/* (h) each block's dynamic shared memory starts as poison, every launch. */
START_TEST(smem_poison) {
  CUfunction f = build(SRC_POISON, "cl_poison");
  unsigned *out = calloc(4 * 64, sizeof *out);
  ck_assert_ptr_nonnull(out);
  void *args[] = {&out};
  for (int rep = 0; rep < 2; rep++) {
    ck_assert_int_eq(launch_ex(f, 4, 1, 64, 256, 0, 1, 0, args), CUDA_SUCCESS);
    for (int i = 0; i < 4 * 64; i++) ck_assert_uint_eq(out[i], POISON);
    ck_assert_int_eq(launch_ex(f, 4, 1, 64, 256, 2, 1, 0, args), CUDA_SUCCESS);
    for (int i = 0; i < 4 * 64; i++) ck_assert_uint_eq(out[i], POISON);
  }
  free(out);
}
END_TEST

/* (i) static __shared__ works without a cluster and is refused with one. */
START_TEST(static_smem_refused) {
  {
    CUfunction f = build(SRC_STATIC, "cl_static");
    unsigned *out = calloc(4 * 32, sizeof *out);
    ck_assert_ptr_nonnull(out);
    void *args[] = {&out};
    ck_assert_int_eq(launch_ex(f, 4, 1, 32, 0, 0, 1, 0, args), CUDA_SUCCESS);
    for (unsigned i = 0; i < 4 * 32; i++) ck_assert_uint_eq(out[i], i / 32);
    ck_assert_int_eq(launch_ex(f, 4, 1, 32, 0, 1, 1, 0, args), CUDA_SUCCESS);
    EXPECT_ERR(launch_ex(f, 4, 1, 32, 0, 2, 1, 0, args), CUDA_ERROR_NOT_SUPPORTED,
               "supports only dynamic shared memory in cluster kernels");
    free(out);
  }
}
END_TEST

/* (j) dynamic shared memory declared at file scope: evaluated per thread. */
START_TEST(filescope_dyn_smem) {
  CUfunction f = build(SRC_FILESCOPE, "cl_filescope");
  const unsigned gx = 6, threads = 32, cx = 3;
  float *out = calloc((size_t)gx * threads, sizeof *out);
  ck_assert_ptr_nonnull(out);
  void *args[] = {&out};
  ck_assert_int_eq(launch_ex(f, gx, 1, threads, threads * 4, cx, 1, 0, args), CUDA_SUCCESS);
  for (unsigned b = 0; b < gx; b++)
    for (unsigned t = 0; t < threads; t++) {
      const unsigned nb = b - b % cx + (b % cx + 1) % cx;
      const float want = 2.0f * (float)(b * 100 + t) + (float)(nb * 100 + t) + 0.5f;
      ck_assert_msg(out[b * threads + t] == want, "block %u thread %u: %g, expected %g", b, t, out[b * threads + t],
                    want);
    }
  free(out);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("emu_cluster");
  TCase *tc = tcase_create("cluster");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, cluster_dsmem);
  tcase_add_test(tc, cluster_size_limits);
  tcase_add_test(tc, cluster_grid_multiple);
  tcase_add_test(tc, cluster_map_errors);
  tcase_add_test(tc, cluster_deadlock);
  tcase_add_test(tc, cluster_graph);
  tcase_add_test(tc, no_cluster);
  tcase_add_test(tc, smem_poison);
  tcase_add_test(tc, static_smem_refused);
  tcase_add_test(tc, filescope_dyn_smem);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
#if defined(__SANITIZE_ADDRESS__)
  printf("check_emu_cluster: the CPU emulator's fiber stacks are not AddressSanitizer-clean: skipping (exit 77)\n");
  return 77;
#endif
  if (!m3_driver_label()) {
    printf("check_emu_cluster: the CPU emulator is not installed: skipping (exit 77)\n");
    return 77;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  SRunner *sr = srunner_create(suite());
  srunner_set_fork_status(sr, CK_NOFORK); /* the kernels are built once, in this process */
  srunner_set_log(sr, "-");
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
