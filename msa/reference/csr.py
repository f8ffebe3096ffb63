"""Paper §4.2: the reverse sparse index, q2k block_indices -> k2q CSR (histogram, prefix, scatter).

The selector answers "which KV blocks does query ``t`` read?" (q2k, ``I [Tq, Hkv, K]``). The
KV-outer kernel K1 needs the transpose, "which queries read KV block ``j``?" (k2q), so that one
K/V tile is loaded once and serves every query that selected it. Seen as a bipartite graph, both
views hold the same edges ``(h, t, j)``; only the order in which they are stored changes.

The k2q index is one CSR matrix per KV head ``h``, stored side by side:

* a *row* is one (sequence, KV block) pair: block ``j`` of sequence ``b`` is row
  ``block_row_offsets(cu_seqlens_k, Bk)[b] + j``, so ``rows = sum_b ceil(Lk_b / Bk)``;
* ``row_ptr [Hkv, rows+1]``: the queries of row ``r`` of head ``h`` are
  ``q_indices[h, row_ptr[h, r]:row_ptr[h, r+1]]``;
* ``q_indices [Hkv, Tq*K]``: packed query ids, ascending inside each row, -1 past the head's
  nnz ``row_ptr[h, -1]``;
* ``slots [Hkv, Tq*K]``: the position ``s`` of the block in ``I[t, h, :]``, i.e. the slot of
  ``O_part [K, Tq, Hq, D]`` where K1 writes that (query, block) partial, -1 past the head's nnz.

Both flat arrays are sized ``Tq*K`` (the most edges a head can have), so every buffer has a size
known before the selection is read: a GPU launcher never needs a host round trip.

The GPU builds it in three data-parallel steps, which this module spells out one function each
(MiniMax's builder calls them hist, row_prefix and tile_prefix_smem + scatter; its build_row_map
is ``blocks.block_row_offsets``):

1. ``csr_histogram``: one thread per edge, ``atomicAdd(counts[h, row], 1)``;
2. ``exclusive_prefix_sum``: a scan of the counts per head gives ``row_ptr``;
3. ``csr_scatter``: one thread per edge writes its query id at ``row_ptr[h, row] + rank``, where
   ``rank`` is the number of queries with a smaller id in the same row. Taking ``rank`` from an
   atomic cursor instead would give the right set but store each row in whatever order the
   threads happened to run, so the GPU kernel must rank deterministically too (a prefix over
   query tiles plus a rank inside the tile); then reruns are bitwise identical and every row
   is sorted, which K1's gathers and the tests rely on.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_array, cu_to_host
from .blocks import block_row_offsets
from .select import check_block_indices

INT32_MAX = np.iinfo(np.int32).max


def _edge_rows(block_indices, cu_seqlens_q, cu_seqlens_k, block_size):
    """The q2k edges with their CSR rows, in the order the GPU's threads enumerate them.

    Returns ``(q2k, edge_row, rows)``: ``q2k`` int64 [Hkv, Tq, K] is ``I`` transposed to
    MiniMax's q2k layout; ``edge_row`` int64 [Hkv, Tq, K] is the CSR row of each edge, -1 where
    ``I`` is -1 (no edge); ``rows`` is the number of CSR rows. Flattening the last two axes of
    either array lists one head's edges in ascending query id ``t``, then slot ``s``.
    """
    I = check_block_indices(block_indices, cu_seqlens_q, cu_seqlens_k, block_size)  # [Tq, Hkv, K]
    cu_q = np.asarray(cu_to_host(cu_seqlens_q), dtype=np.int64)  # [B+1]
    cu_k = np.asarray(cu_to_host(cu_seqlens_k), dtype=np.int64)  # [B+1]
    row_offsets = block_row_offsets(cu_k, block_size)  # [B+1]
    batch = np.repeat(np.arange(cu_q.size - 1, dtype=np.int64), np.diff(cu_q))  # [Tq]
    q2k = np.transpose(np.asarray(I, dtype=np.int64), (1, 0, 2))  # [Hkv, Tq, K]
    # Block ids are batch-local; the row map turns (sequence, block) into one global row id.
    edge_row = np.where(q2k >= 0, row_offsets[batch][None, :, None] + q2k, -1)  # [Hkv, Tq, K]
    return q2k, edge_row, int(row_offsets[-1])


def csr_histogram(block_indices, cu_seqlens_q, cu_seqlens_k, block_size: int) -> np.ndarray:
    """Paper §4.2, step 1 of the reverse index: how many queries selected each (head, row).

    ``counts[h, row(b, j)] = #{t in sequence b : j in I[t, h, :]}``.

    Args:
        block_indices: I int [Tq, Hkv, K], batch-local block ids of the query's own sequence,
            unique per (t, h), -1 only at the tail (``select.check_block_indices``; the order
            inside a row is free: ``select_blocks`` returns it ascending).
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed-batch offsets (``Lq <= Lk`` per sequence).
        block_size: Bk >= 1.

    Returns:
        counts int32 [Hkv, rows], ``rows = block_row_offsets(cu_seqlens_k, Bk)[-1]``. Rows no
        query selected (blocks after the last query, sequences without queries) are 0; -1
        entries of ``I`` count nowhere.
    """
    _, edge_row, rows = _edge_rows(block_indices, cu_seqlens_q, cu_seqlens_k, block_size)
    hkv = edge_row.shape[0]
    counts = np.zeros((hkv, rows), dtype=np.int32)  # [Hkv, rows]
    h, t, s = np.nonzero(edge_row >= 0)  # [nnz] each: one GPU thread per edge
    # The GPU does atomicAdd(&counts[h, row], 1); np.add.at is its unbuffered NumPy twin.
    # Integer additions commute, so the counts are deterministic despite the atomics.
    np.add.at(counts, (h, edge_row[h, t, s]), 1)
    return counts


def exclusive_prefix_sum(counts) -> np.ndarray:
    """Paper §4.2, step 2 of the reverse index: ``row_ptr`` from the per-row counts.

    ``row_ptr[h, 0] = 0``, ``row_ptr[h, r+1] = row_ptr[h, r] + counts[h, r]`` (a per-head scan).

    Args:
        counts: int [Hkv, rows], non-negative (``csr_histogram``'s output).

    Returns:
        row_ptr int32 [Hkv, rows+1], non-decreasing; ``row_ptr[h, -1]`` is head ``h``'s nnz.

    Raises:
        ValueError if a count is negative, or if a head's nnz exceeds 2**31-1 (int32 offsets
        would wrap; at K=16 that is 134M queries per head).
    """
    check_array("counts", counts, ndim=2, dtypes=("int",))
    counts = np.asarray(cu_to_host(counts), dtype=np.int64)  # [Hkv, rows]
    if np.any(counts < 0):
        raise ValueError(f"counts must be >= 0, got min {counts.min()}")
    # Accumulate in int64 so that an overflow is detected rather than wrapped.
    inclusive = np.cumsum(counts, axis=1)  # [Hkv, rows]
    nnz = inclusive[:, -1] if counts.shape[1] else np.zeros(counts.shape[0], np.int64)  # [Hkv]
    if np.any(nnz > INT32_MAX):
        raise ValueError(
            f"counts sum to {int(nnz.max())} edges in one head, more than int32 row_ptr can hold "
            f"(2**31-1); split the batch")
    row_ptr = np.zeros((counts.shape[0], counts.shape[1] + 1), dtype=np.int32)  # [Hkv, rows+1]
    row_ptr[:, 1:] = inclusive
    return row_ptr


def csr_scatter(block_indices, row_ptr, cu_seqlens_q, cu_seqlens_k, block_size: int):
    """Paper §4.2, step 3 of the reverse index: write every edge's query id into its CSR row.

    Edge ``(h, t, s)`` with row ``r = row(batch(t), I[t, h, s])`` lands at
    ``e = row_ptr[h, r] + rank``, ``rank = #{t' < t : query t' selected row r in head h}``:
    ``q_indices[h, e] = t`` and ``slots[h, e] = s``. A query lists a block at most once, so
    ranks inside a row are distinct and the positions fill the row exactly.

    Args:
        block_indices: I int [Tq, Hkv, K] (see ``csr_histogram``).
        row_ptr: int [Hkv, rows+1], exactly ``exclusive_prefix_sum(csr_histogram(...))`` of the
            same selection.
        cu_seqlens_q, cu_seqlens_k: int [B+1].
        block_size: Bk >= 1.

    Returns:
        ``(q_indices, slots)``, int32 [Hkv, Tq*K] each. Inside a row queries are ascending;
        entries past ``row_ptr[h, -1]`` are -1.

    Raises:
        ValueError if ``row_ptr`` has the wrong shape or does not belong to ``block_indices``
        (scattering with foreign offsets would write outside the rows).
    """
    q2k, edge_row, rows = _edge_rows(block_indices, cu_seqlens_q, cu_seqlens_k, block_size)
    hkv, tq, topk = q2k.shape
    check_array("row_ptr", row_ptr, ndim=2, dtypes=("int",), shape=(hkv, rows + 1))
    row_ptr = np.asarray(cu_to_host(row_ptr), dtype=np.int64)  # [Hkv, rows+1]
    counts = np.zeros((hkv, rows), dtype=np.int64)  # [Hkv, rows]
    h, t, s = np.nonzero(edge_row >= 0)  # [nnz], ordered by (h, t, s)
    r = edge_row[h, t, s]  # [nnz]
    np.add.at(counts, (h, r), 1)
    if not np.array_equal(row_ptr[:, 1:] - row_ptr[:, :-1], counts) or np.any(row_ptr[:, 0] != 0):
        raise ValueError(
            "row_ptr must be exclusive_prefix_sum(csr_histogram(block_indices, ...)) of the same "
            "block_indices, cu_seqlens and block_size")

    # rank = number of earlier queries in the same (head, row). Edges are enumerated in
    # ascending t, so a stable sort by (h, row) keeps each row's queries in t order and an
    # edge's rank is its distance from the start of its run: deterministic, unlike a cursor
    # bumped by atomicAdd.
    key = h * rows + r  # [nnz]
    order = np.argsort(key, kind="stable")  # [nnz]
    run_start = np.zeros(hkv * rows, dtype=np.int64)  # [Hkv*rows] first sorted edge of each row
    run_start[1:] = np.cumsum(counts.reshape(-1))[:-1]
    rank = np.empty_like(order)  # [nnz]
    rank[order] = np.arange(order.size) - run_start[key[order]]
    e = row_ptr[h, r] + rank  # [nnz] destination inside head h's flat arrays

    q_indices = np.full((hkv, tq * topk), -1, dtype=np.int32)  # [Hkv, Tq*K]
    slots = np.full((hkv, tq * topk), -1, dtype=np.int32)  # [Hkv, Tq*K]
    q_indices[h, e] = t
    slots[h, e] = s
    return q_indices, slots


def build_csr(block_indices, cu_seqlens_q, cu_seqlens_k, block_size: int):
    """Paper §4.2: the k2q reverse index of a selection (histogram -> prefix sum -> scatter).

    Args:
        block_indices: I int [Tq, Hkv, K], batch-local block ids, unique per (t, h), -1 only at
            the tail (see ``csr_histogram``).
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed-batch offsets.
        block_size: Bk >= 1.

    Returns:
        ``(row_ptr, q_indices, slots)``: int32 [Hkv, rows+1], [Hkv, Tq*K], [Hkv, Tq*K]. For head
        ``h`` and row ``r`` (block ``j`` of sequence ``b``), ``q_indices[h, row_ptr[h, r]:
        row_ptr[h, r+1]]`` are the packed ids of the queries that selected it, ascending, and
        ``slots`` the position of ``j`` in each one's ``I[t, h, :]``. Flat entries past
        ``row_ptr[h, -1]`` (the head's nnz = number of entries >= 0 in ``I[:, h, :]``) are -1.
    """
    counts = csr_histogram(block_indices, cu_seqlens_q, cu_seqlens_k, block_size)  # [Hkv, rows]
    row_ptr = exclusive_prefix_sum(counts)  # [Hkv, rows+1]
    q_indices, slots = csr_scatter(block_indices, row_ptr, cu_seqlens_q, cu_seqlens_k, block_size)
    return row_ptr, q_indices, slots
