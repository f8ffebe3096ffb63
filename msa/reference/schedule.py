"""Paper §4.2, pre-scheduled tile chunking: cut hot k2q rows into query chunks (work items for K1).

KV-block popularity is very skewed: a sink block may be selected by almost every query, local
blocks by their neighbours, most remote blocks by a handful. If one CTA handled one whole
(KV head, KV block) row, the hot rows would run long after the cold ones had finished and the
GPU would idle on a long tail. The scheduler therefore cuts every row of the k2q CSR
(``msa.reference.csr``) along its gathered-query axis into chunks of at most ``chunk_size``
queries; each chunk is one CTA of K1, which loads the row's K/V tile and serves the chunk's
queries with it. The paper uses chunks of about ``2*K*Bk`` queries.

No CTA accumulates into another's output: the (query, block) partial of every edge has its own
slot of ``O_part`` (the CSR's ``slots``), so chunking needs no atomics and stays exact (K2
combines the slots with their LSEs).

A work item is one int32 row ``[kv_head, row, q_begin, q_count, batch, kv_block]`` (MiniMax's
six-tuple): CSR entries ``q_begin .. q_begin+q_count-1`` of ``q_indices[kv_head]``, all in
``row``, which is block ``kv_block`` of sequence ``batch``. Items are listed largest first, so a
GPU that hands out CTAs in launch order starts the long ones early and fills the tail with short
ones (the longest-processing-time-first rule).
"""

from __future__ import annotations

import numpy as np

from .._checks import (check_array, check_block_size, check_offsets, check_positive_int,
                       cu_to_host)
from .blocks import block_row_offsets

INT32_MAX = np.iinfo(np.int32).max
WORK_COLUMNS = ("kv_head", "row", "q_begin", "q_count", "batch", "kv_block")


def build_schedule(row_ptr, cu_seqlens_k, block_size: int, chunk_size: int) -> np.ndarray:
    """Paper §4.2: split every non-empty k2q row into chunks of <= ``chunk_size`` queries.

    A row of head ``h`` with ``n = row_ptr[h, r+1] - row_ptr[h, r] > 0`` queries gives
    ``ceil(n / chunk_size)`` items; chunk ``c`` starts at ``q_begin = row_ptr[h, r] + c*chunk_size``
    and holds ``min(chunk_size, row_ptr[h, r+1] - q_begin)`` queries. Empty rows give no item.

    Args:
        row_ptr: int [Hkv, rows+1] k2q row pointers (``csr.build_csr``): starts at 0,
            non-decreasing, at most 2**31-1.
        cu_seqlens_k: int [B+1] key offsets; with ``block_size`` they fix ``rows`` and the
            (sequence, block) of every row.
        block_size: Bk >= 1.
        chunk_size: most queries per work item, in ``[1, 2**31 - 1]`` (the paper uses about
            ``2*K*Bk``).

    Returns:
        work int32 [W, 6], columns ``[kv_head, row, q_begin, q_count, batch, kv_block]``
        (``q_begin`` an absolute offset into ``q_indices[kv_head]``), sorted by ``q_count``
        descending, ties by ``(kv_head, row, q_begin)`` ascending. ``W = 0`` gives shape [0, 6].
    """
    block_size = check_block_size(block_size)
    # a work item's q_count is int32: a bigger chunk would be the same schedule
    chunk_size = check_positive_int("chunk_size", chunk_size, high=INT32_MAX)
    cu_k = check_offsets("cu_seqlens_k", cu_seqlens_k)  # [B+1]
    row_offsets = block_row_offsets(cu_k, block_size)  # [B+1]
    rows = int(row_offsets[-1])
    check_array("row_ptr", row_ptr, ndim=2, dtypes=("int",), shape=(None, rows + 1))
    row_ptr = np.asarray(cu_to_host(row_ptr), dtype=np.int64)  # [Hkv, rows+1]
    if np.any(row_ptr[:, 0] != 0):
        raise ValueError(f"row_ptr[:, 0] must be 0, got {row_ptr[:, 0].tolist()}")
    q_per_row = np.diff(row_ptr, axis=1)  # [Hkv, rows]
    if np.any(q_per_row < 0):
        raise ValueError("row_ptr must be non-decreasing along each head")
    if np.any(row_ptr[:, -1] > INT32_MAX):
        raise ValueError(f"row_ptr must fit int32 (<= {INT32_MAX}), got {int(row_ptr.max())}")

    # ceil(n / chunk_size) chunks per row; a hot row becomes several CTAs.
    chunks_per_row = -(-q_per_row // chunk_size)  # [Hkv, rows]
    head, row = np.nonzero(chunks_per_row)  # [R] non-empty rows, (head, row) ascending
    n_chunks = chunks_per_row[head, row]  # [R]
    item_head = np.repeat(head, n_chunks)  # [W]
    item_row = np.repeat(row, n_chunks)  # [W]
    first_item = np.cumsum(n_chunks) - n_chunks  # [R] index of each row's first item
    chunk = np.arange(item_head.size) - np.repeat(first_item, n_chunks)  # [W] c within its row
    q_begin = row_ptr[item_head, item_row] + chunk * chunk_size  # [W]
    q_count = np.minimum(chunk_size, row_ptr[item_head, item_row + 1] - q_begin)  # [W]
    # Row -> (sequence, block): the last sequence whose first row is <= row (empty sequences
    # own no rows, so side="right" skips them).
    batch = np.searchsorted(row_offsets, item_row, side="right") - 1  # [W]
    kv_block = item_row - row_offsets[batch]  # [W]

    # Largest first; ties in (kv_head, row, q_begin) order so the schedule is deterministic.
    order = np.lexsort((q_begin, item_row, item_head, -q_count))  # [W]
    work = np.stack([item_head, item_row, q_begin, q_count, batch, kv_block], axis=1)  # [W, 6]
    return work[order].astype(np.int32).reshape(-1, len(WORK_COLUMNS))


def schedule_stats(work) -> dict:
    """Load balance of a schedule: how much longer the biggest work item is than the average.

    Args:
        work: int [W, 6] from ``build_schedule``.

    Returns:
        dict with ``items`` (W), ``edges`` (sum of ``q_count``: every (query, block) edge once),
        ``max_q_count``, ``mean_q_count`` and ``imbalance = max_q_count / mean_q_count``
        (1.0 is perfectly even; 0 items give zeros and imbalance 1.0).
    """
    check_array("work", work, ndim=2, dtypes=("int",), shape=(None, len(WORK_COLUMNS)))
    q_count = np.asarray(cu_to_host(work), dtype=np.int64)[:, WORK_COLUMNS.index("q_count")]  # [W]
    if q_count.size == 0:
        return dict(items=0, edges=0, max_q_count=0, mean_q_count=0.0, imbalance=1.0)
    mean = float(q_count.mean())
    return dict(items=int(q_count.size), edges=int(q_count.sum()), max_q_count=int(q_count.max()),
                mean_q_count=mean, imbalance=float(q_count.max()) / mean)
