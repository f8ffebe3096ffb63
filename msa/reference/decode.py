"""docs/design.md §8: decode on a paged KV cache, defined by the prefill functions on gathered sequences.

A serving engine keeps each request's keys in *pages* of ``Bk`` tokens, and one page is one
selectable block of eq 4 (what the vLLM and SGLang MSA backends do):

=================  ===========================  ====================================================
name               shape                        meaning
=================  ===========================  ====================================================
``k_cache``        [P, Hkv, Bk, D]              keys of every page, KV head major inside a page
``v_cache``        [P, Hkv, Bk, D]              values, same layout
``k_idx_cache``    [P, Bk, Didx]                the shared index key head (eq 5) of every token
``block_table``    [B, max_pages] int           ``block_table[b, j]``: the page that holds block
                                                ``j`` (positions ``j*Bk .. j*Bk+Bk-1``) of request b
``cache_seqlens``  [B] int                      tokens in request b's cache, the new ones included
=================  ===========================  ====================================================

Only the entries ``j < ceil(cache_seqlens[b] / Bk)`` of a row of ``block_table`` are read (the
rest may hold anything, e.g. -1); pages may be in any order and shared between requests (a
common prefix), but the positions one ``append_to_cache`` writes must be distinct.

A decode step gives every request ``Lq`` new queries (1 for plain decode, up to 8 for MTP
drafts), packed request-major: ``q [B*Lq, Hq, D]``, ``q_idx [B*Lq, Hkv, Didx]``. They are the
*last* ``Lq`` positions of the request's cache (bottom-right causal alignment, docs/design.md §3):
query ``i`` of request ``b`` sits at position ``cache_seqlens[b] - Lq + i``, sees the positions
up to its own, and has its own selection (no union over the drafts).

The definition (``decode_step``) is the existing reference on the gathered sequences::

    k, v, k_idx, cu_k = gather_cache(...)                              # pages -> packed keys
    M = index.block_scores(q_idx, k_idx, cu_q, cu_k, Bk)               # eq 6   [Hkv, B*Lq, NB]
    I = select.select_blocks(M, cu_q, cu_k, topk=K, block_size=Bk)     # eq 7   [B*Lq, Hkv, K]
    o, lse = attention.sparse_attention(q, k, v, I, cu_q, cu_k, Bk)    # eq 8

with ``cu_q = [0, Lq, 2 Lq, ...]``; block ids in ``I`` are the request's logical blocks ``j``
(batch-local, as everywhere in msa), not page numbers. ``msa.cuda.decode`` computes the same
functions straight from the pages.

Stale slots: the gather reads only each request's listed blocks up to its length, and the
prefill functions mask by selection (docs/design.md §3), so a query's results do not depend on
any slot it cannot see (past the length, unlisted pages, later drafts' keys, blocks it did not
select), whatever the slot holds: a freed request's pages need no clearing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._checks import (FLOAT_DTYPES, check_array, check_cu_seqlens, check_gqa, check_offsets,
                       check_positive_int, check_same_dtype, check_scale, cu_to_host, dtype_of)
from .attention import sparse_attention
from .index import block_scores
from .select import select_blocks

# Largest topk accepted (an I of [B*Lq, Hkv, K] int32 is allocated before anything else).
MAX_TOPK = 4096


class CacheLayout(NamedTuple):
    """What ``check_cache`` read off a valid cache: sizes and the host copies of the metadata."""

    num_pages: int  # P
    num_kv_heads: int  # Hkv
    block_size: int  # Bk
    head_dim: int  # D
    index_dim: int  # Didx (0 without an index key cache)
    batch: int  # B
    max_pages: int  # columns of block_table
    seqlens: np.ndarray  # int64 [B], host copy of cache_seqlens
    table: np.ndarray  # int64 [B, max_pages], host copy of block_table


def require_arrays(**named) -> None:
    """Each named argument is an array (a TypeError naming the first that is not, None
    included): the functions that need all of q, q_idx and the caches say so first."""
    for name, x in named.items():
        check_array(name, x)


def check_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, *, block_size=None,
                min_seqlen: int = 0, dtypes=FLOAT_DTYPES, values: bool = True) -> CacheLayout:
    """Validate a paged cache (shapes, dtypes, page ids, lengths); errors name the argument.

    Args:
        k_cache, v_cache: [P, Hkv, Bk, D], same dtype and shape; k_idx_cache: [P, Bk, Didx].
            Any of the three may be None (index-only or attention-only callers), not all.
        block_table: [B, max_pages] integer page ids.
        cache_seqlens: [B] integers, ``min_seqlen <= cache_seqlens[b] <= max_pages * Bk``.
        block_size: the ``Bk`` the caller passes, must equal the page size of the caches.
        min_seqlen: the least length every request must have (``Lq`` of a decode step).
        dtypes: the float dtypes accepted (``check_array``'s form); the caches share one.
        values: read and check the page ids and lengths (False: shapes and dtypes only; the
            layout's ``seqlens`` and ``table`` are then None).

    Every page id a request uses (``block_table[b, j]`` for ``j < ceil(cache_seqlens[b] /
    Bk)``) must be in ``[0, P)``; the other entries are not read.
    """
    p = bk = hkv = d = None
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x is None:
            continue
        check_array(name, x, ndim=4, dtypes=dtypes, shape=(p, hkv, bk, d))
        p, hkv, bk, d = (int(s) for s in x.shape)
        if min(p, hkv, bk, d) < 1:
            raise ValueError(f"{name} must have shape [P, Hkv, Bk, D] with every size >= 1, "
                             f"got {tuple(x.shape)}")
    d_idx = 0
    if k_idx_cache is not None:
        check_array("k_idx_cache", k_idx_cache, ndim=3, dtypes=dtypes, shape=(p, bk, None))
        p, bk, d_idx = (int(s) for s in k_idx_cache.shape)
        if min(p, bk, d_idx) < 1:
            raise ValueError(f"k_idx_cache must have shape [P, Bk, Didx] with every size >= 1, "
                             f"got {tuple(k_idx_cache.shape)}")
    given = {n: x for n, x in (("k_cache", k_cache), ("v_cache", v_cache),
                               ("k_idx_cache", k_idx_cache)) if x is not None}
    if not given:
        raise TypeError("the cache needs k_cache, v_cache or k_idx_cache, got None for all three")
    check_same_dtype(**given)
    if block_size is not None:
        block_size = check_positive_int("block_size", block_size)
        if block_size != bk:
            raise ValueError(f"block_size must equal the page size Bk = {bk} of the cache "
                             f"({next(iter(given))}), got {block_size}")
    check_array("block_table", block_table, ndim=2, dtypes=("int",))
    b, max_pages = (int(s) for s in block_table.shape)
    if b < 1 or max_pages < 1:
        raise ValueError(f"block_table must have shape [B >= 1, max_pages >= 1], got "
                         f"{tuple(block_table.shape)}")
    check_array("cache_seqlens", cache_seqlens, ndim=1, dtypes=("int",), shape=(b,))
    if not values:
        return CacheLayout(p, hkv or 0, bk, d or 0, d_idx, b, max_pages, None, None)
    seqlens = np.asarray(cu_to_host(cache_seqlens), dtype=np.int64)  # [B]
    bad = np.nonzero((seqlens < min_seqlen) | (seqlens > max_pages * bk))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"cache_seqlens[{i}] = {int(seqlens[i])} must be in [{min_seqlen}, max_pages * Bk = "
            f"{max_pages} * {bk} = {max_pages * bk}]" + (
                f" (at least the {min_seqlen} new queries of the step)" if min_seqlen else ""))
    table = np.asarray(cu_to_host(block_table), dtype=np.int64)  # [B, max_pages]
    used = np.arange(max_pages)[None, :] < -(-seqlens[:, None] // bk)  # [B, max_pages]
    bad_pages = used & ((table < 0) | (table >= p))
    if bad_pages.any():
        i, j = (int(x) for x in np.argwhere(bad_pages)[0])
        raise ValueError(f"block_table[{i}, {j}] = {int(table[i, j])} must be a page id in [0, "
                         f"{p}) (block {j} holds positions of request {i}'s cache)")
    return CacheLayout(p, hkv or 0, bk, d or 0, d_idx, b, max_pages, seqlens, table)


def check_queries(q, q_idx, layout: CacheLayout, dtype, dtypes=FLOAT_DTYPES) -> int:
    """Validate ``q [B*Lq, Hq, D]`` and ``q_idx [B*Lq, Hkv, Didx]`` (either may be None) against
    a cache of ``dtype``; return ``Lq``."""
    b = layout.batch
    rows = None
    for name, x, ndim in (("q", q, 3), ("q_idx", q_idx, 3)):
        if x is None:
            continue
        check_array(name, x, ndim=ndim, dtypes=dtypes)
        if dtype_of(x) != dtype:
            raise TypeError(f"{name} must have the dtype of the cache ({dtype}), got {dtype_of(x)}")
        n = int(x.shape[0])
        if n < b or n % b:
            raise ValueError(f"{name} must have B * Lq rows (a multiple of B = {b}, Lq >= 1: the "
                             f"new queries of every request), got shape {tuple(x.shape)}")
        if rows is not None and n != rows:
            raise ValueError(f"{name} must have as many rows as q ({rows}), got {n}")
        rows = n
    if q is not None:
        check_gqa(int(q.shape[1]), layout.num_kv_heads)
        check_array("q", q, shape=(None, None, layout.head_dim))
    if q_idx is not None:
        # an index-only cache does not know Hkv: q_idx says it
        check_array("q_idx", q_idx, shape=(None, layout.num_kv_heads or None, layout.index_dim))
    lq = rows // b
    if layout.seqlens is None:
        return lq
    short = np.nonzero(layout.seqlens < lq)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(f"cache_seqlens[{i}] = {int(layout.seqlens[i])} must be >= Lq = {lq}: the "
                         f"new queries are the last Lq positions of the cache (append them first)")
    return lq


def decode_offsets(layout: CacheLayout, lq: int):
    """``(cu_seqlens_q, cu_seqlens_k)`` int64 [B+1] of the gathered batch: Lq queries per request,
    ``cache_seqlens[b]`` keys."""
    cu_q = np.arange(layout.batch + 1, dtype=np.int64) * lq
    cu_k = np.concatenate([[0], np.cumsum(layout.seqlens)]).astype(np.int64)
    return cu_q, cu_k


def _gather_pages(cache, layout: CacheLayout, per_head: bool):
    """Pages -> packed tokens: [Tk, Hkv, D] from [P, Hkv, Bk, D] (``per_head``) or [Tk, Didx]
    from [P, Bk, Didx], requests in order, each cut at its length."""
    cache = np.asarray(cache)
    bk = layout.block_size
    parts = []
    for b in range(layout.batch):
        n = int(layout.seqlens[b])
        pages = layout.table[b, : -(-n // bk)]  # [nb]
        x = cache[pages]  # [nb, Hkv, Bk, D] or [nb, Bk, Didx]
        if per_head:
            x = x.transpose(0, 2, 1, 3)  # [nb, Bk, Hkv, D]
        parts.append(x.reshape(-1, *x.shape[2:])[:n])  # [n, Hkv, D] or [n, Didx]
    return np.concatenate(parts, axis=0)


def gather_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens):
    """Pages to contiguous packed sequences, the layout of every prefill function.

    Args: the cache (module docstring); any of the three caches may be None (not all).

    Returns:
        ``(k [Tk, Hkv, D], v [Tk, Hkv, D], k_idx [Tk, Didx], cu_seqlens_k [B+1] int32)``, None
        for a cache not given, with ``Tk = sum(cache_seqlens)``: request b's tokens ``0 .. cache_seqlens[b]-1``
        at rows ``cu_seqlens_k[b] ..``, copies in the cache's dtype.
    """
    layout = check_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens)
    k = None if k_cache is None else _gather_pages(k_cache, layout, True)  # [Tk, Hkv, D]
    v = None if v_cache is None else _gather_pages(v_cache, layout, True)  # [Tk, Hkv, D]
    k_idx = None if k_idx_cache is None else _gather_pages(k_idx_cache, layout, False)  # [Tk, Didx]
    cu_k = np.concatenate([[0], np.cumsum(layout.seqlens)]).astype(np.int32)  # [B+1]
    return k, v, k_idx, cu_k


def append_to_cache(k, v, k_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, *,
                    cu_seqlens=None):
    """Write new tokens' K, V and K_idx into their pages, in place (docs/design.md §8).

    Args:
        k, v: [T, Hkv, D] the new tokens' keys and values, request-major; k_idx: [T, Didx]
            their index keys (any of the three may be None to leave that cache alone).
        k_cache, v_cache, k_idx_cache, block_table: the cache (module docstring).
        cache_seqlens: [B] lengths *after* the append, the new tokens included.
        cu_seqlens: [B+1] offsets of each request's new tokens in ``k``; None: ``T / B`` each.

    Request b's ``n_b`` new tokens go to positions ``cache_seqlens[b] - n_b ..
    cache_seqlens[b] - 1``: position ``pos`` lands in page ``block_table[b, pos // Bk]``, slot
    ``pos % Bk``. The positions written must be distinct (no two requests on one page slot).

    Returns ``(k_cache, v_cache, k_idx_cache)``, the arrays given, written.
    """
    ref = k if k is not None else (v if v is not None else k_idx)
    if ref is None:
        raise ValueError("append_to_cache needs at least one of k, v, k_idx")
    layout = check_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens)
    pages, slots = new_token_slots(layout, int(ref.shape[0]), cu_seqlens)
    for name, x, cache, per_head in (("k", k, k_cache, True), ("v", v, v_cache, True),
                                     ("k_idx", k_idx, k_idx_cache, False)):
        if x is None:
            continue
        if cache is None:
            raise ValueError(f"{name} given but its cache is None")
        if isinstance(cache, np.ndarray) and not cache.flags.writeable:
            raise ValueError(f"{name}_cache must be writeable: append_to_cache writes it in place")
        if per_head:
            check_array(name, x, ndim=3, dtypes=("float",),
                        shape=(pages.size, layout.num_kv_heads, layout.head_dim))
        else:
            check_array(name, x, ndim=2, dtypes=("float",), shape=(pages.size, layout.index_dim))
        check_same_dtype(**{f"{name}_cache": cache, name: x})
    for x, cache, per_head in ((k, k_cache, True), (v, v_cache, True), (k_idx, k_idx_cache, False)):
        if x is None:
            continue
        if per_head:
            cache[pages, :, slots] = np.asarray(x)  # [T, Hkv, D] into [P, Hkv, Bk, D]
        else:
            cache[pages, slots] = np.asarray(x)  # [T, Didx] into [P, Bk, Didx]
    return k_cache, v_cache, k_idx_cache


def new_token_slots(layout: CacheLayout, total: int, cu_seqlens=None):
    """``(pages [T], slots [T])`` int64 where the ``T = total`` new tokens go (``append_to_cache``),
    after checking ``cu_seqlens`` and that no two tokens share a slot."""
    b = layout.batch
    if cu_seqlens is None:
        if total % b:
            raise ValueError(f"k must have a multiple of B = {b} rows (the same number of new "
                             f"tokens for every request) when cu_seqlens is None, got {total}")
        cu = np.arange(b + 1, dtype=np.int64) * (total // b)
    else:
        cu = check_offsets("cu_seqlens", cu_seqlens, total)  # an integer array or a list
        if cu.shape[0] != b + 1:
            raise ValueError(f"cu_seqlens must have B+1 = {b + 1} entries (one request a "
                             f"block_table row), got {cu.shape[0]}")
    n_new = np.diff(cu)  # [B]
    over = np.nonzero(n_new > layout.seqlens)[0]
    if over.size:
        i = int(over[0])
        raise ValueError(f"request {i} appends {int(n_new[i])} tokens but cache_seqlens[{i}] = "
                         f"{int(layout.seqlens[i])}: cache_seqlens counts the new tokens too")
    req = np.repeat(np.arange(b), n_new)  # [T]
    pos = layout.seqlens[req] - n_new[req] + (np.arange(total) - cu[req])  # [T]
    pages = layout.table[req, pos // layout.block_size]  # [T]
    slots = pos % layout.block_size  # [T]
    flat = np.sort(pages * layout.block_size + slots)  # [T]
    dup = np.nonzero(flat[1:] == flat[:-1])[0]
    if dup.size:
        at = int(flat[dup[0]])
        raise ValueError(f"block_table maps two new tokens to one cache slot (page "
                         f"{at // layout.block_size}, slot {at % layout.block_size}): pages "
                         f"written by append_to_cache must not be shared")
    return pages, slots


def decode_block_indices(q_idx, k_idx_cache, block_table, cache_seqlens, block_size, topk, *,
                         index_scale=None):
    """Eq 6-7 for a decode step: the selection ``I [B*Lq, Hkv, K]`` int32 of every new query.

    ``select_blocks(block_scores(q_idx, k_idx, ...))`` on the gathered index keys: per (query,
    group) the local block ``floor(pos / Bk)``, the ``K - 1`` best earlier blocks by their
    causal block max (ties to the smaller block id, NaN and -inf never chosen), ascending, -1
    padded. ``index_scale`` defaults to ``1 / sqrt(Didx)``.
    """
    require_arrays(q_idx=q_idx, k_idx_cache=k_idx_cache)
    layout = check_cache(None, None, k_idx_cache, block_table, cache_seqlens,
                         block_size=block_size)
    topk = check_positive_int("topk", topk, high=MAX_TOPK)
    lq = check_queries(None, q_idx, layout, dtype_of(k_idx_cache))
    check_scale("index_scale", index_scale, 1.0)
    return _block_indices(layout, lq, q_idx, k_idx_cache, topk, index_scale)


def _block_indices(layout, lq, q_idx, k_idx_cache, topk, index_scale):
    cu_q, cu_k = decode_offsets(layout, lq)
    k_idx = _gather_pages(k_idx_cache, layout, False)  # [Tk, Didx]
    bk = layout.block_size
    M = block_scores(q_idx, k_idx, cu_q, cu_k, bk, scale=index_scale)  # [Hkv, B*Lq, NB]
    return select_blocks(M, cu_q, cu_k, topk=topk, block_size=bk)  # [B*Lq, Hkv, K]


def decode_attention(q, k_cache, v_cache, block_indices, block_table, cache_seqlens, block_size, *,
                     scale=None):
    """Eq 8 for a decode step: ``(o [B*Lq, Hq, D], lse [B*Lq, Hq])`` on the selected blocks.

    ``sparse_attention`` on the gathered keys and values with the selection ``block_indices
    [B*Lq, Hkv, K]`` (logical block ids of each request, -1 padding; any valid selection,
    ``msa.reference.select.check_block_indices``). Float32 results for float16/32 input,
    float64 for float64; a query with an empty support gets ``o = 0`` and ``lse = -inf``.
    """
    require_arrays(q=q, k_cache=k_cache, v_cache=v_cache)
    layout = check_cache(k_cache, v_cache, None, block_table, cache_seqlens, block_size=block_size)
    lq = check_queries(q, None, layout, dtype_of(k_cache))
    check_array("block_indices", block_indices, ndim=3, dtypes=("int",),
                shape=(int(q.shape[0]), layout.num_kv_heads, None))
    check_scale("scale", scale, 1.0)
    return _attention(layout, lq, q, k_cache, v_cache, block_indices, scale)


def _attention(layout, lq, q, k_cache, v_cache, block_indices, scale):
    cu_q, cu_k = decode_offsets(layout, lq)
    k = _gather_pages(k_cache, layout, True)  # [Tk, Hkv, D]
    v = _gather_pages(v_cache, layout, True)  # [Tk, Hkv, D]
    return sparse_attention(q, k, v, cu_to_host(block_indices), cu_q, cu_k,
                            layout.block_size, scale=scale)


def decode_step(q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, block_size,
                topk, *, scale=None, index_scale=None):
    """One MSA decode step on a paged cache (docs/design.md §8): index branch, top-k, sparse attention.

    Args:
        q: [B*Lq, Hq, D] float16/32/64, the new queries, request-major (``Lq >= 1``; the GPU
            takes 1..8); q_idx: [B*Lq, Hkv, Didx], their index queries; same dtype as the cache.
        k_cache, v_cache, k_idx_cache, block_table, cache_seqlens: the cache (module docstring),
            the new tokens already appended (``append_to_cache``).
        block_size: Bk, the page size. topk: K >= 1 blocks per (query, group), the local block
            included (more than a request has: -1 padding).
        scale, index_scale: softmax and index scales, default ``1/sqrt(D)`` and ``1/sqrt(Didx)``.

    Returns:
        ``(o [B*Lq, Hq, D], lse [B*Lq, Hq], block_indices [B*Lq, Hkv, K] int32)``: exactly
        ``decode_attention(q, ..., decode_block_indices(q_idx, ...))``, i.e. the prefill
        reference on ``gather_cache``'s sequences with ``cu_seqlens_q = [0, Lq, 2 Lq, ...]``.

    Raises:
        TypeError/ValueError naming the argument, before anything is allocated: shapes, dtypes,
        ``block_size`` not the page size, ``Lq`` not a whole number or above a request's length,
        a used page id out of range, ``cache_seqlens`` above ``max_pages * Bk``, bad scales.
    """
    require_arrays(q=q, q_idx=q_idx, k_cache=k_cache, v_cache=v_cache, k_idx_cache=k_idx_cache)
    layout = check_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens,
                         block_size=block_size)
    topk = check_positive_int("topk", topk, high=MAX_TOPK)
    lq = check_queries(q, q_idx, layout, dtype_of(k_cache))
    check_scale("scale", scale, 1.0)
    check_scale("index_scale", index_scale, 1.0)
    I = _block_indices(layout, lq, q_idx, k_idx_cache, topk, index_scale)
    o, lse = _attention(layout, lq, q, k_cache, v_cache, I, scale)
    return o, lse, I


def prefill_chunk(q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens,
                  cu_seqlens_q, block_size, topk, *, scale=None, index_scale=None):
    """Chunked prefill into the cache (docs/design.md §8): each request's chunk of new tokens, already
    appended, attends through the block table to its whole cache.

    ``q [Tq, Hq, D]``, ``q_idx [Tq, Hkv, Didx]`` packed by ``cu_seqlens_q [B+1]`` (request
    ``b`` has ``Lq_b <= cache_seqlens[b]`` queries, any number, the last ``Lq_b`` positions of its
    cache). The prefill reference (index, top-k, sparse attention) on ``gather_cache``'s
    sequences; a decode step is the case ``Lq_b = Lq`` for all. Returns ``(o, lse,
    block_indices)`` as ``decode_step``.
    """
    require_arrays(q=q, q_idx=q_idx, k_cache=k_cache, v_cache=v_cache, k_idx_cache=k_idx_cache)
    layout = check_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens,
                         block_size=block_size)
    topk = check_positive_int("topk", topk, high=MAX_TOPK)
    cu_q, cu_k = chunk_offsets(layout, cu_seqlens_q, q, q_idx, dtype_of(k_cache))
    k, v, k_idx, _ = gather_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens)
    M = block_scores(q_idx, k_idx, cu_q, cu_k, layout.block_size, scale=index_scale)
    I = select_blocks(M, cu_q, cu_k, topk=topk, block_size=layout.block_size)
    o, lse = sparse_attention(q, k, v, I, cu_q, cu_k, layout.block_size, scale=scale)
    return o, lse, I


def chunk_offsets(layout: CacheLayout, cu_seqlens_q, q, q_idx, dtype, dtypes=FLOAT_DTYPES):
    """Validated ``(cu_q, cu_k)`` int64 of a chunked prefill: ``q [Tq, Hq, D]`` and ``q_idx
    [Tq, Hkv, Didx]`` fit the cache (its ``dtype``, heads and dims), and their rows, the chunk
    offsets ``cu_seqlens_q [B+1]`` (an integer array or a list) and the cache lengths agree
    (``Lq_b <= cache_seqlens[b]``)."""
    for name, x in (("q", q), ("q_idx", q_idx)):
        check_array(name, x, ndim=3, dtypes=dtypes)
        if dtype_of(x) != dtype:
            raise TypeError(f"{name} must have the dtype of the cache ({dtype}), got {dtype_of(x)}")
    check_gqa(int(q.shape[1]), layout.num_kv_heads)
    check_array("q", q, shape=(None, None, layout.head_dim))
    check_array("q_idx", q_idx, shape=(int(q.shape[0]), layout.num_kv_heads, layout.index_dim))
    cu_q = check_offsets("cu_seqlens_q", cu_seqlens_q, int(q.shape[0]))
    if cu_q.shape[0] != layout.batch + 1:
        raise ValueError(f"cu_seqlens_q must have B+1 = {layout.batch + 1} entries (one request a "
                         f"block_table row), got {cu_q.shape[0]}")
    cu_k = np.concatenate([[0], np.cumsum(layout.seqlens)]).astype(np.int64)
    return check_cu_seqlens(cu_q, cu_k, int(q.shape[0]), int(cu_k[-1]))


__all__ = ["append_to_cache", "check_cache", "decode_attention", "decode_block_indices",
           "decode_step", "gather_cache", "prefill_chunk"]
