"""Paper eq 1, eq 8 and §4.2 K1: dense causal GQA attention, sparse attention, KV-outer partials.

Three functions compute softmax attention over three supports, all with GQA (query head ``h``
reads KV head ``r = h // G``, eq 3) on a packed variable-length batch with bottom-right causal
alignment (``msa.reference.blocks.query_positions``):

* ``dense_attention`` (eq 1): every key of the query's sequence at a position ``<= pos``. It is
  the warmup branch of Algorithm 1 and the baseline sparse attention must reduce to.
* ``sparse_attention`` (eq 8): only the causally visible keys of the blocks the indexer selected
  for the query's group, ``I[t, r, :]``. This is the definition, written query by query
  (Q-outer).
* ``sparse_attention_backward``: eq 8's gradient (``dq, dk, dv`` given ``dO``), the main
  branch's backward for training (the paper leaves it to the usual FlashAttention rule).
* ``attention_partials`` (K1): the same edges visited block by block (KV-outer, paper §4.2): a
  work item loads one K/V block and serves every query of its CSR chunk with it, writing one
  locally normalised partial per (query, block). ``msa.reference.combine.combine_partials`` (K2)
  merges them into exactly what ``sparse_attention`` returns.

All three return ``lse``, the natural-log normaliser ``log sum_j exp(S_j)`` of the scaled scores
``S_j = <q, k_j> * scale``, which K2 and the KL loss (eq 9) reuse. They compute in float64 for
float64 input and in float32 otherwise (float16 is promoted) and return that dtype. A row with
no visible key gets ``o = 0`` and ``lse = -inf``, never NaN.

Masking is by selection (docs/design.md §3): a query's output and gradients are the same arithmetic
whatever the keys it cannot see hold, NaN and inf included (``msa.reference._mask.attend``). A
NaN or inf it can see makes its own row NaN (or inf), as IEEE arithmetic says.
"""

from __future__ import annotations

import math

import numpy as np

from .._batch import Batch
from .._checks import (check_array, check_block_size, check_gqa, check_lse, check_same_dtype,
                       check_scale, check_topk, cu_to_host)
from ._mask import attend
from .blocks import block_row_offsets
from .select import check_block_indices, nonempty_supports

# Largest score tile one chunk of queries may build, in elements (32 MiB of float64): bounds the
# memory of every function here at any sequence length.
_TILE_ELEMENTS = 1 << 22


def _check_qkv(q, k, v):
    """Validate ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``; return ``(q, k, v, G)``, compute dtype."""
    check_array("q", q, ndim=3, dtypes=("float",))
    check_array("k", k, ndim=3, dtypes=("float",))
    check_array("v", v, ndim=3, dtypes=("float",), shape=tuple(k.shape))
    dt = check_same_dtype(q=q, k=k, v=v)
    d = int(q.shape[2])
    if d < 1:
        raise ValueError(f"q must have head dim D >= 1, got shape {tuple(q.shape)}")
    check_array("k", k, shape=(None, None, d))
    g = check_gqa(int(q.shape[1]), int(k.shape[1]))
    compute = np.float64 if dt == np.float64 else np.float32
    # host copies (NumPy, or a CuPy / torch / Numba array's): the reference has no autograd
    q, k, v = (np.asarray(cu_to_host(x), dtype=compute) for x in (q, k, v))
    return q, k, v, g


def _softmax_attend(s, visible, v):
    """Masked, max-subtracted ``softmax(S) V`` of a score tile, and its log-sum-exp.

    Args:
        s: float [..., C, G, N] scaled scores (overwritten with the probabilities' numerators).
        visible: bool [C, N]: which keys each row (query) may attend to, shared by its G heads
            and by the leading axes.
        v: float [..., N, D] values (the leading axes match ``s``'s or are absent).

    Returns:
        ``(o [..., C, G, D], lse [..., C, G])``; a row with no visible key gives 0 and -inf.
        Keys a row cannot see are never read for it (``attend``), so a NaN there cannot leak.
    """
    *lead, c, g, n = s.shape
    d = v.shape[-1]
    if n == 0:
        return np.zeros((*lead, c, g, d), s.dtype), np.full((*lead, c, g), -np.inf, s.dtype)
    np.copyto(s, -np.inf, where=~visible[:, None, :])
    # m = rowmax(S); a row with nothing visible takes m = 0 so that S - m stays -inf, not NaN.
    m = s.max(axis=-1, keepdims=True)  # [..., C, G, 1]
    m[~np.isfinite(m)] = 0
    s -= m
    p = np.exp(s, out=s)  # [..., C, G, N], exactly 0 where not visible
    l = p.sum(axis=-1)  # [..., C, G], >= 1 where a key is visible, 0 otherwise
    o = attend(p, visible, v)  # [..., C, G, D]
    # A row that sees a NaN (or an infinite score) keeps its NaN: in l, o and lse alike. A row
    # without mass (nothing visible, or only -inf scores) is o = 0, lse = -inf, whatever its
    # values hold: the slot K2 skips.
    empty = l == 0  # [..., C, G]
    l_safe = np.where(empty, 1, l)  # [..., C, G]
    with np.errstate(invalid="ignore"):  # inf / inf on a row that sees an infinite score
        o = np.where(empty[..., None], 0, o / l_safe[..., None])
    lse = np.where(empty, -np.inf, np.log(l_safe) + m[..., 0])  # [..., C, G]
    return o, lse


def dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None):
    r"""Paper eq 1: dense causal softmax attention with GQA on a packed variable-length batch.

    .. math::  o_t^{(h)} = \sum_{i \le t} \mathrm{softmax}_i(s \langle q_t^{(h)}, k_i^{(r)} \rangle)
               \, v_i^{(r)}, \qquad r = \lfloor h / G \rfloor

    Query ``t`` of sequence ``b`` sits at key position ``pos[t] = Lk - Lq + i`` and sees the keys
    ``0 .. pos[t]`` of its own sequence. Queries are processed in chunks whose score tile holds at
    most ``2**22`` elements, so memory stays bounded at any length.

    Args:
        q: float [Tq, Hq, D]; k, v: [Tk, Hkv, D], same dtype as ``q``, ``Hkv`` dividing ``Hq``.
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed offsets, ``Lq <= Lk`` per sequence (any
            integer array or a list).
        scale: keyword-only softmax scale ``s`` (finite, > 0); ``None`` gives ``1/sqrt(D)``.

    Returns:
        ``(o [Tq, Hq, D], lse [Tq, Hq])``, float64 for float64 input, float32 otherwise; ``lse``
        is ``log sum_i exp(S_i)`` in natural log. A query with no visible key (impossible when
        ``Lq <= Lk``, guarded anyway) gets ``o = 0``, ``lse = -inf``.

    Raises:
        TypeError: non-float or mixed dtypes, non-integer offsets, a scale passed positionally.
        ValueError: wrong ranks, ``k``/``v``/``q`` shapes that disagree (``Tk``, ``Hkv``,
        ``D``), ``Hkv`` not dividing ``Hq``, bad ``cu_seqlens``, a non-positive ``scale``.
    """
    q, k, v, g = _check_qkv(q, k, v)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d))
    # no blocks in eq 1: block_size = 1 only completes the validated batch
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, 1, total_q=tq, total_k=k.shape[0])
    cu_q, cu_k, lq, lk = batch.cu_q, batch.cu_k, batch.lq, batch.lk
    o = np.zeros((tq, hq, d), dtype=q.dtype)  # [Tq, Hq, D]
    lse = np.full((tq, hq), -np.inf, dtype=q.dtype)  # [Tq, Hq]
    for b in range(lq.size):
        chunk = max(1, _TILE_ELEMENTS // (hq * max(int(lk[b]), 1)))
        for i0 in range(0, int(lq[b]), chunk):
            i1 = min(i0 + chunk, int(lq[b]))
            t0, t1, c = int(cu_q[b]) + i0, int(cu_q[b]) + i1, i1 - i0
            pos = int(lk[b] - lq[b]) + np.arange(i0, i1)  # [C]
            n = int(pos[-1]) + 1  # the last query of the chunk sees the most keys
            k_b = k[cu_k[b]:cu_k[b] + n].transpose(1, 2, 0)  # [Hkv, D, n]
            v_b = v[cu_k[b]:cu_k[b] + n].transpose(1, 0, 2)  # [Hkv, n, D]
            q_c = (q[t0:t1] * scale).reshape(c, hkv, g, d).transpose(1, 0, 2, 3)  # [Hkv, C, G, D]
            s = (q_c.reshape(hkv, c * g, d) @ k_b).reshape(hkv, c, g, n)  # [Hkv, C, G, n]
            visible = np.arange(n)[None, :] <= pos[:, None]  # [C, n], token-level causal mask
            o_c, lse_c = _softmax_attend(s, visible, v_b)  # [Hkv, C, G, D], [Hkv, C, G]
            o[t0:t1] = o_c.transpose(1, 0, 2, 3).reshape(c, hq, d)
            lse[t0:t1] = lse_c.transpose(1, 0, 2).reshape(c, hq)
    return o, lse



def _check_selection(block_indices, batch: Batch, hkv: int) -> np.ndarray:
    """``block_indices`` [Tq, Hkv, K] checked against the batch; a host int64 copy."""
    check_array("block_indices", block_indices, ndim=3, dtypes=("int",),
                shape=(batch.tq, hkv, None))
    return check_block_indices(block_indices, batch.cu_q, batch.cu_k, batch.block_size)


def _supports(block_indices, cu_seqlens_q, cu_seqlens_k, tq, tk, hkv, g, block_size):
    """Eq 8's supports, a chunk of queries and a KV head at a time (``sparse_attention`` and its
    backward walk the same ones); validates its arguments, then ``_batch_supports``.

    Yields:
        ``(t0, t1, r, visible [C, N] bool, keys [N] int)``: queries ``t0 .. t1-1`` (C of them)
        of one sequence, KV head ``r``, and the union's ``N`` packed key ids (clamped
        into the sequence; ``visible`` is False on the clamped padding and wherever the key is
        not in the query's support).
    """
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, check_block_size(block_size), total_q=tq,
                     total_k=tk)
    yield from _batch_supports(_check_selection(block_indices, batch, hkv), batch, hkv, g)


def _batch_supports(I, batch: Batch, hkv: int, g: int):
    """``_supports`` on a validated batch and selection ``I`` [Tq, Hkv, K] (checks nothing).

    A chunk of neighbouring queries gathers the union of its selected blocks once; each query
    masks that union down to its own support (neighbours share their local and sink blocks, so
    the union is small). The chunk keeps the ``[C, G, union*Bk]`` score tile under
    ``_TILE_ELEMENTS`` (the union has at most ``min(NB, C*K)`` blocks). A block holds at most
    ``min(Bk, max Lk)`` keys, so a block size beyond every sequence allocates nothing more.
    """
    block_size, cu_q, cu_k, lq, lk = batch.block_size, batch.cu_q, batch.cu_k, batch.lq, batch.lk
    topk = I.shape[2]
    # keys a block can hold: Bk, or the longest sequence if every one is shorter than a block
    width = min(block_size, max(int(lk.max(initial=0)), 1))
    offsets = np.arange(width)  # [W]
    for b in range(lq.size):
        nb = -(-int(lk[b]) // block_size)  # blocks of this sequence
        per_block = g * width
        chunk = max(1, _TILE_ELEMENTS // (per_block * max(nb, 1)),
                    math.isqrt(_TILE_ELEMENTS // (per_block * max(topk, 1))))
        for i0 in range(0, int(lq[b]), chunk):
            i1 = min(i0 + chunk, int(lq[b]))
            t0, t1, c = int(cu_q[b]) + i0, int(cu_q[b]) + i1, i1 - i0
            pos = int(lk[b] - lq[b]) + np.arange(i0, i1)  # [C]
            for r in range(hkv):
                I_r = I[t0:t1, r]  # [C, K]
                chosen = np.zeros((c, nb), dtype=bool)  # [C, NB]: block j is in I[t, r, :]
                rows, cols = np.nonzero(I_r >= 0)
                chosen[rows, I_r[rows, cols]] = True
                union = np.flatnonzero(chosen.any(axis=0))  # [U]
                key_pos = union[:, None] * block_size + offsets  # [U, W]
                # Support = chosen block and causally visible; key_pos <= pos < Lk also drops
                # the padding past the end of a partial last block.
                visible = chosen[:, union, None] & (key_pos <= pos[:, None, None])  # [C, U, W]
                keys = cu_k[b] + np.minimum(key_pos.ravel(), int(lk[b]) - 1)  # [N], clamped
                yield t0, t1, r, visible.reshape(c, -1), keys


def sparse_attention(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, *,
                     scale=None):
    r"""Paper eq 8: softmax attention on the causally visible keys of the selected blocks.

    .. math::  O_t^{(h)} = \mathrm{softmax}(s\, Q_t^{(h)} K^{(r)}[\mathcal{I}_t^{(r)}]^\top)
               \, V^{(r)}[\mathcal{I}_t^{(r)}]

    The support of query ``t``, head ``h`` (group ``r = h // G``) is the set of keys at positions
    ``j*Bk .. (j+1)*Bk - 1`` (within its sequence) for every block ``j`` of ``I[t, r, :]``
    (``-1`` entries ignored), keeping only positions ``<= pos[t]``: the local block is cut at
    the query itself, and a block lying wholly in the future contributes nothing. All G heads of
    a group share the support, each with its own query.

    This is the Q-outer definition. To vectorise it, a chunk of neighbouring queries gathers the
    union of its selected blocks once and each query masks that union down to its own support
    (neighbours share their local and sink blocks, so the union is small); the result is the
    per-query softmax, only the K/V reads are shared. Cost is at most that of dense attention.

    Args:
        q: float [Tq, Hq, D]; k, v: [Tk, Hkv, D], same dtype as ``q``.
        block_indices: I int [Tq, Hkv, K], batch-local block ids, unique per row, -1 only at the
            tail (validated by ``msa.reference.select.check_block_indices``; order is free).
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed offsets, ``Lq <= Lk`` per sequence.
        block_size: Bk, an integer in ``[1, 2**31 - 1]``.
        scale: keyword-only softmax scale; ``None`` gives ``1/sqrt(D)``.

    Returns:
        ``(o [Tq, Hq, D], lse [Tq, Hq])``: float64 for float64 input, float32 otherwise (float16
        is promoted); ``lse`` in natural log over the support. A query whose support is empty
        (a row of only -1, or only future blocks) gets ``o = 0`` and ``lse = -inf``.

    Raises:
        TypeError/ValueError as ``dense_attention``, plus ``block_indices`` with a wrong shape
        (``Tq``, ``Hkv``), an out-of-range or repeated block, or -1 before a real block.
    """
    q, k, v, g = _check_qkv(q, k, v)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    block_size = check_block_size(block_size)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d))
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=tq, total_k=k.shape[0])
    I = _check_selection(block_indices, batch, hkv)  # [Tq, Hkv, K]
    o = np.zeros((tq, hq, d), dtype=q.dtype)  # [Tq, Hq, D]
    lse = np.full((tq, hq), -np.inf, dtype=q.dtype)  # [Tq, Hq]
    for t0, t1, r, visible, keys in _batch_supports(I, batch, hkv, g):
        c, heads = t1 - t0, slice(r * g, (r + 1) * g)
        q_c = (q[t0:t1, heads] * scale).reshape(c * g, d)  # [C*G, D], scaled
        s = (q_c @ k[keys, r].T).reshape(c, g, keys.size)  # [C, G, N]
        o[t0:t1, heads], lse[t0:t1, heads] = _softmax_attend(s, visible, v[keys, r])
    return o, lse


def sparse_attention_backward(q, k, v, o, lse, do, block_indices, cu_seqlens_q, cu_seqlens_k,
                              block_size, *, scale=None):
    r"""The gradient of eq 8 (the main branch's backward): ``(dq, dk, dv)`` given ``dO``.

    With ``P = exp(S - LSE)`` on the support of ``sparse_attention`` (0 elsewhere), ``S = s Q Kᵀ``
    and ``D_t = rowsum(dO_t * O_t)`` (FlashAttention's backward):

    .. math::  dV = P^\top dO, \quad dS = P \circ (dO\, V^\top - D), \quad
               dQ = s\, dS\, K, \quad dK = s\, dS^\top Q

    summed over the G query heads that share a KV head and over every query whose support holds
    the key. Only keys in the support get a gradient; a query with an empty support (``lse`` =
    -inf) contributes nothing and gets ``dq = 0``. The chunks and block unions are those of
    ``sparse_attention``; a query's ``dq`` never reads a key outside its support (masking by
    selection, so a NaN there cannot reach it).

    Args:
        q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, scale: as
            ``sparse_attention`` (``scale`` keyword-only).
        o, lse: its outputs ``[Tq, Hq, D]``, ``[Tq, Hq]`` (``o`` enters only through ``D``).
            ``lse`` must be finite wherever the query's support is non-empty and may be -inf
            only where it is empty (``msa._checks.check_lse``).
        do: ``dL/dO`` [Tq, Hq, D], float.

    Returns:
        ``(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])``: float64 for float64 input,
        float32 otherwise.

    Raises:
        As ``sparse_attention``, plus ``o``, ``lse`` or ``do`` of the wrong shape or not float,
        and ValueError naming ``lse`` for a NaN or +inf in it, or a -inf on a non-empty support
        (it would silently give zero gradients).
    """
    q, k, v, g = _check_qkv(q, k, v)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    check_array("o", o, ndim=3, dtypes=("float",), shape=(tq, hq, d))
    check_array("do", do, ndim=3, dtypes=("float",), shape=(tq, hq, d))
    check_array("lse", lse, ndim=2, dtypes=("float",), shape=(tq, hq))
    block_size = check_block_size(block_size)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d))
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=tq, total_k=k.shape[0])
    I = _check_selection(block_indices, batch, hkv)  # [Tq, Hkv, K]
    o, do, lse = (np.asarray(cu_to_host(x), dtype=q.dtype) for x in (o, do, lse))
    check_lse(lse, nonempty_supports(I, batch.cu_q, batch.cu_k, block_size))
    dq = np.zeros((tq, hq, d), dtype=q.dtype)  # [Tq, Hq, D]
    dk = np.zeros(k.shape, dtype=q.dtype)  # [Tk, Hkv, D]
    dv = np.zeros(k.shape, dtype=q.dtype)
    delta = np.einsum("thd,thd->th", do, o)  # [Tq, Hq]: D_t of every head
    for t0, t1, r, visible, keys in _batch_supports(I, batch, hkv, g):
        c, heads = t1 - t0, slice(r * g, (r + 1) * g)
        q_c = (q[t0:t1, heads] * scale).reshape(c * g, d)  # [C*G, D], scaled
        do_c = do[t0:t1, heads].reshape(c * g, d)  # [C*G, D]
        k_r, v_r = k[keys, r], v[keys, r]  # [N, D]
        s = (q_c @ k_r.T).reshape(c, g, -1)  # [C, G, N]
        l_c = lse[t0:t1, heads, None]  # [C, G, 1], finite wherever a key is visible
        live = np.broadcast_to(visible[:, None, :], s.shape)  # [C, G, N]
        # masked before the exp: a key outside the support may score far above the LSE
        p = np.exp(np.where(live, s - l_c, -np.inf))  # [C, G, N], 0 off the support
        dp = (do_c @ v_r.T).reshape(c, g, -1)  # [C, G, N], NaN off the support if V is
        ds = np.where(live, p * (dp - delta[t0:t1, heads, None]), 0)  # [C, G, N]
        dq[t0:t1, heads] = scale * attend(ds, visible, k_r)  # [C, G, D]
        # every (C, G) row adds into the keys of the union; clamped duplicates add 0
        np.add.at(dk[:, r], keys, ds.reshape(c * g, -1).T @ q_c)
        np.add.at(dv[:, r], keys, p.reshape(c * g, -1).T @ do_c)
    return dq, dk, dv


def check_work(work, q_indices, partial_slots, hkv, topk, q_batch, cu_k, block_size):
    """Validate K1's schedule against the problem; return host int64 copies of the three arrays.

    Every item must name a real (head, sequence, block) whose ``row`` is consistent, a CSR range
    inside ``q_indices``, queries of that sequence and slots ``< topk``; no two entries may
    write the same (head, slot, query) partial or serve the same (head, query, row) twice.
    """
    check_array("work", work, ndim=2, dtypes=("int",), shape=(None, 6))
    check_array("q_indices", q_indices, ndim=2, dtypes=("int",), shape=(hkv, None))
    check_array("partial_slots", partial_slots, ndim=2, dtypes=("int",),
                shape=tuple(q_indices.shape))
    work = np.asarray(cu_to_host(work), dtype=np.int64)  # [W, 6]
    q_indices = np.asarray(cu_to_host(q_indices), dtype=np.int64)  # [Hkv, nnz]
    partial_slots = np.asarray(cu_to_host(partial_slots), dtype=np.int64)  # [Hkv, nnz]
    nnz = q_indices.shape[1]
    tq = q_batch.size
    num_seqs = cu_k.size - 1
    lk = np.diff(cu_k)  # [B]
    nb = -(-lk // block_size)  # [B]
    row_offsets = block_row_offsets(cu_k, block_size)  # [B+1]
    h, row, q_begin, q_count, batch, kv_block = work.T  # [W] each
    batch_ok = (batch >= 0) & (batch < num_seqs)  # [W]
    b_safe = np.where(batch_ok, batch, 0)  # [W]
    problems = [
        ((h < 0) | (h >= hkv), f"kv_head must be in [0, {hkv})"),
        (~batch_ok, f"batch must be in [0, {num_seqs})"),
        ((kv_block < 0) | (kv_block >= nb[b_safe]), "kv_block must be a block of its sequence"),
        (row != row_offsets[b_safe] + kv_block, "row must be block_row_offsets[batch] + kv_block"),
        ((q_begin < 0) | (q_count < 0) | (q_begin + q_count > nnz),
         f"q_begin, q_count must give a range inside q_indices' {nnz} columns"),
    ]
    for bad, why in problems:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"work[{i}] = {work[i].tolist()} is invalid: {why}")
    # One entry per (item, CSR position): the queries and slots the items will touch.
    item = np.repeat(np.arange(work.shape[0]), q_count)  # [E]
    first = np.cumsum(q_count) - q_count  # [W]
    e = q_begin[item] + np.arange(item.size) - first[item]  # [E]
    t = q_indices[h[item], e]  # [E]
    slot = partial_slots[h[item], e]  # [E]
    bad_t = (t < 0) | (t >= tq)  # [E]
    wrong_seq = ~bad_t & (q_batch[np.where(bad_t, 0, t)] != batch[item])  # [E]
    for bad, what, arr, why in (
            (bad_t, "q_indices", t, f"must be a query in [0, {tq})"),
            (wrong_seq, "q_indices", t, "must be a query of the work item's sequence"),
            ((slot < 0) | (slot >= topk), "partial_slots", slot, f"must be in [0, topk={topk})")):
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{what}[{int(h[item[j]])}, {int(e[j])}] = {int(arr[j])} "
                             f"(work[{int(item[j])}]) {why}")
    rows = max(int(row_offsets[-1]), 1)
    for key, why in (((h[item] * topk + slot) * tq + t, "write one (kv_head, slot, query) partial"),
                     ((h[item] * tq + t) * rows + row[item], "serve one (kv_head, query, row)")):
        if np.unique(key).size != key.size:
            raise ValueError(f"work, q_indices and partial_slots: two entries {why}")
    return work, q_indices, partial_slots


def attention_partials(q, k, v, work, q_indices, partial_slots, cu_seqlens_q, cu_seqlens_k,
                       block_size, topk, *, scale=None):
    r"""Paper §4.2 K1 (eq 13-16 context): KV-outer partial attention, one per (query, block).

    .. math::  L_s = \log \sum_{j \in J_s} e^{S_j}, \qquad O_s = \sum_{j \in J_s} e^{S_j - L_s} V_j

    The loop is the GPU kernel's: one iteration per work item ``[kv_head, row, q_begin,
    q_count, batch, kv_block]`` (one CTA). It loads block ``kv_block`` of sequence ``batch`` of
    KV head ``r = kv_head`` once, gathers the ``q_count`` queries
    ``q_indices[r, q_begin:q_begin+q_count]`` with their G heads into one ``(q_count*G) x D``
    matrix (the paper's query concatenation), scores it against the block under the token-level
    causal mask (only the local block is cut), takes the softmax local to the block and writes
    ``O_s``, ``L_s`` into slot ``partial_slots[r, e]`` of each query ``t``: ``o_part[slot, t,
    r*G:(r+1)*G]``. Nothing is accumulated, so the result does not depend on the item order.

    Args:
        q: float [Tq, Hq, D]; k, v: [Tk, Hkv, D], same dtype as ``q``.
        work: int [W, 6] work items (``msa.reference.schedule.build_schedule``).
        q_indices, partial_slots: int [Hkv, nnz] k2q CSR entries and their slots
            (``msa.reference.csr.build_csr``); only the ranges named by ``work`` are read.
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed offsets, ``Lq <= Lk`` per sequence.
        block_size: Bk >= 1. topk: K, the number of slots, in ``[1, max(NB, 64)]``
            (``msa._checks.check_topk``: checked before ``o_part`` is allocated).
        scale: keyword-only softmax scale; ``None`` gives ``1/sqrt(D)``.

    Returns:
        ``(o_part [K, Tq, Hq, D], lse_part [K, Tq, Hq])``, float64 for float64 input, float32
        otherwise. Slot ``s`` of query ``t`` holds the partial of its ``s``-th selected block.
        A slot no item writes keeps ``o = 0``, ``lse = -inf``; so does a partial whose block has
        no key visible to the query (a block wholly after it).

    Raises:
        TypeError/ValueError as ``dense_attention``; ValueError for a work item naming a bad
        head, sequence, block or row, a CSR range outside ``q_indices``, a query outside the
        item's sequence, a slot outside ``[0, topk)``, or two entries writing one partial.
    """
    q, k, v, g = _check_qkv(q, k, v)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    block_size = check_block_size(block_size)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d))
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=tq, total_k=k.shape[0])
    topk = check_topk(topk, batch.nb, block_size)
    q_batch, q_pos = batch.query_batch, batch.query_pos  # [Tq] each
    cu_k, lk = batch.cu_k, batch.lk
    work, q_indices, partial_slots = check_work(work, q_indices, partial_slots, hkv, topk,
                                                 q_batch, cu_k, block_size)
    o_part = np.zeros((topk, tq, hq, d), dtype=q.dtype)  # [K, Tq, Hq, D]
    lse_part = np.full((topk, tq, hq), -np.inf, dtype=q.dtype)  # [K, Tq, Hq]
    for r, _, q_begin, q_count, b, j in work.tolist():
        # Load the K/V block once: key positions [j*Bk, min((j+1)*Bk, Lk)) of sequence b.
        key_pos = np.arange(j * block_size, min((j + 1) * block_size, int(lk[b])))  # [n]
        keys = slice(int(cu_k[b]) + key_pos[0], int(cu_k[b]) + key_pos[-1] + 1)
        k_j, v_j = k[keys, r], v[keys, r]  # [n, D] each
        # Gather the chunk's queries and concatenate their G heads: one (q_count*G) x D tile.
        t = q_indices[r, q_begin:q_begin + q_count]  # [q_count]
        slot = partial_slots[r, q_begin:q_begin + q_count]  # [q_count]
        heads = np.arange(r * g, (r + 1) * g)  # [G]
        q_cat = (q[t[:, None], heads] * scale).reshape(q_count * g, d)  # [q_count*G, D]
        s = (q_cat @ k_j.T).reshape(q_count, g, key_pos.size)  # [q_count, G, n]
        visible = key_pos[None, :] <= q_pos[t][:, None]  # [q_count, n]
        o_s, lse_s = _softmax_attend(s, visible, v_j)  # [q_count, G, D], [q_count, G]
        o_part[slot[:, None], t[:, None], heads] = o_s
        lse_part[slot[:, None], t[:, None], heads] = lse_s
    return o_part, lse_part
