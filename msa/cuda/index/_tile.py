"""Device functions of the tensor-core rungs (v2, v3): the CTA's tile and the two epilogues.

A CTA owns a tile of (query, group) rows of one sequence: all ``Hkv`` groups of the queries
``[ta, tb)``, row ``(t - ta) * Hkv + r``. It streams the sequence's key blocks and stages each
block maximum (or sum) of its rows in shared memory, ``FB`` blocks at a time; then either

* the **M store** writes ``M[r, t - m_t0, bg : bg + FB]`` (consecutive threads, consecutive
  blocks of one row: one 32-byte sector a row), ``-inf`` where no key is visible; or
* the **top-k epilogue** (``select_blocks_fused``) offers each row's staged scores ``b < L`` to
  the row's (K-1)-entry heap (paper §4.1, ``msa.cuda._core.heap``), owned by thread ``row``,
  and at the end writes ``I[t, r]`` ascending, ``L``, ``-1``.

``staged(sm, row, c)`` reads the pooled partial of row ``row`` and staged block ``c``: v2
stages four partials a (row, block) and combines them here, v3 combines them before staging.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from .._core.heap import offer


@cuda.jit(device=True, inline=True)
def fmax(m, s):
    """``max(m, s)`` that keeps ``m`` when ``s`` is NaN (the reference's fmax from -inf)."""
    return s if s > m else m


def make_tile_bounds(block_size: int, fused: bool):
    @cuda.jit(device=True, inline=True)
    def tile_bounds(tiles, cu_q, cu_k):
        """The CTA's tile: queries ``[ta, tb)`` of one sequence, its keys ``k_base ..
        k_base + lk - 1``, ``pos = t + shift``, the first and last row positions and the last
        block ``b_last`` it scores (fused: the last before the last row's local block, the only
        candidates)."""
        seq = tiles[cuda.blockIdx.x, 0]
        ta = tiles[cuda.blockIdx.x, 1]
        tb = tiles[cuda.blockIdx.x, 2]
        k_base = cu_k[seq]
        lk = cu_k[seq + 1] - k_base
        shift = lk - (cu_q[seq + 1] - cu_q[seq]) - cu_q[seq]  # pos = t + shift
        p_first = ta + shift
        p_last = tb - 1 + shift
        b_last = p_last // block_size
        if fused:
            b_last -= 1
        return ta, tb, k_base, lk, shift, p_first, p_last, b_last

    return tile_bounds


def make_store(rows: int, flush: int, threads: int, block_size: int, mean: bool, staged):
    @cuda.jit(device=True, inline=True)
    def store_block_scores(M, sm, tid, ta, tb, hkv, shift, bg, b_last, nb_total, m_t0, scale):
        """M[r, t - m_t0, bg : bg + flush] of the tile's rows from the staged partials."""
        neg = float32(-math.inf)
        e = tid
        while e < rows * flush:
            row = e // flush
            c = e - row * flush
            t = ta + row // hkv
            b = bg + c
            if t < tb and b < nb_total:
                value = neg
                if b <= b_last:
                    if mean:
                        n = min(block_size, t + shift - b * block_size + 1)  # visible keys
                        if n > 0:
                            value = staged(sm, row, c) * scale / float32(n)
                    else:
                        value = staged(sm, row, c) * scale
                M[row % hkv, t - m_t0, b] = value
            e += threads

    return store_block_scores


def make_offer(rows: int, flush: int, staged):
    @cuda.jit(device=True, inline=True)
    def offer_block_scores(sm, hs, hi, h_n, h_rs, h_ri, kmax, tid, own_t, own_loc, tb, bg,
                           scale):
        """Row ``tid``'s staged block scores, candidates ``b < L`` only, into its heap; returns
        the heap's new ``(n, root score, root id)``."""
        if tid < rows and own_t < tb and kmax > 0:
            for c in range(flush):
                b = bg + c
                if b < own_loc:
                    h_n, h_rs, h_ri = offer(hs, hi, h_n, kmax, h_rs, h_ri,
                                            staged(sm, tid, c) * scale, b)
        return h_n, h_rs, h_ri

    return offer_block_scores
