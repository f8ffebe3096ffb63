"""Paged-cache problems shared by the decode tests of every backend (docs/design.md §8).

``paged_problem`` builds a cache through ``msa.reference.decode.append_to_cache``: pages handed
out in a random order, spare pages, and NaN in every slot no token owns; ``prefill_last_rows`` is
the whole sequences' prefill cut to a decode step's rows. tests/reference/test_decode.py,
tests/cuda/test_decode.py, tests/cuda/test_attention_paged.py and
tests/cuda/test_decode_cupy_graph.py use them.
"""

from __future__ import annotations

import numpy as np

from msa.reference import attention, decode, index, select
from msa.testing.strategies import offsets


class Paged:
    """A decode problem on a paged cache, with the full sequences it was built from."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    @property
    def cache(self):
        return (self.k_cache, self.v_cache, self.k_idx_cache, self.block_table, self.cache_seqlens)


def paged_problem(seqlens, lq, *, hq=4, hkv=2, d=16, d_idx=16, bk=16, topk=4, dtype=np.float64,
                  seed=0, integer_index=False, spare_pages=3, max_pages=None, shuffle=True):
    """A cache holding ``seqlens[b]`` tokens per request, built with ``append_to_cache``.

    Pages are handed out in a random order (``shuffle``), ``spare_pages`` pages belong to no
    request, unused ``block_table`` entries are -1, and every cache slot no token owns holds NaN
    (a kernel that reads one, or multiplies it by 0, fails). ``integer_index`` draws index
    queries and keys from small integers, so that every index score is exact in float32 and
    block maxima tie often: a kernel's selection must then equal the reference's bit for bit.
    The last ``lq`` positions of each request are the step's queries ``q``, ``q_idx``.
    """
    rng = np.random.default_rng(seed)
    seqlens = np.asarray(seqlens, dtype=np.int64)
    b = seqlens.size
    nb = -(-seqlens // bk)  # [B]
    max_pages = int(max_pages or max(int(nb.max()), 1))
    num_pages = int(nb.sum()) + spare_pages
    pages = rng.permutation(num_pages) if shuffle else np.arange(num_pages)
    table = np.full((b, max_pages), -1, dtype=np.int32)
    at = 0
    for i in range(b):
        table[i, : nb[i]] = pages[at: at + nb[i]]
        at += int(nb[i])
    cu_k = offsets(seqlens)
    tk = int(cu_k[-1])
    if integer_index:
        k_idx = rng.integers(-3, 4, (tk, d_idx)).astype(dtype)
        q_idx_full = rng.integers(-3, 4, (tk, hkv, d_idx)).astype(dtype)
    else:
        k_idx = rng.standard_normal((tk, d_idx)).astype(dtype)
        q_idx_full = rng.standard_normal((tk, hkv, d_idx)).astype(dtype)
    k = rng.standard_normal((tk, hkv, d)).astype(dtype)
    v = rng.standard_normal((tk, hkv, d)).astype(dtype)
    q_full = rng.standard_normal((tk, hq, d)).astype(dtype)
    k_cache = np.full((num_pages, hkv, bk, d), np.nan, dtype=dtype)
    v_cache = np.full((num_pages, hkv, bk, d), np.nan, dtype=dtype)
    k_idx_cache = np.full((num_pages, bk, d_idx), np.nan, dtype=dtype)
    cache_seqlens = seqlens.astype(np.int32)
    decode.append_to_cache(k, v, k_idx, k_cache, v_cache, k_idx_cache, table, cache_seqlens,
                           cu_seqlens=cu_k)
    last = np.concatenate([np.arange(cu_k[i + 1] - lq, cu_k[i + 1]) for i in range(b)])  # [B*Lq]
    return Paged(k=k, v=v, k_idx=k_idx, q_full=q_full, q_idx_full=q_idx_full, cu_k=cu_k,
                 q=np.ascontiguousarray(q_full[last]), q_idx=np.ascontiguousarray(q_idx_full[last]),
                 k_cache=k_cache, v_cache=v_cache, k_idx_cache=k_idx_cache, block_table=table,
                 cache_seqlens=cache_seqlens, lq=lq, bk=bk, topk=topk, last=last)


def prefill_last_rows(p, scale=None, index_scale=None):
    """The whole sequences' prefill (every position a query), cut to the last Lq rows."""
    cu = p.cu_k
    M = index.block_scores(p.q_idx_full, p.k_idx, cu, cu, p.bk, scale=index_scale)
    I = select.select_blocks(M, cu, cu, topk=p.topk, block_size=p.bk)
    o, lse = attention.sparse_attention(p.q_full, p.k, p.v, I, cu, cu, p.bk, scale=scale)
    return o[p.last], lse[p.last], I[p.last]


# -- the cache ----------------------------------------------------------------------------------
