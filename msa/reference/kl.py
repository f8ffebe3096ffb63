"""Paper §3.2, eq 9-11: the KL loss that trains the index branch, and its analytic backward.

Top-k is not differentiable, so the language-model loss never reaches ``W^idx_q, W^idx_k``. The
paper supervises the indexer directly: on the token support ``I_tok(t, r)`` induced by the blocks
that group ``r`` selected for query ``t`` (the causally visible keys of those blocks), the index
branch's softmax (the student) should match the main branch's attention (the teacher).

.. math::

    P^{idx,(r)}_{t,j} = \\frac{\\exp S^{idx,(r)}_{t,j}}{\\sum_{u \\in I_{tok}} \\exp S^{idx,(r)}_{t,u}},
    \\qquad
    P^{(r)}_{t,j} = \\frac{1}{G} \\sum_{h \\in H_r}
        \\exp\\big(S^{(h)}_{t,j} - \\mathrm{LSE}^{(h)}_t\\big)
    \\qquad \\text{(eq 9)}

    L_{KL} = \\frac{1}{T_q H_{kv}} \\sum_t \\sum_r D_{KL}\\big(\\mathrm{sg}(P^{(r)}_{t,\\cdot})
    \\,\\|\\, P^{idx,(r)}_{t,\\cdot}\\big) \\qquad \\text{(eq 10)}

with ``S^idx = (q_idx . k_idx) * index_scale`` (default ``1/sqrt(Didx)``) and ``S^(h) = (q . k) *
scale`` (default ``1/sqrt(D)``). The teacher averages the *probabilities* of the ``G`` heads of
the group (a head that attends to ``j`` keeps at least ``1/G`` of its mass there), not their
logits. Its normaliser ``LSE^(h)_t`` is the main branch's log-sum-exp over the same support,
which the sparse attention forward already wrote (``sparse_attention`` returns it); reusing it
is how the GPU avoids a second softmax pass over ``Q K^T``.

Gradients (eq 10-11). The teacher is held constant (``stopgrad(P)``) and ``q_idx, k_idx`` come
from ``stopgrad(X)``, so ``L_KL`` trains only the two index projections: ``kl_backward`` returns
``dq_idx`` and ``dk_idx`` and nothing for ``q`` or ``k``. With ``sum_j P_j = 1``,

.. math:: \\partial D_{KL}(P \\| P^{idx}) / \\partial S^{idx}_j = P^{idx}_j - P_j

so ``dS = grad_loss (P^idx - P) / (Tq Hkv)`` on the support, ``dq_idx = index_scale dS k_idx``
and ``dk_idx = index_scale dS^T q_idx``.

Warmup (§3.2, mechanism three): ``block_indices=None`` takes the support to be every causally
visible key (the main branch is then dense attention and ``lse`` its LSE).

Loop order. ``kl_loss`` and ``kl_backward`` never build the ``[Hkv, Tq, Tk]`` scores. They visit
each selected (group, key block) once with all the queries that selected it (the KV-outer order
of §4.2, built here with a sort instead of the CSR), score that ``[n, G, Bk]`` tile with one
matmul and reduce it into per-(query, group, slot) partial sums, which are summed over the slots
in slot order. Keys are read once per block instead of once per query, and ``dk_idx`` is a plain
``dS^T q_idx`` per block rather than a scatter. ``student_probs`` and ``teacher_probs`` are the
dense, materialised versions for small problems.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .._batch import Batch
from .._checks import (FLOAT_DTYPES, check_array, check_block_size, check_flag, check_gqa,
                       check_lse, check_positive_int, check_same_dtype, check_scale,
                       cu_to_host)
from ._mask import attend
from .blocks import block_row_offsets, key_positions, max_blocks, visible_block_mask
from .select import check_block_indices, nonempty_supports

# Elements of one [n, G, Bk] teacher score tile (the functions' ``tile_elements``): 4M floats
# bounds memory at any sequence length (the warmup gives one key block thousands of queries) and
# keeps each matmul large.
TILE_ELEMENTS = 1 << 22


def _compute_dtype(dt: np.dtype) -> np.dtype:
    """float64 stays float64; float16 and float32 compute (and return) in float32."""
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    """``log(sum(exp(x)))`` along ``axis``; ``-inf`` where every entry is ``-inf`` or none exist."""
    if x.shape[axis] == 0:
        return np.full(np.delete(x.shape, axis), -np.inf, dtype=x.dtype)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.squeeze(m, axis=axis) + np.log(np.sum(np.exp(x - m), axis=axis))


def _sum_slots(x: np.ndarray) -> np.ndarray:
    """Sum over the last (slot) axis in slot order, one slot at a time.

    Unlike NumPy's pairwise ``sum``, the result does not depend on how many trailing empty
    (zero) slots there are, so ``K > NB`` and the warmup give bitwise the same numbers.
    """
    out = np.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(x.shape[-1]):
        out += x[..., s]
    return out


def _combine_slots(part: np.ndarray) -> np.ndarray:
    """``log sum_s exp(part[..., s])`` over the slots (the K2 identity); ``-inf`` if all are."""
    m = np.max(part, axis=-1, initial=-np.inf)  # [...]
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return m + np.log(_sum_slots(np.exp(part - m[..., None])))


@dataclass
class _Problem:
    """Validated KL inputs in the compute dtype, plus the selected blocks sorted by key block."""

    q: np.ndarray  # [Tq, Hq, D] or None (student only)
    k: np.ndarray  # [Tk, Hkv, D] or None
    q_idx: np.ndarray  # [Tq, Hkv, Didx] or None (teacher only)
    k_idx: np.ndarray  # [Tk, Didx] or None
    lse: np.ndarray  # [Tq, Hq] or None
    block_indices: np.ndarray  # [Tq, Hkv, K] validated host copy, or None (warmup)
    batch_q: np.ndarray  # [Tq] sequence of each query
    pos_q: np.ndarray  # [Tq] key position of each query in its sequence
    cu_k: np.ndarray  # [B+1]
    block_size: int
    tq: int
    tk: int
    hkv: int
    group: int  # G = Hq / Hkv (1 when there is no teacher)
    slots: int  # K, or NB for the warmup
    scale: float
    index_scale: float
    # One entry per (query t, group r, slot s) with a selected block, sorted by (r, key row, t):
    entry_t: np.ndarray  # [E]
    entry_r: np.ndarray  # [E]
    entry_s: np.ndarray  # [E]
    entry_k0: np.ndarray  # [E] packed index of the block's first key
    entry_k1: np.ndarray  # [E] one past its last key (clipped to the sequence)
    entry_kpos0: np.ndarray  # [E] position of the block's first key in its sequence
    segments: np.ndarray  # [S+1] entries [segments[i], segments[i+1]) share (r, key block)
    tile_elements: int  # at most this many teacher scores [n, G, L] a tile (see _tiles)


def _selected_entries(block_indices, batch_q, pos_q, cu_k, block_size, hkv):
    """Entries ``(t, r, s, k0, k1, kpos0)`` of the selected blocks, sorted by (r, key block, t).

    ``block_indices=None`` (warmup) selects every block holding a key visible to the query,
    block ``b`` in slot ``b``.
    """
    tq = pos_q.shape[0]
    if block_indices is None:
        nb = max_blocks(cu_k, block_size)
        visible = visible_block_mask(pos_q, nb, block_size)  # [Tq, NB]
        I = np.where(visible, np.arange(nb, dtype=np.int64)[None, :], -1)  # [Tq, NB]
        I = np.broadcast_to(I[:, None, :], (tq, hkv, nb))  # [Tq, Hkv, NB]
    else:
        I = np.asarray(block_indices, dtype=np.int64)  # [Tq, Hkv, K]
    t, r, s = np.nonzero(I >= 0)  # [E] each
    b = I[t, r, s]  # [E] batch-local block id
    seq = batch_q[t]  # [E]
    row = block_row_offsets(cu_k, block_size)[seq] + b  # [E] global (sequence, block) row
    order = np.lexsort((t, row, r))
    t, r, s, b, seq, row = t[order], r[order], s[order], b[order], seq[order], row[order]
    lk = np.diff(cu_k)[seq]  # [E]
    kpos0 = b * block_size  # [E]
    k0 = cu_k[seq] + kpos0  # [E]
    k1 = cu_k[seq] + np.minimum(kpos0 + block_size, lk)  # [E]
    key = r * (int(row.max()) + 1 if row.size else 1) + row  # [E] one value per (group, row)
    cuts = np.flatnonzero(np.diff(key)) + 1
    segments = np.concatenate([[0], cuts, [t.size]] if t.size else [[0]]).astype(np.int64)
    return t, r, s, k0, k1, kpos0, segments, I.shape[2]


def _check_inputs(*, q=None, k=None, q_idx=None, k_idx=None, block_indices, lse=None,
                  cu_seqlens_q, cu_seqlens_k, block_size, scale=None, index_scale=None,
                  teacher: bool, student: bool, validate: bool = True,
                  tile_elements: int = TILE_ELEMENTS) -> _Problem:
    """Validate the arguments of the public functions and sort the selected blocks."""
    validate = check_flag("validate", validate)
    tile_elements = check_positive_int("tile_elements", tile_elements)
    arrays = {}
    if teacher:
        check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES)
        tq, hq, d = (int(x) for x in q.shape)
        if hq < 1 or d < 1:
            raise ValueError(f"q must have shape [Tq, Hq >= 1, D >= 1], got {tuple(q.shape)}")
        check_array("k", k, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, None, d))
        tk, hkv = int(k.shape[0]), int(k.shape[1])
        if hkv < 1:
            raise ValueError(f"k must have Hkv >= 1 heads, got shape {tuple(k.shape)}")
        group = check_gqa(hq, hkv)
        arrays.update(q=q, k=k)
    if student:
        check_array("q_idx", q_idx, ndim=3, dtypes=FLOAT_DTYPES)
        if teacher:
            check_array("q_idx", q_idx, ndim=3, shape=(tq, hkv, None))
        tq, hkv, d_idx = (int(x) for x in q_idx.shape)
        if hkv < 1 or d_idx < 1:
            raise ValueError(
                f"q_idx must have shape [Tq, Hkv >= 1, Didx >= 1], got {tuple(q_idx.shape)}")
        check_array("k_idx", k_idx, ndim=2, dtypes=FLOAT_DTYPES,
                    shape=(tk if teacher else None, d_idx))
        tk = int(k_idx.shape[0])
        arrays.update(q_idx=q_idx, k_idx=k_idx)
    cdt = _compute_dtype(check_same_dtype(**arrays))
    block_size = check_block_size(block_size)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d)) if teacher else 1.0
    index_scale = (check_scale("index_scale", index_scale, 1.0 / math.sqrt(d_idx)) if student
                   else 1.0)
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=tq, total_k=tk)
    batch_q, pos_q, cu_q, cu_k = batch.query_batch, batch.query_pos, batch.cu_q, batch.cu_k
    if block_indices is not None:
        check_array("block_indices", block_indices, ndim=3, dtypes=("int",))
        if int(block_indices.shape[0]) != tq or int(block_indices.shape[1]) != hkv:
            raise ValueError(
                f"block_indices must have shape [Tq, Hkv, K] = [{tq}, {hkv}, K], "
                f"got {tuple(block_indices.shape)}")
        if validate:
            block_indices = check_block_indices(block_indices, cu_q, cu_k, block_size)
        else:
            block_indices = np.asarray(cu_to_host(block_indices), dtype=np.int64)  # [Tq, Hkv, K]
    if teacher and lse is not None:
        check_array("lse", lse, ndim=2, dtypes=FLOAT_DTYPES, shape=(tq, hq))
        lse = np.asarray(cu_to_host(lse)).astype(cdt)  # [Tq, Hq]
        if validate:
            check_lse(lse, nonempty_supports(block_indices, cu_q, cu_k, block_size))
    t, r, s, k0, k1, kpos0, segments, slots = _selected_entries(
        block_indices, batch_q, pos_q, cu_k, block_size, hkv)

    def host(x):
        return None if x is None else np.asarray(cu_to_host(x)).astype(cdt, copy=False)

    return _Problem(
        q=host(q) if teacher else None, k=host(k) if teacher else None,
        q_idx=host(q_idx) if student else None, k_idx=host(k_idx) if student else None,
        lse=lse, block_indices=block_indices, batch_q=batch_q, pos_q=pos_q, cu_k=cu_k,
        block_size=block_size, tq=tq, tk=tk, hkv=hkv, group=group if teacher else 1, slots=slots,
        scale=scale, index_scale=index_scale, entry_t=t, entry_r=r, entry_s=s, entry_k0=k0,
        entry_k1=k1, entry_kpos0=kpos0, segments=segments, tile_elements=tile_elements)


def _tiles(p: _Problem):
    """Yield ``(t, r, s, k0, k1, hidden)`` per (group, key block) tile of at most
    ``p.tile_elements`` teacher scores (at least one query a tile).

    ``t``/``s`` [n]: the queries that selected the block and the slot it has in their
    ``block_indices`` row; keys ``k0:k1`` (``L <= Bk`` of them) belong to group ``r``;
    ``hidden`` [n, L] marks keys after the query (only the query's local block has any).
    """
    for i in range(p.segments.size - 1):
        e0, e1 = int(p.segments[i]), int(p.segments[i + 1])
        k0, k1 = int(p.entry_k0[e0]), int(p.entry_k1[e0])
        if k1 <= k0:
            continue
        r = int(p.entry_r[e0])
        kpos = int(p.entry_kpos0[e0]) + np.arange(k1 - k0)  # [L]
        step = max(1, p.tile_elements // (p.group * (k1 - k0)))
        for c0 in range(e0, e1, step):
            c1 = min(c0 + step, e1)
            t = p.entry_t[c0:c1]  # [n]
            hidden = kpos[None, :] > p.pos_q[t][:, None]  # [n, L]
            yield t, r, p.entry_s[c0:c1], k0, k1, hidden


def _student_scores(p: _Problem, t, r, k0, k1, hidden):
    """``S^idx`` [n, L] of one tile, ``-inf`` on hidden keys (eq 6 left, eq 9 logits)."""
    S_idx = (p.q_idx[t, r] @ p.k_idx[k0:k1].T) * p.index_scale  # [n, L]
    S_idx[hidden] = -np.inf
    return S_idx


def _teacher_scores(p: _Problem, t, r, k0, k1, hidden):
    """``S^(h)`` [n, G, L] of one tile for the group's heads, ``-inf`` on hidden keys (eq 8 logits)."""
    heads = slice(r * p.group, (r + 1) * p.group)
    q_tile = p.q[t, heads].reshape(t.size * p.group, -1)  # [n*G, D]: one matmul, not n small ones
    S = (q_tile @ p.k[k0:k1, r].T).reshape(t.size, p.group, k1 - k0) * p.scale  # [n, G, L]
    S[np.broadcast_to(hidden[:, None, :], S.shape)] = -np.inf
    return S


def _normalisers(p: _Problem):
    """``(lse_idx [Tq, Hkv], lse [Tq, Hq])``: the student's LSE and the teacher's (given or computed).

    Per-slot partial LSEs are combined over the slots (the K2 identity). A row with an empty
    support gets 0 instead of ``-inf``: none of its keys is ever read.
    """
    dt = p.q_idx.dtype
    part_idx = np.full((p.tq, p.hkv, p.slots), -np.inf, dtype=dt)  # [Tq, Hkv, K]
    need_lse = p.lse is None
    if need_lse:
        part = np.full((p.tq, p.hkv * p.group, p.slots), -np.inf, dtype=dt)  # [Tq, Hq, K]
    for t, r, s, k0, k1, hidden in _tiles(p):
        part_idx[t, r, s] = _logsumexp(_student_scores(p, t, r, k0, k1, hidden), axis=-1)  # [n]
        if need_lse:
            heads = np.arange(r * p.group, (r + 1) * p.group)  # [G]
            S = _teacher_scores(p, t, r, k0, k1, hidden)  # [n, G, L]
            part[t[:, None], heads[None, :], s[:, None]] = _logsumexp(S, axis=-1)  # [n, G]
    lse_idx = _combine_slots(part_idx)  # [Tq, Hkv]
    lse = _combine_slots(part) if need_lse else p.lse  # [Tq, Hq], a given one checked at the entry
    # An empty support's -inf becomes 0 so that `S - lse` stays -inf (not NaN) on hidden keys.
    return _empty_to_zero(lse_idx), _empty_to_zero(lse)


def _empty_to_zero(x: np.ndarray) -> np.ndarray:
    """An empty support's ``-inf`` LSE as 0 (none of its keys is read); a NaN stays NaN."""
    return np.where(x == -np.inf, 0.0, x)


def _log_teacher(p: _Problem, lse, t, r, k0, k1, hidden):
    """``log P`` [n, L] of one tile (eq 9): log of the mean over the group's heads of
    ``exp(S^(h) - LSE^(h))``; ``-inf`` on hidden keys."""
    heads = slice(r * p.group, (r + 1) * p.group)
    S = _teacher_scores(p, t, r, k0, k1, hidden)  # [n, G, L]
    return _logsumexp(S - lse[t, heads][:, :, None], axis=1) - math.log(p.group)  # [n, L]


def kl_loss(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size, *,
            scale=None, index_scale=None, validate=True, tile_elements=TILE_ELEMENTS):
    """Paper eq 9-10: ``KL(sg(P) || P_idx)`` per query and group, and its mean ``L_KL``.

    Args:
        q: [Tq, Hq, D] float16/32/64 main-branch queries (held constant).
        k: [Tk, Hkv, D], same dtype: main-branch keys (held constant). ``G = Hq / Hkv``.
        q_idx: [Tq, Hkv, Didx], same dtype: one index query head per group.
        k_idx: [Tk, Didx], same dtype: the shared index key head.
        block_indices: [Tq, Hkv, K] int, batch-local block ids, unique in a row, ``-1`` only at
            the tail (``select.check_block_indices``; a block after the query's own holds only
            future keys and adds nothing); ``None`` for the warmup (full causal support).
        lse: [Tq, Hq] float, the main branch's natural-log LSE on the same support (``-inf``
            for an empty support), e.g. from ``attention.sparse_attention`` (or
            ``dense_attention`` in the warmup); ``None`` computes it here. Finite wherever the
            support is non-empty, never NaN or +inf (``msa._checks.check_lse``; ValueError).
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums (``Lq <= Lk``; a sequence's queries
            are its last ``Lq`` key positions).
        block_size: ``Bk`` >= 1.
        scale: keyword-only main-branch softmax scale, default ``1/sqrt(D)``.
        index_scale: keyword-only index-branch scale, default ``1/sqrt(Didx)``.
        validate: keyword-only, as msa.cuda's: ``True`` checks ``block_indices``
            (``check_block_indices``) and ``lse`` (``msa._checks.check_lse``); ``False`` takes
            them as msa's own outputs (the selection and LSE of this very batch), unchecked:
            a NaN in ``lse`` then makes its row's ``kl`` NaN, as data NaNs do, instead of an
            error (``msa_layer`` and ``msa.torch.MSAAttention`` pass their own).
        tile_elements: keyword-only, this NumPy reference's only: the most teacher scores
            (``n`` queries x ``G`` heads x ``Bk`` keys) one tile computes at once, default
            ``TILE_ELEMENTS`` (4M); it bounds memory, and any value gives the same result up to
            the rounding of the matrix products' shapes.

    Returns:
        ``(kl, loss)``: ``kl`` [Tq, Hkv] = ``KL(P_{t,r} || P^idx_{t,r})`` and ``loss`` = eq 10,
        ``kl.sum() / (Tq * Hkv)`` as a NumPy scalar; float64 for float64 input, float32
        otherwise. The support of ``(t, r)`` is the causally visible keys (position ``<=``
        the query's, same sequence) of the blocks ``block_indices[t, r]``.

    Edge cases: a row with an empty support has ``kl = 0`` and still counts in the mean
    (eq 10 divides by ``N Hkv``); ``Tq = 0`` gives ``loss = 0``. Keys where ``P = 0`` contribute
    0 (``0 log 0 = 0``). The result is ``>= 0`` when ``lse`` normalises the teacher, i.e. when
    it is the main branch's LSE on this very support; an ``lse`` from another support gives a
    teacher that does not sum to 1 and is not detected unless a row's ``lse`` is ``-inf``.
    """
    p = _check_inputs(q=q, k=k, q_idx=q_idx, k_idx=k_idx, block_indices=block_indices, lse=lse,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_size=block_size,
                      scale=scale, index_scale=index_scale, teacher=True, student=True,
                      validate=validate, tile_elements=tile_elements)
    lse_idx, lse = _normalisers(p)
    part = np.zeros((p.tq, p.hkv, p.slots), dtype=p.q.dtype)  # [Tq, Hkv, K] KL summed per block
    for t, r, s, k0, k1, hidden in _tiles(p):
        log_P = _log_teacher(p, lse, t, r, k0, k1, hidden)  # [n, L]
        log_P_idx = _student_scores(p, t, r, k0, k1, hidden) - lse_idx[t, r][:, None]  # [n, L]
        # sum_j P_j (log P_j - log P^idx_j); hidden keys and underflowed P contribute 0 (0 log 0).
        P = np.exp(log_P)  # [n, L]
        positive = P > 0  # [n, L], never a hidden key
        log_ratio = np.zeros_like(P)  # [n, L]
        log_ratio[positive] = log_P[positive] - log_P_idx[positive]
        part[t, r, s] = (P * log_ratio).sum(axis=-1)
    kl = _sum_slots(part)  # [Tq, Hkv]
    loss = kl.sum() / kl.size if kl.size else 0.0
    return kl, p.q.dtype.type(loss)


def kl_backward(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size,
                *, scale=None, index_scale=None, grad_loss=1.0, validate=True,
                tile_elements=TILE_ELEMENTS):
    """Paper eq 10-11 backward: ``(dq_idx, dk_idx)`` of ``grad_loss * L_KL``.

    Arguments as :func:`kl_loss` (``validate`` and ``tile_elements`` too), plus the keyword-only
    ``grad_loss`` (a finite real, the upstream gradient of the scalar loss, e.g. the KL
    coefficient ``lambda``).

    Returns:
        ``dq_idx`` [Tq, Hkv, Didx] and ``dk_idx`` [Tk, Didx], float64 for float64 input, float32
        otherwise:

        .. math::

            dS_{t,r,j} = \\frac{g}{T_q H_{kv}} (P^{idx}_{t,r,j} - P_{t,r,j}), \\quad
            dq^{idx}_{t,r} = s_{idx} \\sum_j dS_{t,r,j} k^{idx}_j, \\quad
            dk^{idx}_j = s_{idx} \\sum_{t,r} dS_{t,r,j} q^{idx}_{t,r}

        over the support only (``dS = 0`` elsewhere). ``P^idx - P`` is the exact gradient of
        ``KL`` with respect to the student logits when ``sum_j P_j = 1``, i.e. when ``lse`` is the
        main branch's LSE on this support (rounding aside); it is what the paper and the GPU use.

    No gradient flows into ``q`` or ``k``: the teacher is ``stopgrad(P)`` (eq 10), so that the
    main branch cannot lower the loss by flattening its attention, and ``q_idx, k_idx`` come
    from ``stopgrad(X)`` (eq 11), so these gradients end at ``W^idx_q, W^idx_k``. Keys that no
    query selected, and rows with an empty support, get zero gradient.
    """
    p = _check_inputs(q=q, k=k, q_idx=q_idx, k_idx=k_idx, block_indices=block_indices, lse=lse,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_size=block_size,
                      scale=scale, index_scale=index_scale, teacher=True, student=True,
                      validate=validate, tile_elements=tile_elements)
    if isinstance(grad_loss, bool) or not isinstance(grad_loss, numbers.Real):
        raise TypeError(f"grad_loss must be a real number, got {type(grad_loss).__name__}")
    if not math.isfinite(float(grad_loss)):
        raise ValueError(f"grad_loss must be finite, got {grad_loss!r}")
    lse_idx, lse = _normalisers(p)
    dt = p.q.dtype
    dq_idx = np.zeros_like(p.q_idx)  # [Tq, Hkv, Didx]
    dk_idx = np.zeros_like(p.k_idx)  # [Tk, Didx]
    if p.tq == 0:
        return dq_idx, dk_idx
    coef = dt.type(float(grad_loss) / (p.tq * p.hkv))
    for t, r, s, k0, k1, hidden in _tiles(p):
        P = np.exp(_log_teacher(p, lse, t, r, k0, k1, hidden))  # [n, L]
        P_idx = np.exp(_student_scores(p, t, r, k0, k1, hidden) - lse_idx[t, r][:, None])  # [n, L]
        dS = coef * (P_idx - P)  # [n, L] d loss / d S_idx
        # Each query appears once per tile (its blocks are unique), so fancy += does not collide.
        # A query reads only the keys it sees (selection: a NaN k_idx after it cannot reach it).
        seen = ~hidden  # [n, L]
        dq_idx[t, r] += p.index_scale * attend(dS[:, None, :], seen, p.k_idx[k0:k1])[:, 0]  # [n, Didx]
        dk_idx[k0:k1] += p.index_scale * (dS.T @ p.q_idx[t, r])  # [L, Didx]
    return dq_idx, dk_idx


def kl_loss_and_backward(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k,
                         block_size, *, scale=None, index_scale=None, grad_loss=1.0,
                         validate=True, tile_elements=TILE_ELEMENTS):
    """Paper eq 9-11 in one call: ``(kl, loss, dq_idx, dk_idx)``, i.e. :func:`kl_loss` then
    :func:`kl_backward` on the same arguments (a training step needs both; the GPU version
    scores the teacher once for the two)."""
    kl, loss = kl_loss(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q, cu_seqlens_k,
                       block_size, scale=scale, index_scale=index_scale, validate=validate,
                       tile_elements=tile_elements)
    dq_idx, dk_idx = kl_backward(q, k, q_idx, k_idx, block_indices, lse, cu_seqlens_q,
                                 cu_seqlens_k, block_size, scale=scale, index_scale=index_scale,
                                 grad_loss=grad_loss, validate=validate,
                                 tile_elements=tile_elements)
    return kl, loss, dq_idx, dk_idx


def _dense_support(p: _Problem) -> np.ndarray:
    """bool [Hkv, Tq, Tk]: key ``j`` is in the support of (query ``t``, group ``r``).

    Built from token positions directly (not from the sorted entries the tiles use), so the
    dense helpers are an independent check of ``kl_loss``.
    """
    batch_k, pos_k = key_positions(p.cu_k, p.tk)  # [Tk]
    causal = (p.batch_q[:, None] == batch_k[None, :]) & (pos_k[None, :] <= p.pos_q[:, None])  # [Tq, Tk]
    if p.block_indices is None:
        return np.broadcast_to(causal[None], (p.hkv,) + causal.shape).copy()
    I = np.asarray(p.block_indices, dtype=np.int64)  # [Tq, Hkv, K]
    block_k = pos_k // p.block_size  # [Tk]
    selected = np.zeros((p.hkv,) + causal.shape, dtype=bool)  # [Hkv, Tq, Tk]
    for s in range(I.shape[2]):
        selected |= I[:, :, s].T[:, :, None] == block_k[None, None, :]
    return selected & causal[None]


def student_probs(q_idx, k_idx, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, *,
                  index_scale=None):
    """Paper eq 9 (student), dense: ``P_idx`` [Hkv, Tq, Tk] for small problems.

    ``P_idx[r, t, j]`` is the softmax of ``S^idx = (q_idx[t, r] . k_idx[j]) * index_scale`` over
    the support of ``(t, r)`` (see :func:`kl_loss`), 0 off it; a row with an empty support is
    all zeros. float64 for float64 input, float32 otherwise. Memory is ``Hkv Tq Tk``.
    """
    p = _check_inputs(q_idx=q_idx, k_idx=k_idx, block_indices=block_indices,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      block_size=block_size, index_scale=index_scale, teacher=False, student=True)
    support = _dense_support(p)  # [Hkv, Tq, Tk]
    S_idx = np.matmul(p.q_idx.transpose(1, 0, 2), p.k_idx.T) * p.index_scale  # [Hkv, Tq, Tk]
    S_idx[~support] = -np.inf
    lse_idx = _empty_to_zero(_logsumexp(S_idx, axis=-1))  # [Hkv, Tq], 0 for an empty support
    return np.where(support, np.exp(S_idx - lse_idx[..., None]), 0.0)


def teacher_probs(q, k, block_indices, lse, cu_seqlens_q, cu_seqlens_k, block_size, *, scale=None):
    """Paper eq 9 (teacher), dense: ``P`` [Hkv, Tq, Tk] for small problems.

    ``P[r, t, j] = (1/G) sum_{h in group r} exp(S^(h)[t, j] - lse[t, h])`` on the support of
    ``(t, r)``, 0 off it, with ``S^(h) = (q[t, h] . k[j, r]) * scale``. ``lse`` [Tq, Hq] is the
    main branch's LSE on that support, or ``None`` to take each head's own softmax over it; a
    row with an empty support is all zeros. float64 for float64 input, float32 otherwise.
    """
    p = _check_inputs(q=q, k=k, block_indices=block_indices, lse=lse,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      block_size=block_size, scale=scale, teacher=True, student=False)
    support = _dense_support(p)  # [Hkv, Tq, Tk]
    support_h = np.repeat(support, p.group, axis=0)  # [Hq, Tq, Tk]
    k_h = np.repeat(p.k.transpose(1, 0, 2), p.group, axis=0)  # [Hq, Tk, D]
    S = np.matmul(p.q.transpose(1, 0, 2), k_h.transpose(0, 2, 1)) * p.scale  # [Hq, Tq, Tk]
    S[~support_h] = -np.inf
    lse_h = _logsumexp(S, axis=-1) if p.lse is None else p.lse.T  # [Hq, Tq], a given one checked
    lse_h = _empty_to_zero(lse_h)
    P_h = np.where(support_h, np.exp(S - lse_h[..., None]), 0.0)  # [Hq, Tq, Tk]
    return P_h.reshape(p.hkv, p.group, p.tq, p.tk).mean(axis=1)
