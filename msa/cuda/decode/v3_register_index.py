"""Decode rung 3, index branch: the index keys streamed from HBM straight into MMA registers.

Same function as rung 2's split scorer (``v2_split_index``: the context of each request cut into
``S`` equal ranges of candidate blocks, ``S = K_idx Q_idxᵀ`` by ``mma.sync.m16n8k16`` with the
request's ``Lq x Hkv`` index queries as the B operand, block maxima offered to per-column heaps,
each split's heaps sorted into ``cand_s, cand_i [S, B*Lq, Hkv, K-1]``; rung 2's merge kernel
then selects), without shared-memory stages: rung 2 reads its keys at ~3.1 TB/s (three CTAs an
SM by shared memory, a barrier every 16 KB stage), where dense decode reads K and V at ~4.5 TB/s.
Verdict (H200, paper configuration, run T of docs/performance.md): 0.151 ms at B = 32 x 64K,
Lq = 1 (3.6 TB/s) against rung 2's 0.171; 0.084 against 0.089 at 8 x 128K; 0.220 against 0.347
at Lq = 8; the whole step 4.20x dense decode at 32 x 64K (rung 2: 3.4x).

Each warp streams its own pages (``j0 + w, j0 + w + W, ...`` of the split) in m-tiles of 16
keys, ``BUFFERS`` m-tiles in flight in registers while one is scored: lane ``(g, t)`` loads,
for key rows ``g`` and ``g + 8`` of the m-tile, the 16-byte chunks ``t, t + 4, ...`` of the row
(four lanes read one 64-byte run of a row: whole sectors). Those words are the A fragments of
the k-steps under a fixed permutation of the index dimensions inside each 32-dimension chunk
``u`` (the mma's logical pair ``(2t, 2t+1)`` of k-step ``2u + v`` is the physical word ``16u +
4t + 2v``, pair ``(2t + 8, 2t + 9)`` the word after it), and the queries' B fragments are loaded
under the same permutation, so the dot products are those of rung 2 up to the order of the fp32
sums inside an mma (the scores may differ in the last bits; the selection is exact wherever the
scores are exact, as the tests' data make them). The keys' order inside a block does not matter
either: only the block maximum leaves the warp.

The warp's column maxima of a page reduce over its lanes by three shuffles; lane ``n`` (the
column ``n = i Hkv + r`` of query ``i``, group ``r``) offers ``(score, block)`` to its own heap
of ``K - 1`` in shared memory (ties to the smaller id, ``-inf`` and NaN never kept) if the block
is a candidate of its query. Only whole pages before the last query's local block are
candidates, so every key is a real, visible key and nothing is masked; a page id outside
``[0, P)`` is not read and not offered. At the end thread ``n`` merges the other warps' heaps of
column ``n`` into warp 0's (each holds its warp's top ``K - 1``, so the union holds the split's)
and writes the split's sorted list. Every output is what rung 2 writes for the same scores.

Applies where rung 2 does, with ``Didx`` a multiple of 32 and the heaps (``W Lq Hkv (K - 1)``
entries of 8 bytes) within static shared memory.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, types

from .._core.arrays import SIMULATOR
from .._core.diskcache import kernel_jit
from .._core.heap import offer
from .._core.memops import load_u32x4
from ._plan import multiprocessors
from .v1_simple import query_of
from .v2_split_index import plan_splits_and_merge, split_common

FULL_MASK = 0xFFFFFFFF
WARPS = 1 if SIMULATOR else 4  # the simulator runs every thread as a Python thread
BUFFERS = 3  # m-tiles of keys a warp holds in registers (b0, b1, b2: written out thrice)
# The grid: one wave of CTAs (a split's fixed costs outweigh a second wave's tail). Registers
# bound the CTAs an SM (ptxas, paper sizes): 158 a thread with one n-tile of queries (Lq Hkv <=
# 8): 3 CTAs; 178 and 230 with two and four (Lq = 4, 8 at Hkv = 4): 2. H200, run S: at B = 32 x
# 64K, Lq = 1, 3 CTAs an SM index in 0.149 ms against 0.164 (2) and 0.186 (4); at Lq = 8 2 an
# SM in 0.217 ms against 0.290 (3).
CTAS_PER_SM = {1: 3}  # n-tiles -> CTAs an SM
CTAS_PER_SM_DEFAULT = 2
MIN_PAGES = 4  # the least pages a non-empty split takes (fewer: fewer, fuller splits)
MAX_SPLITS = 256  # the merge's cost grows with the splits
HEAP_BYTES = 40 * 1024  # the warps' heaps, within the 48 KB of static shared memory


def heaps_fit(lq: int, hkv: int, topk: int) -> bool:
    """Whether the warps' heaps (``W Lq Hkv (K - 1)`` entries of 8 bytes) fit ``HEAP_BYTES``;
    rung 3 takes the shapes of rung 2 with ``Didx`` a multiple of 32 where they do."""
    return WARPS * lq * hkv * max(topk - 1, 1) * 8 <= HEAP_BYTES


def splits_for(batch: int, max_pages: int, sms: int, num_queries: int) -> int:
    """Splits of each request's context: ``batch * splits`` CTAs, at most one wave of them (the
    CTAs an SM that fit ``num_queries = Lq Hkv`` index queries' registers, ``CTAS_PER_SM``),
    each of at least ``MIN_PAGES`` pages at the full ``max_pages``, at most ``MAX_SPLITS``."""
    per_sm = CTAS_PER_SM.get(-(-num_queries // 8), CTAS_PER_SM_DEFAULT)
    want = per_sm * sms // batch
    return max(1, min(want, -(-max_pages // MIN_PAGES), MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def split_kernel(block_size: int, index_dim: int, lq: int, hkv: int, topk: int, bf16: bool):
    """The split scorer for (Bk, Didx, Lq, Hkv, K, bf16 or fp16); arguments (those of rung 2's):
    ``(q_idx words [B*Lq, Hkv, Didx/2], k_idx_cache words [P, Bk, Didx/2], block_table,
    cache_seqlens, min_pages, scale, cand_s, cand_i)``."""
    BK, DI, LQ, HKV = block_size, index_dim, lq, hkv
    NQ = LQ * HKV
    KM = topk - 1
    NT = -(-NQ // 8)  # n-tiles of queries
    KS = DI // 16  # k-steps
    U = DI // 32  # 16-byte chunks a lane loads of one key row
    DW = DI // 2  # words a key row
    MT = BK // 16  # m-tiles a page
    W = WARPS
    NB = BUFFERS
    TILE = 8 * U  # words a lane holds of one m-tile: rows g, g + 8, U chunks each
    assert NB == 3
    kstep, fold, store = split_common(LQ, HKV, topk, NT, KS, bf16)
    HEAP = W * NQ * KM
    COLS = W * NQ  # the warps' heaps
    QB, CM, ACC = 2 * NT * KS, 2 * NT, 4 * NT  # array sizes (constants)
    assert BK % 16 == 0 and DI % 32 == 0 and 1 <= KM and NQ <= 32

    @cuda.jit(device=True, inline=True)
    def page_of(block_table, b, j, n_pool):
        """The pool page of block ``j`` of request ``b``; -1 when outside ``[0, P)``."""
        page = block_table[b, j]
        return page if 0 <= page < n_pool else int32(-1)

    @cuda.jit(device=True, inline=True)
    def item_page(block_table, b, j0, warp, i, n_items, n_pool):
        """The page of the warp's item ``i`` (-1 past its items)."""
        if i < n_items:
            return page_of(block_table, b, j0 + warp + W * (i // MT), n_pool)
        return int32(-1)

    @cuda.jit(device=True, inline=True)
    def load_tile(buf, k_idx_cache, page, mt, g, t):
        """``buf`` <- the lane's words of m-tile ``mt`` of ``page`` (zeros for no page): chunk
        ``u`` of row ``g + 8 h`` at ``8 u + 4 h``."""
        for h in range(2):
            row = (page * BK + 16 * mt + g + 8 * h) * DW + 4 * t
            for u in range(U):
                w0 = w1 = w2 = w3 = types.uint32(0)
                if page >= 0:
                    w0, w1, w2, w3 = load_u32x4(k_idx_cache, row + 16 * u)
                buf[8 * u + 4 * h] = w0
                buf[8 * u + 4 * h + 1] = w1
                buf[8 * u + 4 * h + 2] = w2
                buf[8 * u + 4 * h + 3] = w3

    @cuda.jit(device=True, inline=True)
    def tile_maxima(buf, qb, cm):
        """S = K_idx Q_idxᵀ of the m-tile in ``buf``; its rows' maxima into ``cm`` (columns 2t
        and 2t + 1 of each n-tile: rows g and g + 8 of this lane)."""
        acc = cuda.local.array(ACC, float32)
        for i in range(ACC):
            acc[i] = float32(0.0)
        for u in range(U):
            for v in range(2):
                a0 = buf[8 * u + 2 * v]  # row g, logical pair 2t
                a2 = buf[8 * u + 2 * v + 1]  # row g, logical pair 2t + 8
                a1 = buf[8 * u + 4 + 2 * v]  # row g + 8
                a3 = buf[8 * u + 4 + 2 * v + 1]
                kstep(a0, a1, a2, a3, qb, 2 * u + v, acc)
        fold(acc, cm)

    @cuda.jit(device=True, inline=True)
    def offer_page(hs, hi, cnt, cm, j, ok, pos_last, scale, lane):
        """The page's maxima over the rows g (lanes differing in bits 2-4), column ``n``'s to
        lane ``n``, offered to its heap if block ``j`` is a candidate of its query; returns the
        heap's new count."""
        mine = float32(-math.inf)
        for e in range(CM):
            x = cm[e]
            for off in (4, 8, 16):
                y = cuda.shfl_xor_sync(FULL_MASK, x, off)
                if y > x:
                    x = y
            x = cuda.shfl_sync(FULL_MASK, x, (lane % 8) // 2)
            if lane // 8 == e // 2 and lane % 2 == e % 2:
                mine = x
        if ok and lane < NQ and j < (pos_last - (LQ - 1 - lane // HKV)) // BK:
            cnt, _, _ = offer(hs, hi, cnt, KM, hs[0], hi[0], mine * scale, int32(j))
        return cnt

    @cuda.jit(device=True, inline=True)
    def item(buf, i, n_items, qb, cm, hs, hi, cnt, k_idx_cache, block_table, b, j0, warp,
             n_pool, pos_last, scale, lane, g, t):
        """Item ``i`` of the warp (page ``j0 + warp + W (i // MT)``, m-tile ``i % MT``), held
        in ``buf``: scored, ``buf`` refilled with item ``i + NB``, the page offered after its
        last m-tile; returns the heap's count."""
        if i < n_items:
            mt = i % MT
            if mt == 0:
                for e in range(CM):
                    cm[e] = float32(-math.inf)
            tile_maxima(buf, qb, cm)
            nxt = i + NB
            load_tile(buf, k_idx_cache, item_page(block_table, b, j0, warp, nxt, n_items, n_pool),
                      nxt % MT, g, t)
            if mt == MT - 1:
                j = j0 + warp + W * (i // MT)
                ok = page_of(block_table, b, j, n_pool) >= 0
                cnt = offer_page(hs, hi, cnt, cm, j, ok, pos_last, scale, lane)
        return cnt

    @kernel_jit
    def kernel(q_idx, k_idx_cache, block_table, cache_seqlens, min_pages, scale, cand_s, cand_i):
        heap_s = cuda.shared.array(HEAP, float32)
        heap_i = cuda.shared.array(HEAP, int32)
        heap_n = cuda.shared.array(COLS, int32)
        qb = cuda.local.array(QB, types.uint32)  # B fragments of the queries
        cm = cuda.local.array(CM, float32)  # this lane's column maxima of the page
        b0 = cuda.local.array(TILE, types.uint32)  # the NB = 3 m-tiles in flight
        b1 = cuda.local.array(TILE, types.uint32)
        b2 = cuda.local.array(TILE, types.uint32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        s = cuda.blockIdx.x
        b = cuda.blockIdx.y
        splits = cuda.gridDim.x
        _, pos_last = query_of(b * LQ + LQ - 1, LQ, cache_seqlens, block_table.shape[1] * BK)
        n_cand = pos_last // BK if pos_last >= 0 else 0  # blocks before the last local one
        per = max(min_pages, (n_cand + splits - 1) // splits)
        j0 = s * per
        j1 = min(n_cand, j0 + per)
        n_pages = max(0, j1 - j0 - warp + W - 1) // W  # this warp's: j0 + warp + W p
        n_items = n_pages * MT
        n_pool = k_idx_cache.shape[0]
        # the queries' B fragments, column n = 8 nt + g (zero past NQ), permuted as the keys
        for nt in range(NT):
            n = 8 * nt + g
            src = ((b * LQ + n // HKV) * HKV + n % HKV) * DW + 4 * t
            for u in range(U):
                w0 = w1 = w2 = w3 = types.uint32(0)
                if n < NQ:
                    w0, w1, w2, w3 = load_u32x4(q_idx, src + 16 * u)
                qb[2 * (nt * KS + 2 * u)] = w0
                qb[2 * (nt * KS + 2 * u) + 1] = w1
                qb[2 * (nt * KS + 2 * u + 1)] = w2
                qb[2 * (nt * KS + 2 * u + 1) + 1] = w3
        # items 0, 1, 2 (item i: page j0 + warp + W (i // MT), m-tile i % MT)
        load_tile(b0, k_idx_cache, item_page(block_table, b, j0, warp, 0, n_items, n_pool),
                  0, g, t)
        load_tile(b1, k_idx_cache, item_page(block_table, b, j0, warp, 1, n_items, n_pool),
                  1 % MT, g, t)
        load_tile(b2, k_idx_cache, item_page(block_table, b, j0, warp, 2, n_items, n_pool),
                  2 % MT, g, t)
        cnt = int32(0)  # lane n's heap (n < NQ): its entries
        col = warp * NQ + lane % NQ
        hs = heap_s[col * KM:(col + 1) * KM]
        hi = heap_i[col * KM:(col + 1) * KM]
        for it in range(0, n_items, NB):
            cnt = item(b0, it, n_items, qb, cm, hs, hi, cnt, k_idx_cache, block_table, b, j0,
                       warp, n_pool, pos_last, scale, lane, g, t)
            cnt = item(b1, it + 1, n_items, qb, cm, hs, hi, cnt, k_idx_cache, block_table, b,
                       j0, warp, n_pool, pos_last, scale, lane, g, t)
            cnt = item(b2, it + 2, n_items, qb, cm, hs, hi, cnt, k_idx_cache, block_table, b,
                       j0, warp, n_pool, pos_last, scale, lane, g, t)
        if lane < NQ:
            heap_n[warp * NQ + lane] = cnt
        cuda.syncthreads()
        # column n: the other warps' heaps into warp 0's, sorted best first into the slot
        for n in range(tid, NQ, 32 * W):
            hs0 = heap_s[n * KM:(n + 1) * KM]
            hi0 = heap_i[n * KM:(n + 1) * KM]
            c0 = heap_n[n]
            for w in range(1, W):
                base = (w * NQ + n) * KM
                for e in range(heap_n[w * NQ + n]):
                    c0, _, _ = offer(hs0, hi0, c0, KM, hs0[0], hi0[0], heap_s[base + e],
                                     heap_i[base + e])
            store(hs0, hi0, c0, cand_s, cand_i, s, b, n)

    return kernel


def plan_index(p, ctx, step, index_scale) -> int:
    """Add the index launches of rung 3 (its split scorer, rung 2's merge) to plan ``p``;
    returns the split count."""
    lay = step.layout
    lq, hkv = step.lq, lay.num_kv_heads
    splits = splits_for(lay.batch, lay.max_pages, multiprocessors(), lq * hkv)
    return plan_splits_and_merge(
        p, ctx, step, index_scale, splits,
        lambda: split_kernel(lay.block_size, lay.index_dim, lq, hkv, step.topk,
                             step.kind == "bfloat16"), 32 * WARPS, 0, MIN_PAGES)
