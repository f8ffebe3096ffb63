"""Schedule rung 1: full chunks by offset, partial chunks by a stable counting sort.

The only rung (it is the paper's scheduler without a general sort). Every chunk of a row but
its last has ``q_count == chunk_size``, the largest possible value, so the schedule is

1. all full chunks, in (kv_head, row, q_begin) order: item ``full_off[i] + c`` is chunk c of
   flattened row ``i = h*rows + r``, where ``full_off`` is the exclusive scan of
   ``n // chunk_size`` over i;
2. then one partial chunk per row with ``q = n % chunk_size > 0``, by q descending, ties by i:
   a stable counting sort on the key ``Q - q`` (``Q = min(chunk_size - 1, max Lk)``): per tile
   of rows a histogram of keys (integer atomics, ``rows_kernel``), a scan over tiles and over
   keys (scan v3, ``_core.scan``), and inside a tile each row's rank among the tile's earlier
   rows with the same key (``write_kernel``: a loop over the tile's keys in shared memory;
   deterministic, no atomics in the order).

Five launches (a clearing fill of the key histogram, ``rows_kernel``, two look-back scans,
``write_kernel``): 0.37 ms at 128K tokens and 0.39 ms at 1M on an H200, including the host.
"""

from __future__ import annotations

from numba import cuda, int32, int64

from .._core.packed import last_le
from .._core.diskcache import kernel_jit


@kernel_jit
def rows_kernel(row_ptr, chunk_size, num_keys, item_tile, full, keys, tile_counts):
    """Per flattened row ``i = h*rows + r`` with ``n`` queries: ``full[0, 0, i] = n // chunk_size``,
    ``keys[i] = num_keys - min(n % chunk_size, num_keys)`` (or -1 when the row has no partial
    chunk), and ``tile_counts[i // item_tile, 0, key] += 1``."""
    hkv = row_ptr.shape[0]
    rows = row_ptr.shape[1] - 1
    m = int64(hkv) * rows
    i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    stride = int64(cuda.gridDim.x) * cuda.blockDim.x
    while i < m:
        h = i // rows
        r = i % rows
        n = max(int64(row_ptr[h, r + 1]) - int64(row_ptr[h, r]), int64(0))
        f = n // chunk_size
        q = n - f * chunk_size
        full[0, 0, i] = f
        key = int32(-1)
        if q > 0 and num_keys > 0:
            # Larger partial chunks first: a smaller key. q > num_keys only for a row longer than
            # its sequence (outside the contract): clamped, so it cannot index out of bounds.
            key = int32(num_keys - min(q, num_keys))
            cuda.atomic.add(tile_counts, (i // item_tile, 0, key), 1)
        keys[i] = key
        i += stride


@cuda.jit(device=True)
def write_item(work, w, h, r, q_begin, q_count, b, j):
    if w >= 0 and w < work.shape[0]:
        work[w, 0] = h
        work[w, 1] = r
        work[w, 2] = q_begin
        work[w, 3] = q_count
        work[w, 4] = b
        work[w, 5] = j


@kernel_jit
def write_kernel(row_ptr, row_offsets, chunk_size, full, full_off, keys, tile_off, key_off,
                 work, num_items):
    """CTA k writes the items of rows ``[k*T, (k+1)*T)`` (T = blockDim), then all CTAs fill the
    tail ``work[W:] = -1`` and CTA 0 stores ``num_items[0] = W``."""
    sh_keys = cuda.shared.array(1024, int32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    hkv = row_ptr.shape[0]
    rows = row_ptr.shape[1] - 1
    m = int64(hkv) * rows
    capacity = work.shape[0]
    i = int64(cuda.blockIdx.x) * nt + tid
    key = int32(-1)
    if i < m:
        key = keys[i]
    sh_keys[tid] = key
    cuda.syncthreads()

    num_full = int64(full_off[0, m])
    num_keys = key_off.shape[1] - 1
    if i < m:
        h = i // rows
        r = i % rows
        b = last_le(row_offsets, r)  # row r is block j of sequence b
        j = r - row_offsets[b]
        start = int64(row_ptr[h, r])
        f = int64(full[0, 0, i])
        # 1. full chunks, (h, r, q_begin) order.
        w = int64(full_off[0, i])
        # (bounded by the capacity, so a garbage row_ptr cannot make a thread loop for ages)
        for c in range(max(int64(0), min(f, capacity - w))):
            write_item(work, w + c, h, r, start + c * chunk_size, chunk_size, b, j)
        # 2. the partial chunk: after every full chunk, every larger key-group and every
        #    earlier row of the same key (earlier tiles via tile_off, this tile by counting).
        if key >= 0:
            rank = int64(0)
            for k in range(tid):
                if sh_keys[k] == key:
                    rank += 1
            w = num_full + key_off[0, key] + tile_off[cuda.blockIdx.x, 0, key] + rank
            q_begin = start + f * chunk_size
            write_item(work, w, h, r, q_begin, int64(row_ptr[h, r + 1]) - q_begin, b, j)

    total = min(num_full + int64(key_off[0, num_keys]), int64(capacity))
    if cuda.blockIdx.x == 0 and tid == 0:
        num_items[0] = total
    e = total * 6 + i
    stride = int64(cuda.gridDim.x) * nt
    while e < capacity * 6:
        work[e // 6, e % 6] = -1
        e += stride
