"""Decode rung 2, main branch: Q-outer sparse attention over page splits, combined by LSE.

Adds over rung 1: a page is loaded once per (decode query, KV head) for the ``G`` query rows of
the group that read it, in 16-byte ``cp.async`` copies, and the rows are the M side of
tensor-core tiles.

``split_kernel``, one CTA per (page split ``s``, KV head ``r``, decode query ``t``): with ``Lq``
queries a request (MTP drafts) query ``t = b * Lq + i`` is draft ``i`` of request ``b``, at
position ``cache_seqlens[b] - Lq + i``, with its own selection and request ``b``'s block table.

* The query's selection ``I[t, r, :]`` is made a sorted list of its distinct valid block ids in
  shared memory, each with its page (the block table is read once here, not before every
  copy); split ``s`` takes its share of it.
* The query rows ``g`` (head ``r*G + g``, padded to ``MT`` m-tiles of 16) are copied once and
  kept as A fragments in registers. Warp ``w`` owns m-tile ``w % MT`` and key range ``w // MT``
  of every page (``KSPLIT = W / MT`` ranges, so that four warps work even at ``G <= 16``).
* Per page: K and V (``[Bk, D]`` of head ``r``) land in shared memory in stages of ``SK`` keys,
  a ring of ``STAGES = 3`` (the next two copied while one is computed; 2 where three would not
  leave two CTAs an SM); keys past the query's position are loaded as zeros (a later draft's
  keys are never read). Per chunk of ``KC`` keys ``S = Q Kᵀ`` by
  ``mma.sync`` (B fragments by ``ldmatrix``), the keys past the position masked to ``-inf``,
  the online softmax in base 2 in registers (``ex2.approx``; ``msa.cuda._core.softmax``), ``P``
  packed to 16 bits as the A fragments of ``O += P V`` (V's B fragments by
  ``ldmatrix.trans``). Every key a CTA loads is one its rows see: there is no masking by
  selection inside a tile to do.
* The warps of one m-tile combine their ``(m, l, O)`` through shared memory; the split writes
  ``o_part [S, B*Lq, Hq, D]`` float32 and ``lse_part [S, B*Lq, Hq]`` (or, with one split, the
  outputs themselves).

``combine_kernel``: one thread per output element, the exact LSE combine of the splits in split
order (``lse = max + log sum exp(lse_s - max)``; a row with nothing visible: o = 0, lse = -inf).

Verdict (H200, paper configuration, bf16, CUDA graphs; benchmarks/results/bench_decode*.json):
Lq = 1 reads the selected pages at 1.8-3.1 TB/s (134 MB at B = 32 x 64K in 0.053-0.073 ms, 537
MB at 128 x 8K in 0.174 ms, the split kernel alone). Lq > 1 was one CTA per request over the
union of its drafts' selections (all ``Lq x G`` rows against every page of the union, masking by
selection inside the tiles, one 8-warp CTA an SM): 0.608 ms at 32 x 64K, Lq = 8 (random
selections, ~8x the pages), against 0.297 ms one CTA column a draft; 0.193 against 0.247 ms
where the drafts select the same blocks (``bench_decode --shared-index-queries``), 0.115 against
0.073 at 8 x 128K; code at 0f02a23 (docs/performance.md, "Tried and dropped"). Two key stages
against one page at a time: 0.073 against 0.076 ms at 32 x 64K, 0.174 against 0.180 at 128 x
8K; three against two (and the pages read once a CTA), on an H100 (``benchmarks.dev.
decode_knobs``), the kernel alone: 0.211 against 0.230 ms at 128 x 8K, 0.0234 against 0.0244
at 8 x 128K, 0.066 against 0.064 at 32 x 64K, 0.383 against 0.386 at Lq = 8; the whole step in
a CUDA graph: 0.334 against 0.349 ms at 128 x 8K, 0.290 both at 32 x 64K, 0.639 against 0.640
at Lq = 8 (at 8 x 128K 0.183 against 0.165, run-to-run noise of that case). More splits are
slower (0.094 ms at 9, 0.129 at 16 against 0.076 at 5); a register cap of 168 changed nothing.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, types

from .._core.arrays import SIMULATOR
from .._core.memops import (cp_async16, cp_async_commit, cp_async_wait_all, cp_async_wait_group,
                            dynamic_smem_f32, dynamic_smem_u32, ldmatrix_x4, ldmatrix_x4_trans)
from .._core.mma import (exp2, f32_to_bf16, f32_to_f16_bits, make_mma_pair, mma_bf16_m16n8k16,
                         mma_f16_m16n8k16, pack_bf16x2, pack_f16x2)
from .._core.packed import LN2, LOG2E
from .._core.softmax import exp2_rows
from ._plan import Kernel, attention_splits, grid_1d, multiprocessors
from .v1_simple import query_of
from .._core.diskcache import kernel_jit

FULL_MASK = 0xFFFFFFFF
NEG_INF = float32(-math.inf)
COMBINE_THREADS = 128


STAGES = 3  # key stages in shared memory: the next two are copied while one is computed
STAGE_KEYS = 16 if SIMULATOR else 64  # keys a stage (16 in the simulator: Bk = 32 has two)
SMEM_PER_CTA = 113 * 1024  # two CTAs an SM (228 KB, 1 KB of it reserved a CTA)


def shape(block_size: int, head_dim: int, group: int):
    """``(MT, KSPLIT, KC, SK)``: m-tiles of the ``G`` rows; key ranges a stage is cut into (the
    CTA has ``MT * KSPLIT`` warps: four where the rows are few); keys a chunk; keys a stage
    (``min(Bk, 64)``, 16 in the simulator: two stages of K and V take the shared memory of one
    page)."""
    mt = -(-group // 16)
    sk = min(block_size, STAGE_KEYS)
    ksplit = max(1, min(4 // mt, sk // 16)) if mt < 4 else 1
    kr = sk // ksplit
    kc = 32 if kr % 32 == 0 else 16
    return mt, ksplit, kc, sk


def layout(block_size: int, head_dim: int, group: int, stages: int = STAGES):
    """``(LD, stage words, combine words, Q offset, total bytes)`` of the split kernel's dynamic
    shared memory: ``stages`` stages of SK keys' K then V rows (rows of ``D/2 + 4`` words),
    re-used at the end for the warps' ``(m, l, O)``, then the query rows."""
    mt, ksplit, _, sk = shape(block_size, head_dim, group)
    ld = head_dim // 2 + 4
    stage = 2 * sk * ld
    comb = ksplit * 16 * mt * (head_dim + 2)
    q_off = -(-max(stages * stage, comb) // 4) * 4
    return ld, stage, comb, q_off, 4 * (q_off + 16 * mt * ld)


def stages_for(block_size: int, head_dim: int, group: int) -> int:
    """``STAGES``, or 2 where that many would not leave two CTAs an SM (``G`` above 16)."""
    fits = layout(block_size, head_dim, group, STAGES)[-1] <= SMEM_PER_CTA
    return STAGES if fits else 2


@functools.lru_cache(maxsize=None)
def split_kernel(block_size: int, head_dim: int, group: int, topk: int, bf16: bool,
                 direct: bool, drafts: int = 1, stages: int = 0):
    """The split attention for (Bk, D, G, K, bf16 or fp16, one split writing the outputs, Lq
    queries a request; ``stages`` key stages, 0: ``stages_for``); arguments ``(q words [B*Lq,
    Hq, D/2], k_cache words, v_cache words [P, Hkv, Bk, D/2], block_indices, block_table,
    cache_seqlens, scale * log2 e, o_part, lse_part, o bits, lse)``, the grid ``(splits, Hkv,
    B*Lq)``."""
    BK, D, G, K = block_size, head_dim, group, topk
    DR = drafts
    R = G
    MT, KSPLIT, KC, SK = shape(BK, D, G)
    W = MT * KSPLIT
    NTH = 32 * W
    KR = SK // KSPLIT  # keys of a stage per warp
    SPP = BK // SK  # stages per page
    NS = stages or stages_for(BK, D, G)
    IN_FLIGHT = NS - 2  # groups still copying once stage c has landed
    LD, STAGE, _, OFF_Q, _ = layout(BK, D, G, NS)
    OFF_V = SK * LD  # V's rows after K's in a stage
    DW = D // 2
    PIECES = DW // 4
    KSD = D // 16  # k-steps of S = Q Kᵀ
    NSC = KC // 8  # n-tiles of a chunk's scores
    NO = D // 8  # n-tiles of O
    NE = K  # entries of the selection
    ROWS = 16 * MT
    DIRECT = direct
    mma_pair = make_mma_pair(mma_bf16_m16n8k16 if bf16 else mma_f16_m16n8k16)
    pack = pack_bf16x2 if bf16 else pack_f16x2
    p_rows = exp2_rows(NSC, pack)
    to_bits = f32_to_bf16 if bf16 else f32_to_f16_bits
    QA, SA, PF, OA = 4 * KSD, 4 * NSC, 2 * NSC, 4 * NO  # register array sizes (constants)
    COMB_L = KSPLIT * ROWS * D  # float offsets of the combine region: O, then m, then l
    COMB_M = COMB_L + KSPLIT * ROWS
    assert KR % KC == 0 and KC in (16, 32) and D % 16 == 0 and R <= 128 and W <= 8

    @cuda.jit(device=True, inline=True)
    def build_union(block_indices, t0, r, nb, raw, first, union, umask, upage, ucount,
                    block_table, b, n_pool):
        """The distinct valid blocks of the selection, ascending (``umask``: 1 for each, the
        bit of the CTA's one query; ``upage``: each one's page, -1 outside ``[0, P)``), the
        block table read once here rather than at every stage."""
        tid = cuda.threadIdx.x
        for e in range(tid, NE, NTH):
            v = block_indices[t0 + e // K, r, e % K]
            raw[e] = v if 0 <= v < nb else -1
        if tid == 0:
            ucount[0] = 0
        cuda.syncthreads()
        for e in range(tid, NE, NTH):
            v = raw[e]
            f = v >= 0
            for e2 in range(e):
                if raw[e2] == v:
                    f = False
            first[e] = 1 if f else 0
            if f:
                cuda.atomic.add(ucount, 0, 1)
        cuda.syncthreads()
        for e in range(tid, NE, NTH):
            if first[e]:
                v = raw[e]
                rank = 0
                mask = 0
                for e2 in range(NE):
                    v2 = raw[e2]
                    if first[e2] and v2 < v:
                        rank += 1
                    if v2 == v:
                        mask |= 1 << (e2 // K)
                page = block_table[b, v]
                union[rank] = v
                umask[rank] = mask
                upage[rank] = page if 0 <= page < n_pool else -1
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def load_stage(smem, base, r, k_cache, v_cache, page, ok, key0, n_keys):
        """cp.async of head ``r``'s K and V rows ``key0 .. key0 + SK - 1`` of ``page`` into the
        stage at word ``base``: zeros from key ``n_keys`` on and everywhere if not ``ok`` (a
        slot past the sequence may hold anything, and a hidden key's V still enters ``P V``
        with P = 0)."""
        hkv = k_cache.shape[1]
        src0 = (((page if ok else 0) * hkv + r) * BK + key0) * DW
        for e in range(cuda.threadIdx.x, SK * PIECES, NTH):
            c = e // PIECES
            w = (e % PIECES) * 4
            n = 16 if ok and key0 + c < n_keys else 0
            src = src0 + c * DW + w if n else 0
            cp_async16(smem, base + c * LD + w, k_cache, src, n)
            cp_async16(smem, base + OFF_V + c * LD + w, v_cache, src, n)

    @cuda.jit(device=True, inline=True)
    def load_queries(smem, q, t0, r):
        """cp.async of the CTA's query rows (zeros past ``Lq * G``)."""
        hq = q.shape[1]
        for e in range(cuda.threadIdx.x, ROWS * PIECES, NTH):
            row = e // PIECES
            w = (e % PIECES) * 4
            real = row < R
            src = ((t0 + row // G) * hq + r * G + row % G) * DW + w if real else 0
            cp_async16(smem, OFF_Q + row * LD + w, q, src, 16 if real else 0)

    @cuda.jit(device=True, inline=True)
    def issue(smem, c, n_stages, u0, union, upage, r, k_cache, v_cache, n_keys):
        """Start copying stage ``c`` (page ``upage[u0 + c // SPP]``, part ``c % SPP``)."""
        if c < n_stages:
            u = u0 + c // SPP
            page = upage[u]
            load_stage(smem, (c % NS) * STAGE, r, k_cache, v_cache, page, page >= 0,
                       (c % SPP) * SK, n_keys - union[u] * BK)

    @cuda.jit(device=True, inline=True)
    def chunk_scores(smem, base, qa, s_acc, c0, lane):
        """S = Q Kᵀ of the stage's keys ``c0 .. c0 + KC - 1`` for the warp's 16 rows (raw,
        fp32); the stage at word ``base``."""
        k_lane = base + ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 4
        for i in range(4 * NSC):
            s_acc[i] = float32(0.0)
        for ks in range(KSD):
            for n2 in range(NSC // 2):
                b0, b1, b2, b3 = ldmatrix_x4(smem, k_lane + (c0 + 16 * n2) * LD + 8 * ks)
                mma_pair(s_acc, 8 * n2, qa[4 * ks], qa[4 * ks + 1], qa[4 * ks + 2],
                         qa[4 * ks + 3], b0, b1, b2, b3)

    @cuda.jit(device=True, inline=True)
    def online_softmax(s_acc, p_frag, o_acc, st, lim_top, lim_bot, c0, t4, sl2):
        """Mask the chunk (key ``c`` hidden from a row iff ``c > lim``), then the online
        softmax of rows top (g) and bottom (g + 8): m, l (this lane's share) and O rescaled,
        P = 2**(S sl2 - m sl2) packed as A fragments. ``st`` = [m_top, m_bot, l_top, l_bot]."""
        col = c0 + 2 * t4
        mx_top = NEG_INF
        mx_bot = NEG_INF
        for i in range(NSC):
            for e in range(2):
                c = col + 8 * i + e
                if c > lim_top:
                    s_acc[4 * i + e] = NEG_INF
                if c > lim_bot:
                    s_acc[4 * i + 2 + e] = NEG_INF
                mx_top = max(mx_top, s_acc[4 * i + e])
                mx_bot = max(mx_bot, s_acc[4 * i + 2 + e])
        # the quad's four lanes hold a row: m_new = max(m, rowmax(S))
        mx_top = max(mx_top, cuda.shfl_xor_sync(FULL_MASK, mx_top, 1))
        mx_bot = max(mx_bot, cuda.shfl_xor_sync(FULL_MASK, mx_bot, 1))
        mx_top = max(mx_top, cuda.shfl_xor_sync(FULL_MASK, mx_top, 2))
        mx_bot = max(mx_bot, cuda.shfl_xor_sync(FULL_MASK, mx_bot, 2))
        m_top = max(st[0], mx_top)
        m_bot = max(st[1], mx_bot)
        # base-2 references; a row that has seen nothing uses 0 (P = 2**-inf = 0, no NaN)
        ref_top = m_top * sl2 if m_top > NEG_INF else float32(0.0)
        ref_bot = m_bot * sl2 if m_bot > NEG_INF else float32(0.0)
        a_top = exp2(st[0] * sl2 - ref_top) if st[0] > NEG_INF else float32(0.0)
        a_bot = exp2(st[1] * sl2 - ref_bot) if st[1] > NEG_INF else float32(0.0)
        st[0] = m_top
        st[1] = m_bot
        # P as K1's (msa.cuda._core.softmax: the fused form, or where |ref| >= 2**24 the exact one)
        l_top, l_bot = p_rows(s_acc, p_frag, m_top, m_bot, ref_top, ref_bot, sl2,
                              st[2] * a_top, st[3] * a_bot)
        st[2] = l_top
        st[3] = l_bot
        for i in range(NO):  # O = O * alpha (rows top: registers 0, 1; bottom: 2, 3)
            o_acc[4 * i] *= a_top
            o_acc[4 * i + 1] *= a_top
            o_acc[4 * i + 2] *= a_bot
            o_acc[4 * i + 3] *= a_bot

    @cuda.jit(device=True, inline=True)
    def chunk_pv(smem, base, p_frag, o_acc, c0, lane):
        """O += P V for the stage's keys ``c0 .. c0 + KC - 1`` (V's B fragments by
        ldmatrix.trans); the stage at word ``base``."""
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        v_lane = base + OFF_V + l_rows * LD + (lane >> 4) * 4
        for kp in range(KC // 16):
            for n2 in range(NO // 2):
                b0, b1, b2, b3 = ldmatrix_x4_trans(smem, v_lane + (c0 + 16 * kp) * LD + 8 * n2)
                mma_pair(o_acc, 8 * n2, p_frag[4 * kp], p_frag[4 * kp + 1], p_frag[4 * kp + 2],
                         p_frag[4 * kp + 3], b0, b1, b2, b3)

    @cuda.jit(device=True, inline=True)
    def stash(smem_f, o_acc, st, kr, mt, lane, sl2):
        """The warp's (m sl2, l, O) into the combine region (the page buffers, now free)."""
        g4 = lane // 4
        t4 = lane % 4
        l_top = st[2] + cuda.shfl_xor_sync(FULL_MASK, st[2], 1)
        l_bot = st[3] + cuda.shfl_xor_sync(FULL_MASK, st[3], 1)
        l_top += cuda.shfl_xor_sync(FULL_MASK, l_top, 2)
        l_bot += cuda.shfl_xor_sync(FULL_MASK, l_bot, 2)
        top = kr * ROWS + 16 * mt + g4
        bot = top + 8
        for i in range(NO):
            col = 8 * i + 2 * t4
            smem_f[top * D + col] = o_acc[4 * i]
            smem_f[top * D + col + 1] = o_acc[4 * i + 1]
            smem_f[bot * D + col] = o_acc[4 * i + 2]
            smem_f[bot * D + col + 1] = o_acc[4 * i + 3]
        if t4 == 0:
            smem_f[COMB_M + top] = st[0] * sl2 if st[0] > NEG_INF else NEG_INF
            smem_f[COMB_M + bot] = st[1] * sl2 if st[1] > NEG_INF else NEG_INF
            smem_f[COMB_L + top] = l_top
            smem_f[COMB_L + bot] = l_bot

    @cuda.jit(device=True, inline=True)
    def finish(smem_f, s, t0, r, o_part, lse_part, o, lse):
        """Combine the key ranges of every real row: this split's (O_s, LSE_s), or the
        outputs."""
        for e in range(cuda.threadIdx.x, R * D, NTH):
            row = e // D
            d = e % D
            mb = NEG_INF
            for kr in range(KSPLIT):
                mb = max(mb, smem_f[COMB_M + kr * ROWS + row])
            total = float32(0.0)
            acc = float32(0.0)
            if mb > NEG_INF:
                for kr in range(KSPLIT):
                    w = exp2(smem_f[COMB_M + kr * ROWS + row] - mb)
                    total += smem_f[COMB_L + kr * ROWS + row] * w
                    acc += smem_f[(kr * ROWS + row) * D + d] * w
            val = acc / total if total > float32(0.0) else float32(0.0)
            ls = (mb + math.log2(total)) * float32(LN2) if total > float32(0.0) else NEG_INF
            t = t0 + row // G
            h = r * G + row % G
            if DIRECT:
                o[t, h, d] = to_bits(val)
                if d == 0:
                    lse[t, h] = ls
            else:
                o_part[s, t, h, d] = val
                if d == 0:
                    lse_part[s, t, h] = ls

    @kernel_jit
    def kernel(q, k_cache, v_cache, block_indices, block_table, cache_seqlens, sl2, o_part,
               lse_part, o, lse):
        smem = dynamic_smem_u32()
        smem_f = dynamic_smem_f32()
        raw = cuda.shared.array(NE, int32)
        first = cuda.shared.array(NE, int32)
        union = cuda.shared.array(NE, int32)
        umask = cuda.shared.array(NE, int32)
        upage = cuda.shared.array(NE, int32)
        ucount = cuda.shared.array(1, int32)
        qa = cuda.local.array(QA, types.uint32)  # Q's A fragments
        s_acc = cuda.local.array(SA, float32)
        p_frag = cuda.local.array(PF, types.uint32)
        o_acc = cuda.local.array(OA, float32)
        st = cuda.local.array(4, float32)  # m_top, m_bot, l_top, l_bot
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        mt = warp % MT
        kr = warp // MT
        s = cuda.blockIdx.x
        r = cuda.blockIdx.y
        b = cuda.blockIdx.z
        splits = cuda.gridDim.x
        t0 = b
        if DR > 1:  # draft t0 % DR of request t0 // DR
            b, pos_last = query_of(t0, DR, cache_seqlens, block_table.shape[1] * BK)
        else:
            _, pos_last = query_of(t0, 1, cache_seqlens, block_table.shape[1] * BK)
        nb = (pos_last + BK) // BK if pos_last >= 0 else 0
        build_union(block_indices, t0, r, nb, raw, first, union, umask, upage, ucount,
                    block_table, b, k_cache.shape[0])
        n_union = ucount[0]
        per = (n_union + splits - 1) // splits
        u0 = s * per
        u1 = min(n_union, u0 + per)
        # this lane's rows (-1: a padding row) and their positions
        row_top = 16 * mt + g4
        row_bot = row_top + 8
        i_top = row_top // G if row_top < R else -1
        i_bot = row_bot // G if row_bot < R else -1
        pos_top = pos_last + i_top
        pos_bot = pos_last + i_bot
        for i in range(4 * NO):
            o_acc[i] = float32(0.0)
        st[0] = NEG_INF
        st[1] = NEG_INF
        st[2] = float32(0.0)
        st[3] = float32(0.0)
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        n_keys = pos_last + 1
        n_stages = max(0, u1 - u0) * SPP
        # the queries and stages 0 .. NS - 2, a group each; then at stage c: wait for it (the
        # NS - 2 after it may still copy), free stage c - 1 (barrier), start copying stage
        # c + NS - 1 into its buffer, compute stage c. A group is committed every step, empty
        # or not, so that "at most NS - 2 pending" always means "stage c has landed".
        load_queries(smem, q, t0, r)
        for c in range(NS - 1):
            issue(smem, c, n_stages, u0, union, upage, r, k_cache, v_cache, n_keys)
            cp_async_commit()
        for c in range(n_stages):
            cp_async_wait_group(IN_FLIGHT)
            cuda.syncthreads()
            if c == 0:
                for ks in range(KSD):
                    a0, a1, a2, a3 = ldmatrix_x4(smem, OFF_Q + (16 * mt + l_rows) * LD
                                                 + (lane >> 4) * 4 + 8 * ks)
                    qa[4 * ks] = a0
                    qa[4 * ks + 1] = a1
                    qa[4 * ks + 2] = a2
                    qa[4 * ks + 3] = a3
            issue(smem, c + NS - 1, n_stages, u0, union, upage, r, k_cache, v_cache, n_keys)
            cp_async_commit()
            u = u0 + c // SPP
            j = union[u]
            if upage[u] >= 0:
                mask = umask[u]
                key0 = (c % SPP) * SK  # the stage's first key in its page
                # key c of the page is visible to a row iff c <= lim (a padding row: lim = -1)
                lim_top = pos_top - j * BK - key0 if i_top >= 0 and (mask >> i_top) & 1 else -1
                lim_bot = pos_bot - j * BK - key0 if i_bot >= 0 and (mask >> i_bot) & 1 else -1
                base = (c % NS) * STAGE
                for c0 in range(kr * KR, (kr + 1) * KR, KC):
                    chunk_scores(smem, base, qa, s_acc, c0, lane)
                    online_softmax(s_acc, p_frag, o_acc, st, lim_top, lim_bot, c0, t4, sl2)
                    chunk_pv(smem, base, p_frag, o_acc, c0, lane)
        cp_async_wait_all()  # nothing in flight at exit (an empty split's queries)
        cuda.syncthreads()  # every warp is done with the stages: their memory is reused
        stash(smem_f, o_acc, st, kr, mt, lane, sl2)
        cuda.syncthreads()
        finish(smem_f, s, t0, r, o_part, lse_part, o, lse)

    return kernel


@kernel_jit
def combine_kernel(o_part, lse_part, o, lse, bf16):
    """``o [B*Lq, Hq, D]`` (16-bit bits) and ``lse`` from the splits' partials, in split order."""
    splits, rows, hq, d = o_part.shape
    x = cuda.grid(1)
    if x >= rows * hq * d:
        return
    t = x // (hq * d)
    h = (x // d) % hq
    e = x % d
    mx = NEG_INF
    for s in range(splits):
        mx = max(mx, lse_part[s, t, h])
    total = float32(0.0)
    acc = float32(0.0)
    if mx > NEG_INF:
        for s in range(splits):
            w = exp2((lse_part[s, t, h] - mx) * float32(LOG2E))
            total += w
            acc += w * o_part[s, t, h, e]
    val = acc / total if total > float32(0.0) else float32(0.0)
    o[t, h, e] = f32_to_bf16(val) if bf16 else f32_to_f16_bits(val)
    if e == 0:
        lse[t, h] = mx + math.log2(total) * float32(LN2) if total > float32(0.0) else NEG_INF


def plan_attention(p, ctx, step, scale) -> int:
    """Add the attention launches of rung 2 to plan ``p``; returns the split count."""
    lay = step.layout
    b, lq, hkv, g, topk = lay.batch, step.lq, lay.num_kv_heads, step.group, p.block_indices.shape[2]
    rows = b * lq
    splits = attention_splits(rows, hkv, min(topk, lay.max_pages), multiprocessors())
    bf16 = step.kind == "bfloat16"
    # one split writes the outputs itself; its partial arguments are then stand-ins
    n = splits if splits > 1 else 1
    p.workspace["o_part"] = ctx.empty((n, rows if n > 1 else 1, step.hq if n > 1 else 1,
                                       lay.head_dim if n > 1 else 1), np.float32)
    p.workspace["lse_part"] = ctx.empty((n, rows if n > 1 else 1, step.hq if n > 1 else 1),
                                        np.float32)
    parts = [("ws", "o_part", None), ("ws", "lse_part", None)]
    mt, ksplit, _, _ = shape(lay.block_size, lay.head_dim, g)
    stages = stages_for(lay.block_size, lay.head_dim, g)
    smem = layout(lay.block_size, lay.head_dim, g, stages)[-1]
    kernel = split_kernel(lay.block_size, lay.head_dim, g, int(topk), bf16, splits == 1, lq,
                          stages=stages)
    p.steps.append((Kernel(kernel, (splits, hkv, rows), 32 * mt * ksplit, smem),
                    [("in", "q", "words"), ("in", "k_cache", "words"), ("in", "v_cache", "words"),
                     ("out", "block_indices", None), ("in", "block_table", None),
                     ("in", "cache_seqlens", None), float(scale * LOG2E), *parts,
                     ("out", "o", "bits"), ("out", "lse", None)]))
    if splits > 1:
        n = rows * step.hq * lay.head_dim
        p.steps.append((Kernel(combine_kernel, grid_1d(n, COMBINE_THREADS), COMBINE_THREADS),
                        [("ws", "o_part", None), ("ws", "lse_part", None), ("out", "o", "bits"),
                         ("out", "lse", None), int(bf16)]))
    return splits
