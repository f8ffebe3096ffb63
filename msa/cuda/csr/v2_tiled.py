"""CSR rung 2: a query tile per CTA, counted in shared memory, ranked without atomics in the order.

What it adds over v1: each CTA ``(tile, h)`` works on ``TQ`` consecutive queries of one head
(``_tiles``), so the counts and the ranks of a tile are made in shared memory and written once.

* count v2 (``count_kernel``): the tile's edges per row in a shared histogram, two 16-bit
  counts a word (a tile count is below ``2**16``), so up to ``2 * HIST_WORDS = 22528`` rows a
  head fit in 44 KB; the CTA writes its tile's whole row of counts, zeros included: no clearing
  launch and no global atomics (0.27 ms against 1.0 ms for count v1 at 1M tokens, H200).
  ``build_csr``'s count wherever it fits, for scatter v2 and v3 alike.
* scatter v2 (``scatter_kernel``): a tiled stable counting sort, ``build_csr``'s scatter for
  outputs below 192 MiB (0.6 ms for the whole build at 128K tokens, 2.7x the PyTorch build).

How it ranks without letting atomics choose the order. An edge ``(t, h, s)`` with row ``r``
goes to ``row_ptr[h, r] + #{t' < t : t' chose r}``. With the queries cut into tiles of ``TQ``:

1. *count*: every edge adds 1 to ``tile_counts[t // TQ, h, r]`` (the totals do not depend on
   the order);
2. *tile scan*: each ``(h, r)`` column becomes an exclusive scan over tiles (the start of each
   tile inside the row) and the row totals become ``row_ptr`` (scan v3, ``_core.scan``);
3. *rank*: CTA ``(tile, h)`` walks its tile in chunks of ``C <= 32`` queries, one thread per
   (query, slot). Each edge inserts its row into a shared hash table and ORs its query's bit
   into the row's 32-bit mask. After a barrier the mask says which queries of the chunk chose
   the row, so the edge's rank in the chunk is ``popc(mask & lanes_below)``; the row's last
   query of the chunk then advances the row's cursor (``tile_counts``, now the tile's write
   position in the row) by ``popc(mask)``. Where a row lands in the hash table depends on the
   atomics, the masks and cursors do not: the output is bitwise reproducible. Two tables
   alternate between chunks, so a chunk costs two barriers.

What limits it: every edge is a 4-byte store straight to its row, spread over the whole output.
At 1M tokens (512 MiB of ``q_indices`` + ``slots``) those stores no longer merge in the 50 MB
L2, and each costs a partial-sector write to HBM (7.1 ms at 1M): scatter v3 is the answer.
"""

from __future__ import annotations

from numba import cuda, int32, int64, uint32

from .._core.packed import block_row, repeats_a_slot, repeats_in_warp, whole_rows_in_warps
from ._tiles import next_edge, tile_block, tile_row, tile_sequence
from .._core.diskcache import kernel_jit

HIST_WORDS = 11264  # uint32 words of the shared histogram, two 16-bit row counts each (44 KB)
TABLE = 2048  # shared hash table slots of scatter v2 (>= 2 * C * K for every K <= 1024)


@kernel_jit
def count_kernel(block_indices, cu_q, row_offsets, tile_queries, tile_counts):
    """v2: CTA (tile, h) counts its tile's edges per row in shared memory and writes the whole
    ``tile_counts[tile, h, :]`` (zeros included: no clearing launch, no global atomics).

    Two 16-bit counts share a word (a tile count is at most ``tile_queries < 2**16``), so rows up
    to ``2 * HIST_WORDS`` fit in 44 KB; the launcher checks both bounds.
    """
    hist = cuda.shared.array(HIST_WORDS, uint32)
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
    first, nblocks = tile_sequence(cu_q, row_offsets, t_begin, nq)
    # Thread tid walks edges tid, tid + nt, ... as (query t_begin + dq, slot s): consecutive
    # threads read consecutive slots (coalesced rows of I); the next block id is loaded while
    # this one is counted.
    dq = int32(tid // topk)
    s = int32(tid % topk)
    step_q = int32(nt // topk)
    step_s = int32(nt % topk)
    # Where a warp holds whole rows (K divides 32), the repeat check is one match among the
    # row's lanes, else K - 1 loads of the row at most.
    in_warp = whole_rows_in_warps(topk, nt)
    x = tile_block(block_indices, t_begin, dq, s, nq, h)
    while dq < nq:
        t = t_begin + dq
        s_now = s
        dq, s = next_edge(dq, s, step_q, step_s, topk)
        x_next = tile_block(block_indices, t_begin, dq, s, nq, h)
        r = tile_row(x, t, first, nblocks, cu_q, row_offsets)
        if in_warp:
            repeated = repeats_in_warp(x, s_now, topk, False)
        else:
            repeated = r >= 0 and repeats_a_slot(block_indices, t, h, s_now, x)
        if r >= 0 and not repeated:
            cuda.atomic.add(hist, r >> 1, uint32(1) << uint32((r & 1) * 16))
        x = x_next
    cuda.syncthreads()
    out = tile_counts[tile, h]
    for r in range(tid, rows, nt):
        out[r] = int32((hist[r >> 1] >> uint32((r & 1) * 16)) & uint32(0xFFFF))


@cuda.jit(device=True)
def table_insert(keys, buf, r, table_size):
    """Slot of key ``r`` in the shared open-addressing table ``keys[buf]`` (inserted if absent)."""
    p = ((r * 2654435761) >> 13) & (table_size - 1)  # Fibonacci hashing spreads strided rows
    while True:
        old = cuda.atomic.cas(keys, (buf, p), int32(-1), int32(r))
        if old == -1 or old == r:
            return p
        p = (p + 1) & (table_size - 1)


@kernel_jit
def scatter_kernel(block_indices, cu_q, row_offsets, row_ptr, cursors, tile_queries,
                   chunk_queries, table_size, q_indices, slots):
    """v2: CTA (tile, h) writes the edges of queries ``[tile*TQ, (tile+1)*TQ)`` of head h.

    ``cursors[tile, h, r]``: where (relative to ``row_ptr[h, r]``) the tile's next edge of row r
    goes; advanced by each chunk. Threads: ``chunk_queries * K``, thread = (query c, slot s).
    Two hash tables alternate between chunks, so that one chunk's inserts and the clearing of
    the previous chunk's table share a phase: two barriers per chunk. Also writes the -1 tail
    ``[nnz_h, Tq*K)``, split between the tiles.
    """
    keys = cuda.shared.array((2, TABLE), int32)
    masks = cuda.shared.array((2, TABLE), uint32)
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
    in_warp = whole_rows_in_warps(topk, nt)  # the repeat check by one match (count_kernel)
    bit = uint32(1) << uint32(c)
    t_begin = int64(tile) * tile_queries
    t_end = min(int64(tq), t_begin + tile_queries)
    # The previous chunk's edge of this thread: its row, cursor and the row's mask.
    r_prev = int64(-1)
    base = int32(0)
    m = uint32(0)
    buf = 0
    j = int32(-1)  # this thread's entry of I for the coming chunk, loaded one chunk ahead
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
            r = block_row(j, cu_q, row_offsets, t)
            # a repeated id: the query's first slot naming it is listed
            if in_warp:
                if repeats_in_warp(j, s, topk, False):
                    r = int64(-1)
            elif r >= 0 and repeats_a_slot(block_indices, t, h, s, j):
                r = int64(-1)
        slot = 0
        if r >= 0:
            slot = table_insert(keys, buf, r, table_size)
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
