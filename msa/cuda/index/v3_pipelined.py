"""Index v3: v2 with the key chunks pipelined and two m-tiles a warp (the default).

What it adds over v2:

* key chunks double-buffered by ``cp.async``: the copy of chunk ``c + 1`` into shared memory
  (16-byte pieces, no registers; a thread's pieces have the same word and rows ``256 / PROW``
  apart, so each costs a few 32-bit adds) runs while chunk ``c`` is multiplied, one barrier a
  chunk (v2 copies through registers, one load at a time, between two barriers);
* B fragments by ``ldmatrix.x4`` (two n-tiles a load, a quarter of v2's shared loads);
* two 16-row m-tiles a warp (32 rows, 256 a CTA of 8 warps): each B fragment feeds four mma
  instead of two, half the shared-memory reads per product. The chunk is walked n-tile pair by
  pair (all k-steps, then the pair's maxima), so 16 accumulators are live beside 64 registers
  of A fragments (128 registers: two CTAs of 8 warps an SM, sm_90);
* the quad's four partials combined by two shuffles, in v2's order, before they are staged;
  the fused kernel (which only compares its maxima) folds them by one ``max.f32``.

Every row's products, sums and maxima are taken in v2's order: the same results bit for bit,
non-finite keys included (masked by selection as in v2, at no extra cost).
Needs what v2 needs, ``Bk % 16 == 0``, 16-byte aligned ``k_idx`` data and its two key chunks
and staged maxima within 48 KB of static shared memory; the default where it applies. Measured
(H200, paper index): fused with the top-k (``select_blocks_fused(version=3)``) 23.9-24.4 ms at
128K tokens (361-368 TFLOP/s), 1.57 s at 1M; M written at 128K 30.2 ms.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, uint32

from .._core.arrays import SIMULATOR
from .._core.heap import sort_ids_ascending, write_selection
from .._core.memops import cp_async16, cp_async_commit, cp_async_wait_all, ldmatrix_x4
from .._core.mma import fmax_f32, mma_bf16_m16n8k16, mma_f16_m16n8k16
from ._plan import FLUSH, key_chunk
from ._tile import fmax, make_offer, make_store, make_tile_bounds
from .v2_tensor_cores import JIT_OPTIONS
from .._core.diskcache import kernel_jit

MT = 2  # 16-row m-tiles a warp


@cuda.jit(device=True, inline=True)
def _staged(sm, row, c):
    """Row ``row``'s pooled score of staged block ``c`` (the quad combined it already)."""
    return sm[row, c]


def _make_copy_chunk(d_idx: int, block_size: int, threads: int):
    D2 = d_idx // 2
    KC = key_chunk(block_size)
    SK = D2 + 4
    PROW = D2 // 4  # 16-byte pieces per key row
    PIECES = KC * PROW
    # thread tid copies pieces tid + i NTHREADS, i < PPT. When NTHREADS is a multiple of PROW
    # every piece of a thread has the same word and rows RSTEP apart ("steady"), so a chunk's
    # copies cost a few 32-bit adds each instead of a division and 64-bit products a piece.
    PPT = -(-PIECES // threads)
    RSTEP = threads // PROW
    STEADY = threads % PROW == 0
    DSTEP = RSTEP * SK

    @cuda.jit(device=True, inline=True)
    def copy_chunk(sk, k32, k_base, lk, j0, dst0, tid, c_kr, c_kw, c_dst):
        """Start copying keys ``j0 .. j0 + KC - 1`` of the sequence into the buffer at word
        ``dst0`` (keys past the sequence read as zeros). ``c_kr, c_kw, c_dst``: the row, word
        and buffer word of the thread's first piece (``STEADY``)."""
        if STEADY:
            for i in range(PPT):
                if (i + 1) * threads <= PIECES or c_kr + i * RSTEP < KC:
                    row = int32(j0 + c_kr + i * RSTEP)
                    ok = row < lk
                    src = (k_base + (row if ok else int32(0))) * D2 + c_kw
                    cp_async16(sk, int32(dst0 + c_dst + i * DSTEP), k32, src, 16 if ok else 0)
            return
        e = tid
        while e < PIECES:
            kr = e // PROW
            kw = (e - kr * PROW) * 4
            ok = j0 + kr < lk
            src = (k_base + (j0 + kr if ok else 0)) * D2 + kw
            dst = dst0 + (kr * SK + kw)
            cp_async16(sk, dst, k32, src, 16 if ok else 0)
            e += threads

    return copy_chunk


def _make_key_buffers(words: int):
    if SIMULATOR:  # the simulator has no alignment argument (and needs none)
        @cuda.jit(device=True)
        def key_buffers():
            return cuda.shared.array(words, uint32)
    else:
        @cuda.jit(device=True, inline=True)
        def key_buffers():
            """Two key chunks; 16-byte aligned for cp.async and ldmatrix."""
            return cuda.shared.array(words, uint32, alignment=16)

    return key_buffers


def _make_mma_steps(d_idx: int, block_size: int, bf16: bool, mean: bool, fused: bool):
    """The tile's A fragments (``load_queries``) and one key chunk's products and maxima
    (``chunk_scores``, with its ``mma_pair`` and ``fold`` steps)."""
    KS = d_idx // 16  # k-steps of 16 features
    NT = key_chunk(block_size) // 8  # n-tiles of 8 keys per chunk (even: ldmatrix.x4 loads two)
    NP = NT // 2
    SK = d_idx // 2 + 4  # padded shared row
    # the fused kernel only compares its maxima, so zeros' signs do not matter: one max.f32
    fmx = fmax_f32 if fused else fmax
    mma = mma_bf16_m16n8k16 if bf16 else mma_f16_m16n8k16

    @cuda.jit(device=True, inline=True)
    def load_queries(aq, pos_a, pos_b, q32, ta, tb, hkv, shift, warp, g, tq):
        """This lane's rows: m-tile mi holds rows (warp MT + mi) 16 + g (a) and that + 8 (b);
        their positions (-1 past the tile: every key masked) and A fragments (zeros there)."""
        for mi in range(MT):
            row_a = (warp * MT + mi) * 16 + g
            row_b = row_a + 8
            t_a = ta + row_a // hkv
            t_b = ta + row_b // hkv
            r_a = row_a % hkv
            r_b = row_b % hkv
            pos_a[mi] = t_a + shift if t_a < tb else -1
            pos_b[mi] = t_b + shift if t_b < tb else -1
            for ks in range(KS):
                w = ks * 8 + tq
                aq[mi, ks, 0] = q32[t_a, r_a, w] if t_a < tb else uint32(0)
                aq[mi, ks, 1] = q32[t_b, r_b, w] if t_b < tb else uint32(0)
                aq[mi, ks, 2] = q32[t_a, r_a, w + 4] if t_a < tb else uint32(0)
                aq[mi, ks, 3] = q32[t_b, r_b, w + 4] if t_b < tb else uint32(0)

    @cuda.jit(device=True, inline=True)
    def mma_pair(acc, nt, aq, mi, ks, b0, b1, b2, b3):
        """n-tiles ``nt`` and ``nt + 1`` of m-tile ``mi`` += A (k-step ``ks``) times B."""
        d0, d1, d2, d3 = mma(aq[mi, ks, 0], aq[mi, ks, 1], aq[mi, ks, 2], aq[mi, ks, 3], b0, b1,
                             acc[nt, 0], acc[nt, 1], acc[nt, 2], acc[nt, 3])
        acc[nt, 0] = d0
        acc[nt, 1] = d1
        acc[nt, 2] = d2
        acc[nt, 3] = d3
        d0, d1, d2, d3 = mma(aq[mi, ks, 0], aq[mi, ks, 1], aq[mi, ks, 2], aq[mi, ks, 3], b2, b3,
                             acc[nt + 1, 0], acc[nt + 1, 1], acc[nt + 1, 2], acc[nt + 1, 3])
        acc[nt + 1, 0] = d0
        acc[nt + 1, 1] = d1
        acc[nt + 1, 2] = d2
        acc[nt + 1, 3] = d3

    @cuda.jit(device=True, inline=True)
    def fold(acc, nt, m_a, m_b, mi, j, masked, pa, pb):
        """Fold n-tile ``nt`` (keys ``j``, ``j + 1`` of this lane) into m-tile ``mi``'s rows:
        max (mean: sum) over the visible keys (j <= pos; only ``masked`` chunks hide any)."""
        if mean:
            if not masked or j <= pa:
                m_a[mi] += acc[nt, 0]
            if not masked or j + 1 <= pa:
                m_a[mi] += acc[nt, 1]
            if not masked or j <= pb:
                m_b[mi] += acc[nt, 2]
            if not masked or j + 1 <= pb:
                m_b[mi] += acc[nt, 3]
        else:
            if not masked or j <= pa:
                m_a[mi] = fmx(m_a[mi], acc[nt, 0])
            if not masked or j + 1 <= pa:
                m_a[mi] = fmx(m_a[mi], acc[nt, 1])
            if not masked or j <= pb:
                m_b[mi] = fmx(m_b[mi], acc[nt, 2])
            if not masked or j + 1 <= pb:
                m_b[mi] = fmx(m_b[mi], acc[nt, 3])

    @cuda.jit(device=True, inline=True)
    def chunk_scores(acc, aq, sk, cur, lrow, m_a, m_b, j0, tq, masked, pos_a, pos_b):
        """The chunk in buffer word ``cur``, n-tile pair by pair: S = Q_idx . K_idx^T over all
        k-steps (B fragments by ldmatrix, four mma each), then the pair's maxima."""
        for npair in range(NP):
            for ks in range(KS):
                b0, b1, b2, b3 = ldmatrix_x4(sk, cur + lrow + npair * 16 * SK + ks * 8)
                for mi in range(MT):
                    if ks == 0:
                        for e4 in range(4):
                            acc[2 * mi, e4] = float32(0.0)
                            acc[2 * mi + 1, e4] = float32(0.0)
                    mma_pair(acc, 2 * mi, aq, mi, ks, b0, b1, b2, b3)
            for half in range(2):
                j = j0 + (2 * npair + half) * 8 + 2 * tq
                for mi in range(MT):
                    fold(acc, 2 * mi + half, m_a, m_b, mi, j, masked, pos_a[mi], pos_b[mi])

    return load_queries, chunk_scores


def _make_stage(mean: bool):
    @cuda.jit(device=True, inline=True)
    def stage_block(sm, m_a, m_b, bl, warp, g, tq):
        """The quad's four partials of each row, combined as v2 combines them ((p0 . p1) .
        (p2 . p3)), into column ``bl`` of the staged maxima."""
        for mi in range(MT):
            ma = m_a[mi]
            mb = m_b[mi]
            for off in (1, 2):
                o_a = cuda.shfl_xor_sync(0xFFFFFFFF, ma, off)
                o_b = cuda.shfl_xor_sync(0xFFFFFFFF, mb, off)
                if mean:
                    ma = ma + o_a if (tq & off) == 0 else o_a + ma
                    mb = mb + o_b if (tq & off) == 0 else o_b + mb
                else:
                    ma = fmax(ma, o_a) if (tq & off) == 0 else fmax(o_a, ma)
                    mb = fmax(mb, o_b) if (tq & off) == 0 else fmax(o_b, mb)
            if tq == 0:
                row_a = (warp * MT + mi) * 16 + g
                sm[row_a, bl] = ma
                sm[row_a + 8, bl] = mb

    return stage_block


@functools.lru_cache(maxsize=None)
def block_scores_kernel(d_idx: int, block_size: int, warps: int, bf16: bool, mean: bool,
                        cap: int = 0):
    """The v3 kernel; arguments and results as ``v2_tensor_cores.block_scores_kernel``."""
    fused = cap > 0
    D2 = d_idx // 2  # uint32 words per row (two 16-bit values each)
    KS = d_idx // 16  # k-steps of 16 features
    KC = key_chunk(block_size)
    R = 16 * MT * warps  # (query, group) rows per CTA
    ACC_TILES = 2 * MT  # live accumulators: one n-tile pair of both m-tiles
    SK = D2 + 4  # padded shared row (16-byte multiple): an 8-row ldmatrix phase hits 32 banks
    BUF = KC * SK  # words per key buffer
    SK_WORDS = 2 * BUF  # two buffers
    PROW = D2 // 4  # 16-byte pieces per key row
    FB = FLUSH
    SMW = FB + 1  # staged maxima per row, padded
    NTHREADS = 32 * warps
    HCAP = max(cap, 1)
    tile_bounds = make_tile_bounds(block_size, fused)
    copy_chunk = _make_copy_chunk(d_idx, block_size, NTHREADS)
    store_block_scores = make_store(R, FB, NTHREADS, block_size, mean, _staged)
    offer_block_scores = make_offer(R, FB, _staged)
    key_buffers = _make_key_buffers(SK_WORDS)
    load_queries, chunk_scores = _make_mma_steps(d_idx, block_size, bf16, mean, fused)
    stage_block = _make_stage(mean)

    @kernel_jit(**JIT_OPTIONS)
    def kernel(q32, k32, cu_q, cu_k, tiles, m_t0, nb_total, scale, M, topk, out):
        sk = key_buffers()
        sm = cuda.shared.array((R, SMW), float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        tq = lane & 3
        hkv = q32.shape[1]
        neg = float32(-math.inf)
        ta, tb, k_base, lk, shift, p_first, p_last, b_last = tile_bounds(tiles, cu_q, cu_k)

        pos_a = cuda.local.array(MT, int32)
        pos_b = cuda.local.array(MT, int32)
        aq = cuda.local.array((MT, KS, 4), uint32)
        load_queries(aq, pos_a, pos_b, q32, ta, tb, hkv, shift, warp, g, tq)
        acc = cuda.local.array((ACC_TILES, 4), float32)
        m_a = cuda.local.array(MT, float32)
        m_b = cuda.local.array(MT, float32)
        # this lane's ldmatrix row: matrix lane // 8 is n-tile lane // 16, word half (lane // 8) % 2
        lrow = ((lane >> 4) * 8 + (lane & 7)) * SK + ((lane >> 3) & 1) * 4

        # Fused top-k: thread tid < R owns row tid's heap.
        hs = cuda.local.array(HCAP, float32)
        hi = cuda.local.array(HCAP, int32)
        h_n = 0
        h_rs = neg
        h_ri = int32(0x7FFFFFFF)
        kmax = topk - 1
        own_t = ta + tid // hkv
        own_loc = (own_t + shift) // block_size

        c_kr = int32(tid // PROW)
        c_kw = int32((tid - c_kr * PROW) * 4)
        c_dst = int32(c_kr * SK + c_kw)
        # chunk c holds keys [c * KC, (c + 1) * KC) in buffer c % 2; chunk 0 starts here
        if b_last >= 0:
            copy_chunk(sk, k32, k_base, lk, 0, 0, tid, c_kr, c_kw, c_dst)
        cp_async_commit()

        for bg in range(0, nb_total, FB):
            if fused and bg > b_last:  # the same for the whole CTA
                break
            for bl in range(FB):
                b = bg + bl
                if b > b_last:  # the same for the whole CTA
                    break
                for mi in range(MT):
                    m_a[mi] = float32(0.0) if mean else neg
                    m_b[mi] = float32(0.0) if mean else neg
                for kc0 in range(0, block_size, KC):
                    j0 = b * block_size + kc0
                    if j0 > p_last:  # past every row's position (the same for the whole CTA)
                        break
                    cur = ((j0 // KC) & 1) * BUF
                    # chunk j0 has landed for every thread, and every warp is done with the
                    # other buffer (the previous chunk): start the next chunk there
                    cp_async_wait_all()
                    cuda.syncthreads()
                    jn = j0 + KC
                    if jn <= p_last and jn // block_size <= b_last:
                        copy_chunk(sk, k32, k_base, lk, jn, BUF - cur, tid, c_kr, c_kw, c_dst)
                    cp_async_commit()
                    masked = not fused and j0 + KC - 1 > p_first
                    chunk_scores(acc, aq, sk, cur, lrow, m_a, m_b, j0, tq, masked, pos_a, pos_b)
                stage_block(sm, m_a, m_b, bl, warp, g, tq)
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
