-- templates/lib/cluster.lua - thread-block clusters (sm_90): the barrier over a
-- cluster's CTAs and loads from another CTA's shared memory (distributed
-- shared memory), for kernels that hand partial results over inside a
-- cluster instead of through L2: decode attention's merge=cluster, and
-- rmsnorm's cluster tiles (a row's sum of squares over the CTAs that share
-- it).  Emitted only by tiles that use it, so other tiles' code is
-- the same with or without this file; its text is that of the attention
-- records timed with it (their code hashes), so changes go in the users' own
-- definitions.
local C = {}

C.defs = [[
/* Thread-block clusters (sm_90): the barrier over all CTAs of the cluster
 * (release/acquire: shared-memory stores before it are seen by every CTA's
 * loads after it), the cluster's size, and loads from the shared memory of
 * the cluster's CTA `rank` at the address p has in this CTA's (mapa). */
#define CLUSTER_MAX 16
#ifdef __CUDA_ARCH__
M3_DEV void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
M3_DEV unsigned cluster_nctarank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
M3_DEV unsigned dsmem_addr(const void *p, unsigned rank) {
  unsigned a, d;
  asm("{ .reg .u64 g; cvta.to.shared.u64 g, %1; cvt.u32.u64 %0, g; }" : "=r"(a) : "l"(p));
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(rank));
  return d;
}
M3_DEV float ld_dsmem(const float *p, unsigned rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(dsmem_addr(p, rank)) : "memory");
  return v;
}
M3_DEV float4 ld_dsmem4(const float *p, unsigned rank) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(dsmem_addr(p, rank)) : "memory");
  return v;
}
#else /* the CPU emulator runs a cluster's CTAs together (docs/emulator.md) */
M3_DEV void cluster_sync() { m3emu_cluster_sync(); }
M3_DEV unsigned cluster_nctarank() { return m3emu_cluster_nctarank(); }
M3_DEV float ld_dsmem(const float *p, unsigned rank) { return *m3emu_map_shared(p, rank); }
M3_DEV float4 ld_dsmem4(const float *p, unsigned rank) { return *(const float4 *)m3emu_map_shared(p, rank); }
#endif
]]

return C
