/* emu_sched.c - fibers, barriers and warp exchange of the CPU emulator (see
 * emu.h).  One OS thread runs a block's CUDA threads as fibers with a
 * hand-written x86-64 context switch (swapcontext would make a syscall per
 * switch).  A fiber runs until it reaches a barrier, then yields; the scheduler
 * cycles over the block until every fiber has exited. */
#include "emu/emu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STACK_BYTES (128 * 1024)
#define MAX_THREADS 1024

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

typedef struct fiber {
  ctx_t ctx;
  m3emu_thread t;
  int done, lane, warp;
  unsigned wait_gen;   /* barrier generation this fiber waits to see pass */
  int waiting;         /* 0 none, 1 block barrier, 2 warp barrier */
} fiber;

typedef struct warp_state {
  uint32_t slot[32];
  int filled[32];
  int arrived;
  unsigned gen;
  int live;
} warp_state;

static struct {
  fiber f[MAX_THREADS];
  unsigned char *stacks;
  int n;                      /* threads in the block */
  int live;                   /* not yet exited */
  int cur;
  ctx_t sched;
  m3emu_thread *curp;
  int arrived;                /* block barrier */
  unsigned gen;
  warp_state w[MAX_THREADS / 32];
  m3emu_entry fn;
  void **args;
  char err[512];
  int failed;
  int progressed;
} S;

static void fail(const char *fmt, const char *a) {
  if (!S.failed) snprintf(S.err, sizeof S.err, fmt, a);
  S.failed = 1;
}

const char *m3emu_last_error(void) { return S.err; }

static void yield(void) { m3emu_swap(&S.f[S.cur].ctx, &S.sched); }

static void fiber_main(void) {
  fiber *me = &S.f[S.cur];
  S.fn(S.args);
  me->done = 1;
  S.live--;
  S.w[me->warp].live--;
  S.progressed = 1;
  m3emu_swap(&me->ctx, &S.sched);
  __builtin_unreachable();
}

static void block_barrier(void) {
  fiber *me = &S.f[S.cur];
  unsigned g = S.gen;
  S.arrived++;
  S.progressed = 1;
  while (S.gen == g) {
    if (S.arrived >= S.live) { /* exited threads count as arrived */
      S.gen++;
      S.arrived = 0;
      break;
    }
    me->waiting = 1;
    yield();
    if (S.failed) break;
  }
  me->waiting = 0;
}

static void warp_barrier(warp_state *w) {
  fiber *me = &S.f[S.cur];
  unsigned g = w->gen;
  w->arrived++;
  S.progressed = 1;
  while (w->gen == g) {
    if (w->arrived >= w->live) {
      w->gen++;
      w->arrived = 0;
      break;
    }
    me->waiting = 2;
    yield();
    if (S.failed) break;
  }
  me->waiting = 0;
}

static uint32_t api_shfl(uint32_t v, int src) {
  fiber *me = &S.f[S.cur];
  warp_state *w = &S.w[me->warp];
  w->slot[me->lane] = v;
  w->filled[me->lane] = 1;
  warp_barrier(w);
  uint32_t r = v;
  if (src < 0 || src > 31) fail("%s: shuffle from a lane outside 0..31", "kernel");
  else if (!w->filled[src]) fail("%s: shuffle reads a lane that has exited or did not take part (divergent shuffle)", "kernel");
  else r = w->slot[src];
  warp_barrier(w);
  w->filled[me->lane] = 0;
  return r;
}

static uint32_t api_ballot(int p) {
  fiber *me = &S.f[S.cur];
  warp_state *w = &S.w[me->warp];
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

static void api_syncwarp(void) { warp_barrier(&S.w[S.f[S.cur].warp]); }
static void api_trap(const char *what) { fail("kernel trapped: %s", what); }

static m3emu_api api = {&S.curp, block_barrier, api_syncwarp, api_shfl, api_ballot, api_trap};
const m3emu_api *m3emu_get_api(void) { return &api; }

static void start_fiber(int i) {
  unsigned char *top = S.stacks + (size_t)(i + 1) * STACK_BYTES;
  top = (unsigned char *)((uintptr_t)top & ~(uintptr_t)15);
  void **sp = (void **)top;
  *--sp = NULL;                 /* fake return address of fiber_main */
  *--sp = (void *)fiber_main;   /* where m3emu_swap's ret lands */
  for (int r = 0; r < 6; r++) *--sp = NULL; /* rbp rbx r12..r15 */
  S.f[i].ctx.rsp = sp;
}

int m3emu_launch(m3emu_entry fn, m3emu_dim3 grid, m3emu_dim3 block, void **args, const char *name) {
  int n = (int)(block.x * block.y * block.z);
  S.failed = 0;
  S.err[0] = 0;
  if (n <= 0 || n > MAX_THREADS) {
    snprintf(S.err, sizeof S.err, "%s: block of %d threads", name, n);
    return -1;
  }
  if (!S.stacks && !(S.stacks = malloc((size_t)MAX_THREADS * STACK_BYTES))) {
    snprintf(S.err, sizeof S.err, "emulator: no memory for fiber stacks");
    return -1;
  }
  S.fn = fn;
  S.args = args;
  for (unsigned bz = 0; bz < grid.z; bz++)
    for (unsigned by = 0; by < grid.y; by++)
      for (unsigned bx = 0; bx < grid.x; bx++) {
        S.n = S.live = n;
        S.arrived = 0;
        memset(S.w, 0, sizeof(warp_state) * (size_t)((n + 31) / 32));
        for (int i = 0; i < n; i++) {
          fiber *f = &S.f[i];
          memset(f, 0, sizeof *f);
          f->t.threadIdx = (m3emu_dim3){(unsigned)i % block.x, ((unsigned)i / block.x) % block.y,
                                        (unsigned)i / (block.x * block.y)};
          f->t.blockIdx = (m3emu_dim3){bx, by, bz};
          f->t.blockDim = block;
          f->t.gridDim = grid;
          f->lane = i & 31;
          f->warp = i / 32;
          S.w[i / 32].live++;
          start_fiber(i);
        }
        while (S.live > 0 && !S.failed) {
          S.progressed = 0;
          for (int i = 0; i < n && !S.failed; i++) {
            if (S.f[i].done) continue;
            S.cur = i;
            S.curp = &S.f[i].t;
            m3emu_swap(&S.sched, &S.f[i].ctx);
          }
          if (!S.progressed && S.live > 0) {
            fail("%s: every live thread waits at a barrier that cannot complete (divergent __syncthreads or warp exchange)", name);
          }
        }
        if (S.failed) {
          size_t l = strlen(S.err);
          snprintf(S.err + l, sizeof S.err - l, " (block %u,%u,%u)", bx, by, bz);
          return -1;
        }
      }
  return 0;
}
