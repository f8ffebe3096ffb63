"""Decode rung 1: CUDA cores, one thread per output, any dtype (float16, bfloat16, float32, float64).

Adds nothing over the reference but the GPU: the teaching rung and the tested fallback.

* ``append_kernel``: one thread per element of a new token's K, V and K_idx rows, written into
  ``block_table[b, pos // Bk]`` at slot ``pos % Bk`` (also rung 2's append: a step appends a few
  KB, so its cost is the launch).
* ``gather_kernel`` / ``gather_index_kernel``: pages back to packed sequences, one thread per
  element.
* ``scores_kernel``: one thread per ``M[r, t, j]``, the block max of query ``t``'s index scores
  over the ``Bk`` keys of its candidate block ``j < floor(pos_t / Bk)`` (every key of such a
  block is visible; later blocks are ``-inf``), dot products from global memory.
* ``topk_kernel``: one thread per (query, group) row of ``M``: ``K - 1`` passes of an arg-max
  (a higher score first, ties to the smaller block id, ``-inf`` and NaN never), each consuming
  its winner, then the winners sorted ascending in the output row, the local block, ``-1``.
* ``attention_kernel``: one thread per (query, head): the online softmax over the visible keys
  of its selected pages, accumulating O in a float32 (float64) workspace row in global memory.

Verdict: correct everywhere and slow (no reuse of a loaded key between threads); the simulator's
cheapest path for float32 and float64, never the default for 16-bit inputs on a GPU.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, float64

from .._core.mma import bf16_to_f32, f16_bits_to_f32, f32_to_bf16, f32_to_f16_bits
from .._core.packed import last_le
from .._core.diskcache import kernel_jit

THREADS = 128


@functools.lru_cache(maxsize=None)
def element_ops(kind: str):
    """``(F, load, store)`` for arrays of ``kind``: the compute type, an element read as ``F``,
    and ``F`` to what an output array of that kind holds (16-bit kinds as uint16 bits)."""
    if kind == "float64":
        F = float64

        @cuda.jit(device=True, inline=True)
        def load(x):
            return x

        @cuda.jit(device=True, inline=True)
        def store(x):
            return float64(x)
    elif kind == "float32":
        F = float32

        @cuda.jit(device=True, inline=True)
        def load(x):
            return x

        @cuda.jit(device=True, inline=True)
        def store(x):
            return float32(x)
    elif kind == "float16":
        F = float32

        @cuda.jit(device=True, inline=True)
        def load(x):
            return f16_bits_to_f32(x)

        @cuda.jit(device=True, inline=True)
        def store(x):
            return f32_to_f16_bits(float32(x))
    else:
        F = float32

        @cuda.jit(device=True, inline=True)
        def load(x):
            return bf16_to_f32(x)

        @cuda.jit(device=True, inline=True)
        def store(x):
            return f32_to_bf16(float32(x))
    return F, load, store


@cuda.jit(device=True, inline=True)
def token_slot(t, cu_new, cache_seqlens, block_table, block_size, num_pages):
    """``(page, slot)`` of new token ``t`` (``cu_new`` [B+1]: each request's new tokens), or
    ``(-1, 0)`` where the position or page is out of range (skipped, never written)."""
    b = last_le(cu_new, t)
    n_new = cu_new[b + 1] - cu_new[b]
    pos = cache_seqlens[b] - n_new + (t - cu_new[b])
    j = pos // block_size
    if pos < 0 or j >= block_table.shape[1]:
        return -1, 0
    page = block_table[b, j]
    if page < 0 or page >= num_pages:
        return -1, 0
    return page, pos - j * block_size


@kernel_jit
def append_kernel(k, v, k_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, cu_new,
                  nk, nv, ni, bk, pages):
    """New tokens into their pages: ``nk``, ``nv``, ``ni`` elements of each token's K, V and K_idx
    rows (0 for an array not given, whose arguments are then stand-ins); ``bk`` tokens a page,
    ``pages`` pages."""
    t_total = cu_new[cu_new.shape[0] - 1]
    row = nk + nv + ni
    x = cuda.grid(1)
    stride = cuda.gridsize(1)
    while x < t_total * row:
        t = x // row
        e = x - t * row
        page, slot = token_slot(t, cu_new, cache_seqlens, block_table, bk, pages)
        if page >= 0:
            if e < nk:
                d = k.shape[2]
                k_cache[page, e // d, slot, e % d] = k[t, e // d, e % d]
            elif e < nk + nv:
                e -= nk
                d = v.shape[2]
                v_cache[page, e // d, slot, e % d] = v[t, e // d, e % d]
            else:
                e -= nk + nv
                k_idx_cache[page, slot, e] = k_idx[t, e]
        x += stride


@kernel_jit
def gather_kernel(cache, out, block_table, cu_k):
    """``out [Tk, Hkv, D]`` from pages ``cache [P, Hkv, Bk, D]``."""
    tk, hkv, d = out.shape
    bk = cache.shape[2]
    x = cuda.grid(1)
    stride = cuda.gridsize(1)
    while x < tk * hkv * d:
        t = x // (hkv * d)
        h = (x // d) % hkv
        e = x % d
        b = last_le(cu_k, t)
        pos = t - cu_k[b]
        out[t, h, e] = cache[block_table[b, pos // bk], h, pos % bk, e]
        x += stride


@kernel_jit
def gather_index_kernel(cache, out, block_table, cu_k):
    """``out [Tk, Didx]`` from pages ``cache [P, Bk, Didx]``."""
    tk, d = out.shape
    bk = cache.shape[1]
    x = cuda.grid(1)
    stride = cuda.gridsize(1)
    while x < tk * d:
        t = x // d
        e = x % d
        b = last_le(cu_k, t)
        pos = t - cu_k[b]
        out[t, e] = cache[block_table[b, pos // bk], pos % bk, e]
        x += stride


@cuda.jit(device=True, inline=True)
def query_of(t, lq, cache_seqlens, capacity):
    """``(request, position)`` of decode query ``t`` (``lq`` a request; the length clamped to the
    block table's ``capacity`` so that no read leaves it)."""
    b = t // lq
    n = min(cache_seqlens[b], capacity)
    return b, n - lq + (t - b * lq)


@functools.lru_cache(maxsize=None)
def scores_kernel(kind: str, block_size: int):
    """``M [Hkv, B*Lq, max_pages]`` block maxima of the candidate blocks (``-inf`` elsewhere)."""
    F, load, _ = element_ops(kind)
    BK = block_size

    @kernel_jit
    def kernel(q_idx, k_idx_cache, block_table, cache_seqlens, lq, scale, M):
        x = cuda.grid(1)
        hkv, rows, nbm = M.shape
        if x >= hkv * rows * nbm:
            return
        r = x // (rows * nbm)
        t = (x // nbm) % rows
        j = x % nbm
        b, pos = query_of(t, lq, cache_seqlens, nbm * BK)
        best = F(-math.inf)
        if pos >= 0 and j < pos // BK:
            page = block_table[b, j]
            if 0 <= page < k_idx_cache.shape[0]:
                for c in range(BK):
                    s = F(0.0)
                    for d in range(q_idx.shape[2]):
                        s += load(q_idx[t, r, d]) * load(k_idx_cache[page, c, d])
                    if s > best:  # fmax from -inf: a NaN score is skipped, as in the reference
                        best = s
                best = best * F(scale)
        M[r, t, j] = best

    return kernel


@functools.lru_cache(maxsize=None)
def topk_kernel(block_size: int):
    """``I [B*Lq, Hkv, K]`` from ``M`` (consumed): winners ascending, the local block, -1."""
    BK = block_size

    @kernel_jit
    def kernel(M, cache_seqlens, lq, out):
        x = cuda.grid(1)
        hkv, rows, nbm = M.shape
        topk = out.shape[2]
        if x >= rows * hkv:
            return
        t = x // hkv
        r = x % hkv
        _, pos = query_of(t, lq, cache_seqlens, nbm * BK)
        loc = pos // BK if pos >= 0 else -1
        n = 0
        for _slot in range(topk - 1):
            best = -1
            bs = M[r, t, 0]
            for j in range(max(loc, 0)):  # candidates j < loc; a strict > keeps the smaller id
                s = M[r, t, j]
                if s > -math.inf and (best < 0 or s > bs):
                    best = j
                    bs = s
            if best < 0:
                break
            out[t, r, n] = best
            M[r, t, best] = -math.inf
            n += 1
        for a in range(1, n):  # ascending ids (insertion sort in the output row)
            val = out[t, r, a]
            c = a
            while c > 0 and out[t, r, c - 1] > val:
                out[t, r, c] = out[t, r, c - 1]
                c -= 1
            out[t, r, c] = val
        for j in range(n, topk):
            out[t, r, j] = loc if j == n else -1

    return kernel


@functools.lru_cache(maxsize=None)
def attention_kernel(kind: str, block_size: int):
    """``(o, lse)`` of every (query, head) on its selected pages; ``acc`` a workspace like o."""
    F, load, store = element_ops(kind)
    BK = block_size

    @kernel_jit
    def kernel(q, k_cache, v_cache, block_indices, block_table, cache_seqlens, lq, group, scale,
               acc, o, lse):
        x = cuda.grid(1)
        rows, hq, d = q.shape
        if x >= rows * hq:
            return
        t = x // hq
        h = x % hq
        r = h // group
        capacity = block_table.shape[1] * BK
        b, pos = query_of(t, lq, cache_seqlens, capacity)
        nb = (pos + BK) // BK  # blocks that hold a key this query may see
        m = F(-math.inf)
        l = F(0.0)
        for e in range(d):
            acc[t, h, e] = F(0.0)
        for s_ in range(block_indices.shape[2]):
            j = block_indices[t, r, s_]
            if j < 0 or j >= nb:
                continue
            page = block_table[b, j]
            if page < 0 or page >= k_cache.shape[0]:
                continue
            for c in range(min(BK, pos - j * BK + 1)):  # keys up to the query's own position
                s = F(0.0)
                for e in range(d):
                    s += load(q[t, h, e]) * load(k_cache[page, r, c, e])
                s *= F(scale)
                # m_new = max(m, s); l = l e^(m - m_new) + e^(s - m_new); O likewise
                m_new = s if s > m else m
                alpha = F(math.exp(m - m_new))
                p = F(math.exp(s - m_new))
                l = l * alpha + p
                for e in range(d):
                    acc[t, h, e] = acc[t, h, e] * alpha + p * load(v_cache[page, r, c, e])
                m = m_new
        inv = F(1.0) / l if l > F(0.0) else F(0.0)
        for e in range(d):
            o[t, h, e] = store(acc[t, h, e] * inv)
        lse[t, h] = m + F(math.log(l)) if l > F(0.0) else float32(-math.inf)

    return kernel
