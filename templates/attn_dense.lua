-- templates/attn_dense.lua - dense causal GQA over the paged KV cache for the
-- dense layers (spec §6.3): query t attends to every key j < positions[t] + 1
-- of its sequence.  Decode is flash-decoding: the history is split over CTAs
-- so that one long sequence fills every SM, with a last-CTA log-sum-exp merge;
-- prefill gives each warp one query token.  The engine is
-- templates/lib/attn_mma.lua (shared with attn_sparse.lua, so "sparse with
-- every block selected == dense" holds by construction).
local A = m3.include("lib/attn_mma")
local P = m3.include("lib/prelude")

local T = {}
T.name = "attn_dense"
T.axes = {
  {"mode", {"decode", "prefill"}},
  {"kv", {"bf16", "e4m3"}},
  {"nq", "int"}, {"nkv", "int"}, {"hd", "int"}, {"bs", "int"},
}
T.tiles = {
  {"warps", {1, 2, 4, 8}},
  {"ctas", {1, 2, 4}},
  {"depth", {1, 2}},               -- decode: K/V tiles in flight a warp (lib/attn_mma.lua attend)
  {"cvt", {"alu", "hw"}},          -- e4m3 cache -> fp16: bit moves, or cvt.rn.f16x2.e4m3x2
  {"lead", {0, 1}},                -- decode: 1 = the token's metadata and an L2 prefetch of its first tiles before
                                   -- the grid wait (lib/attn_mma.lua; attn_sparse has no such tile: it reads sel first)
  {"merge", {"fence", "acqrel", "cluster"}},  -- decode: how the splits merge: a hand-over to the last CTA (fence, acqrel), or a thread-block cluster (lib/attn_mma.lua MERGE)
}

function T.valid(k, t, arch)
  return A.valid_common(k, t, arch)
end

-- Decode: 8 warps x ~210 registers fill an SM's register file, one CTA per
-- SM; with ctas=1 a long sequence gets 132/nkv = 33 splits per KV head, one
-- wave of equal CTAs, each warp keeping one 8 KiB tile of loads in flight
-- (64 KiB per SM, about twice what 4.28 TB/s x ~1 us of latency needs), and
-- the merging CTA reads only 33 partials (264 KiB) with 256 threads.  merge=acqrel: one fence round trip less a
-- split (lib/attn_mma.lua MERGE).
function T.default_tile(k, arch)
  if k.mode == "decode" then return {warps = 8, ctas = 1, depth = 1, cvt = "alu", lead = 0, merge = "acqrel"} end
  return {warps = 4, ctas = 1, depth = 1, cvt = "alu", lead = 0, merge = "fence"}
end

function T.variants(c)
  local out = {}
  if c.has_dense == 0 then return out end
  for _, mode in ipairs({"decode", "prefill"}) do
    for _, kv in ipairs({"bf16", "e4m3"}) do
      out[#out + 1] = {mode = mode, kv = kv, nq = c.nq, nkv = c.nkv, hd = c.hd, bs = c.bs}
    end
  end
  return out
end

function T.render(k, t, arch, sym)
  local r = A.render(k, t, arch, sym, false, 1)
  r.source = P.all(arch) .. r.source
  return r
end

return T
