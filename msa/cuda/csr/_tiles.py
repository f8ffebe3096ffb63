"""Device functions of the tiled CSR kernels (count v2, scatter v2 and v3): a CTA's query tile.

A CTA ``(tile, h)`` owns the edges of queries ``[tile * TQ, (tile + 1) * TQ)`` of head ``h``,
walked in (query, slot) order: thread ``i`` starts at edge ``i`` of the tile and steps by the
CTA's thread count (``next_edge``), so consecutive threads read consecutive slots of ``I``.
"""

from __future__ import annotations

from numba import cuda, int32, int64, uint64

from .._core.packed import block_row, last_le


@cuda.jit(device=True)
def tile_sequence(cu_q, row_offsets, t_begin, nq):
    """``(first, nblocks)`` of the one sequence holding queries ``[t_begin, t_begin + nq)``
    (its CSR rows start at ``first``); ``nblocks = -1`` if they span several (or none)."""
    first = int64(0)
    nblocks = int64(-1)
    if nq > 0:
        b = last_le(cu_q, t_begin)
        if last_le(cu_q, t_begin + nq - 1) == b:
            first = int64(row_offsets[b])
            nblocks = int64(row_offsets[b + 1]) - first
    return first, nblocks


@cuda.jit(device=True)
def tile_block(block_indices, t_begin, dq, s, nq, h):
    """``block_indices[t_begin + dq, h, s]``, -1 from ``dq = nq`` on. Unsigned indices: no
    negative-index wrap-around code."""
    x = int32(-1)
    if dq < nq:
        x = block_indices[uint64(t_begin + dq), uint64(h), uint64(s)]
    return x


@cuda.jit(device=True)
def tile_row(x, t, first, nblocks, cu_q, row_offsets):
    """CSR row of block id x chosen by query t (-1: none), as ``block_row``, without the
    sequence lookup when ``nblocks >= 0`` (``tile_sequence``)."""
    r = int64(-1)
    if x >= 0:
        if nblocks >= 0:
            if x < nblocks:
                r = first + x
        else:
            r = block_row(x, cu_q, row_offsets, t)
    return r


@cuda.jit(device=True)
def next_edge(dq, s, step_q, step_s, topk):
    """``(dq, s)`` advanced by ``step_q * topk + step_s`` edges (``step_s < topk``): a walk over
    a tile's edges in (query, slot) order without a division per edge."""
    dq += step_q
    s += step_s
    if s >= topk:
        s -= topk
        dq += 1
    return dq, s
