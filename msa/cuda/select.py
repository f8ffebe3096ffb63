"""Paper §4.1 and eq 7 on the GPU: the exp-free warp-heap top-k with a forced local block.

``select_blocks`` is ``msa.reference.select.select_blocks`` on a GPU, equal to it bit for bit
(integers): per (query ``t``, group ``r``) row, the local block ``L = floor(pos_t / Bk)``, the
``K - 1`` best candidates ``b < L`` by ``(score, -b)`` (a higher score first, ties to the smaller
block id), ascending, ``-1`` padded. A candidate's score is read as given and neither ``-inf`` nor
NaN; blocks ``b >= L`` are never read. ``select_blocks_fused`` runs the index branch end to end,
``block_scores`` then ``select_blocks``, without ever holding the whole ``M [Hkv, Tq, NB]``.

Versions (every one tested against the reference; the default is the fastest):

=====  =========================  ==============================================================
v1     ``_select_kernel_v1``      one thread per row, a sorted array kept by insertion
warp   ``_select_kernel_warp``    paper §4.1: one warp per row; each lane scans a strided share
                                  of the row into a (K-1)-entry min-heap in a local array with
                                  its root cached in registers, sorts it best first, then K-1
                                  shuffle rounds pick the warp's best and its owner pops; the
                                  winners are ranked by id with K-1 more shuffles
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
=======  ====================================================================================
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64, int32

from .._checks import check_array, check_cu_seqlens, check_positive_int, cu_to_host, dtype_of
from ..reference.blocks import max_blocks
from ._arrays import SIMULATOR, ArrayContext
from . import index as _index
from .index import _POISON, _query_position

if SIMULATOR:
    from ._simwarp import install as _install_simwarp

    _install_simwarp()

VERSIONS = ("v1", "warp")
DEFAULT_VERSION = "warp"
FUSED_VERSIONS = ("chunked", "heap")
MAX_TOPK = 64  # heap capacity of the kernels: K - 1 <= 63 entries per lane
FULL_MASK = 0xFFFFFFFF
_NO_BLOCK = 0x7FFFFFFF  # id of "no candidate": loses every tie against a real block
_WARPS_PER_CTA = 4
_THREADS_V1 = 128
# Default memory for one chunk's block scores in select_blocks_fused (bytes).
FUSED_MEMORY_BUDGET = 4 << 30


# -- (score, -block id) order and the min-heap on it --------------------------------------------

@cuda.jit(device=True, inline=True)
def _better(s1, i1, s2, i2):
    """``(s1, -i1) > (s2, -i2)``: a higher score first, equal scores to the smaller block id."""
    return s1 > s2 or (s1 == s2 and i1 < i2)


@cuda.jit(device=True, inline=True)
def _sift_down(hs, hi, n, pos):
    """Restore the min-heap ``hs/hi[0:n]`` below ``pos`` (each parent worse than its children)."""
    s = hs[pos]
    i = hi[pos]
    while True:
        c = 2 * pos + 1
        if c >= n:
            break
        # descend towards the worse child, so that it can rise above the other
        if c + 1 < n and _better(hs[c], hi[c], hs[c + 1], hi[c + 1]):
            c += 1
        if _better(s, i, hs[c], hi[c]):
            hs[pos] = hs[c]
            hi[pos] = hi[c]
            pos = c
        else:
            break
    hs[pos] = s
    hi[pos] = i


@cuda.jit(device=True, inline=True)
def _sift_up(hs, hi, pos):
    """Restore the min-heap after an entry was written at ``pos`` (the end of the heap)."""
    s = hs[pos]
    i = hi[pos]
    while pos > 0:
        p = (pos - 1) >> 1
        if _better(hs[p], hi[p], s, i):
            hs[pos] = hs[p]
            hi[pos] = hi[p]
            pos = p
        else:
            break
    hs[pos] = s
    hi[pos] = i


@cuda.jit(device=True, inline=True)
def _offer(hs, hi, n, kmax, rs, ri, s, b):
    """Offer candidate ``(s, b)`` to a heap of at most ``kmax >= 1`` entries whose root (its worst
    entry) is cached in ``(rs, ri)``; returns the new ``(n, rs, ri)``. ``-inf`` and NaN are never
    kept: before the heap is full ``s > -inf`` is asked, after it every kept score is > -inf."""
    if n == kmax:
        if _better(s, b, rs, ri):
            hs[0] = s
            hi[0] = b
            _sift_down(hs, hi, n, 0)
            rs = hs[0]
            ri = hi[0]
    elif s > -math.inf:
        hs[n] = s
        hi[n] = b
        _sift_up(hs, hi, n)
        n += 1
        rs = hs[0]
        ri = hi[0]
    return n, rs, ri


@cuda.jit(device=True, inline=True)
def _heap_sort_best_first(hs, hi, n):
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
        _sift_down(hs, hi, m, 0)


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
        kernel = _select_kernel_warp(cap, wide)
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
        ``b >= L`` are never read.

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
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums (``Lq <= Lk``; bottom-right alignment).
        topk: ``K`` in ``[1, 64]``. block_size: ``Bk`` >= 1.
        scale: multiplies the dot products; default ``1 / sqrt(Didx)``.
        version: one of ``FUSED_VERSIONS``; default ``"heap"`` where the tensor-core kernel
            applies (bf16/fp16, ``Didx % 16 == 0``, ``Bk % 8 == 0``), else ``"chunked"``.
            ``"heap"``: one kernel streams the KV blocks of a tile of queries through tensor
            cores and offers each block maximum to the row's heap; M is never written.
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
    try:
        p = _index._prepare(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, scale, "max",
                            version="tc" if version == "heap" else None)
    except ValueError as exc:
        if version == "heap" and "version 'tc'" in str(exc):
            raise ValueError(str(exc).replace("version 'tc'", "version 'heap'")) from None
        raise
    if version is None:
        version = "heap" if p.version == "tc" else "chunked"
    if memory_budget is None:
        memory_budget = FUSED_MEMORY_BUDGET
    memory_budget = check_positive_int("memory_budget", memory_budget)
    ctx = p.ctx
    out = ctx.empty((p.tq, p.hkv, topk), np.int32,
                    fill=np.iinfo(np.int32).min if _POISON else None)
    if p.tq == 0:
        return ctx.output(out)
    out_arg = ctx.arg(out)
    if version == "heap":
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
