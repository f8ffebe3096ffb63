"""CSR rung 1: one thread per edge source or per row, global memory only (the simple rung).

* count v1 (``count_kernel``): one thread per ``(t, h)`` adds its K edges with
  ``atomicAdd(tile_counts[t // TQ, h, row], 1)`` into a zeroed array. Integer sums commute, so
  the counts are deterministic. With one tile (``TQ >= Tq``) it is ``csr_histogram``; it is
  also ``build_csr``'s count where count v2's shared histogram cannot hold the rows (more than
  22528 rows a head, or a tile of ``2**16`` queries).
* scatter v1 (``scatter_kernel``): one thread per ``(h, row)`` walks the queries of its row's
  sequence in order and appends every query that chose the row, so the order is the queries'
  by construction. Reached only by ``csr_scatter(version=1)`` (and the tests): each thread
  reads all of its sequence's ``Lq * K`` entries, ``O(rows * Lq * K)`` work in all: the v1
  build (count v1, scan v1, scatter v1) took 60 ms at 32K tokens on an H200, the default
  build 0.26 ms. ``fill_tail_kernel`` writes the -1 past each head's nnz.
"""

from __future__ import annotations

from numba import cuda, int64

from .._core.packed import edge_row, last_le, repeats_a_slot
from .._core.diskcache import kernel_jit


@kernel_jit
def count_kernel(block_indices, cu_q, row_offsets, tile_queries, tile_counts):
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
            r = edge_row(block_indices, cu_q, row_offsets, t, h, s)
            if r >= 0 and not repeats_a_slot(block_indices, t, h, s, block_indices[t, h, s]):
                cuda.atomic.add(tile_counts, (tile, h, r), 1)
        i += stride


@kernel_jit
def scatter_kernel(block_indices, cu_q, row_offsets, row_ptr, q_indices, slots):
    """v1: thread (h, r) walks the queries of row r's sequence in order and appends matches."""
    tq, hkv, topk = block_indices.shape
    rows = row_ptr.shape[1] - 1
    width = q_indices.shape[1]
    i = cuda.grid(1)
    if i < hkv * rows:
        h = i // rows
        r = i % rows
        b = last_le(row_offsets, r)  # row r is block j of sequence b
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
                    break  # a repeated id: the query's first slot naming it is listed


@kernel_jit
def fill_tail_kernel(row_ptr, q_indices, slots):
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
