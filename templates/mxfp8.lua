-- templates/mxfp8.lua - linear layers straight from the stored weights
-- (spec §8, §10.1), two ops:
--   dequant  MXFP8 -> bf16: out = bf16(e4m3 * 2^(E8M0 - 127)), exact
--            (m3_ref_mxfp8_dequant bit for bit; NaN codes stay NaN);
--   gemv     y[t, r] = sum_c x[t, c] * W[r, c], fp32 accumulation, for the
--            bandwidth-bound decode shapes (n <= 8 tokens): W8A16 (MXFP8
--            weights read as e4m3 + E8M0, never dequantised to memory), W16A16
--            (bf16 weights: batch-1 decode is bandwidth-bound and cuBLAS's GEMV
--            is often slower), and fp32 weights (the fp32 router, §7.2).
--            moe=1 reads each (token, expert) pair's weight through a pointer
--            table indexed by the routed expert id (grid.y = pair), so all the
--            chosen experts of a decode step stream in one launch.
--
-- GEMV design (memory-bound).  bf16 and fp32 weights: each warp owns `rpw`
-- rows; lane l streams the 16-byte chunks l, l+32, ... of each row (512
-- contiguous bytes per warp and row per step, `unroll` steps of loads in
-- flight before first use), so every weight byte is read once with 16-byte
-- coalesced non-L1-allocating loads; x is staged once per CTA into shared
-- memory as fp32 (bank-conflict swizzled) and FMA'd in fp32.
-- MXFP8 (W8A16) weights go through the tensor cores instead: decoding and
-- FMA-ing every e4m3 byte on the integer pipe held the FMA design at 61-72% of
-- HBM bandwidth (ncu on the H200: ALU pipe 58% busy, 2.7 IPC).  A CTA owns
-- `rpw` tiles of 16 rows and its `warps` split the columns (interleaved runs
-- of `unroll` 32-column blocks; a shared-memory sum at the end): a warp per 16
-- rows alone left too few warps streaming (device run 5: 20-55% of HBM).
-- Per 32-column E8M0 block each lane loads 8 bytes of
-- rows g and g+8 (lane = 4g + tq, the quad's 4 lanes cover the block: 8 full
-- 32-byte sectors per warp load), decodes them to fp16 with bit moves (exact,
-- x 2^-8; or cvt.rn.f16x2.e4m3x2 with cvt=hw, exact and unscaled) and runs two
-- mma.m16n8k16 (fp32 accumulate) against x, the mma's 8 columns being up to 8
-- tokens; the block's partial sums are then scaled by the rows' E8M0 factors
-- (exact powers of two) into fp32 accumulators.  x is staged in shared memory
-- as fp16 times a per-token power of two 2^sh that puts max|x| in [2^14, 2^15)
-- (a bf16 value there is exact in fp16; only values below 2^-24 of the token's
-- max lose bits) in the dims order the decoded weights pair them, and sh is
-- undone on the output.  So products are exact, sums are fp32 in another order:
-- a bf16 GEMM with the dequantised weight up to summation order (tests: rel.
-- L2 <= 1e-2 against m3_ref_gemm_w8a16).  Preconditions: |x| < 2^100 and no
-- e4m3 NaN codes (0x7F/0xFF) in the weight (quantisers saturate; cvt=alu reads
-- them as +-480, cvt=hw as NaN).
--
-- Fusions (W8A16 MoE GEMV, opt-in: runtime/op_ffn.c M3KIT_MOE_FUSE): the
-- SwiGLU and combine launches between and after the MoE GEMVs cost ~1.5-3 us
-- each in the step's chain of kernels, 57 MoE layers a token; in the
-- epilogues they cost about as much (device runs 45-47: the combine 3 us of
-- the down GEMV on the H200).  Both are epilogues on the finished row tiles, so
-- the work is spread over the CTAs and done once (staging SwiGLU(gu) as the
-- down GEMV's x instead - every CTA computing a whole row of expf - cost 10
-- us a launch, device run 44).  Each CTA counts its finished tiles in
-- tile_count words (after a __threadfence of its stores); the CTA whose count
-- completes a word reads the rows it pairs through L2 (ld.cg), writes, and
-- zeroes the word for the next launch.  act=swiglu (gate|up): gate tile j and
-- up tile j meet in one word; the second writes act = bf16(SwiGLU-OAI(gate,
-- up)) of those rows - the SwiGLU kernel's exact values (lib/ffn.lua's one
-- text).  combine=1 (down): a row tile's word counts every pair; the last
-- writes out = bf16(sum_k w_k y_k + y_shared) in moe_combine's order and
-- roundings.  A pair skipped for a bad expert id still counts its tiles.
local P = m3.include("lib/prelude")
local F = m3.include("lib/ffn")
local I = m3.include("lib/indexer")
local R = m3.include("lib/route")

local LEAD = m3.include("lib/lead")

local T = {}
T.name = "mxfp8"
T.axes = {
  {"op", {"dequant", "gemv"}},
  {"w", {"e4m3", "bf16", "f32"}},   -- weight storage; e4m3 = MXFP8 (E8M0 scale per 32 along a row)
  {"out", {"bf16", "f32"}},         -- y dtype (f32: router logits)
  {"cols", "int"},                  -- reduction length (in_features)
  {"nmax", {1, 2, 4, 8}},           -- most tokens per launch (accumulators are compile-time)
  {"moe", {0, 1}},                  -- per-pair expert weights through a pointer table
  -- Epilogues of the MoE decode GEMVs (W8A16; opt-in, runtime/op_ffn.c M3KIT_MOE_FUSE):
  {"act", {"none", "swiglu"}},      -- swiglu (gate|up): also writes act = SwiGLU-OAI(gate, up) [pairs, rows/2] (§7.3)
  {"alpha_e6", "int"},              -- act=swiglu: its constants x 10^6 in the key (fault 22); 0 with act=none
  {"limit_e6", "int"},
  {"beta_e6", "int"},
  {"combine", {0, 1}},              -- 1 (down): the last CTA to finish a row tile sums the pairs into out (§12.6)
  -- MoE: 1 = the launcher vouches that ids (and the pointer tables) were written
  -- two or more launches back on the stream, so they are complete when this
  -- kernel starts (lib/lead.lua): the down GEMV, after route -> gate|up
  -- [-> SwiGLU].  It lets lead=1 tiles resolve their experts and stream the
  -- first weights before the grid wait.  The code is the same either way.
  {"settled", {0, 1}},
  -- The fp32 router GEMV's route epilogue (opt-in, M3KIT_MOE_FUSE=route): the
  -- last CTA to finish reads the logits [n, route_e] back from L2 and selects
  -- each token's route_k experts exactly as moe_route's route stage
  -- (lib/route.lua, m3_ref_route): a launch a MoE layer fewer, but no faster
  -- on an H100 (device runs 58-59, 65: runtime/op_ffn.c).  0 = none.
  {"route_e", "int"},               -- experts = the GEMV's rows
  {"route_k", "int"},               -- top-k
  {"route_renorm", {0, 1}},         -- 1: weights renormalised over the chosen (M3)
}
T.tiles = {
  {"warps", {2, 4, 8, 16}},         -- warps per CTA
  {"rpw", {1, 2, 4}},               -- rows per warp (x reuse from shared memory)
  {"unroll", {1, 2, 4, 8}},         -- loads in flight per row: 16-byte steps (bf16, f32), 32-column blocks (e4m3)
  {"cvt", {"alu", "hw"}},           -- e4m3 -> fp16 (W8A16 GEMV): bit moves, or cvt.rn.f16x2.e4m3x2
  {"pipe", {1, 2, 3, 4}},           -- W8A16 GEMV: 1 = load then compute; 2 = the next step's loads in registers
                                    -- during this step's mma; 3, 4 = a per-warp cp.async ring of that many stages
  {"tpc", {0, 1, 2, 3, 4, 6, 8}},   -- W8A16 GEMV with the ring: 16 x rpw-row tiles per CTA (x staged once for all);
                                    -- 0 = balanced: as many CTAs as the SMs hold at once, each 1/G of all tiles;
                                    -- 3 and 6 even out the CTAs per SM (ncu, device run 24: the MoE down's 192
                                    -- CTAs of tpc=8 put 2 on 60 SMs and 1 on 72; gate|up's 96 left 36 SMs idle)
  {"lead", {0, 1}},                 -- bf16 / fp32 GEMV (non-MoE): 1 = the weight rows sent toward L2 before the grid
                                    -- wait (one bulk prefetch a row).  W8A16 GEMV with the ring: 1 = the ring's first stages are issued before the
                                    -- grid wait, while the previous kernel still runs (lib/lead.lua): every CTA's
                                    -- (non-MoE, or MoE with settled=1), or the shared expert's CTAs' (MoE, settled=0, tpc=1:
                                    -- the routed ones need the router's ids; the shared pairs' CTAs come first)
  {"lean", {0, 1}},                 -- W8A16 GEMV with the ring: 1 = fewer instructions a block (RING_COMPUTE_LEAN)
  {"ksplit", {1, 2, 4, 8, 16}},     -- bf16 / fp32 GEMV: warps a row's columns are split over (partial sums reduced
                                    -- in shared memory): a short matrix (the router's 128 rows) then has many
                                    -- warps' loads in flight, not 128 warps' (moe/router: 7.2 -> 3.2 us a layer with
                                    -- the default ksplit=8, lead=1; the step -0.24 ms on an H100, device runs 56, 59).
                                    -- It orders a row's fp32 sum: the router's logits, so an expert choice at a
                                    -- near-tie, can differ with the tile (as with any GEMV tile; m3_ref_route's
                                    -- selection of the logits it is given is exact)
}

-- Opt-in dynamic shared memory per block, by SM generation.
local function smem_limit(arch)
  local sm = m3.sm(arch)
  if sm >= 120 then return 101376 end
  if sm >= 90 then return 232448 end
  if sm == 80 or sm == 87 then return 166912 end
  return 101376
end

-- Staged x: fp32 for the FMA GEMVs; fp16 rows padded by 16 bytes (no bank
-- conflicts between the tokens' rows) for the tensor-core W8A16 GEMV.
-- The cp.async ring (pipe >= 3): per warp `pipe` stages, each the weights of
-- its 16 x rpw rows for `unroll` blocks (rows padded by 32 bytes: the 8-byte
-- fragment reads of a half-warp then hit 32 distinct banks) + their E8M0 bytes.
local function ring_stage(t)
  return t.rpw * 16 * (t.unroll * 32 + 32) + t.rpw * 16 * t.unroll
end
local function gemv_smem(k, t)
  if k.w == "e4m3" then
    local ring = (t and t.pipe >= 3) and t.warps * t.pipe * ring_stage(t) or 0
    local nxs = (t and k.moe == 1 and t.pipe >= 3 and t.tpc == 0) and 2 or k.nmax   -- NXS
    return nxs * (k.cols * 2 + 16) + ring
  end
  return k.nmax * k.cols * 4
end

-- bf16 / fp32 GEMV: a row's steps of 32 16-byte chunks (gemv_body STEPS)
local function gemv_steps(k)
  local epc = k.w == "f32" and 4 or (k.w == "bf16" and 8 or 16)
  return (k.cols // epc + 31) // 32
end

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+" end
  if k.cols < 1 then return false, "cols must be positive" end
  if k.act == "none" then
    if k.alpha_e6 ~= 0 or k.limit_e6 ~= 0 or k.beta_e6 ~= 0 then
      return false, "alpha_e6, limit_e6, beta_e6 are act=swiglu's constants: 0 with act=none"
    end
  elseif k.limit_e6 < 0 then
    return false, "the clamp limit must be >= 0"
  end
  if k.route_e ~= 0 or k.route_k ~= 0 or k.route_renorm ~= 0 then
    if k.op ~= "gemv" or k.w ~= "f32" or k.out ~= "f32" or k.moe ~= 0 then
      return false, "route_e, route_k, route_renorm are the fp32 router GEMV's route epilogue (op=gemv, w=f32, out=f32, moe=0)"
    end
    if k.route_e < 1 or k.route_e > 1024 then return false, "route_e (experts) must be in [1, 1024] (32 per lane)" end
    if k.route_k < 1 or k.route_k > k.route_e or k.route_k > 16 then
      return false, "route_k must be in [1, min(route_e, 16)]"
    end
  end
  if k.settled == 1 and k.moe ~= 1 then
    return false, "settled=1 vouches for the MoE GEMV's expert ids (moe=1); a non-MoE GEMV has none"
  end
  if (k.combine == 1 or k.act ~= "none") and (k.op ~= "gemv" or k.w ~= "e4m3" or k.moe ~= 1) then
    return false, "act=swiglu and combine=1 are the W8A16 MoE GEMV's epilogues (op=gemv, w=e4m3, moe=1)"
  end
  if k.combine == 1 and k.act ~= "none" then
    return false, "act=swiglu is the gate|up launch's epilogue, combine=1 the down launch's: not both"
  end
  if k.op == "dequant" then
    if k.w ~= "e4m3" or k.out ~= "bf16" or k.nmax ~= 1 or k.moe ~= 0 then
      return false, "dequant is e4m3 -> bf16 only: use w=e4m3, out=bf16, nmax=1, moe=0"
    end
    if k.cols % 32 ~= 0 then return false, "MXFP8 rows are blocks of 32: cols % 32 must be 0" end
    if t.rpw ~= 1 or t.unroll ~= 1 or t.cvt ~= "alu" or t.pipe ~= 1 or t.tpc ~= 1 or t.lead ~= 0 or t.lean ~= 0
       or t.ksplit ~= 1 then
      return false, "dequant uses only the warps tile: rpw=1, unroll=1, cvt=alu, pipe=1, tpc=1, lead=0, lean=0, ksplit=1"
    end
    return true
  end
  if t.ksplit ~= 1 then
    if k.w == "e4m3" then return false, "ksplit is the bf16 / fp32 GEMV's (the W8A16 GEMV's warps split the columns)" end
    if t.warps % t.ksplit ~= 0 then return false, "ksplit must divide warps" end
    if t.ksplit > gemv_steps(k) then
      return false, string.format("ksplit %d > the row's %d steps of 32 16-byte chunks", t.ksplit, gemv_steps(k))
    end
  end
  if t.lead == 1 and k.w ~= "e4m3" then
    -- bf16 / fp32: the lead-in sends the warp's weight rows toward L2 (one
    -- bulk prefetch a row) before the wait; x is read after it.
    if k.moe ~= 0 then return false, "lead=1 on the bf16 / fp32 GEMV: non-MoE only (a MoE pair's weights need its id)" end
    if m3.sm(arch) < 90 then return false, "lead=1 overlaps the previous kernel through programmatic dependent launch (sm_90+)" end
  elseif t.lead == 1 then
    -- The weights are the only input no kernel of the stream writes; a MoE
    -- launch needs the router's expert ids first, unless they were written
    -- two launches back (settled=1), or for the shared expert's pairs.
    if t.pipe < 3 then return false, "lead=1 is the W8A16 ring's (w=e4m3, pipe >= 3)" end
    if k.moe ~= 0 and k.settled ~= 1 and t.tpc ~= 1 then
      return false, "lead=1 on a MoE launch whose ids come from the previous kernel (settled=0) starts only the " ..
                    "shared expert's CTAs early, in the one-tile loop: tpc=1"
    end
    if m3.sm(arch) < 90 then return false, "lead=1 overlaps the previous kernel through programmatic dependent launch (sm_90+)" end
  end
  if t.pipe ~= 1 and k.w ~= "e4m3" then return false, "pipe=2 is the W8A16 (e4m3) GEMV's; bf16/fp32 use pipe=1" end
  if t.pipe == 2 and t.rpw * t.unroll > 4 then
    return false, "pipe=2 holds two steps of weights: rpw x unroll <= 4 (registers)"
  end
  if t.pipe >= 3 then
    if m3.sm(arch) < 80 then return false, "cp.async needs sm_80+" end
    if t.unroll ~= 4 and t.unroll ~= 8 then
      return false, "the cp.async ring copies a row's E8M0 bytes in 4-byte pieces: unroll 4 or 8"
    end
    if (k.cols // 32) % t.unroll ~= 0 then
      return false, "the cp.async ring has no partial steps: (cols / 32) % unroll must be 0"
    end
    if t.warps * t.unroll > k.cols // 32 then
      return false, "the cp.async ring needs a step for every warp: warps x unroll <= cols / 32"
    end
  elseif t.tpc ~= 1 then
    return false, "tpc (tiles per CTA) is the cp.async ring's (pipe >= 3): tpc=1"
  end
  if t.lean == 1 and (k.w ~= "e4m3" or t.pipe < 3) then
    return false, "lean=1 is the W8A16 ring's compute (w=e4m3, pipe >= 3)"
  end
  if t.cvt == "hw" and k.w ~= "e4m3" then return false, "cvt=hw decodes e4m3 weights only (cvt=alu)" end
  if t.cvt == "hw" and m3.sm(arch) < 89 then return false, "cvt.rn.f16x2.e4m3x2 needs sm_89+" end
  if k.w == "e4m3" and k.cols % 32 ~= 0 then return false, "MXFP8 rows are blocks of 32: cols % 32 must be 0" end
  if k.cols % 8 ~= 0 then return false, "cols % 8 must be 0 (16-byte staging of x)" end
  if k.w == "e4m3" and k.out ~= "bf16" then return false, "W8A16 writes bf16 (out=bf16)" end
  if k.moe == 1 and k.nmax ~= 1 then return false, "the MoE GEMV runs one token per (token, expert) pair: nmax=1" end
  -- dynamic + the W8A16 kernel's static arrays (s_emax, s_out, the warps'
  -- partial sums: s_red, or s_red2 by tile parity): the driver bounds the sum
  local static = 0
  if k.w == "e4m3" then
    static = 8 * math.max(k.nmax, 2) + 512 * t.warps * t.rpw * ((t.pipe >= 3 and t.tpc ~= 1) and 2 or 1)
  else   -- gemv_body: s_part (ksplit > 1), the route epilogue's s_lg and s_last
    static = (t.ksplit > 1 and 4 * t.warps * t.rpw * k.nmax or 0) + (k.route_e > 0 and 4 * k.nmax * k.route_e + 4 or 0)
  end
  if gemv_smem(k, t) + static > smem_limit(arch) then
    return false, string.format("staging x%s needs %d B of shared memory (+ %d static) > %d on %s",
                                t.pipe >= 3 and " and the cp.async ring" or "", gemv_smem(k, t), static,
                                smem_limit(arch), arch)
  end
  if t.rpw * k.nmax > 32 then return false, "rpw x nmax > 32 accumulators per lane" end
  if t.rpw * t.unroll > 8 then return false, "rpw x unroll > 8 loads in flight per lane (registers)" end
  if k.w == "e4m3" and t.warps > 8 then return false, "W8A16: at most 8 warps (a CTA's column split)" end
  return true
end

function T.default_tile(k, arch)
  if k.op == "dequant" then
    return {warps = 8, rpw = 1, unroll = 1, cvt = "alu", pipe = 1, tpc = 1, lead = 0, lean = 0, ksplit = 1}
  end
  if k.w == "f32" then
    -- The router (128 rows): a row a CTA, its columns over 8 warps, every
    -- weight line in flight at once; on sm_90 the rows stream toward L2
    -- before the wait (lead=1).
    local t = {warps = 8, rpw = 1, unroll = 8, cvt = "alu", pipe = 1, tpc = 1, lead = m3.sm(arch) >= 90 and 1 or 0,
               lean = 0, ksplit = 8}
    while t.ksplit > 1 and not T.valid(k, t, arch) do t.ksplit = t.ksplit // 2 end
    return t
  end
  if k.w == "e4m3" then
    -- The ring where the row fits it: device run 18's winner for the MoE gate|up
    -- and down and the 3072-column GEMV, 1.12-1.17x the pipe=1 tile.
    if (k.cols // 32) % 4 == 0 and k.cols // 32 >= 16 then
      return {warps = 4, rpw = 1, unroll = 4, cvt = m3.sm(arch) >= 89 and "hw" or "alu", pipe = 3, tpc = 1, lead = 0, lean = 0,
              ksplit = 1}
    end
    return {warps = 8, rpw = 1, unroll = 4, cvt = "alu", pipe = 1, tpc = 1, lead = 0, lean = 0, ksplit = 1}
  end
  return {warps = 8, rpw = 2, unroll = 2, cvt = "alu", pipe = 1, tpc = 1, lead = 0, lean = 0, ksplit = 1}
end

function T.variants(c)
  local out, seen = {}, {}
  local function add(op, w, o, cols, moe, epi, settled)
    if not cols or cols < 1 then return end
    local id = table.concat({op, w, o, cols, moe, epi or "", settled or 0}, ",")
    if seen[id] then return end
    seen[id] = true
    local v = {op = op, w = w, out = o, cols = cols, nmax = 1, moe = moe, act = "none", alpha_e6 = 0, limit_e6 = 0,
               beta_e6 = 0, combine = 0, settled = settled or 0, route_e = 0, route_k = 0, route_renorm = 0}
    if epi == "act" then
      v.act, v.alpha_e6 = "swiglu", c.swiglu_alpha_e6 or 1702000
      v.limit_e6, v.beta_e6 = c.swiglu_limit_e6 or 7000000, c.swiglu_beta_e6 or 1000000
    elseif epi == "combine" then
      v.combine = 1
    elseif epi == "route" then
      v.route_e, v.route_k, v.route_renorm = c.experts, c.topk_experts, 1
    end
    out[#out + 1] = v
  end
  local H, O = c.hidden, (c.nq or 0) * (c.hd or 0)
  -- W8A16 decode GEMVs of the MXFP8 checkpoint (batch 1; larger batches
  -- compile their nmax at first use).
  add("gemv", "e4m3", "bf16", H, 0)                         -- qkv(+index), shared/dense gate|up
  add("gemv", "e4m3", "bf16", O, 0)                         -- o_proj
  if c.has_dense_mlp ~= 0 then add("gemv", "e4m3", "bf16", c.dense_inter, 0) end
  if c.has_moe ~= 0 then
    add("gemv", "e4m3", "bf16", c.shared_inter, 0)          -- shared expert down
    add("gemv", "e4m3", "bf16", H, 1)                       -- routed experts gate|up
    add("gemv", "e4m3", "bf16", c.inter, 1, nil, 1)         -- routed experts down (its ids settled: route is 2 back)
    -- The opt-in epilogue launches (runtime/op_ffn.c, M3KIT_MOE_FUSE: the
    -- dims' moe_fuse bits, runtime/op_ffn.h M3_MOE_FUSE_*): the down GEMV's
    -- combine (1); gate|up's SwiGLU (2); the router GEMV's route (16).
    local fuse = c.moe_fuse or 0
    if c.shared_inter == c.inter then
      if fuse & 1 ~= 0 then add("gemv", "e4m3", "bf16", c.inter, 1, "combine", 1) end
      if fuse & 2 ~= 0 and c.inter % 64 == 0 then add("gemv", "e4m3", "bf16", H, 1, "act") end
    end
    add("gemv", "f32", "f32", H, 0)                         -- fp32 router
    if fuse & 16 ~= 0 then add("gemv", "f32", "f32", H, 0, "route") end   -- ... with the route epilogue
  end
  add("gemv", "bf16", "f32", H, 0)                          -- lm_head (bf16 in both releases) -> fp32 logits
  -- Dequantisation for the prefill path (cuBLAS on bf16).
  for _, cols in ipairs({H, O, c.dense_inter, c.inter, c.shared_inter}) do
    add("dequant", "e4m3", "bf16", cols, 0)
  end
  return out
end

local dequant_body = [==[
#define COLS $cols
#define THREADS $threads
#define CPR (COLS / 16)

M3_DEV float e8m0_to_f32(u32 s) {
  return s == 0u ? __uint_as_float(0x00400000u) : (s == 255u ? __uint_as_float(0x7fc00000u) : __uint_as_float(s << 23));
}
M3_DEV u32 dq2(u32 v, int k, float sf) {   /* bytes k, k+1 of v -> two bf16 */
  return pack_bf16(fmul_rn(e4m3_to_f32((e4m3_t)(v >> (8 * k))), sf),
                   fmul_rn(e4m3_to_f32((e4m3_t)(v >> (8 * k + 8))), sf));
}

/* q [rows, COLS] e4m3, scale [rows, COLS/32] E8M0, out [rows, COLS] bf16. */
extern "C" __global__ void __launch_bounds__(THREADS)
$sym(const unsigned char *__restrict__ q, const unsigned char *__restrict__ scale,
     bf16_t *__restrict__ out, long long rows) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  const long long c = (long long)blockIdx.x * THREADS + threadIdx.x;   /* 16-element chunk */
  if (c >= rows * CPR) return;
  const long long row = c / CPR;
  const int k = (int)(c - row * CPR);
  const uint4 v = ld16_stream(q + c * 16);
  const float sf = e8m0_to_f32(scale[row * (COLS / 32) + (k >> 1)]);
  uint4 a, b;
  a.x = dq2(v.x, 0, sf); a.y = dq2(v.x, 2, sf); a.z = dq2(v.y, 0, sf); a.w = dq2(v.y, 2, sf);
  b.x = dq2(v.z, 0, sf); b.y = dq2(v.z, 2, sf); b.z = dq2(v.w, 0, sf); b.w = dq2(v.w, 2, sf);
  st16(out + c * 16, a);
  st16(out + c * 16 + 8, b);
}
]==]

local gemv_body = [==[
#define WFMT $wfmt            /* 0 e4m3 (MXFP8), 1 bf16, 2 fp32 */
#define OUT_F32 $outf32
#define COLS $cols
#define NMAX $nmax
#define MOE $moe
#define WARPS $warps
#define RPW $rpw
#define UNROLL $unroll
#define KSPLIT $ksplit           /* warps over a row's columns */
#define ROUTE_E $route_e         /* > 0: the route epilogue (rows = ROUTE_E experts) */
#define EPC (WFMT == 0 ? 16 : (WFMT == 1 ? 8 : 4))   /* weights per 16-byte chunk */
#define CPR (COLS / EPC)                             /* chunks per row */
#define STEPS ((CPR + 31) / 32)
#define SPW ((STEPS + KSPLIT - 1) / KSPLIT)          /* steps of a warp's column slice */
#define SUB (EPC / 4)                                /* float4s of x per chunk */
#define X4 (COLS / 4)                                /* float4s per staged token */

/* Staged x slot of logical float4 i of chunk c.  Lane l reads chunk c = l
 * (mod 32); without the XOR the 8 lanes of a 16-byte shared-memory phase hit
 * the same bank group 4 ways (e4m3) or 2 ways (bf16). */
M3_DEV int xslot(int c, int i) {
#if SUB == 4
  return 4 * c + (i ^ ((c >> 1) & 3));
#elif SUB == 2
  return 2 * c + (i ^ ((c >> 2) & 1));
#else
  return c + 0 * i;
#endif
}

#if WFMT == 0
M3_DEV float e8m0_to_f32(u32 s) {
  return s == 0u ? __uint_as_float(0x00400000u) : (s == 255u ? __uint_as_float(0x7fc00000u) : __uint_as_float(s << 23));
}
/* Byte k of v as an fp32 of value e4m3 x 2^-120 (see the file comment). */
M3_DEV float e4m3_raw(u32 v, int k) {
  return __uint_as_float((u32)(((int)(v << (24 - 8 * k))) >> 4) & 0x87f00000u);
}
M3_DEV float dot_chunk(uint4 q, const float *xv) {
  float a = 0.0f, b = 0.0f;
  const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    a = ffma_rn(xv[4 * j + 0], e4m3_raw(w[j], 0), a);
    b = ffma_rn(xv[4 * j + 1], e4m3_raw(w[j], 1), b);
    a = ffma_rn(xv[4 * j + 2], e4m3_raw(w[j], 2), a);
    b = ffma_rn(xv[4 * j + 3], e4m3_raw(w[j], 3), b);
  }
  return a + b;
}
#elif WFMT == 1
M3_DEV float dot_chunk(uint4 q, const float *xv, float acc) {
  acc = ffma_rn(xv[0], bf16lo(q.x), acc); acc = ffma_rn(xv[1], bf16hi(q.x), acc);
  acc = ffma_rn(xv[2], bf16lo(q.y), acc); acc = ffma_rn(xv[3], bf16hi(q.y), acc);
  acc = ffma_rn(xv[4], bf16lo(q.z), acc); acc = ffma_rn(xv[5], bf16hi(q.z), acc);
  acc = ffma_rn(xv[6], bf16lo(q.w), acc); acc = ffma_rn(xv[7], bf16hi(q.w), acc);
  return acc;
}
#else
M3_DEV float dot_chunk(uint4 q, const float *xv, float acc) {
  acc = ffma_rn(xv[0], __uint_as_float(q.x), acc); acc = ffma_rn(xv[1], __uint_as_float(q.y), acc);
  acc = ffma_rn(xv[2], __uint_as_float(q.z), acc); acc = ffma_rn(xv[3], __uint_as_float(q.w), acc);
  return acc;
}
#endif

/* Non-MoE: x [n, COLS] bf16 (n <= NMAX), w [rows, COLS] (+ ws [rows, COLS/32]
 * E8M0 for e4m3), y [n, rows].  MoE: pair p = blockIdx.y < n (the routed
 * pairs) uses expert ids[p] (in [0, n_tab)), weight w_tab[ids[p]] (+
 * ws_tab[ids[p]]) and x row p / xdiv (xdiv = top-k for the gate|up GEMV of
 * token rows, 1 for the down GEMV of pair rows); a pair p >= n is the shared
 * expert's (weight w (+ ws)), x row p - n (xdiv > 1) or p (xdiv == 1).  Pair
 * p writes y row p.  y is bf16 or fp32 (OUT_F32). */
extern "C" __global__ void __launch_bounds__(WARPS * 32)
$sym(const bf16_t *__restrict__ x, const void *__restrict__ w, const unsigned char *__restrict__ ws,
     const void *const *__restrict__ w_tab, const unsigned char *const *__restrict__ ws_tab,
     const int *__restrict__ ids, int n_tab, int xdiv, void *__restrict__ y, int n, int rows, int npairs$rparams) {
  $open
  (void)npairs;            /* the W8A16 GEMV's balanced split only */
  DYN_SMEM(float4, xs4);   /* [NMAX][X4] */
  const int p = MOE ? (int)blockIdx.y : 0;
  const int ntok = MOE ? 1 : n;
  const unsigned char *wb;
  const unsigned char *sb = 0;
  if (MOE && p < n) {
    const int ex = ids[p];
    if (ex < 0 || ex >= n_tab) return;   /* the whole CTA: never index the table with a bad id; y row p stays */
    wb = (const unsigned char *)w_tab[ex];
    if (WFMT == 0) sb = ws_tab[ex];
  } else {
    wb = (const unsigned char *)w;
    sb = ws;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  /* KSPLIT warps share RPW rows: warp ks of them reads steps [s_beg, s_end) */
  const int ks = warp % KSPLIT, row0 = ((int)blockIdx.x * (WARPS / KSPLIT) + warp / KSPLIT) * RPW;
  const int s_beg = ks * SPW, s_end = s_beg + SPW < STEPS ? s_beg + SPW : STEPS;
  const int c_end = s_end * 32 < CPR ? s_end * 32 : CPR;   /* the slice's chunks: [32 s_beg, c_end) */
#ifdef __CUDA_ARCH__
$prefetch#endif
$wait
  const bf16_t *xb = MOE ? x + (long long)(p < n ? p / xdiv : (xdiv == 1 ? p : p - n)) * COLS : x;
  const float xscale = WFMT == 0 ? 0x1p64f : 1.0f;   /* exact; see the file comment */
  for (int i = threadIdx.x; i < ntok * (COLS / 8); i += WARPS * 32) {
    const int t = i / (COLS / 8), g = i - t * (COLS / 8);
    const uint4 v = ld16(xb + (long long)t * COLS + g * 8);
    float4 a, b;
    a.x = bf16lo(v.x) * xscale; a.y = bf16hi(v.x) * xscale; a.z = bf16lo(v.y) * xscale; a.w = bf16hi(v.y) * xscale;
    b.x = bf16lo(v.z) * xscale; b.y = bf16hi(v.z) * xscale; b.z = bf16lo(v.w) * xscale; b.w = bf16hi(v.w) * xscale;
    const int f0 = 2 * g, f1 = 2 * g + 1;
    xs4[t * X4 + xslot(f0 / SUB, f0 % SUB)] = a;
    xs4[t * X4 + xslot(f1 / SUB, f1 % SUB)] = b;
  }
  __syncthreads();
#if KSPLIT == 1 && !ROUTE_E
  if (row0 >= rows) return;
#endif
  float acc[RPW][NMAX];
#pragma unroll
  for (int r = 0; r < RPW; r++)
#pragma unroll
    for (int t = 0; t < NMAX; t++) acc[r][t] = 0.0f;

#pragma unroll 1
  for (int s0 = s_beg; s0 < s_end; s0 += UNROLL) {
    uint4 q[UNROLL][RPW];
#if WFMT == 0
    float sf[UNROLL][RPW];
#endif
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int c = (s0 + u) * 32 + lane;
#pragma unroll
      for (int r = 0; r < RPW; r++) {
        const int row = row0 + r;
        q[u][r].x = q[u][r].y = q[u][r].z = q[u][r].w = 0u;
#if WFMT == 0
        sf[u][r] = 0.0f;
#endif
        if (c < c_end && row < rows) {
          q[u][r] = ld16_stream(wb + ((long long)row * CPR + c) * 16);
#if WFMT == 0
          sf[u][r] = e8m0_to_f32(__ldg(sb + (long long)row * (COLS / 32) + (c >> 1)));
#endif
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int c = (s0 + u) * 32 + lane;
      if (c < c_end) {
#pragma unroll
        for (int t = 0; t < NMAX; t++) {
          if (t < ntok) {
            float xv[EPC];
#pragma unroll
            for (int i = 0; i < SUB; i++) {
              const float4 f = xs4[t * X4 + xslot(c, i)];
              xv[4 * i + 0] = f.x; xv[4 * i + 1] = f.y; xv[4 * i + 2] = f.z; xv[4 * i + 3] = f.w;
            }
#pragma unroll
            for (int r = 0; r < RPW; r++) {
#if WFMT == 0
              /* x 2^56 then x 2^(s-127) on the 16-weight partial: exact
               * power-of-two scalings, in two steps so that no large scale
               * overflows on its own; unread rows carry q = 0, sf = 0. */
              acc[r][t] = ffma_rn(fmul_rn(dot_chunk(q[u][r], xv), 0x1p56f), sf[u][r], acc[r][t]);
#else
              acc[r][t] = dot_chunk(q[u][r], xv, acc[r][t]);
#endif
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; r++)
#pragma unroll
    for (int t = 0; t < NMAX; t++)
      if (t < ntok) acc[r][t] = warp_sum(acc[r][t]);
#if KSPLIT > 1
  /* The slices' sums, added in slice order (the same order for every tile
   * of one KSPLIT); warps past the last row still arrive at the barrier. */
  __shared__ float s_part[KSPLIT][WARPS / KSPLIT][RPW][NMAX];
  if (lane == 0)
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
      for (int t = 0; t < NMAX; t++) s_part[ks][warp / KSPLIT][r][t] = acc[r][t];
  __syncthreads();
#if !ROUTE_E
  if (ks != 0) return;
#endif
#pragma unroll
  for (int r = 0; r < RPW; r++)
#pragma unroll
    for (int t = 0; t < NMAX; t++) {
      float a = s_part[0][warp / KSPLIT][r][t];
#pragma unroll
      for (int j = 1; j < KSPLIT; j++) a = fadd_rn(a, s_part[j][warp / KSPLIT][r][t]);
      acc[r][t] = a;
    }
#endif
  if (lane == 0 && ks == 0) {
#pragma unroll
    for (int r = 0; r < RPW; r++) {
      const int row = row0 + r;
      if (row >= rows) break;
#pragma unroll
      for (int t = 0; t < NMAX; t++) {
        if (t >= ntok) break;
        const long long at = (long long)(MOE ? p : t) * rows + row;
#if OUT_F32
        ((float *)y)[at] = acc[r][t];
#else
        ((bf16_t *)y)[at] = f32_to_bf16(acc[r][t]);
#endif
      }
    }
  }
#if ROUTE_E
  /* The route epilogue: the CTA whose count completes the grid selects every
   * token's experts from the logits all CTAs wrote (read back through L2 into
   * shared memory: route_token's plain loads then see this launch's values),
   * and zeroes the count for the next launch.  The count is one acq_rel
   * atomic by thread 0 between two barriers (its release covers the CTA's
   * logit stores, which the barrier ordered before it; its acquire the CTA's
   * reads after the second barrier), not seq_cst fences by every thread, as
   * the attention's split hand-over (lib/attn_mma.lua MERGE: 0.4-0.6 us a
   * launch less); here -0.06 ms a step at 8K, within the spread (device run
   * 65). */
  __shared__ unsigned s_last;
  __shared__ float s_lg[NMAX * ROUTE_E];
  __syncthreads();
  if (threadIdx.x == 0) s_last = route_ticket(rcnt) == gridDim.x - 1u;
  __syncthreads();
  if (!s_last) return;
  for (int i = threadIdx.x; i < n * ROUTE_E; i += WARPS * 32) s_lg[i] = __ldcg((const float *)y + i);
  __syncthreads();
  for (int t = warp; t < n; t += WARPS) route_token(t, s_lg, rbias, rids, rw, rscale, lane);
  if (threadIdx.x == 0) *rcnt = 0u;
#endif
}
]==]


local gemv_mma_body = [==[
#define COLS $cols
#define NMAX $nmax
#define MOE $moe
#define WARPS $warps
#define RPW $rpw                 /* 16-row mma tiles per CTA */
#define UNR $unroll              /* 32-column blocks per lane per step; the CTA's warps take turns */
#define TPC $tpc                 /* pipe >= 3: 16 x RPW-row tiles per CTA */
#define PIPE $pipe               /* 2: step i+1's loads are issued before step i's mma (two wsteps live);
                                  * >= 3: a per-warp cp.async ring of PIPE stages, PIPE - 1 in flight */
#define WLOG2 $wlog2             /* the decoded weight is e4m3 x 2^-WLOG2 */
#define NBLK (COLS / 32)
#define XS4 (COLS / 8 + 1)       /* uint4 per staged token row (16 bytes of padding) */
#define STAGE $stage             /* pipe >= 3: bytes of one ring stage (weights, then E8M0) */
#define WSTR (UNR * 32 + 32)     /* a row's bytes in a ring stage, padded */
#define MULTI (PIPE >= 3 && TPC != 1)   /* the ring over several tiles a CTA (TPC > 1, or 0: balanced) */
#define NXS (MOE && PIPE >= 3 && TPC == 0 ? 2 : NMAX)   /* staged x rows (balanced MoE: a CTA spans <= 2 pairs) */
$fused_defs/* Two selects, no branch: the nested float ternary compiled to a branch per
 * scale (two a block in the mma loop; SASS of device run 21's winners). */
M3_DEV float e8m0_to_f32(u32 s) {
  u32 b = s << 23;
  b = s == 0u ? 0x00400000u : b;
  b = s == 255u ? 0x7fc00000u : b;
  return __uint_as_float(b);
}
M3_DEV float pow2f(int e) { return __uint_as_float((u32)(e + 127) << 23); } /* e in [-126, 127] */
/* MoE: the x row of pair p (see the kernel comment). */
M3_DEV int xrow_of(int p, int n, int xdiv) { return p < n ? p / xdiv : (xdiv == 1 ? p : p - n); }
/* MoE: pair p's weight and scales, 0 for a routed pair whose expert id is
 * outside [0, n_tab) (its tiles then stream zeros into nothing: y rows stay);
 * the pointers are then any readable address, never the table's. */
M3_DEV int pair_weights(int p, int n, const int *ids, int n_tab, const void *const *w_tab,
                        const unsigned char *const *ws_tab, const void *w, const unsigned char *ws, const void *dummy,
                        const unsigned char *&wb, const unsigned char *&sb) {
  if (MOE && p < n) {
    const int ex = ids[p];
    if (ex < 0 || ex >= n_tab) { wb = sb = (const unsigned char *)dummy; return 0; }
    wb = (const unsigned char *)w_tab[ex];
    sb = ws_tab[ex];
    return 1;
  }
  wb = (const unsigned char *)w;
  sb = ws;
  return 1;
}

#ifndef __CUDA_ARCH__
/* fp32 -> fp16 bits, round to nearest even (what cvt.rn does). */
static unsigned f32_to_f16_bits(float f) {
  const u32 u = __float_as_uint(f), s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return s | 0x7e00u;
  if (a >= 0x477ff000u) return s | 0x7c00u;
  if (a < 0x38800000u) return s | (u32)rintf(__uint_as_float(a) * 16777216.0f);
  return s | ((a + 0x0fffu + ((a >> 13) & 1u) - 0x38000000u) >> 13);
}
#endif
M3_DEV u32 f16x2_of(float lo, float hi) {
#ifdef __CUDA_ARCH__
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return f32_to_f16_bits(lo) | (f32_to_f16_bits(hi) << 16);
#endif
}
M3_DEV uint2 ld8_stream(const unsigned char *p) {
#ifdef __CUDA_ARCH__
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
#else
  return *(const uint2 *)p;
#endif
}

#if PIPE >= 3
$cp_async
/* Copy blocks [b0, b0 + UNR) of the tile's 16 x RPW rows into ring stage st:
 * row rr's weight bytes at st + rr * WSTR, its E8M0 bytes at st + 16 RPW WSTR
 * + rr UNR.  2 UNR consecutive lanes copy a row's 32 UNR contiguous bytes. */
M3_DEV void ring_issue(unsigned char *st, const unsigned char *wb, const unsigned char *sb, int row0, int rows,
                       int b0, int lane) {
  /* Lane l copies chunk l % (2 UNR) of rows l / (2 UNR) + i 32 / (2 UNR) (2 UNR
   * lanes a row's 32 UNR bytes): in a
   * full tile (all but the last) one address a step and constant offsets, where
   * the general loop below spent a 64-bit multiply and a select a chunk. */
  constexpr int RSTEP = 32 / (2 * UNR);
  if (row0 + 16 * RPW <= rows) {
    const int rl = lane / (2 * UNR), cc = lane % (2 * UNR);
    const unsigned char *src = wb + (long long)(row0 + rl) * COLS + 32 * b0 + 16 * cc;
    unsigned char *dst = st + rl * WSTR + 16 * cc;
#pragma unroll
    for (int i = 0; i < RPW * UNR; i++) cpa16(dst + i * RSTEP * WSTR, src + (long long)i * RSTEP * COLS, 16);
    if (lane < 4 * RPW * UNR) {
      const int rr = lane / (UNR / 4), j = lane % (UNR / 4);
      cpa4(st + 16 * RPW * WSTR + rr * UNR + 4 * j, sb + (long long)(row0 + rr) * NBLK + b0 + 4 * j, 4);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < RPW * UNR; i++) {
    const int c = i * 32 + lane, rr = c / (2 * UNR), cc = c % (2 * UNR);
    const int ok = row0 + rr < rows;
    cpa16(st + rr * WSTR + 16 * cc, ok ? wb + (long long)(row0 + rr) * COLS + 32 * b0 + 16 * cc : wb, ok ? 16 : 0);
  }
  if (lane < 4 * RPW * UNR) {   /* 16 RPW rows x UNR / 4 words */
    const int rr = lane / (UNR / 4), j = lane % (UNR / 4);
    const int ok = row0 + rr < rows;
    cpa4(st + 16 * RPW * WSTR + rr * UNR + 4 * j, ok ? sb + (long long)(row0 + rr) * NBLK + b0 + 4 * j : sb,
         ok ? 4 : 0);
  }
}

$ring_compute#endif

/* One step of a warp's weights: blocks [b0, b0 + UNR) of its rows. */
struct wstep {
  uint2 q[UNR][RPW][2];            /* 8 bytes of rows g, g+8 of each tile */
  u32 sc[RPW][2][(UNR + 3) / 4];   /* their E8M0 bytes, packed */
};

M3_DEV void load_step(wstep &st, const unsigned char *wb, const unsigned char *sb, int row0, int rows, int b0,
                      int g, int tq) {
#pragma unroll
  for (int r = 0; r < RPW; r++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int row = row0 + 16 * r + 8 * h + g;
      const int ok = row < rows;
      const unsigned char *wr = wb + (long long)row * COLS + 8 * tq;
#pragma unroll
      for (int u = 0; u < UNR; u++) {
        st.q[u][r][h] = make_uint2(0u, 0u);
        if (ok && b0 + u < NBLK) st.q[u][r][h] = ld8_stream(wr + 32 * (b0 + u));
      }
      const unsigned char *sr = sb + (long long)row * NBLK + b0;
#if UNR % 4 == 0 && NBLK % 4 == 0
#pragma unroll
      for (int j = 0; j < UNR / 4; j++) st.sc[r][h][j] = ok && b0 + 4 * j < NBLK ? __ldg((const u32 *)sr + j) : 0u;
#else
#pragma unroll
      for (int j = 0; j < (UNR + 3) / 4; j++) st.sc[r][h][j] = 0u;
#pragma unroll
      for (int u = 0; u < UNR; u++)
        if (ok && b0 + u < NBLK) st.sc[r][h][u / 4] |= (u32)__ldg(sr + u) << (8 * (u % 4));
#endif
    }
}

/* Non-MoE: x [n, COLS] bf16 (n <= NMAX), w [rows, COLS] e4m3 + ws [rows, COLS/32]
 * E8M0, y [n, rows] bf16.  MoE: as the FMA GEMV's (pairs p < n routed, p >= n
 * the shared expert's w + ws). */
extern "C" __global__ void __launch_bounds__(WARPS * 32)
$sym(const bf16_t *__restrict__ x, const void *__restrict__ w, const unsigned char *__restrict__ ws,
     const void *const *__restrict__ w_tab, const unsigned char *const *__restrict__ ws_tab,
     const int *__restrict__ ids, int n_tab, int xdiv, void *__restrict__ y, int n, int rows, int npairs$params) {
  $open
  DYN_SMEM(uint4, xs4);          /* [NXS][XS4] fp16 x 2^sh, dims paired (0,2),(1,3),(4,6),(5,7); lean=1 with cvt=hw: (0,1),(2,3),... */
  __shared__ int s_emax[NXS];
  __shared__ float s_out[NXS];
#if PIPE < 3 || TPC == 1
  __shared__ float s_red[WARPS > 1 ? WARPS : 1][RPW][4][32]; /* the warps' partial sums */
#endif
  const int ntok = MOE ? 1 : n;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
#if MULTI
  /* Tiles (16 x RPW rows) numbered over all pairs: tile u is pair u / tpp's
   * tile u % tpp (non-MoE: one "pair").  TPC > 1: TPC consecutive tiles of
   * pair blockIdx.y.  TPC = 0, balanced: the launcher sizes a 1-D grid to the
   * CTAs the SMs hold at once (and >= the pairs) and CTA i takes tiles
   * [i T / G, (i + 1) T / G) of all T, so every CTA streams within a tile of
   * the same bytes (device run 24's ncu: fixed TPC left SMs with 1 CTA beside
   * SMs with 2), crossing at most one pair boundary.  x staged once for
   * them; the warps' steps over all the tiles form one sequence, so the ring
   * runs on across tile ends. */
  const int tpp = (rows + 16 * RPW - 1) / (16 * RPW);
#if TPC == 0
  const long long T = (long long)(MOE ? npairs : 1) * tpp;
  const long long u0 = (long long)blockIdx.x * T / gridDim.x, u1 = ((long long)blockIdx.x + 1) * T / gridDim.x;
#else
  const long long pb = (long long)(MOE ? blockIdx.y : 0) * tpp, u0 = pb + (long long)blockIdx.x * TPC;
  const long long u1 = u0 + TPC < pb + tpp ? u0 + TPC : pb + tpp;
#endif
  if (u0 >= u1) return;   /* the whole CTA */
  const int pf = (int)(u0 / tpp), pl = (int)((u1 - 1) / tpp);   /* pl - pf <= 1 (NXS) */
  /* Pair slots 0 (pf) and 1 (pl), by selects: an array indexed at run time went to local memory. */
  const unsigned char *wb0, *sb0, *wb1, *sb1;
  const int ok0 = pair_weights(pf, n, ids, n_tab, w_tab, ws_tab, w, ws, x, wb0, sb0);
  const int ok1 = pair_weights(pl, n, ids, n_tab, w_tab, ws_tab, w, ws, x, wb1, sb1);
  unsigned char *ring = (unsigned char *)(xs4 + NXS * XS4) + warp * (PIPE * STAGE);
  const int nst = (NBLK - warp * UNR + WARPS * UNR - 1) / (WARPS * UNR);   /* >= 1: valid() */
  const int total = (int)(u1 - u0) * nst;
  /* The issue pointer (pair slot ij, tile ilt of it, step ns), PIPE - 1 steps
   * ahead of the compute pointer; stepped, never divided at a step. */
  int ij = 0, ilt = (int)(u0 - (long long)pf * tpp), ns = 0;
#pragma unroll
  for (int q = 0; q < PIPE - 1; q++) {
    if (q < total) {
      ring_issue(ring + q * STAGE, ij ? wb1 : wb0, ij ? sb1 : sb0, ilt * 16 * RPW, (ij ? ok1 : ok0) ? rows : 0,
                 warp * UNR + ns * WARPS * UNR, lane);
      if (++ns == nst) { ns = 0; if (++ilt == tpp) { ilt = 0; ij++; } }
    }
    cpa_commit();
  }
  const int nx = MOE ? pl - pf + 1 : n, xp0 = pf;
#else
$pairsel  const unsigned char *wb, *sb;
$badpair  const int row0 = (int)blockIdx.x * RPW * 16;

  /* The first weights are in flight while x is staged. */
#if PIPE >= 3
  /* One tile of 16 x RPW rows a CTA. */
  if (row0 >= rows) return;   /* the whole CTA */
  unsigned char *ring = (unsigned char *)(xs4 + NXS * XS4) + warp * (PIPE * STAGE);
  const int total = (NBLK - warp * UNR + WARPS * UNR - 1) / (WARPS * UNR);   /* >= 1: valid() */
#pragma unroll
  for (int q = 0; q < PIPE - 1; q++) {
    if (q < total) ring_issue(ring + q * STAGE, wb, sb, row0, rows, warp * UNR + q * WARPS * UNR, lane);
    cpa_commit();
  }
#else
  wstep cur;
  load_step(cur, wb, sb, row0, rows, warp * UNR, g, tq);
#endif
  const int nx = ntok, xp0 = p;
#endif

$wait  /* Staged rows: the tokens (non-MoE), or the x rows of pairs xp0 .. xp0 + nx - 1. */
  if (tid < NXS) s_emax[tid] = 0;
  __syncthreads();
  for (int t = 0; t < nx; t++) {
    const bf16_t *xb = MOE ? x + (long long)xrow_of(xp0 + t, n, xdiv) * COLS : x + (long long)t * COLS;
    u32 m = 0u;
    for (int i = tid; i < COLS / 8; i += WARPS * 32) {
      const uint4 v = ld16(xb + 8 * i);
      xs4[t * XS4 + i] = v;
      const u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const u32 lo = a[j] & 0x7fffu, hi = (a[j] >> 16) & 0x7fffu;
        m = max(m, max(lo, hi));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(FULL, m, o));
    if (lane == 0) atomicMax(&s_emax[t], (int)(m >> 7));
  }
  __syncthreads();
  for (int t = 0; t < nx; t++) {
    int sh = 141 - s_emax[t]; /* max|x| 2^sh in [2^14, 2^15) */
    sh = sh < -100 ? -100 : (sh > 100 ? 100 : sh);
    const float xm = pow2f(sh);
    if (tid == 0) s_out[t] = pow2f(WLOG2 - sh); /* |WLOG2 - sh| <= 108 */
    for (int i = tid; i < COLS / 8; i += WARPS * 32) {
      const uint4 v = xs4[t * XS4 + i];
      uint4 o;
$xstage      xs4[t * XS4 + i] = o;
    }
  }
  __syncthreads();
#if PIPE < 3
  if (row0 >= rows) return;
#endif

  float acc[RPW][4];
#pragma unroll
  for (int r = 0; r < RPW; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.0f;
#if PIPE >= 3
  /* ncu (pipes 1, 2): warps waited on their loads at every step, the bytes in
   * flight bounded by registers.  The ring keeps PIPE - 1 steps in flight per
   * warp without holding them in registers, and its copies are whole 128-byte
   * lines of a row where the register loads were 32-byte pieces of 8 rows. */
#if TPC == 1
  /* One tile: the warps run their steps without a barrier; the column slices
   * are summed after the loop.  (Device runs 18-20: the multi-tile loop below
   * with tpc=1 ran 3-20% slower than this one on the non-MoE GEMVs.) */
  int slot1 = 0;   /* q % PIPE, stepped (PIPE = 3 was a multiply-high a step) */
#pragma unroll 1
  for (int q = 0; q < total; q++) {
    __syncwarp();   /* every lane is done with the stage refilled below (step q - 1's) */
    if (q + PIPE - 1 < total)
      ring_issue(ring + (slot1 == 0 ? PIPE - 1 : slot1 - 1) * STAGE, wb, sb, row0, rows,
                 warp * UNR + (q + PIPE - 1) * WARPS * UNR, lane);
    cpa_commit();
    cpa_wait_ring();
    __syncwarp();   /* the other lanes' copies of stage q are visible */
    const unsigned char *st = ring + slot1 * STAGE;
    if (++slot1 == PIPE) slot1 = 0;
    const int b0 = warp * UNR + q * WARPS * UNR;
    ring_compute(acc, st, xs4, b0, g, tq, ntok);
  }
#else
  __shared__ float s_red2[2][WARPS][RPW][4][32];   /* by tile parity: one barrier a tile */
  /* The compute pointer: tile ti (from u0; pair slot cj, its tile clt), step sq, ring stage. */
  int ti = 0, cj = 0, clt = (int)(u0 - (long long)pf * tpp), sq = 0, slot = 0;
#pragma unroll 1
  for (int q = 0; q < total; q++) {
    __syncwarp();   /* every lane is done with the stage refilled below (step q - 1's) */
    if (q + PIPE - 1 < total) {
      const int sn = slot == 0 ? PIPE - 1 : slot - 1;   /* (q + PIPE - 1) % PIPE */
      ring_issue(ring + sn * STAGE, ij ? wb1 : wb0, ij ? sb1 : sb0, ilt * 16 * RPW, (ij ? ok1 : ok0) ? rows : 0,
                 warp * UNR + ns * WARPS * UNR, lane);
      if (++ns == nst) { ns = 0; if (++ilt == tpp) { ilt = 0; ij++; } }
    }
    cpa_commit();
    cpa_wait_ring();
    __syncwarp();   /* the other lanes' copies of stage q are visible */
    const unsigned char *st = ring + slot * STAGE;
    const int b0 = warp * UNR + sq * WARPS * UNR;
    ring_compute(acc, st, xs4 + (MOE ? cj : 0) * XS4, b0, g, tq, ntok);
    if (sq == nst - 1) {
      /* Tile ti done: the warps' column slices summed (warp order:
       * deterministic) by warp 0, while the ring's copies for the next tile
       * are in flight.  The parity buffer is rewritten two tiles later,
       * after a barrier warp 0 reaches only when this sum is done. */
      const int tr0 = clt * 16 * RPW, pp = pf + cj;   /* pp: the pair (MoE) */
#pragma unroll
      for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int i = 0; i < 4; i++) s_red2[ti & 1][warp][r][i][lane] = acc[r][i];
      __syncthreads();
      if (warp == 0 && (cj ? ok1 : ok0)) {
#pragma unroll
        for (int r = 0; r < RPW; r++)
#pragma unroll
          for (int i = 0; i < 4; i++) {
            float v = acc[r][i];
            for (int w2 = 1; w2 < WARPS; w2++) v = fadd_rn(v, s_red2[ti & 1][w2][r][i][lane]);
            const int row = tr0 + 16 * r + g + 8 * (i >> 1), t = 2 * tq + (i & 1);
            if (row < rows && t < ntok) {
              const long long at = (long long)(MOE ? pp : t) * rows + row;
              ((bf16_t *)y)[at] = f32_to_bf16(fmul_rn(v, s_out[MOE ? cj : t]));
            }
          }
      }
$epi_multi#pragma unroll
      for (int r = 0; r < RPW; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.0f;
    }
    if (++sq == nst) { sq = 0; ti++; if (++clt == tpp) { clt = 0; cj++; } }
    if (++slot == PIPE) slot = 0;
  }
#endif
#else
#pragma unroll 1
  for (int b0 = warp * UNR; b0 < NBLK; b0 += WARPS * UNR) {
#if PIPE == 2
    /* ncu (pipe=1): warps stall on their loads at the top of every step, the
     * bytes in flight drained to zero between steps.  Keep the next step's
     * loads outstanding while this one computes. */
    wstep nxt;
    if (b0 + WARPS * UNR < NBLK) load_step(nxt, wb, sb, row0, rows, b0 + WARPS * UNR, g, tq);
#else
    if (b0 != warp * UNR) load_step(cur, wb, sb, row0, rows, b0, g, tq);
#endif
#pragma unroll
    for (int u = 0; u < UNR; u++) {
      if (b0 + u < NBLK) {
        const uint4 xv = g < ntok ? xs4[g * XS4 + 4 * (b0 + u) + tq] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int r = 0; r < RPW; r++) {
          u32 a0, a2, a1, a3, c0, c2, c1, c3;
          e4m3_word_f16(cur.q[u][r][0].x, a0, a2);   /* row g, dims 0-3 of the lane's 8 */
          e4m3_word_f16(cur.q[u][r][1].x, a1, a3);   /* row g + 8 */
          e4m3_word_f16(cur.q[u][r][0].y, c0, c2);   /* dims 4-7 */
          e4m3_word_f16(cur.q[u][r][1].y, c1, c3);
          float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma16816(c, a0, a1, a2, a3, xv.x, xv.y);
          mma16816(c, c0, c1, c2, c3, xv.z, xv.w);
          const float s0 = e8m0_to_f32((cur.sc[r][0][u / 4] >> (8 * (u % 4))) & 0xffu);
          const float s1 = e8m0_to_f32((cur.sc[r][1][u / 4] >> (8 * (u % 4))) & 0xffu);
          acc[r][0] = ffma_rn(c[0], s0, acc[r][0]);
          acc[r][1] = ffma_rn(c[1], s0, acc[r][1]);
          acc[r][2] = ffma_rn(c[2], s1, acc[r][2]);
          acc[r][3] = ffma_rn(c[3], s1, acc[r][3]);
        }
      }
    }
#if PIPE == 2
    cur = nxt;
#endif
  }
#endif
#if PIPE < 3 || TPC == 1
  /* The warps' column slices summed (warp order: deterministic); c[0], c[1]:
   * row g, tokens 2tq, 2tq + 1; c[2], c[3]: row g + 8. */
  if (WARPS > 1) {
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
      for (int i = 0; i < 4; i++) s_red[warp][r][i][lane] = acc[r][i];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
      for (int i = 0; i < 4; i++)
        for (int w2 = 1; w2 < WARPS; w2++) acc[r][i] = fadd_rn(acc[r][i], s_red[w2][r][i][lane]);
  }
#pragma unroll
  for (int r = 0; r < RPW; r++)
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int row = row0 + 16 * r + g + 8 * (i >> 1), t = 2 * tq + (i & 1);
      if (row < rows && t < ntok) {
        const long long at = (long long)(MOE ? p : t) * rows + row;
        ((bf16_t *)y)[at] = f32_to_bf16(fmul_rn(acc[r][i], s_out[t]));
      }
    }
$epi_tail#endif
}
]==]

-- The W8A16 kernel's opening: lead=0 is the grid wait first, as every
-- kernel; lead=1 (lib/lead.lua) moves it down to the staging of x (the
-- previous kernel's output), so that the ring's first PIPE - 1 stages of
-- weights (launch arguments no kernel writes: the launcher's header says so)
-- stream while the previous kernel drains.
-- The fusions (act, combine; file comment): text only where the key has them,
-- so that act=none, combine=0 render the kernel as before.  Both count a
-- CTA's finished row tiles (EPI_TILE) after the tile's y stores.
local ACT_FN = [==[
/* act=swiglu (the gate|up GEMV: rows = 2I, gate rows [0, I), up rows [I, 2I),
 * I a multiple of 16 RPW: the launcher checks): warp 0 of a CTA has stored
 * (or, bad expert id, skipped) rows [r0, r0 + 16 RPW) of pair `pair`.  Gate
 * tile j and up tile j count into one word; the second of the two computes
 * act[pair][j..] = bf16(SwiGLU-OAI(gate, up)) from the bf16 rows (ld.cg: the
 * other CTA's stores of this launch), the SwiGLU kernel's values exactly,
 * and zeroes the word for the next launch. */
M3_DEV void epi_tile(bf16_t *act, unsigned *cnt, int tile, int pair, int r0, const bf16_t *gu, int rows, int lane) {
  (void)tile;
  const int I = rows / 2, j0 = r0 < I ? r0 : r0 - I, slot = pair * (I / (16 * RPW)) + j0 / (16 * RPW);
  __threadfence();   /* this warp's gu stores device-wide before its count */
  __syncwarp();
  unsigned done = 0u;
  if (lane == 0) done = atomicAdd(cnt + slot, 1u) + 1u;
  done = __shfl_sync(FULL, done, 0);
  if (done != 2u) return;
  __threadfence();
  const bf16_t *g = gu + (long long)pair * rows;
  for (int r = lane; r < 16 * RPW; r += 32)
    act[(long long)pair * I + j0 + r] =
        f32_to_bf16(swiglu_oai(bf16_to_f32(__ldcg(g + j0 + r)), bf16_to_f32(__ldcg(g + I + j0 + r))));
  if (lane == 0) cnt[slot] = 0u;
}
#define EPI_TILE(tile, pair, r0) epi_tile(act, cnt, (tile), (pair), (r0), (const bf16_t *)y, rows, lane)
]==]
local COMBINE_FN = [==[
/* combine=1 (the down GEMV): warp 0 of a CTA has stored (or, bad expert id,
 * skipped) pair rows [r0, r0 + 16 RPW) of row tile `tile`.  Count them; the
 * CTA whose count completes the tile (npairs) sums the pairs into out as
 * moe_combine does - out[t] = bf16(sum_k w[t K + k] y[t K + k] + y[n + t]),
 * fp32 in top-k order, one rounding; K = n / (npairs - n), the shared
 * expert's pairs last - and zeroes the count for the next launch. */
M3_DEV void epi_tile(const float *cw, bf16_t *out, unsigned *cnt, int tile, int r0, const bf16_t *y, int n,
                     int npairs, int rows, int lane) {
  __threadfence();   /* this warp's y stores device-wide before its count */
  __syncwarp();
  unsigned done = 0u;
  if (lane == 0) done = atomicAdd(cnt + tile, 1u) + 1u;
  done = __shfl_sync(FULL, done, 0);
  if (done != (unsigned)npairs) return;
  __threadfence();
  const int ntok = npairs - n, K = n / ntok;
  for (int t = 0; t < ntok; t++)
    for (int r = lane; r < 16 * RPW; r += 32) {
      const int row = r0 + r;
      if (row >= rows) break;
      float acc = 0.0f;
      for (int k = 0; k < K; k++)   /* L2 reads (ld.cg): other CTAs' rows of this launch */
        acc = fadd_rn(acc, fmul_rn(cw[t * K + k], bf16_to_f32(__ldcg(y + (long long)(t * K + k) * rows + row))));
      acc = fadd_rn(acc, bf16_to_f32(__ldcg(y + (long long)(n + t) * rows + row)));
      out[(long long)t * rows + row] = f32_to_bf16(acc);
    }
  if (lane == 0) cnt[tile] = 0u;
}
#define EPI_TILE(tile, pair, r0) epi_tile(cw, out, cnt, (tile), (r0), (const bf16_t *)y, n, npairs, rows, lane)
]==]
local function fused_defs(k)
  if k.act == "swiglu" then
    return string.format("#define ALPHA (%s)\n#define LIMIT (%s)\n#define BETA (%s)\n", F.e6_literal(k.alpha_e6),
                         F.e6_literal(k.limit_e6), F.e6_literal(k.beta_e6)) .. F.swiglu_oai .. ACT_FN
  end
  return k.combine == 1 and COMBINE_FN or ""
end
local EPI_PARAMS = {
  act = ",\n     bf16_t *__restrict__ act, unsigned *__restrict__ cnt",
  combine = ",\n     const float *__restrict__ cw, bf16_t *__restrict__ out, unsigned *__restrict__ cnt",
}
local BADPAIR = [==[
  if (!pair_weights(p, n, ids, n_tab, w_tab, ws_tab, w, ws, x, wb, sb)) return;   /* the whole CTA: y row p stays */
]==]
-- A bad pair's CTA writes its epilogue only after the grid wait, as every
-- other global write: with lead=1 and settled=1 it may not have waited yet
-- (elsewhere it has, and griddepcontrol's repeats have no effect, PTX ISA).
local EPI_BADPAIR = [==[
  if (!pair_weights(p, n, ids, n_tab, w_tab, ws_tab, w, ws, x, wb, sb)) {   /* the whole CTA: y row p stays */
    M3_GRID_WAIT(); /* the epilogue writes global memory: after the wait */
    if (warp == 0) EPI_TILE((int)blockIdx.x, p, (int)blockIdx.x * RPW * 16);   /* its tile still counts */
    return;
  }
]==]
local EPI_MULTI = [==[
      if (warp == 0) EPI_TILE(clt, pp, tr0);
]==]
local EPI_TAIL = [==[
  EPI_TILE((int)blockIdx.x, p, row0);
]==]
local function epi(k) return k.act == "swiglu" or k.combine == 1 end

-- A ring stage's blocks, for both lean values: dec decodes the lane's weight
-- words to fp16 pairs, scale_fma scales a block's mma sums into acc.
local RING_STEP = [==[
#pragma unroll
  for (int u = 0; u < UNR; u++) {
    const uint4 xv = g < ntok ? xs4[g * XS4 + 4 * (b0 + u) + tq] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int r = 0; r < RPW; r++) {
      const uint2 q0 = *(const uint2 *)(st + (16 * r + g) * WSTR + 32 * u + 8 * tq);
      const uint2 q1 = *(const uint2 *)(st + (16 * r + 8 + g) * WSTR + 32 * u + 8 * tq);
      u32 a0, a2, a1, a3, c0, c2, c1, c3;
@dec@      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma16816(c, a0, a1, a2, a3, xv.x, xv.y);
      mma16816(c, c0, c1, c2, c3, xv.z, xv.w);
@scale_fma@    }
  }
]==]
local function ring_step(dec, scale_fma)
  local four = ""
  for _, v in ipairs({{"q0.x", "a0", "a2"}, {"q1.x", "a1", "a3"}, {"q0.y", "c0", "c2"}, {"q1.y", "c1", "c3"}}) do
    four = four .. string.format("      %s(%s, %s, %s);\n", dec, v[1], v[2], v[3])
  end
  local t = RING_STEP:gsub("@dec@", function() return four end)
  return (t:gsub("@scale_fma@", function() return scale_fma end))
end
-- A stage's E8M0 words of the lane's rows g, g + 8 of each tile (both lean values).
local SC_LOADS = [==[
  u32 sc[RPW][2][UNR / 4];
#pragma unroll
  for (int r = 0; r < RPW; r++)
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
      for (int j = 0; j < UNR / 4; j++)
        sc[r][h][j] = *(const u32 *)(st + 16 * RPW * WSTR + (16 * r + 8 * h + g) * UNR + 4 * j);
]==]
-- The ring's compute, lean=0: as tuned up to session 24 (this text renders
-- those records' code unchanged).
local RING_COMPUTE = [==[
/* One ring stage into the accumulators: blocks [b0, b0 + UNR) of the tile's
 * rows, decoded to fp16, two mma.m16n8k16 a block, scaled by the rows' E8M0. */
M3_DEV void ring_compute(float (&acc)[RPW][4], const unsigned char *st, const uint4 *xs4, int b0, int g, int tq,
                         int ntok) {
]==] .. SC_LOADS .. ring_step("e4m3_word_f16", [==[
      const float s0 = e8m0_to_f32((sc[r][0][u / 4] >> (8 * (u % 4))) & 0xffu);
      const float s1 = e8m0_to_f32((sc[r][1][u / 4] >> (8 * (u % 4))) & 0xffu);
      acc[r][0] = ffma_rn(c[0], s0, acc[r][0]);
      acc[r][1] = ffma_rn(c[1], s0, acc[r][1]);
      acc[r][2] = ffma_rn(c[2], s1, acc[r][2]);
      acc[r][3] = ffma_rn(c[3], s1, acc[r][3]);
]==]) .. "}\n"
local XSTAGE = [==[
      o.x = f16x2_of(fmul_rn(bf16lo(v.x), xm), fmul_rn(bf16lo(v.y), xm));   /* dims 0, 2 */
      o.y = f16x2_of(fmul_rn(bf16hi(v.x), xm), fmul_rn(bf16hi(v.y), xm));   /* dims 1, 3 */
      o.z = f16x2_of(fmul_rn(bf16lo(v.z), xm), fmul_rn(bf16lo(v.w), xm));   /* dims 4, 6 */
      o.w = f16x2_of(fmul_rn(bf16hi(v.z), xm), fmul_rn(bf16hi(v.w), xm));   /* dims 5, 7 */
]==]
-- lean=1 (device run 51's ncu of the MoE down GEMV: 8.5 weight bytes an
-- instruction, 2 warps a scheduler, no eligible warp half the cycles, so
-- every instruction of the chain shows): per 16 x 32 block a lane spent 8
-- cvt, 4 prmt, 2 x 7 on its two E8M0 scales (shift, mask, the 0 and 255
-- selects) and 4 FFMA, 2 of them on token columns a one-token launch
-- leaves empty.  Here: with cvt=hw the dims pair as they lie ((0,1), (2,3):
-- cvt reads a register's high half, no prmt; x is staged in that order);
-- a scale is two instructions (its byte moved to the exponent field) unless
-- a lane's scale words hold a 0x00 or 0xff code, when the warp takes the
-- select path for the whole stage (same values either way); one-token
-- launches (MoE, nmax=1) FMA only the token-0 columns.
local RING_COMPUTE_LEAN = [==[
#define ONE_TOK (MOE || NMAX == 1)
/* e4m3 bytes b0..b3 -> f16x2 (b0, b1), (b2, b3) */
M3_DEV void e4m3_word_f16_nat(u32 w, u32 &p01, u32 &p23) {
#if defined(__CUDA_ARCH__) && CVT_NAT
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.rn.f16x2.e4m3x2 %0, lo; cvt.rn.f16x2.e4m3x2 %1, hi; }"
      : "=r"(p01), "=r"(p23) : "r"(w));
#elif CVT_NAT
  u32 a, b;   /* the emulator: e4m3_word_f16 pairs (0,2), (1,3); re-pair its halves */
  e4m3_word_f16(w, a, b);
  p01 = (a & 0xffffu) | (b << 16);
  p23 = (a >> 16) | (b & 0xffff0000u);
#else
  e4m3_word_f16(w, p01, p23);   /* cvt=alu: its own pairing (0,2), (1,3), x staged so */
#endif
}
/* 2^(s - 127) for an E8M0 code s = byte k of w, s not 0 or 255 */
M3_DEV float e8m0_byte(u32 w, int k) {
  return __uint_as_float((k == 3 ? w >> 1 : w << (23 - 8 * k)) & 0x7f800000u);
}
/* nonzero when a byte of w is 0x00 or 0xff (codes 2^-127 and NaN: the select path) */
M3_DEV u32 e8m0_edge(u32 w) { return ((w - 0x01010101u) & ~w & 0x80808080u) | ((~w - 0x01010101u) & w & 0x80808080u); }
template <bool EDGE>
M3_DEV void ring_mma(float (&acc)[RPW][4], const unsigned char *st, const uint4 *xs4, int b0, int g, int tq, int ntok,
                     const u32 (&sc)[RPW][2][UNR / 4]) {
]==] .. ring_step("e4m3_word_f16_nat", [==[
      const u32 w0 = sc[r][0][u / 4], w1 = sc[r][1][u / 4];
      const float s0 = EDGE ? e8m0_to_f32((w0 >> (8 * (u % 4))) & 0xffu) : e8m0_byte(w0, u % 4);
      const float s1 = EDGE ? e8m0_to_f32((w1 >> (8 * (u % 4))) & 0xffu) : e8m0_byte(w1, u % 4);
      acc[r][0] = ffma_rn(c[0], s0, acc[r][0]);
      acc[r][2] = ffma_rn(c[2], s1, acc[r][2]);
      if (!ONE_TOK) {
        acc[r][1] = ffma_rn(c[1], s0, acc[r][1]);
        acc[r][3] = ffma_rn(c[3], s1, acc[r][3]);
      }
]==]) .. "}\n" .. [==[
/* One ring stage into the accumulators (lean=1): as lean=0's, see above. */
M3_DEV void ring_compute(float (&acc)[RPW][4], const unsigned char *st, const uint4 *xs4, int b0, int g, int tq,
                         int ntok) {
]==] .. SC_LOADS .. [==[
  u32 edge = 0u;
  for (int i = 0; i < RPW * 2 * (UNR / 4); i++) edge |= e8m0_edge((&sc[0][0][0])[i]);
  if (__any_sync(FULL, edge != 0u)) ring_mma<true>(acc, st, xs4, b0, g, tq, ntok, sc);
  else ring_mma<false>(acc, st, xs4, b0, g, tq, ntok, sc);
}
]==]
-- lean=1 with cvt=hw: x in the dims' own pairs (0,1), (2,3), (4,5), (6,7).
local XSTAGE_NAT = [==[
      o.x = f16x2_of(fmul_rn(bf16lo(v.x), xm), fmul_rn(bf16hi(v.x), xm));   /* dims 0, 1 */
      o.y = f16x2_of(fmul_rn(bf16lo(v.y), xm), fmul_rn(bf16hi(v.y), xm));   /* dims 2, 3 */
      o.z = f16x2_of(fmul_rn(bf16lo(v.z), xm), fmul_rn(bf16hi(v.z), xm));   /* dims 4, 5 */
      o.w = f16x2_of(fmul_rn(bf16lo(v.w), xm), fmul_rn(bf16hi(v.w), xm));   /* dims 6, 7 */
]==]

local WAIT_OPEN = "M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */"
-- The bf16 / fp32 GEMV (gemv_body): the warp's first weight lines toward L2
-- while x is staged (the staging latency overlaps the first HBM reads; a
-- hint only); with lead=1 (non-MoE: the weights are launch inputs no kernel
-- writes) its whole column slice of each row, one bulk prefetch a row, before
-- the wait: the router's 3 MB are then in L2 when the post-attention norm
-- is done.
local PREFETCH_LINES = [==[
#pragma unroll
  for (int u = 0; u < UNROLL; u++)
#pragma unroll
    for (int r = 0; r < RPW; r++) {
      const int c = (s_beg + u) * 32 + lane;
      if (c < c_end && row0 + r < rows)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(wb + ((long long)(row0 + r) * CPR + c) * 16));
    }
]==]
local PREFETCH_LEAD = [==[
  if (lane < RPW && row0 + lane < rows && 32 * s_beg < c_end)
    prefetch_l2(wb + ((long long)(row0 + lane) * CPR + 32 * s_beg) * 16, (unsigned)(c_end - 32 * s_beg) * 16u);
]==]
local LEAD_OPEN = "M3_LEAD_IN; /* the weights only until the wait (lib/lead.lua) */"
local LEAD_WAIT = "  M3_GRID_WAIT(); /* x is the previous kernel's output */\n"
-- The one-tile loop's pair: grid row blockIdx.y.  With lead=1 on a MoE launch
-- whose ids are the previous kernel's (settled=0: the gate|up GEMV, right
-- after route), only the shared expert's pairs (p >= n: weights the launch
-- arguments name) can stream before the wait; their grid rows come first, so
-- that they are the first wave, and the routed CTAs wait before they read ids.
local PAIRSEL = "  const int p = MOE ? (int)blockIdx.y : 0;\n"
-- (A routed CTA then passes the kernel's wait a second time: griddepcontrol's
-- repeats have no effect, PTX ISA.)
local SHARED_PAIRSEL = [==[
  const int nsh = npairs - n, p = (int)blockIdx.y < nsh ? n + (int)blockIdx.y : (int)blockIdx.y - nsh;
  if (p < n) M3_GRID_WAIT(); /* a routed pair: ids are the previous kernel's output */
]==]
local function shared_lead(k, t) return t.lead == 1 and k.moe == 1 and k.settled == 0 end

-- The router GEMV's route epilogue (route_e > 0): lib/route.lua's selection
-- on the key's experts, top-k and renorm; fp32 logits.
-- atomicAdd(p, 1) with release (earlier stores, the barrier's included, are
-- seen first) and acquire (later loads see what the releases published).
local ROUTE_TICKET = [==[
M3_DEV unsigned route_ticket(unsigned *p) {
#ifdef __CUDA_ARCH__
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  return old;
#else
  return __atomic_fetch_add(p, 1u, __ATOMIC_ACQ_REL);
#endif
}
]==]
local function route_defs(k)
  if k.route_e == 0 then return "" end
  return string.format("#define E %d\n#define K %d\n#define EPL ((E + 31) / 32)\n#define RENORM %d\n" ..
                       "#define LOGITS_BF16 0\n#ifndef FULL\n#define FULL 0xffffffffu\n#endif\n",
                       k.route_e, k.route_k, k.route_renorm) .. R.beats .. R.route_token .. ROUTE_TICKET
end
local ROUTE_PARAMS = ",\n     const float *__restrict__ rbias, int *__restrict__ rids, float *__restrict__ rw, " ..
                     "unsigned *__restrict__ rcnt, float rscale"

function T.render(k, t, arch, sym)
  local src, threads, smem
  threads = t.warps * 32
  if k.op == "dequant" then
    src = F.subst("mxfp8", dequant_body, {cols = k.cols, threads = threads, sym = sym})
    smem = 0
  elseif k.w == "e4m3" then
    src = "#ifndef FULL\n#define FULL 0xffffffffu\n#endif\n" .. I.mma("f16") .. I.e4m3_decode(t.cvt) ..
      (t.lead == 1 and LEAD.defs or "") .. F.subst("mxfp8", gemv_mma_body, {
      cols = k.cols, nmax = k.nmax, moe = k.moe, warps = t.warps, rpw = t.rpw, unroll = t.unroll, pipe = t.pipe,
      wlog2 = t.cvt == "hw" and 0 or 8, stage = ring_stage(t), tpc = t.tpc, sym = sym, cp_async = P.cp_async("PIPE - 1"),
      open = t.lead == 1 and LEAD_OPEN or WAIT_OPEN,
      wait = t.lead == 1 and LEAD_WAIT or "",
      pairsel = shared_lead(k, t) and SHARED_PAIRSEL or PAIRSEL,
      fused_defs = fused_defs(k),
      ring_compute = t.lean == 1 and ("#define CVT_NAT " .. (t.cvt == "hw" and 1 or 0) .. "\n" .. RING_COMPUTE_LEAN)
        or RING_COMPUTE,
      xstage = (t.lean == 1 and t.cvt == "hw") and XSTAGE_NAT or XSTAGE,
      params = k.act == "swiglu" and EPI_PARAMS.act or (k.combine == 1 and EPI_PARAMS.combine or ""),
      badpair = epi(k) and EPI_BADPAIR or BADPAIR,
      epi_multi = epi(k) and EPI_MULTI or "", epi_tail = epi(k) and EPI_TAIL or "",
    })
    smem = gemv_smem(k, t)
  else
    src = (t.lead == 1 and LEAD.defs or "") .. route_defs(k) .. F.subst("mxfp8", gemv_body, {
      wfmt = ({e4m3 = 0, bf16 = 1, f32 = 2})[k.w], outf32 = k.out == "f32" and 1 or 0, cols = k.cols,
      nmax = k.nmax, moe = k.moe, warps = t.warps, rpw = t.rpw, unroll = t.unroll, ksplit = t.ksplit, sym = sym,
      open = t.lead == 1 and LEAD_OPEN or WAIT_OPEN,
      prefetch = t.lead == 1 and PREFETCH_LEAD or PREFETCH_LINES,
      wait = t.lead == 1 and LEAD_WAIT or "",
      route_e = k.route_e,
      rparams = k.route_e > 0 and ROUTE_PARAMS or "",
    })
    smem = gemv_smem(k)
  end
  return {source = P.all(arch) .. F.base .. src, threads = threads, smem = smem}
end

return T
