"""Select v1: one thread per (query, group) row, the K - 1 best kept in a sorted array.

The simple rung of paper eq 7: thread ``(t, r)`` reads its row's candidate scores ``b < L``
one after the other and inserts each that beats the worst kept entry into a local array kept
sorted best first (by ``(score, -b)``), then writes the kept ids ascending, the local block
``L`` and ``-1``. Any float dtype. Not the default anywhere; measured (H200, fp32 M [4, 65536,
NB], K = 16): 7.11 ms at NB = 1024, 21.8 ms at NB = 8192 (``torch.topk``: 7.51 / 28.95 ms).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, float64, int32

from .._core.heap import better, sort_ids_ascending, write_selection
from .._core.packed import query_position
from .._core.diskcache import kernel_jit
from .._core.streams import stream

THREADS = 128


@functools.lru_cache(maxsize=None)
def select_kernel(cap: int, wide: bool):
    """One thread per (t, r) row; ``cap`` >= K - 1 entries kept sorted best first."""
    F = float64 if wide else float32

    @kernel_jit
    def kernel(M, cu_q, cu_k, t_begin, topk, block_size, out):
        row = cuda.grid(1)
        hkv = M.shape[0]
        if row >= M.shape[1] * hkv:
            return
        i = row // hkv  # row of M (query t_begin + i)
        r = row - i * hkv
        t = t_begin + i
        pos = query_position(cu_q, cu_k, t)[1]
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
                elif better(s, b, hs[kmax - 1], hi[kmax - 1]):
                    j = kmax - 1
                else:
                    continue
                # insertion into the sorted array, dropping the worst when it is full
                while j > 0 and better(s, b, hs[j - 1], hi[j - 1]):
                    hs[j] = hs[j - 1]
                    hi[j] = hi[j - 1]
                    j -= 1
                hs[j] = s
                hi[j] = b
        # ascending ids: insertion sort of the kept ids (all < loc, so loc comes last)
        sort_ids_ascending(hi, n)
        write_selection(out, t, r, hi, n, loc, topk)

    return kernel



def launch(M, cu_q, cu_k, t0, topk, block_size, out, cap, wide):
    """The v1 kernel over the rows of ``M`` [Hkv, c, NB] (queries t0 .. t0 + c - 1)."""
    rows = int(M.shape[0]) * int(M.shape[1])
    grid = (rows + THREADS - 1) // THREADS
    select_kernel(cap, wide)[grid, THREADS, stream()](M, cu_q, cu_k, t0, topk, block_size, out)
