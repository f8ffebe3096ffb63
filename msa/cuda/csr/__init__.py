"""Paper §4.2 on the GPU: the reverse sparse index, q2k ``block_indices`` -> k2q CSR.

Same functions and arguments as ``msa.reference.csr`` (read its docstring for the layout), plus
keywords: ``validate`` (below) and, where there are several kernels, ``version``. Every step
runs on the device; the launchers read only ``cu_seqlens`` (small metadata) on the host, plus
whatever ``validate=True`` asks for. ``launch_build_csr`` is the build for other stages, on a
validated ``msa._batch.Batch``: it checks nothing.

The build is histogram -> prefix sum -> scatter, each step a ladder (H200 times at 608fd44,
``benchmarks/bench_csr.py``; every rung is tested against the reference):

=========  ===  ==============================================  ==============================
step       v    idea                                            where it runs; verdict
=========  ===  ==============================================  ==============================
count      1    one thread per (t, h) adds its K edges:         ``csr_histogram``; the build's
                ``atomicAdd(counts[h, row], 1)`` into zeros     fallback above 22528 rows
                (``v1_rowwise``)                                (1.0 ms at 1M)
           2    CTA (tile, h) counts in shared memory, two      ``build_csr``: 0.27 ms at 1M
                16-bit counts a word; writes the whole tile
                row, no clearing, no global atomics
                (``v2_tiled``)
scan       1    one thread per head walks its rows              teaching rung
                (``_core.scan``)                                (``exclusive_prefix_sum``)
           2    reduce-then-scan, three launches                ``exclusive_prefix_sum``
           3    tile scan + prefix sum in one decoupled         ``build_csr``: 0.11 ms at 128K
                look-back launch                                (0.24 for tile scan + v2)
scatter    1    one thread per (h, row) walks its sequence's    teaching rung (``csr_scatter(
                queries in order (``v1_rowwise``)               version=1)``): 60 ms at 32K
           2    tiled stable counting sort: a shared hash       ``build_csr`` below 192 MiB of
                table of rows per chunk, ranks from bit masks   output: 0.61 ms at 128K, 2.7x
                (``v2_tiled``)                                  the PyTorch build
           3    two stable multi-splits per tile (by row        ``build_csr`` from 192 MiB on:
                group, then by row) through 8-byte records      3.3 ms at 1M (v2: 7.7, PyTorch
                (``v3_multisplit``)                             12.2)
=========  ===  ==============================================  ==============================

``build_csr`` is three launches (count v2, scan v3, scatter v2), five with scatter v3. Scatter
v3 needs at most 16384 rows a head and two int64 scratch arrays the size of the output, with
256 MiB of free device memory to spare; else v2 runs.

Validation once: the public functions check shapes, dtypes and the offsets (``Batch.of``), and
with ``validate=True`` (the default) the selection on a host copy
(``msa.reference.select.check_block_indices``: a device-to-host copy of ``I`` and a NumPy pass,
about as slow as the reference), raising ``ValueError``. Below them nothing is checked again.
``validate=False`` skips the selection check for speed; the kernels then still never read or
write out of bounds: entries that are not a block of the query's own sequence are skipped, every
write is clamped to ``[0, Tq*K)``, and a block id a query repeats is listed once, at the first
slot naming it (``_core.packed.repeats_in_warp`` where a warp holds whole rows, i.e. K divides
32: a vote that the rows ascend, as msa writes selections, else one ``match.any`` among a row's
lanes; elsewhere ``repeats_a_slot``, up to K - 1 loads of the row a slot), so that every entry
of a row is written (no stale memory read as another query's edge) and no row holds more
queries than its sequence has. The CSR of such a selection is still not
the reference's (it rejects it); the kernels that read it keep the damage in the rows of the
queries that made it (tests/cuda/test_hostile_indices.py).

``launch_slot_mask`` (``_slot_mask``) marks which slots are entries, one bit a slot, for the
stages whose slot sums follow the CSR (the backward's ``dq``, the KL's).
"""

from __future__ import annotations

import numpy as np

from ..._batch import Batch
from ..._checks import check_array, check_flag, check_version, cu_to_host, unsupported
from ...reference.select import check_block_indices
from .._core.arrays import INT32_MAX, ArrayContext, index_dtype
from .._core.launch import karg, kinput
from .._core.scan import launch_scan
from ._plan import MAX_TOPK, Plan, build
from ._slot_mask import is_entry, launch_slot_mask, mask_words

__all__ = ["MAX_TOPK", "build_csr", "csr_histogram", "csr_scatter", "exclusive_prefix_sum",
           "launch_build_csr", "launch_slot_mask", "mask_words", "is_entry"]


def launch_build_csr(batch, block_indices, ctx):
    """``build_csr`` for other stages: checks nothing.

    Args:
        batch: the validated ``msa._batch.Batch`` of the selection (with queries).
        block_indices: I int32/int64 [batch.tq, Hkv, K] on the device (a torch, CuPy or Numba
            array, or a kernel argument from ``_core.launch``; NumPy in the simulator), with
            ``1 <= K <= MAX_TOPK`` and ``Tq*K < 2**31``. Invalid entries are skipped (memory
            safe, result unspecified).
        ctx: the caller's ``ArrayContext``; the outputs are allocated in its library.

    Returns:
        ``(row_ptr, q_indices, slots)``: ``ctx.empty`` arrays int32 [Hkv, rows+1], [Hkv, Tq*K],
        [Hkv, Tq*K] (``ctx.output`` them for a caller). Launched on the launch stream, no host
        round trip.
    """
    return build(batch, block_indices, ctx)


def _selection(block_indices, cu_seqlens_q, cu_seqlens_k, block_size, validate):
    """``(batch, ctx, I)`` of a public call: everything checked, ``I`` a kernel argument."""
    check_flag("validate", validate)
    check_array("block_indices", block_indices, ndim=3, dtypes=("int",))
    index_dtype("block_indices", block_indices)
    tq, hkv, topk = (int(x) for x in block_indices.shape)
    if topk < 1 or hkv < 1:
        raise ValueError(f"block_indices must have shape [Tq, Hkv >= 1, K >= 1], "
                         f"got {(tq, hkv, topk)}")
    if topk > MAX_TOPK:
        raise unsupported("block_indices' K", topk, "msa.cuda", f"K <= {MAX_TOPK}",
                          why="the scatter takes a thread per slot of a query")
    if tq * topk > INT32_MAX:
        raise ValueError(
            f"block_indices has Tq*K = {tq}*{topk} = {tq * topk} possible edges per head, more "
            f"than int32 CSR offsets hold (2**31-1); split the batch")
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=tq)
    if batch.rows > INT32_MAX:
        raise ValueError(f"cu_seqlens_k gives {batch.rows} CSR rows, more than int32 holds")
    if validate:
        check_block_indices(cu_to_host(block_indices), batch.cu_q, batch.cu_k, batch.block_size)
    ctx = ArrayContext(block_indices=block_indices)
    return batch, ctx, kinput(ctx, "block_indices", block_indices)


def csr_histogram(block_indices, cu_seqlens_q, cu_seqlens_k, block_size: int, *,
                  validate: bool = True):
    """Paper §4.2, step 1 of the reverse index: how many queries selected each (head, row).

    ``counts[h, row(b, j)] = #{t in sequence b : j in I[t, h, :]}``: count v1, one GPU thread
    per (t, h) adds its K edges with integer ``atomicAdd`` (integer sums commute: deterministic
    counts).

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
    batch, ctx, I = _selection(block_indices, cu_seqlens_q, cu_seqlens_k, block_size, validate)
    plan = Plan(batch, I, ctx)
    counts = plan.count(max(plan.tq, 1), version=1)  # a single tile: the plain histogram
    return ctx.output(counts)[0]


def exclusive_prefix_sum(counts, *, validate: bool = True, version: int = 2):
    """Paper §4.2, step 2 of the reverse index: ``row_ptr`` from the per-row counts, on the GPU.

    ``row_ptr[h, 0] = 0``, ``row_ptr[h, r+1] = row_ptr[h, r] + counts[h, r]``, accumulated in
    int64: scan v2 (a multi-block reduce-then-scan per head) or v1 (one thread per head).

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
    index_dtype("counts", counts)
    validate = check_flag("validate", validate)
    version = check_version("version", version, (1, 2)) or 2
    ctx = ArrayContext(counts=counts)
    return ctx.output(_prefix_sum(ctx, kinput(ctx, "counts", counts), version, validate, counts))


def _prefix_sum(ctx, counts_arg, version, validate, host_counts, threads=None):
    """``row_ptr`` int32 [S, n+1] (``ctx`` array) from kernel-ready counts [S, n]; with
    ``validate``, reads the error flag back and raises (``host_counts`` names the culprit)."""
    segments, n = counts_arg.shape
    row_ptr = ctx.empty((segments, n + 1), np.int32)
    # The kernels only OR error bits into the flag; unread, it needs no clearing launch.
    flag = ctx.empty((1,), np.int32, fill=0 if validate else None)
    launch_scan(ctx, counts_arg, karg(ctx, row_ptr), karg(ctx, flag), version, threads)
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


def csr_scatter(block_indices, row_ptr, cu_seqlens_q, cu_seqlens_k, block_size: int, *,
                validate: bool = True, version: int | None = None):
    """Paper §4.2, step 3 of the reverse index: every edge's query id into its CSR row.

    Edge ``(h, t, s)`` of row ``r`` lands at ``e = row_ptr[h, r] + #{t' < t : t' chose r}``:
    ``q_indices[h, e] = t``, ``slots[h, e] = s``. Ranks come from a stable counting sort per
    query tile (``v2_tiled``), never from the order of atomics: reruns are bitwise identical.
    The tiles' cursors come from the selection itself (count and scan v3), so this is the
    whole build with ``row_ptr`` taken from the caller.

    Args:
        block_indices: I int [Tq, Hkv, K] (see ``csr_histogram``).
        row_ptr: int32 [Hkv, rows+1], ``exclusive_prefix_sum(csr_histogram(...))`` of the same
            selection, on the same device.
        cu_seqlens_q, cu_seqlens_k: int [B+1]. block_size: Bk >= 1.
        validate: check ``I`` (host copy) and that ``row_ptr`` belongs to it (a copy of
            ``row_ptr`` and of the one the build makes). With ``False`` a foreign ``row_ptr``
            gives unspecified entries but every write stays inside ``[0, Tq*K)``; scatter v3
            may then also take far longer (its loops follow ``row_ptr``'s differences, clamped
            to ``Tq*K``).
        version: 1 (one thread per row, slow), 2 (tiled, a hash table of rows per chunk), 3
            (two stable multi-splits, by row group then by row) or None (default: what
            ``build_csr`` picks, 3 for outputs of 192 MiB and more, else 2).

    Returns:
        ``(q_indices, slots)``, int32 [Hkv, Tq*K] each, in the caller's array library. Queries
        ascend inside a row; entries past ``row_ptr[h, -1]`` are -1.
    """
    check_version("version", version, (1, 2, 3))
    batch, ctx, I = _selection(block_indices, cu_seqlens_q, cu_seqlens_k, block_size, validate)
    hkv = int(block_indices.shape[1])
    check_array("row_ptr", row_ptr, ndim=2, dtypes=("int",), shape=(hkv, batch.rows + 1))
    index_dtype("row_ptr", row_ptr)
    # TypeError if they come from different libraries
    ArrayContext(block_indices=block_indices, row_ptr=row_ptr)
    drow_ptr = kinput(ctx, "row_ptr", row_ptr)
    plan = Plan(batch, I, ctx)
    version = plan.scatter_version(version)
    tile = plan.tile_queries()
    cursors = plan.count(tile)
    own_row_ptr = plan.scan(cursors)
    if validate:
        got = np.asarray(cu_to_host(row_ptr), dtype=np.int64)  # [Hkv, rows+1]
        want = np.asarray(cu_to_host(ctx.output(own_row_ptr)), dtype=np.int64)
        if not np.array_equal(got, want):
            raise ValueError(
                "row_ptr must be exclusive_prefix_sum(csr_histogram(block_indices, ...)) of the "
                "same block_indices, cu_seqlens and block_size")
    q_indices, slots = plan.scatter(drow_ptr, cursors, tile, version)
    return ctx.output(q_indices), ctx.output(slots)


def build_csr(block_indices, cu_seqlens_q, cu_seqlens_k, block_size: int, *,
              validate: bool = True):
    """Paper §4.2: the k2q reverse index of a selection, built on the GPU.

    Tile histogram (count v2) -> tile scan + prefix sum (scan v3, one look-back launch) ->
    tiled deterministic scatter (v3, three launches, for outputs of 192 MiB and more when its
    scratch fits in free device memory; else v2, one launch): three or five launches, no host
    round trip besides ``cu_seqlens`` (and ``validate``).

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
               **knobs):
    """``build_csr`` with the tests' knobs (``_plan.build``'s keywords: ``scatter_version``,
    ``count_version``, ``tile_queries``, ``scan_threads``, ``split_threads``)."""
    batch, ctx, I = _selection(block_indices, cu_seqlens_q, cu_seqlens_k, block_size, validate)
    return tuple(ctx.output(x) for x in build(batch, I, ctx, **knobs))
