"""Paper §2.3, eq 3-4: GQA group mapping, KV-block partition and packed-batch positions.

Every other stage describes tokens by where they sit in a packed variable-length batch:

* ``cu_seqlens_q``/``cu_seqlens_k`` ([B+1] int) are prefix sums of the query/key lengths.
* A sequence's ``Lq`` queries are the *last* ``Lq`` of its ``Lk`` key positions (bottom-right
  causal alignment): query ``i`` of sequence ``b`` sits at key position ``Lk - Lq + i``, so a
  prefill has ``Lq = Lk`` and a decode step ``Lq = 1``.
* KV blocks are numbered per sequence (batch-local ids): block ``j`` of a sequence holds key
  positions ``[j*Bk, min((j+1)*Bk, Lk))`` (eq 4, 0-based), and the last block may be partial.
* The k2q CSR stores one row per (sequence, block); sequence ``b``'s blocks are rows
  ``row_offsets[b] .. row_offsets[b+1]-1``.
"""

from __future__ import annotations

import numpy as np

from .._batch import Batch
from .._checks import (check_block_size, check_cu_seqlens, check_gqa, check_offsets,
                       check_positive_int)


def gqa_group(num_q_heads: int, num_kv_heads: int) -> np.ndarray:
    """Eq 3: the KV head (GQA group) ``r = h // G`` that serves each query head ``h``.

    Returns int64 [Hq]. Heads ``r*G .. r*G+G-1`` form group ``H_r`` and share one selection.
    Raises TypeError for non-integer head counts, ValueError if ``Hkv`` does not divide ``Hq``.
    """
    g = check_gqa(num_q_heads, num_kv_heads)
    return np.arange(num_q_heads, dtype=np.int64) // g


def num_blocks(length: int, block_size: int) -> int:
    """Eq 4: ``B = ceil(N / Bk)``, the number of KV blocks of a sequence of ``length`` keys."""
    block_size = check_block_size(block_size)
    length = check_positive_int("length", length, low=0)
    return -(-length // block_size)


def block_partition(length: int, block_size: int) -> np.ndarray:
    """Eq 4: ``B_b = {b*Bk, ..., min((b+1)*Bk, N) - 1}`` (0-based) as int64 [B, 2] of [start, end)."""
    nb = num_blocks(length, block_size)
    start = np.arange(nb, dtype=np.int64) * block_size
    return np.stack([start, np.minimum(start + block_size, length)], axis=1)


def sequence_lengths(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """Validated ``(cu_q, cu_k, Lq, Lk)`` as int64 NumPy arrays ([B+1], [B+1], [B], [B])."""
    total_q = check_positive_int("total_q", total_q, low=0)
    total_k = check_positive_int("total_k", total_k, low=0)
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    return cu_q, cu_k, np.diff(cu_q), np.diff(cu_k)


def max_blocks(cu_seqlens_k, block_size: int) -> int:
    """``NB = ceil(max Lk / Bk)``: the last axis of ``block_scores`` (0 for an empty batch)."""
    return Batch.of(None, cu_seqlens_k, check_block_size(block_size)).nb


def query_positions(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """Where every packed query sits, with bottom-right causal alignment.

    Returns ``(batch, pos)``, both int64 [Tq]: ``batch[t]`` is the sequence of query ``t`` and
    ``pos[t]`` its key position inside that sequence (``Lk - Lq + i`` for its ``i``-th query).
    Query ``t`` sees exactly the keys ``cu_k[batch[t]] + j`` for ``0 <= j <= pos[t]``.
    """
    cu_q, cu_k, lq, lk = sequence_lengths(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    batch = np.repeat(np.arange(lq.size, dtype=np.int64), lq)  # [Tq]
    local = np.arange(total_q, dtype=np.int64) - cu_q[batch]  # [Tq] index inside the sequence
    pos = (lk - lq)[batch] + local  # [Tq]
    return batch, pos


def key_positions(cu_seqlens_k, total_k: int):
    """``(batch, pos)`` int64 [Tk]: the sequence of each packed key and its position in it."""
    total_k = check_positive_int("total_k", total_k, low=0)
    cu_k = check_offsets("cu_seqlens_k", cu_seqlens_k, total_k)
    lk = np.diff(cu_k)
    batch = np.repeat(np.arange(lk.size, dtype=np.int64), lk)  # [Tk]
    return batch, np.arange(total_k, dtype=np.int64) - cu_k[batch]


def local_blocks(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, block_size: int) -> np.ndarray:
    """Paper §3.2: the local block ``floor(pos / Bk)`` of each query, int64 [Tq] (batch-local id)."""
    block_size = check_block_size(block_size)
    _, pos = query_positions(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    return pos // block_size


def block_row_offsets(cu_seqlens_k, block_size: int) -> np.ndarray:
    """Row offsets of the k2q CSR, int64 [B+1]: sequence ``b`` owns rows ``[off[b], off[b+1])``.

    One row per (sequence, KV block); ``off[-1]`` is the total number of rows.
    """
    return Batch.of(None, cu_seqlens_k, check_block_size(block_size)).row_offsets.copy()


def visible_block_mask(pos: np.ndarray, num_blocks_total: int, block_size: int) -> np.ndarray:
    """bool [T, NB]: block ``b`` holds at least one key a query at ``pos`` may see (``b*Bk <= pos``)."""
    b = np.arange(num_blocks_total, dtype=np.int64)
    return b[None, :] * block_size <= np.asarray(pos)[:, None]
