"""Index v2: eq 6 on tensor cores (``mma.sync.m16n8k16``, fp32 accumulation), tile by tile.

What it adds over v1: a CTA owns a tile of (query, group) rows of one sequence (all ``Hkv``
groups of ``16 * warps // Hkv`` queries), keeps its index queries in registers as mma A
fragments, and streams the sequence's key blocks through shared memory: each key chunk is
loaded once for every group and every query of the tile. The causal mask is applied only to
chunks that reach past the tile's first position. Each lane keeps its partial maxima of two
rows; the four lanes of a quad stage theirs in shared memory, and they are combined when 8
blocks at a time are stored (no shuffle, no extra barrier). With the top-k epilogue instead of
the M store (``cap >= 1``) the same kernel is ``select_blocks_fused(version=2)``.

Non-finite keys (docs/design.md §3): a score is one key's column of the mma, and ``fold``
keeps only the keys a row sees (masking by selection, never a product with 0), so a NaN or
infinite ``k_idx`` reaches exactly the rows that see it, as in the reference (the max skips a
NaN score, the mean keeps it); the fused top-k offers a row only blocks it sees whole. No
extra cost.

Needs bf16/fp16 inputs, ``Didx % 16 == 0`` and ``Bk % 8 == 0``. The default where v3 does not
apply: ``Bk % 16 != 0``, ``k_idx`` data not 16-byte aligned, or v3's key buffers over 48 KB of
static shared memory. Measured (H200, 128K tokens, paper index): 105.6 ms writing M, 102.3 ms
fused with the top-k (84-88 TFLOP/s): each chunk is copied through registers between two
barriers and every B fragment is loaded word by word, so shared memory bounds it; v3 is 3.7x.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, uint32

from .._core.arrays import SIMULATOR
from .._core.heap import sort_ids_ascending, write_selection
from .._core.mma import mma_bf16_m16n8k16, mma_f16_m16n8k16
from ._plan import FLUSH, key_chunk
from ._tile import fmax, make_offer, make_store, make_tile_bounds
from .._core.diskcache import kernel_jit

# Two CTAs of 8 warps per SM need <= 128 registers a thread (65536 per SM); ptxas, left alone,
# takes 130. The simulator's jit has no such option.
JIT_OPTIONS = {} if SIMULATOR else {"max_registers": 128}


def _make_staged(mean: bool):
    @cuda.jit(device=True, inline=True)
    def staged(sm, row, c):
        """The pool of row ``row``'s four quad partials of staged block ``c``."""
        if mean:
            return (sm[row, 4 * c] + sm[row, 4 * c + 1]) + (sm[row, 4 * c + 2] + sm[row, 4 * c + 3])
        return fmax(fmax(sm[row, 4 * c], sm[row, 4 * c + 1]),
                    fmax(sm[row, 4 * c + 2], sm[row, 4 * c + 3]))

    return staged


def _make_copy_chunk(d_idx: int, block_size: int, threads: int):
    KC = key_chunk(block_size)
    D2 = d_idx // 2
    NTHREADS = threads

    @cuda.jit(device=True, inline=True)
    def copy_chunk(sk, k32, k_base, lk, j0, tid):
        """Keys ``j0 .. j0 + KC - 1`` of the sequence into ``sk`` through registers (zeros past
        the sequence's end)."""
        e = tid
        while e < KC * D2:
            kr = e // D2
            kw = e - kr * D2
            sk[kr, kw] = k32[k_base + j0 + kr, kw] if j0 + kr < lk else uint32(0)
            e += NTHREADS

    return copy_chunk


def _make_mma_steps(d_idx: int, block_size: int, bf16: bool, mean: bool):
    """The tile's A fragments (``load_queries``), one key chunk's products (``chunk_scores``)
    and the fold of their maxima into a lane's two rows (``fold``)."""
    KS = d_idx // 16  # k-steps of 16 features
    NT = key_chunk(block_size) // 8  # n-tiles of 8 keys per chunk
    mma = mma_bf16_m16n8k16 if bf16 else mma_f16_m16n8k16

    @cuda.jit(device=True, inline=True)
    def load_queries(aq, q32, t_a, t_b, r_a, r_b, tb, tq):
        """The A fragments (index queries of rows a, b) of every k-step, zeros past the tile."""
        for ks in range(KS):
            w = ks * 8 + tq
            aq[ks, 0] = q32[t_a, r_a, w] if t_a < tb else uint32(0)
            aq[ks, 1] = q32[t_b, r_b, w] if t_b < tb else uint32(0)
            aq[ks, 2] = q32[t_a, r_a, w + 4] if t_a < tb else uint32(0)
            aq[ks, 3] = q32[t_b, r_b, w + 4] if t_b < tb else uint32(0)

    @cuda.jit(device=True, inline=True)
    def chunk_scores(acc, aq, sk, g, tq):
        """S[rows, keys] = Q_idx . K_idx^T for the chunk: acc[nt] is n-tile nt's accumulator."""
        for nt in range(NT):
            for e4 in range(4):
                acc[nt, e4] = float32(0.0)
        for ks in range(KS):
            for nt in range(NT):
                b0 = sk[nt * 8 + g, ks * 8 + tq]
                b1 = sk[nt * 8 + g, ks * 8 + tq + 4]
                d0, d1, d2, d3 = mma(aq[ks, 0], aq[ks, 1], aq[ks, 2], aq[ks, 3], b0, b1,
                                     acc[nt, 0], acc[nt, 1], acc[nt, 2], acc[nt, 3])
                acc[nt, 0] = d0
                acc[nt, 1] = d1
                acc[nt, 2] = d2
                acc[nt, 3] = d3

    @cuda.jit(device=True, inline=True)
    def fold(acc, m_a, m_b, j0, tq, masked, pos_a, pos_b):
        """m = max (mean: sum) over the chunk's visible keys (j <= pos) of this lane's two rows;
        only chunks that reach past the tile's first position (``masked``) can hide a key."""
        for nt in range(NT):
            j = j0 + nt * 8 + 2 * tq
            if mean:
                if not masked or j <= pos_a:
                    m_a += acc[nt, 0]
                if not masked or j + 1 <= pos_a:
                    m_a += acc[nt, 1]
                if not masked or j <= pos_b:
                    m_b += acc[nt, 2]
                if not masked or j + 1 <= pos_b:
                    m_b += acc[nt, 3]
            else:
                if not masked or j <= pos_a:
                    m_a = fmax(m_a, acc[nt, 0])
                if not masked or j + 1 <= pos_a:
                    m_a = fmax(m_a, acc[nt, 1])
                if not masked or j <= pos_b:
                    m_b = fmax(m_b, acc[nt, 2])
                if not masked or j + 1 <= pos_b:
                    m_b = fmax(m_b, acc[nt, 3])
        return m_a, m_b

    return load_queries, chunk_scores, fold


@functools.lru_cache(maxsize=None)
def block_scores_kernel(d_idx: int, block_size: int, warps: int, bf16: bool, mean: bool,
                        cap: int = 0):
    """The v2 kernel for one (Didx, Bk, warps, bf16/fp16, pool) configuration.

    ``cap = 0``: write ``M[r, t - m_t0, b]`` (``out`` unused). ``cap >= 1``: the fused index +
    top-k (max pool only; ``M`` unused): thread ``i < 16 * warps`` owns row ``i`` of the tile
    and offers each block score ``b < L`` of its row to a min-heap of ``topk - 1 <= cap``
    entries as soon as the block is staged, then writes ``out[t, r]``. Only blocks before the
    tile's last local block are scored and no key needs a causal mask: every key of a block
    ``b < L`` is visible to the row. M is never written.
    """
    fused = cap > 0
    D2 = d_idx // 2  # uint32 words per row (two 16-bit values each)
    KS = d_idx // 16  # k-steps of 16 features
    KC = key_chunk(block_size)
    NT = KC // 8  # n-tiles of 8 keys per chunk
    R = 16 * warps  # (query, group) rows per CTA
    SK = D2 + 4  # padded shared row: rows g = 0..7 of a fragment load hit 8 different banks
    FB = FLUSH
    # Staged partials: 4 per (row, block), one per lane of a quad; the row stride 4 * FB + 4
    # words puts the 32 lanes of a warp (rows g, lanes t) in 32 different banks.
    SMW = 4 * FB + 4
    NTHREADS = 32 * warps
    HCAP = max(cap, 1)
    tile_bounds = make_tile_bounds(block_size, fused)
    staged = _make_staged(mean)
    store_block_scores = make_store(R, FB, NTHREADS, block_size, mean, staged)
    offer_block_scores = make_offer(R, FB, staged)
    copy_chunk = _make_copy_chunk(d_idx, block_size, NTHREADS)
    load_queries, chunk_scores, fold = _make_mma_steps(d_idx, block_size, bf16, mean)

    @kernel_jit(**JIT_OPTIONS)
    def kernel(q32, k32, cu_q, cu_k, tiles, m_t0, nb_total, scale, M, topk, out):
        sk = cuda.shared.array((KC, SK), uint32)
        sm = cuda.shared.array((R, SMW), float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        tq = lane & 3
        hkv = q32.shape[1]
        neg = float32(-math.inf)
        ta, tb, k_base, lk, shift, p_first, p_last, b_last = tile_bounds(tiles, cu_q, cu_k)

        # This lane's two rows (g and g + 8 of its warp's 16) and their positions; rows past the
        # tile get position -1, so that every key is masked for them.
        row_a = warp * 16 + g
        row_b = row_a + 8
        t_a = ta + row_a // hkv
        t_b = ta + row_b // hkv
        r_a = row_a % hkv
        r_b = row_b % hkv
        pos_a = t_a + shift if t_a < tb else -1
        pos_b = t_b + shift if t_b < tb else -1
        # A fragments for every k-step, kept in registers for the whole tile
        aq = cuda.local.array((KS, 4), uint32)
        load_queries(aq, q32, t_a, t_b, r_a, r_b, tb, tq)
        acc = cuda.local.array((NT, 4), float32)

        # Fused top-k: thread tid < R owns row tid's heap.
        hs = cuda.local.array(HCAP, float32)
        hi = cuda.local.array(HCAP, int32)
        h_n = 0
        h_rs = neg
        h_ri = int32(0x7FFFFFFF)
        kmax = topk - 1
        own_t = ta + tid // hkv
        own_loc = (own_t + shift) // block_size

        for bg in range(0, nb_total, FB):
            if fused and bg > b_last:  # the same for the whole CTA
                break
            for bl in range(FB):
                b = bg + bl
                if b > b_last:  # the same for the whole CTA
                    break
                m_a = float32(0.0) if mean else neg
                m_b = float32(0.0) if mean else neg
                for kc0 in range(0, block_size, KC):
                    j0 = b * block_size + kc0  # position of the chunk's first key
                    if j0 > p_last:  # past every row's position (the same for the whole CTA)
                        break
                    cuda.syncthreads()  # the previous chunk's fragments are consumed
                    copy_chunk(sk, k32, k_base, lk, j0, tid)
                    cuda.syncthreads()
                    chunk_scores(acc, aq, sk, g, tq)
                    masked = not fused and j0 + KC - 1 > p_first
                    m_a, m_b = fold(acc, m_a, m_b, j0, tq, masked, pos_a, pos_b)
                # The 4 lanes of a quad hold partial results of the same two rows; they are
                # combined when the staged blocks are stored (no shuffle, no extra barrier).
                sm[row_a, bl * 4 + tq] = m_a
                sm[row_b, bl * 4 + tq] = m_b
            cuda.syncthreads()
            if fused:  # each row's block scores straight into its heap
                h_n, h_rs, h_ri = offer_block_scores(sm, hs, hi, h_n, h_rs, h_ri, kmax, tid,
                                                     own_t, own_loc, tb, bg, scale)
            else:
                store_block_scores(M, sm, tid, ta, tb, hkv, shift, bg, b_last, nb_total, m_t0,
                                   scale)
            cuda.syncthreads()

        if fused and tid < R and own_t < tb:
            # I[t, r] = the kept ids ascending (all < L), then L, then -1
            sort_ids_ascending(hi, h_n)
            r = tid % hkv
            write_selection(out, own_t, r, hi, h_n, own_loc, topk)

    return kernel
