-- templates/attn_sparse.lua - block-sparse GQA over the selected KV blocks
-- (spec §6.2): query t, head h attends to the visible keys (j <= pos, j < T)
-- of the logical blocks sel[h / (nq/nkv), t, 0..topk), each mapped through the
-- block table.  Entries < 0, >= the token's visible block count, or repeating
-- an earlier entry contribute nothing and never index the block table (known
-- faults #6, #8).  The engine (GQA group per warp, mma.sync, exp2 online
-- softmax, bf16 P, split-K with a last-CTA log-sum-exp merge) is
-- templates/lib/attn_mma.lua; this file declares the key space.
local A = m3.include("lib/attn_mma")
local P = m3.include("lib/prelude")

local T = {}
T.name = "attn_sparse"
T.axes = {
  {"mode", {"decode", "prefill"}},  -- schedule: split-K per token, or one warp per token
  {"kv", {"bf16", "e4m3"}},         -- KV cache dtype (e4m3 dequantised x 1.0)
  {"nq", "int"}, {"nkv", "int"}, {"hd", "int"}, {"bs", "int"}, {"topk", "int"},
}
T.tiles = {
  {"warps", {1, 2, 4, 8}},          -- warps per CTA: decode - sharing a split; prefill - tokens per CTA
  {"ctas", {1, 2, 4}},              -- decode: split-K target CTAs per SM (fill the GPU at batch 1)
  {"depth", {1, 2}},                -- decode: K/V tiles in flight a warp (lib/attn_mma.lua attend)
  {"cvt", {"alu", "hw"}},           -- e4m3 cache -> fp16: bit moves, or cvt.rn.f16x2.e4m3x2
  {"merge", {"fence", "acqrel", "cluster"}},  -- decode: how the splits merge: a hand-over to the last CTA (fence, acqrel), or a thread-block cluster (lib/attn_mma.lua MERGE)
}

function T.valid(k, t, arch)
  local ok, why = A.valid_common(k, t, arch)
  if not ok then return false, why end
  if k.topk < 1 or k.topk > 32 then return false, "topk must be in [1, 32] (one selection entry per lane)" end
  return true
end

-- Decode: at batch 1 a KV head's 16 x 128 selected keys make 128 16-key
-- tiles; 8 warps per CTA with one tile each give 16 splits per KV head (64
-- CTAs), each CTA has its whole 64 KiB in flight at once, and the merging CTA
-- reads only 16 partials (128 KiB) per head.  merge=acqrel: one fence round
-- trip less a split (lib/attn_mma.lua MERGE).
function T.default_tile(k, arch)
  if k.mode == "decode" then return {warps = 8, ctas = 1, depth = 1, cvt = "alu", merge = "acqrel"} end
  return {warps = 4, ctas = 1, depth = 1, cvt = "alu", merge = "fence"}
end

function T.variants(c)
  local out = {}
  if c.has_sparse == 0 then return out end
  for _, mode in ipairs({"decode", "prefill"}) do
    for _, kv in ipairs({"bf16", "e4m3"}) do
      out[#out + 1] = {mode = mode, kv = kv, nq = c.nq, nkv = c.nkv, hd = c.hd, bs = c.bs, topk = c.topk}
    end
  end
  return out
end

function T.render(k, t, arch, sym)
  local r = A.render(k, t, arch, sym, true, k.topk)
  r.source = P.all(arch) .. r.source
  return r
end

return T
