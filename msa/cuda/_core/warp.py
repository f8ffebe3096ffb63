"""Warp-level building blocks shared by msa's kernels (device functions, GPU and simulator).

Each helper is called by all 32 lanes of a warp together (full mask), so launch blocks whose size
is a multiple of 32 or give the idle lanes neutral values; ``warp_inclusive_sum`` also takes a
mask whose lanes are ``0..n-1`` (e.g. ``cuda.activemask()`` in a partial last warp). Under
``NUMBA_ENABLE_CUDASIM=1`` the shuffles come from ``msa.cuda._core.simwarp``. Numba widens int32
arithmetic to int64, so the sums of int32 values are int64 (two shuffles per step) on the GPU;
float32 stays float32 (checked offline: no f64 and no local memory in the PTX at cc 9.0).

=================================  =========================================================
``warp_sum/max/min(value)``        butterfly (``shfl_xor_sync``): every lane gets the result
``warp_inclusive_sum(mask, v)``    Hillis-Steele scan with ``shfl_up_sync``
``warp_sort_desc(key, idx)``       bitonic sort of 32 (key, idx) pairs across the warp:
                                   lane 0 gets the largest key, ties go to the smaller idx
                                   (docs/design.md §3: ties in the top-k go to the smaller block id)
=================================  =========================================================
"""

from __future__ import annotations

from numba import cuda

FULL_MASK = 0xFFFFFFFF
WARP_SIZE = 32


@cuda.jit(device=True)
def warp_sum(value):
    """Sum of ``value`` over the 32 lanes, returned to every lane (xor butterfly)."""
    offset = 16
    while offset > 0:
        value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
        offset >>= 1
    return value


@cuda.jit(device=True)
def warp_max(value):
    """Maximum of ``value`` over the 32 lanes, returned to every lane."""
    offset = 16
    while offset > 0:
        value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, offset))
        offset >>= 1
    return value


@cuda.jit(device=True)
def warp_min(value):
    """Minimum of ``value`` over the 32 lanes, returned to every lane."""
    offset = 16
    while offset > 0:
        value = min(value, cuda.shfl_xor_sync(FULL_MASK, value, offset))
        offset >>= 1
    return value


@cuda.jit(device=True)
def warp_inclusive_sum(mask, value):
    """Inclusive prefix sum over lanes ``0..lane``; ``mask`` must be lanes ``0..n-1``."""
    lane = cuda.laneid
    offset = 1
    while offset < WARP_SIZE:
        # lanes below `offset` read their own value back, which they discard
        other = cuda.shfl_up_sync(mask, value, offset)
        if lane >= offset:
            value += other
        offset <<= 1
    return value


@cuda.jit(device=True)
def warp_sort_desc(key, idx):
    """Bitonic sort of the warp's ``(key, idx)`` pairs; returns this lane's pair after sorting.

    Order: larger ``key`` first, equal keys by smaller ``idx`` (``-inf`` keys sort last).
    """
    lane = cuda.laneid
    k = 2
    while k <= WARP_SIZE:
        j = k >> 1
        while j > 0:
            other_key = cuda.shfl_xor_sync(FULL_MASK, key, j)
            other_idx = cuda.shfl_xor_sync(FULL_MASK, idx, j)
            mine_first = key > other_key or (key == other_key and idx < other_idx)
            # the lower lane of a pair keeps the first element in rising runs, the second in falling
            first_here = ((lane & j) == 0) == ((lane & k) == 0)
            if mine_first != first_here:
                key = other_key
                idx = other_idx
            j >>= 1
        k <<= 1
    return key, idx
