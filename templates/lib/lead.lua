-- templates/lib/lead.lua - a kernel's lead-in under programmatic dependent
-- launch (lib/prelude.lua M3_GRID_WAIT): statements in front of the grid wait
-- that run while the previous kernel of the stream still does.  Kernel n+1 is
-- launched once every CTA of kernel n passed its own wait, so kernels before n
-- are complete - but a kernel's inputs are safe to read early only if NO
-- kernel of the stream writes them (n may be a library kernel with other PDL
-- habits): in m3kit's decode step, token_seq, positions, seq_lens and the
-- block tables (host copies made before the step's first kernel); or where
-- the key vouches that the writer ran two or more launches back, among
-- m3kit's own kernels (mxfp8.lua settled=1: the MoE down GEMV's expert ids).  A lead-in
-- writes nothing but shared memory, and may prefetch into L2 anything (L2 is
-- where every SM's writes meet, so a prefetch never serves stale data).
-- Emitted only for tiles that have a lead-in, so other tiles' code is the same
-- with or without this file.  Kernels mark the lead-in with M3_LEAD_IN; as
-- their first statement (tests/check_jit.c checks they reach the wait), and
-- their launcher's header names the inputs read before the wait.
local L = {}

L.defs = [[
/* A kernel's lead-in: statements before M3_GRID_WAIT() that read only launch
 * inputs no kernel of the stream writes (templates/lib/lead.lua). */
#define M3_LEAD_IN ((void)0)
/* bytes (a multiple of 16, 16-byte aligned) at p into L2; no architectural
 * effect (the emulator has no cache). */
M3_DEV void prefetch_l2(const void *p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p, (void)bytes;
#endif
}
]]

return L
