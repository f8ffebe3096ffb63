"""Paper §4.1 and eq 7 on the GPU: the exp-free warp-heap top-k with a forced local block.

``select_blocks`` is ``msa.reference.select.select_blocks`` on a GPU, equal to it bit for bit
(integers): per (query ``t``, group ``r``) row, the local block ``L = floor(pos_t / Bk)``, the
``K - 1`` best candidates ``b < L`` by ``(score, -b)`` (a higher score first, ties to the smaller
block id), ascending, ``-1`` padded. A candidate's score is read as given and neither ``-inf`` nor
NaN; the scores of blocks ``b >= L`` are never used (``warp2``/``warp3`` may load some of them
with the 128-bit loads of their group of 4, never past the row's end). ``select_blocks_fused`` runs the
index branch end to end, ``block_scores`` then ``select_blocks``, without ever holding the whole
``M [Hkv, Tq, NB]``.

Versions (every one tested against the reference; the default is the fastest):

=====  =========================  ==============================================================
v1     ``_select_kernel_v1``      one thread per row, a sorted array kept by insertion
warp   ``_select_kernel_warp``    paper §4.1: one warp per row; each lane scans a strided share
                                  of the row into a (K-1)-entry min-heap in a local array with
                                  its root cached in registers, sorts it best first, then K-1
                                  shuffle rounds pick the warp's best and its owner pops; the
                                  winners are ranked by id with K-1 more shuffles
warp2  ``_select_kernel_warp2``   one warp per row, one list for the whole warp: lane ``j``
                                  holds the row's ``j``-th best so far (and ``32 + j`` for
                                  K > 33), sorted best first; the last entry is the threshold.
                                  A batch is 16 scores a lane (four 128-bit loads for float32
                                  rows with NB % 4 == 0 and 16-byte aligned data); one
                                  comparison a score and a vote reject it unless some lane
                                  holds a score >= the threshold. Then, slot by slot, a ballot
                                  names the lanes that beat the threshold, and each in turn is
                                  inserted (shuffled down the list in one step), the threshold
                                  rising after each insertion. The heap of ``warp`` is
                                  divergent (each lane sifts at its own time, in local memory)
                                  and each lane must keep its own K - 1 best; here the warp
                                  shares one threshold, so on random scores a row of N
                                  candidates costs about ``(K-1) ln(N / (K-1))`` insertions in
                                  all, each a few warp-uniform instructions
warp3  ``_select_kernel_warp3``   warp2 with a better start (default): the list begins as each
                                  lane's best of its first 16 scores, bitonic-sorted across the
                                  warp (warp2 begins with each lane's first score); each lane's
                                  best then leaves its slots (in the list already, or below the
                                  threshold for good). On random rows of 1023 candidates, K=16:
                                  ~13 insertions instead of ~52 (~46 instead of ~82 at 8191).
                                  Comparisons are bitwise (``_beats``), so the compiler
                                  predicates the insertion instead of branching; 48 registers,
                                  as warp2
=====  =========================  ==============================================================

Fused index + top-k (``select_blocks_fused``):

=======  ====================================================================================
chunked  the queries in chunks sized to a memory budget: block scores of one chunk into a
         reused ``M`` buffer, then the warp top-k of that chunk (``block_scores``' fastest
         kernel: tensor cores for bf16/fp16). Any dtype.
heap     one kernel (``msa.cuda.index``'s tensor-core kernel with a top-k epilogue): a CTA
         streams its sequence's KV blocks for a tile of (query, group) rows through
         ``mma.sync``, and each block maximum goes straight into the row's (K-1)-entry heap,
         owned by one thread; M is never written. bf16/fp16 with Didx % 16 == 0, Bk % 8 == 0.
heap2    the same epilogue on ``msa.cuda.index``'s ``tc2`` kernel (key chunks double-buffered
         by ``cp.async``, B fragments by ``ldmatrix``). Bk % 16 == 0, k_idx 16-byte aligned.
heap3    the same on ``tc3`` (two m-tiles a warp: half the shared-memory reads per mma); the
         default where it applies.
heap4    the same on ``tc4`` (tc3 on Hopper's wgmma, queries and keys read by the tensor cores
         from shared memory; compute capability 9.0): the same selection, no faster.
=======  ====================================================================================
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64, int32

from .._checks import check_array, check_cu_seqlens, check_positive_int, cu_to_host, dtype_of
from ..reference.blocks import max_blocks
from . import index as _index
from ._core.arrays import SIMULATOR, ArrayContext
from ._core.memops import is_aligned16, load_f32x4
from ._core.warp import warp_sort_desc
from ._core.arrays import POISON as _POISON
from ._core.heap import better as _better
from ._core.heap import heap_sort_best_first as _heap_sort_best_first
from ._core.heap import offer as _offer
from ._core.packed import query_position as _query_position

if SIMULATOR:
    from ._core.simwarp import install as _install_simwarp

    _install_simwarp()

VERSIONS = ("v1", "warp", "warp2", "warp3")
DEFAULT_VERSION = "warp3"
FUSED_VERSIONS = ("chunked", "heap", "heap2", "heap3", "heap4")
# msa.cuda.index kernel of each one-kernel version
_FUSED_KERNEL = {"heap": "tc", "heap2": "tc2", "heap3": "tc3", "heap4": "tc4"}
MAX_TOPK = 64  # heap capacity of the kernels: K - 1 <= 63 entries per lane
FULL_MASK = 0xFFFFFFFF
_NO_BLOCK = 0x7FFFFFFF  # id of "no candidate": loses every tie against a real block
_WARPS_PER_CTA = 4
_THREADS_V1 = 128
# Default memory for one chunk's block scores in select_blocks_fused (bytes).
FUSED_MEMORY_BUDGET = 4 << 30


# -- kernels ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _select_kernel_v1(cap: int, wide: bool):
    """v1: one thread per (t, r) row; ``cap`` >= K - 1 entries kept sorted best first."""
    F = float64 if wide else float32

    @cuda.jit
    def kernel(M, cu_q, cu_k, t_begin, topk, block_size, out):
        row = cuda.grid(1)
        hkv = M.shape[0]
        if row >= M.shape[1] * hkv:
            return
        i = row // hkv  # row of M (query t_begin + i)
        r = row - i * hkv
        t = t_begin + i
        pos = _query_position(cu_q, cu_k, t)[1]
        loc = pos // block_size
        kmax = topk - 1
        neg = F(-math.inf)
        hs = cuda.local.array(cap, F)
        hi = cuda.local.array(cap, int32)
        n = 0
        if kmax > 0:
            for b in range(loc):
                s = F(M[r, i, b])
                if not s > neg:  # -inf and NaN are not candidates
                    continue
                if n < kmax:
                    j = n
                    n += 1
                elif _better(s, b, hs[kmax - 1], hi[kmax - 1]):
                    j = kmax - 1
                else:
                    continue
                # insertion into the sorted array, dropping the worst when it is full
                while j > 0 and _better(s, b, hs[j - 1], hi[j - 1]):
                    hs[j] = hs[j - 1]
                    hi[j] = hi[j - 1]
                    j -= 1
                hs[j] = s
                hi[j] = b
        # ascending ids: insertion sort of the kept ids (all < loc, so loc comes last)
        for a in range(1, n):
            v = hi[a]
            j = a
            while j > 0 and hi[j - 1] > v:
                hi[j] = hi[j - 1]
                j -= 1
            hi[j] = v
        for j in range(topk):
            if j < n:
                out[t, r, j] = hi[j]
            elif j == n:
                out[t, r, j] = loc
            else:
                out[t, r, j] = -1

    return kernel


@functools.lru_cache(maxsize=None)
def _select_kernel_warp(cap: int, wide: bool):
    """Paper §4.1: one warp per (t, r) row; ``cap`` >= K - 1 heap entries per lane."""
    F = float64 if wide else float32

    @cuda.jit
    def kernel(M, cu_q, cu_k, t_begin, topk, block_size, out):
        lane = cuda.threadIdx.x & 31
        row = cuda.blockIdx.x * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5)
        hkv = M.shape[0]
        if row >= M.shape[1] * hkv:  # the whole warp leaves together
            return
        i = row // hkv
        r = row - i * hkv
        t = t_begin + i
        pos = _query_position(cu_q, cu_k, t)[1]
        loc = pos // block_size
        kmax = topk - 1
        neg = F(-math.inf)
        hs = cuda.local.array(cap, F)
        hi = cuda.local.array(cap, int32)

        # Scan: lane l owns candidates l, l+32, ...; a min-heap keeps its kmax best, and the root
        # (the worst kept) stays in registers so that most candidates cost one comparison. Eight
        # loads are issued before they are compared, to keep enough bytes in flight.
        n = 0
        rs = neg
        ri = int32(_NO_BLOCK)
        if kmax > 0:
            b = lane
            while b + 7 * 32 < loc:
                s0 = F(M[r, i, b])
                s1 = F(M[r, i, b + 32])
                s2 = F(M[r, i, b + 64])
                s3 = F(M[r, i, b + 96])
                s4 = F(M[r, i, b + 128])
                s5 = F(M[r, i, b + 160])
                s6 = F(M[r, i, b + 192])
                s7 = F(M[r, i, b + 224])
                n, rs, ri = _offer(hs, hi, n, kmax, rs, ri, s0, b)
                n, rs, ri = _offer(hs, hi, n, kmax, rs, ri, s1, b + 32)
                n, rs, ri = _offer(hs, hi, n, kmax, rs, ri, s2, b + 64)
                n, rs, ri = _offer(hs, hi, n, kmax, rs, ri, s3, b + 96)
                n, rs, ri = _offer(hs, hi, n, kmax, rs, ri, s4, b + 128)
                n, rs, ri = _offer(hs, hi, n, kmax, rs, ri, s5, b + 160)
                n, rs, ri = _offer(hs, hi, n, kmax, rs, ri, s6, b + 192)
                n, rs, ri = _offer(hs, hi, n, kmax, rs, ri, s7, b + 224)
                b += 8 * 32
            while b < loc:
                n, rs, ri = _offer(hs, hi, n, kmax, rs, ri, F(M[r, i, b]), b)
                b += 32
        _heap_sort_best_first(hs, hi, n)

        # Merge: each round every lane shows its best remaining entry, a butterfly arg-max gives
        # every lane the warp's best, and its owner pops it. Lane j keeps the winners of rounds j
        # (w0) and j + 32 (w1).
        p = 0
        count = 0
        w0 = int32(-1)
        w1 = int32(-1)
        while count < kmax:
            cs = neg
            ci = int32(_NO_BLOCK)
            if p < n:
                cs = hs[p]
                ci = hi[p]
            off = 16
            while off > 0:
                os_ = cuda.shfl_xor_sync(FULL_MASK, cs, off)
                oi = cuda.shfl_xor_sync(FULL_MASK, ci, off)
                if _better(os_, oi, cs, ci):
                    cs = os_
                    ci = oi
                off >>= 1
            if ci == _NO_BLOCK:  # every lane is empty (same answer in every lane)
                break
            if p < n and hi[p] == ci:
                p += 1
            if lane == (count & 31):
                if count < 32:
                    w0 = ci
                else:
                    w1 = ci
            count += 1

        # Ascending ids: the rank of a winner is the number of smaller winners; the local block is
        # larger than every candidate, so it takes slot `count` and -1 fills the rest.
        r0 = 0
        r1 = 0
        for j in range(count):
            v = cuda.shfl_sync(FULL_MASK, w0 if j < 32 else w1, j & 31)
            if v < w0:
                r0 += 1
            if v < w1:
                r1 += 1
        if lane < count:
            out[t, r, r0] = w0
        if lane + 32 < count:
            out[t, r, r1] = w1
        j = lane
        while j < topk:
            if j == count:
                out[t, r, j] = loc
            elif j > count:
                out[t, r, j] = -1
            j += 32

    return kernel


# -- warp2: one warp-wide sorted list, a shared threshold and 128-bit loads ---------------------

_W2_SLOTS = 16  # scores per lane per batch: four groups of 4 (one float4 each when vectorised)


@cuda.jit(device=True, inline=True)
def _insert_narrow(cs, ci, lane, ls, li):
    """Insert ``(cs, ci)`` into the warp's list (lane ``j`` holds its ``j``-th best entry):
    entries worse than the candidate move down one lane. Every lane calls it (shuffles)."""
    ps = cuda.shfl_up_sync(FULL_MASK, ls, 1)
    pi = cuda.shfl_up_sync(FULL_MASK, li, 1)
    if _better(cs, ci, ls, li):
        if lane > 0 and _better(cs, ci, ps, pi):
            ls = ps
            li = pi
        else:
            ls = cs
            li = ci
    return ls, li


@cuda.jit(device=True, inline=True)
def _insert_wide(cs, ci, lane, ls, li, ls2, li2):
    """``_insert_narrow`` for a 64-entry list: lane ``j`` holds entries ``j`` (ls, li) and
    ``32 + j`` (ls2, li2); entry 32's predecessor is entry 31 (lane 31's first)."""
    src = (lane + 31) & 31
    ps = cuda.shfl_sync(FULL_MASK, ls, src)
    pi = cuda.shfl_sync(FULL_MASK, li, src)
    ps2 = cuda.shfl_sync(FULL_MASK, ls2, src)
    pi2 = cuda.shfl_sync(FULL_MASK, li2, src)
    if lane == 0:
        ps2 = ps
        pi2 = pi
    if _better(cs, ci, ls2, li2):
        if _better(cs, ci, ps2, pi2):
            ls2 = ps2
            li2 = pi2
        else:
            ls2 = cs
            li2 = ci
    if _better(cs, ci, ls, li):
        if lane > 0 and _better(cs, ci, ps, pi):
            ls = ps
            li = pi
        else:
            ls = cs
            li = ci
    return ls, li, ls2, li2


@cuda.jit(device=True, inline=True)
def _load4_vec(M, flat, r, i, b, step, loc, full):
    """Scores of blocks ``b .. b+3`` (``step`` is 1) of row ``flat`` in one 128-bit load; blocks
    ``>= loc`` read as -inf (``b`` is a multiple of 4 and NB % 4 == 0: never past the row)."""
    neg = float32(-math.inf)
    if full:
        return load_f32x4(M, flat + b)
    if b >= loc:
        return neg, neg, neg, neg
    s0, s1, s2, s3 = load_f32x4(M, flat + b)
    return (s0, s1 if b + 1 < loc else neg, s2 if b + 2 < loc else neg,
            s3 if b + 3 < loc else neg)


def _make_load4_scalar(F):
    @cuda.jit(device=True, inline=True)
    def load4(M, flat, r, i, b, step, loc, full):
        """Scores of blocks ``b + e * step`` (e < 4), -inf from ``loc`` on."""
        neg = F(-math.inf)
        s0 = F(M[r, i, b]) if full or b < loc else neg
        s1 = F(M[r, i, b + step]) if full or b + step < loc else neg
        s2 = F(M[r, i, b + 2 * step]) if full or b + 2 * step < loc else neg
        s3 = F(M[r, i, b + 3 * step]) if full or b + 3 * step < loc else neg
        return s0, s1, s2, s3

    return load4


@functools.lru_cache(maxsize=None)
def _select_kernel_warp2(wide_list: bool, wide: bool, vec: bool):
    """One warp per (t, r) row; the K - 1 best are one list across the warp, sorted best first
    (``wide_list``: 64 entries, two per lane; else 32). ``wide``: float64 scores; ``vec``:
    float32 scores read by 128-bit loads (NB % 4 == 0 and 16-byte aligned data)."""
    F = float64 if wide else float32
    load4 = _load4_vec if vec else _make_load4_scalar(F)
    # A batch is 16 scores a lane: group u (0..3) of lane l holds blocks g + e * STEP (e < 4),
    # g = b0 + 128 u + LANE_MUL l: four consecutive blocks (one float4) or four strided ones.
    STEP = 1 if vec else 32
    LANE_MUL = 4 if vec else 1
    BATCH = 32 * _W2_SLOTS

    if wide_list:
        @cuda.jit(device=True, inline=True)
        def insert(cs, ci, lane, ls, li, ls2, li2):
            return _insert_wide(cs, ci, lane, ls, li, ls2, li2)

        @cuda.jit(device=True, inline=True)
        def threshold(kmax, ls, li, ls2, li2):
            return (cuda.shfl_sync(FULL_MASK, ls2, kmax - 33),
                    cuda.shfl_sync(FULL_MASK, li2, kmax - 33))
    else:
        @cuda.jit(device=True, inline=True)
        def insert(cs, ci, lane, ls, li, ls2, li2):
            ls, li = _insert_narrow(cs, ci, lane, ls, li)
            return ls, li, ls2, li2

        @cuda.jit(device=True, inline=True)
        def threshold(kmax, ls, li, ls2, li2):
            return cuda.shfl_sync(FULL_MASK, ls, kmax - 1), cuda.shfl_sync(FULL_MASK, li, kmax - 1)

    @cuda.jit(device=True, inline=True)
    def drain(s, b, lane, kmax, ls, li, ls2, li2, ts, ti):
        """Insert, lane by lane, the scores ``(s, b)`` of one slot that beat the list's last
        entry ``(ts, ti)``; the threshold rises after each insertion, so later lanes are tested
        again against it."""
        b = int32(b)  # ids travel as one 32-bit register
        m = cuda.ballot_sync(FULL_MASK, _better(s, b, ts, ti))
        while m != 0:
            src = cuda.ffs(m) - 1
            cs = cuda.shfl_sync(FULL_MASK, s, src)
            ci = cuda.shfl_sync(FULL_MASK, b, src)
            ls, li, ls2, li2 = insert(cs, ci, lane, ls, li, ls2, li2)
            ts, ti = threshold(kmax, ls, li, ls2, li2)
            m = cuda.ballot_sync(FULL_MASK, lane > src and _better(s, b, ts, ti))
        return ls, li, ls2, li2, ts, ti

    @cuda.jit(device=True, inline=True)
    def drain4(s0, s1, s2, s3, g, lane, kmax, ls, li, ls2, li2, ts, ti):
        ls, li, ls2, li2, ts, ti = drain(s0, g, lane, kmax, ls, li, ls2, li2, ts, ti)
        ls, li, ls2, li2, ts, ti = drain(s1, g + STEP, lane, kmax, ls, li, ls2, li2, ts, ti)
        ls, li, ls2, li2, ts, ti = drain(s2, g + 2 * STEP, lane, kmax, ls, li, ls2, li2, ts, ti)
        ls, li, ls2, li2, ts, ti = drain(s3, g + 3 * STEP, lane, kmax, ls, li, ls2, li2, ts, ti)
        return ls, li, ls2, li2, ts, ti

    @cuda.jit
    def kernel(M, cu_q, cu_k, t_begin, topk, block_size, out):
        lane = cuda.threadIdx.x & 31
        row = cuda.blockIdx.x * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5)
        hkv = M.shape[0]
        c = M.shape[1]
        if row >= c * hkv:  # the whole warp leaves together
            return
        i = row // hkv
        r = row - i * hkv
        t = t_begin + i
        pos = _query_position(cu_q, cu_k, t)[1]
        loc = pos // block_size
        kmax = topk - 1
        flat = (r * c + i) * M.shape[2]

        # The list starts as sentinels (-inf, -1), which no candidate ties and every score > -inf
        # beats; so -inf and NaN never enter. (ts, ti) is its last entry, the score to beat. A
        # batch costs one comparison per score until some lane has a score >= ts. Lanes past
        # the list (j >= kmax) hold values that are never read.
        ls = F(-math.inf)
        li = int32(-1)
        ls2 = F(-math.inf)
        li2 = int32(-1)
        ts = F(-math.inf)
        ti = int32(-1)
        if kmax > 0:
            b0 = 0
            while b0 < loc:
                full = b0 + BATCH <= loc
                g0 = b0 + LANE_MUL * lane
                g1 = g0 + 128
                g2 = g0 + 256
                g3 = g0 + 384
                a0, a1, a2, a3 = load4(M, flat, r, i, g0, STEP, loc, full)
                c0, c1, c2, c3 = load4(M, flat, r, i, g1, STEP, loc, full)
                d0, d1, d2, d3 = load4(M, flat, r, i, g2, STEP, loc, full)
                e0, e1, e2, e3 = load4(M, flat, r, i, g3, STEP, loc, full)
                if b0 == 0:
                    # The first slot of every lane (32 distinct blocks) seeds the list in one
                    # bitonic sort instead of 32 insertions; -inf and NaN become sentinels.
                    ok = a0 > F(-math.inf)
                    ls, li = warp_sort_desc(a0 if ok else F(-math.inf),
                                            int32(g0) if ok else int32(-1))
                    ts, ti = threshold(kmax, ls, li, ls2, li2)
                    a0 = F(-math.inf)  # consumed
                hit = ((a0 >= ts) | (a1 >= ts) | (a2 >= ts) | (a3 >= ts)
                       | (c0 >= ts) | (c1 >= ts) | (c2 >= ts) | (c3 >= ts)
                       | (d0 >= ts) | (d1 >= ts) | (d2 >= ts) | (d3 >= ts)
                       | (e0 >= ts) | (e1 >= ts) | (e2 >= ts) | (e3 >= ts))
                if cuda.any_sync(FULL_MASK, hit):
                    ls, li, ls2, li2, ts, ti = drain4(a0, a1, a2, a3, g0, lane, kmax,
                                                      ls, li, ls2, li2, ts, ti)
                    ls, li, ls2, li2, ts, ti = drain4(c0, c1, c2, c3, g1, lane, kmax,
                                                      ls, li, ls2, li2, ts, ti)
                    ls, li, ls2, li2, ts, ti = drain4(d0, d1, d2, d3, g2, lane, kmax,
                                                      ls, li, ls2, li2, ts, ti)
                    ls, li, ls2, li2, ts, ti = drain4(e0, e1, e2, e3, g3, lane, kmax,
                                                      ls, li, ls2, li2, ts, ti)
                b0 += BATCH

        # Ascending ids: the kept entries (id >= 0) are a prefix of the list; an entry's slot is
        # the number of smaller kept ids. The local block L exceeds them all and comes next.
        n = cuda.popc(cuda.ballot_sync(FULL_MASK, lane < kmax and li >= 0))
        if wide_list:
            n += cuda.popc(cuda.ballot_sync(FULL_MASK, lane + 32 < kmax and li2 >= 0))
        rank = 0
        rank2 = 0
        for j in range(n):
            v = cuda.shfl_sync(FULL_MASK, li if j < 32 else li2, j & 31)
            if v < li:
                rank += 1
            if v < li2:
                rank2 += 1
        if lane < n:
            out[t, r, rank] = li
        if wide_list and lane + 32 < n:
            out[t, r, rank2] = li2
        j = lane
        while j < topk:
            if j == n:
                out[t, r, j] = loc
            elif j > n:
                out[t, r, j] = -1
            j += 32

    return kernel


# -- warp3: warp2 seeded with the lanes' bests, branch-free comparisons -------------------------

@cuda.jit(device=True, inline=True)
def _beats(s1, i1, s2, i2):
    """``_better`` as one predicate (bitwise operators: no short-circuit branches)."""
    return (s1 > s2) | ((s1 == s2) & (i1 < i2))


@cuda.jit(device=True, inline=True)
def _insert_narrow3(cs, ci, lane, ls, li):
    """``_insert_narrow`` on ``_beats``: the compiler predicates it (no branches, no more
    registers than warp2; a version written with selects took six more)."""
    ps = cuda.shfl_up_sync(FULL_MASK, ls, 1)
    pi = cuda.shfl_up_sync(FULL_MASK, li, 1)
    if _beats(cs, ci, ls, li):  # the candidate lands in this lane's entry or above it
        if (lane > 0) & _beats(cs, ci, ps, pi):  # above: this entry takes its predecessor
            ls = ps
            li = pi
        else:
            ls = cs
            li = ci
    return ls, li


@cuda.jit(device=True, inline=True)
def _insert_wide3(cs, ci, lane, ls, li, ls2, li2):
    """``_insert_wide`` on ``_beats``."""
    src = (lane + 31) & 31
    ps = cuda.shfl_sync(FULL_MASK, ls, src)
    pi = cuda.shfl_sync(FULL_MASK, li, src)
    ps2 = cuda.shfl_sync(FULL_MASK, ls2, src)
    pi2 = cuda.shfl_sync(FULL_MASK, li2, src)
    if lane == 0:  # entry 32's predecessor is entry 31, lane 31's first
        ps2 = ps
        pi2 = pi
    if _beats(cs, ci, ls2, li2):
        if _beats(cs, ci, ps2, pi2):
            ls2 = ps2
            li2 = pi2
        else:
            ls2 = cs
            li2 = ci
    if _beats(cs, ci, ls, li):
        if (lane > 0) & _beats(cs, ci, ps, pi):
            ls = ps
            li = pi
        else:
            ls = cs
            li = ci
    return ls, li, ls2, li2


@cuda.jit(device=True, inline=True)
def _keep_best(bs, bk, s, k):
    """A lane's running best over its slots: a strictly higher score replaces ``(bs, bk)``, so
    equal scores keep the earlier slot (the smaller block id) and -inf/NaN never enter."""
    take = s > bs
    return (s if take else bs), (k if take else bk)


@cuda.jit(device=True, inline=True)
def _drop4(s0, s1, s2, s3, bk, k, neg):
    """Slots ``k .. k+3`` with slot ``bk`` (the lane's seed) replaced by -inf."""
    return (neg if bk == k else s0, neg if bk == k + 1 else s1, neg if bk == k + 2 else s2,
            neg if bk == k + 3 else s3)


@functools.lru_cache(maxsize=None)
def _select_kernel_warp3(wide_list: bool, wide: bool, vec: bool):
    """``warp2`` with a better start: each lane's best of its first 16 scores, bitonic-sorted
    across the warp, is the initial list. Its (K-1)-th entry is the (K-1)-th best of 32 maxima of
    16 scores, a much higher threshold than 32 single scores give (on random rows of 1023
    candidates, K = 16: about 13 insertions instead of 52). A lane's best is then removed from
    its slots: either it is in the list (it must not enter twice) or it is worse than the
    threshold, which only rises. (So any one score per lane would be an exact seed; the best
    only makes the threshold high.) Comparisons are bitwise, which the compiler predicates."""
    F = float64 if wide else float32
    load4 = _load4_vec if vec else _make_load4_scalar(F)
    # as warp2: slot (u, e) of lane l holds block b0 + 128 u + LANE_MUL l + STEP e
    STEP = 1 if vec else 32
    LANE_MUL = 4 if vec else 1
    BATCH = 32 * _W2_SLOTS

    if wide_list:
        @cuda.jit(device=True, inline=True)
        def insert(cs, ci, lane, ls, li, ls2, li2):
            return _insert_wide3(cs, ci, lane, ls, li, ls2, li2)

        @cuda.jit(device=True, inline=True)
        def threshold(kmax, ls, li, ls2, li2):
            return (cuda.shfl_sync(FULL_MASK, ls2, kmax - 33),
                    cuda.shfl_sync(FULL_MASK, li2, kmax - 33))
    else:
        @cuda.jit(device=True, inline=True)
        def insert(cs, ci, lane, ls, li, ls2, li2):
            ls, li = _insert_narrow3(cs, ci, lane, ls, li)
            return ls, li, ls2, li2

        @cuda.jit(device=True, inline=True)
        def threshold(kmax, ls, li, ls2, li2):
            return cuda.shfl_sync(FULL_MASK, ls, kmax - 1), cuda.shfl_sync(FULL_MASK, li, kmax - 1)

    @cuda.jit(device=True, inline=True)
    def drain(s, b, lane, kmax, ls, li, ls2, li2, ts, ti):
        """warp2's drain: insert, lane by lane, the scores of one slot that beat ``(ts, ti)``."""
        b = int32(b)
        m = cuda.ballot_sync(FULL_MASK, _beats(s, b, ts, ti))
        while m != 0:
            src = cuda.ffs(m) - 1
            cs = cuda.shfl_sync(FULL_MASK, s, src)
            ci = cuda.shfl_sync(FULL_MASK, b, src)
            ls, li, ls2, li2 = insert(cs, ci, lane, ls, li, ls2, li2)
            ts, ti = threshold(kmax, ls, li, ls2, li2)
            m = cuda.ballot_sync(FULL_MASK, (lane > src) & _beats(s, b, ts, ti))
        return ls, li, ls2, li2, ts, ti

    @cuda.jit(device=True, inline=True)
    def drain4(s0, s1, s2, s3, g, lane, kmax, ls, li, ls2, li2, ts, ti):
        ls, li, ls2, li2, ts, ti = drain(s0, g, lane, kmax, ls, li, ls2, li2, ts, ti)
        ls, li, ls2, li2, ts, ti = drain(s1, g + STEP, lane, kmax, ls, li, ls2, li2, ts, ti)
        ls, li, ls2, li2, ts, ti = drain(s2, g + 2 * STEP, lane, kmax, ls, li, ls2, li2, ts, ti)
        ls, li, ls2, li2, ts, ti = drain(s3, g + 3 * STEP, lane, kmax, ls, li, ls2, li2, ts, ti)
        return ls, li, ls2, li2, ts, ti

    @cuda.jit(device=True, inline=True)
    def best4(bs, bk, s0, s1, s2, s3, k):
        bs, bk = _keep_best(bs, bk, s0, k)
        bs, bk = _keep_best(bs, bk, s1, int32(k + 1))
        bs, bk = _keep_best(bs, bk, s2, int32(k + 2))
        bs, bk = _keep_best(bs, bk, s3, int32(k + 3))
        return bs, bk

    @cuda.jit
    def kernel(M, cu_q, cu_k, t_begin, topk, block_size, out):
        lane = cuda.threadIdx.x & 31
        row = cuda.blockIdx.x * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5)
        hkv = M.shape[0]
        c = M.shape[1]
        if row >= c * hkv:  # the whole warp leaves together
            return
        i = row // hkv
        r = row - i * hkv
        t = t_begin + i
        pos = _query_position(cu_q, cu_k, t)[1]
        loc = pos // block_size
        kmax = topk - 1
        flat = (r * c + i) * M.shape[2]
        neg = F(-math.inf)

        # The list as in warp2: sorted best first, sentinels (-inf, -1) at its end, (ts, ti) its
        # last entry; lanes past the list (j >= kmax) hold values that are never read.
        ls = neg
        li = int32(-1)
        ls2 = neg
        li2 = int32(-1)
        ts = neg
        ti = int32(-1)
        if kmax > 0:
            b0 = 0
            while b0 < loc:
                full = b0 + BATCH <= loc
                g0 = b0 + LANE_MUL * lane
                g1 = g0 + 128
                g2 = g0 + 256
                g3 = g0 + 384
                a0, a1, a2, a3 = load4(M, flat, r, i, g0, STEP, loc, full)
                c0, c1, c2, c3 = load4(M, flat, r, i, g1, STEP, loc, full)
                d0, d1, d2, d3 = load4(M, flat, r, i, g2, STEP, loc, full)
                e0, e1, e2, e3 = load4(M, flat, r, i, g3, STEP, loc, full)
                if b0 == 0:
                    # The seed: each lane's best (slot bk, or (-inf, -1) when it has no
                    # candidate), sorted across the warp; then dropped from the lane's slots.
                    bs = neg
                    bk = int32(-1)
                    bs, bk = best4(bs, bk, a0, a1, a2, a3, int32(0))
                    bs, bk = best4(bs, bk, c0, c1, c2, c3, int32(4))
                    bs, bk = best4(bs, bk, d0, d1, d2, d3, int32(8))
                    bs, bk = best4(bs, bk, e0, e1, e2, e3, int32(12))
                    bid = int32(g0 + 128 * (bk >> 2) + (bk & 3) * STEP if bk >= 0 else -1)
                    a0, a1, a2, a3 = _drop4(a0, a1, a2, a3, bk, 0, neg)
                    c0, c1, c2, c3 = _drop4(c0, c1, c2, c3, bk, 4, neg)
                    d0, d1, d2, d3 = _drop4(d0, d1, d2, d3, bk, 8, neg)
                    e0, e1, e2, e3 = _drop4(e0, e1, e2, e3, bk, 12, neg)
                    ls, li = warp_sort_desc(bs, bid)
                    ts, ti = threshold(kmax, ls, li, ls2, li2)
                hit = ((a0 >= ts) | (a1 >= ts) | (a2 >= ts) | (a3 >= ts)
                       | (c0 >= ts) | (c1 >= ts) | (c2 >= ts) | (c3 >= ts)
                       | (d0 >= ts) | (d1 >= ts) | (d2 >= ts) | (d3 >= ts)
                       | (e0 >= ts) | (e1 >= ts) | (e2 >= ts) | (e3 >= ts))
                if cuda.any_sync(FULL_MASK, hit):
                    ls, li, ls2, li2, ts, ti = drain4(a0, a1, a2, a3, g0, lane, kmax,
                                                      ls, li, ls2, li2, ts, ti)
                    ls, li, ls2, li2, ts, ti = drain4(c0, c1, c2, c3, g1, lane, kmax,
                                                      ls, li, ls2, li2, ts, ti)
                    ls, li, ls2, li2, ts, ti = drain4(d0, d1, d2, d3, g2, lane, kmax,
                                                      ls, li, ls2, li2, ts, ti)
                    ls, li, ls2, li2, ts, ti = drain4(e0, e1, e2, e3, g3, lane, kmax,
                                                      ls, li, ls2, li2, ts, ti)
                b0 += BATCH

        # Ascending ids, as warp2: an entry's slot is the number of smaller kept ids, then L.
        n = cuda.popc(cuda.ballot_sync(FULL_MASK, (lane < kmax) & (li >= 0)))
        if wide_list:
            n += cuda.popc(cuda.ballot_sync(FULL_MASK, (lane + 32 < kmax) & (li2 >= 0)))
        rank = 0
        rank2 = 0
        for j in range(n):
            v = cuda.shfl_sync(FULL_MASK, li if j < 32 else li2, j & 31)
            rank += v < li
            rank2 += v < li2
        if lane < n:
            out[t, r, rank] = li
        if wide_list and lane + 32 < n:
            out[t, r, rank2] = li2
        j = lane
        while j < topk:
            if j == n:
                out[t, r, j] = loc
            elif j > n:
                out[t, r, j] = -1
            j += 32

    return kernel


# -- launchers ----------------------------------------------------------------------------------

def _heap_capacity(topk: int) -> int:
    """Local-array size for K - 1 entries: a few compiled sizes, the smallest that fits."""
    for cap in (1, 4, 16, MAX_TOPK):
        if topk - 1 <= cap:
            return cap
    raise AssertionError(topk)


def _check_version(name: str, version, versions, default):
    if version is None:
        return default
    if version not in versions:
        raise ValueError(f"{name} must be one of {versions} or None, got {version!r}")
    return version


def _check_select_inputs(block_scores, cu_seqlens_q, cu_seqlens_k, topk, block_size):
    """Validate ``select_blocks``' arguments on the host; returns ``(topk, block_size, hkv, tq, nb)``."""
    topk = check_positive_int("topk", topk, high=MAX_TOPK)
    block_size = check_positive_int("block_size", block_size)
    check_array("block_scores", block_scores, ndim=3, dtypes=("float",))
    dt = dtype_of(block_scores)
    if "bfloat16" in str(getattr(block_scores, "dtype", "")) or dt.kind != "f":
        raise TypeError(f"block_scores must have dtype float16, float32 or float64, got "
                        f"{getattr(block_scores, 'dtype', dt)}")
    hkv, tq, nb_given = (int(s) for s in block_scores.shape)
    if hkv < 1:
        raise ValueError(f"block_scores must have Hkv >= 1 rows, got shape {tuple(block_scores.shape)}")
    check_array("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=("int",))
    cu_k = np.asarray(cu_to_host(cu_seqlens_k), dtype=np.int64)
    total_k = int(cu_k[-1]) if cu_k.size else 0
    check_cu_seqlens(cu_seqlens_q, cu_k, tq, total_k)
    nb = max_blocks(cu_k, block_size)
    if nb_given != nb:
        raise ValueError(
            f"block_scores must have NB = ceil(max Lk / block_size) = {nb} columns "
            f"(block_size={block_size}), got shape {tuple(block_scores.shape)}")
    return topk, block_size, hkv, tq, nb


def _launch_select(version, M, cu_q, cu_k, t_begin, topk, block_size, out):
    """Launch a top-k kernel over the rows of ``M`` [Hkv, c, NB] (queries t_begin .. t_begin+c-1)."""
    rows = int(M.shape[0]) * int(M.shape[1])
    if rows == 0:
        return
    wide = np.dtype(M.dtype) == np.float64
    cap = _heap_capacity(topk)
    if version == "v1":
        kernel = _select_kernel_v1(cap, wide)
        grid = (rows + _THREADS_V1 - 1) // _THREADS_V1
        kernel[grid, _THREADS_V1](M, cu_q, cu_k, t_begin, topk, block_size, out)
    else:
        if version == "warp":
            kernel = _select_kernel_warp(cap, wide)
        else:
            vec = (np.dtype(M.dtype) == np.float32 and int(M.shape[2]) % 4 == 0
                   and is_aligned16(M))
            make = _select_kernel_warp2 if version == "warp2" else _select_kernel_warp3
            kernel = make(topk - 1 > 32, wide, vec)
        grid = (rows + _WARPS_PER_CTA - 1) // _WARPS_PER_CTA
        kernel[grid, 32 * _WARPS_PER_CTA](M, cu_q, cu_k, t_begin, topk, block_size, out)


def select_blocks(block_scores, cu_seqlens_q, cu_seqlens_k, topk: int, block_size: int, *,
                  version=None):
    """Paper eq 7 (§3.2 final recipe) with §4.1's warp-heap top-k: forced local block + top-(K-1).

    Args:
        block_scores: M [Hkv, Tq, NB] float16/32/64, C-contiguous, on the GPU (CuPy, torch, Numba;
            NumPy under the simulator or with a copy each way), ``NB = ceil(max Lk / Bk)``.
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums in the same library (``Lq <= Lk``;
            bottom-right alignment). Copied to the host for validation (small).
        topk: ``K`` in ``[1, 64]``, blocks per row, the local block included.
        block_size: ``Bk`` >= 1.
        version: a kernel of ``VERSIONS`` (default ``DEFAULT_VERSION``, the fastest).

    Returns:
        I [Tq, Hkv, K] int32 in the caller's library, equal to
        ``msa.reference.select.select_blocks``: row ``I[t, r]`` holds, ascending, the ``K - 1``
        best candidates ``b < L = floor(pos_t / Bk)`` by ``(score, -b)`` (scores compared as
        given; ``-inf`` and NaN are not candidates; ``+inf`` is a top score), then ``L``, then
        ``-1`` padding when there are fewer than ``K - 1`` candidates. Scores of blocks
        ``b >= L`` are never used.

    Raises:
        ValueError/TypeError before any launch: wrong rank or dtype, ``K`` outside ``[1, 64]``,
        ``block_size < 1``, bad ``cu_seqlens``, ``NB`` not ``ceil(max Lk / Bk)``, arrays that are
        not contiguous or mix libraries.
    """
    version = _check_version("version", version, VERSIONS, DEFAULT_VERSION)
    topk, block_size, hkv, tq, nb = _check_select_inputs(
        block_scores, cu_seqlens_q, cu_seqlens_k, topk, block_size)
    ctx = ArrayContext(block_scores, cu_seqlens_q, cu_seqlens_k)
    M = ctx.input("block_scores", block_scores)
    cu_q = ctx.input("cu_seqlens_q", cu_seqlens_q)
    cu_k = ctx.input("cu_seqlens_k", cu_seqlens_k)
    out = ctx.empty((tq, hkv, topk), np.int32, fill=np.iinfo(np.int32).min if _POISON else None)
    _launch_select(version, M, cu_q, cu_k, 0, topk, block_size, ctx.arg(out))
    return ctx.output(out)


def select_blocks_fused(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, topk: int, block_size: int,
                        scale=None, *, version=None, memory_budget: int | None = None):
    """Paper §3.1-§4.1, eq 6-7: the index branch end to end, ``block_scores`` then ``select_blocks``.

    Equal to ``select_blocks(block_scores(q_idx, k_idx, ...), ..., topk, block_size)`` but never
    holds the whole ``M [Hkv, Tq, NB]`` (128 GiB at 1M tokens, Hkv=4, Bk=128).

    Args:
        q_idx: [Tq, Hkv, Didx] bf16 (torch), float16, float32 or float64 index queries.
        k_idx: [Tk, Didx], same dtype: the shared index key head.
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums (``Lq <= Lk``; bottom-right alignment);
            NumPy arrays beside GPU inputs are fine (and spare a device-to-host read).
        topk: ``K`` in ``[1, 64]``. block_size: ``Bk`` >= 1.
        scale: multiplies the dot products; default ``1 / sqrt(Didx)``.
        version: one of ``FUSED_VERSIONS``; default ``"heap3"`` where its kernel applies
            (bf16/fp16, ``Didx % 16 == 0``, ``Bk % 16 == 0``, 16-byte aligned ``k_idx``, key
            chunks within 48 KB of static shared memory), else ``"heap2"`` (the same without
            that last condition), else ``"heap"`` where the tensor-core kernel applies
            (``Bk % 8 == 0``), else ``"chunked"``. ``"heap"``: one kernel streams the KV
            blocks of a tile of queries through tensor cores and offers each block maximum to
            the row's heap; M is never written. ``"heap2"``: the same on ``msa.cuda.index``'s
            ``tc2`` kernel (key chunks double-buffered by cp.async, ldmatrix fragments);
            ``"heap3"``: on ``tc3`` (two 16-row m-tiles a warp); ``"heap4"``: on ``tc4``
            (wgmma, operands from shared memory).
            ``"chunked"``: the queries in chunks whose block scores fit ``memory_budget`` bytes
            (default ``FUSED_MEMORY_BUDGET`` = 4 GiB, at least one tile) in one reused buffer:
            ``block_scores``' fastest kernel, then the warp top-k, chunk by chunk.
        memory_budget: bytes for one chunk of block scores (``"chunked"`` only).

    Returns:
        I [Tq, Hkv, K] int32 in the caller's library, as ``select_blocks``. Scores are computed
        as in ``block_scores`` (fp32 accumulation; tensor cores for bf16/fp16), so two blocks
        whose scores differ by less than that rounding may swap against a float64 reference;
        both versions compute the same block scores, hence the same selection.
    """
    version = _check_version("version", version, FUSED_VERSIONS, None)
    topk = check_positive_int("topk", topk, high=MAX_TOPK)
    kernel = _FUSED_KERNEL.get(version)
    try:
        p = _index._prepare(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, scale, "max",
                            version=kernel)
    except ValueError as exc:
        if kernel is not None and f"version '{kernel}'" in str(exc):
            message = str(exc).replace(f"version '{kernel}'", f"version '{version}'")
            raise ValueError(message) from None
        raise
    if version is None:
        version = {k: v for v, k in _FUSED_KERNEL.items()}.get(p.version, "chunked")
    if memory_budget is None:
        memory_budget = FUSED_MEMORY_BUDGET
    memory_budget = check_positive_int("memory_budget", memory_budget)
    ctx = p.ctx
    out = ctx.empty((p.tq, p.hkv, topk), np.int32,
                    fill=np.iinfo(np.int32).min if _POISON else None)
    if p.tq == 0:
        return ctx.output(out)
    out_arg = ctx.arg(out)
    if version in _FUSED_KERNEL:  # one kernel: index scores with a top-k epilogue
        _index._launch_fused_heap(p, topk, _heap_capacity(topk), out_arg)
        return ctx.output(out)
    per_query = p.hkv * max(p.nb, 1) * np.dtype(p.out_dtype).itemsize
    chunk = min(max(p.tile_queries, memory_budget // per_query), p.tq)
    buffer = ctx.empty((p.hkv * chunk * p.nb,), p.out_dtype)
    buf = ctx.arg(buffer)
    for t0 in range(0, p.tq, chunk):
        t1 = min(t0 + chunk, p.tq)
        M = buf[: p.hkv * (t1 - t0) * p.nb].reshape(p.hkv, t1 - t0, p.nb)
        _index._launch_block_scores(p, M, t0, t1)
        _launch_select(DEFAULT_VERSION, M, p.cu_q, p.cu_k, t0, topk, p.block_size, out_arg)
    return ctx.output(out)
