"""Paper §3.1, eq 6 on the GPU: causal block-pooled index scores ``M [Hkv, Tq, NB]``.

``block_scores`` is ``msa.reference.index.block_scores`` on a GPU: ``M[r, t, b]`` is the maximum
(or, with ``pool="mean"``, the mean) over the keys ``j`` of block ``b`` with ``j <= pos_t`` of
``scale * (q_idx[t, r] . k_idx[j])``, ``-inf`` where no key of the block is visible. Dot
products accumulate in float32 (float64 for float64 inputs); the scale multiplies the pooled
value, which for the max gives exactly the max of the scaled scores (``x -> x * scale`` is
monotone, also after rounding).

Versions (every one tested against the reference; the default is the fastest that applies):

=====  =============================  ==========================================================
v1     ``_block_scores_kernel_v1``    one thread per ``M[r, t, b]``: the block's visible keys,
                                      dot products read from global memory. Any dtype and size.
tc     ``_block_scores_kernel_tc``    tensor cores (``mma.sync.m16n8k16``, fp32 accumulation),
                                      bf16/fp16 with ``Didx % 16 == 0`` and ``Bk % 8 == 0``. A
                                      CTA owns a tile of (query, group) rows of one sequence
                                      (all ``Hkv`` groups of ``128 // Hkv`` queries), keeps its
                                      index queries in registers as mma fragments, and streams
                                      the sequence's KV blocks through shared memory: each key
                                      chunk is loaded once for every group. The causal mask is
                                      applied only to chunks that reach past the tile's first
                                      position. Each lane keeps its partial maxima of two rows;
                                      they are staged in shared memory and combined when 8
                                      blocks at a time are stored (32-byte rows of ``M``), so
                                      the kernel needs no shuffle and no extra barrier. With a
                                      top-k epilogue instead of the store, the same kernel is
                                      ``msa.cuda.select.select_blocks_fused(version="heap")``.
tc2    ``_block_scores_kernel_tc2``   tc with the key chunks double-buffered: ``cp.async``
                                      copies chunk c + 1 into shared memory (16-byte pieces,
                                      no registers) while chunk c is multiplied, one barrier a
                                      chunk (tc waits for a copy through registers, one load
                                      at a time, between two barriers); B fragments by
                                      ``ldmatrix.x4`` (two n-tiles a load, a quarter of tc's
                                      shared loads); the quad's partial maxima combined by two
                                      shuffles, in tc's order, so the results are equal bit for
                                      bit. Needs ``Bk % 16 == 0`` and 16-byte aligned
                                      ``k_idx`` (else the default is tc).
                                      ``select_blocks_fused(version="heap2")`` is its top-k.
tc3    ``_block_scores_kernel_tc2``   tc2 with two 16-row m-tiles a warp (32 rows, 256 a CTA
       (``mtiles=2``)                 of 8 warps): each B fragment from ``ldmatrix`` feeds four
                                      mma instead of two, half the shared-memory reads per
                                      product; the chunk is walked n-tile pair by pair (all
                                      k-steps, then the pair's maxima) so that 16 accumulators
                                      are live beside 64 registers of A fragments (128
                                      registers, sm_90). Bit for bit tc2's results. On an H200
                                      1.39x tc2's fused top-k at 128K, 1.33x at 1M (358 TFLOP/s).
                                      ``select_blocks_fused(version="heap3")`` is its top-k.
tc4    ``_block_scores_kernel_tc2``   tc3 on Hopper's wgmma (compute capability 9.0, no
       (``wgmma=True``)               simulator twin): the CTA's queries are copied once into
                                      shared memory as wgmma tiles, and each key chunk's scores
                                      are ``wgmma.m64n{KC}k16`` with both operands read from
                                      shared memory (``msa.cuda._core.wgmma``): no ``ldmatrix``, no
                                      A fragments in registers. Needs 16-byte aligned
                                      ``q_idx`` too and ~105 KB of dynamic shared memory at
                                      Didx = 128. ``select_blocks_fused(version="heap4")``.
                                      Not the default: bit for bit tc3's top-k but no faster
                                      (H200, 128K, paper index: 26.8 ms against tc3's 26.2;
                                      the chunk's barrier, wait and maxima bound it, not the
                                      multiplies).
=====  =============================  ==========================================================

Tensor cores are reached through ``msa.cuda._core.mma`` (inline PTX ``mma.sync``; under the
simulator, or with ``MSA_MMA=twin``, its pure-Numba twin with the same per-lane contract);
``cp.async`` and ``ldmatrix`` through ``msa.cuda._core.memops`` (simulator twins alike).

Sequence positions follow ``msa.reference.blocks``: query ``t`` of sequence ``s`` sits at key
position ``Lk - Lq + (t - cu_seqlens_q[s])`` and sees the keys ``0..pos`` of its sequence.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, float64, int32, types, uint32, uint64

from .._checks import (
    FLOAT_DTYPES,
    check_array,
    check_cu_seqlens,
    check_positive_int,
    check_scale,
    dtype_of,
)
from ..reference.blocks import max_blocks
from ._core.arrays import POISON as _POISON
from ._core.arrays import SIMULATOR, ArrayContext, device_constant, is_bf16
from ._core.heap import offer as _offer
from ._core.launch import launch_smem as _launch_smem
from ._core.packed import query_position as _query_position
from ._core.memops import (
    cp_async16,
    cp_async_commit,
    cp_async_wait_all,
    is_aligned16,
    ldmatrix_x4,
)
from ._core import mma as _mma, wgmma as _wgmma
from ._core.mma import bf16_to_f32, mma_bf16_m16n8k16, mma_f16_m16n8k16
from ._core.wgmma import core_word

VERSIONS = ("v1", "tc", "tc2", "tc3", "tc4")
POOLS = ("max", "mean")
_THREADS_V1 = 128
# Warps per CTA of the tensor-core kernel (16 (query, group) rows each). The simulator runs
# every thread as a Python thread, so it uses the smallest tile; the kernel body is the same.
_TC_WARPS = 2 if SIMULATOR else 8
_TC_FLUSH = 8  # blocks of M staged in shared memory per store (8 floats: one 32-byte sector)
# Two CTAs of 8 warps per SM need <= 128 registers a thread (65536 per SM); ptxas, left alone,
# takes 130. The simulator's jit has no such option.
_TC_JIT_OPTIONS = {} if SIMULATOR else {"max_registers": 128}
# tc2-tc4: each thread's key-chunk copies by a few 32-bit adds from its first piece (instead of
# a division and 64-bit products a piece), and the fused kernels' maxima by one max.f32
# (instead of a compare and a select); switches for A/B runs (benchmarks/ab_index.py).
_TC_STEADY_COPY = True
_TC_FUSED_FMAX = True


# -- positions ----------------------------------------------------------------------------------

# -- element loads: bf16 bits, fp16, fp32, fp64 -> the compute type -----------------------------

if SIMULATOR:
    def _as_float(x):
        """An element of q_idx/k_idx in the compute type: bf16 bits (int16/uint16) and fp16 to
        float32; float32 and float64 unchanged."""
        if isinstance(x, (np.uint16, np.int16)):
            return bf16_to_f32(x)
        if isinstance(x, np.float16):
            return np.float32(x)
        return x
else:
    from numba.cuda.extending import overload

    def _as_float(x):
        """An element of q_idx/k_idx in the compute type (see the simulator twin above)."""

    @overload(_as_float, target="cuda")
    def _as_float_overload(x):
        if isinstance(x, types.Integer):  # bf16 bits: the high half of a float32
            return lambda x: bf16_to_f32(x)
        if x == types.float16:
            return lambda x: float32(x)
        return lambda x: x


@cuda.jit(device=True, inline=True)
def _fmax(m, s):
    """``max(m, s)`` that keeps ``m`` when ``s`` is NaN (the reference's fmax from -inf)."""
    return s if s > m else m


# -- kernels ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _block_scores_kernel_v1(wide: bool, mean: bool):
    """v1: one thread per M[r, i, b] (query t_begin + i); ``wide``: float64 compute."""
    F = float64 if wide else float32

    @cuda.jit
    def kernel(q, k, cu_q, cu_k, t_begin, block_size, scale, M):
        idx = cuda.grid(1)
        hkv = M.shape[0]
        c = M.shape[1]
        nb = M.shape[2]
        if idx >= hkv * c * nb:
            return
        b = idx % nb
        rest = idx // nb
        i = rest % c
        r = rest // c
        t = t_begin + i
        seq, pos = _query_position(cu_q, cu_k, t)
        k0 = cu_k[seq]
        j_lo = b * block_size
        j_hi = min(j_lo + block_size - 1, pos)  # keys past pos (and past Lk > pos) are hidden
        best = F(-math.inf)
        total = F(0.0)
        for j in range(j_lo, j_hi + 1):
            # s = q_idx[t, r] . k_idx[j]
            s = F(0.0)
            for d in range(q.shape[2]):
                s += F(_as_float(q[t, r, d])) * F(_as_float(k[k0 + j, d]))
            if s > best:  # fmax from -inf: a NaN score is skipped, as in the reference
                best = s
            total += s
        if j_hi < j_lo:
            M[r, i, b] = F(-math.inf)
        elif mean:
            M[r, i, b] = total * scale / F(j_hi - j_lo + 1)
        else:
            M[r, i, b] = best * scale

    return kernel


def _key_chunk(block_size: int) -> int:
    """Keys per shared-memory stage of the tc kernel: 64, or the largest of 32/16/8 dividing Bk."""
    for kc in (64, 32, 16, 8):
        if block_size % kc == 0:
            return kc
    raise ValueError(f"the tc kernel needs block_size % 8 == 0, got {block_size}")


@functools.lru_cache(maxsize=None)
def _block_scores_kernel_tc(d_idx: int, block_size: int, warps: int, bf16: bool, mean: bool,
                            cap: int = 0):
    """Tensor-core block scores for one (Didx, Bk, warps, bf16/fp16, pool) configuration.

    ``cap = 0``: write ``M[r, t - m_t0, b]`` (``out`` unused). ``cap >= 1``: the fused index +
    top-k of ``msa.cuda.select.select_blocks_fused`` (max pool only; ``M`` unused): thread ``i <
    16 * warps`` owns row ``i`` of the tile and offers each block score ``b < L`` of its row to a
    min-heap of ``topk - 1 <= cap`` entries (the §4.1 heap, root cached in registers) as soon as
    the block is staged, then writes ``out[t, r]`` ascending, the local block ``L`` and -1. Only
    blocks before the tile's last local block are scored and no key needs a causal mask: every
    key of a block ``b < L`` is visible to the row. M is never written.
    """

    fused = cap > 0
    D2 = d_idx // 2  # uint32 words per row (two 16-bit values each)
    KS = d_idx // 16  # k-steps of 16 features
    KC = _key_chunk(block_size)
    NT = KC // 8  # n-tiles of 8 keys per chunk
    R = 16 * warps  # (query, group) rows per CTA
    SK = D2 + 4  # padded shared row: rows g = 0..7 of a fragment load hit 8 different banks
    FB = _TC_FLUSH
    # Staged partials: 4 per (row, block), one per lane of a quad; the row stride 4 * FB + 4
    # words puts the 32 lanes of a warp (rows g, lanes t) in 32 different banks.
    SMW = 4 * FB + 4
    NTHREADS = 32 * warps
    mma = mma_bf16_m16n8k16 if bf16 else mma_f16_m16n8k16

    HCAP = max(cap, 1)

    @cuda.jit(**_TC_JIT_OPTIONS)
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

        # The tile: queries [ta, tb) of sequence seq, all Hkv groups; row = (t - ta) * Hkv + r.
        seq = tiles[cuda.blockIdx.x, 0]
        ta = tiles[cuda.blockIdx.x, 1]
        tb = tiles[cuda.blockIdx.x, 2]
        k_base = cu_k[seq]
        lk = cu_k[seq + 1] - k_base
        shift = lk - (cu_q[seq + 1] - cu_q[seq]) - cu_q[seq]  # pos = t + shift
        p_first = ta + shift
        p_last = tb - 1 + shift
        b_last = p_last // block_size
        if fused:  # only candidates: blocks before the last row's local block
            b_last -= 1

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

        # A fragments (index queries) for every k-step, kept in registers for the whole tile.
        aq = cuda.local.array((KS, 4), uint32)
        for ks in range(KS):
            w = ks * 8 + tq
            aq[ks, 0] = q32[t_a, r_a, w] if t_a < tb else uint32(0)
            aq[ks, 1] = q32[t_b, r_b, w] if t_b < tb else uint32(0)
            aq[ks, 2] = q32[t_a, r_a, w + 4] if t_a < tb else uint32(0)
            aq[ks, 3] = q32[t_b, r_b, w + 4] if t_b < tb else uint32(0)
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
                    e = tid
                    while e < KC * D2:
                        kr = e // D2
                        kw = e - kr * D2
                        sk[kr, kw] = k32[k_base + j0 + kr, kw] if j0 + kr < lk else uint32(0)
                        e += NTHREADS
                    cuda.syncthreads()
                    for nt in range(NT):
                        for e4 in range(4):
                            acc[nt, e4] = float32(0.0)
                    # S[rows, keys] = Q_idx . K_idx^T for the chunk
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
                    # m = max over the visible keys (j <= pos); only chunks that reach past the
                    # tile's first position can hide a key from one of its rows.
                    masked = not fused and j0 + KC - 1 > p_first
                    for nt in range(NT):
                        j = j0 + nt * 8 + 2 * tq
                        if mean:  # m is the sum of the visible scores
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
                                m_a = _fmax(m_a, acc[nt, 0])
                            if not masked or j + 1 <= pos_a:
                                m_a = _fmax(m_a, acc[nt, 1])
                            if not masked or j <= pos_b:
                                m_b = _fmax(m_b, acc[nt, 2])
                            if not masked or j + 1 <= pos_b:
                                m_b = _fmax(m_b, acc[nt, 3])
                # The 4 lanes of a quad hold partial results of the same two rows; they are
                # combined when the staged blocks are stored (no shuffle, no extra barrier).
                sm[row_a, bl * 4 + tq] = m_a
                sm[row_b, bl * 4 + tq] = m_b
            cuda.syncthreads()
            if fused:
                # each row's block scores straight into its heap: candidates b < L only
                if tid < R and own_t < tb and kmax > 0:
                    for c in range(FB):
                        b = bg + c
                        if b < own_loc:
                            m = _fmax(_fmax(sm[tid, 4 * c], sm[tid, 4 * c + 1]),
                                      _fmax(sm[tid, 4 * c + 2], sm[tid, 4 * c + 3]))
                            h_n, h_rs, h_ri = _offer(hs, hi, h_n, kmax, h_rs, h_ri, m * scale, b)
            else:
                # M[r, t, bg:bg+FB]: consecutive threads write consecutive blocks of one row
                e = tid
                while e < R * FB:
                    row = e // FB
                    c = e - row * FB
                    t = ta + row // hkv
                    b = bg + c
                    if t < tb and b < nb_total:
                        value = neg
                        if b <= b_last:
                            if mean:
                                n = min(block_size, t + shift - b * block_size + 1)  # visible keys
                                if n > 0:
                                    total = (sm[row, 4 * c] + sm[row, 4 * c + 1]) + (
                                        sm[row, 4 * c + 2] + sm[row, 4 * c + 3])
                                    value = total * scale / float32(n)
                            else:
                                m = _fmax(_fmax(sm[row, 4 * c], sm[row, 4 * c + 1]),
                                          _fmax(sm[row, 4 * c + 2], sm[row, 4 * c + 3]))
                                value = m * scale
                        M[row % hkv, t - m_t0, b] = value
                    e += NTHREADS
            cuda.syncthreads()

        if fused and tid < R and own_t < tb:
            # I[t, r] = the kept ids ascending (all < L), then L, then -1
            for a in range(1, h_n):
                v = hi[a]
                j = a
                while j > 0 and hi[j - 1] > v:
                    hi[j] = hi[j - 1]
                    j -= 1
                hi[j] = v
            r = tid % hkv
            for j in range(topk):
                if j < h_n:
                    out[own_t, r, j] = hi[j]
                elif j == h_n:
                    out[own_t, r, j] = own_loc
                else:
                    out[own_t, r, j] = -1

    return kernel


@functools.lru_cache(maxsize=None)
def _block_scores_kernel_tc2(d_idx: int, block_size: int, warps: int, bf16: bool, mean: bool,
                             cap: int = 0, mtiles: int = 1, wgmma: bool = False):
    """``_block_scores_kernel_tc`` with the key chunks double-buffered by ``cp.async`` (the copy
    of chunk ``c + 1`` runs while chunk ``c`` is multiplied; one barrier a chunk), B fragments
    by ``ldmatrix.x4`` (two n-tiles a load) and the quad's partial maxima combined by two
    shuffles before they are staged. Same arguments, same results bit for bit (the same
    products, sums and maxima in the same order). Needs ``Bk % 16 == 0`` and 16-byte aligned
    ``k_idx`` (the launcher checks).

    ``mtiles = 2`` (version ``tc3``): each warp owns two 16-row m-tiles (32 rows; the CTA
    ``32 * warps``), so every B fragment loaded by ``ldmatrix`` feeds four mma instead of two,
    halving the shared-memory reads per product; the chunk is walked n-tile pair by n-tile pair
    (all k-steps of a pair, then its maxima), so only 16 accumulators are live next to the
    64 registers of A fragments. Every row's products, sums and maxima are still taken in tc's
    order: the same results bit for bit.

    ``wgmma`` (version ``tc4``, compute capability 9.0; ``mtiles = 2``, 8 warps): the CTA's
    index queries are copied once into dynamic shared memory as 8 x 8 core matrices, one
    64-row wgmma tile per (warpgroup, m-tile) (warp ``w``'s m-tile ``mi`` is rows
    ``16 (w % 4) ..`` of tile ``(w // 4, mi)``), and the key chunks are stored the same way;
    each chunk's scores are ``2 KS`` ``wgmma.m64n{KC}k16`` with both operands read by the
    tensor cores from shared memory (``msa.cuda._core.wgmma``), no ``ldmatrix`` and no A fragments
    in registers. The accumulators have the ``mma.sync`` layout, so the maxima are folded as
    in tc (key order per row), and staged and stored (or offered to the top-k) as in tc2.
    Needs 16-byte aligned ``q_idx`` too."""

    fused = cap > 0
    D2 = d_idx // 2  # uint32 words per row (two 16-bit values each)
    KS = d_idx // 16  # k-steps of 16 features
    KC = _key_chunk(block_size)
    NT = KC // 8  # n-tiles of 8 keys per chunk (even: ldmatrix.x4 loads two)
    NP = NT // 2
    MT = mtiles
    assert MT in (1, 2)
    WG = wgmma
    assert not WG or (MT == 2 and warps == 8 and _wgmma.AVAILABLE)
    R = 16 * MT * warps  # (query, group) rows per CTA
    # live accumulator n-tiles (see the docstring; tc4: every n-tile of both m-tiles)
    ACC_TILES = NT if MT == 1 else MT * NT if wgmma else 2 * MT
    SK = D2 + 4  # padded shared row (16-byte multiple): an 8-row ldmatrix phase hits 32 banks
    BUF = KC * SK  # words per key buffer
    SK_WORDS = 2 * BUF  # two buffers
    PROW = D2 // 4  # 16-byte pieces per key row
    PIECES = KC * PROW
    FB = _TC_FLUSH
    SMW = FB + 1  # staged maxima per row, padded
    NTHREADS = 32 * warps
    # copy_chunk: thread tid copies pieces tid + i NTHREADS, i < PPT. When NTHREADS is a
    # multiple of PROW (and, for tc4's core matrices, of 8 PROW) every piece of a thread has the
    # same word and rows RSTEP apart, so a chunk's copies cost a few 32-bit adds each instead of
    # a division and 64-bit products a piece.
    PPT = -(-PIECES // NTHREADS)
    RSTEP = NTHREADS // PROW
    STEADY = _TC_STEADY_COPY and NTHREADS % PROW == 0 and (not wgmma or RSTEP % 8 == 0)
    DSTEP = (RSTEP // 8) * 4 * d_idx if wgmma else RSTEP * SK
    # the fused kernel only compares its maxima, so zeros' signs do not matter: one max.f32
    fmx = _mma.fmax_f32 if fused and _TC_FUSED_FMAX else _fmax
    mma = mma_bf16_m16n8k16 if bf16 else mma_f16_m16n8k16
    HCAP = max(cap, 1)
    # tc4: dynamic shared memory [key buffer 0 | key buffer 1 | queries], core matrices
    WBUF = KC * D2  # words per key buffer
    WQ = 2 * WBUF  # first word of the queries: tile (wg, mi) at WQ + (wg MT + mi) 64 D2
    GROUP_BYTES = 16 * d_idx  # next 8 rows of a core-matrix layout (stride byte offset)
    if WG:
        wg_ss = _wgmma.make_wgmma_ss(KC, "bf16" if bf16 else "f16")
        wg_ss2 = _wgmma.make_wgmma_ss(KC, "bf16" if bf16 else "f16", NT * 4)  # m-tile 1
        wg_wait = _wgmma.make_wgmma_wait(MT * NT * 4)
    else:
        wg_ss = wg_ss2 = wg_wait = None

    if SIMULATOR:  # the simulator has no alignment argument (and needs none)
        @cuda.jit(device=True)
        def key_buffers():
            return cuda.shared.array(SK_WORDS, uint32)
    elif WG:
        @cuda.jit(device=True, inline=True)
        def key_buffers():
            """Two key chunks and the queries (dynamic: more than 48 KB), 16-byte aligned."""
            return cuda.shared.array(0, uint32, alignment=16)
    else:
        @cuda.jit(device=True, inline=True)
        def key_buffers():
            """Two key chunks; 16-byte aligned for cp.async and ldmatrix."""
            return cuda.shared.array(SK_WORDS, uint32, alignment=16)

    @cuda.jit(device=True, inline=True)
    def copy_chunk(sk, k32, k_base, lk, j0, dst0, tid, c_kr, c_kw, c_dst):
        """Start copying keys ``j0 .. j0 + KC - 1`` of the sequence into the buffer at word
        ``dst0`` (keys past the sequence read as zeros). ``c_kr, c_kw, c_dst``: the row, word
        and buffer word of the thread's first piece (``STEADY``)."""
        if STEADY:
            for i in range(PPT):
                if (i + 1) * NTHREADS <= PIECES or c_kr + i * RSTEP < KC:
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
            dst = dst0 + (core_word(kr, kw, d_idx) if WG else kr * SK + kw)
            cp_async16(sk, dst, k32, src, 16 if ok else 0)
            e += NTHREADS

    @cuda.jit(device=True, inline=True)
    def copy_queries(sk, q32, ta, tb, hkv, tid):
        """tc4: start copying the CTA's index queries into their wgmma tiles (zeros past tb)."""
        e = tid
        while e < R * PROW:
            row = e // PROW
            w = (e - row * PROW) * 4
            t = ta + row // hkv
            ok = t < tb
            src = ((t if ok else ta) * hkv + row % hkv) * D2 + w
            wr = row // (16 * MT)  # the warp whose m-tile (row // 16) % MT holds the row
            tile = (wr // 4) * MT + (row // 16) % MT
            rho = (wr % 4) * 16 + row % 16
            cp_async16(sk, WQ + tile * 64 * D2 + core_word(rho, w, d_idx), q32, src,
                       16 if ok else 0)
            e += NTHREADS

    @cuda.jit(device=True, inline=True)
    def _mma_pair(acc, nt, aq, mi, ks, b0, b1, b2, b3):
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
    def _fold(acc, nt, m_a, m_b, mi, j, masked, pa, pb):
        """Fold n-tile ``nt`` (keys ``j``, ``j + 1`` of this lane) into m-tile ``mi``'s rows."""
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

    @cuda.jit(**_TC_JIT_OPTIONS)
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

        # this lane's rows: m-tile mi holds rows (warp MT + mi) 16 + g (a) and that + 8 (b)
        pos_a = cuda.local.array(MT, int32)
        pos_b = cuda.local.array(MT, int32)
        aq = cuda.local.array((MT, KS, 4), uint32)
        for mi in range(MT):
            row_a = (warp * MT + mi) * 16 + g
            row_b = row_a + 8
            t_a = ta + row_a // hkv
            t_b = ta + row_b // hkv
            r_a = row_a % hkv
            r_b = row_b % hkv
            pos_a[mi] = t_a + shift if t_a < tb else -1
            pos_b[mi] = t_b + shift if t_b < tb else -1
            for ks in range(0 if WG else KS):
                w = ks * 8 + tq
                aq[mi, ks, 0] = q32[t_a, r_a, w] if t_a < tb else uint32(0)
                aq[mi, ks, 1] = q32[t_b, r_b, w] if t_b < tb else uint32(0)
                aq[mi, ks, 2] = q32[t_a, r_a, w + 4] if t_a < tb else uint32(0)
                aq[mi, ks, 3] = q32[t_b, r_b, w + 4] if t_b < tb else uint32(0)
        acc = cuda.local.array((ACC_TILES, 4), float32)
        m_a = cuda.local.array(MT, float32)
        m_b = cuda.local.array(MT, float32)
        # this lane's ldmatrix row: matrix lane // 8 is n-tile lane // 16, word half (lane // 8) % 2
        lrow = ((lane >> 4) * 8 + (lane & 7)) * SK + ((lane >> 3) & 1) * 4

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
        c_dst = int32(core_word(c_kr, c_kw, d_idx) if WG else c_kr * SK + c_kw)
        # chunk c holds keys [c * KC, (c + 1) * KC) in buffer c % 2; chunk 0 starts here
        if b_last >= 0:
            copy_chunk(sk, k32, k_base, lk, 0, 0, tid, c_kr, c_kw, c_dst)
            if WG:
                copy_queries(sk, q32, ta, tb, hkv, tid)
        cp_async_commit()
        q_desc = uint64(0)
        k_desc = uint64(0)
        if WG:  # this warpgroup's two query tiles; key buffer 0 (buffer 1: + WBUF words)
            q_desc = _wgmma.smem_desc(
                _wgmma.shared_address(sk, WQ + (warp // 4) * MT * 64 * D2), 128, GROUP_BYTES)
            k_desc = _wgmma.smem_desc(_wgmma.shared_address(sk, 0), 128, GROUP_BYTES)

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
                    cur = ((j0 // KC) & 1) * (WBUF if WG else BUF)
                    # chunk j0 has landed for every thread, and every warp is done with the
                    # other buffer (the previous chunk): start the next chunk there
                    cp_async_wait_all()
                    if WG:  # copies are generic-proxy writes; wgmma reads by the async proxy
                        _wgmma.fence_proxy_async()
                    cuda.syncthreads()
                    jn = j0 + KC
                    if jn <= p_last and jn // block_size <= b_last:
                        copy_chunk(sk, k32, k_base, lk, jn, (WBUF if WG else BUF) - cur, tid,
                                   c_kr, c_kw, c_dst)
                    cp_async_commit()
                    masked = not fused and j0 + KC - 1 > p_first
                    if WG:  # both m-tiles' scores of the chunk, operands from shared memory
                        kd = k_desc + uint64(cur >> 2)  # words -> 16-byte units
                        _wgmma.wgmma_fence()
                        for ks in range(KS):
                            wg_ss(acc, q_desc + uint64(16 * ks), kd + uint64(16 * ks),
                                  int32(ks > 0))
                        for ks in range(KS):
                            wg_ss2(acc, q_desc + uint64(16 * ks + 16 * D2), kd + uint64(16 * ks),
                                   int32(ks > 0))
                        _wgmma.wgmma_commit()
                        wg_wait(acc)
                        for mi in range(MT):
                            for nt in range(NT):
                                _fold(acc, mi * NT + nt, m_a, m_b, mi, j0 + nt * 8 + 2 * tq,
                                      masked, pos_a[mi], pos_b[mi])
                    elif MT == 1:  # every n-tile of the chunk at once, k-step by k-step
                        for ks in range(KS):
                            for npair in range(NP):
                                b0, b1, b2, b3 = ldmatrix_x4(sk, cur + lrow + npair * 16 * SK
                                                             + ks * 8)
                                nt = 2 * npair
                                if ks == 0:  # the first k-step starts from zero
                                    for e4 in range(4):
                                        acc[nt, e4] = float32(0.0)
                                        acc[nt + 1, e4] = float32(0.0)
                                _mma_pair(acc, nt, aq, 0, ks, b0, b1, b2, b3)
                        for nt in range(NT):
                            _fold(acc, nt, m_a, m_b, 0, j0 + nt * 8 + 2 * tq, masked, pos_a[0],
                                  pos_b[0])
                    else:  # n-tile pair by pair: all k-steps, then the pair's maxima
                        for npair in range(NP):
                            for ks in range(KS):
                                b0, b1, b2, b3 = ldmatrix_x4(sk, cur + lrow + npair * 16 * SK
                                                             + ks * 8)
                                for mi in range(MT):
                                    if ks == 0:
                                        for e4 in range(4):
                                            acc[2 * mi, e4] = float32(0.0)
                                            acc[2 * mi + 1, e4] = float32(0.0)
                                    _mma_pair(acc, 2 * mi, aq, mi, ks, b0, b1, b2, b3)
                            for half in range(2):
                                j = j0 + (2 * npair + half) * 8 + 2 * tq
                                for mi in range(MT):
                                    _fold(acc, 2 * mi + half, m_a, m_b, mi, j, masked, pos_a[mi],
                                          pos_b[mi])
                # the quad's four partials, combined as tc combines them: (p0 . p1) . (p2 . p3)
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
                            ma = _fmax(ma, o_a) if (tq & off) == 0 else _fmax(o_a, ma)
                            mb = _fmax(mb, o_b) if (tq & off) == 0 else _fmax(o_b, mb)
                    if tq == 0:
                        row_a = (warp * MT + mi) * 16 + g
                        sm[row_a, bl] = ma
                        sm[row_a + 8, bl] = mb
            cuda.syncthreads()
            if fused:
                if tid < R and own_t < tb and kmax > 0:
                    for c in range(FB):
                        b = bg + c
                        if b < own_loc:
                            h_n, h_rs, h_ri = _offer(hs, hi, h_n, kmax, h_rs, h_ri,
                                                     sm[tid, c] * scale, b)
            else:
                e = tid
                while e < R * FB:
                    row = e // FB
                    c = e - row * FB
                    t = ta + row // hkv
                    b = bg + c
                    if t < tb and b < nb_total:
                        value = neg
                        if b <= b_last:
                            if mean:
                                n = min(block_size, t + shift - b * block_size + 1)
                                if n > 0:
                                    value = sm[row, c] * scale / float32(n)
                            else:
                                value = sm[row, c] * scale
                        M[row % hkv, t - m_t0, b] = value
                    e += NTHREADS
            cuda.syncthreads()

        if fused and tid < R and own_t < tb:
            for a in range(1, h_n):
                v = hi[a]
                j = a
                while j > 0 and hi[j - 1] > v:
                    hi[j] = hi[j - 1]
                    j -= 1
                hi[j] = v
            r = tid % hkv
            for j in range(topk):
                if j < h_n:
                    out[own_t, r, j] = hi[j]
                elif j == h_n:
                    out[own_t, r, j] = own_loc
                else:
                    out[own_t, r, j] = -1

    return kernel


# -- launchers ----------------------------------------------------------------------------------

def _tc_mtiles(version) -> int:
    """16-row m-tiles per warp of a tensor-core version (tc3, tc4: 2)."""
    return 2 if version in ("tc3", "tc4") else 1


def _tc4_smem(d_idx: int, block_size: int) -> int:
    """Bytes of tc4's dynamic shared memory: two key chunks and the CTA's queries."""
    return 4 * (d_idx // 2) * (2 * _key_chunk(block_size) + 32 * _TC_WARPS)


def _why_not_tc4(tc3_ok, q, d_idx, block_size):
    """Why tc4 cannot run on these inputs, or None."""
    if not tc3_ok:
        return ("it needs what 'tc3' needs (bf16/float16, Didx % 16 == 0, block_size % 16 == 0, "
                "16-byte aligned k_idx)")
    why_not = _wgmma.why_not_available()
    if why_not:
        return why_not
    if _TC_WARPS != 8:
        return f"8 warps a CTA (two warpgroups) are needed, not {_TC_WARPS}"
    if not is_aligned16(q):
        return "q_idx's data is not 16-byte aligned (cp.async)"
    if _tc4_smem(d_idx, block_size) > _mma.DYNAMIC_SMEM_LIMIT:
        return (f"{_tc4_smem(d_idx, block_size)} bytes of shared memory at Didx={d_idx}, more "
                f"than {_mma.DYNAMIC_SMEM_LIMIT}")
    return None


def _tc2_static_smem(d_idx: int, block_size: int, mtiles: int) -> int:
    """Bytes of static shared memory of the tc2/tc3 kernel: two key chunks of padded rows and
    the staged maxima of ``16 * mtiles * _TC_WARPS`` rows."""
    kc = _key_chunk(block_size)
    return 4 * (2 * kc * (d_idx // 2 + 4) + 16 * mtiles * _TC_WARPS * (_TC_FLUSH + 1))


def _tiles(cu_q: np.ndarray, cu_k: np.ndarray, t0: int, t1: int, tile_queries: int, block_size):
    """int32 [n, 3] rows ``(sequence, ta, tb)``: queries ``[t0, t1)`` cut into tiles of at most
    ``tile_queries`` that never cross a sequence, the tiles with the most blocks first."""
    lo = np.maximum(cu_q[:-1], t0)
    hi = np.minimum(cu_q[1:], t1)
    seqs = np.nonzero(hi > lo)[0]
    parts = []
    for s in seqs:
        starts = np.arange(lo[s], hi[s], tile_queries, dtype=np.int64)
        ends = np.minimum(starts + tile_queries, hi[s])
        parts.append(np.stack([np.full_like(starts, s), starts, ends], axis=1))
    if not parts:
        return np.zeros((0, 3), np.int32)
    tiles = np.concatenate(parts)
    shift = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1]) - cu_q[:-1]  # [B] pos = t + shift
    last_block = (tiles[:, 2] - 1 + shift[tiles[:, 0]]) // block_size
    order = np.argsort(-last_block, kind="stable")
    return np.ascontiguousarray(tiles[order].astype(np.int32))


def _prepare(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, scale, pool, *,
             version=None, bf16_bits=False):
    """Validate eq 6 inputs and pick a kernel; returns a namespace the launchers share.

    ``bf16_bits``: integer (uint16/int16) q_idx/k_idx hold bf16 bit patterns (tests use it under
    the simulator, where NumPy has no bf16); torch bf16 tensors are recognised by their dtype.
    """
    block_size = check_positive_int("block_size", block_size)
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    if version is not None and version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS} or None, got {version!r}")
    bits = ("int16", "uint16") if bf16_bits else ()
    kinds = []
    for name, x, ndim in (("q_idx", q_idx, 3), ("k_idx", k_idx, 2)):
        check_array(name, x, ndim=ndim)
        if is_bf16(x) or (bf16_bits and dtype_of(x).name in bits):
            kinds.append("bf16")
        elif dtype_of(x) in FLOAT_DTYPES:
            kinds.append(dtype_of(x).name)
        else:
            raise TypeError(f"{name} must have dtype bfloat16, float16, float32 or float64, got "
                            f"{getattr(x, 'dtype', None)}")
    if kinds[0] != kinds[1]:
        raise TypeError(f"k_idx must have the dtype of q_idx ({kinds[0]}), got {kinds[1]}")
    kind = kinds[0]
    tq, hkv, d_idx = (int(s) for s in q_idx.shape)
    if hkv < 1 or d_idx < 1:
        raise ValueError(f"q_idx must have shape [Tq, Hkv >= 1, Didx >= 1], got {tuple(q_idx.shape)}")
    check_array("k_idx", k_idx, shape=(None, d_idx))
    tk = int(k_idx.shape[0])
    cu_q_host, cu_k_host = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, tq, tk)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(d_idx))
    nb = max_blocks(cu_k_host, block_size)
    # cu_seqlens are read on the host (above) and go to the device as the other launchers' do
    # (memoised int32 copies), so they may come from any library, NumPy beside GPU inputs too
    ctx = ArrayContext(q_idx, k_idx)
    wide = kind == "float64"
    tc_ok = (kind in ("bf16", "float16") and d_idx % 16 == 0 and block_size % 8 == 0
             and hkv <= 16 * _TC_WARPS)
    q = ctx.input("q_idx", q_idx)
    k = ctx.input("k_idx", k_idx)
    # tc2 copies 16-byte pieces of k_idx rows with cp.async and loads two n-tiles per ldmatrix
    tc2_ok = tc_ok and block_size % 16 == 0 and is_aligned16(k)
    # tc3: tc2 with 32 rows a warp; its two key buffers and staged maxima are static shared
    # memory (at most 48 KB)
    tc3_ok = tc2_ok and _tc2_static_smem(d_idx, block_size, 2) <= 48 * 1024
    if version is None:  # tc4 only when asked: no faster than tc3 (module docstring)
        version = "tc3" if tc3_ok else "tc2" if tc2_ok else "tc" if tc_ok else "v1"
    elif version == "tc" and not tc_ok:
        raise ValueError(
            f"version 'tc' needs bf16/float16 inputs, Didx % 16 == 0, block_size % 8 == 0 and "
            f"Hkv <= {16 * _TC_WARPS}; got {kind}, Didx={d_idx}, block_size={block_size}, Hkv={hkv}")
    elif version == "tc2" and not tc2_ok:
        raise ValueError(
            f"version 'tc2' needs bf16/float16 inputs, Didx % 16 == 0, block_size % 16 == 0, "
            f"Hkv <= {16 * _TC_WARPS} and k_idx data 16-byte aligned; got {kind}, Didx={d_idx}, "
            f"block_size={block_size}, Hkv={hkv}, aligned={is_aligned16(k)}")
    elif version == "tc3" and not tc3_ok:
        raise ValueError(
            f"version 'tc3' needs what 'tc2' needs and at most 48 KB of static shared memory "
            f"({_tc2_static_smem(d_idx, block_size, 2)} bytes at Didx={d_idx}, "
            f"block_size={block_size}); got {kind}, Didx={d_idx}, block_size={block_size}, "
            f"Hkv={hkv}, aligned={is_aligned16(k)}")
    elif version == "tc4":  # tc3 on wgmma, queries in dynamic shared memory
        why_not_tc4 = _why_not_tc4(tc3_ok, q, d_idx, block_size)
        if why_not_tc4:
            raise ValueError(f"version 'tc4' cannot run: {why_not_tc4}")
    if version in ("tc", "tc2", "tc3", "tc4"):
        q = q.view(np.uint32)  # [Tq, Hkv, Didx/2]: two 16-bit values per word
        k = k.view(np.uint32)  # [Tk, Didx/2]
    return SimpleNamespace(
        ctx=ctx, q=q, k=k, cu_q=device_constant(cu_q_host.astype(np.int32)),
        cu_k=device_constant(cu_k_host.astype(np.int32)), cu_q_host=cu_q_host,
        cu_k_host=cu_k_host,
        tq=tq, tk=tk, hkv=hkv, d_idx=d_idx, nb=nb, block_size=block_size, kind=kind,
        scale=np.float64(scale) if wide else np.float32(scale),
        out_dtype=np.float64 if wide else np.float32, mean=pool == "mean", version=version,
        tile_queries=max(1, 16 * _tc_mtiles(version) * _TC_WARPS // hkv))


def _launch_block_scores(p, M, t0: int, t1: int):
    """Fill ``M`` [Hkv, t1 - t0, NB] (a kernel argument) with the block scores of queries [t0, t1)."""
    if (t1 - t0) * p.hkv * p.nb == 0:
        return
    if p.version == "v1":
        kernel = _block_scores_kernel_v1(p.out_dtype == np.float64, p.mean)
        n = p.hkv * (t1 - t0) * p.nb
        kernel[(n + _THREADS_V1 - 1) // _THREADS_V1, _THREADS_V1](
            p.q, p.k, p.cu_q, p.cu_k, t0, p.block_size, p.scale, M)
        return
    _launch_tc(p, t0, t1, 0, M, 0, _dummy(p, np.int32, 3))


def _dummy(p, dtype, ndim):
    """A one-element stand-in for the output a tc kernel variant does not write."""
    return p.ctx.arg(p.ctx.empty((1,) * ndim, dtype))


def _launch_tc(p, t0, t1, cap, M, topk, out):
    """The tensor-core kernel over the tiles of queries [t0, t1): M (cap = 0) or fused top-k."""
    tiles = _tiles(p.cu_q_host, p.cu_k_host, t0, t1, p.tile_queries, p.block_size)
    if tiles.shape[0] == 0:
        return
    if p.version == "tc":
        kernel = _block_scores_kernel_tc(p.d_idx, p.block_size, _TC_WARPS, p.kind == "bf16",
                                         p.mean, cap)
    else:
        kernel = _block_scores_kernel_tc2(p.d_idx, p.block_size, _TC_WARPS, p.kind == "bf16",
                                          p.mean, cap, _tc_mtiles(p.version), p.version == "tc4")
    tiles_dev = device_constant(tiles)
    args = (p.q, p.k, p.cu_q, p.cu_k, tiles_dev, t0, p.nb, p.scale, M, topk, out)
    if p.version == "tc4":
        _launch_smem(kernel, tiles.shape[0], 32 * _TC_WARPS, _tc4_smem(p.d_idx, p.block_size),
                    *args)
        return
    kernel[tiles.shape[0], 32 * _TC_WARPS](*args)


def _launch_fused_heap(p, topk: int, cap: int, out):
    """Fused index + top-k of every query into ``out`` [Tq, Hkv, K] (a kernel argument)."""
    _launch_tc(p, 0, p.tq, cap, _dummy(p, np.float32, 3), topk, out)


def _block_scores(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, scale=None, *,
                  pool="max", version=None, bf16_bits=False):
    p = _prepare(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, scale, pool,
                 version=version, bf16_bits=bf16_bits)
    fill = np.nan if _POISON else None
    out = p.ctx.empty((p.hkv, p.tq, p.nb), p.out_dtype, fill=fill)
    _launch_block_scores(p, p.ctx.arg(out), 0, p.tq)
    return p.ctx.output(out)


def block_scores(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size: int, scale=None, *,
                 pool="max", version=None):
    """Paper eq 6 (right): causal block pooling ``M[r, t, b] = max_{j in block b, j <= pos_t} S``.

    Args:
        q_idx: [Tq, Hkv, Didx] bf16 (torch), float16, float32 or float64 index queries,
            C-contiguous, on the GPU (CuPy, torch, Numba; NumPy under the simulator or with a
            copy each way).
        k_idx: [Tk, Didx], same dtype and library: the shared index key head.
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums, any library (``Lq <= Lk``;
            bottom-right alignment). Copied to the host for validation and tile planning.
        block_size: ``Bk`` >= 1; block ``b`` holds key positions ``[b*Bk, min((b+1)*Bk, Lk))``.
        scale: multiplies the dot products; default ``1 / sqrt(Didx)``.
        pool: ``"max"`` (the paper) or ``"mean"`` (mean over the visible keys of the block).
        version: a kernel of ``VERSIONS``; default the fastest that applies (``tc3`` for
            bf16/fp16 with ``Didx % 16 == 0``, ``Bk % 16 == 0`` and 16-byte aligned ``k_idx``
            data whose key chunks fit 48 KB of static shared memory, else ``tc2``; ``tc`` with
            ``Bk % 8 == 0``; else ``v1``).

    Returns:
        M [Hkv, Tq, NB] float32 (float64 for float64 inputs) in the caller's library,
        ``NB = ceil(max Lk / Bk)``: ``-inf`` where no key of block ``b`` is visible to query
        ``t`` (blocks after its position, blocks past its sequence's end). Dot products
        accumulate in float32 (float64 for float64), on tensor cores for bf16/fp16.

    Raises:
        ValueError/TypeError before any launch: wrong rank, dtype or Didx, mixed dtypes or
        libraries, non-contiguous arrays, bad ``cu_seqlens``, ``block_size < 1``, a bad scale.
    """
    return _block_scores(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, scale,
                         pool=pool, version=version)
