"""Decode rung 4, index branch: the index keys by bulk copies into each warp's own buffers.

Same function and outputs as rung 3's split scorer (``v3_register_index``: each warp streams its
own pages ``j0 + w, j0 + w + W, ...`` of the split, scores them by ``mma.sync`` with the index
queries as the B operand under rung 3's permutation of the index dimensions, offers each page's
maxima to per-column heaps, and the CTA merges its warps' heaps), with the bytes moved another
way. Rung 3 holds its keys in flight in registers (three m-tiles of 16 keys a warp, 96 of its
158 registers), which bounds the bytes an SM has in flight and so the bandwidth (3.6 TB/s at B
= 32 x 64K against dense decode's 4.5). Here lane 0 of each warp keeps ``BUFFERS`` chunks of
``CK`` keys (a chunk is ``CK`` consecutive rows of one page: one contiguous run of the cache)
in flight as bulk copies (``cp.async.bulk``, the TMA's one-dimensional form) into the warp's
own shared-memory buffers, each counted on its own ``mbarrier`` (``msa.cuda._core.bulk``):

* item ``i`` of the warp is chunk ``i % CPP`` of its page ``i // CPP``; it goes to buffer ``i %
  BUFFERS``, whose barrier completes its ``(i // BUFFERS)``-th phase when the chunk has landed;
* the warp waits on that phase, reads its A fragments with 16-byte shared loads (rung 3's
  words: lane ``(g, t)`` chunk ``t + 4u`` of rows ``g`` and ``g + 8``; two rows of an 8-lane
  phase share banks, a 2-way conflict), scores it, then (``syncwarp``: every lane has read the
  buffer) lane 0 copies item ``i + BUFFERS`` into it;
* the page ids come from the block table 32 pages at a time, one a lane, and reach lane 0 by a
  shuffle: no dependent global read before a copy. A page id outside ``[0, P)`` is not read
  (its item's barrier gets a plain arrival) and its block is not offered.

No barrier across warps until the heaps merge. Applies where rung 3 does, on compute capability
9.0 and later, with ``BUFFERS`` chunks a warp within shared memory.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, int32, types

from .._core.arrays import SIMULATOR
from .._core.bulk import (bulk_copy, fence_proxy_async, lds_u32x4, mbar_arrive,
                          mbar_arrive_expect_tx, mbar_fence_init, mbar_init, mbar_try_wait)
from .._core.diskcache import kernel_jit
from .._core.memops import dynamic_smem_u32, load_u32x4
from ._plan import multiprocessors
from .v1_simple import query_of
from .v2_split_index import plan_splits_and_merge
from .v3_register_index import register_common

FULL_MASK = 0xFFFFFFFF
WARPS = 1 if SIMULATOR else 4  # the simulator runs every thread as a Python thread
BUFFERS = 3  # chunks a warp: BUFFERS - 1 copies in flight while one is scored
CHUNK_KEYS = 16 if SIMULATOR else 32  # keys a chunk (a page of Bk = 128 is four)
CTAS_PER_SM = 2  # the grid: one wave of CTAs
MIN_PAGES = 4  # the least pages a non-empty split takes
MAX_SPLITS = 256  # the merge's cost grows with the splits


def chunk_keys(block_size: int) -> int:
    """Keys a chunk: ``CHUNK_KEYS``, or the whole page where that is smaller."""
    return min(block_size, CHUNK_KEYS)


def smem_bytes(index_dim: int, warps: int, buffers: int, chunk: int) -> int:
    """Dynamic shared memory of the split kernel: ``warps x buffers`` chunks of key rows."""
    return warps * buffers * chunk * index_dim * 2


def applies() -> bool:
    """Whether bulk copies exist here (compute capability 9.0 and later; the simulator)."""
    if SIMULATOR:
        return True
    return cuda.get_current_device().compute_capability >= (9, 0)


def splits_for(batch: int, max_pages: int, sms: int) -> int:
    """Splits of each request's context: ``batch * splits`` CTAs, at most one wave of
    ``CTAS_PER_SM`` an SM, each of at least ``MIN_PAGES`` pages at the full ``max_pages``, at
    most ``MAX_SPLITS``."""
    want = CTAS_PER_SM * sms // batch
    return max(1, min(want, -(-max_pages // MIN_PAGES), MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def split_kernel(block_size: int, index_dim: int, lq: int, hkv: int, topk: int, bf16: bool,
                 warps: int, buffers: int, chunk: int):
    """The split scorer for (Bk, Didx, Lq, Hkv, K, bf16 or fp16, warps a CTA, chunk buffers a
    warp, keys a chunk); arguments (rung 2's): ``(q_idx words [B*Lq, Hkv, Didx/2], k_idx_cache words [P,
    Bk, Didx/2], block_table, cache_seqlens, min_pages, scale, cand_s, cand_i)``; dynamic
    shared memory ``smem_bytes``."""
    BK, DI, LQ, HKV = block_size, index_dim, lq, hkv
    NQ = LQ * HKV
    KM = topk - 1
    NT = -(-NQ // 8)  # n-tiles of queries
    KS = DI // 16  # k-steps
    U = DI // 32  # 16-byte chunks a lane reads of one key row
    DW = DI // 2  # words a key row
    CK = chunk
    CPP = BK // CK  # chunks a page
    MTC = CK // 16  # m-tiles a chunk
    CW = CK * DW  # words a chunk
    CB = 4 * CW  # bytes a chunk
    W = warps
    NB = buffers
    TILE = 8 * U  # words a lane holds of one m-tile: rows g, g + 8, U chunks each
    tile_maxima, offer_page, merge_heaps = register_common(BK, DI, LQ, HKV, topk, bf16, W)
    HEAP = W * NQ * KM
    COLS = W * NQ  # the warps' heaps
    BARS = W * NB  # a barrier a buffer
    QB, CM = 2 * NT * KS, 2 * NT  # array sizes (constants)
    assert BK % CK == 0 and CK % 16 == 0 and DI % 32 == 0 and 1 <= KM and NQ <= 32
    assert NB >= 2 and CB % 16 == 0

    @cuda.jit(device=True, inline=True)
    def window(block_table, b, j0, warp, base, n_pages, lane):
        """Lane ``l``'s page id of the warp's page ``base + l`` (-1 past its pages)."""
        p = base + lane
        return block_table[b, j0 + warp + W * p] if p < n_pages else int32(-1)

    @cuda.jit(device=True, inline=True)
    def issue(smem, bars, k_idx_cache, block_table, b, j0, warp, lane, i, n_items, n_pages,
              n_pool, win_base, win_id):
        """Lane 0 starts the copy of the warp's item ``i`` into buffer ``i % NB`` (nothing
        past its items; a plain arrival for a page outside ``[0, P)``); called by the whole
        warp (the page id arrives by a shuffle). Returns the page-id window."""
        if i < n_items:
            p = i // CPP
            base = p - p % 32
            if base != win_base:
                win_base = base
                win_id = window(block_table, b, j0, warp, base, n_pages, lane)
            page = cuda.shfl_sync(FULL_MASK, win_id, p % 32)
            if lane == 0:
                bi = warp * NB + i % NB
                if 0 <= page < n_pool:
                    fence_proxy_async()  # the warp's reads of the buffer come first
                    mbar_arrive_expect_tx(bars, bi, CB)
                    bulk_copy(smem, bi * CW, k_idx_cache, (page * BK + (i % CPP) * CK) * DW, CB,
                              bars, bi)
                else:
                    mbar_arrive(bars, bi)
        return win_base, win_id

    @cuda.jit(device=True, inline=True)
    def read_tile(buf, smem, at, g, t):
        """``buf`` <- the lane's words of the m-tile whose first row is at word ``at``."""
        for h in range(2):
            row = at + (g + 8 * h) * DW + 4 * t
            for u in range(U):
                w0, w1, w2, w3 = lds_u32x4(smem, row + 16 * u)
                buf[8 * u + 4 * h] = w0
                buf[8 * u + 4 * h + 1] = w1
                buf[8 * u + 4 * h + 2] = w2
                buf[8 * u + 4 * h + 3] = w3

    @kernel_jit
    def kernel(q_idx, k_idx_cache, block_table, cache_seqlens, min_pages, scale, cand_s, cand_i):
        smem = dynamic_smem_u32()
        bars = cuda.shared.array(BARS, types.uint64)
        heap_s = cuda.shared.array(HEAP, types.float32)
        heap_i = cuda.shared.array(HEAP, int32)
        heap_n = cuda.shared.array(COLS, int32)
        qb = cuda.local.array(QB, types.uint32)  # B fragments of the queries
        cm = cuda.local.array(CM, types.float32)  # this lane's column maxima of the page
        buf = cuda.local.array(TILE, types.uint32)  # the m-tile being scored
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        s = cuda.blockIdx.x
        b = cuda.blockIdx.y
        splits = cuda.gridDim.x
        if lane == 0:
            for k in range(NB):
                mbar_init(bars, warp * NB + k, 1)
            mbar_fence_init()
        _, pos_last = query_of(b * LQ + LQ - 1, LQ, cache_seqlens, block_table.shape[1] * BK)
        n_cand = pos_last // BK if pos_last >= 0 else 0  # blocks before the last local one
        per = max(min_pages, (n_cand + splits - 1) // splits)
        j0 = s * per
        j1 = min(n_cand, j0 + per)
        n_pages = max(0, j1 - j0 - warp + W - 1) // W  # this warp's: j0 + warp + W p
        n_items = n_pages * CPP
        n_pool = k_idx_cache.shape[0]
        cuda.syncthreads()  # the barriers are set up before any copy or wait
        win_base = int32(-1)
        win_id = int32(-1)
        for i in range(NB):
            win_base, win_id = issue(smem, bars, k_idx_cache, block_table, b, j0, warp, lane, i,
                                     n_items, n_pages, n_pool, win_base, win_id)
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
        cnt = int32(0)  # lane n's heap (n < NQ): its entries
        col = warp * NQ + lane % NQ
        hs = heap_s[col * KM:(col + 1) * KM]
        hi = heap_i[col * KM:(col + 1) * KM]
        for i in range(n_items):
            bi = warp * NB + i % NB
            part = i % CPP
            if part == 0:
                for e in range(CM):
                    cm[e] = types.float32(-math.inf)
            while mbar_try_wait(bars, bi, (i // NB) & 1) == 0:
                pass
            for mt in range(MTC):
                read_tile(buf, smem, bi * CW + 16 * mt * DW, g, t)
                tile_maxima(buf, qb, cm)
            cuda.syncwarp()  # every lane has read the buffer: it may be refilled
            win_base, win_id = issue(smem, bars, k_idx_cache, block_table, b, j0, warp, lane,
                                     i + NB, n_items, n_pages, n_pool, win_base, win_id)
            if part == CPP - 1:
                j = j0 + warp + W * (i // CPP)
                page = block_table[b, j]
                cnt = offer_page(hs, hi, cnt, cm, j, 0 <= page < n_pool, pos_last, scale, lane)
        if lane < NQ:
            heap_n[warp * NQ + lane] = cnt
        cuda.syncthreads()
        merge_heaps(heap_s, heap_i, heap_n, cand_s, cand_i, s, b, tid)

    return kernel


def plan_index(p, ctx, step, index_scale) -> int:
    """Add the index launches of rung 4 (its split scorer, rung 2's merge) to plan ``p``;
    returns the split count."""
    lay = step.layout
    lq, hkv = step.lq, lay.num_kv_heads
    splits = splits_for(lay.batch, lay.max_pages, multiprocessors())
    warps, buffers, chunk = WARPS, BUFFERS, chunk_keys(lay.block_size)
    return plan_splits_and_merge(
        p, ctx, step, index_scale, splits,
        lambda: split_kernel(lay.block_size, lay.index_dim, lq, hkv, step.topk,
                             step.kind == "bfloat16", warps, buffers, chunk),
        32 * warps, smem_bytes(lay.index_dim, warps, buffers, chunk), MIN_PAGES)
