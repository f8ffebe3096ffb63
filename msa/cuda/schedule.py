"""Paper §4.2 on the GPU: the hot-row scheduler (work items for K1), without a host round trip.

Same function and arguments as ``msa.reference.schedule.build_schedule`` (read its docstring
for what a work item is), but the number of items ``W`` depends on the data and the launcher
never reads it back. It returns instead

* ``work`` int32 ``[capacity, 6]``, a size known from the shapes: rows ``0..W-1`` equal the
  reference's ``[W, 6]`` exactly, rows ``W..capacity-1`` are -1;
* ``num_items`` int32 ``[1]`` on the device, holding ``W``.

A consumer launches ``capacity`` CTAs (or a persistent grid) and lets a CTA whose index is
``>= num_items[0]`` return at once; ``work[:int(num_items[0])]`` is the reference's array when
a host copy is wanted.

Capacity. A row of head h holds ``n`` queries and gives ``ceil(n / chunk_size)`` items. Each
row of sequence b holds at most ``Lk_b`` queries (only b's queries pick its blocks, each at most
once, and ``Lq_b <= Lk_b``), so per head ``W_h <= sum_b nb_b * ceil(Lk_b / chunk_size)``. When
the caller passes ``max_edges`` (a bound on every head's nnz; ``Tq*K``, the width of
``build_csr``'s ``q_indices``, is one), also ``W_h <= R + (max_edges - R) // chunk_size`` with
``R = min(rows, max_edges)``. ``capacity = Hkv * min(bounds)``. At N = 1M, Bk = 128, K = 16,
Hkv = 4 and chunk_size = 2*K*Bk = 4096 that is 49 144 rows (1.1 MiB) with ``max_edges = Tq*K``
and 8.4M rows (192 MiB) without: pass ``max_edges``.

How the order is made without a general sort. Every chunk of a row but its last has
``q_count == chunk_size``, the largest possible value, so the schedule is

1. all full chunks, in (kv_head, row, q_begin) order: item ``full_off[i] + c`` is chunk c of
   flattened row ``i = h*rows + r``, where ``full_off`` is the exclusive scan of
   ``n // chunk_size`` over i;
2. then one partial chunk per row with ``q = n % chunk_size > 0``, by q descending, ties by i:
   a stable counting sort on the key ``Q - q`` (``Q = min(chunk_size - 1, max Lk)``): per tile
   of rows a histogram of keys (integer atomics), a scan over tiles and over keys, and inside a
   tile each row's rank among the tile's earlier rows with the same key (a loop over the tile's
   keys in shared memory: deterministic, no atomics in the order).

Kernels (five launches, ten before the look-back scans): a clearing ``fill_`` of the key
histogram, ``_schedule_kernel_rows`` (per-row counts, keys, key histogram per tile), two
look-back scans of ``msa.cuda.csr`` (scan v3: the full-chunk offsets; the key histogram's tile
scan and key scan in one launch), ``_schedule_kernel_write`` (items, -1 tail and
``num_items``). ``scan_version`` 1 or 2 (tests) uses the older tile scan + prefix-sum launches.
Scratch: the key histogram is int32 ``[ceil(Hkv*rows / 512), Q]``, 1 MiB at N = 1M, Hkv = 4.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, int32, int64

from .._checks import check_array, check_offsets, check_positive_int, cu_to_host
from ..reference.blocks import block_row_offsets
from ..reference.schedule import WORK_COLUMNS
from ._core.arrays import SIMULATOR, ArrayContext
from ._core.arrays import INT32_MAX
from ._core.launch import THREADS as _THREADS
from ._core.launch import grid_size as _grid
from ._core.launch import host_ints as _host_ints
from ._core.launch import karg as _karg
from ._core.launch import kinput as _kinput
from ._core.launch import launch as _launch
from ._core.launch import upload_ints as _device_copy
from ._core.packed import last_le as _last_le
from ._core.scan import launch_scan as _launch_scan
from ._core.scan import lookback_scan as _lookback_scan
from ._core.scan import tile_scan_kernel as _csr_kernel_tile_scan

_ITEM_TILE = 64 if SIMULATOR else 512  # rows per CTA of the write kernel (<= 1024)


@cuda.jit
def _schedule_kernel_rows(row_ptr, chunk_size, num_keys, item_tile, full, keys, tile_counts):
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
def _write_item(work, w, h, r, q_begin, q_count, b, j):
    if w >= 0 and w < work.shape[0]:
        work[w, 0] = h
        work[w, 1] = r
        work[w, 2] = q_begin
        work[w, 3] = q_count
        work[w, 4] = b
        work[w, 5] = j


@cuda.jit
def _schedule_kernel_write(row_ptr, row_offsets, chunk_size, full, full_off, keys, tile_off,
                           key_off, work, num_items):
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
        b = _last_le(row_offsets, r)  # row r is block j of sequence b
        j = r - row_offsets[b]
        start = int64(row_ptr[h, r])
        f = int64(full[0, 0, i])
        # 1. full chunks, (h, r, q_begin) order.
        w = int64(full_off[0, i])
        # (bounded by the capacity, so a garbage row_ptr cannot make a thread loop for ages)
        for c in range(max(int64(0), min(f, capacity - w))):
            _write_item(work, w + c, h, r, start + c * chunk_size, chunk_size, b, j)
        # 2. the partial chunk: after every full chunk, every larger key-group and every
        #    earlier row of the same key (earlier tiles via tile_off, this tile by counting).
        if key >= 0:
            rank = int64(0)
            for k in range(tid):
                if sh_keys[k] == key:
                    rank += 1
            w = num_full + key_off[0, key] + tile_off[cuda.blockIdx.x, 0, key] + rank
            q_begin = start + f * chunk_size
            _write_item(work, w, h, r, q_begin, int64(row_ptr[h, r + 1]) - q_begin, b, j)

    total = min(num_full + int64(key_off[0, num_keys]), int64(capacity))
    if cuda.blockIdx.x == 0 and tid == 0:
        num_items[0] = total
    e = total * 6 + i
    stride = int64(cuda.gridDim.x) * nt
    while e < capacity * 6:
        work[e // 6, e % 6] = -1
        e += stride


def _capacity(cu_k, block_size, chunk_size, max_edges):
    """Work rows per KV head known from the shapes (module docstring)."""
    lk = np.diff(cu_k)  # [B]
    nb = -(-lk // block_size)  # [B]
    rows = int(nb.sum())
    per_head = int(np.sum(nb * -(-lk // chunk_size)))
    if max_edges is not None:
        r = min(rows, max_edges)
        per_head = min(per_head, r + (max_edges - r) // chunk_size)
    return per_head


@functools.lru_cache(maxsize=64)
def _host_metadata(cu_k_bytes, block_size, chunk_size, max_edges):
    """``(cu_k, row_offsets, rows, work rows per head, num_keys)`` of one call's
    ``cu_seqlens_k`` (checked; memoised: NumPy work on a tiny array, on every call)."""
    cu_k = check_offsets("cu_seqlens_k", np.frombuffer(cu_k_bytes, dtype=np.int64))
    row_offsets = block_row_offsets(cu_k, block_size)  # [B+1]
    for a in (cu_k, row_offsets):
        a.setflags(write=False)
    max_len = int(np.diff(cu_k).max())
    num_keys = max(0, min(chunk_size - 1, max_len))  # possible q = n % chunk_size values
    return (cu_k, row_offsets, int(row_offsets[-1]),
            _capacity(cu_k, block_size, chunk_size, max_edges), num_keys)


def build_schedule(row_ptr, cu_seqlens_k, block_size: int, chunk_size: int, *,
                   max_edges: int | None = None, validate: bool = True):
    """Paper §4.2 on the GPU: split every non-empty k2q row into chunks of <= ``chunk_size``.

    Items as in ``msa.reference.schedule.build_schedule``: ``[kv_head, row, q_begin, q_count,
    batch, kv_block]``, ``q_count`` descending, ties by ``(kv_head, row, q_begin)`` ascending.

    Args:
        row_ptr: int32 [Hkv, rows+1] k2q row pointers of a selection (``build_csr``) on the GPU
            (or NumPy): starting at 0, non-decreasing, and no row longer than its sequence
            (``row_ptr[h, r+1] - row_ptr[h, r] <= Lk_b`` for row r of sequence b; every CSR of a
            valid selection satisfies it, since a row holds only b's queries, each once).
        cu_seqlens_k: int [B+1] key offsets (read on the host).
        block_size: Bk >= 1.
        chunk_size: most queries per item, >= 1 (the paper uses about ``2*K*Bk``).
        max_edges: optional bound on every head's nnz ``row_ptr[h, -1]`` (e.g. ``Tq*K``); it
            only shrinks ``capacity`` (module docstring), so pass it.
        validate: check ``row_ptr`` on a host copy (``Hkv*(rows+1)`` ints): the reference's rules
            plus the row-length bound above and ``nnz <= max_edges``; ValueError naming
            ``row_ptr`` otherwise. With ``False`` nothing is read back; an out-of-contract
            ``row_ptr`` then gives an unspecified order and at most ``capacity`` items, never
            an out-of-bounds access.

    Returns:
        ``(work, num_items)`` in the caller's array library: work int32 [capacity, 6] whose first
        ``W = num_items[0]`` rows equal the reference's ``[W, 6]`` and whose other rows are -1;
        num_items int32 [1]. No item is dropped for an input within the contract.
    """
    return _build_schedule(row_ptr, cu_seqlens_k, block_size, chunk_size, max_edges=max_edges,
                           validate=validate)


def launch_rows(work, num_items):
    """The rows of ``build_schedule``'s ``work`` that a kernel launch should cover.

    On a GPU all ``capacity`` rows: the padding rows (-1) exit at once, and reading ``num_items``
    would cost a host round trip. In the simulator only the first ``num_items[0]`` rows: there
    every CTA of the grid runs as one Python thread per CUDA thread, padding rows included
    (tens of times the real work on small problems).
    """
    if not SIMULATOR:
        return work
    return work[:int(np.asarray(cu_to_host(num_items)).reshape(-1)[0])]


def _build_schedule(row_ptr, cu_seqlens_k, block_size, chunk_size, *, max_edges=None,
                    validate=True, item_tile=None, scan_version=3, scan_threads=None):
    """``build_schedule`` with the tile size and scan exposed to the tests."""
    block_size = check_positive_int("block_size", block_size)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if max_edges is not None:
        max_edges = check_positive_int("max_edges", max_edges, low=0)
    cu_bytes = _host_ints("cu_seqlens_k", cu_seqlens_k).tobytes()
    cu_k, row_offsets, rows, per_head, num_keys = _host_metadata(cu_bytes, block_size,
                                                                 chunk_size, max_edges)
    check_array("row_ptr", row_ptr, ndim=2, dtypes=("int",), shape=(None, rows + 1))
    hkv = int(row_ptr.shape[0])
    if validate:
        _check_row_ptr(row_ptr, cu_k, row_offsets, max_edges)
    capacity = hkv * per_head
    if capacity > INT32_MAX:
        raise ValueError(f"the schedule could need {capacity} work items, more than int32 holds; "
                         f"pass max_edges or a larger chunk_size")

    ctx = ArrayContext(row_ptr)
    d_row_ptr = _kinput(ctx, "row_ptr", row_ptr)
    work = ctx.empty((capacity, len(WORK_COLUMNS)), np.int32)
    m = hkv * rows
    if m == 0:  # no rows, so capacity == 0 too
        return ctx.output(work), ctx.output(ctx.empty((1,), np.int32, fill=0))
    num_items = ctx.empty((1,), np.int32)

    tile = item_tile or min(_ITEM_TILE, 1 << max(0, (m - 1).bit_length()))
    ntiles = -(-m // tile)
    full = ctx.empty((1, 1, m), np.int32)
    keys = ctx.empty((m,), np.int32)
    tile_counts = ctx.empty((ntiles, 1, num_keys), np.int32,
                            fill=0 if num_keys else None)
    d_full, d_tile_counts = _karg(ctx, full), _karg(ctx, tile_counts)
    _launch(_schedule_kernel_rows, _grid(m), _THREADS, d_row_ptr, chunk_size, num_keys, tile,
            d_full, _karg(ctx, keys), d_tile_counts)
    full_off = ctx.empty((1, m + 1), np.int32)
    key_off = ctx.empty((1, num_keys + 1), np.int32)
    d_full_off, d_key_off = _karg(ctx, full_off), _karg(ctx, key_off)
    if scan_version == 3:
        # Two look-back launches: full-chunk offsets (full itself is kept) and the key scan
        # (tile_counts become each tile's start inside its key group).
        _lookback_scan(d_full, d_full_off, in_place=False, threads=scan_threads)
        _lookback_scan(d_tile_counts, d_key_off, threads=scan_threads)
    else:
        flag = ctx.empty((1,), np.int32)  # never read: no overflow is possible, capacity < 2**31
        _launch_scan(ctx, _karg(ctx, full[0]), d_full_off, _karg(ctx, flag), scan_version,
                     scan_threads)
        key_counts = ctx.empty((1, num_keys), np.int32)
        if num_keys:
            _launch(_csr_kernel_tile_scan, _grid(num_keys), _THREADS, d_tile_counts,
                    _karg(ctx, key_counts))
        _launch_scan(ctx, _karg(ctx, key_counts), d_key_off, _karg(ctx, flag), scan_version,
                     scan_threads)
    _launch(_schedule_kernel_write, ntiles, tile, d_row_ptr, _device_copy(row_offsets),
            chunk_size, d_full, d_full_off, _karg(ctx, keys), d_tile_counts, d_key_off,
            _karg(ctx, work), _karg(ctx, num_items))
    return ctx.output(work), ctx.output(num_items)


def _check_row_ptr(row_ptr, cu_k, row_offsets, max_edges):
    """The contract of ``build_schedule``'s ``row_ptr`` on a host copy (ValueError otherwise)."""
    rp = np.asarray(cu_to_host(row_ptr), dtype=np.int64)  # [Hkv, rows+1]
    if np.any(rp[:, 0] != 0):
        raise ValueError(f"row_ptr[:, 0] must be 0, got {rp[:, 0].tolist()}")
    n = np.diff(rp, axis=1)  # [Hkv, rows]
    if np.any(n < 0):
        raise ValueError("row_ptr must be non-decreasing along each head")
    if np.any(rp[:, -1] > INT32_MAX):
        raise ValueError(f"row_ptr must fit int32 (<= {INT32_MAX}), got {int(rp.max())}")
    lk = np.diff(cu_k)  # [B]
    row_len = np.repeat(lk, np.diff(row_offsets))  # [rows] keys of each row's sequence
    h, r = np.nonzero(n > row_len[None, :])
    if h.size:
        raise ValueError(
            f"row_ptr gives row {int(r[0])} of head {int(h[0])} {int(n[h[0], r[0]])} queries, more "
            f"than its sequence's {int(row_len[r[0]])} keys: not the CSR of a selection")
    if max_edges is not None and np.any(rp[:, -1] > max_edges):
        raise ValueError(f"row_ptr holds {int(rp[:, -1].max())} edges in one head, more than "
                         f"max_edges={max_edges}")
