"""Paper §4.2 on the GPU: the hot-row scheduler (work items for K1), without a host round trip.

Same function and arguments as ``msa.reference.schedule.build_schedule`` (read its docstring
for what a work item is), but the number of items ``W`` depends on the data and the launcher
never reads it back. It returns instead

* ``work`` int32 ``[capacity, 6]``, a size known from the shapes: rows ``0..W-1`` equal the
  reference's ``[W, 6]`` exactly, rows ``W..capacity-1`` are -1;
* ``num_items`` int32 ``[1]`` on the device, holding ``W``.

A consumer launches ``capacity`` CTAs (or a persistent grid) and lets a CTA whose index is
``>= num_items[0]`` return at once (``launch_rows``); ``work[:int(num_items[0])]`` is the
reference's array when a host copy is wanted. ``launch_schedule`` is the same build for other
stages, on a validated ``msa._batch.Batch``: it checks nothing.

=  =============================================================  ===========================
v  idea                                                           where it runs; verdict
=  =============================================================  ===========================
1  full chunks placed by a prefix sum, partial chunks by a        always: 0.37 ms at 128K,
   stable counting sort on their size (``v1_counting_sort``)      0.39 ms at 1M (H200)
=  =============================================================  ===========================

Capacity. A row of head h holds ``n`` queries and gives ``ceil(n / chunk_size)`` items. Each
row of sequence b holds at most ``Lk_b`` queries (only b's queries pick its blocks, each at most
once, and ``Lq_b <= Lk_b``), so per head ``W_h <= sum_b nb_b * ceil(Lk_b / chunk_size)``. When
the caller passes ``max_edges`` (a bound on every head's nnz; ``Tq*K``, the width of
``build_csr``'s ``q_indices``, is one), also ``W_h <= R + (max_edges - R) // chunk_size`` with
``R = min(rows, max_edges)``. ``capacity = Hkv * min(bounds)``. At N = 1M, Bk = 128, K = 16,
Hkv = 4 and chunk_size = 2*K*Bk = 4096 that is 49 144 rows (1.1 MiB) with ``max_edges = Tq*K``
and 8.4M rows (192 MiB) without: pass ``max_edges``.

Scratch: the key histogram is int32 ``[ceil(Hkv*rows / 512), Q]`` (``Q = min(chunk_size - 1,
max Lk)`` keys), 1 MiB at N = 1M, Hkv = 4.
"""

from __future__ import annotations

import numpy as np

from ..._batch import Batch
from ..._checks import check_array, check_flag, check_positive_int, cu_to_host
from ...reference.schedule import WORK_COLUMNS
from .._core.arrays import INT32_MAX, SIMULATOR, ArrayContext, index_dtype
from .._core.launch import THREADS, dev, grid_size, karg, kinput, launch, upload_ints
from .._core.scan import lookback_scan
from . import v1_counting_sort

__all__ = ["build_schedule", "launch_rows", "launch_schedule"]

_ITEM_TILE = 64 if SIMULATOR else 512  # rows per CTA of the write kernel (<= 1024)


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
        chunk_size: most queries per item, in ``[1, 2**31 - 1]`` (the paper uses about
            ``2*K*Bk``).
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


def launch_schedule(batch, row_ptr, chunk_size, max_edges, ctx):
    """``build_schedule`` for other stages: checks nothing.

    Args:
        batch: the validated ``msa._batch.Batch`` whose keys the CSR rows are (the queries,
            if any, are not used).
        row_ptr: int32 [Hkv, rows+1] on the device, as ``launch_build_csr`` returns it (or a
            kernel argument from ``_core.launch``); out of contract it gives an unspecified
            order, never an out-of-bounds access.
        chunk_size: most queries per item, an int >= 1. max_edges: a bound on every head's
            nnz (``Tq*K``), or None.
        ctx: the caller's ``ArrayContext``; the outputs are allocated in its library.

    Returns:
        ``(work, num_items)``: ``ctx.empty`` arrays int32 [capacity, 6] and [1], as
        ``build_schedule``'s. Raises ValueError only if the capacity would pass int32.
    """
    return _schedule(batch, dev(row_ptr), chunk_size, max_edges, ctx)


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
                    validate=True, **knobs):
    """``build_schedule`` with the tests' knobs (``_schedule``'s ``item_tile``,
    ``scan_threads``)."""
    # a work item's q_count is int32: a bigger chunk would be the same schedule
    chunk_size = check_positive_int("chunk_size", chunk_size, high=INT32_MAX)
    if max_edges is not None:
        max_edges = check_positive_int("max_edges", max_edges, low=0)
    batch = Batch.of(None, cu_seqlens_k, block_size)
    check_array("row_ptr", row_ptr, ndim=2, dtypes=("int",), shape=(None, batch.rows + 1))
    index_dtype("row_ptr", row_ptr)
    if check_flag("validate", validate):
        _check_row_ptr(row_ptr, batch, max_edges)
    ctx = ArrayContext(row_ptr=row_ptr)
    work, num_items = _schedule(batch, kinput(ctx, "row_ptr", row_ptr), chunk_size, max_edges,
                                ctx, **knobs)
    return ctx.output(work), ctx.output(num_items)


def _capacity(lk, block_size, chunk_size, max_edges):
    """Work rows per KV head known from the shapes (module docstring); ``lk`` int64 [B]."""
    nb = -(-lk // block_size)  # [B]
    rows = int(nb.sum())
    per_head = int(np.sum(nb * -(-lk // chunk_size)))
    if max_edges is not None:
        r = min(rows, max_edges)
        per_head = min(per_head, r + (max_edges - r) // chunk_size)
    return per_head


def _schedule(batch, row_ptr, chunk_size, max_edges, ctx, *, item_tile=None, scan_threads=None):
    """``(work, num_items)`` (``ctx`` arrays) from the kernel argument ``row_ptr``; ``item_tile``
    (rows per CTA of the write kernel) and ``scan_threads`` are the tests' knobs."""
    hkv = int(row_ptr.shape[0])
    rows = batch.rows
    capacity = hkv * _capacity(batch.lk, batch.block_size, chunk_size, max_edges)
    if capacity > INT32_MAX:
        raise ValueError(f"the schedule could need {capacity} work items, more than int32 holds; "
                         f"pass max_edges or a larger chunk_size")
    work = ctx.empty((capacity, len(WORK_COLUMNS)), np.int32)
    m = hkv * rows
    if m == 0:  # no rows, so capacity == 0 too
        return work, ctx.empty((1,), np.int32, fill=0)
    num_items = ctx.empty((1,), np.int32)
    num_keys = max(0, min(chunk_size - 1, int(batch.lk.max())))  # possible n % chunk_size values

    tile = item_tile or min(_ITEM_TILE, 1 << max(0, (m - 1).bit_length()))
    ntiles = -(-m // tile)
    full = ctx.empty((1, 1, m), np.int32)
    keys = ctx.empty((m,), np.int32)
    tile_counts = ctx.empty((ntiles, 1, num_keys), np.int32, fill=0 if num_keys else None)
    d_full, d_tile_counts = karg(ctx, full), karg(ctx, tile_counts)
    launch(v1_counting_sort.rows_kernel, grid_size(m), THREADS, row_ptr, chunk_size, num_keys,
           tile, d_full, karg(ctx, keys), d_tile_counts)
    full_off = ctx.empty((1, m + 1), np.int32)
    key_off = ctx.empty((1, num_keys + 1), np.int32)
    d_full_off, d_key_off = karg(ctx, full_off), karg(ctx, key_off)
    # Two look-back launches: full-chunk offsets (full itself is kept) and the key scan
    # (tile_counts become each tile's start inside its key group).
    lookback_scan(d_full, d_full_off, in_place=False, threads=scan_threads)
    lookback_scan(d_tile_counts, d_key_off, threads=scan_threads)
    launch(v1_counting_sort.write_kernel, ntiles, tile, row_ptr, upload_ints(batch.row_offsets),
           chunk_size, d_full, d_full_off, karg(ctx, keys), d_tile_counts, d_key_off,
           karg(ctx, work), karg(ctx, num_items))
    return work, num_items


def _check_row_ptr(row_ptr, batch, max_edges):
    """The contract of ``build_schedule``'s ``row_ptr`` on a host copy (ValueError otherwise)."""
    rp = np.asarray(cu_to_host(row_ptr), dtype=np.int64)  # [Hkv, rows+1]
    if np.any(rp[:, 0] != 0):
        raise ValueError(f"row_ptr[:, 0] must be 0, got {rp[:, 0].tolist()}")
    n = np.diff(rp, axis=1)  # [Hkv, rows]
    if np.any(n < 0):
        raise ValueError("row_ptr must be non-decreasing along each head")
    if np.any(rp[:, -1] > INT32_MAX):
        raise ValueError(f"row_ptr must fit int32 (<= {INT32_MAX}), got {int(rp.max())}")
    row_len = np.repeat(batch.lk, np.diff(batch.row_offsets))  # [rows] keys of each row's sequence
    h, r = np.nonzero(n > row_len[None, :])
    if h.size:
        raise ValueError(
            f"row_ptr gives row {int(r[0])} of head {int(h[0])} {int(n[h[0], r[0]])} queries, more "
            f"than its sequence's {int(row_len[r[0]])} keys: not the CSR of a selection")
    if max_edges is not None and np.any(rp[:, -1] > max_edges):
        raise ValueError(f"row_ptr holds {int(rp[:, -1].max())} edges in one head, more than "
                         f"max_edges={max_edges}")
