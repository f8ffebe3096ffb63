"""Paper §3.1, eq 5-6 and 11: the index branch, from hidden states to causal block scores.

The index branch is two extra projections (eq 5): one index query head per GQA group and a single
index key head shared by every group. Its token scores (eq 6, left)

.. math:: S^{idx,(r)}_{i,j} = Q^{idx,(r)}_i \\cdot K^{idx}_j / \\sqrt{d_{idx}}

are max-pooled over the causally visible keys of each KV block (eq 6, right)

.. math:: M^{idx,(r)}_{i,b} = \\max_{j \\in \\mathcal{B}_b,\\ j \\le i} S^{idx,(r)}_{i,j}

so the top-k of eq 7 ranks ``NB = ceil(N / Bk)`` candidates instead of ``N``. ``block_scores``
never holds the whole ``[Hkv, Tq, Tk]`` score tensor (512 MiB at 8K tokens in bf16, terabytes at
1M): it scores one chunk of queries against its sequence's keys, pools, and drops the chunk,
as the fused kernel does tile by tile. ``index_scores`` does materialise it, for small problems
and for the token-level KL of eq 9-10.

Positions follow ``msa.reference.blocks``: a sequence's ``Lq`` queries are the last ``Lq`` of its
``Lk`` keys, and query ``t`` at position ``pos`` sees the keys ``0..pos`` of its own sequence.
"""

from __future__ import annotations

import math

import numpy as np

from .._batch import Batch
from .._checks import (FLOAT_DTYPES, check_array, check_block_size, check_positive_int,
                       check_same_dtype, check_scale, cu_to_host)
from .blocks import key_positions

POOLS = ("max", "mean")

# Elements of one [Hkv, chunk, keys] score tile in ``block_scores``: 4M floats (16 MiB in float32)
# keeps the tile in a few cache-friendly passes and bounds memory at any sequence length.
_TILE_ELEMENTS = 1 << 22


def _compute_dtype(dt: np.dtype) -> np.dtype:
    """float64 stays float64; float16 and float32 compute (and return) in float32."""
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def index_projections(x, w_q_idx, w_k_idx, num_kv_heads: int):
    """Paper eq 5 and 11: index queries and the shared index key, ``sg(X) W^idx``.

    .. math:: Q^{idx} = \\mathrm{sg}(X) W^{idx}_q, \\quad K^{idx} = \\mathrm{sg}(X) W^{idx}_k

    Args:
        x: [T, d_model] float16/32/64 hidden states (packed tokens of every sequence).
        w_q_idx: [d_model, Hkv * Didx], same dtype as ``x``. Column ``r * Didx + d`` feeds
            feature ``d`` of group ``r``'s index query (head-major, as a reshape of ``X W`` gives).
        w_k_idx: [d_model, Didx], same dtype as ``x``: one index key head for all groups.
        num_kv_heads: ``Hkv``, the number of GQA groups (one index query head each).

    Returns:
        ``(q_idx [T, Hkv, Didx], k_idx [T, Didx])``, float64 for float64 input, float32 otherwise.

    Stop-gradient (eq 11): the index branch reads ``X`` *detached*. The KL loss of eq 10 trains
    only ``W^idx_q`` and ``W^idx_k``; without the detach its gradient would flow back through
    ``X`` into the residual stream and pull the whole backbone towards the indexer. NumPy has no
    autograd, so this function is the same with or without it; a framework must call it on
    ``x.detach()`` (msa's torch layer does). The gradients that do exist are
    ``dW^idx_q = X^T dQ^idx`` (with ``dQ^idx`` reshaped to [T, Hkv * Didx]) and
    ``dW^idx_k = X^T dK^idx``; there is no ``dX`` term.
    """
    check_array("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    d_model = int(x.shape[1])
    check_array("w_q_idx", w_q_idx, ndim=2, dtypes=FLOAT_DTYPES, shape=(d_model, None))
    check_array("w_k_idx", w_k_idx, ndim=2, dtypes=FLOAT_DTYPES, shape=(d_model, None))
    dt = check_same_dtype(x=x, w_q_idx=w_q_idx, w_k_idx=w_k_idx)
    hkv = check_positive_int("num_kv_heads", num_kv_heads)
    d_idx = int(w_k_idx.shape[1])
    if d_idx < 1:
        raise ValueError(f"w_k_idx must have Didx >= 1 columns, got shape {tuple(w_k_idx.shape)}")
    if w_q_idx.shape[1] != hkv * d_idx:
        raise ValueError(
            f"w_q_idx must have Hkv * Didx = {hkv} * {d_idx} = {hkv * d_idx} columns "
            f"(num_kv_heads times the columns of w_k_idx), got shape {tuple(w_q_idx.shape)}")
    cdt = _compute_dtype(dt)
    x, w_q_idx, w_k_idx = (np.asarray(cu_to_host(a)).astype(cdt, copy=False)
                           for a in (x, w_q_idx, w_k_idx))  # host copies
    q_idx = (x @ w_q_idx).reshape(-1, hkv, d_idx)  # [T, Hkv, Didx]
    k_idx = x @ w_k_idx  # [T, Didx]
    return q_idx, k_idx


def _check_index_inputs(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, scale, block_size=1):
    """Validate eq 6 inputs; return ``(q_idx, k_idx)`` in the compute dtype, the batch, scale."""
    check_array("q_idx", q_idx, ndim=3, dtypes=FLOAT_DTYPES)
    tq, hkv, d_idx = (int(s) for s in q_idx.shape)
    if hkv < 1 or d_idx < 1:
        raise ValueError(f"q_idx must have shape [Tq, Hkv >= 1, Didx >= 1], got {tuple(q_idx.shape)}")
    check_array("k_idx", k_idx, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, d_idx))
    dt = check_same_dtype(q_idx=q_idx, k_idx=k_idx)
    tk = int(k_idx.shape[0])
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d_idx))
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=tq, total_k=tk)
    cdt = _compute_dtype(dt)
    q = np.asarray(cu_to_host(q_idx)).astype(cdt, copy=False)  # [Tq, Hkv, Didx]
    k = np.asarray(cu_to_host(k_idx)).astype(cdt, copy=False)  # [Tk, Didx]
    return q, k, batch, scale


def index_scores(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, *, scale=None):
    """Paper eq 6 (left): every causal index score ``S = (q_idx . k_idx) * scale``, materialised.

    Args:
        q_idx: [Tq, Hkv, Didx] float16/32/64 index queries.
        k_idx: [Tk, Didx], same dtype: the shared index key head.
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums (``Lq <= Lk`` per sequence; queries are
            the last ``Lq`` key positions).
        scale: keyword-only, multiplies the dot product; default ``1 / sqrt(Didx)``.

    Returns:
        S [Hkv, Tq, Tk], float64 for float64 input, float32 otherwise. ``S[r, t, j]`` is the score
        of packed key ``j`` for group ``r``'s index query at packed query ``t``, and ``-inf``
        where query ``t`` cannot see key ``j`` (another sequence, or a later position). A row
        always has at least its own position visible.

    Memory is ``Hkv * Tq * Tk`` floats: use it for small problems and the token-level KL;
    ``block_scores`` is the scalable eq 6.
    """
    q, k, batch, scale = _check_index_inputs(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, scale)
    batch_q, pos_q = batch.query_batch, batch.query_pos  # [Tq]
    batch_k, pos_k = key_positions(batch.cu_k, k.shape[0])  # [Tk]
    # The dot product is taken first and scaled afterwards, exactly as in block_scores, so that
    # float64 results of the two agree bit for bit.
    S = np.matmul(q.transpose(1, 0, 2), k.T)  # [Hkv, Tq, Tk]
    S *= scale
    hidden = (batch_q[:, None] != batch_k[None, :]) | (pos_k[None, :] > pos_q[:, None])  # [Tq, Tk]
    S[:, hidden] = -np.inf
    return S


def block_scores(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size: int, *, scale=None,
                 pool="max"):
    """Paper eq 6 (right): causal block max-pool ``M[r, t, b] = max_{j in block b, j <= pos_t} S``.

    Args:
        q_idx: [Tq, Hkv, Didx] float16/32/64 index queries.
        k_idx: [Tk, Didx], same dtype: the shared index key head.
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums (``Lq <= Lk``; bottom-right alignment).
        block_size: ``Bk`` >= 1; block ``b`` of a sequence holds its key positions
            ``[b*Bk, min((b+1)*Bk, Lk))``.
        scale: keyword-only, multiplies the dot product; default ``1 / sqrt(Didx)``.
        pool: ``"max"`` (the paper's operator) or ``"mean"``, the mean over the *visible* keys of
            the block, i.e. MoBA's mean-key score (§3.1 contrasts the two: max keeps a single
            strongly matching "needle" token, mean dilutes it by ``Bk``).

    Returns:
        M [Hkv, Tq, NB] with ``NB = blocks.max_blocks(cu_seqlens_k, block_size)``, float64 for
        float64 input, float32 otherwise. ``M[r, t, b]`` is ``-inf`` when no key of block ``b``
        is visible to query ``t``: blocks after its own position, and blocks past the end of a
        sequence shorter than the longest one. Its local block ``floor(pos / Bk)`` is pooled over
        the keys ``<= pos`` only, so token causality holds inside it. With finite scores a row
        has exactly ``floor(pos / Bk) + 1`` finite entries, blocks ``0..floor(pos / Bk)``.
        NaN scores: the max is an ``fmax`` from ``-inf`` (CUDA's ``fmaxf``), so a NaN score is
        skipped and a block whose visible scores are all NaN is ``-inf``; the mean propagates NaN.

    The full ``[Hkv, Tq, Tk]`` tensor is never built: for each sequence and each chunk of its
    queries, the keys up to the chunk's last position are scored, padded with ``-inf`` to whole
    blocks, viewed as ``[nb, Bk]`` and reduced over the block axis.
    """
    block_size = check_block_size(block_size)
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    q, k, batch, scale = _check_index_inputs(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, scale,
                                             block_size)
    pos_q, cu_q, cu_k = batch.query_pos, batch.cu_q, batch.cu_k
    hkv = q.shape[1]
    nb_max = batch.nb
    # A block longer than every sequence is one block per sequence, whatever its size: pad the
    # keys to at most the longest sequence, not to Bk.
    block_size = min(block_size, max(int(batch.lk.max()) if batch.lk.size else 1, 1))
    M = np.full((hkv, q.shape[0], nb_max), -np.inf, dtype=q.dtype)  # [Hkv, Tq, NB]
    for b in range(cu_q.size - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        nb_seq = -(-(k1 - k0) // block_size)
        # Keys padded with zeros to whole blocks, so that a tile is a plain matmul; the padded
        # columns are masked like future keys before pooling.
        k_pad = np.zeros((nb_seq * block_size, k.shape[1]), dtype=q.dtype)  # [nb_seq*Bk, Didx]
        k_pad[: k1 - k0] = k[k0:k1]
        chunk = max(1, _TILE_ELEMENTS // (hkv * nb_seq * block_size))
        for t0 in range(q0, q1, chunk):
            t1 = min(t0 + chunk, q1)
            pos = pos_q[t0:t1]  # [c] ascending inside a sequence
            nb = int(pos[-1]) // block_size + 1  # blocks any query of the chunk can see
            S = np.matmul(q[t0:t1].transpose(1, 0, 2), k_pad[: nb * block_size].T)  # [Hkv, c, nb*Bk]
            S *= scale
            # Only keys after the chunk's first position can be hidden from some of its queries.
            j = np.arange(int(pos[0]) + 1, nb * block_size)  # [n_tail]
            hidden = j[None, :] > pos[:, None]  # [c, n_tail]
            tail = S[:, :, int(pos[0]) + 1:]  # [Hkv, c, n_tail], a view
            S_blocks = S.reshape(hkv, t1 - t0, nb, block_size)  # [Hkv, c, nb, Bk]
            if pool == "max":
                tail[:, hidden] = -np.inf
                # acc = -inf; acc = fmax(acc, s) over the block, as a kernel accumulates it
                # (fmax is also several times faster than max in NumPy).
                M[:, t0:t1, :nb] = np.fmax.reduce(S_blocks, axis=-1, initial=-np.inf)  # [Hkv, c, nb]
            else:
                tail[:, hidden] = 0.0
                first = np.arange(nb, dtype=np.int64) * block_size  # [nb]
                count = np.clip(pos[:, None] + 1 - first[None, :], 0, block_size)  # [c, nb]
                total = S_blocks.sum(axis=-1)  # [Hkv, c, nb]
                with np.errstate(invalid="ignore", divide="ignore"):
                    M[:, t0:t1, :nb] = np.where(count > 0, total / count.astype(q.dtype), -np.inf)
    return M
