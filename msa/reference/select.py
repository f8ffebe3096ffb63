"""Paper §3.2 eq 7 and §2.2: which KV blocks each (query, GQA group) reads.

``select_blocks`` is the learned selector, the exp-free top-k of eq 7 with the final recipe of
§3.2: the query's own (usually incomplete) local block ``floor(pos / Bk)`` is always selected and
the index scores choose the other ``K - 1``:

.. math:: \\mathcal{I}^{(r)}_i = \\{\\lfloor pos_i / B_k \\rfloor\\} \\cup
          \\mathrm{TopK}_{b \\ne \\lfloor pos_i / B_k \\rfloor}(M^{idx,(r)}_{i,\\cdot},\\ k - 1)

Only the order of the scores matters, so no softmax (and no exp) is ever taken. ``fixed_blocks``
is §2.2's position-only indexer with the same budget (attention sink + sliding window), the
baseline of the paper's FLOPs-matched ablation. ``check_block_indices`` validates a selection
from any source before the later stages (CSR, attention, KL) trust it.

Selection layout, shared by every stage: ``I [Tq, Hkv, K]`` int32, batch-local block ids,
ascending inside a (t, r) row, unique, ``-1`` padding only at the tail.
"""

from __future__ import annotations

import numpy as np

from .._batch import Batch
from .._checks import (INT32_MAX, INT64_MAX, check_array, check_block_size, check_offsets,
                       check_positive_int, check_topk, cu_to_host)
from .blocks import local_blocks

# fixed_blocks' num_kv_heads sizes its output: more than this is a mistake, not a model.
MAX_KV_HEADS = 1 << 16
# Elements of one [Hkv, chunk, NB] score tile: bounds the temporaries at any NB.
_TILE_ELEMENTS = 1 << 22


def _query_blocks(cu_seqlens_q, cu_seqlens_k, total_q: int, block_size: int):
    """Validated ``(local [Tq], seq_blocks [Tq])`` int64 and ``NB`` for a batch with ``total_q`` queries.

    ``local[t] = floor(pos_t / Bk)``; ``seq_blocks[t] = ceil(Lk / Bk)`` of query ``t``'s sequence.
    The packed key count is read from ``cu_seqlens_k[-1]``: the selection stages get no keys.
    """
    cu_k = check_offsets("cu_seqlens_k", cu_seqlens_k)
    batch = Batch.of(cu_seqlens_q, cu_k, block_size, total_q=total_q, total_k=int(cu_k[-1]))
    seq_blocks = np.diff(batch.row_offsets)  # [B]
    return batch.query_pos // block_size, seq_blocks[batch.query_batch], batch.nb


def select_blocks(block_scores, cu_seqlens_q, cu_seqlens_k, block_size: int, topk: int):
    """Paper eq 7 with the §3.2 final recipe: forced local block plus exp-free top-(k-1).

    Args:
        block_scores: M [Hkv, Tq, NB] float (any precision, compared as given), with
            ``NB = blocks.max_blocks(cu_seqlens_k, block_size)``, e.g. ``index.block_scores``.
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums (``Lq <= Lk``; bottom-right alignment).
        block_size: ``Bk`` >= 1 (``M``'s ``NB`` must match it: a ``block_size`` and ``topk``
            passed in the wrong order are caught there).
        topk: ``K``, blocks per (query, group), the local block included: in
            ``[1, max(NB, 64)]`` (``msa._checks.check_topk``), checked before ``I`` is allocated.

    Returns:
        I [Tq, Hkv, K] int32. Row ``I[t, r]`` holds, ascending:

        * the local block ``L = floor(pos_t / Bk)``, always, whatever its score;
        * the ``K - 1`` highest-scoring candidates ``b < L`` (ties to the smaller id);
        * ``-1`` in the trailing slots when there are fewer than ``K - 1`` candidates
          (``NB < K``, early queries).

    Candidates are the blocks ``b < L`` whose score is neither ``-inf`` nor NaN. The score of a
    block after the local one (``b > L``: every key is in the future) or past the end of the
    query's sequence is never read, so such a block is not selected even if the caller put a
    finite value there. ``+inf`` is a valid (top) score.
    """
    block_size = check_block_size(block_size)
    check_array("block_scores", block_scores, ndim=3, dtypes=("float",))
    hkv, tq, nb_given = (int(s) for s in block_scores.shape)
    if hkv < 1:
        raise ValueError(f"block_scores must have Hkv >= 1 rows, got shape {tuple(block_scores.shape)}")
    local, _, nb = _query_blocks(cu_seqlens_q, cu_seqlens_k, tq, block_size)  # [Tq]
    if nb_given != nb:
        raise ValueError(
            f"block_scores must have NB = ceil(max Lk / block_size) = {nb} columns "
            f"(block_size={block_size}; the order is block_size, topk), got shape "
            f"{tuple(block_scores.shape)}")
    topk = check_topk(topk, nb, block_size)
    M = np.asarray(cu_to_host(block_scores))
    I = np.full((hkv, tq, topk), -1, dtype=np.int32)  # [Hkv, Tq, K], transposed at the end
    chunk = max(1, _TILE_ELEMENTS // max(1, hkv * nb))
    for t0 in range(0, tq, chunk):
        t1 = min(t0 + chunk, tq)
        I[:, t0:t1] = _select_chunk(M[:, t0:t1], local[t0:t1], topk)
    return np.ascontiguousarray(I.transpose(1, 0, 2))


def _select_chunk(M, local, topk: int):
    """``select_blocks`` for one chunk: M [Hkv, c, NB], local [c] -> [Hkv, c, K] int32."""
    hkv, c = M.shape[:2]
    width = int(local.max()) + 1  # no query of the chunk can select a block beyond its local one
    b = np.arange(width)  # [W]
    candidate = b[None, :] < local[:, None]  # [c, W]
    # -inf marks a non-candidate; `s > -inf` is False for NaN too.
    s = M[:, :, :width]  # [Hkv, c, W]
    s = np.where(candidate[None] & (s > -np.inf), s, -np.inf)  # [Hkv, c, W]
    chosen = np.zeros(s.shape, dtype=bool)  # [Hkv, c, W]
    kk = min(topk - 1, width)
    if kk > 0:
        # v: the kk-th largest score of each row. Every score above v is chosen; the rest of the
        # kk slots go to the scores equal to v, smallest block id first (the tie rule).
        v = np.partition(s, width - kk, axis=-1)[..., width - kk, None]  # [Hkv, c, 1]
        above = s > v  # [Hkv, c, W]
        tie = s == v  # [Hkv, c, W]
        need = kk - above.sum(axis=-1, keepdims=True)  # [Hkv, c, 1]
        chosen = above | (tie & (np.cumsum(tie, axis=-1, dtype=np.int32) <= need))
        chosen &= s > -np.inf  # when v = -inf the "ties" are non-candidates
    chosen[:, np.arange(c), local] = True
    # Scatter each row's chosen ids, already ascending, into slots 0..count-1.
    slot = np.cumsum(chosen, axis=-1, dtype=np.int32) - 1  # [Hkv, c, W]
    r, t, blk = np.nonzero(chosen)
    out = np.full((hkv, c, topk), -1, dtype=np.int32)  # [Hkv, c, K]
    out[r, t, slot[r, t, blk]] = blk
    return out


def fixed_blocks(cu_seqlens_q, cu_seqlens_k, block_size: int, topk: int, *, num_kv_heads: int,
                 num_sink: int = 1):
    """Paper §2.2: the fixed-rule indexer, attention sink plus sliding window, budget ``K`` blocks.

    The selection depends on positions only, never on content: for a query whose local block is
    ``L = floor(pos / Bk)``,

    * if ``L + 1 <= K`` (all its visible blocks fit), blocks ``0..L`` then ``-1`` padding;
    * otherwise the sink blocks ``0..s-1`` with ``s = min(num_sink, K - 1)`` and the window of
      the ``K - s`` most recent blocks ``L-K+s+1 .. L``, the local block included.

    The local block always takes a slot, so at most ``K - 1`` sinks are kept (``num_sink >= K``
    gives ``K - 1`` sinks and the local block); ``num_sink = 0`` is a pure sliding window.

    Args:
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums (``Lq <= Lk``; bottom-right alignment).
        block_size: ``Bk`` >= 1. topk: ``K`` in ``[1, max(NB, 64)]`` (``check_topk``).
        num_kv_heads: keyword-only ``Hkv`` in ``[1, 65536]``; every group gets the same row.
        num_sink: keyword-only, >= 0.

    Returns:
        I [Tq, Hkv, K] int32, ascending rows, ``-1`` only at the tail, as ``select_blocks``.
    """
    block_size = check_block_size(block_size)
    hkv = check_positive_int("num_kv_heads", num_kv_heads, high=MAX_KV_HEADS)
    num_sink = check_positive_int("num_sink", num_sink, low=0)
    cu_q = check_offsets("cu_seqlens_q", cu_seqlens_q)
    local, _, nb = _query_blocks(cu_q, cu_seqlens_k, int(cu_q[-1]), block_size)  # [Tq]
    topk = check_topk(topk, nb, block_size)
    if local.size * hkv * topk > INT32_MAX:
        raise ValueError(f"num_kv_heads={hkv} is too large: I [Tq, Hkv, K] = [{local.size}, "
                         f"{hkv}, {topk}] would hold more than 2**31 - 1 entries (the CSR's int32 "
                         "index space)")
    sinks = min(num_sink, topk - 1)
    j = np.arange(topk, dtype=np.int64)  # [K] slot
    L = local[:, None]  # [Tq, 1]
    all_fit = np.where(j[None, :] <= L, j[None, :], -1)  # [Tq, K]: blocks 0..L, then -1
    # Slot j < s holds sink j; slot j >= s holds window block L - K + 1 + j (so slot K-1 is L).
    sink_window = np.where(j[None, :] < sinks, j[None, :], L - topk + 1 + j[None, :])  # [Tq, K]
    row = np.where(L + 1 <= topk, all_fit, sink_window).astype(np.int32)  # [Tq, K]
    return np.ascontiguousarray(np.broadcast_to(row[:, None, :], (row.shape[0], hkv, topk)))


def check_block_indices(block_indices, cu_seqlens_q, cu_seqlens_k, block_size: int):
    """Validate a selection ``I [Tq, Hkv, K]`` from any source; return a host int64 copy.

    Rules, per (query ``t``, group ``r``) row:

    * every entry is ``-1`` or a block of the query's own sequence, ``0 <= b < ceil(Lk / Bk)``.
      A block after the query's local block is allowed: it holds only future keys, which the
      token-level causal mask of attention and KL removes, so it contributes nothing;
    * no block appears twice (``-1`` excepted);
    * ``-1`` appears only at the tail (after the last real block).

    Rows need not be ascending (``select_blocks`` and ``fixed_blocks`` return ascending rows, but
    every later stage is order-independent). ``K >= 1``.

    Raises:
        TypeError: not an integer array. ValueError: wrong rank, ``Tq`` not matching
        ``cu_seqlens_q``, bad ``cu_seqlens``, or a bad row; the message names ``block_indices``,
        the first offending ``(t, r)`` (row-major) and what is wrong with it.
    """
    block_size = check_block_size(block_size)
    check_array("block_indices", block_indices, ndim=3, dtypes=("int",))
    tq, hkv, topk = (int(s) for s in block_indices.shape)
    if topk < 1 or hkv < 1:
        raise ValueError(f"block_indices must have shape [Tq, Hkv >= 1, K >= 1], got {(tq, hkv, topk)}")
    _, seq_blocks, _ = _query_blocks(cu_seqlens_q, cu_seqlens_k, tq, block_size)  # [Tq]
    given = np.asarray(cu_to_host(block_indices))  # [Tq, Hkv, K]
    # no wrap to -1: an unsigned id int64 cannot hold becomes INT64_MAX, out of range below
    I = np.array(np.minimum(given, np.uint64(INT64_MAX)) if given.dtype.kind == "u" else given,
                 dtype=np.int64)  # [Tq, Hkv, K], a copy
    real = I >= 0  # [Tq, Hkv, K]
    out_of_range = ((I < -1) | (I >= seq_blocks[:, None, None])).any(axis=-1)  # [Tq, Hkv]
    hole = (real[..., 1:] & ~real[..., :-1]).any(axis=-1)  # [Tq, Hkv]: a block after a -1
    ordered = np.sort(I, axis=-1)  # [Tq, Hkv, K]
    duplicate = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(axis=-1)
    bad = out_of_range | hole | duplicate  # [Tq, Hkv]
    if bad.any():
        t, r = (int(i) for i in np.argwhere(bad)[0])
        why = []
        if out_of_range[t, r]:
            why.append(f"entries must be -1 or in [0, {int(seq_blocks[t])}) (the blocks of its sequence)")
        if duplicate[t, r]:
            why.append("a block appears twice")
        if hole[t, r]:
            why.append("-1 padding must come after every real block")
        raise ValueError(f"block_indices[t={t}, r={r}] = {given[t, r].tolist()} is invalid: "
                         f"{'; '.join(why)}")
    return I


def nonempty_supports(block_indices, cu_seqlens_q, cu_seqlens_k, block_size: int) -> np.ndarray:
    """bool [Tq, Hkv]: the support of (query ``t``, group ``r``) holds at least one key.

    That is, ``I[t, r]`` lists a block ``b <= floor(pos_t / Bk)`` (a block after the query's
    local block holds only future keys). ``block_indices`` is a selection already validated by
    :func:`check_block_indices` (host, integer); ``block_indices=None`` is the warmup's full
    causal support, never empty. What ``msa._checks.check_lse`` needs to check a forward's LSE.
    """
    cu_q = check_offsets("cu_seqlens_q", cu_seqlens_q)
    cu_k = check_offsets("cu_seqlens_k", cu_seqlens_k)
    local = local_blocks(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]), block_size)  # [Tq]
    if block_indices is None:
        return np.ones((local.size, 1), dtype=bool)
    I = np.asarray(block_indices)  # [Tq, Hkv, K]
    return ((I >= 0) & (I <= local[:, None, None])).any(axis=-1)
