"""CSR rung 3: scatter by two stable multi-splits, for large outputs.

What it adds over v2: v2 writes every edge straight to its row, 4-byte stores spread over the
whole output, which at 1M tokens (512 MiB of ``q_indices`` + ``slots``) no longer merge in the
50 MB L2. v3 splits the same tile twice, both times with a stable multi-split (``multisplit``:
``match_any`` ranks a record among its warp's records with the same key, a scan over the warps
per key gives the warp's start, a running cursor per key carries over between chunks; no
atomics):

1. pass 1 (``split_groups_kernel``), CTA (tile, h): the tile's edges, in (query, slot) order,
   go into the tile's own range of an int64 scratch array, one record an edge (``query id <<
   32 | slot << 7 | row % 128``), grouped by row group ``row // 128`` (at most 128 groups:
   ``rows <= 16384``, else v2 runs);
2. pass 2 (``split_rows_kernel``), CTA (tile, h): group by group, each record goes whole to its
   row in a second int64 array, at ``row_ptr[h, r] + cursors[tile, h, r]`` plus its rank among
   the tile's earlier records of r;
3. ``unpack_kernel`` splits the records into ``q_indices`` and ``slots`` and writes the -1 tail.

Pass 1 writes inside the tile's range (512 KiB at 1M); pass 2 writes a tile's whole run of each
row (~8 edges at 1M) while it works on that row's group, so the run's sectors fill while they
are in L2, except a sector shared with the next tile's run. The two scratch arrays triple the
memory of the build (1.5 GiB at 1M, half of what the PyTorch build takes).

What bounds both passes is their instruction stream and their scattered stores, more than their
loads: pass 2 at 1M took 2.35 ms, 0.92 without its stores and 0.52 with synthetic records
instead of loaded ones (the loads of the next chunk wait behind the scattered stores of this
one). So every scattered store is one 8-byte record, the kernels walk a tile's edges without a
division per edge (``_tiles.next_edge``), look the tile's sequence up once, index with unsigned
values and load the next chunk while the current one is ranked.

Verdict (H200): the 1M build 3.3 ms against 7.7 ms with scatter v2 and 12.2 ms for the PyTorch
build; at 128K (64 MiB of output) v2 is as fast (0.61 vs 0.63 ms), so ``build_csr`` runs v3
from 192 MiB of output on, where its scratch fits in free memory.
"""

from __future__ import annotations

from numba import cuda, int32, int64, uint32, uint64

from .._core.packed import repeats_a_slot, repeats_in_warp, whole_rows_in_warps
from .._core.warp import FULL_MASK, warp_sum
from ._tiles import next_edge, tile_block, tile_row, tile_sequence
from .._core.diskcache import kernel_jit

GROUP_ROWS = 128  # rows per group (the packed slot << 7 | row % 128 relies on it)
GROUP_STARTS = GROUP_ROWS + 1  # (a shared array's shape must be a plain constant)
MAX_SPLIT_ROWS = GROUP_ROWS * GROUP_ROWS  # at most 128 groups per head


@cuda.jit(device=True)
def tile_groups(row_ptr, cursors, tile, h, gstart, scratch):
    """``gstart[g]``: where row group g's edges of query tile ``tile`` start in the tile's own
    range of the split arrays (``gstart[ngroups]``: where the range ends).

    The tile's range begins after the edges of head h in earlier tiles (``sum_r cursors[tile,
    h, r]``, the scanned tile counts); inside it the groups follow in order, each as large as
    the tile's edges of its ``GROUP_ROWS`` rows. One warp per group sums them; integer sums of
    fixed terms, so the result does not depend on timing. Ends with a barrier."""
    tid = cuda.threadIdx.x
    lane = cuda.laneid
    nw = cuda.blockDim.x // 32
    rows = row_ptr.shape[1] - 1
    ntiles = cursors.shape[0]
    ngroups = (rows + GROUP_ROWS - 1) // GROUP_ROWS
    for g in range(tid // 32, ngroups, nw):
        before = int64(0)  # edges of the group's rows in earlier tiles
        here = int64(0)  # edges of the group's rows in this tile
        for i in range(lane, GROUP_ROWS, 32):
            r = g * GROUP_ROWS + i
            if r < rows:
                c = int64(cursors[tile, h, r])
                if tile + 1 < ntiles:
                    nxt = int64(cursors[tile + 1, h, r])
                else:
                    nxt = int64(row_ptr[h, r + 1]) - int64(row_ptr[h, r])
                before += c
                here += nxt - c
        before = warp_sum(before)
        here = warp_sum(here)
        if lane == 0:
            scratch[g] = before
            gstart[g] = here
    cuda.syncthreads()
    if tid == 0:
        run = int64(0)
        for g in range(ngroups):
            run += scratch[g]
        for g in range(ngroups):
            n = gstart[g]
            gstart[g] = run
            run += n
        gstart[ngroups] = run
    cuda.syncthreads()


@cuda.jit(device=True)
def multisplit(key, stamp, cur, nkeys, wcnt, wpos):
    """Stable multi-split of one chunk: thread i holds record i of the chunk and its ``key`` in
    ``[0, nkeys)`` (-1: none). Returns the record's position, ``cur[key]`` plus the number of
    earlier records of the chunk with the same key, and advances every ``cur[k]`` past the
    chunk's records of k. Ranks come from ``match_any`` inside a warp and a scan over the warps
    per key (no atomics). ``wcnt[w, k]`` holds ``stamp << 6 | count`` of warp w's records of
    key k; a stale stamp means 0, so nothing is cleared between chunks. Two barriers."""
    # (unsigned 32-bit indices: no negative-index wrap-around or 64-bit index arithmetic)
    tid = uint32(cuda.threadIdx.x)
    w = tid // uint32(32)
    nw = uint32(cuda.blockDim.x) // uint32(32)
    peers = cuda.match_any_sync(FULL_MASK, key)
    rank = cuda.popc(peers & cuda.lanemask_lt())
    if key >= 0 and rank == 0:
        wcnt[w, uint32(key)] = (int32(stamp) << 6) | int32(cuda.popc(peers))
    cuda.syncthreads()
    k = tid
    while k < uint32(nkeys):
        run = cur[k]
        v = uint32(0)
        while v < nw:
            c = wcnt[v, k]
            wpos[v, k] = run
            if (c >> 6) == int32(stamp):
                run += c & 63
            v += uint32(1)
        cur[k] = run
        k += uint32(cuda.blockDim.x)
    cuda.syncthreads()
    pos = int64(-1)
    if key >= 0:
        pos = int64(wpos[w, uint32(key)]) + rank
    return pos


@cuda.jit(device=True)
def clear_stamps(wcnt):
    """Stamps no chunk will have (-1); ends with a barrier."""
    for i in range(cuda.threadIdx.x, wcnt.shape[0] * wcnt.shape[1], cuda.blockDim.x):
        wcnt[i // wcnt.shape[1], i % wcnt.shape[1]] = -1
    cuda.syncthreads()


@kernel_jit
def split_groups_kernel(block_indices, cu_q, row_offsets, row_ptr, cursors, tile_queries,
                        records):
    """Scatter v3, pass 1: CTA (tile, h) writes its tile's edges into the tile's range of
    ``records`` (int64: query id << 32 | slot << 7 | row % 128), grouped by row group
    ``row // 128``, in (query, slot) order inside a group. (One 8-byte store an edge, not two
    4-byte ones: these stores are scattered, and they are what the loads queue behind.)"""
    wcnt = cuda.shared.array((32, GROUP_ROWS), int32)
    wpos = cuda.shared.array((32, GROUP_ROWS), int32)
    gstart = cuda.shared.array(GROUP_STARTS, int64)
    scratch = cuda.shared.array(GROUP_ROWS, int64)
    cur = cuda.shared.array(GROUP_ROWS, int32)
    tile = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    tq, hkv, topk = block_indices.shape
    rows = row_ptr.shape[1] - 1
    width = records.shape[1]
    ngroups = (rows + GROUP_ROWS - 1) // GROUP_ROWS
    clear_stamps(wcnt)
    tile_groups(row_ptr, cursors, tile, h, gstart, scratch)
    for g in range(tid, ngroups, nt):
        cur[g] = gstart[g]
    cuda.syncthreads()
    t_begin = int64(tile) * tile_queries
    nq = int32(min(int64(tq), t_begin + tile_queries) - t_begin)
    # Thread tid's edge of each chunk, (query t_begin + dq, slot s) = edge base + tid of the
    # tile, kept by stepping (one division here, none per edge); the next chunk's block id is
    # loaded while this one is ranked.
    dq = int32(tid // topk)
    s = int32(tid % topk)
    step_q = int32(nt // topk)
    step_s = int32(nt % topk)
    first, nblocks = tile_sequence(cu_q, row_offsets, t_begin, nq)
    in_warp = whole_rows_in_warps(topk, nt)
    stamp = 0
    x = tile_block(block_indices, t_begin, dq, s, nq, h)
    for _ in range(0, int64(nq) * topk, nt):
        t = t_begin + dq
        s_now = s
        dq, s = next_edge(dq, s, step_q, step_s, topk)
        x_next = tile_block(block_indices, t_begin, dq, s, nq, h)
        r = tile_row(x, t, first, nblocks, cu_q, row_offsets)
        # a repeated id: the query's first slot naming it is listed (count v2's check)
        if in_warp:
            if repeats_in_warp(x, s_now, topk, True):
                r = int64(-1)
        elif r >= 0 and repeats_a_slot(block_indices, t, h, s_now, x):
            r = int64(-1)
        key = int32(r >> 7) if r >= 0 and r < rows else int32(-1)
        pos = multisplit(key, stamp, cur, ngroups, wcnt, wpos)
        stamp += 1
        if pos >= 0 and pos < width:
            records[h, uint64(pos)] = (int64(t) << 32) | int64(
                (s_now << 7) | int32(r & (GROUP_ROWS - 1)))
        x = x_next


@cuda.jit(device=True)
def split_record(records, h, e, hi):
    """Record e of a row group, ``query id << 32 | slot << 7 | row % 128``, or -1 from ``hi``
    on. Nothing is computed from the loaded value here, so a load issued a chunk ahead stays
    in flight until the next chunk uses it. Unsigned indices: no negative-index wrap-around
    code."""
    rec = int64(-1)
    if e < hi:
        rec = records[h, uint64(e)]
    return rec


@cuda.jit(device=True)
def record_key(rec, nr):
    """The multi-split key of a record of a group of ``nr`` rows, ``row % 128`` (-1: none)."""
    key = int32(-1)
    if rec >= 0 and int32(rec & (GROUP_ROWS - 1)) < nr:
        key = int32(rec & (GROUP_ROWS - 1))  # int32: a 32-bit match.any
    return key


@kernel_jit
def split_rows_kernel(row_ptr, cursors, records, packed):
    """Scatter v3, pass 2: CTA (tile, h) reads its tile's range of ``records`` group by group
    and writes every record whole to its row in ``packed`` (int64 [Hkv, Tq*K]):
    ``row_ptr[h, r] + cursors[tile, h, r]`` plus its rank among the tile's earlier edges of r.
    One 8-byte store an edge; ``unpack_kernel`` then splits the records into the output
    and writes the -1 tail."""
    wcnt = cuda.shared.array((32, GROUP_ROWS), int32)
    wpos = cuda.shared.array((32, GROUP_ROWS), int32)
    gstart = cuda.shared.array(GROUP_STARTS, int64)
    scratch = cuda.shared.array(GROUP_ROWS, int64)
    cur = cuda.shared.array(GROUP_ROWS, int32)
    tile = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    rows = row_ptr.shape[1] - 1
    width = packed.shape[1]
    ngroups = (rows + GROUP_ROWS - 1) // GROUP_ROWS
    clear_stamps(wcnt)
    tile_groups(row_ptr, cursors, tile, h, gstart, scratch)
    stamp = 0
    for g in range(ngroups):
        # (gstart is the same for every thread: the loops below are uniform across the CTA)
        lo = max(int64(0), min(gstart[g], int64(width)))
        hi = max(lo, min(gstart[g + 1], int64(width)))
        if hi == lo:
            continue
        r0 = g * GROUP_ROWS
        nr = min(GROUP_ROWS, rows - r0)
        # The first chunk's records are loaded with the row cursors, before the barrier, and
        # each next chunk's while this one is ranked: one memory round trip at a time, not two.
        rec = split_record(records, h, lo + tid, hi)
        for i in range(tid, nr, nt):
            cur[i] = int64(row_ptr[h, r0 + i]) + int64(cursors[tile, h, r0 + i])
        cuda.syncthreads()
        for base in range(lo, hi, nt):
            key = record_key(rec, nr)
            rec_next = split_record(records, h, base + nt + tid, hi)
            pos = multisplit(key, stamp, cur, nr, wcnt, wpos)
            stamp += 1
            if pos >= 0 and pos < width:
                packed[h, uint64(pos)] = rec
            rec = rec_next


@kernel_jit
def unpack_kernel(row_ptr, packed, q_indices, slots):
    """Scatter v3, last step: ``q_indices[h, e]``, ``slots[h, e]`` = query id and slot of
    ``packed[h, e]`` for ``e < nnz_h``, -1 from there on. Grid (blocks, Hkv), coalesced."""
    width = q_indices.shape[1]
    rows = row_ptr.shape[1] - 1
    h = cuda.blockIdx.y
    nnz = int64(row_ptr[h, rows])
    i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    stride = int64(cuda.gridDim.x) * cuda.blockDim.x
    while i < width:
        q = int32(-1)
        sl = int32(-1)
        if i < nnz:
            rec = packed[h, uint64(i)]
            q = int32(rec >> 32)
            sl = int32(rec & 0xFFFFFFFF) >> 7
        q_indices[h, uint64(i)] = q
        slots[h, uint64(i)] = sl
        i += stride
