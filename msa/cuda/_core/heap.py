"""Paper §4.1: the per-thread min-heap of a top-k, on ``(score, -block id)``.

A heap ``hs/hi[0:n]`` (scores, block ids) keeps the ``n <= kmax`` best candidates seen so far
with the worst at the root, so a new candidate costs one comparison against the root unless it
enters. ``better`` is the order everywhere in msa's selection: a higher score first, equal
scores to the smaller block id; ``offer`` never keeps ``-inf`` or NaN. ``sort_ids_ascending``
and ``write_selection`` turn the kept ids into a row of ``I`` (the select stage's v1 kernel and
the index stage's fused top-k epilogue end the same way); ``warp_merge`` is the end of the
paper's warp-level selection, shared by the select stage's v2 kernel and the decode merge, whose
wide form first reduces each warp to its best with ``warp_top``.
"""

from __future__ import annotations

import math

from numba import cuda, int32

MAX_TOPK = 64  # the kernels' heap capacity: K - 1 <= 63 entries a lane (or thread)
FULL_MASK = 0xFFFFFFFF
NO_BLOCK = 0x7FFFFFFF  # the id of "no candidate": loses every tie against a real block


def heap_capacity(topk: int) -> int:
    """Local-array size for ``K - 1`` entries: a few compiled sizes, the smallest that fits."""
    for cap in (1, 4, 16, MAX_TOPK):
        if topk - 1 <= cap:
            return cap
    raise AssertionError(topk)


@cuda.jit(device=True, inline=True)
def better(s1, i1, s2, i2):
    """``(s1, -i1) > (s2, -i2)``: a higher score first, equal scores to the smaller block id."""
    return s1 > s2 or (s1 == s2 and i1 < i2)


@cuda.jit(device=True, inline=True)
def sift_down(hs, hi, n, pos):
    """Restore the min-heap ``hs/hi[0:n]`` below ``pos`` (each parent worse than its children)."""
    s = hs[pos]
    i = hi[pos]
    while True:
        c = 2 * pos + 1
        if c >= n:
            break
        # descend towards the worse child, so that it can rise above the other
        if c + 1 < n and better(hs[c], hi[c], hs[c + 1], hi[c + 1]):
            c += 1
        if better(s, i, hs[c], hi[c]):
            hs[pos] = hs[c]
            hi[pos] = hi[c]
            pos = c
        else:
            break
    hs[pos] = s
    hi[pos] = i


@cuda.jit(device=True, inline=True)
def sift_up(hs, hi, pos):
    """Restore the min-heap after an entry was written at ``pos`` (the end of the heap)."""
    s = hs[pos]
    i = hi[pos]
    while pos > 0:
        p = (pos - 1) >> 1
        if better(hs[p], hi[p], s, i):
            hs[pos] = hs[p]
            hi[pos] = hi[p]
            pos = p
        else:
            break
    hs[pos] = s
    hi[pos] = i


@cuda.jit(device=True, inline=True)
def offer(hs, hi, n, kmax, rs, ri, s, b):
    """Offer candidate ``(s, b)`` to a heap of at most ``kmax >= 1`` entries whose root (its worst
    entry) is cached in ``(rs, ri)``; returns the new ``(n, rs, ri)``. ``-inf`` and NaN are never
    kept: before the heap is full ``s > -inf`` is asked, after it every kept score is > -inf."""
    if n == kmax:
        if better(s, b, rs, ri):
            hs[0] = s
            hi[0] = b
            sift_down(hs, hi, n, 0)
            rs = hs[0]
            ri = hi[0]
    elif s > -math.inf:
        hs[n] = s
        hi[n] = b
        sift_up(hs, hi, n)
        n += 1
        rs = hs[0]
        ri = hi[0]
    return n, rs, ri


@cuda.jit(device=True, inline=True)
def heap_sort_best_first(hs, hi, n):
    """Heapsort a min-heap in place into ``hs/hi[0:n]`` best first (repeatedly move the root,
    the worst remaining entry, to the end)."""
    m = n
    while m > 1:
        m -= 1
        s = hs[0]
        i = hi[0]
        hs[0] = hs[m]
        hi[0] = hi[m]
        hs[m] = s
        hi[m] = i
        sift_down(hs, hi, m, 0)


@cuda.jit(device=True, inline=True)
def sort_ids_ascending(hi, n):
    """Insertion sort of the kept block ids ``hi[0:n]`` in place, smallest first."""
    for a in range(1, n):
        v = hi[a]
        j = a
        while j > 0 and hi[j - 1] > v:
            hi[j] = hi[j - 1]
            j -= 1
        hi[j] = v


@cuda.jit(device=True, inline=True)
def write_selection(out, t, r, hi, n, loc, topk):
    """Eq 7's row ``I[t, r]``: the ``n`` kept ids ``hi[0:n]`` (ascending, all ``< loc``), then
    the local block ``loc``, then ``-1`` up to ``K = topk`` slots."""
    for j in range(topk):
        if j < n:
            out[t, r, j] = hi[j]
        elif j == n:
            out[t, r, j] = loc
        else:
            out[t, r, j] = -1


@cuda.jit(device=True, inline=True)
def warp_best(hs, hi, p, n, neg):
    """One round of the warp merge: every lane shows its best remaining entry ``hs/hi[p]`` (none
    once ``p == n``), and a butterfly arg-max gives every lane the warp's best ``(score, id)``;
    ``(neg, NO_BLOCK)`` when every lane is empty. Every lane of the warp calls it."""
    cs = neg
    ci = int32(NO_BLOCK)
    if p < n:
        cs = hs[p]
        ci = hi[p]
    off = 16
    while off > 0:
        os_ = cuda.shfl_xor_sync(FULL_MASK, cs, off)
        oi = cuda.shfl_xor_sync(FULL_MASK, ci, off)
        if better(os_, oi, cs, ci):
            cs = os_
            ci = oi
        off >>= 1
    return cs, ci


@cuda.jit(device=True, inline=True)
def warp_top(hs, hi, n, kmax, neg, top_s, top_i, lane):
    """The first level of a merge over several warps: the warp's best ``kmax`` entries of its
    lanes' heaps (each ``hs/hi[0:n]`` sorted best first), best first into ``top_s/top_i``
    (lane 0 writes them); returns their number, in every lane. Their union over the warps holds
    the global best ``kmax`` (each is among its own warp's best)."""
    p = 0
    count = 0
    while count < kmax:
        cs, ci = warp_best(hs, hi, p, n, neg)
        if ci == NO_BLOCK:
            break
        if p < n and hi[p] == ci:
            p += 1
        if lane == 0:
            top_s[count] = cs
            top_i[count] = ci
        count += 1
    return count


@cuda.jit(device=True, inline=True)
def warp_merge(hs, hi, n, kmax, neg, out, t, r, loc, topk, lane):
    """Paper §4.1, the merge of a warp's 32 lane heaps into the row ``out[t, r]``: each lane's
    ``hs/hi[0:n]`` sorted best first (``heap_sort_best_first``), ``kmax`` rounds in which
    every lane shows its best remaining entry, a butterfly arg-max gives every lane the warp's
    best, and its owner pops it (lane ``j`` keeps the winners of rounds ``j`` (``w0``) and
    ``j + 32`` (``w1``)); the winners ranked by id with shuffles fill the row ascending, then
    the local block ``loc``, then -1 up to ``topk`` slots. ``neg`` is ``-inf`` in the scores'
    type. Every lane of the warp calls it."""
    p = 0
    count = 0
    w0 = int32(-1)
    w1 = int32(-1)
    while count < kmax:
        cs, ci = warp_best(hs, hi, p, n, neg)
        if ci == NO_BLOCK:  # every lane is empty (the same answer in every lane)
            break
        if p < n and hi[p] == ci:
            p += 1
        if lane == (count & 31):
            if count < 32:
                w0 = ci
            else:
                w1 = ci
        count += 1
    # ascending ids: a winner's slot is the number of smaller winners; the local block is
    # larger than every candidate, so it takes slot `count`, and -1 fills the rest
    r0 = 0
    r1 = 0
    for j in range(count):
        val = cuda.shfl_sync(FULL_MASK, w0 if j < 32 else w1, j & 31)
        if val < w0:
            r0 += 1
        if val < w1:
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
