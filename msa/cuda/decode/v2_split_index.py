"""Decode rung 2, index branch: the context split over CTAs, tensor-core scores, heaps, exact merge.

Adds over rung 1: each page of index keys is read from HBM once for all ``Lq x Hkv`` index
queries of its request (rung 1 reads it once per query, group and block), in 16-byte
``cp.async`` copies, four stages deep, while the scores of the stage before are computed; the
block maxima never leave the CTA.

``split_kernel``, one CTA per (split ``s``, request ``b``): the request's candidate blocks
``0 .. L_last - 1`` (``L_last`` the local block of its last query; the local blocks are never
scored, every key of a candidate is visible) are cut into ``S`` equal ranges. A stage is ``CK``
keys of one page (``CK = min(Bk, 64)``); warp ``w`` takes its 16-key m-tiles and computes
``S = K_idx Q_idxᵀ`` by ``mma.sync.m16n8k16`` (keys as the A rows by ``ldmatrix``, the request's
index queries, query ``i`` group ``r`` as column ``i * Hkv + r``, as B fragments held in
registers), fp32 accumulation; the column maxima over the warp's keys reduce across the lanes by
three shuffles. After the page's last stage (and the next stage's barrier) the owner thread of
each column takes the maximum over warps, scales it, and offers ``(score, block)`` to the
column's min-heap of ``K - 1`` entries in shared memory (``msa.cuda._core.heap``: a higher
score first, ties to the smaller id, ``-inf`` and NaN never kept) if the block is a candidate of
that query (``j < floor(pos_i / Bk)``). At the end each heap is sorted best first into the
split's slot of ``cand_s, cand_i [S, B*Lq, Hkv, K-1]`` (padding ``(-inf, -1)``).

``merge_kernel``, one warp per (query, group) row: the paper's §4.1 selection over the ``S (K -
1)`` candidates of the splits: lane ``l`` takes the lists of splits ``l, l + 32, ...`` into its
own heap of ``K - 1`` (shared memory): the first list whole (it fits, and stored worst first it
is a heap already), each further list from its best entry until one cannot enter the full heap
(the lists are sorted, so the rest cannot either); it sorts the heap best first (a lane with one
list keeps it as it came, sorted best first: no heap, no sort), then ``K - 1`` rounds give
every lane the warp's best and its owner pops it (``_core.heap.warp_best``: a butterfly of
``(score, id)`` exchanges). The winners are exactly the global top ``K - 1`` (each is in its
split's top ``K - 1``; ``better`` is a total order); ranked by id with shuffles, they fill the
row ascending, then the local block, then -1. Equal to the reference bit for bit wherever the
scores are.
Where a request has more than 32 splits (a lane would walk several lists, one after another),
``merge_kernel_wide`` gives a row up to 8 warps, one list a lane: each warp reduces its lanes'
heaps to its best ``K - 1`` (``_core.heap.warp_top``), then warp 0 merges those lists; the same
rows bit for bit. One warp a row up to 32 splits: at 12 splits 2 warps were slower (0.024
against 0.018 ms on an H100).

Verdict (paper configuration, bf16, CUDA graphs): the split kernel reads the index keys at
3.1-3.5 TB/s on the H200, 72-81% of its 4.26 TB/s copy bandwidth (537 MB at B = 32 x 64K in
0.171-0.175 ms, 4.3 GB at 128 x 128K in 1.24 ms; runs M, R of docs/performance.md); rung 3's
register-streamed kernel (``v3_register_index``) takes 0.151 ms and is the default where
``Didx`` is a multiple of 32, this one elsewhere. The merge, on an H100 (runs O6-O9): 0.010 ms
of the 0.277 ms step at 32 x 64K and of the 0.317 at 128 x 8K (one warp a row), 0.017 of 0.156
at 8 x 128K and 0.018 of 0.051 at 1 x 128K (2 and 8 warps a row), 0.017 of 0.166 at 1 x 1M.
Rung 1 scores every block from global memory, one thread each: orders of magnitude slower, never
the default for 16-bit data.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, types

from .._core.arrays import SIMULATOR
from .._core.heap import (NO_BLOCK, better, heap_sort_best_first, offer, warp_merge,
                          warp_top)
from .._core.memops import (cp_async16, cp_async_commit, cp_async_wait_all, cp_async_wait_group,
                            dynamic_smem_u32, ldmatrix_x4)
from .._core.mma import load_b_frag, mma_bf16_m16n8k16, mma_f16_m16n8k16
from ._plan import Kernel, index_splits, multiprocessors
from .v1_simple import query_of
from .._core.diskcache import kernel_jit

FULL_MASK = 0xFFFFFFFF
WARPS = 1 if SIMULATOR else 4  # the simulator runs every thread as a Python thread
MERGE_WARPS = 1 if SIMULATOR else 4
STAGES = 4  # key stages in shared memory: STAGES - 1 copies in flight while one is scored
STAGE_KEYS = 16 if SIMULATOR else 64  # keys a stage (16 in the simulator: Bk = 32 has two)
_IN_FLIGHT = STAGES - 2  # the wait_group count: stages still copying once stage c has landed


def layout(block_size: int, index_dim: int, num_queries: int):
    """``(CK, LDK, stage words, q offset, total bytes)`` of the split kernel's dynamic shared
    memory: STAGES stages of CK key rows, then the padded query rows. Rows are ``Didx/2 + 4``
    words: 16-byte aligned, and the 8 rows of an ``ldmatrix`` phase hit distinct banks."""
    ck = min(block_size, STAGE_KEYS)
    ldk = index_dim // 2 + 4
    nqp = -(-num_queries // 8) * 8
    stage = ck * ldk
    q_off = STAGES * stage
    return ck, ldk, stage, q_off, 4 * (q_off + nqp * ldk)


@functools.lru_cache(maxsize=None)
def split_common(lq: int, hkv: int, topk: int, n_tiles: int, k_steps: int, bf16: bool):
    """Device functions of the split scorers (rungs 2 and 3): ``kstep(a0, a1, a2, a3, qb, ks,
    acc)`` adds k-step ``ks`` of an m-tile (its A fragment) times every n-tile of the queries'
    B fragments ``qb`` to the C fragments ``acc``; ``fold(acc, cm)`` takes the
    maxima of an m-tile's rows ``g`` and ``g + 8`` (``acc``: the ``n_tiles`` C fragments) into
    the lane's column maxima ``cm`` (fmax from -inf: a NaN score never wins), and ``store(hs,
    hi, cnt, cand_s, cand_i, s, b, n)`` sorts column ``n``'s heap best first into split ``s``'s
    slot (padding ``(-inf, -1)``)."""
    LQ, HKV, KM, NT, KS = lq, hkv, topk - 1, n_tiles, k_steps
    mma = mma_bf16_m16n8k16 if bf16 else mma_f16_m16n8k16

    @cuda.jit(device=True, inline=True)
    def kstep(a0, a1, a2, a3, qb, ks, acc):
        for nt in range(NT):
            d0, d1, d2, d3 = mma(a0, a1, a2, a3, qb[2 * (nt * KS + ks)], qb[2 * (nt * KS + ks) + 1],
                                 acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3])
            acc[4 * nt] = d0
            acc[4 * nt + 1] = d1
            acc[4 * nt + 2] = d2
            acc[4 * nt + 3] = d3

    @cuda.jit(device=True, inline=True)
    def fold(acc, cm):
        for nt in range(NT):
            for e in range(2):
                x = acc[4 * nt + e]
                if x > cm[2 * nt + e]:
                    cm[2 * nt + e] = x
                x = acc[4 * nt + 2 + e]
                if x > cm[2 * nt + e]:
                    cm[2 * nt + e] = x

    @cuda.jit(device=True, inline=True)
    def store(hs, hi, cnt, cand_s, cand_i, s, b, n):
        heap_sort_best_first(hs, hi, cnt)
        t = b * LQ + n // HKV
        r = n % HKV
        for e in range(KM):
            cand_s[s, t, r, e] = hs[e] if e < cnt else float32(-math.inf)
            cand_i[s, t, r, e] = hi[e] if e < cnt else int32(-1)

    return kstep, fold, store


@functools.lru_cache(maxsize=None)
def split_kernel(block_size: int, index_dim: int, lq: int, hkv: int, topk: int, bf16: bool):
    """The split scorer for (Bk, Didx, Lq, Hkv, K, bf16 or fp16); arguments:
    ``(q_idx words [B*Lq, Hkv, Didx/2], k_idx_cache words [P, Bk, Didx/2], block_table,
    cache_seqlens, min_pages, scale, cand_s, cand_i)``."""
    BK, DI, LQ, HKV = block_size, index_dim, lq, hkv
    NQ = LQ * HKV
    KM = topk - 1
    CK, LDK, STAGE, Q_OFF, _ = layout(BK, DI, NQ)
    NQP = -(-NQ // 8) * 8
    NT = NQP // 8  # n-tiles of queries
    KS = DI // 16  # k-steps
    DW = DI // 2  # words per key row
    PIECES = DW // 4  # 16-byte pieces per row
    CPP = BK // CK  # stages per page
    MT = CK // 16  # m-tiles per stage
    W = WARPS
    NTH = 32 * W
    HEAP, QB, CM, ACC = NQ * KM, 2 * NT * KS, 2 * NT, 4 * NT  # array sizes (constants)
    assert BK % CK == 0 and CK % 16 == 0 and DI % 16 == 0 and 1 <= KM and NQ <= 32
    kstep, fold, store = split_common(LQ, HKV, topk, NT, KS, bf16)

    @cuda.jit(device=True, inline=True)
    def issue_stage(smem, k_idx_cache, block_table, b, j0, c, n_stages, buf):
        """Start copying stage ``c`` of the split (page ``j0 + c // CPP``, part ``c % CPP``) into
        buffer ``buf``; nothing past the split; zeros for an out-of-range page."""
        if c < n_stages:
            j = j0 + c // CPP
            key0 = (c % CPP) * CK
            page = block_table[b, j]
            ok = 0 <= page < k_idx_cache.shape[0]
            src0 = ((page if ok else 0) * BK + key0) * DW
            for e in range(cuda.threadIdx.x, CK * PIECES, NTH):
                row = e // PIECES
                w = (e % PIECES) * 4
                cp_async16(smem, buf * STAGE + row * LDK + w, k_idx_cache, src0 + row * DW + w,
                           16 if ok else 0)

    @cuda.jit(device=True, inline=True)
    def offer_page(heap_s, heap_i, heap_n, red, par, j, ok, pos_last, scale):
        """Owners: each column's block maximum over the warps, offered to its heap if block ``j``
        is a candidate of the column's query."""
        for n in range(cuda.threadIdx.x, NQ, NTH):
            bm = float32(-math.inf)
            for w in range(W):
                x = red[par, w, n]
                if x > bm:
                    bm = x
            i = n // HKV
            if ok and j < (pos_last - (LQ - 1 - i)) // BK:
                cnt = heap_n[n]
                hs = heap_s[n * KM:(n + 1) * KM]
                hi = heap_i[n * KM:(n + 1) * KM]
                cnt, _, _ = offer(hs, hi, cnt, KM, hs[0], hi[0], bm * scale, int32(j))
                heap_n[n] = cnt

    @cuda.jit(device=True, inline=True)
    def stage_maxima(smem, qb, cm, buf, warp, lane):
        """The warp's m-tiles of the stage in buffer ``buf``: S = K_idx Q_idxᵀ, column maxima
        accumulated into ``cm`` (two columns per n-tile: 2t and 2t + 1 of this lane)."""
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        for mt in range(warp, MT, W):
            a_at = buf * STAGE + (16 * mt + l_rows) * LDK + (lane >> 4) * 4
            acc = cuda.local.array(ACC, float32)
            for i in range(4 * NT):
                acc[i] = float32(0.0)
            for ks in range(KS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, a_at + 8 * ks)
                kstep(a0, a1, a2, a3, qb, ks, acc)
            fold(acc, cm)

    @kernel_jit
    def kernel(q_idx, k_idx_cache, block_table, cache_seqlens, min_pages, scale, cand_s, cand_i):
        smem = dynamic_smem_u32()
        heap_s = cuda.shared.array(HEAP, float32)
        heap_i = cuda.shared.array(HEAP, int32)
        heap_n = cuda.shared.array(NQ, int32)
        red = cuda.shared.array((2, W, NQP), float32)
        qb = cuda.local.array(QB, types.uint32)  # B fragments of the queries
        cm = cuda.local.array(CM, float32)  # this lane's column maxima of the page
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        s = cuda.blockIdx.x
        b = cuda.blockIdx.y
        splits = cuda.gridDim.x
        _, pos_last = query_of(b * LQ + LQ - 1, LQ, cache_seqlens, block_table.shape[1] * BK)
        n_cand = pos_last // BK if pos_last >= 0 else 0  # blocks before the last local one
        per = max(min_pages, (n_cand + splits - 1) // splits)
        j0 = s * per
        j1 = min(n_cand, j0 + per)
        n_stages = max(0, j1 - j0) * CPP
        for n in range(tid, NQ, NTH):
            heap_n[n] = 0
        # the request's index queries, column n = i * Hkv + r (zero columns past NQ), and the
        # first STAGES - 1 stages; one commit group a stage (empty ones too: uniform counts)
        for e in range(tid, NQP * PIECES, NTH):
            n = e // PIECES
            w = (e % PIECES) * 4
            src = ((b * LQ + n // HKV) * HKV + n % HKV) * DW + w if n < NQ else 0
            cp_async16(smem, Q_OFF + n * LDK + w, q_idx, src, 16 if n < NQ else 0)
        for c in range(STAGES - 1):
            issue_stage(smem, k_idx_cache, block_table, b, j0, c, n_stages, c)
            cp_async_commit()
        pending = -1  # the page whose maxima wait in red for the owners
        for c in range(n_stages):
            cp_async_wait_group(_IN_FLIGHT)  # this thread's copies of stage c have landed
            cuda.syncthreads()  # everyone's have; stage c - 1 is read by all: its buffer is free
            if c == 0:
                for nt in range(NT):
                    for ks in range(KS):
                        b0, b1 = load_b_frag(smem, Q_OFF + nt * 8 * LDK + ks * 8, LDK)
                        qb[2 * (nt * KS + ks)] = b0
                        qb[2 * (nt * KS + ks) + 1] = b1
            if pending >= 0:
                page = block_table[b, pending]
                offer_page(heap_s, heap_i, heap_n, red, pending % 2, pending,
                           0 <= page < k_idx_cache.shape[0], pos_last, scale)
                pending = -1
            issue_stage(smem, k_idx_cache, block_table, b, j0, c + STAGES - 1, n_stages,
                        (c + STAGES - 1) % STAGES)
            cp_async_commit()
            part = c % CPP
            if part == 0:
                for e in range(2 * NT):
                    cm[e] = float32(-math.inf)
            stage_maxima(smem, qb, cm, c % STAGES, warp, lane)
            if part == CPP - 1:
                j = j0 + c // CPP
                for e in range(2 * NT):  # max over the rows g: lanes differing in bits 2-4
                    x = cm[e]
                    for off in (4, 8, 16):
                        y = cuda.shfl_xor_sync(FULL_MASK, x, off)
                        if y > x:
                            x = y
                    if lane < 4:
                        red[j % 2, warp, 8 * (e // 2) + 2 * lane + e % 2] = x
                pending = j
        cp_async_wait_all()  # nothing in flight at exit (the empty groups, the queries)
        cuda.syncthreads()
        if pending >= 0:
            page = block_table[b, pending]
            offer_page(heap_s, heap_i, heap_n, red, pending % 2, pending,
                       0 <= page < k_idx_cache.shape[0], pos_last, scale)
        # each column's heap, best first, into the split's slot (padding (-inf, -1))
        for n in range(tid, NQ, NTH):
            store(heap_s[n * KM:(n + 1) * KM], heap_i[n * KM:(n + 1) * KM], heap_n[n], cand_s,
                  cand_i, s, b, n)

    return kernel


def merge_warps(topk: int) -> int:
    """Warps (rows) of a merge CTA: the lanes' heaps of up to ``K - 1`` entries stay within
    static shared memory (one warp above K = 32)."""
    return MERGE_WARPS if topk <= 32 else 1


@functools.lru_cache(maxsize=None)
def list_walk(km: int, cap: int):
    """``take(hs, hi, cand_s, cand_i, t, r, first, stride) -> (n, heap)``: the candidate lists
    of splits ``first, first + stride, ...`` for row ``(t, r)`` into a lane's ``hs/hi`` of
    ``cap`` entries (``km = K - 1`` a list; ``km = 0``: none). The first list enters whole and
    without offers: it holds at most ``km <= cap`` entries, all kept ones (scores above
    ``-inf``, then ``(-inf, -1)`` padding); its loads are independent of each other (a walk
    would wait for each before the next). Where it is the lane's only list (the common case:
    at most one list a lane) it stays as it came, sorted best first, and ``heap`` is False:
    nothing to sort. Else it is stored worst first, already a min-heap, and each further list
    (sorted best first) is offered until its first entry that cannot enter the full heap;
    ``heap`` is True and the caller sorts ``hs/hi[0:n]`` best first."""
    @cuda.jit(device=True, inline=True)
    def take(hs, hi, cand_s, cand_i, t, r, first, stride):
        n = 0
        rs = float32(-math.inf)
        ri = int32(NO_BLOCK)
        heap = km > 0 and first + stride < cand_s.shape[0]  # more lists than this one
        if km > 0 and first < cand_s.shape[0]:
            for e in range(km):
                hs[e] = cand_s[first, t, r, e]
                hi[e] = cand_i[first, t, r, e]
            for e in range(km):
                if hi[e] >= 0:
                    n += 1
            if heap:
                for e in range(n // 2):  # best first -> worst first
                    s = hs[e]
                    i = hi[e]
                    hs[e] = hs[n - 1 - e]
                    hi[e] = hi[n - 1 - e]
                    hs[n - 1 - e] = s
                    hi[n - 1 - e] = i
                if n > 0:
                    rs = hs[0]
                    ri = hi[0]
        for sp in range(first + stride, cand_s.shape[0] if km > 0 else 0, stride):
            for e in range(km):
                blk = cand_i[sp, t, r, e]
                sc = cand_s[sp, t, r, e]
                if blk < 0 or (n == cap and not better(sc, blk, rs, ri)):
                    break
                n, rs, ri = offer(hs, hi, n, cap, rs, ri, sc, blk)
        return n, heap

    return take


@functools.lru_cache(maxsize=None)
def merge_kernel(block_size: int, topk: int):
    """The merge of the splits' candidate lists into ``I [B*Lq, Hkv, K]``; arguments:
    ``(cand_s, cand_i, cache_seqlens, lq, capacity, out)`` (K = 1: no candidates, any
    stand-ins). A lane's heap holds ``K - 1`` entries, all a lane needs to be exact."""
    BK = block_size
    KM = topk - 1
    CAP = max(KM, 1)  # K = 1: no candidates, the loop below never runs
    WM = merge_warps(topk)
    take_lists = list_walk(KM, CAP)

    @kernel_jit
    def kernel(cand_s, cand_i, cache_seqlens, lq, capacity, out):
        heap_s = cuda.shared.array((WM, 32, CAP), float32)
        heap_i = cuda.shared.array((WM, 32, CAP), int32)
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        hkv = out.shape[1]
        row = cuda.blockIdx.x * WM + warp
        if row >= out.shape[0] * hkv:  # the whole warp leaves together
            return
        t = row // hkv
        r = row % hkv
        _, pos = query_of(t, lq, cache_seqlens, capacity)
        loc = pos // BK if pos >= 0 else -1
        hs = heap_s[warp, lane]
        hi = heap_i[warp, lane]
        # splits lane, lane + 32, ...
        n, heap = take_lists(hs, hi, cand_s, cand_i, t, r, lane, 32)
        if heap:
            heap_sort_best_first(hs, hi, n)
        # the paper's warp merge: the warp's top K - 1, ascending, the local block, -1 padding
        warp_merge(hs, hi, n, KM, float32(-math.inf), out, t, r, loc, out.shape[2], lane)

    return kernel


MAX_WIDE_WARPS = 8  # warps a row of the wide merge: one list a lane up to 256 splits
WIDE_SMEM = 40 * 1024  # its lanes' heaps, in static shared memory (48 KB at most a CTA)


def wide_warps(splits: int, topk: int) -> int:
    """Warps a row of the wide merge (``merge_kernel_wide``) for ``splits`` lists: one list a
    lane where the one-warp merge would give a lane more than one (``splits > 32``), at most
    ``MAX_WIDE_WARPS``, within ``WIDE_SMEM`` bytes of lane heaps; 1 (the one-warp merge)
    otherwise."""
    if topk < 2 or splits <= 32:
        return 1
    fit = WIDE_SMEM // (32 * (topk - 1) * 8)  # a lane's heap: K - 1 (score, id) pairs
    return max(1, min(-(-splits // 32), MAX_WIDE_WARPS, fit))



@functools.lru_cache(maxsize=None)
def merge_kernel_wide(block_size: int, topk: int, warps: int):
    """The merge with ``warps`` warps a row (one CTA a row), for rows of many splits: warp ``w``
    takes the lists of splits ``32 w + l, 32 (w + warps) + l, ...`` into its lanes' heaps as the
    one-warp merge does, reduces them to its best ``K - 1`` (``_core.heap.warp_top``), and after
    the CTA barrier warp 0 merges those ``warps`` sorted lists, one a lane, into the row
    (``warp_merge``). Exact, and bitwise the one-warp merge's row: the global best ``K - 1`` are
    each among their warp's best, and ``better`` is a total order. Arguments as
    ``merge_kernel``'s."""
    BK = block_size
    KM = topk - 1
    W = warps
    assert KM >= 1 and W >= 2
    take_lists = list_walk(KM, KM)

    @kernel_jit
    def kernel(cand_s, cand_i, cache_seqlens, lq, capacity, out):
        heap_s = cuda.shared.array((W, 32, KM), float32)
        heap_i = cuda.shared.array((W, 32, KM), int32)
        top_s = cuda.shared.array((W, KM), float32)
        top_i = cuda.shared.array((W, KM), int32)
        top_n = cuda.shared.array(W, int32)
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        hkv = out.shape[1]
        row = cuda.blockIdx.x  # the grid is exactly the rows: no CTA leaves early
        t = row // hkv
        r = row % hkv
        _, pos = query_of(t, lq, cache_seqlens, capacity)
        loc = pos // BK if pos >= 0 else -1
        hs = heap_s[warp, lane]
        hi = heap_i[warp, lane]
        n, heap = take_lists(hs, hi, cand_s, cand_i, t, r, 32 * warp + lane, 32 * W)
        if heap:
            heap_sort_best_first(hs, hi, n)
        count = warp_top(hs, hi, n, KM, float32(-math.inf), top_s[warp], top_i[warp], lane)
        if lane == 0:
            top_n[warp] = count
        cuda.syncthreads()
        if warp == 0:  # lane l < W holds warp l's list, sorted best first: its "heap"
            mine = min(lane, W - 1)
            m = top_n[mine] if lane < W else 0
            warp_merge(top_s[mine], top_i[mine], m, KM, float32(-math.inf), out, t, r, loc,
                       out.shape[2], lane)

    return kernel


def plan_index(p, ctx, step, index_scale) -> int:
    """Add the index launches of rung 2 to plan ``p``; returns the split count."""
    lay = step.layout
    lq, hkv = step.lq, lay.num_kv_heads
    smem = layout(lay.block_size, lay.index_dim, lq * hkv)[-1]
    return plan_splits_and_merge(
        p, ctx, step, index_scale, index_splits(lay.batch, lay.max_pages, multiprocessors()),
        lambda: split_kernel(lay.block_size, lay.index_dim, lq, hkv, step.topk,
                             step.kind == "bfloat16"), 32 * WARPS, smem, _MIN_PAGES)


def plan_splits_and_merge(p, ctx, step, index_scale, splits, make_split, threads, smem,
                          min_pages) -> int:
    """The index launches of a split rung (2 or 3) in plan ``p``: the candidate workspaces
    ``cand_s, cand_i [S, B*Lq, Hkv, K-1]``, the split scorer ``make_split()`` on a ``(splits,
    B)`` grid of ``threads`` threads and ``smem`` bytes of dynamic shared memory (its
    arguments: rung 2's), then the merge into ``p.block_indices``; returns the split count
    (1 at ``K = 1``: no candidates, the merge writes the local blocks alone)."""
    lay = step.layout
    b, lq, hkv, topk = lay.batch, step.lq, lay.num_kv_heads, step.topk
    rows = b * lq
    if topk == 1:
        splits = 1
        p.workspace["cand_s"] = ctx.empty((1, 1, 1, 1), np.float32)
        p.workspace["cand_i"] = ctx.empty((1, 1, 1, 1), np.int32)
    else:
        p.workspace["cand_s"] = ctx.empty((splits, rows, hkv, topk - 1), np.float32)
        p.workspace["cand_i"] = ctx.empty((splits, rows, hkv, topk - 1), np.int32)
        p.steps.append((Kernel(make_split(), (splits, b), threads, smem),
                        [("in", "q_idx", "words"), ("in", "k_idx_cache", "words"),
                         ("in", "block_table", None), ("in", "cache_seqlens", None),
                         min_pages, float(index_scale), ("ws", "cand_s", None),
                         ("ws", "cand_i", None)]))
    wide = wide_warps(splits, topk)
    if wide > 1:  # one CTA of `wide` warps a row
        merge = Kernel(merge_kernel_wide(lay.block_size, topk, wide), rows * hkv, 32 * wide)
    else:  # one warp a row, `wm` rows a CTA
        wm = merge_warps(topk)
        merge = Kernel(merge_kernel(lay.block_size, topk), -(-rows * hkv // wm), 32 * wm)
    p.steps.append((merge, [("ws", "cand_s", None), ("ws", "cand_i", None),
                            ("in", "cache_seqlens", None), lq, lay.max_pages * lay.block_size,
                            ("out", "block_indices", None)]))
    return splits


_MIN_PAGES = 4  # the least pages a non-empty split takes (fewer: fewer, fuller splits)
