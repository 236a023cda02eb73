/* emu_sched.c - fibers, barriers, warp exchange and thread-block clusters of
 * the CPU emulator (see emu.h).  One OS thread runs a cluster's CUDA threads
 * (a block's, when the launch has no cluster) as fibers with a hand-written
 * x86-64 context switch (swapcontext would make a syscall per switch).  A
 * fiber runs until it reaches a barrier, then yields; the scheduler cycles
 * round-robin over every thread of the cluster until all have exited.  Each
 * block of a cluster has its own barrier, warp states and dynamic shared
 * memory buffer; the cluster barrier and DSMEM (map_shared) span the blocks. */
#include "emu/emu.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define STACK_BYTES (128 * 1024)
#define MAX_THREADS 1024                      /* per block */
#define MAX_CLUSTER 16                        /* blocks per cluster (sm_90 non-portable limit) */
#define MAX_FIBERS (MAX_THREADS * MAX_CLUSTER)
#define SMEM_POISON 0xA5                      /* fresh (uninitialised) shared memory */
#define SMEM_ALIGN 256

typedef struct { void *rsp; } ctx_t;

void m3emu_swap(ctx_t *from, ctx_t *to);
__asm__(".text\n"
        ".globl m3emu_swap\n"
        ".type m3emu_swap,@function\n"
        "m3emu_swap:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq (%rsi), %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size m3emu_swap, .-m3emu_swap\n");

enum { W_NONE, W_BLOCK, W_WARP, W_CLUSTER };

typedef struct fiber {
  ctx_t ctx;
  m3emu_thread t;
  int done, lane, warp;
  int rank;            /* its block's rank in the cluster (blockIdx.x % cluster_x) */
  int waiting;         /* W_*: the barrier it waits at, for the deadlock report */
} fiber;

typedef struct warp_state {
  uint32_t slot[32];
  int filled[32];
  int arrived;
  unsigned gen;
  int live;
} warp_state;

typedef struct block_state {
  int live;                   /* threads not yet exited */
  int arrived;                /* block barrier */
  unsigned gen;
  unsigned char *smem;        /* dynamic shared memory */
  warp_state w[MAX_THREADS / 32];
} block_state;

static fiber F[MAX_FIBERS];
static block_state B[MAX_CLUSTER];

static struct {
  unsigned char *stacks;      /* mmap'd, nstacks * STACK_BYTES, grown on demand */
  size_t nstacks;
  unsigned char *smem;        /* the blocks' dynamic shared memory, smem_cap bytes */
  size_t smem_cap;
  size_t smem_stride;         /* bytes between two blocks' buffers (>= smem_bytes, 256-aligned) */
  unsigned smem_bytes;        /* the launch's dynamic shared memory */
  int n;                      /* threads per block */
  int cx;                     /* blocks per cluster */
  int nf;                     /* fibers: n * cx */
  int clive;                  /* threads of the cluster not yet exited */
  int carrived;               /* cluster barrier */
  unsigned cgen;
  int cur;
  int in_fiber;
  int fail_fiber;             /* the fiber that failed, or -1 (the scheduler: deadlock) */
  ctx_t sched;
  m3emu_thread *curp;
  m3emu_entry fn;
  void **args;
  const char *name;
  char err[512];
  int failed;
  int progressed;
} S;

static void vfail(const char *fmt, va_list ap) {
  if (!S.failed) {
    vsnprintf(S.err, sizeof S.err, fmt, ap);
    S.fail_fiber = S.in_fiber ? S.cur : -1;
  }
  S.failed = 1;
}

__attribute__((format(printf, 1, 2))) static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(fmt, ap);
  va_end(ap);
}

const char *m3emu_last_error(void) { return S.err; }

void m3emu_set_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(S.err, sizeof S.err, fmt, ap);
  va_end(ap);
}

static void yield(void) { m3emu_swap(&F[S.cur].ctx, &S.sched); }

static void fiber_main(void) {
  fiber *me = &F[S.cur];
  S.fn(S.args);
  block_state *b = &B[me->rank];
  me->done = 1;
  b->live--;
  b->w[me->warp].live--;
  S.clive--;
  S.progressed = 1;
  /* The block is gone: its shared memory is no longer its own (a block of the
   * cluster that reads it through map_shared now reads poison; on a GPU that
   * read is undefined, hence the cluster barrier before exit). */
  if (b->live == 0 && S.cx > 1) memset(b->smem, SMEM_POISON, S.smem_stride);
  m3emu_swap(&me->ctx, &S.sched);
  __builtin_unreachable();
}

static void block_barrier(void) {
  fiber *me = &F[S.cur];
  block_state *b = &B[me->rank];
  unsigned g = b->gen;
  b->arrived++;
  S.progressed = 1;
  while (b->gen == g) {
    if (b->arrived >= b->live) { /* exited threads count as arrived */
      b->gen++;
      b->arrived = 0;
      break;
    }
    me->waiting = W_BLOCK;
    yield();
    if (S.failed) break;
  }
  me->waiting = W_NONE;
}

/* barrier.cluster.arrive.release + barrier.cluster.wait.acquire: every thread
 * of every block of the cluster; exited threads count as arrived.  Fibers
 * switch only at barriers, so the release/acquire ordering holds trivially. */
static void cluster_barrier(void) {
  if (S.cx == 1) {
    block_barrier();
    return;
  }
  fiber *me = &F[S.cur];
  unsigned g = S.cgen;
  S.carrived++;
  S.progressed = 1;
  while (S.cgen == g) {
    if (S.carrived >= S.clive) {
      S.cgen++;
      S.carrived = 0;
      break;
    }
    me->waiting = W_CLUSTER;
    yield();
    if (S.failed) break;
  }
  me->waiting = W_NONE;
}

static void warp_barrier(warp_state *w) {
  fiber *me = &F[S.cur];
  unsigned g = w->gen;
  w->arrived++;
  S.progressed = 1;
  while (w->gen == g) {
    if (w->arrived >= w->live) {
      w->gen++;
      w->arrived = 0;
      break;
    }
    me->waiting = W_WARP;
    yield();
    if (S.failed) break;
  }
  me->waiting = W_NONE;
}

static uint32_t api_shfl(uint32_t v, int src) {
  fiber *me = &F[S.cur];
  warp_state *w = &B[me->rank].w[me->warp];
  w->slot[me->lane] = v;
  w->filled[me->lane] = 1;
  warp_barrier(w);
  uint32_t r = v;
  if (src < 0 || src > 31) fail("%s: shuffle from a lane outside 0..31", S.name);
  else if (!w->filled[src]) fail("%s: shuffle reads a lane that has exited or did not take part (divergent shuffle)", S.name);
  else r = w->slot[src];
  warp_barrier(w);
  w->filled[me->lane] = 0;
  return r;
}

static uint32_t api_ballot(int p) {
  fiber *me = &F[S.cur];
  warp_state *w = &B[me->rank].w[me->warp];
  w->slot[me->lane] = p != 0;
  w->filled[me->lane] = 1;
  warp_barrier(w);
  uint32_t r = 0;
  for (int i = 0; i < 32; i++)
    if (w->filled[i] && w->slot[i]) r |= 1u << i;
  warp_barrier(w);
  w->filled[me->lane] = 0;
  return r;
}

static void api_syncwarp(void) { warp_barrier(&B[F[S.cur].rank].w[F[S.cur].warp]); }
static void api_trap(const char *what) { fail("%s: kernel trapped: %s", S.name, what); }

static void *api_dyn_smem(void) { return B[F[S.cur].rank].smem; }
static unsigned api_cluster_rank(void) { return (unsigned)F[S.cur].rank; }
static unsigned api_cluster_size(void) { return (unsigned)S.cx; }

/* mapa: the same offset in the dynamic shared memory of block `rank`. */
static void *api_map_shared(const void *p, unsigned rank) {
  const fiber *me = &F[S.cur];
  uintptr_t base = (uintptr_t)B[me->rank].smem, q = (uintptr_t)p;
  if (q < base || q - base >= S.smem_bytes) {
    fail("%s: map_shared (mapa) of %p, which is not in this block's dynamic shared memory [%p, +%u bytes): "
         "DSMEM maps dynamic shared memory only",
         S.name, p, (void *)base, S.smem_bytes);
    return (void *)(uintptr_t)p;
  }
  if (rank >= (unsigned)S.cx) {
    fail("%s: map_shared (mapa) to cluster rank %u of a cluster of %d block%s", S.name, rank, S.cx,
         S.cx == 1 ? "" : "s");
    return (void *)(uintptr_t)p;
  }
  return B[rank].smem + (q - base);
}

static m3emu_api api = {&S.curp,         block_barrier,   api_syncwarp,   api_shfl,
                        api_ballot,      api_trap,        api_dyn_smem,   cluster_barrier,
                        api_map_shared,  api_cluster_rank, api_cluster_size};
const m3emu_api *m3emu_get_api(void) { return &api; }

static void start_fiber(int i) {
  unsigned char *top = S.stacks + (size_t)(i + 1) * STACK_BYTES;
  top = (unsigned char *)((uintptr_t)top & ~(uintptr_t)15);
  void **sp = (void **)top;
  *--sp = NULL;                 /* fake return address of fiber_main */
  *--sp = (void *)fiber_main;   /* where m3emu_swap's ret lands */
  for (int r = 0; r < 6; r++) *--sp = NULL; /* rbp rbx r12..r15 */
  F[i].ctx.rsp = sp;
}

/* Stacks for n fibers: address space only (MAP_NORESERVE); a stack costs
 * memory for the pages its fiber touches. */
static int ensure_stacks(size_t n) {
  if (n <= S.nstacks) return 0;
  if (S.stacks) munmap(S.stacks, S.nstacks * STACK_BYTES);
  S.stacks = NULL;
  S.nstacks = 0;
  void *p = mmap(NULL, n * STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return -1;
  S.stacks = p;
  S.nstacks = n;
  return 0;
}

static int ensure_smem(size_t bytes) {
  if (bytes <= S.smem_cap) return 0;
  free(S.smem);
  S.smem = aligned_alloc(SMEM_ALIGN, bytes);
  S.smem_cap = S.smem ? bytes : 0;
  return S.smem ? 0 : -1;
}

static void deadlock(void) {
  if (S.cx == 1) {
    fail("%s: every live thread waits at a barrier that cannot complete (divergent __syncthreads or warp exchange)",
         S.name);
    return;
  }
  int at[4] = {0, 0, 0, 0};
  for (int i = 0; i < S.nf; i++)
    if (!F[i].done) at[F[i].waiting]++;
  fail("%s: every live thread of the cluster waits at a barrier that cannot complete (divergent __syncthreads, "
       "warp exchange or cluster barrier): %d at __syncthreads, %d at warp exchanges, %d at the cluster barrier",
       S.name, at[W_BLOCK], at[W_WARP], at[W_CLUSTER]);
}

int m3emu_launch(m3emu_entry fn, m3emu_dim3 grid, m3emu_dim3 block, unsigned cluster_x, unsigned smem_bytes,
                 void **args, const char *name) {
  S.failed = 0;
  S.err[0] = 0;
  S.name = name ? name : "kernel";
  uint64_t nb = (uint64_t)block.x * block.y * block.z;
  if (nb == 0 || nb > MAX_THREADS) {
    snprintf(S.err, sizeof S.err, "%s: block of %llu threads (%u,%u,%u)", S.name, (unsigned long long)nb, block.x,
             block.y, block.z);
    return -1;
  }
  if (cluster_x < 1 || cluster_x > MAX_CLUSTER || grid.x % cluster_x) {
    snprintf(S.err, sizeof S.err, "%s: cluster of %u blocks for a grid of %u along x (1..%d, dividing the grid)",
             S.name, cluster_x, grid.x, MAX_CLUSTER);
    return -1;
  }
  const int n = (int)nb, cx = (int)cluster_x, nf = n * cx;
  size_t stride = ((size_t)(smem_bytes < 16 ? 16 : smem_bytes) + SMEM_ALIGN - 1) & ~(size_t)(SMEM_ALIGN - 1);
  if (ensure_stacks((size_t)nf) || ensure_smem(stride * (size_t)cx)) {
    snprintf(S.err, sizeof S.err, "emulator: no memory for %d fiber stacks and %d x %zu bytes of shared memory", nf,
             cx, stride);
    return -1;
  }
  S.fn = fn;
  S.args = args;
  S.n = n;
  S.cx = cx;
  S.nf = nf;
  S.smem_bytes = smem_bytes;
  S.smem_stride = stride;
  for (int r = 0; r < cx; r++) B[r].smem = S.smem + (size_t)r * stride;
  for (unsigned bz = 0; bz < grid.z; bz++)
    for (unsigned by = 0; by < grid.y; by++)
      for (unsigned bx0 = 0; bx0 < grid.x; bx0 += cluster_x) {
        S.clive = nf;
        S.carrived = 0;
        for (int r = 0; r < cx; r++) {
          block_state *b = &B[r];
          b->live = n;
          b->arrived = 0;
          memset(b->w, 0, sizeof(warp_state) * (size_t)((n + 31) / 32));
          memset(b->smem, SMEM_POISON, stride);
        }
        for (int i = 0; i < nf; i++) {
          fiber *f = &F[i];
          const int r = i / n, t = i % n;
          memset(f, 0, sizeof *f);
          f->t.threadIdx = (m3emu_dim3){(unsigned)t % block.x, ((unsigned)t / block.x) % block.y,
                                        (unsigned)t / (block.x * block.y)};
          f->t.blockIdx = (m3emu_dim3){bx0 + (unsigned)r, by, bz};
          f->t.blockDim = block;
          f->t.gridDim = grid;
          f->lane = t & 31;
          f->warp = t / 32;
          f->rank = r;
          B[r].w[t / 32].live++;
          start_fiber(i);
        }
        while (S.clive > 0 && !S.failed) {
          S.progressed = 0;
          for (int i = 0; i < nf && !S.failed; i++) {
            if (F[i].done) continue;
            S.cur = i;
            S.curp = &F[i].t;
            S.in_fiber = 1;
            m3emu_swap(&S.sched, &F[i].ctx);
            S.in_fiber = 0;
          }
          if (!S.progressed && S.clive > 0 && !S.failed) deadlock();
        }
        if (S.failed) {
          size_t l = strlen(S.err);
          if (cx == 1)
            snprintf(S.err + l, sizeof S.err - l, " (block %u,%u,%u)", bx0, by, bz);
          else if (S.fail_fiber >= 0)
            snprintf(S.err + l, sizeof S.err - l, " (block %u,%u,%u: rank %d of the cluster of blocks %u..%u)",
                     F[S.fail_fiber].t.blockIdx.x, by, bz, F[S.fail_fiber].rank, bx0, bx0 + cluster_x - 1);
          else
            snprintf(S.err + l, sizeof S.err - l, " (cluster of blocks %u..%u,%u,%u)", bx0, bx0 + cluster_x - 1, by,
                     bz);
          return -1;
        }
      }
  return 0;
}
