"""Paper §4.2 on the GPU: the reverse sparse index, q2k ``block_indices`` -> k2q CSR.

Same functions and arguments as ``msa.reference.csr`` (read its docstring for the layout), plus
keywords: ``validate`` (below) and, where there are two kernels, ``version``. Every step runs on
the device; the launchers read only ``cu_seqlens`` (small metadata) on the host, plus whatever
``validate=True`` asks for.

Versions (the default is the last of each line; every one is tested against the reference):

=============  ===  ==========================================================================
step           v    idea
=============  ===  ==========================================================================
histogram /    v1   one thread per (t, h) adds its K edges: ``atomicAdd(counts[h, row], 1)``
tile counts         into a zeroed array (``csr_histogram``; the fallback for > 22528 rows)
               v2   CTA (tile, h) counts in shared memory, two 16-bit counts per word, and
                    writes the tile's whole row of counts: no clearing launch, no global atomics
prefix sum     v1   one thread per head walks its rows (simple, serial)
               v2   reduce-then-scan: per-block sums, one CTA per head scans them, add back
                    (``exclusive_prefix_sum``: it also checks for negative counts and overflow)
               v3   (``build_csr``) tile scan and prefix sum in ONE launch: each CTA scans its
                    rows' tile columns, then takes the sum of the earlier CTAs from their
                    status words (decoupled look-back, below)
scatter        v1   one thread per ``(h, row)`` walks its sequence's queries in order
               v2   tiled stable counting sort (below), one CTA per (query tile, head)
               v3   two stable multi-splits per (query tile, head): by row group, then by row
                    (below); ``build_csr`` runs it for outputs of 192 MiB and more
=============  ===  ==========================================================================

``build_csr`` is three launches (count v2, scan v3, scatter v2), five with scatter v3 (its two
multi-splits and the unpack; seven launches before scan v3 and count v2).
At 128K tokens the GPU work of each is tens of microseconds, so each launch's Python cost
counts too: launchers describe every array once (``_Dev``) and call the compiled kernel of the
signature directly (``_launch``, next to ``_Dev``).

Look-back (scan v3). CTA ``b`` of segment ``s`` publishes its own total (flag 1), waits for the
earlier CTAs' words, adding totals until it meets an inclusive prefix (flag 2), then publishes
its own inclusive prefix. ``(b, s)`` is not the CTA's ``blockIdx`` but a ticket it draws when it
starts (an atomic counter, as CUB does), so every CTA it waits for has already started: it
cannot deadlock whatever order the hardware starts CTAs in. The status buffer is one per device
and assumes its launches do not overlap: msa launches on the legacy default stream, which
serialises them; launching these kernels from several streams at once, or replaying them in a
captured CUDA graph (which would reuse an epoch), is not supported. Status words ``epoch << 34 | flag << 32 | sum`` live in one
int64 buffer kept between calls; each launch has a new epoch and ignores older words, so the
buffer is zeroed once, never per call. The sums are of non-negative counts below 2**31 (the
launcher checked ``Tq*K``), so the 32-bit field cannot overflow; the result does not depend on
timing: integer sums of fixed groups.

Scatter v2, or how to rank without letting atomics choose the order. An edge ``(t, h, s)`` with
row ``r`` goes to ``row_ptr[h, r] + #{t' < t : t' chose r}``. The queries are cut into tiles of
``TQ`` consecutive ids:

1. *count*: every edge adds 1 to ``tile_counts[t // TQ, h, r]`` (integer atomics: the
   totals do not depend on the order);
2. *tile scan*: one thread per ``(h, r)`` turns its column into an exclusive scan over tiles (the
   start of each tile inside the row) and writes the row total, ``counts[h, r]``, which the
   prefix sum turns into ``row_ptr``;
3. *rank*: CTA ``(tile, h)`` walks its tile in chunks of ``C <= 32`` queries, one thread per
   (query, slot). Each edge inserts its row into a shared hash table and ORs its query's bit
   into the row's 32-bit mask. After a barrier the mask says which queries of the chunk chose
   the row, so the edge's rank in the chunk is ``popc(mask & lanes_below)``; the row's last
   query of the chunk then advances the row's cursor (``tile_counts``, now the tile's write
   position in the row) by ``popc(mask)``. Where a row lands in the hash table depends on the
   atomics, the masks and cursors do not: the output is bitwise reproducible. Two tables
   alternate between chunks, so a chunk costs two barriers.

Scatter v3, for large outputs. v2 writes every edge straight to its row: 4-byte writes spread
over the whole output, which at 1M tokens (512 MiB of ``q_indices`` + ``slots``) no longer
merge in the 50 MB L2, so each one costs a partial-sector write to HBM (7 ms at 1M). v3 splits
the same tile twice, both times with a stable multi-split (``_multisplit``: ``match_any`` ranks
a record among its warp's records with the same key, a scan over the warps per key gives the
warp's start, a running cursor per key carries over between chunks; no atomics):

1. pass 1, CTA (tile, h): the tile's edges, in (query, slot) order, go into the tile's own
   range of an int64 scratch array, one record an edge (``query id << 32 | slot << 7 | row %
   128``), grouped by row group ``row // 128`` (at most 128 groups: ``rows <= 16384``, else v2
   runs);
2. pass 2, CTA (tile, h): group by group, each record goes whole to its row in a second int64
   array, at ``row_ptr[h, r] + cursors[tile, h, r]`` plus its rank among the tile's earlier
   records of r;
3. a streaming kernel (``_csr_kernel_unpack``) splits the records into ``q_indices`` and
   ``slots`` and writes the -1 tail.

Pass 1 writes inside the tile's range (512 KiB at 1M); pass 2 writes a tile's whole run of each
row (~8 edges at 1M) while it works on that row's group, so the run's sectors fill while they
are in L2, except a sector shared with the next tile's run. A second pass over (row group x 16
tiles) instead of per tile, which writes 16 tiles' runs of a row side by side, measured slower
(5.1 ms for that pass alone at 1M). The two scratch arrays triple the memory of the build
(1.5 GiB at 1M, half of what the PyTorch build takes).

What bounds both passes (and the tile counts) is their instruction stream and their scattered
stores, more than their loads. Ablations at 1M (H200, each pass without one part, results
wrong, time right) gave pass 2's 2.35 ms as 0.92 without its stores and 0.52 with synthetic
records instead of loaded ones: the loads of the next chunk wait behind the scattered stores of
this one. So every scattered store is one 8-byte record (pass 1: 1.35 -> 0.92 ms, two 4-byte
stores before; pass 2: 2.47 -> 1.39 ms plus 0.41 ms for the coalesced unpack), and the kernels
walk a tile's edges without a division per edge (each thread's (query, slot) steps by the
chunk size: ``_next_edge``), look the tile's sequence up once (``_tile_sequence``), index with
unsigned values (no negative-index wrap-around code), and load the next chunk while the current
one is ranked. Storing each chunk run by run (half the sectors, same number of store
instructions) was no faster. The 1M build: 7.2 ms (v2), 5.0 (v3 as first written), 4.2, 3.2.
At 128K (64 MiB of output) v2 is as fast (0.49 vs 0.52 ms), so ``build_csr`` runs v3 from
192 MiB of output on.

Memory: ``tile_counts`` is int32 ``[ceil(Tq/TQ), Hkv, rows]``. ``TQ`` is the smallest ``C * 2**k``
(at most 8192) with ``TQ >= 8 * rows / K``, i.e. at least 8 edges per (tile, row) on average, so
the tile counts take about 1/16 of the bytes of ``q_indices`` + ``slots``. At N = 1M keys, Bk=128
(rows = 8192 per head), K = 16, Hkv = 4: TQ = 4096, 256 tiles, 32 MiB of tile counts next to
512 MiB of output; at Hkv = 16, K = 64: TQ = 1024, 1024 tiles, 512 MiB next to 8 GiB.

Bad input: with ``validate=True`` (the default) the launchers check the selection on a host copy
(``msa.reference.select.check_block_indices``: a device-to-host copy of ``I`` and a NumPy pass,
about as slow as the reference) and raise ``ValueError``. ``validate=False`` skips that for speed;
the kernels then still never read or write out of bounds: entries that are not a block of the
query's own sequence are skipped, every write is clamped to ``[0, Tq*K)``, and the result for an
invalid selection (duplicates, holes) is unspecified but memory safe.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, int32, int64, uint32, uint64

from .._checks import (
    check_array,
    check_cu_seqlens,
    check_offsets,
    check_positive_int,
    cu_to_host,
)
from ..reference.blocks import block_row_offsets
from ._core.arrays import INT32_MAX, SIMULATOR, ArrayContext
from ._core.launch import THREADS as _THREADS
from ._core.launch import grid_size as _grid
from ._core.launch import host_ints as _host_ints
from ._core.launch import karg as _karg
from ._core.launch import kinput as _kinput
from ._core.launch import launch as _launch
from ._core.launch import upload_ints as _device_copy
from ._core.packed import block_row as _block_row
from ._core.packed import edge_row as _edge_row
from ._core.packed import last_le as _last_le
from ._core.scan import launch_scan as _launch_scan
from ._core.scan import lookback_scan as _lookback_scan
from ._core.scan import tile_scan_kernel as _csr_kernel_tile_scan
from ._core.warp import FULL_MASK, warp_sum
MAX_TOPK = 1024  # one thread per slot of a chunk's query: a CTA holds at most 1024 threads

_CHUNK_THREADS = 64 if SIMULATOR else 512  # target threads per scatter CTA: C = min(32, this // K)
# build_csr's scatter: v3 where the output (q_indices + slots) is at least this large, v2 below
# it (on an H200, v2 is faster at 128K tokens, 64 MiB, and v3 at 1M, 512 MiB: benchmarks/
# bench_csr.py); v3 also needs at most 128 row groups, else v2 runs.
_SPLIT_MIN_BYTES = 192 << 20
_SPLIT_HEADROOM = 256 << 20  # left free after v3's scratch, else build_csr runs v2
_SPLIT_THREADS = 64 if SIMULATOR else 512  # threads per CTA of scatter v3 (a multiple of 32)
_GROUP_ROWS = 128  # rows per group in scatter v3 (the packed slot | row % 128 relies on it)
_GROUP_STARTS = _GROUP_ROWS + 1  # (a shared array's shape must be a plain constant)
_MAX_SPLIT_ROWS = _GROUP_ROWS * _GROUP_ROWS  # scatter v3: at most 128 groups per head
_TABLE = 2048  # shared hash table slots (>= 2 * C * K for every K <= 1024)
_MAX_TILE = 8192  # most queries per scatter tile (fewer, longer CTAs past it)


_HIST_WORDS = 11264  # uint32 words of the shared histogram: two 16-bit row counts each (44 KB)



# --- device helpers ---------------------------------------------------------------------------


@cuda.jit(device=True)
def _tile_sequence(cu_q, row_offsets, t_begin, nq):
    """``(first, nblocks)`` of the one sequence holding queries ``[t_begin, t_begin + nq)``
    (its CSR rows start at ``first``); ``nblocks = -1`` if they span several (or none)."""
    first = int64(0)
    nblocks = int64(-1)
    if nq > 0:
        b = _last_le(cu_q, t_begin)
        if _last_le(cu_q, t_begin + nq - 1) == b:
            first = int64(row_offsets[b])
            nblocks = int64(row_offsets[b + 1]) - first
    return first, nblocks


@cuda.jit(device=True)
def _tile_block(block_indices, t_begin, dq, s, nq, h):
    """``block_indices[t_begin + dq, h, s]``, -1 from ``dq = nq`` on. Unsigned indices: no
    negative-index wrap-around code."""
    x = int32(-1)
    if dq < nq:
        x = block_indices[uint64(t_begin + dq), uint64(h), uint64(s)]
    return x


@cuda.jit(device=True)
def _tile_row(x, t, first, nblocks, cu_q, row_offsets):
    """CSR row of block id x chosen by query t (-1: none), as ``_block_row``, without the
    sequence lookup when ``nblocks >= 0`` (``_tile_sequence``)."""
    r = int64(-1)
    if x >= 0:
        if nblocks >= 0:
            if x < nblocks:
                r = first + x
        else:
            r = _block_row(x, cu_q, row_offsets, t)
    return r


@cuda.jit(device=True)
def _next_edge(dq, s, step_q, step_s, topk):
    """``(dq, s)`` advanced by ``step_q * topk + step_s`` edges (``step_s < topk``): a walk over
    a tile's edges in (query, slot) order without a division per edge."""
    dq += step_q
    s += step_s
    if s >= topk:
        s -= topk
        dq += 1
    return dq, s



# --- histogram / tile counts -------------------------------------------------------------------

@cuda.jit
def _csr_kernel_count(block_indices, cu_q, row_offsets, tile_queries, tile_counts):
    """``tile_counts[t // tile_queries, h, row] += 1`` for every edge; one thread per (t, h)."""
    tq, hkv, topk = block_indices.shape
    n = int64(tq) * hkv
    i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    stride = int64(cuda.gridDim.x) * cuda.blockDim.x
    while i < n:
        h = i % hkv
        t = i // hkv
        tile = t // tile_queries
        for s in range(topk):
            r = _edge_row(block_indices, cu_q, row_offsets, t, h, s)
            if r >= 0:
                cuda.atomic.add(tile_counts, (tile, h, r), 1)
        i += stride



@cuda.jit
def _csr_kernel_count_shared(block_indices, cu_q, row_offsets, tile_queries, tile_counts):
    """v2: CTA (tile, h) counts its tile's edges per row in shared memory and writes the whole
    ``tile_counts[tile, h, :]`` (zeros included: no clearing launch, no global atomics).

    Two 16-bit counts share a word (a tile count is at most ``tile_queries < 2**16``), so rows up
    to ``2 * _HIST_WORDS`` fit in 44 KB; the launcher checks both bounds.
    """
    hist = cuda.shared.array(_HIST_WORDS, uint32)
    tile = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    tq = block_indices.shape[0]
    topk = block_indices.shape[2]
    rows = tile_counts.shape[2]
    for w in range(tid, (rows + 1) // 2, nt):
        hist[w] = 0
    cuda.syncthreads()
    t_begin = int64(tile) * tile_queries
    nq = int32(max(min(int64(tq), t_begin + tile_queries) - t_begin, int64(0)))
    first, nblocks = _tile_sequence(cu_q, row_offsets, t_begin, nq)
    # Thread tid walks edges tid, tid + nt, ... as (query t_begin + dq, slot s): consecutive
    # threads read consecutive slots (coalesced rows of I); the next block id is loaded while
    # this one is counted.
    dq = int32(tid // topk)
    s = int32(tid % topk)
    step_q = int32(nt // topk)
    step_s = int32(nt % topk)
    x = _tile_block(block_indices, t_begin, dq, s, nq, h)
    while dq < nq:
        t = t_begin + dq
        dq, s = _next_edge(dq, s, step_q, step_s, topk)
        x_next = _tile_block(block_indices, t_begin, dq, s, nq, h)
        r = _tile_row(x, t, first, nblocks, cu_q, row_offsets)
        if r >= 0:
            cuda.atomic.add(hist, r >> 1, uint32(1) << uint32((r & 1) * 16))
        x = x_next
    cuda.syncthreads()
    out = tile_counts[tile, h]
    for r in range(tid, rows, nt):
        out[r] = int32((hist[r >> 1] >> uint32((r & 1) * 16)) & uint32(0xFFFF))



# --- scatter ---------------------------------------------------------------------------------

@cuda.jit(device=True)
def _table_insert(keys, buf, r, table_size):
    """Slot of key ``r`` in the shared open-addressing table ``keys[buf]`` (inserted if absent)."""
    p = ((r * 2654435761) >> 13) & (table_size - 1)  # Fibonacci hashing spreads strided rows
    while True:
        old = cuda.atomic.cas(keys, (buf, p), int32(-1), int32(r))
        if old == -1 or old == r:
            return p
        p = (p + 1) & (table_size - 1)


@cuda.jit
def _csr_kernel_scatter_tiled(block_indices, cu_q, row_offsets, row_ptr, cursors, tile_queries,
                              chunk_queries, table_size, q_indices, slots):
    """v2: CTA (tile, h) writes the edges of queries ``[tile*TQ, (tile+1)*TQ)`` of head h.

    ``cursors[tile, h, r]``: where (relative to ``row_ptr[h, r]``) the tile's next edge of row r
    goes; advanced by each chunk. Threads: ``chunk_queries * K``, thread = (query c, slot s).
    Two hash tables alternate between chunks, so that one chunk's inserts and the clearing of
    the previous chunk's table share a phase: two barriers per chunk. Also writes the -1 tail
    ``[nnz_h, Tq*K)``, split between the tiles.
    """
    keys = cuda.shared.array((2, _TABLE), int32)
    masks = cuda.shared.array((2, _TABLE), uint32)
    tile = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    tq, hkv, topk = block_indices.shape
    rows = row_ptr.shape[1] - 1
    width = q_indices.shape[1]
    ntiles = cuda.gridDim.x
    # 1-D views of this CTA's head and tile: fewer live strides, fewer registers.
    q_out = q_indices[h]
    s_out = slots[h]
    ptr = row_ptr[h]
    cursor = cursors[tile, h]

    # The -1 tail: tile k fills its share of [nnz, width).
    nnz = min(max(int64(ptr[rows]), int64(0)), int64(width))
    share = (width - nnz + ntiles - 1) // ntiles
    tail_end = min(int64(width), nnz + (tile + 1) * share)
    e = nnz + tile * share + tid
    while e < tail_end:
        q_out[e] = -1
        s_out[e] = -1
        e += nt

    for p in range(tid, table_size, nt):
        keys[0, p] = -1
        masks[0, p] = 0
        keys[1, p] = -1
        masks[1, p] = 0
    cuda.syncthreads()

    c = tid // topk  # query of the chunk
    s = tid % topk  # slot of that query's selection
    bit = uint32(1) << uint32(c)
    t_begin = int64(tile) * tile_queries
    t_end = min(int64(tq), t_begin + tile_queries)
    # The previous chunk's edge of this thread: its row, cursor and the row's mask.
    r_prev = int64(-1)
    base = int32(0)
    m = uint32(0)
    buf = 0
    j = -1  # this thread's entry of I for the coming chunk, loaded one chunk ahead
    if t_begin + c < t_end:
        j = block_indices[t_begin + c, h, s]
    for chunk in range(t_begin, t_end, chunk_queries):
        # Phase 1: the previous chunk's last query of each row advances the row's cursor past
        # the chunk's entries; the previous table is cleared; this chunk's rows are inserted.
        if r_prev >= 0 and (m >> uint32(c)) == uint32(1):
            cursor[r_prev] = base + cuda.popc(m)
        for p in range(tid, table_size, nt):
            keys[1 - buf, p] = -1
            masks[1 - buf, p] = 0
        t = chunk + c
        r = int64(-1)
        if t < t_end:
            r = _block_row(j, cu_q, row_offsets, t)
        slot = 0
        if r >= 0:
            slot = _table_insert(keys, buf, r, table_size)
            cuda.atomic.or_(masks, (buf, slot), bit)
        cuda.syncthreads()
        # Phase 2: mask = the chunk's queries that chose row r; rank = those before query c.
        if t + chunk_queries < t_end:  # prefetch: the load flies during this phase
            j = block_indices[t + chunk_queries, h, s]
        if r >= 0:
            m = masks[buf, slot]
            base = cursor[r]
            e = int64(ptr[r]) + base + cuda.popc(m & (bit - uint32(1)))
            if e >= 0 and e < width:
                q_out[e] = t
                s_out[e] = s
        r_prev = r
        buf = 1 - buf
        cuda.syncthreads()


# --- scatter v3: two stable multi-splits --------------------------------------------------------

@cuda.jit(device=True)
def _tile_groups(row_ptr, cursors, tile, h, gstart, scratch):
    """``gstart[g]``: where row group g's edges of query tile ``tile`` start in the tile's own
    range of the split arrays (``gstart[ngroups]``: where the range ends).

    The tile's range begins after the edges of head h in earlier tiles (``sum_r cursors[tile,
    h, r]``, the scanned tile counts); inside it the groups follow in order, each as large as
    the tile's edges of its ``_GROUP_ROWS`` rows. One warp per group sums them; integer sums of
    fixed terms, so the result does not depend on timing. Ends with a barrier."""
    tid = cuda.threadIdx.x
    lane = cuda.laneid
    nw = cuda.blockDim.x // 32
    rows = row_ptr.shape[1] - 1
    ntiles = cursors.shape[0]
    ngroups = (rows + _GROUP_ROWS - 1) // _GROUP_ROWS
    for g in range(tid // 32, ngroups, nw):
        before = int64(0)  # edges of the group's rows in earlier tiles
        here = int64(0)  # edges of the group's rows in this tile
        for i in range(lane, _GROUP_ROWS, 32):
            r = g * _GROUP_ROWS + i
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
def _multisplit(key, stamp, cur, nkeys, wcnt, wpos):
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
def _clear_stamps(wcnt):
    """Stamps no chunk will have (-1); ends with a barrier."""
    for i in range(cuda.threadIdx.x, wcnt.shape[0] * wcnt.shape[1], cuda.blockDim.x):
        wcnt[i // wcnt.shape[1], i % wcnt.shape[1]] = -1
    cuda.syncthreads()


@cuda.jit
def _csr_kernel_split_groups(block_indices, cu_q, row_offsets, row_ptr, cursors, tile_queries,
                             records):
    """Scatter v3, pass 1: CTA (tile, h) writes its tile's edges into the tile's range of
    ``records`` (int64: query id << 32 | slot << 7 | row % 128), grouped by row group
    ``row // 128``, in (query, slot) order inside a group. (One 8-byte store an edge, not two
    4-byte ones: these stores are scattered, and they are what the loads queue behind.)"""
    wcnt = cuda.shared.array((32, _GROUP_ROWS), int32)
    wpos = cuda.shared.array((32, _GROUP_ROWS), int32)
    gstart = cuda.shared.array(_GROUP_STARTS, int64)
    scratch = cuda.shared.array(_GROUP_ROWS, int64)
    cur = cuda.shared.array(_GROUP_ROWS, int32)
    tile = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    tq, hkv, topk = block_indices.shape
    rows = row_ptr.shape[1] - 1
    width = records.shape[1]
    ngroups = (rows + _GROUP_ROWS - 1) // _GROUP_ROWS
    _clear_stamps(wcnt)
    _tile_groups(row_ptr, cursors, tile, h, gstart, scratch)
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
    first, nblocks = _tile_sequence(cu_q, row_offsets, t_begin, nq)
    stamp = 0
    x = _tile_block(block_indices, t_begin, dq, s, nq, h)
    for _ in range(0, int64(nq) * topk, nt):
        t = t_begin + dq
        s_now = s
        dq, s = _next_edge(dq, s, step_q, step_s, topk)
        x_next = _tile_block(block_indices, t_begin, dq, s, nq, h)
        r = _tile_row(x, t, first, nblocks, cu_q, row_offsets)
        key = int32(r >> 7) if r >= 0 and r < rows else int32(-1)
        pos = _multisplit(key, stamp, cur, ngroups, wcnt, wpos)
        stamp += 1
        if pos >= 0 and pos < width:
            records[h, uint64(pos)] = (int64(t) << 32) | int64(
                (s_now << 7) | int32(r & (_GROUP_ROWS - 1)))
        x = x_next


@cuda.jit(device=True)
def _split_record(records, h, e, hi):
    """Record e of a row group, ``query id << 32 | slot << 7 | row % 128``, or -1 from ``hi``
    on. Nothing is computed from the loaded value here, so a load issued a chunk ahead stays
    in flight until the next chunk uses it. Unsigned indices: no negative-index wrap-around
    code."""
    rec = int64(-1)
    if e < hi:
        rec = records[h, uint64(e)]
    return rec


@cuda.jit(device=True)
def _record_key(rec, nr):
    """The multi-split key of a record of a group of ``nr`` rows, ``row % 128`` (-1: none)."""
    key = int32(-1)
    if rec >= 0 and int32(rec & (_GROUP_ROWS - 1)) < nr:
        key = int32(rec & (_GROUP_ROWS - 1))  # int32: a 32-bit match.any
    return key


@cuda.jit
def _csr_kernel_split_rows(row_ptr, cursors, records, packed):
    """Scatter v3, pass 2: CTA (tile, h) reads its tile's range of ``records`` group by group
    and writes every record whole to its row in ``packed`` (int64 [Hkv, Tq*K]):
    ``row_ptr[h, r] + cursors[tile, h, r]`` plus its rank among the tile's earlier edges of r.
    One 8-byte store an edge; ``_csr_kernel_unpack`` then splits the records into the output
    and writes the -1 tail."""
    wcnt = cuda.shared.array((32, _GROUP_ROWS), int32)
    wpos = cuda.shared.array((32, _GROUP_ROWS), int32)
    gstart = cuda.shared.array(_GROUP_STARTS, int64)
    scratch = cuda.shared.array(_GROUP_ROWS, int64)
    cur = cuda.shared.array(_GROUP_ROWS, int32)
    tile = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    rows = row_ptr.shape[1] - 1
    width = packed.shape[1]
    ngroups = (rows + _GROUP_ROWS - 1) // _GROUP_ROWS
    _clear_stamps(wcnt)
    _tile_groups(row_ptr, cursors, tile, h, gstart, scratch)
    stamp = 0
    for g in range(ngroups):
        # (gstart is the same for every thread: the loops below are uniform across the CTA)
        lo = max(int64(0), min(gstart[g], int64(width)))
        hi = max(lo, min(gstart[g + 1], int64(width)))
        if hi == lo:
            continue
        r0 = g * _GROUP_ROWS
        nr = min(_GROUP_ROWS, rows - r0)
        # The first chunk's records are loaded with the row cursors, before the barrier, and
        # each next chunk's while this one is ranked: one memory round trip at a time, not two.
        rec = _split_record(records, h, lo + tid, hi)
        for i in range(tid, nr, nt):
            cur[i] = int64(row_ptr[h, r0 + i]) + int64(cursors[tile, h, r0 + i])
        cuda.syncthreads()
        for base in range(lo, hi, nt):
            key = _record_key(rec, nr)
            rec_next = _split_record(records, h, base + nt + tid, hi)
            pos = _multisplit(key, stamp, cur, nr, wcnt, wpos)
            stamp += 1
            if pos >= 0 and pos < width:
                packed[h, uint64(pos)] = rec
            rec = rec_next


@cuda.jit
def _csr_kernel_unpack(row_ptr, packed, q_indices, slots):
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


@cuda.jit
def _csr_kernel_scatter_rowwise(block_indices, cu_q, row_offsets, row_ptr, q_indices, slots):
    """v1: thread (h, r) walks the queries of row r's sequence in order and appends matches."""
    tq, hkv, topk = block_indices.shape
    rows = row_ptr.shape[1] - 1
    width = q_indices.shape[1]
    i = cuda.grid(1)
    if i < hkv * rows:
        h = i // rows
        r = i % rows
        b = _last_le(row_offsets, r)  # row r is block j of sequence b
        j = r - row_offsets[b]
        e = int64(row_ptr[h, r])
        end = int64(row_ptr[h, r + 1])
        for t in range(cu_q[b], cu_q[b + 1]):
            for s in range(topk):
                if block_indices[t, h, s] == j:
                    if e >= 0 and e < end and e < width:
                        q_indices[h, e] = t
                        slots[h, e] = s
                    e += 1


@cuda.jit
def _csr_kernel_fill_tail(row_ptr, q_indices, slots):
    """-1 in ``q_indices[h, e]`` and ``slots[h, e]`` for every ``e >= row_ptr[h, -1]``."""
    hkv, width = q_indices.shape
    rows = row_ptr.shape[1] - 1
    n = int64(hkv) * width
    i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    stride = int64(cuda.gridDim.x) * cuda.blockDim.x
    while i < n:
        h = i // width
        e = i % width
        if e >= row_ptr[h, rows]:
            q_indices[h, e] = -1
            slots[h, e] = -1
        i += stride


# --- launchers ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _host_metadata(cu_q_bytes, cu_k_bytes, block_size, tq):
    """Validated ``(cu_q, cu_k, row_offsets)`` int64 of one call's ``cu_seqlens`` (memoised:
    the checks are NumPy work on tiny arrays, but they run on every call)."""
    cu_q = np.frombuffer(cu_q_bytes, dtype=np.int64)
    cu_k = check_offsets("cu_seqlens_k", np.frombuffer(cu_k_bytes, dtype=np.int64))
    cu_q, cu_k = check_cu_seqlens(cu_q, cu_k, tq, int(cu_k[-1]))
    for a in (cu_q, cu_k):
        a.setflags(write=False)
    row_offsets = block_row_offsets(cu_k, block_size)  # [B+1]
    row_offsets.setflags(write=False)
    return cu_q, cu_k, row_offsets



class _Plan:
    """Validated shapes and device metadata of one selection ``I [Tq, Hkv, K]``."""

    def __init__(self, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, validate):
        self.block_size = check_positive_int("block_size", block_size)
        check_array("block_indices", block_indices, ndim=3, dtypes=("int",))
        self.tq, self.hkv, self.topk = (int(x) for x in block_indices.shape)
        if self.topk < 1 or self.hkv < 1:
            raise ValueError(f"block_indices must have shape [Tq, Hkv >= 1, K >= 1], "
                             f"got {(self.tq, self.hkv, self.topk)}")
        if self.topk > MAX_TOPK:
            raise ValueError(f"block_indices has K={self.topk} slots; the GPU scatter supports "
                             f"K <= {MAX_TOPK}")
        if self.tq * self.topk > INT32_MAX:
            raise ValueError(
                f"block_indices has Tq*K = {self.tq}*{self.topk} = {self.tq * self.topk} possible "
                f"edges per head, more than int32 CSR offsets hold (2**31-1); split the batch")
        cu_q = _host_ints("cu_seqlens_q", cu_seqlens_q)
        cu_k = _host_ints("cu_seqlens_k", cu_seqlens_k)
        self.cu_q, self.cu_k, self.row_offsets = _host_metadata(
            cu_q.tobytes(), cu_k.tobytes(), self.block_size, self.tq)
        self.rows = int(self.row_offsets[-1])
        if self.rows > INT32_MAX:
            raise ValueError(f"cu_seqlens_k gives {self.rows} CSR rows, more than int32 holds")
        if validate:
            from ..reference.select import check_block_indices
            check_block_indices(cu_to_host(block_indices), self.cu_q, self.cu_k, self.block_size)
        self.ctx = ArrayContext(block_indices)
        self.I = _kinput(self.ctx, "block_indices", block_indices)
        self.d_cu_q = _device_copy(self.cu_q)
        self.d_row_offsets = _device_copy(self.row_offsets)
        self.width = self.tq * self.topk
        self.edges = self.tq * self.hkv * self.topk

    def zeros(self, shape):
        # (ArrayContext's fill cannot launch on an empty Numba array)
        return self.ctx.empty(shape, np.int32, fill=0 if int(np.prod(shape)) else None)

    def chunk_queries(self) -> int:
        return max(1, min(32, _CHUNK_THREADS // self.topk))

    def tile_queries(self) -> int:
        """TQ: at least 8 edges per (tile, row) on average (see the module docstring)."""
        tile = self.chunk_queries()
        while tile < _MAX_TILE and tile * self.topk < 8 * self.rows:
            tile *= 2
        return tile

    def shared_count_fits(self, tile_queries) -> bool:
        """Whether count v2 (16-bit counts of every row in shared memory) can take this tile."""
        return self.rows <= 2 * _HIST_WORDS and min(tile_queries, self.tq) < 1 << 16

    def count(self, tile_queries, version=2):
        """Tile counts int32 [ceil(Tq/TQ), Hkv, rows] (caller's array): count v2 where it fits,
        else v1 (global atomics into a zeroed array)."""
        ntiles = max(1, -(-self.tq // tile_queries))
        shape = (ntiles, self.hkv, self.rows)
        if not (self.edges and self.rows):
            return self.zeros(shape)
        if version == 2 and self.shared_count_fits(tile_queries):
            tile_counts = self.ctx.empty(shape, np.int32)
            _launch(_csr_kernel_count_shared, (ntiles, self.hkv), _CHUNK_THREADS, self.I,
                    self.d_cu_q, self.d_row_offsets, tile_queries, _karg(self.ctx, tile_counts))
            return tile_counts
        tile_counts = self.zeros(shape)
        _launch(_csr_kernel_count, _grid(self.tq * self.hkv), _THREADS, self.I, self.d_cu_q,
                self.d_row_offsets, tile_queries, _karg(self.ctx, tile_counts))
        return tile_counts

    def tile_scan(self, tile_counts):
        """Scan tile counts over tiles in place; returns counts int32 [Hkv, rows]."""
        counts = self.ctx.empty((self.hkv, self.rows), np.int32)
        if self.rows:
            _launch(_csr_kernel_tile_scan, _grid(self.hkv * self.rows), _THREADS,
                    _karg(self.ctx, tile_counts), _karg(self.ctx, counts))
        return counts

    def scan(self, tile_counts, version=3, threads=None):
        """Tile scan (in place) and ``row_ptr`` int32 [Hkv, rows+1] (caller's array): v3 is one
        look-back launch; v1/v2 are the tile scan plus ``_prefix_sum``'s launches."""
        ctx = self.ctx
        if version == 3:
            row_ptr = ctx.empty((self.hkv, self.rows + 1), np.int32)
            _lookback_scan(_karg(ctx, tile_counts), _karg(ctx, row_ptr), threads=threads)
            return row_ptr
        counts = self.tile_scan(tile_counts)
        # Tq*K < 2**31 was checked, so no head can overflow: nothing to read back.
        return _prefix_sum(ctx, _karg(ctx, counts), version, False, threads=threads)

    def scatter(self, row_ptr_arg, version, tile_queries=None):
        """``(q_indices, slots)`` int32 [Hkv, Tq*K] (caller's arrays)."""
        q_indices = self.ctx.empty((self.hkv, self.width), np.int32)
        slots = self.ctx.empty((self.hkv, self.width), np.int32)
        dq, ds = _karg(self.ctx, q_indices), _karg(self.ctx, slots)
        if version == 1:
            if self.hkv * self.rows:
                n = self.hkv * self.rows
                _launch(_csr_kernel_scatter_rowwise, -(-n // _THREADS), _THREADS, self.I,
                        self.d_cu_q, self.d_row_offsets, row_ptr_arg, dq, ds)
            if self.hkv * self.width:
                _launch(_csr_kernel_fill_tail, _grid(self.hkv * self.width), _THREADS,
                        row_ptr_arg, dq, ds)
        else:
            tq_tile = tile_queries or self.tile_queries()
            cursors = self.count(tq_tile)
            self.tile_scan(cursors)
            if version == 3 and self.split_fits():
                self._scatter_split(row_ptr_arg, cursors, tq_tile, dq, ds)
            else:
                self._scatter_tiled(row_ptr_arg, cursors, tq_tile, dq, ds)
        return q_indices, slots

    def auto_scatter(self) -> int:
        """The scatter ``build_csr`` runs: 3 for large outputs where it fits, else 2.

        v3's scratch is two int64 arrays [Hkv, Tq*K], each as large as the output (``q_indices``
        and ``slots`` together): 1 GiB in all at N = 1M, Hkv = 4, K = 16. Where the device cannot
        allocate the output and that scratch now (both come after this choice) with
        ``_SPLIT_HEADROOM`` to spare, v2 runs, which needs no scratch.
        """
        out_bytes = 8 * self.hkv * self.width
        if out_bytes < _SPLIT_MIN_BYTES or not self.split_fits():
            return 2
        return 3 if 3 * out_bytes + _SPLIT_HEADROOM <= self.ctx.free_bytes() else 2

    def split_fits(self) -> bool:
        """Whether scatter v3 takes this selection (at most 128 row groups of 128 rows)."""
        return self.rows <= _MAX_SPLIT_ROWS

    def _scatter_split(self, row_ptr_arg, cursors, tile_queries, dq, ds):
        """Scatter v3: two launches over (tile, head) and one streaming launch; two int64
        scratch arrays [Hkv, Tq*K] (each the size of the output)."""
        if not self.split_fits():  # the kernels' shared arrays hold 128 groups
            raise ValueError(f"scatter v3 takes at most {_MAX_SPLIT_ROWS} CSR rows, got "
                             f"{self.rows}")
        if not self.hkv * self.width:
            return
        ctx = self.ctx
        records = _karg(ctx, ctx.empty((self.hkv, self.width), np.int64))
        d_cursors = _karg(ctx, cursors)
        grid = (cursors.shape[0], self.hkv)
        _launch(_csr_kernel_split_groups, grid, _SPLIT_THREADS, self.I, self.d_cu_q,
                self.d_row_offsets, row_ptr_arg, d_cursors, tile_queries, records)
        packed = _karg(ctx, ctx.empty((self.hkv, self.width), np.int64))
        _launch(_csr_kernel_split_rows, grid, _SPLIT_THREADS, row_ptr_arg, d_cursors, records,
                packed)
        _launch(_csr_kernel_unpack, (_grid(self.width), self.hkv), _THREADS, row_ptr_arg,
                packed, dq, ds)

    def _scatter_tiled(self, row_ptr_arg, cursors, tile_queries, dq, ds):
        if not self.hkv * self.width:
            return
        chunk = self.chunk_queries()
        table = 1
        while table < 2 * chunk * self.topk:
            table *= 2
        ntiles = cursors.shape[0]
        _launch(_csr_kernel_scatter_tiled, (ntiles, self.hkv), chunk * self.topk, self.I,
                self.d_cu_q, self.d_row_offsets, row_ptr_arg, _karg(self.ctx, cursors),
                tile_queries, chunk, table, dq, ds)


def _prefix_sum(ctx, counts_arg, version, validate, host_counts=None, threads=None):
    """``row_ptr`` int32 [S, n+1] (caller's array) from kernel-ready counts [S, n]."""
    segments, n = counts_arg.shape
    row_ptr = ctx.empty((segments, n + 1), np.int32)
    # The kernels only OR error bits into the flag; unread, it needs no clearing launch.
    flag = ctx.empty((1,), np.int32, fill=0 if validate else None)
    _launch_scan(ctx, counts_arg, _karg(ctx, row_ptr), _karg(ctx, flag), version, threads)
    if validate:
        bad = int(cu_to_host(flag)[0])
        if bad & 1:
            c = np.asarray(cu_to_host(host_counts))
            raise ValueError(f"counts must be >= 0, got min {int(c.min())}")
        if bad & 2:
            c = np.asarray(cu_to_host(host_counts), dtype=np.int64)
            raise ValueError(
                f"counts sum to {int(c.sum(axis=1).max())} edges in one head, more than int32 "
                f"row_ptr can hold (2**31-1); split the batch")
    return row_ptr


def csr_histogram(block_indices, cu_seqlens_q, cu_seqlens_k, block_size: int, *,
                  validate: bool = True):
    """Paper §4.2, step 1 of the reverse index: how many queries selected each (head, row).

    ``counts[h, row(b, j)] = #{t in sequence b : j in I[t, h, :]}``: one GPU thread per (t, h)
    adds its K edges with integer ``atomicAdd`` (integer sums commute: deterministic counts).

    Args:
        block_indices: I int [Tq, Hkv, K] on the GPU (or NumPy), batch-local block ids, unique
            per (t, h), -1 only at the tail; ``1 <= K <= 1024``, ``Tq*K < 2**31``.
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed-batch offsets (read on the host).
        block_size: Bk >= 1.
        validate: check ``I`` on a host copy first (``select.check_block_indices``); ``False``
            skips it for speed, and invalid entries are then skipped, never read out of bounds.

    Returns:
        counts int32 [Hkv, rows] in the caller's array library; ``rows =
        block_row_offsets(cu_seqlens_k, Bk)[-1]``. -1 entries count nowhere.
    """
    plan = _Plan(block_indices, cu_seqlens_q, cu_seqlens_k, block_size, validate)
    counts = plan.count(max(plan.tq, 1), version=1)  # a single tile: the plain histogram
    return plan.ctx.output(counts)[0]


def exclusive_prefix_sum(counts, *, validate: bool = True, version: int = 2):
    """Paper §4.2, step 2 of the reverse index: ``row_ptr`` from the per-row counts, on the GPU.

    ``row_ptr[h, 0] = 0``, ``row_ptr[h, r+1] = row_ptr[h, r] + counts[h, r]``: a multi-block
    reduce-then-scan per head, accumulated in int64.

    Args:
        counts: int [Hkv, rows], non-negative, on the GPU (or NumPy).
        validate: read back one flag (a device sync) and raise on a negative count or a head
            whose nnz exceeds 2**31-1. With ``False`` nothing is read back; such heads then hold
            offsets clamped to 2**31-1 and negative counts give unspecified offsets.
        version: 1 (serial, one thread per head) or 2 (default, multi-block scan).

    Returns:
        row_ptr int32 [Hkv, rows+1], non-decreasing; ``row_ptr[h, -1]`` is head h's nnz.
    """
    check_array("counts", counts, ndim=2, dtypes=("int",))
    ctx = ArrayContext(counts)
    dcounts = _kinput(ctx, "counts", counts)
    row_ptr = _prefix_sum(ctx, dcounts, version, validate, host_counts=counts)
    return ctx.output(row_ptr)


def csr_scatter(block_indices, row_ptr, cu_seqlens_q, cu_seqlens_k, block_size: int, *,
                validate: bool = True, version: int | None = None):
    """Paper §4.2, step 3 of the reverse index: every edge's query id into its CSR row.

    Edge ``(h, t, s)`` of row ``r`` lands at ``e = row_ptr[h, r] + #{t' < t : t' chose r}``:
    ``q_indices[h, e] = t``, ``slots[h, e] = s``. Ranks come from a tiled stable counting sort
    (module docstring), never from the order of atomics: reruns are bitwise identical.

    Args:
        block_indices: I int [Tq, Hkv, K] (see ``csr_histogram``).
        row_ptr: int32 [Hkv, rows+1], ``exclusive_prefix_sum(csr_histogram(...))`` of the same
            selection, on the same device.
        cu_seqlens_q, cu_seqlens_k: int [B+1]. block_size: Bk >= 1.
        validate: check ``I`` (host copy) and that ``row_ptr`` belongs to it (a copy of the
            counts and of ``row_ptr``). With ``False`` a foreign ``row_ptr`` gives unspecified
            entries but every write stays inside ``[0, Tq*K)``; scatter v3 may then also take
            far longer (its loops follow ``row_ptr``'s differences, clamped to ``Tq*K``).
        version: 1 (one thread per row, slow), 2 (tiled, a hash table of rows per chunk), 3
            (two stable multi-splits, by row group then by row; module docstring) or None
            (default: what ``build_csr`` picks, 3 for outputs of 192 MiB and more, else 2).

    Returns:
        ``(q_indices, slots)``, int32 [Hkv, Tq*K] each, in the caller's array library. Queries
        ascend inside a row; entries past ``row_ptr[h, -1]`` are -1.
    """
    if version not in (None, 1, 2, 3):
        raise ValueError(f"version must be None, 1, 2 or 3, got {version!r}")
    plan = _Plan(block_indices, cu_seqlens_q, cu_seqlens_k, block_size, validate)
    version = version or plan.auto_scatter()
    check_array("row_ptr", row_ptr, ndim=2, dtypes=("int",), shape=(plan.hkv, plan.rows + 1))
    ArrayContext(block_indices, row_ptr)  # TypeError if they come from different libraries
    drow_ptr = _kinput(plan.ctx, "row_ptr", row_ptr)
    if validate:
        counts = plan.tile_scan(plan.count(max(plan.tq, 1), version=1))
        got = np.asarray(cu_to_host(row_ptr), dtype=np.int64)  # [Hkv, rows+1]
        want = np.asarray(cu_to_host(counts), dtype=np.int64)  # [Hkv, rows]
        if not np.array_equal(np.diff(got, axis=1), want) or np.any(got[:, 0] != 0):
            raise ValueError(
                "row_ptr must be exclusive_prefix_sum(csr_histogram(block_indices, ...)) of the "
                "same block_indices, cu_seqlens and block_size")
    q_indices, slots = plan.scatter(drow_ptr, version)
    return plan.ctx.output(q_indices), plan.ctx.output(slots)


def build_csr(block_indices, cu_seqlens_q, cu_seqlens_k, block_size: int, *,
              validate: bool = True):
    """Paper §4.2: the k2q reverse index of a selection, built on the GPU.

    Tile histogram (count v2) -> tile scan + prefix sum (scan v3, one look-back launch) ->
    tiled deterministic scatter (v3, three launches, for outputs of 192 MiB and more when its
    scratch fits in free device memory; else v2, one launch): three or five launches, no host
    round trip besides ``cu_seqlens``
    (and ``validate``).

    Args:
        block_indices: I int [Tq, Hkv, K] on the GPU (or NumPy), batch-local block ids, unique
            per (t, h), -1 only at the tail; ``1 <= K <= 1024``, ``Tq*K < 2**31``.
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed-batch offsets (read on the host).
        block_size: Bk >= 1.
        validate: check ``I`` on a host copy first (``select.check_block_indices``, as slow as the
            reference); ``False`` for speed, with bad entries skipped in the kernels.

    Returns:
        ``(row_ptr, q_indices, slots)``: int32 [Hkv, rows+1], [Hkv, Tq*K], [Hkv, Tq*K] in the
        caller's array library, equal to ``msa.reference.csr.build_csr``: queries ascending
        inside each row, slots = position of the block in ``I[t, h, :]``, -1 past the head's nnz.
    """
    return _build_csr(block_indices, cu_seqlens_q, cu_seqlens_k, block_size, validate=validate)


def _build_csr(block_indices, cu_seqlens_q, cu_seqlens_k, block_size, *, validate=True,
               scatter_version=None, scan_version=3, count_version=2, tile_queries=None,
               scan_threads=None):
    """``build_csr`` with its knobs exposed to the tests (small tiles exercise many of them)."""
    plan = _Plan(block_indices, cu_seqlens_q, cu_seqlens_k, block_size, validate)
    ctx = plan.ctx
    scatter_version = scatter_version or plan.auto_scatter()
    if scatter_version == 1:
        counts = plan.count(max(plan.tq, 1), version=1)[0]
        row_ptr = _prefix_sum(ctx, _karg(ctx, counts), min(scan_version, 2), False,
                              threads=scan_threads)
        q_indices, slots = plan.scatter(_karg(ctx, row_ptr), 1)
    else:
        tq_tile = tile_queries or plan.tile_queries()
        cursors = plan.count(tq_tile, version=count_version)
        row_ptr = plan.scan(cursors, scan_version, scan_threads)
        q_indices = ctx.empty((plan.hkv, plan.width), np.int32)
        slots = ctx.empty((plan.hkv, plan.width), np.int32)
        scatter = plan._scatter_tiled
        if scatter_version == 3 and plan.split_fits():
            scatter = plan._scatter_split
        scatter(_karg(ctx, row_ptr), cursors, tq_tile, _karg(ctx, q_indices), _karg(ctx, slots))
    return ctx.output(row_ptr), ctx.output(q_indices), ctx.output(slots)
