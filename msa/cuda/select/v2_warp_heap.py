"""Select v2: paper §4.1's warp-level heap top-k with a shuffle merge.

One warp per (query, group) row. Each lane scans a strided share of the row's candidates
``b < L`` (lanes l, l + 32, ...) into a (K-1)-entry min-heap in a local array, its root (the
worst kept) cached in registers so that most candidates cost one comparison; sorts it best
first; then K - 1 shuffle rounds (a butterfly arg-max) give every lane the warp's best, whose
owner pops it; the winners are ranked by id with K - 1 more shuffles. The algorithm of the
paper, kept as the rung to read; not the default anywhere: each lane's scan is a chain of
dependent loads and compares with its heap in local memory. Measured (H200, fp32 M
[4, 65536, NB], K = 16): 8.91 ms at NB = 1024, 28.2 ms at NB = 8192 (7% of HBM bandwidth).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, float64, int32

from .._core.heap import NO_BLOCK, heap_sort_best_first, offer, warp_merge
from .._core.packed import query_position
from .._core.diskcache import kernel_jit
from .._core.streams import stream

WARPS_PER_CTA = 4


@functools.lru_cache(maxsize=None)
def select_kernel(cap: int, wide: bool):
    """Paper §4.1: one warp per (t, r) row; ``cap`` >= K - 1 heap entries per lane."""
    F = float64 if wide else float32

    @kernel_jit
    def kernel(M, cu_q, cu_k, t_begin, topk, block_size, out):
        lane = cuda.threadIdx.x & 31
        row = cuda.blockIdx.x * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5)
        hkv = M.shape[0]
        if row >= M.shape[1] * hkv:  # the whole warp leaves together
            return
        i = row // hkv
        r = row - i * hkv
        t = t_begin + i
        pos = query_position(cu_q, cu_k, t)[1]
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
        ri = int32(NO_BLOCK)
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
                n, rs, ri = offer(hs, hi, n, kmax, rs, ri, s0, b)
                n, rs, ri = offer(hs, hi, n, kmax, rs, ri, s1, b + 32)
                n, rs, ri = offer(hs, hi, n, kmax, rs, ri, s2, b + 64)
                n, rs, ri = offer(hs, hi, n, kmax, rs, ri, s3, b + 96)
                n, rs, ri = offer(hs, hi, n, kmax, rs, ri, s4, b + 128)
                n, rs, ri = offer(hs, hi, n, kmax, rs, ri, s5, b + 160)
                n, rs, ri = offer(hs, hi, n, kmax, rs, ri, s6, b + 192)
                n, rs, ri = offer(hs, hi, n, kmax, rs, ri, s7, b + 224)
                b += 8 * 32
            while b < loc:
                n, rs, ri = offer(hs, hi, n, kmax, rs, ri, F(M[r, i, b]), b)
                b += 32
        heap_sort_best_first(hs, hi, n)

        warp_merge(hs, hi, n, kmax, neg, out, t, r, loc, topk, lane)

    return kernel



def launch(M, cu_q, cu_k, t0, topk, block_size, out, cap, wide):
    """The v2 kernel over the rows of ``M`` [Hkv, c, NB] (queries t0 .. t0 + c - 1)."""
    rows = int(M.shape[0]) * int(M.shape[1])
    grid = (rows + WARPS_PER_CTA - 1) // WARPS_PER_CTA
    select_kernel(cap, wide)[grid, 32 * WARPS_PER_CTA, stream()](M, cu_q, cu_k, t0, topk,
                                                                 block_size, out)
