#!/usr/bin/env python3
"""baseline_torch.py - the baseline a user would pick instead of m3kit: one batch-1
decode step of MiniMax-M3 written in plain PyTorch *eager* (no torch.compile, no
CUDA graphs, no custom kernels), at the real shapes, with random weights generated
on the GPU.  Issue 6, target 7.

    python3 bench/baseline_torch.py                       # contexts 8192,32768,131072 on cuda
    python3 bench/baseline_torch.py --contexts 8192,786432 --cache-dtype bf16,e4m3 --json out.json
    python3 bench/baseline_torch.py --device cpu --tiny --check   # tiny config, checks the fast path

What one step does (spec m3-architecture.md §2.3/§2.4), per layer l = 0..59:
  Gemma RMSNorm -> fused QKV(+index) projection -> per-head Gemma norm + partial NeoX RoPE
  (q, k, index-q, index-k) -> append k, v (and index-k) to the caches ->
  dense layers 0-2: causal GQA over the whole history (SDPA) |
  sparse layers 3-59: indexer (index-q . index-K for every cached token, max per 128-token
  block, own block forced, top-16 per index head) + attention over the 16 selected blocks
  of its KV head (SDPA over the gathered blocks) ->
  o_proj -> residual -> RMSNorm -> dense SwiGLU-OAI MLP (layers 0-2) |
  MoE (fp32 sigmoid router + correction bias, top-4, renormalised x2.0, SwiGLU-OAI experts,
  + the shared expert) (layers 3-59) -> residual;
then the final norm, lm_head and greedy argmax, whose id is the next step's input.

Choices (all documented in the output and the --json record):
  * Weights are bf16 (router fp32, as in the checkpoint).  Routing is restricted to
    --resident-experts (default 8) experts per MoE layer exactly as `m3kit run
    --resident-experts 8` does: the router is the full 128-row fp32 matrix, the
    correction bias of the non-resident experts is -inf, so top-4 picks among the 8
    resident ones and a step reads the real model's bytes (4 routed + 1 shared expert).
  * Distinct weights for every layer when they fit in GPU memory together with the
    largest context's caches (bf16: ~78 GB of weights).  Otherwise the 57 sparse/MoE
    layers share P < 57 weight sets round-robin (layer i uses set i mod P, P as large as
    fits; --weight-sets forces P).  One set is ~1.2 GB, 20x the H200's 60 MB L2, so a
    layer still reads all its weights from HBM: the bytes per step are unchanged.
  * Caches are contiguous per layer (batch 1): K and V [4, Tcap, 128], index-K [Tcap, 128],
    filled with random values up to the context.  e4m3 caches (--cache-dtype e4m3, both
    KV and index-K, as m3kit's --kv-dtype/--index-dtype e4m3) are stored as
    torch.float8_e4m3fn and upcast to bf16 where read (what eager PyTorch can do), and
    index-q is rounded through e4m3 as m3kit does.
  * QKV weight rows are ordered [q | k | index_q | index_k | v] (random weights, so only
    the order of the output columns changes) so that one norm + RoPE covers all heads.
  * Attention uses F.scaled_dot_product_attention with the 16 query heads of a KV head
    as 16 "query rows" (q [1, 4, 16, 128] against K/V [1, 4, T, 128]): no repeat of K/V.
    Sparse layers: torch.topk returns the forced local block first (score 1e29), so the
    causal mask is the same for every head: the tokens after the current one in the
    first gathered block.
  * MoE --moe loop (default): the 4 selected ids go to the host (.tolist(), one sync per
    MoE layer) and each expert's weights are used in place; gather: stack the selected
    experts' weights with an index (no sync, but a copy of them); all: run the 8 resident
    experts with zero weight for the unselected ones (no sync, 2x the expert bytes).
  * TPOT: CUDA events around every step after --warmup steps; median (p20, p80) of --steps
    steps; the generated id is read back after each step as a generating user would.
    The position advances by one per step (context C, C+1, ...), as m3kit's decode does.
  * Roofline: bytes the step must read (weights used + KV/index-K read, spec §9.2-9.4)
    / --ceiling-gbps (default 4278: the H200's copy ceiling, shared/spec/h200-anchors.md;
    bench/tpot_curve.sh passes the one it measured in the same call).
"""
import argparse
import json
import math
import statistics
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # --help included: every mode runs PyTorch
    sys.exit("baseline_torch.py: needs PyTorch (pip install torch; the GPU machine has it), also for --device cpu --check")

CEILING_BPS = 4.28e12  # --ceiling-gbps sets it

M3 = dict(  # ../shared/models/minimax-m3/config.json (text_config)
    hidden_size=6144, num_hidden_layers=60, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
    vocab_size=200064, intermediate_size=3072, dense_intermediate_size=12288, shared_intermediate_size=3072,
    n_shared_experts=1, num_local_experts=128, num_experts_per_tok=4, routed_scaling_factor=2.0,
    swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_beta=1.0, rms_norm_eps=1e-6, rope_theta=5000000.0,
    rotary_dim=64, max_position_embeddings=1048576,
    dense_layers=3,  # moe_layer_freq / sparse_attention_freq = [0,0,0, 1 x 57]
    sparse_index_dim=128, sparse_num_index_heads=4, sparse_block_size=128, sparse_topk_blocks=16)

TINY = dict(M3, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, head_dim=32, vocab_size=512,
            intermediate_size=64, dense_intermediate_size=128, shared_intermediate_size=64, num_local_experts=16,
            rotary_dim=16, max_position_embeddings=1 << 21, dense_layers=1, sparse_index_dim=32,
            sparse_block_size=16, sparse_topk_blocks=4)


def load_config(path):
    with open(path) as f:
        j = json.load(f)
    t = j.get("text_config", j)
    c = dict(M3)
    for k in c:
        if k in t:
            c[k] = t[k]
    sac = t.get("sparse_attention_config", {})
    for k in ("sparse_index_dim", "sparse_num_index_heads", "sparse_block_size", "sparse_topk_blocks"):
        if k in sac:
            c[k] = sac[k]
    freq = sac.get("sparse_attention_freq") or t.get("moe_layer_freq")
    if freq:
        c["dense_layers"] = next((i for i, v in enumerate(freq) if v), len(freq))
        if any(not v for v in freq[c["dense_layers"]:]):
            sys.exit("baseline_torch: only configs whose dense layers come first are supported")
    c["swiglu_beta"] = t.get("swiglu_beta", 1.0)
    return c


class Dims:
    def __init__(self, c, resident):
        self.H, self.L, self.nq, self.nkv = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]
        self.D, self.rot, self.V = c["head_dim"], c["rotary_dim"], c["vocab_size"]
        self.I, self.F = c["intermediate_size"], c["dense_intermediate_size"]
        self.S = c["shared_intermediate_size"] * c["n_shared_experts"]
        self.E, self.k = c["num_local_experts"], c["num_experts_per_tok"]
        self.R = min(resident, self.E)
        self.niq, self.idim = c["sparse_num_index_heads"], c["sparse_index_dim"]
        self.B, self.topk = c["sparse_block_size"], c["sparse_topk_blocks"]
        self.ndense = c["dense_layers"]
        self.nsparse = self.L - self.ndense
        self.eps, self.theta = c["rms_norm_eps"], c["rope_theta"]
        self.alpha, self.limit, self.beta = c["swiglu_alpha"], c["swiglu_limit"], c["swiglu_beta"]
        self.scale = c["routed_scaling_factor"]
        self.maxpos = c["max_position_embeddings"]
        if self.idim != self.D or self.niq != self.nkv:
            sys.exit("baseline_torch: needs sparse_index_dim == head_dim and index heads == KV heads (true for M3)")
        if self.R < self.k:
            sys.exit("baseline_torch: --resident-experts must be >= num_experts_per_tok")
        self.G = self.nq // self.nkv

    def qkv_rows(self, sparse):
        return (self.nq + 2 * self.nkv + (self.niq + 1 if sparse else 0)) * self.D

    # ---- bytes (bf16 weights; router fp32) -------------------------------------------------
    def dense_layer_weight_bytes(self):
        return 2 * (self.qkv_rows(False) * self.H + self.H * self.nq * self.D + 3 * self.F * self.H + 2 * self.H)

    def sparse_layer_weight_bytes(self, experts):
        return (2 * (self.qkv_rows(True) * self.H + self.H * self.nq * self.D + 2 * self.H)
                + 4 * (self.E * self.H + self.E) + 2 * 3 * self.H * (experts * self.I + self.S))

    def step_bytes(self, T, kvb, ib):
        """Bytes one decode step at history length T (current token included) must read."""
        w = (self.ndense * self.dense_layer_weight_bytes() + self.nsparse * self.sparse_layer_weight_bytes(self.k)
             + 2 * self.V * self.H + 4 * self.H)  # lm_head, final norm, one embedding row
        kv = self.ndense * T * self.nkv * 2 * self.D * kvb
        kv += self.nsparse * (self.nkv * min(T, self.topk * self.B) * 2 * self.D * kvb + T * self.idim * ib)
        return w, kv

    def cache_bytes(self, tcap, kvb, ib):
        return tcap * (self.L * self.nkv * 2 * self.D * kvb + self.nsparse * self.idim * ib)


def swiglu_oai(h, d):
    g, u = h.float().chunk(2, dim=-1)
    g = g.clamp(max=d.limit)
    u = u.clamp(min=-d.limit, max=d.limit)
    return (g * torch.sigmoid(d.alpha * g) * (u + d.beta)).to(torch.bfloat16)


class Model:
    def __init__(self, d, dev, weight_sets, moe, seed):
        self.d, self.dev, self.moe = d, dev, moe
        g = torch.Generator(device=dev)
        g.manual_seed(seed)
        self.g = g
        bf = torch.bfloat16

        def rnd(*shape, std=None, dtype=bf):
            std = std if std is not None else 1.0 / math.sqrt(shape[-1])
            return torch.empty(*shape, device=dev, dtype=dtype).normal_(0.0, std, generator=g)

        def normw(n):  # Gemma norm: y = x_hat * (1 + w); precompute 1 + w in fp32 from the bf16 weight
            return (1.0 + rnd(n, std=0.1).float())

        H, D = d.H, d.D
        self.embed = rnd(d.V, H, std=1.0)
        self.lm_head = rnd(d.V, H)
        self.final_norm = normw(H)
        self.layers = []
        for l in range(d.ndense):
            self.layers.append(dict(sparse=False, w_in=normw(H), w_post=normw(H), qkv=rnd(d.qkv_rows(False), H),
                                    o=rnd(H, d.nq * D), hn=self._head_norms(normw, False),
                                    gu=rnd(2 * d.F, H), down=rnd(H, d.F)))
        sets = []
        for s in range(weight_sets):
            bias = torch.full((d.E,), float("-inf"), device=dev)
            bias[:d.R] = rnd(d.R, std=0.01, dtype=torch.float32)
            sets.append(dict(sparse=True, w_in=normw(H), w_post=normw(H), qkv=rnd(d.qkv_rows(True), H),
                             o=rnd(H, d.nq * D), hn=self._head_norms(normw, True),
                             router=rnd(d.E, H, dtype=torch.float32), bias=bias,
                             w13=rnd(d.R, 2 * d.I, H), w2=rnd(d.R, H, d.I),
                             sh13=rnd(2 * d.S, H) if d.S else None, sh2=rnd(H, d.S) if d.S else None))
        for i in range(d.nsparse):
            self.layers.append(sets[i % weight_sets])
        self.weight_sets = weight_sets
        self.exact_scores = False  # --check only
        self.sel_seen, self.moe_seen, self.ties = {}, {}, 0
        self.head_idx = torch.arange(d.nkv, device=dev)[:, None]

    def _head_norms(self, normw, sparse):
        d = self.d
        qn, kn = normw(d.D), normw(d.D)
        rows = [qn.expand(d.nq, d.D), kn.expand(d.nkv, d.D)]
        if sparse:
            rows += [normw(d.D).expand(d.niq, d.D), normw(d.D).expand(1, d.D)]
        return torch.cat(rows).contiguous()  # [heads, D] fp32 (1 + w) per head

    def rope_table(self, npos):
        d = self.d
        inv = 1.0 / (d.theta ** (torch.arange(0, d.rot, 2, dtype=torch.float32, device=self.dev) / d.rot))
        ang = torch.arange(npos, dtype=torch.float32, device=self.dev)[:, None] * inv[None, :]
        self.cos = ang.cos().to(torch.bfloat16)
        self.sin = ang.sin().to(torch.bfloat16)

    # ---- caches -------------------------------------------------------------------------------
    def make_caches(self, tcap, ctx, kv_dtype, idx_dtype):
        d = self.d
        self.kv_dtype, self.idx_dtype, self.tcap = kv_dtype, idx_dtype, tcap

        def filled(shape, dtype):  # random history; e4m3 through a bf16 chunk (normal_ has no fp8 kernel)
            t = torch.empty(shape, device=self.dev, dtype=dtype)
            if dtype == torch.bfloat16:
                return t.normal_(generator=self.g)
            flat, step = t.view(-1), 1 << 26
            for i in range(0, flat.numel(), step):
                n = min(step, flat.numel() - i)
                flat[i:i + n].copy_(torch.empty(n, device=self.dev, dtype=torch.bfloat16).normal_(generator=self.g))
            return t

        self.kc, self.vc, self.ic = [], [], []
        for l in range(d.L):
            self.kc.append(filled((d.nkv, tcap, d.D), kv_dtype))
            self.vc.append(filled((d.nkv, tcap, d.D), kv_dtype))
            self.ic.append(filled((tcap, d.idim), idx_dtype) if l >= d.ndense else None)
        self.mask_buf = torch.zeros(d.topk * d.B, device=self.dev, dtype=torch.bfloat16)

    def free_caches(self):
        self.kc = self.vc = self.ic = None
        self.mask_buf = None

    # ---- one decode step ----------------------------------------------------------------------
    def rms(self, x, w1p):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.d.eps) * w1p).to(torch.bfloat16)

    def heads_norm_rope(self, P, L, pos):
        """P [1, rows]: the leading (nq + nkv [+ niq + 1]) heads get Gemma norm + NeoX RoPE."""
        d = self.d
        nh = L["hn"].shape[0]
        x = P[0, :nh * d.D].view(nh, d.D).float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + d.eps) * L["hn"]
        c, s = self.cos[pos].float(), self.sin[pos].float()
        h = d.rot // 2
        x1, x2 = x[:, :h], x[:, h:d.rot]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[:, d.rot:]], dim=-1)  # fp32, rounded by callers

    def attention(self, l, L, P, pos, mask):
        d = self.d
        T = pos + 1
        hx = self.heads_norm_rope(P, L, pos)
        q = hx[:d.nq].to(torch.bfloat16)
        k = hx[d.nq:d.nq + d.nkv]
        v = P[0, L["hn"].shape[0] * d.D:].view(d.nkv, d.D)
        kc, vc = self.kc[l], self.vc[l]
        kc[:, pos].copy_(k)  # fp32 -> bf16 / e4m3, one rounding (spec §4.5)
        vc[:, pos].copy_(v)
        qg = q.view(1, d.nkv, d.G, d.D)
        up = self.kv_dtype != torch.bfloat16
        if not L["sparse"]:
            K, Vv = kc[:, :T], vc[:, :T]
            if up:
                K, Vv = K.to(torch.bfloat16), Vv.to(torch.bfloat16)
            o = F.scaled_dot_product_attention(qg, K.unsqueeze(0), Vv.unsqueeze(0))
        else:
            iq = hx[d.nq + d.nkv:d.nq + d.nkv + d.niq]
            ik = hx[d.nq + d.nkv + d.niq]
            ic = self.ic[l]
            ic[pos].copy_(ik)
            nb = (T + d.B - 1) // d.B
            keys = ic[:nb * d.B]
            if self.idx_dtype != torch.bfloat16:
                iq = iq.to(self.idx_dtype)
                keys = keys.to(torch.bfloat16)
            if self.exact_scores:  # --check: fp32 scores, so that the reference ranks the same values
                s = torch.matmul(iq.to(torch.bfloat16).float(), keys.float().t())
            else:
                s = torch.matmul(iq.to(torch.bfloat16), keys.t()).float()  # [niq, nb*B], bf16 GEMM output
            if nb * d.B > T:
                s[:, T:].fill_(float("-inf"))  # not yet written: causal
            bs = s.view(d.niq, nb, d.B).amax(dim=-1)
            bs[:, nb - 1] = 1e29  # the query's own block is always selected
            kk = min(d.topk, nb)
            sel = torch.topk(bs, kk, dim=-1).indices  # [nkv, kk], own block first
            if self.exact_scores:
                self.sel_seen[l] = sel.tolist()
            Kb = kc.view(d.nkv, -1, d.B, d.D)[self.head_idx, sel].view(1, d.nkv, kk * d.B, d.D)
            Vb = vc.view(d.nkv, -1, d.B, d.D)[self.head_idx, sel].view(1, d.nkv, kk * d.B, d.D)
            if up:
                Kb, Vb = Kb.to(torch.bfloat16), Vb.to(torch.bfloat16)
            o = F.scaled_dot_product_attention(qg, Kb, Vb, attn_mask=mask[:kk * d.B].view(1, 1, 1, -1))
        return F.linear(o.reshape(1, d.nq * d.D), L["o"])

    def ffn(self, L, m):
        d = self.d
        if not L["sparse"]:
            return F.linear(swiglu_oai(F.linear(m, L["gu"]), d), L["down"])
        s = torch.sigmoid(F.linear(m.float(), L["router"]))  # fp32 router [1, E]
        idx = torch.topk(s + L["bias"], d.k, dim=-1).indices  # bias: selection only
        w = s.gather(1, idx)
        w = w / w.sum(dim=-1, keepdim=True) * d.scale  # [1, k] fp32
        if self.exact_scores:
            self.moe_seen[id(L)] = idx[0].tolist()
        routed = torch.zeros(1, d.H, device=self.dev, dtype=torch.float32)
        if self.moe == "loop":
            for j, e in enumerate(idx[0].tolist()):
                y = F.linear(swiglu_oai(F.linear(m, L["w13"][e]), d), L["w2"][e])
                routed += w[:, j:j + 1] * y.float()
        elif self.moe == "gather":
            w13, w2 = L["w13"][idx[0]], L["w2"][idx[0]]  # [k, 2I, H], [k, H, I] copies
            a = swiglu_oai(torch.matmul(w13, m[0]), d)  # [k, I]
            y = torch.matmul(w2, a.unsqueeze(-1)).squeeze(-1)  # [k, H]
            routed += (w[0, :, None] * y.float()).sum(0, keepdim=True)
        else:  # all resident experts, zero weight where not selected
            wr = torch.zeros(1, d.E, device=self.dev).scatter(1, idx, w)[0, :d.R]
            a = swiglu_oai(torch.matmul(L["w13"], m[0]), d)  # [R, I]
            y = torch.matmul(L["w2"], a.unsqueeze(-1)).squeeze(-1)  # [R, H]
            routed += (wr[:, None] * y.float()).sum(0, keepdim=True)
        out = routed.to(torch.bfloat16)
        if d.S:
            out = out + F.linear(swiglu_oai(F.linear(m, L["sh13"]), d), L["sh2"])
        return out

    def step(self, tok, pos, trace=None):
        d = self.d
        x = F.embedding(tok, self.embed)  # [1, H] bf16 residual stream
        mask = self.mask_buf  # one causal mask for every sparse layer (see the module doc)
        mask.zero_()
        if pos % d.B + 1 < d.B:
            mask[pos % d.B + 1:d.B].fill_(float("-inf"))
        for l, L in enumerate(self.layers):
            x_in = x
            a = self.rms(x, L["w_in"])
            P = F.linear(a, L["qkv"])
            x = x + self.attention(l, L, P, pos, mask)
            x = x + self.ffn(L, self.rms(x, L["w_post"]))
            if trace is not None:
                trace.append((x_in, x))
        logits = F.linear(self.rms(x, self.final_norm), self.lm_head)
        return logits.argmax(dim=-1), x


# ---- a slow, loop-by-loop reference of the same step (for --check) ---------------------------------
def close(a, b, rel):
    return all(abs(x - y) <= rel * max(abs(x), abs(y), 1e-30) for x, y in zip(a, b))


def reference_layer(m, l, x, pos):
    """Layer l of the step from its input x, loop by loop: explicit per-block maxima, selection by a
    stable sort (lower block id first among equal scores), explicit softmax per head, every
    expert by its routing weight."""
    d, L = m.d, m.layers[l]
    T = pos + 1
    a = m.rms(x, L["w_in"])
    P = F.linear(a, L["qkv"])
    hx = m.heads_norm_rope(P, L, pos)
    q = hx[:d.nq].to(torch.bfloat16).float()
    K = m.kc[l][:, :T].to(torch.bfloat16).float()
    Vv = m.vc[l][:, :T].to(torch.bfloat16).float()
    o = torch.zeros(d.nq, d.D, device=m.dev)
    for h in range(d.nq):
        g = h // d.G
        keys = list(range(T))
        if L["sparse"]:
            iq = hx[d.nq + d.nkv + g]
            if m.idx_dtype != torch.bfloat16:
                iq = iq.to(m.idx_dtype)
            iq = iq.to(torch.bfloat16).float()
            sc = m.ic[l][:T].to(torch.bfloat16).float() @ iq  # fp32 (the fast path's are too under --check)
            nb = (T + d.B - 1) // d.B
            bsc = [sc[b * d.B:min(T, (b + 1) * d.B)].max().item() for b in range(nb)]
            bsc[nb - 1] = float("inf")  # own block forced
            chosen = sorted(range(nb), key=lambda b: (-bsc[b], b))[:min(d.topk, nb)]
            fast = m.sel_seen.get(l, [[]] * d.nkv)[g]
            if sorted(fast) != sorted(chosen):  # ties: e4m3 scores are often exactly equal
                if not close(sorted(bsc[b] for b in fast), sorted(bsc[b] for b in chosen), 1e-4):
                    raise AssertionError(f"layer {l} head {h}: the fast path selected blocks {sorted(fast)}, "
                                         f"the reference {sorted(chosen)}")
                m.ties += 1
                chosen = fast  # an equally valid top-k: equal scores, another tie order
            keys = [j for j in range(T) if j // d.B in chosen]
        kt = torch.tensor(keys, device=m.dev)
        p = torch.softmax(K[g, kt] @ q[h] / math.sqrt(d.D), 0)
        o[h] = p @ Vv[g, kt]
    x = x + F.linear(o.to(torch.bfloat16).reshape(1, -1), L["o"])
    mm = m.rms(x, L["w_post"])
    if not L["sparse"]:
        return x + F.linear(swiglu_oai(F.linear(mm, L["gu"]), d), L["down"])
    s = torch.sigmoid(mm.float() @ L["router"].t())[0]
    choice = (s + L["bias"]).tolist()
    idx = sorted(range(d.E), key=lambda e: (-choice[e], e))[:d.k]
    fast = m.moe_seen.get(id(L), idx)
    if sorted(fast) != sorted(idx):  # a near tie, flipped by the rounding of the attention output
        if not close(sorted(choice[e] for e in fast), sorted(choice[e] for e in idx), 2e-3):
            raise AssertionError(f"layer {l}: the fast path routed to experts {sorted(fast)}, the reference to "
                                 f"{sorted(idx)}")
        m.ties += 1
        idx = fast
    assert all(e < d.R for e in idx), "routing left the resident experts"
    tot = sum(s[e].item() for e in idx)
    out = torch.zeros(d.H, device=m.dev)
    for e in idx:
        y = F.linear(swiglu_oai(F.linear(mm, L["w13"][e]), d), L["w2"][e])
        out += s[e].item() / tot * d.scale * y[0].float()
    out = out.to(torch.bfloat16)
    if d.S:
        out = out + F.linear(swiglu_oai(F.linear(mm, L["sh13"]), d), L["sh2"])[0]
    return x + out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def run_context(a, d, model, dev, cuda, ctx, tcap, dt, tdt):
    """Caches for `ctx` tokens, optional --check, warm-up, timed steps; the result row."""
    model.make_caches(tcap, ctx, tdt, tdt)
    tok = torch.randint(0, d.V, (1,), device=dev, generator=model.g)
    if a.check:
        if a.tiny or a.config:
            model.moe, model.exact_scores = "loop", True
            trace, model.ties = [], 0
            model.step(tok, ctx - 1, trace)  # writes token ctx-1: the reference sees the same caches
            err = 0.0
            for l, (x_in, x_out) in enumerate(trace):  # each layer from the fast path's own input
                xr = reference_layer(model, l, x_in, ctx - 1).float()
                upd = (x_out.float() - x_in.float()).abs().max()
                err = max(err, ((x_out.float() - xr).abs().max() / upd).item())
            merr = 0.0  # the three MoE implementations on one input per weight set
            for L in model.layers[d.ndense:d.ndense + model.weight_sets]:
                mm = torch.randn(1, d.H, device=dev, generator=model.g).to(torch.bfloat16)
                outs = {}
                for mode in ("loop", "gather", "all"):
                    model.moe = mode
                    outs[mode] = model.ffn(L, mm).float()
                merr = max([merr] + [((outs[k] - outs["loop"]).abs().max() / outs["loop"].abs().max()).item()
                                     for k in outs])
            model.moe, model.exact_scores = a.moe, False
            ok = err < 0.05 and merr < 0.05
            print(f"# check context {ctx} ({dt}): fast path vs loop-by-loop reference, worst layer: max diff "
                  f"{err:.2e} of the layer's update ({model.ties} near-tied block/expert choices taken from the fast path); MoE loop/gather/all max rel. "
                  f"diff {merr:.2e}: "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                sys.exit(1)
        else:
            print("# --check: the loop-by-loop reference runs only with --tiny or --config", flush=True)
    times, walls = [], []
    pos = ctx  # the step appends token `pos`: the history before it is exactly `ctx` tokens
    for i in range(a.warmup + a.steps):
        if cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            w0 = time.perf_counter()
            ev0.record()
            tok, _ = model.step(tok, pos)
            ev1.record()
            tok_host = tok.item()  # a generating user reads the id (EOS, streaming)
            ms = ev0.elapsed_time(ev1)
        else:
            w0 = time.perf_counter()
            tok, _ = model.step(tok, pos)
            tok_host = tok.item()
            ms = (time.perf_counter() - w0) * 1e3
        wall = (time.perf_counter() - w0) * 1e3
        if i >= a.warmup:
            times.append(ms)
            walls.append(wall)
        pos += 1
    del tok_host
    kvb = 2 if dt == "bf16" else 1
    Tmid = ctx + a.warmup + a.steps // 2 + 1
    wb, kb = d.step_bytes(Tmid, kvb, kvb)
    r = dict(context=ctx, cache_dtype=dt, tpot_ms=statistics.median(times), p20_ms=pct(times, 20),
             p80_ms=pct(times, 80), wall_ms_mean=statistics.mean(walls), weight_bytes_per_step=wb,
             kv_bytes_per_step=kb, roofline_ms=(wb + kb) / CEILING_BPS * 1e3)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default=None, help="comma list (default 8192,32768,131072; tiny: 40,200,1000)")
    ap.add_argument("--cache-dtype", default="auto",
                    help="bf16|e4m3|auto, or one per context: KV and index-K cache dtype (auto: bf16 where "
                         "the bf16 caches fit next to distinct weights, else e4m3)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny M3-shaped config (for CPU checks)")
    ap.add_argument("--config", help="config.json to read instead of the embedded minimax-m3 values")
    ap.add_argument("--resident-experts", type=int, default=8)
    ap.add_argument("--weight-sets", type=int, default=0, help="distinct sparse-layer weight sets (default: "
                    "all layers distinct if that fits, else as many as fit)")
    ap.add_argument("--moe", choices=["loop", "gather", "all"], default="loop")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per context (median of these)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-limit-gb", type=float, default=0, help="plan as if the GPU had this much memory")
    ap.add_argument("--check", action="store_true", help="compare one step against the loop-by-loop reference "
                    "(tiny configs only) and the three MoE modes against each other")
    ap.add_argument("--ceiling-gbps", type=float, default=4278.0,
                    help="copy ceiling for the roofline, GB/s (default 4278, the H200's)")
    ap.add_argument("--json", help="write the results (and choices) to this file, rewritten after each context")
    a = ap.parse_args()
    if not (a.ceiling_gbps > 0 and math.isfinite(a.ceiling_gbps)):
        sys.exit("baseline_torch.py: --ceiling-gbps must be a positive number of GB/s")
    global CEILING_BPS
    CEILING_BPS = a.ceiling_gbps * 1e9

    cfg = load_config(a.config) if a.config else (TINY if a.tiny else M3)
    d = Dims(cfg, a.resident_experts)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is None:
        dev = torch.device("cuda", 0)  # set_device and mem_get_info want an index
    if cuda and not torch.cuda.is_available():
        sys.exit("baseline_torch: no CUDA device (use --device cpu --tiny)")
    ctxs = [int(c) for c in (a.contexts or ("40,200,1000" if a.tiny else "8192,32768,131072")).split(",")]
    dts = a.cache_dtype.split(",")
    if len(dts) == 1:
        dts = dts * len(ctxs)
    if len(dts) != len(ctxs) or any(t not in ("bf16", "e4m3", "auto") for t in dts):
        sys.exit("baseline_torch: --cache-dtype wants bf16|e4m3|auto, one value or one per context")
    torch.manual_seed(a.seed)
    if cuda:
        torch.cuda.set_device(dev)
        free, total = torch.cuda.mem_get_info(dev)
    else:
        free = total = 64 << 30
    if a.mem_limit_gb:
        free = min(free, int(a.mem_limit_gb * 1e9))

    tcaps = [((c + a.warmup + a.steps + 1 + d.B - 1) // d.B) * d.B for c in ctxs]
    for c in ctxs:
        if c < 1 or c + a.warmup + a.steps + 1 > d.maxpos:
            sys.exit(f"baseline_torch: context {c} + steps exceeds max_position_embeddings {d.maxpos}")
    fixed = (d.ndense * d.dense_layer_weight_bytes() + 2 * 2 * d.V * d.H + 2 * max(tcaps) * d.rot)
    per_set = d.sparse_layer_weight_bytes(d.R)
    margin = 4e9 if cuda and not a.tiny else 0.05 * free  # workspace, upcast temporaries, allocator slack
    # bytes of a step's transient fp8 -> bf16 upcasts (dense layer K and V, one index-K scan)
    for i, t in enumerate(dts):
        if t == "auto":
            dts[i] = "bf16" if fixed + d.nsparse * per_set + d.cache_bytes(tcaps[i], 2, 2) + margin <= free else "e4m3"
    nbytes = {"bf16": 2, "e4m3": 1}
    cache_max = max(d.cache_bytes(tc, nbytes[t], nbytes[t]) for tc, t in zip(tcaps, dts))
    sets = a.weight_sets or int(max(1, min(d.nsparse, (free - margin - fixed - cache_max) // per_set)))
    sets = max(1, min(sets, d.nsparse))
    wbytes = fixed + sets * per_set
    if wbytes + cache_max + margin > free:
        print(f"baseline_torch: warning: {(wbytes + cache_max) / 1e9:.1f} GB of weights + caches with {sets} "
              f"weight set(s) may not fit in {free / 1e9:.1f} GB free", file=sys.stderr)
    note = ("distinct weights for every layer" if sets == d.nsparse else
            f"{sets} distinct sparse-layer weight sets shared round-robin by the {d.nsparse} sparse layers "
            f"({per_set / 1e9:.2f} GB each, >> L2: a step still reads every layer's weights from HBM)")
    print(f"# baseline_torch: PyTorch {torch.__version__} eager on {torch.cuda.get_device_name(dev) if cuda else 'cpu'}"
          f" ({'tiny config' if a.tiny else 'minimax-m3 shapes'}), bf16 weights, {d.R} of {d.E} experts resident, "
          f"--moe {a.moe}; {note}; {wbytes / 1e9:.2f} GB of weights allocated", flush=True)

    t0 = time.time()
    model = Model(d, dev, sets, a.moe, a.seed)
    model.rope_table(max(tcaps))
    if cuda:
        torch.cuda.synchronize()
    print(f"# weights generated on the {'GPU' if cuda else 'CPU'} in {time.time() - t0:.1f} s", flush=True)

    results = []
    record = dict(tool="bench/baseline_torch.py", torch=torch.__version__, device=str(dev),
                  gpu=torch.cuda.get_device_name(dev) if cuda else None, tiny=a.tiny, weights="bf16",
                  resident_experts=d.R, moe=a.moe, weight_sets=sets, weight_note=note,
                  weight_bytes_allocated=wbytes, steps=a.steps, warmup=a.warmup, ceiling_Bps=CEILING_BPS,
                  command=" ".join(sys.argv), results=results)
    fp8 = getattr(torch, "float8_e4m3fn", None)
    for ctx, tcap, dt in zip(ctxs, tcaps, dts):
        if dt == "e4m3" and fp8 is None:
            sys.exit("baseline_torch: this PyTorch has no float8_e4m3fn")
        tdt = torch.bfloat16 if dt == "bf16" else fp8
        try:
            r = run_context(a, d, model, dev, cuda, ctx, tcap, dt, tdt)
        except torch.cuda.OutOfMemoryError as ex:
            r = None
            print(f"# context {ctx} ({dt} caches): out of GPU memory ({str(ex).splitlines()[0][:160]}); skipped",
                  flush=True)
        if r:
            results.append(r)
            print(f"RESULT context={ctx} cache={dt} tpot_ms={r['tpot_ms']:.3f} p20={r['p20_ms']:.3f} "
                  f"p80={r['p80_ms']:.3f} wall_ms={r['wall_ms_mean']:.3f} roofline_ms={r['roofline_ms']:.3f}",
                  flush=True)
        model.free_caches()
        if cuda:
            torch.cuda.empty_cache()
            record["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(dev)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(record, f, indent=1)

    print("\n| context | caches | TPOT ms (median) | p20 | p80 | wall ms/step | roofline ms | TPOT / roofline |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['context']} | {r['cache_dtype']} | {r['tpot_ms']:.3f} | {r['p20_ms']:.3f} | {r['p80_ms']:.3f} "
              f"| {r['wall_ms_mean']:.3f} | {r['roofline_ms']:.3f} | {r['tpot_ms'] / r['roofline_ms']:.2f} |")
    print(f"\nroofline = (weight bytes used per step + KV/index-K bytes read) / {CEILING_BPS / 1e12:.2f} TB/s; "
          f"bf16 weights; median of {a.steps} steps after {a.warmup} warm-up steps")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
