"""Device functions over the packed batch's metadata, shared by the stages' kernels.

Offsets ``cu_q, cu_k`` (int32 ``[B+1]``), CSR rows (``row_offsets [B+1]``: sequence b's blocks
are rows ``row_offsets[b] ..``), work items ``[kv_head, row, q_begin, q_count, batch,
kv_block]`` and k2q CSR entries ``(q_indices, slots)``. Every function checks what it reads, so a
bad entry is skipped by its caller, never read or written out of bounds. Positions are
bottom-right aligned: query ``t`` of sequence ``b`` sits at key position ``Lk - Lq + (t -
cu_q[b])``.
"""

from __future__ import annotations

from numba import cuda, int32, int64, uint32, uint64

from .arrays import SIMULATOR

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@cuda.jit(device=True)
def last_le(offsets, x):
    """The segment of ``x`` in non-decreasing ``offsets [S+1]``: the largest ``b`` in
    ``[0, S-1]`` with ``offsets[b] <= x``, by binary search.

    For ``offsets[0] <= x < offsets[S]`` that is the one ``b`` with ``offsets[b] <= x <
    offsets[b+1]`` (an empty segment never holds ``x``: the later one with the same offset
    wins). Outside that range it is clamped: 0 below ``offsets[0]``, ``S-1`` from
    ``offsets[S]`` on, so a caller indexing ``offsets[b+1]`` stays in bounds (and checks the
    range itself where ``x`` may lie outside). Used on ``cu_q`` (query -> sequence) and on
    ``row_offsets`` (CSR row -> sequence).
    """
    lo = 0
    hi = offsets.shape[0] - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if offsets[mid] <= x:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True)
def block_row(j, cu_q, row_offsets, t):
    """CSR row of block ``j`` chosen by query ``t``, or -1 for padding and for blocks outside
    t's sequence."""
    if j < 0:
        return int64(-1)
    b = last_le(cu_q, t)  # query t's sequence
    first = int64(row_offsets[b])
    if j >= row_offsets[b + 1] - first:
        return int64(-1)  # not a block of this sequence: skipped, never an out-of-bounds row
    return first + j


@cuda.jit(device=True)
def repeats_a_slot(block_indices, t, h, s, x):
    """Whether query ``t`` names block id ``x`` in a slot before ``s`` too (head ``h``).

    A selection with a repeated id is invalid (``validate=True`` rejects it). With
    ``validate=False`` a repeat counts as -1: the CSR's counts and scatters list the query once
    per block, at the first slot naming it (so they agree on each row's length: no entry of a
    row is left unwritten, for its readers to take stale memory for another query's edge, and
    no row holds more queries than its sequence has), and the slot sums that follow the CSR
    (the backward's dq, the KL's slot states) skip the later slots, which no kernel wrote
    (through ``msa.cuda.csr.launch_slot_mask``).
    ``K - 1`` loads at most, of the row of ``I`` the caller has just read."""
    for s2 in range(s):
        if block_indices[uint64(t), uint64(h), uint64(s2)] == x:
            return True
    return False


@cuda.jit(device=True, inline=True)
def whole_rows_in_warps(topk, threads):
    """Whether a CTA of ``threads`` threads whose thread ``i`` holds slot ``i % topk`` of a
    row keeps each row's ``topk`` slots in consecutive lanes of one warp (``topk`` divides 32,
    ``threads`` a multiple of 32): then ``repeats_in_warp`` replaces ``repeats_a_slot``."""
    return 32 % topk == 0 and threads % 32 == 0


@cuda.jit(device=True)
def repeats_in_warp(x, s, topk, all_lanes):
    """``repeats_a_slot`` where the warp holds the row (``whole_rows_in_warps``): lane ``l``
    holds slot ``s = l % topk`` of its row, whose id is ``x``. Every lane of the row must call
    it; with ``all_lanes`` all 32 lanes of the warp (a caller whose warp meets other full-warp
    operations), else only the row's lanes take part.

    A row whose ids are strictly ascending up to its first -1 and -1 after it (every id >= 0
    follows a smaller id >= 0, as msa's selections are written) repeats none: one shuffle and
    one vote say so. Any other row takes one ``match.any`` among its lanes instead of ``s``
    loads of the row. Count v2 at 128K tokens on an H100 (``benchmarks.dev.csr_repeat_check``):
    0.050 ms with the vote, 0.097 with the match alone, 0.167 with the loads."""
    lane = cuda.laneid
    row = uint32(0xFFFFFFFF)
    if topk < 32:
        row = ((uint32(1) << uint32(topk)) - uint32(1)) << uint32(lane - s)
    mask = int32(-1) if all_lanes else int32(row)
    prev = cuda.shfl_sync(mask, x, lane - 1 if s > 0 else lane)
    out_of_order = x >= 0 and s > 0 and not (prev >= 0 and prev < x)
    if not cuda.any_sync(mask, out_of_order):  # (the vote covers other rows with all_lanes)
        return False
    # (``x`` keeps the selection's dtype: a 32-bit match for int32 ids, 64-bit for int64)
    same = uint32(cuda.match_any_sync(mask, x)) & row
    return (same & cuda.lanemask_lt()) != uint32(0)


@cuda.jit(device=True)
def edge_row(block_indices, cu_q, row_offsets, t, h, s):
    """CSR row of edge ``(t, h, s)`` (see ``block_row``)."""
    return block_row(block_indices[t, h, s], cu_q, row_offsets, t)

@cuda.jit(device=True, inline=True)
def query_position(cu_q, cu_k, t):
    """``(sequence, pos)`` of packed query ``t``: binary search of ``cu_q`` (empty sequences
    repeat an offset; the last ``s`` with ``cu_q[s] <= t`` is the one that holds ``t``)."""
    lo = 0
    hi = cu_q.shape[0] - 1  # invariant: cu_q[lo] <= t < cu_q[hi]
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if cu_q[mid] <= t:
            lo = mid
        else:
            hi = mid
    lq = cu_q[lo + 1] - cu_q[lo]
    lk = cu_k[lo + 1] - cu_k[lo]
    return lo, lk - lq + (t - cu_q[lo])

@cuda.jit(device=True)
def item_fields(work, item, q_indices, cu_k, num_kv_heads, block_size):
    """Read and range-check work item ``item``; ``q_count = 0`` when it is padding or invalid.

    Returns ``(h, q_begin, q_count, b, j, key0, nk)``: KV head, CSR range, sequence, block, the
    block's first packed key and its number of keys.
    """
    h = int(work[item, 0])
    q_begin = int(work[item, 2])
    q_count = int(work[item, 3])
    b = int(work[item, 4])
    j = int(work[item, 5])
    key0 = 0
    nk = 0
    ok = q_count > 0 and 0 <= h < num_kv_heads and 0 <= b < cu_k.shape[0] - 1 and j >= 0
    ok = ok and q_begin >= 0 and q_begin + q_count <= q_indices.shape[1]
    if ok:
        lk = int(cu_k[b + 1]) - int(cu_k[b])
        key0 = int(cu_k[b]) + j * block_size
        nk = min(block_size, lk - j * block_size)
        ok = nk > 0
    if not ok:
        q_count = 0
    return h, q_begin, q_count, b, j, key0, nk


@cuda.jit(device=True)
def paged_item_fields(work, item, q_indices, cu_k, total_rows, block_size):
    """``item_fields`` for K and V in pages (``msa.cuda.attention.sparse_attention(...,
    block_table=...)``): the caches ``[P, Hkv, Bk, D]`` viewed as ``[P*Hkv*Bk, 1, D]``
    (``total_rows`` rows), the block's page in the item's ``row`` column (written there by
    ``msa.cuda.attention._paged``), ``Hkv = q_indices.shape[0]``.

    Returns ``item_fields``' tuple with ``key0 = (page*Hkv + h)*Bk``, the first row of head h of
    that page in the view; ``q_count = 0`` also for a page outside ``[0, P)``.
    """
    hkv = q_indices.shape[0]
    h, q_begin, q_count, b, j, key0, nk = item_fields(work, item, q_indices, cu_k, hkv,
                                                      block_size)
    page = int(work[item, 1])
    key0 = (page * hkv + h) * block_size
    if page < 0 or key0 + block_size > total_rows:
        q_count = 0
    return h, q_begin, q_count, b, j, key0, nk


def item_reader(paged: bool):
    """The work-item reader of a K1 rung, ``read(work, item, q_indices, cu_k, k, block_size)
    -> (h, q_begin, q_count, b, j, key0, nk, kv_h)``: K and V of the item's block are rows
    ``key0 .. key0 + nk - 1`` of head ``kv_h`` of the kernel's ``k`` and ``v``. Packed K/V
    ``[Tk, Hkv, D]``: ``item_fields``, ``kv_h = h``. Paged (the ``[P*Hkv*Bk, 1, D]`` view):
    ``paged_item_fields``, ``kv_h = 0``. ``h`` stays the KV head of the item's queries."""
    if paged:
        @cuda.jit(device=True, inline=True)
        def read(work, item, q_indices, cu_k, k, block_size):
            h, q_begin, q_count, b, j, key0, nk = paged_item_fields(
                work, item, q_indices, cu_k, k.shape[0], block_size)
            return h, q_begin, q_count, b, j, key0, nk, 0
    else:
        @cuda.jit(device=True, inline=True)
        def read(work, item, q_indices, cu_k, k, block_size):
            h, q_begin, q_count, b, j, key0, nk = item_fields(
                work, item, q_indices, cu_k, k.shape[1], block_size)
            return h, q_begin, q_count, b, j, key0, nk, h
    return read


@cuda.jit(device=True)
def row_query(q_indices, slots, cu_q, cu_k, h, b, e, topk):
    """``(t, slot, pos)`` of CSR entry ``e`` of head ``h``; ``t = -1`` if it is not a valid query
    of sequence ``b`` or its slot is outside ``[0, topk)`` (such entries are skipped)."""
    t = int(q_indices[h, e])
    s = int(slots[h, e])
    q_lo = int(cu_q[b])
    q_hi = int(cu_q[b + 1])
    if t < q_lo or t >= q_hi or s < 0 or s >= topk:
        return -1, 0, -1
    # bottom-right alignment: query i of the sequence sits at key position Lk - Lq + i
    pos = (int(cu_k[b + 1]) - int(cu_k[b])) - (q_hi - q_lo) + (t - q_lo)
    return t, s, pos


if SIMULATOR:  # NumPy 2 refuses to cast -1 to an unsigned type; the simulator needs no type
    @cuda.jit(device=True)
    def minus_one(a):
        return -1
else:
    @cuda.jit(device=True, inline=True)
    def minus_one(a):
        """-1 in ``a``'s element type (all ones if unsigned: an invalid entry all the same)."""
        return a.dtype.type(-1)


@cuda.jit(device=True)
def load_entry(q_indices, slots, h, q_begin, q_count, tile, positions, group, tid, rows):
    """Raw ``(t, slot)`` of the CSR entry behind row ``tid`` of ``tile`` (past the chunk: -1,
    all ones for unsigned index arrays; ``check_entry`` rejects both).

    Only loads: the checks that need the values are in ``check_entry``, so the loads can be
    issued early and consumed a tile later. The values stay in the arrays' integer type: a
    conversion to int64 here (``int(...)``) is an instruction that reads the loaded register,
    so the warp would wait for the load right away (on the H200 that wait was ~8% of K1's
    stall samples) instead of a tile later.
    """
    p = tid // group
    t = minus_one(q_indices)
    s = minus_one(slots)
    if tid < rows and tile * positions + p < q_count:
        # unsigned indices (h and e are in range here): no negative-index wrap-around code
        e = uint64(q_begin + tile * positions + p)
        t = q_indices[uint64(h), e]
        s = slots[uint64(h), e]
    return t, s


@cuda.jit(device=True)
def check_entry(t, s, q_lo, q_hi, pos0, topk):
    """``(t, slot, pos)`` of a raw entry; ``t = -1`` if it is not a query of the item's sequence
    ``[q_lo, q_hi)`` or its slot is outside ``[0, topk)`` (such entries are skipped)."""
    t = int64(t)  # from the index arrays' type (unsigned 64-bit: huge values become negative)
    s = int64(s)
    if t < q_lo or t >= q_hi or s < 0 or s >= topk:
        return -1, 0, -1
    return t, s, pos0 + (t - q_lo)
